//! The real `dispatcher` binary end to end, against the figures that bound it:
//!
//! - `ceiling`: the DB-only drain, a tight publisher (no database) and the binary's drain,
//!   unkeyed and over 1,000 keys, in the same rounds; e2e / (1 / (1/drain + 1/publish)).
//! - `round-trip`: the binary publishing through a proxy that adds latency per direction, for
//!   1 and 4 workers and 1 and 3 processes, with the most requests in flight seen.
//! - `latency`: commit → Pub/Sub publish time at a steady rate of single-row transactions, with
//!   NOTIFY and poll-only, and the dispatcher's CPU meanwhile.
//! - `resources`: the binary's resident memory idle, draining unkeyed rows and over 1,000 keys.
//!
//! Every figure is per contender (`--dispatcher-bin label=path`, repeatable: e.g. the binary
//! before and after a change, measured in the same rounds).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, Result, anyhow, bail};
use google_cloud_pubsub::client::{BasePublisher, TopicAdmin};
use google_cloud_pubsub::model::Message;
use outbox_shared::{NewMessage, enqueue_batch, notify};
use tokio::task::JoinSet;

use crate::binary::{Contender, DispatcherProcess, Drained, default_contender, drain};
use crate::dispatch::Keys;
use crate::report::{load_average, parse_duration, summary};
use crate::scratch::Scratch;
use crate::{claim, join_sum};

/// What every pipeline benchmark takes.
#[derive(Debug, Clone, clap::Args)]
pub struct Common {
    /// A dispatcher binary to measure, `label=path` (repeatable, measured in the same rounds).
    /// Default: the `dispatcher` built beside this bench.
    #[arg(long = "dispatcher-bin")]
    pub dispatcher_bin: Vec<Contender>,
    /// Pub/Sub emulator host:port (use a private one: the bench publishes at full speed).
    #[arg(long, env = "PUBSUB_EMULATOR_HOST", default_value = "127.0.0.1:8085")]
    pub pubsub_emulator_host: String,
    /// Project of the bench topics.
    #[arg(long, env = "PUBSUB_PROJECT_ID", default_value = "outbox-bench")]
    pub pubsub_project: String,
    /// Payload bytes per message.
    #[arg(long, default_value_t = 1024)]
    pub payload_bytes: usize,
    /// Extra dispatcher settings, `OUTBOX_X=value` (repeatable; every contender gets them).
    #[arg(long = "dispatcher-env", value_parser = parse_env)]
    pub dispatcher_env: Vec<(String, String)>,
}

fn parse_env(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .ok_or_else(|| format!("expected NAME=value, got {s:?}"))
}

impl Common {
    pub(crate) fn contenders(&self) -> Result<Vec<Contender>> {
        let _ = EXTRA_ENV.set(self.dispatcher_env.clone());
        if self.dispatcher_bin.is_empty() {
            Ok(vec![default_contender()?])
        } else {
            Ok(self.dispatcher_bin.clone())
        }
    }
}

#[derive(Debug, Clone, clap::Args)]
pub struct CeilingArgs {
    #[command(flatten)]
    pub common: Common,
    /// Messages per drain.
    #[arg(long, default_value_t = 200_000)]
    pub rows: usize,
    /// Rounds (every figure once per round, interleaved; medians reported).
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Dispatcher workers (and DB-only drain connections, and tight publishers).
    #[arg(long, default_value_t = 4)]
    pub workers: usize,
    /// Ordering keys of the keyed drain.
    #[arg(long, default_value_t = 1000)]
    pub keys: usize,
}

#[derive(Debug, Clone, clap::Args)]
pub struct RoundTripArgs {
    #[command(flatten)]
    pub common: Common,
    /// Messages per drain.
    #[arg(long, default_value_t = 50_000)]
    pub rows: usize,
    /// Latency the proxy adds per direction.
    #[arg(long, default_value = "20ms", value_parser = parse_duration)]
    pub latency: Duration,
    /// Rounds.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Ordering-key spreads, comma-separated, each drained in every round: `none` (no key) or N
    /// (message i gets key `key-(i % N)`); `none,1` compares a single hot key's backlog with
    /// unkeyed rows through the same proxy.
    #[arg(long, value_delimiter = ',', default_value = "none")]
    pub keys: Vec<Keys>,
    /// Only this shape, `PROCESSES:WORKERS` (default: the benchmark's shapes).
    #[arg(long, value_parser = parse_shape)]
    pub shape: Option<(usize, usize)>,
}

fn parse_shape(s: &str) -> Result<(usize, usize), String> {
    let parse = |n: &str| n.parse::<usize>().ok().filter(|n| *n > 0);
    s.split_once(':')
        .and_then(|(p, w)| Some((parse(p)?, parse(w)?)))
        .ok_or_else(|| format!("expected PROCESSES:WORKERS (e.g. 1:4), got {s:?}"))
}

#[derive(Debug, Clone, clap::Args)]
pub struct LatencyArgs {
    #[command(flatten)]
    pub common: Common,
    /// Single-row transactions per second, all writers together.
    #[arg(long, default_value_t = 1000)]
    pub rate: u32,
    /// Writer connections sharing the rate.
    #[arg(long, default_value_t = 4)]
    pub writers: u32,
    /// Seconds of steady load per measurement (the first second is not counted).
    #[arg(long, default_value_t = 20)]
    pub seconds: u64,
    /// Rounds.
    #[arg(long, default_value_t = 1)]
    pub rounds: usize,
    /// Ordering keys the transactions spread over, round-robin (`none`: unkeyed rows).
    #[arg(long, default_value = "none")]
    pub keys: Keys,
}

#[derive(Debug, Clone, clap::Args)]
pub struct ResourcesArgs {
    #[command(flatten)]
    pub common: Common,
    /// Unkeyed messages of the big drain.
    #[arg(long, default_value_t = 1_000_000)]
    pub rows: usize,
    /// Messages of the keyed drain (over --keys keys).
    #[arg(long, default_value_t = 200_000)]
    pub keyed_rows: usize,
    /// Ordering keys of the keyed drain.
    #[arg(long, default_value_t = 1000)]
    pub keys: usize,
}

/// A topic with no subscription (the emulator accepts and keeps nothing), deleted at the end.
pub(crate) struct BenchTopic {
    admin: TopicAdmin,
    name: String,
}

impl BenchTopic {
    async fn create(common: &Common, what: &str) -> Result<Self> {
        let endpoint = format!("http://{}", common.pubsub_emulator_host);
        let admin = TopicAdmin::builder()
            .with_endpoint(endpoint.clone())
            .with_credentials(anonymous())
            .build()
            .await
            .context("building the topic admin client")?;
        let name = format!(
            "projects/{}/topics/outbox-bench-{what}-{}",
            common.pubsub_project,
            std::process::id()
        );
        tokio::time::timeout(
            Duration::from_secs(10),
            admin.create_topic().set_name(&name).send(),
        )
        .await
        .map_err(|_| anyhow!("the Pub/Sub emulator at {endpoint} did not answer within 10 s"))?
        .with_context(|| format!("creating {name} on the emulator at {endpoint}"))?;
        Ok(Self { admin, name })
    }

    /// Runs `work` on a fresh topic, deleted afterwards (also after `work` failed).
    pub(crate) async fn around(
        common: &Common,
        what: &str,
        work: impl AsyncFnOnce(&str) -> Result<()>,
    ) -> Result<()> {
        let topic = Self::create(common, what).await?;
        let outcome = work(&topic.name).await;
        outcome.and(topic.delete().await)
    }

    async fn delete(self) -> Result<()> {
        self.admin
            .delete_topic()
            .set_topic(&self.name)
            .send()
            .await
            .map(|_| ())
            .with_context(|| format!("deleting {}", self.name))
    }
}

fn anonymous() -> google_cloud_auth::credentials::Credentials {
    google_cloud_auth::credentials::anonymous::Builder::new().build()
}

pub(crate) fn env(workers: usize) -> Vec<(&'static str, String)> {
    let mut env = vec![("OUTBOX_WORKERS", workers.to_string())];
    for (k, v) in EXTRA_ENV.get().into_iter().flatten() {
        env.push((k.as_str(), v.clone()));
    }
    env
}

/// `--dispatcher-env`, set once at the start of a benchmark.
static EXTRA_ENV: std::sync::OnceLock<Vec<(String, String)>> = std::sync::OnceLock::new();

/// Fills the outbox, runs `procs` dispatchers (each with `env`) until all is published.
pub(crate) async fn run_binary(
    db: &Scratch,
    contender: &Contender,
    emulator: &str,
    env: &[(&str, String)],
    procs: usize,
    rows: usize,
) -> Result<crate::binary::Drained> {
    let mut running = Vec::with_capacity(procs);
    for _ in 0..procs {
        running.push(DispatcherProcess::start(&contender.path, db.db.url(), emulator, env).await?);
    }
    // Generous: 1,000 msgs/s at least.
    let limit = Duration::from_secs(60 + rows as u64 / 1000);
    let drained = drain(&running, rows as u64, limit).await;
    for p in running {
        p.stop().await?;
    }
    let drained = drained?;
    if db.remaining().await? != 0 {
        bail!(
            "{}: rows left in the outbox after the drain",
            contender.label
        );
    }
    Ok(drained)
}

/// The DB-only drain with the dispatcher's claim protocol: rows/s.
async fn db_drain(db: &Scratch, rows: usize, payload: usize, workers: usize) -> Result<f64> {
    db.refill(
        rows,
        payload,
        Keys(None),
        "projects/outbox-bench/topics/claim",
    )
    .await?;
    let started = Instant::now();
    let mut drains = JoinSet::new();
    for _ in 0..workers {
        let pool = db.pool.clone();
        drains.spawn(async move { claim::drain_lock(&pool, 500).await });
    }
    let drained: u64 = join_sum(drains).await?;
    if drained != rows as u64 {
        bail!("the DB-only drain deleted {drained} of {rows} rows");
    }
    Ok(rows as f64 / started.elapsed().as_secs_f64())
}

/// A tight publisher: `publishers` tasks, each its own client publisher, sending `rows`
/// messages in requests of 1,000 straight to the emulator. msgs/s.
async fn tight_publish(
    common: &Common,
    topic: &str,
    rows: usize,
    publishers: usize,
) -> Result<f64> {
    let base = BasePublisher::builder()
        .with_endpoint(format!("http://{}", common.pubsub_emulator_host))
        .with_credentials(anonymous())
        .build()
        .await
        .context("building the publisher client")?;
    let payload = vec![7u8; common.payload_bytes];
    let started = Instant::now();
    let mut tasks = JoinSet::new();
    for t in 0..publishers {
        let publisher = base
            .publisher(topic.to_owned())
            .set_message_count_threshold(1000)
            .set_byte_threshold(9_000_000)
            .set_delay_threshold(Duration::from_millis(5))
            .build();
        let payload = payload.clone();
        let share = rows / publishers + usize::from(t < rows % publishers);
        tasks.spawn(async move {
            let mut sent = 0;
            while sent < share {
                let n = (share - sent).min(1000);
                let pending: Vec<_> = (0..n)
                    .map(|i| {
                        publisher.publish(
                            Message::new().set_data(payload.clone()).set_attributes([(
                                "dedupe_key",
                                format!("tight-{t}-{}", sent + i),
                            )]),
                        )
                    })
                    .collect();
                publisher.flush().await;
                for r in futures::future::join_all(pending).await {
                    r.context("a tight publish failed")?;
                }
                sent += n;
            }
            Ok::<usize, anyhow::Error>(sent)
        });
    }
    let sent: usize = join_sum(tasks).await?;
    Ok(sent as f64 / started.elapsed().as_secs_f64())
}

pub async fn ceiling_bench(db: &Scratch, args: &CeilingArgs) -> Result<()> {
    let contenders = args.common.contenders()?;
    BenchTopic::around(&args.common, "ceiling", async |topic: &str| {
        ceiling_rounds(db, args, &contenders, topic).await
    })
    .await
}

async fn ceiling_rounds(
    db: &Scratch,
    args: &CeilingArgs,
    contenders: &[Contender],
    topic: &str,
) -> Result<()> {
    let c = &args.common;
    // The emulator gets much cheaper per message over its first messages (JIT): warm it.
    tight_publish(c, topic, args.rows.min(200_000), args.workers).await?;
    let mut drains = Vec::new();
    let mut publishes = Vec::new();
    let mut e2e: HashMap<String, Vec<(Drained, Drained)>> = HashMap::new();
    for round in 1..=args.rounds {
        let d = db_drain(db, args.rows, c.payload_bytes, args.workers).await?;
        let p = tight_publish(c, topic, args.rows, args.workers).await?;
        let ceiling = 1.0 / (1.0 / d + 1.0 / p);
        println!(
            "ceiling round {round}/{}: DB-only drain {d:.0} rows/s; tight publish {p:.0} msgs/s; pipeline ceiling {ceiling:.0} msgs/s; load {}",
            args.rounds,
            load_average()
        );
        for contender in contenders {
            db.refill(args.rows, c.payload_bytes, Keys(None), topic)
                .await?;
            let unkeyed = run_binary(
                db,
                contender,
                &c.pubsub_emulator_host,
                &env(args.workers),
                1,
                args.rows,
            )
            .await?;
            db.refill(args.rows, c.payload_bytes, Keys(Some(args.keys)), topic)
                .await?;
            let keyed = run_binary(
                db,
                contender,
                &c.pubsub_emulator_host,
                &env(args.workers),
                1,
                args.rows,
            )
            .await?;
            println!(
                "  {}: unkeyed {:.0} msgs/s = {:.2} of the ceiling; {} keys {:.0} msgs/s = {:.2} of unkeyed; peak RSS {:.1} / {:.1} MiB; CPU µs/msg (dispatcher / PostgreSQL / emulator) unkeyed {} keyed {}",
                contender.label,
                unkeyed.rate,
                unkeyed.rate / ceiling,
                args.keys,
                keyed.rate,
                keyed.rate / unkeyed.rate,
                unkeyed.peak_mb,
                keyed.peak_mb,
                cpu_split(&unkeyed.cpu_us),
                cpu_split(&keyed.cpu_us)
            );
            e2e.entry(contender.label.clone())
                .or_default()
                .push((unkeyed, keyed));
        }
        drains.push(d);
        publishes.push(p);
    }
    let ceilings: Vec<f64> = drains
        .iter()
        .zip(&publishes)
        .map(|(d, p)| 1.0 / (1.0 / d + 1.0 / p))
        .collect();
    println!(
        "\n{} rows of {} B, {} workers, rounds {}; load at end {}",
        args.rows,
        c.payload_bytes,
        args.workers,
        args.rounds,
        load_average()
    );
    println!("| figure | median | min | max |");
    println!("|---|---|---|---|");
    let row = |name: &str, v: &mut dyn Iterator<Item = f64>, digits: usize| {
        let s = summary(v);
        println!(
            "| {name} | {:.d$} | {:.d$} | {:.d$} |",
            s.median,
            s.min,
            s.max,
            d = digits
        );
    };
    row("DB-only drain (rows/s)", &mut drains.iter().copied(), 0);
    row(
        "tight publish, no database (msgs/s)",
        &mut publishes.iter().copied(),
        0,
    );
    row(
        "pipeline ceiling (msgs/s)",
        &mut ceilings.iter().copied(),
        0,
    );
    for contender in contenders {
        let runs = &e2e[&contender.label];
        let l = &contender.label;
        row(
            &format!("{l}: unkeyed e2e (msgs/s)"),
            &mut runs.iter().map(|r| r.0.rate),
            0,
        );
        row(
            &format!("{l}: {} keys e2e (msgs/s)", args.keys),
            &mut runs.iter().map(|r| r.1.rate),
            0,
        );
        row(
            &format!("{l}: unkeyed e2e / ceiling (per round)"),
            &mut runs.iter().zip(&ceilings).map(|(r, c)| r.0.rate / c),
            2,
        );
        row(
            &format!("{l}: keyed / unkeyed (per round)"),
            &mut runs.iter().map(|r| r.1.rate / r.0.rate),
            2,
        );
        for (i, part) in ["dispatcher", "PostgreSQL", "emulator"].iter().enumerate() {
            row(
                &format!("{l}: unkeyed CPU µs/msg, {part}"),
                &mut runs.iter().map(|r| r.0.cpu_us[i]),
                1,
            );
            row(
                &format!("{l}: keyed CPU µs/msg, {part}"),
                &mut runs.iter().map(|r| r.1.cpu_us[i]),
                1,
            );
        }
    }
    Ok(())
}

pub(crate) fn cpu_split(us: &[f64; 3]) -> String {
    format!("{:.1} / {:.1} / {:.1}", us[0], us[1], us[2])
}

/// `round-trip`'s (processes, workers per process): what one process gains from workers, and
/// what processes add.
pub const ROUND_TRIP_SHAPES: &[(usize, usize)] = &[(1, 1), (1, 4), (3, 1), (3, 4)];
/// `scale`'s: 1, 2, 3 replicas of the default 4 workers.
pub const SCALE_SHAPES: &[(usize, usize)] = &[(1, 4), (2, 4), (3, 4)];

/// The real binary through the latency proxy, for each shape (processes x workers) in turn,
/// round after round; ratios are to the first shape.
pub async fn round_trip_bench(
    db: &Scratch,
    args: &RoundTripArgs,
    shapes: &[(usize, usize)],
) -> Result<()> {
    let contenders = args.common.contenders()?;
    let only: Vec<(usize, usize)> = args.shape.into_iter().collect();
    let shapes = if only.is_empty() { shapes } else { &only };
    BenchTopic::around(&args.common, "round-trip", async |topic: &str| {
        let proxy = harness::proxy::TcpProxy::start(&args.common.pubsub_emulator_host).await;
        proxy.set_delay(args.latency);
        round_trip_rounds(db, args, &contenders, topic, &proxy, shapes).await
    })
    .await
}

async fn round_trip_rounds(
    db: &Scratch,
    args: &RoundTripArgs,
    contenders: &[Contender],
    topic: &str,
    proxy: &harness::proxy::TcpProxy,
    shapes: &[(usize, usize)],
) -> Result<()> {
    // (contender, shape, keys) -> (rate, most in flight, CPU µs/msg split, bench µs/msg, cores,
    // messages per request) per round
    type Run = (f64, u64, [f64; 3], f64, f64, f64);
    let mut results: HashMap<(String, usize, Keys), Vec<Run>> = HashMap::new();
    for round in 1..=args.rounds {
        for contender in contenders {
            for (i, (procs, workers)) in shapes.iter().enumerate() {
                for keys in &args.keys {
                    db.refill(args.rows, args.common.payload_bytes, *keys, topic)
                        .await?;
                    proxy.reset_max_requests_in_flight();
                    let sent_before = proxy.requests_sent();
                    let d = run_binary(
                        db,
                        contender,
                        &proxy.addr(),
                        &env(*workers),
                        *procs,
                        args.rows,
                    )
                    .await?;
                    let in_flight = proxy.max_requests_in_flight();
                    let requests = proxy.requests_sent().saturating_sub(sent_before).max(1);
                    let per_request = args.rows as f64 / requests as f64;
                    println!(
                        "round-trip round {round}/{}: {} {procs} process(es) x {workers} worker(s), keys {keys}: {:.0} msgs/s, {per_request:.1} messages per request, at most {in_flight} requests in flight; CPU µs/msg dispatchers / PostgreSQL / emulator / bench+proxy {} / {:.1} = {:.2} cores; load {}",
                        args.rounds,
                        contender.label,
                        d.rate,
                        cpu_split(&d.cpu_us),
                        d.bench_us,
                        d.cores(),
                        load_average()
                    );
                    results
                        .entry((contender.label.clone(), i, *keys))
                        .or_default()
                        .push((
                            d.rate,
                            in_flight,
                            d.cpu_us,
                            d.bench_us,
                            d.cores(),
                            per_request,
                        ));
                }
            }
        }
    }
    println!(
        "\n{} rows, {:?} added per direction, {} rounds; ratios: to {} x {} with the same keys, and to keys {} with the same shape (per round, median)",
        args.rows, args.latency, args.rounds, shapes[0].0, shapes[0].1, args.keys[0]
    );
    println!(
        "| dispatcher | processes x workers | keys | median msgs/s | min | max | messages per request | most requests in flight | ratio to {} x {} | ratio to keys {} | CPU µs/msg: dispatchers / PostgreSQL / emulator / bench+proxy (medians) | cores busy (median) |",
        shapes[0].0, shapes[0].1, args.keys[0]
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    for contender in contenders {
        for (i, (procs, workers)) in shapes.iter().enumerate() {
            for keys in &args.keys {
                let runs = &results[&(contender.label.clone(), i, *keys)];
                let base_shape = &results[&(contender.label.clone(), 0, *keys)];
                let base_keys = &results[&(contender.label.clone(), i, args.keys[0])];
                let s = summary(runs.iter().map(|r| r.0));
                let ratio =
                    |base: &Vec<Run>| summary(runs.iter().zip(base).map(|(r, b)| r.0 / b.0)).median;
                let part = |i: usize| summary(runs.iter().map(|r| r.2[i])).median;
                println!(
                    "| {} | {procs} x {workers} | {keys} | {:.0} | {:.0} | {:.0} | {:.1} | {} | {:.2} | {:.2} | {:.1} / {:.1} / {:.1} / {:.1} | {:.2} |",
                    contender.label,
                    s.median,
                    s.min,
                    s.max,
                    summary(runs.iter().map(|r| r.5)).median,
                    runs.iter().map(|r| r.1).max().unwrap_or(0),
                    ratio(base_shape),
                    ratio(base_keys),
                    part(0),
                    part(1),
                    part(2),
                    summary(runs.iter().map(|r| r.3)).median,
                    summary(runs.iter().map(|r| r.4)).median
                );
            }
        }
    }
    Ok(())
}

pub async fn resources_bench(db: &Scratch, args: &ResourcesArgs) -> Result<()> {
    let contenders = args.common.contenders()?;
    BenchTopic::around(&args.common, "resources", async |topic: &str| {
        resources_runs(db, args, &contenders, topic).await
    })
    .await
}

async fn resources_runs(
    db: &Scratch,
    args: &ResourcesArgs,
    contenders: &[Contender],
    topic: &str,
) -> Result<()> {
    let c = &args.common;
    let emulator = &c.pubsub_emulator_host;
    let mut rows = Vec::new();
    for contender in contenders {
        sqlx::raw_sql("TRUNCATE pubsub_outbox")
            .execute(&db.db.pool)
            .await
            .context("emptying the outbox")?;
        let idle =
            DispatcherProcess::start(&contender.path, db.db.url(), emulator, &env(4)).await?;
        tokio::time::sleep(Duration::from_secs(5)).await;
        let (idle_rss, _) = idle.memory_mb();
        idle.stop().await?;
        db.refill(args.rows, c.payload_bytes, Keys(None), topic)
            .await?;
        let unkeyed = run_binary(db, contender, emulator, &env(4), 1, args.rows).await?;
        db.refill(
            args.keyed_rows,
            c.payload_bytes,
            Keys(Some(args.keys)),
            topic,
        )
        .await?;
        let keyed = run_binary(db, contender, emulator, &env(4), 1, args.keyed_rows).await?;
        println!(
            "resources {}: idle {idle_rss:.1} MiB; peak {:.1} MiB draining {} unkeyed ({:.0} msgs/s); peak {:.1} MiB draining {} over {} keys ({:.0} msgs/s); load {}",
            contender.label,
            unkeyed.peak_mb,
            args.rows,
            unkeyed.rate,
            keyed.peak_mb,
            args.keyed_rows,
            args.keys,
            keyed.rate,
            load_average()
        );
        rows.push((contender.label.clone(), idle_rss, unkeyed, keyed));
    }
    println!(
        "\n| dispatcher | RSS idle (MiB) | peak RSS, {} unkeyed (MiB) | peak RSS, {} over {} keys (MiB) |",
        args.rows, args.keyed_rows, args.keys
    );
    println!("|---|---|---|---|");
    for (label, idle, unkeyed, keyed) in rows {
        println!(
            "| {label} | {idle:.1} | {:.1} | {:.1} |",
            unkeyed.peak_mb, keyed.peak_mb
        );
    }
    Ok(())
}

/// When each message was committed and when Pub/Sub stamped and delivered it.
#[derive(Debug, Default)]
struct Timings {
    committed: HashMap<String, SystemTime>,
    published: HashMap<String, (SystemTime, SystemTime)>,
}

pub async fn latency_bench(db: &Scratch, args: &LatencyArgs) -> Result<()> {
    let contenders = args.common.contenders()?;
    let mut table = Vec::new();
    for round in 1..=args.rounds {
        for contender in &contenders {
            for poll_only in [false, true] {
                let r = latency_run(db, args, contender, poll_only).await?;
                let mode = if poll_only { "poll-only" } else { "NOTIFY" };
                println!(
                    "latency round {round}/{}: {} {mode}: {} messages at {:.0} tx/s; commit -> publish p50 {:.1} p95 {:.1} p99 {:.1} max {:.1} ms; commit -> delivery p99 {:.1} ms; dispatcher {:.3} cores, {:.0} batches/s, {:.0} empty claims/s; load {}",
                    args.rounds,
                    contender.label,
                    r.messages,
                    r.rate,
                    r.publish[0],
                    r.publish[1],
                    r.publish[2],
                    r.publish[3],
                    r.delivery_p99,
                    r.cores,
                    r.batches,
                    r.empty,
                    load_average()
                );
                table.push((contender.label.clone(), mode, r));
            }
        }
    }
    println!(
        "\n{} single-row transactions/s from {} writers, {} s each ({} B payloads, keys: {})",
        args.rate, args.writers, args.seconds, args.common.payload_bytes, args.keys
    );
    println!(
        "| dispatcher | wake-up | messages | commit → publish p50 (ms) | p95 | p99 | max | commit → delivery p99 | dispatcher CPU (cores) | batches/s | empty claims/s |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for (label, mode, r) in table {
        println!(
            "| {label} | {mode} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.3} | {:.0} | {:.0} |",
            r.messages,
            r.publish[0],
            r.publish[1],
            r.publish[2],
            r.publish[3],
            r.delivery_p99,
            r.cores,
            r.batches,
            r.empty
        );
    }
    Ok(())
}

#[derive(Debug, Clone, Copy)]
struct LatencyRun {
    messages: usize,
    rate: f64,
    /// p50, p95, p99, max in ms.
    publish: [f64; 4],
    delivery_p99: f64,
    cores: f64,
    /// Batches settled and empty claims, per second.
    batches: f64,
    empty: f64,
}

async fn latency_run(
    db: &Scratch,
    args: &LatencyArgs,
    contender: &Contender,
    poll_only: bool,
) -> Result<LatencyRun> {
    sqlx::raw_sql("TRUNCATE pubsub_outbox")
        .execute(&db.db.pool)
        .await
        .context("emptying the outbox")?;
    let topic = harness::pubsub::TestTopic::new(false).await;
    let timings = Arc::new(Mutex::new(Timings::default()));
    let subscriber = {
        let timings = timings.clone();
        let mut stream = harness::pubsub::stream(&topic.subscription).await;
        tokio::spawn(async move {
            while let Some(Ok((msg, handler))) = stream.next().await {
                let received = SystemTime::now();
                handler.ack();
                let stamped = msg.publish_time.map_or(received, |t| {
                    SystemTime::UNIX_EPOCH
                        + Duration::new(t.seconds().max(0) as u64, t.nanos().max(0) as u32)
                });
                let key = msg
                    .attributes
                    .get(outbox_shared::DEFAULT_DEDUPE_ATTRIBUTE)
                    .cloned()
                    .unwrap_or_default();
                if let Ok(mut t) = timings.lock() {
                    t.published.insert(key, (stamped, received));
                }
            }
        })
    };
    let mut env = env(4);
    if poll_only {
        env.push(("OUTBOX_NO_LISTEN", "true".to_owned()));
    }
    let dispatcher = DispatcherProcess::start(
        &contender.path,
        db.db.url(),
        &args.common.pubsub_emulator_host,
        &env,
    )
    .await?;
    let per_writer = Duration::from_secs_f64(f64::from(args.writers) / f64::from(args.rate));
    let run_for = Duration::from_secs(args.seconds);
    let started = Instant::now();
    let cpu_before = dispatcher.cpu_seconds();
    let batches_before = dispatcher.metric("outbox_batch_size_count").await?;
    let empty_before = dispatcher.metric("outbox_empty_claims_total").await?;
    let mut writers = JoinSet::new();
    for w in 0..args.writers {
        let pool = db.db.pool.clone();
        let timings = timings.clone();
        let topic = topic.topic.clone();
        let payload = vec![3u8; args.common.payload_bytes];
        let (keys, writers_n) = (args.keys, args.writers as usize);
        writers.spawn(async move {
            let mut tick = tokio::time::interval(per_writer);
            let mut n = 0usize;
            while started.elapsed() < run_for {
                tick.tick().await;
                let key = format!("lat-{w}-{n}");
                let mut message = NewMessage::new(topic.clone(), key.clone(), payload.clone());
                if let Some(k) = keys.0 {
                    // Writer w's n-th row: the keys round-robin across all writers' rows.
                    message = message
                        .with_ordering_key(format!("key-{}", (n * writers_n + w as usize) % k));
                }
                let mut tx = pool.begin().await?;
                enqueue_batch(&mut tx, std::slice::from_ref(&message)).await?;
                notify(&mut tx, outbox_shared::DEFAULT_NOTIFY_CHANNEL).await?;
                tx.commit()
                    .await
                    .context("committing a single-row transaction")?;
                let committed = SystemTime::now();
                // The first second warms connections and caches: not counted.
                if started.elapsed() >= Duration::from_secs(1)
                    && let Ok(mut t) = timings.lock()
                {
                    t.committed.insert(key, committed);
                }
                n += 1;
            }
            Ok::<usize, anyhow::Error>(n)
        });
    }
    let written: usize = join_sum(writers).await?;
    let wall = started.elapsed().as_secs_f64();
    let cores = (dispatcher.cpu_seconds() - cpu_before) / wall;
    let batches = (dispatcher.metric("outbox_batch_size_count").await? - batches_before) / wall;
    let empty = (dispatcher.metric("outbox_empty_claims_total").await? - empty_before) / wall;
    // Every message arrives (or the run is void).
    let waited = Instant::now();
    loop {
        let arrived = timings.lock().map(|t| t.published.len()).unwrap_or(0);
        if arrived >= written {
            break;
        }
        if waited.elapsed() > Duration::from_secs(30) {
            bail!("{arrived} of {written} messages arrived within 30 s of the last commit");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    subscriber.abort();
    dispatcher.stop().await?;
    let t = timings
        .lock()
        .map_err(|_| anyhow!("timings lock poisoned"))?;
    let mut to_publish = Vec::new();
    let mut to_delivery = Vec::new();
    for (key, committed) in &t.committed {
        let Some((stamped, received)) = t.published.get(key) else {
            bail!("{key} was committed but never arrived");
        };
        let ms = |later: &SystemTime| match later.duration_since(*committed) {
            Ok(d) => d.as_secs_f64() * 1000.0,
            // Stamped before the writer took its clock reading after the commit returned.
            Err(e) => -e.duration().as_secs_f64() * 1000.0,
        };
        to_publish.push(ms(stamped));
        to_delivery.push(ms(received));
    }
    drop(t);
    Ok(LatencyRun {
        messages: written,
        rate: written as f64 / wall,
        publish: [
            percentile(&mut to_publish, 0.50),
            percentile(&mut to_publish, 0.95),
            percentile(&mut to_publish, 0.99),
            percentile(&mut to_publish, 1.0),
        ],
        delivery_p99: percentile(&mut to_delivery, 0.99),
        cores,
        batches,
        empty,
    })
}

/// The `q` quantile (nearest rank) of `v`.
fn percentile(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}
