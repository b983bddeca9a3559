//! `pending cancel`: moves messages not yet sent to the dead-letter table as `cancelled`
//! (`outbox_shared::store::pending::cancel`): inspectable and replayable there, and they block
//! nothing, so the later messages of their key go on (it was a person's decision). It is how a
//! held topic's messages that must never go (the topic was deleted on purpose) leave the outbox:
//! nothing is dead-lettered without a person. It prints the dead letters they became and the
//! replay that undoes it.

use chrono::{DateTime, Utc};
use outbox_runtime::operator::OpsError;
use outbox_shared::release::Feature;
use outbox_shared::store::audit::Action;
use outbox_shared::store::pending::{self, Pending};
use outbox_shared::store::replica;
use sqlx::PgConnection;

use super::report::{Moved, Report, summary};
use super::rows::{Outbox, OutboxFilter, Rows};
use super::{Audited, ChangeFlags, Plan, Verb, VerbInfo, Words};
use crate::ops::status::STALE_AFTER;

/// `pending cancel` options.
#[derive(Debug, Clone, clap::Args)]
pub struct Cancel {
    #[command(flatten)]
    pub common: outbox_runtime::operator::Common,
    /// Outbox ids (or use the filter flags).
    pub ids: Vec<i64>,
    #[command(flatten)]
    pub filter: OutboxFilter,
    /// Only messages waiting for a retry.
    #[arg(long)]
    pub waiting: bool,
    #[command(flatten)]
    pub flags: ChangeFlags,
}

impl Verb for Cancel {
    type Rows = Outbox;
    const ACTION: Action = Action::Cancel;
    const WORDS: Words = Words {
        done: "cancelled",
        would: "would cancel",
        reason: "say why the messages are cancelled (it goes to the audit trail and to each dead \
                 letter)",
        outside: "the filter leaves them out",
    };
    const INFO: VerbInfo = VerbInfo {
        action: Action::Cancel,
        group: "pending",
        rows: "messages",
        filters: super::rows::OUTBOX_FIELDS,
        nothing: "no unpublished message matches: nothing to do",
        label: "Cancel…",
    };

    fn common(&self) -> &outbox_runtime::operator::Common {
        &self.common
    }

    fn plan(&self, now: DateTime<Utc>) -> Result<Plan<Outbox>, OpsError> {
        let filter = self.filter.selection(&self.ids, now, self.waiting)?;
        Plan::new::<Self>(
            filter,
            &self.ids,
            self.filter.project.clone(),
            &self.flags,
            now,
        )
    }

    async fn preflight(conn: &mut PgConnection, plan: &Plan<Outbox>) -> Result<(), OpsError> {
        refuse_older_releases(conn, plan).await
    }

    async fn apply(
        tx: &mut PgConnection,
        page: &[Pending],
        plan: &Plan<Outbox>,
        report: &mut Report,
    ) -> Result<Audited, OpsError> {
        let ids: Vec<i64> = page.iter().map(|r| r.id).collect();
        let error = format!(
            "cancelled by {}: {}",
            plan.who.actor.as_deref().unwrap_or("the operator's login"),
            plan.who.reason
        );
        let changed = pending::cancel(tx, &ids, &error, plan.now).await?;
        report.in_flight.extend(&changed.in_flight);
        report
            .dead_letter_exists
            .extend(&changed.dead_letter_exists);
        report.gone.extend(&changed.unchanged);
        if !plan.dry_run {
            // Rolled back, the ids would name nothing (or, later, other entries).
            report.dead_letters.extend(changed.dead_letters.iter().map(
                |&(outbox_id, dead_letter_id)| Moved {
                    outbox_id,
                    dead_letter_id,
                },
            ));
        }
        Ok(Audited {
            ids: changed.ids,
            outbox_ids: None,
        })
    }

    fn explain(plan: &Plan<Outbox>, report: &mut Report) -> Vec<String> {
        if report.count == 0 {
            return Vec::new();
        }
        if plan.dry_run {
            // The dead letters' ids are given when they are written: a dry run has none to say.
            return vec![
                "They would become dead letters of kind `cancelled` (replayable; they block \
                 nothing); the real run prints their ids and the replay that undoes it."
                    .to_owned(),
            ];
        }
        let ids: Vec<i64> = report
            .dead_letters
            .iter()
            .map(|m| m.dead_letter_id)
            .collect();
        let all = ids.iter().map(i64::to_string).collect::<Vec<_>>().join(" ");
        let undo = format!("dispatcher dead-letters replay {all} --reason \"…\"");
        let text = if ids.len() <= 20 {
            undo.clone()
        } else {
            format!(
                "dispatcher dead-letters replay --kind cancelled --error-contains {:?} --reason \
                 \"…\" --dry-run, then with --yes (--json's `undo` names every id)",
                plan.who.reason
            )
        };
        report.undo = Some(undo);
        vec![
            format!(
                "They are dead letters {} now (kind `cancelled`: replayable, they block nothing; \
                 these are dead-letter ids, not outbox ids).",
                summary(&ids)
            ),
            format!("To undo: {text}"),
        ]
    }
}

/// Refuses to cancel keyed messages while a dispatcher of a release that misreads a cancelled
/// keyed row is alive ([`Feature::CancelKeyed`]): it would hold the key behind it. Unkeyed
/// messages are cancelled whatever runs.
async fn refuse_older_releases(
    conn: &mut PgConnection,
    plan: &Plan<Outbox>,
) -> Result<(), OpsError> {
    let feature = Feature::CancelKeyed;
    let older: Vec<replica::LiveRelease> = replica::live_releases(conn, STALE_AFTER)
        .await?
        .into_iter()
        .filter(|r| !feature.known_to(&r.version))
        .collect();
    if older.is_empty() {
        return Ok(());
    }
    // Only now (a rollout in progress): whether the selection holds a keyed message, by pages
    // of the same selection the change takes.
    let mut cursor = None;
    let keyed = loop {
        let page = Outbox::page(conn, &plan.filter, 1000, cursor).await?;
        if page.iter().any(|r| r.ordering_key.is_some()) {
            break true;
        }
        match page.last() {
            Some(last) if page.len() == 1000 => cursor = Some(last.id),
            _ => break false,
        }
    };
    if !keyed {
        return Ok(());
    }
    let who: Vec<String> = older
        .iter()
        .map(|r| {
            format!(
                "{} on {} ({})",
                r.replicas,
                r.version,
                r.replica_ids.join(", ")
            )
        })
        .collect();
    Err(OpsError::Failed(format!(
        "not cancelled: the selection holds messages with an ordering key, and {} dispatcher \
         replica(s) of a release before {} are alive ({}): such a release {}. Nothing was \
         changed. Finish the rollout (every replica on {} or later: dispatcher status lists the \
         releases), then cancel again; unkeyed messages can be cancelled now (docs/releases.md)",
        older.iter().map(|r| r.replicas).sum::<i64>(),
        feature.since(),
        who.join("; "),
        feature.misread(),
        feature.since()
    )))
}
