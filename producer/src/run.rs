//! One stream's run: lock, read the watermark, query, then one transaction per page.
//!
//! Exactly once, how:
//! - **Per page, one PostgreSQL transaction**: enqueue (dedupe keys `ON CONFLICT DO NOTHING`),
//!   dead-letter the rejected rows, advance the watermark to the page's last row, add the page to
//!   the run ledger, one NOTIFY, commit. A crash anywhere rolls back the page in flight; the
//!   next run reads from the last committed watermark: no gap, and no duplicate (the rolled-back
//!   rows were never committed; the committed ones are behind the watermark, and their dedupe keys
//!   would absorb a re-read anyway).
//! - **Overlapping executions**: a session advisory lock per stream ([`watermark::lock`]) on a
//!   connection detached from the pool, used for every statement of the run. If that connection
//!   dies the lock goes with it, and so does the ability to write: no second writer can slip in.
//!   The watermark is read *after* the lock is taken.
//! - **Order**: rows must arrive strictly increasing in `(timestamp, key)` and after the lower
//!   bound; anything else fails the run (a query without the right ORDER BY/WHERE could lose rows).
//! - **Monotonic watermark**: it only moves to a position greater than the stored one (with a
//!   lookback, early pages re-read old rows and leave it alone).

use std::time::Instant;

use outbox_runtime::shutdown::Shutdown;
use outbox_shared::NewMessage;
use outbox_shared::store::dead_letter::{self, Rejection};
use outbox_shared::store::run_ledger::{self, Counts, Outcome};
use outbox_shared::store::{notify, outbox, watermark};
use sqlx::{Connection, PgConnection, PgPool};

use crate::bigquery::pages::PagesError;
use crate::bigquery::{Api, BigQuery, QuerySpec};
use crate::config::Stream;
use crate::cursor::Position;
use crate::errors::{Error, InStream};
use crate::job::{OnOverlap, Settings};
use crate::mapping::Mapper;
use crate::report::{Progress, StreamOutcome, StreamSummary};

/// Runs `stream` once (or dry-runs it): everything new since its watermark ends up in the outbox.
// No `err` here: the job logs a failed stream once, where it is handled.
#[tracing::instrument(skip_all, fields(stream = %stream.name))]
pub async fn run_stream<A: Api>(
    pool: &PgPool,
    bq: &BigQuery<A>,
    stream: &Stream,
    settings: &Settings,
    shutdown: &Shutdown,
) -> Result<StreamSummary, Error> {
    if settings.dry_run {
        return crate::dry_run::dry_run_stream(pool, bq, stream, settings).await;
    }
    let name = stream.name.as_str();
    let started = Instant::now();
    // Detached: the lock must not outlive this run in a pooled connection.
    let mut conn = pool
        .acquire()
        .await
        .map_err(|e| db_error(name, "connecting for the run", e))?
        .detach();
    if !watermark::lock(&mut conn, name, false)
        .await
        .in_stream(name)?
    {
        match settings.on_overlap {
            OnOverlap::Skip => return skip(&mut conn, stream, settings, started).await,
            OnOverlap::Wait => {
                tracing::info!(
                    stream = name,
                    "another execution of this stream is running; waiting for it (--on-overlap wait)"
                );
                watermark::lock(&mut conn, name, true)
                    .await
                    .in_stream(name)?;
            }
        }
    }
    let stored_cursor = watermark::get(&mut conn, name).await.in_stream(name)?;
    let stored = match &stored_cursor {
        None => None,
        Some(c) => Some(
            Position::from_cursor(c, stream.cursor.key_type).ok_or_else(|| {
                Error::StoredWatermark {
                    stream: name.to_owned(),
                    key: c.key.clone(),
                    key_type: format!("{:?}", stream.cursor.key_type),
                }
            })?,
        ),
    };
    let run_id = run_ledger::start(&mut conn, name, &settings.executor, stored_cursor.as_ref())
        .await
        .in_stream(name)?;
    let mut run = Run {
        conn,
        stream,
        settings,
        summary: StreamSummary::new(name, StreamOutcome::Succeeded),
        high: stored,
        chunks: 0,
    };
    run.summary.run_id = Some(run_id);
    let result = run
        .read_and_enqueue(bq, shutdown, Progress::new(settings.progress_interval))
        .await;
    let (outcome, error) = match &result {
        Ok(()) => (Outcome::Succeeded, None),
        Err(e) => (Outcome::Failed, Some(e.to_string())),
    };
    let bytes = run.summary.bytes_processed;
    if let Err(e) =
        run_ledger::finish(&mut run.conn, run_id, outcome, bytes, error.as_deref()).await
    {
        tracing::warn!(stream = name, run_id, error = %e, "could not close the producer_run row");
    }
    // Closing the connection releases the lock too; unlock first so it is prompt and explicit.
    let _ = watermark::unlock(&mut run.conn, name).await;
    let _ = run.conn.close().await;
    result?;
    run.summary.watermark = run.high;
    run.summary.elapsed = started.elapsed();
    Ok(run.summary)
}

/// `--on-overlap skip`: record the skip and return successfully.
async fn skip(
    conn: &mut PgConnection,
    stream: &Stream,
    settings: &Settings,
    started: Instant,
) -> Result<StreamSummary, Error> {
    let name = stream.name.as_str();
    tracing::info!(
        stream = name,
        "another execution of this stream is running; skipping this run (--on-overlap skip); the next run will pick up where it ends"
    );
    let run_id = run_ledger::start(conn, name, &settings.executor, None)
        .await
        .in_stream(name)?;
    run_ledger::finish(
        conn,
        run_id,
        Outcome::Skipped,
        None,
        Some("another execution held the stream lock"),
    )
    .await
    .in_stream(name)?;
    let mut summary = StreamSummary::new(name, StreamOutcome::Skipped);
    summary.run_id = Some(run_id);
    summary.watermark = watermark::get(conn, name)
        .await
        .in_stream(name)?
        .and_then(|c| Position::from_cursor(&c, stream.cursor.key_type));
    summary.elapsed = started.elapsed();
    Ok(summary)
}

struct Run<'a> {
    conn: PgConnection,
    stream: &'a Stream,
    settings: &'a Settings,
    summary: StreamSummary,
    /// The stored watermark (kept in step with every commit).
    high: Option<Position>,
    chunks: usize,
}

impl Run<'_> {
    async fn read_and_enqueue<A: Api>(
        &mut self,
        bq: &BigQuery<A>,
        shutdown: &Shutdown,
        mut progress: Progress,
    ) -> Result<(), Error> {
        let name = self.stream.name.as_str();
        let lower = Position::lower_bound(
            self.high.as_ref(),
            self.stream.lookback,
            self.stream.cursor.key_type,
        );
        let spec = query_spec(self.stream, &lower, self.settings.page_size);
        let mut pages = bq.open(&spec).await.map_err(|e| pages_error(name, e))?;
        // Checks every configured column before anything is written.
        let mapper = Mapper::new(
            self.stream,
            pages.schema(),
            &self.settings.dedupe_attribute,
            &self.settings.pubsub_project,
        )?;
        tracing::info!(stream = name, job = pages.job_id(), from = %lower, "reading new rows");
        let mut previous = lower;
        while let Some(rows) = pages.next_page().await.map_err(|e| pages_error(name, e))? {
            self.summary.bytes_processed = pages.bytes_processed();
            if rows.is_empty() {
                continue;
            }
            let (mut accepted, mut rejected) = (Vec::new(), Vec::new());
            for row in &rows {
                let mapped = mapper.map_row(row)?;
                if mapped.position <= previous {
                    return Err(order_error(
                        name,
                        &previous,
                        &mapped.position,
                        self.summary.fetched == 0 && accepted.is_empty() && rejected.is_empty(),
                    ));
                }
                previous = mapped.position;
                match mapped.outcome {
                    Ok(m) => accepted.push(m),
                    Err(r) => rejected.push(r),
                }
            }
            self.commit_chunk(&accepted, &rejected, &previous, rows.len() as u64)
                .await?;
            self.chunks += 1;
            progress.tick(name, self.summary.fetched, self.high.as_ref());
            if self.settings.fail_after_chunks == Some(self.chunks) {
                return Err(Error::InjectedFailure {
                    stream: name.to_owned(),
                    chunks: self.chunks,
                });
            }
            if shutdown.is_requested() {
                return Err(Error::Interrupted {
                    stream: name.to_owned(),
                    chunks: self.chunks,
                });
            }
        }
        self.summary.bytes_processed = pages.bytes_processed();
        self.summary.elapsed = progress.elapsed();
        Ok(())
    }

    /// One page, one transaction (see the module doc).
    async fn commit_chunk(
        &mut self,
        accepted: &[NewMessage],
        rejected: &[Rejection],
        last: &Position,
        fetched: u64,
    ) -> Result<(), Error> {
        let name = self.stream.name.as_str();
        let run_id = self.summary.run_id.unwrap_or_default();
        let mut tx = self
            .conn
            .begin()
            .await
            .map_err(|e| db_error(name, "starting a chunk transaction", e))?;
        let enqueued = outbox::enqueue_batch(&mut tx, accepted)
            .await
            .in_stream(name)?;
        let dead_lettered =
            dead_letter::insert_rejected(&mut tx, &format!("producer:{name}"), rejected)
                .await
                .in_stream(name)?;
        let advance = self.high.as_ref().is_none_or(|high| last > high);
        let to = advance.then(|| last.to_cursor());
        if let Some(cursor) = &to {
            let stored = watermark::advance(&mut tx, name, cursor, run_id)
                .await
                .in_stream(name)?;
            if stored != *cursor {
                tracing::warn!(stream = name, stored = ?stored, wanted = ?cursor, "the stored watermark is ahead of this run; kept it");
            }
        }
        let already_rejected = rejected.len() as u64 - dead_lettered;
        let counts = Counts {
            fetched: fetched as i64,
            enqueued: enqueued.inserted as i64,
            duplicates: (enqueued.duplicates + already_rejected) as i64,
            rejected: dead_lettered as i64,
        };
        run_ledger::record_chunk(&mut tx, run_id, counts, to.as_ref())
            .await
            .in_stream(name)?;
        if enqueued.inserted > 0 {
            notify::notify(&mut tx, &self.settings.notify_channel)
                .await
                .in_stream(name)?;
        }
        tx.commit()
            .await
            .map_err(|e| db_error(name, "committing a chunk", e))?;
        if advance {
            self.high = Some(last.clone());
        }
        self.summary.fetched += fetched;
        self.summary.enqueued += enqueued.inserted;
        self.summary.duplicates += enqueued.duplicates + already_rejected;
        self.summary.rejected += dead_lettered;
        tracing::debug!(stream = name, batch.size = fetched, enqueued = enqueued.inserted, rejected = dead_lettered, watermark = %last, "chunk committed");
        Ok(())
    }
}

/// The query of `stream` from `lower`, `page_size` rows per page.
pub(crate) fn query_spec(stream: &Stream, lower: &Position, page_size: u32) -> QuerySpec {
    QuerySpec {
        query: stream.query.clone(),
        params: lower.parameters(),
        location: stream.location.clone(),
        maximum_bytes_billed: stream.maximum_bytes_billed,
        page_size: page_size.max(1),
    }
}

pub(crate) fn pages_error(stream: &str, e: PagesError) -> Error {
    match e {
        PagesError::Query(message) => Error::Query {
            stream: stream.to_owned(),
            message,
        },
        PagesError::Request(message) => Error::BigQuery {
            stream: stream.to_owned(),
            message,
        },
    }
}

pub(crate) fn order_error(stream: &str, previous: &Position, row: &Position, first: bool) -> Error {
    let detail = if first {
        format!("a row at {row} is not after the lower bound {previous} the query was given")
    } else if row == previous {
        format!("two rows share the cursor {row}")
    } else {
        format!("a row at {row} came after {previous}: rows are not in cursor order")
    };
    Error::CursorOrder {
        stream: stream.to_owned(),
        detail,
    }
}

pub(crate) fn db_error(stream: &str, context: &'static str, source: sqlx::Error) -> Error {
    Error::Database {
        stream: stream.to_owned(),
        source: outbox_shared::Error::Database { context, source },
    }
}
