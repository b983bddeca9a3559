//! The durable retry schedule: a pure function from (attempts so far, now) to a decision.
//!
//! The decision is stored in the row (`attempts`, `next_attempt_at`), so a restart keeps the
//! schedule. `delay = min(cap, base * 2^attempts)`, then reduced by up to `jitter` (a fraction) so
//! retries of a failed batch spread out instead of arriving together.

use std::time::Duration;

use chrono::{DateTime, Utc};

/// What to do with a message whose publish failed transiently.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryDecision {
    /// Try again at this time; `attempts` is the new attempt count to store.
    RetryAt {
        /// When the row becomes due again.
        at: DateTime<Utc>,
        /// The new value of `attempts`.
        attempts: i32,
    },
    /// Out of attempts: move to the dead-letter table.
    DeadLetter {
        /// The final attempt count.
        attempts: i32,
    },
}

/// Exponential backoff with a cap, jitter and an attempt limit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetrySchedule {
    /// Delay after the first failure.
    pub base: Duration,
    /// Longest delay.
    pub cap: Duration,
    /// Fraction (0..=1) of the delay that is randomised away.
    pub jitter: f64,
    /// Failed attempts after which the message is dead-lettered (>= 1).
    pub max_attempts: i32,
}

impl Default for RetrySchedule {
    fn default() -> Self {
        Self {
            base: Duration::from_secs(1),
            cap: Duration::from_secs(600),
            jitter: 0.2,
            max_attempts: 20,
        }
    }
}

impl RetrySchedule {
    /// The un-jittered delay after `attempts` previous failures: `min(cap, base * 2^attempts)`.
    pub fn delay(&self, attempts: i32) -> Duration {
        let exponent = u32::try_from(attempts.max(0)).unwrap_or(0).min(62);
        let factor = 1u64 << exponent;
        let base_ms = u64::try_from(self.base.as_millis()).unwrap_or(u64::MAX);
        let ms = base_ms.saturating_mul(factor);
        Duration::from_millis(ms).min(self.cap)
    }

    /// Decides what follows one more failure of a message that had failed `attempts` times.
    /// `random` is a number in `[0, 1)` (injected so tests are deterministic).
    pub fn on_failure(&self, attempts: i32, now: DateTime<Utc>, random: f64) -> RetryDecision {
        let attempts_now = attempts.saturating_add(1);
        if attempts_now >= self.max_attempts {
            return RetryDecision::DeadLetter {
                attempts: attempts_now,
            };
        }
        let delay = self.delay(attempts);
        let keep = 1.0 - self.jitter.clamp(0.0, 1.0) * random.clamp(0.0, 1.0);
        let jittered = delay.mul_f64(keep);
        let at = now + chrono::Duration::from_std(jittered).unwrap_or(chrono::Duration::MAX);
        RetryDecision::RetryAt {
            at,
            attempts: attempts_now,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schedule() -> RetrySchedule {
        RetrySchedule {
            base: Duration::from_secs(1),
            cap: Duration::from_secs(60),
            jitter: 0.5,
            max_attempts: 5,
        }
    }

    #[test]
    fn delay_doubles_until_the_cap() {
        let s = schedule();
        let table = [
            (0, 1),
            (1, 2),
            (2, 4),
            (3, 8),
            (5, 32),
            (6, 60),
            (40, 60),
            (1000, 60),
        ];
        for (attempts, secs) in table {
            assert_eq!(
                s.delay(attempts),
                Duration::from_secs(secs),
                "attempts={attempts}"
            );
        }
    }

    #[test]
    fn retry_time_is_now_plus_delay_minus_jitter() {
        let s = schedule();
        let now = DateTime::from_timestamp(1_700_000_000, 0).expect("valid time");
        assert_eq!(
            s.on_failure(2, now, 0.0),
            RetryDecision::RetryAt {
                at: now + chrono::Duration::seconds(4),
                attempts: 3
            }
        );
        // The largest jitter (random -> 1) takes off `jitter` of the delay: 4 s * 0.5.
        assert_eq!(
            s.on_failure(2, now, 1.0),
            RetryDecision::RetryAt {
                at: now + chrono::Duration::seconds(2),
                attempts: 3
            }
        );
    }

    #[test]
    fn the_last_attempt_dead_letters() {
        let s = schedule();
        let now = Utc::now();
        assert!(matches!(
            s.on_failure(3, now, 0.0),
            RetryDecision::RetryAt { attempts: 4, .. }
        ));
        assert_eq!(
            s.on_failure(4, now, 0.0),
            RetryDecision::DeadLetter { attempts: 5 }
        );
        assert_eq!(
            s.on_failure(i32::MAX, now, 0.0),
            RetryDecision::DeadLetter { attempts: i32::MAX }
        );
    }

    #[test]
    fn max_attempts_of_one_dead_letters_at_the_first_failure() {
        let s = RetrySchedule {
            max_attempts: 1,
            ..schedule()
        };
        assert_eq!(
            s.on_failure(0, Utc::now(), 0.5),
            RetryDecision::DeadLetter { attempts: 1 }
        );
    }
}
