//! `producer_watermark`: how far each producer stream has enqueued.
//!
//! The cursor is `(UNIX microseconds, tie-breaker)`, compared as a tuple, so rows sharing a
//! timestamp are never lost at a page boundary. [`lock`] serialises overlapping executions of one
//! stream; [`advance`] never moves the cursor backwards. Only an operator moves it back, with
//! [`rewind`], holding the stream's lock and writing an audit row in the same transaction.

use sqlx::PgConnection;

use crate::error::{DbContext, Result};

/// A position in a stream: everything at or before it is enqueued.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Cursor {
    /// Timestamp column value, UNIX microseconds.
    pub micros: i64,
    /// Unique tie-breaker column value, as text.
    pub key: String,
}

/// A stream's stored watermark, as operators read it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Watermark {
    /// Stream name.
    pub stream: String,
    /// Everything at or before it is enqueued.
    pub cursor: Cursor,
    /// When it last moved (a run's page, or a rewind).
    pub updated_at: chrono::DateTime<chrono::Utc>,
    /// The run that last advanced it (None after a rewind).
    pub run_id: Option<i64>,
}

/// A `producer_watermark` row.
#[derive(sqlx::FromRow)]
struct Row {
    stream: String,
    cursor_micros: i64,
    cursor_key: String,
    updated_at: chrono::DateTime<chrono::Utc>,
    run_id: Option<i64>,
}

/// Every stored watermark, by stream name.
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn list(conn: &mut PgConnection) -> Result<Vec<Watermark>> {
    let rows: Vec<Row> = sqlx::query_as(
        "SELECT stream, cursor_micros, cursor_key, updated_at, run_id
         FROM producer_watermark ORDER BY stream",
    )
    .persistent(crate::store::named_statements())
    .fetch_all(&mut *conn)
    .await
    .context("reading producer_watermark")?;
    Ok(rows
        .into_iter()
        .map(|r| Watermark {
            stream: r.stream,
            cursor: Cursor {
                micros: r.cursor_micros,
                key: r.cursor_key,
            },
            updated_at: r.updated_at,
            run_id: r.run_id,
        })
        .collect())
}

/// Reads the stored cursor of `stream` (None: never run).
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn get(conn: &mut PgConnection, stream: &str) -> Result<Option<Cursor>> {
    let row: Option<(i64, String)> = sqlx::query_as(
        "SELECT cursor_micros, cursor_key FROM producer_watermark WHERE stream = $1",
    )
    .persistent(crate::store::named_statements())
    .bind(stream)
    .fetch_optional(&mut *conn)
    .await
    .context("reading producer_watermark")?;
    Ok(row.map(|(micros, key)| Cursor { micros, key }))
}

/// Takes the stream's run lock for the rest of the caller's *session* (not transaction):
/// `wait = false` returns whether it was free; `wait = true` blocks until it is.
/// Released by [`unlock`] or when the connection closes (a crashed run frees it).
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn lock(conn: &mut PgConnection, stream: &str, wait: bool) -> Result<bool> {
    let sql = if wait {
        "SELECT true FROM (SELECT pg_advisory_lock(hashtextextended('producer:' || $1, 0))) l"
    } else {
        "SELECT pg_try_advisory_lock(hashtextextended('producer:' || $1, 0))"
    };
    sqlx::query_scalar(sql)
        .persistent(crate::store::named_statements())
        .bind(stream)
        .fetch_one(&mut *conn)
        .await
        .context("taking the producer stream lock")
}

/// Releases the lock taken by [`lock`].
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn unlock(conn: &mut PgConnection, stream: &str) -> Result<()> {
    sqlx::query("SELECT pg_advisory_unlock(hashtextextended('producer:' || $1, 0))")
        .persistent(crate::store::named_statements())
        .bind(stream)
        .execute(&mut *conn)
        .await
        .context("releasing the producer stream lock")?;
    Ok(())
}

/// Moves the stream's cursor forward to `to` (never backwards) in the caller's transaction.
/// Returns the stored cursor afterwards.
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn advance(
    conn: &mut PgConnection,
    stream: &str,
    to: &Cursor,
    run_id: i64,
) -> Result<Cursor> {
    let row: Option<(i64, String)> = sqlx::query_as(
        "INSERT INTO producer_watermark AS w (stream, cursor_micros, cursor_key, run_id)
         VALUES ($1, $2, $3, $4)
         ON CONFLICT (stream) DO UPDATE SET
             cursor_micros = EXCLUDED.cursor_micros, cursor_key = EXCLUDED.cursor_key,
             run_id = EXCLUDED.run_id, updated_at = now()
         -- Defence in depth behind the run lock: never move the timestamp backwards. (The key is
         -- compared by the stream's query in BigQuery's own type, so it is not compared here.)
         WHERE w.cursor_micros <= EXCLUDED.cursor_micros
         RETURNING cursor_micros, cursor_key",
    )
    .persistent(crate::store::named_statements())
    .bind(stream)
    .bind(to.micros)
    .bind(&to.key)
    .bind(run_id)
    .fetch_optional(&mut *conn)
    .await
    .context("advancing producer_watermark")?;
    match row {
        Some((micros, key)) => Ok(Cursor { micros, key }),
        // Someone stored a later cursor: keep it, report it.
        None => Ok(get(conn, stream).await?.unwrap_or_else(|| to.clone())),
    }
}

/// Moves the stream's cursor back to `to` (an operator's rewind) in the caller's transaction, so
/// the next run re-reads what follows it. Returns false, changing nothing, when the stream has no
/// watermark or `to` is later than it. Call holding the stream's [`lock`] (no run may advance it
/// meanwhile) and write the audit row in the same transaction.
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn rewind(conn: &mut PgConnection, stream: &str, to: &Cursor) -> Result<bool> {
    let moved = sqlx::query(
        "UPDATE producer_watermark
         SET cursor_micros = $2, cursor_key = $3, run_id = NULL, updated_at = now()
         WHERE stream = $1
           -- Back only (the caller compares the keys, which need the stream's key type).
           AND cursor_micros >= $2",
    )
    .persistent(crate::store::named_statements())
    .bind(stream)
    .bind(to.micros)
    .bind(&to.key)
    .execute(&mut *conn)
    .await
    .context("rewinding producer_watermark")?
    .rows_affected();
    Ok(moved == 1)
}
