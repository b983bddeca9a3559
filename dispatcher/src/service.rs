//! The dispatcher as a value: [`Dispatcher::build`] assembles everything from a
//! [`DispatcherConfig`], a database pool and a publisher and binds the HTTP endpoints (port 0 picks
//! a free one, read back with [`Dispatcher::local_addr`]); [`Dispatcher::run_batch`] runs one unit
//! of work on demand (tests, benchmarks); [`Dispatcher::run_until_stopped`] runs the workers and
//! the background tasks until shutdown, then drains in-flight batches within the grace period.
//! The binary, the tests and the benchmarks all build a dispatcher this way.

use std::net::SocketAddr;
use std::sync::Arc;

use chrono::{DateTime, Utc};
use prometheus_client::registry::Registry;
use sqlx::PgPool;
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio::task::JoinSet;

use outbox_runtime::db::DatabaseArgs;
use outbox_runtime::health;
use outbox_runtime::shutdown::Shutdown;

use crate::batch::dispatch::Dispatch;
use crate::batch::outcome::BatchOutcome;
use crate::batch::{self, worker};
use crate::config::DispatcherConfig;
use crate::error::DispatcherError;
use crate::metrics::Metrics;
use crate::pubsub::publish::Publish;
use crate::tasks::{self, hold_watch};

/// A dispatcher ready to run.
#[derive(Debug)]
pub struct Dispatcher<P> {
    dispatch: Arc<Dispatch<P>>,
    config: DispatcherConfig,
    registry: Arc<Registry>,
    listener: TcpListener,
    local_addr: SocketAddr,
}

/// Opens the dispatcher's pool (and applies the migrations with `--migrate`). What the claim
/// transactions need of a session (asynchronous commit, the idle timeout) they set themselves
/// (`claim::ClaimSession`), so the pool works the same behind a transaction-mode pooler.
pub async fn connect_database(
    database: &DatabaseArgs,
    config: &DispatcherConfig,
) -> Result<PgPool, DispatcherError> {
    let pool = outbox_runtime::db::connect(database, "pubsub-outbox-dispatcher").await?;
    if config.migrate {
        outbox_shared::migrate(&pool).await?;
    }
    Ok(pool)
}

impl<P: Publish> Dispatcher<P> {
    /// Assembles a dispatcher and binds its HTTP endpoints; nothing runs until
    /// [`Self::run_until_stopped`] (or [`Self::run_batch`]).
    pub async fn build(
        config: DispatcherConfig,
        pool: PgPool,
        publisher: P,
    ) -> Result<Self, DispatcherError> {
        config.validate().map_err(DispatcherError::Config)?;
        let mut registry = Registry::default();
        let metrics = Arc::new(Metrics::register(&mut registry));
        metrics.fault_injection_rate.set(config.faults.failure_rate);
        if config.faults.failure_rate > 0.0 {
            tracing::warn!(
                rate = config.faults.failure_rate,
                code = ?config.faults.failure_code,
                "Fault injection is on: this fraction of publishes fails on purpose (--inject-failure-rate). Unset OUTBOX_INJECT_FAILURE_RATE outside a test."
            );
        }
        let dispatch = Arc::new(Dispatch::new(pool, Arc::new(publisher), &config, metrics));
        let (listener, local_addr) =
            health::bind(config.listen_addr)
                .await
                .map_err(|source| DispatcherError::Listen {
                    addr: config.listen_addr,
                    source,
                })?;
        Ok(Self {
            dispatch,
            config,
            registry: Arc::new(registry),
            listener,
            local_addr,
        })
    }

    /// Where `/healthz`, `/readyz` and `/metrics` answer.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The configuration it runs with.
    pub fn config(&self) -> &DispatcherConfig {
        &self.config
    }

    /// The publisher it publishes with.
    pub fn publisher(&self) -> &P {
        &self.dispatch.publisher
    }

    /// Claims, publishes and settles one batch of rows due at `now`.
    pub async fn run_batch(&self, now: DateTime<Utc>) -> Result<BatchOutcome, DispatcherError> {
        batch::run_batch(&self.dispatch, now).await
    }

    /// Reads the held topics and probes those due at `now` (what the background task does every
    /// half second; `crate::refusals::hold`): what each probe found.
    pub async fn probe_held_topics(
        &self,
        now: DateTime<Utc>,
    ) -> Result<Vec<(String, hold_watch::Probe)>, DispatcherError> {
        hold_watch::probe_due(&self.dispatch, now).await
    }

    /// The metrics in the Prometheus text format, as `/metrics` serves them.
    pub fn encode_metrics(&self) -> String {
        let mut text = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut text, &self.registry);
        text
    }

    /// Runs the workers, LISTEN, the gauges, the purge and the endpoints until `shutdown` fires,
    /// then lets in-flight batches settle within the grace period.
    pub async fn run_until_stopped(self, shutdown: Shutdown) -> Result<(), DispatcherError> {
        let Self {
            dispatch,
            config,
            registry,
            listener,
            local_addr,
        } = self;
        let pool = dispatch.pool.clone();
        // A replica on a schema behind its release claims nothing and says so
        // (`crate::refusals::schema`); read before the background tasks start, so that none of them
        // reads a missing table.
        let schema_ok = dispatch.schema.check(&pool).await;
        let wakeup = Arc::new(Notify::new());
        let mut background =
            tasks::spawn(&dispatch, &config, registry, listener, &wakeup, &shutdown);
        let mut heartbeat = AbortOnDrop(tokio::spawn(tasks::heartbeat::heartbeat(
            dispatch.clone(),
            config.batch.topics.clone(),
            config.forget_replicas_after,
            shutdown.clone(),
        )));
        // A replica started during an outage must not report ready: probe before the first claim
        // (on a schema behind, only a --topic: there is no table to read one from).
        let topic = if schema_ok {
            probe_topic(&dispatch, &config).await
        } else {
            config
                .batch
                .topics
                .as_ref()
                .and_then(|t| t.first())
                .cloned()
        };
        if let Some(topic) = topic {
            match dispatch.publisher.probe(&topic).await {
                Ok(()) => {}
                Err(e) if e.is_outage() => dispatch.breaker.open_at_start(&topic, &e.to_string()),
                Err(e) => return Err(DispatcherError::PubsubRefused(e.to_string())),
            }
        }
        let mut workers = JoinSet::new();
        for n in 0..config.workers {
            workers.spawn(worker::work(
                dispatch.clone(),
                n,
                wakeup.clone(),
                shutdown.clone(),
            ));
        }
        tracing::info!(addr = %local_addr, workers = config.workers, batch_size = config.batch.batch_size,
            topics = ?config.batch.topics, "The dispatcher started.");

        let mut stop = shutdown.clone();
        stop.requested().await;
        let drained = tokio::time::timeout(config.grace_period, async {
            while workers.join_next().await.is_some() {}
        })
        .await;
        background.abort_all();
        // The heartbeat task removes this replica's row as it stops (bounded: a second at most).
        let _ = tokio::time::timeout(std::time::Duration::from_secs(1), &mut heartbeat.0).await;
        match drained {
            Ok(()) => {
                pool.close().await;
                tracing::info!("The dispatcher stopped: every batch in flight was settled.");
                Ok(())
            }
            Err(_) => Err(DispatcherError::GraceExceeded(config.grace_period)),
        }
    }
}

/// A task ended with the run: when the run's future is dropped (a kill in the tests, a panic
/// above it), the task goes too, as with a process's end, and so do its pool's connections.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The topic the start-up probe asks about: one this replica is about to publish to, never a
/// made-up name (the first `--topic`, else a topic with pending rows). `None` when there is
/// nothing to publish yet: the first publish then tells.
async fn probe_topic<P: Publish>(
    dispatch: &Dispatch<P>,
    config: &DispatcherConfig,
) -> Option<String> {
    if let Some(first) = config.batch.topics.as_ref().and_then(|t| t.first()) {
        return Some(first.clone());
    }
    let mut tx = dispatch.pool.begin().await.ok()?;
    match outbox_shared::store::outbox::pending_topic(&mut tx, None).await {
        Ok(topic) => {
            let _ = tx.commit().await;
            topic
        }
        Err(e) => {
            tracing::warn!(error = %e, "Could not read a pending topic for the start-up probe; the first publish will tell whether Pub/Sub answers.");
            None
        }
    }
}
