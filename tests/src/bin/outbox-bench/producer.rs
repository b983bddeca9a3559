//! `outbox-bench producer`: the real `producer` binary against a BigQuery stand-in
//! ([`harness::bigquery_standin`]: real wire shapes, a delay per call, a transfer rate), measured
//! in the same rounds as its two bounds:
//! - **fetch alone**: the same binary's `run --dry-run` (reads and maps every page, writes
//!   nothing; one extra call for BigQuery's byte estimate);
//! - **enqueue alone**: the rows the producer's first run enqueued (read back: the same payloads,
//!   dedupe and ordering keys), through `enqueue_batch` on one connection, `--enqueue-rows` per
//!   transaction.
//!
//! Every producer run must leave each row in the outbox exactly once and the watermark at the last
//! row; the figures are rows/s, the producer's ratio to min(fetch, enqueue), and its peak RSS.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use harness::bigquery_standin::{StandIn, Table, Wire};
use harness::process::Spawn;
use outbox_producer::settings::DEFAULT_PAGE_BYTES;
use outbox_shared::{NewMessage, enqueue_batch};

use crate::binary;
use crate::report::{parse_duration, summary};
use crate::scratch::Scratch;

/// A producer binary to measure: `after=target/release/producer`.
#[derive(Debug, Clone)]
pub struct ProducerBin {
    label: String,
    path: PathBuf,
}

impl std::str::FromStr for ProducerBin {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (label, path) = s.split_once('=').unwrap_or(("producer", s));
        let path = PathBuf::from(path);
        if !path.is_file() {
            return Err(format!(
                "{} is not a file: build it first (cargo build --release -p pubsub-outbox-producer)",
                path.display()
            ));
        }
        Ok(Self {
            label: label.to_owned(),
            path,
        })
    }
}

#[derive(Debug, clap::Args)]
pub struct ProducerArgs {
    /// Rows in the BigQuery table (one run reads them all).
    #[arg(long, default_value_t = 200_000)]
    rows: usize,
    /// Delay added to every BigQuery call, comma-separated: one table per value.
    #[arg(long, value_delimiter = ',', default_value = "0ms,150ms", value_parser = parse_duration)]
    latency: Vec<Duration>,
    /// Transfer rate of BigQuery's answers, bytes per second (0: loopback speed).
    #[arg(long, default_value_t = 50 << 20)]
    bytes_per_second: u64,
    /// Interleaved rounds (every contender and bound once per round).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Distinct ordering keys (customer ids).
    #[arg(long, default_value_t = 10_000)]
    customers: usize,
    /// Bytes of the JSON document column per row.
    #[arg(long, default_value_t = 500)]
    body_bytes: usize,
    /// Producer binaries, `label=path` (repeat; default: the producer beside this bench).
    #[arg(long = "producer-bin")]
    producers: Vec<ProducerBin>,
    /// Rows per transaction of the enqueue-alone bound (default: what a page of the producer's
    /// default `--page-bytes` holds).
    #[arg(long)]
    enqueue_rows: Option<usize>,
}

/// One leg's measurement.
#[derive(Debug, Clone, Copy)]
struct Leg {
    rows_per_second: f64,
    peak_rss_mib: f64,
    calls: u64,
    /// CPU per row, µs: the producer, PostgreSQL, the stand-in (this process).
    cpu_us: [f64; 3],
    /// Wall time of the whole process, ms.
    wall_ms: f64,
    /// The producer's own account (its summary line): the stream's run, and of it the time the
    /// commits waited for BigQuery's pages, ms (None from a producer that does not report it).
    run_ms: Option<f64>,
    waited_ms: Option<f64>,
}

pub async fn producer_bench(db: &Scratch, args: &ProducerArgs) -> Result<()> {
    let producers = if args.producers.is_empty() {
        vec![beside_the_bench()?]
    } else {
        args.producers.clone()
    };
    let table = Arc::new(Table::generate(args.rows, args.customers, args.body_bytes));
    let row_bytes = table.row_bytes();
    let enqueue_rows = args
        .enqueue_rows
        .unwrap_or((DEFAULT_PAGE_BYTES / row_bytes.max(1)).clamp(1, 50_000));
    // The same rows as the producer enqueued them (read back after its first run).
    let mut messages: Vec<NewMessage> = Vec::new();
    let config =
        std::env::temp_dir().join(format!("outbox-bench-streams-{}.toml", std::process::id()));
    std::fs::write(&config, STREAMS).context("writing the bench's streams file")?;
    println!(
        "producer bench: {} rows of {row_bytes} bytes on the wire ({} customers), {} rounds, answers at {} MiB/s; enqueue alone: {enqueue_rows} rows per transaction",
        args.rows,
        args.customers,
        args.rounds,
        args.bytes_per_second >> 20
    );
    for &delay in &args.latency {
        let wire = Wire {
            delay,
            bytes_per_second: Some(args.bytes_per_second).filter(|r| *r > 0),
        };
        let standin = StandIn::start(Arc::clone(&table), wire)
            .await
            .context("starting the BigQuery stand-in")?;
        let mut runs: Vec<(String, Leg, Leg)> = Vec::new();
        let mut enqueues = Vec::new();
        for round in 1..=args.rounds {
            for p in &producers {
                let run = producer_leg(db, &standin, &p.path, &config, &table, false).await?;
                if messages.is_empty() {
                    messages = written(db).await?;
                }
                let fetch = producer_leg(db, &standin, &p.path, &config, &table, true).await?;
                println!(
                    "  {delay:?} round {round} {}: producer {:.0} rows/s ({} calls, {:.0} MiB peak, CPU per row {:.1} / {:.1} / {:.1} µs producer / PostgreSQL / stand-in; {}), fetch alone {:.0} rows/s ({:.1} µs producer CPU per row)",
                    p.label,
                    run.rows_per_second,
                    run.calls,
                    run.peak_rss_mib,
                    run.cpu_us[0],
                    run.cpu_us[1],
                    run.cpu_us[2],
                    time_split(&run),
                    fetch.rows_per_second,
                    fetch.cpu_us[0]
                );
                runs.push((p.label.clone(), run, fetch));
            }
            let (rate, pg) = enqueue_leg(db, &messages, enqueue_rows).await?;
            println!(
                "  {delay:?} round {round}: enqueue alone {rate:.0} rows/s ({pg:.1} µs PostgreSQL CPU per row)"
            );
            enqueues.push(rate);
        }
        print_table(args.rows, delay, &producers, &runs, &enqueues);
    }
    let _ = std::fs::remove_file(&config);
    Ok(())
}

/// Where a run's wall time went: before the stream's run (process start, connecting, the lock),
/// the commits waiting for BigQuery, and the rest (writing).
fn time_split(leg: &Leg) -> String {
    match (leg.run_ms, leg.waited_ms) {
        (Some(run), Some(waited)) => format!(
            "{:.0} ms: {:.0} before the run, {:.0} waiting for BigQuery, {:.0} writing",
            leg.wall_ms,
            leg.wall_ms - run,
            waited,
            run - waited
        ),
        (Some(run), None) => format!(
            "{:.0} ms: {:.0} before the run",
            leg.wall_ms,
            leg.wall_ms - run
        ),
        _ => format!("{:.0} ms", leg.wall_ms),
    }
}

fn print_table(
    rows: usize,
    delay: Duration,
    producers: &[ProducerBin],
    runs: &[(String, Leg, Leg)],
    enqueues: &[f64],
) {
    let enqueue = summary(enqueues.iter().copied());
    println!();
    println!(
        "BigQuery latency per call: {delay:?}; enqueue alone {:.1} k rows/s ({:.1}-{:.1})",
        enqueue.median / 1e3,
        enqueue.min / 1e3,
        enqueue.max / 1e3
    );
    println!(
        "| producer | rows/s (median, min-max) | fetch alone rows/s | producer / min(fetch, enqueue) | calls per run | peak RSS | CPU per row: producer / PostgreSQL µs | wall ms: before the run / waiting for BigQuery / writing (writing / enqueue alone) |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for p in producers {
        let mine: Vec<&(String, Leg, Leg)> = runs.iter().filter(|r| r.0 == p.label).collect();
        let run = summary(mine.iter().map(|r| r.1.rows_per_second));
        let fetch = summary(mine.iter().map(|r| r.2.rows_per_second));
        // Per round: the producer against the lesser bound of the same round.
        let ratios = summary(
            mine.iter()
                .zip(enqueues)
                .map(|(r, e)| r.1.rows_per_second / r.2.rows_per_second.min(*e)),
        );
        let rss = mine.iter().map(|r| r.1.peak_rss_mib).fold(0.0, f64::max);
        let calls = mine.first().map_or(0, |r| r.1.calls);
        let own = summary(mine.iter().map(|r| r.1.cpu_us[0])).median;
        let pg = summary(mine.iter().map(|r| r.1.cpu_us[1])).median;
        let median = |f: &dyn Fn(&Leg) -> Option<f64>| {
            let v: Vec<f64> = mine.iter().filter_map(|r| f(&r.1)).collect();
            (!v.is_empty()).then(|| summary(v.into_iter()).median)
        };
        let split = match (
            median(&|l| l.run_ms.map(|r| l.wall_ms - r)),
            median(&|l| l.waited_ms),
            median(&|l| l.run_ms.zip(l.waited_ms).map(|(r, w)| r - w)),
        ) {
            (Some(before), Some(waited), Some(writing)) => {
                let alone = rows as f64 / enqueue.median * 1e3;
                format!(
                    "{before:.0} / {waited:.0} / {writing:.0} ({:.2})",
                    writing / alone
                )
            }
            (Some(before), _, _) => format!("{before:.0} / - / -"),
            _ => "-".to_owned(),
        };
        println!(
            "| {} | {:.1} k ({:.1}-{:.1}) | {:.1} k | **{:.2}** ({:.2}-{:.2}) | {calls} | {rss:.0} MiB | {own:.1} / {pg:.1} | {split} |",
            p.label,
            run.median / 1e3,
            run.min / 1e3,
            run.max / 1e3,
            fetch.median / 1e3,
            ratios.median,
            ratios.min,
            ratios.max
        );
    }
    println!();
}

/// The streams file the producer runs: the stand-in's table, keyed by customer.
const STREAMS: &str = r#"
[[stream]]
name = "bench"
query = "SELECT id, ts_micros, updated_at, customer_id, amount, body FROM bench.orders WHERE (ts_micros, id) > (@watermark_ts, @watermark_key) ORDER BY ts_micros, id"
dedupe_key = ["id"]
topic = "projects/bench-project/topics/orders"
ordering_key_column = "customer_id"

[stream.cursor]
timestamp_column = "ts_micros"
key_column = "id"
key_type = "INT64"

[stream.payload]
columns = ["id", "updated_at", "customer_id", "amount", "body"]
"#;

fn beside_the_bench() -> Result<ProducerBin> {
    let exe = std::env::current_exe().context("locating outbox-bench")?;
    let path = exe
        .parent()
        .map(|d| d.join("producer"))
        .context("outbox-bench has no parent directory")?;
    if !path.is_file() {
        bail!(
            "{} is missing: build the producer in the bench's profile, or pass --producer-bin",
            path.display()
        );
    }
    Ok(ProducerBin {
        label: "producer".into(),
        path,
    })
}

/// Empties the outbox and the producer's tables (a fresh stream each leg).
async fn reset(db: &Scratch) -> Result<()> {
    for sql in [
        "TRUNCATE pubsub_outbox, pubsub_outbox_dead_letter, producer_watermark, producer_run,
                  producer_lookback_key",
        "VACUUM ANALYZE pubsub_outbox",
    ] {
        sqlx::raw_sql(sql)
            .execute(&db.db.pool)
            .await
            .context("emptying the outbox and the producer's tables")?;
    }
    Ok(())
}

/// One `producer run` (or `run --dry-run`) over the whole table: rows/s, peak RSS, calls.
async fn producer_leg(
    db: &Scratch,
    standin: &StandIn,
    binary: &Path,
    config: &Path,
    table: &Table,
    dry_run: bool,
) -> Result<Leg> {
    reset(db).await?;
    let calls_before = standin.calls();
    let mut spawn = Spawn::program(binary)
        .args(["run", "--config"])
        .arg(config)
        .env_clear()
        .env("DATABASE_URL", db.db.url())
        .env("BIGQUERY_PROJECT_ID", "bench-project")
        .env("BIGQUERY_EMULATOR_HOST", standin.url())
        .env("OUTBOX_LOG", "warn,outbox_producer::report=info")
        .env("OUTBOX_LOG_FORMAT", "json");
    if dry_run {
        spawn = spawn.args(["--dry-run", "--dry-run-sample", "1"]);
    }
    let started = Instant::now();
    let harness::process::Process {
        mut child,
        pid,
        log,
    } = spawn.start()?;
    let mut peak = 0.0f64;
    // Sampled while it runs: its own CPU and its backend's are gone once it exits.
    let cpu = || {
        [
            binary::cpu_seconds(pid),
            binary::service_cpu_seconds().0,
            binary::cpu_seconds(std::process::id()),
        ]
    };
    let at_start = cpu();
    let mut last = at_start;
    let status = loop {
        peak = peak.max(peak_rss_mib(pid));
        let now = cpu();
        if now[0] > 0.0 {
            last = now;
        }
        match tokio::time::timeout(Duration::from_millis(50), child.wait()).await {
            Ok(status) => break status?,
            Err(_) => continue,
        }
    };
    let elapsed = started.elapsed();
    let stderr = std::fs::read_to_string(&log).unwrap_or_default();
    let _ = std::fs::remove_file(&log);
    ensure!(
        status.success(),
        "{} exited with {status}: {stderr}",
        binary.display()
    );
    if !dry_run {
        check_exactly_once(db, table).await?;
    }
    let reported = |field: &str| summary_field(&stderr, field);
    Ok(Leg {
        wall_ms: elapsed.as_secs_f64() * 1e3,
        run_ms: reported("elapsed_ms"),
        waited_ms: reported("waited_for_bigquery_ms"),
        rows_per_second: table.len() as f64 / elapsed.as_secs_f64(),
        peak_rss_mib: peak,
        calls: standin.calls() - calls_before,
        cpu_us: [0, 1, 2]
            .map(|i| (last[i] - if i == 0 { 0.0 } else { at_start[i] }) * 1e6 / table.len() as f64),
    })
}

/// A number field of the producer's "Stream summary." JSON log line.
fn summary_field(stderr: &str, field: &str) -> Option<f64> {
    stderr
        .lines()
        .filter(|l| l.contains("Stream summary."))
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find_map(|v| {
            let f = v.get("fields").unwrap_or(&v);
            f.get(field).and_then(serde_json::Value::as_f64)
        })
}

/// Every row once, the watermark at the last row.
async fn check_exactly_once(db: &Scratch, table: &Table) -> Result<()> {
    let (rows, distinct): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT dedupe_key) FROM pubsub_outbox")
            .fetch_one(&db.db.pool)
            .await?;
    ensure!(
        rows == table.len() as i64 && distinct == rows,
        "the producer left {rows} rows ({distinct} distinct) for {} source rows",
        table.len()
    );
    let (ts, key): (i64, String) = sqlx::query_as(
        "SELECT cursor_micros, cursor_key FROM producer_watermark WHERE stream = 'bench'",
    )
    .fetch_one(&db.db.pool)
    .await
    .context("reading the bench stream's watermark")?;
    let last = table.last_cursor().unwrap_or_default();
    ensure!(
        (ts, key.as_str()) == (last.0, last.1.to_string().as_str()),
        "the watermark is at ({ts}, {key}), not at the last row {last:?}"
    );
    Ok(())
}

/// The outbox's rows as a producer run left them, in id order.
async fn written(db: &Scratch) -> Result<Vec<NewMessage>> {
    type Row = (
        String,
        Option<String>,
        String,
        Vec<u8>,
        sqlx::types::Json<outbox_shared::message::Attributes>,
    );
    let rows: Vec<Row> = sqlx::query_as(
        "SELECT topic, ordering_key, dedupe_key, payload, attributes FROM pubsub_outbox ORDER BY id",
    )
    .fetch_all(&db.db.pool)
    .await
    .context("reading back the rows the producer enqueued")?;
    Ok(rows
        .into_iter()
        .map(
            |(topic, ordering_key, dedupe_key, payload, attributes)| NewMessage {
                topic,
                ordering_key,
                dedupe_key,
                payload,
                attributes: attributes.0,
                trace_context: None,
            },
        )
        .collect())
}

/// `enqueue_batch` alone: the same rows, `per_tx` per transaction, one connection. Returns
/// rows/s and PostgreSQL's CPU per row (µs).
async fn enqueue_leg(db: &Scratch, messages: &[NewMessage], per_tx: usize) -> Result<(f64, f64)> {
    reset(db).await?;
    let mut conn = db.db.pool.acquire().await?;
    let (pg_before, _) = binary::service_cpu_seconds();
    let started = Instant::now();
    for chunk in messages.chunks(per_tx.max(1)) {
        let mut tx = sqlx::Connection::begin(&mut *conn).await?;
        enqueue_batch(&mut tx, chunk).await?;
        tx.commit().await.context("committing an enqueue")?;
    }
    let elapsed = started.elapsed();
    let (pg_after, _) = binary::service_cpu_seconds();
    let n = messages.len() as f64;
    Ok((n / elapsed.as_secs_f64(), (pg_after - pg_before) * 1e6 / n))
}

/// The process's peak resident memory so far (VmHWM), in MiB; 0 once it is gone.
fn peak_rss_mib(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}
