//! The operator's commands of the producer binary: [`streams`] (each stream's watermark and last
//! runs) and [`rewind`] (move a watermark back, audited, so the next run re-reads a window).
//!
//! Both are built on the one operator framework both binaries share
//! ([`outbox_runtime::operator`]: options, a pure check, a run returning an output value, exit
//! codes 0 ok, 1 failed, 2 bad usage, 3 nothing matched). The JSON shapes are documented in
//! docs/operating.md ("Operating the producer") and only ever grow.

pub mod rewind;
pub mod streams;

use clap::Subcommand;
use outbox_runtime::operator::{Common, Exit, OpsError, execute, parse_instant};
use outbox_runtime::telemetry::TelemetryArgs;
use serde::Serialize;

use crate::cursor::MIN_MICROS;

/// The `application_name` of the operator commands' sessions.
const APPLICATION: &str = "pubsub-outbox-producer-operator";

/// The operator's commands.
#[derive(Debug, Clone, Subcommand)]
pub enum OpsCommand {
    /// Each stream's watermark and its last runs (outcome, rows, error).
    #[command(
        after_help = "Examples:\n  producer streams\n  producer streams orders --runs 10\n  \
                            producer streams --json | jq '.streams[] | {stream, at: .watermark.timestamp}'"
    )]
    Streams(streams::StreamsArgs),
    /// Move a stream's watermark back so its next run re-reads from there. Audited; refused while
    /// a run holds the stream.
    ///
    /// Rows re-read that are still in the outbox count as duplicates; rows already published and
    /// deleted are enqueued again (consumers drop them by dedupe key), except in a stream with a
    /// lookback, which skips every row whose key it still remembers.
    #[command(after_help = "Examples:\n  \
                            producer rewind orders --to 2026-11-30T12:00:00Z --reason \"late rows, INC-1234\"\n  \
                            producer rewind orders --to 2h --reason \"re-read the last two hours\"\n  \
                            producer rewind orders --to 2026-11-30T12:00:00Z --key 1041 --reason \"after id 1041\"")]
    Rewind(rewind::RewindArgs),
}

impl OpsCommand {
    /// The logging flags of the command.
    pub fn telemetry(&self) -> &TelemetryArgs {
        &self.common().telemetry
    }

    fn common(&self) -> &Common {
        match self {
            Self::Streams(a) => &a.common,
            Self::Rewind(a) => &a.common,
        }
    }

    /// Runs the command: checks its options, connects, prints the result (or the error, each
    /// cause once) and says how it ended.
    pub async fn run(&self) -> Exit {
        let common = self.common();
        match self {
            Self::Streams(a) => execute(a, common, APPLICATION).await,
            Self::Rewind(a) => execute(a, common, APPLICATION).await,
        }
    }
}

/// A stream position as the JSON output writes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PositionView {
    /// RFC 3339 with six fractional digits (null outside BigQuery's TIMESTAMP range).
    pub timestamp: Option<String>,
    /// The same instant in UNIX microseconds (what `@watermark_ts` receives).
    pub micros: i64,
    /// The tie-breaker key as stored (text; what `@watermark_key` receives, in its type).
    pub key: String,
}

impl From<&outbox_shared::store::watermark::Cursor> for PositionView {
    fn from(c: &outbox_shared::store::watermark::Cursor) -> Self {
        Self {
            timestamp: crate::value::format_timestamp(c.micros),
            micros: c.micros,
            key: c.key.clone(),
        }
    }
}

impl std::fmt::Display for PositionView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.timestamp {
            Some(ts) => write!(f, "({ts}, {})", self.key),
            None => write!(f, "({} µs, {})", self.micros, self.key),
        }
    }
}

/// An instant (the operators' one parser: RFC 3339 or a duration ago) in UNIX microseconds,
/// within BigQuery's TIMESTAMP range.
pub fn parse_micros(
    flag: &str,
    s: &str,
    now: chrono::DateTime<chrono::Utc>,
) -> Result<i64, OpsError> {
    let micros = parse_instant(flag, s, now)?.timestamp_micros();
    if micros < MIN_MICROS {
        return Err(OpsError::Usage(format!(
            "{flag} {s:?} is before 0001-01-01T00:00:00Z, BigQuery's earliest TIMESTAMP"
        )));
    }
    Ok(micros)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_instant_before_bigquerys_range_is_refused() {
        let now = chrono::DateTime::from_timestamp(1_796_040_000, 0).unwrap_or_default();
        assert_eq!(
            parse_micros("--to", "2h", now).ok(),
            Some(1_796_040_000_000_000 - 7_200_000_000)
        );
        let early = parse_micros("--to", "0000-06-01T00:00:00Z", now).expect_err("refused");
        assert_eq!(early.exit(), Exit::Usage);
        assert!(early.to_string().contains("earliest"), "{early}");
    }
}
