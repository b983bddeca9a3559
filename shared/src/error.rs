//! Typed errors of the shared library. Every message says what failed and what to do.

use std::time::Duration;

/// Errors from the shared library.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Could not reach PostgreSQL within the retry budget.
    #[error(
        "cannot connect to PostgreSQL at {url} after {waited:?}: {source}. \
         Check DATABASE_URL and that the server is running and reachable"
    )]
    Connect {
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
    /// A row read from the database does not have the expected shape.
    #[error("malformed row in {table} (id {id}): {reason}")]
    MalformedRow {
        /// The table.
        table: &'static str,
        /// The row id.
        id: i64,
        /// What is wrong.
        reason: String,
    },
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
