//! The service's background tasks: the health server, LISTEN, the gauges and the purge of
//! retained rows. Each runs until shutdown and logs (never returns) its errors.

use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use prometheus_client::registry::Registry;
use sqlx::postgres::PgListener;
use sqlx::{PgConnection, PgPool};
use tokio::sync::Notify;

use outbox_runtime::health::{self, Checks, LivenessCheck, ReadinessCheck};
use outbox_runtime::shutdown::Shutdown;
use outbox_shared::store::replica::{self, Replica};
use outbox_shared::store::{dead_letter, held_topic, outbox, pause};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;

use crate::breaker::Breaker;
use crate::dispatch::Dispatch;
use crate::metrics::{Labels, Metrics};
use crate::publish::Publish;
use crate::schema::SchemaGate;

/// Cap on the backlog count (an index-only scan that stops here).
const BACKLOG_CAP: i64 = 1_000_000;

pub(crate) async fn health_server(
    listener: tokio::net::TcpListener,
    registry: Arc<Registry>,
    checks: Checks,
    shutdown: Shutdown,
) {
    if let Err(e) = health::serve(listener, registry, checks, shutdown).await {
        tracing::error!(error = %e, "The health and metrics endpoint stopped.");
    }
}

/// Alive while no worker loop is stuck for longer than `timeout`.
pub(crate) fn liveness<P: Publish>(d: Arc<Dispatch<P>>, timeout: Duration) -> LivenessCheck {
    Arc::new(move || match d.heartbeats.stalled(timeout) {
        None => Ok(()),
        Some((worker, age)) => Err(format!(
            "worker {worker} has made no progress for {age:?} (limit --liveness-timeout {timeout:?})"
        )),
    })
}

/// Ready when the database answers (within the endpoint's deadline), its schema has every
/// migration of this release and the breaker is closed (Pub/Sub reachable).
pub(crate) fn readiness(
    pool: PgPool,
    breaker: Arc<Breaker>,
    schema: Arc<SchemaGate>,
) -> ReadinessCheck {
    Arc::new(move || {
        let pool = pool.clone();
        let breaker = breaker.clone();
        let schema = schema.clone();
        Box::pin(async move {
            let ping = tokio::time::timeout(
                Duration::from_millis(800),
                // The simple protocol: no statement is prepared (any pooler passes it through).
                sqlx::raw_sql("SELECT 1").execute(&pool),
            );
            match ping.await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => return Err(format!("database unreachable: {e}")),
                Err(_) => return Err("database unreachable: no answer within 800ms".to_owned()),
            }
            if let Some(reason) = schema.behind() {
                return Err(format!(
                    "the database schema is behind this release: {reason}"
                ));
            }
            match breaker.open_reason() {
                None => Ok(()),
                Some(reason) => Err(format!(
                    "Pub/Sub unreachable (circuit breaker open): {reason}"
                )),
            }
        })
    })
}

/// Wakes idle workers on NOTIFY; reconnects with backoff, waking everyone after a reconnect in
/// case a notification was missed. Notifications arriving within `coalesce` of the first share
/// one wake-up: at 1,000 single-row transactions/s a wake-up per notification meant a claim, a
/// publish request and a settle per message (0.29 cores of dispatcher CPU;
/// docs/benchmarks/2026-12-01-throughput-latency.md, "Latency at 1,000 single-row transactions/s").
pub(crate) async fn listen(
    pool: PgPool,
    channel: String,
    coalesce: Duration,
    wakeup: Arc<Notify>,
    mut shutdown: Shutdown,
) {
    let mut backoff = Duration::from_millis(500);
    loop {
        let mut listener = match PgListener::connect_with(&pool).await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, "The LISTEN connection failed; polling meanwhile.");
                tokio::select! { _ = tokio::time::sleep(backoff) => {}, _ = shutdown.requested() => return }
                backoff = (backoff * 2).min(Duration::from_secs(30));
                continue;
            }
        };
        if let Err(e) = listener.listen(&channel).await {
            tracing::warn!(error = %e, channel = %channel, "LISTEN failed; polling meanwhile.");
            tokio::select! { _ = tokio::time::sleep(backoff) => {}, _ = shutdown.requested() => return }
            continue;
        }
        backoff = Duration::from_millis(500);
        wakeup.notify_waiters();
        'connection: loop {
            tokio::select! {
                n = listener.recv() => match n {
                    // A notification (one committed transaction, and any others within the
                    // window) wakes one idle worker; a worker that then finds a full batch wakes
                    // the next.
                    Ok(_) => {
                        let until = tokio::time::Instant::now() + coalesce;
                        while !coalesce.is_zero() {
                            match tokio::time::timeout_at(until, listener.recv()).await {
                                Ok(Ok(_)) => {}
                                Ok(Err(e)) => {
                                    wakeup.notify_one();
                                    tracing::warn!(error = %e, "The LISTEN connection was lost; reconnecting.");
                                    break 'connection;
                                }
                                Err(_) => break,
                            }
                        }
                        wakeup.notify_one();
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "The LISTEN connection was lost; reconnecting.");
                        break;
                    }
                },
                _ = shutdown.requested() => return,
            }
        }
    }
}

/// Refreshes the gauges every 10 s (per topic, only the topics this replica serves: backlog,
/// oldest due age, claimable age, dead letters, paused; blocked keys; pool connections), and logs progress once a
/// minute while there is traffic or a backlog.
pub(crate) async fn sample_gauges(
    pool: PgPool,
    schema: Arc<SchemaGate>,
    metrics: Arc<Metrics>,
    topics: Option<Vec<String>>,
    skip_topics: Vec<String>,
    mut shutdown: Shutdown,
) {
    let mut sampler = Gauges {
        progress: Progress::new(metrics.published.get()),
        metrics,
        topics,
        skip_topics,
        blocked_log: BlockedLog::default(),
        seen: Seen::default(),
    };
    loop {
        sampler.sample_pool(&pool);
        // Every statement inside a transaction, as behind a transaction-mode pooler it must be.
        // On a schema behind this release there are no tables to read (the gate says why).
        match pool.begin().await {
            Ok(_) if !schema.is_open() => {}
            Ok(mut conn) => {
                // The paused and held topics first: the claimable age leaves their rows out.
                let mut not_claimed = sampler.sample_paused(&mut conn).await;
                match held_topic::topics(&mut conn).await {
                    Ok(held) => not_claimed.extend(held),
                    Err(e) => tracing::warn!(error = %e, "Reading the held topics failed."),
                }
                sampler.sample_backlog(&mut conn, &not_claimed).await;
                sampler.sample_dead_letters(&mut conn).await;
                sampler.sample_blocked_keys(&mut conn).await;
                let _ = conn.commit().await;
            }
            Err(e) => tracing::warn!(error = %e, "No database connection for the gauges."),
        }
        tokio::select! { _ = tokio::time::sleep(Duration::from_secs(10)) => {}, _ = shutdown.requested() => return }
    }
}

/// What the gauge sampler keeps between samples.
struct Gauges {
    metrics: Arc<Metrics>,
    /// The topics this replica serves (`None`: all).
    topics: Option<Vec<String>>,
    skip_topics: Vec<String>,
    progress: Progress,
    blocked_log: BlockedLog,
    seen: Seen,
}

impl Gauges {
    fn sample_pool(&self, pool: &PgPool) {
        let idle = i64::try_from(pool.num_idle()).unwrap_or(i64::MAX);
        let pool_gauge = |state: &str| {
            self.metrics
                .pool_connections
                .get_or_create(&vec![("state", state.to_owned())])
                .clone()
        };
        pool_gauge("idle").set(idle);
        pool_gauge("in_use").set(i64::from(pool.size()) - idle);
    }

    /// Sets the paused gauges of the served topics; returns every paused topic.
    async fn sample_paused(&self, conn: &mut PgConnection) -> Vec<String> {
        match pause::list(conn).await {
            Ok(paused) => {
                self.metrics.paused.clear();
                let topics = self.topics.as_deref();
                for p in paused
                    .iter()
                    .filter(|p| topics.is_none_or(|t| t.contains(&p.topic)))
                {
                    self.metrics
                        .paused
                        .get_or_create(&vec![("topic", p.topic.clone())])
                        .set(1);
                }
                paused.into_iter().map(|p| p.topic).collect()
            }
            Err(e) => {
                tracing::warn!(error = %e, "Reading the paused topics failed.");
                Vec::new()
            }
        }
    }

    /// Backlog, oldest due age and claimable age per served topic (a drained topic reads 0).
    async fn sample_backlog(&mut self, conn: &mut PgConnection, not_claimed: &[String]) {
        let query = outbox::BacklogQuery {
            now: Utc::now(),
            topics: self.topics.as_deref(),
            not_claimed,
            skip_dead_letter_topics: &self.skip_topics,
            cap: BACKLOG_CAP,
        };
        let b = match outbox::backlog_by_topic(conn, &query).await {
            Ok(b) => b,
            Err(e) => return tracing::warn!(error = %e, "Reading the backlog failed."),
        };
        let metrics = &self.metrics;
        let labels = |t: &str| vec![("topic", t.to_owned())];
        let now: Vec<Labels> = b.iter().map(|t| labels(&t.topic)).collect();
        self.seen.zero_gone(&now, |gone| {
            metrics.backlog.get_or_create(gone).set(0);
            metrics.oldest_due_age_seconds.get_or_create(gone).set(0.0);
            metrics.claimable_age_seconds.get_or_create(gone).set(0.0);
        });
        for t in &b {
            let l = labels(&t.topic);
            metrics.backlog.get_or_create(&l).set(t.pending);
            metrics
                .oldest_due_age_seconds
                .get_or_create(&l)
                .set(t.oldest_due_age_secs);
            metrics
                .claimable_age_seconds
                .get_or_create(&l)
                .set(t.claimable_age_secs);
        }
        self.progress.log(metrics, &b);
    }

    async fn sample_dead_letters(&mut self, conn: &mut PgConnection) {
        match dead_letter::counts(conn, self.topics.as_deref()).await {
            Ok(counts) => {
                let labels =
                    |t: &str, k: &str| vec![("topic", t.to_owned()), ("kind", k.to_owned())];
                self.seen.reset_dead(
                    &self.metrics.dead_letters,
                    counts.iter().map(|(t, k, _)| labels(t, k)),
                );
                for (t, k, n) in &counts {
                    self.metrics
                        .dead_letters
                        .get_or_create(&labels(t, k))
                        .set(*n);
                }
            }
            Err(e) => tracing::warn!(error = %e, "Counting the dead letters failed."),
        }
    }

    async fn sample_blocked_keys(&mut self, conn: &mut PgConnection) {
        match dead_letter::blocked_keys(conn, &self.skip_topics, self.topics.as_deref()).await {
            Ok(n) => {
                self.metrics.blocked_keys.set(n);
                self.blocked_log.log(n);
            }
            Err(e) => tracing::warn!(error = %e, "Counting the blocked ordering keys failed."),
        }
    }
}

/// Label sets the gauge families had at the last sample: those gone since are set to 0, so a
/// drained topic reads 0 instead of its last value.
#[derive(Default)]
struct Seen {
    topics: Vec<Labels>,
    dead: Vec<Labels>,
}

impl Seen {
    /// Calls `zero` for each topic label set seen last time and not now.
    fn zero_gone(&mut self, now: &[Labels], mut zero: impl FnMut(&Labels)) {
        for gone in self.topics.iter().filter(|l| !now.contains(l)) {
            zero(gone);
        }
        self.topics = now.to_vec();
    }

    fn reset_dead(&mut self, family: &Family<Labels, Gauge>, now: impl Iterator<Item = Labels>) {
        let now: Vec<Labels> = now.collect();
        for gone in self.dead.iter().filter(|l| !now.contains(l)) {
            family.get_or_create(gone).set(0);
        }
        self.dead = now;
    }
}

/// The once-a-minute progress line.
struct Progress {
    last_published: u64,
    last_report: std::time::Instant,
}

impl Progress {
    fn new(published: u64) -> Self {
        Self {
            last_published: published,
            last_report: std::time::Instant::now(),
        }
    }

    fn log(&mut self, metrics: &Metrics, backlog: &[outbox::TopicBacklog]) {
        let elapsed = self.last_report.elapsed();
        if elapsed < Duration::from_secs(60) {
            return;
        }
        let published = metrics.published.get();
        let delta = published - self.last_published;
        let pending: i64 = backlog.iter().map(|t| t.pending).sum();
        let oldest = backlog
            .iter()
            .map(|t| t.oldest_due_age_secs)
            .fold(0.0, f64::max);
        if delta > 0 || pending > 0 {
            tracing::info!(
                published = delta,
                per_second = (delta as f64 / elapsed.as_secs_f64()).round(),
                backlog = pending,
                oldest_due_age_secs = oldest,
                "Published messages in the last minute, and the backlog."
            );
        }
        self.last_published = published;
        self.last_report = std::time::Instant::now();
    }
}

/// Blocked keys are alert-worthy but not every 10 s: logged when the count changes, else once a
/// minute.
struct BlockedLog {
    last: i64,
    logged_at: std::time::Instant,
}

impl Default for BlockedLog {
    fn default() -> Self {
        Self {
            last: 0,
            logged_at: std::time::Instant::now(),
        }
    }
}

impl BlockedLog {
    fn log(&mut self, n: i64) {
        if n > 0 && (n != self.last || self.logged_at.elapsed() >= Duration::from_secs(60)) {
            tracing::error!(
                blocked_keys = n,
                "Ordering keys are blocked by dead letters: replay or discard them (dispatcher status names them)."
            );
            self.logged_at = std::time::Instant::now();
        }
        self.last = n;
    }
}

/// Keeps this replica's heartbeat row fresh every 5 s and deletes the rows of replicas without a
/// heartbeat for `forget_after` (killed ones: a clean stop removes its own row, as this does).
pub(crate) async fn heartbeat<P: Publish>(
    d: Arc<Dispatch<P>>,
    topics: Option<Vec<String>>,
    forget_after: Duration,
    mut shutdown: Shutdown,
) {
    let forget_secs = forget_after.as_secs_f64();
    let hostname = std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.is_empty())
        .or_else(|| {
            std::fs::read_to_string("/etc/hostname")
                .ok()
                .map(|h| h.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown".to_owned());
    let started_at = Utc::now();
    let pid = std::process::id();
    let mut row = Replica {
        replica_id: format!("{hostname}-{pid}-{}", started_at.timestamp_millis()),
        hostname,
        pid: i32::try_from(pid).unwrap_or(i32::MAX),
        version: env!("CARGO_PKG_VERSION").to_owned(),
        build_commit: Some(outbox_runtime::release::COMMIT.to_owned()),
        topics,
        started_at,
        heartbeat_at: started_at,
        breaker_open: false,
        breaker_reason: None,
        batches_in_flight: 0,
        rows_in_flight: 0,
        published: 0,
    };
    loop {
        row.breaker_reason = d.breaker.open_reason();
        row.breaker_open = row.breaker_reason.is_some();
        (row.batches_in_flight, row.rows_in_flight) = d.in_flight();
        row.published = i64::try_from(d.metrics.published.get()).unwrap_or(i64::MAX);
        match d.pool.begin().await {
            // No heartbeat table to write on a schema behind this release.
            Ok(_) if !d.schema.is_open() => {}
            Ok(mut tx) => match replica::heartbeat(&mut tx, &row).await {
                Ok(()) => {
                    match replica::prune(&mut tx, forget_secs, None).await {
                        Ok(gone) if !gone.is_empty() => tracing::info!(
                            replicas = ?gone,
                            "Forgot replicas without a heartbeat for {forget_after:?}."
                        ),
                        Ok(_) => {}
                        Err(e) => tracing::warn!(error = %e, "Pruning gone replicas failed."),
                    }
                    match replica::live_releases(&mut tx, crate::ops::status::STALE_AFTER).await {
                        Ok(live) => {
                            d.metrics.replicas.clear();
                            for r in live {
                                d.metrics
                                    .replicas
                                    .get_or_create(&vec![("release", r.version)])
                                    .set(r.replicas);
                            }
                        }
                        Err(e) => {
                            tracing::debug!(error = %e, "Reading the replicas' releases failed.")
                        }
                    }
                    if let Err(e) = tx.commit().await {
                        tracing::warn!(error = %e, "Committing the replica heartbeat failed; will retry.");
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "Writing the replica heartbeat failed; will retry.")
                }
            },
            Err(e) => {
                tracing::warn!(error = %e, "No database connection for the replica heartbeat.")
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(5)) => {}
            _ = shutdown.requested() => break,
        }
    }
    if let Ok(mut tx) = d.pool.begin().await
        && replica::remove(&mut tx, &row.replica_id).await.is_ok()
    {
        let _ = tx.commit().await;
    }
}

/// Deletes retained published rows older than `retention`, 1,000 at a time.
pub(crate) async fn purge(
    pool: PgPool,
    schema: Arc<SchemaGate>,
    retention: Duration,
    interval: Duration,
    mut shutdown: Shutdown,
) {
    let retention = chrono::Duration::from_std(retention).unwrap_or(chrono::Duration::MAX);
    loop {
        while schema.is_open() {
            let before = Utc::now() - retention;
            let deleted = match pool.begin().await {
                Ok(mut tx) => match outbox::purge_published(&mut tx, before, 1000).await {
                    Ok(n) => tx
                        .commit()
                        .await
                        .map(|()| n)
                        .map_err(outbox_shared::Error::commit),
                    Err(e) => Err(e),
                },
                Err(e) => Err(outbox_shared::Error::begin(e)),
            };
            match deleted {
                Ok(1000) => continue,
                Ok(_) => break,
                Err(e) => {
                    tracing::warn!(error = %e, "Purging published rows failed; will retry.");
                    break;
                }
            }
        }
        tokio::select! { _ = tokio::time::sleep(interval) => {}, _ = shutdown.requested() => return }
    }
}
