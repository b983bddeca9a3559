//! The circuit breaker: when Pub/Sub is unreachable for everyone, stop claiming (an outage is not
//! the messages' fault, so it burns no attempts and dead-letters nothing), probe with backoff,
//! and resume when the broker answers.
//!
//! The worker trips it when a whole batch failed transiently AND a probe confirms the broker does
//! not answer (or a publish stalled and a probe got no answer either); a batch whose failures are
//! message-specific (the probe succeeds) goes through the normal retry schedule instead.
//!
//! Recovery is prompt and does not flap: the probe interval doubles from `--breaker-cooldown` but
//! is capped low (`--breaker-max-cooldown`, 1 s by default), so claiming resumes within about a
//! second of the broker answering, however long the outage was; and a trip reported by a publish
//! that started before the breaker last closed is ignored (a stale failure never overrides a newer
//! success).

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use prometheus_client::metrics::gauge::Gauge;
use tokio::time::Instant;

use crate::pubsub::publish::Publish;
use outbox_runtime::shutdown::Shutdown;

#[derive(Debug, Clone)]
enum State {
    Closed,
    Open {
        until: Instant,
        cooldown: Duration,
        topic: String,
        reason: String,
    },
}

/// Shared by all workers of a process.
#[derive(Debug)]
pub struct Breaker {
    state: Mutex<State>,
    /// When the breaker last closed (tripping is judged against it).
    closed_at: Mutex<Option<Instant>>,
    probing: AtomicBool,
    min_cooldown: Duration,
    max_cooldown: Duration,
    open_gauge: Gauge,
}

impl Breaker {
    /// A closed breaker whose cooldown doubles from `min_cooldown` to `max_cooldown`.
    /// `open_gauge` is set to 1 while open.
    pub fn new(min_cooldown: Duration, max_cooldown: Duration, open_gauge: Gauge) -> Self {
        Self {
            state: Mutex::new(State::Closed),
            closed_at: Mutex::new(None),
            probing: AtomicBool::new(false),
            min_cooldown,
            max_cooldown: max_cooldown.max(min_cooldown),
            open_gauge,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        match self.state.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        }
    }

    /// Why it is open (the last probe's or publish's error, naming the endpoint), if it is.
    pub fn open_reason(&self) -> Option<String> {
        match &*self.lock() {
            State::Closed => None,
            State::Open { reason, .. } => Some(reason.clone()),
        }
    }

    /// Whether claiming may proceed.
    pub fn is_closed(&self) -> bool {
        matches!(*self.lock(), State::Closed)
    }

    /// Opens (or keeps open, doubling the cooldown) after a confirmed outage on `topic`, seen by
    /// a publish that started at `since`; ignored if the breaker closed after that (the failure
    /// is older than the success that closed it).
    pub fn trip(&self, topic: &str, reason: &str, since: std::time::Instant) {
        let since = Instant::from_std(since);
        if let Ok(closed_at) = self.closed_at.lock()
            && closed_at.is_some_and(|c| c > since)
        {
            tracing::debug!(
                pubsub.topic = topic,
                error = reason,
                "A stale outage report was ignored: Pub/Sub answered since."
            );
            return;
        }
        self.open(topic, reason);
    }

    /// Opens at start-up, before any publish (the first probe failed).
    pub fn open_at_start(&self, topic: &str, reason: &str) {
        self.open(topic, reason);
    }

    fn open(&self, topic: &str, reason: &str) {
        let mut state = self.lock();
        let cooldown = match &*state {
            State::Closed => {
                tracing::warn!(
                    pubsub.topic = topic,
                    error = reason,
                    "Pub/Sub is unreachable: claims are paused and no attempts are charged while it is down."
                );
                self.min_cooldown
            }
            State::Open { cooldown, .. } => (*cooldown * 2).min(self.max_cooldown),
        };
        *state = State::Open {
            until: Instant::now() + cooldown,
            cooldown,
            topic: topic.to_owned(),
            reason: reason.to_owned(),
        };
        self.open_gauge.set(1);
    }

    fn close(&self) {
        if let Ok(mut closed_at) = self.closed_at.lock() {
            *closed_at = Some(Instant::now());
        }
        let mut state = self.lock();
        if matches!(*state, State::Open { .. }) {
            tracing::info!("Pub/Sub answers again: claims resume.");
        }
        *state = State::Closed;
        self.open_gauge.set(0);
    }

    /// Returns when claiming may proceed, or when shutdown is requested. While open, one caller
    /// at a time probes after the cooldown; the others wait.
    /// `beat` is called on every turn of the wait (the worker is alive, only held back).
    pub async fn admit<P: Publish>(&self, publisher: &P, shutdown: &mut Shutdown, beat: impl Fn()) {
        loop {
            beat();
            let (until, topic) = match &*self.lock() {
                State::Closed => return,
                State::Open { until, topic, .. } => (*until, topic.clone()),
            };
            if Instant::now() < until {
                tokio::select! {
                    _ = tokio::time::sleep_until(until) => {}
                    _ = shutdown.requested() => return,
                }
                continue;
            }
            if self.probing.swap(true, Ordering::AcqRel) {
                // Someone else probes; check back shortly.
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                    _ = shutdown.requested() => return,
                }
                continue;
            }
            let result = publisher.probe(&topic).await;
            match result {
                Ok(()) => self.close(),
                Err(refused) if !refused.is_outage() => {
                    // Nothing was sent: not an outage. The messages' own publishes fail
                    // permanently and are dead-lettered with the reason; the others flow.
                    tracing::error!(pubsub.topic = %topic, error = %refused, "The Pub/Sub client refuses requests for this topic; this is a configuration error, not an outage.");
                    self.close();
                }
                Err(reason) => {
                    tracing::debug!(pubsub.topic = %topic, error = %reason, "The probe failed; Pub/Sub is still unreachable.");
                    self.open(&topic, &reason.to_string());
                }
            }
            self.probing.store(false, Ordering::Release);
        }
    }
}
