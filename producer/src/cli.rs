//! Command line and environment configuration. Every flag has a doc comment (its `--help`), an
//! environment fallback and a default.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand};
use outbox_runtime::db::DatabaseArgs;
use outbox_runtime::telemetry::TelemetryArgs;

use crate::bigquery::{Credentials, Timeouts};
use crate::settings::{OnOverlap, Settings, executor_id};

/// pubsub-outbox producer: enqueues new BigQuery rows into pubsub_outbox, exactly once per row.
///
/// A batch job (e.g. a Cloud Run Job on a schedule): reads what is new since each stream's
/// watermark and exits. Exit codes: 0 every stream succeeded (or was skipped because another
/// execution was running it); 1 a stream failed (its watermark holds the last committed chunk, a
/// rerun resumes there); 2 invalid streams config or arguments.
#[derive(Debug, Parser)]
#[command(name = "producer", version, about, long_about)]
pub struct Cli {
    /// What to do (default: run).
    #[command(subcommand)]
    pub command: Option<Command>,
    #[command(flatten)]
    pub database: DatabaseArgs,
    #[command(flatten)]
    pub telemetry: TelemetryArgs,
    #[command(flatten)]
    pub run: RunArgs,
    #[command(flatten)]
    pub bigquery: BigQueryArgs,
}

/// Subcommands.
#[derive(Debug, Clone, Copy, Subcommand)]
pub enum Command {
    /// Read every stream's new rows into the outbox, then exit (the default).
    Run,
    /// Apply the database migrations and exit.
    Migrate,
}

/// What to run and how. Global: they may follow the subcommand (`producer run --dry-run`).
#[derive(Debug, Clone, clap::Args)]
pub struct RunArgs {
    /// The streams file (TOML; see examples/streams.toml).
    #[arg(
        global = true,
        long,
        env = "OUTBOX_PRODUCER_CONFIG",
        default_value = "streams.toml"
    )]
    pub config: PathBuf,
    /// Apply pending migrations before running (otherwise run `producer migrate` first).
    #[arg(global = true, long, env = "OUTBOX_MIGRATE")]
    pub migrate: bool,
    /// Ask BigQuery for the bytes each query would process, run it, and print what would be
    /// enqueued; write nothing (the query is billed as usual, within maximum_bytes_billed).
    #[arg(global = true, long, env = "OUTBOX_PRODUCER_DRY_RUN")]
    pub dry_run: bool,
    /// Sample messages a dry run prints per stream.
    #[arg(
        global = true,
        long,
        env = "OUTBOX_PRODUCER_DRY_RUN_SAMPLE",
        default_value_t = 10
    )]
    pub dry_run_sample: usize,
    /// BigQuery rows per page; each page is one PostgreSQL transaction (memory is bounded by it).
    #[arg(global = true, long, env = "OUTBOX_PRODUCER_PAGE_SIZE", default_value_t = 1000,
          value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub page_size: u32,
    /// When another execution is running a stream: skip it (exit 0, logged) or wait for it.
    #[arg(
        global = true,
        long,
        env = "OUTBOX_PRODUCER_ON_OVERLAP",
        value_enum,
        default_value = "skip"
    )]
    pub on_overlap: OnOverlap,
    /// Run only these streams (repeat the flag, or comma-separate in the env var).
    #[arg(
        global = true,
        long = "stream",
        env = "OUTBOX_PRODUCER_STREAMS",
        value_delimiter = ','
    )]
    pub streams: Vec<String>,
    /// NOTIFY channel sent once per committed chunk (the dispatcher LISTENs on it).
    #[arg(global = true, long, env = "OUTBOX_NOTIFY_CHANNEL", default_value = outbox_shared::store::notify::DEFAULT_CHANNEL)]
    pub notify_channel: String,
    /// Attribute the dispatcher adds with the dedupe key (counted against Pub/Sub's limits).
    #[arg(
        global = true,
        long,
        env = "OUTBOX_DEDUPE_ATTRIBUTE",
        default_value = outbox_shared::DEFAULT_DEDUPE_ATTRIBUTE
    )]
    pub dedupe_attribute: String,
    /// Pub/Sub project of short topic names in the streams file (full names need none).
    #[arg(global = true, long, env = "PUBSUB_PROJECT_ID", default_value = "")]
    pub pubsub_project: String,
    /// This task's index (Cloud Run sets it): runs the streams i with i % count == index.
    #[arg(global = true, long, env = "CLOUD_RUN_TASK_INDEX", default_value_t = 0)]
    pub task_index: usize,
    /// Number of parallel tasks sharing the streams (Cloud Run sets it).
    #[arg(global = true, long, env = "CLOUD_RUN_TASK_COUNT", default_value_t = 1)]
    pub task_count: usize,
    /// How often a long run logs its progress (rows, rows/s, watermark).
    #[arg(global = true, long, env = "OUTBOX_PRODUCER_PROGRESS_INTERVAL", default_value = "10s",
          value_parser = humantime::parse_duration)]
    pub progress_interval: Duration,
}

/// Where BigQuery is and how to reach it.
#[derive(Debug, Clone, clap::Args)]
pub struct BigQueryArgs {
    /// Project the query jobs run in (and are billed to). Required by `run`.
    #[arg(global = true, long, env = "BIGQUERY_PROJECT_ID", default_value = "")]
    pub bigquery_project: String,
    /// Endpoint override, e.g. http://127.0.0.1:9050 for bqemulator (REST base <it>/bigquery/v2).
    /// Unset: BigQuery itself.
    #[arg(global = true, long, env = "BIGQUERY_EMULATOR_HOST")]
    pub bigquery_endpoint: Option<String>,
    /// Credentials: auto (anonymous with a plain-HTTP endpoint override such as an emulator, else
    /// Application Default Credentials: Workload Identity / the Cloud Run service account / a key
    /// file; an https endpoint, e.g. a regional one, uses ADC), adc, anonymous.
    #[arg(
        global = true,
        long,
        env = "OUTBOX_BIGQUERY_CREDENTIALS",
        value_enum,
        default_value = "auto"
    )]
    pub bigquery_credentials: Credentials,
    /// Time limit of one BigQuery HTTP call (retried when transient).
    #[arg(global = true, long, env = "OUTBOX_BIGQUERY_REQUEST_TIMEOUT", default_value = "2m",
          value_parser = humantime::parse_duration)]
    pub bigquery_request_timeout: Duration,
    /// How long a query job may run before the stream fails.
    #[arg(global = true, long, env = "OUTBOX_BIGQUERY_JOB_TIMEOUT", default_value = "30m",
          value_parser = humantime::parse_duration)]
    pub bigquery_job_timeout: Duration,
}

impl Cli {
    /// The job settings these arguments describe.
    pub fn settings(&self) -> Settings {
        let r = &self.run;
        Settings {
            page_size: r.page_size,
            on_overlap: r.on_overlap,
            dry_run: r.dry_run,
            dry_run_sample: r.dry_run_sample,
            notify_channel: r.notify_channel.clone(),
            dedupe_attribute: r.dedupe_attribute.clone(),
            pubsub_project: r.pubsub_project.clone(),
            executor: executor_id(),
            progress_interval: r.progress_interval,
            task_index: r.task_index,
            task_count: r.task_count,
            only_streams: r.streams.clone(),
        }
    }

    /// BigQuery time limits.
    pub fn timeouts(&self) -> Timeouts {
        Timeouts {
            request: self.bigquery.bigquery_request_timeout,
            job: self.bigquery.bigquery_job_timeout,
            ..Timeouts::default()
        }
    }
}
