//! The bench's scratch database (a harness [`TestDb`]) and filling it.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use harness::db::TestDb;
use outbox_shared::{NewMessage, enqueue_batch};
use sqlx::postgres::{PgPool, PgPoolOptions};

use crate::dispatch::Keys;

/// Rows per enqueue statement (and transaction) when filling the outbox.
const FILL_CHUNK: usize = 5_000;

/// The bench's own database: a pool for claim drains (the dispatcher's session settings) and the
/// database's own pool, with default settings, for filling (producers keep synchronous commit).
pub struct Scratch {
    pub db: TestDb,
    pub pool: PgPool,
}

impl Scratch {
    pub async fn create(url: &str, workers: usize) -> Result<Self> {
        let db = TestDb::create(url, "outbox_bench")
            .await
            .context("creating and migrating the bench database from --database-url")?;
        // As the dispatcher's sessions: a lost settle only re-publishes.
        let pool = PgPoolOptions::new()
            .max_connections(workers as u32 + 2)
            .connect_with(db.options().options([("synchronous_commit", "off")]))
            .await
            .context("connecting to the bench database")?;
        // Open every worker connection now, not inside the first timed drain.
        let conns = futures::future::try_join_all((0..workers).map(|_| pool.acquire())).await?;
        drop(conns);
        Ok(Self { db, pool })
    }

    /// Empties the outbox and fills it with `n` messages; returns the enqueue rate (rows/s of
    /// time spent in enqueue + commit). Then VACUUM ANALYZE, so every drain starts alike.
    pub async fn refill(
        &self,
        n: usize,
        payload_bytes: usize,
        keys: Keys,
        topic: &str,
    ) -> Result<f64> {
        self.refill_with(n, keys, topic, |i| {
            (0..payload_bytes).map(|j| (i ^ j) as u8).collect()
        })
        .await
    }

    /// [`Self::refill`] with message `i`'s payload from `payload(i)`.
    pub async fn refill_with(
        &self,
        n: usize,
        keys: Keys,
        topic: &str,
        payload: impl Fn(usize) -> Vec<u8>,
    ) -> Result<f64> {
        self.refill_messages(n, |i| NewMessage {
            topic: topic.to_owned(),
            ordering_key: keys.0.map(|k| format!("key-{}", i % k)),
            dedupe_key: format!("bench-{i}"),
            payload: payload(i),
            attributes: Default::default(),
            trace_context: None,
        })
        .await
    }

    /// [`Self::refill`] with unkeyed rows that each carry a writer's trace context, one in
    /// `sampled_every` of them sampled (as writers sampling at that ratio write them).
    pub async fn refill_traced(
        &self,
        n: usize,
        payload_bytes: usize,
        topic: &str,
        sampled_every: usize,
    ) -> Result<f64> {
        self.refill_messages(n, |i| {
            let flags = u8::from(i % sampled_every.max(1) == 0);
            let context = outbox_shared::TraceParent {
                trace_id: (0x5eed_0000_0000_0000_0000_0000_0000_0000_u128 + i as u128 + 1)
                    .to_be_bytes(),
                span_id: (0xa11c_e000_0000_0000_u64 + i as u64 + 1).to_be_bytes(),
                flags,
            };
            NewMessage {
                topic: topic.to_owned(),
                ordering_key: None,
                dedupe_key: format!("bench-{i}"),
                payload: (0..payload_bytes).map(|j| (i ^ j) as u8).collect(),
                attributes: Default::default(),
                trace_context: Some(outbox_shared::TraceContext::new(context.to_string())),
            }
        })
        .await
    }

    /// Empties the outbox and enqueues `message(i)` for `i` in `0..n`: rows/s of the enqueue.
    async fn refill_messages(
        &self,
        n: usize,
        message: impl Fn(usize) -> NewMessage,
    ) -> Result<f64> {
        let mut conn = self.db.pool.acquire().await?;
        sqlx::raw_sql("TRUNCATE pubsub_outbox, pubsub_outbox_dead_letter")
            .execute(&mut *conn)
            .await
            .context("emptying the outbox")?;
        let mut spent = Duration::ZERO;
        for start in (0..n).step_by(FILL_CHUNK) {
            let chunk: Vec<NewMessage> = (start..n.min(start + FILL_CHUNK)).map(&message).collect();
            let started = Instant::now();
            let mut tx = sqlx::Connection::begin(&mut *conn).await?;
            enqueue_batch(&mut tx, &chunk).await?;
            tx.commit().await.context("committing an enqueue")?;
            spent += started.elapsed();
        }
        sqlx::raw_sql("VACUUM ANALYZE pubsub_outbox")
            .execute(&mut *conn)
            .await
            .context("vacuuming the filled outbox")?;
        Ok(n as f64 / spent.as_secs_f64())
    }

    /// Rows left in the outbox.
    pub async fn remaining(&self) -> Result<i64> {
        Ok(harness::fixtures::outbox_rows(&self.db.pool).await)
    }
}
