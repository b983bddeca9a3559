//! The batch's second step: sending it, and deciding what becomes of each row. A straight line: the
//! local checks (limits, trace context), the first attempt (every sendable row at once, under the
//! byte budget, watched for a stall), isolation of what Pub/Sub refused (`crate::batch::isolate`),
//! what the storms and the quota learn, whether it was an outage, and the decision
//! (`crate::batch::decide`, pure). Nothing is written here: the batch's last step settles the
//! decision in the claim's transaction (`crate::batch::outcome`).
//!
//! **Stalls.** A publish that has had no answer for `--stall-probe-after` triggers a probe with a
//! short deadline; if the broker does not answer the probe either, the batch is an outage at once
//! (released untouched) instead of waiting out the whole `--publish-timeout`.

use std::collections::HashSet;
use std::time::Instant;

use chrono::{DateTime, Utc};
use outbox_shared::ClaimedMessage;
use outbox_shared::limits::check_publishable;
use tracing::Instrument as _;

use crate::batch::claim::Scope;
use crate::batch::decide::{self, Decision, Policy};
use crate::batch::dispatch::Dispatch;
use crate::batch::isolate::Isolation;
use crate::metrics;
use crate::pubsub::classify::{FailureKind, PublishFailure};
use crate::pubsub::publish::{Attempt, BatchResult, Publish};

/// What sending a batch came to.
pub(crate) struct Sent {
    /// Every row's fate, for the settlement.
    pub(crate) decision: Decision,
    /// Pub/Sub did not answer (the probe's error): the batch is released untouched.
    pub(crate) outage: Option<String>,
    /// When the first attempt started (the breaker's clock, on an outage).
    pub(crate) started: Instant,
}

/// Sends the claimed rows and decides each one's fate (the module doc). The send is a span
/// (`publish`) of the batch's.
pub(crate) async fn send<P: Publish>(
    d: &Dispatch<P>,
    claimed: &mut [ClaimedMessage],
    now: DateTime<Utc>,
    scope: Scope<'_>,
) -> Sent {
    let backoff = |topic: &str| d.paces.backoff(topic);
    let policy = Policy {
        schedule: &d.settings.schedule,
        skip_dead_letter_topics: &d.settings.skip_dead_letter_topics,
        quota_backoff: &backoff,
    };
    crate::pubsub::trace::vet(
        claimed,
        d.publisher.dedupe_attribute(),
        &d.metrics.trace_context_ignored,
        &d.trace_log,
    );
    let claimed: &[ClaimedMessage] = claimed;
    let mut attempts = check(d, claimed, policy);
    let started = Instant::now();
    let publishing = tracing::info_span!(
        "publish",
        messaging.system = "gcp_pubsub",
        messaging.operation.type = "send",
        messaging.batch.message_count = claimed.len()
    );
    async {
        let stall = first_attempt(d, claimed, &mut attempts).await;
        isolation(d).isolate(claimed, &mut attempts, policy).await;
        learn(d, claimed, &attempts);
        let outage = match stall {
            Some(probe_error) => Some(probe_error),
            None if decide::may_be_outage(&attempts) => probe_failure(d, claimed, &attempts).await,
            None => None,
        };
        let answered = match scope {
            Scope::Probe(topic) => decide::topic_answered(claimed, &attempts, topic),
            Scope::Serve => false,
        };
        let mut decision = match &outage {
            Some(_) => decide::outage(claimed, attempts),
            None => decide::decide(claimed, attempts, policy, now, fastrand::f64),
        };
        if let (Scope::Probe(topic), true, None) = (scope, answered, &outage) {
            decision.settlement.unheld.push(topic.to_owned());
        }
        Sent {
            decision,
            outage,
            started,
        }
    }
    .instrument(publishing)
    .await
}

/// Isolation sends with the workers' publisher and counts on their metrics.
fn isolation<P>(d: &Dispatch<P>) -> Isolation<'_, P> {
    Isolation {
        publisher: &d.publisher,
        metrics: &d.metrics,
    }
}

/// What the storms and the quota learn from the batch's final attempts.
fn learn<P: Publish>(d: &Dispatch<P>, claimed: &[ClaimedMessage], attempts: &[Attempt]) {
    d.storms.learn(claimed, attempts);
    for topic in d.paces.learn(claimed, attempts) {
        tracing::warn!(
            pubsub.topic = %topic,
            max_backoff = ?d.refusals.quota_max_backoff,
            "Pub/Sub's quota refuses the topic's requests (RESOURCE_EXHAUSTED): it slows down \
             (its refused rows wait, no attempt is charged) and speeds up again as requests \
             are accepted."
        );
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
    d.metrics.fail(metrics::LIMIT, rejected.len() as u64);
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
async fn first_attempt<P: Publish>(
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
                attempts[*i] = Attempt::from(result);
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
    let (isolation, in_storm) = (isolation(d), d.storms.in_storm(batch));
    let publishing = isolation.send_cut(batch, &in_storm);
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
