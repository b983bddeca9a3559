//! `pubsub_outbox_held_topic`: topics Pub/Sub refuses as a whole (the dispatcher's
//! `hold.rs` says when and why). A batch whose requests to a topic were refused so writes
//! [`hold`] in its settle transaction, beside its rows released untouched; every replica skips
//! the held topics' rows; one replica at a time takes the next probe ([`take_probe`], which
//! doubles the interval up to a bound), publishes the topic's head message, and an accepted
//! probe [`release`]s the topic in its own settle transaction.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgConnection;

use crate::error::{DbContext, Result};

/// A topic a batch saw refused as a whole.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hold {
    /// Full topic name.
    pub topic: String,
    /// The gRPC code's name (`PERMISSION_DENIED`).
    pub code: String,
    /// What Pub/Sub (or the proxy) said.
    pub message: String,
}

/// A held topic as `status` and the console show it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct HeldTopic {
    /// Full topic name.
    pub topic: String,
    /// The last refusal's code.
    pub code: String,
    /// The last refusal's message.
    pub message: String,
    /// Since when the topic is held.
    pub held_since: DateTime<Utc>,
    /// When a request to it was last refused.
    pub last_refused_at: DateTime<Utc>,
    /// Requests refused since it is held (batches and probes).
    pub refusals: i64,
    /// Probes sent.
    pub probes: i64,
    /// When the next probe is due.
    pub next_probe_at: DateTime<Utc>,
}

/// Holds the topics of `holds` (each once), or records one more refusal of a topic held already
/// (its first code stays in `held_since`, the message is the latest). The first probe is due
/// `first_probe` after `now`. Returns the topics this call started to hold.
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn hold(
    conn: &mut PgConnection,
    holds: &[Hold],
    now: DateTime<Utc>,
    first_probe: std::time::Duration,
) -> Result<Vec<String>> {
    if holds.is_empty() {
        return Ok(Vec::new());
    }
    let topics: Vec<&str> = holds.iter().map(|h| h.topic.as_str()).collect();
    let codes: Vec<&str> = holds.iter().map(|h| h.code.as_str()).collect();
    let messages: Vec<String> = holds.iter().map(|h| bounded(&h.message)).collect();
    let first_ms = i32::try_from(first_probe.as_millis())
        .unwrap_or(i32::MAX)
        .max(1);
    // `xmax = 0` tells an inserted row from an updated one.
    sqlx::query_scalar(
        "INSERT INTO pubsub_outbox_held_topic AS h
             (topic, code, message, held_since, last_refused_at, next_probe_at, probe_interval_ms)
         SELECT t, c, m, $4, $4, $4 + make_interval(secs => $5 / 1000.0), $5
         FROM UNNEST($1::text[], $2::text[], $3::text[]) AS u(t, c, m)
         ON CONFLICT (topic) DO UPDATE SET
             code = EXCLUDED.code, message = EXCLUDED.message,
             last_refused_at = EXCLUDED.last_refused_at, refusals = h.refusals + 1
         RETURNING CASE WHEN xmax = 0 THEN topic END",
    )
    .persistent(crate::store::named_statements())
    .bind(&topics)
    .bind(&codes)
    .bind(&messages)
    .bind(now)
    .bind(first_ms)
    .fetch_all(&mut *conn)
    .await
    .map(|started: Vec<Option<String>>| started.into_iter().flatten().collect())
    .context("holding topics in pubsub_outbox_held_topic")
}

/// Pub/Sub's messages are short; a proxy's may carry a whole page. Kept to 1,000 characters.
fn bounded(message: &str) -> String {
    message.chars().take(1000).collect()
}

/// Every held topic, oldest hold first.
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn list(conn: &mut PgConnection) -> Result<Vec<HeldTopic>> {
    sqlx::query_as(
        "SELECT topic, code, message, held_since, last_refused_at, refusals, probes, next_probe_at
         FROM pubsub_outbox_held_topic ORDER BY held_since, topic",
    )
    .persistent(crate::store::named_statements())
    .fetch_all(&mut *conn)
    .await
    .context("listing pubsub_outbox_held_topic")
}

/// The held topics' names (what the claims leave alone, and the gauges leave out of the
/// claimable age).
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn topics(conn: &mut PgConnection) -> Result<Vec<String>> {
    sqlx::query_scalar("SELECT topic FROM pubsub_outbox_held_topic")
        .persistent(crate::store::named_statements())
        .fetch_all(&mut *conn)
        .await
        .context("reading the held topics")
}

/// Takes `topic`'s probe when it is due at `now`: the next one is then due after the current
/// interval, which doubles up to `max_interval`. Returns whether this caller probes (another
/// replica that took it first, or a release, leave nothing to take).
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn take_probe(
    conn: &mut PgConnection,
    topic: &str,
    now: DateTime<Utc>,
    max_interval: std::time::Duration,
) -> Result<bool> {
    let max_ms = i32::try_from(max_interval.as_millis())
        .unwrap_or(i32::MAX)
        .max(1);
    let taken = sqlx::query(
        "UPDATE pubsub_outbox_held_topic
         SET next_probe_at = $2 + make_interval(secs => probe_interval_ms / 1000.0),
             probe_interval_ms = LEAST(probe_interval_ms * 2, $3), probes = probes + 1
         WHERE topic = $1 AND next_probe_at <= $2",
    )
    .persistent(crate::store::named_statements())
    .bind(topic)
    .bind(now)
    .bind(max_ms)
    .execute(&mut *conn)
    .await
    .context("taking a held topic's probe in pubsub_outbox_held_topic")?;
    Ok(taken.rows_affected() == 1)
}

/// Releases `topics` (Pub/Sub accepted a probe); returns the ones that were held. Their rows sat
/// below where the claims start while they were skipped, so the claim epoch advances with the
/// release and dispatchers drop their floors (`super::claim`).
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn release(conn: &mut PgConnection, topics: &[String]) -> Result<Vec<String>> {
    if topics.is_empty() {
        return Ok(Vec::new());
    }
    sqlx::query_scalar(
        "WITH released AS (
             DELETE FROM pubsub_outbox_held_topic WHERE topic = ANY($1) RETURNING topic
         ), epoch AS (
             UPDATE pubsub_outbox_claim_epoch SET epoch = epoch + 1
             WHERE EXISTS (SELECT 1 FROM released)
         )
         SELECT topic FROM released ORDER BY topic",
    )
    .persistent(crate::store::named_statements())
    .bind(topics)
    .fetch_all(&mut *conn)
    .await
    .context("releasing held topics in pubsub_outbox_held_topic")
}

/// Releases `topic` if no unpublished row of it is left (an operator cancelled them, say):
/// there is nothing to probe with, and nothing waits. Returns whether it did.
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn release_if_empty(conn: &mut PgConnection, topic: &str) -> Result<bool> {
    let released = sqlx::query(
        "DELETE FROM pubsub_outbox_held_topic h
         WHERE h.topic = $1
           AND NOT EXISTS (SELECT 1 FROM pubsub_outbox o
                           WHERE o.topic = $1 AND o.published_at IS NULL)",
    )
    .persistent(crate::store::named_statements())
    .bind(topic)
    .execute(&mut *conn)
    .await
    .context("releasing an empty held topic in pubsub_outbox_held_topic")?;
    Ok(released.rows_affected() == 1)
}
