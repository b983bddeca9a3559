//! What the operator commands of both binaries share: who is acting, the exit codes, and printing
//! an error once (each cause once, even when a message already quotes its source).

use std::process::ExitCode;

/// Exit codes of the operator commands (and of the binaries' start-up).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// Done.
    Ok,
    /// Something failed (the error says what to fix).
    Failed,
    /// Bad usage: an invalid flag, filter or configuration.
    Usage,
    /// The selection matched nothing.
    NothingMatched,
}

impl From<Exit> for ExitCode {
    fn from(e: Exit) -> Self {
        ExitCode::from(match e {
            Exit::Ok => 0,
            Exit::Failed => 1,
            Exit::Usage => 2,
            Exit::NothingMatched => 3,
        })
    }
}

/// Who performs an operator action: `--actor`, else `OUTBOX_ACTOR`, else the OS user.
pub fn actor(flag: Option<&str>) -> String {
    flag.map(str::to_owned)
        .filter(|a| !a.trim().is_empty())
        .or_else(|| {
            std::env::var("OUTBOX_ACTOR")
                .ok()
                .filter(|a| !a.trim().is_empty())
        })
        .or_else(|| std::env::var("USER").ok().filter(|a| !a.is_empty()))
        .or_else(|| std::env::var("LOGNAME").ok().filter(|a| !a.is_empty()))
        .unwrap_or_else(|| "unknown".to_owned())
}

/// An error and its causes as one line, each cause said once: a cause whose text the message
/// before it already contains is left out (typed errors often quote their source).
pub fn describe(error: &(dyn std::error::Error + 'static)) -> String {
    let mut out = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = cause.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("cannot connect to PostgreSQL: {0}. Check DATABASE_URL")]
    struct Outer(#[source] Inner);

    #[derive(Debug, thiserror::Error)]
    #[error("connection refused")]
    struct Inner;

    #[test]
    fn each_cause_is_said_once() {
        assert_eq!(
            describe(&Outer(Inner)),
            "cannot connect to PostgreSQL: connection refused. Check DATABASE_URL"
        );
        let chained = anyhow::Error::new(Outer(Inner)).context("running the dispatcher");
        assert_eq!(
            describe(chained.as_ref()),
            "running the dispatcher: cannot connect to PostgreSQL: connection refused. Check DATABASE_URL"
        );
    }

    #[test]
    fn the_actor_comes_from_the_flag_first() {
        assert_eq!(actor(Some("alice")), "alice");
        assert!(!actor(None).is_empty());
    }
}
