//! Migrations yield to the application (shared/src/db/apply.rs): a migration that needs the
//! outbox's `ACCESS EXCLUSIVE` lock behind an open business transaction never holds the
//! application's inserts longer than its lock timeout; it gets through once the blocker ends, and
//! exits 1 naming the blocker when it does not end within the deadline. An index built
//! `CONCURRENTLY` (a no-transaction migration) is retried the same way and ends valid.

use std::time::{Duration, Instant};

use harness::application::{Application, Inserts, open_transaction};
use harness::db::TestDb;
use harness::fixtures::message;
use harness::process::Spawn;
use outbox_shared::db::{MigrateSettings, apply};
use sqlx::postgres::PgPoolOptions;
use sqlx::{PgConnection, PgPool};

/// The migration the tests take back: `ALTER TABLE pubsub_outbox` (ACCESS EXCLUSIVE), idempotent.
const VERSION: i64 = 20261206000001;

const TOPIC: &str = "projects/test-project/topics/app";

/// An application committing one outbox insert every 50 ms.
async fn application(db: &TestDb, tag: &'static str) -> Application {
    Application::start(db, Duration::from_millis(50), move |i| {
        vec![message(TOPIC, &format!("{tag}-{i}"), &[])]
    })
    .await
}

/// A business transaction that inserted an outbox row and stays open: what a migration waits for.
async fn open_writer(db: &TestDb) -> (PgConnection, i32) {
    open_transaction(db, "slow-business-tx", &[message(TOPIC, "slow-1", &[])]).await
}

async fn take_back(pool: &PgPool) {
    sqlx::query("DELETE FROM pubsub_outbox_migrations WHERE version = $1")
        .bind(VERSION)
        .execute(pool)
        .await
        .expect("forget the migration");
}

async fn recorded(pool: &PgPool) -> bool {
    sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pubsub_outbox_migrations WHERE version = $1)")
        .bind(VERSION)
        .fetch_one(pool)
        .await
        .expect("read the record")
}

fn migrate(db: &TestDb, deadline: &str) -> Spawn {
    Spawn::binary("dispatcher")
        .args([
            "migrate",
            "--migrate-lock-timeout",
            "1s",
            "--migrate-deadline",
            deadline,
        ])
        .env("DATABASE_URL", db.url())
        .env("OUTBOX_LOG", "info")
}

#[tokio::test]
async fn a_migration_behind_an_open_transaction_never_holds_the_applications_inserts_longer_than_its_lock_timeout()
 {
    let db = TestDb::new().await;
    take_back(&db.pool).await;
    let app = application(&db, "through").await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (mut writer, writer_pid) = open_writer(&db).await;
    let started = Instant::now();
    let run = tokio::spawn(migrate(&db, "60s").output(Duration::from_secs(90)));
    // The blocker ends after 12 s; the migration gets through at its next attempt.
    tokio::time::sleep(Duration::from_secs(12)).await;
    sqlx::raw_sql("COMMIT")
        .execute(&mut writer)
        .await
        .expect("commit");
    let ended_at = started.elapsed();
    let out = run.await.expect("joined").expect("migrate ran");
    let through = started.elapsed();
    let Inserts { count: n, p50, max } = app.inserts(started, Instant::now());
    app.stop().await;
    let log = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "migrate got through: {log}");
    assert!(recorded(&db.pool).await, "the migration is recorded");
    assert!(
        log.contains(&format!("pid {writer_pid}")) && log.contains("slow-business-tx"),
        "each retry names the blocker: {log}"
    );
    assert!(
        through >= ended_at && through < ended_at + Duration::from_secs(20),
        "it got through within a retry of the blocker's end ({through:?}, blocker ended at \
         {ended_at:?})"
    );
    println!(
        "FIGURE migrate behind a 12 s transaction, lock timeout 1 s: applied {through:.1?} after \
         it started ({:.1?} after the blocker's commit); the application's {n} inserts meanwhile: \
         p50 {p50:.1?}, max {max:.1?}",
        through.saturating_sub(ended_at)
    );
    assert!(n > 20, "the application kept writing ({n} inserts)");
    assert!(
        max < Duration::from_millis(1600),
        "no insert waited much longer than the 1 s lock timeout (max {max:?})"
    );
}

#[tokio::test]
async fn a_migration_that_cannot_get_its_locks_by_the_deadline_exits_1_naming_the_blocker() {
    let db = TestDb::new().await;
    take_back(&db.pool).await;
    let app = application(&db, "deadline").await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (mut writer, writer_pid) = open_writer(&db).await;
    let started = Instant::now();
    let out = migrate(&db, "5s")
        .output(Duration::from_secs(60))
        .await
        .expect("migrate ran");
    let took = started.elapsed();
    let Inserts { count: n, p50, max } = app.inserts(started, Instant::now());
    app.stop().await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "exit 1: {stderr}");
    for part in [
        format!("migration {VERSION}"),
        format!("pid {writer_pid}"),
        "application_name \"slow-business-tx\"".to_owned(),
        "idle in transaction".to_owned(),
        "transaction open".to_owned(),
        "run migrate again".to_owned(),
    ] {
        assert!(stderr.contains(&part), "the error says {part:?}: {stderr}");
    }
    assert!(
        !stderr.contains("payload of"),
        "no query text (a payload) in the error"
    );
    assert!(!recorded(&db.pool).await, "nothing of it was applied");
    assert!(
        took < Duration::from_secs(12),
        "it gave up at its deadline ({took:?})"
    );
    println!(
        "FIGURE migrate with a 5 s deadline behind an open transaction: exit 1 after {took:.1?}; \
         the application's {n} inserts meanwhile: p50 {p50:.1?}, max {max:.1?}"
    );
    assert!(max < Duration::from_millis(1600), "max insert {max:?}");

    // Once the blocker ends, the same command applies it.
    sqlx::raw_sql("COMMIT")
        .execute(&mut writer)
        .await
        .expect("commit");
    let again = migrate(&db, "5s")
        .output(Duration::from_secs(60))
        .await
        .expect("migrate ran");
    assert!(
        again.status.success(),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );
    assert!(recorded(&db.pool).await);
}

#[tokio::test]
async fn an_index_built_concurrently_is_retried_behind_a_writer_and_ends_valid() {
    let db = TestDb::new().await;
    let settings = MigrateSettings {
        lock_timeout: Duration::from_millis(500),
        deadline: Duration::from_secs(60),
        ..MigrateSettings::default()
    };
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(db.options())
        .await
        .expect("pool");
    let app = application(&db, "concurrently").await;
    let (mut writer, _) = open_writer(&db).await;
    let mut lock = apply::RunLock::take(&pool.connect_options(), "test:concurrently", &settings)
        .await
        .expect("the run's lock");
    let mut conn = pool.acquire().await.expect("conn");
    let commit_later = async {
        tokio::time::sleep(Duration::from_secs(4)).await;
        sqlx::raw_sql("COMMIT")
            .execute(&mut writer)
            .await
            .expect("commit");
    };
    let started = Instant::now();
    let step = apply::Step {
        version: 1,
        description: "an index on the outbox's topic",
        sql: "-- no-transaction\n\
              DROP INDEX CONCURRENTLY IF EXISTS pubsub_outbox_test_topic;\n\
              CREATE INDEX CONCURRENTLY pubsub_outbox_test_topic ON pubsub_outbox (topic);\n",
        no_tx: true,
    };
    let build = apply::apply_step(&mut lock, &mut conn, &settings, &step, &|c, _| {
        Box::pin(async move { sqlx::query("SELECT 1").execute(c).await.map(|_| ()) })
    });
    let (done, ()) = tokio::join!(build, commit_later);
    let done = done.expect("the index is built");
    let took = started.elapsed();
    lock.release().await;
    let Inserts { count: n, max, .. } = app.inserts(started, Instant::now());
    app.stop().await;
    let valid: bool = sqlx::query_scalar(
        "SELECT indisvalid FROM pg_index WHERE indexrelid = 'pubsub_outbox_test_topic'::regclass",
    )
    .fetch_one(&db.pool)
    .await
    .expect("the index exists");
    let settings_left: String = sqlx::query_scalar("SHOW lock_timeout")
        .fetch_one(&mut *conn)
        .await
        .expect("show");
    assert!(valid, "the index is valid");
    assert!(
        done.attempts > 1,
        "it waited for the writer ({} attempts)",
        done.attempts
    );
    assert_eq!(settings_left, "0", "the session's timeouts were reset");
    println!(
        "FIGURE CREATE INDEX CONCURRENTLY behind a 4 s writer: {} attempts, {took:.1?}; the \
         application's {n} inserts meanwhile: max {max:.1?}",
        done.attempts
    );
    assert!(max < Duration::from_millis(600), "max insert {max:?}");
}
