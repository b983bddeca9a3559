//! `pubsub_outbox_dead_letter`: messages that need an operator.
//!
//! Moving a row here is atomic: one statement deletes it from the outbox and inserts it here, in
//! the dispatcher's settle transaction. A dedupe key is held at most once; a second failure of the
//! same key (after a replay) updates the entry.

use chrono::{DateTime, Utc};
use sqlx::PgConnection;

use crate::error::{DbContext, Result};
use crate::message::{Attributes, NewMessage};
use crate::trace::TraceContext;

/// How the dispatcher's `last_error` begins for a message it refused itself, before sending
/// (a limit check): replaying one runs the same check, so it comes back as a new dead letter.
pub const REFUSED_LOCALLY: &str = "rejected before publishing: ";

/// Why a message was dead-lettered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// Pub/Sub (or a local limit check) refused it; retrying cannot help.
    Permanent,
    /// Transient failures outlasted the maximum attempts.
    Exhausted,
    /// The producer refused it before enqueue.
    Rejected,
}

impl ErrorKind {
    /// The value stored in `error_kind`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Permanent => "permanent",
            Self::Exhausted => "exhausted",
            Self::Rejected => "rejected",
        }
    }
}

/// One outbox row to move here.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// The outbox row id.
    pub id: i64,
    /// The final attempt count.
    pub attempts: i32,
    /// Why.
    pub kind: ErrorKind,
    /// The last error, for the operator.
    pub error: String,
}

/// Moves outbox rows to the dead-letter table (delete + insert in one statement). Returns each
/// moved row's (outbox id, dead letter id): the id operators give `dead-letters show`.
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn move_from_outbox(
    conn: &mut PgConnection,
    failures: &[Failure],
    now: DateTime<Utc>,
) -> Result<Vec<(i64, i64)>> {
    if failures.is_empty() {
        return Ok(Vec::new());
    }
    let ids: Vec<i64> = failures.iter().map(|f| f.id).collect();
    let attempts: Vec<i32> = failures.iter().map(|f| f.attempts).collect();
    let kinds: Vec<&str> = failures.iter().map(|f| f.kind.as_str()).collect();
    let errors: Vec<&str> = failures.iter().map(|f| f.error.as_str()).collect();
    let r: Vec<(i64, i64)> = sqlx::query_as(
        "WITH f AS (
             SELECT * FROM UNNEST($1::bigint[], $2::int[], $3::text[], $4::text[]) AS f(id, attempts, kind, err)
         ), moved AS (
             DELETE FROM pubsub_outbox o USING f WHERE o.id = f.id
             RETURNING o.id, o.topic, o.ordering_key, o.dedupe_key, o.payload, o.attributes, o.created_at,
                       o.traceparent, o.tracestate, f.attempts, f.kind, f.err
         )
         INSERT INTO pubsub_outbox_dead_letter
             (outbox_id, topic, ordering_key, dedupe_key, payload, attributes, created_at, failed_at,
              attempts, error_kind, last_error, source, traceparent, tracestate)
         SELECT id, topic, ordering_key, dedupe_key, payload, attributes, created_at, $5,
                attempts, kind, err, 'dispatcher', traceparent, tracestate
         FROM moved
         ON CONFLICT (dedupe_key) DO UPDATE SET
             outbox_id = EXCLUDED.outbox_id, failed_at = EXCLUDED.failed_at,
             attempts = EXCLUDED.attempts, error_kind = EXCLUDED.error_kind,
             last_error = EXCLUDED.last_error, payload = EXCLUDED.payload,
             attributes = EXCLUDED.attributes, topic = EXCLUDED.topic,
             ordering_key = EXCLUDED.ordering_key, traceparent = EXCLUDED.traceparent,
             tracestate = EXCLUDED.tracestate
         RETURNING outbox_id, id",
    )
    .persistent(crate::store::named_statements())
    .bind(&ids)
    .bind(&attempts)
    .bind(&kinds)
    .bind(&errors)
    .bind(now)
    .fetch_all(&mut *conn)
    .await
    .context("moving rows from pubsub_outbox to pubsub_outbox_dead_letter")?;
    Ok(r)
}

/// A message the producer refused before enqueue, with the reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    /// The message as it would have been enqueued.
    pub message: NewMessage,
    /// Why it can never be published.
    pub reason: String,
}

/// Records messages a writer refused before enqueue, each with an id from the outbox's sequence
/// in the order given (`outbox_id`): its place in its key's order, so it holds back only the rows
/// enqueued after it, and a replay puts it back there. Call it between the enqueues of the rows
/// before and after it. A dedupe key already dead-lettered is skipped (a producer lookback
/// re-reading the same row adds nothing). Returns rows inserted.
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn insert_rejected(
    conn: &mut PgConnection,
    source: &str,
    rejected: &[Rejection],
) -> Result<u64> {
    if rejected.is_empty() {
        return Ok(0);
    }
    let topics: Vec<&str> = rejected.iter().map(|r| r.message.topic.as_str()).collect();
    let keys: Vec<Option<&str>> = rejected
        .iter()
        .map(|r| r.message.ordering_key.as_deref())
        .collect();
    let dedupe: Vec<&str> = rejected
        .iter()
        .map(|r| r.message.dedupe_key.as_str())
        .collect();
    let payloads: Vec<&[u8]> = rejected
        .iter()
        .map(|r| r.message.payload.as_slice())
        .collect();
    let attributes: Vec<String> = rejected
        .iter()
        .map(|r| serde_json::to_string(&r.message.attributes).unwrap_or_else(|_| "{}".to_owned()))
        .collect();
    let reasons: Vec<&str> = rejected.iter().map(|r| r.reason.as_str()).collect();
    fn trace(r: &Rejection) -> Option<&TraceContext> {
        r.message.trace_context.as_ref()
    }
    let parents: Vec<Option<&str>> = rejected
        .iter()
        .map(|r| trace(r).map(|c| c.traceparent.as_str()))
        .collect();
    let states: Vec<Option<&str>> = rejected
        .iter()
        .map(|r| trace(r).and_then(|c| c.tracestate.as_deref()))
        .collect();
    let r = sqlx::query(
        "INSERT INTO pubsub_outbox_dead_letter
             (outbox_id, topic, ordering_key, dedupe_key, payload, attributes, created_at, attempts,
              error_kind, last_error, source, traceparent, tracestate)
         SELECT nextval(pg_get_serial_sequence('pubsub_outbox', 'id')), t, k, d, p, a::jsonb,
                now(), 0, 'rejected', e, $7, tp, ts
         FROM UNNEST($1::text[], $2::text[], $3::text[], $4::bytea[], $5::text[], $6::text[],
                     $8::text[], $9::text[])
              WITH ORDINALITY AS r(t, k, d, p, a, e, tp, ts, n)
         ORDER BY n
         ON CONFLICT (dedupe_key) DO NOTHING",
    )
    .persistent(crate::store::named_statements())
    .bind(&topics)
    .bind(&keys)
    .bind(&dedupe)
    .bind(&payloads)
    .bind(&attributes)
    .bind(&reasons)
    .bind(source)
    .bind(&parents)
    .bind(&states)
    .execute(&mut *conn)
    .await
    .context("recording rejected messages in pubsub_outbox_dead_letter")?;
    Ok(r.rows_affected())
}

/// A dead-letter entry as operators see it.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct DeadLetter {
    /// Entry id.
    pub id: i64,
    /// Original outbox id, if it was enqueued.
    pub outbox_id: Option<i64>,
    /// Full topic name.
    pub topic: String,
    /// Ordering key.
    pub ordering_key: Option<String>,
    /// Dedupe key.
    pub dedupe_key: String,
    /// The message data.
    pub payload: Vec<u8>,
    /// Attributes.
    pub attributes: sqlx::types::Json<Attributes>,
    /// When it was first enqueued.
    pub created_at: DateTime<Utc>,
    /// When it was dead-lettered.
    pub failed_at: DateTime<Utc>,
    /// Attempts made.
    pub attempts: i32,
    /// permanent / exhausted / rejected.
    pub error_kind: String,
    /// The last error.
    pub last_error: String,
    /// dispatcher or producer:<stream>.
    pub source: String,
}

/// Lists dead letters, newest first (optionally for one topic).
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn list(
    conn: &mut PgConnection,
    topic: Option<&str>,
    limit: i64,
) -> Result<Vec<DeadLetter>> {
    sqlx::query_as(
        "SELECT id, outbox_id, topic, ordering_key, dedupe_key, payload, attributes, created_at,
                failed_at, attempts, error_kind, last_error, source
         FROM pubsub_outbox_dead_letter
         WHERE ($1::text IS NULL OR topic = $1)
         ORDER BY failed_at DESC, id DESC
         LIMIT $2",
    )
    .persistent(crate::store::named_statements())
    .bind(topic)
    .bind(limit)
    .fetch_all(&mut *conn)
    .await
    .context("listing pubsub_outbox_dead_letter")
}

/// Which dead letters an operator means. Every field narrows the selection; an empty filter
/// selects everything (callers refuse that for bulk actions).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Filter {
    /// These entry ids only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ids: Option<Vec<i64>>,
    /// Full topic name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub topic: Option<String>,
    /// permanent / exhausted / rejected.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error_kind: Option<String>,
    /// This ordering key.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ordering_key: Option<String>,
    /// Dedupe keys starting with this.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dedupe_prefix: Option<String>,
    /// Failed before this instant.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failed_before: Option<DateTime<Utc>>,
    /// Failed after this instant.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failed_after: Option<DateTime<Utc>>,
    /// Text the error contains (case-insensitive).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error_contains: Option<String>,
}

impl Filter {
    /// Whether nothing narrows it.
    pub fn is_empty(&self) -> bool {
        self == &Self::default()
    }
}

/// Dead letters matching `filter`, newest first, at most `limit`, older than entry `before_id`
/// when given (the next page).
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn select(
    conn: &mut PgConnection,
    filter: &Filter,
    limit: i64,
    before_id: Option<i64>,
) -> Result<Vec<DeadLetter>> {
    sqlx::query_as(
        "SELECT id, outbox_id, topic, ordering_key, dedupe_key, payload, attributes, created_at,
                failed_at, attempts, error_kind, last_error, source
         FROM pubsub_outbox_dead_letter
         WHERE ($1::bigint[] IS NULL OR id = ANY($1))
           AND ($2::text IS NULL OR topic = $2)
           AND ($3::text IS NULL OR error_kind = $3)
           AND ($4::text IS NULL OR ordering_key = $4)
           AND ($5::text IS NULL OR starts_with(dedupe_key, $5))
           AND ($6::timestamptz IS NULL OR failed_at < $6)
           AND ($7::timestamptz IS NULL OR failed_at > $7)
           AND ($8::text IS NULL OR strpos(lower(last_error), lower($8)) > 0)
           AND ($9::bigint IS NULL OR id < $9)
         ORDER BY id DESC
         LIMIT $10",
    )
    .persistent(crate::store::named_statements())
    .bind(&filter.ids)
    .bind(&filter.topic)
    .bind(&filter.error_kind)
    .bind(&filter.ordering_key)
    .bind(&filter.dedupe_prefix)
    .bind(filter.failed_before)
    .bind(filter.failed_after)
    .bind(&filter.error_contains)
    .bind(before_id)
    .bind(limit)
    .fetch_all(&mut *conn)
    .await
    .context("selecting from pubsub_outbox_dead_letter")
}

/// One dead letter by id.
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn get(conn: &mut PgConnection, id: i64) -> Result<Option<DeadLetter>> {
    let filter = Filter {
        ids: Some(vec![id]),
        ..Filter::default()
    };
    Ok(select(conn, &filter, 1, None).await?.into_iter().next())
}

/// The dead letter of outbox row `outbox_id`, if there is one (a replayed message refused
/// again is a new dead letter with its old outbox id).
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn of_outbox_row(conn: &mut PgConnection, outbox_id: i64) -> Result<Option<DeadLetter>> {
    sqlx::query_as(
        "SELECT id, outbox_id, topic, ordering_key, dedupe_key, payload, attributes, created_at,
                failed_at, attempts, error_kind, last_error, source
         FROM pubsub_outbox_dead_letter WHERE outbox_id = $1",
    )
    .persistent(crate::store::named_statements())
    .bind(outbox_id)
    .fetch_optional(&mut *conn)
    .await
    .context("reading a dead letter by its outbox id")
}

/// Puts dead letters back into the outbox (attempts reset, due now) and removes them here.
/// A message keeps its original outbox id, so it goes out **ahead of** the later messages of its
/// ordering key that waited behind it; the claim epoch advances with it, so dispatchers stop
/// using a keyed floor that may be above it. Returns (dead letter id, outbox id) of each entry replayed; a dead letter whose dedupe
/// key is back in the outbox already is left in place.
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn replay(conn: &mut PgConnection, ids: &[i64]) -> Result<Vec<(i64, i64)>> {
    sqlx::query_as(
        "WITH moved AS (
             DELETE FROM pubsub_outbox_dead_letter d
             WHERE d.id = ANY($1)
               AND NOT EXISTS (SELECT 1 FROM pubsub_outbox o WHERE o.dedupe_key = d.dedupe_key)
             RETURNING d.id, d.outbox_id, d.topic, d.ordering_key, d.dedupe_key, d.payload,
                       d.attributes, d.created_at, d.traceparent, d.tracestate
         ), inserted AS (
             INSERT INTO pubsub_outbox (id, topic, ordering_key, dedupe_key, payload, attributes, created_at,
                                        traceparent, tracestate)
             OVERRIDING SYSTEM VALUE
             SELECT COALESCE(outbox_id, nextval(pg_get_serial_sequence('pubsub_outbox', 'id'))),
                    topic, ordering_key, dedupe_key, payload, attributes, created_at, traceparent,
                    tracestate
             FROM moved ORDER BY id
             RETURNING id, dedupe_key
         ), epoch AS (
             -- A keyed row back below its key's head: dispatchers forget the heads they know
             -- (store::claim, \"Claims start past what is published\"), seeing it with the row.
             UPDATE pubsub_outbox_claim_epoch SET epoch = epoch + 1
             WHERE EXISTS (SELECT 1 FROM moved WHERE ordering_key IS NOT NULL)
         )
         SELECT m.id, i.id FROM moved m JOIN inserted i USING (dedupe_key) ORDER BY m.id",
    )
    .persistent(crate::store::named_statements())
    .bind(ids)
    .fetch_all(&mut *conn)
    .await
    .context("replaying dead letters into pubsub_outbox")
}

/// Dead letters that failed after `since`, up to `until` (the console's rate; the index on
/// `failed_at` bounds it).
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn failed_since(
    conn: &mut PgConnection,
    since: DateTime<Utc>,
    until: DateTime<Utc>,
) -> Result<i64> {
    sqlx::query_scalar(
        "SELECT count(*) FROM pubsub_outbox_dead_letter WHERE failed_at > $1 AND failed_at <= $2",
    )
    .persistent(crate::store::named_statements())
    .bind(since)
    .bind(until)
    .fetch_one(&mut *conn)
    .await
    .context("counting recent dead letters")
}

/// Messages of `topic`'s `ordering_key` waiting in the outbox after position `outbox_id` (none:
/// all of them): what a dead letter there holds back (the key index bounds it).
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn held_behind(
    conn: &mut PgConnection,
    topic: &str,
    ordering_key: &str,
    outbox_id: Option<i64>,
) -> Result<i64> {
    sqlx::query_scalar(
        "SELECT count(*) FROM pubsub_outbox
         WHERE published_at IS NULL AND ordering_key IS NOT NULL
           AND topic = $1 AND (ordering_key, id) > ($2, COALESCE($3, 0))
           AND ordering_key <= $2",
    )
    .persistent(crate::store::named_statements())
    .bind(topic)
    .bind(ordering_key)
    .bind(outbox_id)
    .fetch_one(&mut *conn)
    .await
    .context("counting the messages a dead letter holds back")
}

/// Ordering keys held back by a dead letter (topics in `skip_topics` do not block), only of
/// `topics` when given (a `--topic`-scoped replica counts the keys it serves).
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn blocked_keys(
    conn: &mut PgConnection,
    skip_topics: &[String],
    topics: Option<&[String]>,
) -> Result<i64> {
    sqlx::query_scalar(
        "SELECT count(*) FROM (
             SELECT DISTINCT topic, ordering_key FROM pubsub_outbox_dead_letter
             WHERE ordering_key IS NOT NULL AND error_kind <> 'cancelled'
               AND NOT (topic = ANY($1))
               AND ($2::text[] IS NULL OR topic = ANY($2))) k",
    )
    .persistent(crate::store::named_statements())
    .bind(skip_topics)
    .bind(topics)
    .fetch_one(&mut *conn)
    .await
    .context("counting ordering keys blocked by dead letters")
}

/// Dead letters per (topic, kind), only `topics` when given (cheap gauges).
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn counts(
    conn: &mut PgConnection,
    topics: Option<&[String]>,
) -> Result<Vec<(String, String, i64)>> {
    sqlx::query_as(
        "SELECT topic, error_kind, count(*) FROM pubsub_outbox_dead_letter
         WHERE ($1::text[] IS NULL OR topic = ANY($1)) GROUP BY topic, error_kind",
    )
    .persistent(crate::store::named_statements())
    .bind(topics)
    .fetch_all(&mut *conn)
    .await
    .context("counting pubsub_outbox_dead_letter by topic and kind")
}

/// Deletes dead letters for good. Returns the ids discarded.
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn discard(conn: &mut PgConnection, ids: &[i64]) -> Result<Vec<i64>> {
    sqlx::query_scalar("DELETE FROM pubsub_outbox_dead_letter WHERE id = ANY($1) RETURNING id")
        .persistent(crate::store::named_statements())
        .bind(ids)
        .fetch_all(&mut *conn)
        .await
        .context("discarding dead letters")
}
