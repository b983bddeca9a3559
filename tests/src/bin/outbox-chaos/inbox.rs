//! The inbox consumer: the application topic's second subscription read through `outbox_inbox`
//! (`consume`, per-key lanes) into `effect` in the consumer database, one row per run of the
//! handler (deliberately non-idempotent: a key applied twice leaves two rows). PostgreSQL restarts
//! hit it (the consumer database is on the same cluster). With `--inbox-kills N` its task is
//! aborted mid-stream at N seeded moments (open transactions roll back, nothing is acked) and a
//! new one started; off by default, because the emulator never ends the dropped stream and, on
//! this ordered subscription, keeps routing that stream's ordering keys to it (docs/testing.md,
//! "Chaos"). The
//! verdict wants exactly one effect per dedupe key the independent subscriber saw on the topic:
//! none missing, none extra, none twice, and one inbox row per key.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow};
use google_cloud_pubsub::client::Subscriber;
use google_cloud_pubsub::model::Message;
use outbox_inbox::pubsub::{ConsumeOptions, consume};
use outbox_inbox::{Inbox, InboxCounters};
use sqlx::{PgConnection, PgPool};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

#[cfg(test)]
use crate::plan::Mode;
use crate::plan::Plan;

/// Dedupe keys the independent subscriber received on the application topic.
pub type Delivered = Arc<Mutex<HashSet<String>>>;

/// The consumer name the inbox keys on.
const CONSUMER: &str = "chaos-effects";

/// A running (or stopped) inbox consumer and its history.
pub struct InboxConsumer {
    inbox: Inbox,
    client: Subscriber,
    subscription: String,
    options: ConsumeOptions,
    task: Option<(JoinHandle<()>, oneshot::Sender<()>)>,
    starts: usize,
    /// When each abort happened (since the load started) and how many messages had been
    /// processed by then.
    kills: Vec<(Duration, u64)>,
}

impl InboxConsumer {
    /// Creates the inbox and `effect` tables in `pool`'s database and starts consuming.
    pub async fn start(pool: PgPool, subscription: String) -> Result<Self> {
        outbox_inbox::migrate(&pool).await?;
        sqlx::raw_sql(
            "CREATE TABLE IF NOT EXISTS effect (
                 seq bigserial, dedupe_key text NOT NULL, ordering_key text NOT NULL)",
        )
        .execute(&pool)
        .await
        .context("creating the effect table in the consumer database")?;
        let client = Subscriber::builder()
            .with_endpoint(harness::pubsub::endpoint())
            .with_credentials(google_cloud_auth::credentials::anonymous::Builder::new().build())
            .build()
            .await?;
        let options = ConsumeOptions {
            lanes: 4,
            // A PostgreSQL restart fails messages of held keys: wait for them a little only.
            hold_after_failure: Duration::from_secs(10),
            ..ConsumeOptions::new(CONSUMER)
        };
        let mut consumer = Self {
            inbox: Inbox::new(pool),
            client,
            subscription,
            options,
            task: None,
            starts: 0,
            kills: Vec::new(),
        };
        consumer.spawn();
        Ok(consumer)
    }

    fn spawn(&mut self) {
        let stream = self
            .client
            .subscribe(&self.subscription)
            .set_max_outstanding_messages(self.options.max_outstanding_messages())
            .set_max_lease_extension(Duration::from_secs(10))
            .build();
        let (inbox, options) = (self.inbox.clone(), self.options.clone());
        let (stop, stopped) = oneshot::channel();
        let subscription = self.subscription.clone();
        let task = tokio::spawn(async move {
            let shutdown = async {
                let _ = stopped.await;
            };
            if let Err(e) = consume(&inbox, stream, &options, apply, shutdown).await {
                eprintln!("outbox-chaos: inbox consumer on {subscription}: {e}");
            }
        });
        self.task = Some((task, stop));
        self.starts += 1;
    }

    /// Aborts the consumer's task wherever it is (a crash: nothing more is acked, open
    /// transactions roll back) and starts a new one.
    async fn kill_and_restart(&mut self, at: Duration) {
        if let Some((task, _)) = self.task.take() {
            task.abort();
            let _ = task.await;
        }
        self.kills.push((at, self.inbox.counters().processed));
        tokio::time::sleep(Duration::from_millis(500)).await;
        self.spawn();
    }

    /// Asks the consumer to stop and waits for it (bounded).
    async fn stop(&mut self) {
        if let Some((task, stop)) = self.task.take() {
            let _ = stop.send(());
            let abort = task.abort_handle();
            if tokio::time::timeout(Duration::from_secs(20), task)
                .await
                .is_err()
            {
                abort.abort();
            }
        }
    }
}

/// The handler: one `effect` row per run, in the inbox's transaction.
async fn apply(message: &Message, tx: &mut PgConnection) -> sqlx::Result<()> {
    let key = message
        .attributes
        .get(outbox_shared::DEFAULT_DEDUPE_ATTRIBUTE)
        .map(String::as_str)
        .unwrap_or_default();
    sqlx::query("INSERT INTO effect (dedupe_key, ordering_key) VALUES ($1, $2)")
        .bind(key)
        .bind(&message.ordering_key)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

/// When to abort the consumer: `plan.inbox_kills` seeded moments inside the load.
fn kill_times(plan: &Plan) -> Vec<Duration> {
    let mut rng = fastrand::Rng::with_seed(plan.seed ^ 0x1B0C_5EED);
    let mut at: Vec<Duration> = (0..plan.inbox_kills)
        .map(|_| plan.load.mul_f64(0.15 + 0.7 * rng.f64()))
        .collect();
    at.sort();
    at
}

/// Kills and restarts the consumer at the plan's moments (since `t0`).
pub async fn run_kills(
    consumer: &tokio::sync::Mutex<InboxConsumer>,
    plan: &Plan,
    t0: Instant,
) -> Result<()> {
    for at in kill_times(plan) {
        tokio::time::sleep_until((t0 + at).into()).await;
        consumer.lock().await.kill_and_restart(t0.elapsed()).await;
        println!(
            "  [{:>6.1}s] inbox consumer killed (task aborted) and restarted",
            t0.elapsed().as_secs_f64()
        );
    }
    Ok(())
}

/// What the inbox consumer did, and what the verdict found.
#[derive(Debug, Default, Clone)]
pub struct InboxFigures {
    pub counters: InboxCounters,
    pub starts: usize,
    /// (seconds since the load started, messages processed by then) per abort.
    pub kills: Vec<(f64, u64)>,
    /// Keys the independent subscriber received on the application topic.
    pub delivered: usize,
    /// Keys with at least one effect.
    pub applied: usize,
    pub missing: Vec<String>,
    pub extra: Vec<String>,
    /// Keys whose effect exists more than once, with the count.
    pub over_once: Vec<(String, i64)>,
    pub inbox_rows: i64,
    /// How long after the drain the consumer took to apply the last key.
    pub catch_up: Duration,
}

impl InboxFigures {
    pub fn failures(&self) -> Vec<String> {
        let mut f = Vec::new();
        if !self.missing.is_empty() {
            f.push(format!(
                "inbox: {} delivered keys without an effect (first: {:?})",
                self.missing.len(),
                &self.missing[..self.missing.len().min(5)]
            ));
        }
        if !self.extra.is_empty() {
            f.push(format!(
                "inbox: {} effects for keys never delivered (first: {:?})",
                self.extra.len(),
                &self.extra[..self.extra.len().min(5)]
            ));
        }
        if !self.over_once.is_empty() {
            f.push(format!(
                "inbox: {} keys applied more than once (first: {:?})",
                self.over_once.len(),
                &self.over_once[..self.over_once.len().min(5)]
            ));
        }
        if self.inbox_rows != self.applied as i64 {
            f.push(format!(
                "inbox: {} pubsub_inbox rows for {} applied keys",
                self.inbox_rows, self.applied
            ));
        }
        f
    }
}

/// After the drain: waits (up to 2 minutes, or 20 s without a new effect) until every delivered
/// key has its effect, stops the consumer, and judges the effects against `delivered`.
pub async fn settle(
    consumer: &tokio::sync::Mutex<InboxConsumer>,
    pool: &PgPool,
    delivered: &Delivered,
    t0: Instant,
) -> Result<InboxFigures> {
    let delivered: BTreeSet<String> = delivered
        .lock()
        .map_err(|_| anyhow!("delivered keys lock poisoned"))?
        .iter()
        .cloned()
        .collect();
    let started = Instant::now();
    let (mut last, mut since) = (-1i64, Instant::now());
    while started.elapsed() < Duration::from_secs(120) && since.elapsed() < Duration::from_secs(20)
    {
        // Errors (a restart just ended) count as no progress.
        let applied: i64 = sqlx::query_scalar("SELECT count(DISTINCT dedupe_key) FROM effect")
            .fetch_one(pool)
            .await
            .unwrap_or(last);
        if applied as usize >= delivered.len() {
            break;
        }
        if applied != last {
            (last, since) = (applied, Instant::now());
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let catch_up = started.elapsed();
    // Redeliveries of what the last abort held arrive within the ack deadline (10 s); each
    // must be dropped as a duplicate, not applied again.
    let since_kill = consumer
        .lock()
        .await
        .kills
        .last()
        .map(|(at, _)| t0.elapsed().saturating_sub(*at));
    if let Some(since) = since_kill
        && since < Duration::from_secs(12)
    {
        tokio::time::sleep(Duration::from_secs(12) - since).await;
    }
    let mut c = consumer.lock().await;
    c.stop().await;

    let per_key: HashMap<String, i64> =
        sqlx::query_as("SELECT dedupe_key, count(*) FROM effect GROUP BY dedupe_key")
            .fetch_all(pool)
            .await?
            .into_iter()
            .collect();
    let inbox_rows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pubsub_inbox WHERE consumer = $1")
            .bind(CONSUMER)
            .fetch_one(pool)
            .await?;
    let applied: BTreeSet<String> = per_key.keys().cloned().collect();
    let mut over_once: Vec<(String, i64)> = per_key.into_iter().filter(|(_, n)| *n > 1).collect();
    over_once.sort();
    Ok(InboxFigures {
        counters: c.inbox.counters(),
        starts: c.starts,
        kills: c
            .kills
            .iter()
            .map(|(at, n)| (at.as_secs_f64(), *n))
            .collect(),
        delivered: delivered.len(),
        applied: applied.len(),
        missing: delivered.difference(&applied).cloned().collect(),
        extra: applied.difference(&delivered).cloned().collect(),
        over_once,
        inbox_rows,
        catch_up,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kill_moments_are_seeded_and_inside_the_load() {
        let mut plan = Plan::new(Mode::Short, 42);
        assert!(kill_times(&plan).is_empty(), "none unless asked for");
        plan.inbox_kills = 2;
        let at = kill_times(&plan);
        let mut again = Plan::new(Mode::Short, 42);
        again.inbox_kills = 2;
        assert_eq!(at, kill_times(&again), "same seed");
        assert_eq!(at.len(), 2);
        assert!(
            at.iter().all(|t| *t > Duration::ZERO && *t < plan.load),
            "{at:?}"
        );
    }
}
