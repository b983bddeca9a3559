//! The soak's load and its independent reader: application writers at a steady rate, rows
//! appended to the BigQuery table every second, `producer run` on a schedule, and the subscriber
//! that records every arrival and its commit -> publish latency.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, Result, anyhow};
use harness::bigquery::TestTable;
use harness::ledger::Arrival;
use harness::process::{Process, Spawn};
use harness::producer::KeyedStream;
use outbox_shared::{NewMessage, enqueue_batch, notify};
use sqlx::PgPool;

use super::{Shared, SoakArgs, locked};

/// One application writer: owns the keys `j` with `j % writers == w`, writes its share of the
/// rate in transactions of 1-20 rows until `until`.
pub(crate) async fn write(
    pool: PgPool,
    topic: String,
    w: usize,
    args: SoakArgs,
    payload: Vec<u8>,
    until: Instant,
    shared: Arc<Shared>,
) -> Result<()> {
    let mut rng = fastrand::Rng::with_seed(0x50A4 + w as u64);
    let per_second = f64::from(args.rate) / args.writers as f64;
    let owned = args.keys.saturating_sub(w).div_ceil(args.writers).max(1);
    let started = Instant::now();
    let mut written = 0usize;
    while Instant::now() < until {
        let n = rng.usize(1..=20);
        let messages: Vec<NewMessage> = (0..n)
            .map(|i| {
                let dedupe = format!("soak-{w}-{}", written + i);
                let m = NewMessage::new(&topic, &dedupe, payload.clone());
                if rng.bool() {
                    let j = w + args.writers * rng.usize(0..owned);
                    m.with_ordering_key(format!("k-{j:03}"))
                } else {
                    m
                }
            })
            .collect();
        let mut tx = pool.begin().await?;
        enqueue_batch(&mut tx, &messages).await?;
        notify(&mut tx, outbox_shared::DEFAULT_NOTIFY_CHANNEL).await?;
        tx.commit().await.context("committing application rows")?;
        let committed = SystemTime::now();
        {
            let mut pending = locked(&shared.pending)?;
            for m in &messages {
                pending.insert(m.dedupe_key.clone(), committed);
            }
        }
        {
            let mut ledger = locked(&shared.ledger)?;
            for m in &messages {
                ledger.enqueued(&m.dedupe_key, m.ordering_key.as_deref());
            }
        }
        shared.enqueued.fetch_add(n as u64, Ordering::Relaxed);
        written += n;
        let due = started + Duration::from_secs_f64(written as f64 / per_second);
        tokio::time::sleep_until(due.into()).await;
    }
    Ok(())
}

/// 2026-11-30T12:00:00Z in UNIX microseconds; row `id` is stamped `BASE + id ms`.
const BASE_MICROS: i64 = 1_796_040_000_000_000;
/// The producer's stream (dedupe keys `soak:<id>`).
const STREAM: &str = "soak";

/// Appends `rate` rows per second to the BigQuery table until `until`, 80 % over 50 customers
/// (the ordering key).
pub(crate) async fn feed_bigquery(
    table: Arc<TestTable>,
    rate: usize,
    until: Instant,
    shared: Arc<Shared>,
) -> Result<()> {
    let mut next = 1usize;
    let mut rng = fastrand::Rng::with_seed(0xB16);
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    while Instant::now() < until && rate > 0 {
        tick.tick().await;
        let mut request = Vec::with_capacity(rate);
        let mut rows = Vec::with_capacity(rate);
        for id in next..next + rate {
            let customer = (rng.f64() < 0.8).then(|| format!("bq-{:02}", rng.usize(0..50)));
            let micros = BASE_MICROS + id as i64 * 1_000;
            request.push(serde_json::json!({
                "id": id,
                "updated_at": outbox_producer::value::format_timestamp(micros)
                    .ok_or_else(|| anyhow!("timestamp out of range"))?,
                "customer": customer,
                "amount": id,
            }));
            rows.push((id, customer));
        }
        table.try_insert(&request).await?;
        let mut ledger = locked(&shared.ledger)?;
        for (id, customer) in rows {
            ledger.enqueued(&format!("{STREAM}:{id}"), customer.as_deref());
        }
        next += rate;
    }
    Ok(())
}

/// The producer's streams file for the soak's table and topic.
pub(crate) fn streams_toml(table: &TestTable, topic: &str) -> String {
    KeyedStream {
        name: STREAM,
        table,
        topic,
        columns: &["customer", "amount"],
        attribute: None,
        payload: &["id", "customer", "amount"],
        extra: "",
    }
    .toml()
}

/// `producer run` on a schedule, one execution at a time.
pub(crate) struct ProducerSchedule {
    pub(crate) bin: PathBuf,
    pub(crate) config: PathBuf,
    pub(crate) database_url: String,
    pub(crate) emulator: String,
    pub(crate) log: PathBuf,
}

impl ProducerSchedule {
    fn spawn(&self) -> Spawn {
        Spawn::program(&self.bin)
            .arg("--config")
            .arg(&self.config)
            .arg("run")
            .env("DATABASE_URL", &self.database_url)
            .env("PUBSUB_EMULATOR_HOST", &self.emulator)
            .env(
                "BIGQUERY_EMULATOR_HOST",
                harness::env::bigquery_emulator_host(),
            )
            .env("BIGQUERY_PROJECT_ID", harness::env::bigquery_project())
            .env("PUBSUB_PROJECT_ID", harness::env::pubsub_project())
            .env("OUTBOX_LOG", "warn")
            .append_log(&self.log)
    }

    /// Counts the last execution if it ended, and starts the next unless it is still running.
    pub(crate) fn reap_and_start(
        &self,
        running: &mut Option<Process>,
        runs: &mut (usize, usize),
    ) -> Result<()> {
        if let Some(p) = running.as_mut() {
            match p.child.try_wait()? {
                None => return Ok(()),
                Some(s) if s.success() => runs.0 += 1,
                Some(_) => runs.1 += 1,
            }
        }
        *running = Some(self.spawn().start().context("starting the producer")?);
        Ok(())
    }

    /// One execution to its end: whether it succeeded.
    pub(crate) async fn run_to_end(&self) -> Result<bool> {
        let mut last = self.spawn().start().context("starting the producer")?;
        let status = tokio::time::timeout(Duration::from_secs(300), last.child.wait())
            .await
            .map_err(|_| anyhow!("the last producer run did not finish within 300 s"))??;
        Ok(status.success())
    }
}

/// Records every arrival (and acks it); the commit -> publish latency of the ones a writer stamped.
pub(crate) fn read_subscription(
    subscription: String,
    shared: Arc<Shared>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            let mut stream = harness::pubsub::stream(&subscription).await;
            while let Some(next) = stream.next().await {
                let Ok((msg, handler)) = next else { break };
                handler.ack();
                let dedupe = msg
                    .attributes
                    .get(outbox_shared::DEFAULT_DEDUPE_ATTRIBUTE)
                    .cloned()
                    .unwrap_or_default();
                let published = msg.publish_time.map(|t| {
                    SystemTime::UNIX_EPOCH
                        + Duration::new(t.seconds().max(0) as u64, t.nanos().max(0) as u32)
                });
                let committed = shared
                    .pending
                    .lock()
                    .ok()
                    .and_then(|mut p| p.remove(&dedupe));
                if let (Some(c), Some(p)) = (committed, published)
                    && let Ok(mut l) = shared.latencies.lock()
                {
                    let ms = match p.duration_since(c) {
                        Ok(d) => d.as_secs_f64() * 1e3,
                        Err(e) => -e.duration().as_secs_f64() * 1e3,
                    };
                    l.push(ms);
                }
                if let Ok(mut a) = shared.arrivals.lock() {
                    a.push(Arrival {
                        dedupe_key: dedupe,
                        ordering_key: msg.ordering_key,
                    });
                }
                shared.arrived.fetch_add(1, Ordering::Relaxed);
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    })
}
