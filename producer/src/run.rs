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
//!   bound; [`crate::reader`] fails the run otherwise (a query without the right ORDER BY/WHERE
//!   could lose rows).
//! - **Monotonic watermark**: it only moves to a position greater than the stored one (with a
//!   lookback, early pages re-read old rows and leave it alone).
//! - **Lookback without re-publishing**: a stream with a lookback remembers the dedupe keys it
//!   committed in `producer_lookback_key` (same transaction as the page) and skips re-read rows
//!   whose key it remembers, even once the dispatcher has published and deleted them; keys below
//!   `watermark − lookback` are pruned when a run starts. Streams without a lookback write none.
//! - **An honest run ledger**: holding the lock, a run first closes the stream's runs still
//!   marked `running` as `abandoned` (their execution died: nobody else can hold the lock).

use std::time::Instant;

use outbox_runtime::shutdown::Shutdown;
use outbox_shared::store::dead_letter::{self, Rejection};
use outbox_shared::store::run_ledger::{self, Counts, Outcome};
use outbox_shared::store::{lookback, notify, outbox, watermark};
use outbox_shared::{NewMessage, TraceContext};
use sqlx::{Connection, PgConnection, PgPool};
use tokio::sync::mpsc::{Receiver, Sender};

use crate::bigquery::{Api, BigQuery};
use crate::config::{Commit, Stream};
use crate::cursor::Position;
use crate::errors::{ErrorKind, InStream, StreamError};
use crate::mapping::MappedRow;
use crate::reader::{StreamQuery, stored_watermark};
use crate::report::{Progress, StreamOutcome, StreamSummary};
use crate::settings::{OnOverlap, Settings};

/// Runs `stream` once: everything new since its watermark ends up in the outbox.
// No `err` here: the job logs a failed stream once, where it is handled.
#[tracing::instrument(skip_all, fields(stream = %stream.name))]
pub async fn run_stream<A: Api>(
    pool: &PgPool,
    bq: &BigQuery<A>,
    stream: &Stream,
    settings: &Settings,
    shutdown: &Shutdown,
) -> Result<StreamSummary, StreamError> {
    let name = stream.name.as_str();
    let started = Instant::now();
    // Detached: the lock must not outlive this run in a pooled connection.
    let mut conn = pool
        .acquire()
        .await
        .map_err(|e| StreamError::database(name, "connecting for the run", e))?
        .detach();
    if !take_lock(&mut conn, name, settings).await? {
        return skip(&mut conn, stream, settings, started).await;
    }
    let (stored_cursor, stored) = stored_watermark(&mut conn, stream).await?.unzip();
    tidy_before_run(&mut conn, stream, settings, stored.as_ref()).await?;
    let run_id = run_ledger::start(&mut conn, name, &settings.executor, stored_cursor.as_ref())
        .await
        .in_stream(name)?;
    let mut run = Run {
        stream,
        settings,
        summary: StreamSummary::new(name, StreamOutcome::Succeeded),
        high: stored,
        chunks: 0,
    };
    run.summary.run_id = Some(run_id);
    let result = run
        .read_and_enqueue(
            &mut conn,
            bq,
            shutdown,
            Progress::new(settings.progress_interval),
        )
        .await;
    let (outcome, error) = match &result {
        Ok(()) => (Outcome::Succeeded, None),
        Err(e) => (Outcome::Failed, Some(e.to_string())),
    };
    let bytes = run.summary.bytes_processed;
    if let Err(e) = run_ledger::finish(&mut conn, run_id, outcome, bytes, error.as_deref()).await {
        tracing::warn!(stream = name, run_id, error = %e, "Could not close the producer_run row; the next run of the stream closes it.");
    }
    // Closing the connection releases the lock too; unlock first so it is prompt and explicit.
    let _ = watermark::unlock(&mut conn, name).await;
    let _ = conn.close().await;
    result?;
    run.summary.watermark = run.high;
    run.summary.elapsed = started.elapsed();
    Ok(run.summary)
}

/// Takes the stream's run lock: at once, or waiting for the execution holding it
/// (`--on-overlap wait`); false when another execution holds it and `--on-overlap skip`.
async fn take_lock(
    conn: &mut PgConnection,
    name: &str,
    settings: &Settings,
) -> Result<bool, StreamError> {
    if watermark::lock(conn, name, false).await.in_stream(name)? {
        return Ok(true);
    }
    match settings.on_overlap {
        OnOverlap::Skip => Ok(false),
        OnOverlap::Wait => {
            tracing::info!(
                stream = name,
                "Another execution of this stream is running; waiting for it (--on-overlap wait)."
            );
            watermark::lock(conn, name, true).await.in_stream(name)?;
            Ok(true)
        }
    }
}

/// With the lock held: closes a dead execution's `running` ledger rows, and forgets the lookback
/// keys no run re-reads any more.
async fn tidy_before_run(
    conn: &mut PgConnection,
    stream: &Stream,
    settings: &Settings,
    stored: Option<&Position>,
) -> Result<(), StreamError> {
    let name = stream.name.as_str();
    // Holding the lock, nobody else runs this stream: a `running` row is a dead execution's.
    let reason = format!(
        "its execution ended without closing the run (killed?); closed by {} when it took the stream's lock",
        settings.executor
    );
    let abandoned = run_ledger::abandon_running(conn, name, &reason)
        .await
        .in_stream(name)?;
    if !abandoned.is_empty() {
        tracing::warn!(stream = name, runs = ?abandoned, "Closed runs of a dead execution as abandoned; this run resumes from the last committed page.");
    }
    // Keys below (watermark - lookback) are never re-read; a stream without a lookback keeps none.
    let below = match (stream.lookback, stored) {
        (Some(back), Some(p)) => Some(Some(
            Position::lower_bound(Some(p), Some(back), stream.cursor.key_type).micros,
        )),
        (Some(_), None) => None,
        (None, _) => Some(None),
    };
    if let Some(below) = below {
        lookback::prune(conn, name, below).await.in_stream(name)?;
    }
    Ok(())
}

/// `--on-overlap skip`: record the skip and return successfully.
async fn skip(
    conn: &mut PgConnection,
    stream: &Stream,
    settings: &Settings,
    started: Instant,
) -> Result<StreamSummary, StreamError> {
    let name = stream.name.as_str();
    tracing::info!(
        stream = name,
        "Another execution of this stream is running; skipping this run (--on-overlap skip). The next run picks up where it ends."
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
    stream: &'a Stream,
    settings: &'a Settings,
    summary: StreamSummary,
    /// The stored watermark (kept in step with every commit).
    high: Option<Position>,
    chunks: usize,
}

/// A page read and mapped, waiting for its commit.
struct ReadPage {
    rows: Vec<MappedRow>,
    /// The page's last row.
    last: Position,
    bytes_processed: Option<i64>,
}

/// What one page wrote (applied to the summary once its transaction commits).
#[derive(Debug, Default)]
struct Written {
    fetched: u64,
    enqueued: u64,
    duplicates: u64,
    rejected: u64,
    payload_bytes: u64,
    /// The watermark moved to this page's last row.
    advanced: Option<Position>,
}

impl Written {
    fn add(&mut self, other: Written) {
        self.fetched += other.fetched;
        self.enqueued += other.enqueued;
        self.duplicates += other.duplicates;
        self.rejected += other.rejected;
        self.payload_bytes += other.payload_bytes;
        if other.advanced.is_some() {
            self.advanced = other.advanced;
        }
    }
}

/// Consecutive rows of a page that are all enqueued, or all dead-lettered.
enum Segment {
    Accepted(Vec<NewMessage>),
    Rejected(Vec<Rejection>),
}

/// What [`Run::write_in_order`] wrote.
#[derive(Debug, Default)]
struct InOrder {
    enqueued: u64,
    /// Accepted rows whose dedupe key the outbox already had.
    duplicates: u64,
    /// Rejected rows offered, and those newly dead-lettered (the rest were already).
    rejected: u64,
    dead_lettered: u64,
}

/// Pages read ahead of the one committing (besides the reads in flight).
const READ_AHEAD: usize = 1;

impl Run<'_> {
    /// Reads pages while earlier ones commit: the reader (a task of its own, so BigQuery's
    /// answers are parsed and mapped on another core) runs ahead by at most [`READ_AHEAD`] pages
    /// plus the reads in flight; pages commit strictly in order.
    async fn read_and_enqueue<A: Api>(
        &mut self,
        conn: &mut PgConnection,
        bq: &BigQuery<A>,
        shutdown: &Shutdown,
        progress: Progress,
    ) -> Result<(), StreamError> {
        let (tx, rx) = tokio::sync::mpsc::channel(READ_AHEAD);
        let reader = Reader {
            bq: bq.clone(),
            stream: self.stream.clone(),
            settings: self.settings.clone(),
            stored: self.high.clone(),
        };
        let reading = AbortOnDrop(tokio::spawn(reader.read(tx)));
        let committed = self.commit_pages(conn, rx, shutdown, progress).await;
        drop(reading);
        committed
    }

    /// Commits the pages as they come: one transaction each, or one for the run.
    async fn commit_pages(
        &mut self,
        conn: &mut PgConnection,
        mut pages: Receiver<Result<ReadPage, StreamError>>,
        shutdown: &Shutdown,
        mut progress: Progress,
    ) -> Result<(), StreamError> {
        let name = self.stream.name.as_str();
        match self.stream.commit {
            Commit::Page => {
                while let Some(page) = self.next(&mut pages).await? {
                    let mut tx = begin(conn, name).await?;
                    let written = self.write_page(&mut tx, page.rows, &page.last).await?;
                    self.notify(&mut tx, written.enqueued).await?;
                    commit(tx, name).await?;
                    self.apply(written);
                    self.page_done(&mut progress, shutdown, 0)?;
                }
            }
            Commit::Run {
                max_rows,
                max_bytes,
            } => {
                let mut tx = begin(conn, name).await?;
                let mut pending = Written::default();
                while let Some(page) = self.next(&mut pages).await? {
                    pending.add(self.write_page(&mut tx, page.rows, &page.last).await?);
                    for (what, seen, limit) in [
                        ("rows", pending.fetched, max_rows),
                        ("bytes", pending.payload_bytes, max_bytes),
                    ] {
                        if seen > limit {
                            let kind = ErrorKind::RunTooLarge { what, limit };
                            return Err(StreamError::new(name, kind));
                        }
                    }
                    self.page_done(&mut progress, shutdown, pending.fetched)?;
                }
                self.notify(&mut tx, pending.enqueued).await?;
                commit(tx, name).await?;
                self.apply(pending);
            }
        }
        self.summary.elapsed = progress.elapsed();
        Ok(())
    }

    /// The next page with rows (keeping the bytes BigQuery reported), or the read's failure.
    async fn next(
        &mut self,
        pages: &mut Receiver<Result<ReadPage, StreamError>>,
    ) -> Result<Option<ReadPage>, StreamError> {
        loop {
            let waiting = Instant::now();
            let Some(page) = pages.recv().await else {
                break;
            };
            self.summary.waited_for_bigquery += waiting.elapsed();
            let page = page?;
            if page.bytes_processed.is_some() {
                self.summary.bytes_processed = page.bytes_processed;
            }
            if !page.rows.is_empty() {
                return Ok(Some(page));
            }
        }
        Ok(None)
    }

    /// After each page: progress, and a requested shutdown stops the run (in run mode before
    /// anything is committed: the `uncommitted` rows are rolled back).
    fn page_done(
        &mut self,
        progress: &mut Progress,
        shutdown: &Shutdown,
        uncommitted: u64,
    ) -> Result<(), StreamError> {
        let name = self.stream.name.as_str();
        self.chunks += 1;
        progress.tick(name, self.summary.fetched + uncommitted, self.high.as_ref());
        if shutdown.is_requested() {
            let chunks = if uncommitted > 0 { 0 } else { self.chunks };
            return Err(StreamError::new(name, ErrorKind::Interrupted { chunks }));
        }
        Ok(())
    }

    async fn notify(&self, tx: &mut PgConnection, enqueued: u64) -> Result<(), StreamError> {
        if enqueued == 0 {
            return Ok(());
        }
        notify::notify(tx, &self.settings.notify_channel)
            .await
            .in_stream(&self.stream.name)
    }

    /// Takes what a committed transaction wrote into the summary and the watermark.
    fn apply(&mut self, written: Written) {
        if let Some(to) = written.advanced {
            self.high = Some(to);
        }
        self.summary.fetched += written.fetched;
        self.summary.enqueued += written.enqueued;
        self.summary.duplicates += written.duplicates;
        self.summary.rejected += written.rejected;
    }

    /// One page inside `tx` (see the module doc): enqueue, dead-letter, watermark, ledger.
    async fn write_page(
        &self,
        tx: &mut PgConnection,
        page: Vec<MappedRow>,
        last: &Position,
    ) -> Result<Written, StreamError> {
        let name = self.stream.name.as_str();
        let run_id = self.summary.run_id.unwrap_or_default();
        let fetched = page.len() as u64;
        // With a lookback, rows this stream already committed are skipped here, whether or not
        // their outbox row still exists (the dispatcher deletes published rows).
        let remembered = if self.stream.lookback.is_some() {
            let keys: Vec<(&str, i64)> = page
                .iter()
                .map(|m| (dedupe_key(&m.outcome), m.position.micros))
                .collect();
            lookback::remember(&mut *tx, name, &keys)
                .await
                .in_stream(name)?
        } else {
            vec![true; page.len()]
        };
        // With tracing on, every message points at this run's trace (docs/tracing.md).
        let (segments, seen_before, payload_bytes) =
            segments(page, remembered, &crate::trace::current_context());
        let written = self.write_in_order(tx, &segments).await?;
        let (enqueued, dead_lettered) = (written.enqueued, written.dead_lettered);
        // The watermark only moves forward (a lookback's early pages re-read older rows).
        let high = self.high.as_ref();
        let advance = high.is_none_or(|high| last > high);
        let to = advance.then(|| last.to_cursor());
        if let Some(cursor) = &to {
            let stored = watermark::advance(&mut *tx, name, cursor, run_id)
                .await
                .in_stream(name)?;
            if stored != *cursor {
                tracing::warn!(stream = name, stored = ?stored, wanted = ?cursor, "The stored watermark is ahead of this run; kept it.");
            }
        }
        let already_rejected = written.rejected - dead_lettered + seen_before;
        let counts = Counts {
            fetched: fetched as i64,
            enqueued: enqueued as i64,
            duplicates: (written.duplicates + already_rejected) as i64,
            rejected: dead_lettered as i64,
        };
        run_ledger::record_chunk(&mut *tx, run_id, counts, to.as_ref())
            .await
            .in_stream(name)?;
        tracing::debug!(stream = name, batch.size = fetched, enqueued, rejected = dead_lettered, watermark = %last, "Chunk written.");
        Ok(Written {
            fetched,
            enqueued,
            duplicates: written.duplicates + already_rejected,
            rejected: dead_lettered,
            payload_bytes,
            advanced: advance.then(|| last.clone()),
        })
    }

    /// Writes a page's rows in their cursor order: each run of accepted rows enqueued, each run
    /// of rejected rows dead-lettered in between, so a rejected row takes its id from the outbox's
    /// sequence at its own place (a page without rejections is one statement).
    async fn write_in_order(
        &self,
        tx: &mut PgConnection,
        segments: &[Segment],
    ) -> Result<InOrder, StreamError> {
        let name = self.stream.name.as_str();
        let source = format!("producer:{name}");
        let mut written = InOrder::default();
        for segment in segments {
            match segment {
                Segment::Accepted(rows) => {
                    let e = outbox::enqueue_batch(&mut *tx, rows)
                        .await
                        .in_stream(name)?;
                    written.enqueued += e.inserted;
                    written.duplicates += e.duplicates;
                }
                Segment::Rejected(rows) => {
                    written.rejected += rows.len() as u64;
                    written.dead_lettered += dead_letter::insert_rejected(&mut *tx, &source, rows)
                        .await
                        .in_stream(name)?;
                }
            }
        }
        Ok(written)
    }
}

async fn begin<'c>(
    conn: &'c mut PgConnection,
    name: &str,
) -> Result<sqlx::Transaction<'c, sqlx::Postgres>, StreamError> {
    conn.begin()
        .await
        .map_err(|e| StreamError::database(name, "starting a chunk transaction", e))
}

async fn commit(tx: sqlx::Transaction<'_, sqlx::Postgres>, name: &str) -> Result<(), StreamError> {
    tx.commit()
        .await
        .map_err(|e| StreamError::database(name, "committing a chunk", e))
}

/// A run's reading side, owned by its task.
struct Reader<A> {
    bq: BigQuery<A>,
    stream: Stream,
    settings: Settings,
    stored: Option<Position>,
}

impl<A: Api> Reader<A> {
    /// Sends each page read and mapped, in order. A failure goes down the channel too: the pages
    /// before it still commit (page mode) or the run rolls back (run mode). A closed channel (the
    /// commit side failed or finished) stops the reading.
    async fn read(self, pages: Sender<Result<ReadPage, StreamError>>) {
        let name = self.stream.name.as_str();
        let query = StreamQuery::new(&self.stream, self.stored.as_ref(), &self.settings);
        let from = query.lower().clone();
        let mut rows = match query.open(&self.bq, &self.settings).await {
            Ok(rows) => rows,
            Err(e) => {
                let _ = pages.send(Err(e)).await;
                return;
            }
        };
        tracing::info!(stream = name, job = rows.job_id(), from = %from, "Reading new rows.");
        loop {
            let next = tokio::select! {
                biased;
                () = pages.closed() => return,
                next = rows.next_page() => next,
            };
            let page = match next {
                Ok(None) => return,
                Ok(Some(page)) => Ok(ReadPage {
                    rows: page,
                    last: rows.last().clone(),
                    bytes_processed: rows.bytes_processed(),
                }),
                Err(e) => Err(e),
            };
            let failed = page.is_err();
            if pages.send(page).await.is_err() || failed {
                return;
            }
        }
    }
}

/// Aborts the task when dropped (the run ended, or was itself dropped).
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The dedupe key a row is enqueued (or dead-lettered) under.
fn dedupe_key(outcome: &Result<NewMessage, Rejection>) -> &str {
    match outcome {
        Ok(m) => &m.dedupe_key,
        Err(r) => &r.message.dedupe_key,
    }
}
/// A page's rows in their order as runs of accepted and of rejected rows, each carrying
/// `context`, leaving out the rows a lookback had already seen; with how many it left out and
/// the accepted rows' payload bytes.
fn segments(
    page: Vec<MappedRow>,
    remembered: Vec<bool>,
    context: &Option<TraceContext>,
) -> (Vec<Segment>, u64, u64) {
    let mut seen_before = 0u64;
    let mut payload_bytes = 0u64;
    let mut segments: Vec<Segment> = Vec::new();
    for (mapped, new) in page.into_iter().zip(remembered) {
        match (new, mapped.outcome) {
            (false, _) => seen_before += 1,
            (true, Ok(mut m)) => {
                m.trace_context.clone_from(context);
                payload_bytes += m.payload.len() as u64;
                match segments.last_mut() {
                    Some(Segment::Accepted(run)) => run.push(m),
                    _ => segments.push(Segment::Accepted(vec![m])),
                }
            }
            (true, Err(mut r)) => {
                r.message.trace_context.clone_from(context);
                match segments.last_mut() {
                    Some(Segment::Rejected(run)) => run.push(r),
                    _ => segments.push(Segment::Rejected(vec![r])),
                }
            }
        }
    }
    (segments, seen_before, payload_bytes)
}
