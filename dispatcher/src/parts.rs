//! How a claimed batch is cut: into Pub/Sub requests, and into calls of their own when a
//! refused request must be told from the messages in it. The one home of every cut on the
//! publish path:
//!
//! - **Requests** ([`plan`]): a request holds one topic's messages and at most one ordering key
//!   (Pub/Sub takes one key per request), at most 1,000 messages and 10 MB encoded. A call of
//!   [`Publish::publish`] builds requests of its own, so no message of another call ever shares a
//!   request with it: a message refused alone is refused for itself.
//! - **Parts** ([`first_cut`], [`next_cut`]: the one fan-out rule): rows never yet sent apart go
//!   in up to 16 calls; a call refused again is cut in 4. A request is atomic (one message
//!   Pub/Sub refuses, a schema violation say, fails every message in it), so:
//!   - **isolation** ([`isolate`]): a permanent failure is never believed at once. The unkeyed
//!     suspects go in parts, a refused part is cut again until a refused message is alone; a
//!     key's messages from its first permanent failure go alone, in order, stopping at the next
//!     failure (unless the topic skips dead letters). Only a message refused on its own is
//!     dead-lettered; transient failures and outages are never isolated;
//!   - **storms** ([`send_cut`]): a topic in a poison storm (`crate::storm`) sends its unkeyed rows
//!     in parts from the start, so its good rows go out at the first attempt and only the refused
//!     parts are isolated.
//!
//! k poisoned messages among n suspects cost about 16 + 4·k·log4(n/16k) requests and
//! 1 + log4(n/16) round trips (5 among 500: about 64 requests in 4 rounds) instead of n requests
//! (docs/benchmarks/2026-12-02-publish-path.md compares halving, √n parts and this).

use std::collections::{HashMap, HashSet};

use outbox_shared::ClaimedMessage;
use outbox_shared::limits::MAX_MESSAGES_PER_REQUEST;

use crate::classify::{FailureKind, PublishFailure};
use crate::decide::{Attempt, Policy};
use crate::dispatch::Dispatch;
use crate::publish::{BatchResult, Publish};
use crate::wire;

/// Pub/Sub's bound on a request's size; the dispatcher packs requests up to it, encoded.
pub(crate) const MAX_REQUEST_BYTES: usize = 10_000_000;

/// One request of a batch: its messages (indices into the batch) and its encoded size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Request {
    pub of: Vec<usize>,
    pub size: usize,
}

/// The requests of one topic and ordering key (or of one topic's unkeyed messages), in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Sequence {
    /// Keyed: sent one after the other, stopping at a failure.
    pub keyed: bool,
    pub requests: Vec<Request>,
}

/// `batch` as requests: one sequence per topic and key in the order they first appear, each
/// message in its sequence's last request while it has fewer than 1,000 messages and stays
/// within [`MAX_REQUEST_BYTES`] (a message too big for any request goes alone, and Pub/Sub says
/// why; `limits` refuses those before they are claimed for publishing).
pub(crate) fn plan(
    batch: &[ClaimedMessage],
    dedupe_attribute: &str,
    max_bytes: usize,
) -> Vec<Sequence> {
    let mut of: HashMap<(&str, Option<&str>), usize> = HashMap::new();
    let mut sequences: Vec<Sequence> = Vec::new();
    for (i, m) in batch.iter().enumerate() {
        let key = m.ordering_key.as_deref().filter(|k| !k.is_empty());
        let at = *of.entry((m.topic.as_str(), key)).or_insert_with(|| {
            sequences.push(Sequence {
                keyed: key.is_some(),
                requests: Vec::new(),
            });
            sequences.len() - 1
        });
        let adds = wire::in_request_len(wire::message_len(m, dedupe_attribute));
        let requests = &mut sequences[at].requests;
        match requests.last_mut() {
            Some(r) if r.of.len() < MAX_MESSAGES_PER_REQUEST && r.size + adds <= max_bytes => {
                r.of.push(i);
                r.size += adds;
            }
            _ => requests.push(Request {
                of: vec![i],
                size: wire::topic_len(&m.topic) + adds,
            }),
        }
    }
    sequences
}

/// Rows never sent apart yet (they were refused together, or their topic storms) go in this
/// many parts.
const FIRST_PARTS: usize = 16;
/// A part refused again is cut in this many: it holds few refused messages by then, and 4 parts
/// per round find each in fewer requests than 16 (about 64 instead of 96 for 5 among 500), for
/// one more round trip.
const NEXT_PARTS: usize = 4;

/// The fan-out rule's first cut: rows that have not been sent apart yet, in up to 16 parts.
pub(crate) fn first_cut(group: &[usize]) -> Vec<Vec<usize>> {
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

/// The results of a batch sent in parts (each part's indices into the batch, with its results in
/// the same order) back in the batch's order; a message no part answered for failed transiently.
pub(crate) fn gather<'a>(
    len: usize,
    parts: impl IntoIterator<Item = (&'a [usize], BatchResult)>,
) -> BatchResult {
    let mut results: Vec<Option<Result<String, PublishFailure>>> = vec![None; len];
    for (of, got) in parts {
        for (i, result) in of.iter().zip(got) {
            results[*i] = Some(result);
        }
    }
    results
        .into_iter()
        .map(|r| r.unwrap_or_else(|| Err(PublishFailure::transient("no result for the message"))))
        .collect()
}

/// Sends `batch`: the unkeyed messages of storming topics in parts ([`first_cut`]; each part a
/// call of its own, so in requests of its own; counted as isolation publishes), the rest as one
/// call; all at once. One result per message, in order.
pub(crate) async fn send_cut<P: Publish>(d: &Dispatch<P>, batch: &[ClaimedMessage]) -> BatchResult {
    let publisher = d.publisher.as_ref();
    let in_parts = d.storms.in_storm(batch);
    if in_parts.len() < 2 {
        return publisher.publish(batch).await;
    }
    let parts = first_cut(&in_parts);
    d.metrics.isolation_publishes.inc_by(parts.len() as u64);
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

/// Finds which messages Pub/Sub itself refuses among those that got a permanent error (the
/// module doc): the unkeyed suspects in parts, a key's from its first permanent failure alone.
/// Everything of one round goes at once: the parts, and every key (a key's own messages one
/// after the other).
pub(crate) async fn isolate<P: Publish>(
    d: &Dispatch<P>,
    claimed: &[ClaimedMessage],
    attempts: &mut [Attempt],
    policy: Policy<'_>,
) {
    let permanent =
        |a: &Attempt| matches!(a, Attempt::Failed(f) if f.kind == FailureKind::Permanent);
    if !attempts.iter().any(permanent) {
        return;
    }
    d.metrics.isolations.inc();
    let mut unkeyed = Vec::new();
    let mut keys: Vec<(&str, &str)> = Vec::new();
    for (i, m) in claimed.iter().enumerate() {
        if !permanent(&attempts[i]) {
            continue;
        }
        match m.ordering_key.as_deref() {
            None => unkeyed.push(i),
            Some(k) if !keys.contains(&(m.topic.as_str(), k)) => keys.push((m.topic.as_str(), k)),
            Some(_) => {}
        }
    }
    let before: &[Attempt] = attempts;
    let by_key = futures::future::join_all(
        keys.iter()
            .map(|(topic, key)| isolate_key(d, claimed, before, topic, key, policy)),
    );
    let (unkeyed, by_key) = futures::join!(isolate_unkeyed(d, claimed, unkeyed), by_key);
    for (i, attempt) in unkeyed.into_iter().chain(by_key.into_iter().flatten()) {
        attempts[i] = attempt;
    }
}

/// Counts a message Pub/Sub refused on its own (`outbox_publish_failures_total{kind="permanent"}`:
/// refused messages, not the messages of a refused request).
fn count_refused<P: Publish>(d: &Dispatch<P>, result: &Result<String, PublishFailure>) {
    if let Err(f) = result
        && f.kind == FailureKind::Permanent
    {
        d.metrics.fail(f.kind.as_str(), 1);
    }
}

/// The unkeyed suspects' verdicts, cut until each refused one is alone (see [`isolate`]), by
/// index.
async fn isolate_unkeyed<P: Publish>(
    d: &Dispatch<P>,
    claimed: &[ClaimedMessage],
    suspects: Vec<usize>,
) -> Vec<(usize, Attempt)> {
    let mut verdicts = Vec::new();
    // They were refused together already: the first round sends them apart.
    let mut groups = first_cut(&suspects);
    while !groups.is_empty() {
        d.metrics.isolation_publishes.inc_by(groups.len() as u64);
        let sent = futures::future::join_all(groups.iter().map(|group| async move {
            let batch: Vec<ClaimedMessage> = group.iter().map(|i| claimed[*i].clone()).collect();
            d.publisher.publish(&batch).await
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
                        count_refused(d, &result);
                        verdicts.push((i, into_attempt(result)));
                    }
                }
            }
            next.extend(next_cut(&refused));
        }
        groups = next;
    }
    verdicts
}

/// One key's messages from its first permanent failure on, one request each, in order: the new
/// attempts, by index (`attempts` as they were before isolating).
async fn isolate_key<P: Publish>(
    d: &Dispatch<P>,
    claimed: &[ClaimedMessage],
    attempts: &[Attempt],
    topic: &str,
    key: &str,
    policy: Policy<'_>,
) -> Vec<(usize, Attempt)> {
    let of_key = |m: &ClaimedMessage| m.topic == topic && m.ordering_key.as_deref() == Some(key);
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
        d.metrics.isolation_publishes.inc();
        let result = d
            .publisher
            .publish(std::slice::from_ref(&claimed[i]))
            .await
            .pop()
            .unwrap_or_else(|| Err(PublishFailure::transient("no result for the message")));
        count_refused(d, &result);
        let attempt = into_attempt(result);
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

pub(crate) fn into_attempt(result: Result<String, PublishFailure>) -> Attempt {
    match result {
        Ok(message_id) => Attempt::Published(message_id),
        Err(failure) => Attempt::Failed(failure),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(id: i64, key: Option<&str>) -> ClaimedMessage {
        crate::test_support::message(id, "projects/p/topics/t", key, 0)
    }

    fn sized(id: i64, key: Option<&str>, bytes: usize) -> ClaimedMessage {
        let mut m = msg(id, key);
        m.payload = bytes::Bytes::from(vec![0u8; bytes]);
        m
    }

    #[test]
    fn a_request_holds_one_topic_and_key_at_most_1000_messages_and_its_byte_bound() {
        let mut batch = vec![
            msg(1, Some("a")),
            msg(2, None),
            msg(3, Some("b")),
            msg(4, Some("a")),
            msg(5, Some("")),
        ];
        let mut other = msg(6, None);
        other.topic = "projects/p/topics/u".to_owned();
        batch.push(other);
        let of = |p: &[Sequence]| -> Vec<(bool, Vec<Vec<usize>>)> {
            p.iter()
                .map(|s| (s.keyed, s.requests.iter().map(|r| r.of.clone()).collect()))
                .collect()
        };
        assert_eq!(
            of(&plan(&batch, "d", MAX_REQUEST_BYTES)),
            vec![
                (true, vec![vec![0, 3]]),
                (false, vec![vec![1, 4]]),
                (true, vec![vec![2]]),
                (false, vec![vec![5]]),
            ],
            "a key's rows together, unkeyed (an empty key is none) per topic, in first-seen order"
        );
        let many: Vec<ClaimedMessage> = (0..2500).map(|i| msg(i, None)).collect();
        let sizes: Vec<usize> = plan(&many, "d", MAX_REQUEST_BYTES)[0]
            .requests
            .iter()
            .map(|r| r.of.len())
            .collect();
        assert_eq!(sizes, vec![1000, 1000, 500]);
        let big: Vec<ClaimedMessage> = (0..5).map(|i| sized(i, Some("k"), 3_000_000)).collect();
        let p = plan(&big, "d", MAX_REQUEST_BYTES);
        let counts: Vec<usize> = p[0].requests.iter().map(|r| r.of.len()).collect();
        assert_eq!(
            counts,
            vec![3, 2],
            "3 x 3 MB fit in 10 MB, a fourth does not"
        );
        for r in &p[0].requests {
            assert!(r.size <= MAX_REQUEST_BYTES, "{}", r.size);
            let encoded = wire::publish_request(
                &big[0].topic,
                r.of.iter()
                    .map(|i| (&big[*i], wire::message_len(&big[*i], "d"), None)),
                "d",
                r.size,
            );
            assert_eq!(
                encoded.len(),
                r.size,
                "the planned size is the encoded size"
            );
        }
        let huge = [sized(1, None, 12_000_000), sized(2, None, 10)];
        let counts: Vec<usize> = plan(&huge, "d", MAX_REQUEST_BYTES)[0]
            .requests
            .iter()
            .map(|r| r.of.len())
            .collect();
        assert_eq!(counts, vec![1, 1], "an oversize message goes alone");
    }

    #[test]
    fn parts_results_go_back_in_the_batchs_order_and_a_message_without_one_failed_transiently() {
        let parts: Vec<(&[usize], BatchResult)> =
            vec![(&[2, 0], vec![Ok("c".into()), Ok("a".into())])];
        let results = gather(3, parts);
        assert_eq!(results[0], Ok("a".to_owned()));
        assert_eq!(results[2], Ok("c".to_owned()));
        assert!(matches!(&results[1], Err(f) if f.kind == FailureKind::Transient));
    }
}
