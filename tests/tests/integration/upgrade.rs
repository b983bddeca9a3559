//! Release N+1 beside release N (docs/releases.md, "The promise"): the previous release's real
//! binaries (built from its commit by `scripts/previous-release`, which `scripts/test` runs) and
//! this checkout's, on one database under load, through a whole upgrade and a rollback:
//!
//! 1. N migrates and two N dispatchers drain an application's keyed and unkeyed writes;
//! 2. N+1's `migrate` runs while they do, with a business transaction open on the outbox;
//! 3. two N+1 dispatchers start beside them; `status`, the `outbox_replicas` metric name both
//!    releases;
//! 4. the N dispatchers stop one by one;
//! 5. rollback: two N dispatchers start again on N+1's schema, the N+1 ones stop one by one; with
//!    only N running, N+1's `pending cancel` frees a key behind a waiting head (N reads the
//!    `cancelled` dead letter as blocking nothing); N's producer runs once on N+1's schema.
//!
//! Verdicts: nothing lost or invented, every key in order, no dead letter (but the one
//! cancelled), no publish stall, the application's inserts during `migrate` within the lock
//! timeout, no error (nor any SQL error at any level) in any log.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use harness::application::{Application, open_transaction};
use harness::db::TestDb;
use harness::env;
use harness::fixtures::{dead_letters, unpublished_rows};
use harness::process::{Process, Spawn, http_get};
use harness::producer::orders_stream_file;
use harness::pubsub::{TestTopic, arrivals, by_publish_order};
use outbox_shared::{NewMessage, enqueue_batch};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

const LOCK_TIMEOUT: Duration = Duration::from_secs(2);
const KEYS: usize = 12;

/// The previous release's binaries: `OUTBOX_PREVIOUS_RELEASE_DIR`, else where
/// `scripts/previous-release` puts the newest release of RELEASES that is not this version.
fn previous_release() -> (String, PathBuf) {
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let releases = std::fs::read_to_string(repo.join("RELEASES")).expect("RELEASES");
    let (version, commit) = releases
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            Some((w.next()?.to_owned(), w.next()?.to_owned()))
        })
        .rfind(|(v, _)| v != env!("CARGO_PKG_VERSION"))
        .expect("RELEASES names a previous release");
    let dir = std::env::var_os("OUTBOX_PREVIOUS_RELEASE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var("HOME").unwrap_or_else(|_| "/root".into()))
                .join(".cache/pubsub-outbox/releases")
                .join(format!("{version}-{}", &commit[..12]))
        });
    assert!(
        dir.join("dispatcher").exists() && dir.join("producer").exists(),
        "release {version}'s binaries are not in {}: run scripts/previous-release first \
         (scripts/test does)",
        dir.display()
    );
    (version, dir)
}

/// A dispatcher of `bin_dir` (a release) publishing to the emulator, keeping published rows
/// (so each row's latency can be read back).
async fn dispatcher(bin: &PathBuf, db: &TestDb, tag: &str) -> (Process, std::net::SocketAddr) {
    let log = std::env::temp_dir().join(format!("{}.log", env::unique_name(tag)));
    let mut p = Spawn::program(bin)
        .args([
            "run",
            "--listen-addr",
            "127.0.0.1:0",
            "--poll-interval",
            "50ms",
            "--max-poll-interval",
            "200ms",
            "--retention",
            "1h",
            "--db-pool-size",
            "6",
        ])
        .env("DATABASE_URL", db.url())
        .env("PUBSUB_EMULATOR_HOST", env::pubsub_emulator_host())
        .env("PUBSUB_PROJECT_ID", env::pubsub_project())
        .env("OUTBOX_LOG", "info")
        .log(&log)
        .start()
        .expect("start a dispatcher");
    let addr = p
        .bound_addr(Duration::from_secs(30))
        .await
        .unwrap_or_else(|e| panic!("{tag} listens: {e}: {}", p.log_tail(30)));
    (p, addr)
}

/// Stops a dispatcher with SIGTERM and waits for its clean exit; returns its log.
async fn stop(mut p: Process, tag: &str) -> String {
    p.signal("TERM");
    let status = tokio::time::timeout(Duration::from_secs(30), p.child.wait())
        .await
        .unwrap_or_else(|_| panic!("{tag} stops within 30 s"))
        .expect("wait");
    assert!(status.success(), "{tag} exits cleanly: {}", p.log_tail(30));
    p.log()
}

/// Lines of a log that report an error (or a panic).
fn errors(log: &str) -> Vec<String> {
    log.lines()
        .filter(|l| {
            l.contains(" ERROR ") || l.contains("\"level\":\"ERROR\"") || l.contains("panicked")
        })
        .map(str::to_owned)
        .collect()
}

/// Per phase: rows published, their p50 and max latency from insert to publish.
async fn latencies(pool: &PgPool, phases: &[(&str, f64, f64)]) -> Vec<(String, i64, f64, f64)> {
    let mut out = Vec::new();
    for (name, from, to) in phases {
        let (n, p50, max): (i64, Option<f64>, Option<f64>) = sqlx::query_as(
            "SELECT count(*), percentile_cont(0.5) WITHIN GROUP (ORDER BY l), max(l)
             FROM (SELECT extract(epoch FROM published_at - created_at)::float8 AS l
                   FROM pubsub_outbox
                   WHERE published_at IS NOT NULL AND dedupe_key NOT LIKE 'long-%'
                     AND dedupe_key NOT LIKE '%cancel%'
                     AND created_at >= to_timestamp($1) AND created_at < to_timestamp($2)) t",
        )
        .bind(from)
        .bind(to)
        .fetch_one(pool)
        .await
        .expect("latencies");
        out.push((
            (*name).to_owned(),
            n,
            p50.unwrap_or_default(),
            max.unwrap_or_default(),
        ));
    }
    out
}

async fn epoch(pool: &PgPool) -> f64 {
    sqlx::query_scalar("SELECT extract(epoch FROM clock_timestamp())::float8")
        .fetch_one(pool)
        .await
        .expect("clock")
}

#[tokio::test]
async fn the_previous_release_runs_beside_this_one_through_an_upgrade_and_a_rollback() {
    let (previous, dir) = previous_release();
    let old = dir.join("dispatcher");
    let new = harness::process::binary("dispatcher");
    let ours = env!("CARGO_PKG_VERSION");
    let db = TestDb::empty().await;
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(db.options())
        .await
        .expect("pool");
    let topic = TestTopic::new(true).await;

    // 1. Release N's schema and dispatchers, under load.
    let out = Spawn::program(&old)
        .arg("migrate")
        .env("DATABASE_URL", db.url())
        .output(Duration::from_secs(60))
        .await
        .expect("N's migrate");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let t = topic.topic.clone();
    let app = Application::start(&db, Duration::from_millis(20), move |i| {
        vec![
            NewMessage::new(&t, format!("k-{i}"), format!("{i}").into_bytes())
                .with_ordering_key(format!("key-{:02}", i % KEYS)),
            NewMessage::new(&t, format!("u-{i}"), b"u".to_vec()),
        ]
    })
    .await;
    let t0 = epoch(&pool).await;
    let mut olds = Vec::new();
    for i in 0..2 {
        olds.push(dispatcher(&old, &db, &format!("old-{i}")).await);
    }
    tokio::time::sleep(Duration::from_secs(5)).await;

    // 2. N+1's migrate while they run, behind a business transaction open on the outbox.
    let t1 = epoch(&pool).await;
    let (mut long, _) = open_transaction(
        &db,
        "long-business-tx",
        &[NewMessage::new(&topic.topic, "long-1", b"long".to_vec()).with_ordering_key("long-key")],
    )
    .await;
    let migrate_started = Instant::now();
    let out = Spawn::binary("dispatcher")
        .args([
            "migrate",
            "--migrate-lock-timeout",
            "2s",
            "--migrate-deadline",
            "60s",
        ])
        .env("DATABASE_URL", db.url())
        .output(Duration::from_secs(90))
        .await
        .expect("N+1's migrate");
    let migrate_ended = Instant::now();
    let migrate_took = migrate_ended - migrate_started;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let during_migrate = app.inserts(migrate_started, migrate_ended);
    tokio::time::sleep(Duration::from_secs(3)).await;
    sqlx::raw_sql("COMMIT")
        .execute(&mut long)
        .await
        .expect("commit");
    app.enqueued("long-1", Some("long-key"));

    // 3. N+1's dispatchers beside N's: both releases named.
    let t2 = epoch(&pool).await;
    let mut news = Vec::new();
    for i in 0..2 {
        news.push(dispatcher(&new, &db, &format!("new-{i}")).await);
    }
    tokio::time::sleep(Duration::from_secs(6)).await;
    let (code, status, err) = harness::operator::dispatcher(&db, &["status"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        status.contains(&format!(
            "releases: 2 replica(s) on {ours}, 2 on {previous}"
        )),
        "status names both releases: {status}"
    );
    let (_, metrics) = http_get(&news[0].1.to_string(), "/metrics").await;
    assert!(
        metrics.contains(&format!("outbox_replicas{{release=\"{previous}\"}} 2"))
            && metrics.contains(&format!("outbox_replicas{{release=\"{ours}\"}} 2")),
        "the metric names both releases: {}",
        metrics
            .lines()
            .filter(|l| l.contains("replicas"))
            .collect::<Vec<_>>()
            .join("\n")
    );

    // 4. N's dispatchers stop one by one.
    let t3 = epoch(&pool).await;
    let mut logs = Vec::new();
    for (i, (p, _)) in olds.drain(..).enumerate() {
        logs.push((format!("old-{i}"), stop(p, "an N dispatcher").await));
        tokio::time::sleep(Duration::from_secs(3)).await;
    }

    // 5. Rollback: N's dispatchers on N+1's schema, N+1's stopped one by one; N's producer once.
    let t4 = epoch(&pool).await;
    for i in 0..2 {
        olds.push(dispatcher(&old, &db, &format!("rollback-{i}")).await);
    }
    for (i, (p, _)) in news.drain(..).enumerate() {
        tokio::time::sleep(Duration::from_secs(3)).await;
        logs.push((format!("new-{i}"), stop(p, "an N+1 dispatcher").await));
    }
    // N reads a cancelled keyed message as blocking nothing: with only N's dispatchers running, a
    // key whose head waits (its retry a day ahead) is freed by this release's `pending cancel`.
    let head: i64 = sqlx::query_scalar(
        "INSERT INTO pubsub_outbox (topic, ordering_key, dedupe_key, payload, next_attempt_at)
         VALUES ($1, 'cancel-key', 'cancel-me', '\\x00', now() + interval '1 day') RETURNING id",
    )
    .bind(&topic.topic)
    .fetch_one(&pool)
    .await
    .expect("a waiting head");
    let mut tx = pool.begin().await.expect("begin");
    enqueue_batch(
        &mut tx,
        &[
            NewMessage::new(&topic.topic, "after-cancel", b"next".to_vec())
                .with_ordering_key("cancel-key"),
        ],
    )
    .await
    .expect("the key's next message");
    tx.commit().await.expect("commit");
    app.enqueued("after-cancel", Some("cancel-key"));
    let published = |key: &'static str| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, bool>(
                "SELECT published_at IS NOT NULL FROM pubsub_outbox WHERE dedupe_key = $1",
            )
            .bind(key)
            .fetch_one(&pool)
            .await
            .expect("the row")
        }
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        !published("after-cancel").await,
        "the key waits behind its head"
    );
    let (code, _, err) = harness::operator::dispatcher(
        &db,
        &[
            "pending",
            "cancel",
            &head.to_string(),
            "--reason",
            "upgrade test",
        ],
    );
    assert_eq!(code, 0, "cancel with only {previous} running: {err}");
    let cancelled_at = Instant::now();
    harness::wait::wait_until(
        "N publishes the key's next message",
        Duration::from_secs(15),
        || {
            let published = published("after-cancel");
            async move {
                if published.await {
                    Ok(())
                } else {
                    Err("after-cancel unpublished".to_owned())
                }
            }
        },
    )
    .await;
    let freed_in = cancelled_at.elapsed();
    let orders = 30;
    let (_table, path) = orders_stream_file("orders-n", &topic.topic, orders).await;
    let out = Spawn::program(dir.join("producer"))
        .args(["run", "--config"])
        .arg(&path)
        .env("DATABASE_URL", db.url())
        .env("BIGQUERY_EMULATOR_HOST", env::bigquery_emulator_host())
        .env("BIGQUERY_PROJECT_ID", env::bigquery_project())
        .env("PUBSUB_PROJECT_ID", env::pubsub_project())
        .output(Duration::from_secs(120))
        .await
        .expect("N's producer");
    assert!(
        out.status.success(),
        "N's producer runs on N+1's schema: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    tokio::time::sleep(Duration::from_secs(4)).await;
    let t5 = epoch(&pool).await;

    // The end: the application stops, everything drains.
    let (mut ledger, transactions) = app.stop().await;
    for id in 1..=orders {
        ledger.enqueued(&format!("orders-n:{id}"), Some(&format!("c{}", id % 3)));
    }
    harness::wait::drained(&db.pool, Duration::from_secs(60)).await;
    for (i, (p, _)) in olds.drain(..).enumerate() {
        logs.push((format!("rollback-{i}"), stop(p, "an N dispatcher").await));
    }
    let received = by_publish_order(&topic.pull(ledger.len(), Duration::from_secs(5)).await);
    let verdict = ledger.verdict(&arrivals(&received));
    let phases = latencies(
        &pool,
        &[
            ("N alone", t0 + 1.0, t1),
            ("N+1 migrate beside N", t1, t2),
            ("N+1 beside N", t2, t3),
            ("N stopped one by one", t3, t4),
            ("rollback to N", t4, t5),
        ],
    )
    .await;
    let mut report = BTreeMap::new();
    for (name, log) in &logs {
        report.insert(name.clone(), errors(log));
    }
    println!(
        "FIGURE upgrade {previous} -> {ours} and back, application 2 rows / 20 ms ({} \
         transactions, {} messages), 2+2 dispatchers:",
        transactions,
        ledger.len()
    );
    println!(
        "FIGURE   N+1 migrate behind a 3 s+ business transaction: {migrate_took:.1?}; the \
         application's {} inserts meanwhile: max {:.1?} (lock timeout {LOCK_TIMEOUT:?})",
        during_migrate.count, during_migrate.max
    );
    for (name, n, p50, max) in &phases {
        println!(
            "FIGURE   {name}: {n} published, insert to publish p50 {:.0} ms, max {:.0} ms",
            p50 * 1000.0,
            max * 1000.0
        );
    }
    let failed_letters: i64 = harness::fixtures::count(
        &db.pool,
        "SELECT count(*) FROM pubsub_outbox_dead_letter WHERE error_kind <> 'cancelled'",
    )
    .await;
    println!("FIGURE   {previous} freed a key whose head this release cancelled in {freed_in:.1?}");
    println!(
        "FIGURE   verdict: {} arrivals, {} lost, {} invented, {} duplicates, {} order breaks, {} \
         dead letters (and the 1 cancelled)",
        verdict.arrivals,
        verdict.lost.len(),
        verdict.invented.len(),
        verdict.duplicates,
        verdict.order_violations.len(),
        failed_letters
    );
    verdict.assert_clean("the upgrade and the rollback");
    assert_eq!(failed_letters, 0, "no dead letter");
    assert_eq!(dead_letters(&db.pool).await, 1, "the one cancelled message");
    assert_eq!(unpublished_rows(&db.pool).await, 0);
    assert!(
        during_migrate.max < LOCK_TIMEOUT + Duration::from_millis(500),
        "the application's inserts waited at most the lock timeout during migrate ({:?})",
        during_migrate.max
    );
    for (name, n, _, max) in &phases {
        assert!(*n > 0, "{name}: rows published");
        assert!(*max < 5.0, "{name}: no publish stall (max {max:.1} s)");
    }
    for (name, errs) in &report {
        assert!(errs.is_empty(), "{name} logged errors: {errs:#?}");
    }
}
