//! The gauges of the outbox's state, sampled every 10 s from the database (backlog, ages, dead
//! letters, paused topics, blocked keys, the pool), and the once-a-minute progress line. A topic
//! gone from a sample reads 0, never its last value.

use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use sqlx::{PgConnection, PgPool};

use outbox_runtime::shutdown::Shutdown;
use outbox_shared::store::{dead_letter, held_topic, outbox, pause};

use crate::metrics::{Labels, Metrics};
use crate::refusals::schema::SchemaGate;

/// Cap on the backlog count (an index-only scan that stops here).
const BACKLOG_CAP: i64 = 1_000_000;

/// Refreshes the gauges every 10 s (per topic, only the topics this replica serves: backlog, oldest
/// due age, claimable age, dead letters, paused; blocked keys; pool connections), and logs progress
/// once a minute while there is traffic or a backlog.
pub(crate) async fn sample_gauges(
    pool: PgPool,
    schema: Arc<SchemaGate>,
    metrics: Arc<Metrics>,
    topics: Option<Vec<String>>,
    skip_topics: Vec<String>,
    mut shutdown: Shutdown,
) {
    let mut sampler = Gauges {
        progress: Progress::new(metrics.published.get()),
        metrics,
        topics,
        skip_topics,
        blocked_log: BlockedLog::default(),
        seen: Seen::default(),
    };
    loop {
        sampler.sample_pool(&pool);
        // Every statement inside a transaction, as behind a transaction-mode pooler it must be.
        // On a schema behind this release there are no tables to read (the gate says why).
        match pool.begin().await {
            Ok(_) if !schema.is_open() => {}
            Ok(mut conn) => {
                // The paused and held topics first: the claimable age leaves their rows out.
                let mut not_claimed = sampler.sample_paused(&mut conn).await;
                match held_topic::topics(&mut conn).await {
                    Ok(held) => not_claimed.extend(held),
                    Err(e) => tracing::warn!(error = %e, "Reading the held topics failed."),
                }
                sampler.sample_backlog(&mut conn, &not_claimed).await;
                sampler.sample_dead_letters(&mut conn).await;
                sampler.sample_blocked_keys(&mut conn).await;
                let _ = conn.commit().await;
            }
            Err(e) => tracing::warn!(error = %e, "No database connection for the gauges."),
        }
        tokio::select! { _ = tokio::time::sleep(Duration::from_secs(10)) => {}, _ = shutdown.requested() => return }
    }
}

/// What the gauge sampler keeps between samples.
struct Gauges {
    metrics: Arc<Metrics>,
    /// The topics this replica serves (`None`: all).
    topics: Option<Vec<String>>,
    skip_topics: Vec<String>,
    progress: Progress,
    blocked_log: BlockedLog,
    seen: Seen,
}

impl Gauges {
    fn sample_pool(&self, pool: &PgPool) {
        let idle = i64::try_from(pool.num_idle()).unwrap_or(i64::MAX);
        let pool_gauge = |state: &str| {
            self.metrics
                .pool_connections
                .get_or_create(&vec![("state", state.to_owned())])
                .clone()
        };
        pool_gauge("idle").set(idle);
        pool_gauge("in_use").set(i64::from(pool.size()) - idle);
    }

    /// Sets the paused gauges of the served topics; returns every paused topic.
    async fn sample_paused(&self, conn: &mut PgConnection) -> Vec<String> {
        match pause::list(conn).await {
            Ok(paused) => {
                self.metrics.paused.clear();
                let topics = self.topics.as_deref();
                for p in paused
                    .iter()
                    .filter(|p| topics.is_none_or(|t| t.contains(&p.topic)))
                {
                    self.metrics
                        .paused
                        .get_or_create(&vec![("topic", p.topic.clone())])
                        .set(1);
                }
                paused.into_iter().map(|p| p.topic).collect()
            }
            Err(e) => {
                tracing::warn!(error = %e, "Reading the paused topics failed.");
                Vec::new()
            }
        }
    }

    /// Backlog, oldest due age and claimable age per served topic (a drained topic reads 0).
    async fn sample_backlog(&mut self, conn: &mut PgConnection, not_claimed: &[String]) {
        let query = outbox::BacklogQuery {
            now: Utc::now(),
            topics: self.topics.as_deref(),
            not_claimed,
            skip_dead_letter_topics: &self.skip_topics,
            cap: BACKLOG_CAP,
        };
        let b = match outbox::backlog_by_topic(conn, &query).await {
            Ok(b) => b,
            Err(e) => return tracing::warn!(error = %e, "Reading the backlog failed."),
        };
        let metrics = &self.metrics;
        let labels = |t: &str| vec![("topic", t.to_owned())];
        let now: Vec<Labels> = b.iter().map(|t| labels(&t.topic)).collect();
        self.seen.zero_gone(&now, |gone| {
            metrics.backlog.get_or_create(gone).set(0);
            metrics.oldest_due_age_seconds.get_or_create(gone).set(0.0);
            metrics.claimable_age_seconds.get_or_create(gone).set(0.0);
        });
        for t in &b {
            let l = labels(&t.topic);
            metrics.backlog.get_or_create(&l).set(t.pending);
            metrics
                .oldest_due_age_seconds
                .get_or_create(&l)
                .set(t.oldest_due_age_secs);
            metrics
                .claimable_age_seconds
                .get_or_create(&l)
                .set(t.claimable_age_secs);
        }
        self.progress.log(metrics, &b);
    }

    async fn sample_dead_letters(&mut self, conn: &mut PgConnection) {
        match dead_letter::counts(conn, self.topics.as_deref()).await {
            Ok(counts) => {
                let labels =
                    |t: &str, k: &str| vec![("topic", t.to_owned()), ("kind", k.to_owned())];
                self.seen.reset_dead(
                    &self.metrics.dead_letters,
                    counts.iter().map(|(t, k, _)| labels(t, k)),
                );
                for (t, k, n) in &counts {
                    self.metrics
                        .dead_letters
                        .get_or_create(&labels(t, k))
                        .set(*n);
                }
            }
            Err(e) => tracing::warn!(error = %e, "Counting the dead letters failed."),
        }
    }

    async fn sample_blocked_keys(&mut self, conn: &mut PgConnection) {
        match dead_letter::blocked_keys(conn, &self.skip_topics, self.topics.as_deref()).await {
            Ok(n) => {
                self.metrics.blocked_keys.set(n);
                self.blocked_log.log(n);
            }
            Err(e) => tracing::warn!(error = %e, "Counting the blocked ordering keys failed."),
        }
    }
}

/// Label sets the gauge families had at the last sample: those gone since are set to 0, so a
/// drained topic reads 0 instead of its last value.
#[derive(Default)]
struct Seen {
    topics: Vec<Labels>,
    dead: Vec<Labels>,
}

impl Seen {
    /// Calls `zero` for each topic label set seen last time and not now.
    fn zero_gone(&mut self, now: &[Labels], mut zero: impl FnMut(&Labels)) {
        for gone in self.topics.iter().filter(|l| !now.contains(l)) {
            zero(gone);
        }
        self.topics = now.to_vec();
    }

    fn reset_dead(&mut self, family: &Family<Labels, Gauge>, now: impl Iterator<Item = Labels>) {
        let now: Vec<Labels> = now.collect();
        for gone in self.dead.iter().filter(|l| !now.contains(l)) {
            family.get_or_create(gone).set(0);
        }
        self.dead = now;
    }
}

/// The once-a-minute progress line.
struct Progress {
    last_published: u64,
    last_report: std::time::Instant,
}

impl Progress {
    fn new(published: u64) -> Self {
        Self {
            last_published: published,
            last_report: std::time::Instant::now(),
        }
    }

    fn log(&mut self, metrics: &Metrics, backlog: &[outbox::TopicBacklog]) {
        let elapsed = self.last_report.elapsed();
        if elapsed < Duration::from_secs(60) {
            return;
        }
        let published = metrics.published.get();
        let delta = published - self.last_published;
        let pending: i64 = backlog.iter().map(|t| t.pending).sum();
        let oldest = backlog
            .iter()
            .map(|t| t.oldest_due_age_secs)
            .fold(0.0, f64::max);
        if delta > 0 || pending > 0 {
            tracing::info!(
                published = delta,
                per_second = (delta as f64 / elapsed.as_secs_f64()).round(),
                backlog = pending,
                oldest_due_age_secs = oldest,
                "Published messages in the last minute, and the backlog."
            );
        }
        self.last_published = published;
        self.last_report = std::time::Instant::now();
    }
}

/// Blocked keys are alert-worthy but not every 10 s: logged when the count changes, else once a
/// minute.
struct BlockedLog {
    last: i64,
    logged_at: std::time::Instant,
}

impl Default for BlockedLog {
    fn default() -> Self {
        Self {
            last: 0,
            logged_at: std::time::Instant::now(),
        }
    }
}

impl BlockedLog {
    fn log(&mut self, n: i64) {
        if n > 0 && (n != self.last || self.logged_at.elapsed() >= Duration::from_secs(60)) {
            tracing::error!(
                blocked_keys = n,
                "Ordering keys are blocked by dead letters: replay or discard them (dispatcher status names them)."
            );
            self.logged_at = std::time::Instant::now();
        }
        self.last = n;
    }
}
