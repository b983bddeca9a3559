//! The operator's toolkit, run as the real `dispatcher` binary: status numbers equal the database,
//! dead letters are listed, shown, replayed (a keyed one ahead of its key's waiting messages) and
//! discarded, every change is audited in its own transaction, pause stops one topic while others
//! flow, and bad usage is refused with exit 2 naming the bad value.

use std::time::{Duration, Instant};

use outbox_dispatcher::Code;
use serde_json::Value;

use harness::db::TestDb;
use harness::dispatcher::{self as test_dispatcher, Running, drain, real_publisher};
use harness::fixtures::{count, dead_letters, enqueue, message, outbox_dedupe_keys};
use harness::operator::{dispatcher, json};
use harness::pubsub::TestTopic;
use harness::wait::wait_until;
use outbox_dispatcher::fault::{Fault, FaultInjector};
use outbox_shared::NewMessage;

fn keyed(topic: &str, dedupe: &str) -> NewMessage {
    NewMessage::new(topic, dedupe, dedupe.as_bytes().to_vec()).with_ordering_key("k")
}

#[tokio::test]
async fn dead_letters_are_listed_shown_replayed_by_filter_and_discarded_with_an_audit_row_each() {
    let db = TestDb::new().await;
    let topic = TestTopic::new(true).await;
    let t = topic.topic.as_str();
    let batch = vec![
        keyed(t, "k-1"),
        keyed(t, "k-2"),
        keyed(t, "k-3"),
        message(t, "junk-1", &[]),
        message(t, "junk-2", &[]),
        message(t, "fine", &[]),
    ];
    enqueue(&db.pool, &batch).await;
    let publisher = FaultInjector::passthrough(real_publisher().await);
    publisher.record_published();
    let refuse = Fault {
        code: Code::InvalidArgument,
        times: None,
    };
    for k in ["k-1", "junk-1", "junk-2"] {
        publisher.fail(k, refuse);
    }
    let d = test_dispatcher::build(&db.pool, publisher, test_dispatcher::config()).await;
    drain(&d).await;
    assert_eq!(dead_letters(&db.pool).await, 3);
    assert_eq!(
        outbox_dedupe_keys(&db.pool).await,
        vec!["k-2", "k-3"],
        "the key waits"
    );

    let listed = json(&db, &["dead-letters", "list", "--topic", t, "--json"]);
    let entries = listed.as_array().expect("a list");
    assert_eq!(entries.len(), 3, "{listed}");
    let id_of = |k: &str| {
        entries
            .iter()
            .find(|e| e["dedupe_key"] == k)
            .and_then(|e| e["id"].as_i64())
            .unwrap_or_else(|| panic!("{k} listed"))
    };
    let shown = json(
        &db,
        &["dead-letters", "show", &id_of("k-1").to_string(), "--json"],
    );
    assert_eq!(shown["ordering_key"], "k");
    assert_eq!(shown["payload_bytes"], 3);
    assert_eq!(shown["payload_preview"], "k-1");
    assert_eq!(shown["error_kind"], "permanent");

    let dry = json(
        &db,
        &[
            "dead-letters",
            "replay",
            "--topic",
            t,
            "--ordering-key",
            "k",
            "--reason",
            "schema fixed",
            "--dry-run",
            "--json",
        ],
    );
    assert_eq!(dry["ids"], serde_json::json!([id_of("k-1")]), "{dry}");
    assert_eq!(dead_letters(&db.pool).await, 3, "a dry run changes nothing");
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM pubsub_outbox_audit").await,
        0
    );

    d.publisher().heal("k-1");
    let replayed = json(
        &db,
        &[
            "dead-letters",
            "replay",
            "--topic",
            t,
            "--ordering-key",
            "k",
            "--reason",
            "schema fixed",
            "--yes",
            "--json",
        ],
    );
    assert_eq!(replayed["count"], 1, "{replayed}");
    assert_eq!(
        outbox_dedupe_keys(&db.pool).await,
        vec!["k-1", "k-2", "k-3"],
        "k-1 goes first"
    );
    drain(&d).await;
    let keyed_order: Vec<String> = d
        .publisher()
        .published()
        .into_iter()
        .filter(|k| k.starts_with("k-"))
        .collect();
    assert_eq!(
        keyed_order,
        vec!["k-1", "k-2", "k-3"],
        "the replayed message went out ahead"
    );

    let discarded = json(
        &db,
        &[
            "dead-letters",
            "discard",
            "--topic",
            t,
            "--kind",
            "permanent",
            "--reason",
            "junk",
            "--yes",
            "--json",
        ],
    );
    assert_eq!(discarded["count"], 2, "{discarded}");
    assert_eq!(dead_letters(&db.pool).await, 0);

    let audit = json(&db, &["audit", "--json"]);
    let rows = audit.as_array().expect("a list");
    assert_eq!(rows.len(), 2, "one audit row per action: {audit}");
    let (discard, replay) = (&rows[0], &rows[1]);
    assert_eq!(
        (replay["action"].as_str(), replay["actor"].as_str()),
        (Some("replay"), Some("alice"))
    );
    assert_eq!(replay["reason"], "schema fixed");
    assert_eq!(replay["row_ids"], serde_json::json!([id_of("k-1")]));
    assert_eq!(replay["selector"]["ordering_key"], "k");
    assert_eq!(discard["action"], "discard");
    assert_eq!(discard["row_count"], 2);
    assert_eq!(discard["selector"]["error_kind"], "permanent");
}

#[tokio::test]
async fn pause_stops_one_topic_while_another_flows_and_resume_drains_it() {
    let db = TestDb::new().await;
    let (paused, flowing) = (TestTopic::new(false).await, TestTopic::new(false).await);
    let service = Running::start(
        test_dispatcher::build_service(&db, real_publisher().await, test_dispatcher::config())
            .await,
    );
    // Before the topic's first message: the database does not know it yet.
    let (code, _, err) = dispatcher(
        &db,
        &[
            "pause",
            &paused.topic,
            "--new-topic",
            "--reason",
            "consumer down",
        ],
    );
    assert_eq!(code, 0, "{err}");
    let msgs = |topic: &str, tag: &str| -> Vec<NewMessage> {
        (0..50)
            .map(|i| message(topic, &format!("{tag}-{i}"), &[]))
            .collect()
    };
    enqueue(&db.pool, &msgs(&paused.topic, "p")).await;
    enqueue(&db.pool, &msgs(&flowing.topic, "f")).await;
    let flowed =
        harness::wait::topic_drained(&db.pool, &flowing.topic, Duration::from_secs(30)).await;
    eprintln!("PAUSE: the flowing topic drained in {flowed:?}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let waiting = |pool: sqlx::PgPool, topic: String| async move {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pubsub_outbox WHERE topic = $1 AND attempts = 0",
        )
        .bind(topic)
        .fetch_one(&pool)
        .await
        .expect("count")
    };
    assert_eq!(
        waiting(db.pool.clone(), paused.topic.clone()).await,
        50,
        "the paused topic waits, uncharged"
    );
    assert_eq!(
        dead_letters(&db.pool).await,
        0,
        "nothing is dead-lettered for a pause"
    );
    let metrics = harness::process::http_get(&service.addr(), "/metrics")
        .await
        .1;
    let gauge = format!("outbox_paused_topic{{topic=\"{}\"}} 1", paused.topic);
    let sampled = wait_until("the paused gauge", Duration::from_secs(15), || {
        let addr = service.addr();
        let gauge = gauge.clone();
        async move {
            let m = harness::process::http_get(&addr, "/metrics").await.1;
            if m.contains(&gauge) {
                Ok(m)
            } else {
                Err("not yet".to_owned())
            }
        }
    })
    .await;
    assert!(sampled.contains(&gauge) || metrics.contains(&gauge));

    let status = json(&db, &["status", "--json"]);
    let replicas = status["replicas"].as_array().cloned().unwrap_or_default();
    assert_eq!(
        replicas.len(),
        1,
        "the running dispatcher has a heartbeat row: {status}"
    );
    assert_eq!(replicas[0]["alive"], true);
    let (code, _, err) = dispatcher(&db, &["resume", &paused.topic, "--reason", "consumer back"]);
    assert_eq!(code, 0, "{err}");
    harness::wait::drained(&db.pool, Duration::from_secs(30)).await;
    assert_eq!(
        paused.pull(50, Duration::from_secs(3)).await.len(),
        50,
        "resume drains it"
    );
    assert_eq!(flowing.pull(50, Duration::from_secs(3)).await.len(), 50);
    let (code, _, _) = dispatcher(&db, &["resume", &paused.topic, "--reason", "again"]);
    assert_eq!(
        code, 3,
        "resuming a topic that is not paused matches nothing"
    );
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM pubsub_outbox_audit").await,
        2
    );
    service.stop().await;
}

#[tokio::test]
async fn status_json_numbers_equal_the_database_state() {
    let db = TestDb::new().await;
    let t = "projects/p/topics/orders";
    let other = "projects/p/topics/payments";
    enqueue(
        &db.pool,
        &[
            message(t, "due-1", &[]),
            message(t, "due-2", &[]),
            message(t, "later", &[]),
            keyed(other, "blocked-2"),
        ],
    )
    .await;
    sqlx::raw_sql(&format!(
        "UPDATE pubsub_outbox SET next_attempt_at = now() + interval '1 hour', attempts = 2 WHERE dedupe_key = 'later';
         INSERT INTO pubsub_outbox_dead_letter (topic, ordering_key, dedupe_key, payload, attributes, created_at, attempts, error_kind, last_error, source)
         VALUES ('{other}', 'k', 'blocked-1', '\\x00', '{{}}', now(), 1, 'permanent', 'INVALID_ARGUMENT: bad', 'dispatcher');
         INSERT INTO pubsub_outbox_paused_topic (topic, paused_by, reason) VALUES ('{t}', 'bob', 'maintenance');
         INSERT INTO pubsub_outbox_replica (replica_id, hostname, pid, version, started_at, heartbeat_at)
         VALUES ('gone-1', 'pod-a', 1, '0.1.0', now() - interval '1 hour', now() - interval '10 minutes'),
                ('alive-1', 'pod-b', 2, '0.1.0', now() - interval '1 hour', now());"
    ))
    .execute(&db.pool)
    .await
    .expect("set up the states");
    // A long transaction holding a snapshot.
    let mut holder = db.pool.begin().await.expect("begin");
    sqlx::query("SELECT txid_current()")
        .execute(&mut *holder)
        .await
        .expect("snapshot");
    tokio::time::sleep(Duration::from_millis(1500)).await;

    let s = json(&db, &["status", "--json", "--long-transaction", "1s"]);
    let topic = |name: &str| {
        s["topics"]
            .as_array()
            .and_then(|a| a.iter().find(|x| x["topic"] == name).cloned())
            .unwrap_or_else(|| panic!("{name} in {s}"))
    };
    let orders = topic(t);
    assert_eq!(
        (
            orders["due_now"].as_i64(),
            orders["held"].as_i64(),
            orders["waiting"].as_i64()
        ),
        (Some(0), Some(2), Some(1)),
        "a paused topic's due rows are held, not due: {orders}"
    );
    assert_eq!(orders["paused"], true);
    assert!(orders["next_due_at"].is_string());
    let payments = topic(other);
    assert_eq!(payments["dead_permanent"], 1);
    assert_eq!(payments["dead_recent"], 1);
    assert_eq!(s["blocked_keys"][0]["ordering_key"], "k");
    assert_eq!(s["blocked_keys"][0]["waiting"], 1);
    assert!(s["blocked_keys"][0]["dead_letter_id"].is_i64());
    let replicas = s["replicas"].as_array().expect("replicas");
    let alive = |id: &str| {
        replicas
            .iter()
            .find(|r| r["replica_id"] == id)
            .map(|r| r["alive"].clone())
    };
    assert_eq!(alive("alive-1"), Some(Value::Bool(true)));
    assert_eq!(alive("gone-1"), Some(Value::Bool(false)));
    let long = s["long_transactions"]
        .as_array()
        .expect("long transactions");
    assert!(!long.is_empty(), "the held transaction is reported: {s}");
    let warnings = s["warnings"].to_string();
    for needle in [
        "blocked by dead letter",
        "gone-1",
        "holds back vacuum",
        "is paused",
    ] {
        assert!(
            warnings.contains(needle),
            "a warning about {needle:?}: {warnings}"
        );
    }
    holder.rollback().await.expect("rollback");
    let (code, text, _) = dispatcher(&db, &["status"]);
    assert_eq!(code, 0);
    assert!(
        text.contains("TOPIC") && text.contains("Warnings:"),
        "{text}"
    );
}

#[tokio::test]
async fn changes_refuse_without_a_reason_bulk_ones_without_yes_and_bad_filters_name_the_value() {
    let db = TestDb::new().await;
    let refused = [
        (&["dead-letters", "replay", "7"][..], "--reason"),
        (
            &[
                "dead-letters",
                "discard",
                "--topic",
                "projects/test-project/topics/orders",
                "--reason",
                "x",
            ],
            "--yes",
        ),
        (
            &["dead-letters", "discard", "--reason", "x", "--yes"],
            "needs dead letter ids or a filter",
        ),
        (
            &["dead-letters", "list", "--failed-before", "yesterday-ish"],
            "yesterday-ish",
        ),
        (
            &[
                "dead-letters",
                "list",
                "--failed-before",
                "3h",
                "--failed-after",
                "2h",
            ],
            "can match nothing",
        ),
        (
            &[
                "dead-letters",
                "discard",
                "--older-than",
                "soon",
                "--reason",
                "x",
                "--yes",
            ],
            "soon",
        ),
        (&["pause", "orders", "--reason", "x"], "short topic name"),
        (
            &["pause", "projects/test-project/topics/orders"],
            "--reason",
        ),
        (&["dead-letters", "list", "--kind", "bogus"], "bogus"),
    ];
    for (args, needle) in refused {
        let (code, _, err) = dispatcher(&db, args);
        assert_eq!(code, 2, "{args:?} is bad usage: {err}");
        assert!(err.contains(needle), "{args:?} names {needle:?}: {err}");
    }
    let (code, _, err) = dispatcher(&db, &["dead-letters", "show", "424242"]);
    assert_eq!(code, 3, "an unknown id matches nothing: {err}");
    assert!(err.contains("424242"), "{err}");
    let (code, _, _) = dispatcher(&db, &["dead-letters", "list"]);
    assert_eq!(code, 3, "an empty list matched nothing");
}

#[tokio::test]
async fn cli_conventions_configuration_errors_exit_2_and_a_missing_database_fails_at_once_naming_it()
 {
    let db = TestDb::new().await;
    let (code, _, err) = dispatcher(&db, &["--lock-timeout", "1s"]);
    assert_eq!(code, 2, "a configuration error exits 2: {err}");
    assert!(err.contains("--lock-timeout"), "{err}");
    let (code, _, err) = dispatcher(&db, &["run", "--workers", "0"]);
    assert_eq!(code, 2, "flags after run are parsed (and checked): {err}");
    let missing = db.url().replacen(&db.name, "no_such_database", 1);
    let started = Instant::now();
    let (code, _, err) = dispatcher(
        &db,
        &[
            "migrate",
            "--database-url",
            &missing,
            "--db-connect-timeout",
            "30s",
        ],
    );
    let took = started.elapsed();
    assert_eq!(
        code, 2,
        "a missing database is a configuration error: {err}"
    );
    assert!(
        took < Duration::from_secs(10),
        "no retrying a missing database for 30 s: {took:?}"
    );
    assert!(
        err.contains("no_such_database"),
        "names the database: {err}"
    );
    assert_eq!(
        err.matches("does not exist").count(),
        1,
        "the cause is said once: {err}"
    );
}
