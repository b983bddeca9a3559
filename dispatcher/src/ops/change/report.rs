//! What a change did (or, as a dry run, would do) with every id of its selection, as one report
//! for every verb: its JSON (fields are only ever added) and its text, where long id lists are
//! summarised as ranges (the JSON lists every id).

use outbox_runtime::operator::{Exit, OpsError, Output};
use outbox_shared::store::audit::Action;
use outbox_shared::store::pending::{self, KeyAfter};
use serde::Serialize;
use sqlx::PgConnection;

use super::rows::Ids;
use super::{Plan, Verb};

/// A cancelled message and the dead letter it became.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Moved {
    pub outbox_id: i64,
    pub dead_letter_id: i64,
}

/// What a change did with its selection.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub action: Action,
    pub dry_run: bool,
    /// Which table `ids` (and every other id list but `dead_letters`) name: `outbox` or
    /// `dead_letter`.
    pub ids_are: Ids,
    /// Changed.
    pub ids: Vec<i64>,
    pub count: usize,
    /// Held by a dispatcher (being published right now): left alone.
    pub in_flight: Vec<i64>,
    /// Cancel: a dead letter holds the same dedupe key already: left in the outbox.
    pub dead_letter_exists: Vec<i64>,
    /// Replay: the dedupe key is back in the outbox already: left in place.
    pub skipped: Vec<i64>,
    /// Given by id, in the table, but the filter leaves them out (retry-now: not waiting).
    pub outside: Vec<i64>,
    /// Given by id, gone since the change began (published, or changed by someone else).
    pub gone: Vec<i64>,
    /// `outside` and `gone` together (the earlier name; kept for scripts).
    pub unchanged: Vec<i64>,
    /// Cancel: the dead letter each cancelled message became (replay takes these ids).
    pub dead_letters: Vec<Moved>,
    /// Cancel: the command that puts them back.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub undo: Option<String>,
    /// Replay: the ids the dispatcher refused itself, which it will dead-letter again.
    pub refused_locally: Vec<i64>,
    /// Replay: cancelled entries with an ordering key (their key went on without them).
    pub cancelled_keyed: Vec<i64>,
    pub audit_ids: Vec<i64>,
    /// Each ordering key of the rows changed, as the change leaves it: whether a dead letter
    /// still blocks it and how many of its messages then wait in the outbox.
    pub keys: Vec<KeyAfter>,
    #[serde(skip)]
    seen: Vec<i64>,
    /// A verb's own lines for stderr (warnings), after the engine's.
    #[serde(skip)]
    pub(super) warnings: Vec<String>,
}

impl Report {
    pub(super) fn new(action: Action, ids_are: Ids, dry_run: bool) -> Self {
        Self {
            action,
            dry_run,
            ids_are,
            ids: Vec::new(),
            count: 0,
            in_flight: Vec::new(),
            dead_letter_exists: Vec::new(),
            skipped: Vec::new(),
            outside: Vec::new(),
            gone: Vec::new(),
            unchanged: Vec::new(),
            dead_letters: Vec::new(),
            undo: None,
            refused_locally: Vec::new(),
            cancelled_keyed: Vec::new(),
            audit_ids: Vec::new(),
            keys: Vec::new(),
            seen: Vec::new(),
            warnings: Vec::new(),
        }
    }

    /// A page selected these.
    pub(super) fn seen(&mut self, ids: impl Iterator<Item = i64>) {
        self.seen.extend(ids);
    }

    /// A page changed these.
    pub(super) fn changed(&mut self, ids: &[i64]) {
        self.ids.extend(ids);
        self.count = self.ids.len();
    }

    /// Of `given`, those no page selected.
    pub(super) fn unseen(&self, given: &[i64]) -> Vec<i64> {
        let seen: std::collections::HashSet<i64> = self.seen.iter().copied().collect();
        given
            .iter()
            .copied()
            .filter(|id| !seen.contains(id))
            .collect()
    }

    /// Adds what the page's transaction leaves of `keys` (each once).
    pub(super) async fn keys_after(
        &mut self,
        tx: &mut PgConnection,
        keys: &[(String, String)],
        skip_topics: &[String],
    ) -> Result<(), OpsError> {
        for key in pending::keys_after(tx, keys, skip_topics).await? {
            match self
                .keys
                .iter_mut()
                .find(|k| k.topic == key.topic && k.ordering_key == key.ordering_key)
            {
                // A later page's view is the later state.
                Some(known) => *known = key,
                None => self.keys.push(key),
            }
        }
        Ok(())
    }

    /// The text, the JSON, the notes and the exit code.
    pub(super) fn output<V: Verb>(mut self, plan: &Plan<V::Rows>) -> Result<Output, OpsError> {
        self.unchanged = self.outside.iter().chain(&self.gone).copied().collect();
        self.unchanged.sort_unstable();
        let words = V::WORDS;
        let noun = <V::Rows as super::Rows>::PLURAL;
        let verb = if self.dry_run {
            words.would
        } else {
            words.done
        };
        let mut text = format!("{verb} {} {noun}{}\n", self.count, ids_line(&self.ids));
        for line in V::explain(plan, &mut self) {
            text.push_str(&line);
            text.push('\n');
        }
        for k in &self.keys {
            text.push_str(&key_line(k));
            text.push('\n');
        }
        let exit = self.exit();
        let mut notes = self.notes(words.outside);
        notes.append(&mut self.warnings);
        let mut out = Output::new(text, &self, exit)?;
        for n in notes {
            out = out.note(n);
        }
        Ok(out)
    }

    fn exit(&self) -> Exit {
        let left = self.in_flight.len() + self.dead_letter_exists.len() + self.skipped.len();
        match (
            self.count,
            left,
            self.gone.is_empty() && self.outside.is_empty(),
        ) {
            // Selected, but every one left in place: not done (the notes say why).
            (0, 1.., _) => Exit::Failed,
            (0, 0, _) => Exit::NothingMatched,
            // Some of the ids given were not changed: the operator must look.
            (_, _, false) => Exit::Failed,
            _ => Exit::Ok,
        }
    }

    fn notes(&self, outside: &str) -> Vec<String> {
        let mut notes = Vec::new();
        let mut note = |ids: &[i64], why: &str| {
            if !ids.is_empty() {
                notes.push(format!("{} left as they are: {why}", summary(ids)));
            }
        };
        note(
            &self.in_flight,
            "a dispatcher is publishing them right now; list them again in a moment",
        );
        note(
            &self.dead_letter_exists,
            "a dead letter holds the same dedupe key already (discard or replay that dead letter \
             first)",
        );
        note(&self.outside, outside);
        note(
            &self.gone,
            "gone since the change began (published, or changed by someone else)",
        );
        notes
    }
}

/// What a change leaves of one ordering key.
fn key_line(k: &KeyAfter) -> String {
    let state = match (k.blocked, k.waiting) {
        (true, n) => format!(
            "still blocked by a dead letter of its own; {n} message(s) wait (dispatcher \
             dead-letters blocked --topic {})",
            k.topic
        ),
        (false, 0) => "not blocked; no message of it waits".to_owned(),
        (false, n) => format!("not blocked: its {n} waiting message(s) go on at once, in order"),
    };
    format!("ordering key {:?} of {}: {state}", k.ordering_key, k.topic)
}

/// `: 1 2 3` for a few ids, ranges for many (`: 1-500 502-901`), cut after a few ranges.
fn ids_line(ids: &[i64]) -> String {
    if ids.is_empty() {
        String::new()
    } else {
        format!(": {}", summary(ids))
    }
}

/// Ids for a person to read: as ranges, at most eight of them, then how many more (the JSON
/// lists every id).
pub fn summary(ids: &[i64]) -> String {
    const SHOWN: usize = 8;
    let mut sorted = ids.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut ranges: Vec<(i64, i64)> = Vec::new();
    for id in sorted {
        match ranges.last_mut() {
            Some((_, end)) if *end + 1 == id => *end = id,
            _ => ranges.push((id, id)),
        }
    }
    let mut shown: Vec<String> = ranges
        .iter()
        .take(SHOWN)
        .map(|&(a, b)| match b - a {
            0 => a.to_string(),
            1 => format!("{a} {b}"),
            _ => format!("{a}-{b}"),
        })
        .collect();
    if ranges.len() > SHOWN {
        let rest: i64 = ranges[SHOWN..].iter().map(|(a, b)| b - a + 1).sum();
        shown.push(format!("and {rest} more (--json lists every id)"));
    }
    shown.join(" ")
}

#[cfg(test)]
mod tests {
    use super::summary;

    #[test]
    fn a_few_ids_read_as_they_are_and_many_as_ranges() {
        assert_eq!(summary(&[3, 1, 2]), "1-3");
        assert_eq!(summary(&[7, 9]), "7 9");
        assert_eq!(summary(&[4, 5]), "4 5");
        let many: Vec<i64> = (1..=901).collect();
        assert_eq!(summary(&many), "1-901");
        let scattered: Vec<i64> = (0..10_000).map(|i| i * 2).collect();
        let s = summary(&scattered);
        assert!(s.len() < 100, "{s}");
        assert!(s.ends_with("and 9992 more (--json lists every id)"), "{s}");
    }
}
