//! The state the workers of a process share ([`Dispatch`]: the pool, the publisher, the breaker,
//! the schema gate, the byte budget, the key walk, the heartbeats). The unit of work
//! (`crate::batch`) and the worker loop (`crate::batch::worker`) both stand on it; it knows
//! neither.

use std::sync::Arc;
use std::sync::atomic::{AtomicI32, AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use sqlx::PgPool;
use tokio::sync::Semaphore;

use outbox_shared::store::claim::{KeyCursor, OrderedBatch};

use crate::batch::liveness::Heartbeats;
use crate::config::{BatchSettings, DispatcherConfig, Idle, RefusalSettings};
use crate::floors::Floors;
use crate::log_gate::LogGate;
use crate::metrics::Metrics;
use crate::pubsub::publish::Publish;
use crate::refusals::breaker::Breaker;
use crate::refusals::hold::Holds;
use crate::refusals::pace::Paces;
use crate::refusals::schema::SchemaGate;
use crate::refusals::storm::Storms;
use outbox_shared::store::claim::ClaimSession;

/// Everything a worker shares with the other workers of its process.
#[derive(Debug)]
pub(crate) struct Dispatch<P> {
    pub(crate) pool: PgPool,
    pub(crate) publisher: Arc<P>,
    pub(crate) settings: BatchSettings,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) breaker: Arc<Breaker>,
    /// Whether the schema has every migration of this release (`crate::refusals::schema`).
    pub(crate) schema: Arc<SchemaGate>,
    pub(crate) heartbeats: Heartbeats,
    pub(crate) inflight: ByteBudget,
    pub(crate) keys: KeyWalk,
    /// Where the claims start (what this replica knows is published).
    pub(crate) floors: Arc<Floors>,
    pub(crate) stall_probe_after: Duration,
    /// How claim transactions begin (their session settings).
    pub(crate) claim_session: ClaimSession,
    /// Batches claimed and not yet settled, and their rows (for the replica heartbeat).
    in_flight: (AtomicI32, AtomicI32),
    /// The idle workers' shared poll interval.
    pub(crate) idle: SharedIdle,
    /// Writers' NOTIFYs wake the workers (LISTEN is on).
    pub(crate) listening: bool,
    /// Lets through at most one slow-batch warning a second (`crate::batch::outcome`).
    pub(crate) slow_log: LogGate,
    /// The topics in a poison storm (`crate::refusals::storm`).
    pub(crate) storms: Storms,
    /// Lets through at most one ignored-trace-context warning a second (`crate::pubsub::trace`).
    pub(crate) trace_log: LogGate,
    /// The topics Pub/Sub refuses as a whole, held (`crate::refusals::hold`).
    pub(crate) holds: Holds,
    /// The topics slowed down by quota (`crate::refusals::pace`).
    pub(crate) paces: Paces,
    /// How held topics are probed and how far quota slows a topic down.
    pub(crate) refusals: RefusalSettings,
    /// The channel a release of a held topic notifies (`None`: polling only).
    pub(crate) notify_channel: Option<String>,
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
            schema: Arc::new(SchemaGate::default()),
            heartbeats: Heartbeats::new(config.workers),
            inflight: ByteBudget::new(config.max_inflight_bytes),
            keys: KeyWalk::new(config.batch.batch_size),
            floors: Arc::new(Floors::new(config.batch.claim_floor_margin)),
            stall_probe_after: config.stall_probe_after,
            claim_session: ClaimSession::new(config.lock_timeout),
            in_flight: (AtomicI32::new(0), AtomicI32::new(0)),
            idle: SharedIdle::new(config.idle),
            listening: config.notify_channel.is_some(),
            slow_log: LogGate::new(SLOW_LOG_EVERY),
            storms: Storms::default(),
            trace_log: LogGate::new(SLOW_LOG_EVERY),
            holds: Holds::default(),
            paces: Paces::new(config.refusals.quota_max_backoff),
            refusals: config.refusals,
            notify_channel: config.notify_channel.clone(),
        }
    }
}

impl<P> Dispatch<P> {
    /// Counts a claimed batch of `rows` as in flight until the guard drops.
    pub(crate) fn hold(&self, rows: usize) -> InFlight<'_> {
        let rows = i32::try_from(rows).unwrap_or(i32::MAX);
        self.in_flight.0.fetch_add(1, Ordering::Relaxed);
        self.in_flight.1.fetch_add(rows, Ordering::Relaxed);
        InFlight {
            counters: &self.in_flight,
            rows,
        }
    }

    /// The topics this replica's claims leave alone now: held (Pub/Sub refuses them) or slowed
    /// down by quota. Usually none (no allocation then).
    pub(crate) fn left_alone(&self) -> Vec<String> {
        let mut topics = Vec::new();
        self.holds.held(&mut topics);
        self.paces.cooling(&mut topics);
        topics
    }

    /// (batches, rows) in flight now.
    pub(crate) fn in_flight(&self) -> (i32, i32) {
        (
            self.in_flight.0.load(Ordering::Relaxed),
            self.in_flight.1.load(Ordering::Relaxed),
        )
    }
}

/// A batch counted as in flight; uncounted when dropped (settled, failed or abandoned).
pub(crate) struct InFlight<'a> {
    counters: &'a (AtomicI32, AtomicI32),
    rows: i32,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.counters.0.fetch_sub(1, Ordering::Relaxed);
        self.counters.1.fetch_sub(self.rows, Ordering::Relaxed);
    }
}

/// The shortest time between two slow-batch warnings of a process.
const SLOW_LOG_EVERY: Duration = Duration::from_secs(1);

/// Bounds the payload bytes in flight across workers (permits are KiB).
#[derive(Debug)]
pub(crate) struct ByteBudget {
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
    pub(crate) async fn reserve(&self, bytes: usize) -> Option<tokio::sync::SemaphorePermit<'_>> {
        let kib = u32::try_from(bytes.div_ceil(1024))
            .unwrap_or(u32::MAX)
            .clamp(1, self.total_kib);
        // The semaphore is never closed, so acquiring only fails if it were; publish anyway then.
        self.kib.acquire_many(kib).await.ok()
    }
}

/// The round-robin walk over ordering keys, shared by the workers of a process so they spread
/// over the keys, and the number of keys a claim picks, adapted to the backlog's shape: a claim
/// fills the batch key by key (`outbox_shared::store::claim::claim_ordered`), and a key picked
/// after the room ran out is locked for nothing (another worker skips it meanwhile), so a claim
/// picks about as many keys as the last ones filled the batch with.
#[derive(Debug)]
pub(crate) struct KeyWalk {
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

    /// Where the next ordered claim starts and how many keys it may pick.
    pub(crate) fn next(&self) -> (KeyCursor, i64) {
        let cursor = self.cursor.lock().map(|c| c.clone()).unwrap_or_default();
        (cursor, self.keys_per_claim.load(Ordering::Relaxed))
    }

    /// Learns from a claim that picked at most `max_keys` keys and resumes at `next` (see
    /// [`keys_to_pick`]).
    pub(crate) fn learn(&self, claim: &OrderedBatch, max_keys: i64, next: KeyCursor) {
        let rows = i64::try_from(claim.messages.len()).unwrap_or(i64::MAX);
        let adjusted = keys_to_pick(claim, rows, max_keys, self.batch_size);
        self.keys_per_claim.store(adjusted, Ordering::Relaxed);
        if let Ok(mut c) = self.cursor.lock() {
            *c = next;
        }
    }
}

/// How many keys the next claim picks, after one that picked at most `max_keys` and took `rows`
/// rows: when the rows filled the batch, as many keys as gave rows and a quarter more (a key
/// picked and left without room costs little); when the keys ran out first, as many as would
/// fill the batch at this claim's rows per key (at least twice as many); otherwise (the walk
/// found no more due keys) as many as before.
pub(crate) fn keys_to_pick(claim: &OrderedBatch, rows: i64, max_keys: i64, batch: i64) -> i64 {
    let used = i64::try_from(claim.keys).unwrap_or(i64::MAX);
    let picked = i64::try_from(claim.picked_keys).unwrap_or(i64::MAX);
    let keys = if claim.filled {
        used + used / 4 + 1
    } else if picked >= max_keys && rows > 0 {
        (batch.saturating_mul(picked) / rows).max(max_keys.saturating_mul(2))
    } else {
        max_keys
    };
    keys.clamp(1, batch.max(1))
}

/// How long idle workers sleep between polls, shared by the workers of a process: any worker
/// that finds rows resets it to `--poll-interval`, an idle one that found nothing doubles it up to
/// `--max-poll-interval`. (Per-worker waits let a worker back off to the maximum while the others
/// kept finding rows, which gave poll-only mode a tail of the maximum wait.)
#[derive(Debug)]
pub(crate) struct SharedIdle {
    wait_ms: AtomicU64,
    idle: Idle,
}

impl SharedIdle {
    pub(crate) fn new(idle: Idle) -> Self {
        Self {
            wait_ms: AtomicU64::new(millis(idle.poll_interval)),
            idle,
        }
    }

    /// How long an idle worker sleeps now.
    pub(crate) fn current(&self) -> Duration {
        Duration::from_millis(self.wait_ms.load(Ordering::Relaxed))
    }

    /// A worker found rows: back to `--poll-interval`.
    pub(crate) fn found_work(&self) {
        self.wait_ms
            .store(millis(self.idle.poll_interval), Ordering::Relaxed);
    }

    /// An idle worker found nothing: twice the wait, up to `--max-poll-interval`.
    pub(crate) fn found_nothing(&self) {
        let max = millis(self.idle.max_poll_interval);
        let _ = self
            .wait_ms
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |w| {
                Some(w.saturating_mul(2).clamp(1, max.max(1)))
            });
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(keys: usize, picked: usize, filled: bool) -> OrderedBatch {
        OrderedBatch {
            keys,
            picked_keys: picked,
            filled,
            ..OrderedBatch::default()
        }
    }

    #[test]
    fn a_claim_picks_about_as_many_keys_as_filled_the_last_batch() {
        // 1,000 keys of 100 rows, 500 keys picked: 5 keys filled the batch.
        assert_eq!(keys_to_pick(&claim(5, 500, true), 500, 500, 500), 7);
        // A hot key filled it alone.
        assert_eq!(keys_to_pick(&claim(1, 2, true), 500, 2, 500), 2);
        // One row per key and the keys ran out first: as many as fill the batch.
        assert_eq!(keys_to_pick(&claim(7, 7, false), 7, 7, 500), 500);
        // Two rows per key: half as many.
        assert_eq!(keys_to_pick(&claim(8, 8, false), 16, 8, 500), 250);
        // Few keys are due: as before.
        assert_eq!(keys_to_pick(&claim(3, 3, false), 3, 7, 500), 7);
        // Never more than the batch, never none.
        assert_eq!(keys_to_pick(&claim(500, 500, true), 500, 500, 500), 500);
        assert_eq!(keys_to_pick(&claim(0, 0, false), 0, 0, 500), 1);
    }
}
