//! Dispatcher: delivery, disjoint claims, retries, dead letters, outages and signals, against real
//! PostgreSQL and the Pub/Sub emulator.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use chrono::{DateTime, SubsecRound, Utc};
use outbox_dispatcher::Code;

use harness::db::TestDb;
use harness::dispatcher::{self as test_dispatcher, Running, real_publisher};
use harness::fixtures::{count, enqueue, enqueue_numbered, message, outbox_rows};
use harness::process::{Process, http_get};
use harness::proxy::TcpProxy;
use harness::pubsub::{Received, TestTopic, by_dedupe_key};
use harness::wait::drained;
use outbox_dispatcher::BatchOutcome;
use outbox_dispatcher::fault::{Fault, FaultInjector};
use outbox_shared::NewMessage;
use outbox_shared::store::{claim, dead_letter, outbox};

#[tokio::test]
async fn messages_over_several_topics_from_concurrent_writers_all_arrive_with_attributes_and_dedupe_key()
 {
    let db = TestDb::new().await;
    let topics = [
        TestTopic::new(false).await,
        TestTopic::new(false).await,
        TestTopic::new(false).await,
    ];
    let per_writer = 300;
    let writers: Vec<_> = (0..4)
        .map(|w| {
            let pool = db.pool.clone();
            let names: Vec<String> = topics.iter().map(|t| t.topic.clone()).collect();
            tokio::spawn(async move {
                for chunk in (0..per_writer).collect::<Vec<_>>().chunks(50) {
                    let batch: Vec<NewMessage> = chunk
                        .iter()
                        .map(|i| {
                            let key = format!("w{w}-m{i}");
                            message(
                                &names[i % 3],
                                &key,
                                &[("writer", &w.to_string()), ("seq", &i.to_string())],
                            )
                        })
                        .collect();
                    enqueue(&pool, &batch).await;
                }
            })
        })
        .collect();

    let mut config = test_dispatcher::config();
    config.workers = 3;
    let service =
        Running::start(test_dispatcher::build_service(&db, real_publisher().await, config).await);
    let listen = service.addr();
    for w in writers {
        w.await.expect("writer finished");
    }
    drained(&db.pool, Duration::from_secs(60)).await;

    let (status, _) = http_get(&listen, "/readyz").await;
    assert_eq!(status, 200, "ready while the database and Pub/Sub answer");
    let (_, metrics) = http_get(&listen, "/metrics").await;
    assert!(
        metrics.contains("outbox_published_total 1200"),
        "published counter counts every message:\n{metrics}"
    );
    service.stop().await;

    let mut all = Vec::new();
    for (n, t) in topics.iter().enumerate() {
        let got = t.pull(400, Duration::from_secs(5)).await;
        assert_eq!(got.len(), 400, "topic {n} received its 400 messages");
        all.extend(got);
    }
    let counts = by_dedupe_key(&all);
    assert_eq!(counts.len(), 1200, "every message arrived");
    assert!(
        counts.values().all(|c| *c == 1),
        "no duplicates without faults"
    );
    for m in &all {
        let key = m.dedupe_key();
        let (w, i) = key
            .trim_start_matches('w')
            .split_once("-m")
            .expect("dedupe key shape");
        assert_eq!(
            m.attributes.get("writer").map(String::as_str),
            Some(w),
            "writer attribute kept for {key}"
        );
        assert_eq!(
            m.attributes.get("seq").map(String::as_str),
            Some(i),
            "seq attribute kept for {key}"
        );
        assert_eq!(
            m.data,
            format!("payload of {key}").into_bytes(),
            "payload bytes kept for {key}"
        );
    }
    assert_eq!(outbox_rows(&db.pool).await, 0, "published rows are deleted");
}

#[tokio::test]
async fn concurrent_claims_never_overlap() {
    let db = TestDb::new().await;
    let msgs: Vec<NewMessage> = (0..300)
        .map(|i| message("projects/p/topics/t", &format!("k{i}"), &[]))
        .collect();
    enqueue(&db.pool, &msgs).await;
    let mut txs = Vec::new();
    let mut seen = Vec::new();
    for _ in 0..4 {
        let mut tx = db.pool.begin().await.expect("begin");
        let filter = claim::ClaimFilter {
            now: Utc::now(),
            limit: 100,
            topics: None,
            excluded: &[],
        };
        let claimed = claim::claim_batch(&mut tx, &filter, None, 0)
            .await
            .expect("claim")
            .messages;
        seen.extend(claimed.iter().map(|m| m.id));
        txs.push(tx);
    }
    let total = seen.len();
    seen.sort_unstable();
    seen.dedup();
    assert_eq!(
        seen.len(),
        total,
        "no row was claimed by two open transactions"
    );
    assert_eq!(
        total, 300,
        "the first three claims took 100 rows each, the fourth found none left"
    );
}

#[tokio::test]
async fn two_dispatcher_processes_with_several_workers_publish_every_row_exactly_once() {
    let db = TestDb::new().await;
    let topic = TestTopic::new(false).await;
    let n = 4000;
    enqueue_numbered(&db.pool, &topic.topic, n).await;
    let envs = [
        ("DATABASE_URL", db.url().to_owned()),
        ("PUBSUB_EMULATOR_HOST", harness::env::pubsub_emulator_host()),
    ];
    let mut procs = Vec::new();
    for _ in 0..2 {
        procs.push(Process::spawn(
            "dispatcher",
            &[
                "--workers",
                "4",
                "--batch-size",
                "50",
                "--listen-addr",
                "127.0.0.1:0",
            ],
            &envs,
        ));
    }
    drained(&db.pool, Duration::from_secs(90)).await;
    let got = topic.pull(n, Duration::from_secs(5)).await;
    let counts = by_dedupe_key(&got);
    assert_eq!(counts.len(), n, "every row arrived");
    let dupes: Vec<_> = counts.iter().filter(|(_, c)| **c > 1).collect();
    assert!(
        dupes.is_empty(),
        "no row published twice without faults: {dupes:?}"
    );
    harness::process::terminate_all(procs).await;
}

#[tokio::test]
async fn transient_failures_advance_attempts_on_schedule_then_dead_letter_with_the_last_error() {
    let db = TestDb::new().await;
    let topic = TestTopic::new(false).await;
    enqueue(
        &db.pool,
        &[
            message(&topic.topic, "flaky", &[]),
            message(&topic.topic, "fine", &[]),
        ],
    )
    .await;
    let faulty = FaultInjector::passthrough(real_publisher().await);
    faulty.fail(
        "flaky",
        Fault {
            code: Code::Unavailable,
            times: None,
        },
    );
    let d = test_dispatcher::build(&db.pool, faulty, test_dispatcher::config()).await;
    let id: i64 = sqlx::query_scalar("SELECT id FROM pubsub_outbox WHERE dedupe_key = 'flaky'")
        .fetch_one(&db.pool)
        .await
        .expect("row id");

    // PostgreSQL keeps microseconds.
    let mut now: DateTime<Utc> = Utc::now().trunc_subsecs(6);
    // schedule(): base 2 s, no jitter, 4 attempts: retries after 2 s, 4 s, 8 s, then dead letter.
    for (attempt, delay) in [(1, 2), (2, 4), (3, 8)] {
        let outcome = d.run_batch(now).await.expect("batch runs");
        assert!(
            matches!(outcome, BatchOutcome::Settled(_)),
            "settled, not an outage: {outcome:?}"
        );
        let row = outbox::get(&mut db.pool.acquire().await.expect("conn"), id)
            .await
            .expect("read")
            .expect("still queued");
        assert_eq!(
            row.message.attempts, attempt,
            "attempts after failure {attempt}"
        );
        assert_eq!(
            row.next_attempt_at,
            now + chrono::Duration::seconds(delay),
            "next attempt {delay}s later"
        );
        assert_eq!(
            row.last_error.as_deref(),
            Some("UNAVAILABLE: injected fault")
        );
        // Not due before its time.
        let early = d
            .run_batch(now + chrono::Duration::seconds(delay) - chrono::Duration::milliseconds(1))
            .await
            .expect("batch");
        assert_eq!(
            early,
            BatchOutcome::Empty,
            "the row is not claimed before next_attempt_at"
        );
        now += chrono::Duration::seconds(delay);
    }
    d.run_batch(now).await.expect("last attempt");
    assert_eq!(outbox_rows(&db.pool).await, 0, "the outbox is empty");
    let dead = dead_letter::list(&mut db.pool.acquire().await.expect("conn"), None, 10)
        .await
        .expect("list");
    assert_eq!(dead.len(), 1, "the flaky message is dead-lettered");
    assert_eq!(dead[0].dedupe_key, "flaky");
    assert_eq!(dead[0].attempts, 4);
    assert_eq!(dead[0].error_kind, "exhausted");
    assert_eq!(dead[0].last_error, "UNAVAILABLE: injected fault");
    let got = topic.pull(1, Duration::from_secs(5)).await;
    assert_eq!(
        got.iter().map(Received::dedupe_key).collect::<Vec<_>>(),
        vec!["fine"],
        "the good message was published"
    );
}

#[tokio::test]
async fn permanent_failures_are_dead_lettered_with_the_reason_a_missing_topic_held_and_the_rest_published()
 {
    let db = TestDb::new().await;
    let topic = TestTopic::new(false).await;
    let missing = format!(
        "projects/{}/topics/{}",
        harness::env::pubsub_project(),
        harness::env::unique_name("missing")
    );
    let mut oversize = message(&topic.topic, "oversize", &[]);
    oversize.payload = vec![b'x'; 10_000_001];
    let mut many_attrs = message(&topic.topic, "many-attributes", &[]);
    many_attrs.attributes = (0..100)
        .map(|i| (format!("a{i}"), "v".to_owned()))
        .collect::<BTreeMap<_, _>>();
    let batch = vec![
        message(&topic.topic, "good-1", &[]),
        message(&missing, "unknown-topic", &[]),
        oversize,
        message(&topic.topic, "good-2", &[]),
        many_attrs,
        message(&topic.topic, "good-3", &[]),
    ];
    enqueue(&db.pool, &batch).await;
    let d =
        test_dispatcher::build(&db.pool, real_publisher().await, test_dispatcher::config()).await;
    let outcome = d.run_batch(Utc::now()).await.expect("batch runs");
    let BatchOutcome::Settled(s) = outcome else {
        panic!("expected a settled batch, got {outcome:?}")
    };
    assert_eq!((s.published, s.dead_lettered, s.retried), (3, 2, 0));
    assert_eq!(
        (s.released, s.topic_refused),
        (1, 1),
        "the missing topic's row goes back untouched: the topic is refused, not the message"
    );

    let dead = dead_letter::list(&mut db.pool.acquire().await.expect("conn"), None, 10)
        .await
        .expect("list");
    let reasons: HashMap<&str, (&str, &str)> = dead
        .iter()
        .map(|d| {
            (
                d.dedupe_key.as_str(),
                (d.error_kind.as_str(), d.last_error.as_str()),
            )
        })
        .collect();
    assert_eq!(reasons.len(), 2, "two dead letters: {reasons:?}");
    assert!(
        reasons["oversize"]
            .1
            .contains("Pub/Sub accepts at most 10000000"),
        "{reasons:?}"
    );
    assert!(
        reasons["many-attributes"].1.contains("101 attributes"),
        "{reasons:?}"
    );
    assert!(
        reasons.values().all(|(kind, _)| *kind == "permanent"),
        "{reasons:?}"
    );
    let held: Vec<(String, String, i32)> = sqlx::query_as(
        "SELECT h.code, o.dedupe_key, o.attempts FROM pubsub_outbox_held_topic h
         JOIN pubsub_outbox o ON o.topic = h.topic",
    )
    .fetch_all(&db.pool)
    .await
    .expect("read the hold");
    assert_eq!(
        held,
        vec![("NOT_FOUND".to_owned(), "unknown-topic".to_owned(), 0)],
        "the missing topic is held with its row, no attempt charged"
    );
    let got = topic.pull(3, Duration::from_secs(5)).await;
    let mut keys: Vec<&str> = got.iter().map(Received::dedupe_key).collect();
    keys.sort_unstable();
    assert_eq!(
        keys,
        vec!["good-1", "good-2", "good-3"],
        "the good messages of the batch were published"
    );
}

#[tokio::test]
async fn a_pubsub_outage_dead_letters_nothing_charges_no_attempt_and_the_backlog_drains_after() {
    let db = TestDb::new().await;
    let topic = TestTopic::new(false).await;
    let proxy = TcpProxy::start(&harness::env::pubsub_emulator_host()).await;
    let mut config = test_dispatcher::config_for(&proxy.addr());
    config.workers = 2;
    config.batch.batch_size = 50;
    config.batch.schedule.max_attempts = 2;
    let publisher = test_dispatcher::publisher_at(&proxy.addr()).await;
    let service = Running::start(test_dispatcher::build_service(&db, publisher, config).await);
    let listen = service.addr();

    let before: Vec<NewMessage> = (0..100)
        .map(|i| message(&topic.topic, &format!("before-{i}"), &[]))
        .collect();
    enqueue(&db.pool, &before).await;
    drained(&db.pool, Duration::from_secs(30)).await;

    proxy.set_down(true);
    let during: Vec<NewMessage> = (0..300)
        .map(|i| message(&topic.topic, &format!("during-{i}"), &[]))
        .collect();
    enqueue(&db.pool, &during).await;
    // Long enough for many claim attempts, probes and several times max-attempts worth of retries.
    tokio::time::sleep(Duration::from_secs(8)).await;
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM pubsub_outbox_dead_letter").await,
        0,
        "an outage dead-letters nothing"
    );
    assert_eq!(
        count(
            &db.pool,
            "SELECT count(*) FROM pubsub_outbox WHERE attempts > 0"
        )
        .await,
        0,
        "an outage charges no attempt"
    );
    assert_eq!(outbox_rows(&db.pool).await, 300, "the backlog waits");
    // The breaker closes briefly between a probe and the next failed publish: sample until open.
    let started = Instant::now();
    loop {
        let (status, _) = http_get(&listen, "/readyz").await;
        let (_, metrics) = http_get(&listen, "/metrics").await;
        if status == 503 && metrics.contains("outbox_breaker_open 1") {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "/readyz says 503 and the breaker gauge is 1 during the outage"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    proxy.set_down(false);
    drained(&db.pool, Duration::from_secs(60)).await;
    service.stop().await;
    let got = topic.pull(400, Duration::from_secs(5)).await;
    let counts = by_dedupe_key(&got);
    for m in before.iter().chain(&during) {
        assert!(
            counts.contains_key(&m.dedupe_key),
            "{} arrived",
            m.dedupe_key
        );
    }
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM pubsub_outbox_dead_letter").await,
        0
    );
}

#[tokio::test]
async fn a_sigkilled_dispatcher_loses_nothing_and_only_in_flight_rows_arrive_twice() {
    let db = TestDb::new().await;
    let topic = TestTopic::new(false).await;
    // Latency keeps batches in flight, so the kill lands mid-batch.
    let proxy = TcpProxy::start(&harness::env::pubsub_emulator_host()).await;
    proxy.set_delay(Duration::from_millis(20));
    let n = 3000;
    enqueue_numbered(&db.pool, &topic.topic, n).await;
    let envs = [
        ("DATABASE_URL", db.url().to_owned()),
        ("PUBSUB_EMULATOR_HOST", proxy.addr()),
    ];
    let (workers, batch) = (4, 100);
    let args = [
        "--workers",
        "4",
        "--batch-size",
        "100",
        "--listen-addr",
        "127.0.0.1:0",
    ];
    let mut first = Process::spawn("dispatcher", &args, &envs);
    let started = Instant::now();
    while outbox_rows(&db.pool).await > (n as i64) / 2 {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the dispatcher makes progress; log:\n{}",
            first.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    first.signal("KILL");
    let _ = first.child.wait().await;
    let left = outbox_rows(&db.pool).await;
    assert!(left > 0, "killed before the end");

    let mut second = Process::spawn("dispatcher", &args, &envs);
    drained(&db.pool, Duration::from_secs(60)).await;
    second.signal("TERM");
    let _ = second.child.wait().await;

    let got = topic
        .pull(n + workers * batch, Duration::from_secs(5))
        .await;
    let counts = by_dedupe_key(&got);
    assert_eq!(counts.len(), n, "every row arrived");
    let duplicates: usize = counts.values().map(|c| c - 1).sum();
    eprintln!(
        "SIGKILL test: {duplicates} duplicate deliveries (bound: {} in flight)",
        workers * batch
    );
    assert!(
        duplicates <= workers * batch,
        "only the killed process's in-flight batches may repeat: {duplicates}"
    );
}

#[tokio::test]
async fn sigterm_with_a_batch_in_flight_exits_zero_within_the_grace_period_and_settles_it() {
    let db = TestDb::new().await;
    let topic = TestTopic::new(false).await;
    let proxy = TcpProxy::start(&harness::env::pubsub_emulator_host()).await;
    let envs = [
        ("DATABASE_URL", db.url().to_owned()),
        ("PUBSUB_EMULATOR_HOST", proxy.addr()),
    ];
    let mut p = Process::spawn(
        "dispatcher",
        &[
            "--workers",
            "1",
            "--batch-size",
            "100",
            "--grace-period",
            "10s",
            // The link is slow on purpose (1.5 s a chunk), not down: keep the stall probe out of it.
            "--stall-probe-after",
            "30s",
            "--listen-addr",
            "127.0.0.1:0",
        ],
        &envs,
    );
    // Let the client connect, then slow the link so the batch stays in flight.
    tokio::time::sleep(Duration::from_secs(1)).await;
    proxy.set_delay(Duration::from_millis(1500));
    let msgs: Vec<NewMessage> = (0..50)
        .map(|i| message(&topic.topic, &format!("m{i}"), &[]))
        .collect();
    enqueue(&db.pool, &msgs).await;
    // In flight = every row is locked by the dispatcher's claim transaction.
    let in_flight =
        "SELECT count(*) = 0 FROM (SELECT 1 FROM pubsub_outbox FOR UPDATE SKIP LOCKED) s";
    let started = Instant::now();
    while !sqlx::query_scalar::<_, bool>(in_flight)
        .fetch_one(&db.pool)
        .await
        .expect("lock probe")
    {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "a batch gets claimed; log:\n{}",
            p.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let term_at = Instant::now();
    p.signal("TERM");
    let status = tokio::time::timeout(Duration::from_secs(15), p.child.wait())
        .await
        .expect("exits in time")
        .expect("status");
    assert!(
        status.success(),
        "exit code 0 after SIGTERM; log:\n{}",
        p.log()
    );
    assert!(
        term_at.elapsed() < Duration::from_secs(10),
        "within the grace period"
    );
    assert_eq!(
        outbox_rows(&db.pool).await,
        0,
        "the in-flight batch was settled"
    );
    let got = topic.pull(50, Duration::from_secs(5)).await;
    assert_eq!(by_dedupe_key(&got).len(), 50, "and published");
}
