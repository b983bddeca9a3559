//! Blocked ordering keys in the console: the overview sums them up per topic (however many an
//! incident blocks: a keyed topic whose Pub/Sub topic vanished blocks every key it has), and
//! `/blocked-keys` pages through one topic's keys (`dispatcher dead-letters blocked`).

use std::sync::Arc;

use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use serde_json::Value;

use super::fields::{Fields, list, text};
use super::html::{Section, esc, page, problem, table, url};
use super::{Console, Who};

/// Keys of a topic the overview names (the rest are a click away).
const FIRST_KEYS: usize = 5;

/// Keys per page of `/blocked-keys`.
const PAGE: usize = 100;

/// The overview's section: per topic, how many keys are blocked, the messages behind them, the
/// first few keys with their dead letters, and a link to all of them.
pub(super) fn section(status: &Value) -> String {
    let listed = list(status, "blocked_keys");
    let rows: Vec<Vec<String>> = list(status, "blocked_topics")
        .iter()
        .map(|t| {
            let topic = text(t, "topic");
            let first: Vec<String> = listed
                .iter()
                .filter(|k| text(k, "topic") == topic)
                .take(FIRST_KEYS)
                .map(|k| {
                    format!(
                        "<code>{}</code> (<a class=\"dead-letter\" href=\"/dead-letters/{1}\">{1}</a>)",
                        esc(&text(k, "ordering_key")),
                        esc(&text(k, "dead_letter_id"))
                    )
                })
                .collect();
            vec![
                esc(&topic),
                text(t, "keys"),
                text(t, "waiting"),
                first.join(", "),
                format!(
                    "<a class=\"all-blocked\" href=\"/blocked-keys?topic={}\">all {} →</a>",
                    url(&topic),
                    text(t, "keys")
                ),
            ]
        })
        .collect();
    format!(
        "<h2>Blocked ordering keys</h2>{}",
        table(
            "blocked-keys",
            &[
                "Topic",
                "Keys",
                "Waiting behind them",
                "First keys (dead letter)",
                ""
            ],
            &rows
        )
    )
}

/// `/blocked-keys?topic=T[&after=K]`: a page of the topic's blocked keys, each with its dead
/// letter and the messages waiting behind it.
pub async fn keys_page(
    State(c): State<Arc<Console>>,
    Who(who): Who,
    Query(q): Query<Fields>,
) -> Response {
    let Some(topic) = q.get("topic").map(|t| t.trim()).filter(|t| !t.is_empty()) else {
        return problem(StatusCode::BAD_REQUEST, &who, "name the topic (?topic=…)");
    };
    let mut args = vec![
        "dead-letters".into(),
        "blocked".into(),
        "--topic".into(),
        topic.to_owned(),
        "--limit".into(),
        PAGE.to_string(),
    ];
    if let Some(after) = q.get("after").filter(|a| !a.is_empty()) {
        args.extend(["--after-key".into(), after.clone()]);
    }
    args.extend(c.skip_flags());
    let keys = match c.json(&args).await {
        Ok(Value::Array(a)) => a,
        Ok(_) => Vec::new(),
        Err(e) => return problem(StatusCode::BAD_REQUEST, &who, &e),
    };
    let rows: Vec<Vec<String>> = keys
        .iter()
        .map(|k| {
            vec![
                format!("<code>{}</code>", esc(&text(k, "ordering_key"))),
                format!(
                    "<a class=\"dead-letter\" href=\"/dead-letters/{0}\">{0}</a>",
                    esc(&text(k, "dead_letter_id"))
                ),
                text(k, "waiting"),
            ]
        })
        .collect();
    let mut body = format!(
        "<p>Ordering keys of <strong id=\"topic\">{}</strong> held back by a dead letter: each \
         flows again once its dead letter is replayed or discarded (<a href=\"/dead-letters?topic={}\">\
         its dead letters</a>, where the whole filter can be acted on at once).</p>{}",
        esc(topic),
        url(topic),
        table(
            "blocked-keys",
            &["Ordering key", "Dead letter", "Waiting behind it"],
            &rows
        )
    );
    if keys.len() == PAGE
        && let Some(last) = keys.last()
    {
        body.push_str(&format!(
            "<p><a id=\"next\" href=\"/blocked-keys?topic={}&amp;after={}\">Next {PAGE}</a></p>",
            url(topic),
            url(&text(last, "ordering_key"))
        ));
    }
    page(
        "Blocked ordering keys",
        &who,
        Section::Overview,
        None,
        &body,
    )
}
