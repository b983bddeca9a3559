//! LISTEN/NOTIFY wake-ups. A NOTIFY takes a global lock at commit, so writers send at most one per
//! transaction; listeners keep a polling fallback (LISTEN does not pass transaction poolers).

use sqlx::PgConnection;

use crate::error::{DbContext, Result};

/// The default notification channel.
pub const DEFAULT_CHANNEL: &str = "pubsub_outbox";

/// Queues one notification on `channel`, delivered when the caller's transaction commits.
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn notify(conn: &mut PgConnection, channel: &str) -> Result<()> {
    sqlx::query("SELECT pg_notify($1, '')")
        .persistent(crate::store::named_statements())
        .bind(channel)
        .execute(&mut *conn)
        .await
        .context("sending NOTIFY for new outbox rows")?;
    Ok(())
}
