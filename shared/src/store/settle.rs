//! Settling a claimed batch: the one store call that writes what the dispatcher decided, inside
//! the claiming transaction (so the row locks, the writes and the commit are one unit).

use chrono::{DateTime, Utc};
use sqlx::PgConnection;

use crate::error::Result;
use crate::store::dead_letter::{self, Failure};
use crate::store::outbox::{self, Retry};

/// What one batch writes. Rows in none of the lists stay as they were (released untouched: their
/// locks end with the transaction).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Settlement {
    /// Published rows with their Pub/Sub message ids.
    pub published: Vec<(i64, String)>,
    /// Rows to try again later.
    pub retries: Vec<Retry>,
    /// Rows to move to the dead-letter table.
    pub dead_letters: Vec<Failure>,
    /// Rows released untouched (for the record: nothing is written for them).
    pub released: Vec<i64>,
}

/// Writes `s`: published rows are deleted (or marked, when `retain_published`), retries get
/// their schedule, dead letters move out of the outbox.
#[tracing::instrument(skip_all, fields(db.system = "postgresql", batch.published = s.published.len(),
    batch.retried = s.retries.len(), batch.dead_lettered = s.dead_letters.len()), err(level = "debug"))]
pub async fn settle(
    conn: &mut PgConnection,
    s: &Settlement,
    retain_published: bool,
    now: DateTime<Utc>,
) -> Result<()> {
    if retain_published {
        outbox::mark_published(conn, &s.published, now).await?;
    } else {
        let ids: Vec<i64> = s.published.iter().map(|(id, _)| *id).collect();
        outbox::delete_published(conn, &ids).await?;
    }
    outbox::schedule_retries(conn, &s.retries).await?;
    dead_letter::move_from_outbox(conn, &s.dead_letters, now).await?;
    Ok(())
}
