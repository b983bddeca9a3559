//! The console's own samples of the last hour (a ring buffer, no monitoring stack needed): per
//! topic the backlog and the oldest claimable age (the dispatchers' gauge query, capped), the
//! messages published per second (the increments of the replicas' heartbeat counters), and the
//! dead letters per second. Sampled every `--sample-interval`; the plots are drawn from here.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox_runtime::shutdown::Shutdown;
use outbox_shared::store::{dead_letter, held_topic, outbox, pause, replica};
use sqlx::PgPool;

use super::svg::Series;

/// What the plots show: one hour.
pub const SPAN: Duration = Duration::from_secs(3600);
/// Unpublished rows a sample reads at most (the dispatchers' gauges read as many).
const BACKLOG_CAP: i64 = 1_000_000;

/// One sample.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// When (the server's clock).
    pub at: DateTime<Utc>,
    /// Per topic: unpublished rows, oldest claimable age in seconds.
    pub topics: Vec<(String, i64, f64)>,
    /// Messages published per second since the previous sample (none for the first).
    pub published_per_s: Option<f64>,
    /// Dead letters per second since the previous sample (none for the first).
    pub dead_per_s: Option<f64>,
}

/// The ring of samples, and what the next one's rates are measured from.
#[derive(Debug, Default)]
pub struct Samples {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    ring: VecDeque<Sample>,
    /// Each replica's published counter at the last sample.
    published: HashMap<String, i64>,
    last_at: Option<DateTime<Utc>>,
}

impl Samples {
    /// The samples, oldest first.
    pub fn all(&self) -> Vec<Sample> {
        self.state
            .lock()
            .map(|s| s.ring.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// Adds a sample read at `at`: `replicas`' published counters and `dead` dead letters since
    /// the previous sample; drops samples older than the span.
    fn push(
        &self,
        at: DateTime<Utc>,
        topics: Vec<(String, i64, f64)>,
        replicas: &[(String, i64)],
        dead: i64,
    ) {
        let Ok(mut s) = self.state.lock() else {
            return;
        };
        let seconds = s
            .last_at
            .map(|last| (at - last).num_milliseconds() as f64 / 1000.0)
            .filter(|d| *d > 0.0);
        // Per replica: a counter that went down restarted; a new replica starts from 0.
        let published: i64 = replicas
            .iter()
            .map(|(id, now)| match s.published.get(id) {
                Some(before) if now >= before => now - before,
                Some(_) => *now,
                None if s.last_at.is_some() => *now,
                None => 0,
            })
            .sum();
        s.published = replicas.iter().cloned().collect();
        let sample = Sample {
            at,
            topics,
            published_per_s: seconds.map(|d| published as f64 / d),
            dead_per_s: seconds.map(|d| dead as f64 / d),
        };
        s.last_at = Some(at);
        s.ring.push_back(sample);
        let horizon = chrono::Duration::from_std(SPAN).unwrap_or(chrono::Duration::MAX);
        while s.ring.front().is_some_and(|f| at - f.at > horizon) {
            s.ring.pop_front();
        }
    }

    /// The plots' series: the backlog and the oldest claimable age per topic (the `max_topics`
    /// largest), published and dead-lettered per second; times as seconds before `now`.
    pub fn series(&self, now: DateTime<Utc>, max_topics: usize) -> Plots {
        let samples = self.all();
        let ago = |at: DateTime<Utc>| (now - at).num_milliseconds() as f64 / 1000.0;
        let mut peaks: BTreeMap<String, i64> = BTreeMap::new();
        for s in &samples {
            for (t, n, _) in &s.topics {
                let p = peaks.entry(t.clone()).or_default();
                *p = (*p).max(*n);
            }
        }
        let mut top: Vec<(String, i64)> = peaks.into_iter().collect();
        top.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        top.truncate(max_topics);
        let per_topic = |value: &dyn Fn(i64, f64) -> f64| -> Vec<Series> {
            top.iter()
                .map(|(topic, _)| Series {
                    name: topic.clone(),
                    points: samples
                        .iter()
                        .map(|s| {
                            let v = s
                                .topics
                                .iter()
                                .find(|(t, _, _)| t == topic)
                                .map_or(0.0, |(_, n, age)| value(*n, *age));
                            (ago(s.at), v)
                        })
                        .collect(),
                })
                .collect()
        };
        let rate = |name: &str, pick: &dyn Fn(&Sample) -> Option<f64>| Series {
            name: name.to_owned(),
            points: samples
                .iter()
                .filter_map(|s| pick(s).map(|v| (ago(s.at), v)))
                .collect(),
        };
        Plots {
            backlog: per_topic(&|n, _| n as f64),
            claimable_age: per_topic(&|_, age| age),
            published: vec![rate("published/s", &|s| s.published_per_s)],
            dead_letters: vec![rate("dead letters/s", &|s| s.dead_per_s)],
        }
    }
}

/// The series of the four plots.
#[derive(Debug, Clone, PartialEq)]
pub struct Plots {
    /// Unpublished rows per topic.
    pub backlog: Vec<Series>,
    /// Oldest claimable age per topic, seconds.
    pub claimable_age: Vec<Series>,
    /// Published per second.
    pub published: Vec<Series>,
    /// Dead letters per second.
    pub dead_letters: Vec<Series>,
}

/// Takes a sample every `interval` until shutdown (a failed one is logged and skipped).
pub async fn sample(
    pool: PgPool,
    samples: std::sync::Arc<Samples>,
    skip_dead_letter_topics: Vec<String>,
    interval: Duration,
    mut shutdown: Shutdown,
) {
    loop {
        if let Err(e) = sample_once(&pool, &samples, &skip_dead_letter_topics).await {
            tracing::warn!(error = %e, "A console sample failed; the plots skip it.");
        }
        tokio::select! { _ = tokio::time::sleep(interval) => {}, _ = shutdown.requested() => return }
    }
}

async fn sample_once(
    pool: &PgPool,
    samples: &Samples,
    skip: &[String],
) -> Result<(), outbox_shared::Error> {
    // Read-only, inside a transaction (as behind a transaction-mode pooler it must be).
    let mut conn = pool
        .begin()
        .await
        .map_err(|source| outbox_shared::Error::Database {
            context: "starting a console sample",
            source,
        })?;
    let (now, replicas) = replica::list(&mut conn).await?;
    let mut not_claimed: Vec<String> = pause::list(&mut conn)
        .await?
        .into_iter()
        .map(|p| p.topic)
        .collect();
    not_claimed.extend(held_topic::topics(&mut conn).await?);
    let backlog = outbox::backlog_by_topic(
        &mut conn,
        &outbox::BacklogQuery {
            now,
            topics: None,
            not_claimed: &not_claimed,
            skip_dead_letter_topics: skip,
            cap: BACKLOG_CAP,
        },
    )
    .await?;
    let since = samples
        .state
        .lock()
        .ok()
        .and_then(|s| s.last_at)
        .unwrap_or(now);
    let dead = dead_letter::failed_since(&mut conn, since, now).await?;
    let _ = conn.rollback().await;
    samples.push(
        now,
        backlog
            .into_iter()
            .map(|t| (t.topic, t.pending, t.claimable_age_secs))
            .collect(),
        &replicas
            .into_iter()
            .map(|r| (r.replica_id, r.published))
            .collect::<Vec<_>>(),
        dead,
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000 + secs, 0).unwrap_or_default()
    }

    #[test]
    fn rates_come_from_the_replicas_increments_and_survive_a_restart() {
        let s = Samples::default();
        s.push(at(0), vec![], &[("a".into(), 100), ("b".into(), 50)], 0);
        s.push(at(10), vec![], &[("a".into(), 200), ("b".into(), 60)], 5);
        // "b" restarted (its counter went down), "c" is new.
        s.push(
            at(20),
            vec![],
            &[("a".into(), 300), ("b".into(), 10), ("c".into(), 40)],
            0,
        );
        let rates: Vec<Option<f64>> = s.all().iter().map(|x| x.published_per_s).collect();
        assert_eq!(rates, vec![None, Some(11.0), Some(15.0)]);
        let dead: Vec<Option<f64>> = s.all().iter().map(|x| x.dead_per_s).collect();
        assert_eq!(dead, vec![None, Some(0.5), Some(0.0)]);
    }

    #[test]
    fn the_ring_keeps_an_hour_and_the_plots_its_largest_topics() {
        let s = Samples::default();
        for i in 0..400 {
            s.push(
                at(i * 10),
                vec![
                    ("small".into(), 1, 0.5),
                    ("big".into(), i, 2.0),
                    ("mid".into(), 10, 1.0),
                ],
                &[],
                0,
            );
        }
        assert_eq!(s.all().len(), 361, "one hour of 10 s samples");
        let plots = s.series(at(3990), 2);
        let names: Vec<&str> = plots.backlog.iter().map(|x| x.name.as_str()).collect();
        assert_eq!(names, vec!["big", "mid"]);
        assert_eq!(plots.claimable_age[0].points.last(), Some(&(0.0, 2.0)));
    }
}
