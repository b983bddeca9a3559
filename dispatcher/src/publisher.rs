//! Publishing to Pub/Sub: the [`Publish`] seam the worker uses (publish a claimed batch and get
//! one result per message, in order; probe whether the broker answers), and [`PubsubPublisher`],
//! which turns a batch into `Publish` requests and sends them on the [`Transport`].
//!
//! **Requests.** A request holds one topic's messages and at most one ordering key (Pub/Sub takes
//! one key per request), at most 1,000 messages and 10 MB encoded ([`plan`]). Every request of a
//! batch is in flight at once, except a key's own requests (a key with more than fits in one):
//! those go one after the other, and when one fails the rest of the key is not sent (not
//! attempted: its rows go back untouched, so the key's order holds). Every call builds requests
//! of its own, so no message of another call ever shares a request with it (what isolation
//! relies on: a message refused alone is refused for itself).
//!
//! Bounds: the caller bounds what is in flight (workers × batch size, and a byte budget); the
//! transport bounds the calls open per connection; every publish is under `publish_timeout`.
//! Nothing is retried here: the row's durable schedule retries (ARCHITECTURE.md, "The transport").

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use opentelemetry_sdk::trace::SdkTracer;
use outbox_shared::ClaimedMessage;
use outbox_shared::limits::MAX_MESSAGES_PER_REQUEST;

use crate::classify::{FailureKind, PublishFailure, classify};
use crate::config::PubsubConfig;
use crate::error::DispatcherError;
use crate::trace::Sends;
use crate::transport::{Failed, Route, Transport};
use crate::wire;

/// One result per message of a batch, in the batch's order: the Pub/Sub message id or why not.
pub type BatchResult = Vec<Result<String, PublishFailure>>;

/// The publishing seam between the worker and Pub/Sub.
pub trait Publish: Send + Sync + 'static {
    /// Publishes `batch` in requests of its own (no message of another call shares them: a
    /// batch of one is a message alone); returns one result per message, in order.
    fn publish(&self, batch: &[ClaimedMessage]) -> impl Future<Output = BatchResult> + Send;
    /// Whether the broker answers at all (used to tell an outage from a bad message).
    fn probe(&self, topic: &str) -> impl Future<Output = Result<(), ProbeError>> + Send;
    /// The attribute it adds to every message, carrying the dedupe key (the batch counts it
    /// against Pub/Sub's attribute limits before publishing).
    fn dedupe_attribute(&self) -> &str;
}

/// Why a probe did not confirm that Pub/Sub answers.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProbeError {
    /// No answer (refused connection, timeout, transport failure): an outage, claiming pauses.
    #[error("{0}")]
    Unreachable(String),
    /// The request could not be sent at all (a topic name that cannot be a header value): a
    /// configuration error, never an outage.
    #[error("the request to Pub/Sub could not be sent: {0}")]
    Refused(String),
}

impl ProbeError {
    /// Whether this means Pub/Sub is unreachable (rather than the request being wrong).
    pub fn is_outage(&self) -> bool {
        matches!(self, Self::Unreachable(_))
    }
}

/// How long a probe (`GetTopic`) may take at least before the broker counts as unreachable.
const PROBE_DEADLINE: Duration = Duration::from_secs(2);

/// How long a probe may take: [`PROBE_DEADLINE`], or three times the round trips seen lately
/// when those are slower (a slow but answering Pub/Sub is not an outage); never more than the
/// publish timeout. A probe that missed its deadline is still awaited in the background (up to
/// the publish timeout) and, should it answer, teaches the clock its round trip: so a Pub/Sub
/// slower than 2 s from the start is seen after one probe, while a stall (no answer at all) keeps
/// the deadline short and the recovery prompt.
#[derive(Debug, Default)]
struct ProbeClock {
    /// Round trips of publishes and probes that answered: an exponentially weighted mean, µs.
    round_trip_us: AtomicU64,
}

impl ProbeClock {
    fn answered(&self, took: Duration) {
        let sample = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        let _ = self
            .round_trip_us
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |mean| {
                Some(if mean == 0 {
                    sample
                } else {
                    mean - mean / 8 + sample / 8
                })
            });
    }

    fn deadline(&self, cap: Duration) -> Duration {
        let seen = Duration::from_micros(self.round_trip_us.load(Ordering::Relaxed)) * 3;
        seen.clamp(PROBE_DEADLINE, cap.max(PROBE_DEADLINE))
    }
}

/// `group` in at most `parts` parts of about equal size, in order.
pub(crate) fn split(group: &[usize], parts: usize) -> Vec<Vec<usize>> {
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

/// Pub/Sub's bound on a request's size; the dispatcher packs requests up to it, encoded.
pub const MAX_REQUEST_BYTES: usize = 10_000_000;

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

/// [`Publish`] on the transport of this crate ([`Transport`]).
#[derive(Debug, Clone)]
pub struct PubsubPublisher {
    transport: Arc<Transport>,
    timeout: Duration,
    dedupe_attribute: String,
    /// The probes' deadline, from the round trips seen.
    clock: Arc<ProbeClock>,
    /// Starts the send spans when tracing is on (`crate::trace`).
    tracer: Option<SdkTracer>,
}

impl PubsubPublisher {
    /// Opens the transport. Emulator: no credentials; otherwise Application Default
    /// Credentials (Workload Identity on GKE).
    pub async fn connect(args: &PubsubConfig) -> Result<Self, DispatcherError> {
        Ok(Self {
            transport: Arc::new(Transport::open(args)?),
            timeout: args.publish_timeout,
            dedupe_attribute: args.dedupe_attribute.clone(),
            clock: Arc::default(),
            tracer: None,
        })
    }

    /// Starts a send span per message whose writer sampled its trace (`crate::trace`): with
    /// `None` (tracing off), the writer's context is passed on as it is.
    pub fn with_tracer(mut self, tracer: Option<SdkTracer>) -> Self {
        self.tracer = tracer;
        self
    }

    /// One request: its messages' ids, or why not (the same for each of them).
    async fn send(
        &self,
        batch: &[ClaimedMessage],
        request: &Request,
        route: &Result<Route, String>,
        deadline: Instant,
    ) -> BatchResult {
        let Some(first) = request.of.first().map(|i| &batch[*i]) else {
            return Vec::new();
        };
        let topic = first.topic.as_str();
        let route = match route {
            Ok(route) => route,
            Err(why) => {
                return vec![Err(classify(&Failed::NotSent(why.clone()))); request.of.len()];
            }
        };
        let sends = Sends::start(self.tracer.as_ref(), batch, &request.of, topic);
        let body = || {
            wire::publish_request(
                topic,
                request.of.iter().enumerate().map(|(n, i)| {
                    let m = &batch[*i];
                    (
                        m,
                        wire::message_len(m, &self.dedupe_attribute),
                        sends.traceparent(n),
                    )
                }),
                &self.dedupe_attribute,
                request.size,
            )
        };
        let left = deadline.saturating_duration_since(Instant::now());
        let started = Instant::now();
        let answer: Result<wire::PublishResponse, Failed> =
            self.transport.call(wire::PUBLISH, route, body, left).await;
        let results = self.results(answer, request.of.len(), started);
        sends.end(&results);
        results
    }

    /// A request's answer as one result per message.
    fn results(
        &self,
        answer: Result<wire::PublishResponse, Failed>,
        count: usize,
        started: Instant,
    ) -> BatchResult {
        match answer {
            Ok(answer) if answer.message_ids.len() == count => {
                self.clock.answered(started.elapsed());
                answer.message_ids.into_iter().map(Ok).collect()
            }
            Ok(answer) => {
                let failure = PublishFailure::transient(format!(
                    "Pub/Sub answered with {} message ids for {} messages",
                    answer.message_ids.len(),
                    count
                ));
                vec![Err(failure); count]
            }
            Err(failed) => {
                if matches!(failed, Failed::Answered(_)) {
                    self.clock.answered(started.elapsed());
                }
                vec![Err(classify(&failed)); count]
            }
        }
    }

    /// A sequence's requests: all at once, or (keyed) one after the other until one fails, the
    /// rest not attempted.
    async fn send_sequence<'s>(
        &self,
        batch: &[ClaimedMessage],
        sequence: &'s Sequence,
        routes: &HashMap<&str, Result<Route, String>>,
        deadline: Instant,
    ) -> Vec<(&'s [usize], BatchResult)> {
        let topic = sequence
            .requests
            .first()
            .and_then(|r| r.of.first())
            .map_or("", |i| batch[*i].topic.as_str());
        // Every topic of the batch has its entry (`publish` makes them from the same rows).
        let Some(route) = routes.get(topic) else {
            let failure = PublishFailure::transient(format!("topic {topic:?} has no route"));
            return sequence
                .requests
                .iter()
                .map(|r| (r.of.as_slice(), vec![Err(failure.clone()); r.of.len()]))
                .collect();
        };
        if !sequence.keyed {
            let sent = futures::future::join_all(
                sequence
                    .requests
                    .iter()
                    .map(|r| self.send(batch, r, route, deadline)),
            )
            .await;
            return sequence
                .requests
                .iter()
                .map(|r| r.of.as_slice())
                .zip(sent)
                .collect();
        }
        let mut results = Vec::with_capacity(sequence.requests.len());
        let mut failed = false;
        for request in &sequence.requests {
            let result = if failed {
                let held = PublishFailure {
                    kind: FailureKind::NotAttempted,
                    message: "not sent: an earlier request of its ordering key failed".to_owned(),
                };
                vec![Err(held); request.of.len()]
            } else {
                let result = self.send(batch, request, route, deadline).await;
                failed = result.iter().any(Result::is_err);
                result
            };
            results.push((request.of.as_slice(), result));
        }
        results
    }
}

impl Publish for PubsubPublisher {
    async fn publish(&self, batch: &[ClaimedMessage]) -> BatchResult {
        let plan = plan(batch, &self.dedupe_attribute, MAX_REQUEST_BYTES);
        let deadline = Instant::now() + self.timeout;
        let mut routes: HashMap<&str, Result<Route, String>> = HashMap::new();
        for m in batch {
            if !routes.contains_key(m.topic.as_str()) {
                routes.insert(m.topic.as_str(), Transport::route(&m.topic));
            }
        }
        let routes = &routes;
        let all = futures::future::join_all(
            plan.iter()
                .map(|sequence| self.send_sequence(batch, sequence, routes, deadline)),
        );
        match tokio::time::timeout(self.timeout, all).await {
            Ok(sent) => gather(batch.len(), sent.into_iter().flatten()),
            Err(_) => {
                let failure = PublishFailure::transient(format!(
                    "publish did not complete within {:?} (Pub/Sub slow or unreachable at {})",
                    self.timeout,
                    self.transport.endpoint()
                ));
                vec![Err(failure); batch.len()]
            }
        }
    }

    async fn probe(&self, topic: &str) -> Result<(), ProbeError> {
        let deadline = self.clock.deadline(self.timeout);
        let (transport, clock, cap, name) = (
            self.transport.clone(),
            self.clock.clone(),
            self.timeout,
            topic.to_owned(),
        );
        // Spawned, so that an answer after the deadline still teaches the clock (see ProbeClock).
        let mut call = tokio::spawn(async move {
            let started = Instant::now();
            let body = || wire::get_topic_request(&name);
            let call = async {
                let route = Transport::route(&name).map_err(Failed::NotSent)?;
                transport.call(wire::GET_TOPIC, &route, body, cap).await
            };
            let answer: Result<wire::Topic, Failed> = match tokio::time::timeout(cap, call).await {
                Ok(answer) => answer,
                Err(_) => Err(Failed::NoAnswer(format!("no answer within {cap:?}"))),
            };
            if matches!(answer, Ok(_) | Err(Failed::Answered(_))) {
                clock.answered(started.elapsed());
            }
            answer
        });
        let endpoint = self.transport.endpoint();
        match tokio::time::timeout(deadline, &mut call).await {
            // The broker answered; the topic (or our access to it) may be the problem, not an
            // outage.
            Ok(Ok(Ok(_) | Err(Failed::Answered(_)))) => Ok(()),
            Ok(Ok(Err(Failed::NotSent(why)))) => {
                Err(ProbeError::Refused(format!("topic {topic:?}: {why}")))
            }
            Ok(Ok(Err(Failed::NoAnswer(why) | Failed::Credentials(why)))) => Err(
                ProbeError::Unreachable(format!("Pub/Sub at {endpoint} does not answer: {why}")),
            ),
            Ok(Err(join)) => Err(ProbeError::Unreachable(format!(
                "the probe of Pub/Sub at {endpoint} did not run: {join}"
            ))),
            Err(_) => Err(ProbeError::Unreachable(format!(
                "Pub/Sub at {endpoint} gave no answer within {deadline:?}"
            ))),
        }
    }

    fn dedupe_attribute(&self) -> &str {
        &self.dedupe_attribute
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
        assert!(matches!(&results[1], Err(f) if f.kind == crate::classify::FailureKind::Transient));
    }

    #[test]
    fn the_probe_deadline_follows_slow_round_trips_up_to_the_publish_timeout() {
        let cap = Duration::from_secs(30);
        let clock = ProbeClock::default();
        assert_eq!(clock.deadline(cap), PROBE_DEADLINE, "nothing seen yet");
        clock.answered(Duration::from_millis(20));
        assert_eq!(clock.deadline(cap), PROBE_DEADLINE, "fast round trips: 2 s");
        let slow = ProbeClock::default();
        slow.answered(Duration::from_secs(4));
        assert_eq!(
            slow.deadline(cap),
            Duration::from_secs(12),
            "3 x a 4 s round trip"
        );
        let glacial = ProbeClock::default();
        glacial.answered(Duration::from_secs(20));
        assert_eq!(glacial.deadline(cap), cap, "never past the publish timeout");
    }
}
