//! The claims' plans do not depend on how empty the outbox looked when it was last analysed.
//!
//! The state production meets: a drained queue with one straggler at the end of the heap is
//! vacuumed (thousands of pages, one live row), then a backlog builds before autoanalyze runs
//! again. The planner then believes the backlog is one row. The cost of a claim is read from the
//! transaction's own table statistics (`pg_stat_xact_user_tables`: rows fetched and read), not
//! from a clock, so the comparison holds on a loaded machine.

use chrono::Utc;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

use harness::db::TestDb;
use outbox_shared::store::claim::{self, ClaimFilter, KeyCursor, KeyFloor, OrderedClaim};

const KEYS: usize = 500;
const BACKLOG: usize = 50_000;

/// Inserts `n` keyed rows of 1 KiB over [`KEYS`] keys (one statement, like a bulk writer).
async fn fill(pool: &PgPool, tag: &str, n: usize) {
    sqlx::query(
        "INSERT INTO pubsub_outbox (topic, ordering_key, dedupe_key, payload)
         SELECT 'projects/p/topics/plans', 'key-' || lpad((g % $1)::text, 3, '0'),
                $2 || '-' || g, convert_to(repeat('x', 1000), 'UTF8')
         FROM generate_series(1, $3) g",
    )
    .bind(KEYS as i64)
    .bind(tag)
    .bind(n as i64)
    .execute(pool)
    .await
    .expect("fill the outbox");
}

/// Rows the claim touched in its transaction: fetched by index scans (bitmap heap scans
/// included) plus read by sequential scans. On a session of its own: a session's not yet
/// reported counts of earlier transactions show in `pg_stat_xact_*` too.
async fn ordered_claim_cost(db: &TestDb, planned: bool) -> (i64, usize) {
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(db.options())
        .await
        .expect("a session of its own");
    let mut tx = if planned {
        claim::ClaimSession::new(std::time::Duration::from_secs(60))
            .begin(&pool)
            .await
            .expect("begin a claim transaction")
    } else {
        pool.begin().await.expect("begin a plain transaction")
    };
    let ordered = OrderedClaim {
        filter: ClaimFilter {
            now: Utc::now(),
            limit: 500,
            topics: None,
            excluded: &[],
        },
        scan_limit: 1_000,
        skip_dead_letter_topics: &[],
        // Enough keys to show the walk's cost, few enough that the unprotected control is quick.
        max_keys: 50,
    };
    let batch = claim::claim_ordered(
        &mut tx,
        &ordered,
        &KeyCursor::default(),
        &KeyFloor::default(),
    )
    .await
    .expect("claim");
    let touched: i64 = sqlx::query_scalar(
        "SELECT COALESCE(idx_tup_fetch, 0) + COALESCE(seq_tup_read, 0)
         FROM pg_stat_xact_user_tables WHERE relname = 'pubsub_outbox'",
    )
    .fetch_one(&mut *tx)
    .await
    .expect("read the transaction's table statistics");
    tx.rollback().await.expect("rollback");
    pool.close().await;
    (touched, batch.messages.len())
}

/// The planner's estimate of the keyed backlog.
async fn estimated_backlog(pool: &PgPool) -> f64 {
    let plan: serde_json::Value = sqlx::query_scalar(
        "EXPLAIN (FORMAT JSON) SELECT id FROM pubsub_outbox
         WHERE published_at IS NULL AND ordering_key IS NOT NULL",
    )
    .fetch_one(pool)
    .await
    .expect("explain");
    plan[0]["Plan"]["Plan Rows"]
        .as_f64()
        .expect("a row estimate")
}

async fn reltuples(pool: &PgPool) -> f32 {
    sqlx::query_scalar("SELECT reltuples FROM pg_class WHERE relname = 'pubsub_outbox'")
        .fetch_one(pool)
        .await
        .expect("read reltuples")
}

#[tokio::test]
async fn an_ordered_claim_on_statistics_from_an_almost_empty_outbox_costs_what_it_costs_on_fresh_ones()
 {
    let db = TestDb::new().await;
    // Autovacuum must not repair the statistics while the test looks at them.
    sqlx::query("ALTER TABLE pubsub_outbox SET (autovacuum_enabled = false)")
        .execute(&db.pool)
        .await
        .expect("hold autovacuum off");
    // A busy outbox, analysed (production has autoanalyze behind it: the column statistics
    // exist), then drained but for one straggler at the end of the heap, then vacuumed.
    fill(&db.pool, "drained", BACKLOG).await;
    sqlx::raw_sql("ANALYZE pubsub_outbox")
        .execute(&db.pool)
        .await
        .expect("analyze the busy outbox");
    sqlx::query("DELETE FROM pubsub_outbox WHERE id < (SELECT max(id) FROM pubsub_outbox)")
        .execute(&db.pool)
        .await
        .expect("drain all but the straggler");
    sqlx::raw_sql("VACUUM pubsub_outbox")
        .execute(&db.pool)
        .await
        .expect("vacuum the drained outbox");
    fill(&db.pool, "backlog", BACKLOG).await;
    assert!(
        reltuples(&db.pool).await < 10.0,
        "the statistics say the outbox is almost empty"
    );
    let believed = estimated_backlog(&db.pool).await;
    assert!(
        believed < 10.0,
        "the planner believes the backlog of {BACKLOG} rows is {believed} rows"
    );

    let (stale_unprotected, _) = ordered_claim_cost(&db, false).await;
    let (stale, stale_rows) = ordered_claim_cost(&db, true).await;
    sqlx::raw_sql("ANALYZE pubsub_outbox")
        .execute(&db.pool)
        .await
        .expect("analyze");
    let (fresh, fresh_rows) = ordered_claim_cost(&db, true).await;
    eprintln!(
        "ordered claim, rows touched: stale statistics {stale} (a plain transaction: \
         {stale_unprotected}), fresh statistics {fresh}"
    );
    assert_eq!(stale_rows, fresh_rows, "the same rows are claimed");
    assert!(stale_rows > 0, "the claim takes rows");
    assert!(
        stale_unprotected > 10 * fresh,
        "the state is reproduced: without the claim's settings the plan collapses \
         ({stale_unprotected} rows touched against {fresh})"
    );
    assert!(
        stale <= fresh + fresh / 2,
        "the claim costs on stale statistics what it costs on fresh ones: {stale} against {fresh}"
    );
}
