//! `dispatcher dead-letters list|show|replay|discard`.
//!
//! Replay puts dead letters back into the outbox (attempts reset; a message keeps its original
//! id, so a keyed one goes out ahead of the messages that waited behind it), in batches at a
//! bounded rate; discard deletes them. Both need `--reason`, a filter action needs `--yes`, and
//! each batch writes its audit row and wakes the dispatchers in the same transaction as the move
//! (a discard releases the key a dead letter blocked, too).

use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox_runtime::operator::{
    Actor, Command, Common, Confirm, Exit, OpsError, Output, Why, execute, finish, output_on,
    parse_age, parse_instant,
};
use outbox_runtime::table::{Table, instant, printable};
use outbox_shared::store::audit::{self, Action};
use outbox_shared::store::dead_letter::{self, DeadLetter, Filter, REFUSED_LOCALLY};
use outbox_shared::store::pending::{self, KeyAfter};
use outbox_shared::store::{notify, outbox};
use serde::Serialize;
use sqlx::PgPool;

use super::blocked::BlockedArgs;
use super::{ProjectArg, Unknown, Wake, known_topic, merge_keys, refuse_unknown_ids};
use crate::config::SkipDeadLetters;

/// The dead-letter commands.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum DeadLettersCommand {
    /// List dead letters, newest first.
    #[command(
        after_help = "Examples:\n  dispatcher dead-letters list --topic projects/billing-prod/topics/invoices --kind permanent\n  \
                      dispatcher dead-letters list --error-contains schema --json"
    )]
    List(ListArgs),
    /// Show one dead letter: attributes, payload size and a safe preview, the error, attempts.
    #[command(after_help = "Example:\n  dispatcher dead-letters show 42")]
    Show(ShowArgs),
    /// Put dead letters back into the outbox (by id or by filter) and wake the dispatchers.
    #[command(
        after_help = "Examples:\n  dispatcher dead-letters replay 42 43 --reason \"schema fixed\"\n  \
                      dispatcher dead-letters replay --topic projects/billing-prod/topics/invoices --kind permanent --reason \"bad deploy rolled back\" --dry-run\n  \
                      (then the same with --yes instead of --dry-run)"
    )]
    Replay(ReplayArgs),
    /// Delete dead letters for good (by id or by filter); a key one blocked flows again.
    #[command(
        after_help = "Examples:\n  dispatcher dead-letters discard 42 --reason \"test message\"\n  \
                      dispatcher dead-letters discard --older-than 30d --reason \"retention\" --yes"
    )]
    Discard(DiscardArgs),
    /// The ordering keys dead letters hold back, with the messages waiting behind each, a page
    /// at a time (by topic and key).
    #[command(
        after_help = "Examples:\n  dispatcher dead-letters blocked --topic projects/billing-prod/topics/invoices\n  \
                      dispatcher dead-letters blocked --topic invoices --pubsub-project billing-prod --after-key customer-4711"
    )]
    Blocked(BlockedArgs),
}

impl DeadLettersCommand {
    pub(super) fn common(&self) -> &Common {
        match self {
            Self::List(a) => &a.common,
            Self::Show(a) => &a.common,
            Self::Replay(a) => &a.change.common,
            Self::Discard(a) => &a.change.common,
            Self::Blocked(a) => &a.common,
        }
    }

    pub(super) async fn output(&self, pool: &PgPool) -> Result<Output, OpsError> {
        match self {
            Self::List(a) => output_on(a, pool).await,
            Self::Show(a) => output_on(a, pool).await,
            Self::Replay(a) => output_on(a, pool).await,
            Self::Discard(a) => output_on(a, pool).await,
            Self::Blocked(a) => output_on(a, pool).await,
        }
    }

    pub(super) async fn execute(&self, common: &Common, application: &str) -> Exit {
        match self {
            Self::List(a) => execute(a, common, application).await,
            Self::Show(a) => execute(a, common, application).await,
            Self::Replay(a) => execute(a, common, application).await,
            Self::Discard(a) => execute(a, common, application).await,
            Self::Blocked(a) => execute(a, common, application).await,
        }
    }
}

/// Which dead letters (every flag narrows the selection).
#[derive(Debug, Clone, clap::Args)]
pub struct Selection {
    /// Full topic name (or a short one with --pubsub-project).
    #[arg(long)]
    pub topic: Option<String>,
    #[command(flatten)]
    pub project: ProjectArg,
    /// Error kind: permanent, exhausted, rejected or cancelled.
    #[arg(long, value_parser = ["permanent", "exhausted", "rejected", "cancelled"])]
    pub kind: Option<String>,
    /// This ordering key.
    #[arg(long)]
    pub ordering_key: Option<String>,
    /// Dedupe keys starting with this.
    #[arg(long)]
    pub dedupe_prefix: Option<String>,
    /// Failed before this (RFC 3339, or a duration ago such as 2h).
    #[arg(long)]
    pub failed_before: Option<String>,
    /// Failed after this (RFC 3339, or a duration ago such as 2h).
    #[arg(long)]
    pub failed_after: Option<String>,
    /// Text the error contains (case-insensitive).
    #[arg(long)]
    pub error_contains: Option<String>,
}

impl Selection {
    /// The filter: `ids` (when any), the flags, and `older_than` (discard) as a failed-before.
    fn filter(
        &self,
        ids: &[i64],
        now: DateTime<Utc>,
        older_than: Option<Duration>,
    ) -> Result<Filter, OpsError> {
        let instant = |flag, v: &Option<String>| {
            v.as_deref()
                .map(|s| parse_instant(flag, s, now))
                .transpose()
        };
        let mut failed_before = instant("--failed-before", &self.failed_before)?;
        if let Some(age) = older_than {
            let cut = chrono::Duration::from_std(age)
                .ok()
                .and_then(|d| now.checked_sub_signed(d))
                .ok_or_else(|| OpsError::Usage(format!("--older-than {age:?} is too long")))?;
            failed_before = Some(failed_before.map_or(cut, |b| b.min(cut)));
        }
        let filter = Filter {
            ids: (!ids.is_empty()).then(|| ids.to_vec()),
            topic: self
                .topic
                .as_deref()
                .map(|t| self.project.topic(t))
                .transpose()?,
            error_kind: self.kind.clone(),
            ordering_key: self.ordering_key.clone(),
            dedupe_prefix: self.dedupe_prefix.clone().filter(|p| !p.is_empty()),
            failed_before,
            failed_after: instant("--failed-after", &self.failed_after)?,
            error_contains: self.error_contains.clone().filter(|p| !p.is_empty()),
        };
        if let (Some(b), Some(a)) = (filter.failed_before, filter.failed_after)
            && b <= a
        {
            return Err(OpsError::Usage(format!(
                "--failed-before ({b}) is not after --failed-after ({a}): the filter can match nothing"
            )));
        }
        Ok(filter)
    }
}

/// `list` options.
#[derive(Debug, Clone, clap::Args)]
pub struct ListArgs {
    #[command(flatten)]
    pub common: Common,
    #[command(flatten)]
    pub selection: Selection,
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

/// What `replay` and `discard` take.
#[derive(Debug, Clone, clap::Args)]
pub struct ChangeArgs {
    #[command(flatten)]
    pub common: Common,
    /// Dead letter ids (or use the filter flags).
    pub ids: Vec<i64>,
    #[command(flatten)]
    pub selection: Selection,
    #[command(flatten)]
    pub why: Why,
    #[command(flatten)]
    pub confirm: Confirm,
    #[command(flatten)]
    pub wake: Wake,
    /// Entries per transaction (each with its own audit row).
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(i64).range(1..=10_000))]
    pub batch_size: i64,
    /// At most this many entries per second (replay: spare the dispatchers a flood).
    #[arg(long, default_value_t = 1000.0)]
    pub rate: f64,
    #[command(flatten)]
    pub skip_dead_letters: SkipDeadLetters,
}

/// `replay` options.
#[derive(Debug, Clone, clap::Args)]
pub struct ReplayArgs {
    #[command(flatten)]
    pub change: ChangeArgs,
}

/// `discard` options.
#[derive(Debug, Clone, clap::Args)]
pub struct DiscardArgs {
    #[command(flatten)]
    pub change: ChangeArgs,
    /// Entries that failed longer ago than this (e.g. 30d).
    #[arg(long)]
    pub older_than: Option<String>,
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

/// Refuses a filter's topic that nothing in the database names (exit 2, with the near ones):
/// the filter could match nothing, and a typo would look like "no dead letter matches".
async fn check_topic(conn: &mut sqlx::PgConnection, filter: &Filter) -> Result<(), OpsError> {
    if let Some(topic) = &filter.topic {
        let resolved = ProjectArg {
            pubsub_project: String::new(),
        };
        known_topic(conn, &resolved, topic, Unknown::Refuse("")).await?;
    }
    Ok(())
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
    limit: i64,
    before_id: Option<i64>,
}

impl Command for ListArgs {
    type Checked = Page;

    fn check(&self, now: DateTime<Utc>) -> Result<Page, OpsError> {
        Ok(Page {
            filter: self.selection.filter(&[], now, None)?,
            limit: self.limit,
            before_id: self.before_id,
        })
    }

    async fn run(p: Page, pool: &PgPool) -> Result<Output, OpsError> {
        // Read-only, inside a transaction (as behind a transaction-mode pooler it must be).
        let mut conn = pool.begin().await?;
        check_topic(&mut conn, &p.filter).await?;
        // One more than the page tells whether another page follows.
        let mut entries: Vec<Entry> =
            dead_letter::select(&mut conn, &p.filter, p.limit + 1, p.before_id)
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
        if refused {
            text.push_str(&format!("\n{}\n", REFUSED_HINT));
        }
        Output::new(text, &e, Exit::Ok)
    }
}

/// What became of dead letter `id`, which is gone: the audit trail's replay or discard of it and,
/// for a replay, where its message is now (the outbox, published, or a new dead letter: a
/// replayed message refused again gets a new id and keeps its outbox id).
async fn gone(conn: &mut sqlx::PgConnection, id: i64) -> Result<String, OpsError> {
    let Some(entry) = audit::last_touching(conn, id, &["replay", "discard"]).await? else {
        return Ok(format!(
            "no dead letter with id {id} (dispatcher dead-letters list shows the ids)"
        ));
    };
    let mut said = format!(
        "dead letter {id} is gone: {} by {} at {} (audit entry {}, reason: {})",
        if entry.action == "replay" {
            "replayed"
        } else {
            "discarded"
        },
        entry.actor,
        instant(entry.at),
        entry.id,
        entry.reason
    );
    let outbox_id = entry
        .selector
        .get("outbox_ids")
        .and_then(|m| m.get(id.to_string()))
        .and_then(serde_json::Value::as_i64);
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

/// A checked `replay` or `discard`.
#[derive(Debug, Clone)]
pub struct Plan {
    action: &'static str,
    filter: Filter,
    ids: Vec<i64>,
    who: Actor,
    dry_run: bool,
    batch_size: i64,
    rate: f64,
    notify_channel: String,
    skip_topics: Vec<String>,
}

impl ChangeArgs {
    fn plan(
        &self,
        action: &'static str,
        now: DateTime<Utc>,
        older_than: Option<Duration>,
    ) -> Result<Plan, OpsError> {
        let filter = self.selection.filter(&self.ids, now, older_than)?;
        let by_filter = self.ids.is_empty();
        if by_filter && filter.is_empty() {
            return Err(OpsError::Usage(format!(
                "{action} needs dead letter ids or a filter (--topic, --kind, --ordering-key, \
                 --dedupe-prefix, --failed-before/--failed-after, --error-contains{})",
                if action == "discard" {
                    ", --older-than"
                } else {
                    ""
                }
            )));
        }
        if self.rate.is_nan() || self.rate <= 0.0 {
            return Err(OpsError::Usage(format!(
                "--rate must be above 0, got {}",
                self.rate
            )));
        }
        let who = self.why.check(
            &format!("say why the dead letters are {action}ed (it goes to the audit trail)"),
            self.confirm.dry_run,
        )?;
        self.confirm.check(by_filter, action, "dead letter")?;
        Ok(Plan {
            action,
            filter,
            ids: self.ids.clone(),
            who,
            dry_run: self.confirm.dry_run,
            batch_size: self.batch_size,
            rate: self.rate,
            notify_channel: self.wake.notify_channel.clone(),
            skip_topics: self.skip_dead_letters.topics.clone(),
        })
    }
}

impl Command for ReplayArgs {
    type Checked = Plan;

    fn check(&self, now: DateTime<Utc>) -> Result<Plan, OpsError> {
        self.change.plan("replay", now, None)
    }

    async fn run(plan: Plan, pool: &PgPool) -> Result<Output, OpsError> {
        change(plan, pool).await
    }
}

impl Command for DiscardArgs {
    type Checked = Plan;

    fn check(&self, now: DateTime<Utc>) -> Result<Plan, OpsError> {
        let older_than = self
            .older_than
            .as_deref()
            .map(|s| parse_age("--older-than", s))
            .transpose()?;
        self.change.plan("discard", now, older_than)
    }

    async fn run(plan: Plan, pool: &PgPool) -> Result<Output, OpsError> {
        change(plan, pool).await
    }
}

/// What a replay or discard did (or would do, with `--dry-run`).
#[derive(Debug, Clone, Serialize)]
pub struct ChangeReport {
    pub action: &'static str,
    pub dry_run: bool,
    pub ids: Vec<i64>,
    pub count: usize,
    /// Selected but left in place (replay: the dedupe key is back in the outbox already).
    pub skipped: Vec<i64>,
    pub audit_ids: Vec<i64>,
    /// Replay: the ids the dispatcher refused itself, which it will dead-letter again.
    pub refused_locally: Vec<i64>,
    /// Each ordering key of the entries changed, as the change leaves it: whether a dead letter
    /// still blocks it, and how many of its messages then wait in the outbox (they go at once
    /// when it is not blocked; a replayed message goes first).
    pub keys: Vec<KeyAfter>,
}

/// Replays or discards the plan's dead letters, a batch per transaction. Ids that name no dead
/// letter refuse the whole command first (exit 2, nothing changed).
async fn change(plan: Plan, pool: &PgPool) -> Result<Output, OpsError> {
    {
        let mut conn = pool.begin().await?;
        check_topic(&mut conn, &plan.filter).await?;
        if !plan.ids.is_empty() {
            let all = Filter {
                ids: Some(plan.ids.clone()),
                ..Filter::default()
            };
            let limit = i64::try_from(plan.ids.len()).unwrap_or(i64::MAX);
            let found: Vec<i64> = dead_letter::select(&mut conn, &all, limit, None)
                .await?
                .iter()
                .map(|d| d.id)
                .collect();
            refuse_unknown_ids(
                &plan.ids,
                &found,
                "dead letter",
                "replayed or discarded already, or a typo: dispatcher dead-letters list shows the \
                 ids",
            )?;
        }
        conn.rollback().await?;
    }
    let selector = serde_json::to_value(&plan.filter).map_err(OpsError::Encode)?;
    let mut report = ChangeReport {
        action: plan.action,
        dry_run: plan.dry_run,
        ids: Vec::new(),
        count: 0,
        skipped: Vec::new(),
        audit_ids: Vec::new(),
        refused_locally: Vec::new(),
        keys: Vec::new(),
    };
    let mut before_id = None;
    loop {
        let started = std::time::Instant::now();
        let Some((last, selected)) =
            change_page(&plan, &selector, pool, before_id, &mut report).await?
        else {
            break;
        };
        before_id = Some(last);
        if plan.dry_run {
            continue;
        }
        // Rate limit: at most `rate` entries per second across batches.
        let budget = Duration::from_secs_f64(selected as f64 / plan.rate);
        if let Some(wait) = budget.checked_sub(started.elapsed()) {
            tokio::time::sleep(wait).await;
        }
    }
    report.count = report.ids.len();
    change_output(&plan, report)
}

/// One batch in one transaction: the next page of the plan's dead letters (below `before_id`)
/// replayed or discarded with its audit row and a NOTIFY (with `--dry-run`, only listed).
/// Returns the page's last id and size, `None` when nothing is left.
async fn change_page(
    plan: &Plan,
    selector: &serde_json::Value,
    pool: &PgPool,
    before_id: Option<i64>,
    report: &mut ChangeReport,
) -> Result<Option<(i64, usize)>, OpsError> {
    let action = plan.action;
    let mut tx = pool.begin().await?;
    let page = dead_letter::select(&mut tx, &plan.filter, plan.batch_size, before_id).await?;
    let Some(last) = page.last().map(|d| d.id) else {
        return Ok(None);
    };
    if action == "replay" {
        report.refused_locally.extend(
            page.iter()
                .filter(|d| d.last_error.starts_with(REFUSED_LOCALLY))
                .map(|d| d.id),
        );
    }
    let outbox_ids: Vec<(i64, i64)> = page
        .iter()
        .filter_map(|d| d.outbox_id.map(|o| (d.id, o)))
        .collect();
    let keyed: Vec<(i64, String, String)> = page
        .iter()
        .filter_map(|d| d.ordering_key.clone().map(|k| (d.id, d.topic.clone(), k)))
        .collect();
    let page: Vec<i64> = page.iter().map(|d| d.id).collect();
    // A dry run makes the change and rolls it back: what it lists is exactly what the change
    // would do (a replay's skipped entries too, and what it leaves of each key).
    let done = match action {
        "replay" => dead_letter::replay(&mut tx, &page).await?,
        _ => dead_letter::discard(&mut tx, &page).await?,
    };
    let keys: Vec<(String, String)> = keyed
        .into_iter()
        .filter(|(id, _, _)| done.contains(id))
        .map(|(_, topic, key)| (topic, key))
        .collect();
    merge_keys(
        &mut report.keys,
        pending::keys_after(&mut tx, &keys, &plan.skip_topics).await?,
    );
    report
        .skipped
        .extend(page.iter().filter(|id| !done.contains(id)));
    if !done.is_empty() && !plan.dry_run {
        let mut selector = selector.clone();
        if action == "replay"
            && let Some(object) = selector.as_object_mut()
        {
            // Where each replayed entry went: `show` of its gone id follows it there.
            let moved: serde_json::Map<String, serde_json::Value> = outbox_ids
                .iter()
                .filter(|(id, _)| done.contains(id))
                .map(|(id, outbox_id)| (id.to_string(), serde_json::Value::from(*outbox_id)))
                .collect();
            object.insert("outbox_ids".to_owned(), serde_json::Value::Object(moved));
        }
        let entry = Action {
            actor: plan.who.actor.as_deref(),
            action,
            selector,
            row_ids: &done,
            reason: &plan.who.reason,
        };
        report.audit_ids.push(audit::record(&mut tx, &entry).await?);
        // Replayed rows are due now; a discard may release the key its entry blocked.
        notify::notify(&mut tx, &plan.notify_channel).await?;
    }
    finish(tx, plan.dry_run).await?;
    report.ids.extend(&done);
    Ok(Some((last, page.len())))
}

/// The text, the JSON, the notes and the exit code of a replay or discard.
fn change_output(plan: &Plan, report: ChangeReport) -> Result<Output, OpsError> {
    let verb = match (report.action, plan.dry_run) {
        ("replay", true) => "would replay",
        ("replay", false) => "replayed",
        (_, true) => "would discard",
        (_, false) => "discarded",
    };
    let mut text = format!("{verb} {} dead letter(s): {:?}\n", report.count, report.ids);
    for k in &report.keys {
        text.push_str(&format!(
            "ordering key {:?} of {}: {}\n",
            k.ordering_key,
            k.topic,
            match (k.blocked, k.waiting) {
                (true, n) => format!(
                    "still blocked by another dead letter; {n} message(s) wait (dispatcher \
                     dead-letters blocked --topic {})",
                    k.topic
                ),
                (false, 0) => "released; no message of it waits".to_owned(),
                (false, n) => format!("released: {n} message(s) go at once, in order"),
            }
        ));
    }
    if !report.skipped.is_empty() {
        text.push_str(&format!(
            "{} in place: {:?}. Their dedupe key is in the outbox again (the message was written \
             again, or its published copy is retained), so a replay cannot bring them back and \
             the ordering key they block stays blocked: discard them (dispatcher dead-letters \
             discard {} --reason …) to release it\n",
            if plan.dry_run {
                "would be left"
            } else {
                "left"
            },
            report.skipped,
            report
                .skipped
                .iter()
                .map(i64::to_string)
                .collect::<Vec<_>>()
                .join(" ")
        ));
    }
    let unknown: Vec<i64> = plan
        .ids
        .iter()
        .copied()
        .filter(|id| !report.ids.contains(id) && !report.skipped.contains(id))
        .collect();
    let exit = match (report.count, unknown.is_empty()) {
        // Selected, but every one left in place: not done (the text says why and what to do).
        (0, _) if !report.skipped.is_empty() => Exit::Failed,
        (0, _) => Exit::NothingMatched,
        (_, false) => Exit::Failed,
        (_, true) => Exit::Ok,
    };
    let refused = report.refused_locally.clone();
    let mut out = Output::new(text, &report, exit)?;
    if !refused.is_empty() {
        out = out.note(format!(
            "warning: dead letter(s) {refused:?} were refused by the dispatcher itself (a limit \
             check, before sending): replayed, they are dead-lettered again. Discard them, or fix \
             them at the source and write them again"
        ));
    }
    if !unknown.is_empty() {
        out = out.note(format!("error: no dead letter with id(s) {unknown:?}"));
    }
    Ok(out)
}

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
