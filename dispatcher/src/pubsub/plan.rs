//! How a batch is cut into Pub/Sub requests ([`plan`]), and the results of calls made in parts
//! put back in the batch's order ([`gather`]).
//!
//! A request holds one topic's messages and at most one ordering key (Pub/Sub takes one key per
//! request), at most 1,000 messages and 10 MB encoded (its size is known exactly before it is
//! encoded: `wire`). A call of `Publish::publish` builds requests of its own, so no message of
//! another call ever shares a request with it: a message refused alone is refused for itself,
//! which is what isolation (`crate::batch::isolate`) stands on.

use std::collections::HashMap;

use outbox_shared::ClaimedMessage;
use outbox_shared::limits::MAX_MESSAGES_PER_REQUEST;

use crate::pubsub::classify::PublishFailure;
use crate::pubsub::publish::BatchResult;
use crate::pubsub::wire;

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pubsub::classify::FailureKind;

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
