//! `outbox-bench inbox`: the consumer side's cost: messages/s through `Inbox::process` into a
//! table (record the key, upsert an invoice, commit), and duplicates/s dropped, from PostgreSQL
//! alone (no Pub/Sub: the subscriber's own cost is the emulator's, not the inbox's).

use std::time::Instant;

use anyhow::{Result, bail};
use outbox_inbox::{Inbox, Outcome};
use sqlx::PgConnection;
use tokio::task::JoinSet;

use crate::join_sum;
use crate::report::summary;
use crate::scratch::Scratch;

#[derive(Debug, clap::Args)]
pub struct InboxArgs {
    /// Messages processed per run (each a new dedupe key), then all of them again as duplicates.
    #[arg(long, default_value_t = 20_000)]
    pub messages: usize,
    /// Concurrent consumers (one transaction each at a time, as the example's lanes).
    #[arg(long, default_value_t = 8)]
    pub workers: usize,
    /// Runs (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
}

pub async fn inbox_bench(db: &Scratch, args: &InboxArgs) -> Result<()> {
    // The database's own pool: default settings. The inbox commit must be durable
    // (synchronous_commit on): the ack follows it, so a commit lost in a crash loses the effect.
    let pool = db.db.pool.clone();
    outbox_inbox::migrate(&pool).await?;
    sqlx::raw_sql(
        "CREATE TABLE invoice (invoice_id text PRIMARY KEY, total numeric NOT NULL,
                               events_applied integer NOT NULL)",
    )
    .execute(&pool)
    .await?;
    let (mut fresh, mut dupes) = (Vec::new(), Vec::new());
    for run in 1..=args.runs {
        sqlx::raw_sql("TRUNCATE pubsub_inbox, invoice")
            .execute(&pool)
            .await?;
        sqlx::raw_sql("VACUUM ANALYZE pubsub_inbox, invoice")
            .execute(&pool)
            .await?;
        let inbox = Inbox::new(pool.clone());
        let processed = timed(&inbox, args).await?;
        let dropped = timed(&inbox, args).await?;
        let c = inbox.counters();
        if (c.processed, c.duplicates) != (args.messages as u64, args.messages as u64) {
            bail!("run {run}: expected every key processed once and dropped once, got {c:?}");
        }
        println!(
            "run {run}: {processed:.0} msgs/s processed, {dropped:.0} duplicates/s dropped ({} messages, {} workers)",
            args.messages, args.workers
        );
        fresh.push(processed);
        dupes.push(dropped);
    }
    let (p, d) = (summary(fresh.into_iter()), summary(dupes.into_iter()));
    println!("| path | median msgs/s | min | max |");
    println!("|---|---|---|---|");
    println!(
        "| new keys: key + invoice upsert + commit | {:.0} | {:.0} | {:.0} |",
        p.median, p.min, p.max
    );
    println!(
        "| duplicates dropped (handler not run) | {:.0} | {:.0} | {:.0} |",
        d.median, d.min, d.max
    );
    Ok(())
}

/// Processes `invoice-0..messages` over `workers` tasks; returns messages/s.
async fn timed(inbox: &Inbox, args: &InboxArgs) -> Result<f64> {
    let started = Instant::now();
    let mut workers = JoinSet::new();
    for w in 0..args.workers {
        let (inbox, n, step) = (inbox.clone(), args.messages, args.workers);
        workers.spawn(async move {
            let mut done = 0usize;
            for i in (w..n).step_by(step) {
                let key = format!("invoice-{i}");
                let outcome = inbox
                    .process("bench", &key, async |tx: &mut PgConnection| {
                        sqlx::query(
                            "INSERT INTO invoice (invoice_id, total, events_applied)
                             VALUES ($1, $2::numeric, 1)
                             ON CONFLICT (invoice_id) DO UPDATE
                             SET events_applied = invoice.events_applied + 1",
                        )
                        .bind(&key)
                        .bind(format!("{i}.25"))
                        .execute(&mut *tx)
                        .await?;
                        Ok::<_, sqlx::Error>(())
                    })
                    .await;
                if let Outcome::Failed(f) = outcome {
                    bail!("processing {key} failed: {f}");
                }
                done += 1;
            }
            Ok(done)
        });
    }
    let done = join_sum(workers).await?;
    if done != args.messages {
        bail!(
            "{done} of {} messages went through the inbox",
            args.messages
        );
    }
    Ok(args.messages as f64 / started.elapsed().as_secs_f64())
}
