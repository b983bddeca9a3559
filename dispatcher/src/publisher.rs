//! Publishing to Pub/Sub: the only module that talks to the Pub/Sub client.
//!
//! [`Publish`] is the seam the worker uses: publish a claimed batch and get one result per message
//! (in order), and probe whether the broker answers. The real implementation,
//! [`PubsubPublisher`], shares one gRPC channel ([`BasePublisher`]) across its publishers, so one
//! dispatcher serves many topics.
//!
//! **Keyed messages.** Pub/Sub takes one ordering key per request, and the client keeps, per
//! publisher, one sequential batch actor (a task and a channel) for every ordering key it has
//! ever seen, never removed, and `flush()` visits every one of them. The outbox already keeps a
//! key's order by itself (a key's next batch is claimed only after this one settled), so a batch's
//! keyed messages get publishers of their own, one per topic, built for the batch and dropped
//! with it: each key of the batch gets one actor that sends all of its rows in one request (up
//! to the request limits), every key's request is in flight at once on the shared channel, and
//! nothing per key outlives the batch (no rotation, no paused key left behind to resume).
//!
//! Bounds: the client's own queue is unbounded, so the caller bounds what is in flight (workers ×
//! batch size, and a byte budget); every publish is under `publish_timeout`, and the client's own
//! retries are capped inside it (the row schedule owns long retries).

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use google_cloud_gax::retry_policy::RetryPolicyExt;
use google_cloud_pubsub::client::{BasePublisher, Publisher, TopicAdmin};
use google_cloud_pubsub::model::Message;
use google_cloud_pubsub::retry_policy::RetryableErrors;
use outbox_shared::ClaimedMessage;

use crate::classify::{self, PublishFailure, classify};
use crate::config::PubsubConfig;
use crate::error::DispatcherError;

/// One result per message of a batch, in the batch's order: the Pub/Sub message id or why not.
pub type BatchResult = Vec<Result<String, PublishFailure>>;

/// The publishing seam between the worker and Pub/Sub.
pub trait Publish: Send + Sync + 'static {
    /// Publishes `batch`; returns one result per message, in order.
    fn publish(&self, batch: &[ClaimedMessage]) -> impl Future<Output = BatchResult> + Send;
    /// Publishes `batch` through publishers of its own (no message of another call shares its
    /// requests: one request per ordering key, the unkeyed ones packed together), to learn
    /// whether Pub/Sub refuses these messages or only a request they shared; a batch of one is a
    /// message alone.
    fn publish_apart(&self, batch: &[ClaimedMessage]) -> impl Future<Output = BatchResult> + Send;
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
    /// The client refused the request before sending anything (a resource name that does not
    /// match its template, a request it cannot encode): a configuration error, never an outage.
    #[error("the Pub/Sub client refused the request before sending it: {0}")]
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

/// The most ordering keys of one publish whose requests are in flight at once. Pub/Sub takes one
/// key per request, and every request in flight holds the client's buffers for it (its key's
/// actor and channel, tonic's encode and decode buffers, an HTTP/2 stream: some tens of KiB), so
/// 4 workers with batches of 500 one-row keys held about 2,000 of them (110 MiB resident). A
/// batch with more keys sends them in waves of this many, one wave after the other: 4 workers
/// keep up to 256 one-key requests in flight, about what one core can feed at a 30 ms round
/// trip (~120 µs of CPU per one-key request; BENCHMARKS.md).
const KEYS_PER_WAVE: usize = 64;

/// `batch`'s indices in waves, each in the batch's order: the first holds every unkeyed message
/// and the first [`KEYS_PER_WAVE`] keys, each next one the next keys; a key is whole in its wave.
fn waves(batch: &[ClaimedMessage], keys_per_wave: usize) -> Vec<Vec<usize>> {
    let mut wave_of: HashMap<(&str, &str), usize> = HashMap::new();
    let mut waves: Vec<Vec<usize>> = vec![Vec::new()];
    for (i, m) in batch.iter().enumerate() {
        let wave = match m.ordering_key.as_deref() {
            None => 0,
            Some(key) => {
                let seen = wave_of.len();
                *wave_of
                    .entry((m.topic.as_str(), key))
                    .or_insert(seen / keys_per_wave.max(1))
            }
        };
        if waves.len() <= wave {
            waves.resize_with(wave + 1, Vec::new);
        }
        waves[wave].push(i);
    }
    waves
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

/// Lanes of unkeyed publishers (one per topic in each), one lane per concurrent caller (worker):
/// the client's `flush()` waits for every in-flight batch of *its* publisher before it reads its
/// queue again, so workers sharing one publisher would get one request in flight per process.
/// Each call takes a free lane for its whole batch and gives it back after; a call that finds
/// none free makes one, so there are as many lanes as calls ever ran at once (the workers), with
/// no count to configure.
#[derive(Debug, Default)]
struct Lanes {
    topics: Vec<HashMap<String, Publisher>>,
    free: Vec<usize>,
}

/// A lane taken for one publish; given back when dropped.
struct LaneGuard<'a> {
    lanes: &'a Mutex<Lanes>,
    lane: usize,
}

impl Drop for LaneGuard<'_> {
    fn drop(&mut self) {
        let mut lanes = match self.lanes.lock() {
            Ok(l) => l,
            Err(poisoned) => poisoned.into_inner(),
        };
        lanes.free.push(self.lane);
    }
}

/// [`Publish`] over the official `google-cloud-pubsub` client.
#[derive(Debug, Clone)]
pub struct PubsubPublisher {
    base: BasePublisher,
    admin: TopicAdmin,
    lanes: Arc<Mutex<Lanes>>,
    timeout: Duration,
    delay: Duration,
    dedupe_attribute: String,
    /// Where it publishes, for error messages.
    endpoint: String,
    /// The probes' deadline, from the round trips seen.
    clock: Arc<ProbeClock>,
}

impl PubsubPublisher {
    /// Builds the clients. Emulator: anonymous credentials; otherwise Application Default
    /// Credentials (Workload Identity on GKE).
    pub async fn connect(args: &PubsubConfig) -> Result<Self, DispatcherError> {
        let endpoint = args.endpoint();
        let emulator = args.emulator_host.is_some();
        // The client's own retries stay well inside our timeout; longer horizons belong to the row.
        let policy = RetryableErrors
            .with_time_limit(args.publish_timeout.mul_f64(0.8))
            .with_attempt_limit(5);
        let mut base = BasePublisher::builder().with_retry_policy(policy);
        let mut admin = TopicAdmin::builder();
        if let Some(ep) = &endpoint {
            base = base.with_endpoint(ep.clone());
            admin = admin.with_endpoint(ep.clone());
        }
        if emulator {
            base = base.with_credentials(anonymous());
            admin = admin.with_credentials(anonymous());
        }
        let what = endpoint
            .clone()
            .unwrap_or_else(|| "pubsub.googleapis.com (the default endpoint)".to_owned());
        let endpoint_name = what.clone();
        let base = base
            .build()
            .await
            .map_err(|e| DispatcherError::PubsubClient {
                endpoint: what.clone(),
                reason: e.to_string(),
            })?;
        let admin = admin
            .build()
            .await
            .map_err(|e| DispatcherError::PubsubClient {
                endpoint: what,
                reason: e.to_string(),
            })?;
        Ok(Self {
            base,
            admin,
            lanes: Arc::default(),
            timeout: args.publish_timeout,
            delay: args.publish_delay,
            dedupe_attribute: args.dedupe_attribute.clone(),
            endpoint: endpoint_name,
            clock: Arc::default(),
        })
    }

    fn build_publisher(&self, topic: &str) -> Publisher {
        self.base
            .publisher(topic.to_owned())
            .set_message_count_threshold(outbox_shared::limits::MAX_MESSAGES_PER_REQUEST as u32)
            // Leave room under the 10 MB request limit for framing.
            .set_byte_threshold(9_000_000)
            .set_delay_threshold(self.delay)
            .build()
    }

    /// Takes a free lane (or makes one) and picks a
    /// publisher for every message of `batch` (in order): the lane's publisher of the topic for
    /// an unkeyed message, for a keyed one a publisher of the topic built for this batch alone
    /// (see the module doc).
    fn route(&self, batch: &[ClaimedMessage]) -> (LaneGuard<'_>, Vec<Publisher>) {
        let mut lanes = match self.lanes.lock() {
            Ok(l) => l,
            Err(poisoned) => poisoned.into_inner(),
        };
        let lane = match lanes.free.pop() {
            Some(lane) => lane,
            None => {
                lanes.topics.push(HashMap::new());
                lanes.topics.len() - 1
            }
        };
        let unkeyed = &mut lanes.topics[lane];
        let mut keyed: HashMap<&str, Publisher> = HashMap::new();
        let routes = batch
            .iter()
            .map(|m| match m.ordering_key {
                None => unkeyed
                    .entry(m.topic.clone())
                    .or_insert_with(|| self.build_publisher(&m.topic))
                    .clone(),
                Some(_) => keyed
                    .entry(m.topic.as_str())
                    .or_insert_with(|| self.build_publisher(&m.topic))
                    .clone(),
            })
            .collect();
        drop(lanes);
        let guard = LaneGuard {
            lanes: &self.lanes,
            lane,
        };
        (guard, routes)
    }

    /// Publishes each message of `batch` through its publisher (`routes`, in order), flushes each
    /// publisher once, and waits for every result under the publish timeout.
    async fn send(&self, batch: &[ClaimedMessage], routes: &[Publisher]) -> BatchResult {
        let mut pending = Vec::with_capacity(batch.len());
        let mut to_flush: HashMap<(&str, bool), &Publisher> = HashMap::new();
        for (m, publisher) in batch.iter().zip(routes) {
            pending.push(publisher.publish(self.to_message(m)));
            to_flush
                .entry((m.topic.as_str(), m.ordering_key.is_some()))
                .or_insert(publisher);
        }
        // Everything is queued: send it now instead of after the delay threshold, once per
        // publisher (a keyed one has seen only this batch's keys).
        for publisher in to_flush.into_values() {
            let publisher = publisher.clone();
            tokio::spawn(async move { publisher.flush().await });
        }
        let all = futures::future::join_all(pending);
        let started = std::time::Instant::now();
        match tokio::time::timeout(self.timeout, all).await {
            Ok(results) => {
                if results.iter().any(Result::is_ok) {
                    self.clock.answered(started.elapsed());
                }
                results
                    .into_iter()
                    .map(|r| r.map_err(|e| classify(&e)))
                    .collect()
            }
            Err(_) => {
                let failure = PublishFailure::transient(format!(
                    "publish did not complete within {:?} (Pub/Sub slow or unreachable at {})",
                    self.timeout, self.endpoint
                ));
                vec![Err(failure); batch.len()]
            }
        }
    }

    /// The client's message for `m`: the payload shared (not copied), the attributes collected
    /// once (the client's own map is built straight from the row's and the dedupe key).
    fn to_message(&self, m: &ClaimedMessage) -> Message {
        let attributes = m
            .attributes
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .chain(std::iter::once((
                self.dedupe_attribute.clone(),
                m.dedupe_key.clone(),
            )));
        let msg = Message::new()
            .set_data(m.payload.clone())
            .set_attributes(attributes);
        match &m.ordering_key {
            Some(key) => msg.set_ordering_key(key.clone()),
            None => msg,
        }
    }
}

fn anonymous() -> google_cloud_auth::credentials::Credentials {
    google_cloud_auth::credentials::anonymous::Builder::new().build()
}

impl Publish for PubsubPublisher {
    async fn publish(&self, batch: &[ClaimedMessage]) -> BatchResult {
        let waves = waves(batch, KEYS_PER_WAVE);
        if let [_] = waves.as_slice() {
            let (_lane, routes) = self.route(batch);
            return self.send(batch, &routes).await;
        }
        let mut sent = Vec::with_capacity(waves.len());
        for wave in &waves {
            let part: Vec<ClaimedMessage> = wave.iter().map(|i| batch[*i].clone()).collect();
            let (_lane, routes) = self.route(&part);
            sent.push(self.send(&part, &routes).await);
        }
        gather(batch.len(), waves.iter().map(Vec::as_slice).zip(sent))
    }

    async fn publish_apart(&self, batch: &[ClaimedMessage]) -> BatchResult {
        // Publishers of its own, dropped after: they leave no paused key and no state behind.
        let mut own: HashMap<(&str, bool), Publisher> = HashMap::new();
        let routes: Vec<Publisher> = batch
            .iter()
            .map(|m| {
                own.entry((m.topic.as_str(), m.ordering_key.is_some()))
                    .or_insert_with(|| self.build_publisher(&m.topic))
                    .clone()
            })
            .collect();
        self.send(batch, &routes).await
    }

    async fn probe(&self, topic: &str) -> Result<(), ProbeError> {
        let deadline = self.clock.deadline(self.timeout);
        let (admin, clock, cap, name) = (
            self.admin.clone(),
            self.clock.clone(),
            self.timeout,
            topic.to_owned(),
        );
        // Spawned, so that an answer after the deadline still teaches the clock (see ProbeClock).
        let mut call = tokio::spawn(async move {
            let started = std::time::Instant::now();
            let answer = tokio::time::timeout(cap, admin.get_topic().set_topic(name).send()).await;
            let answered = match &answer {
                Ok(Ok(_)) => true,
                Ok(Err(e)) => e.status().is_some() || e.http_status_code().is_some(),
                Err(_) => false,
            };
            if answered {
                clock.answered(started.elapsed());
            }
            answer
        });
        let answer = match tokio::time::timeout(deadline, &mut call).await {
            Ok(Ok(Ok(answer))) => Ok(answer),
            Ok(Ok(Err(_))) | Err(_) => Err(()),
            Ok(Err(join)) => {
                return Err(ProbeError::Unreachable(format!(
                    "the probe of Pub/Sub at {} did not run: {join}",
                    self.endpoint
                )));
            }
        };
        match answer {
            Ok(Ok(_)) => Ok(()),
            // The broker answered; the topic (or our access to it) is the problem, not an outage.
            Ok(Err(e)) if e.status().is_some() || e.http_status_code().is_some() => Ok(()),
            Ok(Err(e)) if classify::refused_before_sending(&e) => {
                Err(ProbeError::Refused(format!("topic {topic:?}: {e}")))
            }
            Ok(Err(e)) => Err(ProbeError::Unreachable(format!(
                "Pub/Sub at {} does not answer: {}",
                self.endpoint,
                classify::describe(&e)
            ))),
            Err(_) => Err(ProbeError::Unreachable(format!(
                "Pub/Sub at {} gave no answer within {deadline:?}",
                self.endpoint
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
        ClaimedMessage {
            id,
            topic: "projects/p/topics/t".to_owned(),
            ordering_key: key.map(str::to_owned),
            dedupe_key: format!("d{id}"),
            payload: bytes::Bytes::new(),
            attributes: Default::default(),
            attempts: 0,
            created_at: chrono::Utc::now(),
        }
    }

    #[test]
    fn a_batch_over_many_keys_goes_in_waves_of_whole_keys_with_the_unkeyed_first() {
        let batch = vec![
            msg(1, Some("a")),
            msg(2, None),
            msg(3, Some("b")),
            msg(4, Some("a")),
            msg(5, Some("c")),
            msg(6, None),
            msg(7, Some("b")),
        ];
        assert_eq!(
            waves(&batch, 2),
            vec![vec![0, 1, 2, 3, 5, 6], vec![4]],
            "keys a and b (whole) with the unkeyed, then c"
        );
        assert_eq!(
            waves(&batch, 3),
            vec![(0..7).collect::<Vec<_>>()],
            "one wave"
        );
        assert_eq!(waves(&[], 3), vec![Vec::<usize>::new()]);
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
