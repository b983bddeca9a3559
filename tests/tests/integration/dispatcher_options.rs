//! Dispatcher options: topic filter, retention and purge, LISTEN/NOTIFY wake-ups.

use std::time::{Duration, Instant};

use chrono::Utc;

use harness::db::TestDb;
use harness::dispatcher::{self as test_dispatcher, Running, real_publisher};
use harness::fixtures::{enqueue, message, outbox_dedupe_keys, outbox_rows};
use harness::pubsub::{Received, TestTopic};
use outbox_dispatcher::BatchOutcome;
use outbox_shared::store::{notify, outbox};

#[tokio::test]
async fn a_topic_filter_publishes_only_its_topic_and_leaves_the_rest() {
    let db = TestDb::new().await;
    let (mine, other) = (TestTopic::new(false).await, TestTopic::new(false).await);
    enqueue(
        &db.pool,
        &[
            message(&mine.topic, "mine-1", &[]),
            message(&other.topic, "other-1", &[]),
            message(&mine.topic, "mine-2", &[]),
        ],
    )
    .await;
    let mut config = test_dispatcher::config();
    config.batch.topics = Some(vec![mine.topic.clone()]);
    let d = test_dispatcher::build(&db.pool, real_publisher().await, config).await;
    let outcome = d.run_batch(Utc::now()).await.expect("batch");
    assert!(
        matches!(outcome, BatchOutcome::Settled(s) if s.published == 2),
        "{outcome:?}"
    );
    assert_eq!(
        d.run_batch(Utc::now()).await.expect("batch"),
        BatchOutcome::Empty,
        "nothing else is ours"
    );
    let left = outbox_dedupe_keys(&db.pool).await;
    assert_eq!(
        left,
        vec!["other-1"],
        "the other topic's row waits for its own dispatcher"
    );
    let got = mine.pull(2, Duration::from_secs(5)).await;
    let mut keys: Vec<&str> = got.iter().map(Received::dedupe_key).collect();
    keys.sort_unstable();
    assert_eq!(keys, vec!["mine-1", "mine-2"]);
}

#[tokio::test]
async fn retained_rows_record_the_message_id_and_are_purged_after_the_retention() {
    let db = TestDb::new().await;
    let topic = TestTopic::new(false).await;
    enqueue(&db.pool, &[message(&topic.topic, "kept", &[])]).await;
    let mut config = test_dispatcher::config();
    config.retention = Duration::from_secs(3600);
    config.batch.retain_published = true;
    let d = test_dispatcher::build(&db.pool, real_publisher().await, config).await;
    d.run_batch(Utc::now()).await.expect("batch");
    let (published_at, message_id): (Option<chrono::DateTime<Utc>>, Option<String>) =
        sqlx::query_as(
            "SELECT published_at, pubsub_message_id FROM pubsub_outbox WHERE dedupe_key = 'kept'",
        )
        .fetch_one(&db.pool)
        .await
        .expect("the row is retained");
    assert!(published_at.is_some(), "published_at is recorded");
    let got = topic.pull(1, Duration::from_secs(5)).await;
    assert_eq!(
        message_id.as_deref(),
        Some(got[0].message_id.as_str()),
        "the Pub/Sub message id is recorded"
    );
    assert_eq!(
        d.run_batch(Utc::now()).await.expect("batch"),
        BatchOutcome::Empty,
        "a published row is not claimed again"
    );

    let mut conn = db.pool.acquire().await.expect("conn");
    let young = outbox::purge_published(&mut conn, Utc::now() - chrono::Duration::hours(1), 1000)
        .await
        .expect("purge");
    assert_eq!(young, 0, "rows younger than the retention stay");
    let old = outbox::purge_published(&mut conn, Utc::now() + chrono::Duration::seconds(1), 1000)
        .await
        .expect("purge");
    assert_eq!(old, 1, "rows older than the retention are purged");
    assert_eq!(outbox_rows(&db.pool).await, 0);
}

#[tokio::test]
async fn a_notify_wakes_an_idle_dispatcher_long_before_its_next_poll() {
    let db = TestDb::new().await;
    let topic = TestTopic::new(false).await;
    // Polling every 60 s: only a NOTIFY can explain a prompt publish.
    let mut config = test_dispatcher::config();
    config.workers = 1;
    config.idle.poll_interval = Duration::from_secs(60);
    config.idle.max_poll_interval = Duration::from_secs(60);
    config.liveness_timeout = Duration::from_secs(300);
    let service =
        Running::start(test_dispatcher::build_service(&db, real_publisher().await, config).await);
    // Let the worker find nothing and go idle, and the listener connect.
    tokio::time::sleep(Duration::from_secs(2)).await;

    let started = Instant::now();
    let mut tx = db.pool.begin().await.expect("begin");
    outbox::enqueue_batch(&mut tx, &[message(&topic.topic, "woken", &[])])
        .await
        .expect("enqueue");
    notify::notify(&mut tx, notify::DEFAULT_CHANNEL)
        .await
        .expect("notify");
    tx.commit().await.expect("commit");
    while outbox_rows(&db.pool).await > 0 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "published long before the 60 s poll"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!("NOTIFY to publish: {:?}", started.elapsed());
    service.stop().await;
    assert_eq!(topic.pull(1, Duration::from_secs(5)).await.len(), 1);
}
