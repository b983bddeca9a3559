//! The schema: the embedded migrations and how to apply them, with bookkeeping of the outbox's own.
//!
//! **Why not sqlx's migrator as it is.** A transactional outbox lives in the application's own
//! database, and most Rust applications there run sqlx migrations too. sqlx records every version
//! in one table, `_sqlx_migrations`, and each migrator refuses versions it does not know
//! ("previously applied but is missing in the resolved migrations"): the outbox and the
//! application could never both migrate one database. So the outbox records its versions in
//! `pubsub_outbox_migrations` (the inbox does the same with `pubsub_inbox_schema`), and never
//! reads or writes `_sqlx_migrations` except to take back its own rows from an install made
//! before this table existed ([`migrate`]). A table rather than a schema of its own: on Cloud SQL
//! the migrating role has `CREATE` on schema `public` only (deploy/sql/bootstrap.sql), and a table
//! needs nothing more. sqlx 0.9 can rename its table, but would bring a major upgrade of the
//! driver under every store function for what forty lines do here.
//!
//! **How it applies** ([`apply`]): every migration in its own transaction, with a short
//! `lock_timeout` and a `statement_timeout` set first ([`MigrateSettings`]); one that waits for a
//! lock longer rolls back, so the application's writes queued behind it go on, and is tried again
//! with backoff until a deadline, naming who blocks it. The run holds a migration lock from the
//! first migration to the last. A failure rolls back that migration alone: the ones before it
//! stay applied and recorded, and a rerun goes on from there. Each applied version is recorded
//! with the SHA-384 checksum of its text (the checksum sqlx computes, so rows taken over from
//! `_sqlx_migrations` compare as they are); an applied migration whose text changed, or a version
//! this release does not know (a newer release migrated), stops the run with what to do.
//! Connecting, pool sizing and session settings belong to the service runtime
//! (`outbox_runtime::db`): an application that already has a pool only needs [`migrate`].

pub mod apply;
mod version;

use std::collections::HashMap;

use sqlx::{Connection, PgConnection, PgPool};

use crate::error::{DbContext, Error, Result};

pub use apply::{Blocker, MigrateSettings};
pub use version::{
    READABLE_SINCE, SchemaBehind, SchemaState, ensure_schema, release_version, schema_state,
};

/// The schema, embedded at build time from `migrations/`.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations");

/// The outbox's bookkeeping table.
pub const MIGRATIONS_TABLE: &str = "pubsub_outbox_migrations";

/// Earlier texts of migrations that were revised after a release applied them, as
/// `(version, SHA-384 of the earlier text in hex)`: an install that applied the earlier text is
/// up to date. 20261201000001 and 20261201000015 created their roles when missing, which needs
/// CREATEROLE; they now stop and point to deploy/sql/bootstrap.sql instead, and the grants are
/// the same.
/// 20261206000001 set its own `lock_timeout`; the runner sets it for every migration now.
const REVISED: &[(i64, &str)] = &[
    (
        20261201000001,
        "a69c7e5265f2483cad200775694e8ffcfcb697160d6b49cafbfa51386a48385cf4de3ee5a035cdf40996712a8162b0e6",
    ),
    (
        20261201000015,
        "f5013e7f6da26e5796a70be5c5c954fcd7f289cf8808355781dab28d0c78c1e31198644323d69ba0d68fe3f49d7827e7",
    ),
    (
        20261206000001,
        "5b027b6c49a63316175ebfbfaff8802182f2506ee1227608faa7b106fb6033698f6d73fa2ce6cab7a3cd97ebb692cad8",
    ),
];

/// What a [`migrate`] run did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Migrated {
    /// The versions applied by this run, in order.
    pub applied: Vec<i64>,
    /// Versions an earlier release recorded in `_sqlx_migrations`, now recorded in
    /// [`MIGRATIONS_TABLE`] (and removed from `_sqlx_migrations`) without running again.
    pub adopted: Vec<i64>,
    /// Versions that were already applied.
    pub up_to_date: usize,
}

/// The group roles the migrations grant to, which deploy/sql/bootstrap.sql creates (no migration
/// creates a role: that needs CREATEROLE, which the migrating login does not have).
const GROUP_ROLES: &[&str] = &["outbox_dispatcher", "outbox_operator", "outbox_producer"];

/// The name of the run's lock (an advisory lock: [`apply`]).
const LOCK: &str = "pubsub_outbox:migrations";

/// Applies every pending migration (idempotent: applied ones are skipped) with the default
/// [`MigrateSettings`].
pub async fn migrate(pool: &PgPool) -> Result<Migrated> {
    migrate_with(pool, &MigrateSettings::default()).await
}

/// Applies every pending migration, each in its own transaction, yielding to the application's
/// writes as `settings` say ([`apply`]).
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn migrate_with(pool: &PgPool, settings: &MigrateSettings) -> Result<Migrated> {
    let mut lock = apply::RunLock::take(&pool.connect_options(), LOCK, settings).await?;
    let mut conn = pool.acquire().await.context("connecting to migrate")?;
    let migrated = run(&mut lock, &mut conn, settings).await;
    lock.release().await;
    migrated
}

async fn run(
    lock: &mut apply::RunLock,
    conn: &mut PgConnection,
    settings: &MigrateSettings,
) -> Result<Migrated> {
    // The bookkeeping, in one short transaction of its own (it locks no table the application
    // writes).
    let mut tx = conn
        .begin()
        .await
        .context("starting the bookkeeping transaction")?;
    sqlx::raw_sql(&apply::timeouts("LOCAL", settings))
        .execute(&mut *tx)
        .await
        .context("setting the migration's timeouts")?;
    create_migrations_table(&mut tx).await?;
    let adopted = adopt_from_sqlx(&mut tx).await?;
    let applied: HashMap<i64, Vec<u8>> =
        sqlx::query_as("SELECT version, checksum FROM pubsub_outbox_migrations")
            .persistent(crate::store::named_statements())
            .fetch_all(&mut *tx)
            .await
            .context("reading pubsub_outbox_migrations")?
            .into_iter()
            .collect();
    // A first install before deploy/sql/bootstrap.sql: stop before anything is created (this
    // transaction rolls back), rather than at the first migration that grants to a missing role
    // with the ones before it applied.
    if release_migrations().any(|m| !applied.contains_key(&m.version)) {
        let missing: Vec<String> = sqlx::query_scalar(
            "SELECT r FROM unnest($1::text[]) AS r
             WHERE NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = r) ORDER BY r",
        )
        .bind(GROUP_ROLES)
        .fetch_all(&mut *tx)
        .await
        .context("looking for the outbox's group roles in pg_roles")?;
        if !missing.is_empty() {
            return Err(Error::RolesMissing {
                roles: missing.join(", "),
            });
        }
    }
    tx.commit()
        .await
        .context("committing the migrations' bookkeeping")?;
    let ours = release_migrations;
    if let Some(unknown) = applied
        .keys()
        .copied()
        .filter(|v| !ours().any(|m| m.version == *v))
        .max()
    {
        return Err(Error::MigrationUnknown { version: unknown });
    }
    let mut report = Migrated {
        adopted,
        ..Migrated::default()
    };
    for m in ours() {
        match applied.get(&m.version) {
            Some(checksum) if matches_release(m.version, &m.checksum, checksum) => {
                report.up_to_date += 1;
            }
            Some(_) => {
                return Err(Error::MigrationModified {
                    version: m.version,
                    description: m.description.to_string(),
                });
            }
            None => {
                let step = apply::Step {
                    version: m.version,
                    description: &m.description,
                    sql: &m.sql,
                    no_tx: m.no_tx,
                };
                let done = apply::apply_step(lock, conn, settings, &step, &move |c, took| {
                    Box::pin(record(c, m, took))
                })
                .await?;
                tracing::info!(
                    migration = m.version,
                    attempts = done.attempts,
                    "Applied migration {} ({}).",
                    m.version,
                    m.description
                );
                report.applied.push(m.version);
            }
        }
    }
    Ok(report)
}

/// This release's migrations (all are up migrations: the outbox ships no down migration).
fn release_migrations() -> impl Iterator<Item = &'static sqlx::migrate::Migration> {
    MIGRATOR
        .iter()
        .filter(|m| m.migration_type.is_up_migration())
}

/// Whether `pubsub_outbox_migrations` exists (any login may ask: a catalog lookup).
async fn migrations_table_exists(conn: &mut PgConnection) -> Result<bool> {
    sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
        .persistent(crate::store::named_statements())
        .bind(MIGRATIONS_TABLE)
        .fetch_one(&mut *conn)
        .await
        .context("looking for pubsub_outbox_migrations")
}

/// Creates `pubsub_outbox_migrations` when it is missing.
async fn create_migrations_table(tx: &mut PgConnection) -> Result<()> {
    if !migrations_table_exists(tx).await? {
        // Created only when missing: `CREATE TABLE IF NOT EXISTS` would need CREATE on the schema
        // even when the table is there.
        sqlx::raw_sql(
            "CREATE TABLE pubsub_outbox_migrations (
                 version      BIGINT      PRIMARY KEY,
                 description  TEXT        NOT NULL,
                 checksum     BYTEA       NOT NULL,
                 applied_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
                 applied_by   TEXT        NOT NULL DEFAULT session_user,
                 execution_ms BIGINT      NOT NULL DEFAULT 0,
                 -- Where the record came from when it was not applied by this table's migrator.
                 adopted_from TEXT
             )",
        )
        .execute(&mut *tx)
        .await
        .map_err(|source| Error::migration(0, "create pubsub_outbox_migrations", source))?;
    }
    Ok(())
}

/// Records a migration as applied (in its transaction).
async fn record(
    c: &mut PgConnection,
    m: &'static sqlx::migrate::Migration,
    took: std::time::Duration,
) -> std::result::Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO pubsub_outbox_migrations (version, description, checksum, execution_ms)
         VALUES ($1, $2, $3, $4)",
    )
    .persistent(crate::store::named_statements())
    .bind(m.version)
    .bind(&*m.description)
    .bind(&*m.checksum)
    .bind(i64::try_from(took.as_millis()).unwrap_or(i64::MAX))
    .execute(c)
    .await?;
    Ok(())
}

/// Whether `recorded` is the checksum of this release's text of a migration, or of an earlier
/// text listed in [`REVISED`].
fn matches_release(version: i64, current: &[u8], recorded: &[u8]) -> bool {
    recorded == current
        || REVISED
            .iter()
            .any(|(v, hex)| *v == version && hex_eq(hex, recorded))
}

fn hex_eq(hex: &str, bytes: &[u8]) -> bool {
    hex.len() == bytes.len() * 2
        && bytes
            .iter()
            .zip(hex.as_bytes().chunks(2))
            .all(|(b, pair)| format!("{b:02x}").as_bytes() == pair)
}

/// Takes the outbox's own rows out of `_sqlx_migrations`, where releases before
/// [`MIGRATIONS_TABLE`] recorded them: recorded here as they were (their checksums checked, not
/// run again), then deleted there, so the application's sqlx migrator no longer finds versions it
/// does not know. A row is ours when its version and description are those of one of our
/// migrations; any other row belongs to the application and is left alone.
async fn adopt_from_sqlx(tx: &mut PgConnection) -> Result<Vec<i64>> {
    let exists: bool = sqlx::query_scalar("SELECT to_regclass('_sqlx_migrations') IS NOT NULL")
        .persistent(crate::store::named_statements())
        .fetch_one(&mut *tx)
        .await
        .context("looking for _sqlx_migrations")?;
    if !exists {
        return Ok(Vec::new());
    }
    let rows: Vec<(i64, String, Vec<u8>, bool)> = sqlx::query_as(
        "SELECT version, description, checksum, success FROM _sqlx_migrations ORDER BY version",
    )
    .persistent(crate::store::named_statements())
    .fetch_all(&mut *tx)
    .await
    .context("reading _sqlx_migrations (the migrating role must be able to read it)")?;
    let mut adopted = Vec::new();
    for (version, description, checksum, success) in rows {
        let Some(m) = MIGRATOR
            .iter()
            .find(|m| m.version == version && m.description == description)
        else {
            continue;
        };
        if !success {
            return Err(Error::MigrationIncomplete {
                version,
                description,
            });
        }
        if !matches_release(version, &m.checksum, &checksum) {
            return Err(Error::MigrationModified {
                version,
                description,
            });
        }
        sqlx::query(
            "INSERT INTO pubsub_outbox_migrations (version, description, checksum, applied_at, adopted_from)
             SELECT version, description, checksum, installed_on, '_sqlx_migrations'
             FROM _sqlx_migrations WHERE version = $1
             ON CONFLICT (version) DO NOTHING",
        )
    .persistent(crate::store::named_statements())
        .bind(version)
        .execute(&mut *tx)
        .await
        .context("recording a migration taken over from _sqlx_migrations")?;
        sqlx::query("DELETE FROM _sqlx_migrations WHERE version = $1")
            .persistent(crate::store::named_statements())
            .bind(version)
            .execute(&mut *tx)
            .await
            .context(
                "removing the outbox's row from _sqlx_migrations (the migrating role must own it)",
            )?;
        adopted.push(version);
    }
    Ok(adopted)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_migration_is_an_up_migration() {
        assert!(MIGRATOR.iter().all(|m| m.migration_type.is_up_migration()));
    }

    #[test]
    fn revised_migrations_accept_their_earlier_text_only() {
        let (version, hex) = REVISED[0];
        let m = MIGRATOR
            .iter()
            .find(|m| m.version == version)
            .expect("a revised version is a migration of this release");
        let earlier: Vec<u8> = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex"))
            .collect();
        assert!(matches_release(version, &m.checksum, &m.checksum));
        assert!(matches_release(version, &m.checksum, &earlier));
        assert!(!matches_release(version + 1, &m.checksum, &earlier));
        assert!(!matches_release(version, &m.checksum, &[0u8; 48]));
    }
}
