//! `dispatcher pause TOPIC` / `dispatcher resume TOPIC`: persisted in the database and honoured
//! by every replica's next claim; each writes its audit row in the same transaction.

use outbox_runtime::operator::Exit;
use outbox_shared::store::audit::{self, Action};
use outbox_shared::store::pause;
use sqlx::PgPool;

use super::{Common, OpsError, Why, begin, print_json, topic_name};

/// `pause` / `resume` options.
#[derive(Debug, Clone, clap::Args)]
pub struct PauseArgs {
    #[command(flatten)]
    pub common: Common,
    /// The topic (full name, or short with --pubsub-project).
    pub topic: String,
    /// Project for a short topic name.
    #[arg(long, env = "PUBSUB_PROJECT_ID", default_value = "")]
    pub pubsub_project: String,
    #[command(flatten)]
    pub why: Why,
}

/// Pauses the topic.
pub async fn pause(a: &PauseArgs, pool: &PgPool) -> Result<Exit, OpsError> {
    change(a, pool, "pause").await
}

/// Resumes the topic.
pub async fn resume(a: &PauseArgs, pool: &PgPool) -> Result<Exit, OpsError> {
    change(a, pool, "resume").await
}

async fn change(a: &PauseArgs, pool: &PgPool, action: &'static str) -> Result<Exit, OpsError> {
    let topic = topic_name(&a.pubsub_project, &a.topic)?;
    let reason = a.why.reason()?;
    let actor = a.why.actor();
    let mut tx = begin(pool).await?;
    let changed = match action {
        "pause" => pause::pause(&mut tx, &topic, actor.as_deref(), reason).await?,
        _ => pause::resume(&mut tx, &topic).await?,
    };
    let audit_id = if changed {
        let entry = Action {
            actor: actor.as_deref(),
            action,
            selector: serde_json::json!({ "topic": topic }),
            row_ids: &[],
            reason,
        };
        Some(audit::record(&mut tx, &entry).await?)
    } else {
        None
    };
    tx.commit().await?;
    if a.common.json {
        print_json(
            &serde_json::json!({ "action": action, "topic": topic, "changed": changed, "audit_id": audit_id }),
        )?;
    } else if changed {
        println!(
            "{topic}: {}d (audit entry {}).",
            action,
            audit_id.unwrap_or_default()
        );
    } else {
        println!(
            "{topic}: already {}; nothing changed.",
            if action == "pause" {
                "paused"
            } else {
                "not paused"
            }
        );
    }
    Ok(if changed {
        Exit::Ok
    } else {
        Exit::NothingMatched
    })
}
