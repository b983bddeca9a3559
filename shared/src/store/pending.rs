//! The operator's verbs for messages not yet sent (`dispatcher pending …`): list them, cancel
//! them, make the ones waiting for a retry due now.
//!
//! - **Cancel** moves unpublished rows to the dead-letter table as `cancelled`, with the person's
//!   reason: inspectable and replayable like any dead letter, but a cancelled message blocks
//!   nothing (it was a person's decision, not a failure): the later messages of its key go on.
//! - **Retry now** makes rows that wait for a retry due at once, their attempt count unchanged.
//!
//! Both take only rows no dispatcher holds: a row locked by a claim is being published now, and is
//! reported as in flight instead of waited for.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgConnection;

use crate::error::{DbContext, Result};

/// Which unpublished rows an operator means. Every field narrows the selection; an empty one
/// selects everything (callers refuse that).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Selection {
    /// These outbox ids only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ids: Option<Vec<i64>>,
    /// Full topic name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub topic: Option<String>,
    /// This ordering key.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ordering_key: Option<String>,
    /// Dedupe keys starting with this.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dedupe_prefix: Option<String>,
    /// Enqueued before this instant.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub created_before: Option<DateTime<Utc>>,
    /// Enqueued after this instant.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub created_after: Option<DateTime<Utc>>,
    /// Text the last error contains (case-insensitive).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error_contains: Option<String>,
    /// Only rows waiting for a retry (due after this instant).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub waiting_at: Option<DateTime<Utc>>,
}

impl Selection {
    /// Whether nothing narrows it.
    pub fn is_empty(&self) -> bool {
        Self {
            waiting_at: None,
            ..self.clone()
        } == Self::default()
    }
}

/// An unpublished row as operators see it (no payload, its size).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct Pending {
    /// Outbox id.
    pub id: i64,
    /// Full topic name.
    pub topic: String,
    /// Ordering key.
    pub ordering_key: Option<String>,
    /// Dedupe key.
    pub dedupe_key: String,
    /// Payload size in bytes.
    pub payload_bytes: i32,
    /// When it was enqueued.
    pub created_at: DateTime<Utc>,
    /// Attempts charged so far.
    pub attempts: i32,
    /// When it is due.
    pub next_attempt_at: DateTime<Utc>,
    /// When it can go: its own next attempt, or later when an earlier message of its key waits
    /// for a retry (a key goes in order: it goes after that one).
    pub due_at: DateTime<Utc>,
    /// Why the last attempt failed.
    pub last_error: Option<String>,
}

/// Unpublished rows matching `s`, by id, at most `limit`, after id `after_id` when given (the
/// next page).
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn select(
    conn: &mut PgConnection,
    s: &Selection,
    limit: i64,
    after_id: Option<i64>,
) -> Result<Vec<Pending>> {
    sqlx::query_as(
        "SELECT id, topic, ordering_key, dedupe_key, length(payload) AS payload_bytes, created_at,
                attempts, next_attempt_at, last_error,
                CASE WHEN ordering_key IS NULL THEN next_attempt_at
                     ELSE GREATEST(next_attempt_at,
                                   (SELECT max(h.next_attempt_at) FROM pubsub_outbox h
                                    WHERE h.topic = o.topic AND h.ordering_key = o.ordering_key
                                      AND h.published_at IS NULL AND h.id < o.id))
                END AS due_at
         FROM pubsub_outbox o
         WHERE published_at IS NULL
           AND ($1::bigint[] IS NULL OR id = ANY($1))
           AND ($2::text IS NULL OR topic = $2)
           AND ($3::text IS NULL OR ordering_key = $3)
           AND ($4::text IS NULL OR starts_with(dedupe_key, $4))
           AND ($5::timestamptz IS NULL OR created_at < $5)
           AND ($6::timestamptz IS NULL OR created_at > $6)
           AND ($7::text IS NULL OR strpos(lower(last_error), lower($7)) > 0)
           AND ($8::timestamptz IS NULL OR next_attempt_at > $8)
           AND ($9::bigint IS NULL OR id > $9)
         ORDER BY id
         LIMIT $10",
    )
    .persistent(crate::store::named_statements())
    .bind(&s.ids)
    .bind(&s.topic)
    .bind(&s.ordering_key)
    .bind(&s.dedupe_prefix)
    .bind(s.created_before)
    .bind(s.created_after)
    .bind(&s.error_contains)
    .bind(s.waiting_at)
    .bind(after_id)
    .bind(limit)
    .fetch_all(&mut *conn)
    .await
    .context("selecting unpublished rows from pubsub_outbox")
}

/// What [`cancel`] or [`retry_now`] did with the ids it was given.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Changed {
    /// Changed.
    pub ids: Vec<i64>,
    /// Locked by a dispatcher: being published right now (left alone).
    pub in_flight: Vec<i64>,
    /// Cancel: a dead letter with the same dedupe key exists (a replay would collide): left.
    pub dead_letter_exists: Vec<i64>,
    /// Published or gone since they were selected, or (retry now) due already.
    pub unchanged: Vec<i64>,
    /// Cancel: (outbox id, the dead letter's id) of each message cancelled.
    pub dead_letters: Vec<(i64, i64)>,
}

impl Changed {
    fn sort(mut self, ids: &[i64]) -> Self {
        let known: Vec<i64> = self
            .ids
            .iter()
            .chain(&self.in_flight)
            .chain(&self.dead_letter_exists)
            .copied()
            .collect();
        self.unchanged = ids
            .iter()
            .copied()
            .filter(|id| !known.contains(id))
            .collect();
        self
    }
}

/// Moves the unpublished rows `ids` to the dead-letter table as `cancelled` at `now`, with
/// `error` (who and why) as their last error. The later messages of their keys go on.
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn cancel(
    conn: &mut PgConnection,
    ids: &[i64],
    error: &str,
    now: DateTime<Utc>,
) -> Result<Changed> {
    // `picked` skips the rows a claim holds (a dispatcher publishing them now) and returns each
    // row it locked with whether a dead letter already holds its dedupe key (moving it would
    // overwrite that entry).
    let rows: Vec<(i64, String, Option<i64>)> = sqlx::query_as(
        "WITH picked AS MATERIALIZED (
             SELECT o.id, EXISTS (SELECT 1 FROM pubsub_outbox_dead_letter d
                                  WHERE d.dedupe_key = o.dedupe_key) AS collides
             FROM pubsub_outbox o
             WHERE o.id = ANY($1) AND o.published_at IS NULL
             FOR UPDATE OF o SKIP LOCKED
         ), moved AS (
             DELETE FROM pubsub_outbox o USING picked p
             WHERE o.id = p.id AND NOT p.collides
             RETURNING o.id, o.topic, o.ordering_key, o.dedupe_key, o.payload, o.attributes,
                       o.created_at, o.attempts, o.traceparent, o.tracestate
         ), inserted AS (
             INSERT INTO pubsub_outbox_dead_letter
                 (outbox_id, topic, ordering_key, dedupe_key, payload, attributes, created_at,
                  failed_at, attempts, error_kind, last_error, source, traceparent, tracestate)
             SELECT id, topic, ordering_key, dedupe_key, payload, attributes, created_at, $2,
                    attempts, 'cancelled', $3, 'operator', traceparent, tracestate
             FROM moved
             RETURNING outbox_id, id
         )
         SELECT outbox_id, 'cancelled', id FROM inserted
         UNION ALL SELECT id, 'collides', NULL::bigint FROM picked WHERE collides",
    )
    .persistent(crate::store::named_statements())
    .bind(ids)
    .bind(now)
    .bind(error)
    .fetch_all(&mut *conn)
    .await
    .context("cancelling rows of pubsub_outbox into pubsub_outbox_dead_letter")?;
    let in_flight = locked(conn, ids).await?;
    let mut c = Changed {
        in_flight,
        ..Changed::default()
    };
    for (id, what, dead_letter) in rows {
        match (what.as_str(), dead_letter) {
            ("cancelled", Some(dead_letter)) => {
                c.ids.push(id);
                c.dead_letters.push((id, dead_letter));
            }
            _ => c.dead_letter_exists.push(id),
        }
    }
    c.ids.sort_unstable();
    c.dead_letters.sort_unstable();
    Ok(c.sort(ids))
}

/// Makes the unpublished rows `ids` that wait for a retry due at `now`, their attempts unchanged.
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn retry_now(
    conn: &mut PgConnection,
    ids: &[i64],
    now: DateTime<Utc>,
) -> Result<Changed> {
    let mut done: Vec<i64> = sqlx::query_scalar(
        "WITH picked AS MATERIALIZED (
             SELECT id FROM pubsub_outbox
             WHERE id = ANY($1) AND published_at IS NULL AND next_attempt_at > $2
             FOR UPDATE SKIP LOCKED
         )
         UPDATE pubsub_outbox o SET next_attempt_at = $2
         FROM picked p WHERE o.id = p.id
         RETURNING o.id",
    )
    .persistent(crate::store::named_statements())
    .bind(ids)
    .bind(now)
    .fetch_all(&mut *conn)
    .await
    .context("making waiting rows of pubsub_outbox due now")?;
    done.sort_unstable();
    let in_flight = locked(conn, ids).await?;
    Ok(Changed {
        ids: done,
        in_flight,
        ..Changed::default()
    }
    .sort(ids))
}

/// Which of `ids` another transaction holds locked (a dispatcher's claim).
async fn locked(conn: &mut PgConnection, ids: &[i64]) -> Result<Vec<i64>> {
    // A row this transaction changed is not locked by another; one it could not lock is.
    sqlx::query_scalar(
        "SELECT o.id FROM pubsub_outbox o
         WHERE o.id = ANY($1) AND o.published_at IS NULL
           AND o.id NOT IN (SELECT id FROM pubsub_outbox WHERE id = ANY($1)
                            FOR UPDATE SKIP LOCKED)
         ORDER BY o.id",
    )
    .persistent(crate::store::named_statements())
    .bind(ids)
    .fetch_all(&mut *conn)
    .await
    .context("finding rows a dispatcher holds")
}

/// What an operator's change leaves of an ordering key: whether a dead letter still blocks it,
/// and how many of its messages wait in the outbox (what goes at once when it is not blocked).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct KeyAfter {
    /// Full topic name.
    pub topic: String,
    /// The key.
    pub ordering_key: String,
    /// A dead letter (not cancelled) still blocks it.
    pub blocked: bool,
    /// Unpublished messages of the key.
    pub waiting: i64,
}

/// The state of `keys` (topic, ordering key) now, in the change's own transaction: a dry run
/// reports exactly what the change would leave. `skip_topics` never block.
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn keys_after(
    conn: &mut PgConnection,
    keys: &[(String, String)],
    skip_topics: &[String],
) -> Result<Vec<KeyAfter>> {
    if keys.is_empty() {
        return Ok(Vec::new());
    }
    let topics: Vec<&str> = keys.iter().map(|(t, _)| t.as_str()).collect();
    let names: Vec<&str> = keys.iter().map(|(_, k)| k.as_str()).collect();
    sqlx::query_as(
        "SELECT k.topic, k.ordering_key,
                NOT (k.topic = ANY($3)) AND EXISTS (
                    SELECT 1 FROM pubsub_outbox_dead_letter d
                    WHERE d.topic = k.topic AND d.ordering_key = k.ordering_key
                      AND d.error_kind <> 'cancelled') AS blocked,
                (SELECT count(*) FROM pubsub_outbox o
                 WHERE o.published_at IS NULL AND o.ordering_key IS NOT NULL
                   AND o.topic = k.topic AND o.ordering_key = k.ordering_key) AS waiting
         FROM (SELECT DISTINCT t AS topic, o AS ordering_key
               FROM UNNEST($1::text[], $2::text[]) AS u(t, o)) k
         ORDER BY k.topic, k.ordering_key",
    )
    .persistent(crate::store::named_statements())
    .bind(&topics)
    .bind(&names)
    .bind(skip_topics)
    .fetch_all(&mut *conn)
    .await
    .context("reading what a change leaves of its ordering keys")
}
