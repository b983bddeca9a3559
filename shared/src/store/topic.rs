//! The topics the database knows: those with outbox rows (published or not), dead letters or a
//! pause, those a replica serves (`--topic`), and those an operator acted on before (the audit
//! trail). The operator commands refuse a topic none of these names (a typo would otherwise pause
//! nothing and look like success). A topic whose rows were all published and deleted, and that
//! nobody paused before, is not known: `pause --new-topic` says it is meant.

use sqlx::PgConnection;

use crate::error::{DbContext, Result};

/// Whether `topic` is known (see the module doc). Each lookup stops at the first row.
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn is_known(conn: &mut PgConnection, topic: &str) -> Result<bool> {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pubsub_outbox_paused_topic WHERE topic = $1)
             OR EXISTS (SELECT 1 FROM pubsub_outbox_replica WHERE $1 = ANY(topics))
             OR EXISTS (SELECT 1 FROM pubsub_outbox_dead_letter WHERE topic = $1)
             OR EXISTS (SELECT 1 FROM pubsub_outbox WHERE topic = $1)
             OR EXISTS (SELECT 1 FROM pubsub_outbox_audit WHERE selector ->> 'topic' = $1)",
    )
    .persistent(crate::store::named_statements())
    .bind(topic)
    .fetch_one(&mut *conn)
    .await
    .context("looking the topic up in the outbox, the dead letters, the pauses, the replicas and the audit trail")
}

/// Every known topic, by name (reads the whole outbox: for a refusal's near matches only).
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn all(conn: &mut PgConnection) -> Result<Vec<String>> {
    sqlx::query_scalar(
        "SELECT topic FROM pubsub_outbox
         UNION SELECT topic FROM pubsub_outbox_dead_letter
         UNION SELECT topic FROM pubsub_outbox_paused_topic
         UNION SELECT unnest(topics) FROM pubsub_outbox_replica
         UNION SELECT selector ->> 'topic' FROM pubsub_outbox_audit WHERE selector ? 'topic'
         ORDER BY 1",
    )
    .persistent(crate::store::named_statements())
    .fetch_all(&mut *conn)
    .await
    .context("listing the known topics")
}
