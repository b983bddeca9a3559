//! The operator's verbs for messages not yet sent, as the real `dispatcher` binary runs them:
//! `pending cancel` (to the dead-letter table as `cancelled`: inspectable, replayable, blocking
//! nothing) and `pending retry-now` (due at once, attempts unchanged), each previewed exactly by
//! its dry run, audited with the identity, and refused whole (exit 2, nothing changed) for a typo
//! or an unknown id; and the same refusal for `dead-letters replay` and `discard`. A cancel names
//! the dead letters it made and the replay that undoes it (their ids, not the outbox's), and an id
//! the filter leaves out is said to be left out.

use serde_json::Value;

use harness::db::TestDb;
use harness::dispatcher::{self as test_dispatcher, drain, real_publisher};
use harness::fixtures::{count, enqueue, message, outbox_dedupe_keys};
use harness::operator::{dispatcher, json};
use harness::pubsub::TestTopic;
use outbox_shared::NewMessage;

fn keyed(topic: &str, dedupe: &str, key: &str) -> NewMessage {
    NewMessage::new(topic, dedupe, dedupe.as_bytes().to_vec()).with_ordering_key(key)
}

async fn id_of(db: &TestDb, dedupe: &str) -> i64 {
    sqlx::query_scalar("SELECT id FROM pubsub_outbox WHERE dedupe_key = $1")
        .bind(dedupe)
        .fetch_one(&db.pool)
        .await
        .expect("the row's id")
}

/// The unpublished rows' (dedupe key, attempts, next attempt in the future), by id.
async fn rows(db: &TestDb) -> Vec<(String, i32, bool)> {
    sqlx::query_as(
        "SELECT dedupe_key, attempts, next_attempt_at > now() FROM pubsub_outbox
         WHERE published_at IS NULL ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .expect("read the rows")
}

fn ids(v: &Value) -> Vec<i64> {
    v["ids"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_i64).collect())
        .unwrap_or_default()
}

#[tokio::test]
async fn a_cancelled_key_head_is_a_replayable_dead_letter_that_frees_its_key() {
    let db = TestDb::new().await;
    let topic = TestTopic::new(true).await;
    let t = topic.topic.as_str();
    enqueue(
        &db.pool,
        &[
            keyed(t, "a-1", "a"),
            keyed(t, "a-2", "a"),
            keyed(t, "a-3", "a"),
            message(t, "u-1", &[]),
        ],
    )
    .await;
    let head = id_of(&db, "a-1").await;

    // The dry run lists exactly what the change then does, and changes nothing.
    let dry = json(
        &db,
        &[
            "pending",
            "cancel",
            &head.to_string(),
            "--dry-run",
            "--json",
        ],
    );
    assert_eq!(ids(&dry), vec![head], "{dry}");
    assert_eq!(dry["dry_run"], true);
    assert_eq!(
        dry["keys"][0]["waiting"], 2,
        "two messages of the key then go: {dry}"
    );
    assert_eq!(dry["keys"][0]["blocked"], false);
    assert_eq!(rows(&db).await.len(), 4, "a dry run changes nothing");
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM pubsub_outbox_audit").await,
        0,
        "nor audits"
    );

    let done = json(
        &db,
        &[
            "pending",
            "cancel",
            &head.to_string(),
            "--reason",
            "sent twice by a bug, INC-7",
            "--json",
        ],
    );
    assert_eq!(ids(&done), ids(&dry), "the dry run previewed exactly this");
    let (kind, error, source, outbox_id): (String, String, String, Option<i64>) = sqlx::query_as(
        "SELECT error_kind, last_error, source, outbox_id FROM pubsub_outbox_dead_letter
         WHERE dedupe_key = 'a-1'",
    )
    .fetch_one(&db.pool)
    .await
    .expect("the cancelled message is a dead letter");
    assert_eq!(kind, "cancelled");
    assert_eq!(error, "cancelled by alice: sent twice by a bug, INC-7");
    assert_eq!((source.as_str(), outbox_id), ("operator", Some(head)));
    let (actor, db_user, action, row_ids, reason): (
        String,
        Option<String>,
        String,
        Vec<i64>,
        String,
    ) = sqlx::query_as("SELECT actor, db_user, action, row_ids, reason FROM pubsub_outbox_audit")
        .fetch_one(&db.pool)
        .await
        .expect("one audit row");
    assert_eq!(
        (actor.as_str(), action.as_str(), row_ids, reason.as_str()),
        ("alice", "cancel", vec![head], "sent twice by a bug, INC-7")
    );
    assert!(
        db_user.is_some_and(|u| !u.is_empty()),
        "the login is recorded too"
    );

    // The key is not blocked: a dispatcher publishes the rest of it, in order.
    let status = json(&db, &["status", "--json"]);
    assert_eq!(
        status["blocked_topics"],
        Value::Array(Vec::new()),
        "{status}"
    );
    let d =
        test_dispatcher::build(&db.pool, real_publisher().await, test_dispatcher::config()).await;
    drain(&d).await;
    assert!(outbox_dedupe_keys(&db.pool).await.is_empty());
    let got = topic.pull(3, std::time::Duration::from_secs(5)).await;
    let keyed_order: Vec<String> = harness::pubsub::by_publish_order(&got)
        .iter()
        .filter(|m| m.ordering_key == "a")
        .map(|m| m.dedupe_key().to_owned())
        .collect();
    assert_eq!(keyed_order, vec!["a-2", "a-3"]);

    // Replayable like any dead letter: back with its id, then published.
    let listed = json(
        &db,
        &["dead-letters", "list", "--kind", "cancelled", "--json"],
    );
    let dead_id = listed[0]["id"].as_i64().expect("a cancelled dead letter");
    json(
        &db,
        &[
            "dead-letters",
            "replay",
            &dead_id.to_string(),
            "--reason",
            "it was needed after all",
            "--json",
        ],
    );
    assert_eq!(id_of(&db, "a-1").await, head, "back with its own id");
}

#[tokio::test]
async fn retry_now_makes_waiting_rows_due_at_once_with_their_attempts_unchanged() {
    let db = TestDb::new().await;
    let t = "projects/pending-tests/topics/retry-now";
    enqueue(
        &db.pool,
        &[
            message(t, "w-1", &[]),
            message(t, "w-2", &[]),
            message(t, "due", &[]),
            keyed(t, "k-1", "k"),
        ],
    )
    .await;
    sqlx::raw_sql(
        "UPDATE pubsub_outbox SET attempts = 3, next_attempt_at = now() + interval '1 hour',
             last_error = 'UNAVAILABLE: down'
         WHERE dedupe_key IN ('w-1', 'w-2', 'k-1')",
    )
    .execute(&db.pool)
    .await
    .expect("put rows in backoff");
    let dry = json(
        &db,
        &["pending", "retry-now", "--topic", t, "--dry-run", "--json"],
    );
    assert_eq!(
        ids(&dry).len(),
        3,
        "the three waiting rows, not the due one: {dry}"
    );
    let (code, _, err) = dispatcher(
        &db,
        &["pending", "retry-now", "--topic", t, "--reason", "fixed"],
    );
    assert_eq!(code, 2, "by filter without --yes: {err}");
    let done = json(
        &db,
        &[
            "pending",
            "retry-now",
            "--topic",
            t,
            "--reason",
            "fixed",
            "--yes",
            "--json",
        ],
    );
    assert_eq!(ids(&done), ids(&dry), "the dry run previewed exactly this");
    assert_eq!(
        rows(&db).await,
        vec![
            ("w-1".to_owned(), 3, false),
            ("w-2".to_owned(), 3, false),
            ("due".to_owned(), 0, false),
            ("k-1".to_owned(), 3, false),
        ],
        "due now, attempts unchanged"
    );
    let audited: i64 = count(
        &db.pool,
        "SELECT count(*) FROM pubsub_outbox_audit WHERE action = 'retry-now' AND row_count = 3 AND actor = 'alice'",
    )
    .await;
    assert_eq!(audited, 1);
    // Nothing waits now: by id, it is nothing to do (exit 3), not an error.
    let w1 = id_of(&db, "w-1").await;
    let (code, _, err) = dispatcher(
        &db,
        &["pending", "retry-now", &w1.to_string(), "--reason", "again"],
    );
    assert_eq!(code, 3, "{err}");
}

#[tokio::test]
async fn a_typo_or_an_unknown_id_refuses_the_whole_change_with_exit_2_and_changes_nothing() {
    let db = TestDb::new().await;
    let t = "projects/pending-tests/topics/refusals";
    enqueue(&db.pool, &[message(t, "m-1", &[]), message(t, "m-2", &[])]).await;
    let m1 = id_of(&db, "m-1").await;
    let before = rows(&db).await;
    for args in [
        vec![
            "pending",
            "cancel",
            "--topic",
            "projects/pending-tests/topics/refusal",
            "--reason",
            "x",
            "--yes",
        ],
        vec![
            "pending",
            "cancel",
            &m1.to_string(),
            "99999",
            "--reason",
            "x",
        ],
        vec![
            "pending",
            "retry-now",
            &m1.to_string(),
            "99999",
            "--reason",
            "x",
        ],
        vec!["pending", "cancel", &m1.to_string(), "99999", "--dry-run"],
        vec!["pending", "cancel", "--reason", "x", "--yes"],
        vec!["pending", "cancel", &m1.to_string()],
    ] {
        let (code, out, err) = dispatcher(&db, &args);
        assert_eq!(code, 2, "{args:?}: {out}{err}");
        assert!(out.is_empty(), "{args:?} printed no result: {out}");
    }
    let (_, _, err) = dispatcher(
        &db,
        &[
            "pending",
            "cancel",
            &m1.to_string(),
            "99999",
            "--reason",
            "x",
        ],
    );
    assert!(
        err.contains("99999") && err.contains("nothing was changed"),
        "names the unknown id: {err}"
    );
    let (_, _, err) = dispatcher(
        &db,
        &[
            "pending",
            "cancel",
            "--topic",
            "projects/pending-tests/topics/refusal",
            "--reason",
            "x",
            "--yes",
        ],
    );
    assert!(
        err.contains("did you mean projects/pending-tests/topics/refusals"),
        "{err}"
    );
    assert_eq!(rows(&db).await, before, "nothing changed");
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM pubsub_outbox_dead_letter").await
            + count(&db.pool, "SELECT count(*) FROM pubsub_outbox_audit").await,
        0
    );

    // The dead letters' changes take the same rule: one unknown id refuses them whole.
    sqlx::raw_sql(&format!(
        "INSERT INTO pubsub_outbox_dead_letter (topic, dedupe_key, payload, attributes, created_at,
             attempts, error_kind, last_error, source)
         VALUES ('{t}', 'dl-1', '\\x00', '{{}}', now(), 1, 'permanent', 'INVALID_ARGUMENT: x', 'dispatcher')"
    ))
    .execute(&db.pool)
    .await
    .expect("a dead letter");
    let dead: i64 = count(&db.pool, "SELECT id FROM pubsub_outbox_dead_letter").await;
    for action in ["replay", "discard"] {
        for dry in [false, true] {
            let mut args = vec!["dead-letters", action];
            let id = dead.to_string();
            args.extend([id.as_str(), "99999", "--reason", "x"]);
            if dry {
                args.push("--dry-run");
            }
            let (code, _, err) = dispatcher(&db, &args);
            assert_eq!(code, 2, "{args:?}: {err}");
            assert!(err.contains("99999"), "{err}");
        }
    }
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM pubsub_outbox_dead_letter").await,
        1,
        "nothing replayed or discarded"
    );
    assert_eq!(rows(&db).await, before);
}

#[tokio::test]
async fn a_page_that_is_not_the_last_says_how_to_get_the_next_across_topics_too() {
    let db = TestDb::new().await;
    let (a, b) = (
        "projects/pending-tests/topics/pages-a",
        "projects/pending-tests/topics/pages-b",
    );
    let mut values = Vec::new();
    for (topic, key) in [(a, "k1"), (a, "k2"), (b, "k1")] {
        values.push(format!(
            "('{topic}', '{key}', '{topic}-{key}', '\\x00', '{{}}', now(), 1, 'permanent', 'INVALID_ARGUMENT: x', 'dispatcher')"
        ));
    }
    sqlx::raw_sql(&format!(
        "INSERT INTO pubsub_outbox_dead_letter (topic, ordering_key, dedupe_key, payload,
             attributes, created_at, attempts, error_kind, last_error, source)
         VALUES {}",
        values.join(", ")
    ))
    .execute(&db.pool)
    .await
    .expect("three blocking dead letters over two topics");

    let (code, out, err) = dispatcher(&db, &["dead-letters", "blocked", "--limit", "2"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("k2") && !out.contains("pages-b"), "{out}");
    assert!(
        err.contains(&format!("--after-topic {a} --after-key \"k2\"")),
        "says how to get the next page: {err}"
    );
    let (code, out, err) = dispatcher(
        &db,
        &[
            "dead-letters",
            "blocked",
            "--limit",
            "2",
            "--after-topic",
            a,
            "--after-key",
            "k2",
        ],
    );
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("pages-b") && !out.contains("pages-a"), "{out}");
    assert!(err.is_empty(), "the last page says nothing more: {err}");
    let (code, _, err) = dispatcher(&db, &["dead-letters", "blocked", "--after-key", "k2"]);
    assert_eq!(code, 2, "--after-key needs its topic: {err}");

    let (code, out, err) = dispatcher(&db, &["dead-letters", "list", "--limit", "2"]);
    assert_eq!(code, 0, "{err}");
    let shown: Vec<&str> = out.lines().skip(1).collect();
    assert_eq!(shown.len(), 2, "{out}");
    assert!(err.contains("the next page is --before-id"), "{err}");
    let (_, _, err) = dispatcher(&db, &["dead-letters", "list", "--limit", "3"]);
    assert!(err.is_empty(), "all fit: {err}");

    enqueue(
        &db.pool,
        &[
            message(a, "p-1", &[]),
            message(a, "p-2", &[]),
            message(a, "p-3", &[]),
        ],
    )
    .await;
    let (code, _, err) = dispatcher(&db, &["pending", "list", "--topic", a, "--limit", "2"]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("--after-id"), "{err}");
}

#[tokio::test]
async fn show_of_a_replayed_dead_letter_says_where_its_message_went() {
    use outbox_dispatcher::Code;
    use outbox_dispatcher::fault::{Fault, FaultInjector};
    let db = TestDb::new().await;
    let topic = TestTopic::new(false).await;
    enqueue(&db.pool, &[message(&topic.topic, "again", &[])]).await;
    let publisher = FaultInjector::passthrough(real_publisher().await);
    publisher.fail(
        "again",
        Fault {
            code: Code::InvalidArgument,
            times: None,
        },
    );
    let d = test_dispatcher::build(&db.pool, publisher, test_dispatcher::config()).await;
    drain(&d).await;
    let first: i64 = count(&db.pool, "SELECT id FROM pubsub_outbox_dead_letter").await;
    json(
        &db,
        &[
            "dead-letters",
            "replay",
            &first.to_string(),
            "--reason",
            "try again",
            "--json",
        ],
    );
    let (code, _, err) = dispatcher(&db, &["dead-letters", "show", &first.to_string()]);
    assert_eq!(code, 3, "{err}");
    assert!(
        err.contains("replayed by alice") && err.contains("waits in the outbox"),
        "{err}"
    );
    drain(&d).await;
    let second: i64 = count(&db.pool, "SELECT id FROM pubsub_outbox_dead_letter").await;
    assert_ne!(first, second, "refused again: a new dead letter");
    let (code, _, err) = dispatcher(&db, &["dead-letters", "show", &first.to_string()]);
    assert_eq!(code, 3, "{err}");
    assert!(
        err.contains(&format!("it is dead letter {second} now")),
        "the gone id points at the new one: {err}"
    );
}

#[tokio::test]
async fn a_cancel_names_the_dead_letters_it_made_and_its_undo_puts_them_back() {
    let db = TestDb::new().await;
    let t = "projects/test-project/topics/undo";
    enqueue(&db.pool, &[message(t, "x-1", &[]), message(t, "x-2", &[])]).await;
    // A dead letter whose id overlaps the outbox's: the ids must not be confused.
    harness::fixtures::dead_letter(&db.pool, t, None, b"{}", "INVALID_ARGUMENT: old").await;
    let (x1, x2) = (id_of(&db, "x-1").await, id_of(&db, "x-2").await);
    let (a, b) = (x1.to_string(), x2.to_string());
    let done = json(
        &db,
        &[
            "pending",
            "cancel",
            &a,
            &b,
            "--reason",
            "sent twice",
            "--json",
        ],
    );
    assert_eq!(done["ids_are"], "outbox", "{done}");
    assert_eq!(ids(&done), vec![x1, x2], "{done}");
    let made: Vec<(i64, i64)> = done["dead_letters"]
        .as_array()
        .expect("dead_letters")
        .iter()
        .map(|m| {
            (
                m["outbox_id"].as_i64().expect("outbox id"),
                m["dead_letter_id"].as_i64().expect("dead letter id"),
            )
        })
        .collect();
    for (outbox_id, dead_letter_id) in &made {
        let stored: Option<i64> = sqlx::query_scalar(
            "SELECT outbox_id FROM pubsub_outbox_dead_letter WHERE id = $1 AND error_kind = 'cancelled'",
        )
        .bind(dead_letter_id)
        .fetch_optional(&db.pool)
        .await
        .expect("read the dead letter");
        assert_eq!(
            stored,
            Some(*outbox_id),
            "dead letter {dead_letter_id} is outbox row {outbox_id}"
        );
    }
    let undo = done["undo"].as_str().expect("the undo command");
    let (_, text, _) = dispatcher(&db, &["pending", "list", "--topic", t]);
    assert!(text.contains("No unpublished message"), "{text}");
    // The undo command, as printed (its reason filled in).
    let args: Vec<String> = undo
        .trim_start_matches("dispatcher ")
        .replace("\"…\"", "undo")
        .split_whitespace()
        .map(str::to_owned)
        .collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (code, out, err) = dispatcher(&db, &args);
    assert_eq!(code, 0, "{undo}: {out}{err}");
    assert_eq!(
        outbox_dedupe_keys(&db.pool).await,
        vec!["x-1".to_owned(), "x-2".to_owned()],
        "both back, under their own outbox ids"
    );
    let (_, text, _) = dispatcher(&db, &["pending", "cancel", &a, "--reason", "again"]);
    assert!(
        text.contains("They are dead letters")
            && text.contains("To undo: dispatcher dead-letters replay"),
        "the text names the dead letters and the undo: {text}"
    );
}

#[tokio::test]
async fn an_id_the_filter_leaves_out_is_said_to_be_left_out() {
    let db = TestDb::new().await;
    let t = "projects/test-project/topics/outside";
    enqueue(
        &db.pool,
        &[message(t, "in-1", &[]), message(t, "out-1", &[])],
    )
    .await;
    let (inside, outside) = (id_of(&db, "in-1").await, id_of(&db, "out-1").await);
    let (code, out, err) = dispatcher(
        &db,
        &[
            "pending",
            "cancel",
            &inside.to_string(),
            &outside.to_string(),
            "--dedupe-prefix",
            "in-",
            "--reason",
            "only the in ones",
            "--json",
        ],
    );
    assert_eq!(code, 1, "an id given was not changed: {out}{err}");
    let report: Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(ids(&report), vec![inside], "{report}");
    assert_eq!(report["outside"], serde_json::json!([outside]), "{report}");
    assert!(err.contains("the filter leaves them out"), "{err}");
    assert_eq!(outbox_dedupe_keys(&db.pool).await, vec!["out-1".to_owned()]);
}
