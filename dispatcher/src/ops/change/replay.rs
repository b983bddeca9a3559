//! `dead-letters replay`: puts dead letters back into the outbox (attempts reset; a message
//! keeps its original outbox id, so a keyed one goes out ahead of the messages that waited
//! behind it) at a bounded rate, and wakes the dispatchers. An entry whose dedupe key is back in
//! the outbox already is left in place (`skipped`). Each audit row records where every entry went
//! (`outbox_ids`), so `dead-letters show` of a replayed id follows it.

use chrono::{DateTime, Utc};
use outbox_runtime::operator::OpsError;
use outbox_shared::store::audit::Action;
use outbox_shared::store::dead_letter::{self, DeadLetter, REFUSED_LOCALLY};
use sqlx::PgConnection;

use super::report::{Report, summary};
use super::rows::{DeadLetterFilter, DeadLetters};
use super::{Audited, ChangeFlags, Plan, Verb, VerbInfo, Words};

/// `dead-letters replay` options.
#[derive(Debug, Clone, clap::Args)]
pub struct Replay {
    #[command(flatten)]
    pub common: outbox_runtime::operator::Common,
    /// Dead-letter ids (or use the filter flags).
    pub ids: Vec<i64>,
    #[command(flatten)]
    pub filter: DeadLetterFilter,
    /// At most this many entries per second (spares the dispatchers a flood).
    #[arg(long, default_value_t = 1000.0)]
    pub rate: f64,
    #[command(flatten)]
    pub flags: ChangeFlags,
}

impl Verb for Replay {
    type Rows = DeadLetters;
    const ACTION: Action = Action::Replay;
    const WORDS: Words = Words {
        done: "replayed",
        would: "would replay",
        reason: "say why the dead letters are replayed (it goes to the audit trail)",
        outside: "the filter leaves them out",
    };
    const INFO: VerbInfo = VerbInfo {
        action: Action::Replay,
        group: "dead-letters",
        rows: "entries",
        filters: super::rows::DEAD_LETTER_FIELDS,
        nothing: "no dead letter matches: nothing to do",
        label: "Replay…",
    };

    fn common(&self) -> &outbox_runtime::operator::Common {
        &self.common
    }

    fn plan(&self, now: DateTime<Utc>) -> Result<Plan<DeadLetters>, OpsError> {
        if self.rate.is_nan() || self.rate <= 0.0 {
            return Err(OpsError::Usage(format!(
                "--rate must be above 0, got {}",
                self.rate
            )));
        }
        let filter = self.filter.filter(&self.ids, now, None)?;
        let mut plan = Plan::new::<Self>(
            filter,
            &self.ids,
            self.filter.project.clone(),
            &self.flags,
            now,
        )?;
        plan.rate = Some(self.rate);
        Ok(plan)
    }

    async fn apply(
        tx: &mut PgConnection,
        page: &[DeadLetter],
        _plan: &Plan<DeadLetters>,
        report: &mut Report,
    ) -> Result<Audited, OpsError> {
        let ids: Vec<i64> = page.iter().map(|d| d.id).collect();
        let moved = dead_letter::replay(tx, &ids).await?;
        let done: Vec<i64> = moved.iter().map(|(id, _)| *id).collect();
        for d in page.iter().filter(|d| done.contains(&d.id)) {
            if d.last_error.starts_with(REFUSED_LOCALLY) {
                report.refused_locally.push(d.id);
            }
            if d.error_kind == "cancelled" && d.ordering_key.is_some() {
                report.cancelled_keyed.push(d.id);
            }
        }
        // Left in place: the dedupe key is in the outbox again (or the entry is gone).
        report
            .skipped
            .extend(ids.iter().filter(|id| !done.contains(id)));
        Ok(Audited {
            ids: done,
            outbox_ids: Some(moved.iter().map(|(_, outbox)| *outbox).collect()),
        })
    }

    fn explain(plan: &Plan<DeadLetters>, report: &mut Report) -> Vec<String> {
        let mut lines = Vec::new();
        let would = if plan.dry_run { "would be" } else { "are" };
        if !report.skipped.is_empty() {
            let ids: Vec<String> = report.skipped.iter().map(i64::to_string).collect();
            lines.push(format!(
                "{} {} in place: their dedupe key is in the outbox again (the message was written \
                 again, or its published copy is retained), so a replay cannot bring them back \
                 and the ordering key they block stays blocked. To release it: dispatcher \
                 dead-letters discard {} --reason \"…\"",
                summary(&report.skipped),
                if plan.dry_run {
                    "would be left"
                } else {
                    "are left"
                },
                ids.join(" ")
            ));
        }
        if !report.refused_locally.is_empty() {
            let warning = format!(
                "warning: dead letter(s) {} {would} refused again: the dispatcher refused them \
                 itself (a limit check, before sending), so they come back as new dead letters \
                 and a key they head is blocked again. Discard them, or fix them at the source \
                 and write them again",
                summary(&report.refused_locally)
            );
            report.warnings.push(warning);
        }
        if !report.cancelled_keyed.is_empty() {
            lines.push(format!(
                "note: {} {would} cancelled messages with an ordering key: their key went on \
                 without them, so messages enqueued after them may be published already; \
                 replayed, they go out after those, not in their first place.",
                summary(&report.cancelled_keyed)
            ));
        }
        lines
    }
}
