//! How the console runs what it shows and does: every query and change is an operator command
//! of this binary ([`crate::ops::OpsCommand`]), parsed from the CLI's own flags and run on the
//! console's pool; and the pieces every page's forms share (the CSRF field, the `--ordering-skip-dead-letters`
//! flag, a command line a person can copy).

use serde_json::Value;

use super::html::esc;
use super::state::Console;
use crate::ops::OpsCommand;

/// `args` as the CLI takes them, for a person to read (shell-quoted where needed).
pub(super) fn cli_line(args: &[String]) -> String {
    let quoted: Vec<String> = args
        .iter()
        .map(|a| {
            if !a.is_empty()
                && a.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_./:=,@".contains(c))
            {
                a.clone()
            } else {
                format!("'{}'", a.replace('\'', "'\\''"))
            }
        })
        .collect();
    format!("dispatcher {}", quoted.join(" "))
}

impl Console {
    /// Runs the operator command `args` (as after `dispatcher`) on the console's pool.
    pub(super) async fn command(
        &self,
        args: &[String],
    ) -> Result<outbox_runtime::operator::Output, String> {
        let mut argv: Vec<String> = vec!["dispatcher".into()];
        argv.extend(args.iter().cloned());
        // The command runs on the console's pool: the flag only satisfies the parser.
        argv.extend([
            "--database-url".into(),
            "postgres://console.invalid/".into(),
        ]);
        let op = OpsCommand::try_parse(argv).map_err(|e| {
            e.to_string()
                .lines()
                .find(|l| l.starts_with("error:"))
                .unwrap_or("the request's values were refused")
                .trim_start_matches("error: ")
                .to_owned()
        })?;
        op.output(&self.pool)
            .await
            .map_err(|e| outbox_runtime::operator::describe(&e))
    }

    /// Runs `args` and parses its JSON.
    pub(super) async fn json(&self, args: &[String]) -> Result<Value, String> {
        let out = self.command(args).await?;
        serde_json::from_str(&out.json).map_err(|e| format!("reading the command's JSON: {e}"))
    }

    pub(super) fn skip_flags(&self) -> Vec<String> {
        if self.skip_dead_letter_topics.is_empty() {
            Vec::new()
        } else {
            vec![
                "--ordering-skip-dead-letters".into(),
                self.skip_dead_letter_topics.join(","),
            ]
        }
    }

    /// A form's hidden CSRF field for `identity`.
    pub(super) fn csrf_field(&self, identity: &str) -> String {
        format!(
            "<input type=\"hidden\" name=\"csrf\" value=\"{}\">",
            esc(&self.csrf.token(identity))
        )
    }

    /// A "pause"/"resume" button for `topic`, leading to the preview.
    pub(super) fn topic_action(&self, identity: &str, action: &str, topic: &str) -> String {
        if !self.actions {
            return String::new();
        }
        format!(
            "<form class=\"inline\" method=\"post\" action=\"/actions/preview\">{}\
             <input type=\"hidden\" name=\"action\" value=\"{action}\">\
             <input type=\"hidden\" name=\"topic\" value=\"{}\">\
             <button type=\"submit\" name=\"go\" value=\"{action}\">{action}</button></form>",
            self.csrf_field(identity),
            esc(topic)
        )
    }
}
