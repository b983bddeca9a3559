//! What the real platform says that the emulator never does, against a stand-in of Google's
//! front end (`harness::front_end`: TLS with ALPN h2 under a private CA, Application Default
//! Credentials naming a quota project, the metadata server, refusals by topic, GOAWAY), with the
//! real `dispatcher` binary:
//! - a topic refused as a whole for a while (PERMISSION_DENIED while a grant propagates,
//!   NOT_FOUND before the topic exists, FAILED_PRECONDITION for a disabled CMEK key,
//!   UNIMPLEMENTED from a proxy's 404) is held: nothing dead-lettered, no attempt charged, every
//!   key in order, published within 30 s of the fix, the other topic unaffected; and `GetTopic`
//!   refused throughout (a publisher-only identity) changes none of it;
//! - quota (RESOURCE_EXHAUSTED on 30 % of calls) slows the topic down and charges no attempt;
//! - connections recycled by GOAWAY every 1.5 s cost nothing;
//! - the metadata server answering 503 at pod start costs nothing;
//! - every request carries the ADC file's quota project, and the authority asked for.

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use harness::db::TestDb;
use harness::fixtures::{count, enqueue};
use harness::front_end::{FrontEnd, QUOTA_PROJECT};
use harness::grpc_recorder::{Options, Refusal};
use harness::ledger::DeliveryLedger;
use harness::process::{Process, http_request};
use harness::pubsub::TestTopic;
use harness::wait::{drained, wait_until};
use outbox_shared::NewMessage;
use tonic::Code;

/// `keys` ordering keys `{prefix}-key-N` of `per_key` messages each (interleaved, in sequence
/// within a key), then `unkeyed` unkeyed messages; dedupe keys start with `prefix`.
fn rows(topic: &str, prefix: &str, keys: usize, per_key: usize, unkeyed: usize) -> Vec<NewMessage> {
    let keyed = (0..per_key).flat_map(|seq| {
        (0..keys).map(move |k| {
            NewMessage::new(topic, format!("{prefix}-k{k}-m{seq}"), vec![b'x'; 200])
                .with_ordering_key(format!("{prefix}-key-{k}"))
        })
    });
    let plain =
        (0..unkeyed).map(|i| NewMessage::new(topic, format!("{prefix}-u{i}"), vec![b'y'; 200]));
    keyed.chain(plain).collect()
}

/// Attempts charged to any row, published or not (the dispatchers keep published rows with
/// `--retention`), and dead letters.
async fn charged_and_dead(db: &TestDb) -> (i64, i64) {
    (
        count(
            &db.pool,
            "SELECT COALESCE(max(attempts), 0)::bigint FROM pubsub_outbox",
        )
        .await,
        count(&db.pool, "SELECT count(*) FROM pubsub_outbox_dead_letter").await,
    )
}

/// When `topic`'s rows were published: (first, last).
async fn published_between(db: &TestDb, topic: &str) -> (DateTime<Utc>, DateTime<Utc>) {
    let (first, last): (Option<DateTime<Utc>>, Option<DateTime<Utc>>) = sqlx::query_as(
        "SELECT min(published_at), max(published_at) FROM pubsub_outbox WHERE topic = $1",
    )
    .bind(topic)
    .fetch_one(&db.pool)
    .await
    .expect("read the publish times");
    (
        first.expect("published rows are kept"),
        last.expect("published rows are kept"),
    )
}

/// Rows published before `at` (rows are kept, marked).
async fn published_before(db: &TestDb, at: DateTime<Utc>) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM pubsub_outbox WHERE published_at < $1")
        .bind(at)
        .fetch_one(&db.pool)
        .await
        .expect("count the rows published")
}

/// Waits until every row of `topic` is published (rows are kept, marked).
async fn topic_published(db: &TestDb, topic: &str, limit: Duration) {
    wait_until(&format!("{topic} is published"), limit, || async {
        let left: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pubsub_outbox WHERE topic = $1 AND published_at IS NULL",
        )
        .bind(topic)
        .fetch_one(&db.pool)
        .await
        .map_err(|e| e.to_string())?;
        if left == 0 {
            Ok(())
        } else {
            Err(format!("{left} unpublished"))
        }
    })
    .await;
}

async fn metrics(dispatcher: &mut Process) -> String {
    let addr = dispatcher
        .bound_addr(Duration::from_secs(30))
        .await
        .expect("the dispatcher serves its endpoints");
    http_request(&addr.to_string(), "GET", "/metrics", &[], "")
        .await
        .body
}

/// Pulls both subscriptions and judges the delivery: nothing lost or invented, every key in
/// order.
async fn delivered(topics: &[(&TestTopic, &[NewMessage])]) {
    for (topic, sent) in topics {
        let received = topic.pull(sent.len(), Duration::from_secs(5)).await;
        let arrivals = harness::pubsub::arrivals(&harness::pubsub::by_publish_order(&received));
        DeliveryLedger::of(sent)
            .verdict(&arrivals)
            .assert_clean(&format!("delivery on {}", topic.topic));
    }
}

/// The held topic's story, for one code: 400 rows wait (10 keys x 30, 100 unkeyed) while the
/// topic is refused for 20 s, beside another topic's 200 rows.
async fn held_while_refused_then_published_within_30_s(code: Code) {
    let db = TestDb::new().await;
    let (held, other) = (TestTopic::new(true).await, TestTopic::new(true).await);
    let front = FrontEnd::start(Options {
        publisher_only: true,
        ..Options::default()
    })
    .await;
    let window = Duration::from_secs(20);
    front
        .recorder
        .refuse(Refusal::topic_for(&held.topic, code, window));
    let fixed_at = Utc::now() + chrono::Duration::from_std(window).expect("a short window");
    let held_rows = rows(&held.topic, "held", 10, 30, 100);
    let other_rows = rows(&other.topic, "other", 5, 20, 100);
    enqueue(&db.pool, &held_rows).await;
    enqueue(&db.pool, &other_rows).await;

    let mut dispatcher = front
        .dispatcher(db.url(), &["--retention", "1h", "--poll-interval", "100ms"])
        .start()
        .expect("start the dispatcher");
    topic_published(&db, &other.topic, Duration::from_secs(30)).await;
    let (_, other_done) = published_between(&db, &other.topic).await;
    assert!(
        other_done < fixed_at - chrono::Duration::seconds(5),
        "the other topic flowed while {code:?} held the first (done {other_done}, fix at {fixed_at})"
    );

    // While refused: held, visibly; nothing charged or dead-lettered; no key blocked.
    let held_topic = held.topic.clone();
    wait_until("the topic is held", Duration::from_secs(10), || async {
        let n = count(
            &db.pool,
            &format!(
                "SELECT count(*) FROM pubsub_outbox_held_topic WHERE topic = '{held_topic}' \
                 AND code = '{}'",
                outbox_dispatcher::classify::code_name(code)
            ),
        )
        .await;
        if n == 1 {
            Ok(())
        } else {
            Err("not held yet".to_owned())
        }
    })
    .await;
    let addr = dispatcher
        .bound_addr(Duration::from_secs(30))
        .await
        .expect("the dispatcher serves its endpoints")
        .to_string();
    wait_until(
        "the held gauge names the topic",
        Duration::from_secs(5),
        || async {
            let text = http_request(&addr, "GET", "/metrics", &[], "").await.body;
            match text
                .lines()
                .any(|l| l.starts_with("outbox_topic_held_seconds{") && l.contains(&held.topic))
            {
                true => Ok(()),
                false => Err(text),
            }
        },
    )
    .await;
    let status = harness::operator::json(&db, &["status", "--json"]);
    let shown = status["held_topics"]
        .as_array()
        .and_then(|h| h.iter().find(|t| t["topic"] == held.topic.as_str()))
        .unwrap_or_else(|| panic!("status shows the held topic: {status}"));
    assert_eq!(shown["code"], outbox_dispatcher::classify::code_name(code));
    assert_eq!(shown["waiting"], 400, "{shown}");
    assert_eq!(
        charged_and_dead(&db).await,
        (0, 0),
        "nothing charged or dead-lettered"
    );
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM pubsub_outbox WHERE published_at IS NOT NULL AND topic = ANY(SELECT topic FROM pubsub_outbox_held_topic)").await,
        0,
        "nothing of the held topic was published while refused"
    );

    topic_published(&db, &held.topic, window + Duration::from_secs(40)).await;
    let (first, last) = published_between(&db, &held.topic).await;
    assert!(
        first >= fixed_at,
        "nothing went out before the fix: {first}"
    );
    let after = (last - fixed_at).to_std().unwrap_or_default();
    assert!(
        after <= Duration::from_secs(30),
        "every held row was published within 30 s of the fix ({after:?})"
    );
    assert_eq!(
        charged_and_dead(&db).await,
        (0, 0),
        "nothing charged or dead-lettered"
    );
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM pubsub_outbox_held_topic").await,
        0,
        "the hold ended"
    );
    delivered(&[(&held, &held_rows), (&other, &other_rows)]).await;
    let publishes = front.recorder.publishes();
    let refused = publishes.iter().filter(|c| c.refused.is_some()).count();
    eprintln!(
        "{code:?}: {refused} requests refused while held (probes included), the last held row \
         published {after:?} after the fix, {} publishes in all",
        publishes.len()
    );
    assert!(
        refused < 120,
        "the hold stops the doomed requests: {refused} refused"
    );
    dispatcher.signal("TERM");
}

#[tokio::test]
async fn permission_denied_while_a_grant_propagates_holds_the_topic_and_dead_letters_nothing() {
    held_while_refused_then_published_within_30_s(Code::PermissionDenied).await;
}

#[tokio::test]
async fn a_topic_created_after_its_writers_is_held_until_it_exists() {
    held_while_refused_then_published_within_30_s(Code::NotFound).await;
}

#[tokio::test]
async fn a_disabled_cmek_key_holds_the_topic_until_it_is_enabled() {
    held_while_refused_then_published_within_30_s(Code::FailedPrecondition).await;
}

#[tokio::test]
async fn a_proxys_404_holds_the_topic_until_the_route_exists() {
    held_while_refused_then_published_within_30_s(Code::Unimplemented).await;
}

#[tokio::test]
async fn a_held_topic_deleted_on_purpose_is_emptied_by_a_persons_cancel_and_the_hold_ends() {
    let db = TestDb::new().await;
    let gone = TestTopic::new(true).await;
    let front = FrontEnd::start(Options::default()).await;
    front.recorder.refuse(Refusal {
        until: None,
        ..Refusal::topic_for(&gone.topic, Code::NotFound, Duration::ZERO)
    });
    let sent = rows(&gone.topic, "gone", 3, 5, 10);
    enqueue(&db.pool, &sent).await;
    let dispatcher = front
        .dispatcher(db.url(), &["--poll-interval", "100ms"])
        .start()
        .expect("start the dispatcher");
    let held = || async { count(&db.pool, "SELECT count(*) FROM pubsub_outbox_held_topic").await };
    wait_until("the topic is held", Duration::from_secs(15), || async {
        if held().await == 1 {
            Ok(())
        } else {
            Err("not yet".to_owned())
        }
    })
    .await;
    // Nothing is dead-lettered without a person: it stays held, its rows untouched.
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(charged_and_dead(&db).await, (0, 0));
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM pubsub_outbox").await,
        25
    );

    let done = harness::operator::json(
        &db,
        &[
            "pending",
            "cancel",
            "--topic",
            &gone.topic,
            "--reason",
            "topic retired, CHG-42",
            "--yes",
            "--json",
        ],
    );
    assert_eq!(done["count"], 25, "{done}");
    wait_until("the hold ends", Duration::from_secs(20), || async {
        if held().await == 0 {
            Ok(())
        } else {
            Err("still held".to_owned())
        }
    })
    .await;
    assert_eq!(
        count(
            &db.pool,
            "SELECT count(*) FROM pubsub_outbox_dead_letter WHERE error_kind = 'cancelled'"
        )
        .await,
        25,
        "every message is a cancelled dead letter: inspectable, replayable"
    );
    let publishes = front.recorder.publishes();
    assert!(
        publishes.iter().all(|c| c.refused.is_some()),
        "nothing was accepted"
    );
    dispatcher.signal("TERM");
}

#[tokio::test]
async fn quota_refusals_slow_the_topic_down_and_charge_no_attempt() {
    let db = TestDb::new().await;
    let topic = TestTopic::new(true).await;
    let front = FrontEnd::start(Options::default()).await;
    let window = Duration::from_secs(30);
    front.recorder.refuse(Refusal {
        topic: None,
        code: Code::ResourceExhausted,
        message: "Quota exceeded for quota metric 'Regional publisher throughput'".to_owned(),
        until: Some(Instant::now() + window),
        fraction: 0.3,
        publish_only: true,
        messages_per_second: None,
    });
    let started = Utc::now();
    let fixed_at = started + chrono::Duration::from_std(window).expect("a short window");
    let mut dispatcher = front
        .dispatcher(db.url(), &["--retention", "1h", "--poll-interval", "100ms"])
        .start()
        .expect("start the dispatcher");
    // 100 rows a second for 30 s: half on 20 keys, half unkeyed.
    let all = rows(&topic.topic, "q", 20, 75, 1500);
    let (keyed, plain) = all.split_at(1500);
    let mut sent = Vec::new();
    for second in 0..30 {
        let tick = Instant::now();
        let mut chunk: Vec<NewMessage> = keyed[second * 50..(second + 1) * 50].to_vec();
        chunk.extend_from_slice(&plain[second * 50..(second + 1) * 50]);
        enqueue(&db.pool, &chunk).await;
        sent.extend(chunk);
        tokio::time::sleep(Duration::from_secs(1).saturating_sub(tick.elapsed())).await;
    }
    drained_published(&db, Duration::from_secs(60)).await;
    let (charged, dead) = charged_and_dead(&db).await;
    assert_eq!(dead, 0, "nothing dead-lettered");
    assert_eq!(charged, 0, "no attempt charged for RESOURCE_EXHAUSTED");
    let text = metrics(&mut dispatcher).await;
    let deferred: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("outbox_publish_failures_total{kind=\"throttled\"} "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0);
    let publishes = front.recorder.publishes();
    let refused = publishes.iter().filter(|c| c.refused.is_some()).count();
    assert!(
        refused > 0 && deferred > 0.0,
        "the stand-in refused ({refused}) and rows waited ({deferred})"
    );
    delivered(&[(&topic, &sent)]).await;

    let during = published_before(&db, fixed_at).await;
    let (_, last) = published_between(&db, &topic.topic).await;
    let tail = (last - fixed_at).num_milliseconds().max(0) as f64 / 1000.0;
    eprintln!(
        "quota: 3,000 rows written at 100/s for 30 s with 30 % of publishes refused: {during} \
         published while refused ({:.0} msgs/s against 100 written/s), the other {} within \
         {tail:.1} s after; {refused} of {} requests refused; {deferred} rows waited without an \
         attempt charged",
        during as f64 / window.as_secs_f64(),
        3000 - during,
        publishes.len()
    );
    dispatcher.signal("TERM");
}

#[tokio::test]
async fn a_throughput_quota_below_the_write_rate_is_met_by_slowing_down_without_charging() {
    let db = TestDb::new().await;
    let topic = TestTopic::new(true).await;
    let front = FrontEnd::start(Options::default()).await;
    let window = Duration::from_secs(30);
    // A quota of 60 messages a second for 30 s while 100 a second are written.
    front.recorder.refuse(Refusal {
        topic: None,
        code: Code::ResourceExhausted,
        message: "Quota exceeded for quota metric 'Regional publisher throughput'".to_owned(),
        until: Some(Instant::now() + window),
        fraction: 1.0,
        publish_only: true,
        messages_per_second: Some(60),
    });
    let started = Utc::now();
    let fixed_at = started + chrono::Duration::from_std(window).expect("a short window");
    let mut dispatcher = front
        .dispatcher(db.url(), &["--retention", "1h", "--poll-interval", "100ms"])
        .start()
        .expect("start the dispatcher");
    let sent = rows(&topic.topic, "r", 0, 0, 3000);
    for second in sent.chunks(100) {
        let tick = Instant::now();
        enqueue(&db.pool, second).await;
        tokio::time::sleep(Duration::from_secs(1).saturating_sub(tick.elapsed())).await;
    }
    drained_published(&db, Duration::from_secs(60)).await;
    assert_eq!(
        charged_and_dead(&db).await,
        (0, 0),
        "no attempt charged, nothing dead-lettered"
    );
    delivered(&[(&topic, &sent)]).await;
    let during = published_before(&db, fixed_at).await;
    let publishes = front.recorder.publishes();
    let refused = publishes.iter().filter(|c| c.refused.is_some()).count();
    let (_, last) = published_between(&db, &topic.topic).await;
    eprintln!(
        "throughput quota of 60 msgs/s for 30 s, 100 written/s: {during} published while it \
         held ({:.0} msgs/s), the other {} within {:.1} s after; {refused} of {} requests \
         refused",
        during as f64 / window.as_secs_f64(),
        3000 - during,
        (last - fixed_at).num_milliseconds().max(0) as f64 / 1000.0,
        publishes.len()
    );
    let _ = metrics(&mut dispatcher).await;
    dispatcher.signal("TERM");
}

/// Waits until every row is published (kept, marked).
async fn drained_published(db: &TestDb, limit: Duration) {
    wait_until("every row is published", limit, || async {
        match count(
            &db.pool,
            "SELECT count(*) FROM pubsub_outbox WHERE published_at IS NULL",
        )
        .await
        {
            0 => Ok(()),
            n => Err(format!("{n} unpublished")),
        }
    })
    .await;
}

#[tokio::test]
async fn connections_recycled_by_goaway_every_1_5_s_cost_no_attempt_and_lose_nothing() {
    let db = TestDb::new().await;
    let topic = TestTopic::new(true).await;
    let front = FrontEnd::start(Options {
        max_connection_age: Some(Duration::from_millis(1500)),
        ..Options::default()
    })
    .await;
    let mut dispatcher = front
        .dispatcher(
            db.url(),
            &[
                "--retention",
                "1h",
                "--poll-interval",
                "50ms",
                "--batch-size",
                "100",
            ],
        )
        .start()
        .expect("start the dispatcher");
    // 5,000 rows in ten waves a second apart, so requests are in flight as connections age out.
    let all = rows(&topic.topic, "g", 50, 40, 3000);
    for wave in all.chunks(500) {
        enqueue(&db.pool, wave).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    drained_published(&db, Duration::from_secs(60)).await;
    assert_eq!(
        charged_and_dead(&db).await,
        (0, 0),
        "no attempt charged, nothing dead-lettered"
    );
    delivered(&[(&topic, &all)]).await;
    let connections = front.recorder.connections();
    assert!(
        connections >= 6,
        "the connections were recycled: {connections} accepted over about 10 s"
    );
    let _ = metrics(&mut dispatcher).await;
    dispatcher.signal("TERM");
}

#[tokio::test]
async fn the_metadata_server_answering_503_at_pod_start_costs_nothing() {
    let db = TestDb::new().await;
    let topic = TestTopic::new(true).await;
    let front = FrontEnd::start(Options::default()).await;
    let down = Duration::from_secs(20);
    front.tokens.metadata_unavailable_for(down);
    let up_at = Instant::now() + down;
    let all = rows(&topic.topic, "m", 5, 20, 100);
    enqueue(&db.pool, &all).await;
    let mut dispatcher = front
        .dispatcher_on_gke(db.url(), &["--retention", "1h"])
        .start()
        .expect("start the dispatcher");
    let addr = dispatcher
        .bound_addr(Duration::from_secs(30))
        .await
        .expect("the dispatcher serves its endpoints")
        .to_string();
    tokio::time::sleep(Duration::from_secs(5)).await;
    let ready = http_request(&addr, "GET", "/readyz", &[], "").await;
    assert_eq!(
        ready.status,
        503,
        "not ready without credentials: {}\n{}",
        ready.body,
        dispatcher.log_tail(40)
    );
    drained_published(&db, down + Duration::from_secs(40)).await;
    let lag = Instant::now().saturating_duration_since(up_at);
    let (first, _) = published_between(&db, &topic.topic).await;
    assert_eq!(
        charged_and_dead(&db).await,
        (0, 0),
        "no attempt charged, nothing dead-lettered"
    );
    delivered(&[(&topic, &all)]).await;
    let publishes = front.recorder.publishes();
    assert!(!publishes.is_empty());
    for call in &publishes {
        assert_eq!(
            call.authorization,
            format!("Bearer {}", harness::token_server::METADATA_TOKEN),
            "every request carries the metadata server's token"
        );
    }
    let asked = front
        .tokens
        .requests()
        .iter()
        .filter(|r| r.request_line.contains("/computeMetadata/v1/"))
        .count();
    eprintln!(
        "metadata server 503 for {down:?}: first publish at {first}, drained within {lag:?} of \
         its recovery; {asked} token requests"
    );
    dispatcher.signal("TERM");
}

#[tokio::test]
async fn every_request_carries_the_adc_files_quota_project_and_the_authority_asked_for() {
    let db = TestDb::new().await;
    let topic = TestTopic::new(true).await;
    let front = FrontEnd::start(Options::default()).await;
    let all = rows(&topic.topic, "p", 3, 10, 20);
    enqueue(&db.pool, &all).await;
    let dispatcher = front
        .dispatcher(db.url(), &["--pubsub-authority", "pubsub.googleapis.com"])
        .start()
        .expect("start the dispatcher");
    drained(&db.pool, Duration::from_secs(30)).await;
    delivered(&[(&topic, &all)]).await;
    let calls = front.recorder.calls();
    assert!(calls.iter().any(|c| c.path.ends_with("/Publish")));
    for call in &calls {
        assert_eq!(
            call.user_project, QUOTA_PROJECT,
            "{}: x-goog-user-project",
            call.path
        );
        assert_eq!(
            call.authority, "pubsub.googleapis.com",
            "{}: the authority asked for, over TLS verified for localhost",
            call.path
        );
        assert_eq!(
            call.authorization,
            format!("Bearer {}", harness::token_server::USER_TOKEN)
        );
    }
    dispatcher.signal("TERM");
}
