//! `pubsub_outbox_audit`: every operator action (what, which rows, who, why, when), written in the
//! same transaction as the action itself.

use sqlx::PgConnection;

use crate::error::{DbContext, Result};

/// One operator action.
#[derive(Debug, Clone, PartialEq)]
pub struct Action<'a> {
    /// Who (a person or a service account).
    pub actor: &'a str,
    /// What: replay, discard, pause, resume, purge…
    pub action: &'a str,
    /// The selection as the operator gave it.
    pub selector: serde_json::Value,
    /// Rows affected.
    pub row_ids: &'a [i64],
    /// Why.
    pub reason: &'a str,
}

/// Records an action; returns the audit entry id.
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn record(conn: &mut PgConnection, action: &Action<'_>) -> Result<i64> {
    sqlx::query_scalar(
        "INSERT INTO pubsub_outbox_audit (actor, action, selector, row_ids, row_count, reason)
         VALUES ($1, $2, $3, $4, $5, $6) RETURNING id",
    )
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
