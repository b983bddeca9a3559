//! The consumer side: through the inbox, a handler's effects happen exactly once per dedupe key
//! when messages are re-published (new message ids) and redelivered, when the consumer is
//! SIGKILLed mid-stream, and when a handler fails; an ordered subscription is applied in order.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use harness::db::TestDb;
use harness::dispatcher as test_dispatcher;
use harness::fixtures::{count, enqueue, invoice_event, keyed_dedupe, keyed_messages};
use harness::process::{Process, Spawn};
use harness::pubsub::{self, TestTopic};
use harness::wait::wait_until;
use outbox_inbox::pubsub::{ConsumeOptions, consume, dedupe_key, process_message};
use outbox_inbox::{Failure, Inbox, Outcome};
use outbox_shared::NewMessage;
use sqlx::{PgConnection, PgPool};

const CONSUMER: &str = "billing";

/// A migrated database with the inbox and `applied`, a side-effect table with no unique key: a
/// handler that ran twice for a key leaves two rows.
/// The inbox's example consumer as a process.
fn consumer(args: &[&str], envs: &[(&str, String)]) -> Process {
    Spawn::example("invoice_consumer")
        .args(args)
        .envs(envs)
        .start()
        .expect("start the example consumer")
}

async fn consumer_db() -> TestDb {
    let db = TestDb::new().await;
    outbox_inbox::migrate(&db.pool)
        .await
        .expect("the inbox schema applies");
    outbox_inbox::migrate(&db.pool)
        .await
        .expect("applying the inbox schema again is a no-op");
    sqlx::raw_sql(
        "CREATE TABLE applied (seq bigserial, dedupe_key text NOT NULL, ordering_key text NOT NULL)",
    )
    .execute(&db.pool)
    .await
    .expect("create the side-effect table");
    db
}

/// Publishes `messages` through the outbox and the dispatcher (each publish gets new ids).
async fn publish(db: &TestDb, messages: &[NewMessage]) {
    enqueue(&db.pool, messages).await;
    let dispatcher = test_dispatcher::build(
        &db.pool,
        test_dispatcher::real_publisher().await,
        test_dispatcher::config(),
    )
    .await;
    test_dispatcher::drain(&dispatcher).await;
}

/// The handler of these tests: one `applied` row per run.
async fn apply(tx: &mut PgConnection, dedupe_key: &str, ordering_key: &str) -> sqlx::Result<()> {
    sqlx::query("INSERT INTO applied (dedupe_key, ordering_key) VALUES ($1, $2)")
        .bind(dedupe_key)
        .bind(ordering_key)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

/// How many times the handler's effect exists per dedupe key.
async fn applied_per_key(pool: &PgPool) -> HashMap<String, i64> {
    sqlx::query_as("SELECT dedupe_key, count(*) FROM applied GROUP BY dedupe_key")
        .fetch_all(pool)
        .await
        .expect("read applied")
        .into_iter()
        .collect()
}

#[tokio::test]
async fn the_handler_runs_once_per_dedupe_key_through_republishes_and_redeliveries() {
    let db = consumer_db().await;
    let topic = TestTopic::new(false).await;
    let messages: Vec<_> = (0..40).map(|i| invoice_event(&topic.topic, i)).collect();
    // Published twice, as a dispatcher crash between publish and settle does: new message ids.
    publish(&db, &messages).await;
    publish(&db, &messages).await;

    let inbox = Inbox::new(db.pool.clone());
    let mut stream = pubsub::stream(&topic.subscription).await;
    let mut withheld = HashSet::new();
    let mut acked = HashSet::new();
    let mut deliveries = 0;
    while acked.len() < 2 * messages.len() {
        let (message, ack) = tokio::time::timeout(Duration::from_secs(30), stream.next())
            .await
            .unwrap_or_else(|_| panic!("no delivery for 30 s; {} of 80 acked", acked.len()))
            .expect("the stream is open")
            .expect("a delivery");
        deliveries += 1;
        let key = dedupe_key(&message, "dedupe_key").expect("outbox messages carry a dedupe key");
        let outcome = inbox
            .process(CONSUMER, key, async |tx: &mut PgConnection| {
                apply(tx, key, "").await
            })
            .await;
        assert!(outcome.should_ack(), "{outcome:?}");
        // The first delivery of every message id is not acked: Pub/Sub delivers it again.
        if withheld.insert(message.message_id.clone()) {
            ack.nack();
        } else {
            ack.ack();
            acked.insert(message.message_id.clone());
        }
    }

    let applied = applied_per_key(&db.pool).await;
    assert_eq!(applied.len(), 40, "every invoice applied");
    assert!(
        applied.values().all(|&n| n == 1),
        "each key's effect exactly once: {applied:?}"
    );
    let counters = inbox.counters();
    assert_eq!(counters.processed, 40, "{counters:?}");
    assert_eq!(counters.duplicates, deliveries - 40, "{counters:?}");
    assert!(
        deliveries >= 160,
        "2 publishes × 2 deliveries each, got {deliveries}"
    );
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM pubsub_inbox").await,
        40,
        "one inbox row per key"
    );
}

#[tokio::test]
async fn a_handler_error_rolls_back_its_writes_and_the_redelivery_is_processed() {
    let db = consumer_db().await;
    let topic = TestTopic::new(false).await;
    let messages: Vec<_> = (0..10).map(|i| invoice_event(&topic.topic, i)).collect();
    publish(&db, &messages).await;

    let inbox = Inbox::new(db.pool.clone());
    let failed_once = AtomicBool::new(false);
    let mut stream = pubsub::stream(&topic.subscription).await;
    while inbox.counters().processed < 10 {
        let (message, ack) = tokio::time::timeout(Duration::from_secs(30), stream.next())
            .await
            .expect("a delivery within 30 s")
            .expect("the stream is open")
            .expect("a delivery");
        let key = dedupe_key(&message, "dedupe_key")
            .expect("a dedupe key")
            .to_owned();
        let outcome = process_message(
            &inbox,
            CONSUMER,
            "dedupe_key",
            &message,
            ack,
            async |tx: &mut PgConnection| {
                apply(tx, &key, "").await.map_err(|e| e.to_string())?;
                // invoice-3 fails once, after its write.
                if key == "invoice-3" && !failed_once.swap(true, Ordering::SeqCst) {
                    return Err("the ledger service said no".to_owned());
                }
                Ok(())
            },
        )
        .await;
        if let Outcome::Failed(failure) = outcome {
            assert!(matches!(failure, Failure::Handler(_)), "{failure}");
            assert_eq!(key, "invoice-3");
            let written = count(
                &db.pool,
                "SELECT (SELECT count(*) FROM applied WHERE dedupe_key = 'invoice-3')
                      + (SELECT count(*) FROM pubsub_inbox WHERE dedupe_key = 'invoice-3')",
            )
            .await;
            assert_eq!(written, 0, "the failed handler's write and key rolled back");
        }
    }

    assert!(
        failed_once.load(Ordering::SeqCst),
        "the handler failed once"
    );
    let applied = applied_per_key(&db.pool).await;
    assert_eq!(applied.len(), 10, "every invoice applied: {applied:?}");
    assert!(applied.values().all(|&n| n == 1), "once each: {applied:?}");
    let counters = inbox.counters();
    assert_eq!(
        (counters.processed, counters.failures),
        (10, 1),
        "{counters:?}"
    );
}

#[tokio::test]
async fn an_ordered_subscription_is_applied_in_key_order_through_a_handler_failure() {
    let db = consumer_db().await;
    let topic = TestTopic::new(true).await;
    let (keys, per_key) = (6, 15);
    publish(&db, &keyed_messages(&topic.topic, keys, per_key)).await;

    let inbox = Inbox::new(db.pool.clone());
    let failed_once = AtomicBool::new(false);
    let options = ConsumeOptions {
        lanes: 4,
        stop_when_idle: Some(Duration::from_secs(3)),
        ..ConsumeOptions::new(CONSUMER)
    };
    let handler = async |message: &google_cloud_pubsub::model::Message, tx: &mut PgConnection| {
        let key = dedupe_key(message, "dedupe_key").unwrap_or_default();
        apply(tx, key, &message.ordering_key)
            .await
            .map_err(|e| e.to_string())?;
        // The middle of key 2 fails once: the rest of key 2 must wait for its redelivery.
        if key == keyed_dedupe(2, 7) && !failed_once.swap(true, Ordering::SeqCst) {
            return Err("fails once".to_owned());
        }
        Ok(())
    };
    let stream = pubsub::stream(&topic.subscription).await;
    consume(&inbox, stream, &options, handler, std::future::pending())
        .await
        .expect("the stream stays healthy");

    assert!(
        failed_once.load(Ordering::SeqCst),
        "the handler failed once"
    );
    let rows: Vec<(String, String)> =
        sqlx::query_as("SELECT ordering_key, dedupe_key FROM applied ORDER BY seq")
            .fetch_all(&db.pool)
            .await
            .expect("read applied");
    assert_eq!(rows.len(), keys * per_key, "every message once: {rows:?}");
    for key in 0..keys {
        let order: Vec<&str> = rows
            .iter()
            .filter(|(k, _)| *k == format!("key-{key:03}"))
            .map(|(_, d)| d.as_str())
            .collect();
        let expected: Vec<String> = (0..per_key).map(|seq| keyed_dedupe(key, seq)).collect();
        assert_eq!(order, expected, "key {key} applied in publish order");
    }
    assert_eq!(inbox.counters().failures, 1);
}

// The emulator never ends the streaming pull of a SIGKILLed client (its HTTP adapter drops the
// connection reset: "exceptionCaught() ... reached the tail of the pipeline" in its log); the
// dead stream's pusher keeps taking 100 messages every 50 ms as their deadlines expire, so each
// kill leaves a stream that competes with the live ones for every redelivery, forever. Real
// Pub/Sub drops a dead client's stream. Here the final phase runs three consumers (replicas
// sharing the inbox, as a deployment would) so the live streams win most redeliveries, with a
// budget for the rest (with two, the last ~1,500 invoices took 50-200 s); docs/consuming.md,
// "The Pub/Sub emulator differs".
#[tokio::test]
async fn a_consumer_killed_at_random_points_applies_every_event_exactly_once() {
    let db = TestDb::new().await;
    // Short leases (the subscription's deadline and the client's extension): what a killed
    // consumer held comes back about 10 s later.
    let topic = TestTopic::with_ack_deadline(false, 10).await;
    let n = 2_000;
    let messages: Vec<_> = (0..n).map(|i| invoice_event(&topic.topic, i)).collect();
    publish(&db, &messages).await;
    // A tenth re-published as well (new message ids): duplicates in the stream from the start.
    publish(&db, &messages[..n / 10]).await;

    let args = [
        "--subscription",
        topic.subscription.as_str(),
        "--lanes",
        "4",
        "--lease-extension",
        "10s",
    ];
    let envs = [
        ("DATABASE_URL", db.url().to_owned()),
        ("PUBSUB_EMULATOR_HOST", harness::env::pubsub_emulator_host()),
    ];
    let invoices = async || {
        // Before the consumer created its table there is none.
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM invoice")
            .fetch_one(&db.pool)
            .await
            .unwrap_or(0)
    };
    let mut at_kill = Vec::new();
    for round in 0..3 {
        let consumer = consumer(&args, &envs);
        let before = invoices().await;
        // Kill only once this run is applying events, at a random instant after that.
        wait_until(
            &format!("run {round} applies events"),
            Duration::from_secs(30),
            || async {
                match invoices().await {
                    now if now > before => Ok(()),
                    now => Err(format!("{now} invoices; log:\n{}", consumer.log())),
                }
            },
        )
        .await;
        tokio::time::sleep(Duration::from_millis(fastrand::u64(0..300))).await;
        consumer.signal("KILL");
        let mut consumer = consumer;
        let _ = consumer.child.wait().await;
        at_kill.push(invoices().await);
    }
    eprintln!("invoices applied at each SIGKILL: {at_kill:?} of {n}");
    assert!(
        at_kill.iter().all(|&k| (k as usize) < n),
        "every kill landed mid-stream: invoices at each kill {at_kill:?}"
    );

    // The last phase applies the rest: what the killed runs held comes back within the ack
    // deadline (10 s), but the killed runs' streams (module comment above) keep taking a share
    // of every redelivery.
    let replicas = [(); 3].map(|()| consumer(&args, &envs));
    let started = std::time::Instant::now();
    wait_until(
        "every invoice applied",
        Duration::from_secs(300),
        || async {
            match invoices().await {
                now if now as usize >= n => Ok(()),
                now => Err(format!(
                    "{now} of {n} invoices; log:\n{}",
                    replicas[0].log()
                )),
            }
        },
    )
    .await;
    eprintln!(
        "the last phase applied the rest in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    // Let redeliveries of what the killed runs held (ack deadline 10 s) arrive and be dropped.
    tokio::time::sleep(Duration::from_secs(12)).await;
    let logs: Vec<_> = replicas.iter().map(|p| p.log.clone()).collect();
    harness::process::terminate_all(replicas.into()).await;
    let log: String = logs
        .iter()
        .map(|path| std::fs::read_to_string(path).unwrap_or_default())
        .collect::<Vec<_>>()
        .join("\n---\n");
    for summary in log
        .lines()
        .filter(|l| l.starts_with("invoice_consumer: processed"))
    {
        eprintln!("last phase: {summary}");
    }

    let (invoices, applied, over_once): (i64, i64, i64) = sqlx::query_as(
        "SELECT count(*), sum(events_applied)::bigint, count(*) FILTER (WHERE events_applied <> 1)
         FROM invoice",
    )
    .fetch_one(&db.pool)
    .await
    .expect("read invoices");
    assert_eq!(
        (invoices, applied, over_once),
        (n as i64, n as i64, 0),
        "each event applied exactly once (kills at {at_kill:?}); log:\n{log}"
    );
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM pubsub_inbox").await,
        n as i64
    );
}

#[tokio::test]
async fn retention_purges_only_rows_older_than_the_window_in_batches() {
    let db = consumer_db().await;
    let inbox = Inbox::new(db.pool.clone());
    for i in 0..7 {
        let key = format!("invoice-{i}");
        let outcome = inbox
            .process(CONSUMER, &key, async |tx: &mut PgConnection| {
                apply(tx, &key, "").await
            })
            .await;
        assert!(matches!(outcome, Outcome::Processed), "{outcome:?}");
    }
    sqlx::query(
        "UPDATE pubsub_inbox SET processed_at = now() - interval '10 days'
         WHERE dedupe_key <> 'invoice-6'",
    )
    .execute(&db.pool)
    .await
    .expect("age six rows");

    let purged = inbox
        .purge(Duration::from_secs(7 * 24 * 3600), 4)
        .await
        .expect("the purge runs");
    assert_eq!(purged, 6, "the six old rows, in batches of 4");
    assert_eq!(inbox.counters().purged, 6);
    let left: Vec<String> = sqlx::query_scalar("SELECT dedupe_key FROM pubsub_inbox")
        .fetch_all(&db.pool)
        .await
        .expect("read the inbox");
    assert_eq!(left, ["invoice-6"], "the recent row stays");
    // Inside the window a key is still a duplicate.
    let again = inbox
        .process(CONSUMER, "invoice-6", async |_: &mut PgConnection| {
            Ok::<_, sqlx::Error>(())
        })
        .await;
    assert!(matches!(again, Outcome::Duplicate), "{again:?}");
}
