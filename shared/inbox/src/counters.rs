//! What the inbox did, as counters a consumer exports to its metrics system.

use std::sync::atomic::{AtomicU64, Ordering};

/// Monotonic counters of one [`crate::Inbox`] (shared by its clones).
#[derive(Debug, Default)]
pub(crate) struct Counters {
    processed: AtomicU64,
    duplicates: AtomicU64,
    failures: AtomicU64,
    purged: AtomicU64,
}

/// A snapshot of an inbox's counters since it was created.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InboxCounters {
    /// Messages whose handler ran and committed (ack them).
    pub processed: u64,
    /// Messages dropped as duplicates: their key was already committed (ack them).
    pub duplicates: u64,
    /// Messages that failed: handler error, inbox error or missing key (nack them).
    pub failures: u64,
    /// Inbox rows deleted by retention.
    pub purged: u64,
}

impl Counters {
    pub(crate) fn processed(&self) {
        self.processed.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn duplicate(&self) {
        self.duplicates.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn failure(&self) {
        self.failures.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn purged(&self, n: u64) {
        self.purged.fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> InboxCounters {
        InboxCounters {
            processed: self.processed.load(Ordering::Relaxed),
            duplicates: self.duplicates.load(Ordering::Relaxed),
            failures: self.failures.load(Ordering::Relaxed),
            purged: self.purged.load(Ordering::Relaxed),
        }
    }
}
