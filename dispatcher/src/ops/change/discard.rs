//! `dead-letters discard`: deletes dead letters for good; a key one blocked flows again.

use chrono::{DateTime, Utc};
use outbox_runtime::operator::{OpsError, parse_age};
use outbox_shared::store::audit::Action;
use outbox_shared::store::dead_letter::{self, DeadLetter};
use sqlx::PgConnection;

use super::report::Report;
use super::rows::{DeadLetterFilter, DeadLetters};
use super::{Audited, ChangeFlags, Plan, Verb, VerbInfo, Words};

/// `dead-letters discard` options.
#[derive(Debug, Clone, clap::Args)]
pub struct Discard {
    #[command(flatten)]
    pub common: outbox_runtime::operator::Common,
    /// Dead-letter ids (or use the filter flags).
    pub ids: Vec<i64>,
    #[command(flatten)]
    pub filter: DeadLetterFilter,
    /// Entries that failed longer ago than this (e.g. 30d).
    #[arg(long)]
    pub older_than: Option<String>,
    #[command(flatten)]
    pub flags: ChangeFlags,
}

impl Verb for Discard {
    type Rows = DeadLetters;
    const ACTION: Action = Action::Discard;
    const WORDS: Words = Words {
        done: "discarded",
        would: "would discard",
        reason: "say why the dead letters are discarded (it goes to the audit trail)",
        outside: "the filter leaves them out",
    };
    const INFO: VerbInfo = VerbInfo {
        action: Action::Discard,
        group: "dead-letters",
        rows: "entries",
        filters: super::rows::DEAD_LETTER_FIELDS,
        nothing: "no dead letter matches: nothing to do",
        label: "Discard…",
    };

    fn common(&self) -> &outbox_runtime::operator::Common {
        &self.common
    }

    fn plan(&self, now: DateTime<Utc>) -> Result<Plan<DeadLetters>, OpsError> {
        let older_than = self
            .older_than
            .as_deref()
            .map(|s| parse_age("--older-than", s))
            .transpose()?;
        let filter = self.filter.filter(&self.ids, now, older_than)?;
        Plan::new::<Self>(
            filter,
            &self.ids,
            self.filter.project.clone(),
            &self.flags,
            now,
        )
    }

    async fn apply(
        tx: &mut PgConnection,
        page: &[DeadLetter],
        _plan: &Plan<DeadLetters>,
        report: &mut Report,
    ) -> Result<Audited, OpsError> {
        let ids: Vec<i64> = page.iter().map(|d| d.id).collect();
        let done = dead_letter::discard(tx, &ids).await?;
        report
            .gone
            .extend(ids.iter().filter(|id| !done.contains(id)));
        Ok(Audited {
            ids: done,
            outbox_ids: None,
        })
    }
}
