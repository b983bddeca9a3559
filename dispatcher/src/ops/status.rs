//! `dispatcher status`: what is stuck and why, in one look (the SQL is in
//! `outbox_shared::store::status`, `replica` and `pause`).

use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox_runtime::operator::{Command, Common, Exit, OpsError, Output};
use outbox_runtime::table::Table;
use outbox_shared::store::status::{
    BlockedKey, LongTransaction, StreamState, TableHealth, TopicState,
};
use outbox_shared::store::{pause, replica, status};
use serde::Serialize;
use sqlx::PgPool;

use crate::config::SkipDeadLetters;

/// A replica whose heartbeat is older than this is shown as gone.
pub const STALE_AFTER: Duration = Duration::from_secs(30);

/// `status` options.
#[derive(Debug, Clone, clap::Args)]
pub struct StatusArgs {
    #[command(flatten)]
    pub common: Common,
    /// Warn about transactions open longer than this (they hold back vacuum on the outbox).
    #[arg(long, default_value = "5m", value_parser = humantime::parse_duration)]
    pub long_transaction: Duration,
    #[command(flatten)]
    pub skip_dead_letters: SkipDeadLetters,
}

/// A replica as `status` reports it.
#[derive(Debug, Clone, Serialize)]
pub struct ReplicaStatus {
    #[serde(flatten)]
    pub replica: replica::Replica,
    /// Seconds since its last heartbeat.
    pub heartbeat_age_seconds: f64,
    /// Whether it is alive (heartbeat younger than 30 s).
    pub alive: bool,
}

/// Everything `status --json` prints (a stable shape: fields are only ever added).
#[derive(Debug, Clone, Serialize)]
pub struct Status {
    /// The server's clock.
    pub now: DateTime<Utc>,
    pub topics: Vec<TopicState>,
    pub paused: Vec<pause::PausedTopic>,
    pub blocked_keys: Vec<BlockedKey>,
    pub streams: Vec<StreamStatus>,
    pub replicas: Vec<ReplicaStatus>,
    pub long_transactions: Vec<LongTransaction>,
    pub outbox_table: TableHealth,
    /// What needs action, one sentence each.
    pub warnings: Vec<String>,
}

/// A producer stream as `status` reports it.
#[derive(Debug, Clone, Serialize)]
pub struct StreamStatus {
    #[serde(flatten)]
    pub stream: StreamState,
    /// The watermark as a time.
    pub watermark_at: Option<DateTime<Utc>>,
    /// Seconds the watermark is behind now.
    pub lag_seconds: Option<f64>,
}

/// A checked `status`.
#[derive(Debug, Clone)]
pub struct Settings {
    long_transaction: Duration,
    skip_dead_letter_topics: Vec<String>,
}

impl Command for StatusArgs {
    type Checked = Settings;

    fn check(&self, _now: DateTime<Utc>) -> Result<Settings, OpsError> {
        Ok(Settings {
            long_transaction: self.long_transaction,
            skip_dead_letter_topics: self.skip_dead_letters.topics.clone(),
        })
    }

    async fn run(settings: Settings, pool: &PgPool) -> Result<Output, OpsError> {
        let s = read(&settings, pool).await?;
        Output::new(render(&s), &s, Exit::Ok)
    }
}

/// Reads everything `status` shows.
async fn read(args: &Settings, pool: &PgPool) -> Result<Status, OpsError> {
    // Read-only, inside a transaction (as behind a transaction-mode pooler it must be).
    let mut conn = pool.begin().await?;
    let (now, replicas) = replica::list(&mut conn).await?;
    let topics = status::topics(&mut conn, now, &args.skip_dead_letter_topics).await?;
    let paused = pause::list(&mut conn).await?;
    let blocked_keys = status::blocked_keys(&mut conn, &args.skip_dead_letter_topics).await?;
    let streams = status::streams(&mut conn)
        .await?
        .into_iter()
        .map(|s| {
            let at = DateTime::<Utc>::from_timestamp_micros(s.watermark_micros);
            StreamStatus {
                lag_seconds: at.map(|t| seconds(now - t)),
                watermark_at: at,
                stream: s,
            }
        })
        .collect();
    let long_transactions =
        status::long_transactions(&mut conn, args.long_transaction.as_secs_f64()).await?;
    let outbox_table = status::outbox_table(&mut conn).await?;
    let replicas: Vec<ReplicaStatus> = replicas
        .into_iter()
        .map(|r| {
            let age = seconds(now - r.heartbeat_at);
            ReplicaStatus {
                replica: r,
                heartbeat_age_seconds: age,
                alive: age <= STALE_AFTER.as_secs_f64(),
            }
        })
        .collect();
    let mut s = Status {
        now,
        topics,
        paused,
        blocked_keys,
        streams,
        replicas,
        long_transactions,
        outbox_table,
        warnings: Vec::new(),
    };
    s.warnings = warnings(&s, args);
    Ok(s)
}

fn seconds(d: chrono::Duration) -> f64 {
    d.num_milliseconds() as f64 / 1000.0
}

fn warnings(s: &Status, args: &Settings) -> Vec<String> {
    let mut w = Vec::new();
    for k in &s.blocked_keys {
        w.push(format!(
            "ordering key {:?} of {} is blocked by dead letter {} ({} message(s) wait): inspect it \
             (dispatcher dead-letters show {}), then replay or discard it",
            k.ordering_key, k.topic, k.dead_letter_id, k.waiting, k.dead_letter_id
        ));
    }
    for t in s.topics.iter().filter(|t| t.dead_recent > 0) {
        w.push(format!(
            "{} message(s) of {} were dead-lettered in the last 15 minutes: dispatcher dead-letters list --topic {}",
            t.dead_recent, t.topic, t.topic
        ));
    }
    for r in s.replicas.iter().filter(|r| !r.alive) {
        w.push(format!(
            "replica {} ({}) has not sent a heartbeat for {:.0} s: it is gone or wedged (its row is \
             forgotten after the replicas' --forget-replicas-after; dispatcher replicas prune \
             --reason … removes it now)",
            r.replica.replica_id, r.replica.hostname, r.heartbeat_age_seconds
        ));
    }
    for t in &s.long_transactions {
        w.push(format!(
            "transaction of pid {} ({}, {}) has been open {:.0} s (> {:?}): it holds back vacuum on the outbox",
            t.pid,
            if t.application_name.is_empty() { "no application name" } else { &t.application_name },
            t.state.as_deref().unwrap_or("unknown state"),
            t.age_seconds,
            args.long_transaction
        ));
    }
    let table = &s.outbox_table;
    if table.dead_rows > 100_000 && table.dead_rows > table.live_rows {
        w.push(format!(
            "pubsub_outbox has {} dead rows for {} live ones: vacuum is behind (a long transaction?)",
            table.dead_rows, table.live_rows
        ));
    }
    for p in &s.paused {
        w.push(format!(
            "{} is paused since {} by {}: {}",
            p.topic, p.paused_at, p.paused_by, p.reason
        ));
    }
    w
}

/// The tables people read.
fn render(s: &Status) -> String {
    let mut out = topics_table(s);
    for table in [streams_table(s), replicas_table(s)] {
        if !table.is_empty() {
            out.push('\n');
            out.push_str(&table.render());
        }
    }
    out.push_str(&format!(
        "\noutbox table: {} live rows, {} dead rows, {} MiB\n",
        s.outbox_table.live_rows,
        s.outbox_table.dead_rows,
        s.outbox_table.total_bytes / (1024 * 1024)
    ));
    if s.warnings.is_empty() {
        out.push_str("No warnings.\n");
    } else {
        out.push_str("\nWarnings:\n");
        for w in &s.warnings {
            out.push_str(&format!("- {w}\n"));
        }
    }
    out
}

/// Per topic: due, held, waiting, next due, oldest due age, dead letters, paused.
fn topics_table(s: &Status) -> String {
    let mut t = Table::new(&[
        "TOPIC",
        "DUE",
        "HELD",
        "WAITING",
        "NEXT DUE",
        "OLDEST DUE AGE",
        "DEAD (perm/exh/rej)",
        "PAUSED",
    ]);
    for topic in &s.topics {
        t.row(vec![
            topic.topic.clone(),
            topic.due_now.to_string(),
            topic.held.to_string(),
            topic.waiting.to_string(),
            topic.next_due_at.map_or("-".to_owned(), |d| d.to_rfc3339()),
            format!("{:.1}s", topic.oldest_due_age_seconds),
            format!(
                "{}/{}/{}",
                topic.dead_permanent, topic.dead_exhausted, topic.dead_rejected
            ),
            if topic.paused { "yes" } else { "no" }.to_owned(),
        ]);
    }
    if t.is_empty() {
        "No topic has messages or dead letters.\n".to_owned()
    } else {
        t.render()
    }
}

/// Per producer stream: watermark, lag, last run.
fn streams_table(s: &Status) -> Table {
    let mut streams = Table::new(&[
        "STREAM",
        "WATERMARK",
        "LAG",
        "LAST RUN",
        "OUTCOME",
        "ENQUEUED",
    ]);
    for st in &s.streams {
        streams.row(vec![
            st.stream.stream.clone(),
            st.watermark_at.map_or("-".to_owned(), |t| t.to_rfc3339()),
            st.lag_seconds
                .map_or("-".to_owned(), |l| format!("{l:.0}s")),
            st.stream
                .last_run_started_at
                .map_or("-".to_owned(), |t| t.to_rfc3339()),
            st.stream
                .last_run_outcome
                .clone()
                .unwrap_or_else(|| "-".to_owned()),
            st.stream
                .last_run_enqueued
                .map_or("-".to_owned(), |n| n.to_string()),
        ]);
    }
    streams
}

/// Per dispatcher replica: heartbeat age, breaker, in flight, alive or gone.
fn replicas_table(s: &Status) -> Table {
    let mut replicas = Table::new(&[
        "REPLICA",
        "HOST",
        "STARTED",
        "HEARTBEAT AGE",
        "BREAKER",
        "IN FLIGHT (batches/rows)",
        "STATE",
    ]);
    for r in &s.replicas {
        replicas.row(vec![
            r.replica.replica_id.clone(),
            r.replica.hostname.clone(),
            r.replica.started_at.to_rfc3339(),
            format!("{:.0}s", r.heartbeat_age_seconds),
            if r.replica.breaker_open {
                "open"
            } else {
                "closed"
            }
            .to_owned(),
            format!(
                "{}/{}",
                r.replica.batches_in_flight, r.replica.rows_in_flight
            ),
            if r.alive { "alive" } else { "gone" }.to_owned(),
        ]);
    }
    replicas
}
