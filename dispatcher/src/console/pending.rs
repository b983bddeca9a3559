//! Messages not yet sent in the console: `/pending` lists them (`dispatcher pending list`), a
//! filter and a page at a time, and, with actions, cancels them or makes the waiting ones due now
//! (`pending cancel` / `pending retry-now`), previewed by the command's dry run and confirmed like
//! every change (`pages::preview`, `pages::apply`).

use std::sync::Arc;

use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use serde_json::Value;

use super::fields::{Fields, text};
use super::filters::{PENDING_FILTERS, filter_flags, filter_form};
use super::html::{Section, esc, page, problem, table, url};
use super::{Console, Who};

/// `/pending`: the filterable, paged list; with actions, cancel or retry-now of the ticked
/// messages or of the whole filter.
pub async fn page_of(
    State(c): State<Arc<Console>>,
    Who(who): Who,
    Query(q): Query<Fields>,
) -> Response {
    let mut args = vec![
        "pending".into(),
        "list".into(),
        "--limit".into(),
        "50".into(),
    ];
    args.extend(filter_flags(&q, PENDING_FILTERS));
    let waiting = q.get("waiting").is_some_and(|v| v == "yes");
    if waiting {
        args.push("--waiting".into());
    }
    if let Some(after) = q.get("after_id").filter(|v| !v.is_empty()) {
        args.extend(["--after-id".into(), after.clone()]);
    }
    let rows = match c.json(&args).await {
        Ok(Value::Array(a)) => a,
        Ok(_) => Vec::new(),
        Err(e) => return problem(StatusCode::BAD_REQUEST, &who, &e),
    };
    let waiting_box = format!(
        "<label><input type=\"checkbox\" name=\"waiting\" value=\"yes\"{}> waiting for a retry \
         only</label> ",
        if waiting { " checked" } else { "" }
    );
    let mut body = filter_form("/pending", PENDING_FILTERS, &q, &waiting_box);
    body.push_str(&c.pending_rows(&rows));
    if rows.len() == 50
        && let Some(last) = rows.last().map(|r| text(r, "id"))
    {
        let mut more: Vec<String> = PENDING_FILTERS
            .iter()
            .filter_map(|(f, _)| q.get(*f).map(|v| format!("{f}={}", url(v))))
            .collect();
        if waiting {
            more.push("waiting=yes".into());
        }
        more.push(format!("after_id={}", url(&last)));
        body.push_str(&format!(
            "<p><a id=\"newer\" href=\"/pending?{}\">Next page</a></p>",
            more.join("&amp;")
        ));
    }
    if c.actions {
        body.push_str(&c.act_form(
            &who,
            &q,
            PENDING_FILTERS,
            "messages",
            &[("retry-now", "Retry now…"), ("cancel", "Cancel…")],
        ));
    }
    page("Pending messages", &who, Section::Pending, None, &body)
}

impl Console {
    /// The pending list's table (a tick box per message with actions).
    fn pending_rows(&self, rows: &[Value]) -> String {
        let body: Vec<Vec<String>> = rows
            .iter()
            .map(|r| {
                let id = text(r, "id");
                let mut row = Vec::new();
                if self.actions {
                    row.push(format!(
                        "<input type=\"checkbox\" name=\"id\" value=\"{}\" form=\"act\">",
                        esc(&id)
                    ));
                }
                row.extend([
                    esc(&id),
                    esc(&text(r, "topic")),
                    esc(&text(r, "ordering_key")),
                    esc(&text(r, "dedupe_key")),
                    esc(&text(r, "created_at")),
                    text(r, "attempts"),
                    esc(&text(r, "next_attempt_at")),
                    esc(&text(r, "last_error").chars().take(120).collect::<String>()),
                ]);
                row
            })
            .collect();
        let mut head = if self.actions { vec![""] } else { Vec::new() };
        head.extend([
            "Id",
            "Topic",
            "Ordering key",
            "Dedupe key",
            "Enqueued",
            "Attempts",
            "Next attempt",
            "Last error",
        ]);
        table("pending", &head, &body)
    }

    /// A cancel's or a retry-now's dry run: what it would change (exactly the ids), what it
    /// leaves, and what each key it touches then does, as HTML; `None` when nothing matches.
    pub(super) async fn dry_run_pending(
        &self,
        action: &str,
        args: &[String],
    ) -> Result<Option<(String, Vec<String>)>, String> {
        let report = self.dry_json(args).await?;
        let ids_of = |field: &str| -> Vec<String> {
            report
                .get(field)
                .and_then(Value::as_array)
                .map(|a| a.iter().map(|v| v.to_string()).collect())
                .unwrap_or_default()
        };
        let (ids, in_flight) = (ids_of("ids"), ids_of("in_flight"));
        if ids.is_empty() && in_flight.is_empty() {
            return Ok(None);
        }
        let what = if action == "cancel" {
            "to the dead-letter table as cancelled (replayable; they block nothing)"
        } else {
            "due now, their attempts unchanged"
        };
        let mut body = format!(
            "<p>{action} <strong id=\"count\">{}</strong> message(s), {what}: \
             <span id=\"ids\">{}</span></p>",
            ids.len(),
            esc(&ids.join(" "))
        );
        if !in_flight.is_empty() {
            body.push_str(&format!(
                "<p class=\"warn\">{} are being published right now and would be left alone: {}</p>",
                in_flight.len(),
                esc(&in_flight.join(" "))
            ));
        }
        let keys: Vec<String> = report
            .get("keys")
            .and_then(Value::as_array)
            .map(|keys| {
                keys.iter()
                    .map(|k| {
                        let blocked = k.get("blocked").and_then(Value::as_bool).unwrap_or(false);
                        format!(
                            "<li><code>{}</code> of {}: {} message(s) wait{}</li>",
                            esc(&text(k, "ordering_key")),
                            esc(&text(k, "topic")),
                            text(k, "waiting"),
                            if blocked {
                                ", still blocked by a dead letter of its own"
                            } else {
                                " and go on at once"
                            }
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        if !keys.is_empty() {
            body.push_str(&format!(
                "<p>The ordering keys it touches, as it leaves them:</p><ul id=\"keys\">{}</ul>",
                keys.join("")
            ));
        }
        Ok(Some((body, ids)))
    }
}
