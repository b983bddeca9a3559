//! `dispatcher audit`: the audit trail of operator actions.

use chrono::{DateTime, Utc};
use outbox_runtime::operator::{Command, Common, Exit, OpsError, Output, parse_instant};
use outbox_runtime::table::{Table, instant};
use outbox_shared::store::audit::{self, Action};
use sqlx::PgPool;

/// `audit` options.
#[derive(Debug, Clone, clap::Args)]
pub struct AuditArgs {
    #[command(flatten)]
    pub common: Common,
    /// Only this action.
    #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(Action::names()))]
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

/// A checked `audit`.
#[derive(Debug, Clone)]
pub struct Query {
    action: Option<Action>,
    actor: Option<String>,
    since: Option<DateTime<Utc>>,
    limit: i64,
}

impl Command for AuditArgs {
    type Checked = Query;

    fn check(&self, now: DateTime<Utc>) -> Result<Query, OpsError> {
        Ok(Query {
            action: self.action.as_deref().and_then(Action::parse),
            actor: self.actor.clone(),
            since: self
                .since
                .as_deref()
                .map(|s| parse_instant("--since", s, now))
                .transpose()?,
            limit: self.limit,
        })
    }

    async fn run(q: Query, pool: &PgPool) -> Result<Output, OpsError> {
        // Read-only, inside a transaction (as behind a transaction-mode pooler it must be).
        let mut conn = pool.begin().await?;
        let entries =
            audit::list(&mut conn, q.action, q.actor.as_deref(), q.since, q.limit).await?;
        let mut t = Table::new(&[
            "ID", "AT", "ACTOR", "DB USER", "ACTION", "ROWS", "SELECTOR", "REASON",
        ]);
        for e in &entries {
            t.row(vec![
                e.id.to_string(),
                instant(e.at),
                e.actor.clone(),
                e.db_user.clone().unwrap_or_else(|| "-".to_owned()),
                e.action.clone(),
                e.row_count.to_string(),
                short(&e.selector.0.to_string()),
                e.reason.clone(),
            ]);
        }
        let (text, exit) = if t.is_empty() {
            ("No audit entry matches.\n".to_owned(), Exit::NothingMatched)
        } else {
            (t.render(), Exit::Ok)
        };
        Output::new(text, &entries, exit)
    }
}

/// A selector as the table shows it: whole up to 120 characters (every selector written since
/// 0.2.0 is), cut after that (an older replay's map of ids; `--json` has it all).
fn short(selector: &str) -> String {
    const MAX: usize = 120;
    match selector.char_indices().nth(MAX) {
        Some((cut, _)) => format!("{}… (--json has it all)", &selector[..cut]),
        None => selector.to_owned(),
    }
}
