//! The one design of the operator commands of both binaries.
//!
//! A command is its options (clap, flattening [`Common`] and, for a change, [`Why`] and
//! [`Confirm`]), a pure [`Command::check`] of them (no I/O: bad usage is refused before anything
//! connects), and a [`Command::run`] of the checked request that returns an [`Output`]: a text for
//! people, a JSON document for scripts and the exit code. [`execute`] does the rest the same way
//! for every command: check, connect, run, close, print (a closed pipe is not an error), or print
//! the error once and map it to its exit code (0 ok, 1 failed, 2 bad usage, 3 nothing matched).
//!
//! Also here, once: the reason/actor/confirmation rules ([`Why`], [`Confirm`], [`actor`]), the one
//! parser for instants and durations ([`parse_instant`], [`parse_age`]), and the near matches a
//! refusal of an unknown name lists ([`near`]).

mod actor;
mod output;
mod parse;

use std::future::Future;

use chrono::{DateTime, Utc};
use sqlx::PgPool;

use crate::db::{ConnectError, DatabaseArgs};
use crate::telemetry::TelemetryArgs;

pub use crate::exit::{Exit, describe};
pub use actor::actor;
pub use output::Output;
pub use parse::{near, parse_age, parse_instant};

/// What every operator command takes.
#[derive(Debug, Clone, clap::Args)]
pub struct Common {
    #[command(flatten)]
    pub database: DatabaseArgs,
    #[command(flatten)]
    pub telemetry: TelemetryArgs,
    /// Print JSON (a stable shape, documented in docs/operating.md: fields are only ever added)
    /// instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Who acts and why: required by every change.
#[derive(Debug, Clone, clap::Args)]
pub struct Why {
    /// Why (written to the audit trail). Required.
    #[arg(long)]
    pub reason: Option<String>,
    /// Who acts (default: OUTBOX_ACTOR, else the OS user: USER, LOGNAME or the process's user
    /// name). The audit trail also records the database login itself, whatever this says.
    #[arg(long)]
    pub actor: Option<String>,
}

/// A checked [`Why`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Actor {
    /// Why, trimmed, never empty.
    pub reason: String,
    /// Who says they act (`None`: the database login is recorded as the actor too).
    pub actor: Option<String>,
}

impl Why {
    /// The reason (required for a change: `what` says what it is for; a dry run changes and
    /// audits nothing, so it needs none) and the actor.
    pub fn check(&self, what: &str, dry_run: bool) -> Result<Actor, OpsError> {
        let reason = match self.reason.as_deref().map(str::trim) {
            // Rolled back: the change's rules (a reason is never empty) still hold in it.
            Some("") | None if dry_run => "(dry run)",
            _ => required("--reason", self.reason.as_deref(), what)?,
        };
        Ok(Actor {
            reason: reason.to_owned(),
            actor: actor(self.actor.as_deref()),
        })
    }
}

/// How a change is confirmed: every change of both binaries takes these. `--dry-run` makes the
/// change in a transaction that is rolled back ([`finish`]), so it shows exactly what the change
/// would do (the same statements, the same rows skipped), and writes, audits and wakes nothing.
/// A change selected by a filter (rather than by names or ids) also needs `--yes`.
#[derive(Debug, Clone, clap::Args)]
pub struct Confirm {
    /// Confirm a change selected by a filter (not needed for ids or names).
    #[arg(long)]
    pub yes: bool,
    /// Show exactly what would change (the change is made and rolled back); change nothing.
    #[arg(long)]
    pub dry_run: bool,
}

impl Confirm {
    /// Refuses a change by filter without `--yes` (a dry run needs none).
    pub fn check(&self, by_filter: bool, action: &str, selected: &str) -> Result<(), OpsError> {
        if by_filter && !self.yes && !self.dry_run {
            return Err(OpsError::Usage(format!(
                "{action} by filter changes every matching {selected}: check with --dry-run, then \
                 add --yes"
            )));
        }
        Ok(())
    }
}

/// Ends a change's transaction: committed, or rolled back for a dry run (what it did is then
/// what the change would do).
pub async fn finish(
    tx: sqlx::Transaction<'_, sqlx::Postgres>,
    dry_run: bool,
) -> Result<(), OpsError> {
    if dry_run {
        tx.rollback().await?;
    } else {
        tx.commit().await?;
    }
    Ok(())
}

/// A required, non-empty text flag, trimmed; `why` completes "X is required: …".
pub fn required<'a>(flag: &str, value: Option<&'a str>, why: &str) -> Result<&'a str, OpsError> {
    match value.map(str::trim) {
        Some(v) if !v.is_empty() => Ok(v),
        Some(_) => Err(OpsError::Usage(format!("{flag} is empty: {why}"))),
        None => Err(OpsError::Usage(format!("{flag} is required: {why}"))),
    }
}

/// How an operator command fails.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OpsError {
    /// A flag is missing, empty, malformed or contradicts another (exit 2).
    #[error("{0}")]
    Usage(String),
    /// The selection matched nothing (exit 3).
    #[error("{0}")]
    NothingMatched(String),
    /// The change could not be made as checked, e.g. something else holds it (exit 1).
    #[error("{0}")]
    Failed(String),
    /// PostgreSQL could not be reached (exit 1), or DATABASE_URL is wrong (exit 2).
    #[error(transparent)]
    Connect(#[from] ConnectError),
    /// A statement failed (exit 1; 2 when the database is set up wrong, e.g. a missing grant).
    #[error(transparent)]
    Store(#[from] outbox_shared::Error),
    /// The result could not be encoded as JSON (exit 1).
    #[error("encoding the JSON output failed: {0}")]
    Encode(#[source] serde_json::Error),
}

impl From<sqlx::Error> for OpsError {
    fn from(source: sqlx::Error) -> Self {
        Self::Store(outbox_shared::Error::Database {
            context: "running an operator command",
            source,
        })
    }
}

impl OpsError {
    /// The exit code this error ends the command with.
    pub fn exit(&self) -> Exit {
        match self {
            Self::Usage(_) => Exit::Usage,
            Self::NothingMatched(_) => Exit::NothingMatched,
            Self::Connect(e) if e.is_configuration() => Exit::Usage,
            Self::Store(e) if e.is_configuration() => Exit::Usage,
            _ => Exit::Failed,
        }
    }
}

/// An operator command: options, a pure check, a run. (Its [`Common`] options are a field its
/// binary's command enum hands to [`execute`].)
pub trait Command {
    /// The checked request [`Command::run`] carries out.
    type Checked: Send;

    /// Checks the options without I/O (`now` resolves a duration ago).
    fn check(&self, now: DateTime<Utc>) -> Result<Self::Checked, OpsError>;

    /// Carries out a checked request on `pool`.
    fn run(
        checked: Self::Checked,
        pool: &PgPool,
    ) -> impl Future<Output = Result<Output, OpsError>> + Send;
}

/// Checks and runs `command` on `pool` and returns its output, without printing: what
/// [`execute`] does between connecting and printing, for a caller that holds a pool and shows
/// the output its own way (the dispatcher's console).
pub async fn output_on<C: Command>(command: &C, pool: &PgPool) -> Result<Output, OpsError> {
    let checked = command.check(Utc::now())?;
    run_checked::<C>(checked, pool).await
}

/// Runs a checked request once the schema has every migration of this release (an operator
/// command on a schema behind its binary would fail on a missing table or column, or act on half
/// of what it means to: it stops with exit 2 and what to run instead).
async fn run_checked<C: Command>(checked: C::Checked, pool: &PgPool) -> Result<Output, OpsError> {
    outbox_shared::db::ensure_schema(pool).await?;
    C::run(checked, pool).await
}

/// Runs `command` with its `common` options as every operator command runs (see the module doc);
/// `application_name` names its database sessions.
pub async fn execute<C: Command>(command: &C, common: &Common, application_name: &str) -> Exit {
    let outcome = async {
        let checked = command.check(Utc::now())?;
        let pool = crate::db::connect(&common.database, application_name).await?;
        let output = run_checked::<C>(checked, &pool).await;
        pool.close().await;
        output
    }
    .await;
    match outcome {
        Ok(output) => output.print(common.json),
        Err(e) => crate::exit::report(
            common.telemetry.log_format,
            "The operator command failed",
            &describe(&e),
            e.exit(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn a_dry_run_needs_no_reason_and_a_change_does() {
        let why = Why {
            reason: None,
            actor: Some("alice".into()),
        };
        assert!(why.check("say why", false).is_err());
        let dry = why
            .check("say why", true)
            .expect("a dry run needs no reason");
        assert_eq!(dry.reason, "(dry run)");
        assert_eq!(dry.actor.as_deref(), Some("alice"));
    }

    #[test]
    fn a_change_by_filter_needs_yes_unless_it_is_a_dry_run() {
        let confirm = |yes, dry_run| Confirm { yes, dry_run };
        assert!(confirm(false, false).check(true, "replay", "x").is_err());
        assert!(confirm(true, false).check(true, "replay", "x").is_ok());
        assert!(confirm(false, true).check(true, "replay", "x").is_ok());
        assert!(confirm(false, false).check(false, "replay", "x").is_ok());
    }
}
