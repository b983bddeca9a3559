//! The producer's errors. Each names the stream and says what to do; the job logs each once.

/// The streams file is unusable. Nothing was read or written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid streams config {origin}: {}. Fix the file and rerun", .problems.join("; "))]
pub struct ConfigError {
    /// The file (or other origin) of the text.
    pub origin: String,
    /// Every problem found, each naming the stream and field.
    pub problems: Vec<String>,
}

impl ConfigError {
    pub(crate) fn new(origin: impl Into<String>, problems: Vec<String>) -> Self {
        Self {
            origin: origin.into(),
            problems,
        }
    }
}

/// Why one stream's run failed. The watermark holds the last committed chunk: a rerun resumes there.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A column the mapping uses is not in the query's result.
    #[error(
        "stream '{stream}': the query result has no column `{column}` (used by {usage}); it has: {available}. \
         Add the column to the query's SELECT list or fix the mapping"
    )]
    UnknownColumn {
        /// Stream name.
        stream: String,
        /// The missing column.
        column: String,
        /// Which mapping field names it.
        usage: String,
        /// The columns the query returns.
        available: String,
    },
    /// A column has a type the mapping cannot use.
    #[error("stream '{stream}': column `{column}` {detail}")]
    ColumnType {
        /// Stream name.
        stream: String,
        /// The column.
        column: String,
        /// Which mapping field names it, its type, what is expected, how to fix it.
        detail: String,
    },
    /// BigQuery refused or failed the query (syntax, permissions, bytes-billed limit, …).
    #[error(
        "stream '{stream}': BigQuery query failed: {message}. Fix the stream's query or its permissions and rerun"
    )]
    Query {
        /// Stream name.
        stream: String,
        /// BigQuery's message.
        message: String,
    },
    /// BigQuery could not be reached or answered unexpectedly (after retries).
    #[error(
        "stream '{stream}': BigQuery request failed: {message}. Check --bigquery-endpoint, credentials and network; rerun"
    )]
    BigQuery {
        /// Stream name.
        stream: String,
        /// What failed.
        message: String,
    },
    /// The rows do not follow the cursor order, or repeat / precede the watermark.
    #[error(
        "stream '{stream}': {detail}. The query must return rows after (@watermark_ts, @watermark_key), \
         ORDER BY the timestamp then the key column, and the key must be unique per timestamp"
    )]
    CursorOrder {
        /// Stream name.
        stream: String,
        /// What was seen.
        detail: String,
    },
    /// A cell could not be read (an unexpected wire form), or a cursor cell is NULL or malformed.
    #[error("stream '{stream}': {detail}")]
    BadRow {
        /// Stream name.
        stream: String,
        /// What is wrong, with the column.
        detail: String,
    },
    /// A database statement failed.
    #[error(
        "stream '{stream}': {source}. Nothing of the failed chunk was committed; rerun to resume"
    )]
    Database {
        /// Stream name.
        stream: String,
        /// The store error.
        #[source]
        source: outbox_shared::Error,
    },
    /// The stored watermark does not fit the configured key type (the config changed?).
    #[error(
        "stream '{stream}': stored watermark key {key:?} is not a valid {key_type}. Was cursor.key_type changed? Fix the config or reset producer_watermark for this stream"
    )]
    StoredWatermark {
        /// Stream name.
        stream: String,
        /// The stored key.
        key: String,
        /// The configured type.
        key_type: String,
    },
    /// Shutdown was requested between chunks.
    #[error(
        "stream '{stream}': interrupted by shutdown after {chunks} committed chunk(s); the next run resumes from the watermark"
    )]
    Interrupted {
        /// Stream name.
        stream: String,
        /// Chunks committed before stopping.
        chunks: usize,
    },
    /// Test hook: the run stopped on purpose after `chunks` committed chunks (simulated crash).
    #[error("stream '{stream}': stopped after {chunks} committed chunk(s) (injected failure)")]
    InjectedFailure {
        /// Stream name.
        stream: String,
        /// Chunks committed.
        chunks: usize,
    },
}

impl Error {
    /// The stream the error belongs to.
    pub fn stream(&self) -> &str {
        match self {
            Self::UnknownColumn { stream, .. }
            | Self::ColumnType { stream, .. }
            | Self::Query { stream, .. }
            | Self::BigQuery { stream, .. }
            | Self::CursorOrder { stream, .. }
            | Self::BadRow { stream, .. }
            | Self::Database { stream, .. }
            | Self::StoredWatermark { stream, .. }
            | Self::Interrupted { stream, .. }
            | Self::InjectedFailure { stream, .. } => stream,
        }
    }
}

/// Attaches a stream name to store errors.
pub(crate) trait InStream<T> {
    fn in_stream(self, stream: &str) -> Result<T, Error>;
}

impl<T> InStream<T> for Result<T, outbox_shared::Error> {
    fn in_stream(self, stream: &str) -> Result<T, Error> {
        self.map_err(|source| Error::Database {
            stream: stream.to_owned(),
            source,
        })
    }
}
