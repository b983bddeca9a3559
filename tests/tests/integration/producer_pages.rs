//! The producer's read pipeline and commit modes (issue #23), against bqemulator and PostgreSQL:
//! pages read ahead and in parallel (`startIndex` ranges) commit strictly in order; a failure
//! between overlapped pages loses and duplicates nothing; `commit = "run"` is all or nothing; a
//! rejected row keeps its place in its key's order, through the real dispatcher.

use std::time::Duration;

use harness::bigquery::TestTable;
use harness::db::TestDb;
use harness::dispatcher::{self as test_dispatcher, drain, real_publisher};
use harness::producer::{
    assert_nothing_written, failing_from, failure, keys, load, order, orders_schema, orders_toml,
    outbox_keys, run_all, run_with, settings, stored_watermark, summary,
};
use harness::pubsub::TestTopic;
use outbox_producer::{ErrorKind, Settings};
use outbox_shared::store::{dead_letter, run_ledger};

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
    assert!(
        s.waited_for_bigquery > Duration::ZERO && s.waited_for_bigquery < s.elapsed,
        "the commits waited for BigQuery's pages part of the run: {:?} of {:?}",
        s.waited_for_bigquery,
        s.elapsed
    );
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
    let counting = failing_from(&table, u64::MAX);
    let report = run_with(&db, &counting, &config, &overlapped()).await;
    let err = failure(&report, 0);
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

    // BigQuery fails on the last page (rows 26-30): nothing of the run is enqueued.
    let failing = failing_from(&table, 25);
    let report = run_with(&db, &failing, &config, &overlapped()).await;
    let err = failure(&report, 0);
    assert!(
        err.to_string().contains("injected failure from row 25"),
        "{err}"
    );
    // Nothing of the failed run is visible, and the watermark did not move.
    assert_nothing_written(&db, "whole").await;
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
    let err = failure(&report, 0);
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

#[tokio::test]
async fn a_row_the_producer_rejects_holds_back_only_the_later_rows_of_its_key_and_replays_into_its_place()
 {
    let db = TestDb::new().await;
    let topic = TestTopic::new(true).await;
    let table = TestTable::create(orders_schema()).await;
    table
        .insert(&(1..=8).map(|i| order(i, i)).collect::<Vec<_>>())
        .await;
    // One key for every row; row 4's payload (10.5 MB) can never be published.
    let toml = format!(
        r#"[[stream]]
name = "place"
query = '''SELECT id, UNIX_MICROS(updated_at) AS updated_at_micros, 'one' AS customer,
                  IF(id = 4, REPEAT('x', 10500000), status) AS status
           FROM {}
           WHERE UNIX_MICROS(updated_at) > @watermark_ts
              OR (UNIX_MICROS(updated_at) = @watermark_ts AND id > @watermark_key)
           ORDER BY updated_at_micros, id'''
dedupe_key = ["id"]
topic = "{}"
ordering_key_column = "customer"
cursor = {{ timestamp_column = "updated_at_micros", key_column = "id", key_type = "INT64" }}
payload = {{ columns = ["id", "status"] }}
"#,
        table.name(),
        topic.topic
    );
    let config = load(&toml);
    let report = run_all(&db, &table, &config, &overlapped()).await;
    let s = summary(&report, 0);
    assert_eq!((s.enqueued, s.rejected), (7, 1));
    let ids = |rows: Vec<(i64, String)>| rows.into_iter().map(|(_, k)| k).collect::<Vec<_>>();
    let mut conn = db.pool.acquire().await.expect("connection");
    let dead = dead_letter::list(&mut conn, None, 10)
        .await
        .expect("dead letters");
    let place = dead[0].outbox_id.expect("the rejected row has its place");
    let around: Vec<(i64, String)> =
        sqlx::query_as("SELECT id, dedupe_key FROM pubsub_outbox ORDER BY id")
            .fetch_all(&db.pool)
            .await
            .expect("outbox");
    let before: Vec<i64> = around
        .iter()
        .filter(|(id, _)| *id < place)
        .map(|r| r.0)
        .collect();
    assert_eq!(
        before.len(),
        3,
        "its id lies between rows 3 and 5 of its page: {around:?}, place {place}"
    );

    // (a) The dispatcher publishes the rows before it; only the rows after it wait.
    let d =
        test_dispatcher::build(&db.pool, real_publisher().await, test_dispatcher::config()).await;
    drain(&d).await;
    let waiting: Vec<(i64, String)> =
        sqlx::query_as("SELECT id, dedupe_key FROM pubsub_outbox ORDER BY id")
            .fetch_all(&db.pool)
            .await
            .expect("outbox");
    assert_eq!(ids(waiting), keys("place", 5..=8));

    // (b) A replay puts it back in its place: ahead of the rows its key held.
    dead_letter::replay(&mut conn, &[dead[0].id])
        .await
        .expect("replay");
    let replayed: Vec<(i64, String)> =
        sqlx::query_as("SELECT id, dedupe_key FROM pubsub_outbox ORDER BY id")
            .fetch_all(&db.pool)
            .await
            .expect("outbox");
    assert_eq!(replayed[0].0, place);
    assert_eq!(ids(replayed), keys("place", 4..=8));

    // Still unpublishable: the dispatcher dead-letters it again, at the same place; discarding
    // it releases the key, and the subscriber sees every other row once, in order.
    drain(&d).await;
    let dead = dead_letter::list(&mut conn, None, 10)
        .await
        .expect("dead letters");
    assert_eq!(
        (dead.len(), dead[0].outbox_id),
        (1, Some(place)),
        "dead-lettered again at its place"
    );
    dead_letter::discard(&mut conn, &[dead[0].id])
        .await
        .expect("discard");
    drop(conn);
    drain(&d).await;
    let received = topic.pull(7, Duration::from_secs(5)).await;
    let got: Vec<String> = harness::pubsub::by_publish_order(&received)
        .iter()
        .map(|r| r.dedupe_key().to_owned())
        .collect();
    assert_eq!(
        got,
        keys("place", [1, 2, 3, 5, 6, 7, 8]),
        "the key's rows arrive in cursor order, the rejected one never"
    );
}
