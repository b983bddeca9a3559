//! The ordered claim ([`claim_ordered`]): whole ordering keys, a publishable prefix of each,
//! walking keys round-robin from a cursor and from the heads this replica already knows (the
//! parent module's doc says why, and its statement in `sql/claim_ordered.sql` how).

use chrono::{DateTime, Utc};
use sqlx::PgConnection;

use super::ClaimFilter;
use crate::error::{DbContext, Result};
use crate::message::{Attributes, ClaimedMessage};
use crate::trace::TraceContext;

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
    /// Pick (lock the heads of) at most this many keys; the batch is filled key by key in walk
    /// order, each key giving as many of its rows as the room left takes, so the keys picked
    /// after the room ran out give nothing this time.
    pub max_keys: i64,
}

/// Where a replica knows the live keyed rows start: every live row with an id below `floor`
/// belongs to one of the old keys, each given with the head (lowest id) it last had; gathered in
/// claim epoch `epoch` (the parent module's doc). The default knows nothing: the walk fetches
/// every index entry from each key's start.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeyFloor {
    /// Ids below this belong to the old keys or are published.
    pub floor: i64,
    /// The old keys' topics.
    pub topics: Vec<String>,
    /// The old keys' ordering keys.
    pub keys: Vec<String>,
    /// The old keys' last heads.
    pub heads: Vec<i64>,
    /// The epoch this was gathered in.
    pub epoch: i64,
}

/// A key a claim visited and the head it had there (`None`: no row left).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeenHead {
    /// The key's topic.
    pub topic: String,
    /// The ordering key.
    pub ordering_key: String,
    /// Its lowest unpublished id, if any.
    pub head: Option<i64>,
}

/// What [`claim_ordered`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OrderedBatch {
    /// Claimed rows, grouped by key, each key in id order.
    pub messages: Vec<ClaimedMessage>,
    /// Where the next claim should resume.
    pub next_cursor: KeyCursor,
    /// Keys that gave rows.
    pub keys: usize,
    /// Keys picked (their heads locked), some of which may have given nothing: the room ran out
    /// first.
    pub picked_keys: usize,
    /// Whether the rows filled the room (the row limit), rather than the keys running out.
    pub filled: bool,
    /// Every key the walk visited, with the head it had (for the next claims' floor).
    pub seen: Vec<SeenHead>,
    /// The claim epoch the walk read (another than the floor's: the floor was not used).
    pub epoch: i64,
}

#[derive(sqlx::FromRow)]
struct KeyedRow {
    /// Where the walk stopped (the next claim resumes after it) and how many keys it visited.
    last_topic: Option<String>,
    last_key: Option<String>,
    visited: Option<i64>,
    picked_keys: Option<i64>,
    filled_rows: Option<bool>,
    /// The keys visited and their heads, and the claim epoch (on the walk's row only).
    seen_topics: Option<Vec<String>>,
    seen_keys: Option<Vec<String>>,
    seen_heads: Option<Vec<Option<i64>>>,
    epoch: Option<i64>,
    /// A claimed row; all NULL when no key was picked.
    id: Option<i64>,
    topic: Option<String>,
    ordering_key: Option<String>,
    dedupe_key: Option<String>,
    payload: Option<Vec<u8>>,
    attributes: Option<sqlx::types::Json<Attributes>>,
    traceparent: Option<String>,
    tracestate: Option<String>,
    attempts: Option<i32>,
    created_at: Option<DateTime<Utc>>,
    next_attempt_at: Option<DateTime<Utc>>,
}

/// What the walk's row reports.
#[derive(Debug, Default)]
struct WalkReport {
    visited: i64,
    picked_keys: i64,
    filled: bool,
    last: Option<(String, String)>,
    seen: Vec<SeenHead>,
    epoch: Option<i64>,
}

impl KeyedRow {
    /// The walk's report, from the walk's row (the one that carries `visited`).
    fn report(&mut self) -> Option<WalkReport> {
        let visited = self.visited?;
        let seen = match (
            self.seen_topics.take(),
            self.seen_keys.take(),
            self.seen_heads.take(),
        ) {
            (Some(topics), Some(keys), Some(heads)) => topics
                .into_iter()
                .zip(keys)
                .zip(heads)
                .map(|((topic, ordering_key), head)| SeenHead {
                    topic,
                    ordering_key,
                    head,
                })
                .collect(),
            _ => Vec::new(),
        };
        Some(WalkReport {
            visited,
            picked_keys: self.picked_keys.unwrap_or(0),
            filled: self.filled_rows.unwrap_or(false),
            last: self.last_topic.take().zip(self.last_key.take()),
            seen,
            epoch: self.epoch,
        })
    }

    /// The claimed message and when it is due, unless this is the walk's row alone.
    fn claimed(self) -> Option<(ClaimedMessage, DateTime<Utc>)> {
        let message = ClaimedMessage {
            id: self.id?,
            topic: self.topic?,
            ordering_key: self.ordering_key,
            dedupe_key: self.dedupe_key?,
            payload: self.payload?.into(),
            attributes: self.attributes?.0,
            trace_context: self.traceparent.map(|traceparent| TraceContext {
                traceparent,
                tracestate: self.tracestate,
            }),
            attempts: self.attempts?,
            created_at: self.created_at?,
        };
        Some((message, self.next_attempt_at?))
    }
}

/// The ordered claim's statement (its steps are commented in the file).
const CLAIM_ORDERED: &str = include_str!("../sql/claim_ordered.sql");

/// Claims whole ordering keys (see the module doc) and returns the publishable prefix of each:
/// its rows from the head in id order, up to the first row not yet due, as many as the room
/// left takes, key after key in walk order (so a key with a backlog fills requests).
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn claim_ordered(
    conn: &mut PgConnection,
    claim: &OrderedClaim<'_>,
    cursor: &KeyCursor,
    floor: &KeyFloor,
) -> Result<OrderedBatch> {
    let max_keys = claim.max_keys.clamp(1, claim.filter.limit.max(1));
    walk(conn, claim, cursor, floor, max_keys).await
}

/// The ordered claim's walk alone: up to `scan_limit` keys from `cursor` and the head each has,
/// taking none (the floor probe's walk, `crate::store::claim::probe`).
pub async fn walk_keys(
    conn: &mut PgConnection,
    cursor: &KeyCursor,
    scan_limit: i64,
    floor: &KeyFloor,
) -> Result<OrderedBatch> {
    let walk_only = OrderedClaim {
        filter: ClaimFilter {
            now: Utc::now(),
            limit: 1,
            topics: None,
            excluded: &[],
        },
        scan_limit,
        skip_dead_letter_topics: &[],
        max_keys: 0,
    };
    walk(conn, &walk_only, cursor, floor, 0).await
}

async fn walk(
    conn: &mut PgConnection,
    claim: &OrderedClaim<'_>,
    cursor: &KeyCursor,
    floor: &KeyFloor,
    max_keys: i64,
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
        .bind(max_keys)
        .bind(&floor.topics)
        .bind(&floor.keys)
        .bind(&floor.heads)
        .bind(floor.epoch)
        .bind(floor.floor)
        .bind(f.excluded)
        .fetch_all(&mut *conn)
        .await
        .context("claiming ordering keys from pubsub_outbox")?;

    let mut report = WalkReport::default();
    let mut found = Vec::new();
    for mut row in rows {
        if let Some(r) = row.report() {
            report = r;
        }
        // The walk's row has no claimed row in it.
        if let Some(claimed) = row.claimed() {
            found.push(claimed);
        }
    }
    let messages = publishable_prefixes(found, f.now);
    let next_cursor = match report.last {
        Some((topic, ordering_key)) if report.visited >= claim.scan_limit => KeyCursor {
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
        keys,
        picked_keys: usize::try_from(report.picked_keys).unwrap_or(0),
        filled: report.filled,
        seen: report.seen,
        epoch: report.epoch.unwrap_or(floor.epoch),
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
            payload: bytes::Bytes::new(),
            attributes: Attributes::new(),
            trace_context: None,
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
    fn keys_are_counted_once_each() {
        assert_eq!(count_keys(&[msg(1, "a"), msg(2, "a"), msg(3, "b")]), 2);
    }
}
