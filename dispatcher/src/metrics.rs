//! The dispatcher's Prometheus metrics. Counters for flows, gauges for states, histograms for
//! batch size, publish latency and end-to-end lag (created -> published).

use std::sync::atomic::AtomicU64;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use outbox_shared::store::dead_letter::ErrorKind;

use crate::pubsub::classify::FailureKind;

/// The `kind` of a publish failure refused by the local limit checks (never sent, so of no
/// [`FailureKind`]).
pub const LIMIT: &str = "limit";

/// The kinds of dead letters the dispatcher writes (`rejected` is the producer's).
pub const DEAD_LETTER_KINDS: [ErrorKind; 2] = [ErrorKind::Permanent, ErrorKind::Exhausted];

/// Every `kind` of `outbox_publish_failures_total`: each [`FailureKind`]'s, and [`LIMIT`].
fn failure_kinds() -> impl Iterator<Item = &'static str> {
    FailureKind::ALL
        .into_iter()
        .map(FailureKind::as_str)
        .chain([LIMIT])
}

/// A one-label set: `kind`.
pub type KindLabel = Vec<(&'static str, &'static str)>;

/// Labels with owned values: `topic`, and `kind` where it applies. Topic names are
/// configuration, never message content.
pub type Labels = Vec<(&'static str, String)>;

/// Every metric the dispatcher exports.
#[derive(Debug)]
pub struct Metrics {
    /// Messages published.
    pub published: Counter,
    /// Failed message publishes, by kind (transient, permanent, topic_refused, throttled, limit,
    /// not_attempted).
    pub failed: Family<KindLabel, Counter>,
    /// Retries scheduled on rows.
    pub retried: Counter,
    /// Messages moved to the dead-letter table, by kind (permanent, exhausted).
    pub dead_lettered: Family<KindLabel, Counter>,
    /// Batches released untouched because Pub/Sub was unreachable.
    pub outage_batches: Counter,
    /// Claims that found nothing due (idle polls and wake-ups that found the work taken).
    pub empty_claims: Counter,
    /// Batches whose permanent publish failures were isolated (each message published alone).
    pub isolations: Counter,
    /// Messages published alone to isolate a permanent failure.
    pub isolation_publishes: Counter,
    /// Rows whose trace context was ignored (a malformed `traceparent`, or no room left for the
    /// trace attributes): published without it.
    pub trace_context_ignored: Counter,
    /// Rows the probe found that the claims' floors passed over, by kind (unkeyed: a row below
    /// the floor nobody holds; keyed: a key whose head is below the head this replica knew).
    pub floor_stragglers: Family<KindLabel, Counter>,
    /// Ordering keys with rows below the keyed claim floor (old keys, looked up one by one).
    pub old_keys: Gauge,
    /// Seconds since the newest settled mark was stamped (the floors may rise no further): a
    /// writer transaction open on the outbox holds it back for as long as it is open.
    pub floor_settled_age_seconds: Gauge<f64, AtomicU64>,
    /// Messages per claimed batch.
    pub batch_size: Histogram,
    /// Seconds one batch publish took.
    pub publish_seconds: Histogram,
    /// Seconds one claim took (its `BEGIN` and claim statements; empty claims included).
    pub claim_seconds: Histogram,
    /// Seconds from enqueue to publish.
    pub lag_seconds: Histogram,
    /// Unpublished rows per topic (of the topics this replica serves; capped count).
    pub backlog: Family<Labels, Gauge>,
    /// Age in seconds of the oldest row due now, per topic.
    pub oldest_due_age_seconds: Family<Labels, Gauge<f64, AtomicU64>>,
    /// Age in seconds of the oldest row a claim could take now (due, topic not paused, key not
    /// blocked by a dead letter), per topic: the autoscaling signal.
    pub claimable_age_seconds: Family<Labels, Gauge<f64, AtomicU64>>,
    /// Dead letters per topic and kind.
    pub dead_letters: Family<Labels, Gauge>,
    /// 1 per paused topic.
    pub paused: Family<Labels, Gauge>,
    /// The live replicas by release, as this replica's heartbeat reads them.
    pub replicas: Family<Labels, Gauge>,
    /// Pool connections by state (in_use, idle).
    pub pool_connections: Family<Labels, Gauge>,
    /// 1 while the circuit breaker holds claiming because Pub/Sub is unreachable.
    pub breaker_open: Gauge,
    /// Ordering keys held back by a dead-lettered message (an operator must act).
    pub blocked_keys: Gauge,
    /// The fraction of publishes failed on purpose (`--inject-failure-rate`; 0 in production).
    pub fault_injection_rate: Gauge<f64, AtomicU64>,
    /// Seconds since Pub/Sub began refusing a held topic, per topic (`crate::refusals::hold`); the
    /// paging alert's input.
    pub topic_held_seconds: Family<Labels, Gauge<f64, AtomicU64>>,
    /// Probes of held topics sent by this replica.
    pub held_topic_probes: Counter,
    /// The quota backoff of a topic Pub/Sub refuses for quota, per topic (`crate::refusals::pace`).
    pub quota_backoff_seconds: Family<Labels, Gauge<f64, AtomicU64>>,
}

impl Metrics {
    /// Creates the metrics and registers them under the `outbox_` prefix.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::new();
        let r = registry.sub_registry_with_prefix("outbox");
        m.register_flows(r);
        m.register_histograms(r);
        m.register_states(r);
        m.register_refusals(r);
        // Every labelled series exists from the start (at 0), so alerts on increases work from the
        // first failure.
        for kind in failure_kinds() {
            m.fail(kind, 0);
        }
        for kind in DEAD_LETTER_KINDS {
            m.dead_letter(kind, 0);
        }
        m
    }

    /// The metrics at zero, registered nowhere.
    fn new() -> Self {
        Self {
            published: Counter::default(),
            failed: Family::default(),
            retried: Counter::default(),
            dead_lettered: Family::default(),
            outage_batches: Counter::default(),
            empty_claims: Counter::default(),
            isolations: Counter::default(),
            trace_context_ignored: Counter::default(),
            isolation_publishes: Counter::default(),
            floor_stragglers: Family::default(),
            old_keys: Gauge::default(),
            floor_settled_age_seconds: Gauge::default(),
            batch_size: Histogram::new(exponential_buckets(1.0, 2.0, 11)),
            publish_seconds: Histogram::new(exponential_buckets(0.001, 2.0, 16)),
            claim_seconds: Histogram::new(exponential_buckets(0.0005, 2.0, 16)),
            lag_seconds: Histogram::new(exponential_buckets(0.005, 2.0, 20)),
            backlog: Family::default(),
            oldest_due_age_seconds: Family::default(),
            claimable_age_seconds: Family::default(),
            dead_letters: Family::default(),
            paused: Family::default(),
            replicas: Family::default(),
            pool_connections: Family::default(),
            breaker_open: Gauge::default(),
            blocked_keys: Gauge::default(),
            fault_injection_rate: Gauge::default(),
            topic_held_seconds: Family::default(),
            held_topic_probes: Counter::default(),
            quota_backoff_seconds: Family::default(),
        }
    }

    /// The flows (counters), and the keyed claims' old keys.
    fn register_flows(&self, r: &mut Registry) {
        r.register(
            "published",
            "Messages published to Pub/Sub",
            self.published.clone(),
        );
        r.register(
            "publish_failures",
            "Messages whose publish failed, by kind: transient, topic_refused (the topic refused as a whole: held), throttled (quota: no attempt charged) and not_attempted (each message of a failed request), permanent (each message Pub/Sub refused on its own, found by isolation), limit (refused locally by a limit check)",
            self.failed.clone(),
        );
        r.register(
            "retries_scheduled",
            "Retries scheduled on outbox rows",
            self.retried.clone(),
        );
        r.register(
            "dead_lettered",
            "Messages moved to the dead-letter table by kind",
            self.dead_lettered.clone(),
        );
        r.register(
            "outage_batches",
            "Batches released untouched because Pub/Sub was unreachable",
            self.outage_batches.clone(),
        );
        r.register(
            "empty_claims",
            "Claims that found nothing due",
            self.empty_claims.clone(),
        );
        r.register(
            "isolations",
            "Batches whose permanent publish failures were isolated (suspects published again apart)",
            self.isolations.clone(),
        );
        r.register(
            "trace_context_ignored",
            "Rows published without their trace context (a malformed traceparent, or no room for the trace attributes)",
            self.trace_context_ignored.clone(),
        );
        r.register(
            "isolation_publishes",
            "Requests sent apart to tell a bad message from the request it shared (parts of the unkeyed suspects, and of a storming topic's rows; keyed messages alone)",
            self.isolation_publishes.clone(),
        );
        r.register(
            "floor_stragglers",
            "Rows the probe found below where the claims start (kind: unkeyed, keyed); claims take them next",
            self.floor_stragglers.clone(),
        );
        r.register(
            "old_keys",
            "Ordering keys with rows below where keyed claims start (each looked up from its last head)",
            self.old_keys.clone(),
        );
        r.register(
            "floor_settled_age_seconds",
            "Seconds since the newest settled mark was stamped: the claims' floors rise no further than it, and a writer transaction open on the outbox holds it back",
            self.floor_settled_age_seconds.clone(),
        );
    }

    /// Batch size, and the durations of publishes, claims and the way through.
    fn register_histograms(&self, r: &mut Registry) {
        r.register(
            "batch_size",
            "Messages per claimed batch",
            self.batch_size.clone(),
        );
        r.register(
            "publish_duration_seconds",
            "Seconds one batch publish took",
            self.publish_seconds.clone(),
        );
        r.register(
            "claim_duration_seconds",
            "Seconds one claim took (BEGIN and the claim statements, empty claims included)",
            self.claim_seconds.clone(),
        );
        r.register(
            "end_to_end_lag_seconds",
            "Seconds from enqueue to publish",
            self.lag_seconds.clone(),
        );
    }

    /// The states (gauges): backlog, dead letters, pauses, the pool, the build, ages, the breaker.
    fn register_states(&self, r: &mut Registry) {
        r.register(
            "backlog_rows",
            "Unpublished outbox rows per topic (count capped at 1,000,000)",
            self.backlog.clone(),
        );
        r.register(
            "dead_letters",
            "Rows in pubsub_outbox_dead_letter per topic and kind",
            self.dead_letters.clone(),
        );
        r.register(
            "paused_topic",
            "1 for each paused topic (dispatcher pause / resume)",
            self.paused.clone(),
        );
        r.register(
            "db_pool_connections",
            "Database pool connections by state",
            self.pool_connections.clone(),
        );
        r.register(
            "replicas",
            "Live dispatcher replicas (a heartbeat within 30 s) by release, as this replica reads \
             the heartbeat table: two releases during a rollout (every replica reports the same \
             count: take max, not sum)",
            self.replicas.clone(),
        );
        let build = Family::<Labels, Gauge>::default();
        build
            .get_or_create(&vec![
                ("version", env!("CARGO_PKG_VERSION").to_owned()),
                ("commit", outbox_runtime::release::COMMIT.to_owned()),
            ])
            .set(1);
        r.register("build_info", "The dispatcher's version", build);
        r.register(
            "oldest_due_age_seconds",
            "Age of the oldest outbox row due now, per topic",
            self.oldest_due_age_seconds.clone(),
        );
        r.register(
            "claimable_age_seconds",
            "Age of the oldest outbox row a claim could take now (due, topic not paused, key not blocked), per topic",
            self.claimable_age_seconds.clone(),
        );
        r.register(
            "breaker_open",
            "1 while claiming is paused because Pub/Sub is unreachable",
            self.breaker_open.clone(),
        );
    }

    /// Fault injection, held topics, the quota's backoff and the blocked keys.
    fn register_refusals(&self, r: &mut Registry) {
        r.register(
            "fault_injection_rate",
            "Fraction of publishes this replica fails on purpose (--inject-failure-rate; 0 in production)",
            self.fault_injection_rate.clone(),
        );
        r.register(
            "topic_held_seconds",
            "Seconds since Pub/Sub began refusing a held topic as a whole (PERMISSION_DENIED, NOT_FOUND, FAILED_PRECONDITION, UNIMPLEMENTED): its rows wait untouched; absent once released",
            self.topic_held_seconds.clone(),
        );
        r.register(
            "held_topic_probes",
            "Probes of held topics (a publish of the topic's head message) this replica sent",
            self.held_topic_probes.clone(),
        );
        r.register(
            "quota_backoff_seconds",
            "How long this replica leaves a topic alone after Pub/Sub's quota refused it (RESOURCE_EXHAUSTED); absent at full speed",
            self.quota_backoff_seconds.clone(),
        );
        r.register(
            "blocked_ordering_keys",
            "Ordering keys held back by a dead-lettered message: replay or discard it",
            self.blocked_keys.clone(),
        );
    }

    /// Counts `n` failures of `kind` ([`FailureKind::as_str`], or [`LIMIT`]).
    pub fn fail(&self, kind: &'static str, n: u64) {
        self.failed.get_or_create(&vec![("kind", kind)]).inc_by(n);
    }

    /// Counts `n` dead letters of `kind`.
    pub fn dead_letter(&self, kind: ErrorKind, n: u64) {
        self.dead_lettered
            .get_or_create(&vec![("kind", kind.as_str())])
            .inc_by(n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exported() -> String {
        let mut registry = Registry::default();
        let _metrics = Metrics::register(&mut registry);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).expect("encodes");
        text
    }

    #[test]
    fn every_failure_kind_and_dead_letter_kind_has_a_series_from_the_start() {
        let text = exported();
        for kind in FailureKind::ALL {
            // Exhaustive: a new kind stops this compiling until it is named here; list it in
            // `FailureKind::ALL` too, whose kinds the metrics register.
            let (FailureKind::Transient
            | FailureKind::Permanent
            | FailureKind::TopicRefused
            | FailureKind::Throttled
            | FailureKind::NotAttempted) = kind;
            let series = format!(
                "outbox_publish_failures_total{{kind=\"{}\"}} 0",
                kind.as_str()
            );
            assert!(text.contains(&series), "no {series} in:\n{text}");
        }
        let series = format!("outbox_publish_failures_total{{kind=\"{LIMIT}\"}} 0");
        assert!(text.contains(&series), "no {series}");
        for kind in DEAD_LETTER_KINDS {
            let series = format!("outbox_dead_lettered_total{{kind=\"{}\"}} 0", kind.as_str());
            assert!(text.contains(&series), "no {series} in:\n{text}");
        }
    }
}
