//! The producer's read pipeline and commit modes (issue #23), against bqemulator and PostgreSQL:
//! pages read ahead and in parallel (`startIndex` ranges) commit strictly in order; a failure
//! between overlapped pages loses and duplicates nothing; `commit = "run"` is all or nothing.

use harness::bigquery::{FailFromRow, TestTable};
use harness::db::TestDb;
use harness::env;
use outbox_producer::bigquery::{BigQuery, Timeouts};
use outbox_producer::{ErrorKind, Settings, run_job, select_streams};
use outbox_runtime::shutdown::Shutdown;
use outbox_shared::store::run_ledger;

use crate::producer::{
    keys, load, order, orders_schema, orders_toml, outbox_keys, run_all, settings,
    stored_watermark, summary,
};

/// Pages of 5 rows, 4 read at once: 60 rows are 12 pages, most read while others commit.
fn overlapped() -> Settings {
    Settings {
        parallel_reads: 4,
        ..settings(5)
    }
}

#[tokio::test]
async fn pages_read_ahead_and_in_parallel_commit_in_cursor_order_each_row_once() {
    let db = TestDb::new().await;
    let table = TestTable::create(orders_schema()).await;
    // Pairs of rows share a timestamp (the key column orders them).
    table
        .insert(&(1..=60).map(|i| order(i, i / 2)).collect::<Vec<_>>())
        .await;
    let config = load(&orders_toml(&table, "ahead", ""));
    let report = run_all(&db, &table, &config, &overlapped()).await;
    let s = summary(&report, 0);
    assert_eq!((s.fetched, s.enqueued, s.duplicates), (60, 60, 0));
    assert_eq!(
        outbox_keys(&db).await,
        keys("ahead", 1..=60),
        "every row once, enqueued in cursor order (outbox ids follow the pages)"
    );
    assert_eq!(
        stored_watermark(&db, "ahead").await.map(|c| c.key),
        Some("60".to_owned())
    );
    assert_eq!(transactions(&db).await, 12, "one transaction per page of 5");
}

/// How many transactions wrote the outbox's rows.
async fn transactions(db: &TestDb) -> i64 {
    sqlx::query_scalar("SELECT count(DISTINCT xmin::text) FROM pubsub_outbox")
        .fetch_one(&db.pool)
        .await
        .expect("count the writing transactions")
}

#[tokio::test]
async fn a_commit_failing_while_later_pages_are_read_loses_and_duplicates_nothing_on_rerun() {
    let db = TestDb::new().await;
    let table = TestTable::create(orders_schema()).await;
    table
        .insert(&(1..=60).map(|i| order(i, i)).collect::<Vec<_>>())
        .await;
    let config = load(&orders_toml(&table, "overlap", ""));
    // Row 23's insert fails: its page (rows 21-25) cannot commit, while the pages after it have
    // been read (up to 4 ranges in flight plus one queued) — the crash between overlapped pages.
    sqlx::raw_sql(
        "CREATE FUNCTION fail_row_23() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF NEW.dedupe_key = 'overlap:23' THEN RAISE EXCEPTION 'injected: row 23 cannot commit'; END IF;
             RETURN NEW;
         END $$;
         CREATE TRIGGER fail_row_23 BEFORE INSERT ON pubsub_outbox
             FOR EACH ROW EXECUTE FUNCTION fail_row_23();",
    )
    .execute(&db.pool)
    .await
    .expect("install the failing trigger");
    let streams = select_streams(&config, &overlapped()).expect("streams");
    let counting = BigQuery::new(
        FailFromRow::new(table.api.clone(), u64::MAX),
        env::bigquery_project(),
        Timeouts::default(),
    );
    let report = run_job(
        &db.pool,
        &counting,
        &streams,
        &overlapped(),
        &Shutdown::never(),
    )
    .await;
    let err = report.streams[0]
        .result
        .as_ref()
        .expect_err("the run fails");
    assert!(
        matches!(&err.kind, ErrorKind::Database(_)) && err.to_string().contains("row 23"),
        "the failed commit is the error: {err}"
    );
    assert_eq!(
        outbox_keys(&db).await,
        keys("overlap", 1..=20),
        "the four pages before the failed one are committed, nothing after it"
    );
    assert_eq!(
        stored_watermark(&db, "overlap").await.map(|c| c.key),
        Some("20".to_owned())
    );
    assert!(
        counting.api().calls() >= 5,
        "pages after the failed one were being read when it failed ({} page reads)",
        counting.api().calls()
    );

    sqlx::raw_sql("DROP TRIGGER fail_row_23 ON pubsub_outbox")
        .execute(&db.pool)
        .await
        .expect("drop the trigger");
    let rerun = run_all(&db, &table, &config, &overlapped()).await;
    let s = summary(&rerun, 0);
    assert_eq!(
        (s.fetched, s.enqueued, s.duplicates),
        (40, 40, 0),
        "the rerun resumes after the last committed page"
    );
    assert_eq!(outbox_keys(&db).await, keys("overlap", 1..=60));
}

#[tokio::test]
async fn a_run_committed_as_one_transaction_is_all_or_nothing() {
    let db = TestDb::new().await;
    let table = TestTable::create(orders_schema()).await;
    table
        .insert(&(1..=30).map(|i| order(i, i)).collect::<Vec<_>>())
        .await;
    let config = load(&orders_toml(&table, "whole", r#"commit = "run""#));
    let streams = select_streams(&config, &overlapped()).expect("streams");

    // BigQuery fails on the last page (rows 26-30): nothing of the run is enqueued.
    let failing = BigQuery::new(
        FailFromRow::new(table.api.clone(), 25),
        env::bigquery_project(),
        Timeouts::default(),
    );
    let report = run_job(
        &db.pool,
        &failing,
        &streams,
        &overlapped(),
        &Shutdown::never(),
    )
    .await;
    let err = report.streams[0]
        .result
        .as_ref()
        .expect_err("the run fails");
    assert!(
        err.to_string().contains("injected failure from row 25"),
        "{err}"
    );
    assert!(
        outbox_keys(&db).await.is_empty(),
        "nothing of the failed run is visible"
    );
    assert_eq!(
        stored_watermark(&db, "whole").await,
        None,
        "the watermark did not move"
    );
    let mut conn = db.pool.acquire().await.expect("connection");
    let runs = run_ledger::recent(&mut conn, "whole", 1)
        .await
        .expect("ledger");
    assert_eq!(
        (runs[0].outcome.as_str(), runs[0].rows_enqueued),
        ("failed", 0),
        "the ledger says the run failed with nothing enqueued"
    );

    // The rerun commits the whole run at once.
    let rerun = run_all(&db, &table, &config, &overlapped()).await;
    let s = summary(&rerun, 0);
    assert_eq!((s.fetched, s.enqueued), (30, 30));
    assert_eq!(outbox_keys(&db).await, keys("whole", 1..=30));
    assert_eq!(
        stored_watermark(&db, "whole").await.map(|c| c.key),
        Some("30".to_owned())
    );
    let runs = run_ledger::recent(&mut conn, "whole", 1)
        .await
        .expect("ledger");
    assert_eq!(
        (runs[0].outcome.as_str(), runs[0].rows_enqueued),
        ("succeeded", 30)
    );
    assert_eq!(
        transactions(&db).await,
        1,
        "one transaction held the run's six pages"
    );
}

#[tokio::test]
async fn a_run_above_its_size_guard_fails_with_the_fix_and_enqueues_nothing() {
    let db = TestDb::new().await;
    let table = TestTable::create(orders_schema()).await;
    table
        .insert(&(1..=30).map(|i| order(i, i)).collect::<Vec<_>>())
        .await;
    let config = load(&orders_toml(
        &table,
        "guarded",
        "commit = \"run\"\nmax_run_rows = 12",
    ));
    let report = run_all(&db, &table, &config, &overlapped()).await;
    let err = report.streams[0]
        .result
        .as_ref()
        .expect_err("the guard trips");
    assert!(
        matches!(
            err.kind,
            ErrorKind::RunTooLarge {
                what: "rows",
                limit: 12
            }
        ),
        "{err}"
    );
    let text = err.to_string();
    assert!(
        text.contains("max_run_rows") && text.contains("commit = \"page\""),
        "the message says what to change: {text}"
    );
    assert!(outbox_keys(&db).await.is_empty());
    assert_eq!(stored_watermark(&db, "guarded").await, None);
}
