//! `/`: the overview: per topic the queue (due, held, waiting, oldest due and claimable ages,
//! dead letters, pause/resume), the held topics, blocked keys, replicas and their releases,
//! producer streams, the warnings `status` gives and the last hour's plots.

use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use serde_json::Value;

use super::fields::{list, text};
use super::html::{Section, esc, page, problem, table, url};
use super::svg::chart;
use super::{Console, Who};

/// Seconds as a short duration (`3.2s`, `4m`, `2h`).
pub(super) fn age(seconds: f64) -> String {
    if seconds < 60.0 {
        format!("{seconds:.1}s")
    } else if seconds < 3600.0 {
        format!("{:.0}m", seconds / 60.0)
    } else {
        format!("{:.1}h", seconds / 3600.0)
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
                    if t.get("due_now").and_then(Value::as_i64).unwrap_or(0)
                        + t.get("held").and_then(Value::as_i64).unwrap_or(0)
                        == 0
                    {
                        "-".to_owned()
                    } else {
                        age(t
                            .get("oldest_due_age_seconds")
                            .and_then(Value::as_f64)
                            .unwrap_or(0.0))
                    },
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
