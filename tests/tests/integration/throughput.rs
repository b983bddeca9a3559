//! Throughput structure: one process keeps several publish requests in flight (each worker's
//! batch is requests of its own on the shared connections), a batch over many ordering keys
//! sends one request per key, all at once, and one NOTIFY wakes one idle worker, not all.

use std::time::Duration;

use harness::db::TestDb;
use harness::dispatcher::{self as test_dispatcher, Running};
use harness::fixtures::{enqueue_numbered, message};
use harness::process::http_get;
use harness::proxy::TcpProxy;
use harness::pubsub::TestTopic;
use harness::wait::drained;
use outbox_shared::{DEFAULT_NOTIFY_CHANNEL, enqueue_batch, notify};

fn counter(metrics: &str, name: &str) -> u64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

#[tokio::test]
async fn a_process_keeps_several_publish_requests_in_flight_to_a_slow_sink() {
    let db = TestDb::new().await;
    let topic = TestTopic::new(false).await;
    // 50 ms each way: a stand-in for the round trip to real Pub/Sub.
    let proxy = TcpProxy::start(&harness::env::pubsub_emulator_host()).await;
    proxy.set_delay(Duration::from_millis(50));
    enqueue_numbered(&db.pool, &topic.topic, 2000).await;
    let mut config = test_dispatcher::config_for(&proxy.addr());
    config.workers = 4;
    config.batch.batch_size = 50;
    let publisher = test_dispatcher::publisher_at(&proxy.addr()).await;
    let service = Running::start(test_dispatcher::build_service(&db, publisher, config).await);
    drained(&db.pool, Duration::from_secs(60)).await;
    service.stop().await;
    let in_flight = proxy.max_requests_in_flight();
    eprintln!(
        "THROUGHPUT most publish requests in flight from one process with 4 workers: {in_flight}"
    );
    assert!(
        in_flight >= 3,
        "4 workers keep several requests in flight, not one at a time: {in_flight}"
    );
    assert_eq!(topic.pull(2000, Duration::from_secs(3)).await.len(), 2000);
}

#[tokio::test]
async fn a_batch_over_many_keys_sends_one_request_per_key_all_in_flight_at_once() {
    let db = TestDb::new().await;
    let topic = TestTopic::new(true).await;
    let proxy = TcpProxy::start(&harness::env::pubsub_emulator_host()).await;
    proxy.set_delay(Duration::from_millis(50));
    // 100 keys: every key's request at once (4 connections carry up to 400 calls).
    let (keys, per_key) = (100, 2);
    harness::fixtures::enqueue(
        &db.pool,
        &harness::fixtures::keyed_messages(&topic.topic, keys, per_key),
    )
    .await;
    let mut config = test_dispatcher::config_for(&proxy.addr());
    config.workers = 1;
    config.batch.batch_size = 200;
    let publisher = test_dispatcher::publisher_at(&proxy.addr()).await;
    let service = Running::start(test_dispatcher::build_service(&db, publisher, config).await);
    drained(&db.pool, Duration::from_secs(60)).await;
    service.stop().await;
    let (sent, in_flight) = (proxy.requests_sent(), proxy.max_requests_in_flight());
    eprintln!(
        "KEYS: {keys} keys x {per_key} rows, one worker: {sent} publish requests, at most {in_flight} at once"
    );
    assert_eq!(
        sent,
        keys as u64 + 1,
        "one request per key, with all of its rows, and the start-up probe (GetTopic)"
    );
    assert!(
        (50..=100).contains(&in_flight),
        "the keys' requests are in flight together, not one after the other: {in_flight}"
    );
    let received = topic.pull(keys * per_key, Duration::from_secs(3)).await;
    assert_eq!(received.len(), keys * per_key);
}

#[tokio::test]
async fn one_notify_wakes_one_idle_worker() {
    let db = TestDb::new().await;
    let topic = TestTopic::new(false).await;
    let mut config = test_dispatcher::config();
    config.workers = 4;
    // Polling every 60 s: every claim below comes from a notification.
    config.idle.poll_interval = Duration::from_secs(60);
    config.idle.max_poll_interval = Duration::from_secs(60);
    config.liveness_timeout = Duration::from_secs(300);
    let service = Running::start(
        test_dispatcher::build_service(&db, test_dispatcher::real_publisher().await, config).await,
    );
    let addr = service.addr();
    // Let every worker find nothing and go idle, and the listener connect.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = counter(
        &http_get(&addr, "/metrics").await.1,
        "outbox_empty_claims_total",
    );

    let mut tx = db.pool.begin().await.expect("begin");
    enqueue_batch(&mut tx, &[message(&topic.topic, "woken", &[])])
        .await
        .expect("enqueue");
    notify(&mut tx, DEFAULT_NOTIFY_CHANNEL)
        .await
        .expect("notify");
    tx.commit().await.expect("commit");
    drained(&db.pool, Duration::from_secs(10)).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let metrics = http_get(&addr, "/metrics").await.1;
    let empty = counter(&metrics, "outbox_empty_claims_total") - before;
    eprintln!("THROUGHPUT empty claims after one NOTIFY with 4 idle workers: {empty}");
    assert_eq!(counter(&metrics, "outbox_published_total"), 1);
    assert!(
        empty <= 1,
        "one worker woke (its follow-up claim found nothing); the other three slept: {empty}"
    );
    service.stop().await;
}
