//! Where this replica knows the live rows start, so its claims start there (`outbox_shared`'s
//! claim module, "Claims start past what is published"): the unkeyed floor, and the keyed floor
//! with its old keys, in the claim epoch they were gathered in. Shared by the workers of a
//! process; claims raise the unkeyed floor and keep the old keys' heads current, a batch that
//! gives rows back lowers the unkeyed floor, and the probe task raises the keyed floor (a walk
//! over every key) and lowers either when it finds a row they passed over.
//!
//! Invariants: the unkeyed floor is at most the oldest due time a claim took less the margin,
//! and goes back to the due time of any row given back (a resume, which makes a paused topic's
//! rows claimable below it, advances the epoch). Every live keyed row with an id below
//! the keyed floor belongs to an old key, and an old key's known head is at most its lowest id,
//! but for rows a floor may miss by design (a writer transaction longer than the margin, a
//! second concurrent writer of one key), which the probe finds. Knowledge of an older epoch is
//! dropped, never applied: a replay may have put a row back below it.

pub(crate) mod upkeep;

use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use outbox_shared::store::claim::{KeyCursor, KeyFloor, SeenHead};

/// How long samples of the id sequence are kept (a candidate floor needs one `margin` old).
const SAMPLES_FOR: Duration = Duration::from_secs(600);

/// The claims' floors.
#[derive(Debug)]
pub(crate) struct Floors {
    state: Mutex<State>,
    margin: Duration,
}

/// What the floors know, all of one claim epoch.
#[derive(Debug, Default)]
struct State {
    epoch: i64,
    /// Where unkeyed claims start (`None`: at the start).
    unkeyed: Option<DateTime<Utc>>,
    /// Ids below this belong to the old keys or are published.
    floor: i64,
    /// The old keys and their last heads.
    old: BTreeMap<(String, String), i64>,
    /// How far the id sequence had allocated, as claims and walks saw it (oldest first).
    allocated: VecDeque<(Instant, i64)>,
}

impl Floors {
    /// Floors that know nothing yet: claims start `margin` before the oldest unkeyed row the
    /// last claim took, and the keyed floor is raised to what the sequence allocated `margin`
    /// before a walk over every key began.
    pub(crate) fn new(margin: Duration) -> Self {
        Self {
            state: Mutex::new(State::default()),
            margin,
        }
    }

    /// Where unkeyed claims start (`None`: at the start), and its epoch.
    pub(crate) fn unkeyed(&self) -> (Option<DateTime<Utc>>, i64) {
        self.state
            .lock()
            .map_or((None, 0), |s| (s.unkeyed, s.epoch))
    }

    /// An unkeyed claim that read `epoch` took rows, the oldest due at `oldest`: the floor
    /// follows (never back).
    pub(crate) fn took_unkeyed(&self, epoch: i64, oldest: DateTime<Utc>) {
        let margin = chrono::Duration::from_std(self.margin).unwrap_or(chrono::Duration::MAX);
        let Some(candidate) = oldest.checked_sub_signed(margin) else {
            return;
        };
        if let Ok(mut s) = self.state.lock()
            && s.at_epoch(epoch)
        {
            s.unkeyed = Some(s.unkeyed.map_or(candidate, |f| f.max(candidate)));
        }
    }

    /// Unkeyed rows due from `oldest` on went back to the queue (given back by a batch, or found
    /// by the probe): the floor goes back to them.
    pub(crate) fn lower_unkeyed(&self, oldest: DateTime<Utc>) {
        if let Ok(mut s) = self.state.lock()
            && s.unkeyed.is_some_and(|f| f > oldest)
        {
            s.unkeyed = Some(oldest);
        }
    }

    /// The keyed floor for a walk from `cursor`, with at most `limit` old keys after it (in this
    /// process's order; the claim puts them in the index's).
    pub(crate) fn key_floor(&self, cursor: &KeyCursor, limit: usize) -> KeyFloor {
        let Ok(k) = self.state.lock() else {
            return KeyFloor::default();
        };
        let after = (cursor.topic.clone(), cursor.ordering_key.clone());
        let mut floor = KeyFloor {
            floor: k.floor,
            epoch: k.epoch,
            ..KeyFloor::default()
        };
        let range = k
            .old
            .range((std::ops::Bound::Excluded(after), std::ops::Bound::Unbounded));
        for ((topic, key), head) in range.take(limit) {
            floor.topics.push(topic.clone());
            floor.keys.push(key.clone());
            floor.heads.push(*head);
        }
        floor
    }

    /// A claim or walk in `epoch` saw these keys while the sequence had allocated `allocated`:
    /// an old key's head follows (no longer old once at or above the floor, or without rows); a
    /// key seen below the floor becomes old. A newer epoch drops all that was known; an older
    /// one is ignored.
    pub(crate) fn saw(&self, epoch: i64, allocated: i64, seen: &[SeenHead]) {
        let Ok(mut k) = self.state.lock() else {
            return;
        };
        if !k.at_epoch(epoch) {
            return;
        }
        let now = Instant::now();
        if k.allocated
            .back()
            .is_none_or(|(at, _)| now.duration_since(*at) >= Duration::from_millis(100))
        {
            k.allocated.push_back((now, allocated));
        }
        while k
            .allocated
            .front()
            .is_some_and(|(at, _)| now.duration_since(*at) > SAMPLES_FOR)
        {
            k.allocated.pop_front();
        }
        let floor = k.floor;
        for s in seen {
            let key = (s.topic.clone(), s.ordering_key.clone());
            match s.head {
                Some(head) if head < floor => {
                    k.old.insert(key, head);
                }
                _ => {
                    k.old.remove(&key);
                }
            }
        }
    }

    /// What a walk over every key starting now may raise the keyed floor to (with the epoch):
    /// how far the sequence had allocated `margin` ago. Ids up to there belong to transactions
    /// that began at least that long ago.
    pub(crate) fn candidate(&self) -> (i64, i64) {
        let Ok(k) = self.state.lock() else {
            return (0, 0);
        };
        let Some(then) = Instant::now().checked_sub(self.margin) else {
            return (k.epoch, k.floor);
        };
        let allocated = k
            .allocated
            .iter()
            .rev()
            .find(|(at, _)| *at <= then)
            .map_or(k.floor, |(_, a)| *a);
        (k.epoch, allocated.max(k.floor))
    }

    /// A walk over every key, from the floor, begun when [`Self::candidate`] said `candidate`
    /// in `epoch`, saw these heads: the floor rises to the candidate and the keys seen with a
    /// lower head are the old keys. Nothing changes when the epoch changed meanwhile, or when
    /// more than `max_old` keys would be old (a backlog over many keys: each claim would carry
    /// them all, for index entries a backlog's claims hardly walk anyway). Returns whether it rose.
    pub(crate) fn raise(
        &self,
        epoch: i64,
        candidate: i64,
        seen: &[SeenHead],
        max_old: usize,
    ) -> bool {
        let Ok(mut k) = self.state.lock() else {
            return false;
        };
        if epoch != k.epoch || candidate < k.floor {
            return false;
        }
        let old: BTreeMap<(String, String), i64> = seen
            .iter()
            .filter_map(|s| {
                let head = s.head.filter(|h| *h < candidate)?;
                Some(((s.topic.clone(), s.ordering_key.clone()), head))
            })
            .collect();
        if old.len() > max_old {
            return false;
        }
        k.old = old;
        k.floor = candidate;
        true
    }

    /// A walk over every key with no floor (the probe) saw these heads in `epoch`: a key below
    /// the floor that is not old, or old with a lower head, is a row the floor passed over; it
    /// becomes old with that head. Returns how many.
    pub(crate) fn probed(&self, epoch: i64, seen: &[SeenHead]) -> usize {
        let Ok(mut k) = self.state.lock() else {
            return 0;
        };
        if epoch != k.epoch {
            return 0;
        }
        let floor = k.floor;
        let mut found = 0;
        for s in seen {
            let Some(head) = s.head.filter(|h| *h < floor) else {
                continue;
            };
            let key = (s.topic.clone(), s.ordering_key.clone());
            if k.old.get(&key).is_none_or(|known| *known > head) {
                k.old.insert(key, head);
                found += 1;
            }
        }
        found
    }

    /// The old keys (for the metrics).
    pub(crate) fn old_keys(&self) -> usize {
        self.state.lock().map_or(0, |k| k.old.len())
    }
}

impl State {
    /// Whether knowledge of `epoch` applies, dropping all that is known when it is newer.
    fn at_epoch(&mut self, epoch: i64) -> bool {
        if epoch < self.epoch {
            return false;
        }
        if epoch > self.epoch {
            *self = State {
                epoch,
                ..State::default()
            };
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(key: &str, head: Option<i64>) -> SeenHead {
        SeenHead {
            topic: "projects/p/topics/t".into(),
            ordering_key: key.into(),
            head,
        }
    }

    fn at(secs: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000 + secs, 0).unwrap_or_default()
    }

    fn old(f: &Floors) -> Vec<(String, i64)> {
        let k = f.key_floor(&KeyCursor::default(), usize::MAX);
        k.keys.into_iter().zip(k.heads).collect()
    }

    #[test]
    fn the_unkeyed_floor_trails_the_oldest_row_taken_by_the_margin_and_goes_back_for_rows_given_back()
     {
        let f = Floors::new(Duration::from_secs(5));
        assert_eq!(f.unkeyed(), (None, 0), "nothing known: from the start");
        f.took_unkeyed(0, at(100));
        assert_eq!(f.unkeyed(), (Some(at(95)), 0));
        f.took_unkeyed(0, at(90));
        assert_eq!(f.unkeyed().0, Some(at(95)), "never back on a claim");
        f.lower_unkeyed(at(60));
        assert_eq!(f.unkeyed().0, Some(at(60)), "back to rows given back");
        f.lower_unkeyed(at(70));
        assert_eq!(f.unkeyed().0, Some(at(60)));
        // A resume advanced the epoch: the floor is dropped, and a claim of the old one ignored.
        f.saw(1, 0, &[]);
        assert_eq!(f.unkeyed(), (None, 1));
        f.took_unkeyed(0, at(200));
        assert_eq!(f.unkeyed(), (None, 1));
    }

    #[test]
    fn the_keyed_floor_rises_to_what_was_allocated_a_margin_before_a_walk_began() {
        let f = Floors::new(Duration::ZERO);
        assert_eq!(
            f.key_floor(&KeyCursor::default(), 10).floor,
            0,
            "nothing known"
        );
        f.saw(0, 1_000, &[]);
        let (epoch, candidate) = f.candidate();
        assert_eq!((epoch, candidate), (0, 1_000));
        // The walk saw "a" waiting at 400 and "b" at 1,200: "a" is old, "b" is not.
        assert!(f.raise(
            epoch,
            candidate,
            &[
                seen("a", Some(400)),
                seen("b", Some(1_200)),
                seen("c", None)
            ],
            10
        ));
        assert_eq!(f.key_floor(&KeyCursor::default(), 10).floor, 1_000);
        assert_eq!(old(&f), vec![("a".to_owned(), 400)]);
        // Claims keep an old key's head current, and drop it once at the floor or empty.
        f.saw(0, 1_100, &[seen("a", Some(700))]);
        assert_eq!(old(&f), vec![("a".to_owned(), 700)]);
        f.saw(0, 1_100, &[seen("a", Some(1_050))]);
        assert_eq!(old(&f), vec![], "at or above the floor: no longer old");
    }

    #[test]
    fn the_floor_stays_when_too_many_keys_would_be_old() {
        let f = Floors::new(Duration::ZERO);
        f.saw(0, 1_000, &[]);
        let seen: Vec<SeenHead> = ["a", "b", "c"].iter().map(|k| seen(k, Some(5))).collect();
        assert!(!f.raise(0, 1_000, &seen, 2), "three old keys, two allowed");
        assert_eq!(f.key_floor(&KeyCursor::default(), 10).floor, 0);
        assert!(f.raise(0, 1_000, &seen, 3));
    }

    #[test]
    fn a_candidate_is_a_margin_old_and_a_raise_of_another_epoch_changes_nothing() {
        let f = Floors::new(Duration::from_secs(3_600));
        f.saw(0, 1_000, &[]);
        assert_eq!(
            f.candidate(),
            (0, 0),
            "no sample a margin old yet: the floor stays"
        );
        assert!(!f.raise(1, 500, &[], 10), "another epoch");
        assert_eq!(f.key_floor(&KeyCursor::default(), 10).floor, 0);
    }

    #[test]
    fn a_newer_epoch_drops_the_floor_and_the_old_keys_and_an_older_one_is_ignored() {
        let f = Floors::new(Duration::ZERO);
        f.saw(0, 1_000, &[]);
        assert!(f.raise(0, 1_000, &[seen("a", Some(10)), seen("b", Some(20))], 10));
        assert_eq!(old(&f).len(), 2);
        // A replay advanced the epoch: what was known is dropped.
        f.saw(1, 1_200, &[seen("a", Some(5))]);
        let k = f.key_floor(&KeyCursor::default(), 10);
        assert_eq!((k.floor, k.epoch, k.keys.len()), (0, 1, 0));
        // A claim that read the old epoch reports late: ignored.
        f.saw(0, 1_300, &[seen("c", Some(1))]);
        assert_eq!(f.key_floor(&KeyCursor::default(), 10).epoch, 1);
        assert_eq!(old(&f), vec![]);
    }

    #[test]
    fn old_keys_are_given_after_the_cursor() {
        let f = Floors::new(Duration::ZERO);
        f.saw(0, 100, &[]);
        assert!(f.raise(
            0,
            100,
            &[seen("a", Some(1)), seen("b", Some(2)), seen("c", Some(3))],
            10
        ));
        let cursor = KeyCursor {
            topic: "projects/p/topics/t".into(),
            ordering_key: "a".into(),
        };
        assert_eq!(f.key_floor(&cursor, 10).keys, vec!["b", "c"]);
        assert_eq!(f.key_floor(&KeyCursor::default(), 1).keys, vec!["a"]);
    }

    #[test]
    fn the_probe_makes_a_key_below_the_floor_old_and_lowers_an_old_keys_head() {
        let f = Floors::new(Duration::ZERO);
        f.saw(0, 100, &[]);
        assert!(f.raise(0, 100, &[seen("a", Some(50))], 10));
        let found = f.probed(
            0,
            &[
                seen("a", Some(40)),
                seen("b", Some(60)),
                seen("c", Some(150)),
                seen("d", None),
            ],
        );
        assert_eq!(
            found, 2,
            "a lower head of an old key, a key below the floor"
        );
        assert_eq!(old(&f), vec![("a".to_owned(), 40), ("b".to_owned(), 60)]);
        assert_eq!(f.probed(1, &[seen("e", Some(1))]), 0, "another epoch");
    }
}
