//! Command line and environment configuration. Every flag has a doc comment (its `--help`), an
//! environment fallback and a default; single values are range-checked as they are parsed, and
//! [`DispatcherConfig::try_from`] checks the rules that tie them together.
//!
//! `run` is the default command, and its flags may come before or after it
//! (`dispatcher --workers 3 run`, `dispatcher run --workers 3`, `dispatcher --workers 3`):
//! [`Cli::parse_args`] applies both binaries' one rule, [`outbox_runtime::cli::run_first`], before
//! clap parses. Every other command takes only its own flags.

use std::net::SocketAddr;
use std::time::Duration;

use crate::pubsub::classify::{Code, code_name};
use clap::{CommandFactory, Parser, Subcommand};
use outbox_runtime::cli::run_first;
use outbox_runtime::db::DatabaseArgs;
use outbox_runtime::telemetry::TelemetryArgs;
use outbox_runtime::traces::TraceArgs;
use outbox_shared::{
    DEFAULT_DEDUPE_ATTRIBUTE, DEFAULT_NOTIFY_CHANNEL, RetrySchedule, resolve_topic,
};

use crate::config::{
    BatchSettings, BreakerSettings, DispatcherConfig, FaultSettings, Idle, PubsubConfig,
    RefusalSettings, SkipDeadLetters,
};

/// pubsub-outbox dispatcher: drains the pubsub_outbox table to Google Cloud Pub/Sub, and the
/// operator's commands (status, dead letters, pause/resume, audit).
///
/// `dispatcher [FLAGS]`, `dispatcher run [FLAGS]` and `dispatcher [FLAGS] run` all run it; every
/// flag also reads its environment variable. Exit codes: 0 ok, 1 failed, 2 bad usage or
/// configuration, 3 nothing matched (operator commands).
#[derive(Debug, Parser)]
#[command(name = "dispatcher", version = outbox_runtime::release::LONG_VERSION, about, long_about = None)]
pub struct Cli {
    /// What to do (`dispatcher [FLAGS]` means `dispatcher run [FLAGS]`).
    #[command(subcommand)]
    pub command: Command,
}

impl Cli {
    /// Parses the process's arguments; `dispatcher [FLAGS]` (no subcommand) runs the dispatcher
    /// (exits with clap's message and code 2 on bad usage).
    pub fn parse_args() -> Self {
        Self::parse_from(run_first(&Self::command(), std::env::args_os().collect()))
    }

    /// Like [`Self::parse_args`] over `args` (the program name first).
    pub fn try_parse_args<I, T>(args: I) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString>,
    {
        let args = run_first(&Self::command(), args.into_iter().map(Into::into).collect());
        Self::try_parse_from(args)
    }

    /// The run flags (of `run`, given or implied).
    pub fn run_args(&self) -> Option<&RunArgs> {
        match &self.command {
            Command::Run(args) => Some(args),
            _ => None,
        }
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
            Command::Migrate(a) => &a.telemetry,
            Command::Ops(op) => op.telemetry(),
            Command::Console(a) => &a.telemetry,
            Command::Run(a) => &a.telemetry,
        }
    }
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
    pub pubsub: PubsubArgs,
    #[command(flatten)]
    pub dispatch: DispatchArgs,
}

pub use outbox_runtime::db::MigrateArgs;

/// Subcommands.
// Parsed once at start-up: the size of the largest variant does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, Subcommand)]
pub enum Command {
    /// Run the dispatcher until SIGTERM/SIGINT (the default).
    Run(RunArgs),
    /// Apply the database migrations and exit.
    Migrate(MigrateArgs),
    #[command(flatten)]
    Ops(crate::ops::OpsCommand),
    /// The operator's console in a browser: the overview, plots of the last hour, pending
    /// messages, dead letters, the audit trail, and (with --actions) pause/resume,
    /// replay/discard of dead letters and cancel/retry-now of pending messages, previewed,
    /// confirmed and audited with the identity. Local (loopback) or behind Identity-Aware Proxy.
    #[command(
        after_help = "Examples:\n  dispatcher console                    # http://127.0.0.1:8080/, read-only\n  \
                      dispatcher console --actions          # with pause/resume, replay/discard, cancel/retry-now\n  \
                      dispatcher console --auth iap --iap-audience /projects/123/global/backendServices/456 --listen-addr 0.0.0.0:8080"
    )]
    Console(crate::console::ConsoleArgs),
}

/// Dispatching knobs.
#[derive(Debug, Clone, clap::Args)]
pub struct DispatchArgs {
    /// Apply pending migrations before starting (otherwise run `dispatcher migrate` first).
    #[arg(long, env = "OUTBOX_MIGRATE")]
    pub migrate: bool,
    /// Concurrent workers in this process (each holds one database connection while a batch is
    /// in flight).
    #[arg(long, env = "OUTBOX_WORKERS", default_value_t = 4,
          value_parser = clap::value_parser!(u16).range(1..))]
    pub workers: u16,
    /// Rows claimed per batch (1..=1000; Pub/Sub takes at most 1,000 messages per request).
    #[arg(long, env = "OUTBOX_BATCH_SIZE", default_value_t = 500,
          value_parser = clap::value_parser!(i64).range(1..=1000))]
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
    #[arg(long, env = "OUTBOX_BACKOFF_JITTER", default_value_t = 0.2, value_parser = fraction)]
    pub backoff_jitter: f64,
    /// Failed attempts after which a message moves to the dead-letter table.
    #[arg(long, env = "OUTBOX_MAX_ATTEMPTS", default_value_t = 20,
          value_parser = clap::value_parser!(i32).range(1..))]
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
    #[arg(long, env = "OUTBOX_NOTIFY_CHANNEL", default_value = DEFAULT_NOTIFY_CHANNEL)]
    pub notify_channel: String,
    /// After a NOTIFY, gather further notifications this long before waking one idle worker, so
    /// rows committed meanwhile share one claim and one publish (0: a wake-up per notification).
    #[arg(long, env = "OUTBOX_NOTIFY_COALESCE", default_value = "5ms", value_parser = humantime::parse_duration)]
    pub notify_coalesce: Duration,
    /// Do not LISTEN (for transaction-pooling poolers such as PgBouncer); poll only.
    #[arg(long, env = "OUTBOX_NO_LISTEN")]
    pub no_listen: bool,
    /// Only publish these topics (comma-separated; short names use --pubsub-project). Default: all.
    #[arg(long = "topic", env = "OUTBOX_TOPICS", value_delimiter = ',')]
    pub topics: Vec<String>,
    /// Ordering keys visited per ordered claim (a round-robin walk over keys with pending rows).
    #[arg(long, env = "OUTBOX_KEY_SCAN_LIMIT", default_value_t = 2000,
          value_parser = clap::value_parser!(i64).range(1..))]
    pub key_scan_limit: i64,
    /// Unkeyed claims start this long before the earlier of the oldest row the last claim took
    /// and the last instant at which every writer of the outbox had ended (a cushion for rows
    /// given back with a due time a little before it; the keyed floor needs none: it rises only
    /// to ids no open transaction can still write).
    #[arg(long, env = "OUTBOX_CLAIM_FLOOR_MARGIN", default_value = "5s", value_parser = humantime::parse_duration)]
    pub claim_floor_margin: Duration,
    /// How often a probe walks the outbox from its start for rows the claims' floors cannot know
    /// of (rows a vanished replica held, rows written with a due time before their insert); at
    /// least 10 x the probe's own last duration.
    #[arg(long, env = "OUTBOX_CLAIM_PROBE_INTERVAL", default_value = "30s", value_parser = humantime::parse_duration)]
    pub claim_probe_interval: Duration,
    #[command(flatten)]
    pub skip_dead_letters: SkipDeadLetters,
    /// Log a batch (a warning with the time of each step: the oldest row's wait to be claimed,
    /// claim, publish, settle and commit) when it takes longer than this from claim to commit,
    /// or its oldest row waited this long to be claimed; at most one line a second per process
    /// (`held_back` counts the slow batches not logged since the last). 0 turns it off.
    #[arg(long, env = "OUTBOX_SLOW_BATCH", default_value = "1s", value_parser = humantime::parse_duration)]
    pub slow_batch: Duration,
    /// Fault injection (testing a deployment's alerts and recovery): fail this fraction (0..=1)
    /// of message publishes on purpose, with --inject-failure-code. 0 (the default) disables it.
    /// Never set it in production.
    #[arg(long, env = "OUTBOX_INJECT_FAILURE_RATE", default_value_t = 0.0, value_parser = fraction)]
    pub inject_failure_rate: f64,
    /// Fault injection: the gRPC code injected failures carry (e.g. UNAVAILABLE, NOT_FOUND).
    #[arg(long, env = "OUTBOX_INJECT_FAILURE_CODE", default_value = "UNAVAILABLE", value_parser = grpc_code)]
    pub inject_failure_code: Code,
    /// Address for /healthz, /readyz and /metrics.
    #[arg(long, env = "OUTBOX_LISTEN_ADDR", default_value = "0.0.0.0:9090")]
    pub listen_addr: SocketAddr,
    /// /healthz fails when a worker loop has made no progress for this long (a wedged process is
    /// restarted by the liveness probe). Must exceed --lock-timeout and 3 x --max-poll-interval.
    #[arg(long, env = "OUTBOX_LIVENESS_TIMEOUT", default_value = "90s", value_parser = humantime::parse_duration)]
    pub liveness_timeout: Duration,
    /// On SIGTERM, how long in-flight batches may take to finish (below GKE's 30 s).
    #[arg(long, env = "OUTBOX_GRACE_PERIOD", default_value = "25s", value_parser = humantime::parse_duration)]
    pub grace_period: Duration,
    /// First pause when Pub/Sub is unreachable; doubles while it stays down.
    #[arg(long, env = "OUTBOX_BREAKER_COOLDOWN", default_value = "250ms", value_parser = humantime::parse_duration)]
    pub breaker_cooldown: Duration,
    /// Longest pause between probes while Pub/Sub is unreachable (claiming resumes within about
    /// this long of Pub/Sub answering again).
    #[arg(long, env = "OUTBOX_BREAKER_MAX_COOLDOWN", default_value = "1s", value_parser = humantime::parse_duration)]
    pub breaker_max_cooldown: Duration,
    /// A publish with no answer this long triggers a probe (its deadline 2 s, or 3x the round
    /// trips seen lately when they are slower, at most --publish-timeout); if the probe gets no
    /// answer either, the batch is released as an outage at once instead of waiting out
    /// --publish-timeout.
    #[arg(long, env = "OUTBOX_STALL_PROBE_AFTER", default_value = "3s", value_parser = humantime::parse_duration)]
    pub stall_probe_after: Duration,
    /// A topic Pub/Sub refuses as a whole (PERMISSION_DENIED, NOT_FOUND, FAILED_PRECONDITION,
    /// UNIMPLEMENTED) is held: its rows wait untouched and it is probed by publishing its head
    /// message, first this long after the refusal, then at doubling intervals.
    #[arg(long, env = "OUTBOX_HELD_TOPIC_PROBE_INTERVAL", default_value = "1s", value_parser = humantime::parse_duration)]
    pub held_topic_probe_interval: Duration,
    /// The longest interval between two probes of a held topic (at most 10m): its rows go out at
    /// most about this long after Pub/Sub accepts the topic again.
    #[arg(long, env = "OUTBOX_HELD_TOPIC_MAX_PROBE_INTERVAL", default_value = "15s", value_parser = humantime::parse_duration)]
    pub held_topic_max_probe_interval: Duration,
    /// RESOURCE_EXHAUSTED (quota) slows a topic down instead of charging attempts: this replica
    /// leaves the topic alone for a backoff that doubles from 100ms on each refusal and halves on
    /// each accepted request, at most this long; the refused rows wait as long, no attempt
    /// charged.
    #[arg(long, env = "OUTBOX_QUOTA_MAX_BACKOFF", default_value = "10s", value_parser = humantime::parse_duration)]
    pub quota_max_backoff: Duration,
    /// Delete the heartbeat row of a replica that sent none for this long (a killed pod), so
    /// `dispatcher status` stops listing it as gone (at least 1m; `dispatcher replicas prune`
    /// removes one at once).
    #[arg(long, env = "OUTBOX_FORGET_REPLICAS_AFTER", default_value = "10m", value_parser = humantime::parse_duration)]
    pub forget_replicas_after: Duration,
}

/// How to reach Pub/Sub.
#[derive(Debug, Clone, clap::Args)]
pub struct PubsubArgs {
    /// Pub/Sub emulator host:port. When set, the dispatcher talks plain HTTP to it with anonymous
    /// credentials (the official client does not read this variable by itself).
    #[arg(long, env = "PUBSUB_EMULATOR_HOST")]
    pub pubsub_emulator_host: Option<String>,
    /// Pub/Sub endpoint override, e.g. a regional endpoint https://us-east1-pubsub.googleapis.com
    /// (strict ordering holds only within one region). Default: the global endpoint.
    #[arg(long, env = "OUTBOX_PUBSUB_ENDPOINT")]
    pub pubsub_endpoint: Option<String>,
    /// Project for short topic names given to --topic and --ordering-skip-dead-letters. Optional:
    /// rows always carry full names (projects/P/topics/T), and full names need no project; a
    /// short name without it is refused at start-up (exit 2).
    #[arg(long, env = "PUBSUB_PROJECT_ID", default_value = "")]
    pub pubsub_project: String,
    /// Upper bound on one batch publish (each request carries the time left as its
    /// grpc-timeout). Keep it well below --lock-timeout.
    #[arg(long, env = "OUTBOX_PUBLISH_TIMEOUT", default_value = "20s", value_parser = humantime::parse_duration)]
    pub publish_timeout: Duration,
    /// Name of the attribute that carries the dedupe key to consumers.
    #[arg(long, env = "OUTBOX_DEDUPE_ATTRIBUTE", default_value = DEFAULT_DEDUPE_ATTRIBUTE)]
    pub dedupe_attribute: String,
    /// HTTP/2 connections to Pub/Sub per replica (1..=64). Each carries up to 100 requests at
    /// once (the bound Google's clients keep); a batch over many ordering keys sends one request
    /// per key, so 4 connections keep 400 one-key requests in flight.
    #[arg(long, env = "OUTBOX_PUBLISH_CONNECTIONS", default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub publish_connections: u16,
    /// A PEM file of certificate authorities to trust, besides the system's, for an https://
    /// --pubsub-endpoint whose certificate a private CA signed (a Private Service Connect
    /// endpoint behind your own TLS, a test endpoint).
    #[arg(long, env = "OUTBOX_PUBSUB_CA_FILE", value_name = "PEM")]
    pub pubsub_ca_file: Option<std::path::PathBuf>,
    /// The `:authority` of every request (TLS still verifies the endpoint's own name). By
    /// default the one Google's clients send: pubsub.googleapis.com for private.googleapis.com,
    /// restricted.googleapis.com (VPC Service Controls) and Private Service Connect names
    /// (*.p.googleapis.com), the endpoint's own host for regional and locational endpoints and
    /// for any other name. Set it for an endpoint of your own naming that forwards to Google
    /// (--pubsub-authority pubsub.googleapis.com).
    #[arg(long, env = "OUTBOX_PUBSUB_AUTHORITY", value_name = "HOST")]
    pub pubsub_authority: Option<String>,
    /// Removed: the dispatcher sends each batch's requests at once, so there is no batching
    /// delay to tune. Refused with the reason when set.
    #[arg(long, env = "OUTBOX_PUBLISH_DELAY", hide = true)]
    pub publish_delay: Option<String>,
}

impl TryFrom<&RunArgs> for DispatcherConfig {
    type Error = String;

    fn try_from(cli: &RunArgs) -> Result<Self, String> {
        refuse_unusable(cli)?;
        let a = &cli.dispatch;
        let config = DispatcherConfig {
            batch: batch_settings(a, &cli.pubsub.pubsub_project)?,
            pubsub: pubsub_config(&cli.pubsub),
            workers: usize::from(a.workers),
            max_inflight_bytes: a.max_inflight_bytes,
            lock_timeout: a.lock_timeout,
            idle: Idle {
                poll_interval: a.poll_interval,
                max_poll_interval: a.max_poll_interval,
                notify_coalesce: a.notify_coalesce,
            },
            notify_channel: (!a.no_listen).then(|| a.notify_channel.clone()),
            retention: a.retention,
            purge_interval: a.purge_interval,
            listen_addr: a.listen_addr,
            grace_period: a.grace_period,
            liveness_timeout: a.liveness_timeout,
            breaker: BreakerSettings {
                cooldown: a.breaker_cooldown,
                max_cooldown: a.breaker_max_cooldown,
            },
            stall_probe_after: a.stall_probe_after,
            forget_replicas_after: a.forget_replicas_after,
            claim_probe_interval: a.claim_probe_interval,
            refusals: RefusalSettings {
                held_probe_interval: a.held_topic_probe_interval,
                held_max_probe_interval: a.held_topic_max_probe_interval,
                quota_max_backoff: a.quota_max_backoff,
            },
            faults: FaultSettings {
                failure_rate: a.inject_failure_rate,
                failure_code: a.inject_failure_code,
            },
            migrate: a.migrate,
        };
        config.validate()?;
        Ok(config)
    }
}

/// Refuses the settings no configuration can honour: LISTEN behind a transaction-mode pooler,
/// and the removed --publish-delay.
fn refuse_unusable(cli: &RunArgs) -> Result<(), String> {
    if cli.database.pooler.per_transaction() && !cli.dispatch.no_listen {
        return Err(
            "--db-pooler transaction: LISTEN needs a session of its own, which a \
                    transaction-mode pooler does not keep; add --no-listen (OUTBOX_NO_LISTEN) \
                    to claim by polling, or point the dispatcher at the database directly"
                .to_owned(),
        );
    }
    if cli.pubsub.publish_delay.is_some() {
        return Err(
            "--publish-delay (OUTBOX_PUBLISH_DELAY) was removed: the dispatcher no longer \
             waits to fill a request; each claimed batch goes out at once, one request per \
             ordering key and the unkeyed rows packed up to 1,000 messages or 10 MB. Remove \
             the setting (tune --batch-size and --notify-coalesce instead)"
                .to_owned(),
        );
    }
    Ok(())
}

/// What one batch claims and how it settles; short topic names get `project`.
fn batch_settings(a: &DispatchArgs, project: &str) -> Result<BatchSettings, String> {
    Ok(BatchSettings {
        batch_size: a.batch_size,
        topics: if a.topics.is_empty() {
            None
        } else {
            Some(full_topics(project, "--topic", &a.topics)?)
        },
        retain_published: !a.retention.is_zero(),
        schedule: RetrySchedule {
            base: a.backoff_base,
            cap: a.backoff_cap,
            jitter: a.backoff_jitter,
            max_attempts: a.max_attempts,
        },
        key_scan_limit: a.key_scan_limit,
        claim_floor_margin: a.claim_floor_margin,
        skip_dead_letter_topics: full_topics(
            project,
            "--ordering-skip-dead-letters",
            &a.skip_dead_letters.topics,
        )?,
        slow_batch: a.slow_batch,
    })
}

/// How to reach Pub/Sub.
fn pubsub_config(p: &PubsubArgs) -> PubsubConfig {
    PubsubConfig {
        emulator_host: p.pubsub_emulator_host.clone(),
        endpoint: p.pubsub_endpoint.clone(),
        project: p.pubsub_project.clone(),
        publish_timeout: p.publish_timeout,
        dedupe_attribute: p.dedupe_attribute.clone(),
        connections: usize::from(p.publish_connections),
        ca_file: p.pubsub_ca_file.clone(),
        authority: p.pubsub_authority.clone(),
    }
}

/// The full names of `topics` (short ones get `project`); an error names `flag`.
fn full_topics(project: &str, flag: &str, topics: &[String]) -> Result<Vec<String>, String> {
    topics
        .iter()
        .map(|t| resolve_topic(project, t).map_err(|e| format!("{flag}: topic {e}")))
        .collect()
}

/// A fraction within 0..=1.
fn fraction(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(f) if (0.0..=1.0).contains(&f) => Ok(f),
        _ => Err(format!("expected a number within 0..=1, got {s:?}")),
    }
}

/// A gRPC code name such as `UNAVAILABLE` (case-insensitive).
fn grpc_code(name: &str) -> Result<Code, String> {
    (0..=16)
        .map(Code::from_i32)
        .find(|c| code_name(*c).eq_ignore_ascii_case(name))
        .ok_or_else(|| format!("{name:?} is not a gRPC code name (e.g. UNAVAILABLE, NOT_FOUND)"))
}

#[cfg(test)]
#[path = "cli_tests.rs"]
mod tests;
