//! Command line and environment configuration. Every flag has a doc comment (its `--help`), an
//! environment fallback and a default, and each command takes only the flags it uses: `run`
//! the job's, `migrate` the database's, `streams` and `rewind` theirs ([`crate::ops`]).
//!
//! `run` is the default command, and its flags may come before or after it
//! (`producer --config x run`, `producer run --config x`, `producer --config x`):
//! [`Cli::parse_args`] applies both binaries' one rule, [`outbox_runtime::cli::run_first`], before
//! clap parses. Flags before any other command stay where they are, and clap refuses them.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use clap::{CommandFactory, Parser, Subcommand};
use outbox_runtime::cli::run_first;
use outbox_runtime::db::DatabaseArgs;
use outbox_runtime::telemetry::TelemetryArgs;
use outbox_runtime::traces::TraceArgs;

use crate::bigquery::{Credentials, Timeouts};
use crate::ops::OpsCommand;
use crate::settings::{self, OnOverlap, Settings, executor_id};

/// pubsub-outbox producer: enqueues new BigQuery rows into pubsub_outbox, exactly once per row.
///
/// A batch job (e.g. a Cloud Run Job on a schedule): reads what is new since each stream's
/// watermark and exits. `run` is the default command, and its flags may also precede it
/// (`producer --config streams.toml run`). Exit codes: 0 every stream succeeded (or was skipped
/// because another execution was running it); 1 a stream failed (its watermark holds the last
/// committed chunk, a rerun resumes there); 2 invalid streams config, configuration or
/// arguments; 3 an operator command matched nothing.
#[derive(Debug, Parser)]
#[command(
    name = "producer",
    version = outbox_runtime::release::LONG_VERSION,
    about,
    long_about,
    subcommand_required = true,
    after_help = "Examples:\n  producer migrate\n  producer --config streams.toml run\n  \
                        producer run --config streams.toml --dry-run\n  producer streams --json\n  \
                        producer rewind orders --to 2h --reason \"late rows, INC-1234\""
)]
pub struct Cli {
    /// What to do (default: run).
    #[command(subcommand)]
    pub command: Command,
}

impl Cli {
    /// Parses the process's arguments (exits with clap's message and code 2 on bad usage).
    pub fn parse_args() -> Self {
        Self::parse_from(run_first(&Self::command(), std::env::args_os().collect()))
    }

    /// Parses `args` (the program name first), as [`Cli::parse_args`] does.
    pub fn try_parse_args<I, T>(args: I) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<OsString>,
    {
        let args = run_first(&Self::command(), args.into_iter().map(Into::into).collect());
        Self::try_parse_from(args)
    }

    /// The tracing flags, for `run` (the other commands trace nothing).
    pub fn traces(&self) -> Option<&TraceArgs> {
        match &self.command {
            Command::Run(a) => Some(&a.traces),
            _ => None,
        }
    }

    /// The logging flags of whatever command runs.
    pub fn telemetry(&self) -> &TelemetryArgs {
        match &self.command {
            Command::Run(a) => &a.telemetry,
            Command::Migrate(a) => &a.telemetry,
            Command::Ops(op) => op.telemetry(),
        }
    }
}

/// Subcommands.
// Parsed once at start-up: the size of the largest variant does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, Subcommand)]
pub enum Command {
    /// Read every stream's new rows into the outbox, then exit (the default).
    #[command(after_help = "Examples:\n  producer run --config streams.toml\n  \
                            producer --config streams.toml run --dry-run --stream orders")]
    Run(RunArgs),
    /// Apply the database migrations and exit.
    #[command(after_help = "Example:\n  producer migrate --database-url postgres://user@host/db")]
    Migrate(MigrateArgs),
    #[command(flatten)]
    Ops(OpsCommand),
}

/// Everything `run` takes.
#[derive(Debug, Clone, clap::Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub database: DatabaseArgs,
    #[command(flatten)]
    pub telemetry: TelemetryArgs,
    #[command(flatten)]
    pub traces: TraceArgs,
    #[command(flatten)]
    pub job: JobArgs,
    #[command(flatten)]
    pub bigquery: BigQueryArgs,
}

pub use outbox_runtime::db::MigrateArgs;

/// What to run and how.
#[derive(Debug, Clone, clap::Args)]
pub struct JobArgs {
    /// The streams file (TOML; see examples/streams.toml).
    #[arg(long, env = "OUTBOX_PRODUCER_CONFIG", default_value = "streams.toml")]
    pub config: PathBuf,
    /// Apply pending migrations before running (otherwise run `producer migrate` first).
    #[arg(long, env = "OUTBOX_MIGRATE")]
    pub migrate: bool,
    /// Ask BigQuery for the bytes each query would process, run it, and print what would be
    /// enqueued; write nothing (the query is billed as usual, within maximum_bytes_billed).
    #[arg(long, env = "OUTBOX_PRODUCER_DRY_RUN")]
    pub dry_run: bool,
    /// Sample messages a dry run prints per stream.
    #[arg(long, env = "OUTBOX_PRODUCER_DRY_RUN_SAMPLE", default_value_t = 10)]
    pub dry_run_sample: usize,
    /// At most this many BigQuery rows per page (pages are sized by --page-bytes); in page mode
    /// each page is one PostgreSQL transaction.
    #[arg(long, env = "OUTBOX_PRODUCER_PAGE_SIZE", default_value_t = settings::DEFAULT_PAGE_ROWS,
          value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub page_size: u32,
    /// BigQuery pages of about this many bytes on the wire (64 KiB to 10 MiB; the first page is
    /// at most 1,000 rows, then the rows per page follow from the row size seen). Memory holds
    /// about (--read-parallelism + 3) pages.
    #[arg(long, env = "OUTBOX_PRODUCER_PAGE_BYTES", default_value_t = settings::DEFAULT_PAGE_BYTES as u64,
          value_parser = clap::value_parser!(u64).range(65_536..=10_485_760))]
    pub page_bytes: u64,
    /// Pages of one result read from BigQuery at once (row ranges by startIndex, committed
    /// strictly in order); 1 reads one page after another. The next pages are read while the
    /// current one commits either way.
    #[arg(long, env = "OUTBOX_PRODUCER_READ_PARALLELISM", default_value_t = settings::DEFAULT_PARALLEL_READS as u64,
          value_parser = clap::value_parser!(u64).range(1..=16))]
    pub read_parallelism: u64,
    /// When another execution is running a stream: skip it (exit 0, logged) or wait for it.
    #[arg(
        long,
        env = "OUTBOX_PRODUCER_ON_OVERLAP",
        value_enum,
        default_value = "skip"
    )]
    pub on_overlap: OnOverlap,
    /// Run only these streams (repeat the flag, or comma-separate in the env var).
    #[arg(
        long = "stream",
        env = "OUTBOX_PRODUCER_STREAMS",
        value_delimiter = ','
    )]
    pub streams: Vec<String>,
    /// NOTIFY channel sent once per committed chunk (the dispatcher LISTENs on it).
    #[arg(long, env = "OUTBOX_NOTIFY_CHANNEL", default_value = outbox_shared::store::notify::DEFAULT_CHANNEL)]
    pub notify_channel: String,
    /// Attribute the dispatcher adds with the dedupe key (counted against Pub/Sub's limits).
    #[arg(
        long,
        env = "OUTBOX_DEDUPE_ATTRIBUTE",
        default_value = outbox_shared::DEFAULT_DEDUPE_ATTRIBUTE
    )]
    pub dedupe_attribute: String,
    /// Pub/Sub project of short topic names in the streams file (full names need none).
    #[arg(long, env = "PUBSUB_PROJECT_ID", default_value = "")]
    pub pubsub_project: String,
    /// This task's index (Cloud Run sets it): runs the streams i with i % count == index.
    #[arg(long, env = "CLOUD_RUN_TASK_INDEX", default_value_t = 0)]
    pub task_index: usize,
    /// Number of parallel tasks sharing the streams (Cloud Run sets it).
    #[arg(long, env = "CLOUD_RUN_TASK_COUNT", default_value_t = 1)]
    pub task_count: usize,
    /// How often a long run logs its progress (rows, rows/s, watermark).
    #[arg(long, env = "OUTBOX_PRODUCER_PROGRESS_INTERVAL", default_value = "10s",
          value_parser = humantime::parse_duration)]
    pub progress_interval: Duration,
    /// A sidecar to stop when the run ends, however it ends (success, failure, a signal): the
    /// producer POSTs to this URL once as it exits. On Cloud Run, the Cloud SQL Auth Proxy's
    /// http://127.0.0.1:9091/quitquitquit (started with --quitquitquit --admin-port=9091), so
    /// the task ends with the producer. Unset: nothing is called.
    #[arg(long, env = "OUTBOX_SIDECAR_QUIT_URL")]
    pub sidecar_quit_url: Option<String>,
}

/// Where BigQuery is and how to reach it.
#[derive(Debug, Clone, clap::Args)]
pub struct BigQueryArgs {
    /// Project the query jobs run in (and are billed to). Required by `run`.
    #[arg(long, env = "BIGQUERY_PROJECT_ID", default_value = "")]
    pub bigquery_project: String,
    /// Endpoint override, e.g. http://127.0.0.1:9050 for bqemulator (REST base <it>/bigquery/v2).
    /// Unset: BigQuery itself.
    #[arg(long, env = "BIGQUERY_EMULATOR_HOST")]
    pub bigquery_endpoint: Option<String>,
    /// Credentials: auto (anonymous with a plain-HTTP endpoint override such as an emulator, else
    /// Application Default Credentials: Workload Identity / the Cloud Run service account / a key
    /// file; an https endpoint, e.g. a regional one, uses ADC), adc, anonymous.
    #[arg(
        long,
        env = "OUTBOX_BIGQUERY_CREDENTIALS",
        value_enum,
        default_value = "auto"
    )]
    pub bigquery_credentials: Credentials,
    /// Time limit of one BigQuery HTTP call (retried when transient).
    #[arg(long, env = "OUTBOX_BIGQUERY_REQUEST_TIMEOUT", default_value = "2m",
          value_parser = humantime::parse_duration)]
    pub bigquery_request_timeout: Duration,
    /// How long a query job may run before the stream fails.
    #[arg(long, env = "OUTBOX_BIGQUERY_JOB_TIMEOUT", default_value = "30m",
          value_parser = humantime::parse_duration)]
    pub bigquery_job_timeout: Duration,
}

impl RunArgs {
    /// The job settings these arguments describe.
    pub fn settings(&self) -> Settings {
        let r = &self.job;
        Settings {
            page_size: r.page_size,
            page_bytes: usize::try_from(r.page_bytes).unwrap_or(settings::DEFAULT_PAGE_BYTES),
            parallel_reads: usize::try_from(r.read_parallelism).unwrap_or(1),
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

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &str) -> Result<Cli, clap::Error> {
        Cli::try_parse_args(std::iter::once("producer").chain(args.split_whitespace()))
    }

    fn job(cli: &Cli) -> &JobArgs {
        match &cli.command {
            Command::Run(args) => &args.job,
            other => panic!("not run: {other:?}"),
        }
    }

    #[test]
    fn run_flags_go_before_or_after_run_or_without_it() {
        let url = "--database-url postgres://u@h/db";
        for args in [
            format!("{url} --config x.toml run"),
            format!("run {url} --config x.toml"),
            format!("{url} --config x.toml"),
            format!("--config x.toml run --page-size 7 {url}"),
        ] {
            let cli = parse(&args).unwrap_or_else(|e| panic!("{args}: {e}"));
            assert_eq!(job(&cli).config, PathBuf::from("x.toml"), "{args}");
        }
        let cli = parse(&format!("--page-size 7 run --dry-run {url}")).expect("both sides");
        assert_eq!((job(&cli).page_size, job(&cli).dry_run), (7, true));
        let cli = parse(&format!("--config run run {url}")).expect("a config file named run");
        assert_eq!(job(&cli).config, PathBuf::from("run"));
    }

    #[test]
    fn migrate_and_the_operator_commands_refuse_run_flags() {
        for args in [
            "migrate --database-url postgres://u@h/db --config x.toml",
            "--config x.toml migrate --database-url postgres://u@h/db",
            "streams --database-url postgres://u@h/db --page-size 5",
        ] {
            let e = parse(args)
                .err()
                .unwrap_or_else(|| panic!("{args} is refused"));
            assert_eq!(e.exit_code(), 2, "{args}: {e}");
        }
        let cli = parse("migrate --database-url postgres://u@h/db").expect("migrate alone");
        assert!(matches!(cli.command, Command::Migrate(_)));
        for help in ["--help", "-V"] {
            let e = parse(help)
                .err()
                .unwrap_or_else(|| panic!("{help} prints and exits"));
            assert_eq!(e.exit_code(), 0, "{help} is the top level's: {e}");
        }
    }
}
