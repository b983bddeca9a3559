//! A bad message is never the good messages' problem: a locally rejected message holds its key
//! (and only its key) until an operator acts; a message Pub/Sub refuses is isolated from the
//! request it shared, so only it is dead-lettered.

use std::time::Duration;

use harness::db::TestDb;
use harness::dispatcher::{self as test_dispatcher, drain, real_publisher};
use harness::fixtures::{dead_letters, enqueue, outbox_dedupe_keys};
use harness::proxy::TcpProxy;
use harness::pubsub::{Received, TestTopic};
use outbox_shared::NewMessage;
use outbox_shared::store::dead_letter;

fn keyed(topic: &str, dedupe: &str, key: &str) -> NewMessage {
    NewMessage::new(topic, dedupe, format!("payload of {dedupe}").into_bytes())
        .with_ordering_key(key)
}

fn sorted_keys(received: &[Received]) -> Vec<String> {
    let mut keys: Vec<String> = received.iter().map(|m| m.dedupe_key().to_owned()).collect();
    keys.sort();
    keys
}

async fn dead_letter_id(db: &TestDb, dedupe_key: &str) -> i64 {
    let mut conn = db.pool.acquire().await.expect("conn");
    dead_letter::list(&mut conn, None, 100)
        .await
        .expect("dead letters")
        .into_iter()
        .find(|d| d.dedupe_key == dedupe_key)
        .map(|d| d.id)
        .unwrap_or_else(|| panic!("{dedupe_key} is dead-lettered"))
}

#[tokio::test]
async fn a_locally_rejected_message_holds_its_key_until_discarded_and_a_skip_topic_goes_on() {
    let db = TestDb::new().await;
    let (blocking, skipping) = (TestTopic::new(true).await, TestTopic::new(true).await);
    let too_long = "v".repeat(2000);
    let mut batch = Vec::new();
    for t in [&blocking.topic, &skipping.topic] {
        let tag = if *t == blocking.topic { "b" } else { "s" };
        batch.push(keyed(t, &format!("{tag}-ok-1"), "k"));
        batch.push(keyed(t, &format!("{tag}-bad"), "k").with_attribute("note", too_long.as_str()));
        batch.push(keyed(t, &format!("{tag}-ok-3"), "k"));
    }
    enqueue(&db.pool, &batch).await;
    let mut config = test_dispatcher::config();
    config.batch.skip_dead_letter_topics = vec![skipping.topic.clone()];
    let d = test_dispatcher::build(&db.pool, real_publisher().await, config).await;
    drain(&d).await;

    assert_eq!(
        sorted_keys(&skipping.pull(2, Duration::from_secs(3)).await),
        vec!["s-ok-1", "s-ok-3"],
        "with the skip policy the key goes on past its dead letter"
    );
    // Ordered subscriptions: pull each subscription once, at the end (an ack still in flight when a
    // pull stops would hold the key back for the ack deadline).
    assert_eq!(
        outbox_dedupe_keys(&db.pool).await,
        vec!["b-ok-3"],
        "by default ok-3 waits untouched behind the rejected message (ok-1 went out)"
    );
    assert_eq!(
        dead_letters(&db.pool).await,
        2,
        "both rejected messages are dead-lettered"
    );

    // A replay of a message that is still invalid is rejected again and keeps the key held.
    let mut conn = db.pool.acquire().await.expect("conn");
    dead_letter::replay(&mut conn, &[dead_letter_id(&db, "b-bad").await])
        .await
        .expect("replay");
    drop(conn);
    drain(&d).await;
    assert_eq!(
        outbox_dedupe_keys(&db.pool).await,
        vec!["b-ok-3"],
        "ok-3 still waits"
    );

    let mut conn = db.pool.acquire().await.expect("conn");
    dead_letter::discard(&mut conn, &[dead_letter_id(&db, "b-bad").await])
        .await
        .expect("discard");
    drop(conn);
    drain(&d).await;
    assert!(
        outbox_dedupe_keys(&db.pool).await.is_empty(),
        "discarding the dead letter releases the key"
    );
    let arrived: Vec<String> = blocking
        .pull(3, Duration::from_secs(3))
        .await
        .iter()
        .map(|m| m.dedupe_key().to_owned())
        .collect();
    assert_eq!(
        arrived,
        vec!["b-ok-1", "b-ok-3"],
        "in order, without the bad one"
    );
}

#[tokio::test]
async fn a_message_the_schema_refuses_is_isolated_and_only_it_is_dead_lettered() {
    let db = TestDb::new().await;
    let topic = TestTopic::with_schema(true).await;
    let valid = |n: usize| format!(r#"{{"amount": {n}}}"#).into_bytes();
    let invalid = br#"{"amount": "not a number"}"#.to_vec();
    let mut batch: Vec<NewMessage> = (0..10)
        .map(|i| NewMessage::new(&topic.topic, format!("good-{i:02}"), valid(i)))
        .collect();
    batch.push(NewMessage::new(
        &topic.topic,
        "bad-unkeyed",
        invalid.clone(),
    ));
    batch.extend((10..20).map(|i| NewMessage::new(&topic.topic, format!("good-{i:02}"), valid(i))));
    batch.push(NewMessage::new(&topic.topic, "ok-1", valid(1)).with_ordering_key("k"));
    batch.push(NewMessage::new(&topic.topic, "bad", invalid).with_ordering_key("k"));
    batch.push(NewMessage::new(&topic.topic, "ok-3", valid(3)).with_ordering_key("k"));
    enqueue(&db.pool, &batch).await;

    let d =
        test_dispatcher::build(&db.pool, real_publisher().await, test_dispatcher::config()).await;
    drain(&d).await;

    let received = topic.pull(21, Duration::from_secs(3)).await;
    let mut expected: Vec<String> = (0..20).map(|i| format!("good-{i:02}")).collect();
    expected.push("ok-1".to_owned());
    expected.sort();
    assert_eq!(
        sorted_keys(&received),
        expected,
        "every good unkeyed message and ok-1 arrived"
    );
    let mut conn = db.pool.acquire().await.expect("conn");
    let mut dead: Vec<(String, String)> = dead_letter::list(&mut conn, None, 100)
        .await
        .expect("dead letters")
        .into_iter()
        .map(|d| (d.dedupe_key, d.error_kind))
        .collect();
    dead.sort();
    assert_eq!(
        dead,
        vec![
            ("bad".to_owned(), "permanent".to_owned()),
            ("bad-unkeyed".to_owned(), "permanent".to_owned())
        ],
        "exactly the invalid messages are dead-lettered"
    );
    assert_eq!(
        outbox_dedupe_keys(&db.pool).await,
        vec!["ok-3"],
        "ok-3 waits behind bad"
    );
    let metrics = d.encode_metrics();
    let isolations = metrics
        .lines()
        .find_map(|l| l.strip_prefix("outbox_isolations_total "))
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0);
    assert!(
        isolations >= 1.0,
        "the isolation metric counts it:\n{metrics}"
    );
    // 24 messages went in requests Pub/Sub refused whole; 2 of them were refused on their own.
    assert!(
        metrics.contains("outbox_publish_failures_total{kind=\"permanent\"} 2\n"),
        "permanent failures count the refused messages, not the messages of a refused request:\n{metrics}"
    );
}

#[tokio::test]
async fn in_a_poison_storm_a_topics_unkeyed_rows_go_in_parts_and_only_the_refused_are_dead_lettered()
 {
    let db = TestDb::new().await;
    let topic = TestTopic::with_schema(false).await;
    let proxy = TcpProxy::start(&harness::env::pubsub_emulator_host()).await;
    let valid = |n: usize| format!(r#"{{"amount": {n}}}"#).into_bytes();
    let invalid = || br#"{"amount": "not a number"}"#.to_vec();
    // Four batches of 64 rows: poison in the first (row 10) and the second (rows 5 and 40, in
    // different sixteenths), none in the third and fourth.
    let bad = |batch: usize, row: usize| matches!((batch, row), (0, 10) | (1, 5) | (1, 40));
    let rows: Vec<NewMessage> = (0..4)
        .flat_map(|b| (0..64).map(move |r| (b, r)))
        .map(|(b, r)| {
            let name = format!("b{b}-r{r:02}");
            let payload = if bad(b, r) { invalid() } else { valid(r) };
            NewMessage::new(&topic.topic, name, payload)
        })
        .collect();
    enqueue(&db.pool, &rows).await;
    let mut config = test_dispatcher::config_for(&proxy.addr());
    config.workers = 1;
    config.batch.batch_size = 64;
    let publisher = test_dispatcher::publisher_at(&proxy.addr()).await;
    let d = test_dispatcher::build(&db.pool, publisher, config).await;
    let mut requests = Vec::new();
    for _ in 0..4 {
        let before = proxy.requests_sent();
        d.run_batch(chrono::Utc::now()).await.expect("a batch");
        requests.push(proxy.requests_sent() - before);
    }
    assert_eq!(
        requests,
        vec![
            // The whole batch refused in one request, then 16 parts of 4, then the refused
            // part's 4 messages alone.
            1 + 16 + 4,
            // In the storm: straight in 16 parts (no doomed first request), each refused part's
            // 4 messages alone.
            16 + 4 + 4,
            // Still in the storm: 16 parts, all published, which ends it.
            16,
            // Over: one request again.
            1,
        ],
        "publish requests per batch"
    );
    let mut dead: Vec<String> =
        dead_letter::list(&mut db.pool.acquire().await.expect("conn"), None, 100)
            .await
            .expect("dead letters")
            .into_iter()
            .map(|d| d.dedupe_key)
            .collect();
    dead.sort();
    assert_eq!(
        dead,
        vec!["b0-r10", "b1-r05", "b1-r40"],
        "exactly the refused rows are dead-lettered"
    );
    let mut expected: Vec<String> = rows
        .iter()
        .map(|m| m.dedupe_key.clone())
        .filter(|k| !dead.contains(k))
        .collect();
    expected.sort();
    assert_eq!(
        sorted_keys(&topic.pull(expected.len(), Duration::from_secs(5)).await),
        expected,
        "every good row arrived"
    );
    assert!(
        outbox_dedupe_keys(&db.pool).await.is_empty(),
        "nothing left"
    );
}
