//! The load: application writers enqueueing in many small transactions (a steady stream, paced
//! over the load duration), rows appended to the BigQuery table every second, and the producer
//! run on a short schedule against it. What was committed is recorded in [`Expected`] in commit
//! order, the one source of the verdict's expectations.
//!
//! Unpublishable rows, chosen from the seed: an oversize attribute (over Pub/Sub's 1,024 bytes) on
//! the application topic and on the BigQuery stream, JSON the schema topic refuses on the schema
//! topic. Unkeyed ones with probability `bad_unkeyed`; keyed ones as the third row of the first
//! `poison_keys` keys of each topic, which then hold every later row of their key.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Result, anyhow};
use harness::bigquery::TestTable;
use harness::ledger::DeliveryLedger;
use harness::producer::KeyedStream;
use outbox_shared::NewMessage;
use sqlx::PgPool;

use crate::plan::Plan;

/// 2026-11-30T12:00:00Z in UNIX microseconds: BigQuery row `id` is at `BASE + (id / 3) ms`
/// (three rows share each timestamp, so the cursor's tie-breaker matters).
const BASE_MICROS: i64 = 1_796_040_000_000_000;
/// The producer's stream name (dedupe keys are `chaos:<id>`).
pub const STREAM: &str = "chaos";
/// An attribute value Pub/Sub refuses (limit 1,024 bytes).
const OVERSIZE: usize = 1_500;

/// What the run committed, in commit order.
#[derive(Debug, Default)]
pub struct Expected {
    /// Every publishable row, per key in enqueue order.
    pub ledger: DeliveryLedger,
    /// Dedupe keys of the unpublishable rows: the dead-letter table must end holding exactly these.
    pub dead: BTreeSet<String>,
    /// Poison ordering keys and what they hold.
    pub held: BTreeMap<String, Held>,
    pub app_rows: usize,
    pub bigquery_rows: usize,
    /// The newest BigQuery row: (timestamp micros, id).
    pub newest: Option<(i64, i64)>,
    /// Application transactions retried after an error (a PostgreSQL restart mid-transaction).
    pub retried_transactions: usize,
    /// Application transactions kept open after their inserts (`Plan::long_writes`), and the
    /// longest.
    pub long_writes: usize,
    pub longest_write: Duration,
}

/// A poison key: its unpublishable row and the rows around it.
#[derive(Debug, Clone, Default)]
pub struct Held {
    /// The unpublishable row's dedupe key.
    pub bad: String,
    /// The key's rows enqueued after it, in order: these must wait.
    pub after: Vec<String>,
}

impl Expected {
    fn record(&mut self, dedupe: &str, key: Option<&str>, bad: bool) {
        if bad {
            self.dead.insert(dedupe.to_owned());
            if let Some(k) = key {
                self.held.insert(
                    k.to_owned(),
                    Held {
                        bad: dedupe.to_owned(),
                        after: Vec::new(),
                    },
                );
            }
            return;
        }
        if let Some(h) = key.and_then(|k| self.held.get_mut(k)) {
            h.after.push(dedupe.to_owned());
        }
        self.ledger.enqueued(dedupe, key);
    }
}

pub type Shared = Arc<Mutex<Expected>>;

fn lock(e: &Shared) -> Result<std::sync::MutexGuard<'_, Expected>> {
    e.lock()
        .map_err(|_| anyhow!("the expectations lock is poisoned"))
}

/// The topics an application writer writes to.
#[derive(Debug, Clone)]
pub struct AppTopics {
    pub app: String,
    pub schema: String,
}

/// One application writer: owns the keys `k` with `k % writers == w` of both topics (so each
/// key's transactions are serialised, as the README asks of writers), writes `quota` rows in
/// transactions of 1-40 rows, paced to end with the load; a share of them (`plan.long_writes`)
/// stays open for seconds after its inserts, as a business transaction that calls another service
/// before it commits.
pub async fn write(
    pool: PgPool,
    plan: Plan,
    topics: AppTopics,
    w: usize,
    quota: usize,
    expected: Shared,
    t0: Instant,
) -> Result<()> {
    let mut rng =
        fastrand::Rng::with_seed(plan.seed ^ (0x9E37_79B9_7F4A_7C15u64.wrapping_mul(w as u64 + 1)));
    let mut per_key: HashMap<String, usize> = HashMap::new();
    let mut written = 0usize;
    let mut seq = 0usize;
    while written < quota {
        let n = rng.usize(1..=40).min(quota - written);
        let mut batch: Vec<(NewMessage, bool)> = Vec::with_capacity(n);
        for _ in 0..n {
            seq += 1;
            let dedupe = format!("app-{w}-{seq}");
            let on_schema = rng.f64() < 0.25;
            let (topic, prefix, keys) = if on_schema {
                (&topics.schema, "sch", plan.schema_keys)
            } else {
                (&topics.app, "app", plan.app_keys)
            };
            let key = if rng.f64() < 0.7 {
                let owned = keys.saturating_sub(w).div_ceil(plan.writers).max(1);
                let j = w + plan.writers * rng.usize(0..owned);
                Some((j, format!("{prefix}-{j:03}")))
            } else {
                None
            };
            let bad = match &key {
                Some((j, name)) => {
                    let c = per_key.entry(name.clone()).or_insert(0);
                    *c += 1;
                    *j < plan.poison_keys && *c == 3
                }
                None => rng.f64() < plan.bad_unkeyed,
            };
            let payload = match (on_schema, bad) {
                (true, false) => format!("{{\"amount\": {seq}}}"),
                (true, true) => "{\"amount\": \"not a number\"}".to_owned(),
                (false, _) => format!("{{\"seq\": {seq}}}"),
            };
            let mut m = NewMessage::new(topic, &dedupe, payload.into_bytes())
                .with_attribute("writer", w.to_string());
            if bad && !on_schema {
                m = m.with_attribute("note", "x".repeat(OVERSIZE));
            }
            if let Some((_, name)) = key {
                m = m.with_ordering_key(name);
            }
            batch.push((m, bad));
        }
        let messages: Vec<NewMessage> = batch.iter().map(|(m, _)| m.clone()).collect();
        let hold = (rng.f64() < plan.long_writes).then(|| {
            let (least, most) = plan.long_write;
            Duration::from_millis(rng.u64(least.as_millis() as u64..=most.as_millis() as u64))
        });
        let retried = enqueue_retrying(&pool, &messages, hold).await?;
        {
            let mut e = lock(&expected)?;
            e.retried_transactions += usize::from(retried);
            if let Some(hold) = hold {
                e.long_writes += 1;
                e.longest_write = e.longest_write.max(hold);
            }
            e.app_rows += messages.len();
            for (m, bad) in &batch {
                e.record(&m.dedupe_key, m.ordering_key.as_deref(), *bad);
            }
        }
        written += n;
        let due = t0 + plan.load.mul_f64(written as f64 / quota as f64);
        tokio::time::sleep_until(due.into()).await;
    }
    Ok(())
}

/// One transaction: the rows and a NOTIFY, kept open for `hold` before the commit when given. An
/// error (the server restarting) retries the same rows for up to 2 minutes, without the hold: a
/// commit whose answer was lost is then a no-op re-enqueue (the dedupe key is unique while the
/// row is in the outbox). Returns whether it had to retry.
async fn enqueue_retrying(
    pool: &PgPool,
    messages: &[NewMessage],
    mut hold: Option<Duration>,
) -> Result<bool> {
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut retried = false;
    loop {
        let attempt = async {
            let mut tx = pool.begin().await?;
            outbox_shared::enqueue_batch(&mut tx, messages).await?;
            outbox_shared::store::notify::notify(&mut tx, outbox_shared::DEFAULT_NOTIFY_CHANNEL)
                .await?;
            if let Some(hold) = hold.take() {
                tokio::time::sleep(hold).await;
            }
            tx.commit().await?;
            anyhow::Ok(())
        };
        match attempt.await {
            Ok(()) => return Ok(retried),
            Err(e) if Instant::now() < deadline => {
                retried = true;
                tracing::debug!(error = %e, "enqueue failed; retrying");
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            Err(e) => return Err(e.context("enqueueing application rows for 2 minutes")),
        }
    }
}

/// Appends rows to the BigQuery table every second until `plan.bigquery_rows()` are there.
pub async fn feed_bigquery(
    table: &TestTable,
    plan: &Plan,
    expected: &Shared,
    t0: Instant,
) -> Result<()> {
    let total = plan.bigquery_rows();
    let mut rng = fastrand::Rng::with_seed(plan.seed ^ 0xB1C0);
    let mut per_key: HashMap<usize, usize> = HashMap::new();
    let mut next = 1usize;
    while next <= total {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let share = (t0.elapsed().as_secs_f64() / plan.load.as_secs_f64()).min(1.0);
        let upto = ((total as f64 * share) as usize).max(next).min(total);
        let mut request = Vec::new();
        let mut rows = Vec::new();
        for id in next..=upto {
            let keyed = rng.f64() < 0.8;
            let j = id % plan.bigquery_keys;
            let bad = if keyed {
                let c = per_key.entry(j).or_insert(0);
                *c += 1;
                j < plan.poison_keys && *c == 3
            } else {
                rng.f64() < plan.bad_unkeyed
            };
            let micros = BASE_MICROS + (id as i64 / 3) * 1_000;
            let customer = keyed.then(|| format!("bq-{j:02}"));
            let note = if bad {
                "x".repeat(OVERSIZE)
            } else {
                format!("n{id}")
            };
            let row = serde_json::json!({
                "id": id,
                "updated_at": outbox_producer::value::format_timestamp(micros)
                    .ok_or_else(|| anyhow!("timestamp out of range"))?,
                "customer": customer,
                "note": note,
                "amount": id,
            });
            request.push(row);
            rows.push((id, micros, customer, bad));
        }
        table.try_insert(&request).await?;
        let mut e = lock(expected)?;
        for (id, micros, customer, bad) in rows {
            e.record(&format!("{STREAM}:{id}"), customer.as_deref(), bad);
            e.bigquery_rows += 1;
            e.newest = Some((micros, id as i64));
        }
        next = upto + 1;
    }
    Ok(())
}

/// The producer's streams file for the run's table and topic.
pub fn streams_toml(table: &TestTable, topic: &str) -> String {
    KeyedStream {
        name: STREAM,
        table,
        topic,
        columns: &["customer", "note", "amount"],
        attribute: Some(("note", "chaos")),
        payload: &["id", "customer", "amount"],
        extra: "",
    }
    .toml()
}
