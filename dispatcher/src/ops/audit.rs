//! `dispatcher audit`: the audit trail of operator actions.

use outbox_runtime::operator::Exit;
use outbox_shared::store::audit;
use sqlx::PgPool;

use super::{Common, OpsError, Table, instant, print_json};

/// `audit` options.
#[derive(Debug, Clone, clap::Args)]
pub struct AuditArgs {
    #[command(flatten)]
    pub common: Common,
    /// Only this action (replay, discard, pause, resume, rewind).
    #[arg(long)]
    pub action: Option<String>,
    /// Only this actor.
    #[arg(long)]
    pub actor: Option<String>,
    /// Only entries since (RFC 3339, or a duration ago such as 24h).
    #[arg(long)]
    pub since: Option<String>,
    /// At most this many.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(i64).range(1..=10_000))]
    pub limit: i64,
}

/// Lists the trail.
pub async fn run(a: &AuditArgs, pool: &PgPool) -> Result<Exit, OpsError> {
    let since = a
        .since
        .as_deref()
        .map(|s| instant("--since", s))
        .transpose()?;
    // Read-only, inside a transaction (as behind a transaction-mode pooler it must be).
    let mut conn = pool.begin().await?;
    let entries = audit::list(
        &mut conn,
        a.action.as_deref(),
        a.actor.as_deref(),
        since,
        a.limit,
    )
    .await?;
    if a.common.json {
        print_json(&entries)?;
    } else {
        let mut t = Table::new(&[
            "ID", "AT", "ACTOR", "DB USER", "ACTION", "ROWS", "SELECTOR", "REASON",
        ]);
        for e in &entries {
            t.row(vec![
                e.id.to_string(),
                e.at.to_rfc3339(),
                e.actor.clone(),
                e.db_user.clone().unwrap_or_else(|| "-".to_owned()),
                e.action.clone(),
                e.row_count.to_string(),
                e.selector.0.to_string(),
                e.reason.clone(),
            ]);
        }
        if t.is_empty() {
            println!("No audit entry matches.");
        } else {
            print!("{}", t.render());
        }
    }
    Ok(if entries.is_empty() {
        Exit::NothingMatched
    } else {
        Exit::Ok
    })
}
