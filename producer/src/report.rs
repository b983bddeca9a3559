//! What a run did: per-stream summaries, the job's exit code, the table printed for people, and
//! periodic progress logs for long runs.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use crate::cursor::Position;
use crate::errors::StreamError;

/// How a stream's run ended without error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamOutcome {
    /// Read everything new and enqueued it.
    Succeeded,
    /// Another execution held the stream (`--on-overlap skip`).
    Skipped,
    /// `--dry-run`: read and mapped, nothing written.
    DryRun,
}

/// One stream's run. Invariant: `fetched = enqueued + duplicates + rejected` (not for dry runs,
/// which cannot tell duplicates: there `enqueued` counts messages that would be offered).
#[derive(Debug, Clone, PartialEq)]
pub struct StreamSummary {
    /// Stream name.
    pub stream: String,
    /// How it ended.
    pub outcome: StreamOutcome,
    /// `producer_run.id` (None for dry runs).
    pub run_id: Option<i64>,
    /// Rows read from BigQuery.
    pub fetched: u64,
    /// Rows inserted into the outbox.
    pub enqueued: u64,
    /// Rows whose dedupe key was already in the outbox or the dead-letter table.
    pub duplicates: u64,
    /// Rows newly sent to the dead-letter table.
    pub rejected: u64,
    /// The stored watermark afterwards (dry run: where it would be).
    pub watermark: Option<Position>,
    /// Bytes BigQuery processed (dry run: its estimate).
    pub bytes_processed: Option<i64>,
    /// Wall time.
    pub elapsed: Duration,
    /// Of `elapsed`, the time the commits waited for BigQuery's next page (the query, the first
    /// page, and every page not yet read when the previous one had committed): near `elapsed`,
    /// the run is bound by BigQuery; near zero, by PostgreSQL.
    pub waited_for_bigquery: Duration,
    /// Dry run only: the first messages that would be enqueued or rejected.
    pub samples: Vec<serde_json::Value>,
}

impl StreamSummary {
    pub(crate) fn new(stream: &str, outcome: StreamOutcome) -> Self {
        Self {
            stream: stream.to_owned(),
            outcome,
            run_id: None,
            fetched: 0,
            enqueued: 0,
            duplicates: 0,
            rejected: 0,
            watermark: None,
            bytes_processed: None,
            elapsed: Duration::ZERO,
            waited_for_bigquery: Duration::ZERO,
            samples: Vec::new(),
        }
    }

    /// The summary log line (INFO), with stable field names.
    pub fn log(&self) {
        // How far behind now the watermark stands (the dashboard's producer lag, a logs-based
        // metric); absent before the first row.
        let lag = self.watermark.as_ref().map(|w| {
            let now = chrono::Utc::now().timestamp_micros();
            (now.saturating_sub(w.micros) as f64 / 1e6).max(0.0)
        });
        tracing::info!(
            stream = %self.stream,
            outcome = ?self.outcome,
            run_id = self.run_id,
            rows.fetched = self.fetched,
            rows.enqueued = self.enqueued,
            rows.duplicate = self.duplicates,
            rows.rejected = self.rejected,
            watermark = %self.watermark.as_ref().map(ToString::to_string).unwrap_or_default(),
            watermark_lag_seconds = lag,
            bytes_processed = self.bytes_processed,
            elapsed_ms = self.elapsed.as_millis() as u64,
            waited_for_bigquery_ms = self.waited_for_bigquery.as_millis() as u64,
            "Stream summary."
        );
    }
}

/// One stream of the job: its summary or its error.
#[derive(Debug)]
pub struct StreamReport {
    /// Stream name.
    pub stream: String,
    /// What happened.
    pub result: Result<StreamSummary, StreamError>,
}

/// Every stream this task ran.
#[derive(Debug, Default)]
pub struct JobReport {
    /// In run order.
    pub streams: Vec<StreamReport>,
}

impl JobReport {
    /// Whether every stream succeeded (or was skipped / dry-run).
    pub fn succeeded(&self) -> bool {
        self.streams.iter().all(|s| s.result.is_ok())
    }

    /// The process exit code: 0 when every stream succeeded, 1 otherwise (so Cloud Run retries).
    pub fn exit_code(&self) -> u8 {
        if self.succeeded() { 0 } else { 1 }
    }

    /// A table for people (stdout), then the sample messages of a dry run.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{:<24} {:<10} {:>10} {:>10} {:>10} {:>9} {:>14}  watermark",
            "stream", "outcome", "fetched", "enqueued", "duplicate", "rejected", "bytes"
        );
        for s in &self.streams {
            match &s.result {
                Ok(r) => {
                    let _ = writeln!(
                        out,
                        "{:<24} {:<10} {:>10} {:>10} {:>10} {:>9} {:>14}  {}",
                        r.stream,
                        format!("{:?}", r.outcome).to_lowercase(),
                        r.fetched,
                        r.enqueued,
                        r.duplicates,
                        r.rejected,
                        r.bytes_processed
                            .map(|b| b.to_string())
                            .unwrap_or_else(|| "-".into()),
                        r.watermark
                            .as_ref()
                            .map(ToString::to_string)
                            .unwrap_or_else(|| "-".into())
                    );
                }
                Err(e) => {
                    let _ = writeln!(out, "{:<24} {:<10} {e}", s.stream, "FAILED");
                }
            }
        }
        for r in self.streams.iter().filter_map(|s| s.result.as_ref().ok()) {
            if r.outcome == StreamOutcome::DryRun {
                let _ = writeln!(
                    out,
                    "\n# {}: first {} message(s) that would be written",
                    r.stream,
                    r.samples.len()
                );
                for sample in &r.samples {
                    let _ = writeln!(out, "{sample}");
                }
            }
        }
        out
    }
}

/// Logs progress at INFO every `interval`: rows, rows/s, watermark.
#[derive(Debug)]
pub(crate) struct Progress {
    started: Instant,
    last: Instant,
    interval: Duration,
}

impl Progress {
    pub(crate) fn new(interval: Duration) -> Self {
        let now = Instant::now();
        Self {
            started: now,
            last: now,
            interval,
        }
    }

    pub(crate) fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    pub(crate) fn tick(&mut self, stream: &str, rows: u64, watermark: Option<&Position>) {
        if self.last.elapsed() < self.interval {
            return;
        }
        self.last = Instant::now();
        let secs = self.started.elapsed().as_secs_f64().max(0.001);
        tracing::info!(
            stream,
            rows,
            rows_per_sec = (rows as f64 / secs).round() as u64,
            watermark = %watermark.map(ToString::to_string).unwrap_or_default(),
            "Progress."
        );
    }
}
