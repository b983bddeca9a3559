//! The unkeyed half of the probe behind the claims' floors (the parent module's doc): the oldest
//! unkeyed row below the floor that no claim holds. (The keyed half walks the keys with
//! [`super::walk_keys`] and no floor.) Under a held snapshot this is the walk over dead index
//! entries the claims no longer make, so it runs seldom.

use chrono::{DateTime, Utc};
use sqlx::PgConnection;

use crate::error::{DbContext, Result};

/// The due time of the oldest due unkeyed row below `floor` that no claim holds (a claim's
/// rows below the floor are its own business), of `topics` when given, not paused and not in
/// `excluded` (the topics the claims leave alone now: their rows wait below the floor by design).
/// It locks that row: call it in a claim transaction and roll back.
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn unkeyed_below(
    tx: &mut PgConnection,
    floor: DateTime<Utc>,
    now: DateTime<Utc>,
    topics: Option<&[String]>,
    excluded: &[String],
) -> Result<Option<DateTime<Utc>>> {
    sqlx::query_scalar(
        "SELECT next_attempt_at FROM pubsub_outbox
         WHERE published_at IS NULL AND ordering_key IS NULL
           AND next_attempt_at < $1 AND next_attempt_at <= $2
           AND ($3::text[] IS NULL OR topic = ANY($3))
           AND NOT (topic = ANY(ARRAY(SELECT p.topic FROM pubsub_outbox_paused_topic p)))
           AND NOT (topic = ANY($4))
         ORDER BY next_attempt_at, id
         LIMIT 1
         FOR UPDATE SKIP LOCKED",
    )
    .persistent(crate::store::named_statements())
    .bind(floor)
    .bind(now)
    .bind(topics)
    .bind(excluded)
    .fetch_optional(&mut *tx)
    .await
    .context("probing for unkeyed rows below the claims' floor")
}
