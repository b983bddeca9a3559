//! Held topics: a topic Pub/Sub refuses as a whole is not its messages' fault.
//!
//! While an IAM grant propagates (PERMISSION_DENIED, for minutes), before a topic exists
//! (NOT_FOUND: created after its writers), while its CMEK key is disabled (FAILED_PRECONDITION)
//! or when a proxy does not route it (UNIMPLEMENTED), every request to the topic fails alike
//! (`crate::pubsub::classify::CODES` says which codes). Dead-lettering would turn a deployment's
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
//! (`crate::tasks::hold_watch`, which also takes the probes due)
//! and updated at once by its own batches, so the claims pass them as a parameter instead of
//! reading another table. A replica that has not seen a new hold yet sends one more doomed
//! request at most per batch: it costs nothing either.
//!
//! [`RefusalSettings::held_probe_interval`]: crate::config::RefusalSettings
//! [`RefusalSettings::held_max_probe_interval`]: crate::config::RefusalSettings

use std::sync::Mutex;

use chrono::{DateTime, Utc};
use outbox_shared::store::held_topic::HeldTopic;

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

    /// What the table holds now (the watch's read).
    pub(crate) fn set(&self, topics: Vec<HeldTopic>) {
        *self.lock() = topics;
    }
}
