//! Isolation: calls of their own, so that a refused request is told from the messages in it. A
//! request is atomic (one message Pub/Sub refuses, a schema violation say, fails every message in
//! it), and a call of `Publish::publish` builds requests of its own (`crate::pubsub::plan`), so a
//! message refused in a call alone is refused for itself. The one fan-out rule ([`first_cut`],
//! [`next_cut`]): rows never yet sent apart go in up to 16 calls; a call refused again is cut in 4.
//!
//! - **isolation** ([`Isolation::isolate`]): a permanent failure is never believed at once. The
//!   unkeyed suspects go in parts, a refused part is cut again until a refused message is alone;
//!   a key's messages from its first permanent failure go alone, in order, stopping at the next
//!   failure (unless the topic skips dead letters). Only a message refused on its own is
//!   dead-lettered; transient failures and outages are never isolated;
//! - **storms** ([`Isolation::send_cut`]): a topic in a poison storm (`crate::refusals::storm`)
//!   sends its unkeyed rows in parts from the start, so its good rows go out at the first attempt
//!   and only the refused parts are isolated.
//!
//! k poisoned messages among n suspects cost about 16 + 4·k·log4(n/16k) requests and
//! 1 + log4(n/16) round trips (5 among 500: about 64 requests in 4 rounds) instead of n requests
//! (docs/benchmarks/2026-12-02-publish-path.md compares halving, √n parts and this).
//!
//! It takes only what it sends with and counts on ([`Isolation`]), not the workers' whole state.

use std::collections::HashSet;

use outbox_shared::ClaimedMessage;

use crate::batch::decide::Policy;
use crate::metrics::Metrics;
use crate::pubsub::classify::{FailureKind, PublishFailure};
use crate::pubsub::plan::gather;
use crate::pubsub::publish::{Attempt, BatchResult, Publish};

/// Rows never sent apart yet (they were refused together, or their topic storms) go in this
/// many parts.
const FIRST_PARTS: usize = 16;
/// A part refused again is cut in this many: it holds few refused messages by then, and 4 parts
/// per round find each in fewer requests than 16 (about 64 instead of 96 for 5 among 500), for
/// one more round trip.
const NEXT_PARTS: usize = 4;

/// The fan-out rule's first cut: rows that have not been sent apart yet, in up to 16 parts.
fn first_cut(group: &[usize]) -> Vec<Vec<usize>> {
    split(group, FIRST_PARTS)
}

/// The fan-out rule's next cut: a part refused again, in up to 4 parts.
fn next_cut(group: &[usize]) -> Vec<Vec<usize>> {
    split(group, NEXT_PARTS)
}

/// `group` in at most `parts` parts of about equal size, in order.
fn split(group: &[usize], parts: usize) -> Vec<Vec<usize>> {
    let size = group.len().div_ceil(parts.max(1)).max(1);
    group.chunks(size).map(<[usize]>::to_vec).collect()
}

/// What isolation sends with and counts on: the publisher and the metrics, nothing else of the
/// workers' shared state.
pub(crate) struct Isolation<'a, P> {
    pub(crate) publisher: &'a P,
    pub(crate) metrics: &'a Metrics,
}

impl<P: Publish> Isolation<'_, P> {
    /// Sends `batch`: the messages `in_parts` (by index: the unkeyed messages of storming topics)
    /// in parts ([`first_cut`]; each part a call of its own, so in requests of its own; counted as
    /// isolation publishes), the rest as one call; all at once. One result per message, in order.
    pub(crate) async fn send_cut(
        &self,
        batch: &[ClaimedMessage],
        in_parts: &[usize],
    ) -> BatchResult {
        let publisher = self.publisher;
        if in_parts.len() < 2 {
            return publisher.publish(batch).await;
        }
        let parts = first_cut(in_parts);
        self.metrics.isolation_publishes.inc_by(parts.len() as u64);
        let rest: Vec<usize> = {
            let set: HashSet<usize> = in_parts.iter().copied().collect();
            (0..batch.len()).filter(|i| !set.contains(i)).collect()
        };
        let copy = |of: &[usize]| -> Vec<ClaimedMessage> {
            of.iter().map(|i| batch[*i].clone()).collect()
        };
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

    /// Finds which messages Pub/Sub itself refuses among those that got a permanent error (the
    /// module doc): the unkeyed suspects in parts, a key's from its first permanent failure
    /// alone. Everything of one round goes at once: the parts, and every key (a key's own
    /// messages one after the other).
    pub(crate) async fn isolate(
        &self,
        claimed: &[ClaimedMessage],
        attempts: &mut [Attempt],
        policy: Policy<'_>,
    ) {
        let permanent =
            |a: &Attempt| matches!(a, Attempt::Failed(f) if f.kind == FailureKind::Permanent);
        if !attempts.iter().any(permanent) {
            return;
        }
        self.metrics.isolations.inc();
        let mut unkeyed = Vec::new();
        let mut keys: Vec<(&str, &str)> = Vec::new();
        for (i, m) in claimed.iter().enumerate() {
            if !permanent(&attempts[i]) {
                continue;
            }
            match m.ordering_key.as_deref() {
                None => unkeyed.push(i),
                Some(k) if !keys.contains(&(m.topic.as_str(), k)) => {
                    keys.push((m.topic.as_str(), k))
                }
                Some(_) => {}
            }
        }
        let before: &[Attempt] = attempts;
        let by_key = futures::future::join_all(
            keys.iter()
                .map(|(topic, key)| self.isolate_key(claimed, before, topic, key, policy)),
        );
        let (unkeyed, by_key) = futures::join!(self.isolate_unkeyed(claimed, unkeyed), by_key);
        for (i, attempt) in unkeyed.into_iter().chain(by_key.into_iter().flatten()) {
            attempts[i] = attempt;
        }
    }

    /// Counts a message Pub/Sub refused on its own
    /// (`outbox_publish_failures_total{kind="permanent"}`: refused messages, not the messages of
    /// a refused request).
    fn count_refused(&self, result: &Result<String, PublishFailure>) {
        if let Err(f) = result
            && f.kind == FailureKind::Permanent
        {
            self.metrics.fail(f.kind.as_str(), 1);
        }
    }

    /// The unkeyed suspects' verdicts, cut until each refused one is alone (see
    /// [`Self::isolate`]), by index.
    async fn isolate_unkeyed(
        &self,
        claimed: &[ClaimedMessage],
        suspects: Vec<usize>,
    ) -> Vec<(usize, Attempt)> {
        let mut verdicts = Vec::new();
        // They were refused together already: the first round sends them apart.
        let mut groups = first_cut(&suspects);
        while !groups.is_empty() {
            self.metrics.isolation_publishes.inc_by(groups.len() as u64);
            let sent = futures::future::join_all(groups.iter().map(|group| async move {
                let batch: Vec<ClaimedMessage> =
                    group.iter().map(|i| claimed[*i].clone()).collect();
                self.publisher.publish(&batch).await
            }))
            .await;
            let mut next = Vec::new();
            for (group, results) in groups.into_iter().zip(sent) {
                let mut refused = Vec::new();
                for (i, result) in group.iter().copied().zip(results) {
                    match result {
                        // Refused in company: it may be its neighbours' fault.
                        Err(f) if f.kind == FailureKind::Permanent && group.len() > 1 => {
                            refused.push(i)
                        }
                        result => {
                            self.count_refused(&result);
                            verdicts.push((i, Attempt::from(result)));
                        }
                    }
                }
                next.extend(next_cut(&refused));
            }
            groups = next;
        }
        verdicts
    }

    /// One key's messages from its first permanent failure on, one request each, in order: the
    /// new attempts, by index (`attempts` as they were before isolating).
    async fn isolate_key(
        &self,
        claimed: &[ClaimedMessage],
        attempts: &[Attempt],
        topic: &str,
        key: &str,
        policy: Policy<'_>,
    ) -> Vec<(usize, Attempt)> {
        let of_key =
            |m: &ClaimedMessage| m.topic == topic && m.ordering_key.as_deref() == Some(key);
        let mut updates = Vec::new();
        let Some(first) = (0..claimed.len()).find(|i| {
            of_key(&claimed[*i])
                && matches!(&attempts[*i], Attempt::Failed(f) if f.kind == FailureKind::Permanent)
        }) else {
            return updates;
        };
        for i in (first..claimed.len()).filter(|i| of_key(&claimed[*i])) {
            match &attempts[i] {
                Attempt::Published(_) => continue,
                Attempt::Failed(f)
                    if matches!(f.kind, FailureKind::Permanent | FailureKind::NotAttempted) => {}
                // A transient failure, a rejection or a held-back message: the rest waits.
                _ => return updates,
            }
            self.metrics.isolation_publishes.inc();
            let result = self
                .publisher
                .publish(std::slice::from_ref(&claimed[i]))
                .await
                .pop()
                .unwrap_or_else(|| Err(PublishFailure::transient("no result for the message")));
            self.count_refused(&result);
            let attempt = Attempt::from(result);
            let goes_on = match &attempt {
                Attempt::Published(_) => true,
                Attempt::Failed(f) => f.kind == FailureKind::Permanent && policy.skips(topic),
                _ => false,
            };
            updates.push((i, attempt));
            if !goes_on {
                // The rest of the key waits behind it (decide releases them untouched).
                return updates;
            }
        }
        updates
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;
    use std::time::Duration;

    use outbox_shared::retry::RetrySchedule;

    use super::*;
    use crate::pubsub::publish::ProbeError;

    const T: &str = "projects/p/topics/t";

    /// Refuses every call that holds a poisoned message (a request is atomic), publishes the rest.
    struct Poisoned(HashSet<i64>);

    impl Publish for Poisoned {
        async fn publish(&self, batch: &[ClaimedMessage]) -> BatchResult {
            let refused = batch.iter().any(|m| self.0.contains(&m.id));
            batch
                .iter()
                .map(|m| match refused {
                    true => Err(PublishFailure::permanent("INVALID_ARGUMENT: schema")),
                    false => Ok(format!("m{}", m.id)),
                })
                .collect()
        }

        async fn probe(&self, _topic: &str) -> Result<(), ProbeError> {
            Ok(())
        }

        fn dedupe_attribute(&self) -> &str {
            "dedupe_key"
        }
    }

    fn refused_together() -> Attempt {
        Attempt::Failed(PublishFailure::permanent(
            "INVALID_ARGUMENT: refused with others",
        ))
    }

    #[tokio::test]
    async fn only_the_messages_refused_on_their_own_stay_refused_and_a_key_stops_at_one() {
        let schedule = RetrySchedule {
            base: Duration::from_secs(1),
            cap: Duration::from_secs(60),
            jitter: 0.0,
            max_attempts: 3,
        };
        let no_wait = |_: &str| Duration::ZERO;
        let policy = Policy {
            schedule: &schedule,
            skip_dead_letter_topics: &[],
            quota_backoff: &no_wait,
        };
        let mut claimed: Vec<ClaimedMessage> = (0..40)
            .map(|id| crate::test_support::message(id, T, None, 0))
            .collect();
        claimed.extend((40..43).map(|id| crate::test_support::message(id, T, Some("k"), 0)));
        let publisher = Poisoned(HashSet::from([7, 31, 41]));
        let metrics = Metrics::register(&mut prometheus_client::registry::Registry::default());
        let isolation = Isolation {
            publisher: &publisher,
            metrics: &metrics,
        };
        let mut attempts = vec![refused_together(); claimed.len()];
        isolation.isolate(&claimed, &mut attempts, policy).await;
        for (m, attempt) in claimed.iter().zip(&attempts) {
            let want = match m.id {
                7 | 31 | 41 => {
                    Attempt::Failed(PublishFailure::permanent("INVALID_ARGUMENT: schema"))
                }
                // Behind the key's refused message: untouched (decide releases it).
                42 => refused_together(),
                id => Attempt::Published(format!("m{id}")),
            };
            assert_eq!(*attempt, want, "message {}", m.id);
        }
        assert_eq!(metrics.isolations.get(), 1);
        assert!(
            metrics.isolation_publishes.get() < 40,
            "fewer calls than suspects: {}",
            metrics.isolation_publishes.get()
        );
    }
}
