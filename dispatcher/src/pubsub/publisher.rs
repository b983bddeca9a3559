//! [`PubsubPublisher`]: [`Publish`] on the transport of this crate. It cuts a batch into
//! requests (`crate::pubsub::plan`: one topic and at most one ordering key per request, at most
//! 1,000 messages and 10 MB encoded) and sends them on the [`Transport`]. Every request of a
//! batch is in flight at once, except a key's own requests (a key with more than fits in one):
//! those go one after the other, and when one fails the rest of the key is not sent (not
//! attempted: its rows go back untouched, so the key's order holds).
//!
//! Bounds: the caller bounds what is in flight (workers × batch size, and a byte budget); the
//! transport bounds the calls open per connection; every publish is under `publish_timeout`.
//! Nothing is retried here: the row's durable schedule retries (ARCHITECTURE.md, "The transport").

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use opentelemetry_sdk::trace::SdkTracer;
use outbox_shared::ClaimedMessage;

use crate::config::PubsubConfig;
use crate::error::DispatcherError;
use crate::pubsub::classify::{FailureKind, PublishFailure, classify};
use crate::pubsub::plan::{MAX_REQUEST_BYTES, Request, Sequence, gather, plan};
use crate::pubsub::publish::{BatchResult, ProbeError, Publish};
use crate::pubsub::trace::Sends;
use crate::pubsub::transport::{Failed, Route, Transport};
use crate::pubsub::wire;

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

/// [`Publish`] on the transport of this crate ([`Transport`]).
#[derive(Debug, Clone)]
pub struct PubsubPublisher {
    transport: Arc<Transport>,
    timeout: Duration,
    dedupe_attribute: String,
    /// The probes' deadline, from the round trips seen.
    clock: Arc<ProbeClock>,
    /// Starts the send spans when tracing is on (`crate::pubsub::trace`).
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

    /// Starts a send span per message whose writer sampled its trace (`crate::pubsub::trace`): with
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
