//! The schema: the embedded migrations and how to apply them.
//!
//! Connecting with retries, pool sizing and session settings belong to the service runtime
//! (`outbox_runtime::db`); an application that already has a pool only needs [`migrate`] (or its
//! own migration tool pointed at `migrations/`).

use sqlx::PgPool;

use crate::error::Result;

/// The schema, embedded at build time from `migrations/`.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations");

/// Applies every pending migration (idempotent: applied ones are skipped).
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn migrate(pool: &PgPool) -> Result<()> {
    MIGRATOR.run(pool).await?;
    Ok(())
}
