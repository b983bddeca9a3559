//! `producer_lookback_key`: the dedupe keys a stream with a lookback has enqueued within its
//! lookback window, so a re-read row is never enqueued twice, even after the dispatcher has
//! published and deleted its outbox row (`ON CONFLICT (dedupe_key)` only sees rows still there).
//!
//! [`remember`] runs in the page's transaction, so a key is remembered exactly when its row is
//! committed; [`prune`] drops keys below `watermark − lookback`, which no later run re-reads.

use sqlx::PgConnection;

use crate::error::{DbContext, Result};

/// Remembers `keys` (each with its row's cursor timestamp, UNIX microseconds) for `stream` and
/// returns, for each key, whether it is new: `false` means an earlier committed page already
/// enqueued (or dead-lettered) it, so the row must be skipped.
#[tracing::instrument(skip_all, fields(db.system = "postgresql", batch.size = keys.len()), err(level = "debug"))]
pub async fn remember(
    conn: &mut PgConnection,
    stream: &str,
    keys: &[(&str, i64)],
) -> Result<Vec<bool>> {
    if keys.is_empty() {
        return Ok(Vec::new());
    }
    let (dedupe, micros): (Vec<&str>, Vec<i64>) = keys.iter().copied().unzip();
    let inserted: Vec<String> = sqlx::query_scalar(
        "INSERT INTO producer_lookback_key (stream, dedupe_key, cursor_micros)
         SELECT $1, k, m FROM UNNEST($2::text[], $3::bigint[]) AS t(k, m)
         ON CONFLICT (stream, dedupe_key) DO NOTHING
         RETURNING dedupe_key",
    )
    .persistent(crate::store::named_statements())
    .bind(stream)
    .bind(&dedupe)
    .bind(&micros)
    .fetch_all(&mut *conn)
    .await
    .context("remembering lookback dedupe keys")?;
    let inserted: std::collections::HashSet<&str> = inserted.iter().map(String::as_str).collect();
    Ok(dedupe.iter().map(|k| inserted.contains(k)).collect())
}

/// Forgets `stream`'s keys of rows before `below_micros` (None: all of them, for a stream
/// without a lookback). Returns how many were dropped.
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn prune(
    conn: &mut PgConnection,
    stream: &str,
    below_micros: Option<i64>,
) -> Result<u64> {
    let done = sqlx::query(
        "DELETE FROM producer_lookback_key
         WHERE stream = $1 AND ($2::bigint IS NULL OR cursor_micros < $2)",
    )
    .persistent(crate::store::named_statements())
    .bind(stream)
    .bind(below_micros)
    .execute(&mut *conn)
    .await
    .context("pruning lookback dedupe keys")?;
    Ok(done.rows_affected())
}

/// The cursor timestamp (UNIX microseconds) of the oldest key `stream` remembers, or `None` when
/// it remembers none (a stream without a lookback): rows re-read from there on whose key is
/// remembered are skipped, even when their outbox row is gone.
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn oldest(conn: &mut PgConnection, stream: &str) -> Result<Option<i64>> {
    sqlx::query_scalar("SELECT min(cursor_micros) FROM producer_lookback_key WHERE stream = $1")
        .persistent(crate::store::named_statements())
        .bind(stream)
        .fetch_one(&mut *conn)
        .await
        .context("reading the oldest remembered lookback key")
}
