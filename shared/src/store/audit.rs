//! `pubsub_outbox_audit`: every operator action (what, which rows, who, why, when), written in the
//! same transaction as the action itself.

use sqlx::PgConnection;

use crate::error::{DbContext, Result};

/// Every action the operator commands record (`pubsub_outbox_audit.action`).
pub const ACTIONS: &[&str] = &[
    "replay",
    "discard",
    "cancel",
    "retry-now",
    "pause",
    "resume",
    "rewind",
    "prune",
];

/// One operator action.
#[derive(Debug, Clone, PartialEq)]
pub struct Action<'a> {
    /// Who says they act (`None`: the database login is recorded as the actor too).
    pub actor: Option<&'a str>,
    /// What: one of [`ACTIONS`].
    pub action: &'a str,
    /// The selection as the operator gave it.
    pub selector: serde_json::Value,
    /// Rows affected.
    pub row_ids: &'a [i64],
    /// Why.
    pub reason: &'a str,
}

/// Records an action; returns the audit entry id. The database records the session's login in
/// `db_user` itself (a trigger: the writer cannot set it).
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn record(conn: &mut PgConnection, action: &Action<'_>) -> Result<i64> {
    sqlx::query_scalar(
        "INSERT INTO pubsub_outbox_audit (actor, action, selector, row_ids, row_count, reason)
         VALUES (COALESCE($1, session_user), $2, $3, $4, $5, $6) RETURNING id",
    )
    .persistent(crate::store::named_statements())
    .bind(action.actor)
    .bind(action.action)
    .bind(sqlx::types::Json(&action.selector))
    .bind(action.row_ids)
    .bind(i32::try_from(action.row_ids.len()).unwrap_or(i32::MAX))
    .bind(action.reason)
    .fetch_one(&mut *conn)
    .await
    .context("writing pubsub_outbox_audit")
}

/// One audit entry as operators read it.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow, serde::Serialize)]
pub struct Entry {
    /// Entry id.
    pub id: i64,
    /// When.
    pub at: chrono::DateTime<chrono::Utc>,
    /// Who said they acted.
    pub actor: String,
    /// The database login that wrote the entry (set by the database; `None` for entries written
    /// before it was recorded).
    pub db_user: Option<String>,
    /// What.
    pub action: String,
    /// The selection as given.
    pub selector: sqlx::types::Json<serde_json::Value>,
    /// The rows affected.
    pub row_ids: Vec<i64>,
    /// How many.
    pub row_count: i32,
    /// Why.
    pub reason: String,
}

/// The audit trail, newest first, optionally narrowed to an action, an actor and a start time.
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn list(
    conn: &mut PgConnection,
    action: Option<&str>,
    actor: Option<&str>,
    since: Option<chrono::DateTime<chrono::Utc>>,
    limit: i64,
) -> Result<Vec<Entry>> {
    sqlx::query_as(
        "SELECT id, at, actor, db_user, action, selector, row_ids, row_count, reason
         FROM pubsub_outbox_audit
         WHERE ($1::text IS NULL OR action = $1) AND ($2::text IS NULL OR actor = $2)
           AND ($3::timestamptz IS NULL OR at >= $3)
         ORDER BY id DESC LIMIT $4",
    )
    .persistent(crate::store::named_statements())
    .bind(action)
    .bind(actor)
    .bind(since)
    .bind(limit)
    .fetch_all(&mut *conn)
    .await
    .context("reading pubsub_outbox_audit")
}

/// The latest entry of one of `actions` that changed dead letter (or row) `row_id`: what became of
/// an id that is gone (`dead-letters show` of a replayed or discarded entry).
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn last_touching(
    conn: &mut PgConnection,
    row_id: i64,
    actions: &[&str],
) -> Result<Option<Entry>> {
    sqlx::query_as(
        "SELECT id, at, actor, db_user, action, selector, row_ids, row_count, reason
         FROM pubsub_outbox_audit
         WHERE $1 = ANY(row_ids) AND action = ANY($2)
         ORDER BY id DESC LIMIT 1",
    )
    .persistent(crate::store::named_statements())
    .bind(row_id)
    .bind(actions)
    .fetch_optional(&mut *conn)
    .await
    .context("reading pubsub_outbox_audit")
}
