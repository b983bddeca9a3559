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
//!   stopping at the first row that is not due. So one key is only ever in one worker's hands, a
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

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgPool, Postgres, Transaction};

use crate::error::{DbContext, Result};
use crate::message::{Attributes, ClaimedMessage};
use crate::store::outbox::MessageRow;

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
}

// Paused topics (see [`super::pause`]) are skipped by reading the pause table in the claim
// statement itself, as an array computed once per statement (`ARRAY(SELECT …)`, an init plan;
// not a join: an anti-join made the planner expect one row and sort the whole outbox). So a
// pause is in force once its transaction commits: a claim whose snapshot is older cannot see
// rows committed after the pause either.

/// Locks and returns up to `filter.limit` due rows **without an ordering key**, oldest due first,
/// skipping rows other workers hold. Run inside a transaction kept open until they are settled.
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn claim_batch(
    conn: &mut PgConnection,
    filter: &ClaimFilter<'_>,
) -> Result<Vec<ClaimedMessage>> {
    // A materialized CTE bounds the locking to exactly `limit` rows and keeps a safe plan even
    // when the plan cache switches to a generic plan; `id IN (SELECT … LIMIT … SKIP LOCKED)`
    // inlined into the outer query can lock more rows than it returns and seq-scans generically.
    // The CTE returns the columns of the rows it locked (FOR UPDATE returns the locked, rechecked
    // version), so no second lookup by primary key is needed.
    let rows: Vec<MessageRow> = sqlx::query_as(
        "WITH claimed AS MATERIALIZED (
             SELECT id, topic, ordering_key, dedupe_key, payload, attributes, attempts, created_at
             FROM pubsub_outbox
             WHERE published_at IS NULL AND ordering_key IS NULL
               AND next_attempt_at <= $1
               AND ($3::text[] IS NULL OR topic = ANY($3))
               AND NOT (topic = ANY(ARRAY(SELECT p.topic FROM pubsub_outbox_paused_topic p)))
             ORDER BY next_attempt_at, id
             LIMIT $2
             FOR UPDATE SKIP LOCKED)
         SELECT id, topic, ordering_key, dedupe_key, payload, attributes, attempts, created_at
         FROM claimed
         ORDER BY id",
    )
    .persistent(crate::store::named_statements())
    .bind(filter.now)
    .bind(filter.limit)
    .bind(filter.topics)
    .fetch_all(&mut *conn)
    .await
    .context("claiming due rows from pubsub_outbox")?;
    Ok(rows.into_iter().map(ClaimedMessage::from).collect())
}

/// Where the round-robin walk over ordering keys resumes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeyCursor {
    /// Last key visited: topic.
    pub topic: String,
    /// Last key visited: ordering key.
    pub ordering_key: String,
}

/// How an ordered claim walks keys.
#[derive(Debug, Clone)]
pub struct OrderedClaim<'a> {
    /// Due time, row limit and topic filter.
    pub filter: ClaimFilter<'a>,
    /// Visit at most this many keys (heads) per claim.
    pub scan_limit: i64,
    /// Topics whose keys skip dead-lettered messages instead of blocking behind them.
    pub skip_dead_letter_topics: &'a [String],
    /// Take at most this many keys; the row limit is shared evenly among the keys taken.
    pub max_keys: i64,
}

/// What [`claim_ordered`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OrderedBatch {
    /// Claimed rows, grouped by key, each key in id order.
    pub messages: Vec<ClaimedMessage>,
    /// Where the next claim should resume.
    pub next_cursor: KeyCursor,
    /// Keys taken.
    pub keys: usize,
    /// Keys that had more rows than their share of the row limit (fewer keys per claim would
    /// have filled the batch with fewer publish requests).
    pub saturated_keys: usize,
}

#[derive(sqlx::FromRow)]
struct KeyedRow {
    /// Where the walk stopped (the next claim resumes after it) and how many keys it visited.
    last_topic: Option<String>,
    last_key: Option<String>,
    visited: i64,
    /// A claimed row; all NULL when no key was picked.
    id: Option<i64>,
    topic: Option<String>,
    ordering_key: Option<String>,
    dedupe_key: Option<String>,
    payload: Option<Vec<u8>>,
    attributes: Option<sqlx::types::Json<Attributes>>,
    attempts: Option<i32>,
    created_at: Option<DateTime<Utc>>,
    next_attempt_at: Option<DateTime<Utc>>,
}

impl KeyedRow {
    /// The claimed message and when it is due, unless this is the walk's row alone.
    fn claimed(self) -> Option<(ClaimedMessage, DateTime<Utc>)> {
        let message = ClaimedMessage {
            id: self.id?,
            topic: self.topic?,
            ordering_key: self.ordering_key,
            dedupe_key: self.dedupe_key?,
            payload: self.payload?,
            attributes: self.attributes?.0,
            attempts: self.attempts?,
            created_at: self.created_at?,
        };
        Some((message, self.next_attempt_at?))
    }
}

/// The ordered claim's statement (its steps are commented in the file).
const CLAIM_ORDERED: &str = include_str!("sql/claim_ordered.sql");

/// Claims whole ordering keys (see the module doc) and returns the publishable prefix of each:
/// its rows from the head in id order, up to the first row not yet due.
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn claim_ordered(
    conn: &mut PgConnection,
    claim: &OrderedClaim<'_>,
    cursor: &KeyCursor,
) -> Result<OrderedBatch> {
    let f = &claim.filter;
    // The statement and its steps: sql/claim_ordered.sql.
    let rows: Vec<KeyedRow> = sqlx::query_as(CLAIM_ORDERED)
        .persistent(crate::store::named_statements())
        .bind(&cursor.topic)
        .bind(&cursor.ordering_key)
        .bind(claim.scan_limit)
        .bind(f.now)
        .bind(f.topics)
        .bind(claim.skip_dead_letter_topics)
        .bind(f.limit)
        .bind(claim.max_keys.clamp(1, f.limit.max(1)))
        .fetch_all(&mut *conn)
        .await
        .context("claiming ordering keys from pubsub_outbox")?;

    let mut scanned = 0;
    let mut last: Option<(String, String)> = None;
    let mut found = Vec::new();
    for mut row in rows {
        scanned = row.visited;
        if let (Some(t), Some(k)) = (row.last_topic.take(), row.last_key.take()) {
            last = Some((t, k));
        }
        // The LEFT JOIN yields one all-NULL row when no key was picked.
        if let Some(claimed) = row.claimed() {
            found.push(claimed);
        }
    }
    let (found, saturated_keys) = truncate_shares(found, f.limit);
    let messages = publishable_prefixes(found, f.now);
    let next_cursor = match last {
        Some((topic, ordering_key)) if scanned >= claim.scan_limit => KeyCursor {
            topic,
            ordering_key,
        },
        // The walk reached the last key: start again from the first.
        _ => KeyCursor::default(),
    };
    let keys = count_keys(&messages);
    Ok(OrderedBatch {
        messages,
        next_cursor,
        saturated_keys,
        keys,
    })
}

/// Keeps, for each key, its rows from the head in id order up to (not including) the first row
/// that is not due: a message may only go out once every earlier message of its key has.
/// `rows` must be grouped by key with each key in id order (as the claim returns them).
pub fn publishable_prefixes(
    rows: Vec<(ClaimedMessage, DateTime<Utc>)>,
    now: DateTime<Utc>,
) -> Vec<ClaimedMessage> {
    let mut out = Vec::with_capacity(rows.len());
    let mut blocked: Option<(String, Option<String>)> = None;
    for (message, due) in rows {
        let key = (message.topic.clone(), message.ordering_key.clone());
        if blocked.as_ref() == Some(&key) {
            continue;
        }
        if due > now {
            blocked = Some(key);
            continue;
        }
        out.push(message);
    }
    out
}

/// Cuts each key to its share of the row limit (`limit / keys`, as the claim computed it) and
/// counts the keys that had more rows than that (the claim fetched one extra row to tell).
fn truncate_shares(
    found: Vec<(ClaimedMessage, DateTime<Utc>)>,
    limit: i64,
) -> (Vec<(ClaimedMessage, DateTime<Utc>)>, usize) {
    let mut keys: Vec<(String, Option<String>)> = found
        .iter()
        .map(|(m, _)| (m.topic.clone(), m.ordering_key.clone()))
        .collect();
    keys.dedup();
    let share = (usize::try_from(limit).unwrap_or(1) / keys.len().max(1)).max(1);
    let mut out = Vec::with_capacity(found.len());
    let mut saturated = 0;
    let mut taken = 0;
    let mut last: Option<(String, Option<String>)> = None;
    for (m, due) in found {
        let key = (m.topic.clone(), m.ordering_key.clone());
        if last.as_ref() != Some(&key) {
            last = Some(key);
            taken = 0;
        }
        taken += 1;
        if taken == share + 1 {
            saturated += 1;
        }
        if taken <= share {
            out.push((m, due));
        }
    }
    (out, saturated)
}

fn count_keys(messages: &[ClaimedMessage]) -> usize {
    let mut keys: Vec<(&str, Option<&str>)> = messages
        .iter()
        .map(|m| (m.topic.as_str(), m.ordering_key.as_deref()))
        .collect();
    keys.dedup();
    keys.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(id: i64, key: &str) -> ClaimedMessage {
        ClaimedMessage {
            id,
            topic: "projects/p/topics/t".into(),
            ordering_key: Some(key.into()),
            dedupe_key: format!("d{id}"),
            payload: vec![],
            attributes: Attributes::new(),
            attempts: 0,
            created_at: Utc::now(),
        }
    }

    #[test]
    fn a_key_stops_at_its_first_row_that_is_not_due() {
        let now = Utc::now();
        let later = now + chrono::Duration::seconds(30);
        let rows = vec![
            (msg(1, "a"), now),
            (msg(2, "a"), later),
            (msg(3, "a"), now),
            (msg(4, "b"), later),
            (msg(5, "b"), now),
            (msg(6, "c"), now),
            (msg(7, "c"), now),
        ];
        let ids: Vec<i64> = publishable_prefixes(rows, now)
            .iter()
            .map(|m| m.id)
            .collect();
        assert_eq!(
            ids,
            vec![1, 6, 7],
            "a stops before 2, b is blocked at its head, c flows"
        );
    }

    #[test]
    fn shares_are_cut_and_keys_with_more_rows_are_counted() {
        let now = Utc::now();
        let rows = vec![
            (msg(1, "a"), now),
            (msg(2, "a"), now),
            (msg(3, "a"), now),
            (msg(4, "b"), now),
        ];
        // limit 4 over 2 keys: share 2; "a" brought a third row, so it has more.
        let (kept, saturated) = truncate_shares(rows, 4);
        let ids: Vec<i64> = kept.iter().map(|(m, _)| m.id).collect();
        assert_eq!(ids, vec![1, 2, 4]);
        assert_eq!(saturated, 1);
    }

    #[test]
    fn keys_are_counted_once_each() {
        assert_eq!(count_keys(&[msg(1, "a"), msg(2, "a"), msg(3, "b")]), 2);
    }
}
