//! A fresh, migrated database per test, dropped when the test ends.

use std::str::FromStr;

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgConnection};

use crate::env;

/// A database created for one test from `DATABASE_URL`, migrated, and dropped on drop.
#[derive(Debug)]
pub struct TestDb {
    /// A pool on the test database.
    pub pool: PgPool,
    /// The test database's name.
    pub name: String,
    url: String,
}

impl TestDb {
    /// Creates and migrates a fresh database.
    pub async fn new() -> Self {
        let db = Self::empty().await;
        outbox_shared::db::migrate(&db.pool)
            .await
            .expect("migrations apply to a fresh database");
        db
    }

    /// Creates a fresh database without applying migrations.
    pub async fn empty() -> Self {
        let admin = PgConnectOptions::from_str(&env::database_url())
            .expect("DATABASE_URL parses")
            .disable_statement_logging();
        let name = env::unique_name("outbox_test").to_lowercase();
        let mut conn = PgConnection::connect_with(&admin)
            .await
            .expect("PostgreSQL at DATABASE_URL answers (run `scripts/services up`)");
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(&mut conn)
            .await
            .expect("the DATABASE_URL role may CREATE DATABASE");
        let _ = conn.close().await;
        let options = admin.clone().database(&name);
        let pool = PgPoolOptions::new()
            .max_connections(20)
            .connect_with(options.clone())
            .await
            .expect("connect to the new test database");
        let url = replace_database(&env::database_url(), &name);
        Self { pool, name, url }
    }

    /// A URL of the test database (for dispatcher/producer processes the test spawns).
    pub fn url(&self) -> &str {
        &self.url
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        // Drop cannot await, and a nested runtime here can stall on connections that belong to
        // the test's runtime: psql is synchronous and simple. WITH (FORCE) ends open sessions.
        let _ = std::process::Command::new("psql")
            .arg(env::database_url())
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
