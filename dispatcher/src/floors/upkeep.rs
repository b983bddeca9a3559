//! The floors' upkeep, off the claim path ([`keep`]): stamping the outbox and learning which
//! stamps settled, raising the keyed floor to the settled one after a walk over every key, and
//! the probe for rows the floors cannot know of (the parent module and
//! `outbox_shared::store::claim` say why). It stands on what it is given ([`Upkeep`]), not on
//! the workers' shared state.

use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use outbox_runtime::shutdown::Shutdown;
use outbox_shared::store::claim::{
    ClaimSession, KeyCursor, KeyFloor, SeenHead, probe, settled, walk_keys,
};
use sqlx::PgPool;

use super::Floors;
use crate::metrics::Metrics;
use crate::refusals::schema::SchemaGate;

/// What the upkeep works on: the floors, and what it needs to walk the outbox.
pub(crate) struct Upkeep {
    pub(crate) floors: Arc<Floors>,
    pub(crate) pool: PgPool,
    /// The claims' transaction settings (its walks need the same plans).
    pub(crate) session: ClaimSession,
    pub(crate) schema: Arc<SchemaGate>,
    pub(crate) metrics: Arc<Metrics>,
    /// The topics this replica serves (None: all).
    pub(crate) topics: Option<Vec<String>>,
    /// The old keys a raised floor may keep at most (`--key-scan-limit`).
    pub(crate) max_old_keys: usize,
    /// The topics the claims leave alone now (held, or slowed down by quota).
    pub(crate) left_alone: Box<dyn Fn() -> Vec<String> + Send + Sync>,
}

/// Keys per statement of the walks over every key.
const WALK_KEYS: i64 = 10_000;

/// Keeps the claims' floors up to date, on two cadences, each at least a
/// multiple of its own last duration so that neither takes a noticeable share of a core:
/// - a stamp of the outbox, which stamps have settled, and raising the keyed floor to the
///   settled one: a walk over every key from the floor (as cheap as the claims' walks), every
///   second or 20 x its duration;
/// - the probe for rows the floors passed over: a walk over every key from each key's start and
///   the oldest unkeyed row below the floor (under a held snapshot, the walk over dead index
///   entries the claims no longer make), every `interval` or 10 x its duration. What it finds,
///   the claims take next.
pub(crate) async fn keep(d: Upkeep, interval: Duration, mut shutdown: Shutdown) {
    let start = tokio::time::Instant::now();
    let (mut next_raise, mut next_probe) = (start + Duration::from_secs(1), start + interval);
    loop {
        tokio::select! {
            _ = tokio::time::sleep_until(next_raise.min(next_probe)) => {},
            _ = shutdown.requested() => return,
        }
        if !d.schema.is_open() {
            // No outbox to walk on a schema behind this release (the gate says why).
            next_raise = tokio::time::Instant::now() + Duration::from_secs(1);
            continue;
        }
        let now = tokio::time::Instant::now();
        if now >= next_raise {
            if let Err(e) = settle(&d).await {
                tracing::warn!(error = %e, "Reading where the outbox is settled failed; the claims' floors stay where they are and it is tried again later.");
            } else if let Err(e) = raise_key_floor(&d).await {
                tracing::warn!(error = %e, "Raising the keyed claim floor failed; it is tried again later.");
            }
            next_raise = now + Duration::from_secs(1).max(now.elapsed() * 20);
        }
        let now = tokio::time::Instant::now();
        if now >= next_probe {
            match probe_floors(&d).await {
                Ok((unkeyed, keyed)) => {
                    for (kind, n) in [("unkeyed", unkeyed), ("keyed", keyed)] {
                        d.metrics
                            .floor_stragglers
                            .get_or_create(&vec![("kind", kind)])
                            .inc_by(n);
                    }
                    if unkeyed + keyed > 0 {
                        tracing::info!(
                            unkeyed,
                            keyed,
                            took_ms = now.elapsed().as_millis() as u64,
                            "The probe found rows below where the claims start (rows a vanished replica held, or rows written with a due time before their insert); the claims take them next."
                        );
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "The floor probe failed; it runs again later.")
                }
            }
            next_probe = now + interval.max(now.elapsed() * 10);
        }
        d.metrics
            .old_keys
            .set(i64::try_from(d.floors.old_keys()).unwrap_or(i64::MAX));
        if let Some(settled) = d.floors.settled() {
            d.metrics
                .floor_settled_age_seconds
                .set(settled.stamped.elapsed().as_secs_f64());
        }
    }
}

/// Walks every key, each chunk from the floor `floor_for` gives; returns everything seen and the
/// epoch the chunks read (`None`: they differed).
async fn walk_every_key(
    d: &Upkeep,
    floor_for: impl Fn(&KeyCursor) -> KeyFloor,
) -> Result<(Vec<SeenHead>, Option<i64>), outbox_shared::Error> {
    let mut cursor = KeyCursor::default();
    let mut all = Vec::new();
    let mut epoch: Option<Option<i64>> = None;
    loop {
        // In a claim transaction for its planner settings; it takes nothing.
        let mut tx = d.session.begin(&d.pool).await?;
        let walk = walk_keys(&mut tx, &cursor, WALK_KEYS, &floor_for(&cursor)).await?;
        let _ = tx.rollback().await;
        epoch = Some(match epoch {
            None => Some(walk.epoch),
            Some(e) => e.filter(|e| *e == walk.epoch),
        });
        all.extend(walk.seen);
        if walk.next_cursor == KeyCursor::default() {
            return Ok((all, epoch.flatten()));
        }
        cursor = walk.next_cursor;
    }
}

/// Stamps the outbox and learns which of the stamps waiting have settled (their writers all
/// ended): two statements, in a transaction that takes nothing (safe behind a transaction
/// pooler).
async fn settle(d: &Upkeep) -> Result<(), outbox_shared::Error> {
    let mut tx = d.pool.begin().await.map_err(outbox_shared::Error::begin)?;
    let stamp = settled::stamp(&mut tx).await?;
    if !stamp.exact {
        warn_caching_sequence();
    }
    let writers = d.floors.stamped(stamp);
    let running = settled::running(&mut tx, &writers).await?;
    let _ = tx.rollback().await;
    d.floors.settle(&running);
    Ok(())
}

/// Once per process: a sequence that caches ids per session proves no floor.
fn warn_caching_sequence() {
    static WARNED: std::sync::Once = std::sync::Once::new();
    WARNED.call_once(|| {
        tracing::warn!(
            "pubsub_outbox_id_seq caches ids per session (CACHE > 1): no id floor is provable, so the claims walk every key from its start (slower under a long-held snapshot). Set it back: ALTER SEQUENCE pubsub_outbox_id_seq CACHE 1."
        );
    });
}

/// Raises the keyed floor to the settled stamp, after a walk over every key begun after it
/// settled: the keys it saw below that become the old keys.
async fn raise_key_floor(d: &Upkeep) -> Result<(), outbox_shared::Error> {
    let Some(candidate) = d.floors.candidate() else {
        return Ok(());
    };
    let (seen, walked) = walk_every_key(d, |c| d.floors.key_floor(c, usize::MAX).0).await?;
    if walked == Some(candidate.0) {
        d.floors.raise(candidate, &seen, d.max_old_keys);
    }
    Ok(())
}

/// One probe: (unkeyed rows found below the floor: 0 or 1, keys found below the keyed floor).
async fn probe_floors(d: &Upkeep) -> Result<(u64, u64), outbox_shared::Error> {
    let mut unkeyed = 0;
    if let Some(floor) = d.floors.unkeyed().floor {
        // In a claim transaction (its planner settings); the row it finds is locked, then let go.
        let mut tx = d.session.begin(&d.pool).await?;
        let topics = d.topics.as_deref();
        let left_alone = (d.left_alone)();
        let below = probe::unkeyed_below(&mut tx, floor, Utc::now(), topics, &left_alone).await?;
        let _ = tx.rollback().await;
        if let Some(due) = below {
            d.floors.lower_unkeyed(due);
            unkeyed = 1;
        }
    }
    let (seen, epoch) = walk_every_key(d, |_| KeyFloor::default()).await?;
    let keyed = epoch.map_or(0, |e| d.floors.probed(e, &seen));
    Ok((unkeyed, keyed as u64))
}
