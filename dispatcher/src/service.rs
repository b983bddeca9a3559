//! The long-running service: connects, starts the workers, the LISTEN task, the backlog sampler,
//! the purge task and the HTTP endpoints, and shuts them down in order.

use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use prometheus_client::registry::Registry;
use sqlx::PgPool;
use sqlx::postgres::PgListener;
use tokio::sync::Notify;
use tokio::task::JoinSet;

use outbox_shared::health::{self, ReadinessCheck};
use outbox_shared::message::full_topic_name;
use outbox_shared::retry::RetrySchedule;
use outbox_shared::shutdown::Shutdown;
use outbox_shared::store::{dead_letter, outbox};

use crate::breaker::Breaker;
use crate::chaos::{self, Chaos};
use crate::cli::Cli;
use crate::error::DispatcherError;
use crate::metrics::Metrics;
use crate::publisher::PubsubPublisher;
use crate::worker::{self, BatchSettings, Dispatch, Idle};

/// Cap on the backlog count (an index-only scan that stops here).
const BACKLOG_CAP: i64 = 1_000_000;

/// Runs the dispatcher until `shutdown` fires, then drains in-flight batches within the grace
/// period.
pub async fn run(cli: &Cli, shutdown: Shutdown) -> Result<(), DispatcherError> {
    let args = &cli.dispatch;
    args.validate(cli.pubsub.publish_timeout)
        .map_err(DispatcherError::Config)?;
    let settings = [
        // A lost settle only re-publishes (consumers dedupe), so the dispatcher's commits need not
        // wait for the WAL flush: 1.2-2.3x more batches per second at small batch sizes.
        ("synchronous_commit", "off".to_owned()),
        // A claim transaction idle this long belongs to a hung dispatcher: end it, free its rows.
        (
            "idle_in_transaction_session_timeout",
            format!("{}", args.lock_timeout.as_millis()),
        ),
    ];
    let pool = outbox_shared::db::connect_with_settings(
        &cli.database,
        "pubsub-outbox-dispatcher",
        &settings,
    )
    .await?;
    if args.migrate {
        outbox_shared::db::migrate(&pool).await?;
    }
    let publisher = PubsubPublisher::connect(&cli.pubsub).await?;
    let code = chaos::parse_code(&args.chaos_failure_code)
        .unwrap_or(google_cloud_gax::error::rpc::Code::Unavailable);
    if args.chaos_failure_rate > 0.0 {
        tracing::warn!(
            rate = args.chaos_failure_rate,
            code = code.name(),
            "CHAOS: failing publishes on purpose"
        );
    }
    let publisher = Arc::new(Chaos::new(publisher, args.chaos_failure_rate, code));

    let mut registry = Registry::default();
    let metrics = Arc::new(Metrics::register(&mut registry));
    let topics = (!args.topics.is_empty()).then(|| {
        args.topics
            .iter()
            .map(|t| full_topic_name(&cli.pubsub.pubsub_project, t))
            .collect::<Vec<_>>()
    });
    let settings = BatchSettings {
        batch_size: args.batch_size,
        topics,
        retain_published: !args.retention.is_zero(),
        dedupe_attribute: cli.pubsub.dedupe_attribute.clone(),
        schedule: RetrySchedule {
            base: args.backoff_base,
            cap: args.backoff_cap,
            jitter: args.backoff_jitter,
            max_attempts: args.max_attempts,
        },
        key_scan_limit: args.key_scan_limit.max(1),
        skip_dead_letter_topics: args
            .skip_dead_letter_topics
            .iter()
            .map(|t| full_topic_name(&cli.pubsub.pubsub_project, t))
            .collect(),
    };
    let breaker = Arc::new(Breaker::new(
        args.breaker_cooldown,
        args.breaker_max_cooldown,
        metrics.breaker_open.clone(),
    ));
    let dispatch = Arc::new(Dispatch::new(
        pool.clone(),
        publisher,
        settings,
        metrics.clone(),
        breaker,
        args.max_inflight_bytes,
    ));

    let (listener, addr) =
        health::bind(args.listen_addr)
            .await
            .map_err(|source| DispatcherError::Listen {
                addr: args.listen_addr,
                source,
            })?;
    let mut background = JoinSet::new();
    background.spawn(health_server(
        listener,
        registry,
        readiness(pool.clone(), dispatch.breaker.clone()),
        shutdown.clone(),
    ));

    let wakeup = Arc::new(Notify::new());
    if !args.no_listen {
        background.spawn(listen(
            pool.clone(),
            args.notify_channel.clone(),
            wakeup.clone(),
            shutdown.clone(),
        ));
    }
    background.spawn(sample_backlog(
        pool.clone(),
        metrics.clone(),
        dispatch.settings.skip_dead_letter_topics.clone(),
        shutdown.clone(),
    ));
    if !args.retention.is_zero() {
        background.spawn(purge(
            pool.clone(),
            args.retention,
            args.purge_interval,
            shutdown.clone(),
        ));
    }

    let idle = Idle {
        poll_interval: args.poll_interval,
        max_poll_interval: args.max_poll_interval,
    };
    let mut workers = JoinSet::new();
    for n in 0..args.workers {
        workers.spawn(worker::work(
            dispatch.clone(),
            n,
            wakeup.clone(),
            idle,
            shutdown.clone(),
        ));
    }
    tracing::info!(%addr, workers = args.workers, batch_size = args.batch_size,
        topics = ?dispatch.settings.topics, "dispatcher started");

    let mut stop = shutdown.clone();
    stop.requested().await;
    let drained = tokio::time::timeout(args.grace_period, async {
        while workers.join_next().await.is_some() {}
    })
    .await;
    background.abort_all();
    match drained {
        Ok(()) => {
            pool.close().await;
            tracing::info!("dispatcher stopped: in-flight batches settled");
            Ok(())
        }
        Err(_) => Err(DispatcherError::GraceExceeded(args.grace_period)),
    }
}

async fn health_server(
    listener: tokio::net::TcpListener,
    registry: Registry,
    ready: ReadinessCheck,
    shutdown: Shutdown,
) {
    if let Err(e) = health::serve(listener, Arc::new(registry), ready, shutdown).await {
        tracing::error!(error = %e, "the health/metrics endpoint stopped");
    }
}

/// Ready when the database answers and the breaker is closed (Pub/Sub reachable).
fn readiness(pool: PgPool, breaker: Arc<Breaker>) -> ReadinessCheck {
    Arc::new(move || {
        let pool = pool.clone();
        let breaker = breaker.clone();
        Box::pin(async move {
            sqlx::query("SELECT 1")
                .execute(&pool)
                .await
                .map_err(|e| format!("database: {e}"))?;
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
async fn listen(pool: PgPool, channel: String, wakeup: Arc<Notify>, mut shutdown: Shutdown) {
    let mut backoff = Duration::from_millis(500);
    loop {
        let mut listener = match PgListener::connect_with(&pool).await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, "LISTEN connection failed; polling meanwhile");
                tokio::select! { _ = tokio::time::sleep(backoff) => {}, _ = shutdown.requested() => return }
                backoff = (backoff * 2).min(Duration::from_secs(30));
                continue;
            }
        };
        if let Err(e) = listener.listen(&channel).await {
            tracing::warn!(error = %e, channel = %channel, "LISTEN failed; polling meanwhile");
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
                        tracing::warn!(error = %e, "LISTEN connection lost; reconnecting");
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
async fn sample_backlog(
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
                                    "progress"
                                );
                            }
                            last_published = published;
                            last_report = std::time::Instant::now();
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, "reading the backlog failed"),
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
                                "ordering keys are blocked by dead letters: replay or discard them"
                            );
                            last_blocked_log = std::time::Instant::now();
                        }
                        last_blocked = n;
                    }
                    Err(e) => tracing::warn!(error = %e, "counting blocked ordering keys failed"),
                }
            }
            Err(e) => tracing::warn!(error = %e, "no database connection for the backlog gauges"),
        }
        tokio::select! { _ = tokio::time::sleep(Duration::from_secs(10)) => {}, _ = shutdown.requested() => return }
    }
}

/// Deletes retained published rows older than `retention`, 1,000 at a time.
async fn purge(pool: PgPool, retention: Duration, interval: Duration, mut shutdown: Shutdown) {
    let retention = chrono::Duration::from_std(retention).unwrap_or(chrono::Duration::MAX);
    loop {
        loop {
            let before = Utc::now() - retention;
            let deleted = match pool.acquire().await {
                Ok(mut conn) => outbox::purge_published(&mut conn, before, 1000).await,
                Err(e) => Err(outbox_shared::Error::Database {
                    context: "purging published rows",
                    source: e,
                }),
            };
            match deleted {
                Ok(1000) => continue,
                Ok(_) => break,
                Err(e) => {
                    tracing::warn!(error = %e, "purging published rows failed; will retry");
                    break;
                }
            }
        }
        tokio::select! { _ = tokio::time::sleep(interval) => {}, _ = shutdown.requested() => return }
    }
}
