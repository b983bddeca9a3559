//! Typed errors of the shared library. Every message says what failed and what to do.

/// Errors from the shared library.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A migration failed and was rolled back (each runs in its own transaction; the ones before
    /// it stay applied).
    #[error(
        "migration {version} ({description}) failed and was rolled back (the migrations before \
         it stay applied; migrate again once this is fixed goes on from it): {source}{hint}"
    )]
    Migration {
        /// The migration's version (0: the bookkeeping table itself).
        version: i64,
        /// Its description.
        description: String,
        /// What to do, for the failures we know (empty otherwise).
        hint: &'static str,
        /// The server's error.
        #[source]
        source: sqlx::Error,
    },
    /// The group roles the migrations grant to do not exist (deploy/sql/bootstrap.sql not run).
    #[error(
        "the outbox's group role(s) {roles} do not exist, so no migration was applied (nothing \
         was changed): run deploy/sql/bootstrap.sql as an administrator first (it creates them; \
         no migration creates a role), then migrate again"
    )]
    RolesMissing {
        /// The missing roles, comma-separated.
        roles: String,
    },
    /// A migration could not take its locks within the deadline: others held them.
    #[error(
        "migration {version} ({description}) could not take its locks: each attempt gave up after \
         waiting {lock_timeout:?} and rolled back ({attempts} attempt(s) over {waited:.1?}), \
         blocked by {blockers}. Nothing of it was applied, and no write of the application \
         waited on it longer than {lock_timeout:?}. End that transaction (or wait for it; \
         SELECT pg_terminate_backend(pid) ends one that is stuck), then run migrate again; \
         --migrate-deadline waits longer"
    )]
    MigrationBlocked {
        /// The migration's version (0: the run's own lock, another run holds it).
        version: i64,
        /// Its description.
        description: String,
        /// How long each attempt waited.
        lock_timeout: std::time::Duration,
        /// How many attempts.
        attempts: u32,
        /// How long the run tried.
        waited: std::time::Duration,
        /// Who blocked it ([`crate::db::Blocker`]s, described).
        blockers: String,
    },
    /// An applied migration's text differs from this release's.
    #[error(
        "migration {version} ({description}) was applied with other contents than this release ships: the migrations were edited after they were applied. Restore the released migrations (never edit an applied one; add a new migration instead)"
    )]
    MigrationModified {
        /// The version.
        version: i64,
        /// Its description.
        description: String,
    },
    /// The database has a migration this release does not know.
    #[error(
        "the database has outbox migration {version}, which this release does not ship: a newer release migrated it. Run that release's migrate, or upgrade this binary"
    )]
    MigrationUnknown {
        /// The newest unknown version.
        version: i64,
    },
    /// `_sqlx_migrations` records an outbox migration of an earlier release as failed.
    #[error(
        "an earlier release recorded outbox migration {version} ({description}) as failed in _sqlx_migrations: repair the schema by hand (compare with migrations/), then delete that row and migrate again"
    )]
    MigrationIncomplete {
        /// The version.
        version: i64,
        /// Its description.
        description: String,
    },
    /// The database's schema lacks migrations of this release (a rollout ahead of its migration).
    #[error("the database schema is behind this release: {0}")]
    SchemaBehind(SchemaBehind),
    /// A statement failed.
    #[error("database error while {context}: {source}")]
    Database {
        /// What we were doing.
        context: &'static str,
        /// The driver error.
        #[source]
        source: sqlx::Error,
    },
}

impl Error {
    /// A failed migration, with the fix for the causes a first install meets.
    pub(crate) fn migration(version: i64, description: &str, source: sqlx::Error) -> Self {
        let hint = match sqlstate(&source).as_deref() {
            // insufficient_privilege
            Some("42501") => {
                ". The migrating role lacks a privilege: run deploy/sql/bootstrap.sql as an \
                 administrator (it grants CREATE on schema public to the migrator), and migrate \
                 as the role it names as migrator (which then owns the outbox's tables)"
            }
            // query_canceled: the statement timeout
            Some("57014") => {
                ". It ran longer than the statement timeout (--migrate-statement-timeout): \
                 raise it for this run, or run it when the table is quieter"
            }
            _ => "",
        };
        Self::Migration {
            version,
            description: description.to_owned(),
            hint,
            source,
        }
    }

    /// Whether retrying cannot help because the database is set up wrong for this role (a
    /// missing role or privilege, migrations edited or from a newer release): the binaries exit 2.
    pub fn is_configuration(&self) -> bool {
        match self {
            // insufficient_privilege; undefined_object (a role bootstrap.sql creates is missing)
            Self::Migration { source, .. } => {
                matches!(sqlstate(source).as_deref(), Some("42501" | "42704"))
            }
            Self::MigrationModified { .. }
            | Self::MigrationUnknown { .. }
            | Self::MigrationIncomplete { .. }
            | Self::SchemaBehind(_)
            | Self::RolesMissing { .. } => true,
            Self::MigrationBlocked { .. } => false,
            Self::Database { source, .. } => {
                matches!(sqlstate(source).as_deref(), Some("42501"))
            }
        }
    }

    /// Whether a statement failed because the schema lacks what it names (a table, a column, a
    /// function: undefined_table, undefined_column, undefined_function): the schema may be
    /// behind this release, which [`crate::db::schema_state`] tells.
    pub fn is_schema_mismatch(&self) -> bool {
        match self {
            Self::Database { source, .. } => {
                matches!(
                    sqlstate(source).as_deref(),
                    Some("42P01" | "42703" | "42883")
                )
            }
            Self::SchemaBehind(_) => true,
            _ => false,
        }
    }

    /// A failed `BEGIN`, for applications that open their own transaction around an enqueue.
    pub fn begin(source: sqlx::Error) -> Self {
        Self::Database {
            context: "starting a transaction",
            source,
        }
    }

    /// A failed `COMMIT`, for applications that commit their own transaction after an enqueue.
    pub fn commit(source: sqlx::Error) -> Self {
        Self::Database {
            context: "committing a transaction",
            source,
        }
    }
}

/// A schema missing migrations of this release.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchemaBehind {
    /// The newest applied version (`None`: no outbox migration is recorded, or the record is
    /// not readable by this login).
    pub at: Option<i64>,
    /// The newest version this release ships.
    pub needs: i64,
    /// How many of this release's migrations are missing (`None` when the record is unreadable).
    pub pending: Option<usize>,
    /// The record exists but this login may not read it: the schema predates this migration,
    /// the one that lets the workloads' roles read it.
    pub unreadable_before: Option<i64>,
}

impl std::fmt::Display for SchemaBehind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let at = match (self.at, self.unreadable_before) {
            (Some(v), _) => v.to_string(),
            (None, Some(before)) => format!("a version before {before}"),
            (None, None) => "none (no outbox migration is recorded here)".to_owned(),
        };
        write!(f, "schema at {at}, this release needs {}", self.needs)?;
        if let Some(n) = self.pending {
            write!(f, " ({n} migration(s) pending)")?;
        }
        write!(
            f,
            ": run `dispatcher migrate` (or `producer migrate`) as the migrating role, or the \
             release's migration Job, before this release"
        )
    }
}

/// The SQLSTATE of a server error.
fn sqlstate(e: &sqlx::Error) -> Option<String> {
    e.as_database_error()
        .and_then(|d| d.code())
        .map(|c| c.into_owned())
}

/// Result alias for the shared library.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Attaches "what we were doing" to a sqlx error.
pub(crate) trait DbContext<T> {
    fn context(self, context: &'static str) -> Result<T>;
}

impl<T> DbContext<T> for std::result::Result<T, sqlx::Error> {
    fn context(self, context: &'static str) -> Result<T> {
        self.map_err(|source| Error::Database { context, source })
    }
}
