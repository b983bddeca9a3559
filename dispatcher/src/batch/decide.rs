//! The decisions of a unit of work, as pure functions of what was claimed and what happened to it,
//! so every case is a table test without PostgreSQL or Pub/Sub:
//!
//! - [`hold_back`]: which claimed messages may be sent. A message refused by the local limit
//!   checks never is; the later messages of its ordering key are held back (released untouched)
//!   unless its topic lets keys skip dead letters.
//! - [`decide`]: from every message's [`Attempt`], the retry schedule and the ordering policy, the
//!   [`Decision`]: what is published, retried (when), dead-lettered (why) or released untouched.
//!
//! Invariant kept by both: on an ordering key, nothing after a message that was not published
//! goes out in the same batch unless the key's topic skips dead letters and that message was
//! dead-lettered.

use std::collections::HashSet;
use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox_shared::ClaimedMessage;
use outbox_shared::retry::{RetryDecision, RetrySchedule};
use outbox_shared::store::dead_letter::{ErrorKind, Failure, REFUSED_LOCALLY};
use outbox_shared::store::held_topic::Hold;
use outbox_shared::store::outbox::Retry;
use outbox_shared::store::settle::Settlement;

use crate::pubsub::classify::{FailureKind, PublishFailure};
use crate::pubsub::publish::Attempt;

/// The ordering policy, the retry schedule and the quota backoff a decision applies.
#[derive(Clone, Copy)]
pub(crate) struct Policy<'a> {
    pub(crate) schedule: &'a RetrySchedule,
    pub(crate) skip_dead_letter_topics: &'a [String],
    /// How long a topic's rows refused for quota wait (`crate::refusals::pace`), before jitter.
    pub(crate) quota_backoff: &'a (dyn Fn(&str) -> Duration + Sync),
}

impl std::fmt::Debug for Policy<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Policy")
            .field("schedule", self.schedule)
            .field("skip_dead_letter_topics", &self.skip_dead_letter_topics)
            .finish_non_exhaustive()
    }
}

impl Policy<'_> {
    /// Whether the keys of `topic` go on past a dead-lettered message.
    pub(crate) fn skips(&self, topic: &str) -> bool {
        self.skip_dead_letter_topics.iter().any(|t| t == topic)
    }
}

/// What a batch decided: the rows to write. (Nothing is owed to the publisher after the commit: it
/// keeps no state per key, see `crate::pubsub::publisher`; a key stopped at a failure stays stopped
/// through the rows written here.)
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Decision {
    /// The database writes (one store call, in the batch transaction).
    pub(crate) settlement: Settlement,
    /// Rows refused for quota, among the retries (no attempt charged).
    pub(crate) throttled: usize,
}

/// Marks, in batch order, the messages that must not be sent: locally `rejected` ones (index set)
/// and, on a key whose topic does not skip dead letters, every later message of that key.
pub(crate) fn hold_back(
    claimed: &[ClaimedMessage],
    rejected: &HashSet<usize>,
    policy: Policy<'_>,
) -> Vec<bool> {
    let mut blocked: HashSet<(&str, &str)> = HashSet::new();
    claimed
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let key = m.ordering_key.as_deref().map(|k| (m.topic.as_str(), k));
            if key.is_some_and(|k| blocked.contains(&k)) {
                return true;
            }
            if rejected.contains(&i) {
                if let Some(k) = key
                    && !policy.skips(&m.topic)
                {
                    blocked.insert(k);
                }
                return true;
            }
            false
        })
        .collect()
}

/// Turns every claimed message's attempt into the batch's decision. `random` draws the jitter
/// (one value in 0..1 per retry), so tests pass a constant.
pub(crate) fn decide(
    claimed: &[ClaimedMessage],
    attempts: Vec<Attempt>,
    policy: Policy<'_>,
    now: DateTime<Utc>,
    mut random: impl FnMut() -> f64,
) -> Decision {
    let mut d = Decision::default();
    let mut paused: HashSet<(&str, &str)> = HashSet::new();
    for (m, attempt) in claimed.iter().zip(attempts) {
        let key = m.ordering_key.as_deref().map(|k| (m.topic.as_str(), k));
        if key.is_some_and(|k| paused.contains(&k)) && !matches!(attempt, Attempt::Published(_)) {
            // Behind a failure on its key: whatever the client reported, it waits untouched.
            d.settlement.released.push(m.id);
            continue;
        }
        match attempt {
            Attempt::Published(message_id) => d.settlement.published.push((m.id, message_id)),
            Attempt::HeldBack => d.settlement.released.push(m.id),
            Attempt::Rejected(reason) => {
                d.settlement.dead_letters.push(Failure {
                    id: m.id,
                    attempts: m.attempts,
                    kind: ErrorKind::Permanent,
                    error: format!("{REFUSED_LOCALLY}{reason}"),
                });
                if let Some(k) = key
                    && !policy.skips(&m.topic)
                {
                    paused.insert(k);
                }
            }
            Attempt::Failed(failure) => {
                if let Some(k) = key {
                    let goes_on = failure.kind == FailureKind::Permanent && policy.skips(&m.topic);
                    if !goes_on {
                        paused.insert(k);
                    }
                }
                if failure.kind == FailureKind::Throttled {
                    d.throttled += 1;
                }
                if failure.kind == FailureKind::TopicRefused
                    && !d.settlement.holds.iter().any(|h| h.topic == m.topic)
                {
                    d.settlement.holds.push(hold(&m.topic, &failure.message));
                }
                settle_failure(&mut d.settlement, m, failure, policy, now, &mut random);
            }
        }
    }
    d
}

fn settle_failure(
    s: &mut Settlement,
    m: &ClaimedMessage,
    failure: PublishFailure,
    policy: Policy<'_>,
    now: DateTime<Utc>,
    random: &mut impl FnMut() -> f64,
) {
    match failure.kind {
        FailureKind::NotAttempted | FailureKind::TopicRefused => s.released.push(m.id),
        FailureKind::Throttled => {
            // Waits the topic's backoff, between half and all of it, with no attempt charged.
            let wait = (policy.quota_backoff)(&m.topic).mul_f64(0.5 + random() / 2.0);
            s.retries.push(Retry {
                id: m.id,
                attempts: m.attempts,
                next_attempt_at: now
                    + chrono::Duration::from_std(wait).unwrap_or(chrono::Duration::zero()),
                last_error: format!(
                    "{} (quota: tried again without charging an attempt)",
                    failure.message
                ),
            });
        }
        FailureKind::Permanent => s.dead_letters.push(Failure {
            id: m.id,
            attempts: m.attempts.saturating_add(1),
            kind: ErrorKind::Permanent,
            error: failure.message,
        }),
        FailureKind::Transient => match policy.schedule.on_failure(m.attempts, now, random()) {
            RetryDecision::RetryAt { at, attempts } => s.retries.push(Retry {
                id: m.id,
                attempts,
                next_attempt_at: at,
                last_error: failure.message,
            }),
            RetryDecision::DeadLetter { attempts } => s.dead_letters.push(Failure {
                id: m.id,
                attempts,
                kind: ErrorKind::Exhausted,
                error: failure.message,
            }),
        },
    }
}

/// A held topic for a refusal whose message is `CODE: what Pub/Sub said`
/// (`crate::pubsub::classify`).
fn hold(topic: &str, message: &str) -> Hold {
    let (code, said) = message.split_once(": ").unwrap_or(("REFUSED", message));
    Hold {
        topic: topic.to_owned(),
        code: code.to_owned(),
        message: said.to_owned(),
    }
}

/// Whether Pub/Sub answered for `topic` in this batch as it does for a topic it accepts: a
/// message of it was published, or refused for its own fault. (A held topic's probe so answered
/// releases the topic.)
pub(crate) fn topic_answered(
    claimed: &[ClaimedMessage],
    attempts: &[Attempt],
    topic: &str,
) -> bool {
    claimed.iter().zip(attempts).any(|(m, a)| {
        let answered = match a {
            Attempt::Published(_) => true,
            Attempt::Failed(f) => f.kind == FailureKind::Permanent,
            _ => false,
        };
        m.topic == topic && answered
    })
}

/// Whether a batch looks like an outage rather than bad messages: something was sent, nothing was
/// published, and every failure was transient (any answer of Pub/Sub's, a refusal too, shows it
/// is reachable). Only a failed probe then makes it one.
pub(crate) fn may_be_outage(attempts: &[Attempt]) -> bool {
    let mut sent = attempts
        .iter()
        .filter(|a| matches!(a, Attempt::Published(_) | Attempt::Failed(_)))
        .peekable();
    sent.peek().is_some()
        && sent.all(|a| {
            matches!(a, Attempt::Failed(f)
                if matches!(f.kind, FailureKind::Transient | FailureKind::NotAttempted))
        })
        && attempts
            .iter()
            .any(|a| matches!(a, Attempt::Failed(f) if f.kind == FailureKind::Transient))
}

/// The decision for an outage: the locally rejected messages are dead-lettered (they can never be
/// published), everything else is released untouched, charged nothing.
pub(crate) fn outage(claimed: &[ClaimedMessage], attempts: Vec<Attempt>) -> Decision {
    let mut d = Decision::default();
    for (m, attempt) in claimed.iter().zip(attempts) {
        match attempt {
            Attempt::Rejected(reason) => d.settlement.dead_letters.push(Failure {
                id: m.id,
                attempts: m.attempts,
                kind: ErrorKind::Permanent,
                error: format!("{REFUSED_LOCALLY}{reason}"),
            }),
            _ => d.settlement.released.push(m.id),
        }
    }
    d
}

#[cfg(test)]
#[path = "decide_tests.rs"]
mod tests;
