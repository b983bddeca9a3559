//! Where this replica knows the live rows start, so its claims start there (`outbox_shared`'s
//! claim module, "Claims start past what is published"): the unkeyed floor, and the keyed floor
//! with its old keys, in the claim epoch they were gathered in. Shared by the workers of a
//! process; claims raise the unkeyed floor and keep the old keys' heads current, a batch that
//! gives rows back lowers the unkeyed floor, and the upkeep task stamps the outbox, learns when
//! a stamp is settled, and raises the keyed floor to it (a walk over every key).
//!
//! Invariants: the keyed floor is at most the `allocated` of a settled stamp (no row can still
//! appear below it), and every live keyed row below it belongs to an old key whose known head is
//! at most its lowest id: the walk that raised it began after the stamp settled, so it saw every
//! row below, and a claim's report of heads counts only if it walked from the floor now in force
//! (its generation). The unkeyed floor is at most the oldest due time a claim took, and at most
//! the instant of the settled stamp that claim knew when it began, less the margin; it goes back
//! to the due time of any row given back (a resume, which makes a paused topic's rows claimable
//! below it, advances the epoch). Knowledge of an older epoch is dropped, never applied: a
//! replay may have put a row back below it. What is left for the probe: rows a vanished replica
//! held (they come back below the unkeyed floor) and rows written with an explicit due time
//! before their insert.

pub(crate) mod upkeep;

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use outbox_shared::store::claim::settled::Stamp;
use outbox_shared::store::claim::{KeyCursor, KeyFloor, SeenHead};

/// Stamps kept while waiting to settle (20 minutes at one a second); the oldest go first.
const STAMPS_KEPT: usize = 1_200;

/// The claims' floors.
#[derive(Debug)]
pub(crate) struct Floors {
    state: Mutex<State>,
    marks: Mutex<Marks>,
    margin: Duration,
}

/// What the floors know, all of one claim epoch.
#[derive(Debug, Default)]
struct State {
    epoch: i64,
    /// How many times the keyed floor rose (in any epoch): a claim's report of heads counts only
    /// in the generation it walked in.
    generation: u64,
    /// Where unkeyed claims start (`None`: at the start).
    unkeyed: Option<DateTime<Utc>>,
    /// Ids below this belong to the old keys or are published.
    floor: i64,
    /// The old keys and their last heads.
    old: BTreeMap<(String, String), i64>,
}

/// The stamps waiting to settle (with when this process took each) and the newest settled one:
/// facts about the sequence and the clock, kept across epochs.
#[derive(Debug, Default)]
struct Marks {
    pending: VecDeque<(Stamp, Instant)>,
    settled: Option<Settled>,
}

/// A settled stamp: no row can still appear with an id up to `allocated`, nor (by the column's
/// default) due before `at`; stamped when this process's clock said `stamped`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Settled {
    pub(crate) allocated: i64,
    pub(crate) at: DateTime<Utc>,
    pub(crate) stamped: Instant,
}

/// Where an unkeyed claim starts, and what it needs to move the floor afterwards.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct UnkeyedStart {
    /// The floor (`None`: from the start).
    pub(crate) floor: Option<DateTime<Utc>>,
    /// The epoch it belongs to.
    pub(crate) epoch: i64,
    /// The settled instant known when the claim began (`None`: nothing settled yet).
    pub(crate) settled_at: Option<DateTime<Utc>>,
}

impl Floors {
    /// Floors that know nothing yet: claims start from the outbox's start until a stamp settles.
    /// The unkeyed floor trails what it may rise to by `margin`.
    pub(crate) fn new(margin: Duration) -> Self {
        Self {
            state: Mutex::new(State::default()),
            marks: Mutex::new(Marks::default()),
            margin,
        }
    }

    /// Where unkeyed claims start.
    pub(crate) fn unkeyed(&self) -> UnkeyedStart {
        let settled_at = self.settled().map(|s| s.at);
        let (floor, epoch) = self
            .state
            .lock()
            .map_or((None, 0), |s| (s.unkeyed, s.epoch));
        UnkeyedStart {
            floor,
            epoch,
            settled_at,
        }
    }

    /// An unkeyed claim that began knowing `start` and read `epoch` took rows, the oldest due at
    /// `oldest`: the floor follows, to the earlier of that and the settled instant the claim
    /// knew, less the margin (never back; not at all before a stamp settled).
    pub(crate) fn took_unkeyed(&self, start: UnkeyedStart, epoch: i64, oldest: DateTime<Utc>) {
        let Some(settled_at) = start.settled_at else {
            return;
        };
        let margin = chrono::Duration::from_std(self.margin).unwrap_or(chrono::Duration::MAX);
        let Some(candidate) = oldest.min(settled_at).checked_sub_signed(margin) else {
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
    /// process's order; the claim puts them in the index's), and its generation (for
    /// [`Self::saw`]).
    pub(crate) fn key_floor(&self, cursor: &KeyCursor, limit: usize) -> (KeyFloor, u64) {
        let Ok(k) = self.state.lock() else {
            return (KeyFloor::default(), u64::MAX);
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
        (floor, k.generation)
    }

    /// A claim in `epoch`, walking from the floor of `generation`, saw these keys: an old key's
    /// head follows (no longer old once at or above the floor, or without rows). A report of
    /// another generation is ignored (its walk began before the floor rose: a head it saw may
    /// be above a row the raise's walk found); a newer epoch drops all that was known.
    pub(crate) fn saw(&self, epoch: i64, generation: u64, seen: &[SeenHead]) {
        let Ok(mut k) = self.state.lock() else {
            return;
        };
        if !k.at_epoch(epoch) || k.generation != generation {
            return;
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

    /// A new stamp (ignored when it proves nothing: a caching sequence). Returns the writers of
    /// every stamp waiting to settle, to ask which still run.
    pub(crate) fn stamped(&self, stamp: Stamp) -> Vec<String> {
        let Ok(mut m) = self.marks.lock() else {
            return Vec::new();
        };
        if stamp.exact {
            m.pending.push_back((stamp, Instant::now()));
            while m.pending.len() > STAMPS_KEPT {
                m.pending.pop_front();
            }
        }
        let writers: HashSet<&String> = m.pending.iter().flat_map(|(s, _)| &s.writers).collect();
        writers.into_iter().cloned().collect()
    }

    /// `running` are the writers still running: the newest stamp with none of its writers among
    /// them is settled, with every older one (a writer of an older stamp still running holds
    /// its lock at every later stamp too). Returns the settled stamp now known.
    pub(crate) fn settle(&self, running: &[String]) -> Option<Settled> {
        let running: HashSet<&String> = running.iter().collect();
        let Ok(mut m) = self.marks.lock() else {
            return None;
        };
        let newest = m
            .pending
            .iter()
            .rposition(|(s, _)| s.writers.iter().all(|w| !running.contains(w)));
        if let Some(i) = newest {
            let stamps: Vec<(Stamp, Instant)> = m.pending.drain(..=i).collect();
            if let Some((s, stamped)) = stamps.last() {
                m.settled = Some(Settled {
                    allocated: s.allocated,
                    at: s.at,
                    stamped: *stamped,
                });
            }
        }
        m.settled
    }

    /// The newest settled stamp.
    pub(crate) fn settled(&self) -> Option<Settled> {
        self.marks.lock().ok().and_then(|m| m.settled)
    }

    /// What a walk over every key starting now may raise the keyed floor to: the settled stamp's
    /// `allocated` (no row can still appear below it), with the epoch and generation the raise
    /// must still be in. `None`: nothing settled above the floor.
    pub(crate) fn candidate(&self) -> Option<(i64, u64, i64)> {
        let settled = self.settled()?;
        let k = self.state.lock().ok()?;
        (settled.allocated > k.floor).then_some((k.epoch, k.generation, settled.allocated))
    }

    /// A walk over every key, from the floor, begun after [`Self::candidate`] said `candidate`
    /// in `epoch` and `generation`, saw these heads: the floor rises to the candidate and the
    /// keys seen with a lower head are the old keys. Nothing changes when the epoch or the
    /// generation changed meanwhile, or when more than `max_old` keys would be old (a backlog
    /// over many keys: each claim would carry them all, for index entries a backlog's claims
    /// hardly walk anyway). Returns whether it rose.
    pub(crate) fn raise(
        &self,
        (epoch, generation, candidate): (i64, u64, i64),
        seen: &[SeenHead],
        max_old: usize,
    ) -> bool {
        let Ok(mut k) = self.state.lock() else {
            return false;
        };
        if epoch != k.epoch || generation != k.generation || candidate < k.floor {
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
        k.generation += 1;
        true
    }

    /// A walk over every key with no floor (the probe) saw these heads in `epoch`: a key below
    /// the floor that is not old, or old with a lower head, is a row the floor passed over (with
    /// settled floors, none should be); it becomes old with that head. Returns how many.
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
    /// Whether knowledge of `epoch` applies, dropping all that is known when it is newer (the
    /// generation goes on counting).
    fn at_epoch(&mut self, epoch: i64) -> bool {
        if epoch < self.epoch {
            return false;
        }
        if epoch > self.epoch {
            *self = State {
                epoch,
                generation: self.generation + 1,
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

    fn stamp(allocated: i64, secs: i64, writers: &[&str]) -> Stamp {
        Stamp {
            allocated,
            at: at(secs),
            writers: writers.iter().map(|w| (*w).to_owned()).collect(),
            exact: true,
        }
    }

    /// Settles a stamp of `allocated` at `secs` at once (no writer running).
    fn settle_at(f: &Floors, allocated: i64, secs: i64) {
        f.stamped(stamp(allocated, secs, &[]));
        f.settle(&[]);
    }

    fn old(f: &Floors) -> Vec<(String, i64)> {
        let (k, _) = f.key_floor(&KeyCursor::default(), usize::MAX);
        k.keys.into_iter().zip(k.heads).collect()
    }

    fn floor(f: &Floors) -> i64 {
        f.key_floor(&KeyCursor::default(), 10).0.floor
    }

    /// Raises the keyed floor to the settled stamp with what a walk saw.
    fn raise(f: &Floors, seen: &[SeenHead], max_old: usize) -> bool {
        let candidate = f.candidate().expect("a settled stamp above the floor");
        f.raise(candidate, seen, max_old)
    }

    #[test]
    fn the_unkeyed_floor_trails_the_oldest_row_taken_and_the_settled_instant_and_goes_back_for_rows_given_back()
     {
        let f = Floors::new(Duration::from_secs(5));
        let start = f.unkeyed();
        assert_eq!(
            (start.floor, start.epoch, start.settled_at),
            (None, 0, None)
        );
        f.took_unkeyed(start, 0, at(100));
        assert_eq!(f.unkeyed().floor, None, "nothing settled: from the start");

        settle_at(&f, 10, 200);
        let start = f.unkeyed();
        f.took_unkeyed(start, 0, at(100));
        assert_eq!(
            f.unkeyed().floor,
            Some(at(95)),
            "the oldest taken less the margin"
        );
        f.took_unkeyed(start, 0, at(90));
        assert_eq!(f.unkeyed().floor, Some(at(95)), "never back on a claim");
        f.took_unkeyed(start, 0, at(400));
        assert_eq!(
            f.unkeyed().floor,
            Some(at(195)),
            "no further than the settled instant: a writer still open then may commit a row due before it"
        );
        f.lower_unkeyed(at(60));
        assert_eq!(f.unkeyed().floor, Some(at(60)), "back to rows given back");
        f.lower_unkeyed(at(70));
        assert_eq!(f.unkeyed().floor, Some(at(60)));
        // A resume advanced the epoch: the floor is dropped, and a claim of the old one ignored.
        f.saw(1, 0, &[]);
        assert_eq!((f.unkeyed().floor, f.unkeyed().epoch), (None, 1));
        f.took_unkeyed(f.unkeyed(), 0, at(200));
        assert_eq!((f.unkeyed().floor, f.unkeyed().epoch), (None, 1));
    }

    #[test]
    fn the_keyed_floor_rises_only_to_a_stamp_whose_writers_all_ended() {
        let f = Floors::new(Duration::ZERO);
        assert_eq!(floor(&f), 0, "nothing known");
        // A writer ("3/7") held the outbox when the sequence stood at 1,000: it may still commit
        // a row below that.
        let writers = f.stamped(stamp(1_000, 10, &["3/7", "4/2"]));
        assert_eq!(writers.len(), 2);
        assert_eq!(f.settle(&["3/7".to_owned()]), None);
        assert_eq!(f.candidate(), None, "nothing settled: the floor stays");
        // It is still open at the next stamp (it holds its lock to its end).
        f.stamped(stamp(1_500, 11, &["3/7"]));
        assert_eq!(f.settle(&["3/7".to_owned()]), None);
        // It ended: both stamps settle, the newest counts.
        let settled = f.settle(&[]).expect("settled");
        assert_eq!((settled.allocated, settled.at), (1_500, at(11)));
        assert!(f.stamped(stamp(1_600, 12, &[])).is_empty());
        // The walk saw "a" waiting at 400 and "b" at 1,700: "a" is old, "b" is not.
        assert!(raise(
            &f,
            &[
                seen("a", Some(400)),
                seen("b", Some(1_700)),
                seen("c", None)
            ],
            10
        ));
        assert_eq!(floor(&f), 1_500);
        assert_eq!(old(&f), vec![("a".to_owned(), 400)]);
        // Claims keep an old key's head current, and drop it once at the floor or empty.
        let (_, generation) = f.key_floor(&KeyCursor::default(), 10);
        f.saw(0, generation, &[seen("a", Some(700))]);
        assert_eq!(old(&f), vec![("a".to_owned(), 700)]);
        f.saw(0, generation, &[seen("a", Some(1_550))]);
        assert_eq!(old(&f), vec![], "at or above the floor: no longer old");
    }

    #[test]
    fn a_claims_report_from_before_the_floor_rose_is_ignored() {
        let f = Floors::new(Duration::ZERO);
        settle_at(&f, 100, 1);
        let (_, before) = f.key_floor(&KeyCursor::default(), 10);
        // The raise's walk found "a" at 50, committed after a claim had seen "a" at 80.
        assert!(raise(&f, &[seen("a", Some(50))], 10));
        f.saw(0, before, &[seen("a", Some(80))]);
        assert_eq!(
            old(&f),
            vec![("a".to_owned(), 50)],
            "the older claim's head would pass over row 50"
        );
    }

    #[test]
    fn a_stamp_of_a_caching_sequence_proves_nothing() {
        let f = Floors::new(Duration::ZERO);
        f.stamped(Stamp {
            exact: false,
            ..stamp(1_000, 1, &[])
        });
        assert_eq!(f.settle(&[]), None);
        assert_eq!(f.candidate(), None);
    }

    #[test]
    fn the_floor_stays_when_too_many_keys_would_be_old() {
        let f = Floors::new(Duration::ZERO);
        settle_at(&f, 1_000, 1);
        let seen: Vec<SeenHead> = ["a", "b", "c"].iter().map(|k| seen(k, Some(5))).collect();
        assert!(!raise(&f, &seen, 2), "three old keys, two allowed");
        assert_eq!(floor(&f), 0);
        assert!(raise(&f, &seen, 3));
    }

    #[test]
    fn a_raise_of_another_epoch_changes_nothing() {
        let f = Floors::new(Duration::ZERO);
        settle_at(&f, 1_000, 1);
        let (epoch, generation, candidate) = f.candidate().expect("candidate");
        f.saw(epoch + 1, generation, &[]);
        assert!(!f.raise((epoch, generation, candidate), &[], 10));
        assert_eq!(floor(&f), 0);
    }

    #[test]
    fn a_newer_epoch_drops_the_floor_and_the_old_keys_and_an_older_one_is_ignored() {
        let f = Floors::new(Duration::ZERO);
        settle_at(&f, 1_000, 1);
        assert!(raise(&f, &[seen("a", Some(10)), seen("b", Some(20))], 10));
        assert_eq!(old(&f).len(), 2);
        // A replay advanced the epoch: what was known is dropped.
        let (_, generation) = f.key_floor(&KeyCursor::default(), 10);
        f.saw(1, generation, &[seen("a", Some(5))]);
        let (k, _) = f.key_floor(&KeyCursor::default(), 10);
        assert_eq!((k.floor, k.epoch, k.keys.len()), (0, 1, 0));
        // A claim that read the old epoch reports late: ignored.
        let (_, generation) = f.key_floor(&KeyCursor::default(), 10);
        f.saw(0, generation, &[seen("c", Some(1))]);
        assert_eq!(f.key_floor(&KeyCursor::default(), 10).0.epoch, 1);
        assert_eq!(old(&f), vec![]);
        // The settled stamp is a fact about the sequence: the new epoch's floor may rise to it.
        assert!(raise(&f, &[seen("a", Some(5))], 10));
        assert_eq!(floor(&f), 1_000);
    }

    #[test]
    fn old_keys_are_given_after_the_cursor() {
        let f = Floors::new(Duration::ZERO);
        settle_at(&f, 100, 1);
        assert!(raise(
            &f,
            &[seen("a", Some(1)), seen("b", Some(2)), seen("c", Some(3))],
            10
        ));
        let cursor = KeyCursor {
            topic: "projects/p/topics/t".into(),
            ordering_key: "a".into(),
        };
        assert_eq!(f.key_floor(&cursor, 10).0.keys, vec!["b", "c"]);
        assert_eq!(f.key_floor(&KeyCursor::default(), 1).0.keys, vec!["a"]);
    }

    #[test]
    fn the_probe_makes_a_key_below_the_floor_old_and_lowers_an_old_keys_head() {
        let f = Floors::new(Duration::ZERO);
        settle_at(&f, 100, 1);
        assert!(raise(&f, &[seen("a", Some(50))], 10));
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
