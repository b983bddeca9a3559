//! `dispatcher pending list|cancel|retry-now`: the operator's verbs for messages not yet sent (a
//! seed-style outbox's `cancel_message` and retry). `list` is here; `cancel` and `retry-now` are
//! changes of the one engine ([`super::change`]: `--reason`, `--yes` for a change by filter,
//! `--dry-run` making it and rolling it back, an audit row and a NOTIFY in each page's
//! transaction, every id of the selection whatever `--batch-size`).
//!
//! Ids name outbox rows (a cancel prints the dead-letter ids they become: those are what
//! `dead-letters replay` takes). A row a dispatcher holds (being published right now) is left
//! alone and reported as in flight.

use chrono::{DateTime, Utc};
use outbox_runtime::operator::{Command, Common, Exit, OpsError, Output};
use outbox_runtime::table::{Table, instant, printable};
use outbox_shared::store::pending::{self, Selection};
use sqlx::PgPool;

use super::change::rows::{Outbox, OutboxFilter, resolve};
use super::change::{Cancel, RetryNow};
use super::{ProjectArg, group, plain};

group! {
    /// The pending-message commands.
    pub enum PendingCommand {
        /// List unpublished messages (no payloads), by id, a page at a time. A message behind
        /// its key's head that waits for a retry shows the head's next attempt: it goes after it.
        #[command(
            after_help = "Examples:\n  dispatcher pending list --topic projects/billing-prod/topics/invoices --waiting\n  \
                          dispatcher pending list --ordering-key customer-42 --json"
        )]
        List(ListArgs),
        /// Move messages not yet sent to the dead-letter table as `cancelled` (inspectable,
        /// replayable by the dead-letter ids it prints; they block nothing: the later messages
        /// of their key go on).
        #[command(
            after_help = "Examples:\n  dispatcher pending cancel 4711 --reason \"sent twice by a bug, INC-1234\"\n  \
                          dispatcher pending cancel --topic projects/billing-prod/topics/retired --reason \"topic retired, CHG-42\" --dry-run\n  \
                          (then the same with --yes instead of --dry-run)"
        )]
        Cancel(Cancel),
        /// Make messages waiting for a retry due now (their attempts unchanged) and wake the
        /// dispatchers.
        #[command(
            name = "retry-now",
            after_help = "Examples:\n  dispatcher pending retry-now 4711 --reason \"the consumer is back\"\n  \
                          dispatcher pending retry-now --topic projects/billing-prod/topics/invoices --reason \"Pub/Sub fixed\" --yes"
        )]
        RetryNow(RetryNow),
    }
}

plain!(ListArgs);

/// `pending list` options.
#[derive(Debug, Clone, clap::Args)]
pub struct ListArgs {
    #[command(flatten)]
    pub common: Common,
    /// Outbox ids (or use the filter flags; nothing lists every unpublished message).
    pub ids: Vec<i64>,
    #[command(flatten)]
    pub filter: OutboxFilter,
    /// Only messages waiting for a retry (not due yet).
    #[arg(long)]
    pub waiting: bool,
    /// At most this many (a page).
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(i64).range(1..=10_000))]
    pub limit: i64,
    /// The next page: messages after this id (the last id of the previous page).
    #[arg(long)]
    pub after_id: Option<i64>,
}

/// A checked `pending list`.
#[derive(Debug, Clone)]
pub struct Page {
    selection: Selection,
    project: ProjectArg,
    limit: i64,
    after_id: Option<i64>,
}

impl Command for ListArgs {
    type Checked = Page;

    fn check(&self, now: DateTime<Utc>) -> Result<Page, OpsError> {
        Ok(Page {
            selection: self.filter.selection(&self.ids, now, self.waiting)?,
            project: self.filter.project.clone(),
            limit: self.limit,
            after_id: self.after_id,
        })
    }

    async fn run(p: Page, pool: &PgPool) -> Result<Output, OpsError> {
        // Read-only, inside a transaction (as behind a transaction-mode pooler it must be).
        let mut conn = pool.begin().await?;
        let selection = resolve::<Outbox>(&mut conn, &p.project, p.selection).await?;
        // One more than the page tells whether another page follows.
        let mut rows = pending::select(&mut conn, &selection, p.limit + 1, p.after_id).await?;
        let more = rows.len() as i64 > p.limit;
        rows.truncate(usize::try_from(p.limit).unwrap_or(usize::MAX));
        let mut t = Table::new(&[
            "ID",
            "TOPIC",
            "ORDERING KEY",
            "DEDUPE KEY",
            "ENQUEUED",
            "ATTEMPTS",
            "NEXT ATTEMPT",
            "LAST ERROR",
        ]);
        for r in &rows {
            t.row(vec![
                r.id.to_string(),
                r.topic.clone(),
                r.ordering_key.as_deref().map_or("-".to_owned(), printable),
                printable(&r.dedupe_key),
                instant(r.created_at),
                r.attempts.to_string(),
                due(r),
                r.last_error.as_deref().map_or("-".to_owned(), |e| {
                    printable(&e.chars().take(60).collect::<String>())
                }),
            ]);
        }
        let (text, exit) = if t.is_empty() {
            (
                "No unpublished message matches.\n".to_owned(),
                Exit::NothingMatched,
            )
        } else {
            (t.render(), Exit::Ok)
        };
        let mut out = Output::new(text, &rows, exit)?;
        if let (true, Some(last)) = (more, rows.last()) {
            out = out.note(format!(
                "more match: the next page is --after-id {} (with the same filter)",
                last.id
            ));
        }
        Ok(out)
    }
}

/// When a row can go: its next attempt, or, behind an earlier message of its key that waits for
/// a retry, after that one.
fn due(r: &outbox_shared::store::pending::Pending) -> String {
    if r.due_at > r.next_attempt_at {
        format!("{} (after its key's head)", instant(r.due_at))
    } else {
        instant(r.next_attempt_at)
    }
}
