//! Claims start past what is published (issue #26; `outbox_shared::store::claim`, "Claims start
//! past what is published"): under a held snapshot a claim fetches only the rows above its floor,
//! and no row is lost or reordered by a floor: a replay below it goes out first, and a floor
//! never passes a row of a writer transaction still open (issue #49), however long it stays open.
//!
//! Costs are read from the transaction's own statistics (index entries read), not from a clock.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::Utc;
use outbox_dispatcher::Code;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

use harness::db::TestDb;
use harness::dispatcher::{self as test_dispatcher, Running, metric, real_publisher};
use harness::fixtures::{
    enqueue, enqueue_and_notify, keyed_dedupe as dedupe, keyed_messages, message,
};
use harness::ledger::DeliveryLedger;
use harness::pubsub::TestTopic;
use harness::wait::{drained, wait_until};
use outbox_dispatcher::config::DispatcherConfig;
use outbox_dispatcher::fault::{Fault, FaultInjector};
use outbox_shared::store::claim::{self, ClaimFilter, ClaimSession, KeyCursor, KeyFloor, settled};
use outbox_shared::store::dead_letter;

const KEYS: usize = 200;

/// Index entries the current transaction's scans of the outbox's indexes read: a live row's
/// and a published one's alike (under a held snapshot each of those also costs a fetch of the
/// row, to learn it is gone).
async fn entries_read(tx: &mut sqlx::PgConnection) -> i64 {
    sqlx::query_scalar(
        "SELECT sum(pg_stat_get_xact_tuples_returned(indexrelid))::bigint
         FROM pg_index WHERE indrelid = 'pubsub_outbox'::regclass",
    )
    .fetch_one(&mut *tx)
    .await
    .expect("read the transaction's index statistics")
}

/// A session of its own (a session's not yet reported counts of earlier transactions show in
/// the `xact` functions too).
async fn session(db: &TestDb) -> PgPool {
    PgPoolOptions::new()
        .max_connections(1)
        .connect_with(db.options())
        .await
        .expect("a session of its own")
}

/// A REPEATABLE READ transaction on `pool` that has read the outbox: its snapshot is held (as
/// a report or a backup holds one) until it ends.
async fn hold_snapshot(pool: &PgPool) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut tx = pool
        .begin_with("BEGIN ISOLATION LEVEL REPEATABLE READ")
        .await
        .expect("begin a snapshot");
    sqlx::query("SELECT count(*) FROM pubsub_outbox")
        .execute(&mut *tx)
        .await
        .expect("take the snapshot");
    tx
}

/// The walk over every key from `floor`: the heads it saw and the index entries it read.
async fn walk_cost(db: &TestDb, floor: &KeyFloor) -> (Vec<(String, Option<i64>)>, i64) {
    let pool = session(db).await;
    let mut tx = ClaimSession::new(Duration::from_secs(60))
        .begin(&pool)
        .await
        .expect("begin");
    let walk = claim::walk_keys(&mut tx, &KeyCursor::default(), 10_000, floor)
        .await
        .expect("walk");
    let read = entries_read(&mut tx).await;
    tx.rollback().await.expect("rollback");
    pool.close().await;
    let heads = walk
        .seen
        .into_iter()
        .map(|s| (s.ordering_key, s.head))
        .collect();
    (heads, read)
}

/// An ordered claim of every key from `floor`, a share of 5 rows per key: the index entries it
/// read.
async fn ordered_claim_cost(db: &TestDb, floor: &KeyFloor) -> i64 {
    let pool = session(db).await;
    let mut tx = ClaimSession::new(Duration::from_secs(60))
        .begin(&pool)
        .await
        .expect("begin");
    let ordered = claim::OrderedClaim {
        filter: ClaimFilter {
            now: Utc::now(),
            limit: (KEYS * 5) as i64,
            topics: None,
            excluded: &[],
        },
        scan_limit: 10_000,
        skip_dead_letter_topics: &[],
        max_keys: KEYS as i64,
    };
    let batch = claim::claim_ordered(&mut tx, &ordered, &KeyCursor::default(), floor)
        .await
        .expect("claim");
    assert_eq!(batch.messages.len(), KEYS * 4, "every live keyed row");
    let read = entries_read(&mut tx).await;
    tx.rollback().await.expect("rollback");
    pool.close().await;
    read
}

/// The unkeyed claim from `floor`: the ids it took and the index entries it read.
async fn unkeyed_cost(db: &TestDb, floor: Option<chrono::DateTime<Utc>>) -> (Vec<i64>, i64) {
    let pool = session(db).await;
    let mut tx = ClaimSession::new(Duration::from_secs(60))
        .begin(&pool)
        .await
        .expect("begin");
    let filter = ClaimFilter {
        now: Utc::now(),
        limit: 500,
        topics: None,
        excluded: &[],
    };
    let batch = claim::claim_batch(&mut tx, &filter, floor, 0)
        .await
        .expect("claim");
    let read = entries_read(&mut tx).await;
    tx.rollback().await.expect("rollback");
    pool.close().await;
    (batch.messages.iter().map(|m| m.id).collect(), read)
}

#[tokio::test]
async fn under_a_held_snapshot_claims_fetch_only_the_rows_above_their_floor() {
    let db = TestDb::new().await;
    // 40 keyed rows per key and 20,000 unkeyed ones, all due.
    sqlx::query(
        "INSERT INTO pubsub_outbox (topic, ordering_key, dedupe_key, payload, next_attempt_at)
         SELECT 'projects/p/topics/floors',
                CASE WHEN g <= $1 * 40 THEN 'key-' || lpad((g % $1)::text, 4, '0') END,
                'd-' || g, convert_to(repeat('x', 500), 'UTF8'),
                now() - interval '1 hour' + g * interval '1 ms'
         FROM generate_series(1, $1 * 40 + 20000) g",
    )
    .bind(KEYS as i64)
    .execute(&db.pool)
    .await
    .expect("fill the outbox");
    sqlx::query("VACUUM ANALYZE pubsub_outbox")
        .execute(&db.pool)
        .await
        .expect("vacuum");

    // A report holds a snapshot while most rows are published (deleted, as the dispatcher does):
    // every key keeps its last 4 rows, the unkeyed queue its newest 1,000.
    let holder = session(&db).await;
    let snapshot = hold_snapshot(&holder).await;
    let keyed_end = (KEYS * 40) as i64;
    sqlx::query("DELETE FROM pubsub_outbox WHERE id <= $1 - $2 OR (id > $1 AND id <= $1 + 19000)")
        .bind(keyed_end)
        .bind((KEYS * 4) as i64)
        .execute(&db.pool)
        .await
        .expect("publish most rows");

    // Keyed: every live row is above the floor (no old keys).
    let floor = KeyFloor {
        floor: keyed_end - (KEYS * 4) as i64 + 1,
        ..KeyFloor::default()
    };
    let (from_start, start_read) = walk_cost(&db, &KeyFloor::default()).await;
    let (from_floor, floor_read) = walk_cost(&db, &floor).await;
    println!(
        "keyed walk under the snapshot: {start_read} index entries from the start, {floor_read} from the floor"
    );
    assert_eq!(from_start.len(), KEYS, "the walk saw every key");
    assert_eq!(
        from_floor, from_start,
        "the same heads, from the floor or the start"
    );
    assert!(
        floor_read * 10 < start_read,
        "the walk from the floor read {floor_read} index entries, from the start {start_read}"
    );

    // A claim of every key from the floor reads each key's rows and no other key's: a key with
    // fewer rows than its share of the batch ends its walk at its own end, not in the next key's
    // published rows.
    let claim_read = ordered_claim_cost(&db, &floor).await;
    println!(
        "ordered claim of every key under the snapshot, from the floor: {claim_read} index entries"
    );
    assert!(
        claim_read < (KEYS * 4 * 3) as i64,
        "the claim read {claim_read} index entries for {} live rows",
        KEYS * 4
    );

    // An old key: its rows below the floor are found from its last head.
    let old_key = format!("key-{:04}", 7);
    let old_head = from_start
        .iter()
        .find(|(k, _)| *k == old_key)
        .and_then(|(_, h)| *h)
        .expect("the key's head");
    let above_all = KeyFloor {
        floor: keyed_end + 1,
        topics: vec!["projects/p/topics/floors".into()],
        keys: vec![old_key.clone()],
        heads: vec![old_head],
        ..KeyFloor::default()
    };
    let (seen, _) = walk_cost(&db, &above_all).await;
    assert_eq!(
        seen,
        vec![(old_key, Some(old_head))],
        "only the old key has rows below a floor above every row"
    );

    // Unkeyed: from the oldest live row's due time, the same rows.
    let oldest_live: chrono::DateTime<Utc> = sqlx::query_scalar(
        "SELECT min(next_attempt_at) FROM pubsub_outbox WHERE ordering_key IS NULL",
    )
    .fetch_one(&db.pool)
    .await
    .expect("oldest unkeyed row");
    let (from_start, start_read) = unkeyed_cost(&db, None).await;
    let (from_floor, floor_read) = unkeyed_cost(&db, Some(oldest_live)).await;
    println!(
        "unkeyed claim under the snapshot: {start_read} index entries from the start, {floor_read} from the floor"
    );
    assert_eq!(from_start.len(), 500);
    assert_eq!(
        from_floor, from_start,
        "the same rows, from the floor or the start"
    );
    assert!(
        floor_read * 10 < start_read,
        "the unkeyed claim from the floor read {floor_read} index entries, from the start {start_read}"
    );
    snapshot.rollback().await.expect("release the snapshot");
}

/// Test settings whose floors move fast: no margin, a probe every second.
fn fast_floors() -> DispatcherConfig {
    let mut config = test_dispatcher::config();
    config.batch.claim_floor_margin = Duration::ZERO;
    config.claim_probe_interval = Duration::from_secs(1);
    config
}

/// Waits until the running dispatcher's keyed floor passed a key held behind a dead letter
/// (it is then an old key).
async fn floor_passed_a_held_key(running: &Running) {
    wait_until(
        "the floor passes the held key",
        Duration::from_secs(20),
        || {
            let addr = running.addr();
            async move {
                let old = metric(&addr, "outbox_old_keys").await;
                if old >= 1.0 {
                    Ok(())
                } else {
                    Err(format!("{old} old keys"))
                }
            }
        },
    )
    .await;
}

/// The dedupe keys of `key`'s messages in the order they arrived on the ordered subscription.
fn arrival_order(received: &[harness::pubsub::Received], key: usize) -> Vec<String> {
    received
        .iter()
        .map(|r| r.dedupe_key())
        .filter(|k| k.starts_with(&format!("k{key:03}-")))
        .map(str::to_owned)
        .collect()
}

#[tokio::test]
async fn a_replay_below_the_floor_goes_out_before_the_rows_that_waited_behind_it() {
    let db = TestDb::new().await;
    let topic = TestTopic::new(true).await;
    let (keys, per_key) = (3, 6);
    enqueue(&db.pool, &keyed_messages(&topic.topic, keys, per_key)).await;
    // Key 1's third message is refused on its first two publishes (the batch, then alone): it is
    // dead-lettered and key 1 waits behind it.
    let publisher = FaultInjector::passthrough(real_publisher().await);
    publisher.fail(
        &dedupe(1, 2),
        Fault {
            code: Code::InvalidArgument,
            times: Some(2),
        },
    );
    let d = test_dispatcher::build_service(&db, publisher, fast_floors()).await;
    let running = Running::start(d);
    floor_passed_a_held_key(&running).await;

    let mut conn = db.pool.acquire().await.expect("conn");
    let dead = dead_letter::list(&mut conn, None, 10)
        .await
        .expect("dead letters");
    assert_eq!(dead.len(), 1, "the refused message is the only dead letter");
    dead_letter::replay(&mut conn, &[dead[0].id])
        .await
        .expect("replay");
    drop(conn);
    drained(&db.pool, Duration::from_secs(30)).await;
    running.stop().await;

    let received = topic.pull(keys * per_key, Duration::from_secs(5)).await;
    for key in 0..keys {
        let expected: Vec<String> = (0..per_key).map(|s| dedupe(key, s)).collect();
        assert_eq!(
            arrival_order(&received, key),
            expected,
            "key {key} arrived in enqueue order, the replayed message in its place"
        );
    }
}

/// The background of the long-writer case: 20 keys getting a row every 100 ms, and an unkeyed
/// row with each, in transactions of their own, until `stop`; every committed row goes into the
/// ledger in commit order.
async fn steady_writer(
    pool: PgPool,
    topic: String,
    ledger: Arc<Mutex<DeliveryLedger>>,
    stop: Arc<AtomicBool>,
) {
    let mut round = 0usize;
    while !stop.load(Ordering::Relaxed) {
        let mut rows: Vec<_> = (0..20)
            .map(|k| {
                message(&topic, &format!("bg-{k:02}-{round:04}"), &[])
                    .with_ordering_key(format!("bg-{k:02}"))
            })
            .collect();
        rows.push(message(&topic, &format!("bg-u-{round:04}"), &[]));
        enqueue_and_notify(&pool, &rows).await;
        {
            let mut l = ledger.lock().expect("ledger");
            for m in &rows {
                l.enqueued(&m.dedupe_key, m.ordering_key.as_deref());
            }
        }
        round += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until each of `dedupe_keys` has left the outbox (published), returning when each left.
async fn left_the_outbox(pool: &PgPool, dedupe_keys: &[&str]) -> Vec<Instant> {
    let keys: Vec<String> = dedupe_keys.iter().map(|k| (*k).to_owned()).collect();
    let mut left: Vec<Option<Instant>> = vec![None; keys.len()];
    let deadline = Instant::now() + Duration::from_secs(60);
    while left.iter().any(Option::is_none) {
        assert!(
            Instant::now() < deadline,
            "still in the outbox after a minute: {:?}",
            keys.iter()
                .zip(&left)
                .filter(|(_, l)| l.is_none())
                .map(|(k, _)| k)
                .collect::<Vec<_>>()
        );
        let present: Vec<String> =
            sqlx::query_scalar("SELECT dedupe_key FROM pubsub_outbox WHERE dedupe_key = ANY($1)")
                .bind(&keys)
                .fetch_all(pool)
                .await
                .expect("read the outbox");
        let now = Instant::now();
        for (k, l) in keys.iter().zip(left.iter_mut()) {
            if l.is_none() && !present.contains(k) {
                *l = Some(now);
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    left.into_iter().flatten().collect()
}

/// Issue #49's case: a writer inserts K#1 (ordering key K) and an unkeyed U#1 and keeps its
/// transaction open 15 s (three times the floor margin) while 20 other keys and unkeyed rows
/// flow through `replicas` dispatchers; K#2 is committed right after it. Each row must leave the
/// outbox within 2 s of its commit (the probe, every 10 minutes here, cannot be what finds
/// them) and K#1 must arrive before K#2.
async fn a_long_writer_transaction(replicas: usize) {
    let db = TestDb::new().await;
    let topic = TestTopic::new(true).await;
    let t = topic.topic.clone();
    let mut running = Vec::new();
    for _ in 0..replicas {
        let mut config = test_dispatcher::config();
        config.claim_probe_interval = Duration::from_secs(600);
        config.workers = 2;
        let d = test_dispatcher::build_service(&db, real_publisher().await, config).await;
        running.push(Running::start(d));
    }
    let ledger = Arc::new(Mutex::new(DeliveryLedger::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let background = tokio::spawn(steady_writer(
        db.pool.clone(),
        t.clone(),
        ledger.clone(),
        stop.clone(),
    ));
    tokio::time::sleep(Duration::from_secs(2)).await;

    let k1 = message(&t, "K#1", &[]).with_ordering_key("K");
    let u1 = message(&t, "U#1", &[]);
    let k2 = message(&t, "K#2", &[]).with_ordering_key("K");
    let mut a = db.pool.begin().await.expect("begin");
    enqueue_in(&mut a, k1.clone()).await;
    enqueue_in(&mut a, u1.clone()).await;
    tokio::time::sleep(Duration::from_secs(15)).await;
    a.commit().await.expect("commit the long transaction");
    let a_committed = Instant::now();
    ledger.lock().expect("ledger").enqueued("K#1", Some("K"));
    ledger.lock().expect("ledger").enqueued("U#1", None);
    enqueue(&db.pool, std::slice::from_ref(&k2)).await;
    let k2_committed = Instant::now();
    ledger.lock().expect("ledger").enqueued("K#2", Some("K"));

    let left = left_the_outbox(&db.pool, &["K#1", "U#1", "K#2"]).await;
    let waited = [
        left[0] - a_committed,
        left[1] - a_committed,
        left[2] - k2_committed,
    ];
    println!(
        "{replicas} replica(s): K#1 out {:?}, U#1 {:?} after the long commit, K#2 {:?} after its own",
        waited[0], waited[1], waited[2]
    );
    for (row, w) in ["K#1", "U#1", "K#2"].iter().zip(waited) {
        assert!(
            w < Duration::from_secs(2),
            "{row} left the outbox {w:?} after its commit (at most 2 s)"
        );
    }
    stop.store(true, Ordering::Relaxed);
    background.await.expect("the background writer");
    drained(&db.pool, Duration::from_secs(30)).await;
    for r in &running {
        for kind in ["keyed", "unkeyed"] {
            let found = metric(
                &r.addr(),
                &format!("outbox_floor_stragglers_total{{kind=\"{kind}\"}}"),
            )
            .await;
            assert_eq!(found, 0.0, "no {kind} row was ever below a floor");
        }
    }
    for r in running {
        r.stop().await;
    }
    let ledger = ledger.lock().expect("ledger").clone();
    let received = topic.pull(ledger.len(), Duration::from_secs(5)).await;
    ledger
        .verdict(&harness::pubsub::arrivals(&received))
        .assert_clean("the long writer's rows and the background's");
    let k_order: Vec<&str> = received
        .iter()
        .map(|r| r.dedupe_key())
        .filter(|k| k.starts_with("K#"))
        .collect();
    assert_eq!(k_order[..2], ["K#1", "K#2"], "key K in commit order");
}

#[tokio::test]
async fn a_long_writer_transactions_rows_go_out_in_order_within_two_seconds_of_its_commit() {
    a_long_writer_transaction(1).await;
}

#[tokio::test]
async fn a_long_writer_transactions_rows_go_out_in_order_within_two_seconds_across_two_replicas() {
    a_long_writer_transaction(2).await;
}

/// Enqueues `m` in the caller's transaction (left open).
async fn enqueue_in(tx: &mut sqlx::PgConnection, m: outbox_shared::NewMessage) {
    outbox_shared::enqueue_batch(&mut *tx, &[m])
        .await
        .expect("enqueue");
}

#[tokio::test]
async fn a_resumed_topics_rows_go_out_at_once_though_the_floor_passed_them() {
    let db = TestDb::new().await;
    let paused = TestTopic::new(false).await;
    let flowing = TestTopic::new(false).await;
    let mut conn = db.pool.acquire().await.expect("conn");
    outbox_shared::store::pause::pause(&mut conn, &paused.topic, Some("test"), "floors")
        .await
        .expect("pause");
    drop(conn);
    enqueue(
        &db.pool,
        &(0..10)
            .map(|i| message(&paused.topic, &format!("held-{i}"), &[]))
            .collect::<Vec<_>>(),
    )
    .await;
    // The other topic's rows, due well after the margin, move the unkeyed floor past the paused
    // ones; the probe would find those only after a minute.
    let mut config = fast_floors();
    config.batch.claim_floor_margin = Duration::from_millis(200);
    config.claim_probe_interval = Duration::from_secs(600);
    let d = test_dispatcher::build_service(&db, real_publisher().await, config).await;
    let running = Running::start(d);
    tokio::time::sleep(Duration::from_millis(500)).await;
    enqueue(
        &db.pool,
        &(0..10)
            .map(|i| message(&flowing.topic, &format!("flowing-{i}"), &[]))
            .collect::<Vec<_>>(),
    )
    .await;
    harness::wait::topic_drained(&db.pool, &flowing.topic, Duration::from_secs(20)).await;

    let mut conn = db.pool.acquire().await.expect("conn");
    outbox_shared::store::pause::resume(&mut conn, &paused.topic)
        .await
        .expect("resume");
    drop(conn);
    let took = harness::wait::topic_drained(&db.pool, &paused.topic, Duration::from_secs(20)).await;
    running.stop().await;
    assert!(
        took < Duration::from_secs(10),
        "the resumed topic's rows went out in {took:?}, not at the probe a minute later"
    );
    assert_eq!(paused.pull(10, Duration::from_secs(3)).await.len(), 10);
}

#[tokio::test]
async fn a_mark_waits_for_an_open_writer_but_not_for_a_held_snapshot() {
    let db = TestDb::new().await;
    let t = "projects/p/topics/marks";
    // A report holds a snapshot of the outbox; a writer holds a row it has not committed.
    let reader = session(&db).await;
    let report = hold_snapshot(&reader).await;
    let mut writer = db.pool.begin().await.expect("begin the writer");
    enqueue_in(&mut writer, message(t, "open", &[]).with_ordering_key("k")).await;

    let mut conn = db.pool.acquire().await.expect("conn");
    let stamp = settled::stamp(&mut conn).await.expect("stamp");
    assert!(
        stamp.exact,
        "the identity sequence hands out ids one at a time"
    );
    let running = settled::running(&mut conn, &stamp.writers)
        .await
        .expect("running");
    assert_eq!(
        running.len(),
        1,
        "the writer holds the mark, the report does not: {stamp:?}"
    );
    writer.commit().await.expect("commit the writer");
    let open_id: i64 = sqlx::query_scalar("SELECT id FROM pubsub_outbox WHERE dedupe_key = 'open'")
        .fetch_one(&db.pool)
        .await
        .expect("the row");
    assert!(
        stamp.allocated >= open_id,
        "the mark covers the writer's row"
    );
    assert!(
        settled::running(&mut conn, &stamp.writers)
            .await
            .expect("running")
            .is_empty(),
        "settled once the writer ended, the report still open"
    );
    report.rollback().await.expect("end the report");

    // A sequence that caches ids per session proves nothing.
    sqlx::query("ALTER SEQUENCE pubsub_outbox_id_seq CACHE 20")
        .execute(&mut *conn)
        .await
        .expect("cache");
    assert!(!settled::stamp(&mut conn).await.expect("stamp").exact);
}
