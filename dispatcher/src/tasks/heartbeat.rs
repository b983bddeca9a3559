//! This replica's heartbeat row (`pubsub_outbox_replica`: what `dispatcher status` lists), the
//! pruning of replicas gone without a clean stop, and the gauge of the live replicas' releases.

use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use sqlx::PgConnection;

use outbox_runtime::shutdown::Shutdown;
use outbox_shared::store::replica::{self, Replica};

use crate::batch::dispatch::Dispatch;
use crate::pubsub::publish::Publish;

/// Keeps this replica's heartbeat row fresh every 5 s and deletes the rows of replicas without a
/// heartbeat for `forget_after` (killed ones: a clean stop removes its own row, as this does).
pub(crate) async fn heartbeat<P: Publish>(
    d: Arc<Dispatch<P>>,
    topics: Option<Vec<String>>,
    forget_after: Duration,
    mut shutdown: Shutdown,
) {
    let mut row = this_replica(topics);
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
                    tidy(&d, &mut tx, forget_after).await;
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

/// This process's row, as it starts: named after its host, its pid and its start.
fn this_replica(topics: Option<Vec<String>>) -> Replica {
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
    Replica {
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
    }
}

/// In the heartbeat's transaction: forgets the replicas without a heartbeat for `forget_after`
/// and sets the gauge of the live replicas' releases.
async fn tidy<P>(d: &Dispatch<P>, tx: &mut PgConnection, forget_after: Duration) {
    match replica::prune(tx, forget_after.as_secs_f64(), None).await {
        Ok(gone) if !gone.is_empty() => tracing::info!(
            replicas = ?gone,
            "Forgot replicas without a heartbeat for {forget_after:?}."
        ),
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "Pruning gone replicas failed."),
    }
    match replica::live_releases(tx, crate::ops::status::STALE_AFTER).await {
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
}
