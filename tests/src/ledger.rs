//! The independent verdict on a delivery: given what was enqueued (in order) and what arrived (in
//! the order it arrived, or in Pub/Sub's publish order), it reports every message lost, every
//! arrival nobody enqueued, the duplicates, and every place where a key's first arrivals are out
//! of enqueue order.

use std::collections::{HashMap, HashSet};

use outbox_shared::NewMessage;

/// What was enqueued: dedupe keys with their ordering key, in enqueue order.
#[derive(Debug, Default, Clone)]
pub struct DeliveryLedger {
    expected: Vec<(String, Option<String>)>,
    index: HashMap<String, usize>,
}

/// One arrival: its dedupe key and the ordering key it arrived with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Arrival {
    /// The dedupe attribute.
    pub dedupe_key: String,
    /// The ordering key ("" for none, as Pub/Sub reports it).
    pub ordering_key: String,
}

/// Two messages of one key whose first arrivals came in the wrong order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OrderViolation {
    /// The ordering key.
    pub ordering_key: String,
    /// Enqueued first, arrived second.
    pub enqueued_first: String,
    /// Enqueued second, arrived first.
    pub arrived_first: String,
}

/// The verdict.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Verdict {
    /// Arrivals (first ones and duplicates).
    pub arrivals: usize,
    /// Enqueued, never arrived.
    pub lost: Vec<String>,
    /// Arrived, never enqueued.
    pub invented: Vec<String>,
    /// Arrivals beyond the first of each dedupe key.
    pub duplicates: usize,
    /// Per-key order breaks among first arrivals.
    pub order_violations: Vec<OrderViolation>,
}

impl Verdict {
    /// Nothing lost, nothing invented, no order broken (duplicates are allowed: at-least-once).
    pub fn is_clean(&self) -> bool {
        self.lost.is_empty() && self.invented.is_empty() && self.order_violations.is_empty()
    }

    /// Panics with the verdict unless it [`Self::is_clean`].
    pub fn assert_clean(&self, what: &str) {
        assert!(
            self.is_clean(),
            "{what}: {} lost (first: {:?}), {} invented (first: {:?}), {} order violations (first: {:?})",
            self.lost.len(),
            self.lost.iter().take(5).collect::<Vec<_>>(),
            self.invented.len(),
            self.invented.iter().take(5).collect::<Vec<_>>(),
            self.order_violations.len(),
            self.order_violations.iter().take(3).collect::<Vec<_>>(),
        );
    }
}

impl DeliveryLedger {
    /// An empty ledger.
    pub fn new() -> Self {
        Self::default()
    }

    /// A ledger of `messages`, enqueued in this order.
    pub fn of(messages: &[NewMessage]) -> Self {
        let mut l = Self::new();
        for m in messages {
            l.enqueued(&m.dedupe_key, m.ordering_key.as_deref());
        }
        l
    }

    /// Records the next enqueued message (a dedupe key enqueued again is ignored, as the outbox
    /// ignores it).
    pub fn enqueued(&mut self, dedupe_key: &str, ordering_key: Option<&str>) {
        if !self.index.contains_key(dedupe_key) {
            self.index
                .insert(dedupe_key.to_owned(), self.expected.len());
            self.expected
                .push((dedupe_key.to_owned(), ordering_key.map(str::to_owned)));
        }
    }

    /// Forgets a message that is expected not to arrive (for example, a discarded dead letter).
    pub fn withdraw(&mut self, dedupe_key: &str) {
        if let Some(i) = self.index.remove(dedupe_key) {
            self.expected[i].0.clear();
        }
    }

    /// Messages expected to arrive.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// Whether nothing is expected.
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// Judges `arrivals`, taken in the order given.
    pub fn verdict<'a>(&self, arrivals: impl IntoIterator<Item = &'a Arrival>) -> Verdict {
        let mut v = Verdict::default();
        let mut seen = HashSet::new();
        // Per ordering key: the enqueue index and dedupe key of the latest first arrival.
        let mut last: HashMap<&str, (usize, &str)> = HashMap::new();
        for a in arrivals {
            v.arrivals += 1;
            let Some(&i) = self.index.get(&a.dedupe_key) else {
                v.invented.push(a.dedupe_key.clone());
                continue;
            };
            if !seen.insert(i) {
                v.duplicates += 1;
                continue;
            }
            let Some(key) = self.expected[i].1.as_deref() else {
                continue;
            };
            if let Some(&(prev, prev_key)) = last.get(key)
                && prev > i
            {
                v.order_violations.push(OrderViolation {
                    ordering_key: key.to_owned(),
                    enqueued_first: self.expected[i].0.clone(),
                    arrived_first: prev_key.to_owned(),
                });
                continue;
            }
            last.insert(key, (i, self.expected[i].0.as_str()));
        }
        v.lost = self
            .expected
            .iter()
            .enumerate()
            .filter(|(i, (k, _))| !k.is_empty() && !seen.contains(i))
            .map(|(_, (k, _))| k.clone())
            .collect();
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arrivals(keys: &[(&str, &str)]) -> Vec<Arrival> {
        keys.iter()
            .map(|(d, k)| Arrival {
                dedupe_key: (*d).to_owned(),
                ordering_key: (*k).to_owned(),
            })
            .collect()
    }

    fn ledger() -> DeliveryLedger {
        let mut l = DeliveryLedger::new();
        for (d, k) in [
            ("a1", Some("a")),
            ("b1", Some("b")),
            ("a2", Some("a")),
            ("u", None),
            ("a3", Some("a")),
        ] {
            l.enqueued(d, k);
        }
        l
    }

    #[test]
    fn a_complete_in_order_delivery_with_duplicates_is_clean() {
        let v = ledger().verdict(&arrivals(&[
            ("b1", "b"),
            ("a1", "a"),
            ("u", ""),
            ("a1", "a"),
            ("a2", "a"),
            ("a3", "a"),
            ("a2", "a"),
        ]));
        assert!(v.is_clean(), "{v:?}");
        assert_eq!((v.arrivals, v.duplicates), (7, 2));
    }

    #[test]
    fn a_lost_message_is_caught() {
        let v = ledger().verdict(&arrivals(&[
            ("a1", "a"),
            ("b1", "b"),
            ("a2", "a"),
            ("a3", "a"),
        ]));
        assert_eq!(v.lost, vec!["u".to_owned()]);
        assert!(!v.is_clean());
    }

    #[test]
    fn an_invented_message_is_caught() {
        let v = ledger().verdict(&arrivals(&[
            ("a1", "a"),
            ("b1", "b"),
            ("a2", "a"),
            ("u", ""),
            ("a3", "a"),
            ("zz", ""),
        ]));
        assert_eq!(v.invented, vec!["zz".to_owned()]);
        assert!(!v.is_clean());
    }

    #[test]
    fn an_order_swap_within_a_key_is_caught_but_a_duplicate_resend_is_not_one() {
        let v = ledger().verdict(&arrivals(&[
            ("a1", "a"),
            ("a3", "a"),
            ("a2", "a"),
            ("b1", "b"),
            ("u", ""),
        ]));
        assert_eq!(
            v.order_violations,
            vec![OrderViolation {
                ordering_key: "a".into(),
                enqueued_first: "a2".into(),
                arrived_first: "a3".into(),
            }]
        );
        // A re-send of a1 after a2 (a crash between publish and commit) is a duplicate only.
        let v = ledger().verdict(&arrivals(&[
            ("a1", "a"),
            ("a2", "a"),
            ("a1", "a"),
            ("a3", "a"),
            ("b1", "b"),
            ("u", ""),
        ]));
        assert!(v.is_clean(), "{v:?}");
    }

    #[test]
    fn a_withdrawn_message_is_not_lost() {
        let mut l = ledger();
        l.withdraw("u");
        let v = l.verdict(&arrivals(&[
            ("a1", "a"),
            ("b1", "b"),
            ("a2", "a"),
            ("a3", "a"),
        ]));
        assert!(v.is_clean(), "{v:?}");
        assert_eq!(l.len(), 4);
    }
}
