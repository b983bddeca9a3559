//! pubsub-outbox producer: a batch job that enqueues new BigQuery rows into `pubsub_outbox`,
//! exactly once per source row, across reruns, crashes, retries and overlapping executions.
//!
//! Layout (data flows top to bottom):
//! - [`cli`]: flags and env (clap) → [`settings`]; [`config`]: the streams file (TOML), validated
//!   on load.
//! - [`job`]: one execution: this Cloud Run task's streams, run in turn ([`job::run_job`]), each
//!   in the mode the settings choose:
//! - [`run`]: one stream's run: lock, watermark, query, one transaction per page
//!   ([`run::run_stream`]; the exactly-once argument is in its module doc), or [`dry_run`]: the
//!   same reading without writing. Both iterate [`reader`]: the lower bound, the query, its pages,
//!   the mapping and the cursor-order check.
//! - [`bigquery`]: the only code calling BigQuery: the [`bigquery::Api`] seam and the paging loop.
//! - [`mapping`]: a result row → a message or a rejection; [`value`]: BigQuery cells → JSON;
//!   [`decimal`]: exact NUMERIC and TIMESTAMP text; [`cursor`]: the typed stream position.
//! - [`report`]: summaries, progress, exit code; [`errors`]: what failed and what to do;
//!   [`sidecar`]: the sidecar stopped when the run ends.
//! - [`ops`]: the operator's commands (`streams`, `rewind`), beside the job: they read and move
//!   watermarks through the store, never BigQuery.
//!
//! No module imports one that imports it back: `job` → `run`, `dry_run` → `reader` → `mapping`
//! → `cursor` → `bigquery`; `settings`, `errors`, `config`, `decimal` sit below them; `cli` →
//! `ops` → `cursor`, `value` (ARCHITECTURE.md draws the graph).
//!
//! All SQL lives in `outbox_shared::store` (outbox, dead_letter, watermark, run_ledger, notify,
//! audit).

pub mod bigquery;
pub mod cli;
pub mod config;
pub mod cursor;
pub mod decimal;
pub mod dry_run;
pub mod errors;
pub mod job;
pub mod mapping;
pub mod ops;
mod reader;
pub mod report;
pub mod run;
pub mod settings;
pub mod sidecar;
mod trace;
pub mod value;

use outbox_runtime::shutdown::Shutdown;

pub use cli::{Cli, Command, RunArgs};
pub use config::{LoadOptions, StreamsConfig};
pub use errors::{ConfigError, ErrorKind, StreamError};
pub use job::{run_job, select_streams};
pub use report::{JobReport, StreamOutcome, StreamSummary};
pub use run::run_stream;
pub use settings::{OnOverlap, Settings};

/// Why the job could not start (no stream ran).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartupError {
    /// The streams file or the stream selection is invalid (exit code 2).
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// PostgreSQL is unreachable.
    #[error(transparent)]
    Connect(#[from] outbox_runtime::db::ConnectError),
    /// The migrations failed.
    #[error(transparent)]
    Database(#[from] outbox_shared::Error),
    /// The producer cannot work through the configured connection pooler.
    #[error(
        "--db-pooler transaction: producer run holds each stream's lock for the whole run on a \
         session of its own (a session advisory lock), which a transaction-mode pooler does not \
         keep. Point the producer at the database directly (the Cloud SQL Auth Proxy is not a \
         pooler) or through a session-mode pooler, and keep --db-pooler none or session"
    )]
    TransactionPooler,
    /// The BigQuery client could not be built.
    #[error(
        "{0}. Check --bigquery-endpoint / --bigquery-credentials (GOOGLE_APPLICATION_CREDENTIALS)"
    )]
    BigQuery(#[from] bigquery::ApiError),
}

impl outbox_runtime::exit::Failure for StartupError {
    /// Configuration: an invalid streams file or flag, a DATABASE_URL that is malformed or names a
    /// database or role the server refuses, a schema set up wrong for this role, a BigQuery
    /// client that cannot be built from the flags (retrying cannot help).
    fn is_configuration(&self) -> bool {
        match self {
            Self::Config(_) | Self::TransactionPooler => true,
            Self::Connect(e) => e.is_configuration(),
            Self::Database(e) => e.is_configuration(),
            Self::BigQuery(e) => e.kind != bigquery::ApiErrorKind::Transient,
        }
    }
}

/// `producer run`: load and check the streams file, connect, run this task's streams.
pub async fn execute(args: &RunArgs, shutdown: &Shutdown) -> Result<JobReport, StartupError> {
    if args.database.pooler.per_transaction() {
        return Err(StartupError::TransactionPooler);
    }
    let settings = args.settings();
    let options = LoadOptions {
        pubsub_project: settings.pubsub_project.clone(),
        dedupe_attribute: settings.dedupe_attribute.clone(),
    };
    let config = StreamsConfig::load(&args.job.config, &options)?;
    if args.bigquery.bigquery_project.is_empty() {
        return Err(ConfigError::flag(
            "--bigquery-project",
            vec!["set --bigquery-project or BIGQUERY_PROJECT_ID".into()],
        )
        .into());
    }
    let streams = select_streams(&config, &settings)?;
    let pool = outbox_runtime::db::connect(&args.database, "pubsub-outbox-producer").await?;
    if args.job.migrate {
        outbox_shared::db::migrate(&pool).await?;
    }
    // A run on a schema behind this release stops here (exit 2, what to run), not at its first
    // statement on a missing table.
    outbox_shared::db::ensure_schema(&pool).await?;
    let client = bigquery::connect(
        args.bigquery.bigquery_endpoint.as_deref(),
        args.bigquery.bigquery_credentials,
    )
    .await?;
    let bq = bigquery::BigQuery::new(
        client,
        args.bigquery.bigquery_project.clone(),
        args.timeouts(),
    );
    let report = run_job(&pool, &bq, &streams, &settings, shutdown).await;
    pool.close().await;
    Ok(report)
}
