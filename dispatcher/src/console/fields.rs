//! What a page reads: a request's query or form fields, and the JSON an operator command printed
//! (a leaf: the pages stand on it).

use std::collections::HashMap;

use serde_json::Value;

/// The query or form fields of a request.
pub type Fields = HashMap<String, String>;

/// The value of `key` in a JSON object as text (`-` when absent or null).
pub fn text(v: &Value, key: &str) -> String {
    match v.get(key) {
        None | Some(Value::Null) => "-".to_owned(),
        Some(Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
    }
}

/// The array `key` of `status`'s JSON (empty when absent).
pub fn list<'a>(status: &'a Value, key: &str) -> &'a [Value] {
    status
        .get(key)
        .and_then(Value::as_array)
        .map_or(&[], Vec::as_slice)
}
