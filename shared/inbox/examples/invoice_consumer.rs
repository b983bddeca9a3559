//! An example consumer: applies invoice events from a Pub/Sub subscription to the `invoice` table
//! exactly once, through the inbox, with the official `google-cloud-pubsub` subscriber
//! (streaming pull).
//!
//! An event is a JSON object with `order_id` (the invoice), `customer_id`, `status` and `total`
//! (strings or numbers): the demo's `orders` messages are such events. Applying one upserts the
//! invoice's current state and adds 1 to its `events_applied`, a deliberately non-idempotent
//! write: processed twice, an event would show as 2.
//!
//! ```sh
//! eval "$(scripts/services up)"
//! cargo run -p pubsub-outbox-inbox --features pubsub --example invoice_consumer -- \
//!     --subscription demo-orders-billing --stop-when-idle 3s
//! ```
//!
//! It runs until SIGTERM/SIGINT (or `--stop-when-idle`), then prints what the inbox counted.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result, anyhow};
use clap::Parser;
use google_cloud_pubsub::client::Subscriber;
use google_cloud_pubsub::model::Message;
use outbox_inbox::Inbox;
use outbox_inbox::pubsub::{ConsumeOptions, consume};
use serde_json::Value;
use sqlx::PgConnection;
use sqlx::postgres::PgPoolOptions;

/// Applies invoice events from a Pub/Sub subscription to the `invoice` table exactly once.
#[derive(Debug, Parser)]
#[command(name = "invoice_consumer")]
struct Cli {
    /// PostgreSQL URL of the consumer's database (the inbox and the invoice table live there).
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database_url: String,
    /// Subscription: `projects/<p>/subscriptions/<s>` or a short name (with --pubsub-project).
    #[arg(long, env = "INVOICE_SUBSCRIPTION")]
    subscription: String,
    /// Project for a short subscription name.
    #[arg(long, env = "PUBSUB_PROJECT_ID")]
    pubsub_project: Option<String>,
    /// Use the Pub/Sub emulator at HOST:PORT (anonymous credentials, plain HTTP).
    #[arg(long, env = "PUBSUB_EMULATOR_HOST")]
    pubsub_emulator_host: Option<String>,
    /// The name the inbox keys on (default: the subscription's short name).
    #[arg(long, env = "INVOICE_CONSUMER_NAME")]
    consumer: Option<String>,
    /// The attribute carrying the dedupe key.
    #[arg(long, env = "OUTBOX_DEDUPE_ATTRIBUTE", default_value = outbox_shared::DEFAULT_DEDUPE_ATTRIBUTE)]
    dedupe_attribute: String,
    /// Concurrent sequential lanes (an ordering key stays on one lane).
    #[arg(long, env = "INVOICE_LANES", default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..=256))]
    lanes: u16,
    /// How far the client extends a message's lease at a time, and the stream's ack deadline
    /// (the client sends it as `stream_ack_deadline_seconds`, which overrides the
    /// subscription's): a crashed consumer's messages are redelivered up to this long after it
    /// died (10s to 10m).
    #[arg(long, env = "INVOICE_LEASE_EXTENSION", default_value = "60s", value_parser = humantime::parse_duration)]
    lease_extension: Duration,
    /// Exit when no message arrived for this long (e.g. `3s`); default: run until a signal.
    #[arg(long, env = "INVOICE_STOP_WHEN_IDLE", value_parser = humantime::parse_duration)]
    stop_when_idle: Option<Duration>,
    /// Keep inbox rows this long (longer than the subscription's message retention).
    #[arg(long, env = "INVOICE_INBOX_RETENTION", default_value = "8days", value_parser = humantime::parse_duration)]
    retention: Duration,
    /// How often to purge inbox rows older than --retention.
    #[arg(long, env = "INVOICE_PURGE_INTERVAL", default_value = "10m", value_parser = humantime::parse_duration)]
    purge_interval: Duration,
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    match run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("invoice_consumer: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> Result<()> {
    let subscription = full_subscription_name(&cli.subscription, cli.pubsub_project.as_deref())?;
    let short = subscription.rsplit('/').next().unwrap_or(&subscription);
    let consumer = cli.consumer.clone().unwrap_or_else(|| short.to_owned());

    let pool = PgPoolOptions::new()
        .max_connections(u32::from(cli.lanes) + 2)
        .acquire_timeout(Duration::from_secs(10))
        .connect(&cli.database_url)
        .await
        .context("connecting to --database-url; check it and that PostgreSQL is up")?;
    outbox_inbox::migrate(&pool).await?;
    create_invoice_table(&pool).await?;
    let inbox = Inbox::new(pool);

    let mut builder = Subscriber::builder();
    if let Some(host) = &cli.pubsub_emulator_host {
        // The official client ignores PUBSUB_EMULATOR_HOST: point it there and go anonymous.
        builder = builder
            .with_endpoint(format!("http://{host}"))
            .with_credentials(google_cloud_auth::credentials::anonymous::Builder::new().build());
    }
    let client = builder
        .build()
        .await
        .context("building the Pub/Sub subscriber (check credentials or --pubsub-emulator-host)")?;
    let options = ConsumeOptions {
        lanes: usize::from(cli.lanes),
        dedupe_attribute: cli.dedupe_attribute.clone(),
        stop_when_idle: cli.stop_when_idle,
        ..ConsumeOptions::new(consumer.clone())
    };
    // Hold only what the lanes work through: the rest of the backlog stays with Pub/Sub for
    // other consumers, and a killed consumer leaves little to wait out.
    let stream = client
        .subscribe(&subscription)
        .set_max_outstanding_messages(options.max_outstanding_messages())
        .set_max_lease_extension(cli.lease_extension)
        .build();

    let purge = tokio::spawn(purge_periodically(
        inbox.clone(),
        cli.retention,
        cli.purge_interval,
    ));
    tracing::info!(%subscription, %consumer, lanes = cli.lanes, "consuming invoice events");
    let consumed = consume(
        &inbox,
        stream,
        &options,
        apply_invoice_event,
        shutdown_signal(),
    )
    .await;
    purge.abort();
    let c = inbox.counters();
    println!(
        "invoice_consumer: processed {}, duplicates dropped {}, failures {}, inbox rows purged {}",
        c.processed, c.duplicates, c.failures, c.purged
    );
    consumed.with_context(|| format!("reading {subscription} failed (does it exist?)"))
}

/// The application's schema (an application would keep this in its own migrations).
async fn create_invoice_table(pool: &sqlx::PgPool) -> Result<()> {
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS invoice (
             invoice_id      text        PRIMARY KEY,
             customer_id     text        NOT NULL,
             status          text        NOT NULL,
             total           numeric     NOT NULL,
             events_applied  integer     NOT NULL,
             last_dedupe_key text        NOT NULL,
             updated_at      timestamptz NOT NULL DEFAULT now())",
    )
    .execute(pool)
    .await
    .context("creating the invoice table")?;
    Ok(())
}

/// The handler: runs inside the inbox's transaction, only for a dedupe key not seen before.
async fn apply_invoice_event(message: &Message, tx: &mut PgConnection) -> Result<()> {
    let event: Value = serde_json::from_slice(&message.data)
        .context("the message data is not JSON (an invoice event is a JSON object)")?;
    let field = |name: &str| -> Result<String> {
        match event.get(name) {
            Some(Value::String(s)) => Ok(s.clone()),
            Some(Value::Number(n)) => Ok(n.to_string()),
            _ => Err(anyhow!(
                "the invoice event has no string or number `{name}`"
            )),
        }
    };
    let dedupe_key = message
        .attributes
        .get(outbox_shared::DEFAULT_DEDUPE_ATTRIBUTE)
        .cloned()
        .unwrap_or_default();
    sqlx::query(
        "INSERT INTO invoice (invoice_id, customer_id, status, total, events_applied, last_dedupe_key)
         VALUES ($1, $2, $3, $4::numeric, 1, $5)
         ON CONFLICT (invoice_id) DO UPDATE SET
             customer_id = EXCLUDED.customer_id, status = EXCLUDED.status, total = EXCLUDED.total,
             events_applied = invoice.events_applied + 1,
             last_dedupe_key = EXCLUDED.last_dedupe_key, updated_at = now()",
    )
    .bind(field("order_id")?)
    .bind(field("customer_id")?)
    .bind(field("status")?)
    .bind(field("total")?)
    .bind(dedupe_key)
    .execute(&mut *tx)
    .await
    .context("applying the invoice event")?;
    Ok(())
}

/// Retention: every `interval`, purge inbox rows older than `retention` in batches of 1,000.
async fn purge_periodically(inbox: Inbox, retention: Duration, interval: Duration) {
    let mut tick = tokio::time::interval(interval);
    loop {
        tick.tick().await;
        match inbox.purge(retention, 1_000).await {
            Ok(0) => {}
            Ok(n) => tracing::info!(rows = n, "purged old inbox rows"),
            Err(e) => tracing::warn!(error = %e, "purging old inbox rows failed; retrying later"),
        }
    }
}

fn full_subscription_name(name: &str, project: Option<&str>) -> Result<String> {
    if name.starts_with("projects/") {
        return Ok(name.to_owned());
    }
    let project = project.ok_or_else(|| {
        anyhow!("--subscription {name:?} is a short name: set --pubsub-project (PUBSUB_PROJECT_ID)")
    })?;
    Ok(format!("projects/{project}/subscriptions/{name}"))
}

/// Completes at the first SIGTERM or SIGINT.
async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        _ = term => {},
        _ = tokio::signal::ctrl_c() => {},
    }
    tracing::info!("signal received: finishing the messages in hand");
}
