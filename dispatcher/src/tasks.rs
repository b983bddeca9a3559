//! The service's background tasks: the health server, LISTEN, the gauges and the purge of
//! retained rows. Each runs until shutdown and logs (never returns) its errors.

use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use prometheus_client::registry::Registry;
use sqlx::PgPool;
use sqlx::postgres::PgListener;
use tokio::sync::Notify;

use outbox_runtime::health::{self, Checks, LivenessCheck, ReadinessCheck};
use outbox_runtime::shutdown::Shutdown;
use outbox_shared::store::{dead_letter, outbox};

use crate::breaker::Breaker;
use crate::metrics::Metrics;
use crate::publisher::Publish;
use crate::worker::Dispatch;

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

/// Ready when the database answers (within the endpoint's deadline) and the breaker is closed
/// (Pub/Sub reachable).
pub(crate) fn readiness(pool: PgPool, breaker: Arc<Breaker>) -> ReadinessCheck {
    Arc::new(move || {
        let pool = pool.clone();
        let breaker = breaker.clone();
        Box::pin(async move {
            let ping = tokio::time::timeout(
                Duration::from_millis(800),
                sqlx::query("SELECT 1").execute(&pool),
            );
            match ping.await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => return Err(format!("database unreachable: {e}")),
                Err(_) => return Err("database unreachable: no answer within 800ms".to_owned()),
            }
            if breaker.is_closed() {
                Ok(())
            } else {
                Err("Pub/Sub unreachable (circuit breaker open)".to_owned())
            }
        })
    })
}

/// Wakes idle workers on NOTIFY; reconnects with backoff, waking everyone after a reconnect in
/// case a notification was missed.
pub(crate) async fn listen(
    pool: PgPool,
    channel: String,
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
        loop {
            tokio::select! {
                n = listener.recv() => match n {
                    Ok(_) => wakeup.notify_waiters(),
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

/// Refreshes the backlog and blocked-key gauges every 10 s (index-only scans, capped), and logs
/// progress once a minute while there is traffic or a backlog.
pub(crate) async fn sample_backlog(
    pool: PgPool,
    metrics: Arc<Metrics>,
    skip_topics: Vec<String>,
    mut shutdown: Shutdown,
) {
    let mut last_published = metrics.published.get();
    let mut last_report = std::time::Instant::now();
    let mut last_blocked = 0;
    let mut last_blocked_log = std::time::Instant::now();
    loop {
        match pool.acquire().await {
            Ok(mut conn) => {
                match outbox::backlog(&mut conn, Utc::now(), BACKLOG_CAP).await {
                    Ok(b) => {
                        metrics.backlog.set(b.pending);
                        metrics.oldest_due_age_seconds.set(b.oldest_due_age_secs);
                        let elapsed = last_report.elapsed();
                        if elapsed >= Duration::from_secs(60) {
                            let published = metrics.published.get();
                            let delta = published - last_published;
                            if delta > 0 || b.pending > 0 {
                                tracing::info!(
                                    published = delta,
                                    per_second = (delta as f64 / elapsed.as_secs_f64()).round(),
                                    backlog = b.pending,
                                    oldest_due_age_secs = b.oldest_due_age_secs,
                                    "Published messages in the last minute, and the backlog."
                                );
                            }
                            last_published = published;
                            last_report = std::time::Instant::now();
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, "Reading the backlog failed."),
                }
                match dead_letter::blocked_keys(&mut conn, &skip_topics).await {
                    Ok(n) => {
                        metrics.blocked_keys.set(n);
                        // Alert-worthy but not every 10 s: when the count changes, else once a minute.
                        if n > 0
                            && (n != last_blocked
                                || last_blocked_log.elapsed() >= Duration::from_secs(60))
                        {
                            tracing::error!(
                                blocked_keys = n,
                                "Ordering keys are blocked by dead letters: replay or discard them."
                            );
                            last_blocked_log = std::time::Instant::now();
                        }
                        last_blocked = n;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "Counting the blocked ordering keys failed.")
                    }
                }
            }
            Err(e) => tracing::warn!(error = %e, "No database connection for the backlog gauges."),
        }
        tokio::select! { _ = tokio::time::sleep(Duration::from_secs(10)) => {}, _ = shutdown.requested() => return }
    }
}

/// Deletes retained published rows older than `retention`, 1,000 at a time.
pub(crate) async fn purge(
    pool: PgPool,
    retention: Duration,
    interval: Duration,
    mut shutdown: Shutdown,
) {
    let retention = chrono::Duration::from_std(retention).unwrap_or(chrono::Duration::MAX);
    loop {
        loop {
            let before = Utc::now() - retention;
            let deleted = match pool.acquire().await {
                Ok(mut conn) => outbox::purge_published(&mut conn, before, 1000).await,
                Err(e) => Err(outbox_shared::Error::Database {
                    context: "acquiring a connection to purge published rows",
                    source: e,
                }),
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
