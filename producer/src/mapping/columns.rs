//! Resolving a stream's configured columns against the query's result schema (once per run, on
//! the first page, before anything is written): unknown columns and unusable types are errors
//! naming the stream, the column and the config field.

use gcp_bigquery_client::model::field_type::FieldType;
use gcp_bigquery_client::model::table_field_schema::TableFieldSchema;
use gcp_bigquery_client::model::table_schema::TableSchema;

use super::{Mapper, Payload};
use crate::config::{KeyType, PayloadSpec, Stream, TopicSpec};
use crate::errors::{ErrorKind, StreamError};
use crate::value::type_name;

impl<'s> Mapper<'s> {
    /// Resolves the stream's columns in `schema`.
    pub fn new(
        stream: &'s Stream,
        schema: &TableSchema,
        dedupe_attribute: &str,
        pubsub_project: &str,
    ) -> Result<Self, StreamError> {
        let fields = schema.fields.clone().unwrap_or_default();
        let find = |column: &str, usage: &str| find_column(stream, &fields, column, usage);
        let (timestamp, key) = cursor_columns(stream, &fields)?;
        let dedupe = stream
            .dedupe_key
            .iter()
            .map(|c| find(c, "dedupe_key"))
            .collect::<Result<_, _>>()?;
        let topic_column = match &stream.topic {
            TopicSpec::Fixed(_) => None,
            TopicSpec::Column(c) => Some(find(c, "topic_column")?),
        };
        let ordering = stream
            .ordering_key_column
            .as_deref()
            .map(|c| find(c, "ordering_key_column"))
            .transpose()?;
        let attributes = stream
            .attribute_columns
            .iter()
            .map(|(name, c)| {
                Ok((
                    name.clone(),
                    find(c, &format!("attributes.columns.{name}"))?,
                ))
            })
            .collect::<Result<_, StreamError>>()?;
        let payload = payload_columns(stream, &fields)?;
        Ok(Self {
            stream,
            fields,
            timestamp,
            key,
            dedupe,
            topic_column,
            ordering,
            attributes,
            payload,
            dedupe_attribute: dedupe_attribute.to_owned(),
            pubsub_project: pubsub_project.to_owned(),
        })
    }
}

/// The cursor's timestamp (INT64 micros) and key (of the configured type) columns.
fn cursor_columns(
    stream: &Stream,
    fields: &[TableFieldSchema],
) -> Result<(usize, usize), StreamError> {
    let timestamp = find_column(
        stream,
        fields,
        &stream.cursor.timestamp_column,
        "cursor.timestamp_column",
    )?;
    expect_type(
        stream,
        &fields[timestamp],
        "cursor.timestamp_column",
        &[FieldType::Integer, FieldType::Int64],
        "INT64",
        "Select the cursor as UNIX_MICROS(<timestamp column>) AS <name>: real BigQuery sends TIMESTAMP as float seconds, which can drop microseconds",
    )?;
    let key = find_column(
        stream,
        fields,
        &stream.cursor.key_column,
        "cursor.key_column",
    )?;
    let (types, name): (&[FieldType], _) = match stream.cursor.key_type {
        KeyType::Int64 => (&[FieldType::Integer, FieldType::Int64], "INT64"),
        KeyType::String => (&[FieldType::String], "STRING"),
    };
    expect_type(
        stream,
        &fields[key],
        "cursor.key_column",
        types,
        name,
        "Set cursor.key_type to the column's type (INT64 or STRING), or CAST it in the query",
    )?;
    Ok((timestamp, key))
}

/// The payload: a JSON object of columns, or one BYTES or STRING column (not REPEATED).
fn payload_columns(stream: &Stream, fields: &[TableFieldSchema]) -> Result<Payload, StreamError> {
    let find = |column: &str, usage: &str| find_column(stream, fields, column, usage);
    Ok(match &stream.payload {
        PayloadSpec::Columns(cols) => Payload::Object(
            cols.iter()
                .map(|c| find(c, "payload.columns"))
                .collect::<Result<_, _>>()?,
        ),
        PayloadSpec::Raw(c) => {
            let i = find(c, "payload.raw_column")?;
            let repeated = fields[i]
                .mode
                .as_deref()
                .is_some_and(|m| m.eq_ignore_ascii_case("REPEATED"));
            match fields[i].r#type {
                FieldType::Bytes if !repeated => Payload::Bytes(i),
                FieldType::String if !repeated => Payload::Text(i),
                _ => {
                    return Err(column_type(
                        stream,
                        &fields[i],
                        "payload.raw_column",
                        "BYTES or STRING",
                        "Use payload.columns for a JSON object, or TO_JSON_STRING(...) in the query",
                    ));
                }
            }
        }
    })
}

fn find_column(
    stream: &Stream,
    fields: &[TableFieldSchema],
    column: &str,
    usage: &str,
) -> Result<usize, StreamError> {
    // BigQuery column names are case-insensitive; prefer an exact match.
    fields
        .iter()
        .position(|f| f.name == column)
        .or_else(|| {
            fields
                .iter()
                .position(|f| f.name.eq_ignore_ascii_case(column))
        })
        .ok_or_else(|| {
            let available = fields
                .iter()
                .map(|f| format!("`{}`", f.name))
                .collect::<Vec<_>>()
                .join(", ");
            let kind = ErrorKind::UnknownColumn {
                column: column.to_owned(),
                usage: usage.to_owned(),
                available,
            };
            StreamError::new(&stream.name, kind)
        })
}

fn expect_type(
    stream: &Stream,
    field: &TableFieldSchema,
    usage: &str,
    ok: &[FieldType],
    expected: &str,
    hint: &str,
) -> Result<(), StreamError> {
    let repeated = field
        .mode
        .as_deref()
        .is_some_and(|m| m.eq_ignore_ascii_case("REPEATED"));
    let name = type_name(&field.r#type);
    if !repeated && ok.iter().any(|t| type_name(t) == name) {
        return Ok(());
    }
    Err(column_type(stream, field, usage, expected, hint))
}

fn column_type(
    stream: &Stream,
    field: &TableFieldSchema,
    usage: &str,
    expected: &str,
    hint: &str,
) -> StreamError {
    let repeated = field
        .mode
        .as_deref()
        .is_some_and(|m| m.eq_ignore_ascii_case("REPEATED"));
    let found = format!(
        "{}{}",
        if repeated { "ARRAY of " } else { "" },
        type_name(&field.r#type)
    );
    let kind = ErrorKind::ColumnType {
        column: field.name.clone(),
        detail: format!("({usage}) is {found}, expected {expected}. {hint}"),
    };
    StreamError::new(&stream.name, kind)
}
