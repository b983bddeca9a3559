//! Releases side by side (docs/releases.md): every replica's release in `status`, the console's
//! JSON and the `outbox_replicas` metric, and a change an older release misreads refused while
//! one is alive. The previous release's real binaries beside these are `upgrade.rs`.

use std::time::Duration;

use harness::db::TestDb;
use harness::fixtures::{enqueue, keyed_messages, message, unpublished_rows};
use harness::operator::{dispatcher, json};

/// A replica row as a dispatcher reporting `version` writes it, alive.
async fn replica(db: &TestDb, id: &str, version: &str) {
    sqlx::query(
        "INSERT INTO pubsub_outbox_replica (replica_id, hostname, pid, version, started_at, heartbeat_at)
         VALUES ($1, 'pod-' || $1, 1, $2, now() - interval '1 hour', now())",
    )
    .bind(id)
    .bind(version)
    .execute(&db.pool)
    .await
    .expect("a replica row");
}

#[tokio::test]
async fn status_names_each_release_and_cancel_of_keyed_messages_waits_for_the_older_one() {
    let db = TestDb::new().await;
    let ours = env!("CARGO_PKG_VERSION");
    replica(&db, "new-1", ours).await;
    replica(&db, "new-2", ours).await;
    replica(&db, "old-1", "0.0.9").await;
    let keyed = "projects/test-project/topics/keyed";
    let unkeyed = "projects/test-project/topics/unkeyed";
    enqueue(&db.pool, &keyed_messages(keyed, 2, 2)).await;
    enqueue(
        &db.pool,
        &[message(unkeyed, "u-1", &[]), message(unkeyed, "u-2", &[])],
    )
    .await;

    let (code, out, _) = dispatcher(&db, &["status"]);
    assert_eq!(code, 0);
    assert!(
        out.contains(&format!("releases: 2 replica(s) on {ours}, 1 on 0.0.9")),
        "{out}"
    );
    assert!(
        out.contains("1 replica(s) run 0.0.9 (old-1), which predates 0.1.0"),
        "a warning names the older replica: {out}"
    );
    let status = json(&db, &["status", "--json"]);
    assert_eq!(status["releases"][0]["version"], ours);
    assert_eq!(status["releases"][0]["replicas"], 2);
    assert_eq!(status["releases"][1]["replica_ids"][0], "old-1");

    // Keyed messages: refused, nothing changed, the replica and what to do named.
    let (code, _, err) = dispatcher(
        &db,
        &[
            "pending", "cancel", "--topic", keyed, "--reason", "test", "--yes",
        ],
    );
    assert_eq!(code, 1, "{err}");
    for part in [
        "0.0.9",
        "old-1",
        "Nothing was changed",
        "Finish the rollout",
    ] {
        assert!(err.contains(part), "the refusal says {part:?}: {err}");
    }
    assert_eq!(unpublished_rows(&db.pool).await, 6);
    // The dry run says the same.
    let (code, _, _) = dispatcher(
        &db,
        &[
            "pending",
            "cancel",
            "--topic",
            keyed,
            "--reason",
            "test",
            "--dry-run",
        ],
    );
    assert_eq!(code, 1);
    // Unkeyed messages are cancelled whatever runs.
    let (code, _, err) = dispatcher(
        &db,
        &[
            "pending", "cancel", "--topic", unkeyed, "--reason", "test", "--yes",
        ],
    );
    assert_eq!(code, 0, "{err}");
    assert_eq!(unpublished_rows(&db.pool).await, 4);

    // Once the older replica is gone (no heartbeat for 30 s), keyed messages can be cancelled.
    sqlx::query(
        "UPDATE pubsub_outbox_replica SET heartbeat_at = now() - interval '1 minute'
         WHERE replica_id = 'old-1'",
    )
    .execute(&db.pool)
    .await
    .expect("the old replica stops");
    let (code, _, err) = dispatcher(
        &db,
        &[
            "pending", "cancel", "--topic", keyed, "--reason", "test", "--yes",
        ],
    );
    assert_eq!(code, 0, "{err}");
    assert_eq!(unpublished_rows(&db.pool).await, 0);
}

#[tokio::test]
async fn a_dispatcher_reports_its_release_in_its_heartbeat_and_metrics_and_version() {
    let out = harness::process::Spawn::binary("dispatcher")
        .arg("--version")
        .output(Duration::from_secs(10))
        .await
        .expect("dispatcher --version");
    let line = String::from_utf8_lossy(&out.stdout);
    assert!(
        line.starts_with(&format!(
            "dispatcher {} (commit ",
            env!("CARGO_PKG_VERSION")
        )),
        "{line}"
    );
    let out = harness::process::Spawn::binary("producer")
        .arg("--version")
        .output(Duration::from_secs(10))
        .await
        .expect("producer --version");
    assert!(
        String::from_utf8_lossy(&out.stdout).starts_with("producer "),
        "producer --version"
    );
}
