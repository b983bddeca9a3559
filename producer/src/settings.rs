//! How the job runs: the settings built from the command line (tests build them directly).

use std::time::Duration;

/// `--page-size`: a cap; pages are sized by `--page-bytes`.
pub const DEFAULT_PAGE_ROWS: u32 = 50_000;
/// `--page-bytes`: 3 MiB (BigQuery cuts a page at ~10 MB). Measured against 4 MiB
/// (docs/benchmarks/2026-12-02-producer.md): the same rows/s at 0 and 150 ms per call, 93
/// against 131 MiB peak for 1,000,000 rows.
pub const DEFAULT_PAGE_BYTES: usize = 3 << 20;
/// `--read-parallelism`.
pub const DEFAULT_PARALLEL_READS: usize = 4;

/// What to do when another execution is running the same stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum OnOverlap {
    /// Exit this stream's run at once (success, outcome "skipped"); the running one does the work.
    #[default]
    Skip,
    /// Wait for the other execution to finish, then read what is new after it.
    Wait,
}

/// How the job runs (built from the command line; tests build it directly).
#[derive(Debug, Clone)]
pub struct Settings {
    /// At most this many BigQuery rows per page (one PostgreSQL transaction in page mode).
    pub page_size: u32,
    /// BigQuery pages of about this many bytes on the wire.
    pub page_bytes: usize,
    /// Row ranges of one result read at once.
    pub parallel_reads: usize,
    /// What to do when the stream is already running elsewhere.
    pub on_overlap: OnOverlap,
    /// Read and map, but write nothing.
    pub dry_run: bool,
    /// Sample messages a dry run reports per stream.
    pub dry_run_sample: usize,
    /// NOTIFY channel the dispatcher listens on.
    pub notify_channel: String,
    /// Attribute name the dispatcher adds with the dedupe key (counted in the limits).
    pub dedupe_attribute: String,
    /// Project of short topic names (empty: topics must be full names).
    pub pubsub_project: String,
    /// Who runs (recorded in `producer_run.executor`).
    pub executor: String,
    /// How often long runs log progress.
    pub progress_interval: Duration,
    /// This task's index among `task_count`.
    pub task_index: usize,
    /// Parallel tasks sharing the streams.
    pub task_count: usize,
    /// Only these streams (empty: all).
    pub only_streams: Vec<String>,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            page_size: DEFAULT_PAGE_ROWS,
            page_bytes: DEFAULT_PAGE_BYTES,
            parallel_reads: DEFAULT_PARALLEL_READS,
            on_overlap: OnOverlap::Skip,
            dry_run: false,
            dry_run_sample: 10,
            notify_channel: outbox_shared::store::notify::DEFAULT_CHANNEL.to_owned(),
            dedupe_attribute: outbox_shared::DEFAULT_DEDUPE_ATTRIBUTE.to_owned(),
            pubsub_project: String::new(),
            executor: executor_id(),
            progress_interval: Duration::from_secs(10),
            task_index: 0,
            task_count: 1,
            only_streams: Vec::new(),
        }
    }
}

/// `CLOUD_RUN_EXECUTION/CLOUD_RUN_TASK_INDEX` on Cloud Run, else the host name.
pub fn executor_id() -> String {
    match std::env::var("CLOUD_RUN_EXECUTION") {
        Ok(execution) => {
            format!(
                "{execution}/{}",
                std::env::var("CLOUD_RUN_TASK_INDEX").unwrap_or_else(|_| "0".into())
            )
        }
        Err(_) => std::env::var("HOSTNAME").unwrap_or_else(|_| "local".into()),
    }
}
