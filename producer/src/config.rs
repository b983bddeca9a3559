//! The streams file (TOML): what to read from BigQuery and how each row becomes a message.
//!
//! Loaded and validated once, before anything touches BigQuery or PostgreSQL. Every problem is
//! reported (not only the first), each naming the stream and the field. Column names are checked
//! against the query's result schema later, on the first page (see [`crate::mapping`]).
//! `examples/streams.toml` documents every field.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Duration;

use outbox_shared::limits::{MAX_ATTRIBUTE_KEY_BYTES, MAX_ATTRIBUTE_VALUE_BYTES, MAX_ATTRIBUTES};
use outbox_shared::message::full_topic_name;
use serde::Deserialize;

use crate::errors::ConfigError;

/// All streams of one file, sorted by name (the order Cloud Run tasks split them in).
#[derive(Debug, Clone)]
pub struct StreamsConfig {
    /// The streams.
    pub streams: Vec<Stream>,
}

/// One BigQuery query feeding the outbox.
#[derive(Debug, Clone)]
pub struct Stream {
    /// Unique name: the watermark, run ledger, lock, dedupe keys and dead-letter source use it.
    pub name: String,
    /// GoogleSQL with `@watermark_ts` (INT64 UNIX microseconds) and `@watermark_key` (the key
    /// column's type), returning rows ORDERED BY the cursor.
    pub query: String,
    /// BigQuery location of the job (None: BigQuery decides).
    pub location: Option<String>,
    /// Cost guard: the query fails rather than bill more than this.
    pub maximum_bytes_billed: Option<i64>,
    /// Re-read rows this far before the watermark on every run (late arrivals).
    pub lookback: Option<Duration>,
    /// The cursor columns.
    pub cursor: CursorSpec,
    /// Columns whose values, joined, identify a message across reruns.
    pub dedupe_key: Vec<String>,
    /// Where the topic comes from.
    pub topic: TopicSpec,
    /// Column holding the ordering key (NULL or empty: unordered).
    pub ordering_key_column: Option<String>,
    /// Attribute name → column.
    pub attribute_columns: BTreeMap<String, String>,
    /// Attribute name → fixed value.
    pub fixed_attributes: BTreeMap<String, String>,
    /// What the message data is.
    pub payload: PayloadSpec,
}

/// The stream's cursor: an INT64 microseconds column and a unique tie-breaker.
#[derive(Debug, Clone)]
pub struct CursorSpec {
    /// Result column with `UNIX_MICROS(<timestamp>)` (INT64).
    pub timestamp_column: String,
    /// Result column with a value unique among rows sharing a timestamp.
    pub key_column: String,
    /// The key column's type (also the type of `@watermark_key`).
    pub key_type: KeyType,
}

/// Supported tie-breaker types.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum KeyType {
    /// INT64 (compared numerically).
    #[serde(rename = "INT64", alias = "INTEGER")]
    Int64,
    /// STRING (compared byte-wise, as BigQuery does without a collation).
    #[serde(rename = "STRING")]
    String,
}

/// Where a message's topic comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TopicSpec {
    /// Always this full topic name.
    Fixed(String),
    /// From this column (a full name, or a short one in the Pub/Sub project).
    Column(String),
}

/// What the message data is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PayloadSpec {
    /// A JSON object of these columns (keys are the column names).
    Columns(Vec<String>),
    /// One BYTES (decoded) or STRING (UTF-8) column, as is.
    Raw(String),
}

/// What validation needs from the command line.
#[derive(Debug, Clone, Default)]
pub struct LoadOptions {
    /// Project for short topic names (empty: topics must be full names).
    pub pubsub_project: String,
    /// The attribute the dispatcher adds with the dedupe key (reserved).
    pub dedupe_attribute: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    #[serde(default)]
    stream: Vec<toml::Value>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawStream {
    name: String,
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

impl StreamsConfig {
    /// Reads and validates the file at `path`.
    pub fn load(path: &Path, options: &LoadOptions) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            ConfigError::new(
                path.display().to_string(),
                vec![format!("cannot read the file: {e}")],
            )
        })?;
        Self::parse(&text, &path.display().to_string(), options)
    }

    /// Parses and validates TOML text; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str, options: &LoadOptions) -> Result<Self, ConfigError> {
        let file: RawFile =
            toml::from_str(text).map_err(|e| ConfigError::new(origin, vec![locate(text, &e)]))?;
        let mut problems = Vec::new();
        if file.stream.is_empty() {
            problems.push("no streams: add at least one [[stream]] table".to_owned());
        }
        let mut streams = Vec::new();
        let mut names = BTreeSet::new();
        for (i, value) in file.stream.into_iter().enumerate() {
            let label = match value.get("name").and_then(toml::Value::as_str) {
                Some(name) => format!("stream '{name}'"),
                None => format!("stream #{}", i + 1),
            };
            let raw: RawStream = match value.try_into() {
                Ok(raw) => raw,
                Err(e) => {
                    problems.push(format!("{label}: {}", one_line(&e)));
                    continue;
                }
            };
            if !names.insert(raw.name.clone()) {
                problems.push(format!("{label}: name: another stream has the same name"));
            }
            let before = problems.len();
            let stream = validate(raw, &label, options, &mut problems);
            if problems.len() == before {
                streams.push(stream);
            }
        }
        if !problems.is_empty() {
            return Err(ConfigError::new(origin, problems));
        }
        streams.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(Self { streams })
    }
}

fn validate(
    raw: RawStream,
    label: &str,
    options: &LoadOptions,
    problems: &mut Vec<String>,
) -> Stream {
    let mut problem = |field: &str, msg: String| problems.push(format!("{label}: {field}: {msg}"));
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
    let lookback = match raw.lookback.as_deref().map(humantime::parse_duration) {
        None => None,
        Some(Ok(d)) if d.is_zero() => None,
        Some(Ok(d)) => Some(d),
        Some(Err(e)) => {
            problem("lookback", format!("not a duration like \"15m\": {e}"));
            None
        }
    };
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
    let topic = match (raw.topic, raw.topic_column) {
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
        (Some(t), None) => TopicSpec::Fixed(resolve_topic(&t, options, &mut problem)),
        (None, Some(c)) => TopicSpec::Column(c),
    };
    let payload = match (raw.payload.columns, raw.payload.raw_column) {
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
    };
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
    }
}

fn resolve_topic(
    topic: &str,
    options: &LoadOptions,
    problem: &mut impl FnMut(&str, String),
) -> String {
    if topic.is_empty() || topic.contains(char::is_whitespace) {
        problem("topic", format!("{topic:?} is not a topic name"));
        return String::new();
    }
    if topic.starts_with("projects/") {
        let parts: Vec<&str> = topic.split('/').collect();
        if parts.len() != 4 || parts[2] != "topics" || parts[1].is_empty() || parts[3].is_empty() {
            problem(
                "topic",
                format!("{topic:?} is not projects/<project>/topics/<topic>"),
            );
        }
        return topic.to_owned();
    }
    if topic.contains('/') {
        problem(
            "topic",
            format!("{topic:?}: use a short name or projects/<project>/topics/<topic>"),
        );
    }
    if options.pubsub_project.is_empty() {
        problem(
            "topic",
            format!(
                "{topic:?} is a short name: set --pubsub-project (PUBSUB_PROJECT_ID) or use projects/<project>/topics/{topic}"
            ),
        );
    }
    full_topic_name(&options.pubsub_project, topic)
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

/// A syntax error with its line and the stream it is in (the nearest `[[stream]]` above it that
/// has a `name = "…"`), so even a file that does not parse names the stream.
fn locate(text: &str, e: &toml::de::Error) -> String {
    let Some(span) = e.span() else {
        return one_line(e);
    };
    let before = &text[..span.start.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let stream = before.rfind("[[stream]]").and_then(|start| {
        text[start..]
            .lines()
            .skip(1)
            .take_while(|l| !l.trim_start().starts_with('['))
            .find_map(|l| {
                let (key, value) = l.split_once('=')?;
                (key.trim() == "name").then(|| value.trim().trim_matches('"').to_owned())
            })
    });
    let message = e.message().split_whitespace().collect::<Vec<_>>().join(" ");
    match stream {
        Some(name) => format!("stream '{name}' (line {line}): {message}"),
        None => format!("line {line}: {message}"),
    }
}

fn one_line(e: &toml::de::Error) -> String {
    e.to_string()
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
#[path = "config_tests.rs"]
mod tests;
