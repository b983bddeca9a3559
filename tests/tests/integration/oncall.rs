//! What a new operator met on call (issue #36), through the real binaries: `status` says why a
//! breaker is open; a dead-letter filter's unknown topic is refused like `pause`'s (short names
//! too); every change has a dry run that shows exactly what it would do, and a change by filter
//! needs `--yes`; a replay that would leave an entry in place says so at its dry run, and how to
//! release the key; an operator command's last word in JSON mode is one JSON line.

use chrono::Utc;
use harness::db::TestDb;
use harness::fixtures::{count, dead_letter, enqueue, message};
use harness::operator::{dispatcher, json};
use harness::process::output;
use outbox_shared::store::replica::{self, Replica};

const TOPIC: &str = "projects/ops-project/topics/payments";

#[tokio::test]
async fn status_says_why_a_replicas_breaker_is_open() {
    let db = TestDb::new().await;
    let reason = "Pub/Sub at https://pubsub.googleapis.com does not answer: cannot connect: \
                  Connection refused (os error 111)";
    let mut tx = db.pool.begin().await.expect("begin");
    for id in ["replica-a", "replica-b"] {
        let row = Replica {
            replica_id: id.into(),
            hostname: format!("{id}-host"),
            pid: 1,
            version: env!("CARGO_PKG_VERSION").into(),
            build_commit: None,
            topics: None,
            started_at: Utc::now(),
            heartbeat_at: Utc::now(),
            breaker_open: true,
            breaker_reason: Some(reason.into()),
            batches_in_flight: 0,
            rows_in_flight: 0,
            published: 0,
        };
        replica::heartbeat(&mut tx, &row).await.expect("heartbeat");
    }
    tx.commit().await.expect("commit");
    let status = json(&db, &["status", "--json"]);
    let warnings: Vec<&str> = status["warnings"]
        .as_array()
        .expect("warnings")
        .iter()
        .filter_map(|w| w.as_str())
        .filter(|w| w.contains("unreachable"))
        .collect();
    assert_eq!(warnings.len(), 1, "one warning per reason: {warnings:#?}");
    assert!(
        warnings[0].contains("from 2 replica(s)") && warnings[0].contains(reason),
        "{}",
        warnings[0]
    );
    assert_eq!(status["replicas"][0]["breaker_reason"], reason);
}

#[tokio::test]
async fn a_dead_letter_filters_unknown_topic_is_refused_with_the_near_ones() {
    let db = TestDb::new().await;
    dead_letter(&db.pool, TOPIC, None, b"{}", "INVALID_ARGUMENT: x").await;
    for (args, hint) in [
        (
            &[
                "dead-letters",
                "list",
                "--topic",
                "projects/ops-project/topics/paymens",
            ][..],
            "did you mean projects/ops-project/topics/payments?",
        ),
        (
            &[
                "dead-letters",
                "list",
                "--topic",
                "paymens",
                "--pubsub-project",
                "ops-project",
            ][..],
            "did you mean projects/ops-project/topics/payments?",
        ),
        (
            &[
                "dead-letters",
                "replay",
                "--topic",
                "paymens",
                "--pubsub-project",
                "ops-project",
                "--dry-run",
            ][..],
            "did you mean",
        ),
        (
            &[
                "dead-letters",
                "blocked",
                "--topic",
                "projects/ops-project/topics/paymens",
            ][..],
            "did you mean",
        ),
    ] {
        let (code, _, err) = dispatcher(&db, args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains(hint), "{args:?}: {err}");
    }
    let (code, out, _) = dispatcher(
        &db,
        &[
            "dead-letters",
            "list",
            "--topic",
            "payments",
            "--pubsub-project",
            "ops-project",
        ],
    );
    assert_eq!(code, 0, "the short name of a known topic lists it: {out}");
}

#[tokio::test]
async fn a_replays_dry_run_shows_what_it_would_leave_in_place_and_how_to_release_the_key() {
    let db = TestDb::new().await;
    let id = dead_letter(
        &db.pool,
        TOPIC,
        Some("customer-7"),
        b"{}",
        "INVALID_ARGUMENT: x",
    )
    .await;
    let dedupe: String =
        sqlx::query_scalar("SELECT dedupe_key FROM pubsub_outbox_dead_letter WHERE id = $1")
            .bind(id)
            .fetch_one(&db.pool)
            .await
            .expect("its dedupe key");
    // The same message written again (a rewind, an application retry): its key is in the outbox.
    enqueue(&db.pool, &[message(TOPIC, &dedupe, &[])]).await;
    let id_text = id.to_string();
    let replay = |args: &[&str]| {
        let (code, out, err) = dispatcher(&db, args);
        let report: serde_json::Value = serde_json::from_str(&out).expect("--json");
        (code, report, err)
    };
    let (code, dry, _) = replay(&["dead-letters", "replay", &id_text, "--dry-run", "--json"]);
    assert_eq!(code, 1, "nothing it was asked to replay would be: {dry}");
    assert_eq!(dry["ids"], serde_json::json!([]), "{dry}");
    assert_eq!(dry["skipped"], serde_json::json!([id]), "{dry}");
    let (_, text, _) = dispatcher(&db, &["dead-letters", "replay", &id_text, "--dry-run"]);
    assert!(
        text.contains("would be left in place") && text.contains(&format!("discard {id}")),
        "the dry run says what the replay would do and how to release the key: {text}"
    );
    let (code, done, _) = replay(&[
        "dead-letters",
        "replay",
        &id_text,
        "--reason",
        "x",
        "--json",
    ]);
    assert_eq!(code, 1, "{done}");
    assert_eq!(
        (done["ids"].clone(), done["skipped"].clone()),
        (dry["ids"].clone(), dry["skipped"].clone()),
        "the replay did what its dry run showed"
    );
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM pubsub_outbox_dead_letter").await,
        1
    );
}

#[tokio::test]
async fn every_change_has_a_dry_run_that_changes_nothing_and_a_filter_needs_yes() {
    let db = TestDb::new().await;
    enqueue(&db.pool, &[message(TOPIC, "m-1", &[])]).await;
    let audit = || count(&db.pool, "SELECT count(*) FROM pubsub_outbox_audit");
    // No reason needed for a dry run; nothing written.
    let pause = json(&db, &["pause", TOPIC, "--dry-run", "--json"]);
    assert_eq!(
        (pause["changed"].clone(), pause["dry_run"].clone()),
        (true.into(), true.into())
    );
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM pubsub_outbox_paused_topic").await,
        0
    );
    assert_eq!(audit().await, 0);
    let (code, _, err) = dispatcher(&db, &["pause", TOPIC]);
    assert_eq!(code, 2, "a change needs its reason: {err}");
    let (code, _, err) = dispatcher(
        &db,
        &["dead-letters", "discard", "--topic", TOPIC, "--reason", "x"],
    );
    assert_eq!(code, 2, "a change by filter needs --yes: {err}");
    assert!(err.contains("--dry-run, then add --yes"), "{err}");

    // producer rewind, the change that re-publishes the most: a dry run first.
    sqlx::query(
        "INSERT INTO producer_watermark (stream, cursor_micros, cursor_key, updated_at)
         VALUES ('orders', 1796040005000000, '42', now())",
    )
    .execute(&db.pool)
    .await
    .expect("a watermark");
    let dry = output(
        "producer",
        &[
            "rewind",
            "orders",
            "--to",
            "2026-11-30T12:00:00Z",
            "--dry-run",
            "--json",
        ],
        &[("DATABASE_URL", db.url().to_owned())],
    )
    .await;
    let view: serde_json::Value =
        serde_json::from_slice(&dry.stdout).expect("rewind --dry-run --json");
    assert_eq!(dry.status.code(), Some(0), "{view}");
    assert_eq!(view["dry_run"], true);
    assert!(view["audit_id"].is_null(), "{view}");
    assert_eq!(
        view["watermark"]["timestamp"],
        "2026-11-30T12:00:00.000000Z"
    );
    let stored: i64 =
        sqlx::query_scalar("SELECT cursor_micros FROM producer_watermark WHERE stream = 'orders'")
            .fetch_one(&db.pool)
            .await
            .expect("the watermark");
    assert_eq!(stored, 1796040005000000, "a dry run moves nothing");
    assert_eq!(audit().await, 0, "and audits nothing");
}

#[tokio::test]
async fn in_json_mode_an_operator_commands_last_word_is_one_json_line() {
    let db = TestDb::new().await;
    let out = output(
        "dispatcher",
        &["dead-letters", "show", "4242", "--log-format", "json"],
        &[("DATABASE_URL", db.url().to_owned())],
    )
    .await;
    assert_eq!(out.status.code(), Some(3));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    let line: serde_json::Value = serde_json::from_str(lines[0]).expect("a JSON line");
    assert_eq!(line["severity"], "ERROR");
    assert_eq!(line["exit_code"], 3);
    assert!(
        line["error"]
            .as_str()
            .is_some_and(|e| e.contains("no dead letter with id 4242")),
        "{line}"
    );
}
