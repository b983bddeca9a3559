//! The lists' filters: which query fields a list takes and the operator command's flag for each,
//! the flags a request sets, and the filter form (a leaf: the pages stand on it).

use super::fields::Fields;
use super::html::esc;

/// The dead-letter filter fields a list takes, with their CLI flags (the commands' own).
pub(super) use crate::ops::change::rows::DEAD_LETTER_FIELDS as DEAD_LETTER_FILTERS;
/// The filter fields `/pending` takes, with their CLI flags (the commands' own).
pub(super) use crate::ops::change::rows::OUTBOX_FIELDS as PENDING_FILTERS;

/// The CLI flags of the filter fields of `filters` set in `q`.
pub(super) fn filter_flags(q: &Fields, filters: &[(&str, &str)]) -> Vec<String> {
    let mut flags = Vec::new();
    for (field, flag) in filters {
        if let Some(v) = q.get(*field).map(|v| v.trim()).filter(|v| !v.is_empty()) {
            flags.push((*flag).to_owned());
            flags.push(v.to_owned());
        }
    }
    flags
}

/// A list's filter form (a text field per filter of `filters`, filled from `q`, and `extra`),
/// that GETs `path`.
pub(super) fn filter_form(path: &str, filters: &[(&str, &str)], q: &Fields, extra: &str) -> String {
    let inputs: String = filters
        .iter()
        .map(|(field, _)| {
            format!(
                "<label>{} <input type=\"text\" name=\"{field}\" value=\"{}\"></label> ",
                field.replace('_', " "),
                esc(q.get(*field).map_or("", String::as_str))
            )
        })
        .collect();
    format!(
        "<form method=\"get\" action=\"{path}\" id=\"filter\">{inputs}{extra}\
         <button type=\"submit\">Filter</button></form>"
    )
}
