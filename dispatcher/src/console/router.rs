//! The console's routes ([`router`]): the pages, the actions, the stylesheet and `/healthz`,
//! every answer with the security headers ([`html::secure_every`]); in local mode every route
//! sits behind the check of the request's `Host` ([`is_loopback_host`]: loopback names only,
//! against DNS rebinding).

use std::sync::Arc;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use axum::routing::{get, post};

use super::state::Console;
use super::{audit, auth, blocked, change, dead_letters, html, overview, pending};

/// The console's routes on `console`.
pub fn router(console: Arc<Console>) -> Router {
    Router::new()
        .route("/", get(overview::overview))
        .route("/pending", get(pending::page_of))
        .route("/dead-letters", get(dead_letters::dead_letters))
        .route("/dead-letters/{id}", get(dead_letters::dead_letter))
        .route("/audit", get(audit::audit))
        .route("/actions/preview", post(change::preview))
        .route("/actions/apply", post(change::apply))
        .route("/console.css", get(stylesheet))
        .route("/blocked-keys", get(blocked::keys_page))
        .route("/healthz", get(healthz))
        .fallback(not_found)
        .layer(axum::middleware::from_fn_with_state(
            console.clone(),
            only_loopback_hosts,
        ))
        .layer(axum::middleware::map_response(html::secure_every))
        .with_state(console)
}

/// Whether the `Host` of a request names this machine's loopback (`127.0.0.1`, `[::1]`,
/// `localhost`, with any port): in local mode nothing else is served, so a page an attacker
/// serves under a name that resolves to 127.0.0.1 (DNS rebinding) reads and posts nothing.
pub fn is_loopback_host(headers: &HeaderMap) -> bool {
    let Some(host) = headers
        .get(axum::http::header::HOST)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let name = match host.rsplit_once(':') {
        // IPv6 literals keep their brackets; a colon inside them is not a port.
        Some((name, port)) if !port.contains(']') && port.bytes().all(|b| b.is_ascii_digit()) => {
            name
        }
        _ => host,
    };
    name == "127.0.0.1" || name == "[::1]" || name.eq_ignore_ascii_case("localhost")
}

/// An unknown path.
async fn not_found() -> Response {
    html::respond(
        StatusCode::NOT_FOUND,
        "text/plain; charset=utf-8",
        "No such page: the console has /, /pending, /dead-letters, /blocked-keys and /audit.\n"
            .into(),
    )
}

/// Local mode: refuses a request whose `Host` is not a loopback name before anything renders
/// ([`is_loopback_host`]). Behind IAP the proxy's assertion decides instead.
async fn only_loopback_hosts(
    State(c): State<Arc<Console>>,
    request: Request,
    next: axum::middleware::Next,
) -> Response {
    if matches!(c.auth, auth::Auth::Local { .. }) && !is_loopback_host(request.headers()) {
        tracing::warn!(
            host = ?request.headers().get(axum::http::header::HOST),
            "A console request for another host name was refused (local mode answers to 127.0.0.1, [::1] and localhost only)."
        );
        return html::respond(
            StatusCode::MISDIRECTED_REQUEST,
            "text/plain; charset=utf-8",
            "This console (local mode) answers only to http://127.0.0.1, http://[::1] and \
             http://localhost with its port: a page under another host name cannot use it.\n"
                .into(),
        );
    }
    next.run(request).await
}

async fn stylesheet() -> Response {
    html::respond(
        StatusCode::OK,
        "text/css; charset=utf-8",
        html::CSS.to_owned(),
    )
}

/// Liveness for the load balancer's health check (which comes without an identity): the
/// database answers.
async fn healthz(State(c): State<Arc<Console>>) -> Response {
    match sqlx::query("SELECT 1").execute(&c.pool).await {
        Ok(_) => html::respond(StatusCode::OK, "text/plain; charset=utf-8", "ok\n".into()),
        Err(_) => html::respond(
            StatusCode::SERVICE_UNAVAILABLE,
            "text/plain; charset=utf-8",
            "the database does not answer\n".into(),
        ),
    }
}
