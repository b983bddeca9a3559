//! The worker loop: runs the unit of work (`crate::batch::run_batch`) until shutdown, waking on
//! NOTIFY or the shared poll interval when idle, backing off after a failed batch, waiting while
//! the schema is behind this release (`crate::refusals::schema`) or Pub/Sub is unreachable
//! (`crate::refusals::breaker`).

use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use outbox_runtime::shutdown::Shutdown;
use tokio::sync::Notify;

use crate::batch::dispatch::Dispatch;
use crate::batch::outcome::BatchOutcome;
use crate::batch::run_batch;
use crate::pubsub::publish::Publish;

/// Runs batches until shutdown: back-to-back while there is work, waiting on NOTIFY or the shared
/// poll interval while idle or after a batch under a quarter full (with LISTEN on). One NOTIFY
/// wakes one idle worker; a worker that claimed a full batch wakes the next (there is likely more).
/// A batch in flight when shutdown arrives is finished.
pub(crate) async fn work<P: Publish>(
    d: Arc<Dispatch<P>>,
    worker: usize,
    wakeup: Arc<Notify>,
    mut shutdown: Shutdown,
) {
    let mut error_backoff = Duration::from_millis(200);
    loop {
        d.heartbeats.beat(worker);
        if shutdown.is_requested() {
            break;
        }
        d.schema
            .admit(&mut shutdown, || d.heartbeats.beat(worker))
            .await;
        d.breaker
            .admit(&*d.publisher, &mut shutdown, || d.heartbeats.beat(worker))
            .await;
        if shutdown.is_requested() {
            break;
        }
        let notified = wakeup.notified();
        match run_batch(&d, Utc::now()).await {
            Ok(BatchOutcome::Settled(s)) => {
                tracing::debug!(
                    worker,
                    published = s.published,
                    retried = s.retried,
                    dead_lettered = s.dead_lettered,
                    "Batch settled."
                );
                d.idle.found_work();
                let claimed = s.claimed as i64;
                if claimed >= d.settings.batch_size {
                    wakeup.notify_one();
                }
                error_backoff = Duration::from_millis(200);
                // Well short of full: the backlog is drained and rows trickle in. With LISTEN,
                // wait for the next (coalesced) notification rather than claim again at once, so
                // a steady trickle is published in batches of a coalescing window each, not in
                // back-to-back claims of a row or two (measured: "Latency" in
                // docs/benchmarks/2026-12-01-throughput-latency.md).
                if d.listening && claimed * 4 < d.settings.batch_size {
                    tokio::select! {
                        _ = notified => {}
                        _ = tokio::time::sleep(d.idle.current()) => {}
                        _ = shutdown.requested() => break,
                    }
                }
            }
            Ok(BatchOutcome::Outage { error, released }) => {
                tracing::debug!(worker, released, %error, "Batch released: Pub/Sub is unreachable.");
            }
            Ok(BatchOutcome::Empty) => {
                d.metrics.empty_claims.inc();
                tokio::select! {
                    _ = notified => {}
                    _ = tokio::time::sleep(d.idle.current()) => d.idle.found_nothing(),
                    _ = shutdown.requested() => break,
                }
            }
            Err(e) if e.is_schema_mismatch() && !d.schema.check(&d.pool).await => {
                // The schema lacks what the statement named: the gate closed and says why (once
                // an interval); the next turn waits at it.
                tracing::debug!(worker, error = %e, "A batch failed on a schema behind this release.");
            }
            Err(e) => {
                // Logged once here (run_batch's span records it at debug level).
                tracing::error!(worker, error = %e, retry_in = ?error_backoff, "A batch failed; its rows will be claimed again.");
                tokio::select! {
                    _ = tokio::time::sleep(error_backoff) => {}
                    _ = shutdown.requested() => break,
                }
                error_backoff = (error_backoff * 2).min(Duration::from_secs(10));
            }
        }
    }
    tracing::debug!(worker, "Worker stopped.");
}
