//! The console's pages. Every query and every action is an operator command of this binary,
//! parsed from the same flags the CLI takes and run through the same code
//! ([`crate::ops::OpsCommand::output`]): the same checks, statements and audit rows; a page
//! renders the command's JSON. A change is always previewed first (a dry run lists exactly
//! the ids it would touch), then confirmed with those ids, a reason and the CSRF token; the
//! audit row names the authenticated identity.

use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use serde_json::Value;

use super::fields::{Fields, list, text};
use super::filters::{DEAD_LETTER_FILTERS, PENDING_FILTERS, filter_flags, filter_form};
use super::html::{Section, esc, page, problem, table, url};
use super::svg::chart;
use super::{Change, Console, Who};
use crate::ops::OpsCommand;

/// Seconds as a short duration (`3.2s`, `4m`, `2h`).
fn age(seconds: f64) -> String {
    if seconds < 60.0 {
        format!("{seconds:.1}s")
    } else if seconds < 3600.0 {
        format!("{:.0}m", seconds / 60.0)
    } else {
        format!("{:.1}h", seconds / 3600.0)
    }
}

/// `args` as the CLI takes them, for a person to read (shell-quoted where needed).
fn cli_line(args: &[String]) -> String {
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
    fn topic_action(&self, identity: &str, action: &str, topic: &str) -> String {
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

/// `/`: queues per topic, blocked keys, replicas, streams, warnings, the last hour's plots.
pub async fn overview(State(c): State<Arc<Console>>, Who(who): Who) -> Response {
    let (status, age) = match c.status().await {
        Ok(s) => s,
        Err(e) => return problem(StatusCode::INTERNAL_SERVER_ERROR, &who, &e),
    };
    let mut body = format!(
        "<p class=\"as-of\">As of {:.0} s ago (read every {} s).</p>",
        age.as_secs_f64(),
        c.status_every().as_secs()
    );
    body.push_str(&warnings_section(&status));
    body.push_str(&c.topics_section(&status, &who));
    body.push_str(&held_section(&status));
    body.push_str(&super::blocked::section(&status));
    body.push_str(&replicas_section(&status));
    body.push_str(&streams_section(&status));
    body.push_str(&c.plots_section());
    if c.actions {
        body.push_str(&format!(
            "<fieldset><legend>Pause a topic</legend><form method=\"post\" action=\"/actions/preview\">{}\
             <input type=\"hidden\" name=\"action\" value=\"pause\">\
             <label>Topic <input type=\"text\" name=\"topic\"></label> \
             <label><input type=\"checkbox\" name=\"new_topic\" value=\"yes\"> a topic with no \
             message here yet</label> \
             <button type=\"submit\">Preview</button></form></fieldset>",
            c.csrf_field(&who)
        ));
    }
    page("Overview", &who, Section::Overview, Some(10), &body)
}

/// The warnings `status` gives.
fn warnings_section(status: &Value) -> String {
    let warnings = list(status, "warnings");
    let mut body = String::from("<section id=\"warnings\">");
    if warnings.is_empty() {
        body.push_str("<p class=\"ok\">No warnings.</p>");
    }
    for w in warnings {
        body.push_str(&format!(
            "<p class=\"warn\">{}</p>",
            esc(w.as_str().unwrap_or(""))
        ));
    }
    body.push_str("</section>");
    body
}

impl Console {
    /// Per topic: the queue, the oldest claimable age (the last sample's), the dead letters
    /// and pause/resume.
    fn topics_section(&self, status: &Value, who: &str) -> String {
        let claimable: HashMap<String, f64> = self
            .samples
            .all()
            .last()
            .map(|s| s.topics.iter().map(|(t, _, a)| (t.clone(), *a)).collect())
            .unwrap_or_default();
        section(
            status,
            "topics",
            ("Topics", "topics"),
            &[
                "Topic",
                "Due",
                "Held",
                "Waiting",
                "Oldest due",
                "Oldest claimable",
                "Dead (perm/exh/rej/canc)",
                "Paused",
            ],
            |t| {
                let name = text(t, "topic");
                let paused = t.get("paused").and_then(Value::as_bool).unwrap_or(false);
                let refused = t.get("refused").and_then(Value::as_bool).unwrap_or(false);
                vec![
                    esc(&name),
                    text(t, "due_now"),
                    text(t, "held"),
                    text(t, "waiting"),
                    age(t
                        .get("oldest_due_age_seconds")
                        .and_then(Value::as_f64)
                        .unwrap_or(0.0)),
                    // The last sample's (the status has no such figure); nothing due, none.
                    claimable
                        .get(&name)
                        .filter(|_| t.get("due_now").and_then(Value::as_i64).unwrap_or(0) > 0)
                        .map_or("-".to_owned(), |a| age(*a)),
                    format!(
                        "<a href=\"/dead-letters?topic={}\">{}/{}/{}/{}</a>",
                        url(&name),
                        text(t, "dead_permanent"),
                        text(t, "dead_exhausted"),
                        text(t, "dead_rejected"),
                        text(t, "dead_cancelled")
                    ),
                    match (paused, refused) {
                        (true, _) => format!("paused {}", self.topic_action(who, "resume", &name)),
                        (false, true) => format!(
                            "<a href=\"#held\">held: Pub/Sub refuses it</a> {}",
                            self.topic_action(who, "pause", &name)
                        ),
                        (false, false) => self.topic_action(who, "pause", &name),
                    },
                ]
            },
        )
    }

    /// The last hour's plots from the console's own samples.
    fn plots_section(&self) -> String {
        let plots = self.samples.series(chrono::Utc::now(), 8);
        let span = super::samples::SPAN.as_secs_f64();
        let mut body = String::from("<h2>The last hour</h2><div class=\"plots\">");
        body.push_str(&chart(
            "plot-backlog",
            "Backlog per topic",
            "rows",
            span,
            &plots.backlog,
        ));
        body.push_str(&chart(
            "plot-claimable-age",
            "Oldest claimable message per topic",
            "s",
            span,
            &plots.claimable_age,
        ));
        body.push_str(&chart(
            "plot-published",
            "Published",
            "msg/s",
            span,
            &plots.published,
        ));
        body.push_str(&chart(
            "plot-dead-letters",
            "Dead-lettered",
            "msg/s",
            span,
            &plots.dead_letters,
        ));
        body.push_str("</div>");
        body
    }
}

/// The topics Pub/Sub refuses as a whole: held, released by themselves once a probe is accepted.
fn held_section(status: &Value) -> String {
    if list(status, "held_topics").is_empty() {
        return String::new();
    }
    let mut body = section(
        status,
        "held_topics",
        ("Held topics: Pub/Sub refuses them", "held"),
        &[
            "Topic",
            "Code",
            "Pub/Sub said",
            "Held since",
            "Waiting",
            "Refusals",
            "Next probe",
        ],
        |h| {
            vec![
                esc(&text(h, "topic")),
                esc(&text(h, "code")),
                esc(&text(h, "message")),
                esc(&text(h, "held_since")),
                text(h, "waiting"),
                text(h, "refusals"),
                esc(&text(h, "next_probe_at")),
            ]
        },
    );
    body.push_str(
        "<p>Their messages wait untouched: no attempt is charged, nothing is dead-lettered, every \
         key keeps its order. A probe (a publish of the topic's head message) releases a topic \
         by itself once Pub/Sub accepts it. The runbook: docs/operating.md, \"A topic is held\".</p>",
    );
    body
}

/// A titled table of `status`'s array `key`, a row per entry.
fn section(
    status: &Value,
    key: &str,
    (title, id): (&str, &str),
    head: &[&str],
    row: impl Fn(&Value) -> Vec<String>,
) -> String {
    let rows: Vec<Vec<String>> = list(status, key).iter().map(row).collect();
    format!("<h2>{title}</h2>{}", table(id, head, &rows))
}

/// The dispatcher replicas' heartbeats, and the releases they run (two during a rollout).
fn replicas_section(status: &Value) -> String {
    let releases: Vec<String> = list(status, "releases")
        .iter()
        .map(|r| format!("{} on {}", text(r, "replicas"), esc(&text(r, "version"))))
        .collect();
    let summary = if releases.is_empty() {
        String::new()
    } else {
        format!(
            "<p id=\"releases\">Releases: {} (live replicas)</p>",
            releases.join(", ")
        )
    };
    let table = section(
        status,
        "replicas",
        ("Dispatcher replicas", "replicas"),
        &[
            "Replica",
            "Release",
            "Host",
            "Heartbeat age",
            "Breaker",
            "In flight (batches/rows)",
            "State",
        ],
        |r| {
            let alive = r.get("alive").and_then(Value::as_bool).unwrap_or(false);
            let open = r
                .get("breaker_open")
                .and_then(Value::as_bool)
                .unwrap_or(false);
            let heartbeat = r.get("heartbeat_age_seconds").and_then(Value::as_f64);
            vec![
                esc(&text(r, "replica_id")),
                esc(&text(r, "version")),
                esc(&text(r, "hostname")),
                age(heartbeat.unwrap_or(0.0)),
                if open { "open" } else { "closed" }.to_owned(),
                format!(
                    "{}/{}",
                    text(r, "batches_in_flight"),
                    text(r, "rows_in_flight")
                ),
                if alive { "alive" } else { "gone" }.to_owned(),
            ]
        },
    );
    format!("{table}{summary}")
}

/// The producer's streams: watermark, lag, last run.
fn streams_section(status: &Value) -> String {
    section(
        status,
        "streams",
        ("Producer streams", "streams"),
        &[
            "Stream",
            "Watermark",
            "Lag",
            "Last run",
            "Outcome",
            "Enqueued",
        ],
        |s| {
            vec![
                esc(&text(s, "stream")),
                esc(&text(s, "watermark_at")),
                s.get("lag_seconds")
                    .and_then(Value::as_f64)
                    .map_or("-".into(), age),
                esc(&text(s, "last_run_started_at")),
                esc(&text(s, "last_run_outcome")),
                text(s, "last_run_enqueued"),
            ]
        },
    )
}

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
        body.push_str(&c.list_action_form(&who, &q));
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

    /// Replay or discard of the ticked entries or of the whole filter `q`.
    fn list_action_form(&self, who: &str, q: &Fields) -> String {
        self.act_form(
            who,
            q,
            DEAD_LETTER_FILTERS,
            "entries",
            &[("replay", "Replay…"), ("discard", "Discard…")],
        )
    }

    /// A list's actions: `buttons` (action, label) on the ticked `items` or on every one the
    /// filter `q` (of `filters`) matches, posted to the preview.
    pub(super) fn act_form(
        &self,
        who: &str,
        q: &Fields,
        filters: &[(&str, &str)],
        items: &str,
        buttons: &[(&str, &str)],
    ) -> String {
        let hidden: String = filters
            .iter()
            .map(|(f, _)| *f)
            .chain(["waiting"])
            .filter_map(|f| {
                q.get(f)
                    .map(|v| format!("<input type=\"hidden\" name=\"{f}\" value=\"{}\">", esc(v)))
            })
            .collect();
        let buttons: Vec<String> = buttons
            .iter()
            .map(|(action, label)| {
                format!(
                    "<button type=\"submit\" name=\"action\" value=\"{action}\">{label}</button>"
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

/// `/audit`: the audit trail, filtered by action, actor and time.
pub async fn audit(
    State(c): State<Arc<Console>>,
    Who(who): Who,
    Query(q): Query<Fields>,
) -> Response {
    let mut args = vec!["audit".into(), "--limit".into(), "200".into()];
    for (field, flag) in [
        ("action", "--action"),
        ("actor", "--actor"),
        ("since", "--since"),
    ] {
        if let Some(v) = q.get(field).map(|v| v.trim()).filter(|v| !v.is_empty()) {
            args.extend([flag.to_owned(), v.to_owned()]);
        }
    }
    let entries = match c.json(&args).await {
        Ok(Value::Array(a)) => a,
        Ok(_) => Vec::new(),
        Err(e) => return problem(StatusCode::BAD_REQUEST, &who, &e),
    };
    let inputs: String = ["action", "actor", "since"]
        .iter()
        .map(|f| {
            format!(
                "<label>{f} <input type=\"text\" name=\"{f}\" value=\"{}\"></label> ",
                esc(q.get(*f).map_or("", String::as_str))
            )
        })
        .collect();
    let rows: Vec<Vec<String>> = entries
        .iter()
        .map(|e| {
            vec![
                text(e, "id"),
                esc(&text(e, "at")),
                esc(&text(e, "actor")),
                esc(&text(e, "db_user")),
                esc(&text(e, "action")),
                text(e, "row_count"),
                esc(&e.get("selector").map_or("-".into(), Value::to_string)),
                esc(&text(e, "reason")),
            ]
        })
        .collect();
    let body = format!(
        "<form method=\"get\" action=\"/audit\">{inputs}<button type=\"submit\">Filter</button></form>{}",
        table(
            "audit",
            &[
                "Id",
                "At",
                "Actor",
                "Database login",
                "Action",
                "Rows",
                "Selector",
                "Reason"
            ],
            &rows
        )
    );
    page("Audit trail", &who, Section::Audit, None, &body)
}

/// The change a preview or an apply carries: the command's flags without its confirmation.
fn change_args(f: &Fields, ids: &[String], who: &str) -> Result<(String, Vec<String>), String> {
    let action = f.get("action").map(String::as_str).unwrap_or("");
    let reason = f.get("reason").cloned().unwrap_or_default();
    let mut args: Vec<String> = match action {
        "replay" | "discard" | "cancel" | "retry-now" => {
            let (group, filters) = match action {
                "replay" | "discard" => ("dead-letters", DEAD_LETTER_FILTERS),
                _ => ("pending", PENDING_FILTERS),
            };
            let mut a = vec![group.to_owned(), action.to_owned()];
            if f.get("scope").map(String::as_str) == Some("filter") {
                a.extend(filter_flags(f, filters));
                if group == "pending" && f.get("waiting").is_some_and(|v| v == "yes") {
                    a.push("--waiting".into());
                }
            } else if ids.is_empty() {
                return Err("tick at least one entry, or choose the whole filter".into());
            } else {
                a.extend(ids.iter().cloned());
            }
            a
        }
        "pause" | "resume" => {
            let topic = f.get("topic").map(|t| t.trim()).filter(|t| !t.is_empty());
            let Some(topic) = topic else {
                return Err("name the topic".into());
            };
            let mut a = vec![action.to_owned(), topic.to_owned()];
            if action == "pause" && f.get("new_topic").is_some_and(|v| v == "yes") {
                a.push("--new-topic".into());
            }
            a
        }
        other => return Err(format!("unknown action {other:?}")),
    };
    args.extend(["--reason".into(), reason, "--actor".into(), who.to_owned()]);
    Ok((action.to_owned(), args))
}

/// `POST /actions/preview`: what a change would do (a dry run lists exactly the ids), with the
/// form that confirms it.
pub async fn preview(State(c): State<Arc<Console>>, change: Change) -> Response {
    let Change {
        who,
        fields: f,
        ids,
    } = change;
    let reason = f.get("reason").cloned().unwrap_or_default();
    let (action, args) = match change_args(&f, &ids, &who) {
        Ok(a) => a,
        Err(e) => return problem(StatusCode::BAD_REQUEST, &who, &e),
    };
    let topic = f.get("topic").map_or("", String::as_str);
    let (mut body, confirm_ids) = match c.dry_run_change(&action, &args).await {
        Ok(Some(r)) => r,
        Ok(None) => return problem(StatusCode::NOT_FOUND, &who, nothing_to_do(&action)),
        Err(e) => return problem(StatusCode::BAD_REQUEST, &who, &e),
    };
    let by_filter = f.get("scope").map(String::as_str) == Some("filter");
    body.push_str(&command_line(&args, &reason, by_filter));
    let by_ids = matches!(
        action.as_str(),
        "replay" | "discard" | "cancel" | "retry-now"
    );
    if by_ids && confirm_ids.is_empty() {
        // Every selected entry would be left in place: nothing to confirm.
        body.push_str("<p><a href=\"/\">Overview</a></p>");
    } else {
        body.push_str(&c.confirm_form(&who, &action, topic, &reason, &args, &confirm_ids));
    }
    page(
        &format!("Preview: {action}"),
        &who,
        Section::Overview,
        None,
        &body,
    )
}

/// Why a preview whose dry run matched nothing has nothing to confirm.
fn nothing_to_do(action: &str) -> &'static str {
    match action {
        "pause" => "the topic is paused already: nothing to do",
        "resume" => "the topic is not paused: nothing to do",
        "cancel" => "no unpublished message matches: nothing to do",
        "retry-now" => "no message waiting for a retry matches: nothing to do",
        _ => "no dead letter matches: nothing to do",
    }
}

/// The preview's "the same from the command line" paragraph: the change's `args` with the
/// reason given (`…` while there is none), and `--yes` when it covers a whole filter.
fn command_line(args: &[String], reason: &str, by_filter: bool) -> String {
    let mut cli = args.to_vec();
    set_flag(
        &mut cli,
        "--reason",
        if reason.trim().is_empty() {
            "…"
        } else {
            reason
        },
    );
    if by_filter {
        cli.push("--yes".into());
    }
    format!(
        "<p>The same from the command line: <code>{}</code></p>",
        esc(&cli_line(&cli))
    )
}

/// Sets the value after `flag` in `args`, where it is.
fn set_flag(args: &mut [String], flag: &str, value: &str) {
    if let Some(v) = args
        .iter()
        .position(|a| a == flag)
        .and_then(|i| args.get_mut(i + 1))
    {
        value.clone_into(v);
    }
}

impl Console {
    /// The JSON of the change `args` made as a dry run (made, then rolled back).
    pub(super) async fn dry_json(&self, args: &[String]) -> Result<Value, String> {
        let mut dry = args.to_vec();
        dry.push("--dry-run".into());
        self.json(&dry).await
    }

    /// A replay's or a discard's dry run: what it would touch (exactly the ids) as HTML, and
    /// the ids; `None` when nothing matches.
    async fn dry_run(
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
        let (ids, skipped) = (ids_of("ids"), ids_of("skipped"));
        if ids.is_empty() && skipped.is_empty() {
            return Ok(None);
        }
        let mut body = format!(
            "<p>{action} <strong id=\"count\">{}</strong> dead letter(s): \
             <span id=\"ids\">{}</span></p>",
            ids.len(),
            esc(&ids.join(" "))
        );
        if !skipped.is_empty() {
            body.push_str(&format!(
                "<p class=\"warn\" id=\"skipped\">{} would be left in place ({}): their dedupe key is in \
                 the outbox again (the message was written again, or its published copy is \
                 retained), so a replay cannot bring them back and the key they block stays \
                 blocked. Discard them to release it.</p>",
                skipped.len(),
                esc(&skipped.join(" "))
            ));
        }
        if let Some(refused) = report
            .get("refused_locally")
            .and_then(Value::as_array)
            .filter(|a| !a.is_empty())
        {
            body.push_str(&format!(
                "<p class=\"warn\">{} of them were refused by the dispatcher itself: replayed, they are \
                 dead-lettered again.</p>",
                refused.len()
            ));
        }
        Ok(Some((body, ids)))
    }

    /// A pause's or a resume's dry run: what it would do as HTML; `None` when it would change
    /// nothing (paused already, or not paused).
    async fn dry_run_topic(
        &self,
        action: &str,
        args: &[String],
    ) -> Result<Option<(String, Vec<String>)>, String> {
        let report = self.dry_json(args).await?;
        if !report
            .get("changed")
            .and_then(Value::as_bool)
            .unwrap_or(false)
        {
            return Ok(None);
        }
        let body = format!(
            "<p>{action} topic <strong id=\"topic\">{}</strong>{}.</p>",
            esc(&text(&report, "topic")),
            if action == "pause" {
                ": no claim takes its messages until it is resumed; they accumulate"
            } else {
                ": its messages are claimed again at once"
            }
        );
        Ok(Some((body, Vec::new())))
    }

    /// A change's dry run, by its action: what it would do as HTML and the ids to confirm;
    /// `None` when it would change nothing. Every change is previewed by its dry run: the same
    /// checks (a topic the database does not know, ids that are gone) refuse it here, not at the
    /// confirmation.
    async fn dry_run_change(
        &self,
        action: &str,
        args: &[String],
    ) -> Result<Option<(String, Vec<String>)>, String> {
        match action {
            "replay" | "discard" => self.dry_run(action, args).await,
            "cancel" | "retry-now" => self.dry_run_pending(action, args).await,
            _ => self.dry_run_topic(action, args).await,
        }
    }

    /// The form that confirms a previewed change: its action, exactly the previewed ids, its
    /// topic (and whether it is new), the reason (required, audited) and `who`'s CSRF token.
    fn confirm_form(
        &self,
        who: &str,
        action: &str,
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
            esc(action),
            esc(topic),
            esc(reason),
            esc(action)
        )
    }
}

/// `POST /actions/apply`: the confirmed change (by the previewed ids), audited with the identity.
pub async fn apply(State(c): State<Arc<Console>>, change: Change) -> Response {
    let Change {
        who,
        fields: f,
        ids,
    } = change;
    let (action, args) = match change_args(&f, &ids, &who) {
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
                esc(&action),
                esc(&who),
                esc(&out.text)
            );
            page(
                &format!("Done: {action}"),
                &who,
                Section::Overview,
                None,
                &body,
            )
        }
        Err(e) => problem(StatusCode::BAD_REQUEST, &who, &e),
    }
}
