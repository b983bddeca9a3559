//! Typed errors of the inbox. Every message says what failed and what to do.

/// Errors from the inbox itself (the handler's own errors are [`crate::Failure::Handler`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A statement of the inbox failed (the message was not acked and will be redelivered).
    #[error(
        "inbox database error while {context}: {source}. The message is redelivered; check the database is reachable and `outbox_inbox::migrate` ran"
    )]
    Database {
        /// What we were doing.
        context: &'static str,
        /// The driver error.
        #[source]
        source: sqlx::Error,
    },
    /// The handler returned `Ok` but its transaction was aborted by a failed statement, so
    /// PostgreSQL would have rolled back the commit without an error.
    #[error(
        "the handler returned Ok after a statement of its transaction failed ({source}); nothing was committed. Return SQL errors from the handler (`?`) instead of ignoring them, or wrap an expected failure in a SAVEPOINT"
    )]
    AbortedTransaction {
        /// The error the check statement got.
        #[source]
        source: sqlx::Error,
    },
    /// Creating or changing the inbox's schema failed (a migration that could not take its locks
    /// in time names who blocks it).
    #[error("the inbox's schema: {0}")]
    Schema(#[from] outbox_shared::Error),
    /// The message has no dedupe key, so it cannot be deduplicated.
    #[error(
        "the message has no `{attribute}` attribute (or it is empty), so it cannot be deduplicated; it is not processed. Publish through the outbox (every message carries one), or give the subscription a dead-letter topic for such messages"
    )]
    MissingDedupeKey {
        /// The attribute that was looked for.
        attribute: String,
    },
}

/// Result alias for the inbox.
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
