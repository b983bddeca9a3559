//! Command line and environment configuration. Every flag has a doc comment (its `--help`), an
//! environment fallback and a default.

use std::net::SocketAddr;
use std::time::Duration;

use clap::{Parser, Subcommand};
use outbox_shared::db::DatabaseArgs;
use outbox_shared::telemetry::TelemetryArgs;

use crate::publisher::PubsubArgs;

/// pubsub-outbox dispatcher: drains the pubsub_outbox table to Google Cloud Pub/Sub.
#[derive(Debug, Parser)]
#[command(name = "dispatcher", version, about, long_about = None)]
pub struct Cli {
    /// What to do (default: run).
    #[command(subcommand)]
    pub command: Option<Command>,
    #[command(flatten)]
    pub database: DatabaseArgs,
    #[command(flatten)]
    pub telemetry: TelemetryArgs,
    #[command(flatten)]
    pub pubsub: PubsubArgs,
    #[command(flatten)]
    pub dispatch: DispatchArgs,
}

/// Subcommands.
#[derive(Debug, Clone, Copy, Subcommand)]
pub enum Command {
    /// Run the dispatcher until SIGTERM/SIGINT (the default).
    Run,
    /// Apply the database migrations and exit.
    Migrate,
}

/// Dispatching knobs.
#[derive(Debug, Clone, clap::Args)]
pub struct DispatchArgs {
    /// Apply pending migrations before starting (otherwise run `dispatcher migrate` first).
    #[arg(long, env = "OUTBOX_MIGRATE")]
    pub migrate: bool,
    /// Concurrent workers in this process (each holds one database connection while a batch is
    /// in flight).
    #[arg(long, env = "OUTBOX_WORKERS", default_value_t = 4)]
    pub workers: usize,
    /// Rows claimed per batch (1..=1000; Pub/Sub takes at most 1,000 messages per request).
    #[arg(long, env = "OUTBOX_BATCH_SIZE", default_value_t = 500)]
    pub batch_size: i64,
    /// Payload bytes in flight across all workers of this process.
    #[arg(long, env = "OUTBOX_MAX_INFLIGHT_BYTES", default_value_t = 64 * 1024 * 1024)]
    pub max_inflight_bytes: u64,
    /// Longest a claimed batch may stay locked: the server ends a claim transaction idle this
    /// long (a hung dispatcher), making its rows claimable again. Keep it above
    /// --publish-timeout.
    #[arg(long, env = "OUTBOX_LOCK_TIMEOUT", default_value = "60s", value_parser = humantime::parse_duration)]
    pub lock_timeout: Duration,
    /// Delay before the first retry of a transiently failed message.
    #[arg(long, env = "OUTBOX_BACKOFF_BASE", default_value = "1s", value_parser = humantime::parse_duration)]
    pub backoff_base: Duration,
    /// Longest delay between retries.
    #[arg(long, env = "OUTBOX_BACKOFF_CAP", default_value = "10m", value_parser = humantime::parse_duration)]
    pub backoff_cap: Duration,
    /// Fraction (0..=1) of each retry delay that is randomised away, to spread retries.
    #[arg(long, env = "OUTBOX_BACKOFF_JITTER", default_value_t = 0.2)]
    pub backoff_jitter: f64,
    /// Failed attempts after which a message moves to the dead-letter table.
    #[arg(long, env = "OUTBOX_MAX_ATTEMPTS", default_value_t = 20)]
    pub max_attempts: i32,
    /// Keep published rows this long (0: delete at once, the fastest).
    #[arg(long, env = "OUTBOX_RETENTION", default_value = "0s", value_parser = humantime::parse_duration)]
    pub retention: Duration,
    /// How often retained published rows are purged (in small batches that skip locked rows).
    #[arg(long, env = "OUTBOX_PURGE_INTERVAL", default_value = "30s", value_parser = humantime::parse_duration)]
    pub purge_interval: Duration,
    /// Poll interval right after work ran out (NOTIFY wakes workers sooner).
    #[arg(long, env = "OUTBOX_POLL_INTERVAL", default_value = "250ms", value_parser = humantime::parse_duration)]
    pub poll_interval: Duration,
    /// Longest poll interval when idle (the interval doubles up to this).
    #[arg(long, env = "OUTBOX_MAX_POLL_INTERVAL", default_value = "5s", value_parser = humantime::parse_duration)]
    pub max_poll_interval: Duration,
    /// LISTEN channel writers NOTIFY after enqueueing.
    #[arg(long, env = "OUTBOX_NOTIFY_CHANNEL", default_value = outbox_shared::store::notify::DEFAULT_CHANNEL)]
    pub notify_channel: String,
    /// Do not LISTEN (for transaction-pooling poolers such as PgBouncer); poll only.
    #[arg(long, env = "OUTBOX_NO_LISTEN")]
    pub no_listen: bool,
    /// Only publish these topics (comma-separated; short names use --pubsub-project). Default: all.
    #[arg(long = "topic", env = "OUTBOX_TOPICS", value_delimiter = ',')]
    pub topics: Vec<String>,
    /// Ordering keys visited per ordered claim (a round-robin walk over keys with pending rows).
    #[arg(long, env = "OUTBOX_KEY_SCAN_LIMIT", default_value_t = 2000)]
    pub key_scan_limit: i64,
    /// Topics (comma-separated) whose ordering keys skip a dead-lettered message instead of
    /// blocking behind it. Default: every key blocks until an operator replays or discards.
    #[arg(
        long = "ordering-skip-dead-letters",
        env = "OUTBOX_ORDERING_SKIP_DEAD_LETTERS",
        value_delimiter = ','
    )]
    pub skip_dead_letter_topics: Vec<String>,
    /// Chaos testing: fail this fraction (0..=1) of message publishes on purpose, with
    /// --chaos-failure-code. 0 (the default) disables it. Never set it in production.
    #[arg(long, env = "OUTBOX_CHAOS_FAILURE_RATE", default_value_t = 0.0)]
    pub chaos_failure_rate: f64,
    /// Chaos testing: the gRPC code injected failures carry (e.g. UNAVAILABLE, NOT_FOUND).
    #[arg(long, env = "OUTBOX_CHAOS_FAILURE_CODE", default_value = "UNAVAILABLE")]
    pub chaos_failure_code: String,
    /// Address for /healthz, /readyz and /metrics.
    #[arg(long, env = "OUTBOX_LISTEN_ADDR", default_value = "0.0.0.0:9090")]
    pub listen_addr: SocketAddr,
    /// On SIGTERM, how long in-flight batches may take to finish (below GKE's 30 s).
    #[arg(long, env = "OUTBOX_GRACE_PERIOD", default_value = "25s", value_parser = humantime::parse_duration)]
    pub grace_period: Duration,
    /// First pause when Pub/Sub is unreachable; doubles while it stays down.
    #[arg(long, env = "OUTBOX_BREAKER_COOLDOWN", default_value = "1s", value_parser = humantime::parse_duration)]
    pub breaker_cooldown: Duration,
    /// Longest pause between probes while Pub/Sub is unreachable.
    #[arg(long, env = "OUTBOX_BREAKER_MAX_COOLDOWN", default_value = "30s", value_parser = humantime::parse_duration)]
    pub breaker_max_cooldown: Duration,
}

impl DispatchArgs {
    /// Rejects out-of-range values with a message naming the flag.
    pub fn validate(&self, publish_timeout: Duration) -> Result<(), String> {
        if !(1..=1000).contains(&self.batch_size) {
            return Err(format!(
                "--batch-size must be 1..=1000, got {}",
                self.batch_size
            ));
        }
        if self.workers == 0 {
            return Err("--workers must be at least 1".to_owned());
        }
        if self.max_attempts < 1 {
            return Err(format!(
                "--max-attempts must be at least 1, got {}",
                self.max_attempts
            ));
        }
        if !(0.0..=1.0).contains(&self.backoff_jitter) {
            return Err(format!(
                "--backoff-jitter must be within 0..=1, got {}",
                self.backoff_jitter
            ));
        }
        if !(0.0..=1.0).contains(&self.chaos_failure_rate) {
            return Err(format!(
                "--chaos-failure-rate must be within 0..=1, got {}",
                self.chaos_failure_rate
            ));
        }
        if crate::chaos::parse_code(&self.chaos_failure_code).is_none() {
            return Err(format!(
                "--chaos-failure-code {:?} is not a gRPC code name (e.g. UNAVAILABLE, NOT_FOUND)",
                self.chaos_failure_code
            ));
        }
        if self.lock_timeout <= publish_timeout {
            return Err(format!(
                "--lock-timeout ({:?}) must exceed --publish-timeout ({publish_timeout:?}), or claims \
                 would expire while their publish is still running",
                self.lock_timeout
            ));
        }
        Ok(())
    }
}
