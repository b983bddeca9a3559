//! The rules every operator command keeps, through the real `dispatcher` binary (issue #21): a
//! topic name must be valid and known (a typo is refused with the near matches, changing
//! nothing); a pause is in force when the command returns (two replicas running); a change that
//! makes rows claimable wakes the dispatchers; output into a closed pipe ends quietly; a payload
//! preview is escaped once; the actor is the OS user when no variable names one; gone replicas
//! are forgotten and can be pruned; `status` counts as due only what a claim can take.

use std::time::Duration;

use serde_json::Value;

use harness::db::TestDb;
use harness::dispatcher::{self as test_dispatcher, Running, real_publisher};
use harness::fixtures::{count, dead_letter, enqueue, enqueue_and_notify, message};
use harness::operator::{dispatcher, json};
use harness::process::{Spawn, binary};
use harness::pubsub::TestTopic;
use harness::wait::{topic_drained, wait_until};
use outbox_dispatcher::DispatcherConfig;
use outbox_shared::NewMessage;

/// A dispatcher replica on `db`, running until stopped.
async fn replica(db: &TestDb, config: DispatcherConfig) -> Running {
    Running::start(test_dispatcher::build_service(db, real_publisher().await, config).await)
}

/// Idle workers that poll only every 30 s: what reaches them sooner was a NOTIFY.
fn slow_polling() -> DispatcherConfig {
    let mut config = test_dispatcher::config();
    config.idle.poll_interval = Duration::from_secs(30);
    config.idle.max_poll_interval = Duration::from_secs(30);
    config
}

#[tokio::test]
async fn pause_refuses_a_name_that_is_not_a_known_topic_and_lists_the_near_ones() {
    let db = TestDb::new().await;
    let known = "projects/ops-project/topics/shipments";
    enqueue(&db.pool, &[message(known, "s-1", &[])]).await;
    let refused = [
        (
            "projects/ops-project/topic/shipments",
            "did you mean projects/ops-project/topics/shipments?",
        ),
        (
            "not a topic",
            "known: projects/ops-project/topics/shipments",
        ),
        (
            "projects/ops-project/topics/shipments ",
            "did you mean projects/ops-project/topics/shipments?",
        ),
        (
            "projects/ops-project/topics/Shipments",
            "did you mean projects/ops-project/topics/shipments?",
        ),
        ("projects/ops-project/topics/returns", "is not known here"),
        ("projects/ops-project/topics/go", "3 to 255"),
        ("projects/x/topics/shipments", "6 to 30"),
    ];
    for (given, needle) in refused {
        let (code, out, err) = dispatcher(&db, &["pause", given, "--reason", "typo"]);
        assert_eq!(code, 2, "pause {given:?} is bad usage: {out}{err}");
        assert!(
            err.contains(needle),
            "pause {given:?} says {needle:?}: {err}"
        );
        assert!(!out.contains("paused"), "{out}");
    }
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM pubsub_outbox_paused_topic").await,
        0
    );
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM pubsub_outbox_audit").await,
        0,
        "nothing audited"
    );
    // A topic with no message yet, said so explicitly; the real one, known.
    let (code, _, err) = dispatcher(
        &db,
        &[
            "pause",
            "projects/ops-project/topics/returns",
            "--new-topic",
            "--reason",
            "before launch",
        ],
    );
    assert_eq!(code, 0, "{err}");
    let (code, out, err) = dispatcher(&db, &["pause", known, "--reason", "consumer down"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("paused (audit entry"), "{out}");
    // resume of a typo: nothing is paused under that name; the paused ones near it are named.
    let (code, out, _) = dispatcher(
        &db,
        &[
            "resume",
            "projects/ops-project/topics/shipment",
            "--reason",
            "typo",
        ],
    );
    assert_eq!(code, 3, "{out}");
    assert!(
        out.contains("did you mean projects/ops-project/topics/shipments?"),
        "{out}"
    );
}

#[tokio::test]
async fn a_pause_is_in_force_when_it_returns_twenty_times_in_a_row_with_two_replicas() {
    let db = TestDb::new().await;
    let topic = TestTopic::new(false).await;
    let t = topic.topic.as_str();
    // Eager replicas: each polls every 50 ms and wakes on the enqueue's NOTIFY.
    let replicas = [
        replica(&db, test_dispatcher::config()).await,
        replica(&db, test_dispatcher::config()).await,
    ];
    for round in 0..20 {
        let mut pause = vec!["pause", t, "--reason", "consumer down"];
        if round == 0 {
            pause.insert(2, "--new-topic");
        }
        let (code, _, err) = dispatcher(&db, &pause);
        assert_eq!(code, 0, "round {round}: {err}");
        // Committed the moment pause returned: no claim may take it.
        enqueue_and_notify(&db.pool, &[message(t, &format!("r{round}"), &[])]).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        let waits = count(
            &db.pool,
            &format!(
                "SELECT count(*) FROM pubsub_outbox WHERE dedupe_key = 'r{round}' AND attempts = 0"
            ),
        )
        .await;
        assert_eq!(
            waits, 1,
            "round {round}: the row waits while the topic is paused"
        );
        let (code, _, err) = dispatcher(&db, &["resume", t, "--reason", "consumer back"]);
        assert_eq!(code, 0, "round {round}: {err}");
        topic_drained(&db.pool, t, Duration::from_secs(15)).await;
    }
    let received = topic.pull(20, Duration::from_secs(3)).await;
    assert_eq!(
        received.len(),
        20,
        "every round's message arrived once resumed"
    );
    for r in replicas {
        r.stop().await;
    }
}

#[tokio::test]
async fn resume_replay_and_discard_wake_the_dispatchers_and_a_locally_refused_replay_warns() {
    let db = TestDb::new().await;
    let topic = TestTopic::new(true).await;
    let t = topic.topic.as_str();
    // A key blocked by a dead letter, with two messages waiting behind it.
    let blocking = dead_letter(&db.pool, t, Some("k"), b"{}", "INVALID_ARGUMENT: schema").await;
    let waiting: Vec<NewMessage> = (0..2)
        .map(|i| NewMessage::new(t, format!("k-{i}"), b"{}".to_vec()).with_ordering_key("k"))
        .collect();
    enqueue(&db.pool, &waiting).await;
    let service = replica(&db, slow_polling()).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM pubsub_outbox").await,
        2,
        "the key is blocked"
    );
    let (code, _, err) = dispatcher(
        &db,
        &[
            "dead-letters",
            "discard",
            &blocking.to_string(),
            "--reason",
            "never send it",
        ],
    );
    assert_eq!(code, 0, "{err}");
    let took = topic_drained(&db.pool, t, Duration::from_secs(15)).await;
    eprintln!("WAKE: the key's rows published {took:?} after the discard (poll every 30 s)");

    let replayed = dead_letter(
        &db.pool,
        t,
        None,
        b"{\"fine\":1}",
        "INVALID_ARGUMENT: schema",
    )
    .await;
    let (code, out, err) = dispatcher(
        &db,
        &[
            "dead-letters",
            "replay",
            &replayed.to_string(),
            "--reason",
            "schema fixed",
            "--json",
        ],
    );
    assert_eq!(code, 0, "{err}");
    let report: Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(report["refused_locally"], serde_json::json!([]), "{out}");
    let took = topic_drained(&db.pool, t, Duration::from_secs(15)).await;
    eprintln!("WAKE: the replayed row published {took:?} after the replay");
    // Every row of the topic is published and deleted: it must be named as meant.
    let (code, _, err) = dispatcher(&db, &["pause", t, "--reason", "consumer down"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--new-topic"), "{err}");
    let (code, _, err) = dispatcher(
        &db,
        &["pause", t, "--new-topic", "--reason", "consumer down"],
    );
    assert_eq!(code, 0, "{err}");
    enqueue(&db.pool, &[message(t, "after-pause", &[])]).await;
    let (code, _, err) = dispatcher(&db, &["resume", t, "--reason", "consumer back"]);
    assert_eq!(code, 0, "{err}");
    let took = topic_drained(&db.pool, t, Duration::from_secs(15)).await;
    eprintln!("WAKE: the paused row published {took:?} after the resume");
    assert_eq!(topic.pull(4, Duration::from_secs(3)).await.len(), 4);

    // A message the dispatcher refused itself comes back: the operator is told so.
    let refused = dead_letter(
        &db.pool,
        t,
        None,
        b"x",
        "rejected before publishing: attribute \"a\" is 2000 bytes, Pub/Sub allows 1024",
    )
    .await;
    let (code, out, _) = dispatcher(&db, &["dead-letters", "show", &refused.to_string()]);
    assert_eq!(code, 0);
    assert!(out.contains("Discard it, or fix it at the source"), "{out}");
    let (code, out, err) = dispatcher(
        &db,
        &[
            "dead-letters",
            "replay",
            &refused.to_string(),
            "--reason",
            "try again",
            "--json",
        ],
    );
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("warning: dead letter(s)")
            && err.contains("Discard them, or fix them at the source"),
        "{err}"
    );
    let report: Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(
        report["refused_locally"],
        serde_json::json!([refused]),
        "{out}"
    );
    service.stop().await;
}

#[tokio::test]
async fn output_into_a_closed_pipe_ends_quietly_with_the_commands_exit_code() {
    let db = TestDb::new().await;
    // Enough topics that status writes well past a pipe's 64 KiB buffer.
    let many: Vec<NewMessage> = (0..1500)
        .map(|i| {
            message(
                &format!("projects/test-project/topics/pipe-{i:04}"),
                &format!("p{i}"),
                &[],
            )
        })
        .collect();
    enqueue(&db.pool, &many).await;
    let bin = binary("dispatcher");
    for (args, reader) in [
        ("status", "head -1"),
        ("status --json", "head -c 10"),
        ("status", "true"),
        ("dead-letters list", "true"),
    ] {
        let script = format!(
            "\"$DISPATCHER\" {args} | {reader} >/dev/null; echo \"exit=${{PIPESTATUS[0]}}\""
        );
        let out = Spawn::program("bash")
            .args(["-c", &script])
            .env("DISPATCHER", &bin)
            .env("DATABASE_URL", db.url())
            .env("OUTBOX_ACTOR", "alice")
            .output_blocking()
            .expect("run bash");
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        let expected = if args.starts_with("dead-letters") {
            "exit=3"
        } else {
            "exit=0"
        };
        assert!(
            stdout.contains(expected),
            "dispatcher {args} | {reader}: {stdout} {stderr}"
        );
        assert!(
            !stderr.contains("panicked") && !stderr.contains("Broken pipe"),
            "{stderr}"
        );
    }
}

#[tokio::test]
async fn a_payload_preview_is_the_text_escaped_once() {
    let db = TestDb::new().await;
    let t = "projects/test-project/topics/previews";
    let id = dead_letter(
        &db.pool,
        t,
        None,
        br#"{"seq":3}"#,
        "INVALID_ARGUMENT: schema",
    )
    .await;
    let (code, out, err) = dispatcher(&db, &["dead-letters", "show", &id.to_string()]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("preview:       {\"seq\":3}\n"), "{out}");
    let shown = json(&db, &["dead-letters", "show", &id.to_string(), "--json"]);
    assert_eq!(shown["payload_preview"], "{\"seq\":3}", "{shown}");
    let listed = json(&db, &["dead-letters", "list", "--json"]);
    assert_eq!(listed[0]["payload_preview"], "{\"seq\":3}", "{listed}");
    let control = dead_letter(
        &db.pool,
        t,
        None,
        b"line\n\x1b[31mred",
        "INVALID_ARGUMENT: schema",
    )
    .await;
    let (_, out, _) = dispatcher(&db, &["dead-letters", "show", &control.to_string()]);
    assert!(
        out.contains("preview:       line\\n\\u{1b}[31mred\n"),
        "a terminal sees no control characters: {out}"
    );
}

#[tokio::test]
async fn without_outbox_actor_user_or_logname_the_actor_is_the_os_user() {
    let db = TestDb::new().await;
    let t = "projects/test-project/topics/actors";
    enqueue(&db.pool, &[message(t, "a-1", &[])]).await;
    let whoami = std::process::Command::new("id")
        .arg("-un")
        .output()
        .expect("id -un");
    let me = String::from_utf8_lossy(&whoami.stdout).trim().to_owned();
    let out = Spawn::binary("dispatcher")
        .args(["pause", t, "--reason", "as kubectl exec runs it"])
        .env("DATABASE_URL", db.url())
        .env_remove_all(&["USER", "LOGNAME"])
        .output(Duration::from_secs(60))
        .await
        .expect("run the dispatcher");
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (actor, paused_by): (String, String) = sqlx::query_as(
        "SELECT a.actor, p.paused_by FROM pubsub_outbox_audit a, pubsub_outbox_paused_topic p",
    )
    .fetch_one(&db.pool)
    .await
    .expect("the audit row and the pause");
    assert!(!me.is_empty());
    assert_eq!(actor, me, "the audit row names the OS user");
    assert_eq!(paused_by, me, "so does the pause");
}

#[tokio::test]
async fn a_killed_replicas_row_is_forgotten_and_replicas_prune_removes_one_at_once() {
    let db = TestDb::new().await;
    let stale = |id: &str, ago: &str| {
        format!(
            "INSERT INTO pubsub_outbox_replica (replica_id, hostname, pid, version, started_at, heartbeat_at)
             VALUES ('{id}', 'pod-{id}', 1, '0', now() - interval '1 hour', now() - interval '{ago}')"
        )
    };
    sqlx::raw_sql(&stale("killed-long-ago", "20 minutes"))
        .execute(&db.pool)
        .await
        .expect("a replica killed 20 minutes ago");
    let service = replica(&db, test_dispatcher::config()).await;
    wait_until("the replicas forget the killed one (10 min)", Duration::from_secs(15), || {
        let pool = db.pool.clone();
        async move {
            let n = count(&pool, "SELECT count(*) FROM pubsub_outbox_replica WHERE replica_id = 'killed-long-ago'").await;
            if n == 0 { Ok(()) } else { Err("still listed".to_owned()) }
        }
    })
    .await;
    sqlx::raw_sql(&stale("killed-just-now", "2 minutes"))
        .execute(&db.pool)
        .await
        .expect("a replica killed 2 minutes ago");
    let status = json(&db, &["status", "--json"]);
    let states: Vec<(String, bool)> = status["replicas"]
        .as_array()
        .map(|r| {
            r.iter()
                .map(|r| {
                    (
                        r["replica_id"].as_str().unwrap_or("").to_owned(),
                        r["alive"] == true,
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    assert_eq!(
        states.len(),
        2,
        "the live one and the one gone 2 min: {status}"
    );
    let alive = states
        .iter()
        .find(|(_, a)| *a)
        .map(|(id, _)| id.clone())
        .expect("the live replica");
    let (code, _, err) = dispatcher(&db, &["replicas", "prune", &alive, "--reason", "mistake"]);
    assert_eq!(code, 3, "a live replica is never pruned: {err}");
    assert!(err.contains("not pruned"), "{err}");
    let (code, _, err) = dispatcher(
        &db,
        &["replicas", "prune", "--gone-for", "5s", "--reason", "x"],
    );
    assert_eq!(code, 2, "{err}");
    // Every replica gone that long is a selection by filter: a dry run shows it, --yes does it.
    let (code, _, err) = dispatcher(&db, &["replicas", "prune", "--reason", "node drained"]);
    assert_eq!(code, 2, "by filter without --yes: {err}");
    assert!(err.contains("--yes"), "{err}");
    let dry = json(&db, &["replicas", "prune", "--dry-run", "--json"]);
    assert_eq!(
        dry["pruned"],
        serde_json::json!(["killed-just-now"]),
        "{dry}"
    );
    assert_eq!(dry["dry_run"], true);
    assert!(dry["audit_id"].is_null(), "a dry run audits nothing: {dry}");
    let pruned = json(
        &db,
        &[
            "replicas",
            "prune",
            "--reason",
            "node drained",
            "--yes",
            "--json",
        ],
    );
    assert_eq!(
        pruned["pruned"],
        serde_json::json!(["killed-just-now"]),
        "{pruned}"
    );
    let (code, _, _) = dispatcher(&db, &["replicas", "prune", "--reason", "again", "--yes"]);
    assert_eq!(code, 3, "nothing left to prune");
    let audit = json(&db, &["audit", "--action", "prune", "--json"]);
    assert_eq!(audit.as_array().map(Vec::len), Some(1), "{audit}");
    assert_eq!(
        audit[0]["selector"]["replica_ids"],
        serde_json::json!(["killed-just-now"])
    );
    let status = json(&db, &["status", "--json"]);
    assert_eq!(
        status["replicas"].as_array().map(Vec::len),
        Some(1),
        "{status}"
    );
    service.stop().await;
}

#[tokio::test]
async fn status_counts_as_due_only_what_a_claim_can_take_and_a_scoped_replica_its_own_keys() {
    let db = TestDb::new().await;
    let (paused, blocked) = (
        "projects/test-project/topics/held-paused",
        "projects/test-project/topics/held-blocked",
    );
    let keyed = |d: &str| NewMessage::new(blocked, d, b"{}".to_vec()).with_ordering_key("k");
    enqueue(
        &db.pool,
        &[
            message(paused, "p-1", &[]),
            message(paused, "p-2", &[]),
            message(paused, "p-3", &[]),
            keyed("b-1"),
            keyed("b-2"),
            message(blocked, "free", &[]),
        ],
    )
    .await;
    dead_letter(
        &db.pool,
        blocked,
        Some("k"),
        b"{}",
        "INVALID_ARGUMENT: schema",
    )
    .await;
    let (code, _, err) = dispatcher(&db, &["pause", paused, "--reason", "held"]);
    assert_eq!(code, 0, "{err}");
    let status = json(&db, &["status", "--json"]);
    let topic = |name: &str| -> Value {
        status["topics"]
            .as_array()
            .and_then(|t| t.iter().find(|t| t["topic"] == name).cloned())
            .unwrap_or_else(|| panic!("{name} in {status}"))
    };
    assert_eq!(
        (
            topic(paused)["due_now"].as_i64(),
            topic(paused)["held"].as_i64()
        ),
        (Some(0), Some(3))
    );
    assert_eq!(
        (
            topic(blocked)["due_now"].as_i64(),
            topic(blocked)["held"].as_i64()
        ),
        (Some(1), Some(2))
    );
    let (_, text, _) = dispatcher(&db, &["status"]);
    assert!(
        text.lines()
            .next()
            .is_some_and(|h| h.contains("DUE") && h.contains("HELD")),
        "{text}"
    );

    // A replica serving another topic counts no blocked key of these.
    let other = TestTopic::new(false).await;
    let mut config = test_dispatcher::config();
    config.batch.topics = Some(vec![other.topic.clone()]);
    let scoped = replica(&db, config).await;
    let gauge = wait_until(
        "the scoped replica's gauges",
        Duration::from_secs(15),
        || {
            let addr = scoped.addr();
            async move {
                let m = harness::process::http_get(&addr, "/metrics").await.1;
                m.lines()
                    .find(|l| l.starts_with("outbox_blocked_ordering_keys "))
                    .map(str::to_owned)
                    .ok_or_else(|| "not sampled yet".to_owned())
            }
        },
    )
    .await;
    assert_eq!(
        gauge, "outbox_blocked_ordering_keys 0",
        "a key of a topic it does not serve"
    );
    scoped.stop().await;
    let unscoped = replica(&db, test_dispatcher::config()).await;
    let gauge = wait_until(
        "the unscoped replica's gauge",
        Duration::from_secs(15),
        || {
            let addr = unscoped.addr();
            async move {
                let m = harness::process::http_get(&addr, "/metrics").await.1;
                m.lines()
                    .find(|l| *l == "outbox_blocked_ordering_keys 1")
                    .map(str::to_owned)
                    .ok_or_else(|| "not 1 yet".to_owned())
            }
        },
    )
    .await;
    assert_eq!(gauge, "outbox_blocked_ordering_keys 1");
    unscoped.stop().await;
}

#[tokio::test]
async fn an_unknown_audit_action_is_bad_usage_naming_the_actions() {
    let db = TestDb::new().await;
    let (code, _, err) = dispatcher(&db, &["audit", "--action", "bogus"]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("bogus") && err.contains("replay") && err.contains("prune"),
        "{err}"
    );
    let (code, out, _) = dispatcher(&db, &["audit", "--action", "rewind"]);
    assert_eq!(
        code, 3,
        "a known action with no entry matches nothing: {out}"
    );
}
