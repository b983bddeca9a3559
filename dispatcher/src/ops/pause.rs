//! `dispatcher pause TOPIC` / `dispatcher resume TOPIC`: persisted in the database, each with
//! its audit row in the same transaction.
//!
//! A pause is in force when the command returns: both claims read the pause table in the claim
//! statement itself (`outbox_shared::store::claim`), so no claim whose snapshot includes the
//! pause takes the topic's rows, and one whose snapshot predates it cannot see a row committed
//! after it. (Batches claimed before the pause finish.) A resume notifies the dispatchers so the
//! topic's rows are claimed at once.

use chrono::{DateTime, Utc};
use outbox_runtime::operator::{
    Actor, Command, Common, Confirm, Exit, OpsError, Output, Why, finish,
};
use outbox_shared::store::audit::{self, Action, Record};
use outbox_shared::store::{notify, pause};
use serde::Serialize;
use sqlx::PgPool;

use super::{PAUSE_A_NEW_TOPIC, ProjectArg, Unknown, Wake, did_you_mean, known_topic};

/// `pause` options.
#[derive(Debug, Clone, clap::Args)]
pub struct PauseArgs {
    #[command(flatten)]
    pub common: Common,
    /// The topic (full name, or short with --pubsub-project). It must be known: named by an
    /// outbox row, a dead letter, a replica's --topic list or an earlier audit entry.
    pub topic: String,
    #[command(flatten)]
    pub project: ProjectArg,
    /// Pause a topic the database does not know (no message yet, or all published and deleted).
    #[arg(long)]
    pub new_topic: bool,
    #[command(flatten)]
    pub why: Why,
    #[command(flatten)]
    pub confirm: Confirm,
}

/// `resume` options.
#[derive(Debug, Clone, clap::Args)]
pub struct ResumeArgs {
    #[command(flatten)]
    pub common: Common,
    /// The paused topic (full name, or short with --pubsub-project).
    pub topic: String,
    #[command(flatten)]
    pub project: ProjectArg,
    #[command(flatten)]
    pub why: Why,
    #[command(flatten)]
    pub confirm: Confirm,
    #[command(flatten)]
    pub wake: Wake,
}

/// A checked pause or resume.
#[derive(Debug, Clone)]
pub struct Change {
    /// The topic as given (resolved and looked up in the run).
    given: String,
    project: ProjectArg,
    who: Actor,
    /// Pause: accept a topic nobody names yet.
    new_topic: bool,
    /// Resume: the channel to notify.
    notify_channel: Option<String>,
    /// Made and rolled back: what it would do.
    dry_run: bool,
}

impl Change {
    /// A change of `given`, `done` ("paused", "resumed") for the reason `why` gives.
    fn new(
        given: &str,
        project: &ProjectArg,
        why: &Why,
        confirm: &Confirm,
        done: &str,
    ) -> Result<Self, OpsError> {
        Ok(Self {
            given: given.to_owned(),
            project: project.clone(),
            who: why.check(
                &format!("say why the topic is {done} (it goes to the audit trail)"),
                confirm.dry_run,
            )?,
            new_topic: false,
            notify_channel: None,
            dry_run: confirm.dry_run,
        })
    }

    /// `done` ("paused") or, in a dry run, "would be paused".
    fn says(&self, done: &str) -> String {
        if self.dry_run {
            format!("would be {done} (dry run: nothing changed)")
        } else {
            done.to_owned()
        }
    }
}

/// `pause` / `resume --json`.
#[derive(Debug, Clone, Serialize)]
struct Report {
    action: Action,
    topic: String,
    changed: bool,
    audit_id: Option<i64>,
    dry_run: bool,
}

impl Command for PauseArgs {
    type Checked = Change;

    fn check(&self, _now: DateTime<Utc>) -> Result<Change, OpsError> {
        Change::new(
            &self.topic,
            &self.project,
            &self.why,
            &self.confirm,
            "paused",
        )
        .map(|c| Change {
            new_topic: self.new_topic,
            ..c
        })
    }

    async fn run(c: Change, pool: &PgPool) -> Result<Output, OpsError> {
        let mut tx = pool.begin().await?;
        let unknown = if c.new_topic {
            Unknown::Allow
        } else {
            Unknown::Refuse(PAUSE_A_NEW_TOPIC)
        };
        let topic = known_topic(&mut tx, &c.project, &c.given, unknown).await?;
        let changed = pause::pause(&mut tx, &topic, c.who.actor.as_deref(), &c.who.reason).await?;
        let audit_id = record(&mut tx, changed, Action::Pause, &topic, &c).await?;
        finish(tx, c.dry_run).await?;
        let text = match (changed, audit_id) {
            (true, Some(id)) => format!(
                "{topic}: paused (audit entry {id}). No claim takes its messages from now on; they \
                 accumulate until `dispatcher resume`.\n"
            ),
            (true, None) => format!("{topic}: {}.\n", c.says("paused")),
            (false, _) => format!("{topic}: already paused; nothing changed.\n"),
        };
        report(text, Action::Pause, topic, changed, audit_id, c.dry_run)
    }
}

impl Command for ResumeArgs {
    type Checked = Change;

    fn check(&self, _now: DateTime<Utc>) -> Result<Change, OpsError> {
        Change::new(
            &self.topic,
            &self.project,
            &self.why,
            &self.confirm,
            "resumed",
        )
        .map(|c| Change {
            notify_channel: Some(self.wake.notify_channel.clone()),
            ..c
        })
    }

    async fn run(c: Change, pool: &PgPool) -> Result<Output, OpsError> {
        let mut tx = pool.begin().await?;
        let topic = known_topic(&mut tx, &c.project, &c.given, Unknown::Allow).await?;
        let changed = pause::resume(&mut tx, &topic).await?;
        let audit_id = record(&mut tx, changed, Action::Resume, &topic, &c).await?;
        if let (true, Some(channel)) = (changed, &c.notify_channel) {
            notify::notify(&mut tx, channel).await?;
        }
        let paused: Vec<String> = if changed {
            Vec::new()
        } else {
            pause::topics(&mut tx).await?
        };
        finish(tx, c.dry_run).await?;
        match (changed, audit_id) {
            (true, Some(id)) => report(
                format!("{topic}: resumed (audit entry {id}); the dispatchers were woken.\n"),
                Action::Resume,
                topic,
                true,
                audit_id,
                false,
            ),
            (true, None) => report(
                format!("{topic}: {}.\n", c.says("resumed")),
                Action::Resume,
                topic,
                true,
                None,
                true,
            ),
            (false, _) => {
                let hint = if paused.is_empty() {
                    "no topic is paused".to_owned()
                } else {
                    did_you_mean(&topic, &paused)
                };
                report(
                    format!("{topic}: not paused ({hint}); nothing changed.\n"),
                    Action::Resume,
                    topic,
                    false,
                    None,
                    c.dry_run,
                )
            }
        }
    }
}

/// Writes the audit row of a change that happened (none in a dry run).
async fn record(
    tx: &mut sqlx::PgConnection,
    changed: bool,
    action: Action,
    topic: &str,
    c: &Change,
) -> Result<Option<i64>, OpsError> {
    if !changed || c.dry_run {
        return Ok(None);
    }
    let who: &Actor = &c.who;
    let entry = Record {
        actor: who.actor.as_deref(),
        action,
        selector: serde_json::json!({ "topic": topic }),
        row_ids: &[],
        outbox_ids: None,
        reason: &who.reason,
    };
    Ok(Some(audit::record(tx, &entry).await?))
}

fn report(
    text: String,
    action: Action,
    topic: String,
    changed: bool,
    audit_id: Option<i64>,
    dry_run: bool,
) -> Result<Output, OpsError> {
    let exit = if changed {
        Exit::Ok
    } else {
        Exit::NothingMatched
    };
    let report = Report {
        action,
        topic,
        changed,
        audit_id,
        dry_run,
    };
    Output::new(text, &report, exit)
}
