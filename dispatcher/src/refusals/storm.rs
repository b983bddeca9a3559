//! Poison storms: a topic whose messages Pub/Sub keeps refusing (a schema it validates, say).
//!
//! A refused request fails every message in it, so a batch's unkeyed rows, sent together, are
//! refused whole as soon as one of them is poisoned; isolation then finds the poisoned ones
//! (`crate::batch::isolate`). In a storm every batch would pay that first doomed request (every
//! message of it validated for nothing) before isolating. So a topic whose batch had an unkeyed
//! message refused on its own is *in a storm*: its unkeyed rows go straight in parts
//! (`Isolation::send_cut`), each in requests of its own, the good parts are published at the
//! first attempt and only the refused parts are isolated. A batch of the topic with none of its
//! unkeyed rows refused ends the storm (logged at info when it starts, at debug when it ends).
//! Keyed rows are never affected (a key is a request of its own already).

use std::collections::HashSet;
use std::sync::Mutex;

use outbox_shared::ClaimedMessage;

use crate::pubsub::classify::FailureKind;
use crate::pubsub::publish::Attempt;

/// The topics in a storm, shared by the workers of a process.
#[derive(Debug, Default)]
pub(crate) struct Storms {
    topics: Mutex<HashSet<String>>,
}

impl Storms {
    fn topics(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        match self.topics.lock() {
            Ok(t) => t,
            Err(poisoned) => poisoned.into_inner(),
        }
    }

    /// The unkeyed messages of `batch` whose topic storms (by index): they go in parts
    /// (`crate::batch::isolate::Isolation::send_cut`).
    pub(crate) fn in_storm(&self, batch: &[ClaimedMessage]) -> Vec<usize> {
        let topics = self.topics();
        if topics.is_empty() {
            return Vec::new();
        }
        (0..batch.len())
            .filter(|i| batch[*i].ordering_key.is_none() && topics.contains(&batch[*i].topic))
            .collect()
    }

    /// Learns from a batch's final attempts (after isolation, so an unkeyed message still refused
    /// was refused on its own): its topic starts or stays in a storm; a storming topic whose
    /// unkeyed messages were all published in this batch leaves it.
    pub(crate) fn learn(&self, claimed: &[ClaimedMessage], attempts: &[Attempt]) {
        let mut refused: HashSet<&str> = HashSet::new();
        let mut published: HashSet<&str> = HashSet::new();
        for (m, attempt) in claimed.iter().zip(attempts) {
            if m.ordering_key.is_some() {
                continue;
            }
            match attempt {
                Attempt::Failed(f) if f.kind == FailureKind::Permanent => {
                    refused.insert(m.topic.as_str());
                }
                Attempt::Published(_) => {
                    published.insert(m.topic.as_str());
                }
                _ => {}
            }
        }
        if refused.is_empty() && published.is_empty() {
            return;
        }
        let mut topics = self.topics();
        for topic in published.difference(&refused) {
            if topics.remove(*topic) {
                // Debug: with rare poison a storm starts and ends every few batches, and each
                // start already comes with the dead letters' error lines.
                tracing::debug!(
                    pubsub.topic = %topic,
                    "Poison storm over: a batch of the topic had no message refused; its unkeyed \
                     rows go in one request per batch again."
                );
            }
        }
        for topic in refused {
            if topics.insert(topic.to_owned()) {
                tracing::info!(
                    pubsub.topic = %topic,
                    "Poison storm: Pub/Sub refused messages of the topic on their own (see the \
                     dead letters); until a batch has none refused, its unkeyed rows go in \
                     parts so the good ones are not held by a refused request."
                );
            }
        }
    }
}
