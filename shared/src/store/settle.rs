//! Settling a claimed batch: the one store call that writes what the dispatcher decided, inside
//! the claiming transaction (so the row locks, the writes and the commit are one unit).

use chrono::{DateTime, Utc};
use sqlx::PgConnection;

use crate::error::Result;
use crate::store::dead_letter::{self, Failure};
use crate::store::held_topic::{self, Hold};
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
    /// Topics Pub/Sub refused as a whole: held (their rows are among `released`).
    pub holds: Vec<Hold>,
    /// Held topics whose probe Pub/Sub accepted: released.
    pub unheld: Vec<String>,
}

/// What [`settle`] changed beyond the rows: the topics it started to hold and those it released.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Settled {
    /// Topics held from now on (not held before).
    pub held: Vec<String>,
    /// Held topics released.
    pub unheld: Vec<String>,
    /// Each dead-lettered row's (outbox id, dead letter id).
    pub dead_letter_ids: Vec<(i64, i64)>,
}

/// Writes `s`: published rows are deleted (or marked, when `retain_published`), retries get
/// their schedule, dead letters move out of the outbox, refused topics are held (their first
/// probe due `first_probe` from `now`) and accepted ones released.
#[tracing::instrument(skip_all, fields(db.system = "postgresql", batch.published = s.published.len(),
    batch.retried = s.retries.len(), batch.dead_lettered = s.dead_letters.len()), err(level = "debug"))]
pub async fn settle(
    conn: &mut PgConnection,
    s: &Settlement,
    retain_published: bool,
    now: DateTime<Utc>,
    first_probe: std::time::Duration,
) -> Result<Settled> {
    if retain_published {
        outbox::mark_published(conn, &s.published, now).await?;
    } else {
        let ids: Vec<i64> = s.published.iter().map(|(id, _)| *id).collect();
        outbox::delete_published(conn, &ids).await?;
    }
    outbox::schedule_retries(conn, &s.retries).await?;
    let dead_letter_ids = dead_letter::move_from_outbox(conn, &s.dead_letters, now).await?;
    Ok(Settled {
        dead_letter_ids,
        held: held_topic::hold(conn, &s.holds, now, first_probe).await?,
        unheld: held_topic::release(conn, &s.unheld).await?,
    })
}
