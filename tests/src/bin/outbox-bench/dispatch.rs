//! `outbox-bench dispatch`: drains end to end through the dispatcher's unit of work
//! (`Dispatcher::run_batch`) against the Pub/Sub emulator, per ordering-key spread.

use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use chrono::Utc;
use google_cloud_pubsub::client::{SchemaService, TopicAdmin};
use google_cloud_pubsub::model::{Encoding, Schema, SchemaSettings, schema};
use outbox_dispatcher::config::PubsubConfig;
use outbox_dispatcher::publisher::PubsubPublisher;
use outbox_dispatcher::{BatchOutcome, Dispatcher, DispatcherConfig, connect_database};
use outbox_runtime::db::DatabaseArgs;
use sqlx::PgPool;
use tokio::task::JoinSet;

use crate::report::{load_average, parse_duration, resident_mb, summary};
use crate::scratch::Scratch;
use crate::{interruptible, join_sum};

/// How messages spread over ordering keys: none, or round-robin over N keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Keys(pub Option<usize>);

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

#[derive(Debug, Clone, clap::Args)]
pub struct DispatchArgs {
    /// Ordering-key spreads to measure, comma-separated: `none` (no key) or N (message i gets
    /// key `key-(i % N)`).
    #[arg(long, value_delimiter = ',', default_value = "none,10,1000,100000")]
    pub keys: Vec<Keys>,
    /// Messages in the outbox at the start of each drain.
    #[arg(long, default_value_t = 100_000)]
    pub messages: usize,
    /// Concurrent run_batch loops sharing one dispatcher.
    #[arg(long, default_value_t = 4)]
    pub workers: usize,
    /// Rows per claim (the dispatcher's --batch-size, 1..=1000).
    #[arg(long, default_value_t = 500)]
    pub batch_size: i64,
    /// Drains per key spread (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Payload bytes per message.
    #[arg(long, default_value_t = 1024)]
    pub payload_bytes: usize,
    /// Ordering keys visited per ordered claim (the dispatcher's --key-scan-limit).
    #[arg(long, default_value_t = 2000)]
    pub key_scan_limit: i64,
    /// Pub/Sub emulator host:port (use a private one: the bench publishes at full speed).
    #[arg(long, env = "PUBSUB_EMULATOR_HOST", default_value = "127.0.0.1:8085")]
    pub pubsub_emulator_host: String,
    /// Added latency per direction through a TCP proxy in front of the emulator (e.g. 20ms, a
    /// stand-in for the round trip to real Pub/Sub); 0 publishes directly.
    #[arg(long, default_value = "0ms", value_parser = parse_duration)]
    pub pubsub_latency: Duration,
    /// Project of the bench topic.
    #[arg(long, env = "PUBSUB_PROJECT_ID", default_value = "outbox-bench")]
    pub pubsub_project: String,
    /// Upper bound on one batch publish (the dispatcher's --publish-timeout).
    #[arg(long, default_value = "20s", value_parser = parse_duration)]
    pub publish_timeout: Duration,
    /// Payload bytes in flight across workers (the dispatcher's --max-inflight-bytes).
    #[arg(long, default_value_t = 64 * 1024 * 1024)]
    pub max_inflight_bytes: u64,
    /// Keep one Pub/Sub client for every key spread, as a long-running dispatcher does, instead
    /// of a fresh one per spread (keyed publishers live one batch either way).
    #[arg(long, default_value_t = false)]
    pub share_publisher: bool,
    /// A poison storm: the bench topic validates every message against an Avro schema (JSON),
    /// payloads are small invoices, and this percentage of them breaks the schema (Pub/Sub refuses
    /// a whole request then). Each run drains the spread twice, clean and poisoned, and reports
    /// the good messages/s of both; exactly the poisoned rows must be dead-lettered. 0: off.
    #[arg(long, default_value_t = 0.0)]
    pub poison_percent: f64,
}

/// What a drain's payloads are.
#[derive(Debug, Clone, Copy)]
enum Payloads {
    /// `--payload-bytes` of filler (the topic has no schema).
    Filler,
    /// Invoices for the schema topic; every `n`-th breaks the schema (None: none does).
    Invoices(Option<usize>),
}

impl Payloads {
    fn poisoned(self, i: usize) -> bool {
        matches!(self, Self::Invoices(Some(n)) if i % n == n / 2)
    }

    fn count_poisoned(self, messages: usize) -> usize {
        (0..messages).filter(|i| self.poisoned(*i)).count()
    }
}

/// One dispatch drain.
#[derive(Debug, Clone, Copy)]
struct DispatchRun {
    /// Good (published) messages per second.
    rate: f64,
    mean_batch: f64,
    publish_share: f64,
}

pub async fn dispatch_bench(db: &Scratch, args: &DispatchArgs) -> Result<()> {
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
    let schema = if args.poison_percent > 0.0 {
        Some(invoice_schema(&endpoint, &args.pubsub_project).await?)
    } else {
        None
    };
    let settings = schema.map(|s| {
        SchemaSettings::new()
            .set_schema(s)
            .set_encoding(Encoding::Json)
    });
    // The official client hangs rather than fails on a wrong endpoint: bound the first call.
    tokio::time::timeout(
        Duration::from_secs(10),
        admin
            .create_topic()
            .set_name(&topic)
            .set_or_clear_schema_settings(settings)
            .send(),
    )
    .await
    .map_err(|_| anyhow!("the Pub/Sub emulator at {endpoint} did not answer within 10 s"))?
    .with_context(|| format!("creating {topic} on the emulator at {endpoint}"))?;
    // With added latency the dispatcher publishes through a proxy that also counts the requests
    // in flight (HTTP/2 streams).
    let proxy = if args.pubsub_latency.is_zero() {
        None
    } else {
        let proxy = harness::proxy::TcpProxy::start(&args.pubsub_emulator_host).await;
        proxy.set_delay(args.pubsub_latency);
        Some(proxy)
    };
    let mut args = args.clone();
    if let Some(p) = &proxy {
        args.pubsub_emulator_host = p.addr();
    }
    let outcome = interruptible(dispatch_runs(db, &args, &topic)).await;
    if let Some(p) = &proxy {
        println!(
            "through a proxy adding {:?} per direction: at most {} publish requests in flight at once",
            args.pubsub_latency,
            p.max_requests_in_flight()
        );
    }
    let deleted = admin.delete_topic().set_topic(&topic).send().await;
    outcome.and(deleted.map(|_| ()).context("deleting the bench topic"))
}

/// Creates the invoice schema (`harness::pubsub::INVOICE_SCHEMA`) in `project`; returns its name.
async fn invoice_schema(endpoint: &str, project: &str) -> Result<String> {
    let client = SchemaService::builder()
        .with_endpoint(endpoint.to_owned())
        .with_credentials(google_cloud_auth::credentials::anonymous::Builder::new().build())
        .build()
        .await
        .context("building the schema client")?;
    let id = format!("outbox-bench-invoice-{}", std::process::id());
    client
        .create_schema()
        .set_parent(format!("projects/{project}"))
        .set_schema_id(&id)
        .set_schema(
            Schema::new()
                .set_type(schema::Type::Avro)
                .set_definition(harness::pubsub::INVOICE_SCHEMA),
        )
        .send()
        .await
        .context("creating the invoice schema on the emulator")?;
    Ok(format!("projects/{project}/schemas/{id}"))
}

/// Builds a dispatcher exactly as the service does (one Pub/Sub client, one dispatcher its
/// workers share), on the bench database, publishing with `publisher`.
async fn dispatcher(
    db: &Scratch,
    args: &DispatchArgs,
    topic: &str,
    publisher: PubsubPublisher,
) -> Result<Arc<Dispatcher<PubsubPublisher>>> {
    let mut config = config(args);
    if args.poison_percent > 0.0 {
        // A poisoned keyed message must not hold its key's later rows for ever (the drain ends
        // when the outbox is empty): the storm topic's keys skip dead letters.
        config.batch.skip_dead_letter_topics = vec![topic.to_owned()];
    }
    let pool = connect_database(&DatabaseArgs::for_url(db.db.url()), &config).await?;
    Ok(Arc::new(Dispatcher::build(config, pool, publisher).await?))
}

fn config(args: &DispatchArgs) -> DispatcherConfig {
    let mut c = DispatcherConfig {
        pubsub: PubsubConfig {
            publish_timeout: args.publish_timeout,
            ..PubsubConfig::emulator(&args.pubsub_emulator_host, &args.pubsub_project)
        },
        workers: args.workers,
        max_inflight_bytes: args.max_inflight_bytes,
        listen_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
        ..DispatcherConfig::default()
    };
    c.batch.batch_size = args.batch_size;
    c.batch.key_scan_limit = args.key_scan_limit;
    c
}

async fn dispatch_runs(db: &Scratch, args: &DispatchArgs, topic: &str) -> Result<()> {
    let pubsub = config(args).pubsub;
    let mut shared = None;
    let mut table = Vec::new();
    for keys in &args.keys {
        // By default every key spread starts with a fresh client (its unkeyed publishers and
        // channel warm up again); `--share-publisher` keeps one, as a long-running dispatcher does.
        let publisher = match &shared {
            Some(p) if args.share_publisher => Clone::clone(p),
            _ => PubsubPublisher::connect(&pubsub).await?,
        };
        shared = Some(publisher.clone());
        let kinds: Vec<(&str, Payloads)> = if args.poison_percent > 0.0 {
            let every = (100.0 / args.poison_percent).round().max(1.0) as usize;
            vec![
                ("clean", Payloads::Invoices(None)),
                ("poisoned", Payloads::Invoices(Some(every))),
            ]
        } else {
            vec![("", Payloads::Filler)]
        };
        for (label, payloads) in kinds {
            let mut runs = Vec::new();
            for run in 1..=args.runs {
                runs.push(drain(db, args, topic, *keys, payloads, &publisher, run).await?);
            }
            let spread = if label.is_empty() {
                keys.to_string()
            } else {
                format!("{keys} {label}")
            };
            table.push((spread, runs));
        }
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

/// One drain of `keys`' spread with `payloads`: fills the outbox, drains it with a fresh
/// dispatcher (same client), checks that every good message was published and exactly the
/// poisoned ones dead-lettered.
async fn drain(
    db: &Scratch,
    args: &DispatchArgs,
    topic: &str,
    keys: Keys,
    payloads: Payloads,
    publisher: &PubsubPublisher,
    run: usize,
) -> Result<DispatchRun> {
    let enqueue_rate = match payloads {
        Payloads::Filler => {
            db.refill(args.messages, args.payload_bytes, keys, topic)
                .await?
        }
        Payloads::Invoices(_) => {
            db.refill_with(args.messages, keys, topic, |i| {
                if payloads.poisoned(i) {
                    format!(r#"{{"amount": "not a number {i}"}}"#).into_bytes()
                } else {
                    format!(r#"{{"amount": {i}}}"#).into_bytes()
                }
            })
            .await?
        }
    };
    let poisoned = payloads.count_poisoned(args.messages);
    // A fresh dispatcher per run (same client): every run starts its key walk afresh.
    let dispatcher = dispatcher(db, args, topic, publisher.clone()).await?;
    let before = histogram_sums(&dispatcher)?;
    let started = Instant::now();
    let mut loops = JoinSet::new();
    for _ in 0..args.workers {
        loops.spawn(dispatch_loop(dispatcher.clone(), db.db.pool.clone()));
    }
    let published = join_sum(loops).await?;
    let elapsed = started.elapsed().as_secs_f64();
    let after = histogram_sums(&dispatcher)?;
    let dead: i64 = sqlx::query_scalar("SELECT count(*) FROM pubsub_outbox_dead_letter")
        .fetch_one(&db.db.pool)
        .await?;
    if published != args.messages - poisoned || dead != poisoned as i64 {
        bail!(
            "keys={keys}: published {published} and dead-lettered {dead} of {} messages ({poisoned} poisoned)",
            args.messages
        );
    }
    let batches = after.batches - before.batches;
    let r = DispatchRun {
        rate: published as f64 / elapsed,
        mean_batch: (after.claimed - before.claimed) / batches.max(1.0),
        publish_share: (after.publish_seconds - before.publish_seconds)
            / (elapsed * args.workers as f64),
    };
    println!(
        "dispatch keys={keys} run {run}/{}: enqueue {enqueue_rate:.0} rows/s; drained {} in {elapsed:.2} s \
         = {:.0} good msgs/s ({poisoned} dead-lettered); {batches:.0} batches (mean {:.0} rows); \
         publishing {:.0}% of worker time; bench RSS {} MB; load {}",
        args.runs,
        args.messages,
        r.rate,
        r.mean_batch,
        r.publish_share * 100.0,
        resident_mb(),
        load_average()
    );
    Ok(r)
}

/// Runs batches until one finds nothing due and the outbox is empty; returns messages published.
/// A failed publish invalidates the run (its retry would wait out a backoff), so it stops the bench.
async fn dispatch_loop(d: Arc<Dispatcher<PubsubPublisher>>, pool: PgPool) -> Result<usize> {
    let mut published = 0;
    loop {
        match d.run_batch(Utc::now()).await? {
            BatchOutcome::Settled(s) => {
                if s.published + s.dead_lettered != s.claimed {
                    bail!("a batch did not publish (or dead-letter) everything it claimed: {s:?}");
                }
                published += s.published;
            }
            BatchOutcome::Outage { error, .. } => bail!("Pub/Sub emulator unreachable: {error}"),
            BatchOutcome::Empty => {
                let any: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pubsub_outbox)")
                    .fetch_one(&pool)
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

/// Sums of the dispatcher's histograms, read from its metrics.
#[derive(Debug, Default, Clone, Copy)]
struct Sums {
    batches: f64,
    claimed: f64,
    publish_seconds: f64,
}

fn histogram_sums(d: &Dispatcher<PubsubPublisher>) -> Result<Sums> {
    let text = d.encode_metrics();
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
