//! The producer's errors. Each says what failed and what to do; the job logs each once, at ERROR.
//!
//! A failed stream is one [`StreamError`]: the stream's name plus an [`ErrorKind`] saying what
//! went wrong. The kinds carry no stream name of their own, so the name is written once.

use crate::bigquery::pages::PagesError;

/// The streams file, or a flag, is unusable. Nothing was read or written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {}{origin}: {}{}", if *.in_file { "streams config " } else { "" },
        .problems.join("; "), if *.in_file { ". Fix the file and rerun" } else { "" })]
pub struct ConfigError {
    /// The file (or the flag) at fault.
    pub origin: String,
    /// Every problem found, each naming the stream and field (or saying the fix).
    pub problems: Vec<String>,
    /// Whether `origin` is the streams file (else a flag or variable).
    pub in_file: bool,
}

impl ConfigError {
    /// A problem in the streams file `origin`.
    pub(crate) fn new(origin: impl Into<String>, problems: Vec<String>) -> Self {
        Self {
            origin: origin.into(),
            problems,
            in_file: true,
        }
    }

    /// A problem in the flag (or variable) `flag`; each problem says the fix.
    pub(crate) fn flag(flag: impl Into<String>, problems: Vec<String>) -> Self {
        Self {
            in_file: false,
            ..Self::new(flag, problems)
        }
    }
}

/// Why one stream's run failed. The watermark holds the last committed chunk: a rerun resumes there.
#[derive(Debug, thiserror::Error)]
#[error("stream '{stream}': {kind}")]
pub struct StreamError {
    /// Stream name.
    pub stream: String,
    /// What failed.
    pub kind: ErrorKind,
}

impl StreamError {
    /// `kind` in `stream`.
    pub fn new(stream: &str, kind: ErrorKind) -> Self {
        Self {
            stream: stream.to_owned(),
            kind,
        }
    }

    /// A failed database statement of `stream` (`context` says which).
    pub(crate) fn database(stream: &str, context: &'static str, source: sqlx::Error) -> Self {
        Self::new(
            stream,
            ErrorKind::Database(outbox_shared::Error::Database { context, source }),
        )
    }

    /// A failed BigQuery read of `stream`.
    pub(crate) fn pages(stream: &str, e: PagesError) -> Self {
        let kind = match e {
            PagesError::Query(message) => ErrorKind::Query(message),
            PagesError::Request(message) => ErrorKind::BigQuery(message),
        };
        Self::new(stream, kind)
    }
}

/// What went wrong in a stream's run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ErrorKind {
    /// A column the mapping uses is not in the query's result.
    #[error(
        "the query result has no column `{column}` (used by {usage}); it has: {available}. \
         Add the column to the query's SELECT list or fix the mapping"
    )]
    UnknownColumn {
        /// The missing column.
        column: String,
        /// Which mapping field names it.
        usage: String,
        /// The columns the query returns.
        available: String,
    },
    /// A column has a type the mapping cannot use.
    #[error("column `{column}` {detail}")]
    ColumnType {
        /// The column.
        column: String,
        /// Which mapping field names it, its type, what is expected, how to fix it.
        detail: String,
    },
    /// BigQuery refused or failed the query (syntax, permissions, bytes-billed limit, …).
    #[error("BigQuery query failed: {0}. Fix the stream's query or its permissions and rerun")]
    Query(String),
    /// BigQuery could not be reached or answered unexpectedly (after retries).
    #[error(
        "BigQuery request failed: {0}. Check --bigquery-endpoint, credentials and network; rerun"
    )]
    BigQuery(String),
    /// The rows do not follow the cursor order, or repeat / precede the watermark.
    #[error(
        "{0}. The query must return rows after (@watermark_ts, @watermark_key), \
         ORDER BY the timestamp then the key column, and the key must be unique per timestamp"
    )]
    CursorOrder(String),
    /// A cell could not be read (an unexpected wire form), or a cursor cell is NULL or malformed.
    #[error("{0}")]
    BadRow(String),
    /// A database statement failed.
    #[error("{0}. Nothing of the failed chunk was committed; rerun to resume")]
    Database(#[source] outbox_shared::Error),
    /// The stored watermark does not fit the configured key type (the config changed?).
    #[error(
        "stored watermark key {key:?} is not a valid {key_type}. Was cursor.key_type changed? \
         Fix the config or reset producer_watermark for this stream"
    )]
    StoredWatermark {
        /// The stored key.
        key: String,
        /// The configured type.
        key_type: String,
    },
    /// Shutdown was requested between chunks.
    #[error(
        "interrupted by shutdown after {chunks} committed chunk(s); the next run resumes from the watermark"
    )]
    Interrupted {
        /// Chunks committed before stopping.
        chunks: usize,
    },
    /// `commit = "run"`: the run grew past a guard; its transaction was rolled back.
    #[error(
        "the run has more than {limit} {what} and commit = \"run\" makes a run one transaction; \
         nothing was enqueued and the watermark did not move. Raise max_run_{what} for this \
         stream, or use commit = \"page\" for streams this large"
    )]
    RunTooLarge {
        /// "rows" or "bytes".
        what: &'static str,
        /// The guard.
        limit: u64,
    },
}

/// Attaches a stream name to store errors.
pub(crate) trait InStream<T> {
    fn in_stream(self, stream: &str) -> Result<T, StreamError>;
}

impl<T> InStream<T> for Result<T, outbox_shared::Error> {
    fn in_stream(self, stream: &str) -> Result<T, StreamError> {
        self.map_err(|source| StreamError::new(stream, ErrorKind::Database(source)))
    }
}
