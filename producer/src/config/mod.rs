//! The streams file (TOML): what to read from BigQuery and how each row becomes a message.
//!
//! Loaded and validated once, before anything touches BigQuery or PostgreSQL. Every problem is
//! reported (not only the first), each naming the stream and the field. Column names are checked
//! against the query's result schema later, on the first page (see [`crate::mapping`]).
//! `examples/streams.toml` documents every field; `raw` holds the file shapes and validation.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Duration;

use serde::Deserialize;

use crate::errors::ConfigError;

mod raw;

use raw::{RawFile, RawStream, validate};

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
    /// What one PostgreSQL transaction holds: a page, or the whole run.
    pub commit: Commit,
}

/// What one PostgreSQL transaction of a run holds (`commit = "page"` or `"run"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Commit {
    /// Each page commits on its own (with the watermark at its last row): any run size, and a
    /// crashed run keeps its committed pages; consumers may see part of a run first.
    Page,
    /// The whole run is one transaction (rows, dead letters, watermark, ledger): consumers see all
    /// of a run or none of it. A run above either guard fails and enqueues nothing.
    Run {
        /// At most this many rows per run.
        max_rows: u64,
        /// At most this many payload bytes per run.
        max_bytes: u64,
    },
}

/// `max_run_rows` when `commit = "run"` does not say.
pub const DEFAULT_MAX_RUN_ROWS: u64 = 100_000;
/// `max_run_bytes` when `commit = "run"` does not say (256 MiB of payloads).
pub const DEFAULT_MAX_RUN_BYTES: u64 = 256 << 20;

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
#[path = "tests.rs"]
mod tests;
