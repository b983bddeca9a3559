//! The held topics' watch (`crate::refusals::hold` says what a hold is): each replica reads the
//! held topics every [`WATCH_EVERY`] into its memory, and takes the probes due, one replica at a
//! time per topic: a batch of one, the topic's head message (`crate::batch::probe_held`).

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox_runtime::shutdown::Shutdown;
use outbox_shared::store::held_topic::{self, HeldTopic};

use crate::batch;
use crate::batch::dispatch::Dispatch;
use crate::batch::outcome::BatchOutcome;
use crate::error::DispatcherError;
use crate::pubsub::publish::Publish;

/// How often each replica reads the held topics and looks for a probe due.
pub(crate) const WATCH_EVERY: Duration = Duration::from_millis(500);

/// What one probe of a held topic found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probe {
    /// Pub/Sub accepted it: the topic is released.
    Released,
    /// Refused alike: the topic stays held.
    StillRefused,
    /// No unpublished row left: the hold ended.
    Emptied,
    /// Its rows are all waiting for a retry: nothing to probe with yet.
    NothingDue,
}

/// Reads the held topics (this replica's `--topic`s only, when given) into `d.holds` and probes
/// each one due at `now` whose probe this replica takes. Returns what each probe found.
pub(crate) async fn probe_due<P: Publish>(
    d: &Dispatch<P>,
    now: DateTime<Utc>,
) -> Result<Vec<(String, Probe)>, DispatcherError> {
    let mut tx = begin(d, "reading the held topics").await?;
    let served = |t: &str| {
        d.settings
            .topics
            .as_ref()
            .is_none_or(|s| s.iter().any(|x| x == t))
    };
    let mut held: Vec<HeldTopic> = held_topic::list(&mut tx).await?;
    held.retain(|h| served(&h.topic));
    let _ = tx.commit().await;
    let due: Vec<String> = held
        .iter()
        .filter(|h| h.next_probe_at <= now)
        .map(|h| h.topic.clone())
        .collect();
    d.holds.set(held);
    let mut found = Vec::new();
    for topic in due {
        let mut tx = begin(d, "taking a held topic's probe").await?;
        let max = d.refusals.held_max_probe_interval;
        let taken = held_topic::take_probe(&mut tx, &topic, now, max).await?;
        let _ = tx.commit().await;
        if taken {
            let probe = probe(d, &topic, now).await?;
            found.push((topic, probe));
        }
    }
    Ok(found)
}

/// One probe: a batch of one, the topic's head message.
async fn probe<P: Publish>(
    d: &Dispatch<P>,
    topic: &str,
    now: DateTime<Utc>,
) -> Result<Probe, DispatcherError> {
    d.metrics.held_topic_probes.inc();
    match batch::probe_held(d, topic, now).await? {
        BatchOutcome::Empty => {
            let mut tx = begin(d, "ending an empty hold").await?;
            let emptied = held_topic::release_if_empty(&mut tx, topic).await?;
            let _ = tx.commit().await;
            if emptied {
                d.holds.remove(topic);
                tracing::info!(
                    pubsub.topic = topic,
                    "The topic is no longer held: no unpublished message of it is left."
                );
                Ok(Probe::Emptied)
            } else {
                Ok(Probe::NothingDue)
            }
        }
        BatchOutcome::Settled(s) if s.unheld => Ok(Probe::Released),
        _ => Ok(Probe::StillRefused),
    }
}

/// The gauges of held topics (seconds held) and of topics slowed down by quota (their backoff).
fn sample<P>(d: &Dispatch<P>) {
    let now = Utc::now();
    let m = &d.metrics;
    m.topic_held_seconds.clear();
    for h in d.holds.all() {
        let held = (now - h.held_since).num_milliseconds().max(0) as f64 / 1000.0;
        m.topic_held_seconds
            .get_or_create(&vec![("topic", h.topic)])
            .set(held);
    }
    m.quota_backoff_seconds.clear();
    for (topic, backoff) in d.paces.backoffs() {
        m.quota_backoff_seconds
            .get_or_create(&vec![("topic", topic)])
            .set(backoff.as_secs_f64());
    }
}

/// A transaction on the dispatcher's pool (every statement in one, as behind a transaction-mode
/// pooler it must be).
async fn begin<P>(
    d: &Dispatch<P>,
    context: &'static str,
) -> Result<sqlx::Transaction<'static, sqlx::Postgres>, DispatcherError> {
    d.pool
        .begin()
        .await
        .map_err(|source| DispatcherError::from(outbox_shared::Error::Database { context, source }))
}

/// Probes the held topics every [`WATCH_EVERY`] until shutdown.
pub(crate) async fn watch<P: Publish>(d: Arc<Dispatch<P>>, mut shutdown: Shutdown) {
    loop {
        if d.schema.is_open() && d.breaker.is_closed() {
            match probe_due(&d, Utc::now()).await {
                Ok(found) => {
                    for (topic, probe) in found {
                        tracing::debug!(pubsub.topic = %topic, ?probe, "A held topic was probed.");
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "Probing the held topics failed; tried again shortly.")
                }
            }
        }
        sample(&d);
        tokio::select! {
            _ = tokio::time::sleep(WATCH_EVERY) => {}
            _ = shutdown.requested() => return,
        }
    }
}
