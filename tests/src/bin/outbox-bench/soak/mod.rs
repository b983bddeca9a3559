//! `soak`: steady load for a long time, with a `REPEATABLE READ` snapshot held in the middle, and
//! the figures a queue table's slow failures show in, sampled every 10 s.
//!
//! The load: application writers enqueueing `--rate` messages/s in transactions of 1-20 rows
//! (half of the rows over `--keys` ordering keys, 1 KiB payloads, one NOTIFY per transaction),
//! rows appended to a BigQuery table (bqemulator) every second and a `producer run` every
//! `--producer-every`, two `dispatcher` processes (the real binary) publishing to the emulator,
//! and an independent reader draining the ordered subscription. Phases: warm-up, steady, the
//! held snapshot, after. Each sample: enqueued/published/arrived per second, commit -> publish
//! p50/p99 (the writer's clock after COMMIT returned against Pub/Sub's publish time), the
//! dispatchers' claim time (their `outbox_claim_duration_seconds`), the outbox's heap and index
//! size, live and dead tuples, (auto)vacuum and analyze counts, the dispatchers' memory, and what
//! `dispatcher status` warns about. At the end: the delivery ledger's verdict (nothing lost,
//! order kept), the targets of issue #26 judged from the samples, and in `--out`: `samples.csv`
//! and `soak.svg` (the series over time).
//!
//! Modules: `load` (writers, the BigQuery feed, the producer schedule, the reader), `sample`
//! (one sample every 10 s, the CSV), `report` (the targets judged), `plot` (the SVG).
//!
//! `--table-settings stock` resets the outbox's per-table storage settings (the migration's) to
//! the server's defaults first: the before of a before/after, same binary, same load.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, Result, anyhow, bail};
use gcp_bigquery_client::model::field_type::FieldType;
use gcp_bigquery_client::model::table_field_schema::TableFieldSchema;
use harness::bigquery::TestTable;
use harness::ledger::{Arrival, DeliveryLedger};
use harness::process::Process;
use sqlx::{Connection, PgPool};
use tokio::task::JoinSet;

use crate::binary::DispatcherProcess;
use crate::pipeline::Common;
use crate::report::load_average;
use crate::scratch::Scratch;

mod load;
mod plot;
mod report;
mod sample;

use load::{ProducerSchedule, feed_bigquery, read_subscription, streams_toml, write};
use sample::{Counters, print_sample, sample, write_csv};

#[derive(Debug, Clone, clap::Args)]
pub struct SoakArgs {
    #[command(flatten)]
    pub common: Common,
    /// The CI mode: 170 s of load (20 s warm-up, the snapshot held from 70 s to 130 s).
    #[arg(long)]
    pub short: bool,
    /// Minutes of load (default 60; 170 s with --short).
    #[arg(long)]
    pub minutes: Option<f64>,
    /// When the snapshot is taken, in minutes from the start (default 20; 70 s with --short).
    #[arg(long)]
    pub snapshot_at: Option<f64>,
    /// Minutes the snapshot is held (default 10; 1 with --short).
    #[arg(long)]
    pub snapshot_minutes: Option<f64>,
    /// Minutes of warm-up, not judged (default 5; 20 s with --short).
    #[arg(long)]
    pub warmup_minutes: Option<f64>,
    /// Application messages per second, all writers together.
    #[arg(long, default_value_t = 1000)]
    pub rate: u32,
    /// Writer connections sharing the rate (each owns its share of the keys).
    #[arg(long, default_value_t = 8)]
    pub writers: usize,
    /// Ordering keys of the keyed half.
    #[arg(long, default_value_t = 500)]
    pub keys: usize,
    /// Dispatcher processes (4 workers each).
    #[arg(long, default_value_t = 2)]
    pub replicas: usize,
    /// Rows appended to the BigQuery table per second (the producer's stream).
    #[arg(long, default_value_t = 20)]
    pub bigquery_rate: usize,
    /// Seconds between producer runs (one at a time).
    #[arg(long, default_value_t = 15)]
    pub producer_every: u64,
    /// Seconds per sample.
    #[arg(long, default_value_t = 10)]
    pub sample_seconds: u64,
    /// The outbox's per-table storage settings: as the migrations leave them, or reset to the
    /// server's defaults (`stock`).
    #[arg(long, value_enum, default_value_t = TableSettings::Migration)]
    pub table_settings: TableSettings,
    /// Output folder for samples.csv and soak.svg (default: a fresh one under the temp dir).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Only redraw: read this run's samples.csv and write soak.svg beside it (the phases from
    /// the flags above), then exit. No load runs.
    #[arg(long)]
    pub replot: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum TableSettings {
    Migration,
    Stock,
}

/// When each phase starts, from the start of the load.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Phases {
    pub(crate) warmup_end: Duration,
    pub(crate) snapshot_start: Duration,
    pub(crate) snapshot_end: Duration,
    pub(crate) end: Duration,
}

impl Phases {
    fn of(args: &SoakArgs) -> Result<Self> {
        let m = |v: f64| Duration::from_secs_f64(v * 60.0);
        let (end, at, held, warm) = if args.short {
            (170.0 / 60.0, 70.0 / 60.0, 1.0, 20.0 / 60.0)
        } else {
            (60.0, 20.0, 10.0, 5.0)
        };
        let p = Self {
            warmup_end: m(args.warmup_minutes.unwrap_or(warm)),
            snapshot_start: m(args.snapshot_at.unwrap_or(at)),
            snapshot_end: m(args.snapshot_at.unwrap_or(at) + args.snapshot_minutes.unwrap_or(held)),
            end: m(args.minutes.unwrap_or(end)),
        };
        if !(p.warmup_end <= p.snapshot_start
            && p.snapshot_start < p.snapshot_end
            && p.snapshot_end < p.end)
        {
            bail!(
                "the phases must follow one another: warm-up ends {:?}, snapshot {:?}..{:?}, load ends {:?}",
                p.warmup_end,
                p.snapshot_start,
                p.snapshot_end,
                p.end
            );
        }
        Ok(p)
    }

    pub(crate) fn name(&self, t: Duration) -> &'static str {
        if t <= self.warmup_end {
            "warmup"
        } else if t <= self.snapshot_start {
            "steady"
        } else if t <= self.snapshot_end {
            "snapshot"
        } else {
            "after"
        }
    }
}

/// What the load tasks and the reader share.
#[derive(Default)]
pub(crate) struct Shared {
    pub(crate) ledger: Mutex<DeliveryLedger>,
    /// Dedupe key -> when its commit returned, until it arrives.
    pub(crate) pending: Mutex<HashMap<String, SystemTime>>,
    /// Commit -> publish of the arrivals since the last sample, ms.
    pub(crate) latencies: Mutex<Vec<f64>>,
    pub(crate) arrivals: Mutex<Vec<Arrival>>,
    pub(crate) enqueued: AtomicU64,
    pub(crate) arrived: AtomicU64,
}

pub(crate) fn locked<T>(m: &Mutex<T>) -> Result<std::sync::MutexGuard<'_, T>> {
    m.lock().map_err(|_| anyhow!("a soak lock is poisoned"))
}

pub async fn soak_bench(db: &Scratch, args: &SoakArgs) -> Result<()> {
    let phases = Phases::of(args)?;
    if let Some(csv) = &args.replot {
        let samples = sample::read_csv(csv)?;
        let svg = csv.with_file_name("soak.svg");
        std::fs::write(&svg, plot::plot(&samples, phases))
            .with_context(|| format!("writing {}", svg.display()))?;
        println!("{} samples redrawn: {}", samples.len(), svg.display());
        return Ok(());
    }
    let contender = args
        .common
        .dispatcher_bin
        .first()
        .cloned()
        .map_or_else(crate::binary::default_contender, Ok)?;
    let producer_bin = contender
        .path
        .parent()
        .map(|d| d.join("producer"))
        .filter(|p| p.is_file())
        .ok_or_else(|| {
            anyhow!(
                "no producer beside {}: build it in the same profile (cargo build -p pubsub-outbox-producer)",
                contender.path.display()
            )
        })?;
    let out = match &args.out {
        Some(d) => d.clone(),
        None => std::env::temp_dir().join(format!("outbox-soak-{}", std::process::id())),
    };
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let pool = db.db.pool.clone();
    if args.table_settings == TableSettings::Stock {
        reset_table_settings(&pool).await?;
    }
    let settings: Option<Vec<String>> =
        sqlx::query_scalar("SELECT reloptions FROM pg_class WHERE oid = 'pubsub_outbox'::regclass")
            .fetch_one(&pool)
            .await?;
    println!(
        "soak: {} msgs/s over {} writers ({} keys for half), {} dispatcher(s), BigQuery {} rows/s, producer every {} s; phases: warm-up to {:?}, snapshot {:?}..{:?}, end {:?}; outbox settings {:?}; output in {}",
        args.rate,
        args.writers,
        args.keys,
        args.replicas,
        args.bigquery_rate,
        args.producer_every,
        phases.warmup_end,
        phases.snapshot_start,
        phases.snapshot_end,
        phases.end,
        settings.unwrap_or_default(),
        out.display()
    );

    let topic = harness::pubsub::TestTopic::new(true).await;
    // One handle, shared: a TestTable deletes its dataset when dropped.
    let table = Arc::new(
        TestTable::create(vec![
            TableFieldSchema::integer("id"),
            TableFieldSchema::new("updated_at", FieldType::Timestamp),
            TableFieldSchema::string("customer"),
            TableFieldSchema::integer("amount"),
        ])
        .await,
    );
    let config = out.join("streams.toml");
    std::fs::write(&config, streams_toml(&table, &topic.topic))?;

    let shared = Arc::new(Shared::default());
    let reader = read_subscription(topic.subscription.clone(), shared.clone());
    let mut dispatchers = Vec::new();
    let mut labels = Vec::new();
    let bins = if args.common.dispatcher_bin.is_empty() {
        vec![contender.clone()]
    } else {
        args.common.dispatcher_bin.clone()
    };
    let mut env = vec![
        ("OUTBOX_WORKERS", "4".to_owned()),
        ("OUTBOX_SLOW_BATCH", "200ms".to_owned()),
    ];
    env.extend(
        args.common
            .dispatcher_env
            .iter()
            .map(|(k, v)| (k.as_str(), v.clone())),
    );
    for r in 0..args.replicas {
        // Replica r runs the (r mod n)-th --dispatcher-bin: an A/B of two builds in one run.
        let bin = &bins[r % bins.len()];
        labels.push(format!("{}#{}", bin.label, r + 1));
        dispatchers.push(
            DispatcherProcess::start(
                &bin.path,
                db.db.url(),
                &args.common.pubsub_emulator_host,
                &env,
            )
            .await?,
        );
    }
    println!("  dispatchers: {}", labels.join(", "));
    let producer = ProducerSchedule {
        bin: producer_bin,
        config,
        database_url: db.db.url().to_owned(),
        emulator: args.common.pubsub_emulator_host.clone(),
        log: out.join("producer.log"),
    };

    let t0 = Instant::now();
    let mut load = JoinSet::new();
    for w in 0..args.writers {
        load.spawn(write(
            pool.clone(),
            topic.topic.clone(),
            w,
            args.clone(),
            vec![7u8; args.common.payload_bytes],
            t0 + phases.end,
            shared.clone(),
        ));
    }
    load.spawn(feed_bigquery(
        table.clone(),
        args.bigquery_rate,
        t0 + phases.end,
        shared.clone(),
    ));
    let snapshot = tokio::spawn(hold_snapshot(
        db.db.options(),
        t0 + phases.snapshot_start,
        t0 + phases.snapshot_end,
    ));

    let mut samples = Vec::new();
    let mut producer_runs = (0usize, 0usize);
    let mut running: Option<Process> = None;
    let mut last_producer = t0;
    let mut before = Counters::read(&dispatchers).await?;
    let mut tick = tokio::time::interval_at(
        (t0 + Duration::from_secs(args.sample_seconds)).into(),
        Duration::from_secs(args.sample_seconds),
    );
    let mut pulse = tokio::time::interval(Duration::from_secs(1));
    let status_bin = contender.path.clone();
    while t0.elapsed() < phases.end {
        tokio::select! {
            _ = tick.tick() => {
                let s = sample(&pool, &dispatchers, &shared, &mut before, &status_bin, db.db.url(), phases, t0, args).await?;
                print_sample(&s);
                samples.push(s);
            }
            _ = pulse.tick() => {
                for d in &mut dispatchers {
                    if !d.running() {
                        bail!("a dispatcher exited during the soak; log:\n{}", d.log());
                    }
                }
                if last_producer.elapsed() >= Duration::from_secs(args.producer_every) {
                    producer.reap_and_start(&mut running, &mut producer_runs)?;
                    last_producer = Instant::now();
                }
            }
            Some(done) = load.join_next() => {
                done.context("a load task panicked")??;
            }
        }
    }
    while let Some(done) = load.join_next().await {
        done.context("a load task panicked")??;
    }
    snapshot.await.context("the snapshot task panicked")??;
    println!(
        "  [{:>6.0}s] load done; catching up (a last producer run, then every row published and arrived)",
        t0.elapsed().as_secs_f64()
    );
    if let Some(mut p) = running.take() {
        let ok = p.child.wait().await.map(|s| s.success()).unwrap_or(false);
        if ok {
            producer_runs.0 += 1
        } else {
            producer_runs.1 += 1
        }
    }
    let last = producer.run_to_end().await?;
    if last {
        producer_runs.0 += 1;
    } else {
        bail!(
            "the last producer run failed: see {}",
            producer.log.display()
        );
    }
    let expected = locked(&shared.ledger)?.len();
    let settle = Instant::now();
    let mut quiet = (shared.arrived.load(Ordering::Relaxed), Instant::now());
    loop {
        let backlog: i64 =
            sqlx::query_scalar("SELECT count(*) FROM pubsub_outbox WHERE published_at IS NULL")
                .fetch_one(&pool)
                .await?;
        let arrived = shared.arrived.load(Ordering::Relaxed);
        if arrived != quiet.0 {
            quiet = (arrived, Instant::now());
        }
        if backlog == 0 && arrived as usize >= expected {
            break;
        }
        if quiet.1.elapsed() > Duration::from_secs(30)
            || settle.elapsed() > Duration::from_secs(300)
        {
            println!(
                "  nothing more arrived ({backlog} rows unpublished, {arrived} of {expected} arrived)"
            );
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    reader.abort();
    for (d, label) in dispatchers.into_iter().zip(&labels) {
        // Its warnings (the slow batches among them) stay beside the samples.
        let log = out.join(format!("dispatcher-{}.log", label.replace('#', "-")));
        std::fs::write(&log, d.log()).with_context(|| format!("writing {}", log.display()))?;
        d.stop().await?;
    }

    let verdict = {
        let ledger = locked(&shared.ledger)?;
        let arrivals = locked(&shared.arrivals)?;
        ledger.verdict(arrivals.iter())
    };
    write_csv(&out.join("samples.csv"), &samples)?;
    std::fs::write(out.join("soak.svg"), plot::plot(&samples, phases))?;
    println!(
        "\nsoak done: {} messages enqueued ({} application, {} from BigQuery through {} producer runs, {} failed); {} arrivals, {} duplicates, {} lost, {} invented, {} order violations; load average {}",
        expected,
        shared.enqueued.load(Ordering::Relaxed),
        expected.saturating_sub(shared.enqueued.load(Ordering::Relaxed) as usize),
        producer_runs.0,
        producer_runs.1,
        verdict.arrivals,
        verdict.duplicates,
        verdict.lost.len(),
        verdict.invented.len(),
        verdict.order_violations.len(),
        load_average()
    );
    report::judge(&samples, phases, args, &labels);
    println!(
        "samples: {}; plot: {}",
        out.join("samples.csv").display(),
        out.join("soak.svg").display()
    );
    if !verdict.is_clean() {
        bail!(
            "the delivery verdict failed: {} lost (first {:?}), {} invented, {} order violations (first {:?})",
            verdict.lost.len(),
            verdict.lost.iter().take(5).collect::<Vec<_>>(),
            verdict.invented.len(),
            verdict.order_violations.len(),
            verdict.order_violations.iter().take(3).collect::<Vec<_>>()
        );
    }
    if samples.is_empty() {
        bail!("no sample was taken");
    }
    Ok(())
}

/// `ALTER TABLE pubsub_outbox RESET (...)` for every per-table setting the migrations made.
async fn reset_table_settings(pool: &PgPool) -> Result<()> {
    let names: Vec<String> = sqlx::query_scalar(
        "SELECT option_name FROM pg_options_to_table(
             (SELECT reloptions FROM pg_class WHERE oid = 'pubsub_outbox'::regclass))",
    )
    .fetch_all(pool)
    .await?;
    if !names.is_empty() {
        sqlx::raw_sql(&format!(
            "ALTER TABLE pubsub_outbox RESET ({})",
            names.join(", ")
        ))
        .execute(pool)
        .await
        .context("resetting the outbox's storage settings")?;
    }
    Ok(())
}

/// Takes a `REPEATABLE READ` snapshot at `from` and holds it until `to` (as a report or a backup
/// would), on a session of its own named so `status` can tell.
async fn hold_snapshot(
    options: sqlx::postgres::PgConnectOptions,
    from: Instant,
    to: Instant,
) -> Result<()> {
    tokio::time::sleep_until(from.into()).await;
    let mut conn =
        sqlx::PgConnection::connect_with(&options.application_name("outbox-soak held snapshot"))
            .await
            .context("connecting the snapshot session")?;
    let mut tx = conn
        .begin_with("BEGIN ISOLATION LEVEL REPEATABLE READ")
        .await
        .context("beginning the snapshot transaction")?;
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM pubsub_outbox")
        .fetch_one(&mut *tx)
        .await
        .context("taking the snapshot")?;
    println!(
        "  snapshot taken (REPEATABLE READ, {rows} rows seen, held for {:?})",
        to - from
    );
    tokio::time::sleep_until(to.into()).await;
    tx.commit().await.context("releasing the snapshot")?;
    println!("  snapshot released");
    Ok(())
}
