//! `dispatcher dead-letters list|show|replay|discard`.
//!
//! Replay puts dead letters back into the outbox (attempts reset; a message keeps its original
//! id, so a keyed one goes out ahead of the messages that waited behind it), in batches at a
//! bounded rate; discard deletes them. Both need `--reason`, a filter action needs `--yes`, and
//! each batch writes its audit row in the same transaction as the move.

use std::time::Duration;

use outbox_runtime::operator::Exit;
use outbox_shared::store::audit::{self, Action};
use outbox_shared::store::dead_letter::{self, DeadLetter, Filter};
use serde::Serialize;
use sqlx::PgPool;

use super::{Common, OpsError, Table, Why, begin, instant, print_json, topic_name};

/// The dead-letter commands.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum DeadLettersCommand {
    /// List dead letters, newest first.
    ///
    /// Examples: `dispatcher dead-letters list --topic invoices --kind permanent`,
    /// `dispatcher dead-letters list --error-contains schema --json`
    List(ListArgs),
    /// Show one dead letter: attributes, payload size and a safe preview, the error, attempts.
    ///
    /// Example: `dispatcher dead-letters show 42`
    Show(ShowArgs),
    /// Put dead letters back into the outbox (by id or by filter).
    ///
    /// Examples: `dispatcher dead-letters replay 42 43 --reason "schema fixed"`,
    /// `dispatcher dead-letters replay --topic invoices --kind permanent --reason "bad deploy rolled back" --yes`
    Replay(ChangeArgs),
    /// Delete dead letters for good (by id or by filter).
    ///
    /// Examples: `dispatcher dead-letters discard 42 --reason "test message"`,
    /// `dispatcher dead-letters discard --older-than 30d --reason "retention" --yes`
    Discard(ChangeArgs),
}

impl DeadLettersCommand {
    pub(super) fn common(&self) -> &Common {
        match self {
            Self::List(a) => &a.common,
            Self::Show(a) => &a.common,
            Self::Replay(a) | Self::Discard(a) => &a.common,
        }
    }
}

/// Which dead letters (every flag narrows the selection).
#[derive(Debug, Clone, clap::Args)]
pub struct Selection {
    /// Full topic name (or a short one with --pubsub-project).
    #[arg(long)]
    pub topic: Option<String>,
    /// Project for short topic names.
    #[arg(long, env = "PUBSUB_PROJECT_ID", default_value = "")]
    pub pubsub_project: String,
    /// Error kind: permanent, exhausted or rejected.
    #[arg(long, value_parser = ["permanent", "exhausted", "rejected"])]
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
    fn filter(&self, ids: &[i64], older_than: Option<&str>) -> Result<Filter, OpsError> {
        let mut failed_before = self
            .failed_before
            .as_deref()
            .map(|s| instant("--failed-before", s))
            .transpose()?;
        if let Some(age) = older_than {
            let d = humantime::parse_duration(age)
                .ok()
                .and_then(|d| chrono::Duration::from_std(d).ok())
                .ok_or_else(|| {
                    OpsError::Usage(format!(
                        "--older-than {age:?} is not a duration (e.g. 30d, 12h)"
                    ))
                })?;
            let cut = chrono::Utc::now() - d;
            failed_before = Some(failed_before.map_or(cut, |b| b.min(cut)));
        }
        let filter = Filter {
            ids: (!ids.is_empty()).then(|| ids.to_vec()),
            topic: self
                .topic
                .as_deref()
                .map(|t| topic_name(&self.pubsub_project, t))
                .transpose()?,
            error_kind: self.kind.clone(),
            ordering_key: self.ordering_key.clone(),
            dedupe_prefix: self.dedupe_prefix.clone().filter(|p| !p.is_empty()),
            failed_before,
            failed_after: self
                .failed_after
                .as_deref()
                .map(|s| instant("--failed-after", s))
                .transpose()?,
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

/// `replay` / `discard` options.
#[derive(Debug, Clone, clap::Args)]
pub struct ChangeArgs {
    #[command(flatten)]
    pub common: Common,
    /// Dead letter ids (or use the filter flags).
    pub ids: Vec<i64>,
    #[command(flatten)]
    pub selection: Selection,
    /// Discard only: entries that failed longer ago than this (e.g. 30d).
    #[arg(long)]
    pub older_than: Option<String>,
    #[command(flatten)]
    pub why: Why,
    /// Confirm a change selected by a filter (not needed for an id list).
    #[arg(long)]
    pub yes: bool,
    /// Show exactly what would change; change nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Entries per transaction (each with its own audit row).
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(i64).range(1..=10_000))]
    pub batch_size: i64,
    /// At most this many entries per second (replay: spare the dispatchers a flood).
    #[arg(long, default_value_t = 1000.0)]
    pub rate: f64,
}

/// A dead letter as `list`/`show` print it (the payload as a size and a safe preview).
#[derive(Debug, Clone, Serialize)]
pub struct Entry {
    pub id: i64,
    pub outbox_id: Option<i64>,
    pub topic: String,
    pub ordering_key: Option<String>,
    pub dedupe_key: String,
    pub attributes: outbox_shared::Attributes,
    pub payload_bytes: usize,
    /// The first 200 bytes as text, control characters escaped; `null` when not UTF-8.
    pub payload_preview: Option<String>,
    pub created_at: chrono::DateTime<chrono::Utc>,
    pub failed_at: chrono::DateTime<chrono::Utc>,
    pub attempts: i32,
    pub error_kind: String,
    pub last_error: String,
    pub source: String,
}

impl From<DeadLetter> for Entry {
    fn from(d: DeadLetter) -> Self {
        let head = &d.payload[..d.payload.len().min(200)];
        let payload_preview = std::str::from_utf8(head)
            .ok()
            .map(|s| s.chars().flat_map(char::escape_debug).collect::<String>());
        Self {
            id: d.id,
            outbox_id: d.outbox_id,
            topic: d.topic,
            ordering_key: d.ordering_key,
            dedupe_key: d.dedupe_key,
            attributes: d.attributes.0,
            payload_bytes: d.payload.len(),
            payload_preview,
            created_at: d.created_at,
            failed_at: d.failed_at,
            attempts: d.attempts,
            error_kind: d.error_kind,
            last_error: d.last_error,
            source: d.source,
        }
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
}

/// Runs a dead-letter command.
pub async fn run(c: &DeadLettersCommand, pool: &PgPool) -> Result<Exit, OpsError> {
    match c {
        DeadLettersCommand::List(a) => list(a, pool).await,
        DeadLettersCommand::Show(a) => show(a, pool).await,
        DeadLettersCommand::Replay(a) => change(a, pool, "replay").await,
        DeadLettersCommand::Discard(a) => change(a, pool, "discard").await,
    }
}

async fn list(a: &ListArgs, pool: &PgPool) -> Result<Exit, OpsError> {
    let filter = a.selection.filter(&[], None)?;
    // Read-only, inside a transaction (as behind a transaction-mode pooler it must be).
    let mut conn = pool.begin().await?;
    let entries: Vec<Entry> = dead_letter::select(&mut conn, &filter, a.limit, a.before_id)
        .await?
        .into_iter()
        .map(Entry::from)
        .collect();
    if a.common.json {
        print_json(&entries)?;
    } else {
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
                e.failed_at.to_rfc3339(),
                e.error_kind.clone(),
                e.topic.clone(),
                e.ordering_key.clone().unwrap_or_else(|| "-".to_owned()),
                e.dedupe_key.clone(),
                e.attempts.to_string(),
                e.last_error.chars().take(80).collect(),
            ]);
        }
        if t.is_empty() {
            println!("No dead letter matches.");
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

async fn show(a: &ShowArgs, pool: &PgPool) -> Result<Exit, OpsError> {
    // Read-only, inside a transaction (as behind a transaction-mode pooler it must be).
    let mut conn = pool.begin().await?;
    let Some(entry) = dead_letter::get(&mut conn, a.id).await?.map(Entry::from) else {
        eprintln!(
            "error: no dead letter with id {} (dispatcher dead-letters list shows the ids)",
            a.id
        );
        return Ok(Exit::NothingMatched);
    };
    if a.common.json {
        print_json(&entry)?;
    } else {
        println!("id:            {}", entry.id);
        println!("topic:         {}", entry.topic);
        println!(
            "ordering key:  {}",
            entry.ordering_key.as_deref().unwrap_or("-")
        );
        println!("dedupe key:    {}", entry.dedupe_key);
        println!(
            "outbox id:     {}",
            entry.outbox_id.map_or("-".to_owned(), |i| i.to_string())
        );
        println!("source:        {}", entry.source);
        println!("enqueued at:   {}", entry.created_at.to_rfc3339());
        println!("failed at:     {}", entry.failed_at.to_rfc3339());
        println!("attempts:      {}", entry.attempts);
        println!("error kind:    {}", entry.error_kind);
        println!("error:         {}", entry.last_error);
        println!(
            "attributes:    {}",
            serde_json::to_string(&entry.attributes).unwrap_or_default()
        );
        println!("payload:       {} bytes", entry.payload_bytes);
        println!(
            "preview:       {}",
            entry
                .payload_preview
                .as_deref()
                .unwrap_or("(binary: not shown)")
        );
    }
    Ok(Exit::Ok)
}

async fn change(a: &ChangeArgs, pool: &PgPool, action: &'static str) -> Result<Exit, OpsError> {
    if action == "replay" && a.older_than.is_some() {
        return Err(OpsError::Usage(
            "--older-than is for discard; replay takes --failed-before".to_owned(),
        ));
    }
    let filter = a.selection.filter(&a.ids, a.older_than.as_deref())?;
    let by_filter = a.ids.is_empty();
    if by_filter && filter.is_empty() {
        return Err(OpsError::Usage(format!(
            "{action} needs dead letter ids or a filter (--topic, --kind, --ordering-key, --dedupe-prefix, --failed-before/--failed-after, --error-contains{})",
            if action == "discard" {
                ", --older-than"
            } else {
                ""
            }
        )));
    }
    if a.rate.is_nan() || a.rate <= 0.0 {
        return Err(OpsError::Usage(format!(
            "--rate must be above 0, got {}",
            a.rate
        )));
    }
    let reason = a.why.reason()?;
    if by_filter && !a.yes && !a.dry_run {
        return Err(OpsError::Usage(format!(
            "{action} by filter changes every matching dead letter: check with --dry-run, then add --yes"
        )));
    }
    let actor = a.why.actor();
    let selector = serde_json::to_value(&filter).unwrap_or_default();
    let mut report = ChangeReport {
        action,
        dry_run: a.dry_run,
        ids: Vec::new(),
        count: 0,
        skipped: Vec::new(),
        audit_ids: Vec::new(),
    };
    let mut before_id = None;
    loop {
        let started = std::time::Instant::now();
        let mut tx = begin(pool).await?;
        let page: Vec<i64> = dead_letter::select(&mut tx, &filter, a.batch_size, before_id)
            .await?
            .iter()
            .map(|d| d.id)
            .collect();
        let Some(last) = page.last().copied() else {
            break;
        };
        before_id = Some(last);
        if a.dry_run {
            report.ids.extend(&page);
            continue;
        }
        let done = match action {
            "replay" => dead_letter::replay(&mut tx, &page).await?,
            _ => dead_letter::discard(&mut tx, &page).await?,
        };
        report
            .skipped
            .extend(page.iter().filter(|id| !done.contains(id)));
        if !done.is_empty() {
            let entry = Action {
                actor: actor.as_deref(),
                action,
                selector: selector.clone(),
                row_ids: &done,
                reason,
            };
            report.audit_ids.push(audit::record(&mut tx, &entry).await?);
        }
        tx.commit().await?;
        report.ids.extend(&done);
        // Rate limit: at most `rate` entries per second across batches.
        let budget = Duration::from_secs_f64(page.len() as f64 / a.rate);
        if let Some(wait) = budget.checked_sub(started.elapsed()) {
            tokio::time::sleep(wait).await;
        }
        if !a.ids.is_empty() {
            break;
        }
    }
    report.count = report.ids.len();
    if a.common.json {
        print_json(&report)?;
    } else {
        let verb = match (action, a.dry_run) {
            ("replay", true) => "would replay",
            ("replay", false) => "replayed",
            (_, true) => "would discard",
            (_, false) => "discarded",
        };
        println!("{verb} {} dead letter(s): {:?}", report.count, report.ids);
        if !report.skipped.is_empty() {
            println!(
                "left in place (the dedupe key is in the outbox already): {:?}",
                report.skipped
            );
        }
    }
    if !a.ids.is_empty() && !a.dry_run {
        let unknown: Vec<i64> = a
            .ids
            .iter()
            .copied()
            .filter(|id| !report.ids.contains(id) && !report.skipped.contains(id))
            .collect();
        if !unknown.is_empty() {
            eprintln!("error: no dead letter with id(s) {unknown:?}");
            return Ok(if report.count == 0 {
                Exit::NothingMatched
            } else {
                Exit::Failed
            });
        }
    }
    Ok(if report.count == 0 {
        Exit::NothingMatched
    } else {
        Exit::Ok
    })
}
