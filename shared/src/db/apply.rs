//! Applying one migration without stalling the application: the step runner the outbox's
//! migrations ([`super::migrate_with`]) and the inbox's schema both use.
//!
//! **Why.** A migration that needs `ACCESS EXCLUSIVE` on a hot table (an `ALTER TABLE` of the
//! outbox) waits behind every open transaction that touched the table, and while it waits every
//! new `INSERT` queues behind *it*: one slow business transaction and the application stops
//! writing. So each statement of a migration waits at most [`MigrateSettings::lock_timeout`];
//! then its transaction rolls back, the queue behind it drains, and the step is tried again after
//! a pause with jitter, until [`MigrateSettings::deadline`]. While a step waits, the run asks
//! PostgreSQL who holds it up (`pg_blocking_pids`, `pg_stat_activity`: pid, login,
//! application_name, state, the transaction's age; never the query text, which may hold a
//! payload), logs it at each retry and names it when it gives up ([`Error::MigrationBlocked`]).
//!
//! **Each migration in its own transaction** (its `SET LOCAL` timeouts first): a failure rolls back
//! that migration alone, the ones before it stay applied and recorded, and a rerun goes on from
//! there. A migration whose first line is `-- no-transaction` (an index built `CONCURRENTLY`,
//! which PostgreSQL refuses inside a transaction) runs statement by statement on the session with
//! the same timeouts, and must be safe to run again from any statement (e.g. `DROP INDEX
//! CONCURRENTLY IF EXISTS` before `CREATE INDEX CONCURRENTLY`); it is recorded once all of it ran.
//!
//! **The run's lock** ([`RunLock`]) is held from the first migration to the last, so two
//! `migrate` runs never interleave: an advisory lock taken in a transaction of its own, on a
//! connection of its own, left open (idle, holding no snapshot and no table lock) until the run
//! ends. A transaction-scoped lock rather than a session lock: behind a transaction-mode pooler
//! a session lock could stay on a server connection another client then gets.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

use sqlx::postgres::PgConnectOptions;
use sqlx::{Connection, PgConnection};

use crate::error::{DbContext, Error, Result};

/// How migrations take their locks and how long they may wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MigrateSettings {
    /// How long one statement of a migration waits for a lock before its attempt rolls back:
    /// the longest any write queued behind the migration waits.
    pub lock_timeout: Duration,
    /// How long one statement of a migration may run (an index build, a validation).
    pub statement_timeout: Duration,
    /// How long a migration keeps retrying while others hold its locks (and the run waits for
    /// another run's lock) before it gives up, naming who blocks it.
    pub deadline: Duration,
}

impl Default for MigrateSettings {
    fn default() -> Self {
        Self {
            lock_timeout: Duration::from_secs(3),
            statement_timeout: Duration::from_secs(15 * 60),
            deadline: Duration::from_secs(5 * 60),
        }
    }
}

/// A session that holds up a migration, as `pg_stat_activity` shows it to the migrating role
/// (state and transaction age need `pg_read_all_stats` for another login's sessions).
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct Blocker {
    /// Its backend pid (`pg_terminate_backend(pid)` ends it).
    pub pid: i32,
    /// Its login.
    pub user: Option<String>,
    /// Its `application_name`.
    pub application_name: Option<String>,
    /// `active`, `idle in transaction`, … (`None` when the role may not see it).
    pub state: Option<String>,
    /// How long its transaction has been open, in seconds.
    pub transaction_seconds: Option<f64>,
}

impl std::fmt::Display for Blocker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "pid {}", self.pid)?;
        let mut parts = Vec::new();
        match self.application_name.as_deref() {
            Some(a) if !a.is_empty() => parts.push(format!("application_name {a:?}")),
            _ => parts.push("no application_name".to_owned()),
        }
        if let Some(u) = &self.user {
            parts.push(format!("user {u}"));
        }
        match &self.state {
            Some(s) => parts.push(s.clone()),
            None => parts.push("state hidden from this role (grant it pg_read_all_stats)".into()),
        }
        if let Some(t) = self.transaction_seconds {
            parts.push(format!("transaction open {t:.1} s"));
        }
        write!(f, " ({})", parts.join(", "))
    }
}

/// Who is named in messages: each blocker, or that none was seen.
pub fn describe(blockers: &[Blocker]) -> String {
    if blockers.is_empty() {
        "a session that ended before it could be named".to_owned()
    } else {
        blockers
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; ")
    }
}

/// The run's lock: an advisory lock held in an open transaction on a connection of its own, and
/// that connection for asking who blocks a migration.
pub struct RunLock {
    conn: PgConnection,
}

impl RunLock {
    /// Takes the lock named `name`, waiting at most the deadline for another run to end.
    pub async fn take(
        options: &PgConnectOptions,
        name: &'static str,
        settings: &MigrateSettings,
    ) -> Result<Self> {
        let mut conn = PgConnection::connect_with(options)
            .await
            .context("connecting to hold the migration lock")?;
        sqlx::raw_sql(&format!(
            "BEGIN; SET LOCAL idle_in_transaction_session_timeout = 0; \
             SET LOCAL lock_timeout = '{}ms'",
            settings.deadline.as_millis().max(1)
        ))
        .execute(&mut conn)
        .await
        .context("starting the migration lock's transaction")?;
        let started = Instant::now();
        let taken = sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended($1, 0))")
            .bind(name)
            .execute(&mut conn)
            .await;
        match taken {
            Ok(_) => Ok(Self { conn }),
            Err(e) if is_lock_timeout(&e) => {
                let _ = sqlx::raw_sql("ROLLBACK").execute(&mut conn).await;
                let holders: Vec<Blocker> = sqlx::query_as(HOLDERS_SQL)
                    .bind(name)
                    .fetch_all(&mut conn)
                    .await
                    .unwrap_or_default();
                Err(Error::MigrationBlocked {
                    version: 0,
                    description: format!(
                        "the migration lock {name:?}: another migrate run holds it"
                    ),
                    lock_timeout: settings.deadline,
                    attempts: 1,
                    waited: started.elapsed(),
                    blockers: describe(&holders),
                })
            }
            Err(source) => Err(Error::Database {
                context: "taking the migration lock",
                source,
            }),
        }
    }

    /// Who holds up the session `pid` right now (empty when nothing does).
    async fn blockers(&mut self, pid: i32) -> Result<Vec<Blocker>> {
        sqlx::query_as(BLOCKERS_SQL)
            .bind(pid)
            .fetch_all(&mut self.conn)
            .await
            .context("asking pg_stat_activity who blocks the migration")
    }

    /// Ends the lock's transaction (the lock goes with it) and the connection.
    pub async fn release(mut self) {
        let _ = sqlx::raw_sql("COMMIT").execute(&mut self.conn).await;
        let _ = self.conn.close().await;
    }
}

/// The sessions `pg_blocking_pids` names for a pid.
const BLOCKERS_SQL: &str = "SELECT a.pid, a.usename::text AS user, a.application_name, a.state,
        extract(epoch FROM clock_timestamp() - a.xact_start)::float8 AS transaction_seconds
 FROM unnest(pg_blocking_pids($1)) AS b(pid)
 JOIN pg_stat_activity a ON a.pid = b.pid
 ORDER BY a.xact_start NULLS LAST";

/// The sessions holding the advisory lock named $1 (bigint keys: classid high, objid low).
const HOLDERS_SQL: &str = "SELECT a.pid, a.usename::text AS user, a.application_name, a.state,
        extract(epoch FROM clock_timestamp() - a.xact_start)::float8 AS transaction_seconds
 FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
 WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
   AND ((l.classid::int8 << 32) | l.objid::int8) = hashtextextended($1, 0)";

/// One migration for [`apply_step`].
pub struct Step<'a> {
    /// Its version (the inbox's steps: their position).
    pub version: i64,
    /// Its name, for messages.
    pub description: &'a str,
    /// Its text.
    pub sql: &'a str,
    /// Runs outside a transaction (`-- no-transaction`), statement by statement.
    pub no_tx: bool,
}

/// Records a step as applied, in the step's transaction (how long it ran is given).
pub type Record = dyn for<'c> Fn(
        &'c mut PgConnection,
        Duration,
    )
        -> Pin<Box<dyn Future<Output = std::result::Result<(), sqlx::Error>> + Send + 'c>>
    + Send
    + Sync;

/// How a step went.
#[derive(Debug, Clone, Copy)]
pub struct Applied {
    /// Attempts, the last one successful.
    pub attempts: u32,
}

/// Applies `step` on `conn` and records it, retrying while others hold its locks (see the
/// module's documentation).
pub async fn apply_step(
    lock: &mut RunLock,
    conn: &mut PgConnection,
    settings: &MigrateSettings,
    step: &Step<'_>,
    record: &Record,
) -> Result<Applied> {
    let started = Instant::now();
    let mut attempts = 0u32;
    loop {
        attempts += 1;
        // The backend the attempt runs on (behind a transaction-mode pooler, each transaction
        // may get another one), set by the attempt once it knows.
        let pid = AtomicI32::new(0);
        let (outcome, blockers) = watch(
            lock,
            &pid,
            settings.lock_timeout,
            attempt(conn, &pid, settings, step, record),
        )
        .await;
        let err = match outcome {
            Ok(()) => return Ok(Applied { attempts }),
            Err(e) if is_lock_timeout(&e) => e,
            Err(source) => {
                if step.no_tx {
                    reset_session(conn).await;
                }
                return Err(Error::migration(step.version, step.description, source));
            }
        };
        if step.no_tx {
            reset_session(conn).await;
        }
        let waited = started.elapsed();
        let pause = retry_pause(attempts);
        if waited + pause >= settings.deadline {
            tracing::debug!(error = %err, "the last attempt's error");
            return Err(Error::MigrationBlocked {
                version: step.version,
                description: step.description.to_owned(),
                lock_timeout: settings.lock_timeout,
                attempts,
                waited,
                blockers: describe(&blockers),
            });
        }
        tracing::warn!(
            migration = step.version,
            attempt = attempts,
            blocked_by = %describe(&blockers),
            retry_in_ms = u64::try_from(pause.as_millis()).unwrap_or(u64::MAX),
            "Migration {} ({}) gave up waiting {:?} for its locks and rolled back, so the \
             application's writes queued behind it went on: blocked by {}. Trying again in \
             {:.1?} (until {:?} have passed; end that transaction to let it through).",
            step.version,
            step.description,
            settings.lock_timeout,
            describe(&blockers),
            pause,
            settings.deadline
        );
        tokio::time::sleep(pause).await;
    }
}

/// One attempt at a step.
async fn attempt(
    conn: &mut PgConnection,
    pid: &AtomicI32,
    settings: &MigrateSettings,
    step: &Step<'_>,
    record: &Record,
) -> std::result::Result<(), sqlx::Error> {
    let timeouts = |scope| timeouts(scope, settings);
    let started = Instant::now();
    if step.no_tx {
        sqlx::raw_sql(&timeouts("SESSION"))
            .execute(&mut *conn)
            .await?;
        pid.store(backend_pid(conn).await?, Ordering::Relaxed);
        for statement in statements(step.sql) {
            sqlx::raw_sql(statement).execute(&mut *conn).await?;
        }
        let mut tx = conn.begin().await?;
        record(&mut tx, started.elapsed()).await?;
        tx.commit().await?;
        reset_session(conn).await;
        return Ok(());
    }
    let mut tx = conn.begin().await?;
    sqlx::raw_sql(&timeouts("LOCAL")).execute(&mut *tx).await?;
    pid.store(backend_pid(&mut tx).await?, Ordering::Relaxed);
    sqlx::raw_sql(step.sql).execute(&mut *tx).await?;
    record(&mut tx, started.elapsed()).await?;
    tx.commit().await
}

/// The statements that set `settings`' timeouts for the transaction (`LOCAL`) or the session.
pub fn timeouts(scope: &str, settings: &MigrateSettings) -> String {
    format!(
        "SET {scope} lock_timeout = '{}ms'; SET {scope} statement_timeout = '{}ms'",
        settings.lock_timeout.as_millis().max(1),
        settings.statement_timeout.as_millis().max(1)
    )
}

async fn backend_pid(conn: &mut PgConnection) -> std::result::Result<i32, sqlx::Error> {
    sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(conn)
        .await
}

/// Puts the session's timeouts back after a no-transaction step.
async fn reset_session(conn: &mut PgConnection) {
    let _ = sqlx::raw_sql("RESET lock_timeout; RESET statement_timeout")
        .execute(conn)
        .await;
}

/// Runs `work`, asking every so often who blocks `pid`; returns its outcome and the last
/// blockers seen (those of the wait that timed out, when one did).
async fn watch<T>(
    lock: &mut RunLock,
    pid: &AtomicI32,
    lock_timeout: Duration,
    work: impl Future<Output = T>,
) -> (T, Vec<Blocker>) {
    let every = (lock_timeout / 3).clamp(Duration::from_millis(50), Duration::from_secs(1));
    let mut seen = Vec::new();
    tokio::pin!(work);
    loop {
        tokio::select! {
            out = &mut work => return (out, seen),
            () = tokio::time::sleep(every) => {
                let pid = pid.load(Ordering::Relaxed);
                if pid != 0
                    && let Ok(now) = lock.blockers(pid).await
                    && !now.is_empty()
                {
                    seen = now;
                }
            }
        }
    }
}

/// The pause before attempt `attempts + 1`: 1 s doubling to 15 s, ±25 % jitter (so several runs,
/// or a run and a restarted Job, do not retry in step).
fn retry_pause(attempts: u32) -> Duration {
    let base = Duration::from_secs(1)
        .saturating_mul(1 << attempts.saturating_sub(1).min(4))
        .min(Duration::from_secs(15));
    base.mul_f64(0.75 + fastrand::f64() * 0.5)
}

/// Whether a statement gave up waiting for a lock (`lock_not_available`).
fn is_lock_timeout(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if db.code().as_deref() == Some("55P03"))
}

/// The statements of a no-transaction migration: each ends with `;` at the end of a line
/// (comment-only and empty pieces are dropped). Dollar-quoted bodies are not supported there.
pub(crate) fn statements(sql: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut start = 0;
    for (i, _) in sql.match_indices(";\n") {
        out.push(&sql[start..=i]);
        start = i + 2;
    }
    out.push(&sql[start..]);
    out.into_iter()
        .filter(|s| {
            s.lines()
                .map(str::trim)
                .any(|l| !l.is_empty() && !l.starts_with("--") && l != ";")
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_no_transaction_migration_splits_at_line_ends() {
        let sql = "-- no-transaction\n-- why\nDROP INDEX CONCURRENTLY IF EXISTS a;\n\
                   CREATE INDEX CONCURRENTLY IF NOT EXISTS a\n    ON t (x);\n-- done\n";
        let parts = statements(sql);
        assert_eq!(parts.len(), 2, "{parts:?}");
        assert!(
            parts[0]
                .trim_end()
                .ends_with("DROP INDEX CONCURRENTLY IF EXISTS a;")
        );
        assert!(parts[1].contains("ON t (x);"));
    }

    #[test]
    fn retries_back_off_to_fifteen_seconds_with_jitter() {
        for attempts in 1..20 {
            let p = retry_pause(attempts);
            assert!(p >= Duration::from_millis(750) && p <= Duration::from_millis(18_750));
        }
        assert!(retry_pause(1) <= Duration::from_millis(1250));
        assert!(retry_pause(10) >= Duration::from_millis(11_250));
    }

    #[test]
    fn a_blocker_is_named_without_its_query() {
        let b = Blocker {
            pid: 4711,
            user: Some("app".into()),
            application_name: Some("billing".into()),
            state: Some("idle in transaction".into()),
            transaction_seconds: Some(14.94),
        };
        assert_eq!(
            b.to_string(),
            "pid 4711 (application_name \"billing\", user app, idle in transaction, \
             transaction open 14.9 s)"
        );
        assert_eq!(
            describe(&[]),
            "a session that ended before it could be named"
        );
    }
}
