//! Connecting to PostgreSQL for the binaries: the clap argument group, a pool with session
//! settings, and bounded retries.
//!
//! Connecting retries with backoff for a bounded time (`backon`: an in-process retry horizon), then
//! fails with an error that names the (password-masked) URL and what to check.

use std::str::FromStr;
use std::time::{Duration, Instant};

use backon::{ExponentialBuilder, Retryable};
use sqlx::Connection;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool, PgPoolOptions};

/// Why a pool could not be opened.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// Could not reach PostgreSQL within the retry budget, or the server refused us.
    #[error(
        "cannot connect to PostgreSQL at {url} (gave up after {waited:.1?}): {source}. \
         Check DATABASE_URL (host, port, database name, user and password) and that the server \
         is running and reachable"
    )]
    Unreachable {
        /// The URL with any password masked.
        url: String,
        /// How long we kept trying.
        waited: Duration,
        /// The last error.
        #[source]
        source: sqlx::Error,
    },
    /// The DATABASE_URL could not be parsed.
    #[error(
        "invalid DATABASE_URL {url}: {source}. Expected postgres://user[:password]@host[:port]/database"
    )]
    BadUrl {
        /// The URL with any password masked.
        url: String,
        /// Why it failed to parse.
        #[source]
        source: sqlx::Error,
    },
}

impl ConnectError {
    /// Whether the configuration is wrong (a malformed URL, a database that does not exist, a
    /// role or password the server refuses), so retrying cannot help: the binaries exit 2.
    pub fn is_configuration(&self) -> bool {
        match self {
            Self::BadUrl { .. } => true,
            Self::Unreachable { source, .. } => is_final(source),
        }
    }
}

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
    /// The connection pooler between this process and PostgreSQL, if any: `none` (direct, or
    /// the Cloud SQL Auth Proxy), `session` (PgBouncer pool_mode=session: the same as direct), or
    /// `transaction` (PgBouncer pool_mode=transaction, Cloud SQL managed connection pooling):
    /// then statements are sent unnamed, each inside a transaction, and what needs a session of
    /// its own is refused (the dispatcher's LISTEN: use --no-listen; the producer's stream lock).
    #[arg(
        long = "db-pooler",
        env = "OUTBOX_DB_POOLER",
        value_enum,
        default_value = "none"
    )]
    pub pooler: Pooler,
}

/// The connection pooler in front of PostgreSQL.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Pooler {
    /// A direct connection (or the Auth Proxy, which is not a pooler).
    None,
    /// A pooler in session mode: a server connection per client connection, as direct.
    Session,
    /// A pooler in transaction mode: a server connection per transaction only.
    Transaction,
}

impl Pooler {
    /// Whether a session's state (named statements, session locks, LISTEN, session settings)
    /// is lost between transactions.
    pub fn per_transaction(self) -> bool {
        self == Self::Transaction
    }
}

impl DatabaseArgs {
    /// Settings for `url` with the defaults (tests and tools).
    pub fn for_url(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            pool_size: 10,
            connect_timeout: Duration::from_secs(30),
            pooler: Pooler::None,
        }
    }
}

/// Opens a pool, retrying with backoff for up to `args.connect_timeout`. Behind a
/// transaction-mode pooler (`--db-pooler transaction`) it also switches the store to unnamed
/// statements, process-wide ([`outbox_shared::store::use_unnamed_statements`]), and leaves out
/// the start-up parameters such a pooler refuses.
#[tracing::instrument(skip_all, fields(db.system = "postgresql", db.application = application_name), err(level = "debug"))]
pub async fn connect(args: &DatabaseArgs, application_name: &str) -> Result<PgPool, ConnectError> {
    let masked = mask_url(&args.url);
    if !(args.url.starts_with("postgres://") || args.url.starts_with("postgresql://")) {
        // sqlx would read any scheme as a host name and then fail to resolve it.
        return Err(ConnectError::BadUrl {
            url: masked,
            source: sqlx::Error::Configuration(
                "the scheme must be postgres:// or postgresql://".into(),
            ),
        });
    }
    let options = PgConnectOptions::from_str(&args.url)
        .map_err(|source| ConnectError::BadUrl {
            url: masked.clone(),
            source,
        })?
        .application_name(application_name)
        // A start-up parameter PgBouncer refuses unless told to ignore it; it only shapes floats
        // in text results, and sqlx reads results in binary.
        .extra_float_digits(None);
    let options = if args.pooler.per_transaction() {
        outbox_shared::store::use_unnamed_statements(true);
        // Nothing may be cached per server connection.
        options.statement_cache_capacity(0)
    } else {
        options
    };
    let started = Instant::now();
    let deadline = started + args.connect_timeout;
    // One connection proves the server answers and lets us in, and fails with the server's or
    // the network's own reason (a pool would only say it timed out). Each attempt is bounded by
    // what is left of --db-connect-timeout (a black-holed address would otherwise hang in
    // connect), so the whole wait is within it.
    let attempt = || async {
        let left = deadline.saturating_duration_since(Instant::now());
        let attempt_budget = left.clamp(Duration::from_millis(100), Duration::from_secs(10));
        match tokio::time::timeout(attempt_budget, PgConnection::connect_with(&options)).await {
            Ok(result) => result,
            Err(_) => Err(sqlx::Error::Io(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no answer within {attempt_budget:?}"),
            ))),
        }
    };
    let connected = attempt
        .retry(
            ExponentialBuilder::default()
                .with_min_delay(Duration::from_millis(200))
                .with_max_delay(Duration::from_secs(5))
                .with_total_delay(Some(args.connect_timeout))
                .without_max_times(),
        )
        .when(|e| !is_final(e) && Instant::now() + Duration::from_millis(200) < deadline)
        .notify(|e, wait| {
            tracing::warn!(error = %e, retry_in = ?wait, url = %masked, "PostgreSQL is not reachable yet; retrying.");
        })
        .await
        .map_err(|source| ConnectError::Unreachable {
            url: masked.clone(),
            waited: started.elapsed(),
            source,
        })?;
    let _ = connected.close().await;
    // Later connections are opened on demand; a slow one waits at most the connect timeout.
    Ok(PgPoolOptions::new()
        .max_connections(args.pool_size.max(1))
        .acquire_timeout(args.connect_timeout.max(Duration::from_secs(1)))
        .connect_lazy_with(options))
}

/// What `migrate` takes (both binaries).
#[derive(Debug, Clone, clap::Args)]
pub struct MigrateArgs {
    #[command(flatten)]
    pub database: DatabaseArgs,
    #[command(flatten)]
    pub timeouts: MigrateTimeouts,
    #[command(flatten)]
    pub telemetry: crate::telemetry::TelemetryArgs,
}

/// How a migration yields to the application's writes (docs/migrations.md).
#[derive(Debug, Clone, clap::Args)]
pub struct MigrateTimeouts {
    /// How long each statement of a migration waits for a lock before its migration rolls back
    /// and is tried again: the longest any write of the application queues behind a migration.
    #[arg(long = "migrate-lock-timeout", env = "OUTBOX_MIGRATE_LOCK_TIMEOUT", default_value = "3s",
          value_parser = humantime::parse_duration)]
    pub lock_timeout: Duration,
    /// How long one statement of a migration may run (an index build, a validation) before it is
    /// cancelled and its migration rolled back.
    #[arg(long = "migrate-statement-timeout", env = "OUTBOX_MIGRATE_STATEMENT_TIMEOUT",
          default_value = "15m", value_parser = humantime::parse_duration)]
    pub statement_timeout: Duration,
    /// How long a migration keeps retrying while other transactions hold its locks (retries
    /// back off from 1 s to 15 s with jitter) before `migrate` exits 1 naming the blocking
    /// session; also how long it waits for another `migrate` run to end.
    #[arg(long = "migrate-deadline", env = "OUTBOX_MIGRATE_DEADLINE", default_value = "5m",
          value_parser = humantime::parse_duration)]
    pub deadline: Duration,
}

impl MigrateTimeouts {
    /// The runner's settings.
    pub fn settings(&self) -> outbox_shared::db::MigrateSettings {
        outbox_shared::db::MigrateSettings {
            lock_timeout: self.lock_timeout,
            statement_timeout: self.statement_timeout,
            deadline: self.deadline,
        }
    }
}

/// Why `migrate` failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MigrateError {
    /// PostgreSQL could not be reached.
    #[error(transparent)]
    Connect(#[from] ConnectError),
    /// A migration or the bookkeeping failed (nothing was changed).
    #[error(transparent)]
    Migrate(#[from] outbox_shared::Error),
}

impl crate::exit::Failure for ConnectError {
    fn is_configuration(&self) -> bool {
        ConnectError::is_configuration(self)
    }
}

impl crate::exit::Failure for MigrateError {
    fn is_configuration(&self) -> bool {
        match self {
            Self::Connect(e) => e.is_configuration(),
            Self::Migrate(e) => e.is_configuration(),
        }
    }
}

/// The `migrate` command of both binaries: connects as the migrating role, applies what is
/// pending (each migration in its own transaction, yielding to the application's writes), and
/// says what it did (or what failed, once). Returns the exit code.
pub async fn migrate_command(args: &MigrateArgs) -> crate::exit::Exit {
    let applied = async {
        let pool = connect(&args.database, "pubsub-outbox-migrate").await?;
        let report = outbox_shared::db::migrate_with(&pool, &args.timeouts.settings()).await;
        pool.close().await;
        Ok::<_, MigrateError>(report?)
    };
    match applied.await {
        Ok(report) => {
            tracing::info!(
                applied = report.applied.len(),
                adopted = report.adopted.len(),
                up_to_date = report.up_to_date,
                "Migrations applied: {} new, {} already applied ({} of them taken over from _sqlx_migrations).",
                report.applied.len(),
                report.up_to_date,
                report.adopted.len()
            );
            crate::exit::Exit::Ok
        }
        Err(e) => crate::exit::fail(
            args.telemetry.log_format,
            "Migrating the database failed",
            &e,
        ),
    }
}

/// Errors no retry can fix: a bad configuration, a database that does not exist, a role or
/// password the server refuses. They fail at once with the server's reason.
fn is_final(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Configuration(_) => true,
        sqlx::Error::Database(db) => matches!(
            db.code().as_deref(),
            // invalid_catalog_name, invalid_authorization_specification, invalid_password,
            // protocol_violation (e.g. a pooler refusing a start-up parameter)
            Some("3D000" | "28000" | "28P01" | "08P01")
        ),
        _ => false,
    }
}

/// Returns `url` with the password (if any) replaced by `***`, safe for logs and errors.
pub fn mask_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let Some((userinfo, host)) = rest.rsplit_once('@') else {
        return url.to_owned();
    };
    match userinfo.split_once(':') {
        Some((user, _password)) => format!("{scheme}://{user}:***@{host}"),
        None => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::mask_url;

    #[test]
    fn masks_only_the_password() {
        assert_eq!(
            mask_url("postgres://u:secret@h:5432/db"),
            "postgres://u:***@h:5432/db"
        );
        assert_eq!(mask_url("postgres://u@h/db"), "postgres://u@h/db");
        assert_eq!(mask_url("postgres:///db"), "postgres:///db");
    }
}
