//! Dispatchers for tests, built exactly as the binary builds one ([`Dispatcher::build`]), with
//! settings that make tests fast: the local emulator, endpoints on a free port, short polls and
//! probes, a short retry schedule without jitter.

use std::net::SocketAddr;
use std::time::Duration;

use outbox_dispatcher::config::{BreakerSettings, DispatcherConfig, Idle, PubsubConfig};
use outbox_dispatcher::publish::Publish;
use outbox_dispatcher::publisher::PubsubPublisher;
use outbox_dispatcher::{BatchOutcome, Dispatcher, DispatcherError};
use outbox_runtime::db::DatabaseArgs;
use outbox_runtime::shutdown::{self, Trigger};
use outbox_shared::RetrySchedule;
use sqlx::PgPool;
use tokio::task::JoinHandle;

use crate::db::TestDb;

/// The test settings, publishing to the Pub/Sub emulator at `pubsub_host`.
pub fn config_for(pubsub_host: &str) -> DispatcherConfig {
    let mut c = DispatcherConfig {
        pubsub: PubsubConfig {
            publish_timeout: Duration::from_secs(5),
            ..PubsubConfig::emulator(pubsub_host, crate::env::pubsub_project())
        },
        listen_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
        idle: Idle {
            poll_interval: Duration::from_millis(50),
            max_poll_interval: Duration::from_millis(200),
            ..Idle::default()
        },
        breaker: BreakerSettings {
            cooldown: Duration::from_millis(200),
            max_cooldown: Duration::from_secs(1),
        },
        ..DispatcherConfig::default()
    };
    c.batch.batch_size = 100;
    c.batch.key_scan_limit = 1000;
    c.batch.schedule = test_schedule();
    c
}

/// [`config_for`] the emulator the services script started.
pub fn config() -> DispatcherConfig {
    config_for(&crate::env::pubsub_emulator_host())
}

/// Base 2 s, cap 60 s, no jitter, 4 attempts: retries after 2, 4 and 8 s, then a dead letter.
pub fn test_schedule() -> RetrySchedule {
    RetrySchedule {
        base: Duration::from_secs(2),
        cap: Duration::from_secs(60),
        jitter: 0.0,
        max_attempts: 4,
    }
}

/// A publisher on the emulator at `host`.
pub async fn publisher_at(host: &str) -> PubsubPublisher {
    PubsubPublisher::connect(&config_for(host).pubsub)
        .await
        .expect("the Pub/Sub publisher connects")
}

/// A publisher on the emulator the services script started.
pub async fn real_publisher() -> PubsubPublisher {
    publisher_at(&crate::env::pubsub_emulator_host()).await
}

/// Builds a dispatcher on `pool` (the test's own pool, for driving `run_batch` by hand).
pub async fn build<P: Publish>(
    pool: &PgPool,
    publisher: P,
    config: DispatcherConfig,
) -> Dispatcher<P> {
    Dispatcher::build(config, pool.clone(), publisher)
        .await
        .expect("the dispatcher builds")
}

/// Builds a dispatcher with its own pool, as the service opens it (session settings included).
pub async fn build_service<P: Publish>(
    db: &TestDb,
    publisher: P,
    config: DispatcherConfig,
) -> Dispatcher<P> {
    let pool = outbox_dispatcher::connect_database(&DatabaseArgs::for_url(db.url()), &config)
        .await
        .expect("the dispatcher's pool connects");
    Dispatcher::build(config, pool, publisher)
        .await
        .expect("the dispatcher builds")
}

/// Runs batches at "now" until one finds nothing due; panics if that takes over 1,000 batches.
pub async fn drain<P: Publish>(d: &Dispatcher<P>) {
    for _ in 0..1000 {
        if d.run_batch(chrono::Utc::now())
            .await
            .expect("the batch runs")
            == BatchOutcome::Empty
        {
            return;
        }
    }
    panic!("the outbox did not settle within 1,000 batches");
}

/// A dispatcher running in the background until [`Running::stop`].
#[derive(Debug)]
pub struct Running {
    addr: SocketAddr,
    trigger: Trigger,
    task: JoinHandle<Result<(), DispatcherError>>,
}

impl Running {
    /// Starts `dispatcher` (workers, LISTEN, endpoints).
    pub fn start<P: Publish>(dispatcher: Dispatcher<P>) -> Self {
        let addr = dispatcher.local_addr();
        let (trigger, stop) = shutdown::channel();
        let task = tokio::spawn(dispatcher.run_until_stopped(stop));
        Self {
            addr,
            trigger,
            task,
        }
    }

    /// `host:port` of its endpoints.
    pub fn addr(&self) -> String {
        self.addr.to_string()
    }

    /// Ends it at once, as a killed process would end (nothing is settled).
    pub fn abort(self) {
        self.task.abort();
    }

    /// Asks it to stop and asserts it stops cleanly.
    pub async fn stop(self) {
        self.trigger.fire();
        self.task
            .await
            .expect("the dispatcher task did not panic")
            .expect("the dispatcher stops cleanly");
    }
}

/// The sum of metric `name` over its label sets in a `/metrics` page (0 when absent); `name` may
/// carry a label set (`outbox_dead_lettered_total{kind="permanent"}`) to read that one alone.
pub fn metric_sum(page: &str, name: &str) -> f64 {
    page.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>()
}

/// [`metric_sum`] of the `/metrics` page of the dispatcher at `addr`.
pub async fn metric(addr: &str, name: &str) -> f64 {
    metric_sum(&crate::process::http_get(addr, "/metrics").await.1, name)
}
