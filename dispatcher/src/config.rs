//! The dispatcher's configuration as plain, validated values: what [`crate::Dispatcher::build`]
//! takes. The command line ([`crate::cli`]) is one way to make it (`TryFrom<&RunArgs>`); tests and
//! benchmarks start from [`Default`] and change what they need.
//!
//! The defaults here are the documented ones; a unit test in `cli` checks that the flags' defaults
//! produce exactly [`DispatcherConfig::default`].

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use outbox_shared::{DEFAULT_DEDUPE_ATTRIBUTE, DEFAULT_NOTIFY_CHANNEL, RetrySchedule};
use tonic::Code;

/// Everything a dispatcher process needs besides its database pool and its publisher.
#[derive(Debug, Clone, PartialEq)]
pub struct DispatcherConfig {
    /// What each batch does.
    pub batch: BatchSettings,
    /// How to reach Pub/Sub.
    pub pubsub: PubsubConfig,
    /// Concurrent workers (each holds one database connection while its batch is in flight).
    pub workers: usize,
    /// Payload bytes in flight across all workers.
    pub max_inflight_bytes: u64,
    /// A claim transaction idle this long is ended by the server (its rows become claimable).
    pub lock_timeout: Duration,
    /// How idle workers wait.
    pub idle: Idle,
    /// The LISTEN channel, or None to poll only.
    pub notify_channel: Option<String>,
    /// Keep published rows this long (zero: delete them at once).
    pub retention: Duration,
    /// How often retained rows are purged.
    pub purge_interval: Duration,
    /// Address of `/healthz`, `/readyz` and `/metrics` (port 0: any free port).
    pub listen_addr: SocketAddr,
    /// On shutdown, how long in-flight batches may take.
    pub grace_period: Duration,
    /// `/healthz` fails when a worker loop made no progress for this long.
    pub liveness_timeout: Duration,
    /// Probing while Pub/Sub is unreachable.
    pub breaker: BreakerSettings,
    /// A publish with no answer this long triggers a probe; if that fails too, the batch is an
    /// outage at once.
    pub stall_probe_after: Duration,
    /// A replica row without a heartbeat this long is deleted (by any replica's heartbeat).
    pub forget_replicas_after: Duration,
    /// How often the probe looks for rows the claims' floors skip (at least 10 x its own last
    /// duration).
    pub claim_probe_interval: Duration,
    /// Topics Pub/Sub refuses as a whole, and quota.
    pub refusals: RefusalSettings,
    /// Deliberate publish failures (fault injection; off by default).
    pub faults: FaultSettings,
    /// Apply pending migrations at start.
    pub migrate: bool,
}

impl Default for DispatcherConfig {
    fn default() -> Self {
        Self {
            batch: BatchSettings::default(),
            pubsub: PubsubConfig::default(),
            workers: 4,
            max_inflight_bytes: 64 * 1024 * 1024,
            lock_timeout: Duration::from_secs(60),
            idle: Idle::default(),
            notify_channel: Some(DEFAULT_NOTIFY_CHANNEL.to_owned()),
            retention: Duration::ZERO,
            purge_interval: Duration::from_secs(30),
            listen_addr: SocketAddr::from(([0, 0, 0, 0], 9090)),
            grace_period: Duration::from_secs(25),
            liveness_timeout: Duration::from_secs(90),
            breaker: BreakerSettings::default(),
            stall_probe_after: Duration::from_secs(3),
            forget_replicas_after: Duration::from_secs(600),
            claim_probe_interval: Duration::from_secs(30),
            refusals: RefusalSettings::default(),
            faults: FaultSettings::default(),
            migrate: false,
        }
    }
}

impl DispatcherConfig {
    /// Checks the rules that tie settings together (single values are range-checked where they
    /// are parsed). The message names the flags.
    pub fn validate(&self) -> Result<(), String> {
        if self.lock_timeout <= self.pubsub.publish_timeout {
            return Err(format!(
                "--lock-timeout ({:?}) must exceed --publish-timeout ({:?}), or claims would expire \
                 while their publish is still running",
                self.lock_timeout, self.pubsub.publish_timeout
            ));
        }
        if self.liveness_timeout <= self.lock_timeout
            || self.liveness_timeout < self.idle.max_poll_interval * 3
        {
            return Err(format!(
                "--liveness-timeout ({:?}) must exceed --lock-timeout ({:?}) and be at least 3 x \
                 --max-poll-interval ({:?}), or healthy workers would be reported stuck",
                self.liveness_timeout, self.lock_timeout, self.idle.max_poll_interval
            ));
        }
        if self.claim_probe_interval < Duration::from_secs(1) {
            return Err(format!(
                "--claim-probe-interval ({:?}) must be at least 1s",
                self.claim_probe_interval
            ));
        }
        if self.forget_replicas_after < Duration::from_secs(60) {
            return Err(format!(
                "--forget-replicas-after ({:?}) must be at least 1m: a live replica sends a \
                 heartbeat every 5 s, and one delayed by a slow database must not be forgotten",
                self.forget_replicas_after
            ));
        }
        let r = &self.refusals;
        if r.held_probe_interval < Duration::from_millis(100)
            || r.held_max_probe_interval < r.held_probe_interval
            || r.held_max_probe_interval > Duration::from_secs(600)
        {
            return Err(format!(
                "--held-topic-probe-interval ({:?}) must be at least 100ms, and \
                 --held-topic-max-probe-interval ({:?}) at least that and at most 10m (a held \
                 topic's rows go out at most this long after Pub/Sub accepts it again)",
                r.held_probe_interval, r.held_max_probe_interval
            ));
        }
        if r.quota_max_backoff < MIN_QUOTA_BACKOFF || r.quota_max_backoff > Duration::from_secs(600)
        {
            return Err(format!(
                "--quota-max-backoff ({:?}) must be within {:?}..=10m",
                r.quota_max_backoff, MIN_QUOTA_BACKOFF
            ));
        }
        if !(1..=1000).contains(&self.batch.batch_size) || self.workers == 0 {
            return Err(format!(
                "--batch-size must be 1..=1000 (got {}) and --workers at least 1 (got {})",
                self.batch.batch_size, self.workers
            ));
        }
        Ok(())
    }
}

/// `--ordering-skip-dead-letters`, one declaration for the two commands that read it: `run` (its
/// claims) and `status` (what it reports as blocking), so both name the same topics the same way.
#[derive(Debug, Clone, Default, PartialEq, Eq, clap::Args)]
pub struct SkipDeadLetters {
    /// Topics (comma-separated) whose ordering keys skip a dead-lettered message instead of
    /// blocking behind it (`status` then reports their dead letters as not blocking). Default:
    /// every key blocks until an operator replays or discards.
    #[arg(
        id = "ordering_skip_dead_letters",
        long = "ordering-skip-dead-letters",
        value_name = "TOPICS",
        env = "OUTBOX_ORDERING_SKIP_DEAD_LETTERS",
        value_delimiter = ','
    )]
    pub topics: Vec<String>,
}

/// What one batch does.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchSettings {
    /// Rows per claim (1..=1,000).
    pub batch_size: i64,
    /// Only these full topic names (None: all).
    pub topics: Option<Vec<String>>,
    /// Keep published rows (marked) instead of deleting them.
    pub retain_published: bool,
    /// The retry schedule.
    pub schedule: RetrySchedule,
    /// Ordering keys visited per ordered claim.
    pub key_scan_limit: i64,
    /// Unkeyed claims start this long before the oldest row the last claim took (the claim
    /// module's doc, "Claims start past what is published").
    pub claim_floor_margin: Duration,
    /// Topics whose ordering keys skip dead-lettered messages instead of blocking behind them.
    pub skip_dead_letter_topics: Vec<String>,
    /// A batch slower than this, or whose oldest row waited this long to be claimed, is logged
    /// with the time of each step (`Duration::ZERO`: never).
    pub slow_batch: Duration,
}

impl Default for BatchSettings {
    fn default() -> Self {
        Self {
            batch_size: 500,
            topics: None,
            retain_published: false,
            schedule: RetrySchedule::default(),
            key_scan_limit: 2000,
            claim_floor_margin: Duration::from_secs(5),
            skip_dead_letter_topics: Vec::new(),
            slow_batch: Duration::from_secs(1),
        }
    }
}

/// How to reach Pub/Sub and how to publish.
#[derive(Debug, Clone, PartialEq)]
pub struct PubsubConfig {
    /// The emulator's `host:port`: plain HTTP and anonymous credentials.
    pub emulator_host: Option<String>,
    /// An endpoint override (e.g. a regional endpoint).
    pub endpoint: Option<String>,
    /// Project for short topic names.
    pub project: String,
    /// Upper bound on one batch publish.
    pub publish_timeout: Duration,
    /// The attribute carrying the dedupe key (the one place it is set: the batch asks the
    /// publisher, [`crate::publish::Publish::dedupe_attribute`]).
    pub dedupe_attribute: String,
    /// HTTP/2 connections to Pub/Sub (each carries up to 100 calls at once).
    pub connections: usize,
    /// A PEM file of certificate authorities to trust besides the system's (a private endpoint).
    pub ca_file: Option<PathBuf>,
    /// The `:authority` requests carry, when not the one Google's clients derive from the
    /// endpoint (`crate::pubsub::transport::authority`).
    pub authority: Option<String>,
}

impl Default for PubsubConfig {
    fn default() -> Self {
        Self {
            emulator_host: None,
            endpoint: None,
            project: String::new(),
            publish_timeout: Duration::from_secs(20),
            dedupe_attribute: DEFAULT_DEDUPE_ATTRIBUTE.to_owned(),
            connections: 4,
            ca_file: None,
            authority: None,
        }
    }
}

impl PubsubConfig {
    /// The local emulator at `host` (`host:port`), short topic names in `project`.
    pub fn emulator(host: impl Into<String>, project: impl Into<String>) -> Self {
        Self {
            emulator_host: Some(host.into()),
            project: project.into(),
            ..Self::default()
        }
    }

    /// The endpoint to use, if not the default.
    pub fn endpoint(&self) -> Option<String> {
        match (&self.emulator_host, &self.endpoint) {
            (_, Some(endpoint)) => Some(endpoint.clone()),
            (Some(host), None) if host.starts_with("http") => Some(host.clone()),
            (Some(host), None) => Some(format!("http://{host}")),
            (None, None) => None,
        }
    }
}

/// How an idle worker waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Idle {
    /// First poll interval after work ran out.
    pub poll_interval: Duration,
    /// Longest poll interval when idle.
    pub max_poll_interval: Duration,
    /// After a NOTIFY, how long further notifications are gathered before one idle worker is
    /// woken: rows committed in that window share one claim and one publish request (zero wakes
    /// a worker per notification).
    pub notify_coalesce: Duration,
}

impl Default for Idle {
    fn default() -> Self {
        Self {
            poll_interval: Duration::from_millis(250),
            max_poll_interval: Duration::from_secs(5),
            notify_coalesce: Duration::from_millis(5),
        }
    }
}

/// The circuit breaker's probe cadence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BreakerSettings {
    /// First pause after an outage is confirmed.
    pub cooldown: Duration,
    /// Longest pause between probes.
    pub max_cooldown: Duration,
}

impl Default for BreakerSettings {
    fn default() -> Self {
        Self {
            cooldown: Duration::from_millis(250),
            max_cooldown: Duration::from_secs(1),
        }
    }
}

/// The first backoff of a topic refused for quota (`crate::refusals::pace`), and the least
/// `--quota-max-backoff` may be.
pub const MIN_QUOTA_BACKOFF: Duration = Duration::from_millis(100);

/// What the dispatcher does when Pub/Sub refuses a topic as a whole (`crate::refusals::hold`), and
/// how far quota slows a topic down (`crate::refusals::pace`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RefusalSettings {
    /// The first probe of a held topic comes this long after the refusal; the interval doubles.
    pub held_probe_interval: Duration,
    /// The longest interval between two probes of a held topic: its rows go out at most about
    /// this long after Pub/Sub accepts it again.
    pub held_max_probe_interval: Duration,
    /// The longest a topic refused by quota (RESOURCE_EXHAUSTED) waits before it is tried again.
    pub quota_max_backoff: Duration,
}

impl Default for RefusalSettings {
    fn default() -> Self {
        Self {
            held_probe_interval: Duration::from_secs(1),
            held_max_probe_interval: Duration::from_secs(15),
            quota_max_backoff: Duration::from_secs(10),
        }
    }
}

/// Deliberate publish failures, for testing a deployment's alerting and recovery.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FaultSettings {
    /// Fraction (0..=1) of message publishes that fail.
    pub failure_rate: f64,
    /// The gRPC code they fail with.
    pub failure_code: Code,
}

impl Default for FaultSettings {
    fn default() -> Self {
        Self {
            failure_rate: 0.0,
            failure_code: Code::Unavailable,
        }
    }
}
