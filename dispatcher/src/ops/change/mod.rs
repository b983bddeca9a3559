//! The one engine of every operator change by selection (`pending cancel|retry-now`,
//! `dead-letters replay|discard`), for the CLI and the console alike:
//!
//! select → preview → apply page by page until the selection is exhausted → audit → report.
//!
//! - **Select.** A selection is ids, a filter, or both ([`Plan`]); its table ([`Rows`]: the
//!   outbox's unpublished rows, or the dead letters) reads it a page at a time, in id order, from
//!   a cursor. Ids the table does not hold at all refuse the whole change before anything changes
//!   (exit 2).
//! - **Preview is the change rolled back.** `--dry-run` runs exactly the path below and rolls each
//!   page's transaction back, so it lists exactly what the real run changes, at every size.
//! - **Apply.** Each page is one transaction: the verb's statement ([`Verb::apply`]), its audit
//!   row (the short selector, the page's ids in `row_ids`) and a NOTIFY, committed together. The
//!   loop ends when a page comes back empty: a selection by ids goes through every id, whatever
//!   `--batch-size`.
//! - **Report.** [`report::Report`] says what became of every id: changed, or left (in flight,
//!   a colliding dead letter, back in the outbox already, gone meanwhile, or outside the filter)
//!   and what each touched ordering key is left with.
//!
//! A verb supplies only what differs: its table, its statement and its words. Adding one is a
//! file beside these and its line in [`VERBS`] (and its command variant).

mod cancel;
mod discard;
mod replay;
pub(crate) mod report;
mod retry_now;
pub(crate) mod rows;

use std::fmt::Debug;
use std::future::Future;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use outbox_runtime::operator::{Actor, Command, Confirm, OpsError, Output, Why, finish};
use outbox_shared::store::audit::{self, Action, Record};
use outbox_shared::store::notify;
use sqlx::{PgConnection, PgPool};

pub use cancel::Cancel;
pub use discard::Discard;
pub use replay::Replay;
pub use retry_now::RetryNow;

use self::report::Report;
use self::rows::Rows;
use super::{ProjectArg, Wake};
use crate::config::SkipDeadLetters;

/// What a verb is to the console and the help: found by its audit action.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VerbInfo {
    /// The audit action (and the command's name).
    pub action: Action,
    /// The command group it belongs to (`pending`, `dead-letters`).
    pub group: &'static str,
    /// What it selects, in the plural ("dead letters").
    pub rows: &'static str,
    /// The console's filter fields (form field, flag) of its table.
    pub filters: &'static [(&'static str, &'static str)],
    /// What the console says when a preview matches nothing.
    pub nothing: &'static str,
    /// Its button's label.
    pub label: &'static str,
}

/// Every verb of the engine: the registration line of each.
pub const VERBS: &[VerbInfo] = &[Cancel::INFO, RetryNow::INFO, Replay::INFO, Discard::INFO];

/// The verb of `action`, when the engine has one.
pub fn verb(action: Action) -> Option<&'static VerbInfo> {
    VERBS.iter().find(|v| v.action == action)
}

/// How a verb words its change.
#[derive(Debug, Clone, Copy)]
pub struct Words {
    /// Past tense: "cancelled".
    pub done: &'static str,
    /// A dry run's: "would cancel".
    pub would: &'static str,
    /// What `--reason` is for.
    pub reason: &'static str,
    /// What an id outside the selection is, when it is in the table but not selected (retry-now:
    /// "not waiting for a retry").
    pub outside: &'static str,
}

/// One operator change: its table, its statement and its words; the engine does the rest.
pub trait Verb: Clone + Debug + Send + Sync + 'static {
    /// The table whose rows it changes.
    type Rows: Rows;
    /// The audit action.
    const ACTION: Action;
    /// Its words.
    const WORDS: Words;
    /// What it is to the console.
    const INFO: VerbInfo;

    /// The flags every command takes.
    fn common(&self) -> &outbox_runtime::operator::Common;

    /// The checked selection and flags (no I/O).
    fn plan(&self, now: DateTime<Utc>) -> Result<Plan<Self::Rows>, OpsError>;

    /// Refusals particular to the verb, before anything changes (in a transaction rolled back).
    fn preflight(
        _conn: &mut PgConnection,
        _plan: &Plan<Self::Rows>,
    ) -> impl Future<Output = Result<(), OpsError>> + Send {
        async { Ok(()) }
    }

    /// Changes `page` in its transaction, says what became of each row in `report`, and returns
    /// the audit's rows: the ids changed (and, for a replay, where each went).
    fn apply(
        tx: &mut PgConnection,
        page: &[<Self::Rows as Rows>::Row],
        plan: &Plan<Self::Rows>,
        report: &mut Report,
    ) -> impl Future<Output = Result<Audited, OpsError>> + Send;

    /// Lines of its own after the summary (a cancel's dead letters and undo command, a replay's
    /// warnings); it may add its fields to the report.
    fn explain(_plan: &Plan<Self::Rows>, _report: &mut Report) -> Vec<String> {
        Vec::new()
    }
}

/// What a page's audit row records.
#[derive(Debug, Clone, Default)]
pub struct Audited {
    /// The rows changed (the selection's table's ids).
    pub ids: Vec<i64>,
    /// Replay: the outbox id each went back to, in the order of `ids`.
    pub outbox_ids: Option<Vec<i64>>,
}

/// The flags every change takes, whatever its table.
#[derive(Debug, Clone, clap::Args)]
pub struct ChangeFlags {
    #[command(flatten)]
    pub why: Why,
    #[command(flatten)]
    pub confirm: Confirm,
    #[command(flatten)]
    pub wake: Wake,
    /// Rows per transaction (each with its own audit row); the change goes on, a page after
    /// another, until the selection is exhausted.
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(i64).range(1..=10_000))]
    pub batch_size: i64,
    #[command(flatten)]
    pub skip_dead_letters: SkipDeadLetters,
}

/// A checked change: what it selects, who asks and why, and how it runs.
#[derive(Debug, Clone)]
pub struct Plan<R: Rows> {
    /// The selection (with the ids given, when any).
    pub filter: R::Filter,
    /// The ids given (empty: by filter).
    pub ids: Vec<i64>,
    /// For short topic names in the filter.
    pub project: ProjectArg,
    pub who: Actor,
    pub dry_run: bool,
    pub batch_size: i64,
    /// At most this many rows per second (replay spares the dispatchers a flood).
    pub rate: Option<f64>,
    pub notify_channel: String,
    pub skip_topics: Vec<String>,
    pub now: DateTime<Utc>,
}

impl<R: Rows> Plan<R> {
    /// A plan of `filter` and `ids` with `flags`: refuses a change with neither ids nor a filter,
    /// one without a reason, and one by filter without `--yes`.
    pub fn new<V: Verb<Rows = R>>(
        filter: R::Filter,
        ids: &[i64],
        project: ProjectArg,
        flags: &ChangeFlags,
        now: DateTime<Utc>,
    ) -> Result<Self, OpsError> {
        let action = V::ACTION.as_str();
        let by_filter = ids.is_empty();
        if by_filter && R::narrows_nothing(&filter) {
            return Err(OpsError::Usage(format!(
                "{action} needs {} ids or a filter ({}); {}",
                R::ID,
                R::FILTER_FLAGS,
                R::LIST
            )));
        }
        let who = flags.why.check(V::WORDS.reason, flags.confirm.dry_run)?;
        flags.confirm.check(by_filter, action, R::NOUN)?;
        Ok(Self {
            filter,
            ids: ids.to_vec(),
            project,
            who,
            dry_run: flags.confirm.dry_run,
            batch_size: flags.batch_size,
            rate: None,
            notify_channel: flags.wake.notify_channel.clone(),
            skip_topics: flags.skip_dead_letters.topics.clone(),
            now,
        })
    }
}

/// A verb's command, as the operator framework runs it.
#[derive(Debug, Clone)]
pub struct Change<V: Verb>(pub V);

impl<V: Verb> Command for Change<V> {
    type Checked = Plan<V::Rows>;

    fn check(&self, now: DateTime<Utc>) -> Result<Plan<V::Rows>, OpsError> {
        self.0.plan(now)
    }

    async fn run(plan: Plan<V::Rows>, pool: &PgPool) -> Result<Output, OpsError> {
        run::<V>(plan, pool).await
    }
}

/// Runs a checked change: refusals first, then page after page until the selection is
/// exhausted, then the report.
async fn run<V: Verb>(plan: Plan<V::Rows>, pool: &PgPool) -> Result<Output, OpsError> {
    let plan = preflight::<V>(plan, pool).await?;
    let selector = selector::<V::Rows>(&plan)?;
    let mut report = Report::new(V::ACTION, V::Rows::IDS, plan.dry_run);
    let mut cursor = None;
    loop {
        let started = Instant::now();
        let Some((last, size)) = page::<V>(&plan, &selector, pool, cursor, &mut report).await?
        else {
            break;
        };
        cursor = Some(last);
        if let (Some(rate), false) = (plan.rate, plan.dry_run) {
            let budget = Duration::from_secs_f64(size as f64 / rate);
            if let Some(wait) = budget.checked_sub(started.elapsed()) {
                tokio::time::sleep(wait).await;
            }
        }
    }
    account_for_ids::<V::Rows>(&plan, pool, &mut report).await?;
    report.output::<V>(&plan)
}

/// The refusals before anything changes: a topic nothing names (or a malformed one: both with
/// the known names near it), ids the table does not hold, and the verb's own. Returns the plan
/// with its topic's full name.
async fn preflight<V: Verb>(
    mut plan: Plan<V::Rows>,
    pool: &PgPool,
) -> Result<Plan<V::Rows>, OpsError> {
    let mut conn = pool.begin().await?;
    plan.filter = rows::resolve::<V::Rows>(&mut conn, &plan.project, plan.filter).await?;
    let plan = plan;
    if !plan.ids.is_empty() {
        let held = V::Rows::holding(&mut conn, &plan.ids).await?;
        let unknown: Vec<i64> = plan
            .ids
            .iter()
            .copied()
            .filter(|id| !held.contains(id))
            .collect();
        if !unknown.is_empty() {
            return Err(OpsError::Usage(format!(
                "no {} with id(s) {} ({}); nothing was changed",
                V::Rows::NOUN,
                report::summary(&unknown),
                V::Rows::MISSING
            )));
        }
    }
    V::preflight(&mut conn, &plan).await?;
    conn.rollback().await?;
    Ok(plan)
}

/// One page in one transaction: the next rows of the selection after `cursor`, changed with
/// their audit row and a NOTIFY, committed (a dry run: rolled back). Returns the page's cursor
/// and size; `None` once the selection is exhausted.
async fn page<V: Verb>(
    plan: &Plan<V::Rows>,
    selector: &serde_json::Value,
    pool: &PgPool,
    cursor: Option<i64>,
    report: &mut Report,
) -> Result<Option<(i64, usize)>, OpsError> {
    let mut tx = pool.begin().await?;
    let rows = V::Rows::page(&mut tx, &plan.filter, plan.batch_size, cursor).await?;
    let Some(last) = rows.last().map(V::Rows::id) else {
        return Ok(None);
    };
    report.seen(rows.iter().map(V::Rows::id));
    let audited = V::apply(&mut tx, &rows, plan, report).await?;
    let keys: Vec<(String, String)> = rows
        .iter()
        .filter(|r| audited.ids.contains(&V::Rows::id(r)))
        .filter_map(V::Rows::key)
        .collect();
    report.keys_after(&mut tx, &keys, &plan.skip_topics).await?;
    if !audited.ids.is_empty() && !plan.dry_run {
        let entry = Record {
            actor: plan.who.actor.as_deref(),
            action: V::ACTION,
            selector: selector.clone(),
            row_ids: &audited.ids,
            outbox_ids: audited.outbox_ids.as_deref(),
            reason: &plan.who.reason,
        };
        report.audit_ids.push(audit::record(&mut tx, &entry).await?);
        // Changed rows may be claimable now (due now, back in the outbox, or a key released).
        notify::notify(&mut tx, &plan.notify_channel).await?;
    }
    finish(tx, plan.dry_run).await?;
    report.changed(&audited.ids);
    Ok(Some((last, rows.len())))
}

/// The audit's selector: the filter as given, without the ids (they are the row's `row_ids`),
/// and how many ids were given, with their range.
fn selector<R: Rows>(plan: &Plan<R>) -> Result<serde_json::Value, OpsError> {
    let mut value = serde_json::to_value(&plan.filter).map_err(OpsError::Encode)?;
    if let Some(object) = value.as_object_mut() {
        object.remove("ids");
        if let (Some(first), Some(last)) = (plan.ids.iter().min(), plan.ids.iter().max()) {
            object.insert(
                "given_ids".to_owned(),
                serde_json::json!({"count": plan.ids.len(), "min": first, "max": last}),
            );
        }
    }
    Ok(value)
}

/// The ids given that no page selected: outside the filter (the table holds them, the filter
/// leaves them out), or gone meanwhile (published, or changed by someone else).
async fn account_for_ids<R: Rows>(
    plan: &Plan<R>,
    pool: &PgPool,
    report: &mut Report,
) -> Result<(), OpsError> {
    let unseen = report.unseen(&plan.ids);
    if unseen.is_empty() {
        return Ok(());
    }
    let mut conn = pool.begin().await?;
    let held = R::holding(&mut conn, &unseen).await?;
    conn.rollback().await?;
    for id in unseen {
        if held.contains(&id) {
            report.outside.push(id);
        } else {
            report.gone.push(id);
        }
    }
    Ok(())
}
