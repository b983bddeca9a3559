//! `dispatcher status`: what is stuck and why, in one look (the SQL is in
//! `outbox_shared::store::status`, `replica` and `pause`).

use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox_runtime::operator::{Command, Common, Exit, OpsError, Output};
use outbox_runtime::table::{Table, duration, instant};
use outbox_shared::release::Feature;
use outbox_shared::store::status::{
    BlockedKey, BlockedQuery, BlockedTopic, HeldTopicState, LongTransaction, StreamState,
    TableHealth, TopicState,
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
    /// List at most this many blocked ordering keys (the first, by topic and key); every topic's
    /// count is given whatever this is, and `dispatcher dead-letters blocked --topic T` pages
    /// through the rest.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(i64).range(0..=10_000))]
    pub blocked_keys: i64,
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
    /// Topics Pub/Sub refuses as a whole, held: the code, its message, since when, the rows
    /// waiting, the next probe.
    pub held_topics: Vec<HeldTopicState>,
    /// The first `--blocked-keys` blocked keys, by topic and key (`blocked_topics` counts all).
    pub blocked_keys: Vec<BlockedKey>,
    /// Per topic: how many keys are blocked, how many messages wait behind them.
    pub blocked_topics: Vec<BlockedTopic>,
    pub streams: Vec<StreamStatus>,
    pub replicas: Vec<ReplicaStatus>,
    /// The live replicas by release, newest first (two during a rollout).
    pub releases: Vec<replica::LiveRelease>,
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
    blocked_keys: i64,
    skip_dead_letter_topics: Vec<String>,
}

impl Command for StatusArgs {
    type Checked = Settings;

    fn check(&self, _now: DateTime<Utc>) -> Result<Settings, OpsError> {
        Ok(Settings {
            long_transaction: self.long_transaction,
            blocked_keys: self.blocked_keys,
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
    let releases = replica::live_releases(&mut conn, STALE_AFTER).await?;
    let topics = status::topics(&mut conn, now, &args.skip_dead_letter_topics).await?;
    let paused = pause::list(&mut conn).await?;
    let held_topics = status::held_topics(&mut conn).await?;
    let blocked_keys = status::blocked_keys(
        &mut conn,
        &BlockedQuery {
            skip_topics: &args.skip_dead_letter_topics,
            topic: None,
            after: None,
            limit: args.blocked_keys,
        },
    )
    .await?;
    let blocked_topics = status::blocked_topics(&mut conn, &args.skip_dead_letter_topics).await?;
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
        held_topics,
        blocked_keys,
        blocked_topics,
        streams,
        replicas,
        releases,
        long_transactions,
        outbox_table,
        warnings: Vec::new(),
    };
    s.warnings = warnings(&s, args);
    Ok(s)
}

/// One warning per topic with blocked keys, however many (an incident can block thousands): the
/// key and its dead letter when there is one, else the count and the first few listed.
fn blocked_warning(t: &BlockedTopic, listed: &[BlockedKey]) -> String {
    let first: Vec<&BlockedKey> = listed.iter().filter(|k| k.topic == t.topic).collect();
    match first.as_slice() {
        [k] if t.keys == 1 => format!(
            "ordering key {:?} of {} is blocked by dead letter {} ({} message(s) wait): inspect it \
             (dispatcher dead-letters show {}), then replay or discard it",
            k.ordering_key, k.topic, k.dead_letter_id, k.waiting, k.dead_letter_id
        ),
        _ => {
            let examples: Vec<String> = first
                .iter()
                .take(3)
                .map(|k| format!("{:?} (dead letter {})", k.ordering_key, k.dead_letter_id))
                .collect();
            format!(
                "{} ordering keys of {} are blocked by dead letters ({} message(s) wait behind \
                 them){}: dispatcher dead-letters blocked --topic {} lists them; inspect, then \
                 replay or discard (by filter: dead-letters replay --topic {} --dry-run)",
                t.keys,
                t.topic,
                t.waiting,
                if examples.is_empty() {
                    String::new()
                } else {
                    format!(", among them {}", examples.join(", "))
                },
                t.topic,
                t.topic
            )
        }
    }
}

fn seconds(d: chrono::Duration) -> f64 {
    d.num_milliseconds() as f64 / 1000.0
}

fn warnings(s: &Status, args: &Settings) -> Vec<String> {
    let mut w: Vec<String> = s.held_topics.iter().map(|h| held_warning(s, h)).collect();
    for t in &s.blocked_topics {
        w.push(blocked_warning(t, &s.blocked_keys));
    }
    for t in s.topics.iter().filter(|t| t.dead_recent > 0) {
        w.push(format!(
            "{} message(s) of {} were dead-lettered in the last 15 minutes: dispatcher dead-letters list --topic {}",
            t.dead_recent, t.topic, t.topic
        ));
    }
    w.extend(unreachable_warnings(s));
    w.extend(release_warnings(&s.releases));
    for r in s.replicas.iter().filter(|r| !r.alive) {
        w.push(format!(
            "replica {} ({}) has not sent a heartbeat for {}: it is gone or wedged (its row is \
             forgotten after the replicas' --forget-replicas-after; dispatcher replicas prune \
             --reason … removes it now)",
            r.replica.replica_id,
            r.replica.hostname,
            duration(r.heartbeat_age_seconds)
        ));
    }
    for t in &s.long_transactions {
        w.push(format!(
            "transaction of pid {} ({}, {}) has been open {} (> {}): it holds back vacuum on the outbox",
            t.pid,
            if t.application_name.is_empty() { "no application name" } else { &t.application_name },
            t.state.as_deref().unwrap_or("unknown state"),
            duration(t.age_seconds),
            duration(args.long_transaction.as_secs_f64())
        ));
    }
    let table = &s.outbox_table;
    if table.dead_rows > 100_000 && table.dead_rows > table.live_rows {
        w.push(format!(
            "pubsub_outbox has {} dead tuples for {} live rows: vacuum is behind (a long transaction?)",
            table.dead_rows, table.live_rows
        ));
    }
    for p in &s.paused {
        w.push(format!(
            "{} is paused since {} by {}: {}",
            p.topic,
            instant(p.paused_at),
            p.paused_by,
            p.reason
        ));
    }
    w
}

/// The warning of a held topic.
fn held_warning(s: &Status, h: &HeldTopicState) -> String {
    let held = &h.hold;
    format!(
        "{} is held: Pub/Sub refuses it as a whole with {} ({}) since {} ({} ago, {} \
         refusal(s)); its {} message(s) wait untouched (nothing charged or dead-lettered) \
         and it is released by itself when a probe (next at {}) is accepted. {}",
        held.topic,
        held.code,
        held.message,
        instant(held.held_since),
        duration(seconds(s.now - held.held_since)),
        held.refusals,
        h.waiting,
        instant(held.next_probe_at),
        held_hint(&held.topic, &held.code)
    )
}

/// What to do about a topic held with `code`.
pub(crate) fn held_hint(topic: &str, code: &str) -> String {
    match code {
        "NOT_FOUND" => format!(
            "The topic does not exist: create it (Terraform's topics, or gcloud pubsub topics \
             create {topic}), or, if it was retired on purpose, cancel its messages: dispatcher \
             pending cancel --topic {topic} --reason \"…\" --dry-run, then --yes. Runbook: \"A \
             topic is held\""
        ),
        "PERMISSION_DENIED" => format!(
            "The dispatchers' account may not publish to it: grant roles/pubsub.publisher on \
             {topic} to the dispatcher's service account (terraform output \
             dispatcher_service_account_email; its Kubernetes service account is bound to it by \
             Workload Identity); a new grant takes up to about 7 minutes to apply. Runbook: \"A \
             topic is held\""
        ),
        _ => "Runbook: \"A topic is held\" (a grant still propagating, a topic not created yet, \
              a disabled CMEK key, a proxy's route)"
            .to_owned(),
    }
}

/// Pub/Sub unreachable: one warning per reason (every replica of an outage says the same).
fn unreachable_warnings(s: &Status) -> Vec<String> {
    let mut out = Vec::new();
    let mut unreachable: Vec<(&str, Vec<&str>)> = Vec::new();
    for r in s
        .replicas
        .iter()
        .filter(|r| r.alive && r.replica.breaker_open)
    {
        let reason = r
            .replica
            .breaker_reason
            .as_deref()
            .unwrap_or("no reason recorded (a replica of an older release: its /readyz says)");
        match unreachable.iter_mut().find(|(known, _)| *known == reason) {
            Some((_, ids)) => ids.push(&r.replica.replica_id),
            None => unreachable.push((reason, vec![&r.replica.replica_id])),
        }
    }
    for (reason, ids) in unreachable {
        out.push(format!(
            "Pub/Sub is unreachable from {} replica(s) ({}): {reason}. Their claims are paused and \
             no attempts are charged; they resume by themselves within a second of Pub/Sub \
             answering (runbook: \"The backlog is stuck\")",
            ids.len(),
            ids.join(", ")
        ));
    }
    out
}

/// "3 replica(s) on 0.2.0, 1 on 0.1.0": the live replicas by release.
pub fn releases_line(releases: &[replica::LiveRelease]) -> String {
    releases
        .iter()
        .enumerate()
        .map(|(i, r)| {
            format!(
                "{}{} on {}",
                r.replicas,
                if i == 0 { " replica(s)" } else { "" },
                r.version
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// One warning per live release that misreads a feature: what it misreads and what refuses.
fn release_warnings(releases: &[replica::LiveRelease]) -> Vec<String> {
    let mut out = Vec::new();
    for r in releases {
        for f in [Feature::CancelKeyed] {
            if !f.known_to(&r.version) {
                out.push(format!(
                    "{} replica(s) run {} ({}), which predates {}: it {}. `pending cancel` of such \
                     messages refuses until they run {} or later (docs/releases.md)",
                    r.replicas,
                    r.version,
                    r.replica_ids.join(", "),
                    f.since(),
                    f.misread(),
                    f.since()
                ));
            }
        }
    }
    out
}

/// The tables people read.
fn render(s: &Status) -> String {
    let mut out = topics_table(s);
    for table in [held_table(s), streams_table(s), replicas_table(s)] {
        if !table.is_empty() {
            out.push('\n');
            out.push_str(&table.render());
        }
    }
    if !s.releases.is_empty() {
        out.push_str(&format!("\nreleases: {}\n", releases_line(&s.releases)));
    }
    out.push_str(&format!(
        "\noutbox table: {} live rows, {} dead tuples (vacuum's backlog), {} MiB\n",
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
        "DEAD (perm/exh/rej/canc)",
        "PAUSED",
    ]);
    for topic in &s.topics {
        t.row(vec![
            topic.topic.clone(),
            topic.due_now.to_string(),
            topic.held.to_string(),
            topic.waiting.to_string(),
            topic.next_due_at.map_or("-".to_owned(), instant),
            // Nothing due (an empty topic, or only waiting rows): no age to give.
            if topic.due_now + topic.held == 0 {
                "-".to_owned()
            } else {
                duration(topic.oldest_due_age_seconds)
            },
            format!(
                "{}/{}/{}/{}",
                topic.dead_permanent,
                topic.dead_exhausted,
                topic.dead_rejected,
                topic.dead_cancelled
            ),
            match (topic.paused, topic.refused) {
                (true, _) => "yes",
                (false, true) => "held",
                (false, false) => "no",
            }
            .to_owned(),
        ]);
    }
    if t.is_empty() {
        "No topic has messages or dead letters.\n".to_owned()
    } else {
        t.render()
    }
}

/// Per held topic: the code, since when, the rows waiting, the next probe.
fn held_table(s: &Status) -> Table {
    let mut held = Table::new(&[
        "HELD TOPIC",
        "CODE",
        "SINCE",
        "WAITING",
        "REFUSALS",
        "NEXT PROBE",
        "PUB/SUB SAID",
    ]);
    for h in &s.held_topics {
        held.row(vec![
            h.hold.topic.clone(),
            h.hold.code.clone(),
            instant(h.hold.held_since),
            h.waiting.to_string(),
            h.hold.refusals.to_string(),
            instant(h.hold.next_probe_at),
            outbox_runtime::table::printable(&h.hold.message.chars().take(80).collect::<String>()),
        ]);
    }
    held
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
            st.watermark_at.map_or("-".to_owned(), instant),
            st.lag_seconds.map_or("-".to_owned(), duration),
            st.stream
                .last_run_started_at
                .map_or("-".to_owned(), instant),
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
        "RELEASE",
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
            match &r.replica.build_commit {
                Some(c) => format!("{} ({c})", r.replica.version),
                None => r.replica.version.clone(),
            },
            r.replica.hostname.clone(),
            instant(r.replica.started_at),
            duration(r.heartbeat_age_seconds),
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
