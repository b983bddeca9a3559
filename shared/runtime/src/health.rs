//! The operator endpoints: `/healthz` (the process is alive: its liveness check passes), `/readyz`
//! (its dependencies answer) and `/metrics` (Prometheus text format).
//!
//! `/readyz` always answers within [`READINESS_DEADLINE`]: a check that takes longer (a database
//! that does not answer) reports not ready instead of leaving the probe hanging.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;

use crate::shutdown::Shutdown;

/// A readiness probe: `Ok` when ready, `Err(reason)` when not.
pub type ReadinessCheck =
    Arc<dyn Fn() -> Pin<Box<dyn Future<Output = Result<(), String>> + Send>> + Send + Sync>;

/// A liveness check: `Ok` while the process makes progress, `Err(reason)` when it is wedged.
pub type LivenessCheck = Arc<dyn Fn() -> Result<(), String> + Send + Sync>;

/// The longest `/readyz` takes to answer.
pub const READINESS_DEADLINE: Duration = Duration::from_millis(900);

/// What the endpoints report.
#[derive(Clone)]
pub struct Checks {
    /// Behind `/healthz`.
    pub live: LivenessCheck,
    /// Behind `/readyz`.
    pub ready: ReadinessCheck,
}

#[derive(Clone)]
struct AppState {
    registry: Arc<Registry>,
    checks: Checks,
}

/// Binds the listen address (port 0 picks a free port; the bound address is returned).
pub async fn bind(addr: SocketAddr) -> std::io::Result<(TcpListener, SocketAddr)> {
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    Ok((listener, local))
}

/// Serves the endpoints until `shutdown` fires.
pub async fn serve(
    listener: TcpListener,
    registry: Arc<Registry>,
    checks: Checks,
    mut shutdown: Shutdown,
) -> std::io::Result<()> {
    let app = Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(AppState { registry, checks });
    axum::serve(listener, app)
        .with_graceful_shutdown(async move { shutdown.requested().await })
        .await
}

async fn healthz(State(state): State<AppState>) -> Response {
    match (state.checks.live)() {
        Ok(()) => (StatusCode::OK, "ok\n").into_response(),
        Err(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not alive: {reason}\n"),
        )
            .into_response(),
    }
}

async fn readyz(State(state): State<AppState>) -> Response {
    let answer = tokio::time::timeout(READINESS_DEADLINE, (state.checks.ready)()).await;
    let result = answer.unwrap_or_else(|_| {
        Err(format!(
            "the readiness check did not answer within {READINESS_DEADLINE:?}"
        ))
    });
    match result {
        Ok(()) => (StatusCode::OK, "ready\n").into_response(),
        Err(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {reason}\n"),
        )
            .into_response(),
    }
}

async fn metrics(State(state): State<AppState>) -> Response {
    let mut body = String::new();
    match prometheus_client::encoding::text::encode(&mut body, &state.registry) {
        Ok(()) => (
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            body,
        )
            .into_response(),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("encoding metrics failed: {e}\n"),
        )
            .into_response(),
    }
}
