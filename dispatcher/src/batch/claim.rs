//! The batch's first step: its claim. A claim transaction (`ClaimSession`: the planner settings
//! that keep the plans from collapsing) locks whole ordering keys first, then fills the batch with
//! unkeyed rows (`outbox_shared::store::claim` says how). Serving, each claim starts where this
//! replica knows the live rows start (`crate::floors`), takes as many keys as the backlog's shape
//! calls for (`crate::batch::dispatch::KeyWalk`) and leaves alone the topics held or slowed down by
//! quota. The rows stay locked until the batch commits.

use std::time::Instant;

use chrono::{DateTime, Utc};
use outbox_shared::ClaimedMessage;
use outbox_shared::store::claim::{
    self, ClaimFilter, KeyCursor, KeyFloor, OrderedBatch, OrderedClaim,
};
use sqlx::{PgConnection, Postgres, Transaction};
use tracing::Instrument as _;

use crate::batch::dispatch::{Dispatch, InFlight};
use crate::error::DispatcherError;
use crate::pubsub::publish::Publish;

/// Which rows a batch claims.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scope<'a> {
    /// Everything this replica serves, except the topics it leaves alone now (held, or slowed
    /// down by quota), from where it knows the live rows start.
    Serve,
    /// One row of a held topic, its head (a key's first row, or its oldest unkeyed row): the
    /// probe of `crate::refusals::hold`, from the outbox's start.
    Probe(&'a str),
}

/// A claimed batch: its transaction (the rows stay locked in it until the batch commits) and
/// its rows, counted as in flight until it is dropped.
pub(crate) struct Claimed<'d> {
    pub(crate) tx: Transaction<'static, Postgres>,
    pub(crate) messages: Vec<ClaimedMessage>,
    pub(crate) give_back: GiveBack<'d>,
    pub(crate) in_flight: InFlight<'d>,
}

/// Claims the rows of `scope` due at `now` in a claim transaction of its own; `None` when
/// nothing was due (the transaction ended). The claim is a span (`claim`) of the batch's.
pub(crate) async fn claim<'d, P: Publish>(
    d: &'d Dispatch<P>,
    now: DateTime<Utc>,
    scope: Scope<'_>,
) -> Result<Option<Claimed<'d>>, DispatcherError> {
    let started = Instant::now();
    let claiming = tracing::info_span!("claim", db.system = "postgresql");
    let mut tx = d
        .claim_session
        .begin(&d.pool)
        .instrument(claiming.clone())
        .await?;
    let (messages, give_back) = take(d, &mut tx, now, scope).instrument(claiming).await?;
    d.metrics
        .claim_seconds
        .observe(started.elapsed().as_secs_f64());
    if messages.is_empty() {
        // Nothing locked, nothing written: ending the transaction either way is the same.
        let _ = tx.rollback().await;
        return Ok(None);
    }
    tracing::Span::current().record("batch.size", messages.len());
    d.metrics.batch_size.observe(messages.len() as f64);
    Ok(Some(Claimed {
        in_flight: d.hold(messages.len()),
        tx,
        messages,
        give_back,
    }))
}

/// Claims ordering keys first (whole keys, in id order), then fills the batch with unkeyed rows.
/// Serving, each claim starts from where this replica knows the live rows start
/// (`crate::floors`) and leaves alone the topics held or slowed down; the unkeyed floor follows
/// the rows taken, and goes back to them unless the batch settles them ([`GiveBack`]). A probe
/// takes one row of its topic from the outbox's start, and teaches the floors nothing.
async fn take<'d, P: Publish>(
    d: &'d Dispatch<P>,
    tx: &mut PgConnection,
    now: DateTime<Utc>,
    scope: Scope<'_>,
) -> Result<(Vec<ClaimedMessage>, GiveBack<'d>), DispatcherError> {
    let mut give_back = GiveBack {
        floors: &d.floors,
        oldest: None,
    };
    let probed: [String; 1];
    let (filter, cursor, max_keys, excluded) = match scope {
        Scope::Serve => {
            let (cursor, max_keys) = d.keys.next();
            let filter = ClaimFilter {
                now,
                limit: d.settings.batch_size,
                topics: d.settings.topics.as_deref(),
                excluded: &[],
            };
            (filter, cursor, max_keys, d.left_alone())
        }
        Scope::Probe(topic) => {
            probed = [topic.to_owned()];
            let filter = ClaimFilter {
                now,
                limit: 1,
                topics: Some(&probed),
                excluded: &[],
            };
            let cursor = KeyCursor {
                topic: topic.to_owned(),
                ordering_key: String::new(),
            };
            (filter, cursor, 1, Vec::new())
        }
    };
    let filter = ClaimFilter {
        excluded: &excluded,
        ..filter
    };
    let ordered = OrderedClaim {
        filter: filter.clone(),
        scan_limit: d.settings.key_scan_limit,
        skip_dead_letter_topics: &d.settings.skip_dead_letter_topics,
        max_keys,
    };
    let serving = scope == Scope::Serve;
    let keyed = take_keys(d, tx, &ordered, cursor, serving).await?;
    let mut claimed = keyed.messages;
    let room = filter.limit - claimed.len() as i64;
    if room > 0 {
        let unkeyed = ClaimFilter {
            limit: room,
            ..filter
        };
        let start = serving.then(|| d.floors.unkeyed());
        let (floor, epoch) = start.map_or((None, 0), |s| (s.floor, s.epoch));
        let batch = claim::claim_batch(tx, &unkeyed, floor, epoch).await?;
        if let (Some(start), Some(oldest), Some(epoch)) = (start, batch.oldest_due, batch.epoch) {
            d.floors.took_unkeyed(start, epoch, oldest);
            give_back.oldest = Some(oldest);
        }
        claimed.extend(batch.messages);
    }
    Ok((claimed, give_back))
}

/// The keyed part of a claim: whole keys from `cursor` (serving: from the floors, and the key
/// walk learns from it; a probe: from the outbox's start).
async fn take_keys<P: Publish>(
    d: &Dispatch<P>,
    tx: &mut PgConnection,
    ordered: &OrderedClaim<'_>,
    cursor: KeyCursor,
    serving: bool,
) -> Result<OrderedBatch, DispatcherError> {
    let scan = usize::try_from(ordered.scan_limit).unwrap_or(usize::MAX);
    let (floor, mut generation) = if serving {
        d.floors.key_floor(&cursor, scan)
    } else {
        (KeyFloor::default(), 0)
    };
    let mut keyed = claim::claim_ordered(tx, ordered, &cursor, &floor).await?;
    if serving
        && keyed.messages.is_empty()
        && keyed.next_cursor == KeyCursor::default()
        && cursor != KeyCursor::default()
    {
        // The walk began after the first keys and reached the end taking nothing: the keys
        // before the cursor come next (a hot key that filled the last batch is one of them).
        d.floors.saw(keyed.epoch, generation, &keyed.seen);
        let start = KeyCursor::default();
        let floor;
        (floor, generation) = d.floors.key_floor(&start, scan);
        keyed = claim::claim_ordered(tx, ordered, &start, &floor).await?;
    }
    if serving {
        d.floors.saw(keyed.epoch, generation, &keyed.seen);
        d.keys
            .learn(&keyed, ordered.max_keys, keyed.next_cursor.clone());
    }
    Ok(keyed)
}

/// The unkeyed rows of a batch go back to the queue at their place unless the batch settles
/// them: dropped on every early return (an error, the transaction rolling back) or kept armed
/// after a batch that released some of them, it puts the unkeyed floor back to the oldest.
pub(crate) struct GiveBack<'d> {
    floors: &'d crate::floors::Floors,
    oldest: Option<DateTime<Utc>>,
}

impl GiveBack<'_> {
    /// The batch committed: its unkeyed rows were settled unless `released` holds one of them.
    pub(crate) fn settled(mut self, claimed: &[ClaimedMessage], released: &[i64]) {
        let gave_back = claimed
            .iter()
            .any(|m| m.ordering_key.is_none() && released.contains(&m.id));
        if !gave_back {
            self.oldest = None;
        }
    }
}

impl Drop for GiveBack<'_> {
    fn drop(&mut self) {
        if let Some(oldest) = self.oldest {
            self.floors.lower_unkeyed(oldest);
        }
    }
}
