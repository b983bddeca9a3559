//! Typed errors of the shared library. Every message says what failed and what to do.

/// Errors from the shared library.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Applying the schema migrations failed.
    #[error("applying database migrations failed: {0}. Check the database user may create tables")]
    Migrate(#[from] sqlx::migrate::MigrateError),
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
