//! One unit of work ([`run_batch`]) and the worker loop around it.
//!
//! A batch is one PostgreSQL transaction: claim due rows (`FOR UPDATE SKIP LOCKED`, locks held),
//! check Pub/Sub's limits locally, publish, then settle every row before commit: published rows are
//! deleted (or marked, with retention), transient failures get their next attempt time, permanent
//! failures and exhausted rows move to the dead-letter table. A crash anywhere before commit rolls
//! everything back (the rows are claimed again; published ones are re-sent: at-least-once).

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use sqlx::PgPool;
use tokio::sync::{Notify, Semaphore};

use outbox_runtime::shutdown::Shutdown;
use outbox_shared::ClaimedMessage;
use outbox_shared::limits::check_publishable;
use outbox_shared::retry::RetryDecision;
use outbox_shared::store::claim::{self, ClaimFilter, KeyCursor, OrderedClaim};
use outbox_shared::store::dead_letter::{self, ErrorKind, Failure};
use outbox_shared::store::outbox::{self, Retry};

use crate::breaker::Breaker;
use crate::classify::FailureKind;
use crate::config::{BatchSettings, DispatcherConfig, Idle};
use crate::error::DispatcherError;
use crate::liveness::Heartbeats;
use crate::metrics::Metrics;
use crate::publisher::Publish;

/// Everything a worker shares with the other workers of its process.
#[derive(Debug)]
pub(crate) struct Dispatch<P> {
    pub(crate) pool: PgPool,
    pub(crate) publisher: Arc<P>,
    pub(crate) settings: BatchSettings,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) breaker: Arc<Breaker>,
    pub(crate) heartbeats: Heartbeats,
    inflight: ByteBudget,
    keys: KeyWalk,
}

impl<P: Publish> Dispatch<P> {
    /// Assembles the shared state of `config.workers` workers.
    pub(crate) fn new(
        pool: PgPool,
        publisher: Arc<P>,
        config: &DispatcherConfig,
        metrics: Arc<Metrics>,
    ) -> Self {
        let breaker = Arc::new(Breaker::new(
            config.breaker.cooldown,
            config.breaker.max_cooldown,
            metrics.breaker_open.clone(),
        ));
        Self {
            pool,
            publisher,
            settings: config.batch.clone(),
            metrics,
            breaker,
            heartbeats: Heartbeats::new(config.workers),
            inflight: ByteBudget::new(config.max_inflight_bytes),
            keys: KeyWalk::new(config.batch.batch_size),
        }
    }
}

/// Bounds the payload bytes in flight across workers (permits are KiB).
#[derive(Debug)]
struct ByteBudget {
    kib: Semaphore,
    total_kib: u32,
}

impl ByteBudget {
    fn new(max_bytes: u64) -> Self {
        let total_kib = u32::try_from(max_bytes / 1024).unwrap_or(u32::MAX).max(1);
        Self {
            kib: Semaphore::new(total_kib as usize),
            total_kib,
        }
    }

    /// Waits until `bytes` fit (a batch larger than the whole budget waits for all of it).
    async fn reserve(&self, bytes: usize) -> Option<tokio::sync::SemaphorePermit<'_>> {
        let kib = u32::try_from(bytes.div_ceil(1024))
            .unwrap_or(u32::MAX)
            .clamp(1, self.total_kib);
        // The semaphore is never closed, so acquiring only fails if it were; publish anyway then.
        self.kib.acquire_many(kib).await.ok()
    }
}

/// The fewest ordering keys a claim adapts down to.
const MIN_KEYS_PER_CLAIM: i64 = 4;

/// The round-robin walk over ordering keys, shared by the workers of a process so they spread
/// over the keys, and the number of keys per claim, adapted to the backlog's shape.
#[derive(Debug)]
struct KeyWalk {
    cursor: std::sync::Mutex<KeyCursor>,
    keys_per_claim: AtomicI64,
    batch_size: i64,
}

impl KeyWalk {
    fn new(batch_size: i64) -> Self {
        Self {
            cursor: std::sync::Mutex::default(),
            keys_per_claim: AtomicI64::new(batch_size.max(1)),
            batch_size,
        }
    }

    /// Where the next ordered claim starts and how many keys it may take.
    fn next(&self) -> (KeyCursor, i64) {
        let cursor = self.cursor.lock().map(|c| c.clone()).unwrap_or_default();
        (cursor, self.keys_per_claim.load(Ordering::Relaxed))
    }

    /// Learns from a claim that took `keys` keys (`saturated` of them had more rows than their
    /// share) with at most `max_keys`: when most keys were deep, take fewer keys (more rows each,
    /// fewer publish requests, and keys left for other workers); when the key limit was the
    /// bottleneck, take more.
    fn learn(&self, keys: usize, saturated: usize, max_keys: i64, next: KeyCursor) {
        let adjusted = if keys > 0 && saturated * 2 > keys {
            (max_keys / 2).max(MIN_KEYS_PER_CLAIM.min(self.batch_size))
        } else if keys as i64 >= max_keys {
            (max_keys * 2).min(self.batch_size)
        } else {
            max_keys
        };
        self.keys_per_claim.store(adjusted, Ordering::Relaxed);
        if let Ok(mut c) = self.cursor.lock() {
            *c = next;
        }
    }
}

/// What one batch did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Settled {
    /// Rows claimed.
    pub claimed: usize,
    /// Published and recorded.
    pub published: usize,
    /// Scheduled for another attempt.
    pub retried: usize,
    /// Moved to the dead-letter table.
    pub dead_lettered: usize,
    /// Released untouched (not attempted).
    pub released: usize,
}

/// The outcome of [`run_batch`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BatchOutcome {
    /// Nothing was due.
    Empty,
    /// Every claimed row was settled.
    Settled(Settled),
    /// Pub/Sub did not answer: the rows were released untouched and the breaker tripped.
    Outage {
        /// The first error seen.
        error: String,
        /// Rows released.
        released: usize,
    },
}

/// Claims, publishes and settles one batch of rows due at `now`.
#[tracing::instrument(skip_all, fields(batch.size = tracing::field::Empty), err(level = "debug"))]
pub(crate) async fn run_batch<P: Publish>(
    d: &Dispatch<P>,
    now: DateTime<Utc>,
) -> Result<BatchOutcome, DispatcherError> {
    let mut tx = d
        .pool
        .begin()
        .await
        .map_err(|source| outbox_shared::Error::Database {
            context: "starting a claim transaction",
            source,
        })?;
    let claimed = claim(d, &mut tx, now).await?;
    if claimed.is_empty() {
        // Nothing locked, nothing written: ending the transaction either way is the same.
        let _ = tx.rollback().await;
        return Ok(BatchOutcome::Empty);
    }
    tracing::Span::current().record("batch.size", claimed.len());
    d.metrics.batch_size.observe(claimed.len() as f64);

    // Local limit checks: a message that can never be published costs no round trip.
    // Messages move (no copies): the sendable ones to the publisher, the others beside their
    // failure, for the log.
    let claimed_count = claimed.len();
    let mut rejected = Vec::new();
    let mut rejected_messages = Vec::new();
    let mut sendable: Vec<ClaimedMessage> = Vec::with_capacity(claimed_count);
    for m in claimed {
        match check_publishable(
            &m.payload,
            &m.attributes,
            m.ordering_key.as_deref(),
            &d.settings.dedupe_attribute,
            &m.dedupe_key,
        ) {
            Ok(()) => sendable.push(m),
            Err(violation) => {
                d.metrics.fail("limit", 1);
                rejected.push(Failure {
                    id: m.id,
                    attempts: m.attempts,
                    kind: ErrorKind::Permanent,
                    error: format!("rejected before publishing: {violation}"),
                });
                rejected_messages.push(m);
            }
        }
    }

    let results = publish_bounded(d, &sendable).await;

    let mut settled = Settled {
        claimed: claimed_count,
        ..Settled::default()
    };
    let mut published: Vec<(i64, String)> = Vec::new();
    let mut retries = Vec::new();
    let mut failures = Vec::new();
    let mut paused_keys = Vec::new();
    let mut transient_error = None;
    for (m, result) in sendable.iter().zip(results) {
        match result {
            Ok(message_id) => {
                let lag = (now - m.created_at).num_milliseconds().max(0) as f64 / 1000.0;
                d.metrics.lag_seconds.observe(lag);
                published.push((m.id, message_id));
            }
            Err(failure) => {
                d.metrics.fail(failure.kind.as_str(), 1);
                if let Some(key) = &m.ordering_key {
                    paused_keys.push((m.topic.clone(), key.clone()));
                }
                match failure.kind {
                    FailureKind::NotAttempted => settled.released += 1,
                    FailureKind::Permanent => {
                        failures.push(Failure {
                            id: m.id,
                            attempts: m.attempts.saturating_add(1),
                            kind: ErrorKind::Permanent,
                            error: failure.message,
                        });
                    }
                    FailureKind::Transient => {
                        transient_error
                            .get_or_insert_with(|| (m.topic.clone(), failure.message.clone()));
                        match d
                            .settings
                            .schedule
                            .on_failure(m.attempts, now, fastrand::f64())
                        {
                            RetryDecision::RetryAt { at, attempts } => retries.push(Retry {
                                id: m.id,
                                attempts,
                                next_attempt_at: at,
                                last_error: failure.message,
                            }),
                            RetryDecision::DeadLetter { attempts } => failures.push(Failure {
                                id: m.id,
                                attempts,
                                kind: ErrorKind::Exhausted,
                                error: failure.message,
                            }),
                        }
                    }
                }
            }
        }
    }

    // Every message sent failed transiently: is it the messages, or is Pub/Sub down for everyone?
    // Only a failed probe makes it an outage; then nothing is charged and the rows are released.
    let only_transient =
        published.is_empty() && failures.iter().all(|f| f.kind == ErrorKind::Exhausted);
    if only_transient
        && let Some((topic, error)) = &transient_error
        && let Err(probe_error) = d.publisher.probe(topic).await
    {
        dead_letter::move_from_outbox(&mut tx, &rejected, now).await?;
        commit(tx).await?;
        d.metrics.outage_batches.inc();
        d.metrics.dead_letter("permanent", rejected.len() as u64);
        d.breaker.trip(topic, &probe_error);
        resume(d, &paused_keys);
        let released = claimed_count - rejected.len();
        return Ok(BatchOutcome::Outage {
            error: format!("{error} (probe: {probe_error})"),
            released,
        });
    }
    failures.append(&mut rejected);

    if d.settings.retain_published {
        outbox::mark_published(&mut tx, &published, now).await?;
    } else {
        let ids: Vec<i64> = published.iter().map(|(id, _)| *id).collect();
        outbox::delete_published(&mut tx, &ids).await?;
    }
    outbox::schedule_retries(&mut tx, &retries).await?;
    dead_letter::move_from_outbox(&mut tx, &failures, now).await?;
    commit(tx).await?;
    // Only now, with the failed message re-queued ahead of later ones, may the key go on.
    resume(d, &paused_keys);

    settled.published = published.len();
    settled.retried = retries.len();
    settled.dead_lettered = failures.len();
    d.metrics.published.inc_by(published.len() as u64);
    d.metrics.retried.inc_by(retries.len() as u64);
    for f in &failures {
        d.metrics.dead_letter(f.kind.as_str(), 1);
        let message = sendable
            .iter()
            .chain(&rejected_messages)
            .find(|m| m.id == f.id);
        match message.and_then(|m| m.ordering_key.as_deref().map(|k| (m, k))) {
            Some((m, key)) if !d.settings.skip_dead_letter_topics.contains(&m.topic) => {
                tracing::error!(
                    outbox.id = f.id, outbox.dedupe_key = %m.dedupe_key, pubsub.topic = %m.topic, pubsub.ordering_key = key,
                    error.kind = f.kind.as_str(), error = %f.error,
                    "Ordering key BLOCKED: its message was dead-lettered and the later messages of the key wait; \
                     replay or discard the dead letter to release it."
                )
            }
            _ => {
                tracing::error!(outbox.id = f.id, error.kind = f.kind.as_str(), error = %f.error,
                    "Message dead-lettered: inspect it, then replay or discard it.")
            }
        }
    }
    Ok(BatchOutcome::Settled(settled))
}

/// Claims ordering keys first (whole keys, in id order), then fills the batch with unkeyed rows.
async fn claim<P: Publish>(
    d: &Dispatch<P>,
    tx: &mut sqlx::PgConnection,
    now: DateTime<Utc>,
) -> Result<Vec<ClaimedMessage>, DispatcherError> {
    let filter = ClaimFilter {
        now,
        limit: d.settings.batch_size,
        topics: d.settings.topics.as_deref(),
    };
    let (cursor, max_keys) = d.keys.next();
    let ordered = OrderedClaim {
        filter: filter.clone(),
        scan_limit: d.settings.key_scan_limit,
        skip_dead_letter_topics: &d.settings.skip_dead_letter_topics,
        max_keys,
    };
    let keyed = claim::claim_ordered(tx, &ordered, &cursor).await?;
    d.keys.learn(
        keyed.keys,
        keyed.saturated_keys,
        max_keys,
        keyed.next_cursor,
    );
    let mut claimed = keyed.messages;
    let room = d.settings.batch_size - claimed.len() as i64;
    if room > 0 {
        claimed.extend(
            claim::claim_batch(
                tx,
                &ClaimFilter {
                    limit: room,
                    ..filter
                },
            )
            .await?,
        );
    }
    Ok(claimed)
}

async fn commit(tx: sqlx::Transaction<'_, sqlx::Postgres>) -> Result<(), DispatcherError> {
    tx.commit().await.map_err(|source| {
        DispatcherError::Store(outbox_shared::Error::Database {
            context: "committing a settled batch",
            source,
        })
    })
}

fn resume<P: Publish>(d: &Dispatch<P>, keys: &[(String, String)]) {
    for (topic, key) in keys {
        d.publisher.resume(topic, key);
    }
}

/// Publishes under the process-wide byte budget and records the latency.
async fn publish_bounded<P: Publish>(
    d: &Dispatch<P>,
    batch: &[ClaimedMessage],
) -> Vec<Result<String, crate::classify::PublishFailure>> {
    if batch.is_empty() {
        return Vec::new();
    }
    let bytes: usize = batch
        .iter()
        .map(|m| m.payload.len() + m.dedupe_key.len() + 64)
        .sum();
    let _permit = d.inflight.reserve(bytes).await;
    let started = Instant::now();
    let results = d.publisher.publish(batch).await;
    d.metrics
        .publish_seconds
        .observe(started.elapsed().as_secs_f64());
    results
}

/// Runs batches until shutdown: back-to-back while there is work, waiting on NOTIFY or a poll
/// interval that doubles while idle. A batch in flight when shutdown arrives is finished.
pub(crate) async fn work<P: Publish>(
    d: Arc<Dispatch<P>>,
    worker: usize,
    wakeup: Arc<Notify>,
    idle: Idle,
    mut shutdown: Shutdown,
) {
    let mut wait = idle.poll_interval;
    let mut error_backoff = Duration::from_millis(200);
    loop {
        d.heartbeats.beat(worker);
        if shutdown.is_requested() {
            break;
        }
        d.breaker
            .admit(&*d.publisher, &mut shutdown, || d.heartbeats.beat(worker))
            .await;
        if shutdown.is_requested() {
            break;
        }
        let notified = wakeup.notified();
        match run_batch(&d, Utc::now()).await {
            Ok(BatchOutcome::Settled(s)) => {
                tracing::debug!(
                    worker,
                    published = s.published,
                    retried = s.retried,
                    dead_lettered = s.dead_lettered,
                    "Batch settled."
                );
                wait = idle.poll_interval;
                error_backoff = Duration::from_millis(200);
            }
            Ok(BatchOutcome::Outage { error, released }) => {
                tracing::debug!(worker, released, %error, "Batch released: Pub/Sub is unreachable.");
            }
            Ok(BatchOutcome::Empty) => {
                tokio::select! {
                    _ = notified => { wait = idle.poll_interval; }
                    _ = tokio::time::sleep(wait) => { wait = (wait * 2).min(idle.max_poll_interval); }
                    _ = shutdown.requested() => break,
                }
            }
            Err(e) => {
                // Logged once here (run_batch's span records it at debug level).
                tracing::error!(worker, error = %e, retry_in = ?error_backoff, "A batch failed; its rows will be claimed again.");
                tokio::select! {
                    _ = tokio::time::sleep(error_backoff) => {}
                    _ = shutdown.requested() => break,
                }
                error_backoff = (error_backoff * 2).min(Duration::from_secs(10));
            }
        }
    }
    tracing::debug!(worker, "Worker stopped.");
}
