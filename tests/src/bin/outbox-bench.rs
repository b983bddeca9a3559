//! `outbox-bench`: the throughput figures in BENCHMARKS.md.
//!
//! - `claim`: drains a filled outbox straight from PostgreSQL (no Pub/Sub) with the dispatcher's
//!   claim protocol (row locks held until the delete commits) and/or a lease alternative; reports
//!   rows/s, enqueue rows/s and WAL bytes per row.
//! - `dispatch`: drains end to end through the dispatcher's unit of work
//!   (`outbox_dispatcher::worker::run_batch`) against the Pub/Sub emulator, per ordering-key spread.
//!
//! Every invocation works in its own database (`outbox_bench_<pid>`, created from DATABASE_URL and
//! migrated) and, for `dispatch`, its own topic; both are removed at the end, also after an error
//! or Ctrl-C. The topic has no subscription: the emulator accepts the publishes and keeps nothing.

use std::process::ExitCode;
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use chrono::{DateTime, Utc};
use clap::{Parser, Subcommand, ValueEnum};
use google_cloud_pubsub::client::TopicAdmin;
use prometheus_client::registry::Registry;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgConnection};
use tokio::task::JoinSet;

use outbox_dispatcher::breaker::Breaker;
use outbox_dispatcher::metrics::Metrics;
use outbox_dispatcher::publisher::{PubsubArgs, PubsubPublisher};
use outbox_dispatcher::worker::{BatchOutcome, BatchSettings, Dispatch, run_batch};
use outbox_shared::NewMessage;
use outbox_shared::retry::RetrySchedule;
use outbox_shared::store::claim::{self, ClaimFilter, KeyCursor};
use outbox_shared::store::outbox;
use outbox_shared::telemetry::{self, TelemetryArgs};

/// Rows per enqueue statement (and transaction) when filling the outbox.
const FILL_CHUNK: usize = 5_000;

/// Benchmarks of the outbox claim protocols and of the dispatcher against the Pub/Sub emulator.
#[derive(Debug, Parser)]
#[command(name = "outbox-bench")]
struct Cli {
    /// PostgreSQL URL the scratch database is created from (the role needs CREATEDB).
    #[arg(
        long,
        env = "DATABASE_URL",
        global = true,
        hide_env_values = true,
        default_value = "postgres://postgres@127.0.0.1:5432/postgres"
    )]
    database_url: String,
    #[command(flatten)]
    telemetry: TelemetryArgs,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Drain a filled outbox from PostgreSQL alone with the lock and/or lease claim protocol.
    Claim(ClaimArgs),
    /// Drain an outbox end to end through the dispatcher's run_batch into the Pub/Sub emulator.
    Dispatch(DispatchArgs),
}

/// A claim protocol to measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Protocol {
    /// The dispatcher's: claim (FOR UPDATE SKIP LOCKED) and delete in one transaction.
    Lock,
    /// Claim by writing a lease and committing; delete in a second transaction.
    Lease,
    /// Both, interleaved run by run.
    Both,
}

impl std::fmt::Display for Protocol {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Lock => "lock",
            Self::Lease => "lease",
            Self::Both => "both",
        })
    }
}

#[derive(Debug, clap::Args)]
struct ClaimArgs {
    /// Claim protocol(s) to measure.
    #[arg(long, value_enum, default_value = "both")]
    protocol: Protocol,
    /// Rows in the outbox at the start of each drain (unkeyed).
    #[arg(long, default_value_t = 200_000)]
    rows: usize,
    /// Concurrent draining connections.
    #[arg(long, default_value_t = 4)]
    workers: usize,
    /// Rows per claim.
    #[arg(long, default_value_t = 1000)]
    batch_size: i64,
    /// Drains per protocol (the median is reported).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Payload bytes per row.
    #[arg(long, default_value_t = 1024)]
    payload_bytes: usize,
}

/// How messages spread over ordering keys: none, or round-robin over N keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Keys(Option<usize>);

impl FromStr for Keys {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "none" => Ok(Self(None)),
            n => match n.parse::<usize>() {
                Ok(n) if n > 0 => Ok(Self(Some(n))),
                _ => Err(format!(
                    "expected `none` or a positive number of keys, got {s:?}"
                )),
            },
        }
    }
}

impl std::fmt::Display for Keys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            None => f.write_str("none"),
            Some(n) => write!(f, "{n}"),
        }
    }
}

#[derive(Debug, clap::Args)]
struct DispatchArgs {
    /// Ordering-key spreads to measure, comma-separated: `none` (no key) or N (message i gets
    /// key `key-(i % N)`).
    #[arg(long, value_delimiter = ',', default_value = "none,10,1000,100000")]
    keys: Vec<Keys>,
    /// Messages in the outbox at the start of each drain.
    #[arg(long, default_value_t = 100_000)]
    messages: usize,
    /// Concurrent run_batch loops sharing one Dispatch.
    #[arg(long, default_value_t = 4)]
    workers: usize,
    /// Rows per claim (the dispatcher's --batch-size, 1..=1000).
    #[arg(long, default_value_t = 500)]
    batch_size: i64,
    /// Drains per key spread (the median is reported).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Payload bytes per message.
    #[arg(long, default_value_t = 1024)]
    payload_bytes: usize,
    /// Ordering keys visited per ordered claim (the dispatcher's --key-scan-limit).
    #[arg(long, default_value_t = 2000)]
    key_scan_limit: i64,
    /// Pub/Sub emulator host:port (use a private one: the bench publishes at full speed).
    #[arg(long, env = "PUBSUB_EMULATOR_HOST", default_value = "127.0.0.1:8085")]
    pubsub_emulator_host: String,
    /// Project of the bench topic.
    #[arg(long, env = "PUBSUB_PROJECT_ID", default_value = "outbox-bench")]
    pubsub_project: String,
    /// How long the client may wait to fill a request (the dispatcher's --publish-delay).
    #[arg(long, default_value = "5ms", value_parser = parse_duration)]
    publish_delay: Duration,
    /// Upper bound on one batch publish (the dispatcher's --publish-timeout).
    #[arg(long, default_value = "20s", value_parser = parse_duration)]
    publish_timeout: Duration,
    /// Payload bytes in flight across workers (the dispatcher's --max-inflight-bytes).
    #[arg(long, default_value_t = 64 * 1024 * 1024)]
    max_inflight_bytes: u64,
    /// Keep one Pub/Sub client for every key spread, as a long-running dispatcher does, instead
    /// of a fresh one per spread (shows what keys seen earlier cost later batches).
    #[arg(long, default_value_t = false)]
    share_publisher: bool,
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    telemetry::init(&cli.telemetry);
    match run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("outbox-bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> Result<()> {
    let workers = match &cli.command {
        Command::Claim(a) => a.workers,
        Command::Dispatch(a) => a.workers,
    };
    println!("load average at start: {}", load_average());
    let db = Scratch::create(&cli.database_url, workers.max(1)).await?;
    let outcome = match &cli.command {
        Command::Claim(a) => interruptible(claim_bench(&db, a)).await,
        Command::Dispatch(a) => dispatch_bench(&db, a).await,
    };
    let dropped = db.drop_database().await;
    println!("load average at end: {}", load_average());
    outcome.and(dropped)
}

/// Waits for every worker and adds up what they did. The first failure returns at once, and
/// dropping the set (also on Ctrl-C) aborts the other workers.
async fn join_sum<T: std::iter::Sum<T> + Send + 'static>(
    mut workers: JoinSet<Result<T>>,
) -> Result<T> {
    let mut done = Vec::with_capacity(workers.len());
    while let Some(joined) = workers.join_next().await {
        done.push(joined.context("a worker task panicked")??);
    }
    Ok(done.into_iter().sum())
}

/// Runs `work` unless Ctrl-C comes first, so the caller still removes what it created.
async fn interruptible(work: impl Future<Output = Result<()>>) -> Result<()> {
    tokio::select! {
        r = work => r,
        _ = tokio::signal::ctrl_c() => Err(anyhow!("interrupted")),
    }
}

/// The bench's own database: a pool for the drain (dispatcher session settings) and one
/// connection with default settings for filling (producers keep synchronous commit).
struct Scratch {
    admin: PgConnectOptions,
    name: String,
    pool: PgPool,
    fill: PgPool,
}

impl Scratch {
    async fn create(url: &str, workers: usize) -> Result<Self> {
        let admin = PgConnectOptions::from_str(url)
            .context("parsing --database-url")?
            .disable_statement_logging();
        let name = format!("outbox_bench_{}", std::process::id());
        let mut conn = PgConnection::connect_with(&admin)
            .await
            .context("connecting to --database-url; is PostgreSQL running?")?;
        sqlx::raw_sql(&format!("CREATE DATABASE {name}"))
            .execute(&mut conn)
            .await
            .with_context(|| format!("creating database {name}; the role needs CREATEDB"))?;
        conn.close().await.ok();
        let target = admin.clone().database(&name);
        let connect = async {
            // As the dispatcher's sessions: a lost settle only re-publishes.
            let drain_options = target.clone().options([("synchronous_commit", "off")]);
            let pool = PgPoolOptions::new()
                .max_connections(workers as u32 + 2)
                .connect_with(drain_options)
                .await?;
            let fill = PgPoolOptions::new()
                .max_connections(1)
                .connect_with(target.clone())
                .await?;
            outbox_shared::db::migrate(&pool).await?;
            // Open every worker connection now, not inside the first timed drain.
            let conns = futures::future::try_join_all((0..workers).map(|_| pool.acquire())).await?;
            drop(conns);
            anyhow::Ok((pool, fill))
        };
        match connect.await {
            Ok((pool, fill)) => Ok(Self {
                admin,
                name,
                pool,
                fill,
            }),
            Err(e) => {
                let partial = Self {
                    admin: admin.clone(),
                    name: name.clone(),
                    pool: PgPoolOptions::new().connect_lazy_with(target.clone()),
                    fill: PgPoolOptions::new().connect_lazy_with(target),
                };
                partial.drop_database().await.ok();
                Err(e.context(format!("preparing database {name}")))
            }
        }
    }

    async fn drop_database(self) -> Result<()> {
        self.pool.close().await;
        self.fill.close().await;
        let mut conn = PgConnection::connect_with(&self.admin).await?;
        sqlx::raw_sql(&format!(
            "DROP DATABASE IF EXISTS {} WITH (FORCE)",
            self.name
        ))
        .execute(&mut conn)
        .await
        .with_context(|| format!("dropping database {}", self.name))?;
        Ok(())
    }

    /// Empties the outbox and fills it with `n` messages; returns the enqueue rate (rows/s of
    /// time spent in enqueue + commit). Then VACUUM ANALYZE, so every drain starts alike.
    async fn refill(&self, n: usize, payload_bytes: usize, keys: Keys, topic: &str) -> Result<f64> {
        let mut conn = self.fill.acquire().await?;
        sqlx::raw_sql("TRUNCATE pubsub_outbox, pubsub_outbox_dead_letter")
            .execute(&mut *conn)
            .await
            .context("emptying the outbox")?;
        let mut spent = Duration::ZERO;
        for start in (0..n).step_by(FILL_CHUNK) {
            let chunk: Vec<NewMessage> = (start..n.min(start + FILL_CHUNK))
                .map(|i| NewMessage {
                    topic: topic.to_owned(),
                    ordering_key: keys.0.map(|k| format!("key-{}", i % k)),
                    dedupe_key: format!("bench-{i}"),
                    payload: (0..payload_bytes).map(|j| (i ^ j) as u8).collect(),
                    attributes: Default::default(),
                })
                .collect();
            let started = Instant::now();
            let mut tx = conn.begin().await?;
            outbox::enqueue_batch(&mut tx, &chunk).await?;
            tx.commit().await.context("committing an enqueue")?;
            spent += started.elapsed();
        }
        sqlx::raw_sql("VACUUM ANALYZE pubsub_outbox")
            .execute(&mut *conn)
            .await
            .context("vacuuming the filled outbox")?;
        Ok(n as f64 / spent.as_secs_f64())
    }

    async fn remaining(&self) -> Result<i64> {
        Ok(sqlx::query_scalar("SELECT count(*) FROM pubsub_outbox")
            .fetch_one(&self.pool)
            .await?)
    }
}

/// Cluster-wide counters read around a drain (other databases' writes count too: run quiet).
#[derive(Debug, Clone, Copy)]
struct Counters {
    wal_bytes: i64,
    full_page_images: i64,
    checkpoints: i64,
    heap_bytes: i64,
}

async fn counters(pool: &PgPool) -> Result<Counters> {
    let (wal_bytes, full_page_images, checkpoints, heap_bytes) = sqlx::query_as(
        "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint,
                (SELECT wal_fpi FROM pg_stat_wal),
                (SELECT checkpoints_timed + checkpoints_req FROM pg_stat_bgwriter),
                pg_relation_size('pubsub_outbox')",
    )
    .fetch_one(pool)
    .await
    .context("reading WAL and checkpoint counters")?;
    Ok(Counters {
        wal_bytes,
        full_page_images,
        checkpoints,
        heap_bytes,
    })
}

/// One claim drain.
#[derive(Debug, Clone, Copy)]
struct ClaimRun {
    enqueue_rate: f64,
    drain_rate: f64,
    wal_per_row: f64,
    fpi_per_1k: f64,
    checkpoints: i64,
    heap_before_mb: f64,
    heap_after_mb: f64,
}

async fn claim_bench(db: &Scratch, args: &ClaimArgs) -> Result<()> {
    let protocols = match args.protocol {
        Protocol::Both => vec![Protocol::Lock, Protocol::Lease],
        p => vec![p],
    };
    let mut results: Vec<(Protocol, Vec<ClaimRun>)> =
        protocols.iter().map(|p| (*p, Vec::new())).collect();
    // Interleaved, so a change in machine load hits both protocols alike.
    for run in 1..=args.runs {
        for (protocol, runs) in results.iter_mut() {
            let r = claim_run(db, args, *protocol).await?;
            println!(
                "claim {protocol} run {run}/{}: enqueue {:.0} rows/s; drain {:.0} rows/s; WAL {:.0} B/row, \
                 {:.0} full-page images per 1k rows, {} checkpoint(s); heap {:.0} -> {:.0} MB",
                args.runs,
                r.enqueue_rate,
                r.drain_rate,
                r.wal_per_row,
                r.fpi_per_1k,
                r.checkpoints,
                r.heap_before_mb,
                r.heap_after_mb
            );
            runs.push(r);
        }
    }
    println!(
        "\n| protocol | median rows/s | min | max | runs | enqueue rows/s (median) | WAL B/row (median) | FPI per 1k rows (median) | heap after drain / before |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for (protocol, runs) in &results {
        let rate = summary(runs.iter().map(|r| r.drain_rate));
        println!(
            "| {protocol} | {:.0} | {:.0} | {:.0} | {} | {:.0} | {:.0} | {:.0} | {:.2} |",
            rate.median,
            rate.min,
            rate.max,
            runs.len(),
            summary(runs.iter().map(|r| r.enqueue_rate)).median,
            summary(runs.iter().map(|r| r.wal_per_row)).median,
            summary(runs.iter().map(|r| r.fpi_per_1k)).median,
            summary(runs.iter().map(|r| r.heap_after_mb / r.heap_before_mb)).median,
        );
    }
    Ok(())
}

async fn claim_run(db: &Scratch, args: &ClaimArgs, protocol: Protocol) -> Result<ClaimRun> {
    let enqueue_rate = db
        .refill(
            args.rows,
            args.payload_bytes,
            Keys(None),
            "projects/outbox-bench/topics/claim",
        )
        .await?;
    let before = counters(&db.pool).await?;
    let started = Instant::now();
    let mut drains = JoinSet::new();
    for w in 0..args.workers {
        let pool = db.pool.clone();
        let batch = args.batch_size;
        drains.spawn(async move {
            match protocol {
                Protocol::Lease => drain_lease(&pool, &format!("bench-{w}"), batch).await,
                _ => drain_lock(&pool, batch).await,
            }
        });
    }
    let drained: u64 = join_sum(drains).await?;
    let elapsed = started.elapsed();
    let after = counters(&db.pool).await?;
    // Backends publish their WAL statistics (full-page images) within about a second of going
    // idle; the WAL position above is exact, and read before autovacuum can add to it.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let late = counters(&db.pool).await?;
    let left = db.remaining().await?;
    if left != 0 || drained != args.rows as u64 {
        bail!(
            "the {protocol} drain deleted {drained} of {} rows ({left} left)",
            args.rows
        );
    }
    let rows = args.rows as f64;
    let mb = |b: i64| b as f64 / (1024.0 * 1024.0);
    Ok(ClaimRun {
        enqueue_rate,
        drain_rate: rows / elapsed.as_secs_f64(),
        wal_per_row: (after.wal_bytes - before.wal_bytes) as f64 / rows,
        fpi_per_1k: (late.full_page_images - before.full_page_images) as f64 * 1000.0 / rows,
        checkpoints: late.checkpoints - before.checkpoints,
        heap_before_mb: mb(before.heap_bytes),
        heap_after_mb: mb(after.heap_bytes),
    })
}

/// The dispatcher's protocol: claim and delete in one transaction, row locks held in between
/// (where the publish happens).
async fn drain_lock(pool: &PgPool, batch: i64) -> Result<u64> {
    let mut deleted = 0;
    loop {
        let mut tx = pool.begin().await?;
        let filter = ClaimFilter {
            now: Utc::now(),
            limit: batch,
            topics: None,
        };
        let claimed = claim::claim_batch(&mut tx, &filter).await?;
        if claimed.is_empty() {
            tx.rollback().await?;
            return Ok(deleted);
        }
        let ids: Vec<i64> = claimed.iter().map(|m| m.id).collect();
        deleted += outbox::delete_published(&mut tx, &ids).await?;
        tx.commit().await.context("committing a lock batch")?;
    }
}

type LeasedRow = (
    i64,
    String,
    Option<String>,
    String,
    Vec<u8>,
    sqlx::types::Json<serde_json::Value>,
    i32,
    DateTime<Utc>,
);

/// EXPERIMENTAL, bench only: the lease alternative the issue asks to compare. It is not the
/// dispatcher's protocol (see `outbox_shared::store::claim`). The lease columns are in no index,
/// so `pubsub_outbox_claimable_idx` still serves the walk and the lease test is a filter over it.
const LEASE_CLAIM: &str = "UPDATE pubsub_outbox
     SET lease_owner = $1, lease_expires_at = now() + interval '60 s'
     WHERE id = ANY(ARRAY(
         SELECT id FROM pubsub_outbox
         WHERE published_at IS NULL AND ordering_key IS NULL AND next_attempt_at <= now()
           AND (lease_expires_at IS NULL OR lease_expires_at < now())
         ORDER BY next_attempt_at, id
         LIMIT $2
         FOR UPDATE SKIP LOCKED))
     RETURNING id, topic, ordering_key, dedupe_key, payload, attributes, attempts, created_at";

/// The lease protocol: claim = write a lease and commit (autocommit statement); the publish
/// would run here with no transaction open; settle = delete what this worker still owns.
async fn drain_lease(pool: &PgPool, owner: &str, batch: i64) -> Result<u64> {
    let mut deleted = 0;
    loop {
        let leased: Vec<LeasedRow> = sqlx::query_as(LEASE_CLAIM)
            .bind(owner)
            .bind(batch)
            .fetch_all(pool)
            .await
            .context("leasing rows")?;
        if leased.is_empty() {
            return Ok(deleted);
        }
        let ids: Vec<i64> = leased.iter().map(|r| r.0).collect();
        // The owner check keeps a worker whose lease expired from settling another's claim.
        deleted += sqlx::query("DELETE FROM pubsub_outbox WHERE id = ANY($1) AND lease_owner = $2")
            .bind(&ids)
            .bind(owner)
            .execute(pool)
            .await
            .context("deleting leased rows")?
            .rows_affected();
    }
}

/// One dispatch drain.
#[derive(Debug, Clone, Copy)]
struct DispatchRun {
    rate: f64,
    mean_batch: f64,
    publish_share: f64,
}

async fn dispatch_bench(db: &Scratch, args: &DispatchArgs) -> Result<()> {
    let endpoint = format!("http://{}", args.pubsub_emulator_host);
    let admin = TopicAdmin::builder()
        .with_endpoint(endpoint.clone())
        .with_credentials(google_cloud_auth::credentials::anonymous::Builder::new().build())
        .build()
        .await
        .context("building the topic admin client")?;
    let topic = format!(
        "projects/{}/topics/outbox-bench-{}",
        args.pubsub_project,
        std::process::id()
    );
    // The official client hangs rather than fails on a wrong endpoint: bound the first call.
    tokio::time::timeout(
        Duration::from_secs(10),
        admin.create_topic().set_name(&topic).send(),
    )
    .await
    .map_err(|_| anyhow!("the Pub/Sub emulator at {endpoint} did not answer within 10 s"))?
    .with_context(|| format!("creating {topic} on the emulator at {endpoint}"))?;
    let outcome = interruptible(dispatch_runs(db, args, &topic)).await;
    let deleted = admin.delete_topic().set_topic(&topic).send().await;
    outcome.and(deleted.map(|_| ()).context("deleting the bench topic"))
}

/// A dispatcher context and the registry its metrics are read from.
struct Dispatcher {
    dispatch: Arc<Dispatch<PubsubPublisher>>,
    registry: Registry,
}

/// Builds what the dispatcher's service builds: one Pub/Sub client, one `Dispatch` its workers
/// share.
async fn dispatcher(db: &Scratch, args: &DispatchArgs) -> Result<Dispatcher> {
    let pubsub = PubsubArgs {
        pubsub_emulator_host: Some(args.pubsub_emulator_host.clone()),
        pubsub_endpoint: None,
        pubsub_project: args.pubsub_project.clone(),
        publish_timeout: args.publish_timeout,
        dedupe_attribute: "dedupe_key".to_owned(),
        publish_delay: args.publish_delay,
    };
    let publisher = PubsubPublisher::connect(&pubsub).await?;
    let mut registry = Registry::default();
    let metrics = Arc::new(Metrics::register(&mut registry));
    let breaker = Arc::new(Breaker::new(
        Duration::from_millis(100),
        Duration::from_secs(1),
        metrics.breaker_open.clone(),
    ));
    let settings = BatchSettings {
        batch_size: args.batch_size,
        topics: None,
        retain_published: false,
        dedupe_attribute: "dedupe_key".to_owned(),
        schedule: RetrySchedule::default(),
        key_scan_limit: args.key_scan_limit,
        skip_dead_letter_topics: vec![],
    };
    let dispatch = Arc::new(Dispatch::new(
        db.pool.clone(),
        Arc::new(publisher),
        settings,
        metrics,
        breaker,
        args.max_inflight_bytes,
    ));
    Ok(Dispatcher { dispatch, registry })
}

async fn dispatch_runs(db: &Scratch, args: &DispatchArgs, topic: &str) -> Result<()> {
    let mut shared = None;
    let mut table = Vec::new();
    for keys in &args.keys {
        // The Pub/Sub client keeps per-ordering-key state for its whole life (BENCHMARKS.md), so
        // by default every key spread starts with a fresh client.
        let fresh;
        let Dispatcher { dispatch, registry } = if args.share_publisher {
            match &mut shared {
                Some(d) => &*d,
                None => &*shared.insert(dispatcher(db, args).await?),
            }
        } else {
            fresh = dispatcher(db, args).await?;
            &fresh
        };
        let mut runs = Vec::new();
        for run in 1..=args.runs {
            let enqueue_rate = db
                .refill(args.messages, args.payload_bytes, *keys, topic)
                .await?;
            if let Ok(mut cursor) = dispatch.key_cursor.lock() {
                *cursor = KeyCursor::default();
            }
            let before = histogram_sums(registry)?;
            let started = Instant::now();
            let mut loops = JoinSet::new();
            for _ in 0..args.workers {
                loops.spawn(dispatch_loop(dispatch.clone()));
            }
            let published = join_sum(loops).await?;
            let elapsed = started.elapsed().as_secs_f64();
            let after = histogram_sums(registry)?;
            if published != args.messages {
                bail!(
                    "keys={keys}: published {published} of {} messages",
                    args.messages
                );
            }
            let batches = after.batches - before.batches;
            let r = DispatchRun {
                rate: args.messages as f64 / elapsed,
                mean_batch: (after.claimed - before.claimed) / batches.max(1.0),
                publish_share: (after.publish_seconds - before.publish_seconds)
                    / (elapsed * args.workers as f64),
            };
            println!(
                "dispatch keys={keys} run {run}/{}: enqueue {enqueue_rate:.0} rows/s; drained {} in {elapsed:.2} s \
                 = {:.0} msgs/s; {batches:.0} batches (mean {:.0} rows); publishing {:.0}% of worker time; \
                 bench RSS {} MB; load {}",
                args.runs,
                args.messages,
                r.rate,
                r.mean_batch,
                r.publish_share * 100.0,
                resident_mb(),
                load_average()
            );
            runs.push(r);
        }
        table.push((*keys, runs));
    }
    println!(
        "\n| keys | median msgs/s | min | max | runs | mean batch (rows) | publish share of worker time |"
    );
    println!("|---|---|---|---|---|---|---|");
    for (keys, runs) in &table {
        let rate = summary(runs.iter().map(|r| r.rate));
        println!(
            "| {keys} | {:.0} | {:.0} | {:.0} | {} | {:.0} | {:.0}% |",
            rate.median,
            rate.min,
            rate.max,
            runs.len(),
            summary(runs.iter().map(|r| r.mean_batch)).median,
            summary(runs.iter().map(|r| r.publish_share)).median * 100.0
        );
    }
    Ok(())
}

/// Runs batches until one finds nothing due and the outbox is empty; returns messages published.
/// A failed publish invalidates the run (its retry would wait out a backoff), so it stops the bench.
async fn dispatch_loop(d: Arc<Dispatch<PubsubPublisher>>) -> Result<usize> {
    let mut published = 0;
    loop {
        match run_batch(&d, Utc::now()).await? {
            BatchOutcome::Settled(s) => {
                if s.published != s.claimed {
                    bail!("a batch did not publish everything it claimed: {s:?}");
                }
                published += s.published;
            }
            BatchOutcome::Outage { error, .. } => bail!("Pub/Sub emulator unreachable: {error}"),
            BatchOutcome::Empty => {
                let any: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pubsub_outbox)")
                    .fetch_one(&d.pool)
                    .await?;
                if !any {
                    return Ok(published);
                }
                // Everything left is held by other workers: let them finish.
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
    }
}

/// Sums of the dispatcher's histograms, read from its Prometheus registry.
#[derive(Debug, Default, Clone, Copy)]
struct Sums {
    batches: f64,
    claimed: f64,
    publish_seconds: f64,
}

fn histogram_sums(registry: &Registry) -> Result<Sums> {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, registry)?;
    let mut sums = Sums::default();
    for line in text.lines() {
        let Some((name, value)) = line.split_once(' ') else {
            continue;
        };
        let slot = match name {
            "outbox_batch_size_count" => &mut sums.batches,
            "outbox_batch_size_sum" => &mut sums.claimed,
            "outbox_publish_duration_seconds_sum" => &mut sums.publish_seconds,
            _ => continue,
        };
        *slot = value.parse().context("parsing a metric value")?;
    }
    Ok(sums)
}

#[derive(Debug, Clone, Copy)]
struct Summary {
    median: f64,
    min: f64,
    max: f64,
}

fn summary(values: impl Iterator<Item = f64>) -> Summary {
    let mut v: Vec<f64> = values.collect();
    v.sort_by(f64::total_cmp);
    let median = match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    };
    Summary {
        median,
        min: v.first().copied().unwrap_or(f64::NAN),
        max: v.last().copied().unwrap_or(f64::NAN),
    }
}

/// Parses `250ms` or `20s` (the dispatcher's duration flags take humantime; this binary keeps
/// the test crate's dependencies, and so Cargo.lock, as they are).
fn parse_duration(s: &str) -> Result<Duration, String> {
    let bad = || format!("expected a duration like 5ms or 20s, got {s:?}");
    let (number, unit) = s
        .find(|c: char| !c.is_ascii_digit())
        .map_or((s, ""), |i| s.split_at(i));
    let n: u64 = number.parse().map_err(|_| bad())?;
    match unit {
        "ms" => Ok(Duration::from_millis(n)),
        "s" => Ok(Duration::from_secs(n)),
        _ => Err(bad()),
    }
}

/// This process's resident memory (the Pub/Sub client's per-key state shows here).
fn resident_mb() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kb| kb / 1024)
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".to_owned())
}
