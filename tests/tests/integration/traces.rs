//! One trace from the writer to the consumer (docs/tracing.md), followed through a stand-in OTLP
//! receiver: a row written with a known `traceparent` is published by the real `dispatcher`
//! binary in a `send` span that is the writer's child, the message carries that span as
//! `googclient_traceparent`, and the inbox's handler span is the send span's child; the same
//! for what a real `producer run` enqueues. A row without a context sends no trace attribute, a
//! malformed one is ignored with one warning and the message still goes out, and JSON log lines
//! inside a traced batch carry Cloud Logging's trace fields (none with tracing off).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use harness::db::TestDb;
use harness::fixtures::{enqueue, message};
use harness::otlp::{OtlpReceiver, ReceivedSpan};
use harness::process::{Process, Spawn};
use harness::pubsub::{self, TestTopic};
use harness::wait::drained;
use outbox_inbox::Inbox;
use outbox_inbox::pubsub::{ConsumeOptions, consume};
use outbox_runtime::traces::{TraceArgs, Traces};
use outbox_shared::trace::{TRACEPARENT_ATTRIBUTE, TRACESTATE_ATTRIBUTE, TraceParent};
use outbox_shared::{NewMessage, TraceContext};
use sqlx::PgConnection;
use tracing::instrument::WithSubscriber as _;
use tracing_subscriber::layer::SubscriberExt as _;

const WRITER: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
const WRITER_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const WRITER_SPAN: &str = "00f067aa0ba902b7";
const UNSAMPLED: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00";
const CONSUMER: &str = "traced-consumer";

/// The dispatcher binary over the test database, its logs in JSON, tracing to `receiver`
/// when given.
fn dispatcher(db: &TestDb, receiver: Option<&OtlpReceiver>) -> Process {
    let mut args = vec![
        "run".to_owned(),
        "--listen-addr".to_owned(),
        "127.0.0.1:0".to_owned(),
        "--poll-interval".to_owned(),
        "50ms".to_owned(),
        "--max-poll-interval".to_owned(),
        "200ms".to_owned(),
        "--log-format".to_owned(),
        "json".to_owned(),
    ];
    if let Some(receiver) = receiver {
        args.extend([
            "--trace-endpoint".to_owned(),
            receiver.endpoint(),
            "--trace-sample-ratio".to_owned(),
            "1".to_owned(),
            "--trace-project".to_owned(),
            "trace-project".to_owned(),
        ]);
    }
    Spawn::binary("dispatcher")
        .args(args)
        .env("DATABASE_URL", db.url())
        .env_remove_all(&["OUTBOX_TRACE_ENDPOINT", "OUTBOX_LOG_FORMAT"])
        .start()
        .expect("start the dispatcher")
}

/// A consumer database: the outbox's schema and the inbox's.
async fn consumer_db() -> TestDb {
    let db = TestDb::new().await;
    outbox_inbox::migrate(&db.pool)
        .await
        .expect("the inbox schema applies");
    db
}

/// Runs the inbox's `consume` over `topic` until idle, in a subscriber that exports its spans to
/// `receiver` (as a consuming application with tracing on); returns each message's attributes
/// and id by dedupe key.
async fn consume_traced(
    db: &TestDb,
    topic: &TestTopic,
    receiver: &OtlpReceiver,
) -> HashMap<String, (HashMap<String, String>, String)> {
    let args = TraceArgs {
        trace_endpoint: Some(receiver.endpoint()),
        trace_sample_ratio: 1.0,
        trace_project: None,
    };
    let traces = Traces::start(&args, "inbox-test")
        .await
        .expect("the test's trace pipeline");
    let tracer = traces.tracer("inbox-test").expect("tracing is on");
    let subscriber =
        tracing_subscriber::registry().with(tracing_opentelemetry::layer().with_tracer(tracer));
    let inbox = Inbox::new(db.pool.clone());
    let options = ConsumeOptions {
        lanes: 2,
        stop_when_idle: Some(Duration::from_secs(3)),
        ..ConsumeOptions::new(CONSUMER)
    };
    let seen = Mutex::new(HashMap::new());
    let handler = async |m: &google_cloud_pubsub::model::Message, _tx: &mut PgConnection| {
        let attributes: HashMap<String, String> = m
            .attributes
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let key = attributes.get("dedupe_key").cloned().unwrap_or_default();
        seen.lock()
            .expect("seen")
            .insert(key, (attributes, m.message_id.clone()));
        Ok::<(), String>(())
    };
    let stream = pubsub::stream(&topic.subscription).await;
    consume(&inbox, stream, &options, handler, std::future::pending())
        .with_subscriber(subscriber)
        .await
        .expect("the stream stays healthy");
    traces.shutdown().await;
    seen.into_inner().expect("seen")
}

fn traced(topic: &str, dedupe: &str, key: &str, traceparent: &str) -> NewMessage {
    message(topic, dedupe, &[])
        .with_ordering_key(key)
        .with_trace_context(TraceContext::new(traceparent).with_tracestate("congo=t61rcWkgMzE"))
}

/// The JSON log lines of `process` whose message contains `text`.
fn log_lines(process: &Process, text: &str) -> Vec<serde_json::Value> {
    process
        .log()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|l| l["message"].as_str().is_some_and(|m| m.contains(text)))
        .collect()
}

fn span_of<'a>(spans: &'a [ReceivedSpan], id: &str) -> &'a ReceivedSpan {
    spans
        .iter()
        .find(|s| s.span_id == id)
        .unwrap_or_else(|| panic!("no span {id} among {spans:#?}"))
}

/// The dispatcher's send span of the message Pub/Sub numbered `message_id`, checked against
/// the messaging conventions; with its batch's publish step linked, and that step's batch.
async fn send_span(receiver: &OtlpReceiver, topic: &TestTopic, message_id: &str) -> ReceivedSpan {
    let send = receiver
        .wait_for("send with the message id", |s| {
            s.service == "pubsub-outbox-dispatcher"
                && s.attr("messaging.message.id") == Some(message_id)
        })
        .await;
    let topic_id = topic.topic.rsplit('/').next().expect("a topic id");
    assert_eq!(send.service, "pubsub-outbox-dispatcher");
    assert_eq!(send.name, format!("send {topic_id}"));
    assert_eq!(send.kind, 4, "a producer span");
    assert_eq!(send.attr("messaging.system"), Some("gcp_pubsub"));
    assert_eq!(send.attr("messaging.operation.type"), Some("send"));
    assert_eq!(send.attr("messaging.destination.name"), Some(topic_id));
    assert!(
        send.attr("messaging.batch.message_count")
            .and_then(|n| n.parse::<u32>().ok())
            .is_some_and(|n| n >= 1),
        "{send:?}"
    );
    let (_, publish_id) = send
        .links
        .first()
        .expect("linked to its batch's publish step");
    let spans = receiver.spans();
    let publish = span_of(&spans, publish_id);
    assert_eq!(publish.name, "publish");
    let batch = span_of(&spans, &publish.parent_span_id);
    assert_eq!(batch.name, "run_batch");
    for step in ["claim", "settle"] {
        assert!(
            spans
                .iter()
                .any(|s| s.name == step && s.parent_span_id == batch.span_id),
            "the batch's {step} step is its child"
        );
    }
    send
}

#[tokio::test]
async fn a_writers_trace_runs_through_the_send_span_to_the_inbox_handler() {
    let db = consumer_db().await;
    let topic = TestTopic::new(true).await;
    let receiver = OtlpReceiver::start(true).await;
    let t = &topic.topic;
    let rows = vec![
        traced(t, "traced", "k1", WRITER),
        message(t, "plain", &[]).with_ordering_key("k1"),
        message(t, "malformed", &[]).with_trace_context(TraceContext::new("00-not-a-traceparent")),
        traced(t, "unsampled", "k2", UNSAMPLED),
    ];
    enqueue(&db.pool, &rows).await;
    let mut d = dispatcher(&db, Some(&receiver));
    d.bound_addr(Duration::from_secs(30))
        .await
        .expect("the dispatcher serves its endpoints");
    drained(&db.pool, Duration::from_secs(60)).await;
    let seen = consume_traced(&db, &topic, &receiver).await;
    assert_eq!(seen.len(), 4, "every message arrived: {seen:?}");

    // The traced row: its own send span, in the writer's trace, and the writer's tracestate.
    let (attributes, message_id) = &seen["traced"];
    let carried = TraceParent::parse(&attributes[TRACEPARENT_ATTRIBUTE]).expect("a traceparent");
    let send = send_span(&receiver, &topic, message_id).await;
    assert_eq!(send.trace_id, WRITER_TRACE, "the writer's trace");
    assert_eq!(
        send.parent_span_id, WRITER_SPAN,
        "the writer's span is the parent"
    );
    assert_eq!(
        send.attr("messaging.gcp_pubsub.message.ordering_key"),
        Some("k1")
    );
    assert_eq!(
        carried.to_string(),
        format!("00-{}-{}-01", send.trace_id, send.span_id)
    );
    assert_eq!(attributes[TRACESTATE_ATTRIBUTE], "congo=t61rcWkgMzE");
    let handler = receiver
        .wait_for("the inbox handler's", |s| {
            s.service == "inbox-test" && s.trace_id == WRITER_TRACE && s.kind == 5
        })
        .await;
    assert_eq!(handler.name, format!("process {CONSUMER}"));
    assert_eq!(handler.kind, 5, "a consumer span");
    assert_eq!(
        handler.parent_span_id, send.span_id,
        "the handler is the send span's child"
    );
    assert_eq!(
        handler.attr("messaging.message.id"),
        Some(message_id.as_str())
    );

    // No context: no attribute. Malformed: no attribute, one warning, and the message went out.
    assert!(!seen["plain"].0.contains_key(TRACEPARENT_ATTRIBUTE));
    assert!(!seen["malformed"].0.contains_key(TRACEPARENT_ATTRIBUTE));
    d.signal("TERM");
    let _ = d.child.wait().await;
    let warnings = log_lines(&d, "trace context was ignored");
    assert_eq!(warnings.len(), 1, "one warning: {}", d.log());
    let warning = &warnings[0];
    assert_eq!(warning["outbox.dedupe_key"], "malformed");
    // A line inside a traced batch carries Cloud Logging's trace fields, naming a batch the
    // receiver holds.
    let trace = warning["logging.googleapis.com/trace"]
        .as_str()
        .expect("the trace field");
    let trace_id = trace
        .strip_prefix("projects/trace-project/traces/")
        .expect("projects/P/traces/ID");
    assert_eq!(warning["logging.googleapis.com/trace_sampled"], true);
    let span_id = warning["logging.googleapis.com/spanId"]
        .as_str()
        .expect("the span field");
    let spans = receiver.spans();
    let logged_in = span_of(&spans, span_id);
    assert_eq!(logged_in.trace_id, trace_id);
    assert_eq!(logged_in.name, "run_batch");

    // An unsampled writer: its context is passed on as it is, and no span is made for it.
    assert_eq!(seen["unsampled"].0[TRACEPARENT_ATTRIBUTE], UNSAMPLED);
    assert!(
        !spans
            .iter()
            .any(|s| s.trace_id == UNSAMPLED[3..35] && s.service != "inbox-test"),
        "no dispatcher span in an unsampled trace"
    );
}

#[tokio::test]
async fn with_tracing_off_the_context_is_passed_on_and_logs_carry_no_trace_fields() {
    let db = TestDb::new().await;
    let topic = TestTopic::new(true).await;
    let t = &topic.topic;
    enqueue(
        &db.pool,
        &[
            traced(t, "traced", "k1", WRITER),
            message(t, "plain", &[]),
            message(t, "malformed", &[]).with_trace_context(TraceContext::new("garbage")),
        ],
    )
    .await;
    let mut d = dispatcher(&db, None);
    d.bound_addr(Duration::from_secs(30))
        .await
        .expect("the dispatcher serves its endpoints");
    drained(&db.pool, Duration::from_secs(60)).await;
    let received = topic.pull(3, Duration::from_secs(3)).await;
    let by_key: HashMap<&str, &HashMap<String, String>> = received
        .iter()
        .map(|m| (m.dedupe_key(), &m.attributes))
        .collect();
    assert_eq!(by_key.len(), 3, "every message arrived");
    assert_eq!(
        by_key["traced"][TRACEPARENT_ATTRIBUTE], WRITER,
        "passed on as written"
    );
    assert_eq!(by_key["traced"][TRACESTATE_ATTRIBUTE], "congo=t61rcWkgMzE");
    assert!(!by_key["plain"].contains_key(TRACEPARENT_ATTRIBUTE));
    assert!(!by_key["malformed"].contains_key(TRACEPARENT_ATTRIBUTE));
    d.signal("TERM");
    let _ = d.child.wait().await;
    let warnings = log_lines(&d, "trace context was ignored");
    assert_eq!(warnings.len(), 1, "one warning: {}", d.log());
    let lines: Vec<serde_json::Value> = d
        .log()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    assert!(!lines.is_empty());
    assert!(
        lines
            .iter()
            .all(|l| l.get("logging.googleapis.com/trace").is_none()
                && l.get("logging.googleapis.com/spanId").is_none()),
        "no trace fields with tracing off: {}",
        d.log()
    );
}

#[tokio::test]
async fn a_producer_run_is_a_trace_that_its_messages_continue_to_the_handler() {
    use harness::producer::orders_stream_file;

    let db = consumer_db().await;
    let topic = TestTopic::new(true).await;
    let receiver = OtlpReceiver::start(true).await;
    let (_table, path) = orders_stream_file("traced", &topic.topic, 3).await;
    let endpoint = receiver.endpoint();
    let output = Spawn::binary("producer")
        .args([
            "run",
            "--trace-endpoint",
            &endpoint,
            "--trace-sample-ratio",
            "1",
            "--config",
        ])
        .arg(&path)
        .env("DATABASE_URL", db.url())
        .env(
            "BIGQUERY_EMULATOR_HOST",
            harness::env::bigquery_emulator_host(),
        )
        .env("BIGQUERY_PROJECT_ID", harness::env::bigquery_project())
        .env("PUBSUB_PROJECT_ID", harness::env::pubsub_project())
        .output(Duration::from_secs(120))
        .await
        .expect("the producer runs");
    assert!(output.status.success(), "{output:?}");
    let _ = std::fs::remove_file(&path);

    // The run is a trace: its root span, the stream's run its child, and every row points at it.
    let run = receiver
        .wait_for("of the producer's run", |s| s.name == "producer run")
        .await;
    assert_eq!(run.service, "pubsub-outbox-producer");
    assert!(run.parent_span_id.is_empty(), "the run is the root");
    let stored: Vec<Option<String>> =
        sqlx::query_scalar("SELECT traceparent FROM pubsub_outbox ORDER BY id")
            .fetch_all(&db.pool)
            .await
            .expect("read the outbox");
    assert_eq!(stored.len(), 3);
    let parents: Vec<TraceParent> = stored
        .iter()
        .map(|p| TraceParent::parse(p.as_deref().expect("a context")).expect("valid"))
        .collect();
    let spans = receiver.spans();
    for parent in &parents {
        let hex: String = parent.trace_id.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, run.trace_id, "the row points into the run's trace");
        let span: String = parent.span_id.iter().map(|b| format!("{b:02x}")).collect();
        let writer = span_of(&spans, &span);
        assert_eq!(
            writer.trace_id, run.trace_id,
            "the writing span is the run's: {writer:?}"
        );
    }

    let mut d = dispatcher(&db, Some(&receiver));
    d.bound_addr(Duration::from_secs(30))
        .await
        .expect("the dispatcher serves its endpoints");
    drained(&db.pool, Duration::from_secs(60)).await;
    let seen = consume_traced(&db, &topic, &receiver).await;
    assert_eq!(seen.len(), 3, "every message arrived");
    for (attributes, message_id) in seen.values() {
        let carried =
            TraceParent::parse(&attributes[TRACEPARENT_ATTRIBUTE]).expect("a traceparent");
        let send = send_span(&receiver, &topic, message_id).await;
        assert_eq!(send.trace_id, run.trace_id, "the run's trace goes on");
        assert!(
            parents.iter().any(|p| p
                .span_id
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>()
                == send.parent_span_id),
            "the send span is the writing span's child"
        );
        assert_eq!(
            carried.to_string(),
            format!("00-{}-{}-01", send.trace_id, send.span_id)
        );
        let span_id = send.span_id.clone();
        let handler = receiver
            .wait_for("the handler's", move |s| {
                s.service == "inbox-test" && s.parent_span_id == span_id && s.kind == 5
            })
            .await;
        assert_eq!(handler.trace_id, run.trace_id);
        assert_eq!(handler.name, format!("process {CONSUMER}"));
    }
    d.signal("TERM");
}
