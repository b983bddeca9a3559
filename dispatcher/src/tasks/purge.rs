//! The purge of retained published rows (`--retention`): deleted in slices, never while the
//! schema is behind this release.

use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use sqlx::PgPool;

use outbox_runtime::shutdown::Shutdown;
use outbox_shared::store::outbox;

use crate::refusals::schema::SchemaGate;

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
