//! What a command prints, and printing it without ever panicking: `dispatcher status | head -1`
//! closes the pipe after one line, which `println!` turns into a panic (exit 101). Here a closed
//! pipe ends the output quietly with the command's own exit code: the reader had what it wanted.

use std::io::Write;

use serde::Serialize;

use super::{Exit, OpsError};

/// What a command prints: a text for people, a JSON document for scripts, notes for stderr (in
/// both modes: warnings and partial failures a script must not parse as data), and its exit code.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Output {
    /// The human form (tables, sentences), ending in a newline.
    pub text: String,
    /// The JSON form (pretty, fields in their documented order), ending in a newline.
    pub json: String,
    /// Whole lines for stderr (`warning: …`, `error: …`).
    pub notes: Vec<String>,
    /// How it ended.
    pub exit: Exit,
}

impl Output {
    /// An output of `text` and `value` as JSON, ending with `exit`.
    pub fn new(text: String, value: &impl Serialize, exit: Exit) -> Result<Self, OpsError> {
        let mut json = serde_json::to_string_pretty(value).map_err(OpsError::Encode)?;
        json.push('\n');
        Ok(Self {
            text,
            json,
            notes: Vec::new(),
            exit,
        })
    }

    /// Adds a line for stderr (e.g. `warning: …`, `error: …`).
    pub fn note(mut self, line: String) -> Self {
        self.notes.push(line);
        self
    }

    /// Prints the text (or the JSON) to stdout and the notes to stderr; returns the exit code.
    /// A closed stdout (a pipe whose reader is gone) is not a failure; any other write error is.
    pub fn print(&self, json: bool) -> Exit {
        let body = if json { &self.json } else { &self.text };
        let written = {
            let mut out = std::io::stdout().lock();
            out.write_all(body.as_bytes()).and_then(|()| out.flush())
        };
        for note in &self.notes {
            error_line(note);
        }
        match written {
            Ok(()) => self.exit,
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => self.exit,
            Err(e) => {
                error_line(&format!("error: writing the output failed: {e}"));
                Exit::Failed
            }
        }
    }
}

/// Writes one line to stderr; a closed stderr is ignored (there is nowhere left to say it).
pub(super) fn error_line(line: &str) {
    let _ = std::io::stderr()
        .lock()
        .write_all(format!("{line}\n").as_bytes());
}
