//! The producer's operator commands and command line, run as the real `producer` binary against
//! a database per test (and bqemulator where a run re-reads): `streams`, `rewind`, which flags
//! each command takes, and how errors and exit codes read.

use harness::bigquery::TestTable;
use harness::db::TestDb;
use harness::env;
use harness::process::output;
use outbox_shared::store::run_ledger::{self, Counts, Outcome};
use outbox_shared::store::watermark::{self, Cursor};
use serde_json::{Value, json};
use sqlx::{Connection, PgConnection};

use harness::producer::{
    BASE_MICROS, keys, load, order, orders_schema, orders_toml, outbox_keys, rfc3339, run_all,
    settings, stored_watermark, summary,
};

/// `producer ARGS` against `db`: (exit code, stdout, stderr).
async fn producer(
    db_url: &str,
    args: &[&str],
    extra_env: &[(&str, String)],
) -> (i32, String, String) {
    let mut envs = vec![
        ("DATABASE_URL", db_url.to_owned()),
        ("OUTBOX_LOG", "warn".to_owned()),
        ("OUTBOX_DB_CONNECT_TIMEOUT", "2s".to_owned()),
    ];
    envs.extend(extra_env.iter().cloned());
    let out = output("producer", args, &envs).await;
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn json_of(stdout: &str) -> Value {
    serde_json::from_str(stdout).unwrap_or_else(|e| panic!("stdout is JSON ({e}): {stdout}"))
}

/// Stores a watermark for `stream` as a run would (one run, one committed page).
async fn seed(db: &TestDb, stream: &str, micros: i64, key: &str, fetched: i64) -> i64 {
    let mut conn = db.pool.acquire().await.expect("connection");
    let run = run_ledger::start(&mut conn, stream, "seed", None)
        .await
        .expect("open a run");
    let to = Cursor {
        micros,
        key: key.to_owned(),
    };
    let counts = Counts {
        fetched,
        enqueued: fetched - 1,
        duplicates: 1,
        rejected: 0,
    };
    let mut tx = conn.begin().await.expect("begin");
    watermark::advance(&mut tx, stream, &to, run)
        .await
        .expect("advance");
    run_ledger::record_chunk(&mut tx, run, counts, Some(&to))
        .await
        .expect("record the chunk");
    tx.commit().await.expect("commit");
    run_ledger::finish(&mut conn, run, Outcome::Succeeded, Some(1234), None)
        .await
        .expect("close the run");
    run
}

async fn audit_rows(db: &TestDb) -> Vec<(String, String, Value, String)> {
    sqlx::query_as::<_, (String, String, sqlx::types::Json<Value>, String)>(
        "SELECT actor, action, selector, reason FROM pubsub_outbox_audit ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .expect("read the audit trail")
    .into_iter()
    .map(|(actor, action, selector, reason)| (actor, action, selector.0, reason))
    .collect()
}

// ---------------------------------------------------------------- streams

#[tokio::test]
async fn streams_json_reports_exactly_what_the_database_holds() {
    let db = TestDb::new().await;
    let orders_run = seed(&db, "orders", BASE_MICROS + 5_000_000, "42", 7).await;
    // A stream that only ever failed before its first page: a run, no watermark.
    let mut conn = db.pool.acquire().await.expect("connection");
    let failed = run_ledger::start(&mut conn, "payments", "seed", None)
        .await
        .expect("open a run");
    run_ledger::finish(
        &mut conn,
        failed,
        Outcome::Failed,
        None,
        Some("query refused"),
    )
    .await
    .expect("close the run");
    drop(conn);

    let (code, stdout, stderr) = producer(db.url(), &["streams", "--json"], &[]).await;
    assert_eq!(code, 0, "stderr: {stderr}");
    let got = json_of(&stdout);
    let (micros, key, updated_at, run_id): (
        i64,
        String,
        chrono::DateTime<chrono::Utc>,
        Option<i64>,
    ) = sqlx::query_as(
        "SELECT cursor_micros, cursor_key, updated_at, run_id FROM producer_watermark
             WHERE stream = 'orders'",
    )
    .fetch_one(&db.pool)
    .await
    .expect("the stored watermark");
    let run: (i64, i64, i64, i64, Option<i64>, String) = sqlx::query_as(
        "SELECT rows_fetched, rows_enqueued, rows_duplicate, rows_rejected, bytes_processed, outcome
         FROM producer_run WHERE id = $1",
    )
    .bind(orders_run)
    .fetch_one(&db.pool)
    .await
    .expect("the stored run");

    let streams = got["streams"].as_array().expect("a streams array");
    assert_eq!(
        streams
            .iter()
            .map(|s| s["stream"].clone())
            .collect::<Vec<_>>(),
        vec![json!("orders"), json!("payments")],
        "every stream with a watermark or a run, by name: {got:#}"
    );
    let orders = &streams[0];
    assert_eq!(
        orders["watermark"],
        json!({
            "timestamp": rfc3339(micros),
            "micros": micros,
            "key": key,
            "updated_at": updated_at.to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
            "run_id": run_id,
        })
    );
    let last = &orders["runs"][0];
    assert_eq!(
        (
            last["id"].as_i64(),
            last["rows_fetched"].as_i64(),
            last["rows_enqueued"].as_i64(),
            last["rows_duplicate"].as_i64(),
            last["rows_rejected"].as_i64(),
            last["bytes_processed"].as_i64(),
            last["outcome"].as_str(),
        ),
        (
            Some(orders_run),
            Some(run.0),
            Some(run.1),
            Some(run.2),
            Some(run.3),
            run.4,
            Some(run.5.as_str()),
        ),
        "the last run's numbers are the stored ones: {last:#}"
    );
    assert_eq!(streams[1]["watermark"], Value::Null);
    assert_eq!(streams[1]["runs"][0]["outcome"], "failed");
    assert_eq!(streams[1]["runs"][0]["error"], "query refused");

    // The table names both; a filter shows one; an unknown name matches nothing (exit 3).
    let (code, table, _) = producer(db.url(), &["streams"], &[]).await;
    assert_eq!(code, 0);
    assert!(
        table.contains("orders") && table.contains("payments"),
        "{table}"
    );
    let (code, one, _) = producer(db.url(), &["streams", "payments", "--json"], &[]).await;
    assert_eq!(
        (code, json_of(&one)["streams"].as_array().map(Vec::len)),
        (0, Some(1))
    );
    let (code, _, stderr) = producer(db.url(), &["streams", "nosuch"], &[]).await;
    assert_eq!(code, 3, "stderr: {stderr}");
    assert!(
        stderr.contains("nosuch") && stderr.contains("orders"),
        "{stderr}"
    );
}

// ---------------------------------------------------------------- rewind

#[tokio::test]
async fn a_rewind_moves_the_watermark_back_audits_once_and_the_next_run_rereads_the_window() {
    let db = TestDb::new().await;
    let table = TestTable::create(orders_schema()).await;
    let second = 1_000_000;
    table
        .insert(&(1..=10).map(|i| order(i, i * second)).collect::<Vec<_>>())
        .await;
    let toml = orders_toml(&table, "rewound", "");
    let first = run_all(&db, &table, &load(&toml), &settings(4)).await;
    assert_eq!(summary(&first, 0).enqueued, 10);
    // The dispatcher published and deleted rows 6..=10 (retention 0).
    sqlx::query("DELETE FROM pubsub_outbox WHERE dedupe_key = ANY($1)")
        .bind(keys("rewound", 6..=10))
        .execute(&db.pool)
        .await
        .expect("delete the published rows");

    let to = rfc3339(BASE_MICROS + 6 * second);
    let (code, stdout, stderr) = producer(
        db.url(),
        &[
            "rewind",
            "rewound",
            "--to",
            &to,
            "--reason",
            "consumer lost 6-10, INC-7",
            "--json",
        ],
        &[("OUTBOX_ACTOR", "alice@example.com".to_owned())],
    )
    .await;
    assert_eq!(code, 0, "stderr: {stderr}");
    let got = json_of(&stdout);
    let floor = i64::MIN.to_string();
    assert_eq!(got["stream"], "rewound");
    assert_eq!(
        got["previous"],
        json!({"timestamp": rfc3339(BASE_MICROS + 10 * second), "micros": BASE_MICROS + 10 * second, "key": "10"})
    );
    assert_eq!(
        got["watermark"],
        json!({"timestamp": to, "micros": BASE_MICROS + 6 * second, "key": floor}),
        "without --key the new watermark is before every row at --to"
    );
    assert_eq!(
        stored_watermark(&db, "rewound").await,
        Some(Cursor {
            micros: BASE_MICROS + 6 * second,
            key: floor.clone()
        })
    );
    assert_eq!(
        audit_rows(&db).await,
        vec![(
            "alice@example.com".to_owned(),
            "rewind".to_owned(),
            json!({
                "stream": "rewound",
                "to": to,
                "key": floor,
                "previous": {"timestamp": rfc3339(BASE_MICROS + 10 * second), "key": "10"},
            }),
            "consumer lost 6-10, INC-7".to_owned(),
        )],
        "exactly one audit row, with who, what and why"
    );
    assert_eq!(got["audit_id"].as_i64().map(|id| id > 0), Some(true));

    // The next run (flags before `run`, as docs/producer.md writes it) re-reads 6..=10 and
    // enqueues the deleted rows again; nothing else.
    let path = std::env::temp_dir().join(format!("{}.toml", env::unique_name("rewound")));
    std::fs::write(&path, &toml).expect("write the config");
    let config = path.to_string_lossy().into_owned();
    let (code, _, stderr) = producer(
        db.url(),
        &["--config", &config, "--page-size", "4", "run"],
        &[
            ("BIGQUERY_EMULATOR_HOST", env::bigquery_emulator_host()),
            ("BIGQUERY_PROJECT_ID", env::bigquery_project()),
            ("PUBSUB_PROJECT_ID", env::pubsub_project()),
        ],
    )
    .await;
    let _ = std::fs::remove_file(&path);
    assert_eq!(code, 0, "the rerun succeeds; stderr: {stderr}");
    let mut conn = db.pool.acquire().await.expect("connection");
    let rerun = &run_ledger::recent(&mut conn, "rewound", 1)
        .await
        .expect("ledger")[0];
    assert_eq!(
        (
            rerun.rows_fetched,
            rerun.rows_enqueued,
            rerun.rows_duplicate
        ),
        (5, 5, 0),
        "the rerun read exactly the rewound window: {rerun:?}"
    );
    let mut all = outbox_keys(&db).await;
    all.sort();
    let mut expected = keys("rewound", 1..=10);
    expected.sort();
    assert_eq!(all, expected, "every row once");
    assert_eq!(
        stored_watermark(&db, "rewound").await.map(|c| c.key),
        Some("10".to_owned()),
        "the watermark is back at the last row"
    );
}

#[tokio::test]
async fn a_rewind_is_refused_without_a_reason_for_an_unknown_stream_and_forward() {
    let db = TestDb::new().await;
    seed(&db, "orders", BASE_MICROS, "42", 3).await;
    let before = stored_watermark(&db, "orders").await;
    let earlier = rfc3339(BASE_MICROS - 60_000_000);
    let later = rfc3339(BASE_MICROS + 1);
    let cases: [(&[&str], i32, &str); 6] = [
        (
            &["rewind", "orders", "--to", &earlier],
            2,
            "--reason is required",
        ),
        (
            &["rewind", "orders", "--to", &earlier, "--reason", " "],
            2,
            "--reason is empty",
        ),
        (
            &["rewind", "nosuch", "--to", &earlier, "--reason", "r"],
            3,
            "'nosuch'",
        ),
        (
            &["rewind", "orders", "--to", &later, "--reason", "r"],
            2,
            "use rewind only to move back",
        ),
        (
            &["rewind", "orders", "--to", "last tuesday", "--reason", "r"],
            2,
            "\"last tuesday\"",
        ),
        (
            &[
                "rewind", "orders", "--to", &earlier, "--key", "abc", "--reason", "r",
            ],
            2,
            "--key \"abc\"",
        ),
    ];
    for (args, want, says) in cases {
        let (code, stdout, stderr) = producer(db.url(), args, &[]).await;
        assert_eq!(code, want, "{args:?}: stderr: {stderr}");
        assert!(stderr.contains(says), "{args:?} says {says:?}: {stderr}");
        assert!(stdout.is_empty(), "{args:?} prints no result: {stdout}");
    }
    assert_eq!(
        stored_watermark(&db, "orders").await,
        before,
        "nothing moved"
    );
    assert!(audit_rows(&db).await.is_empty(), "nothing was audited");
}

#[tokio::test]
async fn a_rewind_is_refused_while_a_run_holds_the_stream_and_changes_nothing() {
    let db = TestDb::new().await;
    seed(&db, "orders", BASE_MICROS, "42", 3).await;
    let before = stored_watermark(&db, "orders").await;
    // A run holds the stream's lock on its own session for its whole duration.
    let mut run = PgConnection::connect(db.url())
        .await
        .expect("a run's session");
    assert!(
        watermark::lock(&mut run, "orders", false)
            .await
            .expect("lock")
    );

    let earlier = rfc3339(BASE_MICROS - 3_600_000_000);
    let args = ["rewind", "orders", "--to", &earlier, "--reason", "r"];
    let (code, _, stderr) = producer(db.url(), &args, &[]).await;
    assert_eq!(code, 1, "stderr: {stderr}");
    assert!(
        stderr.contains("stream 'orders' is being run"),
        "the error names the stream and says a run is in progress: {stderr}"
    );
    assert_eq!(stored_watermark(&db, "orders").await, before, "unchanged");
    assert!(audit_rows(&db).await.is_empty(), "no audit row");

    // Once the run ends, the same command goes through.
    watermark::unlock(&mut run, "orders").await.expect("unlock");
    let (code, _, stderr) = producer(db.url(), &args, &[]).await;
    assert_eq!(code, 0, "stderr: {stderr}");
    assert_eq!(audit_rows(&db).await.len(), 1);
}

// ---------------------------------------------------------------- the command line

#[tokio::test]
async fn migrate_takes_only_the_database_flags() {
    let db = TestDb::empty().await;
    let (code, _, stderr) = producer(db.url(), &["migrate", "--config", "streams.toml"], &[]).await;
    assert_eq!(code, 2, "a run flag is refused: {stderr}");
    assert!(stderr.contains("--config"), "{stderr}");
    let (code, _, stderr) = producer(db.url(), &["--config", "streams.toml", "migrate"], &[]).await;
    assert_eq!(code, 2, "before the command too: {stderr}");
    let tables: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pg_tables WHERE tablename = 'pubsub_outbox'")
            .fetch_one(&db.pool)
            .await
            .expect("count");
    assert_eq!(tables, 0, "the refused commands did nothing");

    let (code, _, stderr) = producer(db.url(), &["migrate"], &[]).await;
    assert_eq!(code, 0, "stderr: {stderr}");
    let tables: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pg_tables WHERE tablename = 'pubsub_outbox'")
            .fetch_one(&db.pool)
            .await
            .expect("count");
    assert_eq!(tables, 1, "migrate created the schema");
}

#[tokio::test]
async fn configuration_errors_exit_2_and_say_their_cause_once() {
    let db = TestDb::new().await;
    let missing_db = format!("{}_gone", db.url());
    let sample = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/streams.toml");
    // A database that does not exist: the server's reason reaches the operator once, although
    // the connect error, the driver error and the server error each carry it.
    for args in [&["streams"][..], &["migrate"], &["run", "--config", sample]] {
        let (code, _, stderr) = producer(
            &missing_db,
            args,
            &[
                ("BIGQUERY_PROJECT_ID", "p".to_owned()),
                ("PUBSUB_PROJECT_ID", "test-project".to_owned()),
            ],
        )
        .await;
        assert_eq!(code, 2, "{args:?}: stderr: {stderr}");
        let line: Vec<&str> = stderr
            .lines()
            .filter(|l| l.starts_with("error: "))
            .collect();
        assert_eq!(line.len(), 1, "{args:?}: one error line: {stderr}");
        assert_eq!(
            line[0].matches("does not exist").count(),
            1,
            "{args:?}: the cause is said once: {stderr}"
        );
    }
    // A malformed URL, a missing streams file, a bad flag value: 2 as well.
    let (code, _, stderr) = producer("postgres://u@h:port/db", &["streams"], &[]).await;
    assert_eq!(code, 2, "{stderr}");
    let (code, _, stderr) = producer(
        db.url(),
        &[
            "run",
            "--config",
            "/nonexistent/streams.toml",
            "--bigquery-project",
            "p",
        ],
        &[],
    )
    .await;
    assert_eq!(code, 2, "{stderr}");
    let (code, _, stderr) = producer(db.url(), &["streams", "--runs", "0"], &[]).await;
    assert_eq!(code, 2, "{stderr}");
    // An unreachable server is not a configuration error: 1, its cause once.
    let (code, _, stderr) = producer(
        "postgres://postgres@127.0.0.1:1/none",
        &[
            "streams",
            "--db-connect-timeout",
            "1s",
            "--log-filter",
            "error",
        ],
        &[],
    )
    .await;
    assert_eq!(code, 1, "{stderr}");
    assert_eq!(
        stderr.matches("cannot connect to PostgreSQL").count(),
        1,
        "{stderr}"
    );
}

// ---------------------------------------------------------------- names and lookbacks

#[tokio::test]
async fn a_mistyped_stream_is_refused_with_the_streams_there_are() {
    let db = TestDb::new().await;
    let sample = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/streams.toml");
    let (code, _, stderr) = producer(
        db.url(),
        &["run", "--config", sample, "--stream", "order"],
        &[
            ("BIGQUERY_PROJECT_ID", "p".to_owned()),
            ("PUBSUB_PROJECT_ID", "test-project".to_owned()),
        ],
    )
    .await;
    assert_eq!(code, 2, "a typo in --stream is bad usage: {stderr}");
    assert!(
        stderr.contains("did you mean orders?")
            && stderr.contains("its streams: order_events, orders"),
        "{stderr}"
    );
    assert!(
        !stderr.contains("Fix the file"),
        "the file is fine: {stderr}"
    );
    seed(&db, "orders", BASE_MICROS + 5_000_000, "42", 7).await;
    let (code, _, stderr) = producer(db.url(), &["streams", "ordrs"], &[]).await;
    assert_eq!(code, 3, "{stderr}");
    assert!(stderr.contains("did you mean orders?"), "{stderr}");
    let (code, _, stderr) = producer(
        db.url(),
        &["rewind", "ordrs", "--to", "2h", "--reason", "typo"],
        &[("OUTBOX_ACTOR", "alice".to_owned())],
    )
    .await;
    assert_eq!(code, 3, "{stderr}");
    assert!(stderr.contains("did you mean orders?"), "{stderr}");
}

#[tokio::test]
async fn the_rewind_message_says_what_is_enqueued_again_with_and_without_a_lookback() {
    let db = TestDb::new().await;
    let at = BASE_MICROS + 60_000_000;
    seed(&db, "plain", at, "42", 7).await;
    seed(&db, "windowed", at, "42", 7).await;
    // The windowed stream remembers the keys it enqueued from BASE_MICROS on.
    sqlx::query(
        "INSERT INTO producer_lookback_key (stream, dedupe_key, cursor_micros)
         VALUES ('windowed', 'o-1', $1), ('windowed', 'o-2', $2)",
    )
    .bind(BASE_MICROS)
    .bind(at)
    .execute(&db.pool)
    .await
    .expect("remember two keys");
    let to = |micros: i64| rfc3339(micros);
    let rewind = |stream: &'static str, target: String| {
        let url = db.url().to_owned();
        async move {
            producer(
                &url,
                &["rewind", stream, "--to", &target, "--reason", "re-read"],
                &[("OUTBOX_ACTOR", "alice".to_owned())],
            )
            .await
        }
    };
    let (code, out, err) = rewind("plain", to(BASE_MICROS + 30_000_000)).await;
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("rows already published and deleted are enqueued again"),
        "{out}"
    );
    let (code, out, err) = rewind("windowed", to(BASE_MICROS + 30_000_000)).await;
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("none of the re-read rows is enqueued again")
            && !out.contains("deleted are enqueued again"),
        "a lookback stream re-enqueues nothing it remembers: {out}"
    );
    let (code, out, err) = rewind("windowed", to(BASE_MICROS - 30_000_000)).await;
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("remembers the keys it enqueued from") && out.contains("before that"),
        "further back than it remembers: {out}"
    );
}
