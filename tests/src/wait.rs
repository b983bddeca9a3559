//! Waiting for a condition a background process brings about, with a deadline that fails the test
//! naming what did not happen.

use std::future::Future;
use std::time::{Duration, Instant};

use sqlx::PgPool;

/// Polls `check` every 50 ms until it returns `Ok`, or panics after `limit` naming `what` and the
/// last state `check` reported as its `Err`.
pub async fn wait_until<T, F, Fut>(what: &str, limit: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, String>>,
{
    let started = Instant::now();
    loop {
        match check().await {
            Ok(value) => return value,
            Err(state) if started.elapsed() >= limit => {
                panic!("{what}: not done after {limit:?} ({state})")
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

/// Waits until at most `left` rows remain in the outbox.
pub async fn outbox_at_most(pool: &PgPool, left: i64, limit: Duration, what: &str) {
    wait_until(what, limit, || async {
        let n = crate::fixtures::outbox_rows(pool).await;
        if n <= left {
            Ok(())
        } else {
            Err(format!("{n} rows left"))
        }
    })
    .await;
}

/// Waits until the outbox holds at least `n` rows (a producer run under way).
pub async fn outbox_at_least(pool: &PgPool, n: i64, limit: Duration, what: &str) {
    wait_until(what, limit, || async {
        let rows = crate::fixtures::outbox_rows(pool).await;
        if rows >= n {
            Ok(())
        } else {
            Err(format!("{rows} rows so far"))
        }
    })
    .await;
}

/// Waits until no unpublished row is left.
pub async fn drained(pool: &PgPool, limit: Duration) {
    wait_until("the outbox drains", limit, || async {
        match crate::fixtures::unpublished_rows(pool).await {
            0 => Ok(()),
            n => Err(format!("{n} rows unpublished")),
        }
    })
    .await;
}

/// Waits until the outbox holds no row of `topic`; returns how long that took.
pub async fn topic_drained(pool: &PgPool, topic: &str, limit: Duration) -> Duration {
    let started = Instant::now();
    wait_until(&format!("{topic} drains"), limit, || async {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM pubsub_outbox WHERE topic = $1")
            .bind(topic)
            .fetch_one(pool)
            .await
            .map_err(|e| e.to_string())?;
        if n == 0 {
            Ok(())
        } else {
            Err(format!("{n} left"))
        }
    })
    .await;
    started.elapsed()
}
