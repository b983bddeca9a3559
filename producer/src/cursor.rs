//! A stream's position, typed: `(UNIX microseconds, tie-breaker key)`, ordered as BigQuery orders
//! the query's `ORDER BY <timestamp>, <key>` (INT64 keys numerically, STRING keys byte-wise).
//!
//! The store keeps the key as text ([`Cursor`]); this module converts both ways and builds the
//! query parameters `@watermark_ts` (INT64 microseconds) and `@watermark_key` (the key's type).

use std::fmt;
use std::time::Duration;

use gcp_bigquery_client::model::query_parameter::QueryParameter;
use outbox_shared::store::watermark::Cursor;

use crate::bigquery::parameter;
use crate::config::KeyType;

/// `0001-01-01T00:00:00Z`, BigQuery's earliest TIMESTAMP, in UNIX microseconds.
pub const MIN_MICROS: i64 = crate::decimal::MIN_TIMESTAMP_MICROS;

/// A tie-breaker value.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Key {
    /// An INT64 key.
    Int(i64),
    /// A STRING key (Rust compares strings byte-wise, like BigQuery without a collation).
    Str(String),
}

/// A position in a stream.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Position {
    /// Timestamp, UNIX microseconds.
    pub micros: i64,
    /// Tie-breaker.
    pub key: Key,
}

impl Position {
    /// Before every row: the smallest key at [`MIN_MICROS`]. (A row at exactly that timestamp with
    /// the smallest possible key, `i64::MIN` or `""`, would not be read; BigQuery data never has
    /// one in practice.)
    pub fn start(key_type: KeyType) -> Self {
        Self::floor(MIN_MICROS, key_type)
    }

    /// The smallest position at `micros` (used for the lookback re-read).
    pub fn floor(micros: i64, key_type: KeyType) -> Self {
        let key = match key_type {
            KeyType::Int64 => Key::Int(i64::MIN),
            KeyType::String => Key::Str(String::new()),
        };
        Self {
            micros: micros.max(MIN_MICROS),
            key,
        }
    }

    /// Reads a stored cursor; None if its key is not a `key_type` value.
    pub fn from_cursor(cursor: &Cursor, key_type: KeyType) -> Option<Self> {
        let key = match key_type {
            KeyType::Int64 => Key::Int(cursor.key.parse().ok()?),
            KeyType::String => Key::Str(cursor.key.clone()),
        };
        Some(Self {
            micros: cursor.micros,
            key,
        })
    }

    /// The stored form.
    pub fn to_cursor(&self) -> Cursor {
        Cursor {
            micros: self.micros,
            key: self.key.to_string(),
        }
    }

    /// Where a run reads from: after the stored position, or `lookback` before it (never before
    /// [`MIN_MICROS`]).
    pub fn lower_bound(
        stored: Option<&Self>,
        lookback: Option<Duration>,
        key_type: KeyType,
    ) -> Self {
        match (stored, lookback) {
            (None, _) => Self::start(key_type),
            (Some(p), None) => p.clone(),
            (Some(p), Some(back)) => {
                let back = i64::try_from(back.as_micros()).unwrap_or(i64::MAX);
                Self::floor(p.micros.saturating_sub(back), key_type)
            }
        }
    }

    /// `@watermark_ts` and `@watermark_key` for this position.
    pub fn parameters(&self) -> Vec<QueryParameter> {
        let key = match &self.key {
            Key::Int(i) => parameter("watermark_key", "INT64", i.to_string()),
            Key::Str(s) => parameter("watermark_key", "STRING", s.clone()),
        };
        vec![
            parameter("watermark_ts", "INT64", self.micros.to_string()),
            key,
        ]
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Int(i) => write!(f, "{i}"),
            Self::Str(s) => f.write_str(s),
        }
    }
}

impl fmt::Display for Position {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match crate::value::format_timestamp(self.micros) {
            Some(ts) => write!(f, "({ts}, {})", self.key),
            None => write!(f, "({}, {})", self.micros, self.key),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_order_by_timestamp_then_typed_key() {
        let p = |micros, key| Position { micros, key };
        assert!(p(1, Key::Int(9)) < p(2, Key::Int(1)));
        assert!(
            p(1, Key::Int(9)) < p(1, Key::Int(10)),
            "INT64 keys compare numerically, not as text"
        );
        assert!(
            p(1, Key::Str("B".into())) < p(1, Key::Str("a".into())),
            "STRING keys compare byte-wise"
        );
        assert!(Position::start(KeyType::Int64) < p(MIN_MICROS, Key::Int(i64::MIN + 1)));
    }

    #[test]
    fn stored_cursors_round_trip_and_bad_keys_are_refused() {
        let c = Cursor {
            micros: 5,
            key: "-12".into(),
        };
        assert_eq!(
            Position::from_cursor(&c, KeyType::Int64).map(|p| p.to_cursor()),
            Some(c.clone())
        );
        assert_eq!(
            Position::from_cursor(&c, KeyType::String).map(|p| p.key),
            Some(Key::Str("-12".into()))
        );
        assert_eq!(
            Position::from_cursor(
                &Cursor {
                    micros: 5,
                    key: "abc".into()
                },
                KeyType::Int64
            ),
            None
        );
    }

    #[test]
    fn lookback_reads_from_before_the_watermark_without_going_below_the_minimum() {
        let stored = Position {
            micros: 10_000_000,
            key: Key::Int(7),
        };
        let kt = KeyType::Int64;
        assert_eq!(Position::lower_bound(Some(&stored), None, kt), stored);
        assert_eq!(
            Position::lower_bound(Some(&stored), Some(Duration::from_secs(4)), kt),
            Position {
                micros: 6_000_000,
                key: Key::Int(i64::MIN)
            }
        );
        assert_eq!(
            Position::lower_bound(None, Some(Duration::from_secs(4)), kt),
            Position::start(kt)
        );
        let early = Position {
            micros: MIN_MICROS + 1,
            key: Key::Int(0),
        };
        assert_eq!(
            Position::lower_bound(Some(&early), Some(Duration::from_secs(1)), kt).micros,
            MIN_MICROS
        );
    }
}
