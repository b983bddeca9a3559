//! Streams file parsing and validation: every error names the stream and the field.

use super::*;

const GOOD: &str = r#"
[[stream]]
name = "orders"
query = "SELECT id, UNIX_MICROS(ts) AS ts_micros FROM t WHERE UNIX_MICROS(ts) > @watermark_ts OR (UNIX_MICROS(ts) = @watermark_ts AND id > @watermark_key) ORDER BY ts_micros, id"
location = "EU"
maximum_bytes_billed = 1000000000
lookback = "15m"
dedupe_key = ["id", "ts_micros"]
topic = "orders"
ordering_key_column = "customer_id"

[stream.cursor]
timestamp_column = "ts_micros"
key_column = "id"
key_type = "INT64"

[stream.attributes]
columns = { status = "status" }
fixed = { source = "bigquery" }

[stream.payload]
columns = ["id", "status"]

[[stream]]
name = "audit"
query = "SELECT … @watermark_ts … @watermark_key"
dedupe_key = ["event_id"]
topic_column = "topic"
cursor = { timestamp_column = "at", key_column = "event_id", key_type = "STRING" }
payload = { raw_column = "body" }
"#;

fn options() -> LoadOptions {
    LoadOptions {
        pubsub_project: "test-project".into(),
        dedupe_attribute: "dedupe_key".into(),
    }
}

fn problems(text: &str) -> Vec<String> {
    StreamsConfig::parse(text, "streams.toml", &options())
        .expect_err("invalid config")
        .problems
}

#[test]
fn a_valid_file_loads_every_stream_sorted_by_name() {
    let c = StreamsConfig::parse(GOOD, "streams.toml", &options()).expect("valid");
    let names: Vec<&str> = c.streams.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["audit", "orders"]);
    let orders = &c.streams[1];
    assert_eq!(
        orders.topic,
        TopicSpec::Fixed("projects/test-project/topics/orders".into())
    );
    assert_eq!(orders.lookback, Some(Duration::from_secs(900)));
    assert_eq!(orders.maximum_bytes_billed, Some(1_000_000_000));
    assert_eq!(orders.cursor.key_type, KeyType::Int64);
    assert_eq!(
        orders.fixed_attributes.get("source").map(String::as_str),
        Some("bigquery")
    );
    let audit = &c.streams[0];
    assert_eq!(audit.topic, TopicSpec::Column("topic".into()));
    assert_eq!(audit.payload, PayloadSpec::Raw("body".into()));
    assert_eq!(audit.cursor.key_type, KeyType::String);
}

#[test]
fn unknown_and_missing_fields_name_the_stream() {
    let text = GOOD.replace("topic = \"orders\"", "topik = \"orders\"");
    let p = problems(&text);
    assert!(
        p.iter()
            .any(|m| m.starts_with("stream 'orders':") && m.contains("topik")),
        "{p:?}"
    );

    let text = GOOD.replace("query = \"SELECT … @watermark_ts … @watermark_key\"\n", "");
    let p = problems(&text);
    assert!(
        p.iter()
            .any(|m| m.starts_with("stream 'audit':") && m.contains("query")),
        "{p:?}"
    );
}

#[test]
fn semantic_problems_are_all_reported_with_stream_and_field() {
    let text = GOOD
        .replace("lookback = \"15m\"", "lookback = \"soon\"")
        .replace(
            "maximum_bytes_billed = 1000000000",
            "maximum_bytes_billed = 0",
        )
        .replace(
            "fixed = { source = \"bigquery\" }",
            "fixed = { dedupe_key = \"x\" }",
        )
        .replace(
            "payload = { raw_column = \"body\" }",
            "payload = { raw_column = \"body\", columns = [\"a\"] }",
        )
        .replace(
            "topic_column = \"topic\"",
            "topic_column = \"topic\"\ntopic = \"t\"",
        );
    let p = problems(&text);
    for (stream, field) in [
        ("orders", "lookback"),
        ("orders", "maximum_bytes_billed"),
        ("orders", "attributes"),
        ("audit", "payload"),
        ("audit", "topic"),
    ] {
        assert!(
            p.iter()
                .any(|m| m.starts_with(&format!("stream '{stream}': {field}:"))),
            "no {stream}/{field} in {p:?}"
        );
    }
}

#[test]
fn queries_must_use_both_watermark_parameters() {
    let text = GOOD.replace("SELECT … @watermark_ts … @watermark_key", "SELECT * FROM t");
    let p = problems(&text);
    assert!(
        p.iter()
            .any(|m| m.contains("stream 'audit': query:") && m.contains("@watermark_ts")),
        "{p:?}"
    );
}

#[test]
fn short_topics_need_a_pubsub_project() {
    let err = StreamsConfig::parse(GOOD, "streams.toml", &LoadOptions::default())
        .expect_err("no project");
    assert!(
        err.problems
            .iter()
            .any(|m| m.starts_with("stream 'orders': topic:") && m.contains("--pubsub-project")),
        "{err}"
    );
}

#[test]
fn duplicate_names_and_empty_files_are_refused() {
    let text = format!(
        "{GOOD}\n{}",
        GOOD.split("[[stream]]")
            .nth(2)
            .map(|s| format!("[[stream]]{s}"))
            .unwrap_or_default()
    );
    let p = problems(&text);
    assert!(
        p.iter()
            .any(|m| m.contains("stream 'audit': name: another stream has the same name")),
        "{p:?}"
    );
    assert!(problems("").iter().any(|m| m.contains("no streams")));
}

#[test]
fn a_syntax_error_names_the_stream_it_is_in() {
    let text = GOOD.replace("key_type = \"INT64\"", "key_type = INT64");
    let err = StreamsConfig::parse(&text, "streams.toml", &options()).expect_err("syntax error");
    let message = err.to_string();
    assert!(
        message.contains("streams.toml") && message.contains("stream 'orders' (line"),
        "{message}"
    );
}

#[test]
fn an_unsupported_key_type_is_named() {
    let text = GOOD.replace("key_type = \"STRING\"", "key_type = \"BYTES\"");
    let p = problems(&text);
    assert!(
        p.iter()
            .any(|m| m.starts_with("stream 'audit':") && m.contains("BYTES")),
        "{p:?}"
    );
}

#[test]
fn the_sample_streams_file_is_valid() {
    let text = include_str!("../../../examples/streams.toml");
    let c = StreamsConfig::parse(text, "examples/streams.toml", &options())
        .expect("examples/streams.toml is valid");
    let names: Vec<&str> = c.streams.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["order_events", "orders"]);
}

#[test]
fn commit_modes_and_their_guards_are_checked() {
    let with = |extra: &str| {
        GOOD.replacen(
            "lookback = \"15m\"",
            &format!("lookback = \"15m\"\n{extra}"),
            1,
        )
    };
    let config = StreamsConfig::parse(
        &with("commit = \"run\"\nmax_run_rows = 500"),
        "t",
        &options(),
    )
    .expect("valid");
    let orders = config
        .streams
        .iter()
        .find(|s| s.name == "orders")
        .expect("orders");
    assert_eq!(
        orders.commit,
        Commit::Run {
            max_rows: 500,
            max_bytes: DEFAULT_MAX_RUN_BYTES
        }
    );
    let audit = config
        .streams
        .iter()
        .find(|s| s.name == "audit")
        .expect("audit");
    assert_eq!(audit.commit, Commit::Page, "page is the default");
    for (extra, wanted) in [
        ("commit = \"whole\"", "commit: \"whole\" is not"),
        ("max_run_rows = 10", "apply only with commit = \"run\""),
        (
            "commit = \"run\"\nmax_run_bytes = 0",
            "max_run_bytes: must be a positive number",
        ),
    ] {
        let found = problems(&with(extra));
        assert!(
            found
                .iter()
                .any(|p| p.contains("orders") && p.contains(wanted)),
            "{extra}: {found:?}"
        );
    }
}
