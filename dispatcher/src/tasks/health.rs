//! The HTTP endpoints (`/healthz`, `/readyz`, `/metrics`) and the checks behind the first two:
//! alive while no worker is stuck, ready while the database answers on a current schema and
//! Pub/Sub is reachable.

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::registry::Registry;
use sqlx::PgPool;

use outbox_runtime::health::{self, Checks, LivenessCheck, ReadinessCheck};
use outbox_runtime::shutdown::Shutdown;

use crate::batch::dispatch::Dispatch;
use crate::pubsub::publish::Publish;
use crate::refusals::breaker::Breaker;
use crate::refusals::schema::SchemaGate;

/// Serves the endpoints until shutdown.
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
