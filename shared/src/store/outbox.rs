//! `pubsub_outbox`: enqueue, settle (published / retry), purge, backlog figures. Claiming lives in
//! [`super::claim`].

use chrono::{DateTime, Utc};
use sqlx::PgConnection;

use crate::error::{DbContext, Result};
use crate::message::{Attributes, ClaimedMessage, NewMessage};
use crate::trace::TraceContext;

/// The message columns of an outbox row, as claims and reads select them.
#[derive(Debug, sqlx::FromRow)]
pub(crate) struct MessageRow {
    id: i64,
    topic: String,
    ordering_key: Option<String>,
    dedupe_key: String,
    payload: Vec<u8>,
    attributes: sqlx::types::Json<Attributes>,
    traceparent: Option<String>,
    tracestate: Option<String>,
    attempts: i32,
    created_at: DateTime<Utc>,
}

impl From<MessageRow> for ClaimedMessage {
    fn from(r: MessageRow) -> Self {
        ClaimedMessage {
            id: r.id,
            topic: r.topic,
            ordering_key: r.ordering_key,
            dedupe_key: r.dedupe_key,
            payload: r.payload.into(),
            attributes: r.attributes.0,
            trace_context: r.traceparent.map(|traceparent| TraceContext {
                traceparent,
                tracestate: r.tracestate,
            }),
            attempts: r.attempts,
            created_at: r.created_at,
        }
    }
}

/// What [`enqueue_batch`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EnqueueOutcome {
    /// Rows inserted.
    pub inserted: u64,
    /// Rows skipped because their dedupe key was already in the outbox.
    pub duplicates: u64,
}

/// Inserts `messages` in one statement; a dedupe key already present is skipped, never duplicated.
///
/// Runs on the caller's connection or transaction: enqueue in the same transaction as the business
/// change (that is the point of an outbox), then call [`super::notify::notify`] once before commit.
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn enqueue_batch(
    conn: &mut PgConnection,
    messages: &[NewMessage],
) -> Result<EnqueueOutcome> {
    if messages.is_empty() {
        return Ok(EnqueueOutcome::default());
    }
    let mut topics = Vec::with_capacity(messages.len());
    let mut keys = Vec::with_capacity(messages.len());
    let mut dedupe = Vec::with_capacity(messages.len());
    let mut payloads = Vec::with_capacity(messages.len());
    let mut attributes = Vec::with_capacity(messages.len());
    let mut parents = Vec::with_capacity(messages.len());
    let mut states = Vec::with_capacity(messages.len());
    for m in messages {
        topics.push(m.topic.as_str());
        keys.push(m.ordering_key.as_deref());
        dedupe.push(m.dedupe_key.as_str());
        payloads.push(m.payload.as_slice());
        attributes.push(serde_json::to_string(&m.attributes).unwrap_or_else(|_| "{}".to_owned()));
        parents.push(m.trace_context.as_ref().map(|c| c.traceparent.as_str()));
        states.push(
            m.trace_context
                .as_ref()
                .and_then(|c| c.tracestate.as_deref()),
        );
    }
    // WITH ORDINALITY keeps the caller's order in the identity column, which is the order
    // messages sharing an ordering key are published in.
    let result = sqlx::query(
        "INSERT INTO pubsub_outbox (topic, ordering_key, dedupe_key, payload, attributes,
                                    traceparent, tracestate)
         SELECT t, k, d, p, a::jsonb, tp, ts
         FROM UNNEST($1::text[], $2::text[], $3::text[], $4::bytea[], $5::text[], $6::text[],
                     $7::text[])
              WITH ORDINALITY AS m(t, k, d, p, a, tp, ts, n)
         ORDER BY n
         ON CONFLICT (dedupe_key) DO NOTHING",
    )
    .persistent(crate::store::named_statements())
    .bind(&topics)
    .bind(&keys)
    .bind(&dedupe)
    .bind(&payloads)
    .bind(&attributes)
    .bind(&parents)
    .bind(&states)
    .execute(&mut *conn)
    .await
    .context("inserting messages into pubsub_outbox")?;
    let inserted = result.rows_affected();
    Ok(EnqueueOutcome {
        inserted,
        duplicates: messages.len() as u64 - inserted,
    })
}

/// Deletes rows that were published (retention 0: nothing is kept).
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn delete_published(conn: &mut PgConnection, ids: &[i64]) -> Result<u64> {
    if ids.is_empty() {
        return Ok(0);
    }
    let r = sqlx::query("DELETE FROM pubsub_outbox WHERE id = ANY($1)")
        .persistent(crate::store::named_statements())
        .bind(ids)
        .execute(&mut *conn)
        .await
        .context("deleting published rows from pubsub_outbox")?;
    Ok(r.rows_affected())
}

/// Records the publish of retained rows: `(id, Pub/Sub message id)` pairs.
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn mark_published(
    conn: &mut PgConnection,
    published: &[(i64, String)],
    now: DateTime<Utc>,
) -> Result<u64> {
    if published.is_empty() {
        return Ok(0);
    }
    let (ids, message_ids): (Vec<i64>, Vec<&str>) = published
        .iter()
        .map(|(id, mid)| (*id, mid.as_str()))
        .unzip();
    let r = sqlx::query(
        "UPDATE pubsub_outbox o
         SET published_at = $3, pubsub_message_id = p.mid, last_error = NULL
         FROM UNNEST($1::bigint[], $2::text[]) AS p(id, mid)
         WHERE o.id = p.id",
    )
    .persistent(crate::store::named_statements())
    .bind(&ids)
    .bind(&message_ids)
    .bind(now)
    .execute(&mut *conn)
    .await
    .context("marking rows published in pubsub_outbox")?;
    Ok(r.rows_affected())
}

/// One row to retry later.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Retry {
    /// Row id.
    pub id: i64,
    /// New attempt count.
    pub attempts: i32,
    /// When it becomes due again.
    pub next_attempt_at: DateTime<Utc>,
    /// Why the last attempt failed.
    pub last_error: String,
}

/// Stores the retry schedule of failed rows (attempts, next attempt time, last error).
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn schedule_retries(conn: &mut PgConnection, retries: &[Retry]) -> Result<u64> {
    if retries.is_empty() {
        return Ok(0);
    }
    let ids: Vec<i64> = retries.iter().map(|r| r.id).collect();
    let attempts: Vec<i32> = retries.iter().map(|r| r.attempts).collect();
    let due: Vec<DateTime<Utc>> = retries.iter().map(|r| r.next_attempt_at).collect();
    let errors: Vec<&str> = retries.iter().map(|r| r.last_error.as_str()).collect();
    let r = sqlx::query(
        "UPDATE pubsub_outbox o
         SET attempts = r.attempts, next_attempt_at = r.due, last_error = r.err
         FROM UNNEST($1::bigint[], $2::int[], $3::timestamptz[], $4::text[]) AS r(id, attempts, due, err)
         WHERE o.id = r.id",
    )
    .persistent(crate::store::named_statements())
    .bind(&ids)
    .bind(&attempts)
    .bind(&due)
    .bind(&errors)
    .execute(&mut *conn)
    .await
    .context("scheduling retries in pubsub_outbox")?;
    Ok(r.rows_affected())
}

/// Deletes up to `limit` published rows older than `before`, skipping rows someone else holds,
/// so a purge never stalls claiming. Returns how many were deleted.
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn purge_published(
    conn: &mut PgConnection,
    before: DateTime<Utc>,
    limit: i64,
) -> Result<u64> {
    let r = sqlx::query(
        "DELETE FROM pubsub_outbox
         WHERE id = ANY(ARRAY(
             SELECT id FROM pubsub_outbox
             WHERE published_at IS NOT NULL AND published_at < $1
             ORDER BY published_at
             LIMIT $2
             FOR UPDATE SKIP LOCKED))",
    )
    .persistent(crate::store::named_statements())
    .bind(before)
    .bind(limit)
    .execute(&mut *conn)
    .await
    .context("purging published rows from pubsub_outbox")?;
    Ok(r.rows_affected())
}

/// Cheap backlog figures for gauges.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Backlog {
    /// Unpublished rows, counted up to the cap given to [`backlog`].
    pub pending: i64,
    /// Whether `pending` hit the cap (the real backlog is at least that).
    pub pending_capped: bool,
    /// Age in seconds of the oldest row that is due now (0 when none is due).
    pub oldest_due_age_secs: f64,
}

/// Counts unpublished rows (index-only scans of the two partial indexes, each stopped at `cap`)
/// and the age of the oldest row due now (keyed rows: among the oldest 100,000 ids, to stay cheap).
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn backlog(conn: &mut PgConnection, now: DateTime<Utc>, cap: i64) -> Result<Backlog> {
    let (unkeyed, keyed, oldest_unkeyed, oldest_keyed): (i64, i64, Option<DateTime<Utc>>, Option<DateTime<Utc>>) =
        sqlx::query_as(
            "SELECT
                 (SELECT count(*) FROM (SELECT 1 FROM pubsub_outbox
                      WHERE published_at IS NULL AND ordering_key IS NULL LIMIT $2) s),
                 (SELECT count(*) FROM (SELECT 1 FROM pubsub_outbox
                      WHERE published_at IS NULL AND ordering_key IS NOT NULL LIMIT $2) s),
                 (SELECT min(created_at) FROM (
                      SELECT created_at FROM pubsub_outbox
                      WHERE published_at IS NULL AND ordering_key IS NULL AND next_attempt_at <= $1
                      ORDER BY next_attempt_at, id LIMIT 1000) d),
                 (SELECT min(created_at) FROM (
                      SELECT created_at, published_at, ordering_key, next_attempt_at FROM pubsub_outbox
                      ORDER BY id LIMIT 100000) k
                  WHERE published_at IS NULL AND ordering_key IS NOT NULL AND next_attempt_at <= $1)",
        )
    .persistent(crate::store::named_statements())
        .bind(now)
        .bind(cap)
        .fetch_one(&mut *conn)
        .await
        .context("reading the pubsub_outbox backlog")?;
    let oldest = match (oldest_unkeyed, oldest_keyed) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    let oldest_due_age_secs =
        oldest.map_or(0.0, |t| (now - t).num_milliseconds().max(0) as f64 / 1000.0);
    Ok(Backlog {
        pending: unkeyed + keyed,
        pending_capped: unkeyed >= cap || keyed >= cap,
        oldest_due_age_secs,
    })
}

/// A topic with unpublished rows, if any (the start-up probe asks Pub/Sub about a topic the
/// dispatcher is about to publish to). Among `topics` when given.
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn pending_topic(
    conn: &mut PgConnection,
    topics: Option<&[String]>,
) -> Result<Option<String>> {
    sqlx::query_scalar(
        "SELECT topic FROM pubsub_outbox
         WHERE published_at IS NULL AND ($1::text[] IS NULL OR topic = ANY($1))
         LIMIT 1",
    )
    .persistent(crate::store::named_statements())
    .bind(topics)
    .fetch_optional(&mut *conn)
    .await
    .context("reading a pending topic from pubsub_outbox")
}

/// One topic's backlog figures.
#[derive(Debug, Clone, PartialEq)]
pub struct TopicBacklog {
    /// Full topic name.
    pub topic: String,
    /// Unpublished rows (among the first `cap` read).
    pub pending: i64,
    /// Age in seconds of the oldest row due now (0 when none is due). A keyed row is due only
    /// when its key's head is (as `dispatcher status` counts it): rows behind a head waiting for
    /// its retry wait too.
    pub oldest_due_age_secs: f64,
    /// Age in seconds of the oldest row a claim could take now (0 when none): due, its topic not
    /// paused, and not behind a dead-lettered message of its ordering key (unless the topic
    /// skips dead letters). What more dispatchers could publish: the autoscaling signal.
    pub claimable_age_secs: f64,
}

/// What [`backlog_by_topic`] reads.
#[derive(Debug, Clone, Copy)]
pub struct BacklogQuery<'a> {
    /// The instant "due" is measured against.
    pub now: DateTime<Utc>,
    /// Only these topics (None: every topic).
    pub topics: Option<&'a [String]>,
    /// Topics no claim takes now: paused by an operator, or held because Pub/Sub refuses them.
    /// Their rows wait by intent, and are not claimable.
    pub not_claimed: &'a [String],
    /// Topics whose keys skip dead letters (their keyed rows are never blocked).
    pub skip_dead_letter_topics: &'a [String],
    /// Read at most this many unpublished rows.
    pub cap: i64,
}

/// Backlog per topic (only `q.topics` when given), reading at most `q.cap` unpublished rows.
/// The claimable age counts a keyed row only when its key's head (its lowest unpublished id) is
/// due: rows behind a head waiting for its retry are not work a dispatcher could do.
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn backlog_by_topic(
    conn: &mut PgConnection,
    q: &BacklogQuery<'_>,
) -> Result<Vec<TopicBacklog>> {
    // A row is held back by a dead letter of its key placed before it (`stop`: the key's first
    // blocking position, none: all of it; a cancelled one blocks nothing), and a keyed row waits
    // while its key's head (its lowest unpublished id) is not due. Both come per key from one
    // aggregate over the keyed rows (the dead letters' stops, few rows, hash-joined into it),
    // hash-joined back: no probe per outbox row, no sort, no materialized copy of the rows read.
    // Each of the two scans reads at most `cap` rows.
    let rows: Vec<(String, i64, Option<f64>, Option<f64>)> = sqlx::query_as(
        "SELECT s.topic, count(*),
                EXTRACT(EPOCH FROM ($1 - min(s.created_at) FILTER (
                    WHERE s.next_attempt_at <= $1
                      AND (s.ordering_key IS NULL OR k.head_due))))::float8,
                EXTRACT(EPOCH FROM ($1 - min(s.created_at) FILTER (
                    WHERE s.next_attempt_at <= $1 AND NOT (s.topic = ANY($4))
                      AND (s.ordering_key IS NULL
                           OR (k.head_due AND (s.topic = ANY($5) OR k.stop IS NULL
                                               OR s.id < k.stop))))))::float8
         FROM (SELECT id, topic, ordering_key, created_at, next_attempt_at FROM pubsub_outbox
               WHERE published_at IS NULL AND ($2::text[] IS NULL OR topic = ANY($2))
               LIMIT $3) s
         LEFT JOIN (
             SELECT o.topic, o.ordering_key,
                    min(o.id) = min(o.id) FILTER (WHERE o.next_attempt_at <= $1) AS head_due,
                    min(b.stop) AS stop
             FROM (SELECT id, topic, ordering_key, next_attempt_at FROM pubsub_outbox
                   WHERE published_at IS NULL AND ordering_key IS NOT NULL
                     AND ($2::text[] IS NULL OR topic = ANY($2))
                   LIMIT $3) o
             LEFT JOIN (SELECT d.topic, d.ordering_key, min(COALESCE(d.outbox_id, 0)) AS stop
                        FROM pubsub_outbox_dead_letter d
                        WHERE d.ordering_key IS NOT NULL AND d.error_kind <> 'cancelled'
                        GROUP BY d.topic, d.ordering_key) b
               ON b.topic = o.topic AND b.ordering_key = o.ordering_key
             GROUP BY o.topic, o.ordering_key) k
           ON k.topic = s.topic AND k.ordering_key = s.ordering_key
         GROUP BY s.topic",
    )
    .persistent(crate::store::named_statements())
    .bind(q.now)
    .bind(q.topics)
    .bind(q.cap)
    .bind(q.not_claimed)
    .bind(q.skip_dead_letter_topics)
    .fetch_all(&mut *conn)
    .await
    .context("reading the pubsub_outbox backlog per topic")?;
    Ok(rows
        .into_iter()
        .map(|(topic, pending, age, claimable)| TopicBacklog {
            topic,
            pending,
            oldest_due_age_secs: age.unwrap_or(0.0).max(0.0),
            claimable_age_secs: claimable.unwrap_or(0.0).max(0.0),
        })
        .collect())
}

/// Reads one row by id (operators and tests).
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn get(conn: &mut PgConnection, id: i64) -> Result<Option<OutboxRow>> {
    #[derive(sqlx::FromRow)]
    struct Row {
        #[sqlx(flatten)]
        message: MessageRow,
        published_at: Option<DateTime<Utc>>,
        pubsub_message_id: Option<String>,
        last_error: Option<String>,
        next_attempt_at: DateTime<Utc>,
    }
    let row: Option<Row> = sqlx::query_as(
        "SELECT id, topic, ordering_key, dedupe_key, payload, attributes, traceparent, tracestate,
                attempts, created_at, published_at, pubsub_message_id, last_error, next_attempt_at
         FROM pubsub_outbox WHERE id = $1",
    )
    .persistent(crate::store::named_statements())
    .bind(id)
    .fetch_optional(&mut *conn)
    .await
    .context("reading a pubsub_outbox row")?;
    Ok(row.map(|r| OutboxRow {
        message: r.message.into(),
        published_at: r.published_at,
        pubsub_message_id: r.pubsub_message_id,
        last_error: r.last_error,
        next_attempt_at: r.next_attempt_at,
    }))
}

/// A whole outbox row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxRow {
    /// The message columns.
    pub message: ClaimedMessage,
    /// When it was published (retained rows only).
    pub published_at: Option<DateTime<Utc>>,
    /// Pub/Sub's message id (retained rows only).
    pub pubsub_message_id: Option<String>,
    /// Why the last attempt failed.
    pub last_error: Option<String>,
    /// When it is due.
    pub next_attempt_at: DateTime<Utc>,
}
