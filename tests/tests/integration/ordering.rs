//! Strict per-key ordering across processes, failures and SIGKILL; per-key head-of-line blocking.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use chrono::Utc;
use google_cloud_gax::error::rpc::Code;
use sqlx::PgPool;

use harness::db::TestDb;
use harness::process::Process;
use harness::pubsub::{Received, TestTopic};

use super::dispatcher::{dispatch, real_publisher};
use outbox_dispatcher::chaos::{Chaos, Fault};
use outbox_dispatcher::worker::{BatchOutcome, Dispatch, run_batch};
use outbox_shared::NewMessage;
use outbox_shared::store::{dead_letter, outbox};

const KEYS: usize = 200;
const PER_KEY: usize = 50;

fn dedupe(key: usize, seq: usize) -> String {
    format!("k{key:03}-m{seq:02}")
}

/// Enqueues KEYS x PER_KEY messages, interleaved across keys, each key's in sequence order.
async fn enqueue_keyed(pool: &PgPool, topic: &str) {
    let all: Vec<NewMessage> = (0..PER_KEY)
        .flat_map(|seq| (0..KEYS).map(move |key| (key, seq)))
        .map(|(key, seq)| NewMessage {
            topic: topic.to_owned(),
            ordering_key: Some(format!("key-{key:03}")),
            dedupe_key: dedupe(key, seq),
            payload: format!("{key}:{seq}").into_bytes(),
            attributes: Default::default(),
        })
        .collect();
    for chunk in all.chunks(1000) {
        let mut tx = pool.begin().await.expect("begin");
        outbox::enqueue_batch(&mut tx, chunk)
            .await
            .expect("enqueue");
        tx.commit().await.expect("commit");
    }
}

async fn remaining(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM pubsub_outbox")
        .fetch_one(pool)
        .await
        .expect("count")
}

async fn wait_until(pool: &PgPool, left: i64, limit: Duration, what: &str) {
    let started = Instant::now();
    loop {
        let n = remaining(pool).await;
        if n <= left {
            return;
        }
        assert!(
            started.elapsed() < limit,
            "{what}: {n} rows left after {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Per ordering key, the sequence numbers of the first arrival of each dedupe key, in the order
/// given (delivery order, or publish order when sorted by message id).
fn first_arrivals(received: &[Received]) -> HashMap<String, Vec<usize>> {
    let mut seen = std::collections::HashSet::new();
    let mut per_key: HashMap<String, Vec<usize>> = HashMap::new();
    for m in received {
        if seen.insert(m.dedupe_key().to_owned()) {
            let seq = m
                .dedupe_key()
                .rsplit("-m")
                .next()
                .and_then(|s| s.parse().ok())
                .expect("dedupe key shape");
            per_key.entry(m.ordering_key.clone()).or_default().push(seq);
        }
    }
    per_key
}

fn assert_every_key_in_enqueue_order(received: &[Received], what: &str) {
    let per_key = first_arrivals(received);
    assert_eq!(per_key.len(), KEYS, "{what}: every key arrived");
    let expected: Vec<usize> = (0..PER_KEY).collect();
    for (key, seqs) in &per_key {
        assert_eq!(
            seqs, &expected,
            "{what}: key {key} arrived complete and in enqueue order"
        );
    }
}

fn by_publish_order(received: &[Received]) -> Vec<Received> {
    let mut sorted = received.to_vec();
    // The emulator numbers messages in the order it accepts them.
    sorted.sort_by_key(|m| {
        m.message_id
            .parse::<u64>()
            .expect("emulator message ids are numbers")
    });
    sorted
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
        "--chaos-failure-rate",
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
    enqueue_keyed(&db.pool, &topic.topic).await;
    let procs = spawn_dispatchers(&db, 3, &[]);
    wait_until(&db.pool, 0, Duration::from_secs(240), "drain").await;
    harness::process::terminate_all(procs).await;

    let received = topic.pull(KEYS * PER_KEY, Duration::from_secs(10)).await;
    assert_every_key_in_enqueue_order(&received, "delivery order");
    assert_every_key_in_enqueue_order(&by_publish_order(&received), "publish order");
    let dead: i64 = sqlx::query_scalar("SELECT count(*) FROM pubsub_outbox_dead_letter")
        .fetch_one(&db.pool)
        .await
        .expect("count");
    assert_eq!(
        dead, 0,
        "transient failures never dead-letter with max attempts this high"
    );
}

#[tokio::test]
async fn a_sigkill_mid_run_loses_nothing_and_first_arrivals_keep_enqueue_order() {
    let db = TestDb::new().await;
    let topic = TestTopic::new(true).await;
    enqueue_keyed(&db.pool, &topic.topic).await;
    let mut procs = spawn_dispatchers(&db, 3, &[]);
    let total = (KEYS * PER_KEY) as i64;
    wait_until(
        &db.pool,
        total / 2,
        Duration::from_secs(240),
        "half drained",
    )
    .await;
    let mut victim = procs.remove(0);
    victim.signal("KILL");
    let _ = victim.child.wait().await;
    wait_until(
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
    assert_every_key_in_enqueue_order(&received, "delivery order (first arrivals)");
    assert_every_key_in_enqueue_order(
        &by_publish_order(&received),
        "publish order (first arrivals)",
    );
}

async fn drain<P: outbox_dispatcher::publisher::Publish>(d: &Dispatch<P>) {
    for _ in 0..1000 {
        if run_batch(d, Utc::now()).await.expect("batch runs") == BatchOutcome::Empty {
            return;
        }
    }
    panic!("the outbox did not settle");
}

async fn keys_left(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar("SELECT dedupe_key FROM pubsub_outbox ORDER BY id")
        .fetch_all(pool)
        .await
        .expect("rows")
}

#[tokio::test]
async fn a_permanently_failing_message_blocks_only_its_key_until_discarded_or_replayed() {
    let db = TestDb::new().await;
    let topic = TestTopic::new(true).await;
    let (keys, per_key) = (10, 8);
    let messages: Vec<NewMessage> = (0..per_key)
        .flat_map(|seq| (0..keys).map(move |key| (key, seq)))
        .map(|(key, seq)| NewMessage {
            topic: topic.topic.clone(),
            ordering_key: Some(format!("key-{key:03}")),
            dedupe_key: dedupe(key, seq),
            payload: Vec::from(b"x".as_slice()),
            attributes: Default::default(),
        })
        .collect();
    let mut tx = db.pool.begin().await.expect("begin");
    outbox::enqueue_batch(&mut tx, &messages)
        .await
        .expect("enqueue");
    tx.commit().await.expect("commit");

    let publisher = Chaos::passthrough(real_publisher().await);
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
    let d = dispatch(&db.pool, publisher, 100);
    drain(&d).await;

    let expected_left: Vec<String> = (3..per_key)
        .map(|s| dedupe(3, s))
        .chain((5..per_key).map(|s| dedupe(5, s)))
        .collect();
    let mut left = keys_left(&db.pool).await;
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
        dead_letter::blocked_keys(&mut conn, &[])
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
    d.publisher.heal(&dedupe(5, 4));
    dead_letter::replay(&mut conn, &[id_of(&dedupe(5, 4))])
        .await
        .expect("replay");
    drop(conn);
    drain(&d).await;
    assert!(
        keys_left(&db.pool).await.is_empty(),
        "both keys drained after the operator acted"
    );

    let published = d.publisher.published();
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
