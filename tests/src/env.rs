//! Where the local services are, from the environment `scripts/services env` prints.

/// PostgreSQL URL of a database the tests may create databases from.
pub fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned())
}

/// `host:port` of the Pub/Sub emulator.
pub fn pubsub_emulator_host() -> String {
    std::env::var("PUBSUB_EMULATOR_HOST").unwrap_or_else(|_| "127.0.0.1:8085".to_owned())
}

/// The Pub/Sub project used in tests.
pub fn pubsub_project() -> String {
    std::env::var("PUBSUB_PROJECT_ID").unwrap_or_else(|_| "test-project".to_owned())
}

/// Base URL of bqemulator (the REST v2 base is `<this>/bigquery/v2`).
pub fn bigquery_emulator_host() -> String {
    std::env::var("BIGQUERY_EMULATOR_HOST").unwrap_or_else(|_| "http://127.0.0.1:9050".to_owned())
}

/// The BigQuery project used in tests.
pub fn bigquery_project() -> String {
    std::env::var("BIGQUERY_PROJECT_ID").unwrap_or_else(|_| "test-project".to_owned())
}

/// A name unique across the tests of this run and concurrent runs.
pub fn unique_name(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!("{prefix}_{}_{n}_{nanos:x}", std::process::id())
}
