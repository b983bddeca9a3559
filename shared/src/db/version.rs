//! Whether the database's schema is the one this release runs on: what a workload checks before
//! it claims or enqueues, so that a rollout ahead of its migration says so instead of failing
//! every statement ([`schema_state`]).
//!
//! **Newer is fine.** A schema migrated by a newer release (versions this one does not know, none
//! of its own missing) is a rolling upgrade in progress: the migration Job of the new release ran
//! first and the old pods still serve. The outbox's migrations only ever add (a table, a column
//! with a default, an index, a grant), so an older binary keeps working on a newer schema; a
//! change that removes something must wait a release after the code stopped using it. Only a
//! schema *missing* one of this release's migrations stops a workload.

use std::collections::BTreeSet;

use sqlx::PgConnection;

use super::MIGRATIONS_TABLE;
pub use crate::error::SchemaBehind;
use crate::error::{DbContext, Result};

/// The migration that lets the workloads' roles read [`MIGRATIONS_TABLE`]: a login refused
/// there is on a schema older than it.
pub const READABLE_SINCE: i64 = 20261204000001;

/// How the database's schema stands against this release.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SchemaState {
    /// Every migration of this release is applied, and nothing else.
    Current {
        /// The newest applied version.
        version: i64,
    },
    /// Every migration of this release is applied, and newer ones too: a newer release migrated
    /// (a rolling upgrade); this release runs on it.
    Newer {
        /// The newest applied version.
        version: i64,
        /// The newest version this release ships.
        ours: i64,
    },
    /// Migrations of this release are missing: run `migrate`.
    Behind(SchemaBehind),
}

/// The newest version this release ships.
pub fn release_version() -> i64 {
    ours().max().unwrap_or(0)
}

fn ours() -> impl Iterator<Item = i64> {
    super::release_migrations().map(|m| m.version)
}

/// Reads the applied versions and compares them with this release's (one or two small
/// statements, inside the caller's transaction or on its connection).
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn schema_state(conn: &mut PgConnection) -> Result<SchemaState> {
    let needs = release_version();
    if !super::migrations_table_exists(conn).await? {
        return Ok(SchemaState::Behind(SchemaBehind {
            at: None,
            needs,
            pending: Some(ours().count()),
            unreadable_before: None,
        }));
    }
    // The privilege is asked first: a refused SELECT would abort the caller's transaction.
    let readable: bool = sqlx::query_scalar("SELECT has_table_privilege($1, 'SELECT')")
        .persistent(crate::store::named_statements())
        .bind(MIGRATIONS_TABLE)
        .fetch_one(&mut *conn)
        .await
        .context("checking that pubsub_outbox_migrations is readable")?;
    if !readable {
        return Ok(SchemaState::Behind(SchemaBehind {
            at: None,
            needs,
            pending: None,
            unreadable_before: Some(READABLE_SINCE),
        }));
    }
    let applied: Vec<i64> = sqlx::query_scalar("SELECT version FROM pubsub_outbox_migrations")
        .persistent(crate::store::named_statements())
        .fetch_all(&mut *conn)
        .await
        .context("reading pubsub_outbox_migrations")?;
    Ok(compare(&applied.into_iter().collect(), &ours().collect()))
}

/// [`schema_state`] in a transaction of its own on `pool`, refusing a schema behind this release
/// ([`crate::Error::SchemaBehind`]: a configuration error, exit 2 in the binaries): what a
/// producer run and every operator command check before they start.
pub async fn ensure_schema(pool: &sqlx::PgPool) -> Result<SchemaState> {
    let mut tx = pool.begin().await.map_err(crate::Error::begin)?;
    let state = schema_state(&mut tx).await?;
    let _ = tx.rollback().await;
    match state {
        SchemaState::Behind(behind) => Err(crate::Error::SchemaBehind(behind)),
        state => Ok(state),
    }
}

/// The state of a database with `applied` versions for a release shipping `ours`.
fn compare(applied: &BTreeSet<i64>, ours: &BTreeSet<i64>) -> SchemaState {
    let needs = ours.last().copied().unwrap_or(0);
    let newest = applied.last().copied();
    let pending = ours.difference(applied).count();
    match newest {
        Some(version) if pending == 0 && version > needs => SchemaState::Newer {
            version,
            ours: needs,
        },
        Some(version) if pending == 0 => SchemaState::Current { version },
        at => SchemaState::Behind(SchemaBehind {
            at,
            needs,
            pending: Some(pending),
            unreadable_before: None,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(v: &[i64]) -> BTreeSet<i64> {
        v.iter().copied().collect()
    }

    #[test]
    fn a_schema_is_current_newer_or_behind_by_what_is_missing() {
        let ours = set(&[1, 2, 3]);
        assert_eq!(
            compare(&set(&[1, 2, 3]), &ours),
            SchemaState::Current { version: 3 }
        );
        assert_eq!(
            compare(&set(&[1, 2, 3, 4]), &ours),
            SchemaState::Newer {
                version: 4,
                ours: 3
            }
        );
        let behind = |at, pending| {
            SchemaState::Behind(SchemaBehind {
                at,
                needs: 3,
                pending: Some(pending),
                unreadable_before: None,
            })
        };
        assert_eq!(compare(&set(&[1, 2]), &ours), behind(Some(2), 1));
        assert_eq!(compare(&set(&[]), &ours), behind(None, 3));
        // A newer release's migrations do not make up for one of ours that is missing.
        assert_eq!(compare(&set(&[1, 3, 4]), &ours), behind(Some(4), 1));
    }

    #[test]
    fn the_message_says_where_the_schema_is_and_what_to_run() {
        let behind = SchemaBehind {
            at: Some(20261203000002),
            needs: 20261204000002,
            pending: Some(2),
            unreadable_before: None,
        };
        assert_eq!(
            behind.to_string(),
            "schema at 20261203000002, this release needs 20261204000002 (2 migration(s) \
             pending): run `dispatcher migrate` (or `producer migrate`) as the migrating role, or \
             the release's migration Job, before this release"
        );
        let empty = SchemaBehind {
            at: None,
            pending: Some(15),
            ..behind.clone()
        };
        assert!(
            empty
                .to_string()
                .starts_with("schema at none (no outbox migration is recorded here)")
        );
        let unreadable = SchemaBehind {
            at: None,
            pending: None,
            unreadable_before: Some(READABLE_SINCE),
            ..behind
        };
        assert!(
            unreadable
                .to_string()
                .starts_with("schema at a version before 20261204000001, this release needs")
        );
    }

    #[test]
    fn the_first_readable_version_is_a_migration_of_this_release() {
        assert!(ours().any(|v| v == READABLE_SINCE));
    }
}
