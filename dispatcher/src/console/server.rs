//! `dispatcher console` as a process: [`run`] checks the options, connects, binds, warns once
//! when its login is a superuser, and [`serve`]s until SIGTERM/SIGINT, the sampler and the
//! `status` refresher beside the routes.

use std::sync::Arc;
use std::time::Duration;

use outbox_runtime::exit::Exit;
use outbox_runtime::shutdown::{Shutdown, on_signals};
use sqlx::PgPool;

use super::args::ConsoleArgs;
use super::error::ConsoleError;
use super::router::router;
use super::samples;
use super::state::{Console, refresh_status};

/// Serves the console on `listener` until `shutdown` (the sampler runs beside it).
pub async fn serve(
    console: Arc<Console>,
    listener: tokio::net::TcpListener,
    interval: Duration,
    shutdown: Shutdown,
) -> std::io::Result<()> {
    let sampler = tokio::spawn(samples::sample(
        console.pool.clone(),
        console.samples.clone(),
        console.skip_dead_letter_topics.clone(),
        interval,
        shutdown.clone(),
    ));
    let refresher = tokio::spawn(refresh_status(console.clone(), shutdown.clone()));
    let mut stop = shutdown.clone();
    let served = axum::serve(listener, router(console))
        .with_graceful_shutdown(async move { stop.requested().await })
        .await;
    sampler.abort();
    refresher.abort();
    served
}

/// The console acts with its login's rights: an operator's (a member of `outbox_operator`, as
/// deploy/sql/bootstrap.sql makes one). A superuser can do anything the audit trail would not
/// show: said once at start.
async fn warn_if_superuser(pool: &PgPool) {
    let login = async {
        let mut tx = pool.begin().await.map_err(outbox_shared::Error::begin)?;
        let login = outbox_shared::store::status::login(&mut tx).await;
        let _ = tx.rollback().await;
        login
    };
    match login.await {
        Ok(l) if l.superuser => tracing::warn!(
            login = %l.name,
            "The console logs in as a superuser: it acts with more than an operator's rights. \
             Give it a login that is a member of outbox_operator only (deploy/sql/bootstrap.sql \
             -v operator=NAME)."
        ),
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "Reading the console's login failed."),
    }
}

/// `dispatcher console`: checks the options, connects, serves until SIGTERM/SIGINT.
pub async fn run(args: &ConsoleArgs) -> Exit {
    match start_and_serve(args).await {
        Ok(()) => Exit::Ok,
        Err(e) => outbox_runtime::exit::fail(args.telemetry.log_format, "The console failed", &e),
    }
}

async fn start_and_serve(args: &ConsoleArgs) -> Result<(), ConsoleError> {
    args.check().map_err(ConsoleError::Config)?;
    let pool = outbox_runtime::db::connect(&args.database, "pubsub-outbox-console").await?;
    let listener = tokio::net::TcpListener::bind(args.listen_addr)
        .await
        .map_err(|source| ConsoleError::Listen {
            addr: args.listen_addr,
            source,
        })?;
    let addr = listener.local_addr().map_or(args.listen_addr, |a| a);
    warn_if_superuser(&pool).await;
    let console = Arc::new(Console::new(args, pool));
    tracing::info!(addr = %addr, auth = ?args.auth, actions = args.actions,
        "The console is up: http://{addr}/");
    let signals = on_signals();
    serve(console, listener, args.sample_interval, signals.shutdown)
        .await
        .map_err(ConsoleError::Serve)
}
