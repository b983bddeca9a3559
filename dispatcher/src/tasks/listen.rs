//! LISTEN: writers' NOTIFYs wake the idle workers, so a committed row is claimed at once rather
//! than at the next poll.

use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::PgListener;
use tokio::sync::Notify;

use outbox_runtime::shutdown::Shutdown;

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
