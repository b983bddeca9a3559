//! `/dead-letters`: the filterable, paged list, one entry with its safe preview and the key it
//! holds back, and (with actions) replay or discard of the ticked entries, the whole filter, or
//! one entry.

use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use serde_json::Value;

use super::fields::{Fields, text};
use super::filters::{DEAD_LETTER_FILTERS, filter_flags, filter_form};
use super::html::{Section, esc, page, problem, table, url};
use super::{Console, Who};
use crate::ops::change::{VERBS, VerbInfo};

/// `/dead-letters`: the filterable, paged list; with actions, replay or discard of the ticked
/// entries or of the whole filter.
pub async fn dead_letters(
    State(c): State<Arc<Console>>,
    Who(who): Who,
    Query(q): Query<Fields>,
) -> Response {
    let mut args = vec![
        "dead-letters".into(),
        "list".into(),
        "--limit".into(),
        "50".into(),
    ];
    args.extend(filter_flags(&q, DEAD_LETTER_FILTERS));
    if let Some(before) = q.get("before_id").filter(|v| !v.is_empty()) {
        args.extend(["--before-id".into(), before.clone()]);
    }
    let entries = match c.json(&args).await {
        Ok(Value::Array(a)) => a,
        Ok(_) => Vec::new(),
        Err(e) => return problem(StatusCode::BAD_REQUEST, &who, &e),
    };
    let mut body = filter_form("/dead-letters", DEAD_LETTER_FILTERS, &q, "");
    body.push_str(&c.dead_letter_rows(&entries));
    if let Some(last) = entries.last().map(|e| text(e, "id")) {
        let mut more: Vec<String> = DEAD_LETTER_FILTERS
            .iter()
            .filter_map(|(f, _)| q.get(*f).map(|v| format!("{f}={}", url(v))))
            .collect();
        more.push(format!("before_id={}", url(&last)));
        body.push_str(&format!(
            "<p><a id=\"older\" href=\"/dead-letters?{}\">Older entries</a></p>",
            more.join("&amp;")
        ));
    }
    if c.actions {
        body.push_str(&c.act_form(&who, &q, "dead-letters"));
    }
    page("Dead letters", &who, Section::DeadLetters, None, &body)
}

impl Console {
    /// The dead-letter list's table (a tick box per entry with actions).
    fn dead_letter_rows(&self, entries: &[Value]) -> String {
        let rows: Vec<Vec<String>> = entries
            .iter()
            .map(|e| {
                let id = text(e, "id");
                let mut row = Vec::new();
                if self.actions {
                    row.push(format!(
                        "<input type=\"checkbox\" name=\"id\" value=\"{}\" form=\"act\">",
                        esc(&id)
                    ));
                }
                row.extend([
                    format!("<a href=\"/dead-letters/{0}\">{0}</a>", esc(&id)),
                    esc(&text(e, "failed_at")),
                    esc(&text(e, "error_kind")),
                    esc(&text(e, "topic")),
                    esc(&text(e, "ordering_key")),
                    esc(&text(e, "dedupe_key")),
                    text(e, "attempts"),
                    esc(&text(e, "last_error").chars().take(120).collect::<String>()),
                ]);
                row
            })
            .collect();
        let mut head = if self.actions { vec![""] } else { Vec::new() };
        head.extend([
            "Id",
            "Failed at",
            "Kind",
            "Topic",
            "Ordering key",
            "Dedupe key",
            "Attempts",
            "Error",
        ]);
        table("dead-letters", &head, &rows)
    }

    /// A list's actions: the change verbs of `group` on the ticked items or on every one the
    /// filter `q` matches, posted to the preview.
    pub(super) fn act_form(&self, who: &str, q: &Fields, group: &str) -> String {
        let verbs: Vec<&VerbInfo> = VERBS.iter().filter(|v| v.group == group).collect();
        let (filters, items) = verbs
            .first()
            .map_or((&[][..], "items"), |v| (v.filters, v.rows));
        let hidden: String = filters
            .iter()
            .map(|(f, _)| *f)
            .chain(["waiting"])
            .filter_map(|f| {
                q.get(f)
                    .map(|v| format!("<input type=\"hidden\" name=\"{f}\" value=\"{}\">", esc(v)))
            })
            .collect();
        let buttons: Vec<String> = verbs
            .iter()
            .map(|v| {
                format!(
                    "<button type=\"submit\" name=\"action\" value=\"{}\">{}</button>",
                    v.action.as_str(),
                    v.label
                )
            })
            .collect();
        format!(
            "<fieldset><legend>Act on the ticked {items}, or on every one the filter matches</legend>\
             <form id=\"act\" method=\"post\" action=\"/actions/preview\">{}{hidden}\
             <label><input type=\"radio\" name=\"scope\" value=\"ids\" checked> ticked {items}</label> \
             <label><input type=\"radio\" name=\"scope\" value=\"filter\"> the whole filter</label><br>\
             {}</form></fieldset>",
            self.csrf_field(who),
            buttons.join(" ")
        )
    }
}

/// `/dead-letters/{id}`: one entry with the safe preview, and the key it holds back.
pub async fn dead_letter(
    State(c): State<Arc<Console>>,
    Who(who): Who,
    Path(id): Path<i64>,
) -> Response {
    let e = match c
        .json(&["dead-letters".into(), "show".into(), id.to_string()])
        .await
    {
        Ok(v) => v,
        Err(e) => return problem(StatusCode::NOT_FOUND, &who, &e),
    };
    let topic = text(&e, "topic");
    let key = e.get("ordering_key").and_then(Value::as_str);
    let outbox_id = e.get("outbox_id").and_then(Value::as_i64);
    let refused =
        text(&e, "last_error").starts_with(outbox_shared::store::dead_letter::REFUSED_LOCALLY);
    let mut body = entry_table(&e);
    if let Some(key) = key {
        body.push_str(&c.holds(&topic, key, outbox_id).await);
    }
    if refused {
        body.push_str(
            "<p class=\"warn\">The dispatcher refused this message itself (a limit check, before \
             sending): a replay dead-letters it again. Discard it, or fix it at the source.</p>",
        );
    }
    if c.actions {
        body.push_str(&format!(
            "<fieldset><legend>Act on this entry</legend>\
             <form id=\"act\" method=\"post\" action=\"/actions/preview\">{}\
             <input type=\"hidden\" name=\"scope\" value=\"ids\">\
             <input type=\"hidden\" name=\"id\" value=\"{id}\">\
             <button type=\"submit\" name=\"action\" value=\"replay\" id=\"replay\">Replay…</button> \
             <button type=\"submit\" name=\"action\" value=\"discard\" id=\"discard\">Discard…</button>\
             </form></fieldset>",
            c.csrf_field(&who)
        ));
    }
    page(
        &format!("Dead letter {id}"),
        &who,
        Section::DeadLetters,
        None,
        &body,
    )
}

/// A dead letter's fields and its safe preview (escaped; binary not shown).
fn entry_table(e: &Value) -> String {
    let fields = [
        ("Id", text(e, "id")),
        ("Topic", text(e, "topic")),
        ("Ordering key", text(e, "ordering_key")),
        ("Dedupe key", text(e, "dedupe_key")),
        ("Outbox id", text(e, "outbox_id")),
        ("Source", text(e, "source")),
        ("Enqueued at", text(e, "created_at")),
        ("Failed at", text(e, "failed_at")),
        ("Attempts", text(e, "attempts")),
        ("Error kind", text(e, "error_kind")),
        ("Error", text(e, "last_error")),
        (
            "Attributes",
            e.get("attributes").map_or("{}".into(), Value::to_string),
        ),
        ("Payload", format!("{} bytes", text(e, "payload_bytes"))),
    ];
    let rows: Vec<Vec<String>> = fields
        .iter()
        .map(|(k, v)| vec![(*k).to_owned(), esc(v)])
        .collect();
    let mut body = table("dead-letter", &["", ""], &rows);
    body.push_str(&format!(
        "<h2>Preview</h2><pre id=\"preview\">{}</pre>",
        e.get("payload_preview")
            .and_then(Value::as_str)
            .map_or("(binary: not shown)".to_owned(), esc)
    ));
    body
}

impl Console {
    /// What the dead letter of `topic`'s `key` at `outbox_id` holds back.
    async fn holds(&self, topic: &str, key: &str, outbox_id: Option<i64>) -> String {
        let skips = self.skip_dead_letter_topics.iter().any(|t| t == topic);
        let held = match self.held_behind(topic, key, outbox_id).await {
            Ok(n) => n.to_string(),
            Err(e) => format!("unknown ({e})"),
        };
        format!(
            "<p id=\"holds\">{}</p>",
            if skips {
                format!(
                    "Its topic skips dead letters: ordering key <code>{}</code> flows on.",
                    esc(key)
                )
            } else {
                format!(
                    "It holds back ordering key <code>{}</code>: <strong id=\"held\">{held}</strong> \
                     message(s) wait behind it until it is replayed or discarded.",
                    esc(key)
                )
            }
        )
    }
}
