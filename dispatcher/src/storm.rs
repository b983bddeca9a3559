//! Poison storms: a topic whose messages Pub/Sub keeps refusing (a schema it validates, say).
//!
//! A refused request fails every message in it, so a batch's unkeyed rows, sent together, are
//! refused whole as soon as one of them is poisoned; isolation then finds the poisoned ones
//! (`crate::batch`). In a storm every batch would pay that first doomed request (every message
//! of it validated for nothing) before isolating. So a topic whose batch had an unkeyed message
//! refused on its own is *in a storm*: its unkeyed rows go straight in parts, each in requests of
//! its own, the good parts are published at the first attempt and only the refused parts are
//! isolated. A batch of the topic with none of its unkeyed rows refused ends the storm (logged
//! at info when it starts, at debug when it ends). Keyed rows are never affected (a key is a
//! request of its own already).

use std::collections::HashSet;
use std::sync::Mutex;

use outbox_shared::ClaimedMessage;

use crate::classify::FailureKind;
use crate::decide::Attempt;
use crate::metrics::Metrics;
use crate::publisher::{BatchResult, Publish, gather, split};

/// How many parts a storming topic's unkeyed rows are sent in (as isolation's first round).
pub(crate) const PARTS: usize = 16;

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
                    parts = PARTS,
                    "Poison storm: Pub/Sub refused messages of the topic on their own (see the \
                     dead letters); until a batch has none refused, its unkeyed rows go in \
                     parts so the good ones are not held by a refused request."
                );
            }
        }
    }
}

/// Publishes `batch`, the unkeyed messages of storming topics in [`PARTS`] parts (each part a
/// call of its own, so in requests of its own; counted as isolation publishes), the rest as one
/// call; all at once. One result per message, in order.
pub(crate) async fn publish<P: Publish>(
    storms: &Storms,
    publisher: &P,
    metrics: &Metrics,
    batch: &[ClaimedMessage],
) -> BatchResult {
    let in_parts: Vec<usize> = {
        let topics = storms.topics();
        if topics.is_empty() {
            Vec::new()
        } else {
            (0..batch.len())
                .filter(|i| batch[*i].ordering_key.is_none() && topics.contains(&batch[*i].topic))
                .collect()
        }
    };
    if in_parts.len() < 2 {
        return publisher.publish(batch).await;
    }
    let parts = split(&in_parts, PARTS);
    metrics.isolation_publishes.inc_by(parts.len() as u64);
    let rest: Vec<usize> = {
        let set: HashSet<usize> = in_parts.iter().copied().collect();
        (0..batch.len()).filter(|i| !set.contains(i)).collect()
    };
    let copy =
        |of: &[usize]| -> Vec<ClaimedMessage> { of.iter().map(|i| batch[*i].clone()).collect() };
    let rest_batch = copy(&rest);
    let rest_sent = async {
        if rest_batch.is_empty() {
            Vec::new()
        } else {
            publisher.publish(&rest_batch).await
        }
    };
    let parts_sent = futures::future::join_all(parts.iter().map(|part| {
        let part_batch = copy(part);
        async move { publisher.publish(&part_batch).await }
    }));
    let (rest_results, part_results) = futures::join!(rest_sent, parts_sent);
    let sent = parts
        .iter()
        .map(Vec::as_slice)
        .zip(part_results)
        .chain(std::iter::once((rest.as_slice(), rest_results)));
    gather(batch.len(), sent)
}
