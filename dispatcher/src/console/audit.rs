//! `/audit`: the audit trail, filtered by action, actor and time.

use std::sync::Arc;

use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use serde_json::Value;

use super::fields::{Fields, text};
use super::html::{Section, esc, page, problem, table};
use super::{Console, Who};

/// `/audit`: the audit trail, filtered by action, actor and time.
pub async fn audit(
    State(c): State<Arc<Console>>,
    Who(who): Who,
    Query(q): Query<Fields>,
) -> Response {
    let mut args = vec!["audit".into(), "--limit".into(), "200".into()];
    for (field, flag) in [
        ("action", "--action"),
        ("actor", "--actor"),
        ("since", "--since"),
    ] {
        if let Some(v) = q.get(field).map(|v| v.trim()).filter(|v| !v.is_empty()) {
            args.extend([flag.to_owned(), v.to_owned()]);
        }
    }
    let entries = match c.json(&args).await {
        Ok(Value::Array(a)) => a,
        Ok(_) => Vec::new(),
        Err(e) => return problem(StatusCode::BAD_REQUEST, &who, &e),
    };
    let inputs: String = ["action", "actor", "since"]
        .iter()
        .map(|f| {
            format!(
                "<label>{f} <input type=\"text\" name=\"{f}\" value=\"{}\"></label> ",
                esc(q.get(*f).map_or("", String::as_str))
            )
        })
        .collect();
    let rows: Vec<Vec<String>> = entries
        .iter()
        .map(|e| {
            vec![
                text(e, "id"),
                esc(&text(e, "at")),
                esc(&text(e, "actor")),
                esc(&text(e, "db_user")),
                esc(&text(e, "action")),
                text(e, "row_count"),
                esc(&e.get("selector").map_or("-".into(), Value::to_string)),
                esc(&text(e, "reason")),
            ]
        })
        .collect();
    let body = format!(
        "<form method=\"get\" action=\"/audit\">{inputs}<button type=\"submit\">Filter</button></form>{}",
        table(
            "audit",
            &[
                "Id",
                "At",
                "Actor",
                "Database login",
                "Action",
                "Rows",
                "Selector",
                "Reason"
            ],
            &rows
        )
    );
    page("Audit trail", &who, Section::Audit, None, &body)
}
