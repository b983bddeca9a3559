//! Fault injection in front of a publisher, for testing a deployment's alerts and recovery and for
//! the tests: a random fraction of messages (`--inject-failure-rate`) or chosen messages (by
//! dedupe key) fail
//! with a chosen gRPC code; everything else goes to the real publisher. Like the official client,
//! a failed message pauses its ordering key: later messages of that key in the same batch are not
//! attempted. With no fault configured it is a pass-through.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use outbox_shared::ClaimedMessage;

use crate::config::FaultSettings;
use crate::pubsub::classify::{Code, FailureKind, PublishFailure, classify_code, code_name};
use crate::pubsub::publish::{BatchResult, ProbeError, Publish};

/// A targeted fault: fail with `code`, `times` times (None: forever).
#[derive(Debug, Clone, Copy)]
pub struct Fault {
    /// The gRPC code to fail with.
    pub code: Code,
    /// How many publishes fail before it succeeds (None: forever).
    pub times: Option<u32>,
}

/// Wraps a publisher and injects faults.
#[derive(Debug)]
pub struct FaultInjector<P> {
    inner: P,
    rate: f64,
    code: Code,
    targeted: Mutex<HashMap<String, Fault>>,
    has_targets: AtomicBool,
    record: AtomicBool,
    published: Mutex<Vec<String>>,
}

impl<P: Publish> FaultInjector<P> {
    /// Fails a `rate` fraction (0..=1) of message publishes with `code`.
    pub fn new(inner: P, rate: f64, code: Code) -> Self {
        Self {
            inner,
            rate: rate.clamp(0.0, 1.0),
            code,
            targeted: Mutex::default(),
            has_targets: AtomicBool::new(false),
            record: AtomicBool::new(false),
            published: Mutex::default(),
        }
    }

    /// Injects what `settings` asks for (nothing, by default).
    pub fn with_settings(inner: P, settings: &FaultSettings) -> Self {
        if settings.failure_rate > 0.0 {
            tracing::warn!(
                rate = settings.failure_rate,
                code = code_name(settings.failure_code),
                "Fault injection is on: publishes fail on purpose."
            );
        }
        Self::new(inner, settings.failure_rate, settings.failure_code)
    }

    /// A pass-through until [`FaultInjector::fail`] is called.
    pub fn passthrough(inner: P) -> Self {
        Self::new(inner, 0.0, Code::Unavailable)
    }

    /// Makes the message with `dedupe_key` fail.
    pub fn fail(&self, dedupe_key: &str, fault: Fault) {
        if let Ok(mut t) = self.targeted.lock() {
            t.insert(dedupe_key.to_owned(), fault);
        }
        self.has_targets.store(true, Ordering::Release);
    }

    /// Stops failing the message with `dedupe_key`.
    pub fn heal(&self, dedupe_key: &str) {
        if let Ok(mut t) = self.targeted.lock() {
            t.remove(dedupe_key);
        }
    }

    /// Starts recording the dedupe keys the inner publisher accepted, in order.
    pub fn record_published(&self) {
        self.record.store(true, Ordering::Release);
    }

    /// The dedupe keys published so far (when recording), in publish order.
    pub fn published(&self) -> Vec<String> {
        self.published.lock().map(|p| p.clone()).unwrap_or_default()
    }

    fn fault_for(&self, dedupe_key: &str) -> Option<Code> {
        if self.has_targets.load(Ordering::Acquire)
            && let Ok(mut targeted) = self.targeted.lock()
            && let Some(fault) = targeted.get_mut(dedupe_key)
        {
            match &mut fault.times {
                None => return Some(fault.code),
                Some(0) => {}
                Some(n) => {
                    *n -= 1;
                    return Some(fault.code);
                }
            }
        }
        (self.rate > 0.0 && fastrand::f64() < self.rate).then_some(self.code)
    }
}

impl<P: Publish> FaultInjector<P> {
    /// Publishes `batch` via the wrapped publisher, but the messages a fault targets (or the
    /// failure rate picks) fail with the injected code, and the later messages of their keys
    /// are not attempted (as the real client pauses a key).
    async fn inject(&self, batch: &[ClaimedMessage]) -> BatchResult {
        let idle = self.rate == 0.0
            && !self.has_targets.load(Ordering::Acquire)
            && !self.record.load(Ordering::Acquire);
        if idle {
            // No fault configured: no copies, no bookkeeping.
            return self.inner.publish(batch).await;
        }
        let mut results: Vec<Option<Result<String, PublishFailure>>> = vec![None; batch.len()];
        let mut paused: HashSet<(&str, &str)> = HashSet::new();
        let mut forward = Vec::with_capacity(batch.len());
        let mut forward_idx = Vec::with_capacity(batch.len());
        for (i, m) in batch.iter().enumerate() {
            let key = m.ordering_key.as_deref().map(|k| (m.topic.as_str(), k));
            if key.is_some_and(|k| paused.contains(&k)) {
                results[i] = Some(Err(PublishFailure {
                    kind: FailureKind::NotAttempted,
                    message: "ordering key paused after an injected fault".into(),
                }));
                continue;
            }
            if let Some(code) = self.fault_for(&m.dedupe_key) {
                results[i] = Some(Err(PublishFailure {
                    kind: classify_code(code),
                    message: format!("{}: injected fault", code_name(code)),
                }));
                if let Some(k) = key {
                    paused.insert(k);
                }
                continue;
            }
            forward.push(m.clone());
            forward_idx.push(i);
        }
        let inner = if forward.is_empty() {
            Vec::new()
        } else {
            self.inner.publish(&forward).await
        };
        let recording = self.record.load(Ordering::Acquire);
        let mut log = Vec::new();
        for ((i, result), m) in forward_idx.into_iter().zip(inner).zip(&forward) {
            if recording && result.is_ok() {
                log.push(m.dedupe_key.clone());
            }
            results[i] = Some(result);
        }
        if recording && let Ok(mut p) = self.published.lock() {
            p.extend(log);
        }
        results
            .into_iter()
            .map(|r| {
                r.unwrap_or_else(|| {
                    Err(PublishFailure::transient(
                        "the publisher returned no result",
                    ))
                })
            })
            .collect()
    }
}

impl<P: Publish> Publish for FaultInjector<P> {
    async fn publish(&self, batch: &[ClaimedMessage]) -> BatchResult {
        self.inject(batch).await
    }

    async fn probe(&self, topic: &str) -> Result<(), ProbeError> {
        self.inner.probe(topic).await
    }

    fn dedupe_attribute(&self) -> &str {
        self.inner.dedupe_attribute()
    }
}
