//! Connecting to PostgreSQL and applying the embedded schema migrations.
//!
//! Connecting retries with backoff for a bounded time (`backon`: an in-process retry horizon), then
//! fails with an error that names the (password-masked) URL and what to check.

use std::str::FromStr;
use std::time::{Duration, Instant};

use backon::{ExponentialBuilder, Retryable};
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};

use crate::error::{Error, Result, mask_url};

/// The schema, embedded at build time from `migrations/`.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations");

/// Database settings shared by both binaries.
#[derive(Debug, Clone, clap::Args)]
pub struct DatabaseArgs {
    /// PostgreSQL URL, e.g. postgres://user:password@host:5432/db (Cloud SQL: via the Auth Proxy
    /// or a private IP).
    #[arg(long = "database-url", env = "DATABASE_URL", hide_env_values = true)]
    pub url: String,
    /// Maximum connections in the pool.
    #[arg(
        long = "db-pool-size",
        env = "OUTBOX_DB_POOL_SIZE",
        default_value_t = 10
    )]
    pub pool_size: u32,
    /// How long to keep retrying the first connection before giving up.
    #[arg(long = "db-connect-timeout", env = "OUTBOX_DB_CONNECT_TIMEOUT", default_value = "30s",
          value_parser = humantime::parse_duration)]
    pub connect_timeout: Duration,
}

/// Opens a pool, retrying with backoff for up to `args.connect_timeout`.
pub async fn connect(args: &DatabaseArgs, application_name: &str) -> Result<PgPool> {
    connect_with_settings(args, application_name, &[]).await
}

/// Like [`connect`], with session settings (`SET name = value`) sent at connection start-up, so
/// they cost no round trip per transaction.
pub async fn connect_with_settings(
    args: &DatabaseArgs,
    application_name: &str,
    settings: &[(&str, String)],
) -> Result<PgPool> {
    let masked = mask_url(&args.url);
    let options = PgConnectOptions::from_str(&args.url)
        .map_err(|source| Error::BadUrl {
            url: masked.clone(),
            source,
        })?
        .application_name(application_name)
        .options(settings.iter().map(|(k, v)| (*k, v.as_str())));
    let started = Instant::now();
    let budget = args.connect_timeout;
    // Each attempt is bounded too (a black-holed address would otherwise hang in connect), and
    // the whole retry loop by `budget`, so --db-connect-timeout is a real upper bound.
    let per_attempt = budget.clamp(Duration::from_millis(200), Duration::from_secs(10));
    let attempt = || {
        PgPoolOptions::new()
            .max_connections(args.pool_size.max(1))
            .acquire_timeout(per_attempt)
            .connect_with(options.clone())
    };
    let retrying = attempt
        .retry(
            ExponentialBuilder::default()
                .with_min_delay(Duration::from_millis(200))
                .with_max_delay(Duration::from_secs(5))
                .with_total_delay(Some(budget))
                .without_max_times(),
        )
        .when(|e| !matches!(e, sqlx::Error::Configuration(_)))
        .notify(|e, wait| {
            tracing::warn!(error = %e, retry_in = ?wait, url = %masked, "PostgreSQL not reachable yet; retrying");
        });
    let result = match tokio::time::timeout(budget + per_attempt, retrying).await {
        Ok(result) => result,
        Err(_) => Err(sqlx::Error::PoolTimedOut),
    };
    result.map_err(|source| Error::Connect {
        url: masked.clone(),
        waited: started.elapsed(),
        source,
    })
}

/// Applies every pending migration (idempotent: applied ones are skipped).
pub async fn migrate(pool: &PgPool) -> Result<()> {
    MIGRATOR.run(pool).await?;
    Ok(())
}
