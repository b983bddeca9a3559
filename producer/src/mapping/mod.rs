//! One result row → one message (or a rejection), as a stream's config says.
//!
//! [`Mapper::new`] resolves every configured column against the query's result schema once, on
//! the first page and before anything is written: an unknown column or a wrong type fails the run
//! naming the stream and the column. [`Mapper::map_row`] then produces:
//! - the row's cursor [`Position`] (a NULL or malformed cursor cell fails the run: it cannot be
//!   ordered, so it could be lost);
//! - a [`NewMessage`], or a [`Rejection`] when the message can never be published (Pub/Sub limits,
//!   a NULL dedupe column, no usable topic). Rejections go to the dead-letter table, not the outbox.
//!
//! Dedupe key: `<stream>:<value>[:<value>…]` from the configured columns' text, with `%` and `:`
//! percent-escaped in values so different rows never join to the same key. Stable across reruns
//! as long as the column values are.

use gcp_bigquery_client::model::table_cell::TableCell;
use gcp_bigquery_client::model::table_field_schema::TableFieldSchema;
use gcp_bigquery_client::model::table_row::TableRow;
use outbox_shared::NewMessage;
use outbox_shared::limits::check_publishable;
use outbox_shared::message::Attributes;
use outbox_shared::store::dead_letter::Rejection;
use serde_json::{Map, Value};

use crate::config::{KeyType, Stream, TopicSpec};
use crate::cursor::{Key, Position};
use crate::errors::{ErrorKind, StreamError};
use crate::value::{as_text, cell_to_json, decode_base64};

mod columns;

/// A mapped row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MappedRow {
    /// Where the row is in the stream.
    pub position: Position,
    /// The message, or why it can never be published.
    pub outcome: Result<NewMessage, Rejection>,
}

/// A stream's mapping, resolved against a result schema.
#[derive(Debug)]
pub struct Mapper<'s> {
    stream: &'s Stream,
    fields: Vec<TableFieldSchema>,
    timestamp: usize,
    key: usize,
    dedupe: Vec<usize>,
    topic_column: Option<usize>,
    ordering: Option<usize>,
    attributes: Vec<(String, usize)>,
    payload: Payload,
    dedupe_attribute: String,
    pubsub_project: String,
}

/// One row's cells, read through the mapper's schema.
struct Cells<'a> {
    mapper: &'a Mapper<'a>,
    cells: &'a [TableCell],
}

impl Cells<'_> {
    /// The cell as it came (NULL when absent).
    fn raw(&self, i: usize) -> &Value {
        self.cells[i].value.as_ref().unwrap_or(&Value::Null)
    }

    /// The cell as JSON, by its column's type.
    fn json(&self, i: usize) -> Result<Value, StreamError> {
        cell_to_json(&self.mapper.fields[i], self.raw(i))
            .map_err(|e| self.mapper.bad(e.to_string()))
    }
}

#[derive(Debug)]
enum Payload {
    Object(Vec<usize>),
    Bytes(usize),
    Text(usize),
}

impl Mapper<'_> {
    /// Maps one row. Errors only for rows that cannot be placed or read (see the module doc).
    pub fn map_row(&self, row: &TableRow) -> Result<MappedRow, StreamError> {
        let cells = row.columns.as_deref().unwrap_or_default();
        if cells.len() != self.fields.len() {
            return Err(self.bad(format!(
                "a row has {} cells but the schema has {} columns",
                cells.len(),
                self.fields.len()
            )));
        }
        let row = Cells {
            mapper: self,
            cells,
        };
        let position = self.position(row.raw(self.timestamp), row.raw(self.key))?;
        let attributes = self.attributes(&row)?;
        let ordering_key = match self.ordering {
            Some(i) => as_text(&row.json(i)?).filter(|k| !k.is_empty()),
            None => None,
        };
        let payload = self.payload(&row)?;
        let (dedupe_key, missing) = self.dedupe_key(&row)?;
        let (topic, topic_problem) = self.topic(&|i| row.json(i))?;
        let mut message = NewMessage {
            topic,
            ordering_key,
            dedupe_key,
            payload,
            attributes,
            trace_context: None,
        };
        let reason = if let Some(column) = missing {
            // The dead-letter table needs a unique key: derive one from the cursor (unique, stable).
            message.dedupe_key = format!(
                "{}:missing-dedupe-key:{}:{}",
                self.stream.name,
                position.micros,
                escape(&position.key.to_string())
            );
            Some(format!(
                "dedupe key column `{column}` is NULL; every message needs a stable dedupe key"
            ))
        } else if let Some(problem) = topic_problem {
            Some(problem)
        } else {
            check_publishable(
                &message.payload,
                &message.attributes,
                message.ordering_key.as_deref(),
                &self.dedupe_attribute,
                &message.dedupe_key,
            )
            .err()
            .map(|v| v.to_string())
        };
        let outcome = match reason {
            None => Ok(message),
            Some(reason) => Err(Rejection { message, reason }),
        };
        Ok(MappedRow { position, outcome })
    }

    /// The attribute columns' text (a NULL one is left out), then the fixed attributes.
    fn attributes(&self, row: &Cells<'_>) -> Result<Attributes, StreamError> {
        let mut attributes = Attributes::new();
        for (name, i) in &self.attributes {
            if let Some(v) = as_text(&row.json(*i)?) {
                attributes.insert(name.clone(), v);
            }
        }
        attributes.extend(
            self.stream
                .fixed_attributes
                .iter()
                .map(|(k, v)| (k.clone(), v.clone())),
        );
        Ok(attributes)
    }

    /// A JSON object of the payload columns, or one BYTES (base64 on the wire) or STRING column.
    fn payload(&self, row: &Cells<'_>) -> Result<Vec<u8>, StreamError> {
        Ok(match &self.payload {
            Payload::Object(cols) => {
                let mut object = Map::new();
                for &i in cols {
                    object.insert(self.fields[i].name.clone(), row.json(i)?);
                }
                serde_json::to_vec(&Value::Object(object))
                    .map_err(|e| self.bad(format!("encoding the payload: {e}")))?
            }
            Payload::Bytes(i) => match row.raw(*i) {
                Value::Null => Vec::new(),
                Value::String(b64) => decode_base64(b64).ok_or_else(|| {
                    self.bad(format!(
                        "column `{}` is not valid base64 BYTES",
                        self.fields[*i].name
                    ))
                })?,
                other => {
                    return Err(self.bad(format!(
                        "column `{}`: expected BYTES, got {other}",
                        self.fields[*i].name
                    )));
                }
            },
            Payload::Text(i) => as_text(&row.json(*i)?).unwrap_or_default().into_bytes(),
        })
    }

    /// `<stream>:<value>[:<value>…]`, and the first dedupe column that is NULL, if any.
    fn dedupe_key(&self, row: &Cells<'_>) -> Result<(String, Option<String>), StreamError> {
        let mut parts = Vec::with_capacity(self.dedupe.len());
        let mut missing = None;
        for &i in &self.dedupe {
            match as_text(&row.json(i)?) {
                Some(v) => parts.push(escape(&v)),
                None => missing = missing.or(Some(self.fields[i].name.clone())),
            }
        }
        Ok((format!("{}:{}", self.stream.name, parts.join(":")), missing))
    }

    fn position(&self, ts: &Value, key: &Value) -> Result<Position, StreamError> {
        let ts_name = &self.fields[self.timestamp].name;
        let key_name = &self.fields[self.key].name;
        let micros = ts
            .as_str()
            .and_then(|s| s.parse::<i64>().ok())
            .ok_or_else(|| self.bad(format!("cursor column `{ts_name}` is {ts}, expected INT64 microseconds (rows with a NULL cursor cannot be ordered; filter them out in the query)")))?;
        let key = match (self.stream.cursor.key_type, key) {
            (KeyType::Int64, Value::String(s)) => s.parse().ok().map(Key::Int),
            (KeyType::String, Value::String(s)) => Some(Key::Str(s.clone())),
            _ => None,
        }
        .ok_or_else(|| {
            self.bad(format!(
                "cursor key column `{key_name}` is {key}, expected a non-NULL {:?}",
                self.stream.cursor.key_type
            ))
        })?;
        Ok(Position { micros, key })
    }

    /// The full topic name, plus a rejection reason when the row has no usable topic.
    fn topic(
        &self,
        json: &impl Fn(usize) -> Result<Value, StreamError>,
    ) -> Result<(String, Option<String>), StreamError> {
        let i = match (&self.stream.topic, self.topic_column) {
            (TopicSpec::Fixed(topic), _) => return Ok((topic.clone(), None)),
            (TopicSpec::Column(_), Some(i)) => i,
            (TopicSpec::Column(c), None) => {
                return Err(self.bad(format!("topic column `{c}` was not resolved")));
            }
        };
        let column = &self.fields[i].name;
        let Some(value) = as_text(&json(i)?).filter(|v| !v.is_empty()) else {
            return Ok((
                String::new(),
                Some(format!("topic column `{column}` is NULL or empty")),
            ));
        };
        match outbox_shared::resolve_topic(&self.pubsub_project, &value) {
            Ok(full) => Ok((full, None)),
            Err(e) => Ok((value, Some(format!("topic from column `{column}`: {e}")))),
        }
    }

    fn bad(&self, detail: String) -> StreamError {
        StreamError::new(&self.stream.name, ErrorKind::BadRow(detail))
    }
}

/// `%` → `%25`, `:` → `%3A`: keeps the joined dedupe key unambiguous.
fn escape(value: &str) -> String {
    value.replace('%', "%25").replace(':', "%3A")
}

#[cfg(test)]
#[path = "tests.rs"]
mod tests;
