//! Behind PgBouncer (Debian's, started per test) in transaction mode: two dispatchers publish every
//! row, each key in order; the operator commands work; what cannot work through such a pooler is
//! refused at start-up with the fix (exit 2). In session mode everything works as direct.

use std::time::Duration;

use harness::db::TestDb;
use harness::fixtures::{enqueue, keyed_messages, message};
use harness::ledger::DeliveryLedger;
use harness::pgbouncer::{PgBouncer, PoolMode};
use harness::process::{Process, Spawn};
use harness::pubsub::{TestTopic, arrivals};
use harness::wait::outbox_at_most;

const KEYS: usize = 100;
const PER_KEY: usize = 100;

fn pooled_dispatchers(url: &str, n: usize) -> Vec<Process> {
    let envs = [
        ("DATABASE_URL", url.to_owned()),
        ("OUTBOX_DB_POOLER", "transaction".to_owned()),
        ("OUTBOX_NO_LISTEN", "true".to_owned()),
    ];
    let args = [
        "--workers",
        "3",
        "--batch-size",
        "200",
        "--listen-addr",
        "127.0.0.1:0",
        "--poll-interval",
        "20ms",
        "--max-poll-interval",
        "200ms",
        "--db-pool-size",
        "6",
    ];
    (0..n)
        .map(|_| Process::spawn("dispatcher", &args, &envs))
        .collect()
}

#[tokio::test]
async fn two_dispatchers_through_a_transaction_pooler_publish_every_key_in_order() {
    let db = TestDb::new().await;
    let bouncer = PgBouncer::start(PoolMode::Transaction).await;
    let topic = TestTopic::new(true).await;
    let mut messages = keyed_messages(&topic.topic, KEYS, PER_KEY);
    messages.extend((0..2_000).map(|i| message(&topic.topic, &format!("unkeyed-{i}"), &[])));
    enqueue(&db.pool, &messages).await;
    let ledger = DeliveryLedger::of(&messages);

    let procs = pooled_dispatchers(&bouncer.url_for(db.url()), 2);
    outbox_at_most(
        &db.pool,
        0,
        Duration::from_secs(180),
        "drain through PgBouncer",
    )
    .await;
    let logs: Vec<String> = procs.iter().map(Process::log).collect();
    harness::process::terminate_all(procs).await;

    let received = topic.pull(messages.len(), Duration::from_secs(10)).await;
    let verdict = ledger.verdict(&arrivals(&received));
    verdict.assert_clean("through PgBouncer in transaction mode");
    for log in &logs {
        assert!(
            !log.contains("prepared statement"),
            "no statement depends on a server connection: {log}"
        );
    }
    assert!(
        !bouncer.log().contains("unsupported startup parameter"),
        "the start-up parameters pass: {}",
        bouncer.log()
    );
}

/// Runs `binary ARGS` through `url`; returns (exit code, stdout, stderr).
async fn run(binary: &str, url: &str, args: &[&str], pooler: &str) -> (i32, String, String) {
    let out = Spawn::binary(binary)
        .args(args)
        .env("DATABASE_URL", url)
        .env("OUTBOX_DB_POOLER", pooler)
        .env("OUTBOX_DB_CONNECT_TIMEOUT", "5s")
        .env("OUTBOX_ACTOR", "pooler-test")
        .env_remove("PUBSUB_PROJECT_ID")
        .output(Duration::from_secs(60))
        .await
        .expect("run the binary");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn the_operator_commands_work_through_a_transaction_pooler() {
    let db = TestDb::new().await;
    let bouncer = PgBouncer::start(PoolMode::Transaction).await;
    let url = bouncer.url_for(db.url());
    let topic = "projects/test-project/topics/pooled";
    enqueue(&db.pool, &[message(topic, "waiting", &[])]).await;
    let commands: [&[&str]; 6] = [
        &["status", "--json"],
        &["dead-letters", "list", "--json"],
        &["pause", topic, "--reason", "pooler test"],
        &["resume", topic, "--reason", "pooler test"],
        &["audit", "--json"],
        &["status"],
    ];
    // Twice over, so that statements land on server connections other clients used before.
    for _ in 0..2 {
        for args in commands {
            let (code, _, err) = run("dispatcher", &url, args, "transaction").await;
            assert!(
                code == 0 || (code == 3 && args[0] == "dead-letters"),
                "dispatcher {args:?} through PgBouncer: exit {code}: {err}"
            );
        }
    }
    let (code, out, err) = run("producer", &url, &["streams", "--json"], "transaction").await;
    assert!(
        code == 0 || code == 3,
        "producer streams: exit {code}: {err}"
    );
    let streams: serde_json::Value = serde_json::from_str(&out).expect("streams --json is JSON");
    assert_eq!(
        streams["streams"],
        serde_json::json!([]),
        "no stream has run: {out}"
    );
}

#[tokio::test]
async fn what_needs_a_session_is_refused_through_a_transaction_pooler_with_the_fix() {
    let db = TestDb::new().await;
    let url = db.url().to_owned();
    let (code, _, err) = run(
        "dispatcher",
        &url,
        &["--listen-addr", "127.0.0.1:0"],
        "transaction",
    )
    .await;
    assert_eq!(code, 2, "LISTEN needs a session: {err}");
    assert!(err.contains("--no-listen"), "the fix: {err}");
    let (code, _, err) = run(
        "producer",
        &url,
        &["run", "--config", "/nonexistent.toml"],
        "transaction",
    )
    .await;
    assert_eq!(code, 2, "the stream lock needs a session: {err}");
    assert!(err.contains("session-mode pooler"), "the fix: {err}");
    let (code, _, err) = run(
        "producer",
        &url,
        &["rewind", "orders", "--to", "1h", "--reason", "x"],
        "transaction",
    )
    .await;
    assert_eq!(code, 2, "rewind's lock needs a session: {err}");
}

#[tokio::test]
async fn a_dispatcher_through_a_session_pooler_works_as_direct() {
    let db = TestDb::new().await;
    let bouncer = PgBouncer::start(PoolMode::Session).await;
    let topic = TestTopic::new(false).await;
    let messages: Vec<_> = (0..500)
        .map(|i| message(&topic.topic, &format!("s-{i}"), &[]))
        .collect();
    enqueue(&db.pool, &messages).await;
    let envs = [
        ("DATABASE_URL", bouncer.url_for(db.url())),
        ("OUTBOX_DB_POOLER", "session".to_owned()),
    ];
    let proc = Process::spawn("dispatcher", &["--listen-addr", "127.0.0.1:0"], &envs);
    harness::wait::wait_until(
        "drain through a session pooler",
        Duration::from_secs(60),
        || async {
            match harness::fixtures::count(&db.pool, "SELECT count(*) FROM pubsub_outbox").await {
                0 => Ok(()),
                n => Err(format!("{n} rows left; log:\n{}", proc.log())),
            }
        },
    )
    .await;
    harness::process::terminate_all(vec![proc]).await;
    let received = topic.pull(messages.len(), Duration::from_secs(5)).await;
    assert_eq!(
        harness::pubsub::by_dedupe_key(&received).len(),
        messages.len(),
        "every row arrived"
    );
}
