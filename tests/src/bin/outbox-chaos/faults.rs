//! The processes under test and the faults that hit them: the dispatcher replicas (supervised:
//! one that exits on its own is recorded and restarted, as an orchestrator would), the producer's
//! schedule, and the seeded fault schedule executed at its moments. Every fault is bounded in
//! time and healed before its future returns.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use tokio::sync::Mutex as AsyncMutex;

use crate::plan::{Fault, Plan};
use harness::process::Process;

use crate::stack::Stack;

/// One fault as it happened (times since the load started).
#[derive(Debug, Clone)]
pub struct FaultRecord {
    pub kind: &'static str,
    pub at: Duration,
    pub healed: Duration,
    pub detail: String,
    /// Kills: whether the victim had a batch in flight (an open claim transaction).
    pub hit_in_flight: Option<bool>,
}

/// The dispatcher replicas.
#[derive(Debug)]
pub struct Dispatchers {
    slots: AsyncMutex<Vec<Option<Process>>>,
    started: Mutex<usize>,
    /// Exits nobody asked for: (replica, status, log tail).
    pub unexpected: Mutex<Vec<String>>,
}

impl Dispatchers {
    pub fn new() -> Self {
        Self {
            slots: AsyncMutex::new(Vec::new()),
            started: Mutex::new(0),
            unexpected: Mutex::new(Vec::new()),
        }
    }

    fn args(plan: &Plan) -> Vec<String> {
        [
            "--workers",
            &plan.workers.to_string(),
            "--batch-size",
            &plan.batch_size.to_string(),
            "--db-pool-size",
            &(plan.workers + 4).to_string(),
            // A replica restarted while PostgreSQL restarts waits for it.
            "--db-connect-timeout",
            "120s",
            "--listen-addr",
            "127.0.0.1:0",
            "--publish-timeout",
            "10s",
            "--backoff-base",
            "100ms",
            "--backoff-cap",
            "2s",
            "--max-attempts",
            "1000",
            "--poll-interval",
            "50ms",
            "--max-poll-interval",
            "500ms",
            "--grace-period",
            "10s",
        ]
        .map(str::to_owned)
        .to_vec()
    }

    fn spawn(&self, stack: &Stack, plan: &Plan, i: usize) -> Result<Process> {
        let n = {
            let mut s = self
                .started
                .lock()
                .map_err(|_| anyhow!("dispatcher counter poisoned"))?;
            *s += 1;
            *s
        };
        stack.spawn(
            "dispatcher",
            &Self::args(plan),
            &format!("dispatcher-{i}-{n}"),
        )
    }

    pub async fn start_all(&self, stack: &Stack, plan: &Plan) -> Result<()> {
        let mut slots = self.slots.lock().await;
        for i in 0..plan.dispatchers {
            slots.push(Some(self.spawn(stack, plan, i)?));
        }
        Ok(())
    }

    /// Restarts any replica that exited on its own, recording it; runs until `until` resolves.
    pub async fn supervise(&self, stack: &Stack, plan: &Plan) -> Result<()> {
        loop {
            tokio::time::sleep(Duration::from_millis(250)).await;
            let mut slots = self.slots.lock().await;
            for (i, slot) in slots.iter_mut().enumerate() {
                let Some(p) = slot.as_mut() else { continue };
                if let Some(status) = p.child.try_wait()? {
                    let what = format!(
                        "dispatcher {i} exited by itself ({status}): {}",
                        p.log_tail(5)
                    );
                    eprintln!("outbox-chaos: {what}");
                    if let Ok(mut u) = self.unexpected.lock() {
                        u.push(what);
                    }
                    *slot = Some(self.spawn(stack, plan, i)?);
                }
            }
        }
    }

    /// SIGKILL replica `i`; returns whether it had a batch in flight. Its slot stays empty until
    /// [`Self::restart`].
    async fn kill(&self, stack: &Stack, i: usize) -> Result<bool> {
        let mut slots = self.slots.lock().await;
        let slot = slots
            .get_mut(i)
            .ok_or_else(|| anyhow!("no dispatcher {i}"))?;
        let Some(mut p) = slot.take() else {
            return Ok(false);
        };
        let in_flight = stack.open_transactions_of(p.pid).await.unwrap_or(0);
        p.child.start_kill().context("SIGKILL a dispatcher")?;
        let _ = p.child.wait().await;
        Ok(in_flight > 0)
    }

    async fn restart(&self, stack: &Stack, plan: &Plan, i: usize) -> Result<()> {
        let p = self.spawn(stack, plan, i)?;
        if let Some(slot) = self.slots.lock().await.get_mut(i) {
            *slot = Some(p);
        }
        Ok(())
    }

    /// SIGTERM every replica; each must exit 0 within 30 s. Returns the failures.
    pub async fn terminate(&self) -> Vec<String> {
        let mut failures = Vec::new();
        let mut slots = self.slots.lock().await;
        for (i, slot) in slots.iter_mut().enumerate() {
            let Some(mut p) = slot.take() else { continue };
            p.try_signal("TERM");
            match tokio::time::timeout(Duration::from_secs(30), p.child.wait()).await {
                Ok(Ok(s)) if s.success() => {}
                Ok(Ok(s)) => failures.push(format!(
                    "dispatcher {i} exited {s} on SIGTERM: {}",
                    p.log_tail(5)
                )),
                Ok(Err(e)) => failures.push(format!("dispatcher {i}: {e}")),
                Err(_) => failures.push(format!(
                    "dispatcher {i} did not exit within 30 s of SIGTERM"
                )),
            }
        }
        failures
    }

    /// How many replicas were started in all (initial ones and restarts).
    pub fn started(&self) -> usize {
        self.started.lock().map(|s| *s).unwrap_or(0)
    }
}

/// The producer's schedule: an execution every `plan.producer_every`, one at a time.
#[derive(Debug)]
pub struct Producer {
    current: AsyncMutex<Option<Process>>,
    config: std::path::PathBuf,
    page_size: usize,
    /// Exit outcomes: (succeeded, failed, killed).
    pub outcomes: Mutex<(usize, usize, usize)>,
    runs: Mutex<usize>,
}

impl Producer {
    pub fn new(config: std::path::PathBuf, plan: &Plan) -> Self {
        let per_run = plan.bigquery_rows() as f64 / plan.load.as_secs_f64()
            * plan.producer_every.as_secs_f64();
        Self {
            current: AsyncMutex::new(None),
            config,
            // A few pages per execution, so a kill can land between two committed pages.
            page_size: ((per_run / 3.0) as usize).clamp(20, 2_000),
            outcomes: Mutex::new((0, 0, 0)),
            runs: Mutex::new(0),
        }
    }

    fn spawn(&self, stack: &Stack) -> Result<Process> {
        let n = {
            let mut r = self
                .runs
                .lock()
                .map_err(|_| anyhow!("producer counter poisoned"))?;
            *r += 1;
            *r
        };
        let args = [
            "--config".to_owned(),
            self.config.to_string_lossy().into_owned(),
            "run".to_owned(),
            "--page-size".to_owned(),
            self.page_size.to_string(),
        ];
        stack.spawn("producer", &args, &format!("producer-{n}"))
    }

    /// Reaps a finished execution and starts the next (one at a time).
    pub async fn tick(&self, stack: &Stack) -> Result<()> {
        let mut current = self.current.lock().await;
        if let Some(p) = current.as_mut() {
            match p.child.try_wait()? {
                None => return Ok(()),
                Some(status) => self.count(status.success()),
            }
        }
        *current = Some(self.spawn(stack)?);
        Ok(())
    }

    /// Runs the schedule forever (the caller drops it).
    pub async fn schedule(&self, stack: &Stack, every: Duration) -> Result<()> {
        loop {
            self.tick(stack).await?;
            tokio::time::sleep(every).await;
        }
    }

    /// Waits for the running execution, if any (up to 2 minutes).
    pub async fn finish(&self) -> Result<()> {
        let mut current = self.current.lock().await;
        if let Some(mut p) = current.take() {
            let status = tokio::time::timeout(Duration::from_secs(120), p.child.wait())
                .await
                .map_err(|_| anyhow!("a producer execution ran over 2 minutes"))??;
            self.count(status.success());
        }
        Ok(())
    }

    /// SIGKILLs an execution mid-run: holds the schedule for 3 s (a backlog of several pages
    /// builds up), lets the running execution finish, starts a fresh one and kills it once its
    /// producer_run row shows a committed page (up to 5 tries). Returns the rows it had committed.
    async fn kill(&self, stack: &Stack) -> Result<i64> {
        let mut current = self.current.lock().await;
        tokio::time::sleep(Duration::from_secs(3)).await;
        if let Some(mut p) = current.take() {
            let status = tokio::time::timeout(Duration::from_secs(120), p.child.wait())
                .await
                .map_err(|_| anyhow!("a producer execution ran over 2 minutes"))??;
            self.count(status.success());
        }
        for _ in 0..5 {
            let mut p = self.spawn(stack)?;
            let deadline = Instant::now() + Duration::from_secs(30);
            while Instant::now() < deadline {
                if let Some(status) = p.child.try_wait()? {
                    self.count(status.success());
                    break;
                }
                let committed: Option<i64> = sqlx::query_scalar(
                    "SELECT rows_enqueued FROM producer_run
                     WHERE stream = $1 AND outcome = 'running' ORDER BY id DESC LIMIT 1",
                )
                .bind(crate::load::STREAM)
                .fetch_optional(&stack.db.pool)
                .await
                .unwrap_or(None);
                if let Some(n) = committed.filter(|n| *n > 0) {
                    p.child.start_kill().context("SIGKILL the producer")?;
                    let _ = p.child.wait().await;
                    if let Ok(mut o) = self.outcomes.lock() {
                        o.2 += 1;
                    }
                    return Ok(n);
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        bail!("no producer execution could be killed mid-run in 5 tries")
    }

    fn count(&self, success: bool) {
        if let Ok(mut o) = self.outcomes.lock() {
            if success {
                o.0 += 1;
            } else {
                o.1 += 1;
            }
        }
    }
}

/// Executes the schedule's faults at their moments (`t0` = the load's start).
pub async fn run_schedule(
    stack: &Stack,
    plan: &Plan,
    dispatchers: &Dispatchers,
    producer: &Producer,
    t0: Instant,
    exclusive: bool,
) -> Result<Vec<FaultRecord>> {
    let mut records = Vec::new();
    for (at, fault) in &plan.faults {
        let is_kill = matches!(fault, Fault::KillDispatcher { .. });
        if is_kill == exclusive {
            continue;
        }
        tokio::time::sleep_until((t0 + *at).into()).await;
        let started = t0.elapsed();
        let mut hit_in_flight = None;
        let detail = match fault {
            Fault::KillDispatcher { victim, down } => {
                let hit = dispatchers.kill(stack, *victim).await?;
                hit_in_flight = Some(hit);
                tokio::time::sleep(*down).await;
                dispatchers.restart(stack, plan, *victim).await?;
                format!("replica {victim}, down {} ms", down.as_millis())
            }
            Fault::KillProducer => {
                let committed = producer.kill(stack).await?;
                format!("killed after its run committed {committed} rows")
            }
            Fault::CutPubsub(d) => {
                stack.proxy.set_down(true);
                tokio::time::sleep(*d).await;
                stack.proxy.set_down(false);
                format!("{} s refused", d.as_secs())
            }
            Fault::StallPubsub(d) => {
                stack.proxy.set_stalled(true);
                tokio::time::sleep(*d).await;
                stack.proxy.set_stalled(false);
                format!("{} s silent", d.as_secs())
            }
            Fault::RestartPostgres => {
                let took = stack.restart_postgres().await?;
                format!("pg_ctl restart -m fast took {} ms", took.as_millis())
            }
            Fault::LongTransaction(d) => hold_transaction(stack, *d).await?,
            Fault::PauseTopic(d) => {
                let topic = stack.app.topic.as_str();
                stack
                    // The topic is the chaos run's own: at this instant it may hold no row (all
                    // published and deleted), so it is named as one the run knows exists.
                    .operator(&[
                        "pause",
                        topic,
                        "--new-topic",
                        "--reason",
                        "chaos: pause mid-run",
                    ])
                    .await?;
                tokio::time::sleep(*d).await;
                stack
                    .operator(&["resume", topic, "--reason", "chaos: resume"])
                    .await?;
                format!("application topic paused {} s", d.as_secs())
            }
            Fault::ReplayDeadLetter => replay_one(stack).await?,
        };
        let healed = t0.elapsed();
        println!(
            "  [{:>6.1}s] {} ({detail})",
            started.as_secs_f64(),
            fault.kind()
        );
        records.push(FaultRecord {
            kind: fault.kind(),
            at: started,
            healed,
            detail,
            hit_in_flight,
        });
    }
    Ok(records)
}

/// Holds a REPEATABLE READ snapshot (the cluster's vacuum horizon) for `d`; reports the outbox's
/// dead tuples when it began and ended.
async fn hold_transaction(stack: &Stack, d: Duration) -> Result<String> {
    let mut tx = stack.db.pool.begin().await?;
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut *tx)
        .await?;
    sqlx::query("SELECT count(*) FROM pubsub_outbox")
        .execute(&mut *tx)
        .await?;
    let before = crate::report::table_health(&stack.db.pool).await?;
    tokio::time::sleep(d).await;
    let after = crate::report::table_health(&stack.db.pool).await?;
    tx.commit().await?;
    Ok(format!(
        "snapshot held {} s; outbox dead tuples {} -> {}",
        d.as_secs(),
        before.dead_tuples,
        after.dead_tuples
    ))
}

/// Replays the oldest dead letter (keyed if there is one) with the operator command: it is
/// unpublishable, so it returns to the dead-letter table, and a keyed one goes back to its place
/// (its outbox id) ahead of the rows its key holds, whether the dispatcher or the producer made it.
async fn replay_one(stack: &Stack) -> Result<String> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let id: Option<(i64, String)> = sqlx::query_as(
            "SELECT id, dedupe_key FROM pubsub_outbox_dead_letter
             ORDER BY (ordering_key IS NULL), id LIMIT 1",
        )
        .fetch_optional(&stack.db.pool)
        .await?;
        if let Some((id, dedupe)) = id {
            let id = id.to_string();
            stack
                .operator(&[
                    "dead-letters",
                    "replay",
                    &id,
                    "--reason",
                    "chaos: replay mid-run",
                ])
                .await?;
            return Ok(format!("dead letter {id} ({dedupe}) replayed"));
        }
        if Instant::now() > deadline {
            bail!("no dead letter to replay 20 s after its moment");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
