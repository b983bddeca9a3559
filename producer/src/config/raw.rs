//! The file as written (serde shapes that refuse unknown fields) and its validation into
//! [`super::Stream`]: every problem is collected with the stream and field it concerns.

use std::collections::BTreeMap;

use outbox_shared::limits::{MAX_ATTRIBUTE_KEY_BYTES, MAX_ATTRIBUTE_VALUE_BYTES, MAX_ATTRIBUTES};
use serde::Deserialize;

use super::{
    Commit, CursorSpec, DEFAULT_MAX_RUN_BYTES, DEFAULT_MAX_RUN_ROWS, KeyType, LoadOptions,
    PayloadSpec, Stream, TopicSpec,
};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawFile {
    #[serde(default)]
    pub(super) stream: Vec<toml::Value>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawStream {
    pub(super) name: String,
    query: String,
    location: Option<String>,
    maximum_bytes_billed: Option<i64>,
    lookback: Option<String>,
    cursor: RawCursor,
    dedupe_key: Vec<String>,
    topic: Option<String>,
    topic_column: Option<String>,
    ordering_key_column: Option<String>,
    #[serde(default)]
    attributes: RawAttributes,
    payload: RawPayload,
    commit: Option<String>,
    max_run_rows: Option<i64>,
    max_run_bytes: Option<i64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCursor {
    timestamp_column: String,
    key_column: String,
    key_type: KeyType,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAttributes {
    #[serde(default)]
    columns: BTreeMap<String, String>,
    #[serde(default)]
    fixed: BTreeMap<String, String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPayload {
    columns: Option<Vec<String>>,
    raw_column: Option<String>,
}

pub(super) fn validate(
    raw: RawStream,
    label: &str,
    options: &LoadOptions,
    problems: &mut Vec<String>,
) -> Stream {
    let mut problem = |field: &str, msg: String| problems.push(format!("{label}: {field}: {msg}"));
    check_name_and_query(&raw, &mut problem);
    let lookback = lookback(raw.lookback.as_deref(), &mut problem);
    check_columns(&raw, &mut problem);
    let commit = commit_mode(&raw, &mut problem);
    let topic = topic_spec(raw.topic, raw.topic_column, options, &mut problem);
    let payload = payload_spec(raw.payload, &mut problem);
    check_attributes(&raw.attributes, options, &mut problem);
    Stream {
        name: raw.name,
        query: raw.query,
        location: raw.location.filter(|l| !l.is_empty()),
        maximum_bytes_billed: raw.maximum_bytes_billed,
        lookback,
        cursor: CursorSpec {
            timestamp_column: raw.cursor.timestamp_column,
            key_column: raw.cursor.key_column,
            key_type: raw.cursor.key_type,
        },
        dedupe_key: raw.dedupe_key,
        topic,
        ordering_key_column: raw.ordering_key_column.filter(|c| !c.is_empty()),
        attribute_columns: raw.attributes.columns,
        fixed_attributes: raw.attributes.fixed,
        payload,
        commit,
    }
}

/// The name, the query's watermark parameters, the byte cap.
fn check_name_and_query(raw: &RawStream, problem: &mut impl FnMut(&str, String)) {
    let valid_name = !raw.name.is_empty()
        && raw.name.len() <= 100
        && raw
            .name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
    if !valid_name {
        problem("name", "use 1-100 characters from A-Z a-z 0-9 _ - .".into());
    }
    for param in ["@watermark_ts", "@watermark_key"] {
        if !raw.query.to_ascii_lowercase().contains(param) {
            problem(
                "query",
                format!("must use the parameter {param} (rows after the stored watermark)"),
            );
        }
    }
    if raw.maximum_bytes_billed.is_some_and(|b| b <= 0) {
        problem(
            "maximum_bytes_billed",
            "must be a positive number of bytes".into(),
        );
    }
}

/// The cursor and dedupe key columns are named.
fn check_columns(raw: &RawStream, problem: &mut impl FnMut(&str, String)) {
    for (field, column) in [
        ("cursor.timestamp_column", &raw.cursor.timestamp_column),
        ("cursor.key_column", &raw.cursor.key_column),
    ] {
        if column.is_empty() {
            problem(field, "must name a column of the query".into());
        }
    }
    if raw.dedupe_key.is_empty() || raw.dedupe_key.iter().any(String::is_empty) {
        problem(
            "dedupe_key",
            "list one or more columns that identify a row across reruns".into(),
        );
    }
}

/// `lookback = "15m"`: none when absent or zero.
fn lookback(
    value: Option<&str>,
    problem: &mut impl FnMut(&str, String),
) -> Option<std::time::Duration> {
    match value.map(humantime::parse_duration) {
        None => None,
        Some(Ok(d)) if d.is_zero() => None,
        Some(Ok(d)) => Some(d),
        Some(Err(e)) => {
            problem("lookback", format!("not a duration like \"15m\": {e}"));
            None
        }
    }
}

/// Exactly one of `topic` (checked as Pub/Sub checks it) and `topic_column`.
fn topic_spec(
    topic: Option<String>,
    column: Option<String>,
    options: &LoadOptions,
    problem: &mut impl FnMut(&str, String),
) -> TopicSpec {
    match (topic, column) {
        (Some(_), Some(_)) => {
            problem("topic", "set either topic or topic_column, not both".into());
            TopicSpec::Fixed(String::new())
        }
        (None, None) => {
            problem(
                "topic",
                "set topic (a fixed topic) or topic_column (a column holding it)".into(),
            );
            TopicSpec::Fixed(String::new())
        }
        (Some(t), None) => TopicSpec::Fixed(resolve_topic(&t, options, problem)),
        (None, Some(c)) => TopicSpec::Column(c),
    }
}

/// Exactly one of `columns = [..]` and `raw_column`.
fn payload_spec(payload: RawPayload, problem: &mut impl FnMut(&str, String)) -> PayloadSpec {
    match (payload.columns, payload.raw_column) {
        (Some(cols), None) if !cols.is_empty() && !cols.iter().any(String::is_empty) => {
            PayloadSpec::Columns(cols)
        }
        (None, Some(col)) if !col.is_empty() => PayloadSpec::Raw(col),
        _ => {
            problem(
                "payload",
                "set exactly one of columns = [..] (a JSON object) or raw_column (BYTES/STRING)"
                    .into(),
            );
            PayloadSpec::Columns(Vec::new())
        }
    }
}

fn commit_mode(raw: &RawStream, problem: &mut impl FnMut(&str, String)) -> Commit {
    let mut guard = |field: &str, value: Option<i64>, default: u64| match value {
        None => default,
        Some(v) if v > 0 => v.unsigned_abs(),
        Some(_) => {
            problem(field, "must be a positive number".into());
            default
        }
    };
    let max_rows = guard("max_run_rows", raw.max_run_rows, DEFAULT_MAX_RUN_ROWS);
    let max_bytes = guard("max_run_bytes", raw.max_run_bytes, DEFAULT_MAX_RUN_BYTES);
    match raw.commit.as_deref() {
        None | Some("page") => {
            if raw.max_run_rows.is_some() || raw.max_run_bytes.is_some() {
                problem(
                    "commit",
                    "max_run_rows and max_run_bytes apply only with commit = \"run\"".into(),
                );
            }
            Commit::Page
        }
        Some("run") => Commit::Run {
            max_rows,
            max_bytes,
        },
        Some(other) => {
            problem(
                "commit",
                format!(
                    "{other:?} is not \"page\" (each page commits) or \"run\" (one transaction per run)"
                ),
            );
            Commit::Page
        }
    }
}

fn resolve_topic(
    topic: &str,
    options: &LoadOptions,
    problem: &mut impl FnMut(&str, String),
) -> String {
    match outbox_shared::resolve_topic(&options.pubsub_project, topic) {
        Ok(full) => full,
        Err(e) => {
            problem("topic", e.to_string());
            String::new()
        }
    }
}

fn check_attributes(
    attrs: &RawAttributes,
    options: &LoadOptions,
    problem: &mut impl FnMut(&str, String),
) {
    for name in attrs.columns.keys() {
        if attrs.fixed.contains_key(name) {
            problem(
                "attributes",
                format!("{name:?} is both a column attribute and a fixed one"),
            );
        }
    }
    let all = attrs.columns.iter().chain(attrs.fixed.iter());
    for (name, _) in all.clone() {
        if name.is_empty() || name.len() > MAX_ATTRIBUTE_KEY_BYTES {
            problem(
                "attributes",
                format!("name {name:?} must be 1 to {MAX_ATTRIBUTE_KEY_BYTES} bytes"),
            );
        }
        if *name == options.dedupe_attribute || name.starts_with("goog") {
            problem(
                "attributes",
                format!("{name:?} is reserved (the dispatcher's dedupe attribute or a goog* name)"),
            );
        }
    }
    for (name, column) in &attrs.columns {
        if column.is_empty() {
            problem("attributes.columns", format!("{name:?} must name a column"));
        }
    }
    for (name, value) in &attrs.fixed {
        if value.len() > MAX_ATTRIBUTE_VALUE_BYTES {
            problem(
                "attributes.fixed",
                format!("{name:?} is longer than {MAX_ATTRIBUTE_VALUE_BYTES} bytes"),
            );
        }
    }
    if all.count() + 1 > MAX_ATTRIBUTES {
        problem(
            "attributes",
            format!(
                "at most {} attributes (the dedupe attribute is added)",
                MAX_ATTRIBUTES - 1
            ),
        );
    }
}
