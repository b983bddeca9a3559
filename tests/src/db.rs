//! A fresh, migrated database per test, dropped when the test ends.

use std::str::FromStr;

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgConnection};

use crate::env;

/// The outbox's group roles (deploy/sql/roles.sql, which deploy/sql/bootstrap.sql includes).
pub const BOOTSTRAP_ROLES: &str = include_str!("../../deploy/sql/roles.sql");

/// A scratch database created from an admin URL (`DATABASE_URL` for tests), migrated, and
/// dropped on drop. Tests, benchmarks and chaos runs all work in one.
#[derive(Debug)]
pub struct TestDb {
    /// A pool on the test database (default session settings).
    pub pool: PgPool,
    /// The test database's name.
    pub name: String,
    url: String,
    admin_url: String,
    options: PgConnectOptions,
}

impl TestDb {
    /// Creates and migrates a fresh database from `DATABASE_URL`.
    pub async fn new() -> Self {
        Self::create(&env::database_url(), "outbox_test")
            .await
            .expect("a migrated test database (run `scripts/services up`; the DATABASE_URL role needs CREATEDB)")
    }

    /// Creates a fresh database from `DATABASE_URL` without applying migrations.
    pub async fn empty() -> Self {
        Self::create_empty(&env::database_url(), "outbox_test")
            .await
            .expect(
                "a test database (run `scripts/services up`; the DATABASE_URL role needs CREATEDB)",
            )
    }

    /// Creates and migrates a database named `<prefix>_<unique>` on the server of `admin_url`.
    pub async fn create(admin_url: &str, prefix: &str) -> Result<Self, outbox_shared::Error> {
        let db = Self::create_empty(admin_url, prefix)
            .await
            .map_err(|source| outbox_shared::Error::Database {
                context: "creating a scratch database (the role needs CREATEDB)",
                source,
            })?;
        outbox_shared::migrate(&db.pool).await?;
        Ok(db)
    }

    async fn create_empty(admin_url: &str, prefix: &str) -> Result<Self, sqlx::Error> {
        let admin = PgConnectOptions::from_str(admin_url)?.disable_statement_logging();
        let name = env::unique_name(prefix).to_lowercase();
        let mut conn = PgConnection::connect_with(&admin).await?;
        // The group roles, as an administrator creates them before the first migration (the
        // migrations never create roles). Cluster-wide and idempotent.
        sqlx::raw_sql(BOOTSTRAP_ROLES).execute(&mut conn).await?;
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(&mut conn)
            .await?;
        let _ = conn.close().await;
        let options = admin.clone().database(&name);
        let pool = PgPoolOptions::new()
            .max_connections(20)
            .connect_with(options.clone())
            .await?;
        let url = replace_database(admin_url, &name);
        Ok(Self {
            pool,
            name,
            url,
            admin_url: admin_url.to_owned(),
            options,
        })
    }

    /// A URL of the test database (for dispatcher/producer processes the test spawns).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Connect options of the test database, for pools with other settings.
    pub fn options(&self) -> PgConnectOptions {
        self.options.clone()
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        // Drop cannot await, and a nested runtime here can stall on connections that belong to
        // the test's runtime: psql is synchronous and simple. WITH (FORCE) ends open sessions.
        let _ = std::process::Command::new("psql")
            .arg(&self.admin_url)
            .args(["-q", "-v", "ON_ERROR_STOP=1", "-c"])
            .arg(format!(
                "DROP DATABASE IF EXISTS {} WITH (FORCE)",
                self.name
            ))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status();
    }
}

/// Replaces the database name in a postgres URL (keeping any query string).
fn replace_database(url: &str, name: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let scheme_end = base.find("://").map_or(0, |i| i + 3);
    let path_start = base[scheme_end..].find('/').map(|i| i + scheme_end);
    let host = path_start.map_or(base, |i| &base[..i]);
    match query {
        Some(q) => format!("{host}/{name}?{q}"),
        None => format!("{host}/{name}"),
    }
}

#[cfg(test)]
mod tests {
    use super::replace_database;

    #[test]
    fn database_names_are_replaced() {
        assert_eq!(
            replace_database("postgres://u@h:1/postgres", "x"),
            "postgres://u@h:1/x"
        );
        assert_eq!(
            replace_database("postgres://u@h:1", "x"),
            "postgres://u@h:1/x"
        );
        assert_eq!(
            replace_database("postgres://u@h/db?sslmode=disable", "x"),
            "postgres://u@h/x?sslmode=disable"
        );
    }
}
