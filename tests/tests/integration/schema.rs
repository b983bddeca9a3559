//! A workload on a schema behind its release says so and waits; one on a newer schema (a rolling
//! upgrade) works: the dispatcher's schema gate, `status`, the producer.

use std::time::{Duration, Instant};

use harness::db::TestDb;
use harness::fixtures::{enqueue, message, outbox_rows};
use harness::process::{Process, http_get, output};
use harness::pubsub::{TestTopic, by_dedupe_key};
use harness::wait::drained;
use outbox_shared::db::{SchemaBehind, SchemaState, release_version, schema_state};

/// What every refusal must say: where the schema is, what this release needs, what to run.
fn says_what_to_run(text: &str) {
    assert!(
        text.contains("schema at none")
            && text.contains(&format!("this release needs {}", release_version()))
            && text.contains("run `dispatcher migrate`"),
        "names the schema's version, the release's and the fix: {text}"
    );
}

#[tokio::test]
async fn a_dispatcher_on_an_empty_database_is_not_ready_says_to_migrate_and_starts_once_migrated() {
    let db = TestDb::empty().await;
    let topic = TestTopic::new(false).await;
    let mut p = Process::spawn(
        "dispatcher",
        &["--listen-addr", "127.0.0.1:0"],
        &[("DATABASE_URL", db.url().to_owned())],
    );
    let addr = p
        .bound_addr(Duration::from_secs(30))
        .await
        .expect("it starts and listens")
        .to_string();
    let (ready, body) = http_get(&addr, "/readyz").await;
    assert_eq!(
        ready, 503,
        "not ready on a schema behind the release: {body}"
    );
    says_what_to_run(&body);
    let (live, _) = http_get(&addr, "/healthz").await;
    assert_eq!(live, 200, "alive: nothing is wrong with the process itself");

    // Two of its intervals: one line each, no claim, no background task failing.
    tokio::time::sleep(Duration::from_secs(21)).await;
    let log = p.log();
    let errors: Vec<&str> = log.lines().filter(|l| l.contains("ERROR")).collect();
    assert!(
        (2..=3).contains(&errors.len()),
        "one ERROR line per 10 s interval, and no other: {errors:#?}"
    );
    assert!(
        errors
            .iter()
            .all(|l| l.contains("schema is behind this release")),
        "only the schema's: {errors:#?}"
    );
    assert!(
        !log.contains("WARN"),
        "no background task fails on the missing tables:\n{log}"
    );

    let status = output(
        "dispatcher",
        &["status"],
        &[("DATABASE_URL", db.url().to_owned())],
    )
    .await;
    assert_eq!(
        status.status.code(),
        Some(2),
        "status: a configuration error"
    );
    says_what_to_run(&String::from_utf8_lossy(&status.stderr));

    // Migrated (as the migration Job would be), it starts by itself within its interval.
    outbox_shared::migrate(&db.pool).await.expect("migrate");
    enqueue(&db.pool, &[message(&topic.topic, "after-migrate", &[])]).await;
    let started = Instant::now();
    loop {
        let (ready, body) = http_get(&addr, "/readyz").await;
        if ready == 200 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "ready within an interval of the migration: {body}\n{}",
            p.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    drained(&db.pool, Duration::from_secs(30)).await;
    p.signal("TERM");
    let _ = p.child.wait().await;
    let got = topic.pull(1, Duration::from_secs(3)).await;
    assert_eq!(by_dedupe_key(&got).len(), 1, "the message went out");
    assert!(
        p.log().contains("claims start"),
        "it says when it starts claiming:\n{}",
        p.log()
    );
}

#[tokio::test]
async fn a_schema_missing_the_newest_migration_is_behind_by_one_and_a_newer_one_is_served() {
    let db = TestDb::new().await;
    let mut conn = db.pool.acquire().await.expect("conn");
    let current = schema_state(&mut conn).await.expect("state");
    assert_eq!(
        current,
        SchemaState::Current {
            version: release_version()
        }
    );

    // A newer release migrated (a rolling upgrade): this release runs on it.
    sqlx::query(
        "INSERT INTO pubsub_outbox_migrations (version, description, checksum)
         VALUES (29991231000000, 'from a newer release', '\\x00')",
    )
    .execute(&mut *conn)
    .await
    .expect("a newer version");
    assert_eq!(
        schema_state(&mut conn).await.expect("state"),
        SchemaState::Newer {
            version: 29991231000000,
            ours: release_version()
        }
    );
    let topic = TestTopic::new(false).await;
    enqueue(&db.pool, &[message(&topic.topic, "on-a-newer-schema", &[])]).await;
    let mut p = Process::spawn(
        "dispatcher",
        &["--listen-addr", "127.0.0.1:0"],
        &[("DATABASE_URL", db.url().to_owned())],
    );
    let addr = p
        .bound_addr(Duration::from_secs(30))
        .await
        .expect("listens");
    drained(&db.pool, Duration::from_secs(30)).await;
    let (ready, body) = http_get(&addr.to_string(), "/readyz").await;
    assert_eq!(ready, 200, "ready on a newer schema: {body}");
    p.signal("TERM");
    let _ = p.child.wait().await;
    assert!(
        p.log().contains("schema is newer than this release"),
        "said once:\n{}",
        p.log()
    );

    // The newest migration of this release missing: behind by one, and the operator commands
    // and the producer refuse to start.
    sqlx::query("DELETE FROM pubsub_outbox_migrations WHERE version >= $1")
        .bind(release_version())
        .execute(&mut *conn)
        .await
        .expect("forget the newest");
    let SchemaState::Behind(SchemaBehind {
        at, needs, pending, ..
    }) = schema_state(&mut conn).await.expect("state")
    else {
        panic!("behind");
    };
    assert_eq!((needs, pending), (release_version(), Some(1)));
    assert!(at.is_some_and(|v| v < release_version()));
    for (binary, args) in [
        ("dispatcher", &["dead-letters", "list"][..]),
        ("producer", &["streams"][..]),
    ] {
        let out = output(binary, args, &[("DATABASE_URL", db.url().to_owned())]).await;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{binary} {args:?}: {stderr}");
        assert!(
            stderr.contains("(1 migration(s) pending)"),
            "{binary} {args:?}: {stderr}"
        );
    }
    assert_eq!(outbox_rows(&db.pool).await, 0);
}
