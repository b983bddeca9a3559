//! Liveness: every worker loop beats a heartbeat on each turn (and while it waits for Pub/Sub to
//! come back); `/healthz` fails when a worker's last beat is older than `--liveness-timeout`, so
//! the orchestrator restarts a process whose worker pool is wedged. Rows a wedged worker holds are
//! safe: its claim transaction ends with its connection, at the latest after `--lock-timeout`.
//!
//! A healthy worker beats at least every `--max-poll-interval` while idle, every
//! `--breaker-max-cooldown` while Pub/Sub is down, and between batches, whose publish is bounded by
//! `--publish-timeout` (< `--lock-timeout` < `--liveness-timeout`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// One heartbeat per worker, as milliseconds since the process's epoch.
#[derive(Debug)]
pub(crate) struct Heartbeats {
    epoch: Instant,
    beats: Vec<AtomicU64>,
}

impl Heartbeats {
    pub(crate) fn new(workers: usize) -> Self {
        Self {
            epoch: Instant::now(),
            beats: (0..workers).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Records that `worker` made progress now.
    pub(crate) fn beat(&self, worker: usize) {
        if let Some(b) = self.beats.get(worker) {
            b.store(self.now_ms(), Ordering::Relaxed);
        }
    }

    /// The worker whose last beat is oldest, if that is longer ago than `timeout`, and how long.
    pub(crate) fn stalled(&self, timeout: Duration) -> Option<(usize, Duration)> {
        let now = self.now_ms();
        self.beats
            .iter()
            .enumerate()
            .map(|(i, b)| {
                (
                    i,
                    Duration::from_millis(now.saturating_sub(b.load(Ordering::Relaxed))),
                )
            })
            .max_by_key(|(_, age)| *age)
            .filter(|(_, age)| *age > timeout)
    }
}

#[cfg(test)]
mod tests {
    use super::Heartbeats;
    use std::time::Duration;

    #[test]
    fn a_worker_that_stops_beating_is_reported_and_beating_again_clears_it() {
        let h = Heartbeats::new(2);
        h.beat(0);
        h.beat(1);
        assert_eq!(h.stalled(Duration::from_millis(50)), None);
        std::thread::sleep(Duration::from_millis(80));
        h.beat(0);
        let (worker, age) = h
            .stalled(Duration::from_millis(50))
            .expect("worker 1 stalled");
        assert_eq!(worker, 1);
        assert!(age >= Duration::from_millis(80), "{age:?}");
        h.beat(1);
        assert_eq!(h.stalled(Duration::from_millis(50)), None);
    }
}
