//! Fault injection in front of the real Pub/Sub publisher: chosen messages (by dedupe key) fail
//! with a chosen gRPC code, the rest go to the emulator. Like the real client, a failed message
//! pauses its ordering key: later messages of that key in the same batch are not attempted.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use google_cloud_gax::error::rpc::Code;
use outbox_dispatcher::classify::{FailureKind, PublishFailure, classify_code};
use outbox_dispatcher::publisher::{BatchResult, Publish};
use outbox_shared::ClaimedMessage;

/// A fault: fail with `code`, `times` times (None: always).
#[derive(Debug, Clone, Copy)]
pub struct Fault {
    /// The gRPC code to fail with.
    pub code: Code,
    /// How many publishes fail before it succeeds (None: forever).
    pub times: Option<u32>,
}

/// Wraps a publisher and injects faults.
#[derive(Debug)]
pub struct FaultInjecting<P> {
    inner: P,
    faults: Mutex<HashMap<String, Fault>>,
    /// Every (dedupe key) the inner publisher accepted, in publish order.
    pub published: Mutex<Vec<String>>,
}

impl<P: Publish> FaultInjecting<P> {
    /// Wraps `inner` with no faults.
    pub fn new(inner: P) -> Self {
        Self {
            inner,
            faults: Mutex::default(),
            published: Mutex::default(),
        }
    }

    /// Makes the message with `dedupe_key` fail.
    pub fn fail(&self, dedupe_key: &str, fault: Fault) {
        self.faults
            .lock()
            .expect("faults lock")
            .insert(dedupe_key.to_owned(), fault);
    }

    fn take_fault(&self, dedupe_key: &str) -> Option<Code> {
        let mut faults = self.faults.lock().expect("faults lock");
        let fault = faults.get_mut(dedupe_key)?;
        match &mut fault.times {
            None => Some(fault.code),
            Some(0) => None,
            Some(n) => {
                *n -= 1;
                Some(fault.code)
            }
        }
    }
}

impl<P: Publish> Publish for FaultInjecting<P> {
    async fn publish(&self, batch: &[ClaimedMessage]) -> BatchResult {
        let mut results: Vec<Option<Result<String, PublishFailure>>> = vec![None; batch.len()];
        let mut paused: HashSet<(String, String)> = HashSet::new();
        let mut forward = Vec::new();
        let mut forward_idx = Vec::new();
        for (i, m) in batch.iter().enumerate() {
            let key = m.ordering_key.clone().map(|k| (m.topic.clone(), k));
            if let Some(k) = &key
                && paused.contains(k)
            {
                results[i] = Some(Err(PublishFailure {
                    kind: FailureKind::NotAttempted,
                    message: "ordering key paused (injected)".into(),
                }));
                continue;
            }
            if let Some(code) = self.take_fault(&m.dedupe_key) {
                results[i] = Some(Err(PublishFailure {
                    kind: classify_code(code),
                    message: format!("{}: injected fault", code.name()),
                }));
                if let Some(k) = key {
                    paused.insert(k);
                }
                continue;
            }
            forward.push(m.clone());
            forward_idx.push(i);
        }
        let inner = self.inner.publish(&forward).await;
        {
            let mut log = self.published.lock().expect("published lock");
            for ((i, r), m) in forward_idx.iter().zip(inner).zip(&forward) {
                if r.is_ok() {
                    log.push(m.dedupe_key.clone());
                }
                results[*i] = Some(r);
            }
        }
        results
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err(PublishFailure::transient("no result"))))
            .collect()
    }

    async fn probe(&self, topic: &str) -> Result<(), String> {
        self.inner.probe(topic).await
    }

    fn resume(&self, topic: &str, ordering_key: &str) {
        self.inner.resume(topic, ordering_key);
    }
}
