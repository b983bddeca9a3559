//! `dispatcher dead-letters list|show|blocked|replay|discard`. The reading commands are here;
//! `replay` and `discard` are changes of the one engine ([`super::change`]: `--reason`, `--yes`
//! for a change by filter, `--dry-run` making it and rolling it back, an audit row and a NOTIFY
//! in each page's transaction, every id of the selection whatever `--batch-size`).

use chrono::{DateTime, Utc};
use outbox_runtime::operator::{Command, Common, Exit, OpsError, Output};
use outbox_runtime::table::{Table, instant, printable};
use outbox_shared::store::audit::{self, Action};
use outbox_shared::store::dead_letter::{self, DeadLetter, Filter, REFUSED_LOCALLY};
use outbox_shared::store::outbox;
use serde::Serialize;
use sqlx::PgPool;

use super::blocked::BlockedArgs;
use super::change::rows::{DeadLetterFilter, DeadLetters, resolve};
use super::change::{Discard, Replay};
use super::{ProjectArg, group, plain};

group! {
    /// The dead-letter commands.
    pub enum DeadLettersCommand {
        /// List dead letters, newest first.
        #[command(
            after_help = "Examples:\n  dispatcher dead-letters list --topic projects/billing-prod/topics/invoices --kind permanent\n  \
                          dispatcher dead-letters list --error-contains schema --json"
        )]
        List(ListArgs),
        /// Show one dead letter: attributes, payload size and a safe preview, the error,
        /// attempts, and the ordering key it holds back with the messages waiting behind it.
        #[command(after_help = "Example:\n  dispatcher dead-letters show 42")]
        Show(ShowArgs),
        /// Put dead letters back into the outbox (by dead-letter id or by filter) and wake the
        /// dispatchers.
        #[command(
            after_help = "Examples:\n  dispatcher dead-letters replay 42 43 --reason \"schema fixed\"\n  \
                          dispatcher dead-letters replay --topic projects/billing-prod/topics/invoices --kind permanent --reason \"bad deploy rolled back\" --dry-run\n  \
                          (then the same with --yes instead of --dry-run)"
        )]
        Replay(Replay),
        /// Delete dead letters for good (by id or by filter); a key one blocked flows again.
        #[command(
            after_help = "Examples:\n  dispatcher dead-letters discard 42 --reason \"test message\"\n  \
                          dispatcher dead-letters discard --older-than 30d --reason \"retention\" --yes"
        )]
        Discard(Discard),
        /// The ordering keys dead letters hold back, with the messages waiting behind each, a
        /// page at a time (by topic and key).
        #[command(
            after_help = "Examples:\n  dispatcher dead-letters blocked --topic projects/billing-prod/topics/invoices\n  \
                          dispatcher dead-letters blocked --topic invoices --pubsub-project billing-prod --after-key customer-4711"
        )]
        Blocked(BlockedArgs),
    }
}

plain!(ListArgs, ShowArgs, BlockedArgs);

/// `list` options.
#[derive(Debug, Clone, clap::Args)]
pub struct ListArgs {
    #[command(flatten)]
    pub common: Common,
    #[command(flatten)]
    pub selection: DeadLetterFilter,
    /// At most this many (a page).
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(i64).range(1..=10_000))]
    pub limit: i64,
    /// The next page: entries older than this id (the last id of the previous page).
    #[arg(long)]
    pub before_id: Option<i64>,
}

/// `show` options.
#[derive(Debug, Clone, clap::Args)]
pub struct ShowArgs {
    #[command(flatten)]
    pub common: Common,
    /// The dead letter's id.
    pub id: i64,
}

/// A dead letter as `list`/`show` print it (the payload as a size and a preview).
#[derive(Debug, Clone, Serialize)]
pub struct Entry {
    pub id: i64,
    pub outbox_id: Option<i64>,
    pub topic: String,
    pub ordering_key: Option<String>,
    pub dedupe_key: String,
    pub attributes: outbox_shared::Attributes,
    pub payload_bytes: usize,
    /// The first 200 bytes as text (cut at a character boundary), exactly as stored; `null` when
    /// they are not UTF-8. The table escapes its control characters; JSON escapes once, as JSON.
    pub payload_preview: Option<String>,
    pub created_at: DateTime<Utc>,
    pub failed_at: DateTime<Utc>,
    pub attempts: i32,
    pub error_kind: String,
    pub last_error: String,
    pub source: String,
}

/// The first `max` bytes of `payload` as text, when they are UTF-8 (a character the cut splits
/// is left out, not taken for binary).
fn preview(payload: &[u8], max: usize) -> Option<String> {
    let head = &payload[..payload.len().min(max)];
    match std::str::from_utf8(head) {
        Ok(text) => Some(text.to_owned()),
        // Only the cut is incomplete: the text up to it.
        Err(e) if e.error_len().is_none() && head.len() < payload.len() => {
            std::str::from_utf8(&head[..e.valid_up_to()])
                .ok()
                .map(str::to_owned)
        }
        Err(_) => None,
    }
}

impl From<DeadLetter> for Entry {
    fn from(d: DeadLetter) -> Self {
        Self {
            id: d.id,
            outbox_id: d.outbox_id,
            topic: d.topic,
            ordering_key: d.ordering_key,
            dedupe_key: d.dedupe_key,
            attributes: d.attributes.0,
            payload_bytes: d.payload.len(),
            payload_preview: preview(&d.payload, 200),
            created_at: d.created_at,
            failed_at: d.failed_at,
            attempts: d.attempts,
            error_kind: d.error_kind,
            last_error: d.last_error,
            source: d.source,
        }
    }
}

/// A checked `list`.
#[derive(Debug, Clone)]
pub struct Page {
    filter: Filter,
    project: ProjectArg,
    limit: i64,
    before_id: Option<i64>,
}

impl Command for ListArgs {
    type Checked = Page;

    fn check(&self, now: DateTime<Utc>) -> Result<Page, OpsError> {
        Ok(Page {
            filter: self.selection.filter(&[], now, None)?,
            project: self.selection.project.clone(),
            limit: self.limit,
            before_id: self.before_id,
        })
    }

    async fn run(p: Page, pool: &PgPool) -> Result<Output, OpsError> {
        // Read-only, inside a transaction (as behind a transaction-mode pooler it must be).
        let mut conn = pool.begin().await?;
        let filter = resolve::<DeadLetters>(&mut conn, &p.project, p.filter).await?;
        // One more than the page tells whether another page follows.
        let mut entries: Vec<Entry> =
            dead_letter::select(&mut conn, &filter, p.limit + 1, p.before_id)
                .await?
                .into_iter()
                .map(Entry::from)
                .collect();
        let more = entries.len() as i64 > p.limit;
        entries.truncate(usize::try_from(p.limit).unwrap_or(usize::MAX));
        let mut t = Table::new(&[
            "ID",
            "FAILED AT",
            "KIND",
            "TOPIC",
            "ORDERING KEY",
            "DEDUPE KEY",
            "ATTEMPTS",
            "ERROR",
        ]);
        for e in &entries {
            t.row(vec![
                e.id.to_string(),
                instant(e.failed_at),
                e.error_kind.clone(),
                e.topic.clone(),
                e.ordering_key.as_deref().map_or("-".to_owned(), printable),
                printable(&e.dedupe_key),
                e.attempts.to_string(),
                printable(&e.last_error.chars().take(80).collect::<String>()),
            ]);
        }
        let (text, exit) = if t.is_empty() {
            ("No dead letter matches.\n".to_owned(), Exit::NothingMatched)
        } else {
            (t.render(), Exit::Ok)
        };
        let mut out = Output::new(text, &entries, exit)?;
        if let (true, Some(last)) = (more, entries.last()) {
            out = out.note(format!(
                "more match than this page of {}: the next page is --before-id {} (with the same \
                 filter)",
                p.limit, last.id
            ));
        }
        Ok(out)
    }
}

impl Command for ShowArgs {
    type Checked = i64;

    fn check(&self, _now: DateTime<Utc>) -> Result<i64, OpsError> {
        Ok(self.id)
    }

    async fn run(id: i64, pool: &PgPool) -> Result<Output, OpsError> {
        // Read-only, inside a transaction (as behind a transaction-mode pooler it must be).
        let mut conn = pool.begin().await?;
        let Some(e) = dead_letter::get(&mut conn, id).await?.map(Entry::from) else {
            return Err(OpsError::NothingMatched(gone(&mut conn, id).await?));
        };
        let refused = e.last_error.starts_with(REFUSED_LOCALLY);
        let lines = [
            ("id", e.id.to_string()),
            ("topic", e.topic.clone()),
            (
                "ordering key",
                e.ordering_key.as_deref().map_or("-".to_owned(), printable),
            ),
            ("dedupe key", printable(&e.dedupe_key)),
            (
                "outbox id",
                e.outbox_id.map_or("-".to_owned(), |i| i.to_string()),
            ),
            ("source", e.source.clone()),
            ("enqueued at", instant(e.created_at)),
            ("failed at", instant(e.failed_at)),
            ("attempts", e.attempts.to_string()),
            ("error kind", e.error_kind.clone()),
            ("error", printable(&e.last_error)),
            (
                "attributes",
                printable(&serde_json::to_string(&e.attributes).map_err(OpsError::Encode)?),
            ),
            ("payload", format!("{} bytes", e.payload_bytes)),
            (
                "preview",
                e.payload_preview
                    .as_deref()
                    .map_or("(binary: not shown)".to_owned(), printable),
            ),
        ];
        let mut text: String = lines
            .iter()
            .map(|(k, v)| format!("{:<15}{v}\n", format!("{k}:")))
            .collect();
        text.push_str(&blocks(&mut conn, &e).await?);
        if refused {
            text.push_str(&format!("\n{}\n", REFUSED_HINT));
        }
        Output::new(text, &e, Exit::Ok)
    }
}

/// The line `show` adds on the ordering key the entry holds back: how many messages wait
/// behind it (a cancelled entry, or an unkeyed one, holds back nothing).
async fn blocks(conn: &mut sqlx::PgConnection, e: &Entry) -> Result<String, OpsError> {
    let Some(key) = e.ordering_key.as_deref() else {
        return Ok(format!("{:<15}nothing (no ordering key)\n", "blocks:"));
    };
    if e.error_kind == "cancelled" {
        return Ok(format!(
            "{:<15}nothing (a cancelled message blocks nothing: ordering key {} went on)\n",
            "blocks:",
            printable(key)
        ));
    }
    let waiting = dead_letter::held_behind(conn, &e.topic, key, e.outbox_id).await?;
    Ok(format!(
        "{:<15}ordering key {}: {waiting} message(s) wait behind it until it is replayed or \
         discarded (unless its topic is in --ordering-skip-dead-letters)\n",
        "blocks:",
        printable(key)
    ))
}

/// What became of dead letter `id`, which is gone: the audit trail's replay or discard of it and,
/// for a replay, where its message is now (the outbox, published, or a new dead letter: a
/// replayed message refused again gets a new id and keeps its outbox id).
async fn gone(conn: &mut sqlx::PgConnection, id: i64) -> Result<String, OpsError> {
    let Some(entry) = audit::last_touching(conn, id, &[Action::Replay, Action::Discard]).await?
    else {
        return Ok(format!(
            "no dead letter with id {id} (dispatcher dead-letters list shows the ids)"
        ));
    };
    let mut said = format!(
        "dead letter {id} is gone: {} by {} at {} (audit entry {}, reason: {})",
        if entry.action == Action::Replay.as_str() {
            "replayed"
        } else {
            "discarded"
        },
        entry.actor,
        instant(entry.at),
        entry.id,
        entry.reason
    );
    // Where it went: the entry's `outbox_ids` (beside `row_ids`), or, written before them, its
    // selector's map.
    let outbox_id = entry
        .outbox_ids
        .as_ref()
        .and_then(|o| {
            entry
                .row_ids
                .iter()
                .position(|r| *r == id)
                .and_then(|i| o.get(i).copied())
        })
        .or_else(|| {
            entry
                .selector
                .get("outbox_ids")
                .and_then(|m| m.get(id.to_string()))
                .and_then(serde_json::Value::as_i64)
        });
    if let Some(outbox_id) = outbox_id {
        let now = match dead_letter::of_outbox_row(conn, outbox_id).await? {
            Some(again) => format!(
                "; its message (outbox id {outbox_id}) was refused again: it is dead letter {} \
                 now (dispatcher dead-letters show {})",
                again.id, again.id
            ),
            None => match outbox::get(conn, outbox_id).await? {
                Some(row) if row.published_at.is_none() => format!(
                    "; its message waits in the outbox as row {outbox_id} (dispatcher pending \
                     list {outbox_id})"
                ),
                _ => format!("; its message (outbox id {outbox_id}) was published"),
            },
        };
        said.push_str(&now);
    }
    Ok(said)
}

/// What to say about a message the dispatcher refused itself.
const REFUSED_HINT: &str = "The dispatcher refused this message itself (a limit check, before \
                            sending): a replay runs the same check and dead-letters it again. \
                            Discard it, or fix it at the source and write it again.";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_preview_is_the_text_as_stored_escaped_once_as_json() {
        let json = br#"{"seq":3}"#;
        assert_eq!(preview(json, 200).as_deref(), Some(r#"{"seq":3}"#));
        assert_eq!(
            serde_json::to_string(&preview(json, 200)).ok().as_deref(),
            Some(r#""{\"seq\":3}""#),
            "escaped once, as JSON"
        );
    }

    #[test]
    fn a_cut_through_a_character_is_text_and_binary_is_not() {
        let text = "aé".repeat(100);
        let cut = preview(text.as_bytes(), 200).expect("text");
        assert!(cut.len() <= 200 && text.starts_with(&cut));
        assert_eq!(preview(&[0xff, 0xfe, 0x00], 200), None);
    }
}
