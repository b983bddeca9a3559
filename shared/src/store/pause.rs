//! `pubsub_outbox_paused_topic`: topics whose rows are not claimed until they are resumed. The
//! dispatcher reads [`topics`] at most once per poll interval and passes them to the claims
//! (`super::claim`), which skip them; rows keep accumulating and nothing is charged.

use chrono::{DateTime, Utc};
use sqlx::PgConnection;

use crate::error::{DbContext, Result};

/// A paused topic.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow, serde::Serialize)]
pub struct PausedTopic {
    /// Full topic name.
    pub topic: String,
    /// Since when.
    pub paused_at: DateTime<Utc>,
    /// Who paused it.
    pub paused_by: String,
    /// Why.
    pub reason: String,
}

/// Pauses `topic`; returns false if it was paused already (nothing changes then).
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn pause(
    conn: &mut PgConnection,
    topic: &str,
    actor: Option<&str>,
    reason: &str,
) -> Result<bool> {
    // No declared actor: the database login (a container often has no OS user).
    let r = sqlx::query(
        "INSERT INTO pubsub_outbox_paused_topic (topic, paused_by, reason)
         VALUES ($1, COALESCE($2, session_user), $3)
         ON CONFLICT (topic) DO NOTHING",
    )
    .persistent(crate::store::named_statements())
    .bind(topic)
    .bind(actor)
    .bind(reason)
    .execute(&mut *conn)
    .await
    .context("pausing a topic in pubsub_outbox_paused_topic")?;
    Ok(r.rows_affected() == 1)
}

/// Resumes `topic`; returns false if it was not paused.
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn resume(conn: &mut PgConnection, topic: &str) -> Result<bool> {
    // The topic's unkeyed rows become claimable below where the claims start: the claim epoch
    // advances with the resume, so dispatchers drop their floors (store::claim).
    let resumed: i64 = sqlx::query_scalar(
        "WITH resumed AS (
             DELETE FROM pubsub_outbox_paused_topic WHERE topic = $1 RETURNING topic
         ), epoch AS (
             UPDATE pubsub_outbox_claim_epoch SET epoch = epoch + 1
             WHERE EXISTS (SELECT 1 FROM resumed)
         )
         SELECT count(*) FROM resumed",
    )
    .persistent(crate::store::named_statements())
    .bind(topic)
    .fetch_one(&mut *conn)
    .await
    .context("resuming a topic in pubsub_outbox_paused_topic")?;
    Ok(resumed == 1)
}

/// Every paused topic.
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn list(conn: &mut PgConnection) -> Result<Vec<PausedTopic>> {
    sqlx::query_as(
        "SELECT topic, paused_at, paused_by, reason FROM pubsub_outbox_paused_topic ORDER BY topic",
    )
    .persistent(crate::store::named_statements())
    .fetch_all(&mut *conn)
    .await
    .context("listing pubsub_outbox_paused_topic")
}

/// The names of the paused topics (what the claims skip).
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn topics(conn: &mut PgConnection) -> Result<Vec<String>> {
    sqlx::query_scalar("SELECT topic FROM pubsub_outbox_paused_topic")
        .persistent(crate::store::named_statements())
        .fetch_all(&mut *conn)
        .await
        .context("reading the paused topics")
}
