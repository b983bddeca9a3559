//! `producer_run`: one row per producer execution per stream, updated as chunks commit, so an
//! operator can see what each run read, enqueued and rejected, and how it ended.

use sqlx::PgConnection;

use crate::error::{DbContext, Result};
use crate::store::watermark::Cursor;

/// How a run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Read everything new and enqueued it.
    Succeeded,
    /// Stopped on an error; the watermark holds the last committed chunk.
    Failed,
    /// Did not run (another execution held the stream).
    Skipped,
    /// Its execution died while running (closed by the next execution holding the stream's lock).
    Abandoned,
}

impl Outcome {
    fn as_str(self) -> &'static str {
        match self {
            Self::Succeeded => "succeeded",
            Self::Failed => "failed",
            Self::Skipped => "skipped",
            Self::Abandoned => "abandoned",
        }
    }
}

/// Counts a chunk adds to its run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Rows read from the source.
    pub fetched: i64,
    /// Rows inserted into the outbox.
    pub enqueued: i64,
    /// Rows whose dedupe key was already enqueued.
    pub duplicates: i64,
    /// Rows sent to the dead-letter table instead.
    pub rejected: i64,
}

/// Opens a run (outcome `running`); returns its id. Committed on its own so a crash leaves a trace.
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn start(
    conn: &mut PgConnection,
    stream: &str,
    executor: &str,
    from: Option<&Cursor>,
) -> Result<i64> {
    sqlx::query_scalar(
        "INSERT INTO producer_run (stream, executor, window_from_micros, window_from_key)
         VALUES ($1, $2, $3, $4) RETURNING id",
    )
    .persistent(crate::store::named_statements())
    .bind(stream)
    .bind(executor)
    .bind(from.map(|c| c.micros))
    .bind(from.map(|c| c.key.as_str()))
    .fetch_one(&mut *conn)
    .await
    .context("opening a producer_run")
}

/// Adds a committed chunk to the run (call in the chunk's transaction).
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn record_chunk(
    conn: &mut PgConnection,
    run_id: i64,
    counts: Counts,
    to: Option<&Cursor>,
) -> Result<()> {
    sqlx::query(
        "UPDATE producer_run SET
             rows_fetched = rows_fetched + $2, rows_enqueued = rows_enqueued + $3,
             rows_duplicate = rows_duplicate + $4, rows_rejected = rows_rejected + $5,
             window_to_micros = COALESCE($6, window_to_micros),
             window_to_key = COALESCE($7, window_to_key)
         WHERE id = $1",
    )
    .persistent(crate::store::named_statements())
    .bind(run_id)
    .bind(counts.fetched)
    .bind(counts.enqueued)
    .bind(counts.duplicates)
    .bind(counts.rejected)
    .bind(to.map(|c| c.micros))
    .bind(to.map(|c| c.key.as_str()))
    .execute(&mut *conn)
    .await
    .context("recording a chunk in producer_run")?;
    Ok(())
}

/// Closes a run with its outcome, bytes processed and error (if any).
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn finish(
    conn: &mut PgConnection,
    run_id: i64,
    outcome: Outcome,
    bytes_processed: Option<i64>,
    error: Option<&str>,
) -> Result<()> {
    sqlx::query(
        "UPDATE producer_run SET outcome = $2, bytes_processed = COALESCE($3, bytes_processed),
                error = $4, finished_at = now()
         WHERE id = $1",
    )
    .persistent(crate::store::named_statements())
    .bind(run_id)
    .bind(outcome.as_str())
    .bind(bytes_processed)
    .bind(error)
    .execute(&mut *conn)
    .await
    .context("closing a producer_run")?;
    Ok(())
}

/// Closes the stream's runs still marked `running` as `abandoned` (with `finished_at` and
/// `reason`); returns their ids. Call only while holding the stream's lock
/// ([`crate::store::watermark::lock`]): then no other execution runs the stream, so a `running`
/// row can only belong to one that died.
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn abandon_running(
    conn: &mut PgConnection,
    stream: &str,
    reason: &str,
) -> Result<Vec<i64>> {
    sqlx::query_scalar(
        "UPDATE producer_run SET outcome = 'abandoned', finished_at = now(), error = $2
         WHERE stream = $1 AND outcome = 'running'
         RETURNING id",
    )
    .persistent(crate::store::named_statements())
    .bind(stream)
    .bind(reason)
    .fetch_all(&mut *conn)
    .await
    .context("closing abandoned producer_run rows")
}

/// A run as stored.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct Run {
    /// Run id.
    pub id: i64,
    /// Stream name.
    pub stream: String,
    /// Who ran it (Cloud Run execution/task, or the host name).
    pub executor: String,
    /// When it started.
    pub started_at: chrono::DateTime<chrono::Utc>,
    /// When it ended (None while running).
    pub finished_at: Option<chrono::DateTime<chrono::Utc>>,
    /// Rows read.
    pub rows_fetched: i64,
    /// Rows enqueued.
    pub rows_enqueued: i64,
    /// Rows already enqueued.
    pub rows_duplicate: i64,
    /// Rows dead-lettered.
    pub rows_rejected: i64,
    /// BigQuery bytes processed, when known.
    pub bytes_processed: Option<i64>,
    /// running / succeeded / failed / skipped / abandoned.
    pub outcome: String,
    /// The error, if failed.
    pub error: Option<String>,
}

const RUN_COLUMNS: &str = "id, stream, executor, started_at, finished_at, rows_fetched, \
     rows_enqueued, rows_duplicate, rows_rejected, bytes_processed, outcome, error";

/// The latest runs of a stream, newest first.
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn recent(conn: &mut PgConnection, stream: &str, limit: i64) -> Result<Vec<Run>> {
    sqlx::query_as(&format!(
        "SELECT {RUN_COLUMNS} FROM producer_run WHERE stream = $1 ORDER BY id DESC LIMIT $2"
    ))
    .persistent(crate::store::named_statements())
    .bind(stream)
    .bind(limit)
    .fetch_all(&mut *conn)
    .await
    .context("reading producer_run")
}

/// The latest `limit` runs of every stream, by stream name, newest first within a stream.
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn recent_per_stream(conn: &mut PgConnection, limit: i64) -> Result<Vec<Run>> {
    sqlx::query_as(&format!(
        "SELECT {RUN_COLUMNS} FROM (
             SELECT *, row_number() OVER (PARTITION BY stream ORDER BY id DESC) AS n
             FROM producer_run) r
         WHERE n <= $1 ORDER BY stream, id DESC"
    ))
    .persistent(crate::store::named_statements())
    .bind(limit)
    .fetch_all(&mut *conn)
    .await
    .context("reading producer_run")
}
