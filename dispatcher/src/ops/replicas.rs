//! `dispatcher replicas prune`: delete the heartbeat rows of replicas that are gone (a killed
//! pod never removes its own), audited. The replicas also forget such rows by themselves after
//! `--forget-replicas-after`; this is for an operator who does not want to wait.

use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox_runtime::operator::{
    Actor, Command, Common, Confirm, Exit, OpsError, Output, Why, finish, parse_age,
};
use outbox_shared::store::audit::{self, Action, Record};
use outbox_shared::store::replica;
use serde::Serialize;
use sqlx::PgPool;

use super::status::STALE_AFTER;
use super::{group, plain};

group! {
    /// The replica commands.
    pub enum ReplicasCommand {
        /// Delete the rows of replicas without a heartbeat for --gone-for (the ids given, or
        /// every such replica with --yes). A live replica is never pruned. Audited.
        #[command(after_help = "Examples:\n  dispatcher replicas prune --dry-run\n  \
                          dispatcher replicas prune --reason \"pods killed in the node drain\" --yes\n  \
                          dispatcher replicas prune dispatcher-7d9f-1-1764650000000 --reason \"OOM-killed\"")]
        Prune(PruneArgs),
    }
}

plain!(PruneArgs);

/// `replicas prune` options.
#[derive(Debug, Clone, clap::Args)]
pub struct PruneArgs {
    #[command(flatten)]
    pub common: Common,
    /// Only these replicas (ids as `dispatcher status` lists them).
    #[arg(value_name = "REPLICA_ID")]
    pub ids: Vec<String>,
    /// Prune replicas without a heartbeat for this long (at least 30s: a live one sends one
    /// every 5 s).
    #[arg(long, default_value = "30s")]
    pub gone_for: String,
    #[command(flatten)]
    pub why: Why,
    #[command(flatten)]
    pub confirm: Confirm,
}

/// A checked `replicas prune`.
#[derive(Debug, Clone)]
pub struct Prune {
    ids: Vec<String>,
    gone_for: Duration,
    who: Actor,
    dry_run: bool,
}

/// `replicas prune --json`.
#[derive(Debug, Clone, Serialize)]
struct Report {
    action: &'static str,
    pruned: Vec<String>,
    audit_id: Option<i64>,
    dry_run: bool,
}

impl Command for PruneArgs {
    type Checked = Prune;

    fn check(&self, _now: DateTime<Utc>) -> Result<Prune, OpsError> {
        let gone_for = parse_age("--gone-for", &self.gone_for)?;
        if gone_for < STALE_AFTER {
            return Err(OpsError::Usage(format!(
                "--gone-for {:?} is below {STALE_AFTER:?}: a replica that recent may be alive",
                self.gone_for
            )));
        }
        if let Some(blank) = self.ids.iter().find(|id| id.trim().is_empty()) {
            return Err(OpsError::Usage(format!(
                "replica id {blank:?} is empty: give the ids dispatcher status lists, or none"
            )));
        }
        // Without ids it prunes every replica gone that long: a selection by filter.
        self.confirm
            .check(self.ids.is_empty(), "prune", "replica gone for --gone-for")?;
        Ok(Prune {
            ids: self.ids.clone(),
            gone_for,
            who: self.why.check(
                "say why the replicas are pruned (it goes to the audit trail)",
                self.confirm.dry_run,
            )?,
            dry_run: self.confirm.dry_run,
        })
    }

    async fn run(p: Prune, pool: &PgPool) -> Result<Output, OpsError> {
        let mut tx = pool.begin().await?;
        let ids = (!p.ids.is_empty()).then_some(p.ids.as_slice());
        let pruned = replica::prune(&mut tx, p.gone_for.as_secs_f64(), ids).await?;
        let audit_id = if pruned.is_empty() || p.dry_run {
            None
        } else {
            let entry = Record {
                actor: p.who.actor.as_deref(),
                action: Action::Prune,
                selector: serde_json::json!({
                    "replica_ids": pruned,
                    "gone_for_seconds": p.gone_for.as_secs(),
                }),
                row_ids: &[],
                outbox_ids: None,
                reason: &p.who.reason,
            };
            Some(audit::record(&mut tx, &entry).await?)
        };
        finish(tx, p.dry_run).await?;
        let left: Vec<&String> = p.ids.iter().filter(|id| !pruned.contains(id)).collect();
        let text = match (audit_id, pruned.is_empty()) {
            (Some(id), _) => format!(
                "pruned {} replica row(s) (audit entry {id}): {}\n",
                pruned.len(),
                pruned.join(", ")
            ),
            (None, false) => format!(
                "would prune {} replica row(s) (dry run: nothing changed): {}\n",
                pruned.len(),
                pruned.join(", ")
            ),
            (None, true) => format!(
                "No replica has been without a heartbeat for {}; nothing pruned.\n",
                outbox_runtime::table::duration(p.gone_for.as_secs_f64())
            ),
        };
        let exit = if pruned.is_empty() {
            Exit::NothingMatched
        } else {
            Exit::Ok
        };
        let report = Report {
            action: "prune",
            pruned: pruned.clone(),
            audit_id,
            dry_run: p.dry_run,
        };
        let out = Output::new(text, &report, exit)?;
        Ok(if left.is_empty() {
            out
        } else {
            out.note(format!(
                "warning: not pruned (no such replica, or its heartbeat is younger than --gone-for): {}",
                left.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ")
            ))
        })
    }
}
