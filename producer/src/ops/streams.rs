//! `producer streams`: each stream's watermark and last runs, as the database has them.
//!
//! A stream is listed once it has a watermark (a page committed) or a run (even a skipped or
//! failed one). Read-only: it takes no lock, so it also shows a stream while it runs.

use std::collections::BTreeMap;

use chrono::{DateTime, SecondsFormat, Utc};
use outbox_runtime::operator::{Command, Common, Exit, OpsError, Output, near};
use outbox_runtime::table::Table;
use outbox_shared::store::run_ledger::{self, Run};
use outbox_shared::store::watermark::{self, Watermark};
use serde::Serialize;
use sqlx::{PgConnection, PgPool};

use super::PositionView;

/// `producer streams [STREAM...]`.
#[derive(Debug, Clone, clap::Args)]
pub struct StreamsArgs {
    #[command(flatten)]
    pub common: Common,
    /// Show only these streams (exit 3 if one has neither a watermark nor a run).
    #[arg(value_name = "STREAM")]
    pub streams: Vec<String>,
    /// Runs shown per stream, newest first.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(i64).range(1..=100))]
    pub runs: i64,
}

/// `producer streams --json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StreamsView {
    /// The streams shown, by name.
    pub streams: Vec<StreamView>,
}

/// One stream in `--json` output.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StreamView {
    /// Stream name.
    pub stream: String,
    /// The stored watermark; null until a run has committed a page.
    pub watermark: Option<WatermarkView>,
    /// The last runs, newest first.
    pub runs: Vec<RunView>,
}

/// A watermark in `--json` output.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct WatermarkView {
    /// Everything at or before this position is enqueued.
    #[serde(flatten)]
    pub position: PositionView,
    /// When it last moved.
    pub updated_at: String,
    /// The run that moved it (null after a rewind).
    pub run_id: Option<i64>,
}

/// A run in `--json` output.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RunView {
    /// Run id (`producer_run.id`).
    pub id: i64,
    /// running, succeeded, failed, skipped or abandoned.
    pub outcome: String,
    /// Cloud Run execution/task or host name.
    pub executor: String,
    /// RFC 3339.
    pub started_at: String,
    /// RFC 3339; null while running.
    pub finished_at: Option<String>,
    /// Rows read from BigQuery.
    pub rows_fetched: i64,
    /// Rows enqueued.
    pub rows_enqueued: i64,
    /// Rows whose dedupe key was already enqueued.
    pub rows_duplicate: i64,
    /// Rows dead-lettered.
    pub rows_rejected: i64,
    /// BigQuery bytes processed, when known.
    pub bytes_processed: Option<i64>,
    /// Why it failed or was abandoned.
    pub error: Option<String>,
}

fn time(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Micros, true)
}

impl From<Watermark> for WatermarkView {
    fn from(w: Watermark) -> Self {
        Self {
            position: PositionView::from(&w.cursor),
            updated_at: time(w.updated_at),
            run_id: w.run_id,
        }
    }
}

impl From<Run> for RunView {
    fn from(r: Run) -> Self {
        Self {
            id: r.id,
            outcome: r.outcome,
            executor: r.executor,
            started_at: time(r.started_at),
            finished_at: r.finished_at.map(time),
            rows_fetched: r.rows_fetched,
            rows_enqueued: r.rows_enqueued,
            rows_duplicate: r.rows_duplicate,
            rows_rejected: r.rows_rejected,
            bytes_processed: r.bytes_processed,
            error: r.error,
        }
    }
}

/// The streams the database knows, by name, each with its watermark and `runs` last runs.
pub async fn read(conn: &mut PgConnection, runs: i64) -> Result<Vec<StreamView>, OpsError> {
    let mut streams: BTreeMap<String, StreamView> = BTreeMap::new();
    let view = |stream: &str| StreamView {
        stream: stream.to_owned(),
        watermark: None,
        runs: Vec::new(),
    };
    for w in watermark::list(conn).await? {
        let entry = streams
            .entry(w.stream.clone())
            .or_insert_with(|| view(&w.stream));
        entry.watermark = Some(w.into());
    }
    for r in run_ledger::recent_per_stream(conn, runs).await? {
        let entry = streams
            .entry(r.stream.clone())
            .or_insert_with(|| view(&r.stream));
        entry.runs.push(r.into());
    }
    Ok(streams.into_values().collect())
}

/// A checked `producer streams`.
#[derive(Debug, Clone)]
pub struct Selection {
    streams: Vec<String>,
    runs: i64,
}

impl Command for StreamsArgs {
    type Checked = Selection;

    fn check(&self, _now: DateTime<Utc>) -> Result<Selection, OpsError> {
        if let Some(blank) = self.streams.iter().find(|s| s.trim().is_empty()) {
            return Err(OpsError::Usage(format!(
                "stream name {blank:?} is empty: name a stream, or give none to list them all"
            )));
        }
        Ok(Selection {
            streams: self.streams.clone(),
            runs: self.runs,
        })
    }

    async fn run(sel: Selection, pool: &PgPool) -> Result<Output, OpsError> {
        // Read-only, inside a transaction (as behind a transaction-mode pooler it must be).
        let mut conn = pool.begin().await?;
        let all = read(&mut conn, sel.runs).await?;
        drop(conn);
        let known: Vec<&str> = all.iter().map(|v| v.stream.as_str()).collect();
        if let Some(problem) = unknown(&sel.streams, &known) {
            return Err(OpsError::NothingMatched(problem));
        }
        let shown: Vec<StreamView> = all
            .into_iter()
            .filter(|v| sel.streams.is_empty() || sel.streams.contains(&v.stream))
            .collect();
        let text = render(&shown);
        Output::new(text, &StreamsView { streams: shown }, Exit::Ok)
    }
}

/// Says which of `asked` the database does not know, with the near matches among `known`.
pub fn unknown(asked: &[String], known: &[&str]) -> Option<String> {
    let missing: Vec<String> = asked
        .iter()
        .filter(|s| !known.contains(&s.as_str()))
        .map(|s| {
            let close = near(s, known.iter().copied());
            if close.is_empty() {
                format!("{s:?}")
            } else {
                format!("{s:?} (did you mean {}?)", close.join(" or "))
            }
        })
        .collect();
    (!missing.is_empty()).then(|| {
        format!(
            "no producer stream named {} (it has never run here); known streams: {}",
            missing.join(", "),
            if known.is_empty() {
                "none".to_owned()
            } else {
                known.join(", ")
            }
        )
    })
}

/// The tables people read: one line per stream, then the runs.
pub fn render(streams: &[StreamView]) -> String {
    if streams.is_empty() {
        return "No producer streams yet: none has a watermark or a run.\n".to_owned();
    }
    let mut overview = Table::new(&["STREAM", "WATERMARK", "KEY", "MOVED", "LAST RUN", "OUTCOME"]);
    let mut runs = Table::new(&[
        "STREAM",
        "RUN",
        "OUTCOME",
        "STARTED",
        "FINISHED",
        "FETCHED",
        "ENQUEUED",
        "DUPLICATE",
        "REJECTED",
        "ERROR",
    ]);
    let dash = || "-".to_owned();
    for s in streams {
        let (at, key, moved) = match &s.watermark {
            Some(w) => (
                w.position
                    .timestamp
                    .clone()
                    .unwrap_or_else(|| w.position.micros.to_string()),
                w.position.key.clone(),
                w.updated_at.clone(),
            ),
            None => ("(none: reads from the start)".to_owned(), dash(), dash()),
        };
        let (last, outcome) = match s.runs.first() {
            Some(r) => (r.id.to_string(), r.outcome.clone()),
            None => (dash(), dash()),
        };
        overview.row(vec![s.stream.clone(), at, key, moved, last, outcome]);
        for r in &s.runs {
            runs.row(vec![
                s.stream.clone(),
                r.id.to_string(),
                r.outcome.clone(),
                r.started_at.clone(),
                r.finished_at.clone().unwrap_or_else(dash),
                r.rows_fetched.to_string(),
                r.rows_enqueued.to_string(),
                r.rows_duplicate.to_string(),
                r.rows_rejected.to_string(),
                r.error.as_deref().map(one_line).unwrap_or_else(dash),
            ]);
        }
    }
    format!("{}\n{}", overview.render(), runs.render())
}

/// An error shortened to one line of at most 100 characters for the table (JSON has it whole).
fn one_line(e: &str) -> String {
    let flat = e.split_whitespace().collect::<Vec<_>>().join(" ");
    match flat.char_indices().nth(100) {
        Some((cut, _)) => format!("{}…", &flat[..cut]),
        None => flat,
    }
}
