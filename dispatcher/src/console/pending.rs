//! Messages not yet sent in the console: `/pending` lists them (`dispatcher pending list`), a
//! filter and a page at a time, and, with actions, cancels them or makes the waiting ones due now
//! (`pending cancel` / `pending retry-now`), previewed by the command's dry run and confirmed like
//! every change (`change::preview`, `change::apply`).

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
        body.push_str(&c.act_form(&who, &q, "pending"));
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
                    esc(&text(r, "due_at")),
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
            "Due (after its key's head, if later)",
            "Last error",
        ]);
        table("pending", &head, &body)
    }
}
