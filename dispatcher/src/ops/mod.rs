//! The operator's commands, subcommands of the `dispatcher` binary, run under an operator's own
//! database login (never the dispatcher's): from a laptop through the Auth Proxy, or in the
//! cluster with `deploy/k8s/operator/run` (deploy/README.md, "Operators").
//!
//! Each command is options (clap) with their checks, then a run over one shared bootstrap
//! ([`Common`]: connect, print a table or `--json`). Every change writes one audit row in the
//! same transaction as the change; destructive commands need `--reason`, bulk ones `--yes`.
//! Exit codes: 0 ok, 1 failed, 2 bad usage, 3 nothing matched ([`Exit`]).

mod audit;
mod dead_letters;
mod pause;
mod status;

use clap::Subcommand;
use outbox_runtime::db::DatabaseArgs;
use outbox_runtime::operator::{Exit, describe};
use outbox_runtime::telemetry::TelemetryArgs;
use sqlx::PgPool;

pub use outbox_runtime::table::Table;

/// The operator's commands.
#[derive(Debug, Clone, Subcommand)]
pub enum OpsCommand {
    /// Per topic: due, waiting, oldest due age, dead letters, paused; producer streams;
    /// replicas; warnings for what needs action.
    ///
    /// Examples: `dispatcher status`, `dispatcher status --json | jq .warnings`
    Status(status::StatusArgs),
    /// Inspect, replay or discard dead letters.
    #[command(subcommand, name = "dead-letters")]
    DeadLetters(Box<dead_letters::DeadLettersCommand>),
    /// Stop claiming a topic's messages (they accumulate; nothing is dead-lettered). Audited.
    ///
    /// Example: `dispatcher pause invoices --reason "billing consumer down, INC-1234"`
    Pause(pause::PauseArgs),
    /// Claim a paused topic's messages again. Audited.
    ///
    /// Example: `dispatcher resume invoices --reason "consumer fixed"`
    Resume(pause::PauseArgs),
    /// The audit trail of operator actions, newest first.
    ///
    /// Examples: `dispatcher audit`, `dispatcher audit --action replay --since 2026-12-01T00:00:00Z`
    Audit(audit::AuditArgs),
}

impl OpsCommand {
    /// The logging flags of the command.
    pub fn telemetry(&self) -> &TelemetryArgs {
        &self.common().telemetry
    }

    fn common(&self) -> &Common {
        match self {
            Self::Status(a) => &a.common,
            Self::DeadLetters(c) => c.common(),
            Self::Pause(a) | Self::Resume(a) => &a.common,
            Self::Audit(a) => &a.common,
        }
    }

    /// Runs the command; prints its result (or its error) and says how it ended.
    pub async fn run(&self) -> Exit {
        let common = self.common();
        let pool =
            match outbox_runtime::db::connect(&common.database, "pubsub-outbox-operator").await {
                Ok(pool) => pool,
                Err(e) => return fail(&e),
            };
        let outcome = match self {
            Self::Status(a) => status::run(a, &pool).await,
            Self::DeadLetters(c) => dead_letters::run(c, &pool).await,
            Self::Pause(a) => pause::pause(a, &pool).await,
            Self::Resume(a) => pause::resume(a, &pool).await,
            Self::Audit(a) => audit::run(a, &pool).await,
        };
        pool.close().await;
        match outcome {
            Ok(exit) => exit,
            Err(OpsError::Usage(message)) => {
                eprintln!("error: {message}");
                Exit::Usage
            }
            Err(OpsError::Store(e)) => fail(&e),
        }
    }
}

fn fail(e: &(dyn std::error::Error + 'static)) -> Exit {
    eprintln!("error: {}", describe(e));
    Exit::Failed
}

/// What every operator command takes.
#[derive(Debug, Clone, clap::Args)]
pub struct Common {
    #[command(flatten)]
    pub database: DatabaseArgs,
    #[command(flatten)]
    pub telemetry: TelemetryArgs,
    /// Print JSON (a stable shape, documented in README) instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Who acts and why: required by every change.
#[derive(Debug, Clone, clap::Args)]
pub struct Why {
    /// Why (written to the audit trail). Required.
    #[arg(long)]
    pub reason: Option<String>,
    /// Who acts (default: OUTBOX_ACTOR, else the OS user, else the database login). The audit
    /// trail also records the database login itself, whatever this says.
    #[arg(long)]
    pub actor: Option<String>,
}

impl Why {
    /// The reason, or a usage error naming the flag.
    pub fn reason(&self) -> Result<&str, OpsError> {
        match self.reason.as_deref().map(str::trim) {
            Some(r) if !r.is_empty() => Ok(r),
            _ => Err(OpsError::Usage(
                "--reason is required: say why (it goes to the audit trail)".to_owned(),
            )),
        }
    }

    /// The declared actor, if any.
    pub fn actor(&self) -> Option<String> {
        outbox_runtime::operator::actor(self.actor.as_deref())
    }
}

/// How an operator command fails.
#[derive(Debug)]
pub enum OpsError {
    /// Bad usage (exit 2): the message names the bad value.
    Usage(String),
    /// The database failed (exit 1).
    Store(outbox_shared::Error),
}

impl From<outbox_shared::Error> for OpsError {
    fn from(e: outbox_shared::Error) -> Self {
        Self::Store(e)
    }
}

impl From<sqlx::Error> for OpsError {
    fn from(source: sqlx::Error) -> Self {
        Self::Store(outbox_shared::Error::Database {
            context: "running an operator command",
            source,
        })
    }
}

/// Prints `value` as JSON (pretty, one document).
pub fn print_json(value: &impl serde::Serialize) -> Result<(), OpsError> {
    let text = serde_json::to_string_pretty(value)
        .map_err(|e| OpsError::Usage(format!("encoding JSON failed: {e}")))?;
    println!("{text}");
    Ok(())
}

/// A full topic name for `topic` (short names need `--pubsub-project`/`PUBSUB_PROJECT_ID`).
pub fn topic_name(project: &str, topic: &str) -> Result<String, OpsError> {
    outbox_shared::resolve_topic(project, topic).map_err(|e| OpsError::Usage(format!("topic {e}")))
}

/// Parses an RFC 3339 instant or a duration ago (`2026-12-01T00:00:00Z`, `2h`).
pub fn instant(flag: &str, s: &str) -> Result<chrono::DateTime<chrono::Utc>, OpsError> {
    if let Ok(t) = chrono::DateTime::parse_from_rfc3339(s) {
        return Ok(t.with_timezone(&chrono::Utc));
    }
    match humantime::parse_duration(s)
        .ok()
        .and_then(|d| chrono::Duration::from_std(d).ok())
    {
        Some(ago) => Ok(chrono::Utc::now() - ago),
        None => Err(OpsError::Usage(format!(
            "{flag} {s:?} is neither an RFC 3339 time (2026-12-01T00:00:00Z) nor a duration ago (2h, 30m)"
        ))),
    }
}

/// Opens a transaction for a change.
pub async fn begin(pool: &PgPool) -> Result<sqlx::Transaction<'static, sqlx::Postgres>, OpsError> {
    Ok(pool.begin().await?)
}
