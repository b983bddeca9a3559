//! Day one: the outbox installs into an application's database beside the application's own sqlx
//! migrations (either order, each side re-run), an install of an earlier release (its versions in
//! `_sqlx_migrations`) upgrades without running anything again, a dispatcher with no project
//! publishes rows with full topic names, and both binaries end the same way on a bad
//! configuration: exit 2, one error line (JSON only in JSON mode), an unreachable database
//! reported within the connect timeout with its cause.
//!
//! The real install on a Cloud SQL-like cluster (roles, bootstrap, refusals) is rehearsed by
//! `scripts/rehearse-cloudsql`, on a cluster of its own.

use std::path::Path;
use std::time::{Duration, Instant};

use sqlx::PgPool;
use sqlx::migrate::Migrator;

use harness::db::TestDb;
use harness::fixtures::{enqueue, message};
use harness::process::{ReservedPort, Spawn, output};
use harness::pubsub::{TestTopic, by_dedupe_key};
use harness::wait::drained;
use outbox_shared::db::MIGRATIONS_TABLE;

/// An application's own sqlx migrations, in a folder of their own: `files` are (name, SQL).
struct AppMigrations {
    dir: std::path::PathBuf,
}

impl AppMigrations {
    fn new(files: &[(&str, &str)]) -> Self {
        let dir = std::env::temp_dir().join(harness::env::unique_name("app_migrations"));
        std::fs::create_dir_all(&dir).expect("create the migrations folder");
        let app = Self { dir };
        for (name, sql) in files {
            app.add(name, sql);
        }
        app
    }

    fn add(&self, name: &str, sql: &str) {
        std::fs::write(self.dir.join(name), sql).expect("write a migration");
    }

    /// Runs the application's migrator as sqlx-cli (`sqlx migrate run`) would.
    async fn run(&self, pool: &PgPool) -> Result<(), sqlx::migrate::MigrateError> {
        Migrator::new(Path::new(&self.dir)).await?.run(pool).await
    }
}

impl Drop for AppMigrations {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

const APP_CREATE: (&str, &str) = (
    "20250301090000_create_invoice.sql",
    "CREATE TABLE invoice (id BIGINT PRIMARY KEY, total NUMERIC NOT NULL);",
);
const APP_ADD_COLUMN: (&str, &str) = (
    "20250302090000_add_invoice_status.sql",
    "ALTER TABLE invoice ADD COLUMN status TEXT NOT NULL DEFAULT 'open';",
);
const APP_LATER: (&str, &str) = (
    "20270101090000_add_invoice_due.sql",
    "ALTER TABLE invoice ADD COLUMN due_at TIMESTAMPTZ;",
);

async fn versions(pool: &PgPool, table: &str) -> Vec<i64> {
    sqlx::query_scalar(&format!("SELECT version FROM {table} ORDER BY version"))
        .fetch_all(pool)
        .await
        .expect("read a migrations table")
}

fn outbox_versions() -> Vec<i64> {
    outbox_shared::MIGRATOR.iter().map(|m| m.version).collect()
}

/// Asserts the application and the outbox each recorded exactly their own versions, and that
/// both schemas are usable.
async fn assert_both_installed(pool: &PgPool, app_versions: &[i64]) {
    assert_eq!(
        versions(pool, "_sqlx_migrations").await,
        app_versions,
        "sqlx's table holds the application's versions only"
    );
    assert_eq!(
        versions(pool, MIGRATIONS_TABLE).await,
        outbox_versions(),
        "the outbox's table holds every outbox version"
    );
    sqlx::query("INSERT INTO invoice (id, total) VALUES (1, 10) ON CONFLICT DO NOTHING")
        .execute(pool)
        .await
        .expect("the application's table is there");
    enqueue(
        pool,
        &[message(
            "projects/p/topics/t",
            &harness::env::unique_name("k"),
            &[],
        )],
    )
    .await;
}

#[tokio::test]
async fn the_application_first_then_the_outbox_and_both_rerun_and_migrate_again_later() {
    let db = TestDb::empty().await;
    let app = AppMigrations::new(&[APP_CREATE, APP_ADD_COLUMN]);
    app.run(&db.pool).await.expect("the application migrates");
    outbox_shared::migrate(&db.pool)
        .await
        .expect("the outbox installs beside it");
    app.run(&db.pool)
        .await
        .expect("the application's re-run finds only its own versions");
    let again = outbox_shared::migrate(&db.pool)
        .await
        .expect("the outbox's re-run");
    assert!(again.applied.is_empty(), "nothing applied twice: {again:?}");
    assert_both_installed(&db.pool, &[20250301090000, 20250302090000]).await;

    app.add(APP_LATER.0, APP_LATER.1);
    app.run(&db.pool)
        .await
        .expect("a later application migration applies");
    outbox_shared::migrate(&db.pool)
        .await
        .expect("the outbox still migrates");
    assert_both_installed(&db.pool, &[20250301090000, 20250302090000, 20270101090000]).await;
}

#[tokio::test]
async fn the_outbox_first_then_the_application_and_both_rerun_and_migrate_again_later() {
    let db = TestDb::empty().await;
    let first = outbox_shared::migrate(&db.pool)
        .await
        .expect("the outbox installs");
    assert_eq!(
        first.applied,
        outbox_versions(),
        "every outbox migration applied"
    );
    let app = AppMigrations::new(&[APP_CREATE, APP_ADD_COLUMN]);
    app.run(&db.pool)
        .await
        .expect("the application migrates beside the outbox");
    outbox_shared::migrate(&db.pool)
        .await
        .expect("the outbox's re-run");
    app.run(&db.pool).await.expect("the application's re-run");
    assert_both_installed(&db.pool, &[20250301090000, 20250302090000]).await;

    app.add(APP_LATER.0, APP_LATER.1);
    outbox_shared::migrate(&db.pool)
        .await
        .expect("the outbox migrates");
    app.run(&db.pool)
        .await
        .expect("a later application migration applies");
    assert_both_installed(&db.pool, &[20250301090000, 20250302090000, 20270101090000]).await;
}

/// What an install of a release before `pubsub_outbox_migrations` left: sqlx's own migrator ran
/// that release's migrations (those before the first that needs the table) into
/// `_sqlx_migrations`, and the two migrations revised since (they created their roles) were
/// applied with their earlier text.
async fn earlier_release_install() -> TestDb {
    let db = TestDb::empty().await;
    let dir = std::env::temp_dir().join(harness::env::unique_name("earlier_release"));
    std::fs::create_dir_all(&dir).expect("a migrations dir");
    let ours = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../migrations");
    for file in std::fs::read_dir(&ours).expect("migrations/").flatten() {
        let name = file.file_name().to_string_lossy().into_owned();
        let version: i64 = name
            .split('_')
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        if version < outbox_shared::db::READABLE_SINCE {
            std::fs::copy(file.path(), dir.join(&name)).expect("copy a migration");
        }
    }
    sqlx::migrate::Migrator::new(dir.clone())
        .await
        .expect("the earlier release's migrations")
        .run(&db.pool)
        .await
        .expect("sqlx's migrator applies the outbox's migrations");
    let _ = std::fs::remove_dir_all(&dir);
    for (version, earlier) in [
        (
            20261201000001_i64,
            "a69c7e5265f2483cad200775694e8ffcfcb697160d6b49cafbfa51386a48385cf4de3ee5a035cdf40996712a8162b0e6",
        ),
        (
            20261201000015,
            "f5013e7f6da26e5796a70be5c5c954fcd7f289cf8808355781dab28d0c78c1e31198644323d69ba0d68fe3f49d7827e7",
        ),
    ] {
        sqlx::query("UPDATE _sqlx_migrations SET checksum = decode($2, 'hex') WHERE version = $1")
            .bind(version)
            .bind(earlier)
            .execute(&db.pool)
            .await
            .expect("record the earlier text's checksum");
    }
    db
}

#[tokio::test]
async fn an_install_recorded_in_sqlx_migrations_upgrades_without_running_anything_again() {
    let db = earlier_release_install().await;
    // Written as that release's writers write: the columns of its schema only.
    sqlx::query(
        "INSERT INTO pubsub_outbox (topic, dedupe_key, payload)
         VALUES ('projects/p/topics/t', 'waiting-before-the-upgrade', '\\x00')",
    )
    .execute(&db.pool)
    .await
    .expect("a row written before the upgrade");
    let recorded = versions(&db.pool, "_sqlx_migrations").await;

    let upgrade = outbox_shared::migrate(&db.pool)
        .await
        .expect("the upgrade migrates");
    assert_eq!(
        upgrade.adopted, recorded,
        "every recorded version is taken over, none run again"
    );
    let since: Vec<i64> = outbox_shared::MIGRATOR
        .iter()
        .map(|m| m.version)
        .filter(|v| *v >= outbox_shared::db::READABLE_SINCE)
        .collect();
    assert_eq!(
        upgrade.applied, since,
        "only the migrations added since that release ran: {upgrade:?}"
    );
    assert!(
        versions(&db.pool, "_sqlx_migrations").await.is_empty(),
        "the outbox's rows left sqlx's table"
    );
    let from: Vec<(i64, Option<String>)> = sqlx::query_as(&format!(
        "SELECT version, adopted_from FROM {MIGRATIONS_TABLE}"
    ))
    .fetch_all(&db.pool)
    .await
    .expect("read the bookkeeping");
    assert!(
        from.iter()
            .all(|(v, f)| f.as_deref() == (!since.contains(v)).then_some("_sqlx_migrations")),
        "the taken-over versions say where from, the applied ones not: {from:?}"
    );
    let waiting: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pubsub_outbox WHERE dedupe_key = 'waiting-before-the-upgrade'",
    )
    .fetch_one(&db.pool)
    .await
    .expect("count");
    assert_eq!(
        waiting, 1,
        "the row waiting before the upgrade is still there"
    );

    // The application can now bring its own sqlx migrations into this database.
    let app = AppMigrations::new(&[APP_CREATE]);
    app.run(&db.pool)
        .await
        .expect("the application migrates after the upgrade");
    outbox_shared::migrate(&db.pool)
        .await
        .expect("and the outbox again");
    assert_both_installed(&db.pool, &[20250301090000]).await;
}

#[tokio::test]
async fn an_edited_migration_or_one_from_a_newer_release_stops_the_run_with_what_to_do() {
    let db = TestDb::new().await;
    sqlx::query(&format!(
        "UPDATE {MIGRATIONS_TABLE} SET checksum = '\\x00' WHERE version = 20261130000002"
    ))
    .execute(&db.pool)
    .await
    .expect("tamper with a checksum");
    let edited = outbox_shared::migrate(&db.pool)
        .await
        .expect_err("an edited migration is refused");
    assert!(
        matches!(
            edited,
            outbox_shared::Error::MigrationModified {
                version: 20261130000002,
                ..
            }
        ),
        "{edited}"
    );
    assert!(
        edited.to_string().contains("never edit an applied one"),
        "{edited}"
    );

    let db = TestDb::new().await;
    sqlx::query(&format!("INSERT INTO {MIGRATIONS_TABLE} (version, description, checksum) VALUES (29990101000000, 'from the future', '\\x00')"))
        .execute(&db.pool)
        .await
        .expect("record a newer release's migration");
    let newer = outbox_shared::migrate(&db.pool)
        .await
        .expect_err("a newer release's version is refused");
    assert!(
        matches!(
            newer,
            outbox_shared::Error::MigrationUnknown {
                version: 29990101000000
            }
        ),
        "{newer}"
    );
    assert!(newer.is_configuration(), "retrying cannot help: {newer}");
}

#[tokio::test]
async fn a_dispatcher_with_no_project_publishes_rows_that_carry_full_topic_names() {
    let db = TestDb::new().await;
    let topic = TestTopic::new(false).await;
    let n = 50;
    let messages: Vec<_> = (0..n)
        .map(|i| message(&topic.topic, &format!("no-project-{i}"), &[]))
        .collect();
    enqueue(&db.pool, &messages).await;
    let envs = [("DATABASE_URL", db.url().to_owned())];
    let proc = Spawn::binary("dispatcher")
        .args(["--listen-addr", "127.0.0.1:0"])
        .envs(&envs)
        .env_remove("PUBSUB_PROJECT_ID")
        .start()
        .expect("start the dispatcher");
    drained(&db.pool, Duration::from_secs(60)).await;
    let got = by_dedupe_key(&topic.pull(n, Duration::from_secs(3)).await);
    assert_eq!(got.len(), n, "every row arrived; log:\n{}", proc.log());
    harness::process::terminate_all(vec![proc]).await;
}

#[tokio::test]
async fn a_short_topic_without_a_project_exits_2_within_a_second_with_the_fix() {
    let db = TestDb::new().await;
    let started = Instant::now();
    let out = Spawn::binary("dispatcher")
        .args(["--topic", "orders", "--listen-addr", "127.0.0.1:0"])
        .env("DATABASE_URL", db.url())
        .env_remove("PUBSUB_PROJECT_ID")
        .output(Duration::from_secs(60))
        .await
        .expect("run the dispatcher");
    let took = started.elapsed();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(2),
        "a configuration error: {stderr}"
    );
    assert!(took < Duration::from_secs(1), "fails fast, took {took:?}");
    assert!(
        stderr.contains("PUBSUB_PROJECT_ID") && stderr.contains("projects/<project>/topics/orders"),
        "the fix: {stderr}"
    );
    assert_eq!(stderr.lines().count(), 1, "one line: {stderr}");
}

/// A URL whose connection is refused at once (while `port` lives).
fn refused_url(port: &ReservedPort) -> String {
    format!("postgres://postgres@127.0.0.1:{}/postgres", port.port())
}

#[tokio::test]
async fn both_binaries_exit_2_with_one_line_for_each_database_configuration_error() {
    let db = TestDb::new().await;
    let missing_db = harness::env::database_url()
        .rsplit_once('/')
        .map(|(base, _)| format!("{base}/no_such_database"))
        .expect("a URL with a database");
    let missing_role = replace_user(db.url(), "no_such_role");
    let cases = [
        (
            "a malformed URL",
            "mysql://u@h/db".to_owned(),
            "postgres://",
        ),
        ("a missing database", missing_db, "does not exist"),
        ("a missing role", missing_role, "no_such_role"),
    ];
    for binary in ["dispatcher", "producer"] {
        for (case, url, needle) in &cases {
            let out = output(binary, &["migrate"], &[("DATABASE_URL", url.clone())]).await;
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{binary}, {case}: {stderr}");
            assert_eq!(
                stderr.lines().count(),
                1,
                "{binary}, {case}: one line: {stderr}"
            );
            assert!(
                stderr.starts_with("error: ") && stderr.contains(needle),
                "{binary}, {case}: {stderr}"
            );
            assert!(out.stdout.is_empty(), "{binary}, {case}: nothing on stdout");
        }
    }
}

/// `url` with its user replaced by `user`.
fn replace_user(url: &str, user: &str) -> String {
    let (scheme, rest) = url.split_once("://").expect("a URL");
    let host = rest.rsplit_once('@').map_or(rest, |(_, h)| h);
    format!("{scheme}://{user}@{host}")
}

#[tokio::test]
async fn an_unreachable_database_fails_within_the_connect_timeout_and_names_the_cause() {
    let refused = ReservedPort::new();
    for binary in ["dispatcher", "producer"] {
        let started = Instant::now();
        let out = output(
            binary,
            &["migrate", "--db-connect-timeout", "3s"],
            &[("DATABASE_URL", refused_url(&refused))],
        )
        .await;
        let took = started.elapsed();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.code(),
            Some(1),
            "{binary}: a run-time failure: {stderr}"
        );
        assert!(
            took < Duration::from_secs(5),
            "{binary}: within the timeout + 2 s, took {took:?}"
        );
        assert!(
            stderr.contains("Connection refused"),
            "{binary}: the real cause: {stderr}"
        );
        let errors: Vec<&str> = stderr
            .lines()
            .filter(|l| l.starts_with("error: "))
            .collect();
        assert_eq!(errors.len(), 1, "{binary}: printed once: {stderr}");
    }
}

#[tokio::test]
async fn in_json_mode_a_failure_is_one_json_error_line_and_nothing_else() {
    let db = TestDb::new().await;
    let refused = ReservedPort::new();
    let runs: [(&str, Vec<&str>, String); 3] = [
        (
            "dispatcher",
            vec!["migrate", "--db-connect-timeout", "1s"],
            refused_url(&refused),
        ),
        (
            "producer",
            vec!["migrate", "--db-connect-timeout", "1s"],
            refused_url(&refused),
        ),
        (
            "dispatcher",
            vec!["--topic", "orders", "--listen-addr", "127.0.0.1:0"],
            db.url().to_owned(),
        ),
    ];
    for (binary, args, url) in runs {
        let out = Spawn::binary(binary)
            .args(&args)
            .env("DATABASE_URL", url)
            .env("OUTBOX_LOG_FORMAT", "json")
            .env_remove("PUBSUB_PROJECT_ID")
            .output(Duration::from_secs(60))
            .await
            .expect("run the binary");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_ne!(out.status.code(), Some(0), "{binary} {args:?} fails");
        assert!(
            out.stdout.is_empty(),
            "{binary} {args:?}: nothing on stdout"
        );
        let lines: Vec<serde_json::Value> = stderr
            .lines()
            .map(|l| {
                serde_json::from_str(l)
                    .unwrap_or_else(|e| panic!("{binary} {args:?}: not JSON ({e}): {l}"))
            })
            .collect();
        let errors = lines.iter().filter(|l| l["severity"] == "ERROR").count();
        assert_eq!(errors, 1, "{binary} {args:?}: one ERROR line: {stderr}");
    }
}
