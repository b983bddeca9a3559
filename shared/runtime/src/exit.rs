//! The binaries' one rule for ending: exit codes (0 ok, 1 failed at run time, 2 configuration or
//! usage, 3 an operator selection matched nothing, 130 a second signal), and a failure printed
//! once, each cause once, in the log format the process was told to use.

use std::process::ExitCode;

use crate::telemetry::LogFormat;

/// Exit codes of both binaries, their commands and their start-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// Done.
    Ok,
    /// Something failed at run time (the error says what; retrying may help).
    Failed,
    /// Bad usage or configuration: an invalid flag, filter or setting, a database, role,
    /// privilege or endpoint that is set up wrong. Retrying cannot help; the message says the fix.
    Usage,
    /// The selection matched nothing.
    NothingMatched,
}

impl Exit {
    /// The process exit code.
    pub fn code(self) -> u8 {
        match self {
            Exit::Ok => 0,
            Exit::Failed => 1,
            Exit::Usage => 2,
            Exit::NothingMatched => 3,
        }
    }
}

impl From<Exit> for ExitCode {
    fn from(e: Exit) -> Self {
        ExitCode::from(e.code())
    }
}

/// An error that can end a binary: it knows whether it is a configuration error.
pub trait Failure: std::error::Error + 'static {
    /// Whether the configuration is wrong, so that retrying cannot help (exit 2).
    fn is_configuration(&self) -> bool;

    /// The exit code for this failure.
    fn exit(&self) -> Exit {
        if self.is_configuration() {
            Exit::Usage
        } else {
            Exit::Failed
        }
    }
}

impl Failure for outbox_shared::Error {
    fn is_configuration(&self) -> bool {
        outbox_shared::Error::is_configuration(self)
    }
}

/// Reports a failure that ends the process, once: in JSON mode one JSON log line (what Cloud
/// Logging reads; nothing else is printed), in text mode one `error: …` line on stderr. `what`
/// says what failed, e.g. "The dispatcher failed". Returns the exit code.
pub fn fail(format: LogFormat, what: &str, error: &dyn Failure) -> Exit {
    report(format, what, &describe(error), error.exit())
}

/// Reports `message` (an error already described, each cause once) as [`fail`] does, ending
/// with `exit`: the one way both binaries and every command say their last word.
pub fn report(format: LogFormat, what: &str, message: &str, exit: Exit) -> Exit {
    match format {
        LogFormat::Json => {
            tracing::error!(error = message, exit_code = exit.code(), "{what}.");
        }
        LogFormat::Text => {
            // A closed stderr is ignored (there is nowhere left to say it).
            let _ = std::io::Write::write_all(
                &mut std::io::stderr().lock(),
                format!("error: {message}\n").as_bytes(),
            );
        }
    }
    exit
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

impl Failure for crate::traces::TracesError {
    fn is_configuration(&self) -> bool {
        true
    }
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
}
