//! `dispatcher pending list|cancel|retry-now`: the operator's verbs for messages not yet sent (a
//! seed-style outbox's `cancel_message` and retry), on the operator framework's rules: `--reason`
//! for a change, `--yes` for a change by filter, `--dry-run` making it and rolling it back, an
//! audit row and a NOTIFY in each batch's transaction.
//!
//! - `cancel` moves messages to the dead-letter table as `cancelled` (`outbox_shared::store::
//!   pending`): they stay inspectable and replayable there, and block nothing, so the later
//!   messages of their key go on (it was a person's decision). It is how a held topic's messages
//!   that must never go (the topic was deleted on purpose) leave the outbox: nothing is
//!   dead-lettered without a person.
//! - `retry-now` makes messages waiting for a retry due at once, their attempts unchanged.
//!
//! Ids name outbox rows; one that is not an unpublished row refuses the whole command (exit 2)
//! before anything changes. A row a dispatcher holds (being published right now) is left alone and
//! reported as in flight.

use chrono::{DateTime, Utc};
use outbox_runtime::operator::{
    Actor, Command, Common, Confirm, Exit, OpsError, Output, Why, execute, finish, output_on,
    parse_instant,
};
use outbox_runtime::table::{Table, instant, printable};
use outbox_shared::release::Feature;
use outbox_shared::store::audit::{self, Action};
use outbox_shared::store::notify;
use outbox_shared::store::pending::{self, Changed, KeyAfter, Pending, Selection};
use outbox_shared::store::replica;
use serde::Serialize;
use sqlx::PgPool;

use super::status::STALE_AFTER;
use super::{ProjectArg, Unknown, Wake, known_topic, merge_keys, refuse_unknown_ids};
use crate::config::SkipDeadLetters;

/// The pending-message commands.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum PendingCommand {
    /// List unpublished messages (no payloads), by id, a page at a time.
    #[command(
        after_help = "Examples:\n  dispatcher pending list --topic projects/billing-prod/topics/invoices --waiting\n  \
                      dispatcher pending list --ordering-key customer-42 --json"
    )]
    List(ListArgs),
    /// Move messages not yet sent to the dead-letter table as `cancelled` (inspectable,
    /// replayable; they block nothing: the later messages of their key go on).
    #[command(
        after_help = "Examples:\n  dispatcher pending cancel 4711 --reason \"sent twice by a bug, INC-1234\"\n  \
                      dispatcher pending cancel --topic projects/billing-prod/topics/retired --reason \"topic retired, CHG-42\" --dry-run\n  \
                      (then the same with --yes instead of --dry-run)"
    )]
    Cancel(ChangeArgs),
    /// Make messages waiting for a retry due now (their attempts unchanged) and wake the
    /// dispatchers.
    #[command(
        name = "retry-now",
        after_help = "Examples:\n  dispatcher pending retry-now 4711 --reason \"the consumer is back\"\n  \
                      dispatcher pending retry-now --topic projects/billing-prod/topics/invoices --reason \"Pub/Sub fixed\" --yes"
    )]
    RetryNow(ChangeArgs),
}

impl PendingCommand {
    pub(super) fn common(&self) -> &Common {
        match self {
            Self::List(a) => &a.common,
            Self::Cancel(a) | Self::RetryNow(a) => &a.common,
        }
    }

    pub(super) async fn output(&self, pool: &PgPool) -> Result<Output, OpsError> {
        match self {
            Self::List(a) => output_on(a, pool).await,
            Self::Cancel(a) => output_on(&Cancel(a.clone()), pool).await,
            Self::RetryNow(a) => output_on(&RetryNow(a.clone()), pool).await,
        }
    }

    pub(super) async fn execute(&self, common: &Common, application: &str) -> Exit {
        match self {
            Self::List(a) => execute(a, common, application).await,
            Self::Cancel(a) => execute(&Cancel(a.clone()), common, application).await,
            Self::RetryNow(a) => execute(&RetryNow(a.clone()), common, application).await,
        }
    }
}

/// Which unpublished messages (every flag narrows the selection).
#[derive(Debug, Clone, clap::Args)]
pub struct Filter {
    /// Full topic name (or a short one with --pubsub-project).
    #[arg(long)]
    pub topic: Option<String>,
    #[command(flatten)]
    pub project: ProjectArg,
    /// This ordering key.
    #[arg(long)]
    pub ordering_key: Option<String>,
    /// Dedupe keys starting with this.
    #[arg(long)]
    pub dedupe_prefix: Option<String>,
    /// Enqueued before this (RFC 3339, or a duration ago such as 2h).
    #[arg(long)]
    pub created_before: Option<String>,
    /// Enqueued after this (RFC 3339, or a duration ago such as 2h).
    #[arg(long)]
    pub created_after: Option<String>,
    /// Text the last error contains (case-insensitive).
    #[arg(long)]
    pub error_contains: Option<String>,
}

impl Filter {
    /// The selection: `ids` (when any) and the flags; `waiting` keeps the rows waiting for a retry.
    fn selection(
        &self,
        ids: &[i64],
        now: DateTime<Utc>,
        waiting: bool,
    ) -> Result<Selection, OpsError> {
        let instant = |flag, v: &Option<String>| {
            v.as_deref()
                .map(|s| parse_instant(flag, s, now))
                .transpose()
        };
        let s = Selection {
            ids: (!ids.is_empty()).then(|| ids.to_vec()),
            topic: self
                .topic
                .as_deref()
                .map(|t| self.project.topic(t))
                .transpose()?,
            ordering_key: self.ordering_key.clone(),
            dedupe_prefix: self.dedupe_prefix.clone().filter(|p| !p.is_empty()),
            created_before: instant("--created-before", &self.created_before)?,
            created_after: instant("--created-after", &self.created_after)?,
            error_contains: self.error_contains.clone().filter(|p| !p.is_empty()),
            waiting_at: waiting.then_some(now),
        };
        if let (Some(b), Some(a)) = (s.created_before, s.created_after)
            && b <= a
        {
            return Err(OpsError::Usage(format!(
                "--created-before ({b}) is not after --created-after ({a}): the filter can match nothing"
            )));
        }
        Ok(s)
    }
}

/// `pending list` options.
#[derive(Debug, Clone, clap::Args)]
pub struct ListArgs {
    #[command(flatten)]
    pub common: Common,
    /// Outbox ids (or use the filter flags; nothing lists every unpublished message).
    pub ids: Vec<i64>,
    #[command(flatten)]
    pub filter: Filter,
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

/// What `cancel` and `retry-now` take.
#[derive(Debug, Clone, clap::Args)]
pub struct ChangeArgs {
    #[command(flatten)]
    pub common: Common,
    /// Outbox ids (or use the filter flags).
    pub ids: Vec<i64>,
    #[command(flatten)]
    pub filter: Filter,
    /// Only messages waiting for a retry (retry-now takes only those anyway).
    #[arg(long)]
    pub waiting: bool,
    #[command(flatten)]
    pub why: Why,
    #[command(flatten)]
    pub confirm: Confirm,
    #[command(flatten)]
    pub wake: Wake,
    /// Messages per transaction (each with its own audit row).
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(i64).range(1..=10_000))]
    pub batch_size: i64,
    #[command(flatten)]
    pub skip_dead_letters: SkipDeadLetters,
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
        check_topic(&mut conn, &p.selection, &p.project).await?;
        // One more than the page tells whether another page follows.
        let mut rows = pending::select(&mut conn, &p.selection, p.limit + 1, p.after_id).await?;
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
                instant(r.next_attempt_at),
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

/// `pending cancel`, checked as [`ChangeArgs`] say.
#[derive(Debug, Clone)]
pub struct Cancel(pub ChangeArgs);

/// `pending retry-now`, checked as [`ChangeArgs`] say.
#[derive(Debug, Clone)]
pub struct RetryNow(pub ChangeArgs);

/// A checked `cancel` or `retry-now`.
#[derive(Debug, Clone)]
pub struct Plan {
    action: &'static str,
    selection: Selection,
    project: ProjectArg,
    ids: Vec<i64>,
    who: Actor,
    dry_run: bool,
    batch_size: i64,
    notify_channel: String,
    skip_topics: Vec<String>,
    now: DateTime<Utc>,
}

impl ChangeArgs {
    fn plan(&self, action: &'static str, now: DateTime<Utc>) -> Result<Plan, OpsError> {
        let selection =
            self.filter
                .selection(&self.ids, now, self.waiting || action == "retry-now")?;
        let by_filter = self.ids.is_empty();
        if by_filter && selection.is_empty() {
            return Err(OpsError::Usage(format!(
                "{action} needs outbox ids or a filter (--topic, --ordering-key, --dedupe-prefix, \
                 --created-before/--created-after, --error-contains); dispatcher pending list \
                 shows the ids"
            )));
        }
        let what = match action {
            "cancel" => {
                "say why the messages are cancelled (it goes to the audit trail and to each dead letter)"
            }
            _ => "say why the messages are retried now (it goes to the audit trail)",
        };
        let who = self.why.check(what, self.confirm.dry_run)?;
        self.confirm
            .check(by_filter, action, "unpublished message")?;
        Ok(Plan {
            action,
            selection,
            project: self.filter.project.clone(),
            ids: self.ids.clone(),
            who,
            dry_run: self.confirm.dry_run,
            batch_size: self.batch_size,
            notify_channel: self.wake.notify_channel.clone(),
            skip_topics: self.skip_dead_letters.topics.clone(),
            now,
        })
    }
}

impl Command for Cancel {
    type Checked = Plan;

    fn check(&self, now: DateTime<Utc>) -> Result<Plan, OpsError> {
        self.0.plan("cancel", now)
    }

    async fn run(plan: Plan, pool: &PgPool) -> Result<Output, OpsError> {
        change(plan, pool).await
    }
}

impl Command for RetryNow {
    type Checked = Plan;

    fn check(&self, now: DateTime<Utc>) -> Result<Plan, OpsError> {
        self.0.plan("retry-now", now)
    }

    async fn run(plan: Plan, pool: &PgPool) -> Result<Output, OpsError> {
        change(plan, pool).await
    }
}

/// What a `cancel` or `retry-now` did (or would do, with `--dry-run`).
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub action: &'static str,
    pub dry_run: bool,
    /// The messages changed.
    pub ids: Vec<i64>,
    pub count: usize,
    /// Held by a dispatcher (being published right now): left alone.
    pub in_flight: Vec<i64>,
    /// Cancel: a dead letter holds the same dedupe key already: left in the outbox.
    pub dead_letter_exists: Vec<i64>,
    /// Published or gone meanwhile, or (retry-now) not waiting: left as they are.
    pub unchanged: Vec<i64>,
    pub audit_ids: Vec<i64>,
    /// Cancel: each ordering key it touched, as it leaves it: whether a dead letter still blocks
    /// it and how many of its messages then wait (they go at once when it is not blocked).
    pub keys: Vec<KeyAfter>,
}

/// Refuses a topic nothing in the database names (exit 2, with the near ones).
async fn check_topic(
    conn: &mut sqlx::PgConnection,
    s: &Selection,
    project: &ProjectArg,
) -> Result<(), OpsError> {
    if let Some(topic) = &s.topic {
        known_topic(conn, project, topic, Unknown::Refuse("")).await?;
    }
    Ok(())
}

/// Refuses to cancel keyed messages while a dispatcher of a release that misreads a cancelled
/// keyed row is alive ([`Feature::CancelKeyed`]): it would hold the key behind it. Unkeyed
/// messages are cancelled whatever runs.
async fn refuse_older_releases(conn: &mut sqlx::PgConnection, plan: &Plan) -> Result<(), OpsError> {
    let feature = Feature::CancelKeyed;
    let older: Vec<replica::LiveRelease> = replica::live_releases(conn, STALE_AFTER)
        .await?
        .into_iter()
        .filter(|r| !feature.known_to(&r.version))
        .collect();
    if older.is_empty() {
        return Ok(());
    }
    // Only now (a rollout in progress): whether the selection holds a keyed message, by pages
    // of the same selection the change takes.
    let mut after = None;
    let keyed = loop {
        let page = pending::select(conn, &plan.selection, 1000, after).await?;
        if page.iter().any(|r| r.ordering_key.is_some()) {
            break true;
        }
        match page.last() {
            Some(last) if page.len() == 1000 => after = Some(last.id),
            _ => break false,
        }
    };
    if !keyed {
        return Ok(());
    }
    let who: Vec<String> = older
        .iter()
        .map(|r| {
            format!(
                "{} on {} ({})",
                r.replicas,
                r.version,
                r.replica_ids.join(", ")
            )
        })
        .collect();
    Err(OpsError::Failed(format!(
        "not cancelled: the selection holds messages with an ordering key, and {} dispatcher \
         replica(s) of a release before {} are alive ({}): such a release {}. Nothing was \
         changed. Finish the rollout (every replica on {} or later: dispatcher status lists the \
         releases), then cancel again; unkeyed messages can be cancelled now (docs/releases.md)",
        older.iter().map(|r| r.replicas).sum::<i64>(),
        feature.since(),
        who.join("; "),
        feature.misread(),
        feature.since()
    )))
}

/// Cancels or retries the plan's messages, a batch per transaction. Ids that are not unpublished
/// rows refuse the whole command first (exit 2, nothing changed).
async fn change(plan: Plan, pool: &PgPool) -> Result<Output, OpsError> {
    {
        let mut conn = pool.begin().await?;
        check_topic(&mut conn, &plan.selection, &plan.project).await?;
        if !plan.ids.is_empty() {
            let all = Selection {
                ids: Some(plan.ids.clone()),
                ..Selection::default()
            };
            let limit = i64::try_from(plan.ids.len()).unwrap_or(i64::MAX);
            let found: Vec<i64> = pending::select(&mut conn, &all, limit, None)
                .await?
                .iter()
                .map(|r| r.id)
                .collect();
            refuse_unknown_ids(
                &plan.ids,
                &found,
                "unpublished message",
                "published already, cancelled, or never written: dispatcher pending list shows \
                 the ids",
            )?;
        }
        if plan.action == "cancel" {
            refuse_older_releases(&mut conn, &plan).await?;
        }
        conn.rollback().await?;
    }
    let selector = serde_json::to_value(&plan.selection).map_err(OpsError::Encode)?;
    let mut report = Report {
        action: plan.action,
        dry_run: plan.dry_run,
        ids: Vec::new(),
        count: 0,
        in_flight: Vec::new(),
        dead_letter_exists: Vec::new(),
        unchanged: Vec::new(),
        audit_ids: Vec::new(),
        keys: Vec::new(),
    };
    let mut after_id = None;
    while let Some(last) = change_page(&plan, &selector, pool, after_id, &mut report).await? {
        after_id = Some(last);
    }
    let seen: Vec<i64> = report
        .ids
        .iter()
        .chain(&report.in_flight)
        .chain(&report.dead_letter_exists)
        .chain(&report.unchanged)
        .copied()
        .collect();
    report
        .unchanged
        .extend(plan.ids.iter().filter(|id| !seen.contains(id)));
    report.count = report.ids.len();
    change_output(&plan, report)
}

/// One batch in one transaction: the next page of the plan's messages (after `after_id`),
/// changed with its audit row and a NOTIFY (with `--dry-run`, changed and rolled back). Returns
/// the page's last id, `None` when nothing is left.
async fn change_page(
    plan: &Plan,
    selector: &serde_json::Value,
    pool: &PgPool,
    after_id: Option<i64>,
    report: &mut Report,
) -> Result<Option<i64>, OpsError> {
    let mut tx = pool.begin().await?;
    let page: Vec<Pending> =
        pending::select(&mut tx, &plan.selection, plan.batch_size, after_id).await?;
    let Some(last) = page.last().map(|r| r.id) else {
        return Ok(None);
    };
    let ids: Vec<i64> = page.iter().map(|r| r.id).collect();
    let changed: Changed = match plan.action {
        "cancel" => {
            let error = format!(
                "cancelled by {}: {}",
                plan.who.actor.as_deref().unwrap_or("the operator's login"),
                plan.who.reason
            );
            pending::cancel(&mut tx, &ids, &error, plan.now).await?
        }
        _ => pending::retry_now(&mut tx, &ids, plan.now).await?,
    };
    if plan.action == "cancel" {
        let keys: Vec<(String, String)> = page
            .iter()
            .filter(|r| changed.ids.contains(&r.id))
            .filter_map(|r| r.ordering_key.clone().map(|k| (r.topic.clone(), k)))
            .collect();
        merge_keys(
            &mut report.keys,
            pending::keys_after(&mut tx, &keys, &plan.skip_topics).await?,
        );
    }
    if !changed.ids.is_empty() && !plan.dry_run {
        let entry = Action {
            actor: plan.who.actor.as_deref(),
            action: plan.action,
            selector: selector.clone(),
            row_ids: &changed.ids,
            reason: &plan.who.reason,
        };
        report.audit_ids.push(audit::record(&mut tx, &entry).await?);
        // Retried rows are due now; a cancelled key head lets the rest of its key go.
        notify::notify(&mut tx, &plan.notify_channel).await?;
    }
    finish(tx, plan.dry_run).await?;
    report.ids.extend(&changed.ids);
    report.in_flight.extend(&changed.in_flight);
    report
        .dead_letter_exists
        .extend(&changed.dead_letter_exists);
    report.unchanged.extend(&changed.unchanged);
    Ok(Some(last))
}

/// The text, the JSON, the notes and the exit code of a `cancel` or `retry-now`.
fn change_output(plan: &Plan, report: Report) -> Result<Output, OpsError> {
    let verb = match (report.action, plan.dry_run) {
        ("cancel", true) => "would cancel",
        ("cancel", false) => "cancelled",
        (_, true) => "would make due now",
        (_, false) => "made due now",
    };
    let mut text = format!("{verb} {} message(s): {:?}\n", report.count, report.ids);
    if report.action == "cancel" && report.count > 0 {
        text.push_str(
            "They are in the dead-letter table as `cancelled` (dispatcher dead-letters list --kind \
             cancelled), replayable; they block nothing.\n",
        );
    }
    for k in &report.keys {
        text.push_str(&format!(
            "ordering key {:?} of {}: {} message(s) wait{}\n",
            k.ordering_key,
            k.topic,
            k.waiting,
            if k.blocked {
                ", still blocked by a dead letter of its own (dispatcher dead-letters blocked)"
            } else if k.waiting > 0 {
                " and go on now"
            } else {
                ""
            }
        ));
    }
    let exit = match (report.count, report.in_flight.is_empty()) {
        (0, false) => Exit::Failed,
        (0, true) => Exit::NothingMatched,
        _ => Exit::Ok,
    };
    let mut notes = Vec::new();
    if !report.in_flight.is_empty() {
        notes.push(format!(
            "{} message(s) {:?} are being published right now (a dispatcher holds them): left \
             alone; list them again in a moment",
            report.in_flight.len(),
            report.in_flight
        ));
    }
    if !report.dead_letter_exists.is_empty() {
        notes.push(format!(
            "{:?}: a dead letter holds the same dedupe key already, so they were left in the \
             outbox (discard or replay that dead letter first)",
            report.dead_letter_exists
        ));
    }
    if !report.unchanged.is_empty() {
        notes.push(format!(
            "{:?}: {}",
            report.unchanged,
            if report.action == "cancel" {
                "published or gone meanwhile: left as they are"
            } else {
                "not waiting for a retry (due already, or published meanwhile): left as they are"
            }
        ));
    }
    let mut out = Output::new(text, &report, exit)?;
    for n in notes {
        out = out.note(n);
    }
    Ok(out)
}
