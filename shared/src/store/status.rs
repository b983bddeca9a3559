//! What `dispatcher status` reads: per-topic queue state, blocked ordering keys, producer
//! streams, long transactions and the outbox table's health. Read-only; every query is here so
//! docs/operating.md ("The SQL behind `status`") can point at one file.
//!
//! The per-topic counts scan the unpublished rows once (an operator command, not a hot path).

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgConnection;

use crate::error::{DbContext, Result};

/// One topic's queue.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct TopicState {
    /// Full topic name.
    pub topic: String,
    /// Unpublished rows a claim can take now: due, and (keyed) every earlier row of the key due
    /// too; the topic neither paused nor held, the key not behind a dead letter.
    pub due_now: i64,
    /// Unpublished rows due now that no claim takes: the topic is paused, or held because Pub/Sub
    /// refuses it, or the row's ordering key is blocked by a dead letter (see [`blocked_keys`]).
    pub held: i64,
    /// Unpublished rows waiting for a retry, or (keyed) behind an earlier row of their key that
    /// waits for one.
    pub waiting: i64,
    /// When the next waiting row can go (for a keyed row: when its key's waiting head is tried).
    pub next_due_at: Option<DateTime<Utc>>,
    /// Seconds since the oldest due row was enqueued (0: none due).
    pub oldest_due_age_seconds: f64,
    /// Dead letters, permanent.
    pub dead_permanent: i64,
    /// Dead letters, exhausted.
    pub dead_exhausted: i64,
    /// Dead letters, rejected by the producer.
    pub dead_rejected: i64,
    /// Dead letters cancelled by an operator (they block nothing).
    pub dead_cancelled: i64,
    /// Dead letters that failed in the last 15 minutes.
    pub dead_recent: i64,
    /// Whether the topic is paused.
    pub paused: bool,
    /// Whether Pub/Sub refuses the topic as a whole: held (see [`held_topics`]).
    pub refused: bool,
}

/// Every topic that has unpublished rows, dead letters, a pause or a hold. `skip_topics`: the
/// topics whose keys skip dead letters (their rows are never held behind one). A keyed row can go
/// only when every earlier row of its key can (`due_at`, the running latest due time along the
/// key): rows behind a head waiting for its retry wait too, until the head is tried.
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn topics(
    conn: &mut PgConnection,
    now: DateTime<Utc>,
    skip_topics: &[String],
) -> Result<Vec<TopicState>> {
    sqlx::query_as(
        "WITH r AS (
             SELECT o.topic, o.created_at,
                    CASE WHEN o.ordering_key IS NULL THEN o.next_attempt_at
                         ELSE max(o.next_attempt_at) OVER (
                             PARTITION BY o.topic, o.ordering_key ORDER BY o.id) END AS due_at,
                    COALESCE(b.first_id < o.id, false) AS blocked
             FROM pubsub_outbox o
             LEFT JOIN (SELECT d.topic, d.ordering_key, min(COALESCE(d.outbox_id, 0)) AS first_id
                        FROM pubsub_outbox_dead_letter d
                        WHERE d.ordering_key IS NOT NULL AND d.error_kind <> 'cancelled'
                          AND NOT (d.topic = ANY($2))
                        GROUP BY d.topic, d.ordering_key) b
               ON b.topic = o.topic AND b.ordering_key = o.ordering_key
             WHERE o.published_at IS NULL
         ), q AS (
             SELECT topic,
                    count(*) FILTER (WHERE due_at <= $1 AND NOT blocked) AS due_free,
                    count(*) FILTER (WHERE due_at <= $1 AND blocked) AS due_blocked,
                    count(*) FILTER (WHERE due_at > $1) AS waiting,
                    min(due_at) FILTER (WHERE due_at > $1) AS next_due_at,
                    min(created_at) FILTER (WHERE due_at <= $1) AS oldest_due
             FROM r GROUP BY topic
         ), d AS (
             SELECT topic,
                    count(*) FILTER (WHERE error_kind = 'permanent') AS dead_permanent,
                    count(*) FILTER (WHERE error_kind = 'exhausted') AS dead_exhausted,
                    count(*) FILTER (WHERE error_kind = 'rejected') AS dead_rejected,
                    count(*) FILTER (WHERE error_kind = 'cancelled') AS dead_cancelled,
                    count(*) FILTER (WHERE failed_at > $1 - interval '15 minutes'
                                       AND error_kind <> 'cancelled') AS dead_recent
             FROM pubsub_outbox_dead_letter GROUP BY topic
         ), t AS (
             SELECT topic FROM q UNION SELECT topic FROM d
             UNION SELECT topic FROM pubsub_outbox_paused_topic
             UNION SELECT topic FROM pubsub_outbox_held_topic
         ), s AS (
             SELECT t.topic, q.due_free, q.due_blocked, q.waiting, q.next_due_at, q.oldest_due,
                    d.dead_permanent, d.dead_exhausted, d.dead_rejected, d.dead_cancelled,
                    d.dead_recent,
                    EXISTS (SELECT 1 FROM pubsub_outbox_paused_topic p WHERE p.topic = t.topic) AS paused,
                    EXISTS (SELECT 1 FROM pubsub_outbox_held_topic h WHERE h.topic = t.topic) AS refused
             FROM t LEFT JOIN q USING (topic) LEFT JOIN d USING (topic)
         )
         SELECT s.topic,
                CASE WHEN s.paused OR s.refused THEN 0 ELSE COALESCE(s.due_free, 0) END AS due_now,
                COALESCE(s.due_blocked, 0)
                    + CASE WHEN s.paused OR s.refused THEN COALESCE(s.due_free, 0) ELSE 0 END AS held,
                COALESCE(s.waiting, 0) AS waiting, s.next_due_at,
                COALESCE(EXTRACT(EPOCH FROM ($1 - s.oldest_due))::float8, 0) AS oldest_due_age_seconds,
                COALESCE(s.dead_permanent, 0) AS dead_permanent,
                COALESCE(s.dead_exhausted, 0) AS dead_exhausted,
                COALESCE(s.dead_rejected, 0) AS dead_rejected,
                COALESCE(s.dead_cancelled, 0) AS dead_cancelled,
                COALESCE(s.dead_recent, 0) AS dead_recent,
                s.paused, s.refused
         FROM s ORDER BY s.topic",
    )
    .persistent(crate::store::named_statements())
    .bind(now)
    .bind(skip_topics)
    .fetch_all(&mut *conn)
    .await
    .context("reading the per-topic queue state")
}

/// A held topic (Pub/Sub refuses it as a whole) with the rows that wait for it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct HeldTopicState {
    /// The hold.
    #[serde(flatten)]
    #[sqlx(flatten)]
    pub hold: crate::store::held_topic::HeldTopic,
    /// Unpublished rows of the topic.
    pub waiting: i64,
}

/// Every held topic, oldest hold first, with the rows that wait.
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn held_topics(conn: &mut PgConnection) -> Result<Vec<HeldTopicState>> {
    sqlx::query_as(
        "SELECT h.topic, h.code, h.message, h.held_since, h.last_refused_at, h.refusals, h.probes,
                h.next_probe_at,
                (SELECT count(*) FROM pubsub_outbox o
                 WHERE o.topic = h.topic AND o.published_at IS NULL) AS waiting
         FROM pubsub_outbox_held_topic h ORDER BY h.held_since, h.topic",
    )
    .persistent(crate::store::named_statements())
    .fetch_all(&mut *conn)
    .await
    .context("reading the held topics")
}

/// An ordering key held back by a dead letter.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct BlockedKey {
    /// Full topic name.
    pub topic: String,
    /// The key.
    pub ordering_key: String,
    /// The dead letter holding it (the oldest, if several).
    pub dead_letter_id: i64,
    /// Messages of the key waiting in the outbox.
    pub waiting: i64,
}

/// The ordering keys of one topic a dead letter holds back, counted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct BlockedTopic {
    /// Full topic name.
    pub topic: String,
    /// How many of its ordering keys are blocked.
    pub keys: i64,
    /// Messages waiting behind those keys' dead letters.
    pub waiting: i64,
}

/// Which blocked keys to list: those of `topic` (all topics when `None`) after `after`, in
/// (topic, key) order, at most `limit`, except on topics in `skip_topics` (which skip dead
/// letters). A page of an incident's thousands.
#[derive(Debug, Clone, Copy)]
pub struct BlockedQuery<'a> {
    /// Topics whose dead letters block nothing (`--ordering-skip-dead-letters`).
    pub skip_topics: &'a [String],
    /// One topic, or all.
    pub topic: Option<&'a str>,
    /// The page starts after this (topic, key): the last of the previous page.
    pub after: Option<(&'a str, &'a str)>,
    /// The most keys to list.
    pub limit: i64,
}

// One row per blocked key: the oldest dead letter holding it and the messages behind it.
const BLOCKED_KEYS: &str = "SELECT d.topic, d.ordering_key, min(d.id) AS dead_letter_id,
        (SELECT count(*) FROM pubsub_outbox o
         WHERE o.topic = d.topic AND o.ordering_key = d.ordering_key
           AND o.published_at IS NULL
           AND o.id > min(COALESCE(d.outbox_id, 0))) AS waiting
 FROM pubsub_outbox_dead_letter d
 WHERE d.ordering_key IS NOT NULL AND d.error_kind <> 'cancelled' AND NOT (d.topic = ANY($1))";

/// A page of the keys with a dead letter ([`BlockedQuery`]).
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn blocked_keys(
    conn: &mut PgConnection,
    q: &BlockedQuery<'_>,
) -> Result<Vec<BlockedKey>> {
    sqlx::query_as(&format!(
        "{BLOCKED_KEYS}
           AND ($2::text IS NULL OR d.topic = $2)
           AND ($3::text IS NULL OR (d.topic, d.ordering_key) > ($3, $4::text))
         GROUP BY d.topic, d.ordering_key
         ORDER BY d.topic, d.ordering_key
         LIMIT $5"
    ))
    .persistent(crate::store::named_statements())
    .bind(q.skip_topics)
    .bind(q.topic)
    .bind(q.after.map(|(topic, _)| topic))
    .bind(q.after.map(|(_, key)| key))
    .bind(q.limit)
    .fetch_all(&mut *conn)
    .await
    .context("listing ordering keys blocked by dead letters")
}

/// Per topic, how many keys a dead letter blocks and how many messages wait behind them, except
/// on topics in `skip_topics`: what an incident with thousands of blocked keys is summed up by.
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn blocked_topics(
    conn: &mut PgConnection,
    skip_topics: &[String],
) -> Result<Vec<BlockedTopic>> {
    sqlx::query_as(&format!(
        "SELECT k.topic, count(*) AS keys, COALESCE(sum(k.waiting), 0)::bigint AS waiting
         FROM ({BLOCKED_KEYS} GROUP BY d.topic, d.ordering_key) k
         GROUP BY k.topic
         ORDER BY k.topic"
    ))
    .persistent(crate::store::named_statements())
    .bind(skip_topics)
    .fetch_all(&mut *conn)
    .await
    .context("counting ordering keys blocked by dead letters per topic")
}

/// Who a session is: its login and whether it is a superuser.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct Login {
    /// `session_user`.
    pub name: String,
    /// Whether it has PostgreSQL's superuser attribute.
    pub superuser: bool,
}

/// The session's login (a tool that acts with its login's rights says when they are a
/// superuser's).
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn login(conn: &mut PgConnection) -> Result<Login> {
    sqlx::query_as(
        "SELECT session_user::text AS name, current_setting('is_superuser') = 'on' AS superuser",
    )
    .persistent(crate::store::named_statements())
    .fetch_one(&mut *conn)
    .await
    .context("reading the session's login")
}

/// A producer stream: its watermark and last run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct StreamState {
    /// Stream name.
    pub stream: String,
    /// Watermark timestamp, UNIX microseconds.
    pub watermark_micros: i64,
    /// Watermark tie-breaker.
    pub watermark_key: String,
    /// When the watermark last moved.
    pub watermark_updated_at: DateTime<Utc>,
    /// The last run's start.
    pub last_run_started_at: Option<DateTime<Utc>>,
    /// The last run's end.
    pub last_run_finished_at: Option<DateTime<Utc>>,
    /// running / succeeded / failed / skipped / abandoned.
    pub last_run_outcome: Option<String>,
    /// Rows the last run enqueued.
    pub last_run_enqueued: Option<i64>,
    /// Its error, if it failed.
    pub last_run_error: Option<String>,
}

/// Every stream with a watermark.
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn streams(conn: &mut PgConnection) -> Result<Vec<StreamState>> {
    sqlx::query_as(
        "SELECT w.stream, w.cursor_micros AS watermark_micros, w.cursor_key AS watermark_key,
                w.updated_at AS watermark_updated_at, r.started_at AS last_run_started_at,
                r.finished_at AS last_run_finished_at, r.outcome AS last_run_outcome,
                r.rows_enqueued AS last_run_enqueued, r.error AS last_run_error
         FROM producer_watermark w
         LEFT JOIN LATERAL (SELECT * FROM producer_run p WHERE p.stream = w.stream
                            ORDER BY p.started_at DESC LIMIT 1) r ON true
         ORDER BY w.stream",
    )
    .persistent(crate::store::named_statements())
    .fetch_all(&mut *conn)
    .await
    .context("reading the producer streams")
}

/// A transaction that pins the vacuum horizon.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct LongTransaction {
    /// Backend pid.
    pub pid: i32,
    /// Its application name.
    pub application_name: String,
    /// Its state (active, idle in transaction, ...).
    pub state: Option<String>,
    /// Seconds since the transaction began.
    pub age_seconds: f64,
    /// Its database.
    pub database: Option<String>,
}

/// Transactions anywhere on the server older than `older_than_secs` that hold back the vacuum
/// horizon (a snapshot, `backend_xmin`, or a transaction id, `backend_xid`): vacuum cannot remove
/// the outbox's dead rows behind them.
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn long_transactions(
    conn: &mut PgConnection,
    older_than_secs: f64,
) -> Result<Vec<LongTransaction>> {
    sqlx::query_as(
        "SELECT pid, application_name, state,
                EXTRACT(EPOCH FROM (now() - xact_start))::float8 AS age_seconds,
                datname::text AS database
         FROM pg_stat_activity
         WHERE xact_start < now() - make_interval(secs => $1)
           AND (backend_xmin IS NOT NULL OR backend_xid IS NOT NULL) AND pid <> pg_backend_pid()
         ORDER BY xact_start",
    )
    .persistent(crate::store::named_statements())
    .bind(older_than_secs)
    .fetch_all(&mut *conn)
    .await
    .context("reading long transactions from pg_stat_activity")
}

/// The outbox table's size and dead tuples.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct TableHealth {
    /// Live rows (statistics estimate).
    pub live_rows: i64,
    /// Dead rows waiting for vacuum (statistics estimate).
    pub dead_rows: i64,
    /// Table, indexes and TOAST, in bytes.
    pub total_bytes: i64,
    /// The last (auto)vacuum.
    pub last_vacuum: Option<DateTime<Utc>>,
}

/// `pubsub_outbox`'s health from the statistics views.
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn outbox_table(conn: &mut PgConnection) -> Result<TableHealth> {
    sqlx::query_as(
        "SELECT COALESCE(n_live_tup, 0) AS live_rows, COALESCE(n_dead_tup, 0) AS dead_rows,
                pg_total_relation_size('pubsub_outbox') AS total_bytes,
                GREATEST(last_vacuum, last_autovacuum) AS last_vacuum
         FROM pg_stat_user_tables WHERE relname = 'pubsub_outbox'",
    )
    .persistent(crate::store::named_statements())
    .fetch_one(&mut *conn)
    .await
    .context("reading pubsub_outbox statistics")
}
