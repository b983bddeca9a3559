//! BigQuery cells (the `f`/`v` JSON of `jobs.query` rows) → `serde_json::Value`, without loss.
//!
//! | BigQuery | JSON |
//! |---|---|
//! | INT64, NUMERIC, BIGNUMERIC | string (NUMERIC normalised: `"12.500"` → `"12.5"`, `"-1E-9"` → `"-0.000000001"`) |
//! | FLOAT64 | number; NaN / ±Inf as the strings `"NaN"`, `"Infinity"`, `"-Infinity"` |
//! | BOOL | true / false |
//! | STRING, DATE, TIME, DATETIME, GEOGRAPHY (WKT), INTERVAL | the string BigQuery sends |
//! | BYTES | the base64 string BigQuery sends |
//! | TIMESTAMP | RFC 3339 UTC with microseconds, from either wire form ([`crate::decimal`]) |
//! | JSON | the document itself (numbers as BigQuery's JSON type holds them: int64/uint64/float64) |
//! | STRUCT / RECORD | object keyed by field name; ARRAY (REPEATED) → array |
//! | NULL | null (a NULL ARRAY, which BigQuery sends as `[]` or null, → `[]`) |
//!
//! A cell that does not have the expected wire form is an error (never a guess): it means the
//! producer does not understand what BigQuery sent, and an operator must look.

use gcp_bigquery_client::model::field_type::FieldType;
use gcp_bigquery_client::model::table_field_schema::TableFieldSchema;
use serde_json::{Map, Number, Value};

use crate::decimal::{Decimal, MAX_TIMESTAMP_MICROS, MIN_TIMESTAMP_MICROS, timestamp_micros};

/// A cell that could not be converted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("column `{path}` ({kind}): cannot read {raw}: {reason}")]
pub struct ValueError {
    /// Column path, e.g. `order.items[2].price`.
    pub path: String,
    /// The BigQuery type.
    pub kind: String,
    /// The raw cell, truncated for display.
    pub raw: String,
    /// What is wrong.
    pub reason: String,
}

/// Converts the cell `v` of `field` (the whole `{"v": …}` content, REPEATED and RECORD included).
pub fn cell_to_json(field: &TableFieldSchema, v: &Value) -> Result<Value, ValueError> {
    convert(field, v, &field.name)
}

fn convert(field: &TableFieldSchema, v: &Value, path: &str) -> Result<Value, ValueError> {
    if field
        .mode
        .as_deref()
        .is_some_and(|m| m.eq_ignore_ascii_case("REPEATED"))
    {
        let items = match v {
            Value::Null => return Ok(Value::Array(Vec::new())),
            Value::Array(items) => items,
            other => {
                return Err(error(
                    field,
                    path,
                    other,
                    "expected an array for a REPEATED field",
                ));
            }
        };
        let mut out = Vec::with_capacity(items.len());
        for (i, item) in items.iter().enumerate() {
            let inner = item.get("v").unwrap_or(&Value::Null);
            out.push(convert_single(field, inner, &format!("{path}[{i}]"))?);
        }
        return Ok(Value::Array(out));
    }
    convert_single(field, v, path)
}

fn convert_single(field: &TableFieldSchema, v: &Value, path: &str) -> Result<Value, ValueError> {
    if v.is_null() {
        return Ok(Value::Null);
    }
    match field.r#type {
        FieldType::Record | FieldType::Struct => convert_record(field, v, path),
        FieldType::Integer | FieldType::Int64 => match v {
            Value::String(s) => s
                .parse::<i64>()
                .map(|i| Value::String(i.to_string()))
                .map_err(|_| error(field, path, v, "not a 64-bit integer")),
            Value::Number(n) if n.is_i64() => Ok(Value::String(n.to_string())),
            _ => Err(error(field, path, v, "expected an integer string")),
        },
        FieldType::Numeric | FieldType::Bignumeric => {
            let text = scalar_text(field, path, v)?;
            Decimal::parse(&text)
                .map(|d| Value::String(d.to_plain_string()))
                .map_err(|e| error(field, path, v, &e.to_string()))
        }
        FieldType::Float | FieldType::Float64 => {
            let text = scalar_text(field, path, v)?;
            let f: f64 = text
                .trim()
                .parse()
                .map_err(|_| error(field, path, v, "not a floating point number"))?;
            Ok(float_to_json(f))
        }
        FieldType::Boolean | FieldType::Bool => match v {
            Value::Bool(b) => Ok(Value::Bool(*b)),
            Value::String(s) if s.eq_ignore_ascii_case("true") => Ok(Value::Bool(true)),
            Value::String(s) if s.eq_ignore_ascii_case("false") => Ok(Value::Bool(false)),
            _ => Err(error(field, path, v, "expected true or false")),
        },
        FieldType::Timestamp => {
            let text = scalar_text(field, path, v)?;
            let micros =
                timestamp_micros(&text).map_err(|e| error(field, path, v, &e.to_string()))?;
            format_timestamp(micros)
                .map(Value::String)
                .ok_or_else(|| error(field, path, v, "out of range"))
        }
        FieldType::Json => match v {
            Value::String(s) => {
                serde_json::from_str(s).map_err(|e| error(field, path, v, &e.to_string()))
            }
            // Already a document (not what BigQuery sends today, but unambiguous).
            other => Ok(other.clone()),
        },
        FieldType::String
        | FieldType::Bytes
        | FieldType::Date
        | FieldType::Time
        | FieldType::Datetime
        | FieldType::Geography
        | FieldType::Interval => match v {
            Value::String(s) => Ok(Value::String(s.clone())),
            _ => Err(error(field, path, v, "expected a string")),
        },
    }
}

fn convert_record(field: &TableFieldSchema, v: &Value, path: &str) -> Result<Value, ValueError> {
    let subfields = field.fields.as_deref().unwrap_or_default();
    let cells = v
        .get("f")
        .and_then(Value::as_array)
        .ok_or_else(|| error(field, path, v, "expected a record {\"f\": [...]}"))?;
    if cells.len() != subfields.len() {
        return Err(error(
            field,
            path,
            v,
            "record has a different number of fields than its schema",
        ));
    }
    let mut out = Map::new();
    for (sub, cell) in subfields.iter().zip(cells) {
        let inner = cell.get("v").unwrap_or(&Value::Null);
        out.insert(
            sub.name.clone(),
            convert(sub, inner, &format!("{path}.{}", sub.name))?,
        );
    }
    Ok(Value::Object(out))
}

fn scalar_text(field: &TableFieldSchema, path: &str, v: &Value) -> Result<String, ValueError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Number(n) => Ok(n.to_string()),
        _ => Err(error(field, path, v, "expected a scalar")),
    }
}

/// JSON has no NaN or infinities: they become strings, every finite double stays a number.
fn float_to_json(f: f64) -> Value {
    if f.is_nan() {
        Value::String("NaN".into())
    } else if f.is_infinite() {
        Value::String(if f > 0.0 { "Infinity" } else { "-Infinity" }.into())
    } else {
        Number::from_f64(f).map_or(Value::Null, Value::Number)
    }
}

/// RFC 3339, UTC, four-digit year, always six fractional digits: `2026-11-30T12:00:00.123456Z`.
/// None outside BigQuery's range (0001-01-01 to 9999-12-31), where RFC 3339 has no year form.
pub fn format_timestamp(micros: i64) -> Option<String> {
    if !(MIN_TIMESTAMP_MICROS..=MAX_TIMESTAMP_MICROS).contains(&micros) {
        return None;
    }
    chrono::DateTime::from_timestamp_micros(micros)
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Micros, true))
}

/// A converted value as text, for dedupe keys, attributes, topics and ordering keys: strings as
/// they are, numbers and booleans printed, arrays and objects as compact JSON, NULL → None.
pub fn as_text(value: &Value) -> Option<String> {
    match value {
        Value::Null => None,
        Value::String(s) => Some(s.clone()),
        other => Some(other.to_string()),
    }
}

fn error(field: &TableFieldSchema, path: &str, v: &Value, reason: &str) -> ValueError {
    let mut raw = v.to_string();
    if raw.len() > 120 {
        let cut = (0..=120)
            .rev()
            .find(|&i| raw.is_char_boundary(i))
            .unwrap_or(0);
        raw.truncate(cut);
        raw.push('…');
    }
    ValueError {
        path: path.to_owned(),
        kind: type_name(&field.r#type).to_owned(),
        raw,
        reason: reason.to_owned(),
    }
}

/// The GoogleSQL name of a schema type.
pub fn type_name(t: &FieldType) -> &'static str {
    match t {
        FieldType::String => "STRING",
        FieldType::Bytes => "BYTES",
        FieldType::Integer | FieldType::Int64 => "INT64",
        FieldType::Float | FieldType::Float64 => "FLOAT64",
        FieldType::Numeric => "NUMERIC",
        FieldType::Bignumeric => "BIGNUMERIC",
        FieldType::Boolean | FieldType::Bool => "BOOL",
        FieldType::Timestamp => "TIMESTAMP",
        FieldType::Date => "DATE",
        FieldType::Time => "TIME",
        FieldType::Datetime => "DATETIME",
        FieldType::Record | FieldType::Struct => "STRUCT",
        FieldType::Geography => "GEOGRAPHY",
        FieldType::Json => "JSON",
        FieldType::Interval => "INTERVAL",
    }
}

/// Decodes standard base64 (BigQuery's BYTES form; padding optional).
pub fn decode_base64(text: &str) -> Option<Vec<u8>> {
    fn sextet(c: u8) -> Option<u32> {
        match c {
            b'A'..=b'Z' => Some(u32::from(c - b'A')),
            b'a'..=b'z' => Some(u32::from(c - b'a') + 26),
            b'0'..=b'9' => Some(u32::from(c - b'0') + 52),
            b'+' => Some(62),
            b'/' => Some(63),
            _ => None,
        }
    }
    let body = text.trim_end_matches('=');
    if text.len() - body.len() > 2 || body.len() % 4 == 1 {
        return None;
    }
    let mut out = Vec::with_capacity(body.len() * 3 / 4);
    for chunk in body.as_bytes().chunks(4) {
        let mut acc = 0u32;
        for &c in chunk {
            acc = (acc << 6) | sextet(c)?;
        }
        acc <<= 6 * (4 - chunk.len() as u32);
        let bytes = acc.to_be_bytes();
        out.extend_from_slice(&bytes[1..chunk.len()]);
    }
    Some(out)
}

#[cfg(test)]
#[path = "value_tests.rs"]
mod tests;
