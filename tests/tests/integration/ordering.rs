//! Strict per-key ordering across processes, failures and SIGKILL; per-key head-of-line blocking.

use std::time::Duration;

use outbox_dispatcher::Code;

use harness::db::TestDb;
use harness::dispatcher::{self as test_dispatcher, drain, real_publisher};
use harness::fixtures::{enqueue, keyed_dedupe as dedupe, keyed_messages, outbox_dedupe_keys};
use harness::ledger::DeliveryLedger;
use harness::process::Process;
use harness::pubsub::{Received, TestTopic, arrivals, by_publish_order};
use harness::wait::outbox_at_most;
use outbox_dispatcher::fault::{Fault, FaultInjector};
use outbox_shared::store::dead_letter;

const KEYS: usize = 200;
const PER_KEY: usize = 50;

/// Asserts every key arrived complete and its first arrivals in enqueue order, in the order given.
fn assert_every_key_in_enqueue_order(ledger: &DeliveryLedger, received: &[Received], what: &str) {
    let verdict = ledger.verdict(&arrivals(received));
    verdict.assert_clean(what);
    assert_eq!(verdict.arrivals, received.len());
}

fn spawn_dispatchers(db: &TestDb, n: usize, extra: &[&str]) -> Vec<Process> {
    let envs = [
        ("DATABASE_URL", db.url().to_owned()),
        ("PUBSUB_EMULATOR_HOST", harness::env::pubsub_emulator_host()),
    ];
    let mut args = vec![
        "--workers",
        "3",
        "--batch-size",
        "100",
        "--listen-addr",
        "127.0.0.1:0",
        // Injected transient failures on 2% of publishes; retried quickly, never dead-lettered.
        "--inject-failure-rate",
        "0.02",
        "--backoff-base",
        "50ms",
        "--backoff-cap",
        "500ms",
        "--max-attempts",
        "1000",
        "--poll-interval",
        "20ms",
        "--max-poll-interval",
        "200ms",
    ];
    args.extend_from_slice(extra);
    (0..n)
        .map(|_| Process::spawn("dispatcher", &args, &envs))
        .collect()
}

#[tokio::test]
async fn three_processes_with_injected_failures_publish_every_key_in_enqueue_order() {
    let db = TestDb::new().await;
    let topic = TestTopic::new(true).await;
    let messages = keyed_messages(&topic.topic, KEYS, PER_KEY);
    enqueue(&db.pool, &messages).await;
    let ledger = DeliveryLedger::of(&messages);
    let procs = spawn_dispatchers(&db, 3, &[]);
    outbox_at_most(&db.pool, 0, Duration::from_secs(240), "drain").await;
    harness::process::terminate_all(procs).await;

    let received = topic.pull(KEYS * PER_KEY, Duration::from_secs(10)).await;
    assert_every_key_in_enqueue_order(&ledger, &received, "delivery order");
    assert_every_key_in_enqueue_order(&ledger, &by_publish_order(&received), "publish order");
    let dead = harness::fixtures::dead_letters(&db.pool).await;
    assert_eq!(
        dead, 0,
        "transient failures never dead-letter with max attempts this high"
    );
}

#[tokio::test]
async fn a_sigkill_mid_run_loses_nothing_and_first_arrivals_keep_enqueue_order() {
    let db = TestDb::new().await;
    let topic = TestTopic::new(true).await;
    let messages = keyed_messages(&topic.topic, KEYS, PER_KEY);
    enqueue(&db.pool, &messages).await;
    let ledger = DeliveryLedger::of(&messages);
    let mut procs = spawn_dispatchers(&db, 3, &[]);
    let total = (KEYS * PER_KEY) as i64;
    outbox_at_most(
        &db.pool,
        total / 2,
        Duration::from_secs(240),
        "half drained",
    )
    .await;
    let mut victim = procs.remove(0);
    victim.signal("KILL");
    let _ = victim.child.wait().await;
    outbox_at_most(
        &db.pool,
        0,
        Duration::from_secs(240),
        "drain after the kill",
    )
    .await;
    harness::process::terminate_all(procs).await;

    let received = topic
        .pull(KEYS * PER_KEY + 2000, Duration::from_secs(10))
        .await;
    let duplicates = received.len() - KEYS * PER_KEY.min(received.len());
    eprintln!(
        "SIGKILL ordering test: {} deliveries, {duplicates} duplicates (re-sends of the killed process's in-flight batches: at most 3 workers x 100)",
        received.len()
    );
    assert!(
        duplicates <= 300,
        "duplicates bounded by the killed process's in-flight rows: {duplicates}"
    );
    assert_every_key_in_enqueue_order(&ledger, &received, "delivery order (first arrivals)");
    assert_every_key_in_enqueue_order(
        &ledger,
        &by_publish_order(&received),
        "publish order (first arrivals)",
    );
}

#[tokio::test]
async fn a_permanently_failing_message_blocks_only_its_key_until_discarded_or_replayed() {
    let db = TestDb::new().await;
    let topic = TestTopic::new(true).await;
    let (keys, per_key) = (10, 8);
    let messages = keyed_messages(&topic.topic, keys, per_key);
    enqueue(&db.pool, &messages).await;

    let publisher = FaultInjector::passthrough(real_publisher().await);
    publisher.record_published();
    publisher.fail(
        &dedupe(3, 2),
        Fault {
            code: Code::InvalidArgument,
            times: None,
        },
    );
    publisher.fail(
        &dedupe(5, 4),
        Fault {
            code: Code::InvalidArgument,
            times: None,
        },
    );
    let d = test_dispatcher::build(&db.pool, publisher, test_dispatcher::config()).await;
    drain(&d).await;

    let expected_left: Vec<String> = (3..per_key)
        .map(|s| dedupe(3, s))
        .chain((5..per_key).map(|s| dedupe(5, s)))
        .collect();
    let mut left = outbox_dedupe_keys(&db.pool).await;
    left.sort();
    assert_eq!(
        left, expected_left,
        "only the two failing keys wait, behind their dead letters"
    );
    let mut conn = db.pool.acquire().await.expect("conn");
    let dead = dead_letter::list(&mut conn, None, 10)
        .await
        .expect("dead letters");
    assert_eq!(dead.len(), 2, "both failing messages are dead-lettered");
    assert_eq!(
        dead_letter::blocked_keys(&mut conn, &[], None)
            .await
            .expect("blocked"),
        2,
        "two keys are blocked"
    );

    // Discard key 3's dead letter: its later messages go on. Replay key 5's (healed): it goes out
    // first, ahead of the messages that waited behind it.
    let id_of = |k: &str| {
        dead.iter()
            .find(|d| d.dedupe_key == k)
            .map(|d| d.id)
            .expect("dead letter")
    };
    dead_letter::discard(&mut conn, &[id_of(&dedupe(3, 2))])
        .await
        .expect("discard");
    d.publisher().heal(&dedupe(5, 4));
    dead_letter::replay(&mut conn, &[id_of(&dedupe(5, 4))])
        .await
        .expect("replay");
    drop(conn);
    drain(&d).await;
    assert!(
        outbox_dedupe_keys(&db.pool).await.is_empty(),
        "both keys drained after the operator acted"
    );

    let published = d.publisher().published();
    for key in 0..keys {
        let seqs: Vec<usize> = published
            .iter()
            .filter(|k| k.starts_with(&format!("k{key:03}-")))
            .map(|k| {
                k.rsplit("-m")
                    .next()
                    .and_then(|s| s.parse().ok())
                    .expect("seq")
            })
            .collect();
        let expected: Vec<usize> = (0..per_key).filter(|s| !(key == 3 && *s == 2)).collect();
        assert_eq!(seqs, expected, "key {key} was published in enqueue order");
    }
    let received = topic.pull(keys * per_key - 1, Duration::from_secs(5)).await;
    assert_eq!(
        received.len(),
        keys * per_key - 1,
        "everything but the discarded message arrived"
    );
}
