//! `pubsub_outbox_audit`: every operator action (what, which rows, who, why, when), written in the
//! same transaction as the action itself.

use sqlx::PgConnection;

use crate::error::{DbContext, Result};

/// Every action the operator commands record (`pubsub_outbox_audit.action`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// Dead letters back into the outbox.
    Replay,
    /// Dead letters deleted.
    Discard,
    /// Unpublished messages moved to the dead letters as cancelled.
    Cancel,
    /// Waiting messages made due now.
    RetryNow,
    /// A topic's claims stopped.
    Pause,
    /// A paused topic claimed again.
    Resume,
    /// A producer stream's watermark moved.
    Rewind,
    /// Gone replicas' heartbeat rows deleted.
    Prune,
}

impl Action {
    /// Every action, in the order `--help` lists them.
    pub const ALL: [Action; 8] = [
        Self::Replay,
        Self::Discard,
        Self::Cancel,
        Self::RetryNow,
        Self::Pause,
        Self::Resume,
        Self::Rewind,
        Self::Prune,
    ];

    /// As stored and as the commands name it.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Replay => "replay",
            Self::Discard => "discard",
            Self::Cancel => "cancel",
            Self::RetryNow => "retry-now",
            Self::Pause => "pause",
            Self::Resume => "resume",
            Self::Rewind => "rewind",
            Self::Prune => "prune",
        }
    }

    /// The action named `name`.
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|a| a.as_str() == name)
    }

    /// Every action's name.
    pub fn names() -> [&'static str; 8] {
        Self::ALL.map(Self::as_str)
    }
}

impl std::fmt::Display for Action {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl serde::Serialize for Action {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

/// One operator action, as its audit row records it.
#[derive(Debug, Clone, PartialEq)]
pub struct Record<'a> {
    /// Who says they act (`None`: the database login is recorded as the actor too).
    pub actor: Option<&'a str>,
    /// What.
    pub action: Action,
    /// The selection as the operator gave it, short: the filter, and for ids their count and
    /// range (the ids themselves are `row_ids`).
    pub selector: serde_json::Value,
    /// Rows affected.
    pub row_ids: &'a [i64],
    /// Replay: the outbox id each of `row_ids` went back to, in the same order.
    pub outbox_ids: Option<&'a [i64]>,
    /// Why.
    pub reason: &'a str,
}

/// Records an action; returns the audit entry id. The database records the session's login in
/// `db_user` itself (a trigger: the writer cannot set it).
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn record(conn: &mut PgConnection, action: &Record<'_>) -> Result<i64> {
    sqlx::query_scalar(
        "INSERT INTO pubsub_outbox_audit (actor, action, selector, row_ids, row_count, reason,
                                          outbox_ids)
         VALUES (COALESCE($1, session_user), $2, $3, $4, $5, $6, $7) RETURNING id",
    )
    .persistent(crate::store::named_statements())
    .bind(action.actor)
    .bind(action.action.as_str())
    .bind(sqlx::types::Json(&action.selector))
    .bind(action.row_ids)
    .bind(i32::try_from(action.row_ids.len()).unwrap_or(i32::MAX))
    .bind(action.reason)
    .bind(action.outbox_ids)
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
    /// Replay: the outbox id each of `row_ids` went back to (`None` for other actions, and for
    /// replays audited before it was recorded here).
    pub outbox_ids: Option<Vec<i64>>,
}

/// The audit trail, newest first, optionally narrowed to an action, an actor and a start time.
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn list(
    conn: &mut PgConnection,
    action: Option<Action>,
    actor: Option<&str>,
    since: Option<chrono::DateTime<chrono::Utc>>,
    limit: i64,
) -> Result<Vec<Entry>> {
    sqlx::query_as(
        "SELECT id, at, actor, db_user, action, selector, row_ids, row_count, reason, outbox_ids
         FROM pubsub_outbox_audit
         WHERE ($1::text IS NULL OR action = $1) AND ($2::text IS NULL OR actor = $2)
           AND ($3::timestamptz IS NULL OR at >= $3)
         ORDER BY id DESC LIMIT $4",
    )
    .persistent(crate::store::named_statements())
    .bind(action.map(Action::as_str))
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
    actions: &[Action],
) -> Result<Option<Entry>> {
    let actions: Vec<&str> = actions.iter().map(|a| a.as_str()).collect();
    sqlx::query_as(
        "SELECT id, at, actor, db_user, action, selector, row_ids, row_count, reason, outbox_ids
         FROM pubsub_outbox_audit
         WHERE $1 = ANY(row_ids) AND action = ANY($2)
         ORDER BY id DESC LIMIT 1",
    )
    .persistent(crate::store::named_statements())
    .bind(row_id)
    .bind(&actions)
    .fetch_optional(&mut *conn)
    .await
    .context("reading pubsub_outbox_audit")
}

#[cfg(test)]
mod tests {
    use super::Action;

    #[test]
    fn every_action_parses_back_from_its_name() {
        for a in Action::ALL {
            assert_eq!(Action::parse(a.as_str()), Some(a));
        }
        assert_eq!(Action::parse("retry_now"), None);
    }
}
