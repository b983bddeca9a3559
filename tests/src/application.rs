//! An application writing to the outbox while something else happens (a migration, an upgrade):
//! one session of its own (`application_name` "the-app") committing a transaction every tick,
//! recording what it wrote, in order ([`DeliveryLedger`]), and how long each transaction took.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox_shared::{NewMessage, enqueue_batch};
use sqlx::{Connection, PgConnection};
use tokio::task::JoinHandle;

use crate::db::TestDb;
use crate::ledger::DeliveryLedger;

/// A running application ([`Application::start`]).
#[derive(Debug)]
pub struct Application {
    stop: Arc<AtomicBool>,
    ledger: Arc<Mutex<DeliveryLedger>>,
    inserts: Arc<Mutex<Vec<(Instant, Duration)>>>,
    task: JoinHandle<()>,
}

/// How the inserts that began in a window went.
#[derive(Debug, Clone, Copy, Default)]
pub struct Inserts {
    /// How many.
    pub count: usize,
    /// The median transaction.
    pub p50: Duration,
    /// The slowest.
    pub max: Duration,
}

impl Application {
    /// Starts committing `messages(i)` (and a NOTIFY) in transaction `i` = 0, 1, …, pausing
    /// `every` between them.
    pub async fn start(
        db: &TestDb,
        every: Duration,
        messages: impl Fn(usize) -> Vec<NewMessage> + Send + 'static,
    ) -> Self {
        let mut conn = PgConnection::connect_with(&db.options().application_name("the-app"))
            .await
            .expect("the application connects");
        let stop = Arc::new(AtomicBool::new(false));
        let ledger = Arc::new(Mutex::new(DeliveryLedger::new()));
        let inserts = Arc::new(Mutex::new(Vec::new()));
        let (flag, l, ins) = (stop.clone(), ledger.clone(), inserts.clone());
        let task = tokio::spawn(async move {
            let mut i = 0usize;
            while !flag.load(Ordering::Relaxed) {
                let batch = messages(i);
                let t = Instant::now();
                let mut tx = conn.begin().await.expect("begin");
                enqueue_batch(&mut tx, &batch)
                    .await
                    .expect("the application's insert");
                outbox_shared::notify(&mut tx, outbox_shared::DEFAULT_NOTIFY_CHANNEL)
                    .await
                    .expect("notify");
                tx.commit().await.expect("commit");
                ins.lock().expect("lock").push((t, t.elapsed()));
                {
                    let mut l = l.lock().expect("lock");
                    for m in &batch {
                        l.enqueued(&m.dedupe_key, m.ordering_key.as_deref());
                    }
                }
                i += 1;
                tokio::time::sleep(every).await;
            }
        });
        Self {
            stop,
            ledger,
            inserts,
            task,
        }
    }

    /// Records a message written elsewhere, in its place in the ledger.
    pub fn enqueued(&self, dedupe_key: &str, ordering_key: Option<&str>) {
        self.ledger
            .lock()
            .expect("lock")
            .enqueued(dedupe_key, ordering_key);
    }

    /// The transactions that began in `from..=to`.
    pub fn inserts(&self, from: Instant, to: Instant) -> Inserts {
        let mut during: Vec<Duration> = self
            .inserts
            .lock()
            .expect("lock")
            .iter()
            .filter(|(t, _)| *t >= from && *t <= to)
            .map(|(_, d)| *d)
            .collect();
        during.sort();
        Inserts {
            count: during.len(),
            p50: during.get(during.len() / 2).copied().unwrap_or_default(),
            max: during.last().copied().unwrap_or_default(),
        }
    }

    /// Stops it; what it wrote, in order, and how many transactions it committed.
    pub async fn stop(self) -> (DeliveryLedger, usize) {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.expect("the application ran");
        let ledger = self.ledger.lock().expect("lock").clone();
        let n = self.inserts.lock().expect("lock").len();
        (ledger, n)
    }
}

/// A business transaction of a session named `application_name` that inserted `messages` into the
/// outbox and stays open (what a migration or a floor waits for) until the caller sends `COMMIT`
/// on the connection; with its backend pid.
pub async fn open_transaction(
    db: &TestDb,
    application_name: &str,
    messages: &[NewMessage],
) -> (PgConnection, i32) {
    let mut conn = PgConnection::connect_with(&db.options().application_name(application_name))
        .await
        .expect("the writer connects");
    sqlx::raw_sql("BEGIN")
        .execute(&mut conn)
        .await
        .expect("begin");
    enqueue_batch(&mut conn, messages)
        .await
        .expect("the open transaction's insert");
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut conn)
        .await
        .expect("pid");
    (conn, pid)
}
