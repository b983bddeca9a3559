//! Where the outbox is **settled**: an id and an instant below which no row can still appear.
//! The claims' floors may rise to a settled mark and never past one (the parent module's doc,
//! "Claims start past what is published").
//!
//! Ids are allocated at INSERT and become visible at COMMIT, so a floor on ids (or on due times)
//! that follows what claims saw passes over the rows of every writer transaction still open when
//! it moved. PgQ bounds its batches by transaction snapshots for the same reason. Here the
//! bound is a [`Stamp`]: how far the id sequence had allocated and the database's clock, read
//! first, then the transactions that held a row lock mode on `pubsub_outbox` at that moment
//! (`pg_locks`: `RowExclusiveLock`, which every INSERT, UPDATE, DELETE and COPY takes before it
//! evaluates a default, and `RowShareLock`, which every claim takes). Once none of those
//! transactions is running ([`running`]), the stamp is settled:
//! - every id up to `allocated` belongs to a committed row or to none (a row's id is allocated by
//!   its INSERT while its transaction holds `RowExclusiveLock` on the table, which it keeps until
//!   it ends, so that transaction was in the stamp's list or had ended before it);
//! - every row inserted later has a due time after `at` (the column's default is
//!   `clock_timestamp()`, evaluated after the table's lock was taken), so a row due before `at`
//!   that a claim after the settlement does not see is locked by a claim, or was written with an
//!   explicit earlier due time (which the probe finds).
//!
//! Transactions that only read the outbox (a report, a backup: `AccessShareLock`) and vacuum do
//! not hold a stamp back; a writer transaction does, however long it stays open: that is the
//! point. Read with the workloads' own privileges (`pg_locks` and `pg_sequence` are readable by
//! every role; the sequence is granted to the dispatcher), through a transaction pooler too.

use chrono::{DateTime, Utc};
use sqlx::PgConnection;

use crate::error::{DbContext, Result};

/// How the outbox stood at one moment (see the module doc).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stamp {
    /// How far the id sequence had allocated (its `last_value`).
    pub allocated: i64,
    /// The database's clock then.
    pub at: DateTime<Utc>,
    /// The virtual transaction ids of the transactions that held a row lock mode on the outbox
    /// then: the stamp is settled once none of them runs.
    pub writers: Vec<String>,
    /// Whether the id sequence hands out ids one at a time (`CACHE 1`, the default). A sequence
    /// that caches ids per session may hand out an id below `allocated` later: such a stamp
    /// proves nothing, and the floors stay where they are.
    pub exact: bool,
}

/// Reads a [`Stamp`]: the sequence and the clock first, then the writers. One statement; the
/// writers' subquery depends on the first read's row, so it is evaluated after it.
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn stamp(conn: &mut PgConnection) -> Result<Stamp> {
    #[derive(sqlx::FromRow)]
    struct Row {
        allocated: i64,
        at: DateTime<Utc>,
        writers: Vec<String>,
        exact: bool,
    }
    let row: Row = sqlx::query_as(
        "WITH first AS MATERIALIZED (
             SELECT s.last_value AS allocated, clock_timestamp() AS at
             FROM pubsub_outbox_id_seq s)
         SELECT f.allocated, f.at,
                ARRAY(SELECT DISTINCT l.virtualtransaction FROM pg_locks l
                      WHERE l.locktype = 'relation'
                        AND l.database = (SELECT d.oid FROM pg_database d
                                          WHERE d.datname = current_database())
                        AND l.relation = 'pubsub_outbox'::regclass
                        AND l.mode IN ('RowExclusiveLock', 'RowShareLock')
                        AND l.virtualtransaction IS NOT NULL
                        AND f.at IS NOT NULL) AS writers,
                coalesce((SELECT q.seqcache = 1 FROM pg_sequence q
                          WHERE q.seqrelid = 'pubsub_outbox_id_seq'::regclass), false) AS exact
         FROM first f",
    )
    .persistent(crate::store::named_statements())
    .fetch_one(&mut *conn)
    .await
    .context("reading where the outbox is settled (the id sequence and pg_locks)")?;
    Ok(Stamp {
        allocated: row.allocated,
        at: row.at,
        writers: row.writers,
        exact: row.exact,
    })
}

/// Which of `writers` (virtual transaction ids from [`stamp`]) are still running: a running
/// transaction holds at least the lock on its own virtual transaction id, a prepared one (`-1/…`)
/// its table locks, until it ends.
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn running(conn: &mut PgConnection, writers: &[String]) -> Result<Vec<String>> {
    if writers.is_empty() {
        return Ok(Vec::new());
    }
    sqlx::query_scalar(
        "SELECT DISTINCT l.virtualtransaction FROM pg_locks l
         WHERE l.virtualtransaction = ANY($1)",
    )
    .persistent(crate::store::named_statements())
    .bind(writers)
    .fetch_all(&mut *conn)
    .await
    .context("reading which writer transactions still run (pg_locks)")
}
