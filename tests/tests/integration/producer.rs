//! Producer tests against real bqemulator and PostgreSQL: the acceptance list of issue #4.
//!
//! Each test creates its own BigQuery dataset and database, runs the producer library in-process
//! (`run_job` / `run_stream`, as `producer run` does) and asserts on the outbox, the dead-letter
//! table, the watermark and the run ledger. The fixtures are `harness::producer`'s.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use gcp_bigquery_client::model::field_type::FieldType;
use gcp_bigquery_client::model::query_request::QueryRequest;
use gcp_bigquery_client::model::query_response::ResultSet;
use gcp_bigquery_client::model::table_field_schema::TableFieldSchema;
use harness::bigquery::TestTable;
use harness::db::TestDb;
use harness::env;
use harness::http_faults::{Fault, HttpFaults};
use harness::process::Spawn;
use harness::producer::{
    BASE_MICROS, assert_nothing_written, bigquery, failing_from, failure, keys, load, order,
    orders_schema, orders_toml, outbox, outbox_keys, rfc3339, run_all, run_with, settings,
    stored_watermark, summary,
};
use outbox_producer::bigquery::{BigQuery, Timeouts};
use outbox_producer::cursor::Position;
use outbox_producer::{
    ErrorKind, LoadOptions, OnOverlap, Settings, StreamOutcome, StreamsConfig, run_job, run_stream,
    select_streams,
};
use outbox_runtime::shutdown::Shutdown;
use outbox_shared::store::{run_ledger, watermark};
use serde_json::{Value, json};

// ---------------------------------------------------------------- foundation

#[tokio::test]
async fn bigquery_emulator_round_trips_rows_through_gcp_bigquery_client() {
    let table = TestTable::create(orders_schema()).await;
    table.insert(&[order(1, 0), order(2, 1)]).await;
    let sql = format!(
        "SELECT id, UNIX_MICROS(updated_at) AS micros, amount FROM {} ORDER BY id",
        table.name()
    );
    let response = table
        .client
        .job()
        .query(&table.project, QueryRequest::new(sql))
        .await
        .expect("jobs.query through gcp-bigquery-client answers");
    let mut rs = ResultSet::new_from_query_response(response);
    let mut got = Vec::new();
    while rs.next_row() {
        got.push((
            rs.get_i64_by_name("id").expect("id").expect("not null"),
            rs.get_i64_by_name("micros")
                .expect("micros")
                .expect("not null"),
            rs.get_string_by_name("amount")
                .expect("amount")
                .expect("not null"),
        ));
    }
    assert_eq!(got.len(), 2, "both inserted rows read back");
    assert_eq!((got[0].0, got[0].1), (1, BASE_MICROS));
    assert_eq!((got[1].0, got[1].1), (2, BASE_MICROS + 1));
    assert_eq!(
        got[0].2.parse::<f64>().ok(),
        Some(12.5),
        "NUMERIC comes back as decimal text"
    );
}

// ---------------------------------------------------------------- incremental runs

#[tokio::test]
async fn each_run_enqueues_exactly_the_rows_that_are_new_since_the_previous_one() {
    let db = TestDb::new().await;
    let table = TestTable::create(orders_schema()).await;
    let config = load(&orders_toml(&table, "orders", ""));
    let s = settings(2);
    let mut listener = sqlx::postgres::PgListener::connect_with(&db.pool)
        .await
        .expect("listener");
    listener
        .listen(outbox_shared::store::notify::DEFAULT_CHANNEL)
        .await
        .expect("LISTEN");

    table
        .insert(&(1..=5).map(|i| order(i, i * 10)).collect::<Vec<_>>())
        .await;
    let first = run_all(&db, &table, &config, &s).await;
    assert_eq!(first.exit_code(), 0);
    assert_eq!(summary(&first, 0).enqueued, 5);
    assert_eq!(outbox_keys(&db).await, keys("orders", 1..=5));
    let notified = tokio::time::timeout(Duration::from_secs(5), listener.recv()).await;
    assert!(
        matches!(notified, Ok(Ok(_))),
        "a NOTIFY arrives when rows are enqueued"
    );

    table
        .insert(&(6..=8).map(|i| order(i, i * 10)).collect::<Vec<_>>())
        .await;
    let second = run_all(&db, &table, &config, &s).await;
    let s2 = summary(&second, 0);
    assert_eq!(
        (s2.fetched, s2.enqueued, s2.duplicates),
        (3, 3, 0),
        "the second run reads only the new rows"
    );
    assert_eq!(outbox_keys(&db).await, keys("orders", 1..=8));

    let third = run_all(&db, &table, &config, &s).await;
    let s3 = summary(&third, 0);
    assert_eq!(
        (s3.fetched, s3.enqueued),
        (0, 0),
        "nothing new: nothing read, nothing enqueued"
    );
    assert_eq!(outbox_keys(&db).await, keys("orders", 1..=8));
    assert_eq!(
        stored_watermark(&db, "orders").await,
        Some(watermark::Cursor {
            micros: BASE_MICROS + 80,
            key: "8".into()
        })
    );

    let (_, payload) = &outbox(&db).await[0];
    assert_eq!(
        payload,
        &json!({"id": "1", "customer": "c1", "status": "new", "amount": "12.5", "updated_at": "2026-11-30T12:00:00.000010Z"})
    );
    let mut conn = db.pool.acquire().await.expect("connection");
    let runs = run_ledger::recent(&mut conn, "orders", 10)
        .await
        .expect("ledger");
    let outcomes: Vec<(&str, i64)> = runs
        .iter()
        .map(|r| (r.outcome.as_str(), r.rows_enqueued))
        .collect();
    assert_eq!(
        outcomes,
        [("succeeded", 0), ("succeeded", 3), ("succeeded", 5)],
        "one ledger row per run"
    );
}

#[tokio::test]
async fn rows_sharing_one_timestamp_across_page_boundaries_are_enqueued_once_each() {
    let db = TestDb::new().await;
    let table = TestTable::create(orders_schema()).await;
    let config = load(&orders_toml(&table, "same_ts", ""));
    // 23 rows at one instant, inserted out of id order, read 4 per page.
    let mut rows: Vec<Value> = (1..=23).rev().map(|i| order(i, 500)).collect();
    rows.push(order(100, 400));
    table.insert(&rows).await;
    let first = run_all(&db, &table, &config, &settings(4)).await;
    assert_eq!(summary(&first, 0).enqueued, 24);

    // More rows at the same instant, after the run stopped in the middle of that timestamp.
    table
        .insert(&(24..=30).map(|i| order(i, 500)).collect::<Vec<_>>())
        .await;
    table.insert(&[order(31, 501)]).await;
    let second = run_all(&db, &table, &config, &settings(3)).await;
    assert_eq!(
        summary(&second, 0).enqueued,
        8,
        "the rows added at the watermark's timestamp are read"
    );

    let mut want = vec![100];
    want.extend(1..=31);
    assert_eq!(
        outbox_keys(&db).await,
        keys("same_ts", want),
        "every row once, in cursor order"
    );
}

#[tokio::test]
async fn a_crash_between_chunks_then_a_rerun_leaves_each_source_row_in_the_outbox_exactly_once() {
    let db = TestDb::new().await;
    let table = TestTable::create(orders_schema()).await;
    let config = load(&orders_toml(&table, "crashy", ""));
    table
        .insert(&(1..=10).map(|i| order(i, i / 4)).collect::<Vec<_>>())
        .await;

    // The BigQuery API fails from row 6 on (the third page of 3): the run stops right after
    // committing two chunks, as a crash would, although it reads pages ahead.
    let crashing = failing_from(&table, 6);
    let report = run_with(&db, &crashing, &config, &settings(3)).await;
    let err = failure(&report, 0);
    assert!(
        matches!(&err.kind, ErrorKind::Query(m) if m.contains("injected failure from row 6")),
        "the run fails on the injected failure after two chunks: {err}"
    );
    assert_eq!(report.exit_code(), 1, "a failed stream makes the job fail");
    assert_eq!(
        outbox_keys(&db).await,
        keys("crashy", 1..=6),
        "the two committed chunks are kept"
    );
    let mark = stored_watermark(&db, "crashy")
        .await
        .expect("watermark after two chunks");
    assert_eq!(mark.key, "6");

    let rerun = run_all(&db, &table, &config, &settings(3)).await;
    let s = summary(&rerun, 0);
    assert_eq!(
        (s.fetched, s.enqueued, s.duplicates),
        (4, 4, 0),
        "the rerun resumes after the last commit"
    );
    assert_eq!(outbox_keys(&db).await, keys("crashy", 1..=10));

    let mut conn = db.pool.acquire().await.expect("connection");
    let runs = run_ledger::recent(&mut conn, "crashy", 10)
        .await
        .expect("ledger");
    assert_eq!(runs[1].outcome, "failed");
    assert_eq!(
        runs[1].rows_enqueued, 6,
        "the failed run's ledger counts its committed chunks"
    );
    assert!(
        runs[1]
            .error
            .as_deref()
            .unwrap_or_default()
            .contains("injected")
    );
}

#[tokio::test]
async fn a_producer_process_killed_mid_run_loses_and_duplicates_nothing_on_rerun() {
    let db = TestDb::new().await;
    let table = TestTable::create(orders_schema()).await;
    let total = 3000;
    table
        .insert(&(1..=total).map(|i| order(i, i / 5)).collect::<Vec<_>>())
        .await;
    let config_text = orders_toml(&table, "killed", "");
    let path = std::env::temp_dir().join(format!("{}.toml", env::unique_name("killed")));
    std::fs::write(&path, &config_text).expect("write the config");

    let mut producer = Spawn::binary("producer")
        .args(["run", "--page-size", "5", "--config"])
        .arg(&path)
        .env("DATABASE_URL", db.url())
        .env("BIGQUERY_EMULATOR_HOST", env::bigquery_emulator_host())
        .env("BIGQUERY_PROJECT_ID", env::bigquery_project())
        .env("PUBSUB_PROJECT_ID", env::pubsub_project())
        .env("OUTBOX_LOG", "warn")
        .start()
        .expect("start the producer");
    // SIGKILL once some chunks are committed: mid-run, possibly mid-transaction.
    harness::wait::outbox_at_least(
        &db.pool,
        200,
        Duration::from_secs(60),
        "the run commits chunks",
    )
    .await;
    producer.signal("KILL");
    let _ = producer.child.wait().await;
    let at_kill = outbox_keys(&db).await.len() as i64;
    assert!(
        at_kill > 0 && at_kill < total,
        "killed mid-run ({at_kill} of {total} enqueued)"
    );

    // The killed session's lock goes with its connection; wait in case the server has not
    // noticed yet.
    let rerun = Settings {
        on_overlap: OnOverlap::Wait,
        ..settings(500)
    };
    let report = run_all(&db, &table, &load(&config_text), &rerun).await;
    let s = summary(&report, 0);
    assert_eq!(
        s.duplicates, 0,
        "the rerun starts after the last committed chunk"
    );
    assert_eq!(s.enqueued as i64, total - at_kill);
    assert_eq!(
        outbox_keys(&db).await,
        keys("killed", 1..=total),
        "every row exactly once"
    );
    // The killed execution's ledger row was closed by the rerun, which took the stream's lock.
    let runs: Vec<(String, bool, Option<String>)> = sqlx::query_as(
        "SELECT outcome, finished_at IS NOT NULL, error FROM producer_run WHERE stream = 'killed' ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .expect("read producer_run");
    assert_eq!(runs.len(), 2, "one row per execution: {runs:?}");
    assert_eq!(
        (runs[0].0.as_str(), runs[0].1),
        ("abandoned", true),
        "the killed run reads abandoned, with finished_at: {runs:?}"
    );
    assert!(
        runs[0].2.as_deref().unwrap_or_default().contains("killed"),
        "with the reason: {runs:?}"
    );
    assert_eq!(runs[1].0, "succeeded");
    let _ = std::fs::remove_file(&path);
}

// ---------------------------------------------------------------- overlapping executions

#[tokio::test]
async fn two_executions_started_together_enqueue_each_row_once_and_the_watermark_never_goes_back() {
    for mode in [OnOverlap::Wait, OnOverlap::Skip] {
        let db = TestDb::new().await;
        let table = TestTable::create(orders_schema()).await;
        let config = load(&orders_toml(&table, "twice", ""));
        table
            .insert(&(1..=120).map(|i| order(i, i / 3)).collect::<Vec<_>>())
            .await;
        let s = Settings {
            on_overlap: mode,
            ..settings(7)
        };
        let bq = bigquery(&table.api);

        let stop = Arc::new(AtomicBool::new(false));
        let watcher = {
            let (pool, stop) = (db.pool.clone(), stop.clone());
            tokio::spawn(async move {
                let mut seen = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    if let Ok(mut conn) = pool.acquire().await
                        && let Ok(Some(c)) = watermark::get(&mut conn, "twice").await
                    {
                        seen.push(c);
                    }
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                seen
            })
        };
        let stream = &config.streams[0];
        let never = Shutdown::never();
        let (a, b) = tokio::join!(
            run_stream(&db.pool, &bq, stream, &s, &never),
            run_stream(&db.pool, &bq, stream, &s, &never)
        );
        stop.store(true, Ordering::Relaxed);
        let mut seen = watcher.await.expect("watcher");
        seen.extend(stored_watermark(&db, "twice").await);
        let (a, b) = (
            a.expect("first execution succeeds"),
            b.expect("second execution succeeds"),
        );

        assert_eq!(
            outbox_keys(&db).await,
            keys("twice", 1..=120),
            "{mode:?}: every row once"
        );
        assert_eq!(
            a.enqueued + b.enqueued,
            120,
            "{mode:?}: the two executions split nothing twice"
        );
        let mut outcomes = [(a.outcome, a.enqueued), (b.outcome, b.enqueued)];
        outcomes.sort_by_key(|(_, n)| *n);
        let second = match mode {
            OnOverlap::Skip => StreamOutcome::Skipped,
            OnOverlap::Wait => StreamOutcome::Succeeded,
        };
        assert_eq!(
            outcomes,
            [(second, 0), (StreamOutcome::Succeeded, 120)],
            "{mode:?}: one execution did the work, the other overlapped it and added nothing"
        );
        let positions: Vec<Position> = seen
            .iter()
            .map(|c| {
                Position::from_cursor(c, outbox_producer::config::KeyType::Int64)
                    .expect("INT64 key")
            })
            .collect();
        assert!(
            positions.windows(2).all(|w| w[0] <= w[1]),
            "{mode:?}: watermark went backwards: {seen:?}"
        );
        assert_eq!(
            positions.last().map(|p| p.to_cursor().key),
            Some("120".to_owned())
        );
    }
}

#[tokio::test]
async fn an_execution_that_finds_the_stream_running_skips_or_waits_as_configured() {
    let db = TestDb::new().await;
    let table = TestTable::create(orders_schema()).await;
    let config = load(&orders_toml(&table, "busy", ""));
    table.insert(&[order(1, 1), order(2, 2)]).await;
    let bq = bigquery(&table.api);
    let stream = &config.streams[0];
    let never = Shutdown::never();

    // Another execution holds the stream.
    let mut holder = db.pool.acquire().await.expect("connection").detach();
    assert!(
        watermark::lock(&mut holder, "busy", false)
            .await
            .expect("lock")
    );

    let skipped = run_stream(&db.pool, &bq, stream, &settings(10), &never)
        .await
        .expect("skip is a success");
    assert_eq!(skipped.outcome, StreamOutcome::Skipped);
    assert!(
        outbox_keys(&db).await.is_empty(),
        "a skipped run enqueues nothing"
    );
    let mut conn = db.pool.acquire().await.expect("connection");
    let runs = run_ledger::recent(&mut conn, "busy", 5)
        .await
        .expect("ledger");
    assert_eq!(
        runs[0].outcome, "skipped",
        "the skip is recorded with its reason"
    );
    assert!(
        runs[0]
            .error
            .as_deref()
            .unwrap_or_default()
            .contains("another execution")
    );

    let waiting = Settings {
        on_overlap: OnOverlap::Wait,
        ..settings(10)
    };
    let waiter = {
        let (pool, bq, stream, never) = (
            db.pool.clone(),
            bigquery(&table.api),
            stream.clone(),
            never.clone(),
        );
        tokio::spawn(async move { run_stream(&pool, &bq, &stream, &waiting, &never).await })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !waiter.is_finished(),
        "wait blocks while the other execution holds the stream"
    );
    assert!(outbox_keys(&db).await.is_empty());
    watermark::unlock(&mut holder, "busy")
        .await
        .expect("unlock");
    let waited = waiter
        .await
        .expect("join")
        .expect("the waiting run succeeds");
    assert_eq!(
        (waited.outcome, waited.enqueued),
        (StreamOutcome::Succeeded, 2)
    );
}

// ---------------------------------------------------------------- types

fn all_types_schema() -> Vec<TableFieldSchema> {
    let repeated = |mut f: TableFieldSchema| {
        f.mode = Some("REPEATED".into());
        f
    };
    vec![
        TableFieldSchema::integer("id"),
        TableFieldSchema::new("seq", FieldType::Timestamp),
        TableFieldSchema::integer("i"),
        TableFieldSchema::numeric("n"),
        TableFieldSchema::float("f"),
        TableFieldSchema::bool("b"),
        TableFieldSchema::string("s"),
        TableFieldSchema::bytes("byt"),
        TableFieldSchema::new("d", FieldType::Date),
        TableFieldSchema::new("t", FieldType::Time),
        TableFieldSchema::new("dt", FieldType::Datetime),
        TableFieldSchema::new("ts", FieldType::Timestamp),
        TableFieldSchema::new("j", FieldType::Json),
        repeated(TableFieldSchema::integer("arr")),
        TableFieldSchema::record(
            "st",
            vec![
                TableFieldSchema::string("a"),
                repeated(TableFieldSchema::record(
                    "xs",
                    vec![TableFieldSchema::integer("k")],
                )),
                TableFieldSchema::new("seen_at", FieldType::Timestamp),
            ],
        ),
    ]
}

#[tokio::test]
async fn every_bigquery_type_maps_to_the_expected_json_payload() {
    let db = TestDb::new().await;
    let table = TestTable::create(all_types_schema()).await;
    let seq = |i: i64| rfc3339(BASE_MICROS + i);
    table
        .insert(&[
            json!({"id": 1, "seq": seq(1), "i": "9223372036854775807", "n": "99999999999999999999999999999.999999999",
                   "f": 1.7976931348623157e308, "b": true, "s": "héllo \"q\" ☃\n", "byt": "AAEC/w==",
                   "d": "9999-12-31", "t": "23:59:59.999999", "dt": "9999-12-31T23:59:59.999999",
                   "ts": "9999-12-31T23:59:59.999999Z",
                   "j": "{\"a\":[1,2,{\"b\":null}],\"big\":9007199254740993,\"f\":1.5}",
                   "arr": [1, 2, 3],
                   "st": {"a": "x", "xs": [{"k": 1}, {"k": 2}], "seen_at": "2026-11-30T12:00:00.123456Z"}}),
            json!({"id": 2, "seq": seq(2)}),
            json!({"id": 3, "seq": seq(3), "i": "-9223372036854775808", "n": "-99999999999999999999999999999.999999999",
                   "f": "NaN", "b": false, "s": "", "byt": "", "d": "0001-01-01", "t": "00:00:00",
                   "dt": "0001-01-01T00:00:00", "ts": "0001-01-01T00:00:00Z", "j": "[]", "arr": [-1],
                   "st": {"a": null, "xs": [], "seen_at": null}}),
            json!({"id": 4, "seq": seq(4), "i": 0, "n": "0.000000001", "f": "Infinity", "ts": "1969-12-31T23:59:59.5Z"}),
            json!({"id": 5, "seq": seq(5), "n": "12.5", "f": "-Infinity"}),
            json!({"id": 6, "seq": seq(6), "n": "-0.10", "f": 5e-324}),
        ])
        .await;
    let toml = format!(
        r#"[[stream]]
name = "types"
query = """
SELECT id, UNIX_MICROS(seq) AS seq_micros, i, n, f, b, s, byt, d, t, dt, ts, j, arr, st,
       BIGNUMERIC '12345678901234567890123456.12345678901' AS bn, BIGNUMERIC '-1.5' AS bn_scaled
FROM {}
WHERE UNIX_MICROS(seq) > @watermark_ts OR (UNIX_MICROS(seq) = @watermark_ts AND id > @watermark_key)
ORDER BY seq_micros, id
"""
dedupe_key = ["id"]
topic = "types"
cursor = {{ timestamp_column = "seq_micros", key_column = "id", key_type = "INT64" }}
payload = {{ columns = ["id", "i", "n", "f", "b", "s", "byt", "d", "t", "dt", "ts", "j", "arr", "st", "bn", "bn_scaled"] }}
"#,
        table.name()
    );
    let report = run_all(&db, &table, &load(&toml), &settings(4)).await;
    assert_eq!(summary(&report, 0).enqueued, 6);

    let bn = json!("12345678901234567890123456.12345678901");
    let want = vec![
        json!({"id": "1", "i": "9223372036854775807", "n": "99999999999999999999999999999.999999999",
               "f": 1.7976931348623157e308, "b": true, "s": "héllo \"q\" ☃\n", "byt": "AAEC/w==",
               "d": "9999-12-31", "t": "23:59:59.999999", "dt": "9999-12-31T23:59:59.999999",
               "ts": "9999-12-31T23:59:59.999999Z",
               "j": {"a": [1, 2, {"b": null}], "big": 9007199254740993u64, "f": 1.5},
               "arr": ["1", "2", "3"],
               "st": {"a": "x", "xs": [{"k": "1"}, {"k": "2"}], "seen_at": "2026-11-30T12:00:00.123456Z"},
               "bn": bn, "bn_scaled": "-1.5"}),
        json!({"id": "2", "i": null, "n": null, "f": null, "b": null, "s": null, "byt": null, "d": null, "t": null,
               "dt": null, "ts": null, "j": null, "arr": [], "st": null, "bn": bn, "bn_scaled": "-1.5"}),
        json!({"id": "3", "i": "-9223372036854775808", "n": "-99999999999999999999999999999.999999999",
               "f": "NaN", "b": false, "s": "", "byt": "", "d": "0001-01-01", "t": "00:00:00",
               "dt": "0001-01-01T00:00:00", "ts": "0001-01-01T00:00:00.000000Z", "j": [], "arr": ["-1"],
               "st": {"a": null, "xs": [], "seen_at": null}, "bn": bn, "bn_scaled": "-1.5"}),
        json!({"id": "4", "i": "0", "n": "0.000000001", "f": "Infinity", "b": null, "s": null, "byt": null,
               "d": null, "t": null, "dt": null, "ts": "1969-12-31T23:59:59.500000Z", "j": null, "arr": [],
               "st": null, "bn": bn, "bn_scaled": "-1.5"}),
        json!({"id": "5", "i": null, "n": "12.5", "f": "-Infinity", "b": null, "s": null, "byt": null, "d": null,
               "t": null, "dt": null, "ts": null, "j": null, "arr": [], "st": null, "bn": bn, "bn_scaled": "-1.5"}),
        json!({"id": "6", "i": null, "n": "-0.1", "f": 5e-324, "b": null, "s": null, "byt": null, "d": null,
               "t": null, "dt": null, "ts": null, "j": null, "arr": [], "st": null, "bn": bn, "bn_scaled": "-1.5"}),
    ];
    let got: Vec<Value> = outbox(&db).await.into_iter().map(|(_, p)| p).collect();
    assert_eq!(got.len(), want.len());
    for (g, w) in got.iter().zip(&want) {
        assert_eq!(g, w, "payload of row {} differs", w["id"]);
    }
}

// ---------------------------------------------------------------- rejections

#[tokio::test]
async fn rows_that_can_never_be_published_go_to_the_dead_letter_table_and_the_run_succeeds() {
    let db = TestDb::new().await;
    let table = TestTable::create(orders_schema()).await;
    // Row 2's payload is 10.5 MB; row 3's ordering key is 2 KB; row 4 has no dedupe value.
    let query = format!(
        r#"SELECT id, UNIX_MICROS(updated_at) AS updated_at_micros,
                  IF(id = 3, REPEAT('k', 2000), customer) AS customer,
                  IF(id = 4, NULL, id) AS order_id,
                  IF(id = 2, REPEAT('x', 10500000), status) AS status
           FROM {}
           WHERE UNIX_MICROS(updated_at) > @watermark_ts
              OR (UNIX_MICROS(updated_at) = @watermark_ts AND id > @watermark_key)
           ORDER BY updated_at_micros, id"#,
        table.name()
    );
    let toml = format!(
        r#"[[stream]]
name = "limits"
query = '''{query}'''
dedupe_key = ["order_id"]
topic = "orders"
ordering_key_column = "customer"
cursor = {{ timestamp_column = "updated_at_micros", key_column = "id", key_type = "INT64" }}
payload = {{ columns = ["id", "status"] }}
"#
    );
    let config = load(&toml);
    table
        .insert(&(1..=5).map(|i| order(i, i)).collect::<Vec<_>>())
        .await;

    let report = run_all(&db, &table, &config, &settings(100)).await;
    assert_eq!(report.exit_code(), 0, "rejections do not fail the run");
    let s = summary(&report, 0);
    assert_eq!((s.fetched, s.enqueued, s.rejected), (5, 2, 3));
    assert_eq!(outbox_keys(&db).await, ["limits:1", "limits:5"]);

    let mut conn = db.pool.acquire().await.expect("connection");
    let mut dead = outbox_shared::store::dead_letter::list(&mut conn, None, 10)
        .await
        .expect("dead letters");
    dead.sort_by(|a, b| a.dedupe_key.cmp(&b.dedupe_key));
    let got: Vec<(&str, &str, &str)> = dead
        .iter()
        .map(|d| {
            (
                d.dedupe_key.as_str(),
                d.error_kind.as_str(),
                d.source.as_str(),
            )
        })
        .collect();
    assert_eq!(
        got,
        [
            ("limits:2", "rejected", "producer:limits"),
            ("limits:3", "rejected", "producer:limits"),
            (
                &*format!("limits:missing-dedupe-key:{}:4", BASE_MICROS + 4),
                "rejected",
                "producer:limits"
            ),
        ]
    );
    assert!(
        dead[0].last_error.contains("10000000"),
        "size reason: {}",
        dead[0].last_error
    );
    assert!(
        dead[1].last_error.contains("ordering key"),
        "ordering key reason: {}",
        dead[1].last_error
    );
    assert!(
        dead[2].last_error.contains("`order_id` is NULL"),
        "dedupe reason: {}",
        dead[2].last_error
    );
    assert_eq!(
        stored_watermark(&db, "limits").await.map(|c| c.key),
        Some("5".into()),
        "rejected rows do not hold the watermark back"
    );
}

// ---------------------------------------------------------------- lookback and dry run

#[tokio::test]
async fn a_lookback_picks_up_late_rows_without_duplicating_the_others() {
    let db = TestDb::new().await;
    let table = TestTable::create(orders_schema()).await;
    let config = load(&orders_toml(&table, "late", "lookback = \"1h\""));
    table
        .insert(&(1..=4).map(|i| order(i, i * 1_000_000)).collect::<Vec<_>>())
        .await;
    run_all(&db, &table, &config, &settings(2)).await;
    let before = stored_watermark(&db, "late").await;

    // A row committed late, dated before the watermark (within the lookback).
    table.insert(&[order(50, 2_500_000)]).await;
    let report = run_all(&db, &table, &config, &settings(2)).await;
    let s = summary(&report, 0);
    assert_eq!(
        (s.fetched, s.enqueued, s.duplicates),
        (5, 1, 4),
        "re-read rows are duplicates, the late one is new"
    );
    assert_eq!(outbox_keys(&db).await, keys("late", [1, 2, 3, 4, 50]));
    assert_eq!(
        stored_watermark(&db, "late").await,
        before,
        "the lookback never moves the watermark back"
    );
}

#[tokio::test]
async fn a_lookback_over_rows_already_published_and_deleted_re_enqueues_nothing() {
    let db = TestDb::new().await;
    let table = TestTable::create(orders_schema()).await;
    let config = load(&orders_toml(&table, "gone", "lookback = \"1h\""));
    table
        .insert(&(1..=4).map(|i| order(i, i * 1_000_000)).collect::<Vec<_>>())
        .await;
    run_all(&db, &table, &config, &settings(2)).await;
    assert_eq!(outbox_keys(&db).await, keys("gone", 1..=4));
    // The dispatcher publishes and, with the default --retention 0, deletes the rows.
    sqlx::query("DELETE FROM pubsub_outbox")
        .execute(&db.pool)
        .await
        .expect("delete the published rows");

    // A late row within the lookback: the re-read covers the four published ones too.
    table.insert(&[order(50, 2_500_000)]).await;
    let report = run_all(&db, &table, &config, &settings(2)).await;
    let s = summary(&report, 0);
    assert_eq!(
        (s.fetched, s.enqueued, s.duplicates),
        (5, 1, 4),
        "the published and deleted rows are recognised, only the late one is enqueued"
    );
    assert_eq!(outbox_keys(&db).await, keys("gone", [50]));

    // Two hours later the old keys fall out of the window and are forgotten.
    table.insert(&[order(60, 7_200_000_000)]).await;
    run_all(&db, &table, &config, &settings(2)).await;
    let after_move: i64 =
        sqlx::query_scalar("SELECT count(*) FROM producer_lookback_key WHERE stream = 'gone'")
            .fetch_one(&db.pool)
            .await
            .expect("count remembered keys");
    assert_eq!(after_move, 6, "pruning runs at the start of the next run");
    run_all(&db, &table, &config, &settings(2)).await;
    let remembered: Vec<String> =
        sqlx::query_scalar("SELECT dedupe_key FROM producer_lookback_key WHERE stream = 'gone'")
            .fetch_all(&db.pool)
            .await
            .expect("read remembered keys");
    assert_eq!(
        remembered,
        keys("gone", [60]),
        "keys below watermark - lookback are pruned"
    );

    // A stream without a lookback remembers nothing.
    let plain = load(&orders_toml(&table, "plain", ""));
    run_all(&db, &table, &plain, &settings(10)).await;
    let plain_keys: i64 =
        sqlx::query_scalar("SELECT count(*) FROM producer_lookback_key WHERE stream = 'plain'")
            .fetch_one(&db.pool)
            .await
            .expect("count");
    assert_eq!(plain_keys, 0, "streams without a lookback pay nothing");
}

#[tokio::test]
async fn a_dry_run_reports_what_would_be_enqueued_and_writes_nothing() {
    let db = TestDb::new().await;
    let table = TestTable::create(orders_schema()).await;
    let config = load(&orders_toml(&table, "dry", ""));
    table
        .insert(&(1..=3).map(|i| order(i, i)).collect::<Vec<_>>())
        .await;
    let s = Settings {
        dry_run: true,
        dry_run_sample: 2,
        ..settings(2)
    };
    let report = run_all(&db, &table, &config, &s).await;
    let summary = summary(&report, 0);
    assert_eq!(
        (summary.outcome, summary.fetched, summary.enqueued),
        (StreamOutcome::DryRun, 3, 3)
    );
    assert_eq!(
        summary.bytes_processed,
        Some(0),
        "bqemulator's dry-run estimate"
    );
    assert_eq!(summary.samples.len(), 2);
    assert_eq!(summary.samples[0]["dedupe_key"], json!("dry:1"));
    assert!(
        report.render().contains("dry"),
        "the table lists the stream"
    );
    assert_nothing_written(&db, "dry").await;
    let mut conn = db.pool.acquire().await.expect("connection");
    assert!(
        run_ledger::recent(&mut conn, "dry", 5)
            .await
            .expect("ledger")
            .is_empty(),
        "and writes no ledger row"
    );
}

// ---------------------------------------------------------------- failures

#[tokio::test]
async fn a_stored_watermark_the_key_type_cannot_read_fails_the_run_and_the_dry_run_alike() {
    let db = TestDb::new().await;
    let table = TestTable::create(orders_schema()).await;
    let config = load(&orders_toml(&table, "rekeyed", ""));
    table
        .insert(&(1..=3).map(|i| order(i, i)).collect::<Vec<_>>())
        .await;
    // An INT64-keyed stream whose stored key is not a number (its key type was changed).
    sqlx::query(
        "INSERT INTO producer_watermark (stream, cursor_micros, cursor_key) VALUES ('rekeyed', $1, 'ord-7')",
    )
    .bind(BASE_MICROS)
    .execute(&db.pool)
    .await
    .expect("store the old watermark");
    for dry_run in [false, true] {
        let s = Settings {
            dry_run,
            ..settings(2)
        };
        let report = run_all(&db, &table, &config, &s).await;
        let err = failure(&report, 0);
        assert!(
            matches!(&err.kind, ErrorKind::StoredWatermark { key, .. } if key == "ord-7"),
            "dry run {dry_run}: the stream fails on its stored watermark, it does not read from the start: {err}"
        );
        assert!(
            err.to_string().contains("reset producer_watermark"),
            "the message says what to do: {err}"
        );
        assert!(outbox_keys(&db).await.is_empty(), "nothing enqueued");
    }
}

#[tokio::test]
async fn a_broken_config_file_is_refused_with_a_message_naming_the_stream() {
    let path = std::env::temp_dir().join(format!("{}.toml", env::unique_name("broken")));
    let broken = r#"
[[stream]]
name = "payments"
query = "SELECT 1 FROM t WHERE x > @watermark_ts AND y > @watermark_key"
dedupe_key = ["id"]
topik = "payments"
cursor = { timestamp_column = "ts", key_column = "id", key_type = "INT64" }
payload = { columns = ["id"] }
"#;
    std::fs::write(&path, broken).expect("write the config");
    let options = LoadOptions {
        pubsub_project: "p".into(),
        dedupe_attribute: "dedupe_key".into(),
    };
    let err = StreamsConfig::load(&path, &options).expect_err("the config is broken");
    let message = err.to_string();
    assert!(
        message.contains("stream 'payments'") && message.contains("topik"),
        "{message}"
    );
    assert_eq!(
        outbox_runtime::exit::Failure::exit(&outbox_producer::StartupError::from(err)).code(),
        2,
        "an invalid config exits 2"
    );

    // The binary, when built (`cargo build -p pubsub-outbox-producer`): non-zero exit, message on stderr.
    let output = Spawn::binary("producer")
        .args(["run", "--config"])
        .arg(&path)
        .env("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none")
        .env("BIGQUERY_PROJECT_ID", "p")
        .env("PUBSUB_PROJECT_ID", "p")
        .output(Duration::from_secs(60))
        .await
        .expect("run the producer binary");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(
        output.status.code(),
        Some(2),
        "exit code 2; stderr: {stderr}"
    );
    assert!(
        stderr.contains("stream 'payments'") && stderr.contains("topik"),
        "stderr names the stream: {stderr}"
    );
    let _ = std::fs::remove_file(&path);
}

#[tokio::test]
async fn an_unknown_column_in_the_mapping_fails_the_stream_naming_it_and_writes_nothing() {
    let db = TestDb::new().await;
    let table = TestTable::create(orders_schema()).await;
    let toml = orders_toml(&table, "typo", "").replace(
        r#"columns = { status = "status" }"#,
        r#"columns = { status = "stauts" }"#,
    );
    let config = load(&toml);
    table.insert(&[order(1, 1)]).await;
    let report = run_all(&db, &table, &config, &settings(10)).await;
    assert_eq!(report.exit_code(), 1);
    let err = failure(&report, 0);
    let message = err.to_string();
    assert!(
        message.contains("stream 'typo'") && message.contains("`stauts`"),
        "{message}"
    );
    assert_nothing_written(&db, "typo").await;
}

#[tokio::test]
async fn a_query_error_fails_that_stream_naming_it_while_the_other_streams_still_run() {
    let db = TestDb::new().await;
    let table = TestTable::create(orders_schema()).await;
    let broken =
        orders_toml(&table, "broken", "").replace("SELECT id,", "SELECT no_such_column, id,");
    let config = load(&format!("{broken}\n{}", orders_toml(&table, "healthy", "")));
    table.insert(&[order(1, 1), order(2, 2)]).await;
    let report = run_all(&db, &table, &config, &settings(10)).await;
    assert_eq!(report.exit_code(), 1, "one failed stream fails the job");
    let err = failure(&report, 0);
    assert!(matches!(err.kind, ErrorKind::Query(_)), "{err}");
    assert!(
        err.to_string().contains("stream 'broken'") && err.to_string().contains("no_such_column"),
        "{err}"
    );
    assert_eq!(
        summary(&report, 1).enqueued,
        2,
        "the healthy stream ran anyway"
    );
    assert_eq!(stored_watermark(&db, "broken").await, None);
    let mut conn = db.pool.acquire().await.expect("connection");
    let runs = run_ledger::recent(&mut conn, "broken", 5)
        .await
        .expect("ledger");
    assert_eq!(runs[0].outcome, "failed");
}

#[tokio::test]
async fn rows_out_of_cursor_order_fail_the_run_before_anything_is_written() {
    let db = TestDb::new().await;
    let table = TestTable::create(orders_schema()).await;
    let toml = orders_toml(&table, "unordered", "")
        .replace("ORDER BY updated_at_micros, id", "ORDER BY id DESC");
    let config = load(&toml);
    table
        .insert(&(1..=5).map(|i| order(i, i)).collect::<Vec<_>>())
        .await;
    let report = run_all(&db, &table, &config, &settings(10)).await;
    let err = failure(&report, 0);
    assert!(matches!(err.kind, ErrorKind::CursorOrder(_)), "{err}");
    assert!(
        err.to_string().contains("ORDER BY"),
        "the message says how to fix it: {err}"
    );
    assert_nothing_written(&db, "unordered").await;
}

#[tokio::test]
async fn an_html_502_and_a_bare_503_are_retried_and_each_row_is_enqueued_once() {
    let db = TestDb::new().await;
    let table = TestTable::create(orders_schema()).await;
    let config = load(&orders_toml(&table, "flaky", ""));
    table
        .insert(&(1..=7).map(|i| order(i, i)).collect::<Vec<_>>())
        .await;
    let upstream = env::bigquery_emulator_host();
    let faults = HttpFaults::start(upstream.trim_start_matches("http://")).await;
    // jobs.query is a POST to …/queries; getQueryResults a GET of …/queries/<job>.
    faults.push(Fault::html_502("POST "));
    faults.push(Fault::html_502("GET "));
    faults.push(Fault::bare_503("GET "));
    let bq = BigQuery::new(
        harness::bigquery::api_at(&faults.url()).await,
        env::bigquery_project(),
        Timeouts {
            poll: Duration::from_millis(20),
            ..Timeouts::default()
        },
    );
    let streams = select_streams(&config, &settings(3)).expect("streams selected");
    let report = run_job(&db.pool, &bq, &streams, &settings(3), &Shutdown::never()).await;
    let s = summary(&report, 0);
    assert_eq!(
        faults.pending(),
        0,
        "every fault was answered: {:?}",
        faults.served()
    );
    let statuses: Vec<u16> = faults.served().iter().map(|(s, _)| *s).collect();
    assert_eq!(statuses, [502, 502, 503]);
    assert_eq!((s.fetched, s.enqueued, s.duplicates), (7, 7, 0));
    assert_eq!(
        outbox_keys(&db).await,
        keys("flaky", 1..=7),
        "each row exactly once"
    );
}

// ---------------------------------------------------------------- measurements

/// What a lookback costs: the same 10,000 rows enqueued by a first run without and with a
/// lookback (each on a fresh database), 3 rounds interleaved, medians printed. Not a test of a
/// target: run it by name with `-- --ignored --nocapture`.
#[tokio::test]
#[ignore = "a measurement; run it by name"]
async fn measure_the_cost_of_a_lookback() {
    let rows = 10_000;
    let table = TestTable::create(orders_schema()).await;
    table
        .insert(&(1..=rows).map(|i| order(i, i * 1_000)).collect::<Vec<_>>())
        .await;
    let mut times: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    let mut key_bytes = 0i64;
    for round in 0..3 {
        for (i, extra) in ["", "lookback = \"1h\""].into_iter().enumerate() {
            let db = TestDb::new().await;
            let config = load(&orders_toml(&table, "cost", extra));
            let started = std::time::Instant::now();
            let report = run_all(&db, &table, &config, &settings(1000)).await;
            let secs = started.elapsed().as_secs_f64();
            assert_eq!(summary(&report, 0).enqueued, rows as u64);
            times[i].push(secs);
            if i == 1 {
                key_bytes =
                    sqlx::query_scalar("SELECT pg_total_relation_size('producer_lookback_key')")
                        .fetch_one(&db.pool)
                        .await
                        .expect("size");
            }
            println!(
                "round {round} {:<12} {rows} rows in {secs:.3} s ({:.0} rows/s)",
                if i == 0 { "no lookback" } else { "lookback 1h" },
                rows as f64 / secs
            );
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (plain, lookback) = (median(&mut times[0]), median(&mut times[1]));
    println!(
        "median: no lookback {plain:.3} s, lookback {lookback:.3} s: +{:.1} % ({:.1} µs per row); \
         producer_lookback_key {} KiB for {rows} keys",
        (lookback / plain - 1.0) * 100.0,
        (lookback - plain) * 1e6 / rows as f64,
        key_bytes / 1024
    );
}
