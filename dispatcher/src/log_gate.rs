//! [`LogGate`]: at most one line per interval for a warning every worker may raise on every
//! batch (slow batches, ignored trace contexts).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// At most one line per interval for a warning every worker may raise on every batch (a backlog
/// drain makes every batch's rows "late"): the lines held back are counted into the next one.
#[derive(Debug)]
pub(crate) struct LogGate {
    started: std::time::Instant,
    every_ms: u64,
    /// When (ms after `started`) the next line may go.
    next_ms: AtomicU64,
    held_back: AtomicU64,
}

impl LogGate {
    pub(crate) fn new(every: Duration) -> Self {
        Self {
            started: std::time::Instant::now(),
            every_ms: millis(every),
            next_ms: AtomicU64::new(0),
            held_back: AtomicU64::new(0),
        }
    }

    /// `Some(lines held back since the last one)` when a line may go now, else `None` (and this
    /// one is counted as held back).
    pub(crate) fn pass(&self) -> Option<u64> {
        let now = millis(self.started.elapsed());
        let next = self.next_ms.load(Ordering::Relaxed);
        let won = now >= next
            && self
                .next_ms
                .compare_exchange(
                    next,
                    now + self.every_ms,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_ok();
        if won {
            Some(self.held_back.swap(0, Ordering::Relaxed))
        } else {
            self.held_back.fetch_add(1, Ordering::Relaxed);
            None
        }
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_gate_lets_one_line_through_per_interval_and_counts_the_rest() {
        let gate = LogGate::new(Duration::from_millis(200));
        assert_eq!(gate.pass(), Some(0), "the first line goes");
        assert_eq!(
            gate.pass(),
            None,
            "the next one within the interval is held back"
        );
        assert_eq!(gate.pass(), None);
        std::thread::sleep(Duration::from_millis(250));
        assert_eq!(
            gate.pass(),
            Some(2),
            "after the interval: one line, counting the two held"
        );
        assert_eq!(gate.pass(), None);
    }
}
