//! One unit of work, [`run_batch`], as a straight line of small steps:
//! claim → local checks → publish → isolate → decide → settle → commit.
//!
//! A batch is one PostgreSQL transaction: the claim locks the rows (`FOR UPDATE SKIP LOCKED`) and
//! the settlement writes every row's new state before the commit. A crash anywhere before the
//! commit rolls everything back (the rows are claimed again; published ones are re-sent:
//! at-least-once). Deciding is pure (`crate::decide`); this module only does the I/O around it.
//!
//! **Isolation.** A publish request is atomic: when Pub/Sub refuses one message of a request
//! (a schema violation, say), every message of that request comes back with the same permanent
//! error. So a permanent failure is never believed at once: the suspects are published again
//! in requests of their own, the unkeyed ones split up until each refused message is alone
//! (keys in order, each message alone, a key stopping at its first failure), and only the ones
//! refused on their own are dead-lettered. Transient failures and outages are never isolated.
//! A topic in a poison storm sends its unkeyed rows in parts from the start (`crate::storm`).
//!
//! **Stalls.** A publish that has had no answer for `--stall-probe-after` triggers a probe with a
//! short deadline; if the broker does not answer the probe either, the batch is an outage at once
//! (released untouched) instead of waiting out the whole `--publish-timeout`.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use opentelemetry::KeyValue;
use outbox_shared::ClaimedMessage;
use outbox_shared::limits::check_publishable;
use outbox_shared::store::claim::{self, ClaimFilter, KeyCursor, KeyFloor, OrderedClaim};
use outbox_shared::store::dead_letter::Failure;
use outbox_shared::store::settle::{self, settle};
use sqlx::PgConnection;
use tracing::Instrument as _;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

use crate::classify::{FailureKind, PublishFailure};
use crate::decide::{self, Attempt, Decision, Policy};
use crate::dispatch::Dispatch;
use crate::error::DispatcherError;
use crate::publisher::{BatchResult, Publish, split};

/// What one batch did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Settled {
    /// Rows claimed.
    pub claimed: usize,
    /// Published and recorded.
    pub published: usize,
    /// Scheduled for another attempt.
    pub retried: usize,
    /// Moved to the dead-letter table.
    pub dead_lettered: usize,
    /// Released untouched (not attempted, held behind a failure on their key, or their topic
    /// refused as a whole).
    pub released: usize,
    /// Rows whose topic Pub/Sub refused as a whole (held: `crate::hold`), among `released`.
    pub topic_refused: usize,
    /// Rows refused for quota, waiting without an attempt charged (`crate::pace`), among
    /// `retried`.
    pub throttled: usize,
    /// A held topic's probe was accepted: the topic is released.
    pub unheld: bool,
}

/// The outcome of [`run_batch`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BatchOutcome {
    /// Nothing was due.
    Empty,
    /// Every claimed row was settled.
    Settled(Settled),
    /// Pub/Sub did not answer: the rows were released untouched and the breaker tripped.
    Outage {
        /// The first error seen.
        error: String,
        /// Rows released.
        released: usize,
    },
}

/// Which rows a batch claims.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scope<'a> {
    /// Everything this replica serves, except the topics it leaves alone now (held, or slowed
    /// down by quota), from where it knows the live rows start.
    Serve,
    /// One row of a held topic, its head (a key's first row, or its oldest unkeyed row): the
    /// probe of `crate::hold`, from the outbox's start.
    Probe(&'a str),
}

/// Claims, publishes and settles one batch of rows due at `now`. With tracing on, the batch is a
/// span (`run_batch`) with the steps `claim`, `publish` and `settle` as its children; retries,
/// dead letters and an outage are its events and status (docs/tracing.md).
pub(crate) async fn run_batch<P: Publish>(
    d: &Dispatch<P>,
    now: DateTime<Utc>,
) -> Result<BatchOutcome, DispatcherError> {
    run(d, now, Scope::Serve).await
}

/// Probes the held `topic` with its head message: a batch of one that, accepted, releases the
/// topic (`crate::hold`). [`BatchOutcome::Empty`] when none of its rows is due.
pub(crate) async fn probe_held<P: Publish>(
    d: &Dispatch<P>,
    topic: &str,
    now: DateTime<Utc>,
) -> Result<BatchOutcome, DispatcherError> {
    run(d, now, Scope::Probe(topic)).await
}

#[tracing::instrument(
    name = "run_batch",
    skip_all,
    fields(
        batch.size = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
        otel.status_message = tracing::field::Empty,
    ),
    err(level = "debug")
)]
async fn run<P: Publish>(
    d: &Dispatch<P>,
    now: DateTime<Utc>,
    scope: Scope<'_>,
) -> Result<BatchOutcome, DispatcherError> {
    let mut steps = Steps::start();
    let claiming = tracing::info_span!("claim", db.system = "postgresql");
    let mut tx = d
        .claim_session
        .begin(&d.pool)
        .instrument(claiming.clone())
        .await?;
    let (mut claimed, give_back) = claim(d, &mut tx, now, scope).instrument(claiming).await?;
    d.metrics.claim_seconds.observe(steps.claimed());
    if claimed.is_empty() {
        // Nothing locked, nothing written: ending the transaction either way is the same.
        let _ = tx.rollback().await;
        return Ok(BatchOutcome::Empty);
    }
    let _in_flight = d.hold(claimed.len());
    tracing::Span::current().record("batch.size", claimed.len());
    d.metrics.batch_size.observe(claimed.len() as f64);
    let backoff = |topic: &str| d.paces.backoff(topic);
    let policy = Policy {
        schedule: &d.settings.schedule,
        skip_dead_letter_topics: &d.settings.skip_dead_letter_topics,
        quota_backoff: &backoff,
    };
    crate::trace::vet(
        &mut claimed,
        d.publisher.dedupe_attribute(),
        &d.metrics,
        &d.trace_log,
    );

    let mut attempts = check(d, &claimed, policy);
    let started = Instant::now();
    let publishing = tracing::info_span!(
        "publish",
        messaging.system = "gcp_pubsub",
        messaging.operation.type = "send",
        messaging.batch.message_count = claimed.len()
    );
    let (outage, decision) = async {
        let stall = publish(d, &claimed, &mut attempts).await;
        isolate(d, &claimed, &mut attempts, policy).await;
        d.storms.learn(&claimed, &attempts);
        for topic in d.paces.learn(&claimed, &attempts) {
            tracing::warn!(
                pubsub.topic = %topic,
                max_backoff = ?d.refusals.quota_max_backoff,
                "Pub/Sub's quota refuses the topic's requests (RESOURCE_EXHAUSTED): it slows down \
                 (its refused rows wait, no attempt is charged) and speeds up again as requests \
                 are accepted."
            );
        }
        let outage = match stall {
            Some(probe_error) => Some(probe_error),
            None if decide::may_be_outage(&attempts) => probe_failure(d, &claimed, &attempts).await,
            None => None,
        };
        let answered = match scope {
            Scope::Probe(topic) => decide::topic_answered(&claimed, &attempts, topic),
            Scope::Serve => false,
        };
        let mut decision = match &outage {
            Some(_) => decide::outage(&claimed, attempts),
            None => decide::decide(&claimed, attempts, policy, now, fastrand::f64),
        };
        if let (Scope::Probe(topic), true, None) = (scope, answered, &outage) {
            decision.settlement.unheld.push(topic.to_owned());
        }
        (outage, decision)
    }
    .instrument(publishing)
    .await;
    steps.published();
    let changed = async {
        let changed = settle(
            &mut tx,
            &decision.settlement,
            d.settings.retain_published,
            now,
            d.refusals.held_probe_interval,
        )
        .await?;
        if !changed.unheld.is_empty()
            && let Some(channel) = &d.notify_channel
        {
            // The released topic's rows are claimable again: wake the dispatchers.
            outbox_shared::notify(&mut tx, channel).await?;
        }
        tx.commit()
            .await
            .map_err(|source| outbox_shared::Error::Database {
                context: "committing a settled batch",
                source,
            })?;
        Ok::<_, DispatcherError>(changed)
    }
    .instrument(tracing::info_span!("settle", db.system = "postgresql"))
    .await?;
    give_back.settled(&claimed, &decision.settlement.released);
    record(d, &claimed, &decision, &changed, now);
    steps.log_if_slow(d, &claimed, now);
    match outage {
        Some(error) => {
            if outbox_runtime::traces::on() {
                let span = tracing::Span::current();
                span.record("otel.status_code", "ERROR");
                span.record("otel.status_message", error.as_str());
                span.add_event(
                    "outage: the batch was released untouched",
                    vec![KeyValue::new("error.message", error.clone())],
                );
            }
            d.metrics.outage_batches.inc();
            let topic = first_sent_topic(&claimed, &decision);
            d.breaker.trip(topic, &error, started);
            Ok(BatchOutcome::Outage {
                error,
                released: decision.settlement.released.len(),
            })
        }
        None => {
            let s = &decision.settlement;
            let refused: HashSet<&str> = s.holds.iter().map(|h| h.topic.as_str()).collect();
            let released: HashSet<i64> = s.released.iter().copied().collect();
            Ok(BatchOutcome::Settled(Settled {
                claimed: claimed.len(),
                published: s.published.len(),
                retried: s.retries.len(),
                dead_lettered: s.dead_letters.len(),
                released: s.released.len(),
                topic_refused: claimed
                    .iter()
                    .filter(|m| released.contains(&m.id) && refused.contains(m.topic.as_str()))
                    .count(),
                throttled: decision.throttled,
                unheld: !changed.unheld.is_empty(),
            }))
        }
    }
}

/// Claims ordering keys first (whole keys, in id order), then fills the batch with unkeyed rows.
/// Serving, each claim starts from where this replica knows the live rows start
/// (`crate::floors`) and leaves alone the topics held or slowed down; the unkeyed floor follows
/// the rows taken, and goes back to them unless the batch settles them ([`GiveBack`]). A probe
/// takes one row of its topic from the outbox's start, and teaches the floors nothing.
async fn claim<'d, P: Publish>(
    d: &'d Dispatch<P>,
    tx: &mut PgConnection,
    now: DateTime<Utc>,
    scope: Scope<'_>,
) -> Result<(Vec<ClaimedMessage>, GiveBack<'d>), DispatcherError> {
    let mut give_back = GiveBack {
        floors: &d.floors,
        oldest: None,
    };
    let probed: [String; 1];
    let (filter, cursor, max_keys, excluded) = match scope {
        Scope::Serve => {
            let (cursor, max_keys) = d.keys.next();
            let filter = ClaimFilter {
                now,
                limit: d.settings.batch_size,
                topics: d.settings.topics.as_deref(),
                excluded: &[],
            };
            (filter, cursor, max_keys, d.left_alone())
        }
        Scope::Probe(topic) => {
            probed = [topic.to_owned()];
            let filter = ClaimFilter {
                now,
                limit: 1,
                topics: Some(&probed),
                excluded: &[],
            };
            let cursor = KeyCursor {
                topic: topic.to_owned(),
                ordering_key: String::new(),
            };
            (filter, cursor, 1, Vec::new())
        }
    };
    let filter = ClaimFilter {
        excluded: &excluded,
        ..filter
    };
    let ordered = OrderedClaim {
        filter: filter.clone(),
        scan_limit: d.settings.key_scan_limit,
        skip_dead_letter_topics: &d.settings.skip_dead_letter_topics,
        max_keys,
    };
    let serving = scope == Scope::Serve;
    let floor = if serving {
        d.floors.key_floor(
            &cursor,
            usize::try_from(ordered.scan_limit).unwrap_or(usize::MAX),
        )
    } else {
        KeyFloor::default()
    };
    let keyed = claim::claim_ordered(tx, &ordered, &cursor, &floor).await?;
    if serving {
        d.floors.saw(keyed.epoch, keyed.allocated, &keyed.seen);
        d.keys.learn(
            keyed.keys,
            keyed.saturated_keys,
            max_keys,
            keyed.next_cursor,
        );
    }
    let mut claimed = keyed.messages;
    let room = filter.limit - claimed.len() as i64;
    if room > 0 {
        let unkeyed = ClaimFilter {
            limit: room,
            ..filter
        };
        let (floor, epoch) = if serving {
            d.floors.unkeyed()
        } else {
            (None, 0)
        };
        let batch = claim::claim_batch(tx, &unkeyed, floor, epoch).await?;
        if serving && let (Some(oldest), Some(epoch)) = (batch.oldest_due, batch.epoch) {
            d.floors.took_unkeyed(epoch, oldest);
            give_back.oldest = Some(oldest);
        }
        claimed.extend(batch.messages);
    }
    Ok((claimed, give_back))
}

/// The unkeyed rows of a batch go back to the queue at their place unless the batch settles
/// them: dropped on every early return (an error, the transaction rolling back) or kept armed
/// after a batch that released some of them, it puts the unkeyed floor back to the oldest.
struct GiveBack<'d> {
    floors: &'d crate::floors::Floors,
    oldest: Option<DateTime<Utc>>,
}

impl GiveBack<'_> {
    /// The batch committed: its unkeyed rows were settled unless `released` holds one of them.
    fn settled(mut self, claimed: &[ClaimedMessage], released: &[i64]) {
        let gave_back = claimed
            .iter()
            .any(|m| m.ordering_key.is_none() && released.contains(&m.id));
        if !gave_back {
            self.oldest = None;
        }
    }
}

impl Drop for GiveBack<'_> {
    fn drop(&mut self) {
        if let Some(oldest) = self.oldest {
            self.floors.lower_unkeyed(oldest);
        }
    }
}

/// The local limit checks: a message that can never be published costs no round trip and is
/// rejected; the later messages of its key are held back (unless its topic skips dead letters).
/// Everything else starts as "not attempted" until the publish says otherwise.
fn check<P: Publish>(
    d: &Dispatch<P>,
    claimed: &[ClaimedMessage],
    policy: Policy<'_>,
) -> Vec<Attempt> {
    let mut reasons: Vec<Option<String>> = claimed
        .iter()
        .map(|m| {
            check_publishable(
                &m.payload,
                &m.attributes,
                m.ordering_key.as_deref(),
                d.publisher.dedupe_attribute(),
                &m.dedupe_key,
            )
            .err()
            .map(|violation| violation.to_string())
        })
        .collect();
    let rejected: HashSet<usize> = (0..claimed.len())
        .filter(|i| reasons[*i].is_some())
        .collect();
    d.metrics.fail("limit", rejected.len() as u64);
    decide::hold_back(claimed, &rejected, policy)
        .into_iter()
        .enumerate()
        .map(|(i, held)| match reasons[i].take() {
            Some(reason) => Attempt::Rejected(reason),
            None if held => Attempt::HeldBack,
            None => Attempt::Failed(PublishFailure {
                kind: FailureKind::NotAttempted,
                message: "not sent".to_owned(),
            }),
        })
        .collect()
}

/// Publishes the messages still "not attempted" under the process-wide byte budget, recording
/// each result in `attempts`. Returns the probe's error when the publish stalled and the broker
/// did not answer a probe either (an outage, detected early).
async fn publish<P: Publish>(
    d: &Dispatch<P>,
    claimed: &[ClaimedMessage],
    attempts: &mut [Attempt],
) -> Option<String> {
    let send: Vec<usize> = (0..claimed.len())
        .filter(
            |i| matches!(&attempts[*i], Attempt::Failed(f) if f.kind == FailureKind::NotAttempted),
        )
        .collect();
    if send.is_empty() {
        return None;
    }
    // The publisher takes a slice: the common case (everything sendable) borrows the claim.
    let owned: Vec<ClaimedMessage>;
    let batch: &[ClaimedMessage] = if send.len() == claimed.len() {
        claimed
    } else {
        owned = send.iter().map(|i| claimed[*i].clone()).collect();
        &owned
    };
    let bytes: usize = batch
        .iter()
        .map(|m| m.payload.len() + m.dedupe_key.len() + 64)
        .sum();
    let _permit = d.inflight.reserve(bytes).await;
    let started = Instant::now();
    let results = watch_for_stall(d, batch).await;
    d.metrics
        .publish_seconds
        .observe(started.elapsed().as_secs_f64());
    match results {
        Ok(results) => {
            for (i, result) in send.iter().zip(results) {
                // A refused request fails every message in it: refused messages are counted
                // once isolation has found them (`isolate`), not here.
                if let Err(failure) = &result
                    && failure.kind != FailureKind::Permanent
                {
                    d.metrics.fail(failure.kind.as_str(), 1);
                }
                attempts[*i] = into_attempt(result);
            }
            None
        }
        Err(probe_error) => Some(probe_error),
    }
}

/// Waits for the publish; if it has not answered after `--stall-probe-after`, probes with a short
/// deadline and gives up on the publish when the probe fails too (the client may still deliver
/// what it holds later: a duplicate, never a loss).
async fn watch_for_stall<P: Publish>(
    d: &Dispatch<P>,
    batch: &[ClaimedMessage],
) -> Result<BatchResult, String> {
    let publishing = crate::storm::publish(&d.storms, d.publisher.as_ref(), &d.metrics, batch);
    tokio::pin!(publishing);
    tokio::select! {
        results = &mut publishing => return Ok(results),
        () = tokio::time::sleep(d.stall_probe_after) => {}
    }
    let topic = batch.first().map_or("", |m| m.topic.as_str());
    tokio::select! {
        results = &mut publishing => Ok(results),
        probe = d.publisher.probe(topic) => match probe {
            Err(e) if e.is_outage() => Err(format!(
                "no answer to a publish for {:?}, and the probe failed: {e}",
                d.stall_probe_after
            )),
            // It answered, or refused the probe before sending (not an outage): wait on.
            _ => Ok(publishing.await),
        },
    }
}

/// Finds which messages Pub/Sub itself refuses among those that got a permanent error (a refused
/// request fails every message in it): the unkeyed suspects in up to 16 parts, each in requests
/// of its own, a refused part split again in 4 until a refused message is alone: k poisoned
/// messages among n suspects cost about 16 + 4·k·log4(n/16k) requests and 1 + log4(n/16)
/// round trips (5 among 500: about 64 requests in 4 rounds), instead of n requests. On a key, in
/// order from its first permanent failure, each message alone, stopping at the next failure unless the topic skips
/// dead letters. Everything of one round goes at once: the parts, and every key (a key's own
/// messages one after the other).
async fn isolate<P: Publish>(
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
    let (unkeyed, by_key) = futures::join!(split_out(d, claimed, unkeyed), by_key);
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

/// How many parts the suspects are split into first (they were refused together already).
const FIRST_FAN_OUT: usize = 16;
/// How many parts a refused part is split into for the next round: a part holds few refused
/// messages by then, and 4 parts per round find each in fewer requests than 16 (about 64
/// instead of 96 for 5 among 500), for one more round trip.
const NEXT_FAN_OUT: usize = 4;

/// The unkeyed suspects' verdicts by splitting (see [`isolate`]), by index.
async fn split_out<P: Publish>(
    d: &Dispatch<P>,
    claimed: &[ClaimedMessage],
    suspects: Vec<usize>,
) -> Vec<(usize, Attempt)> {
    let mut verdicts = Vec::new();
    // They were refused together already: the first round sends them in parts
    // (docs/benchmarks/2026-12-02-publish-path.md compares halving, √n parts and this).
    let mut groups = split(&suspects, FIRST_FAN_OUT);
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
            next.extend(split(&refused, NEXT_FAN_OUT));
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

fn into_attempt(result: Result<String, PublishFailure>) -> Attempt {
    match result {
        Ok(message_id) => Attempt::Published(message_id),
        Err(failure) => Attempt::Failed(failure),
    }
}

/// Every message sent failed transiently: is it the messages, or is Pub/Sub down for everyone?
/// Returns the probe's error when the broker does not answer.
async fn probe_failure<P: Publish>(
    d: &Dispatch<P>,
    claimed: &[ClaimedMessage],
    attempts: &[Attempt],
) -> Option<String> {
    let (m, failure) = claimed.iter().zip(attempts).find_map(|(m, a)| match a {
        Attempt::Failed(f) if f.kind == FailureKind::Transient => Some((m, f)),
        _ => None,
    })?;
    let probe = d
        .publisher
        .probe(&m.topic)
        .await
        .err()
        .filter(|e| e.is_outage())?;
    Some(format!("{} (probe: {probe})", failure.message))
}

fn first_sent_topic<'a>(claimed: &'a [ClaimedMessage], decision: &Decision) -> &'a str {
    let released: HashSet<i64> = decision.settlement.released.iter().copied().collect();
    claimed
        .iter()
        .find(|m| released.contains(&m.id))
        .or(claimed.first())
        .map_or("", |m| m.topic.as_str())
}

/// When each step of a batch ended, for the slow-batch log (`--slow-batch`): where the time of
/// a late message went (waiting to be claimed, the claim, the publish, the settlement).
struct Steps {
    started: Instant,
    claimed: Instant,
    published: Instant,
}

impl Steps {
    fn start() -> Self {
        let now = Instant::now();
        Self {
            started: now,
            claimed: now,
            published: now,
        }
    }

    /// The claim ended; returns its duration in seconds.
    fn claimed(&mut self) -> f64 {
        self.claimed = Instant::now();
        (self.claimed - self.started).as_secs_f64()
    }

    /// The publish (isolation and probes included) ended.
    fn published(&mut self) {
        self.published = Instant::now();
    }

    /// The batch committed: a warning with each step's time when it was slow, or its oldest row
    /// had waited `--slow-batch` to be claimed; at most one a second per process (`held_back`
    /// counts the slow batches not logged since the last line).
    fn log_if_slow<P>(&self, d: &Dispatch<P>, claimed: &[ClaimedMessage], now: DateTime<Utc>) {
        let threshold = d.settings.slow_batch;
        let total = self.started.elapsed();
        let waited = claimed
            .iter()
            .map(|m| m.created_at)
            .min()
            .and_then(|oldest| (now - oldest).to_std().ok())
            .unwrap_or_default();
        if threshold.is_zero() || (total < threshold && waited < threshold) {
            return;
        }
        let Some(held_back) = d.slow_log.pass() else {
            return;
        };
        let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        tracing::warn!(
            batch.size = claimed.len(),
            wait_ms = ms(waited),
            claim_ms = ms(self.claimed - self.started),
            publish_ms = ms(self.published - self.claimed),
            settle_ms = ms(self.published.elapsed()),
            total_ms = ms(total),
            held_back,
            "Slow batch: wait_ms is how long its oldest row waited to be claimed, the other fields \
             what each step took (publish_ms includes the byte budget's wait, isolation and \
             probes; settle_ms the commit); the runbook in docs/operating.md, \"A message was late\", \
             says what each points at."
        );
    }
}

/// Metrics and logs of a settled batch (after the commit: only what is durable is reported), and
/// the held topics it started or ended in this replica's memory.
fn record<P: Publish>(
    d: &Dispatch<P>,
    claimed: &[ClaimedMessage],
    decision: &Decision,
    changed: &settle::Settled,
    now: DateTime<Utc>,
) {
    let s = &decision.settlement;
    let published: HashSet<i64> = s.published.iter().map(|(id, _)| *id).collect();
    for m in claimed.iter().filter(|m| published.contains(&m.id)) {
        let lag = (now - m.created_at).num_milliseconds().max(0) as f64 / 1000.0;
        d.metrics.lag_seconds.observe(lag);
    }
    d.metrics.published.inc_by(s.published.len() as u64);
    d.metrics.retried.inc_by(s.retries.len() as u64);
    if outbox_runtime::traces::on() && !s.retries.is_empty() {
        let span = tracing::Span::current();
        for r in &s.retries {
            span.add_event(
                "retry scheduled",
                vec![
                    KeyValue::new("outbox.id", r.id),
                    KeyValue::new("outbox.attempt", i64::from(r.attempts)),
                    KeyValue::new("outbox.next_attempt_at", r.next_attempt_at.to_rfc3339()),
                    KeyValue::new("error.message", r.last_error.clone()),
                ],
            );
        }
    }
    for f in &s.dead_letters {
        d.metrics.dead_letter(f.kind.as_str(), 1);
        let dead_letter_id = changed
            .dead_letter_ids
            .iter()
            .find(|(outbox_id, _)| *outbox_id == f.id)
            .map(|(_, id)| *id);
        if let Some(m) = claimed.iter().find(|m| m.id == f.id) {
            log_dead_letter(d, m, f, dead_letter_id);
        }
    }
    for hold in &s.holds {
        d.holds.add(&hold.topic, &hold.code, &hold.message, now);
        if changed.held.contains(&hold.topic) {
            let waiting = claimed.iter().filter(|m| m.topic == hold.topic).count();
            tracing::warn!(
                pubsub.topic = %hold.topic, code = %hold.code, error = %hold.message,
                first_probe = ?d.refusals.held_probe_interval,
                max_probe_interval = ?d.refusals.held_max_probe_interval,
                batch_rows = waiting,
                "Pub/Sub refuses the topic as a whole, not a message of it: the topic is held. Its \
                 rows wait untouched (no attempt charged, nothing dead-lettered, every key in \
                 order), the other topics flow, and it is probed with its head message until Pub/Sub \
                 accepts it. If it does not clear within minutes: docs/operating.md, \"A topic is held\"."
            );
        }
    }
    for topic in &changed.unheld {
        d.holds.remove(topic);
        tracing::info!(
            pubsub.topic = %topic,
            "Pub/Sub accepts the held topic again: it is released and its rows flow."
        );
    }
}

fn log_dead_letter<P: Publish>(
    d: &Dispatch<P>,
    m: &ClaimedMessage,
    f: &Failure,
    dead_letter_id: Option<i64>,
) {
    match m.ordering_key.as_deref() {
        Some(key) if !d.settings.skip_dead_letter_topics.contains(&m.topic) => tracing::error!(
            dead_letter.id = dead_letter_id, outbox.id = f.id, outbox.dedupe_key = %m.dedupe_key,
            pubsub.topic = %m.topic, pubsub.ordering_key = key, error.kind = f.kind.as_str(),
            error = %f.error,
            "Ordering key BLOCKED: its message was dead-lettered (dispatcher dead-letters show \
             <dead_letter.id>) and the later messages of the key wait; replay or discard the dead \
             letter to release the key."
        ),
        _ => tracing::error!(
            dead_letter.id = dead_letter_id, outbox.id = f.id, outbox.dedupe_key = %m.dedupe_key,
            pubsub.topic = %m.topic, error.kind = f.kind.as_str(), error = %f.error,
            "Message dead-lettered: inspect it (dispatcher dead-letters show <dead_letter.id>), \
             then replay or discard it."
        ),
    }
}
