//! The autoscaling signal (`outbox_claimable_age_seconds`, from `outbox::backlog_by_topic`): the
//! age of the oldest row a claim could take now. A paused topic's rows wait by the operator's
//! intent and a key behind a dead letter waits for the operator: neither is work more
//! dispatchers could do, and neither may hide the other topics' signal.

use chrono::Utc;
use harness::db::TestDb;
use harness::fixtures::{enqueue, message};
use outbox_shared::store::outbox::{self, BacklogQuery, TopicBacklog};

fn keyed(topic: &str, dedupe: &str, key: &str) -> outbox_shared::NewMessage {
    message(topic, dedupe, &[]).with_ordering_key(key)
}

async fn backlog(db: &TestDb, paused: &[String], skip: &[String]) -> Vec<TopicBacklog> {
    let mut tx = db.pool.begin().await.expect("begin");
    let b = outbox::backlog_by_topic(
        &mut tx,
        &BacklogQuery {
            now: Utc::now(),
            topics: None,
            not_claimed: paused,
            skip_dead_letter_topics: skip,
            cap: 1_000_000,
        },
    )
    .await
    .expect("read the backlog");
    tx.commit().await.expect("commit");
    b
}

fn of<'a>(b: &'a [TopicBacklog], topic: &str) -> &'a TopicBacklog {
    b.iter()
        .find(|t| t.topic == topic)
        .unwrap_or_else(|| panic!("{topic} in {b:?}"))
}

#[tokio::test]
async fn a_paused_topic_and_a_blocked_key_are_not_claimable_and_leave_the_other_topics_signal() {
    let db = TestDb::new().await;
    let (paused, mixed, only_blocked) = (
        "projects/p/topics/paused",
        "projects/p/topics/mixed",
        "projects/p/topics/blocked",
    );
    enqueue(
        &db.pool,
        &[
            message(paused, "p-1", &[]),
            keyed(paused, "p-2", "a"),
            // mixed: a key behind a dead letter (the oldest rows), a free key and an unkeyed row.
            keyed(mixed, "m-blocked-1", "k"),
            keyed(mixed, "m-blocked-2", "k"),
            keyed(mixed, "m-free", "j"),
            message(mixed, "m-unkeyed", &[]),
            keyed(only_blocked, "b-1", "z"),
        ],
    )
    .await;
    sqlx::raw_sql(&format!(
        "UPDATE pubsub_outbox SET created_at = now() - interval '600 seconds'
             WHERE dedupe_key IN ('p-1', 'p-2', 'm-blocked-1', 'm-blocked-2', 'b-1');
         UPDATE pubsub_outbox SET created_at = now() - interval '120 seconds'
             WHERE dedupe_key IN ('m-free', 'm-unkeyed');
         INSERT INTO pubsub_outbox_dead_letter (topic, ordering_key, dedupe_key, payload, attributes, created_at, attempts, error_kind, last_error, source)
         VALUES ('{mixed}', 'k', 'm-blocked-0', '\\x00', '{{}}', now(), 1, 'permanent', 'INVALID_ARGUMENT: bad', 'dispatcher'),
                ('{only_blocked}', 'z', 'b-0', '\\x00', '{{}}', now(), 1, 'permanent', 'INVALID_ARGUMENT: bad', 'dispatcher');"
    ))
    .execute(&db.pool)
    .await
    .expect("age the rows, dead-letter the keys' heads");

    let b = backlog(&db, &[paused.to_owned()], &[]).await;
    let near = |v: f64, want: f64| (v - want).abs() < 30.0;
    // The paused topic: its rows wait (due, 10 minutes old) but none is claimable.
    assert!(near(of(&b, paused).oldest_due_age_secs, 600.0), "{b:?}");
    assert_eq!(of(&b, paused).claimable_age_secs, 0.0, "{b:?}");
    // The blocked key does not hide the topic's other rows: the signal is theirs (2 minutes).
    assert!(near(of(&b, mixed).oldest_due_age_secs, 600.0), "{b:?}");
    assert!(near(of(&b, mixed).claimable_age_secs, 120.0), "{b:?}");
    // A topic with nothing but a blocked key has no claimable work.
    assert_eq!(of(&b, only_blocked).claimable_age_secs, 0.0, "{b:?}");
    assert_eq!(of(&b, only_blocked).pending, 1);

    // Resumed, the paused topic's rows are claimable again; a topic whose keys skip dead letters
    // is never blocked.
    let b = backlog(&db, &[], &[only_blocked.to_owned()]).await;
    assert!(near(of(&b, paused).claimable_age_secs, 600.0), "{b:?}");
    assert!(
        near(of(&b, only_blocked).claimable_age_secs, 600.0),
        "{b:?}"
    );
    assert!(near(of(&b, mixed).claimable_age_secs, 120.0), "{b:?}");
}

#[tokio::test]
async fn rows_behind_a_key_head_waiting_for_its_retry_are_waiting_not_claimable() {
    let db = TestDb::new().await;
    let t = "projects/p/topics/backoff";
    enqueue(
        &db.pool,
        &[
            keyed(t, "k-1", "k"),
            keyed(t, "k-2", "k"),
            keyed(t, "k-3", "k"),
            keyed(t, "j-1", "j"),
        ],
    )
    .await;
    // Every row is old; the head of k waits five minutes for its retry, j is free.
    sqlx::raw_sql(
        "UPDATE pubsub_outbox SET created_at = now() - interval '600 seconds';
         UPDATE pubsub_outbox SET created_at = now() - interval '60 seconds' WHERE dedupe_key = 'j-1';
         UPDATE pubsub_outbox SET attempts = 2, next_attempt_at = now() + interval '300 seconds'
             WHERE dedupe_key = 'k-1'",
    )
    .execute(&db.pool)
    .await
    .expect("put k's head in backoff");
    let b = backlog(&db, &[], &[]).await;
    let near = |v: f64, want: f64| (v - want).abs() < 30.0;
    assert!(
        near(of(&b, t).claimable_age_secs, 60.0),
        "k-2 and k-3 are due but wait behind their head: the signal is j's: {b:?}"
    );
    let status = harness::operator::json(&db, &["status", "--json"]);
    let topic = status["topics"]
        .as_array()
        .and_then(|ts| ts.iter().find(|x| x["topic"] == t))
        .unwrap_or_else(|| panic!("{status}"))
        .clone();
    assert_eq!(topic["due_now"], 1, "only j-1: {topic}");
    // The gauge outbox_oldest_due_age_seconds and status agree: j-1's age, not k-2's.
    let status_age = topic["oldest_due_age_seconds"].as_f64().unwrap_or(f64::NAN);
    assert!(near(status_age, 60.0), "{topic}");
    assert!(
        (of(&b, t).oldest_due_age_secs - status_age).abs() < 5.0,
        "the gauge's oldest due age is status's: {b:?} {topic}"
    );
    assert_eq!(
        topic["waiting"], 3,
        "k's three rows wait for its head: {topic}"
    );
    let next: chrono::DateTime<Utc> = topic["next_due_at"]
        .as_str()
        .and_then(|s| s.parse().ok())
        .expect("when the head is tried");
    assert!(
        (next - Utc::now()).num_seconds() > 250,
        "the head's retry time: {next}"
    );
}
