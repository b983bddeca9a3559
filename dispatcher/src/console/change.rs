//! `POST /actions/preview` and `POST /actions/apply`: every change the console makes, previewed
//! by the command's own dry run (the change made and rolled back: it lists exactly the ids the
//! change takes, in the CLI's words), then confirmed with exactly those ids, a reason and the
//! CSRF token; the audit row names the authenticated identity.
//!
//! An action is a type ([`Act`]): pause, resume, or one of the change engine's verbs
//! ([`crate::ops::change::VERBS`]); a form naming anything else is refused.

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use outbox_shared::store::audit::Action;
use serde_json::Value;

use super::commands::cli_line;
use super::fields::{Fields, text};
use super::filters::filter_flags;
use super::html::{Section, esc, page, problem};
use super::{Change, Console};
use crate::ops::change::{VerbInfo, report::summary, verb};

/// What a console form asks for.
#[derive(Debug, Clone, Copy)]
pub enum Act {
    /// Stop claiming a topic.
    Pause,
    /// Claim a paused topic again.
    Resume,
    /// A change of the engine (replay, discard, cancel, retry-now).
    Change(&'static VerbInfo),
}

impl Act {
    /// The action a form's `action` field names.
    pub fn parse(name: &str) -> Result<Self, String> {
        match Action::parse(name) {
            Some(Action::Pause) => Ok(Self::Pause),
            Some(Action::Resume) => Ok(Self::Resume),
            Some(action) => verb(action).map(Self::Change).ok_or_else(|| {
                format!("{name:?} is not an action of the console (it is the command line's)")
            }),
            None => Err(format!("unknown action {name:?}")),
        }
    }

    /// Its name, as the audit records it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Pause => Action::Pause.as_str(),
            Self::Resume => Action::Resume.as_str(),
            Self::Change(v) => v.action.as_str(),
        }
    }

    /// The command's flags for the form `f` and its ticked `ids`, without the confirmation.
    fn args(self, f: &Fields, ids: &[String], who: &str) -> Result<Vec<String>, String> {
        let mut args = match self {
            Self::Change(v) => {
                let mut a = vec![v.group.to_owned(), v.action.as_str().to_owned()];
                if f.get("scope").map(String::as_str) == Some("filter") {
                    a.extend(filter_flags(f, v.filters));
                    if v.group == "pending" && f.get("waiting").is_some_and(|w| w == "yes") {
                        a.push("--waiting".into());
                    }
                } else if ids.is_empty() {
                    return Err("tick at least one entry, or choose the whole filter".into());
                } else {
                    a.extend(ids.iter().cloned());
                }
                a
            }
            Self::Pause | Self::Resume => {
                let topic = f.get("topic").map(|t| t.trim()).filter(|t| !t.is_empty());
                let Some(topic) = topic else {
                    return Err("name the topic".into());
                };
                let mut a = vec![self.name().to_owned(), topic.to_owned()];
                if matches!(self, Self::Pause) && f.get("new_topic").is_some_and(|v| v == "yes") {
                    a.push("--new-topic".into());
                }
                a
            }
        };
        let reason = f.get("reason").cloned().unwrap_or_default();
        args.extend(["--reason".into(), reason, "--actor".into(), who.to_owned()]);
        Ok(args)
    }

    /// What a preview that matches nothing says.
    fn nothing(self) -> &'static str {
        match self {
            Self::Pause => "the topic is paused already: nothing to do",
            Self::Resume => "the topic is not paused: nothing to do",
            Self::Change(v) => v.nothing,
        }
    }
}

/// The action and flags of a change form.
fn parse(f: &Fields, ids: &[String], who: &str) -> Result<(Act, Vec<String>), String> {
    let act = Act::parse(f.get("action").map_or("", String::as_str))?;
    Ok((act, act.args(f, ids, who)?))
}

/// `POST /actions/preview`: what a change would do (its dry run), with the form that confirms
/// it.
pub async fn preview(State(c): State<Arc<Console>>, change: Change) -> Response {
    let Change {
        who,
        fields: f,
        ids,
    } = change;
    let reason = f.get("reason").cloned().unwrap_or_default();
    let (act, args) = match parse(&f, &ids, &who) {
        Ok(a) => a,
        Err(e) => return problem(StatusCode::BAD_REQUEST, &who, &e),
    };
    let dry = match c.dry_run(act, &args).await {
        Ok(Some(d)) => d,
        Ok(None) => return problem(StatusCode::NOT_FOUND, &who, act.nothing()),
        Err(e) => return problem(StatusCode::BAD_REQUEST, &who, &e),
    };
    let by_filter = f.get("scope").map(String::as_str) == Some("filter");
    let mut body = dry.html;
    body.push_str(&command_line(&args, &reason, by_filter));
    if matches!(act, Act::Change(_)) && dry.ids.is_empty() {
        // Every selected entry would be left in place: nothing to confirm.
        body.push_str("<p><a href=\"/\">Overview</a></p>");
    } else {
        let topic = f.get("topic").map_or("", String::as_str);
        body.push_str(&c.confirm_form(&who, act, topic, &reason, &args, &dry.ids));
    }
    page(
        &format!("Preview: {}", act.name()),
        &who,
        Section::Overview,
        None,
        &body,
    )
}

/// A change's dry run as a preview shows it.
struct Dry {
    /// What it would do, as HTML.
    html: String,
    /// The ids to confirm (none for pause and resume).
    ids: Vec<String>,
}

impl Console {
    /// A change's dry run: what it would do and the ids to confirm; `None` when it would change
    /// nothing. The same checks as the change (a topic the database does not know, ids that are
    /// gone) refuse it here, not at the confirmation.
    async fn dry_run(&self, act: Act, args: &[String]) -> Result<Option<Dry>, String> {
        let mut dry = args.to_vec();
        dry.push("--dry-run".into());
        let out = self.command(&dry).await?;
        let report: Value =
            serde_json::from_str(&out.json).map_err(|e| format!("reading the dry run: {e}"))?;
        let Act::Change(verb) = act else {
            if !report
                .get("changed")
                .and_then(Value::as_bool)
                .unwrap_or(false)
            {
                return Ok(None);
            }
            let html = format!(
                "<p>{} topic <strong id=\"topic\">{}</strong>{}.</p>",
                act.name(),
                esc(&text(&report, "topic")),
                if matches!(act, Act::Pause) {
                    ": no claim takes its messages until it is resumed; they accumulate"
                } else {
                    ": its messages are claimed again at once"
                }
            );
            return Ok(Some(Dry {
                html,
                ids: Vec::new(),
            }));
        };
        let ids: Vec<i64> = report
            .get("ids")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_i64).collect())
            .unwrap_or_default();
        if ids.is_empty() && out.exit == outbox_runtime::operator::Exit::NothingMatched {
            return Ok(None);
        }
        let notes: String = out
            .notes
            .iter()
            .map(|n| format!("<p class=\"warn\">{}</p>", esc(n)))
            .collect();
        let html = format!(
            "<p>{} <strong id=\"count\">{}</strong> {}: <span id=\"ids\">{}</span></p>\
             <pre id=\"report\">{}</pre>{notes}",
            verb.action.as_str(),
            ids.len(),
            verb.rows,
            esc(&summary(&ids)),
            esc(&out.text)
        );
        Ok(Some(Dry {
            html,
            ids: ids.iter().map(i64::to_string).collect(),
        }))
    }

    /// The form that confirms a previewed change: its action, exactly the previewed ids, its
    /// topic (and whether it is new), the reason (required, audited) and `who`'s CSRF token.
    fn confirm_form(
        &self,
        who: &str,
        act: Act,
        topic: &str,
        reason: &str,
        args: &[String],
        confirm_ids: &[String],
    ) -> String {
        let new_topic = if args.iter().any(|a| a == "--new-topic") {
            "<input type=\"hidden\" name=\"new_topic\" value=\"yes\">"
        } else {
            ""
        };
        let hidden_ids: String = confirm_ids
            .iter()
            .map(|id| format!("<input type=\"hidden\" name=\"id\" value=\"{}\">", esc(id)))
            .collect();
        format!(
            "<form method=\"post\" action=\"/actions/apply\" id=\"confirm\">{}\
             <input type=\"hidden\" name=\"action\" value=\"{}\">\
             <input type=\"hidden\" name=\"scope\" value=\"ids\">{hidden_ids}\
             <input type=\"hidden\" name=\"topic\" value=\"{}\">{new_topic}\
             <label>Reason (required, audited) <input type=\"text\" name=\"reason\" id=\"reason\" value=\"{}\" required></label> \
             <button type=\"submit\" id=\"apply\">Confirm: {}</button> <a href=\"/\">Cancel</a></form>",
            self.csrf_field(who),
            act.name(),
            esc(topic),
            esc(reason),
            act.name()
        )
    }
}

/// The preview's "the same from the command line" paragraph: the change's `args` with the
/// reason given (`…` while there is none), and `--yes` when it covers a whole filter.
fn command_line(args: &[String], reason: &str, by_filter: bool) -> String {
    let mut cli = args.to_vec();
    if let Some(v) = cli
        .iter()
        .position(|a| a == "--reason")
        .and_then(|i| cli.get_mut(i + 1))
    {
        *v = if reason.trim().is_empty() {
            "…".to_owned()
        } else {
            reason.to_owned()
        };
    }
    if by_filter {
        cli.push("--yes".into());
    }
    format!(
        "<p>The same from the command line: <code>{}</code></p>",
        esc(&cli_line(&cli))
    )
}

/// `POST /actions/apply`: the confirmed change (by the previewed ids), audited with the identity.
pub async fn apply(State(c): State<Arc<Console>>, change: Change) -> Response {
    let Change {
        who,
        fields: f,
        ids,
    } = change;
    let (act, args) = match parse(&f, &ids, &who) {
        Ok(a) => a,
        Err(e) => return problem(StatusCode::BAD_REQUEST, &who, &e),
    };
    match c.command(&args).await {
        Ok(out) => {
            c.forget_status();
            let notes: String = out
                .notes
                .iter()
                .map(|n| format!("<p class=\"warn\">{}</p>", esc(n)))
                .collect();
            let body = format!(
                "<p class=\"ok\" id=\"done\">{} done, audited as {}.</p><pre id=\"result\">{}</pre>{notes}\
                 <p><a href=\"/audit\">The audit trail</a> · <a href=\"/\">Overview</a></p>",
                act.name(),
                esc(&who),
                esc(&out.text)
            );
            page(
                &format!("Done: {}", act.name()),
                &who,
                Section::Overview,
                None,
                &body,
            )
        }
        Err(e) => problem(StatusCode::BAD_REQUEST, &who, &e),
    }
}
