//! The operator's commands, subcommands of the `dispatcher` binary, run under an operator's own
//! database login (never the dispatcher's): from a laptop through the Auth Proxy, or in the
//! cluster with `deploy/k8s/operator/run` (deploy/README.md, "Operators").
//!
//! Each command is built on the one operator framework both binaries share
//! ([`outbox_runtime::operator`]: options, a pure check, a run returning an output value, exit
//! codes); what is particular to the dispatcher's commands is here: topic names (resolved,
//! checked against Pub/Sub's grammar and against the topics the database knows) and waking the
//! dispatchers after a change that releases rows.

mod audit;
mod blocked;
pub mod change;
mod dead_letters;
mod pause;
mod pending;
mod replicas;
pub(crate) mod status;

use clap::Subcommand;
use outbox_runtime::operator::{Common, Exit, OpsError, Output, execute, near, output_on};

use crate::ops::status::StatusArgs;
use outbox_runtime::telemetry::TelemetryArgs;
use outbox_shared::store::{notify, topic};
use sqlx::PgConnection;
use sqlx::PgPool;

/// The `application_name` of the operator commands' sessions.
const APPLICATION: &str = "pubsub-outbox-operator";

/// The operator's commands.
#[derive(Debug, Clone, Subcommand)]
pub enum OpsCommand {
    /// Per topic: claimable now, held (paused or behind a dead letter), waiting, oldest due age,
    /// dead letters, paused; producer streams; replicas; warnings for what needs action.
    #[command(
        after_help = "Examples:\n  dispatcher status\n  dispatcher status --json | jq .warnings"
    )]
    Status(status::StatusArgs),
    /// Inspect, replay or discard dead letters.
    #[command(subcommand, name = "dead-letters")]
    DeadLetters(Box<dead_letters::DeadLettersCommand>),
    /// Messages not yet sent: list them, cancel them (to the dead-letter table, replayable), or
    /// make the ones waiting for a retry due now.
    #[command(subcommand)]
    Pending(Box<pending::PendingCommand>),
    /// Stop claiming a topic's messages (they accumulate; nothing is dead-lettered). In force
    /// when it returns: no claim takes the topic's rows from then on. Audited.
    #[command(
        after_help = "Examples:\n  dispatcher pause projects/billing-prod/topics/invoices --reason \"billing consumer down, INC-1234\"\n  \
                      dispatcher pause invoices --pubsub-project billing-prod --new-topic --reason \"before its first message\""
    )]
    Pause(pause::PauseArgs),
    /// Claim a paused topic's messages again (and wake the dispatchers). Audited.
    #[command(
        after_help = "Example:\n  dispatcher resume projects/billing-prod/topics/invoices --reason \"consumer fixed\""
    )]
    Resume(pause::ResumeArgs),
    /// The audit trail of operator actions, newest first.
    #[command(
        after_help = "Examples:\n  dispatcher audit\n  dispatcher audit --action replay --since 2026-12-01T00:00:00Z"
    )]
    Audit(audit::AuditArgs),
    /// The replicas' heartbeat rows.
    #[command(subcommand)]
    Replicas(replicas::ReplicasCommand),
}

/// The operator commands alone on a command line, as the console reads a page's request.
#[derive(Debug, clap::Parser)]
#[command(name = "dispatcher")]
struct OpsLine {
    #[command(subcommand)]
    op: OpsCommand,
}

impl OpsCommand {
    /// Parses `args` (the program name first, then the command and its flags) exactly as the
    /// CLI parses an operator command: the same flags, defaults and value checks.
    pub fn try_parse<I, T>(args: I) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        use clap::Parser;
        OpsLine::try_parse_from(args).map(|line| line.op)
    }

    /// The logging flags of the command.
    pub fn telemetry(&self) -> &TelemetryArgs {
        &self.common().telemetry
    }

    fn common(&self) -> &Common {
        self.op().common()
    }

    /// The command chosen.
    fn op(&self) -> &dyn Op {
        match self {
            Self::Status(a) => a,
            Self::DeadLetters(c) => c.op(),
            Self::Pending(c) => c.op(),
            Self::Pause(a) => a,
            Self::Resume(a) => a,
            Self::Audit(a) => a,
            Self::Replicas(c) => c.op(),
        }
    }

    /// Checks and runs the command on `pool` and returns its output without printing it (the
    /// console runs the commands this way: the same checks, statements and audit rows).
    pub async fn output(&self, pool: &PgPool) -> Result<Output, OpsError> {
        self.op().output(pool).await
    }

    /// Runs the command: checks its options, connects, prints the result (or the error, each
    /// cause once) and says how it ended.
    pub async fn run(&self) -> Exit {
        self.op().execute(APPLICATION).await
    }
}

/// An operator command as its group runs it, whatever it is: its common flags, its output on a
/// pool (the console), and its run (the CLI). Every command's options type is one: a plain
/// [`Command`] through [`plain!`], a change of the engine through [`change::Verb`].
pub(crate) trait Op: Send + Sync {
    /// The flags every command takes.
    fn common(&self) -> &Common;
    /// Checks and runs it on `pool`; returns its output without printing it.
    fn output<'a>(&'a self, pool: &'a PgPool) -> BoxFuture<'a, Result<Output, OpsError>>;
    /// Checks, connects, runs and prints it; says how it ended.
    fn execute<'a>(&'a self, application: &'a str) -> BoxFuture<'a, Exit>;
}

/// A boxed future of a command (the [`Op`]s of one group differ in type).
pub(crate) type BoxFuture<'a, T> =
    std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;

impl<V: change::Verb> Op for V {
    fn common(&self) -> &Common {
        V::common(self)
    }

    fn output<'a>(&'a self, pool: &'a PgPool) -> BoxFuture<'a, Result<Output, OpsError>> {
        Box::pin(async move { output_on(&change::Change(self.clone()), pool).await })
    }

    fn execute<'a>(&'a self, application: &'a str) -> BoxFuture<'a, Exit> {
        Box::pin(async move {
            execute(&change::Change(self.clone()), V::common(self), application).await
        })
    }
}

/// [`Op`] for plain commands (options with a `common` field that implement [`Command`]).
macro_rules! plain {
    ($($args:ty),* $(,)?) => {$(
        impl $crate::ops::Op for $args {
            fn common(&self) -> &outbox_runtime::operator::Common {
                &self.common
            }

            fn output<'a>(
                &'a self,
                pool: &'a sqlx::PgPool,
            ) -> $crate::ops::BoxFuture<
                'a,
                Result<outbox_runtime::operator::Output, outbox_runtime::operator::OpsError>,
            > {
                Box::pin(outbox_runtime::operator::output_on(self, pool))
            }

            fn execute<'a>(
                &'a self,
                application: &'a str,
            ) -> $crate::ops::BoxFuture<'a, outbox_runtime::operator::Exit> {
                Box::pin(outbox_runtime::operator::execute(self, &self.common, application))
            }
        }
    )*};
}
pub(crate) use plain;

/// A group of subcommands (`pending`, `dead-letters`, `replicas`): the enum clap parses, each
/// variant one command's options, and [`Op`] by each variant's own: a command joins its group
/// with its variant line alone.
macro_rules! group {
    (
        $(#[$meta:meta])*
        pub enum $name:ident {
            $( $(#[$vmeta:meta])* $variant:ident($args:ty), )*
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, clap::Subcommand)]
        pub enum $name {
            $( $(#[$vmeta])* $variant($args), )*
        }

        impl $name {
            /// The command chosen.
            pub(crate) fn op(&self) -> &dyn $crate::ops::Op {
                match self {
                    $( Self::$variant(a) => a, )*
                }
            }
        }
    };
}
pub(crate) use group;

plain!(
    StatusArgs,
    pause::PauseArgs,
    pause::ResumeArgs,
    audit::AuditArgs
);

/// A topic as the commands take it: a full name, or a short one with `--pubsub-project`.
#[derive(Debug, Clone, clap::Args)]
pub struct ProjectArg {
    /// Project for a short topic name.
    #[arg(long, env = "PUBSUB_PROJECT_ID", default_value = "")]
    pub pubsub_project: String,
}

impl ProjectArg {
    /// The full topic name for `given`, checked against Pub/Sub's resource-name rules.
    pub fn topic(&self, given: &str) -> Result<String, OpsError> {
        outbox_shared::resolve_topic(&self.pubsub_project, given)
            .map_err(|e| OpsError::Usage(format!("topic {e}")))
    }
}

/// What a command says of a valid topic name the database does not know.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unknown {
    /// Take it (a resume finds out itself; a pause with `--new-topic`).
    Allow,
    /// Refuse it (exit 2), adding this sentence on what to do when it is right after all.
    Refuse(&'static str),
}

/// What `pause` says of an unknown topic.
pub const PAUSE_A_NEW_TOPIC: &str = "for a topic with no message here yet (or none left: \
                                     published rows are deleted), add --new-topic";

/// The full name of `given`, which must be a valid topic name and, unless `unknown` allows it,
/// one an outbox row, a dead letter, a pause or a replica names. A refusal (exit 2) lists the
/// known topics near the name (compared as resolved, so a short name finds its full one): a typo
/// in a valid-looking name would otherwise change nothing, or match nothing, and exit 0.
pub async fn known_topic(
    conn: &mut PgConnection,
    project: &ProjectArg,
    given: &str,
    unknown: Unknown,
) -> Result<String, OpsError> {
    let (why, compared) = match project.topic(given) {
        Ok(name) if unknown == Unknown::Allow || topic::is_known(conn, &name).await? => {
            return Ok(name);
        }
        Ok(name) => (
            format!(
                "topic {name:?} is not known here: no outbox row, dead letter, pause, replica or \
                 audit entry names it"
            ),
            name,
        ),
        Err(e) => (e.to_string(), given.to_owned()),
    };
    let all = topic::all(conn).await?;
    let hint = match unknown {
        Unknown::Refuse(hint) if !hint.is_empty() => format!("; {hint}"),
        _ => String::new(),
    };
    Err(OpsError::Usage(format!(
        "{why} ({}). Check the name{hint}",
        did_you_mean(&compared, &all),
    )))
}

/// "did you mean …" for `given` among `known`, or what is known when nothing is close.
pub fn did_you_mean(given: &str, known: &[String]) -> String {
    let close = near(given, known.iter().map(String::as_str));
    match (close.is_empty(), known.is_empty()) {
        (false, _) => format!("did you mean {}?", close.join(" or ")),
        (true, true) => "no topic is known yet".to_owned(),
        (true, false) if known.len() <= 10 => format!("known: {}", known.join(", ")),
        (true, false) => format!(
            "{} topics are known; dispatcher status lists them",
            known.len()
        ),
    }
}

/// The channel the dispatchers LISTEN on: a change that makes rows claimable notifies it.
#[derive(Debug, Clone, clap::Args)]
pub struct Wake {
    /// The dispatchers' LISTEN channel (their --notify-channel), notified when a change makes
    /// rows claimable, so they claim at once instead of at their next poll.
    #[arg(long, env = "OUTBOX_NOTIFY_CHANNEL", default_value = notify::DEFAULT_CHANNEL)]
    pub notify_channel: String,
}
