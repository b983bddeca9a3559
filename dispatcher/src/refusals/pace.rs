//! Quota as backpressure: a topic Pub/Sub answers RESOURCE_EXHAUSTED (a project's or region's
//! publish quota, flow control) slows down instead of charging its rows attempts.
//!
//! Per topic, in this process, from each batch's messages of the topic: more refused for quota than
//! accepted doubles the topic's backoff (from [`MIN_QUOTA_BACKOFF`] up to `--quota-max-backoff`);
//! as many or more accepted halves it (while any is refused, not below the minimum; with none
//! refused, below the minimum is back to full speed). After any refusal this replica's claims leave
//! the topic alone for the backoff. A refused row waits the backoff (with jitter) in the row
//! itself, no attempt charged, so a restart keeps the spacing and other replicas do not take it at
//! once; a refused key waits whole, in order. So the backoff grows only while the quota refuses
//! most of what is sent: sending slower then lets a real quota (throughput per minute) accept more,
//! and the backoff settles where refusals no longer outnumber acceptances. Google's clients slow
//! down the same way (flow control and retries with backoff): the request rate adapts to what the
//! quota allows, and a quota that lasts hours costs latency, never a dead letter.
//!
//! What bounds the delay: a refused row waits at most `--quota-max-backoff` before it is tried
//! again, and a topic is never left alone longer; once the quota allows, each accepted batch
//! halves the backoff, so full speed returns within about log2(max / min) batches.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use outbox_shared::ClaimedMessage;
use std::time::Instant;

use crate::config::MIN_QUOTA_BACKOFF;
use crate::pubsub::classify::FailureKind;
use crate::pubsub::publish::Attempt;

#[derive(Debug, Clone, Copy)]
struct Pace {
    backoff: Duration,
    until: Instant,
}

/// The topics slowed down by quota, shared by the workers of a process.
#[derive(Debug)]
pub(crate) struct Paces {
    topics: Mutex<HashMap<String, Pace>>,
    max: Duration,
}

impl Paces {
    /// Backoffs of at most `max`.
    pub(crate) fn new(max: Duration) -> Self {
        Self {
            topics: Mutex::default(),
            max: max.max(MIN_QUOTA_BACKOFF),
        }
    }

    fn topics(&self) -> std::sync::MutexGuard<'_, HashMap<String, Pace>> {
        match self.topics.lock() {
            Ok(t) => t,
            Err(poisoned) => poisoned.into_inner(),
        }
    }

    /// Learns from a batch's attempts (the module doc says how). Returns the topics that started
    /// to back off.
    pub(crate) fn learn(&self, claimed: &[ClaimedMessage], attempts: &[Attempt]) -> Vec<String> {
        // Per topic of the batch: (refused for quota, accepted).
        let mut seen: Vec<(&str, usize, usize)> = Vec::new();
        for (m, attempt) in claimed.iter().zip(attempts) {
            let (refused, accepted) = match attempt {
                Attempt::Failed(f) if f.kind == FailureKind::Throttled => (1, 0),
                Attempt::Published(_) => (0, 1),
                _ => continue,
            };
            match seen.iter_mut().find(|(t, _, _)| *t == m.topic) {
                Some((_, r, a)) => (*r, *a) = (*r + refused, *a + accepted),
                None => seen.push((m.topic.as_str(), refused, accepted)),
            }
        }
        let mut topics = self.topics();
        if topics.is_empty() && seen.iter().all(|(_, refused, _)| *refused == 0) {
            return Vec::new();
        }
        let now = Instant::now();
        let mut started = Vec::new();
        for (topic, refused, accepted) in seen {
            let backoff = match (topics.get(topic), refused) {
                (None, 0) => continue,
                (Some(p), 0) => p.backoff / 2,
                (None, _) => {
                    started.push(topic.to_owned());
                    MIN_QUOTA_BACKOFF
                }
                (Some(p), _) if refused > accepted => (p.backoff * 2).min(self.max),
                (Some(p), _) => (p.backoff / 2).max(MIN_QUOTA_BACKOFF),
            };
            tracing::debug!(pubsub.topic = %topic, refused, accepted, ?backoff, "Quota backoff.");
            if backoff < MIN_QUOTA_BACKOFF {
                topics.remove(topic);
                tracing::info!(
                    pubsub.topic = %topic,
                    "Quota pressure over: Pub/Sub accepts the topic's requests again; it goes at \
                     full speed."
                );
                continue;
            }
            let until = match topics.get(topic) {
                // Accepted only: keep the window a refusal opened, shorter backoff from now on.
                Some(p) if refused == 0 => p.until,
                _ => now + backoff,
            };
            topics.insert(topic.to_owned(), Pace { backoff, until });
        }
        started
    }

    /// The topic's backoff now (zero when it is not slowed down): how long its refused rows wait.
    pub(crate) fn backoff(&self, topic: &str) -> Duration {
        self.topics()
            .get(topic)
            .map_or(Duration::ZERO, |p| p.backoff)
    }

    /// The topics this replica's claims leave alone now, appended to `out`.
    pub(crate) fn cooling(&self, out: &mut Vec<String>) {
        self.cooling_at(Instant::now(), out);
    }

    fn cooling_at(&self, now: Instant, out: &mut Vec<String>) {
        let topics = self.topics();
        if topics.is_empty() {
            return;
        }
        out.extend(
            topics
                .iter()
                .filter(|(_, p)| p.until > now)
                .map(|(t, _)| t.clone()),
        );
    }

    /// Every slowed-down topic and its backoff (the gauges).
    pub(crate) fn backoffs(&self) -> Vec<(String, Duration)> {
        self.topics()
            .iter()
            .map(|(t, p)| (t.clone(), p.backoff))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pubsub::classify::PublishFailure;

    fn msg(id: i64, topic: &str) -> ClaimedMessage {
        crate::test_support::message(id, topic, None, 0)
    }

    fn throttled() -> Attempt {
        Attempt::Failed(PublishFailure {
            kind: FailureKind::Throttled,
            message: "RESOURCE_EXHAUSTED: quota".into(),
        })
    }

    #[test]
    fn a_batch_mostly_refused_doubles_the_backoff_mostly_accepted_halves_it() {
        let paces = Paces::new(Duration::from_secs(10));
        let batch = [msg(1, "a"), msg(2, "a"), msg(3, "a")];
        let ok = || Attempt::Published("x".into());
        paces.learn(&batch, &[throttled(), throttled(), ok()]);
        assert_eq!(paces.backoff("a"), MIN_QUOTA_BACKOFF);
        paces.learn(&batch, &[throttled(), throttled(), ok()]);
        assert_eq!(
            paces.backoff("a"),
            MIN_QUOTA_BACKOFF * 2,
            "2 refused, 1 accepted: doubles"
        );
        paces.learn(&batch, &[throttled(), throttled(), ok()]);
        assert_eq!(paces.backoff("a"), MIN_QUOTA_BACKOFF * 4);
        paces.learn(&batch, &[throttled(), ok(), ok()]);
        assert_eq!(
            paces.backoff("a"),
            MIN_QUOTA_BACKOFF * 2,
            "1 refused, 2 accepted: halves"
        );
        paces.learn(&batch, &[throttled(), ok(), ok()]);
        paces.learn(&batch, &[throttled(), ok(), ok()]);
        assert_eq!(
            paces.backoff("a"),
            MIN_QUOTA_BACKOFF,
            "not below the minimum while refused"
        );
        let mut cooling = Vec::new();
        paces.cooling(&mut cooling);
        assert_eq!(
            cooling,
            vec!["a".to_owned()],
            "any refusal leaves the topic alone a while"
        );
    }

    #[test]
    fn refusals_double_the_backoff_up_to_the_bound_and_acceptances_halve_it_away() {
        let paces = Paces::new(Duration::from_millis(500));
        let batch = [msg(1, "a"), msg(2, "b")];
        let started = paces.learn(&batch, &[throttled(), Attempt::Published("1".into())]);
        assert_eq!(started, vec!["a".to_owned()], "a starts to back off");
        assert_eq!(paces.backoff("a"), MIN_QUOTA_BACKOFF);
        assert_eq!(paces.backoff("b"), Duration::ZERO, "b is not slowed down");
        let mut cooling = Vec::new();
        paces.cooling(&mut cooling);
        assert_eq!(cooling, vec!["a".to_owned()], "claims leave a alone");
        for want in [200, 400, 500, 500] {
            assert!(paces.learn(&batch[..1], &[throttled()]).is_empty());
            assert_eq!(paces.backoff("a"), Duration::from_millis(want));
        }
        let mut cooling = Vec::new();
        paces.cooling_at(Instant::now() + Duration::from_millis(501), &mut cooling);
        assert!(cooling.is_empty(), "claimed again after its backoff");
        let ok = [Attempt::Published("x".into())];
        for want in [250, 125] {
            paces.learn(&batch[..1], &ok);
            assert_eq!(paces.backoff("a"), Duration::from_millis(want));
        }
        paces.learn(&batch[..1], &ok);
        assert_eq!(
            paces.backoff("a"),
            Duration::ZERO,
            "below 100ms: full speed"
        );
        assert!(paces.backoffs().is_empty());
    }
}
