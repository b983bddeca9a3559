//! Held topics: a topic Pub/Sub refuses as a whole is not its messages' fault.
//!
//! While an IAM grant propagates (PERMISSION_DENIED, for minutes), before a topic exists
//! (NOT_FOUND: created after its writers), while its CMEK key is disabled (FAILED_PRECONDITION)
//! or when a proxy does not route it (UNIMPLEMENTED), every request to the topic fails alike
//! (`crate::classify::CODES` says which codes). Dead-lettering would turn a deployment's
//! condition into an operator's backlog of replays and block every key. So the batch that sees
//! it releases the topic's rows untouched (no attempt charged, nothing dead-lettered, every key
//! in order) and holds the topic (`pubsub_outbox_held_topic`, in its settle transaction); every
//! replica's claims then leave the topic alone, and the other topics flow at full speed.
//!
//! A held topic is probed with what the dispatcher really does: a batch of one, the topic's head
//! message (a key's head, in order, or the oldest unkeyed row), published. (`GetTopic` would
//! need `pubsub.topics.get`, which a publisher-only identity lacks: it would be refused while
//! publishing works.) One replica at a time takes each probe (`held_topic::take_probe`), the
//! first [`RefusalSettings::held_probe_interval`] after the refusal, then at doubling intervals
//! up to [`RefusalSettings::held_max_probe_interval`]. A probe that Pub/Sub accepts (or refuses
//! for the message's own fault: the topic answers) releases the topic in its own transaction,
//! and wakes the dispatchers; one refused alike keeps it held. With no unpublished row left (an
//! operator cancelled them), the hold ends.
//!
//! Each replica keeps the held topics in memory ([`Holds`]), read from the table every second
//! and updated at once by its own batches, so the claims pass them as a parameter instead of
//! reading another table. A replica that has not seen a new hold yet sends one more doomed
//! request at most per batch: it costs nothing either.
//!
//! [`RefusalSettings::held_probe_interval`]: crate::config::RefusalSettings
//! [`RefusalSettings::held_max_probe_interval`]: crate::config::RefusalSettings

use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox_runtime::shutdown::Shutdown;
use outbox_shared::store::held_topic::{self, HeldTopic};

use crate::batch::{self, BatchOutcome};
use crate::dispatch::Dispatch;
use crate::error::DispatcherError;
use crate::publisher::Publish;

/// How often each replica reads the held topics and looks for a probe due.
pub(crate) const WATCH_EVERY: Duration = Duration::from_millis(500);

/// The held topics as this replica knows them.
#[derive(Debug, Default)]
pub(crate) struct Holds {
    topics: Mutex<Vec<HeldTopic>>,
}

impl Holds {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<HeldTopic>> {
        match self.topics.lock() {
            Ok(t) => t,
            Err(poisoned) => poisoned.into_inner(),
        }
    }

    /// The held topics' names, appended to `out` (what the claims leave alone).
    pub(crate) fn held(&self, out: &mut Vec<String>) {
        out.extend(self.lock().iter().map(|h| h.topic.clone()));
    }

    /// Every held topic as last read (status-like views and the gauges).
    pub(crate) fn all(&self) -> Vec<HeldTopic> {
        self.lock().clone()
    }

    /// A batch of this replica held `topic` (before the next read of the table).
    pub(crate) fn add(&self, topic: &str, code: &str, message: &str, now: DateTime<Utc>) {
        let mut topics = self.lock();
        if !topics.iter().any(|h| h.topic == topic) {
            topics.push(HeldTopic {
                topic: topic.to_owned(),
                code: code.to_owned(),
                message: message.to_owned(),
                held_since: now,
                last_refused_at: now,
                refusals: 1,
                probes: 0,
                next_probe_at: now,
            });
        }
    }

    /// A probe of this replica released `topic`.
    pub(crate) fn remove(&self, topic: &str) {
        self.lock().retain(|h| h.topic != topic);
    }

    fn set(&self, topics: Vec<HeldTopic>) {
        *self.lock() = topics;
    }
}

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
