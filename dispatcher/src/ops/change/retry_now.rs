//! `pending retry-now`: makes messages waiting for a retry due at once, their attempts
//! unchanged, and wakes the dispatchers. It selects only waiting messages: an id that is due
//! already is outside its selection.

use chrono::{DateTime, Utc};
use outbox_runtime::operator::OpsError;
use outbox_shared::store::audit::Action;
use outbox_shared::store::pending::{self, Pending};
use outbox_shared::store::status;
use sqlx::PgConnection;

use super::report::Report;
use super::rows::{Outbox, OutboxFilter};
use super::{Audited, ChangeFlags, Plan, Verb, VerbInfo, Words};

/// `pending retry-now` options.
#[derive(Debug, Clone, clap::Args)]
pub struct RetryNow {
    #[command(flatten)]
    pub common: outbox_runtime::operator::Common,
    /// Outbox ids (or use the filter flags).
    pub ids: Vec<i64>,
    #[command(flatten)]
    pub filter: OutboxFilter,
    /// Only messages waiting for a retry (retry-now takes only those anyway).
    #[arg(long)]
    pub waiting: bool,
    #[command(flatten)]
    pub flags: ChangeFlags,
}

impl Verb for RetryNow {
    type Rows = Outbox;
    const ACTION: Action = Action::RetryNow;
    const WORDS: Words = Words {
        done: "made due now",
        would: "would make due now",
        reason: "say why the messages are retried now (it goes to the audit trail)",
        outside: "not waiting for a retry (due already), or the filter leaves them out",
    };
    const INFO: VerbInfo = VerbInfo {
        action: Action::RetryNow,
        group: "pending",
        rows: "messages",
        filters: super::rows::OUTBOX_FIELDS,
        nothing: "no message waiting for a retry matches: nothing to do",
        label: "Retry now…",
    };

    fn common(&self) -> &outbox_runtime::operator::Common {
        &self.common
    }

    fn plan(&self, now: DateTime<Utc>) -> Result<Plan<Outbox>, OpsError> {
        let filter = self.filter.selection(&self.ids, now, true)?;
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
        page: &[Pending],
        plan: &Plan<Outbox>,
        report: &mut Report,
    ) -> Result<Audited, OpsError> {
        let ids: Vec<i64> = page.iter().map(|r| r.id).collect();
        let changed = pending::retry_now(tx, &ids, plan.now).await?;
        held_topics(tx, page, report).await?;
        report.in_flight.extend(&changed.in_flight);
        report.gone.extend(&changed.unchanged);
        Ok(Audited {
            ids: changed.ids,
            outbox_ids: None,
        })
    }
}

/// A warning for each held topic of `page` (once): its messages are due now, but the topic waits
/// for its probe, which retry-now does not hurry.
async fn held_topics(
    tx: &mut PgConnection,
    page: &[Pending],
    report: &mut Report,
) -> Result<(), OpsError> {
    for held in status::held_topics(tx).await? {
        let h = &held.hold;
        let said = report.warnings.iter().any(|w| w.contains(&h.topic));
        if !said && page.iter().any(|r| r.topic == h.topic) {
            report.warnings.push(format!(
                "warning: {} is held (Pub/Sub refuses it as a whole with {} since {}): its \
                 messages made due go when its next probe, at {}, is accepted, not before. {}",
                h.topic,
                h.code,
                outbox_runtime::table::instant(h.held_since),
                outbox_runtime::table::instant(h.next_probe_at),
                crate::ops::status::held_hint(&h.topic, &h.code)
            ));
        }
    }
    Ok(())
}
