//! `outbox-bench peer`: our DB-only drain side by side with a naive one-row-per-transaction loop
//! and Graphile Worker (npm), on the same PostgreSQL server, interleaved round by round.
//!
//! - ours: `claim::drain_lock` (the dispatcher's claim + delete in one transaction, locks held in
//!   between), `--workers` connections, per `--batch-sizes` entry;
//! - naive: the original PL/SQL design: per row, claim one row FOR UPDATE SKIP LOCKED, delete it,
//!   commit; `--workers` connections; `--naive-rows` rows (its cost is per row, so its rate scales);
//! - graphile: `node tests/bench/graphile/drain.js` in the same scratch database, in the
//!   `graphile_worker` schema its own migrations install (dropped before each round so every round
//!   starts from an empty job table, as ours starts from a truncated outbox).
//!
//! Ours and naive use the dispatcher's session settings (`synchronous_commit = off`), so the gap
//! between them is batching alone. Ratios are taken within each round, then summarised.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Instant;

use anyhow::{Context, Result, bail, ensure};
use sqlx::postgres::PgPool;
use tokio::task::JoinSet;

use crate::claim::drain_lock;
use crate::dispatch::Keys;
use crate::join_sum;
use crate::report::{load_average, summary};
use crate::scratch::Scratch;

const TOPIC: &str = "projects/outbox-bench/topics/peer";

#[derive(Debug, clap::Args)]
pub struct PeerArgs {
    /// Rounds; each runs every contender once (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Rows (jobs) per drain for ours and Graphile Worker.
    #[arg(long, default_value_t = 200_000)]
    pub rows: usize,
    /// Rows per drain for the naive one-row-per-transaction loop (slow; its rate is per row).
    #[arg(long, default_value_t = 20_000)]
    pub naive_rows: usize,
    /// Draining connections for ours and naive.
    #[arg(long, default_value_t = 4)]
    pub workers: usize,
    /// Claim batch sizes for ours, comma-separated (the dispatcher's default is 500).
    #[arg(long, value_delimiter = ',', default_value = "500")]
    pub batch_sizes: Vec<i64>,
    /// Payload bytes per row (a string of this length in each Graphile job's JSON payload).
    #[arg(long, default_value_t = 1024)]
    pub payload_bytes: usize,
    /// Leave Graphile Worker out (no Node.js needed).
    #[arg(long)]
    pub skip_graphile: bool,
    /// The Node project with drain.js and its installed node_modules.
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/bench/graphile"))]
    pub graphile_dir: PathBuf,
}

/// One drain of one contender.
#[derive(Debug, Clone, Copy)]
struct Drain {
    enqueue_rate: f64,
    drain_rate: f64,
}

pub async fn peer_bench(db: &Scratch, args: &PeerArgs) -> Result<()> {
    ensure!(
        args.rounds > 0 && args.rows > 0 && args.naive_rows > 0 && !args.batch_sizes.is_empty(),
        "--rounds, --rows, --naive-rows and --batch-sizes must be positive / non-empty"
    );
    if !args.skip_graphile {
        check_graphile_installed(args)?;
    }
    let load_start = load_average();
    let mut names: Vec<String> = args
        .batch_sizes
        .iter()
        .map(|b| format!("ours (lock, batch {b} × {})", args.workers))
        .collect();
    names.push(format!("naive (1 row per transaction × {})", args.workers));
    let mut graphile_version = None;
    if !args.skip_graphile {
        names.push("Graphile Worker".to_owned());
    }
    // results[contender][round]
    let mut results: Vec<Vec<Drain>> = vec![Vec::new(); names.len()];
    for round in 1..=args.rounds {
        let mut this_round = Vec::with_capacity(names.len());
        for &batch in &args.batch_sizes {
            this_round.push(ours(db, args, batch).await?);
        }
        this_round.push(naive(db, args).await?);
        if !args.skip_graphile {
            let (drain, version) = graphile(db, args).await?;
            graphile_version = Some(version);
            this_round.push(drain);
        }
        for (name, d) in names.iter().zip(&this_round) {
            println!(
                "peer round {round}/{}: {name}: enqueue {:.0} rows/s; drain {:.0} rows/s",
                args.rounds, d.enqueue_rate, d.drain_rate
            );
        }
        for (all, d) in results.iter_mut().zip(this_round) {
            all.push(d);
        }
    }
    if let Some(v) = &graphile_version
        && let Some(last) = names.last_mut()
    {
        *last = format!("Graphile Worker {v}");
    }
    print_tables(args, &names, &results);
    println!(
        "\nrows per drain: {} (naive {}), payload {} B; load average at start of the rounds: {load_start}; at end: {}",
        args.rows,
        args.naive_rows,
        args.payload_bytes,
        load_average()
    );
    Ok(())
}

fn print_tables(args: &PeerArgs, names: &[String], results: &[Vec<Drain>]) {
    println!("\n| contender | median rows/s | min | max | runs | enqueue rows/s (median) |");
    println!("|---|---|---|---|---|---|");
    for (name, runs) in names.iter().zip(results) {
        let s = summary(runs.iter().map(|d| d.drain_rate));
        println!(
            "| {name} | {:.0} | {:.0} | {:.0} | {} | {:.0} |",
            s.median,
            s.min,
            s.max,
            runs.len(),
            summary(runs.iter().map(|d| d.enqueue_rate)).median
        );
    }
    // Ratios within a round, so a change in machine load between rounds cancels out.
    let ours_count = args.batch_sizes.len();
    let naive = &results[ours_count];
    let graphile = (!args.skip_graphile).then(|| &results[ours_count + 1]);
    println!("\n| ratio (per round) | median | min | max |");
    println!("|---|---|---|---|");
    for (b, ours) in args.batch_sizes.iter().zip(results) {
        let per_round = |other: &[Drain]| {
            summary(
                ours.iter()
                    .zip(other)
                    .map(|(o, x)| o.drain_rate / x.drain_rate),
            )
        };
        if let Some(g) = graphile {
            let r = per_round(g);
            println!(
                "| ours (batch {b}) / graphile | {:.2} | {:.2} | {:.2} |",
                r.median, r.min, r.max
            );
        }
        let r = per_round(naive);
        println!(
            "| ours (batch {b}) / naive | {:.1} | {:.1} | {:.1} |",
            r.median, r.min, r.max
        );
    }
}

/// Ours: the dispatcher's lock protocol over a freshly filled outbox.
async fn ours(db: &Scratch, args: &PeerArgs, batch: i64) -> Result<Drain> {
    let enqueue_rate = db
        .refill(args.rows, args.payload_bytes, Keys(None), TOPIC)
        .await?;
    let started = Instant::now();
    let mut drains = JoinSet::new();
    for _ in 0..args.workers {
        let pool = db.pool.clone();
        drains.spawn(async move { drain_lock(&pool, batch).await });
    }
    let drained: u64 = join_sum(drains).await?;
    let drain_rate = args.rows as f64 / started.elapsed().as_secs_f64();
    check_drained(db, "ours", drained, args.rows).await?;
    Ok(Drain {
        enqueue_rate,
        drain_rate,
    })
}

/// Naive: the original PL/SQL design's loop, one row per transaction.
async fn naive(db: &Scratch, args: &PeerArgs) -> Result<Drain> {
    let enqueue_rate = db
        .refill(args.naive_rows, args.payload_bytes, Keys(None), TOPIC)
        .await?;
    let started = Instant::now();
    let mut drains = JoinSet::new();
    for _ in 0..args.workers {
        let pool = db.pool.clone();
        drains.spawn(async move { drain_one_by_one(&pool).await });
    }
    let drained: u64 = join_sum(drains).await?;
    let drain_rate = args.naive_rows as f64 / started.elapsed().as_secs_f64();
    check_drained(db, "naive", drained, args.naive_rows).await?;
    Ok(Drain {
        enqueue_rate,
        drain_rate,
    })
}

/// Per row: BEGIN; claim one due row (skipping rows other loops hold); delete it; COMMIT.
async fn drain_one_by_one(pool: &PgPool) -> Result<u64> {
    let mut conn = pool.acquire().await?;
    let mut deleted = 0;
    loop {
        let mut tx = sqlx::Connection::begin(&mut *conn).await?;
        // SKIP LOCKED: a row another loop holds is not waited for, the next one is taken.
        let id: Option<i64> = sqlx::query_scalar(
            "SELECT id FROM pubsub_outbox
             WHERE published_at IS NULL AND ordering_key IS NULL AND next_attempt_at <= now()
             ORDER BY next_attempt_at, id
             LIMIT 1
             FOR UPDATE SKIP LOCKED",
        )
        .fetch_optional(&mut *tx)
        .await
        .context("claiming one row")?;
        let Some(id) = id else {
            tx.rollback().await?;
            return Ok(deleted);
        };
        deleted += sqlx::query("DELETE FROM pubsub_outbox WHERE id = $1")
            .bind(id)
            .execute(&mut *tx)
            .await
            .context("deleting one row")?
            .rows_affected();
        tx.commit().await.context("committing one row")?;
    }
}

async fn check_drained(db: &Scratch, who: &str, drained: u64, rows: usize) -> Result<()> {
    let left = db.remaining().await?;
    if left != 0 || drained != rows as u64 {
        bail!("the {who} drain deleted {drained} of {rows} rows ({left} left)");
    }
    Ok(())
}

fn check_graphile_installed(args: &PeerArgs) -> Result<()> {
    let module = args.graphile_dir.join("node_modules/graphile-worker");
    if !module.is_dir() {
        bail!(
            "{} is missing: run `npm ci --prefix tests/bench/graphile` (from the repository root), \
             or pass --skip-graphile",
            module.display()
        );
    }
    Ok(())
}

/// Graphile Worker: a fresh `graphile_worker` schema, then drain.js enqueues and drains.
async fn graphile(db: &Scratch, args: &PeerArgs) -> Result<(Drain, String)> {
    // Empty like the outbox: no rows of ours compete with its jobs for the server.
    sqlx::raw_sql(
        "SET LOCAL client_min_messages = warning; \
         TRUNCATE pubsub_outbox; DROP SCHEMA IF EXISTS graphile_worker CASCADE",
    )
    .execute(&db.db.pool)
    .await
    .context("resetting the graphile_worker schema")?;
    let script = args.graphile_dir.join("drain.js");
    let output = tokio::process::Command::new("node")
        .arg(&script)
        .arg(db.db.url())
        .arg(args.rows.to_string())
        .arg(args.payload_bytes.to_string())
        .current_dir(&args.graphile_dir)
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .output()
        .await
        .with_context(|| {
            format!(
                "running `node {}` (is Node.js installed?)",
                script.display()
            )
        })?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        bail!(
            "`node {}` failed ({}); stdout: {stdout}",
            script.display(),
            output.status
        );
    }
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('{'))
        .with_context(|| format!("drain.js printed no JSON line: {stdout:?}"))?;
    let parsed: serde_json::Value =
        serde_json::from_str(line).with_context(|| format!("parsing drain.js's line {line:?}"))?;
    let number = |field: &str| {
        parsed[field]
            .as_f64()
            .with_context(|| format!("drain.js's line {line:?} has no number {field:?}"))
    };
    let jobs = number("jobs")?;
    ensure!(
        jobs == args.rows as f64,
        "drain.js ran {jobs} jobs, asked for {}",
        args.rows
    );
    let version = parsed["version"].as_str().unwrap_or("?").to_owned();
    Ok((
        Drain {
            enqueue_rate: number("enqueue_per_s")?,
            drain_rate: number("drain_per_s")?,
        },
        version,
    ))
}
