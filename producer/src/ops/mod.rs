//! The operator's commands of the producer binary: [`streams`] (each stream's watermark and last
//! runs) and [`rewind`] (move a watermark back, audited, so the next run re-reads a window).
//!
//! Each command is options (clap) checked before anything connects, then a run over one shared
//! bootstrap ([`run`]: connect, print a table or `--json`, map the outcome to an [`Exit`]).
//! Exit codes: 0 ok, 1 failed, 2 bad usage, 3 nothing matched. The JSON shapes are documented in
//! README.md ("Operating the producer") and only ever grow.

pub mod rewind;
pub mod streams;

use clap::Subcommand;
use outbox_runtime::db::{ConnectError, DatabaseArgs};
use outbox_runtime::operator::{Exit, describe};
use outbox_runtime::telemetry::TelemetryArgs;
use serde::Serialize;

use crate::cursor::MIN_MICROS;

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
    /// deleted are enqueued again (consumers drop them by dedupe key).
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
        let outcome = match self {
            Self::Streams(a) => streams::run(a).await,
            Self::Rewind(a) => rewind::run(a).await,
        };
        let printed = outcome.map(|output| {
            print!(
                "{}",
                if common.json {
                    output.json
                } else {
                    output.text
                }
            );
            output.exit
        });
        match printed {
            Ok(exit) => exit,
            Err(e) => {
                eprintln!("error: {}", describe(&e));
                e.exit()
            }
        }
    }
}

/// What every operator command takes.
#[derive(Debug, Clone, clap::Args)]
pub struct Common {
    #[command(flatten)]
    pub database: DatabaseArgs,
    #[command(flatten)]
    pub telemetry: TelemetryArgs,
    /// Print JSON (a stable shape, documented in README.md) instead of a table.
    #[arg(long)]
    pub json: bool,
}

impl Common {
    /// A pool for one operator command.
    pub async fn connect(&self) -> Result<sqlx::PgPool, OpsError> {
        Ok(outbox_runtime::db::connect(&self.database, "pubsub-outbox-producer-operator").await?)
    }
}

/// What a command prints: a text for people, a JSON document for scripts, and its exit code.
#[derive(Debug)]
pub struct Output {
    /// The human form (tables, sentences), ending in a newline.
    pub text: String,
    /// The JSON form (pretty, fields in their documented order), ending in a newline.
    pub json: String,
    /// How it ended.
    pub exit: Exit,
}

impl Output {
    /// An output of `text` and `value` as JSON, ending with `exit`.
    pub fn new(text: String, value: &impl Serialize, exit: Exit) -> Result<Self, OpsError> {
        let mut json = serde_json::to_string_pretty(value).map_err(OpsError::Encode)?;
        json.push('\n');
        Ok(Self { text, json, exit })
    }
}

/// How an operator command fails.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OpsError {
    /// A flag is missing, empty or contradicts another (exit 2).
    #[error("{0}")]
    Usage(String),
    /// The selection matched nothing (exit 3).
    #[error("{0}")]
    NothingMatched(String),
    /// A run of the stream is in progress, so the change was not made (exit 1).
    #[error(
        "stream '{stream}' is being run (another session holds its lock); nothing was changed. \
         Retry when the run has finished (producer streams shows it as running)"
    )]
    StreamBusy {
        /// The stream.
        stream: String,
    },
    /// The change could not be made as checked (exit 1).
    #[error("{0}")]
    Failed(String),
    /// PostgreSQL could not be reached (exit 1), or DATABASE_URL is wrong (exit 2).
    #[error(transparent)]
    Connect(#[from] ConnectError),
    /// A statement failed (exit 1).
    #[error(transparent)]
    Store(#[from] outbox_shared::Error),
    /// The result could not be encoded as JSON (exit 1).
    #[error("encoding the JSON output failed: {0}")]
    Encode(#[source] serde_json::Error),
}

impl OpsError {
    /// The exit code this error ends the command with.
    pub fn exit(&self) -> Exit {
        match self {
            Self::Usage(_) => Exit::Usage,
            Self::Connect(e) if e.is_configuration() => Exit::Usage,
            Self::NothingMatched(_) => Exit::NothingMatched,
            _ => Exit::Failed,
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

/// Parses an instant: RFC 3339 (`2026-11-30T12:00:00Z`) or a duration ago (`2h`, `90m`), in
/// UNIX microseconds within BigQuery's TIMESTAMP range.
pub fn parse_instant(
    flag: &str,
    s: &str,
    now: chrono::DateTime<chrono::Utc>,
) -> Result<i64, OpsError> {
    let s = s.trim();
    let at = if let Ok(t) = chrono::DateTime::parse_from_rfc3339(s) {
        t.with_timezone(&chrono::Utc)
    } else {
        let ago = humantime::parse_duration(s)
            .ok()
            .and_then(|d| chrono::Duration::from_std(d).ok())
            .and_then(|d| now.checked_sub_signed(d));
        match ago {
            Some(t) => t,
            None => {
                return Err(OpsError::Usage(format!(
                    "{flag} {s:?} is neither an RFC 3339 time (2026-11-30T12:00:00Z) nor a \
                     duration ago (2h, 30m)"
                )));
            }
        }
    };
    let micros = at.timestamp_micros();
    if micros < MIN_MICROS {
        return Err(OpsError::Usage(format!(
            "{flag} {s:?} is before 0001-01-01T00:00:00Z, BigQuery's earliest TIMESTAMP"
        )));
    }
    Ok(micros)
}

/// A required, non-empty text flag, trimmed.
pub fn required<'a>(flag: &str, value: Option<&'a str>, why: &str) -> Result<&'a str, OpsError> {
    match value.map(str::trim) {
        Some(v) if !v.is_empty() => Ok(v),
        Some(_) => Err(OpsError::Usage(format!("{flag} is empty: {why}"))),
        None => Err(OpsError::Usage(format!("{flag} is required: {why}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn now() -> chrono::DateTime<chrono::Utc> {
        chrono::DateTime::from_timestamp(1_796_040_000, 0).unwrap_or_default()
    }

    #[test]
    fn instants_are_rfc3339_or_a_duration_ago() {
        assert_eq!(
            parse_instant("--to", "2026-11-30T12:00:00.000001Z", now()).ok(),
            Some(1_796_040_000_000_001)
        );
        assert_eq!(
            parse_instant("--to", "2026-11-30T13:00:00+01:00", now()).ok(),
            Some(1_796_040_000_000_000)
        );
        assert_eq!(
            parse_instant("--to", "2h", now()).ok(),
            Some(1_796_040_000_000_000 - 7_200_000_000)
        );
    }

    #[test]
    fn a_bad_instant_is_a_usage_error_naming_the_flag_and_value() {
        let e = parse_instant("--to", "yesterday-ish", now()).expect_err("refused");
        assert_eq!(e.exit(), Exit::Usage);
        assert!(e.to_string().contains("--to \"yesterday-ish\""), "{e}");
        let early = parse_instant("--to", "0000-06-01T00:00:00Z", now()).expect_err("refused");
        assert!(early.to_string().contains("earliest"), "{early}");
    }

    #[test]
    fn a_required_flag_must_not_be_missing_or_blank() {
        assert_eq!(
            required("--reason", Some(" why "), "say why").ok(),
            Some("why")
        );
        for v in [None, Some(""), Some("  ")] {
            let e = required("--reason", v, "say why").expect_err("refused");
            assert_eq!(e.exit(), Exit::Usage);
            assert!(e.to_string().starts_with("--reason is"), "{e}");
        }
    }
}
