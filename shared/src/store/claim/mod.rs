//! Claiming due `pubsub_outbox` rows for publishing.
//!
//! Claim protocol: **row locks held in the claiming transaction** (see ARCHITECTURE.md). The
//! dispatcher opens a transaction, claims with `FOR UPDATE SKIP LOCKED`, publishes, settles every
//! row in the same transaction and commits. A dispatcher that dies at any instant drops its
//! connection; PostgreSQL rolls back and the rows are claimable again at once (a hung but connected
//! process is bounded by `idle_in_transaction_session_timeout`, set per dispatcher session).
//!
//! Two claims, because ordering needs a different unit of exclusion:
//! - [`claim_batch`]: rows **without** an ordering key, oldest due first; any worker may take any.
//! - [`claim_ordered`]: **keys**. A worker takes a (topic, ordering key) by locking its head row
//!   (lowest unpublished id) with `FOR UPDATE SKIP LOCKED`, then the rows behind it in id order,
//!   stopping at the first row that is not due. The batch is filled key by key in walk order, each
//!   key giving as many rows as the room left takes, so a key with a backlog goes out in requests
//!   of many messages (Pub/Sub takes one ordering key per request), and a batch of single-row keys
//!   holds as many keys as rows. So one key is only ever in one worker's hands, a
//!   key whose head waits for a retry (or sits in the dead-letter table) holds back only its own
//!   rows, and every other key flows. Keys are visited round-robin from a cursor, so a few busy or
//!   blocked keys cannot starve the rest. Row locks live in the tuples, not in PostgreSQL's shared
//!   lock table, so claiming thousands of keys cannot exhaust it (advisory locks per key could:
//!   20,000 in one transaction failed with "out of shared memory" on a stock server).
//!
//! **Plans that cannot collapse.** A queue table is often almost empty when autovacuum looks at
//! it: after a drain with one straggler at the end of the heap, VACUUM records thousands of pages
//! and one live row (`reltuples` = 1, and ~1 for every index), and the planner extrapolates that
//! density to a backlog of any size. It then believes every index lookup reads the whole index,
//! and chooses bitmap heap scans plus sorts: each step of the ordered claim's head walk read every
//! later key's rows (measured: 50,000 rows over 500 keys, 2,005,776 buffers and 14.3 s per claim,
//! against 7,765 buffers and 15 ms on fresh statistics) until autoanalyze ran again. So every
//! claim transaction starts with [`ClaimSession::begin`], which turns sequential scans, bitmap scans and sorts
//! off for that transaction only (`SET LOCAL`, in the `BEGIN` round trip; safe behind a
//! transaction-mode pooler), and JIT too (the disabled nodes' cost penalty would otherwise
//! trigger a ~0.9 s JIT compilation). The claims are written so that an index walk is always
//! possible without a sort, and no other index gives the order: the head walk and each key's rows
//! are range walks of the key index in `(topic, ordering_key, id)` order (with an equality on the
//! key, the primary key's id order would also do, as a scan of every row with a filter: on stale
//! statistics that is what the planner took, the indexes being ranked by size). Whatever the
//! statistics say, the plan is then the index walk: 50,000 rows over 500 keys, 10,909 buffers per
//! claim on stale statistics and on fresh ones alike.
//!
//! **Claims start past what is published.** A transaction that holds an old snapshot (a report,
//! a backup, an idle session) keeps every row deleted since visible to it, so neither vacuum nor
//! an index scan can retire their index entries, and a claim that walks from the queue's start
//! fetches each of them to learn it is dead: 10 minutes into a snapshot at 1,000 msgs/s, seconds
//! per claim. So a replica keeps where the live rows start, and its claims start there:
//! - unkeyed rows: a floor on `next_attempt_at` (the index scan's start), the earlier of the
//!   oldest due time the last claim took and the settled instant it knew, less a cushion
//!   (`--claim-floor-margin`); back to a batch's rows when it gives them back (an outage) or
//!   fails; a resume (a paused topic's rows become claimable below it) advances the claim epoch;
//! - keys ([`KeyFloor`]): an id floor below which every live row belongs to a few "old" keys
//!   whose heads are known (a key waiting for a retry, held by a dead letter, paused, backed up).
//!   The walk checks `id >= floor` on each index entry before fetching its row, so it passes over
//!   the published rows' entries in the index, and looks for an old key's head from its last
//!   one. The floor is raised by a walk that saw every key (`walk_keys`, off the claim path) to a
//!   settled id, with the keys it saw with a lower head as the old keys. A replay puts a row back
//!   below its key's head: it advances the claim epoch in its transaction, and a floor of another
//!   epoch is not used.
//!
//! **A floor never passes a row that may still commit** ([`settled`]): it rises only to an id and
//! an instant stamped while the outbox's writer transactions were listed, once all of them have
//! ended. So a key's head is always its lowest unpublished row, however long a writer keeps its
//! transaction open, and two replicas lock different heads of one key only for rows of
//! transactions open at the same time (whose order is not promised: docs/dispatcher.md, "Order").
//! Rows no mark can know of (rows a vanished replica held, rows written with an explicit due
//! time before their insert) are found by a probe that walks from the start off the claim path
//! ([`probe`]), every `--claim-probe-interval`.

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgPool, Postgres, Transaction};

use crate::error::{DbContext, Result};
use crate::message::ClaimedMessage;
use crate::store::outbox::MessageRow;

mod ordered;
pub mod probe;
pub mod settled;

pub use ordered::{
    KeyCursor, KeyFloor, OrderedBatch, OrderedClaim, SeenHead, claim_ordered, publishable_prefixes,
    walk_keys,
};

/// How a claim transaction begins: its `BEGIN` and the settings it needs, scoped to the
/// transaction (`SET LOCAL`, sent in the `BEGIN` round trip), so they hold on any session, also
/// one a transaction-mode pooler hands out:
/// - the planner settings of the module doc ("Plans that cannot collapse");
/// - `synchronous_commit = off`: a lost settle only re-publishes (consumers dedupe), and not
///   waiting for the WAL flush makes 1.2-2.3x more batches per second at small batch sizes;
/// - `idle_in_transaction_session_timeout`: a claim left idle this long belongs to a hung
///   dispatcher; the server ends it and the rows are claimable again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimSession {
    begin: String,
}

impl ClaimSession {
    /// Claim transactions ended by the server after `idle_timeout` without a statement.
    pub fn new(idle_timeout: std::time::Duration) -> Self {
        Self {
            begin: format!(
                "BEGIN; SET LOCAL synchronous_commit = off; \
                 SET LOCAL idle_in_transaction_session_timeout = {}; \
                 SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off; \
                 SET LOCAL enable_sort = off; SET LOCAL jit = off",
                idle_timeout.as_millis().max(1)
            ),
        }
    }

    /// Starts a claim transaction on a connection of `pool` (one round trip, like a plain
    /// `BEGIN`). Claim, publish and settle in it, then commit.
    pub async fn begin(&self, pool: &PgPool) -> Result<Transaction<'static, Postgres>> {
        pool.begin_with(self.begin.clone())
            .await
            .context("starting a claim transaction")
    }
}

/// Which rows a claim may take.
#[derive(Debug, Clone)]
pub struct ClaimFilter<'a> {
    /// Rows due at or before this instant.
    pub now: DateTime<Utc>,
    /// At most this many rows.
    pub limit: i64,
    /// Only these full topic names (None: every topic).
    pub topics: Option<&'a [String]>,
    /// Not these: the topics this replica leaves alone now (held because Pub/Sub refuses them,
    /// or slowed down by quota). Usually empty.
    pub excluded: &'a [String],
}

// Paused topics (see [`super::pause`]) are skipped by reading the pause table in the claim
// statement itself, as an array computed once per statement (`ARRAY(SELECT …)`, an init plan;
// not a join: an anti-join made the planner expect one row and sort the whole outbox). So a
// pause is in force once its transaction commits: a claim whose snapshot is older cannot see
// rows committed after the pause either.

/// What [`claim_batch`] took.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UnkeyedBatch {
    /// The rows, in id order.
    pub messages: Vec<ClaimedMessage>,
    /// The oldest due time among them (the next claims' floor follows it).
    pub oldest_due: Option<DateTime<Utc>>,
    /// The claim epoch the claim read (none when it took nothing).
    pub epoch: Option<i64>,
}

/// Locks and returns up to `filter.limit` due rows **without an ordering key**, oldest due first,
/// from `floor` on (none: from the start; see the module doc) unless the claim epoch is no longer
/// `epoch`, skipping rows other workers hold. Run inside a transaction kept open until they are
/// settled.
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn claim_batch(
    conn: &mut PgConnection,
    filter: &ClaimFilter<'_>,
    floor: Option<DateTime<Utc>>,
    epoch: i64,
) -> Result<UnkeyedBatch> {
    #[derive(sqlx::FromRow)]
    struct Row {
        #[sqlx(flatten)]
        message: MessageRow,
        next_attempt_at: DateTime<Utc>,
        epoch: i64,
    }
    // A materialized CTE bounds the locking to exactly `limit` rows and keeps a safe plan even
    // when the plan cache switches to a generic plan; `id IN (SELECT … LIMIT … SKIP LOCKED)`
    // inlined into the outer query can lock more rows than it returns and seq-scans generically.
    // The CTE returns the columns of the rows it locked (FOR UPDATE returns the locked, rechecked
    // version), so no second lookup by primary key is needed. The floor is a plain bound
    // (COALESCE, not `IS NULL OR`), so a generic plan keeps it as the index scan's start.
    let rows: Vec<Row> = sqlx::query_as(
        "WITH claimed AS MATERIALIZED (
             SELECT id, topic, ordering_key, dedupe_key, payload, attributes, traceparent,
                    tracestate, attempts, created_at, next_attempt_at
             FROM pubsub_outbox
             WHERE published_at IS NULL AND ordering_key IS NULL
               AND next_attempt_at <= $1
               AND next_attempt_at >= COALESCE(CASE WHEN (SELECT e.epoch FROM pubsub_outbox_claim_epoch e) = $5
                                                    THEN $4::timestamptz END, '-infinity')
               AND ($3::text[] IS NULL OR topic = ANY($3))
               AND NOT (topic = ANY(ARRAY(SELECT p.topic FROM pubsub_outbox_paused_topic p)))
               AND NOT (topic = ANY($6))
             ORDER BY next_attempt_at, id
             LIMIT $2
             FOR UPDATE SKIP LOCKED)
         SELECT id, topic, ordering_key, dedupe_key, payload, attributes, traceparent, tracestate,
                attempts, created_at, next_attempt_at,
                (SELECT e.epoch FROM pubsub_outbox_claim_epoch e) AS epoch
         FROM claimed
         ORDER BY id",
    )
    .persistent(crate::store::named_statements())
    .bind(filter.now)
    .bind(filter.limit)
    .bind(filter.topics)
    .bind(floor)
    .bind(epoch)
    .bind(filter.excluded)
    .fetch_all(&mut *conn)
    .await
    .context("claiming due rows from pubsub_outbox")?;
    let oldest_due = rows.iter().map(|r| r.next_attempt_at).min();
    let epoch = rows.first().map(|r| r.epoch);
    Ok(UnkeyedBatch {
        epoch,
        messages: rows
            .into_iter()
            .map(|r| ClaimedMessage::from(r.message))
            .collect(),
        oldest_due,
    })
}
