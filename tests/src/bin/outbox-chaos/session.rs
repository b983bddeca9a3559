//! One chaos session, start to verdict: subscribers and dispatchers up; the load and the fault
//! schedule together; then the drain (producer caught up, every unpublishable row dead-lettered,
//! every other due row published except those their key holds), the checks on the dead letters and
//! held keys, the operator's discard that releases the held keys, the final drain, the inbox
//! consumer catching up, and the judgement.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Result, anyhow, bail};

use crate::faults::{Dispatchers, FaultRecord, Producer, run_schedule};
use crate::inbox::{self, InboxConsumer};
use crate::load::{self, AppTopics, Expected, Shared};
use crate::plan::Plan;
use crate::report::{Report, TableHealth, table_health};
use crate::stack::Stack;
use crate::verdict::{self, Arrivals};

pub async fn run(stack: &Stack, plan: &Plan) -> Result<Report> {
    let wall = Instant::now();
    let mut report = Report::new(plan);
    report.health_before = table_health(&stack.db.pool).await?;
    let config = stack.work_dir.join("streams.toml");
    std::fs::write(
        &config,
        load::streams_toml(&stack.table, &stack.bigquery_topic.topic),
    )?;
    let expected: Shared = Arc::new(Mutex::new(Expected::default()));
    let arrivals: Arrivals = Arc::new(Mutex::new(Vec::new()));
    let peak = Mutex::new(TableHealth::default());

    let t0 = Instant::now();
    let app_delivered: inbox::Delivered = Arc::default();
    let subscribers: Vec<_> = [&stack.app, &stack.schema, &stack.bigquery_topic]
        .into_iter()
        .enumerate()
        .map(|(i, t)| {
            let keys = (i == 0).then(|| app_delivered.clone());
            verdict::subscribe(t.subscription.clone(), arrivals.clone(), keys, t0)
        })
        .collect();
    let consumer = tokio::sync::Mutex::new(
        InboxConsumer::start(
            stack.consumer_db.pool.clone(),
            stack.inbox_subscription.name.clone(),
        )
        .await?,
    );
    let dispatchers = Dispatchers::new();
    dispatchers.start_all(stack, plan).await?;
    let producer = Producer::new(config, plan);

    let app_rows = plan.rows - plan.bigquery_rows();
    let topics = AppTopics {
        app: stack.app.topic.clone(),
        schema: stack.schema.topic.clone(),
    };
    let writers: Vec<_> = (0..plan.writers)
        .map(|w| {
            let quota = app_rows / plan.writers + usize::from(w < app_rows % plan.writers);
            tokio::spawn(load::write(
                stack.db.pool.clone(),
                plan.clone(),
                topics.clone(),
                w,
                quota,
                expected.clone(),
                t0,
            ))
        })
        .collect();

    let foreground = async {
        let (_, exclusive, kills, ()) = tokio::try_join!(
            load::feed_bigquery(&stack.table, plan, &expected, t0),
            run_schedule(stack, plan, &dispatchers, &producer, t0, true),
            run_schedule(stack, plan, &dispatchers, &producer, t0, false),
            inbox::run_kills(&consumer, plan, t0),
        )?;
        for w in writers {
            w.await.map_err(|e| anyhow!("a writer panicked: {e}"))??;
        }
        let mut faults: Vec<FaultRecord> = exclusive.into_iter().chain(kills).collect();
        faults.sort_by_key(|f| f.at);
        println!(
            "  [{:>6.1}s] load done; draining",
            t0.elapsed().as_secs_f64()
        );
        let drain_started = Instant::now();
        drain(stack, plan, &expected, &arrivals, &mut report).await?;
        report.drain = drain_started.elapsed();
        report.inbox =
            inbox::settle(&consumer, &stack.consumer_db.pool, &app_delivered, t0).await?;
        anyhow::Ok(faults)
    };
    let background = async {
        tokio::try_join!(
            dispatchers.supervise(stack, plan),
            producer.schedule(stack, plan.producer_every),
            sample_health(stack, &peak),
        )?;
        anyhow::Ok(())
    };
    let faults = tokio::select! {
        r = foreground => r?,
        r = background => {
            r?;
            bail!("the dispatchers' supervisor or the producer schedule stopped");
        }
    };
    report.terminate_failures = dispatchers.terminate().await;
    producer.finish().await?;
    // Let the last acks reach the emulator before the subscribers go.
    tokio::time::sleep(Duration::from_millis(500)).await;
    for s in &subscribers {
        s.abort();
    }

    let recs = arrivals
        .lock()
        .map_err(|_| anyhow!("arrivals lock poisoned"))?
        .clone();
    {
        let e = expected
            .lock()
            .map_err(|_| anyhow!("expectations lock poisoned"))?;
        report.judge(&e, &recs, faults);
    }
    report.health_after = table_health(&stack.db.pool).await?;
    report.health_peak = peak.lock().map(|p| p.clone()).unwrap_or_default();
    report.dispatcher_starts = dispatchers.started();
    report.unexpected_exits = dispatchers
        .unexpected
        .lock()
        .map(|u| u.clone())
        .unwrap_or_default();
    report.producer_outcomes = producer.outcomes.lock().map(|o| *o).unwrap_or_default();
    report.producer_abandoned = sqlx::query_scalar(
        "SELECT count(*) FROM producer_run WHERE stream = $1 AND outcome = 'abandoned'",
    )
    .bind(load::STREAM)
    .fetch_one(&stack.db.pool)
    .await?;
    report.wall = wall.elapsed();
    Ok(report)
}

/// The end of the run: waits for the producer, the dead letters and the due rows; checks the dead
/// letters and the held keys; discards the keyed dead letters (the operator releasing their keys);
/// waits for the last rows to arrive.
async fn drain(
    stack: &Stack,
    plan: &Plan,
    expected: &Shared,
    arrivals: &Arrivals,
    report: &mut Report,
) -> Result<()> {
    let pool = &stack.db.pool;
    let scale = (plan.rows as f64 / 20_000.0).max(1.0);
    let budget = Duration::from_secs_f64(180.0 + 60.0 * scale);
    let (newest, dead, held, ledger_len) = {
        let e = expected
            .lock()
            .map_err(|_| anyhow!("expectations lock poisoned"))?;
        (e.newest, e.dead.clone(), e.held.clone(), e.ledger.len())
    };

    // 1. The producer's watermark reaches the newest source row.
    let want = newest.map(|(micros, id)| (micros, id.to_string()));
    let found = wait_for(budget, || async {
        let w: Option<(i64, String)> = sqlx::query_as(
            "SELECT cursor_micros, cursor_key FROM producer_watermark WHERE stream = $1",
        )
        .bind(load::STREAM)
        .fetch_optional(pool)
        .await?;
        Ok((w == want, w))
    })
    .await?;
    report.watermark = (want, found);

    // 2. Every unpublishable row dead-lettered; every other due row published unless held.
    let settled = wait_for(budget, || async {
        let dead_now: i64 = sqlx::query_scalar("SELECT count(*) FROM pubsub_outbox_dead_letter")
            .fetch_one(pool)
            .await?;
        let free: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pubsub_outbox o WHERE o.published_at IS NULL
               AND NOT (o.ordering_key IS NOT NULL AND EXISTS (
                   SELECT 1 FROM pubsub_outbox_dead_letter d
                   WHERE d.topic = o.topic AND d.ordering_key = o.ordering_key))",
        )
        .fetch_one(pool)
        .await?;
        Ok((
            dead_now as usize == dead.len() && free == 0,
            (dead_now, free),
        ))
    })
    .await?;
    if settled.0 as usize != dead.len() || settled.1 != 0 {
        report.failures.push(format!(
            "not settled within {} s: {} dead letters (want {}), {} due rows not held by a key",
            budget.as_secs(),
            settled.0,
            dead.len(),
            settled.1
        ));
    }

    // 3. The dead-letter table holds exactly the unpublishable rows.
    let in_table: BTreeSet<String> =
        sqlx::query_scalar::<_, String>("SELECT dedupe_key FROM pubsub_outbox_dead_letter")
            .fetch_all(pool)
            .await?
            .into_iter()
            .collect();
    report.dead_expected = dead.len();
    report.dead_found = in_table.len();
    report.dead_missing = dead.difference(&in_table).cloned().collect();
    report.dead_unexpected = in_table.difference(&dead).cloned().collect();

    // 4. Each poison key holds exactly the rows enqueued after its dead letter, none delivered.
    let delivered: BTreeSet<String> = arrivals
        .lock()
        .map_err(|_| anyhow!("arrivals lock poisoned"))?
        .iter()
        .map(|r| r.dedupe.clone())
        .collect();
    // A dead letter holds back exactly the rows of its key after its place: a dispatcher's
    // (every earlier row of its key went out first) and a producer's (its outbox id is its place
    // in the page's order) alike.
    for (key, h) in &held {
        let waiting: Vec<String> = sqlx::query_scalar(
            "SELECT dedupe_key FROM pubsub_outbox
             WHERE ordering_key = $1 AND published_at IS NULL ORDER BY id",
        )
        .bind(key)
        .fetch_all(pool)
        .await?;
        let leaked = h.after.iter().filter(|d| delivered.contains(*d)).count();
        report.held_rows += h.after.len();
        if waiting != h.after || leaked > 0 {
            report.failures.push(format!(
                "key {key} behind dead letter {}: waiting {:?}, expected exactly the rows after it {:?}; {leaked} delivered past it",
                h.bad,
                &waiting[..waiting.len().min(12)],
                &h.after[..h.after.len().min(12)],
            ));
        }
    }
    report.held_keys = held.len();

    // 5. The operator releases the held keys: discard their dead letters.
    let keyed: Vec<i64> = sqlx::query_scalar(
        "SELECT id FROM pubsub_outbox_dead_letter WHERE ordering_key IS NOT NULL ORDER BY id",
    )
    .fetch_all(pool)
    .await?;
    for ids in keyed.chunks(200) {
        let ids: Vec<String> = ids.iter().map(i64::to_string).collect();
        let mut args = vec!["dead-letters", "discard"];
        args.extend(ids.iter().map(String::as_str));
        args.extend(["--reason", "chaos: release the held keys"]);
        stack.operator(&args).await?;
    }
    report.discarded = keyed.len();

    // 6. Everything out, everything arrived (or 15 s without a new arrival).
    let due = wait_for(budget, || async {
        let n: i64 =
            sqlx::query_scalar("SELECT count(*) FROM pubsub_outbox WHERE published_at IS NULL")
                .fetch_one(pool)
                .await?;
        Ok((n == 0, n))
    })
    .await?;
    report.due_at_end = due;
    // Counted incrementally: the arrivals lock is the subscribers' too, hold it briefly.
    let mut distinct: std::collections::HashSet<String> = std::collections::HashSet::new();
    let (mut seen, mut last_new) = (0usize, Instant::now());
    loop {
        {
            let a = arrivals
                .lock()
                .map_err(|_| anyhow!("arrivals lock poisoned"))?;
            if a.len() > seen {
                last_new = Instant::now();
            }
            distinct.extend(a[seen..].iter().map(|r| r.dedupe.clone()));
            seen = a.len();
        }
        if distinct.len() >= ledger_len || last_new.elapsed() > Duration::from_secs(15) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    Ok(())
}

/// Polls `probe` every 500 ms until it says done or `budget` passes; returns its last value.
/// Errors (the server restarting) count as not done yet.
async fn wait_for<T, F, Fut>(budget: Duration, mut probe: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(bool, T)>>,
{
    let deadline = Instant::now() + budget;
    loop {
        match probe().await {
            Ok((true, v)) => return Ok(v),
            Ok((false, v)) if Instant::now() > deadline => return Ok(v),
            Err(e) if Instant::now() > deadline => return Err(e),
            _ => {}
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Records the outbox's highest dead-tuple count (every 2 s).
async fn sample_health(stack: &Stack, peak: &Mutex<TableHealth>) -> Result<()> {
    loop {
        tokio::time::sleep(Duration::from_secs(2)).await;
        if let Ok(h) = table_health(&stack.db.pool).await
            && let Ok(mut p) = peak.lock()
            && h.dead_tuples >= p.dead_tuples
        {
            *p = h;
        }
    }
}
