//! `outbox-bench`: the throughput figures in BENCHMARKS.md.
//!
//! - `claim`: drains a filled outbox straight from PostgreSQL (no Pub/Sub) with the dispatcher's
//!   claim protocol (row locks held until the delete commits) and/or a lease alternative; reports
//!   rows/s, enqueue rows/s and WAL bytes per row.
//! - `dispatch`: drains end to end through the dispatcher's unit of work
//!   (`Dispatcher::run_batch`) against the Pub/Sub emulator, per ordering-key spread.
//! - `inbox`: the consumer side: messages/s through `outbox_inbox::Inbox::process` into a table,
//!   and duplicates/s dropped.
//!
//! - `ceiling`, `round-trip`, `latency`, `resources`: the real `dispatcher` binary as child
//!   processes (one or more `--dispatcher-bin label=path`, measured in the same rounds): against
//!   the pipeline ceiling, through added latency, commit -> publish percentiles at a steady
//!   rate, and its memory (module `pipeline`, the process handling in `binary`).
//!
//! - `soak`: steady load for a long time with a snapshot held in the middle, sampled every 10 s
//!   (module `soak`): the claim's cost, latency, the table's size and dead tuples over time.
//!
//! - `peer`: side by side on the same server, interleaved: our DB-only drain (the dispatcher's
//!   lock protocol), a naive one-row-per-transaction loop and Graphile Worker (npm, run from
//!   `tests/bench/graphile/drain.js`; `npm ci --prefix tests/bench/graphile` first); ratios per round.
//! - `producer`: the real `producer` binary against a BigQuery stand-in with a delay per call
//!   and a transfer rate, beside fetching alone and enqueueing alone (module `producer`).
//! - `enqueue`: `enqueue_batch` (`INSERT … SELECT FROM UNNEST`) against binary COPY of the same
//!   rows, one stream, with the COPY encoding verified by reading rows back.
//! - `console`: the console's pages (the real binary) with 10^6 outbox rows and 10^5 dead letters.
//!
//! Every invocation works in its own database (`outbox_bench_<unique>`, created from DATABASE_URL
//! and migrated) and, for `dispatch`, its own topic; both are removed at the end, also after an error
//! or Ctrl-C. The topic has no subscription: the emulator accepts the publishes and keeps nothing.
//!
//! Modules: `claim`, `dispatch`, `inbox`, `peer`, `enqueue` (the benchmarks), `scratch` (the database), `report` (figures).

mod binary;
mod claim;
mod console;
mod dispatch;
mod enqueue;
mod inbox;
mod peer;
mod pipeline;
mod producer;
mod report;
mod scratch;
mod soak;
mod trace_cost;

use std::process::ExitCode;

use anyhow::{Context, Result, anyhow};
use clap::{Parser, Subcommand};
use outbox_runtime::telemetry::{self, TelemetryArgs};
use tokio::task::JoinSet;

use crate::report::load_average;
use crate::scratch::Scratch;

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
    Claim(claim::ClaimArgs),
    /// Drain an outbox end to end through the dispatcher's run_batch into the Pub/Sub emulator.
    Dispatch(dispatch::DispatchArgs),
    /// Process messages through the consumer inbox into a table, then drop them as duplicates.
    Inbox(inbox::InboxArgs),
    /// The real dispatcher binary against the pipeline ceiling (DB-only drain and a tight
    /// publisher in the same rounds), unkeyed and keyed.
    Ceiling(pipeline::CeilingArgs),
    /// The real dispatcher binary through a proxy adding latency: 1/4 workers, 1/3 processes.
    RoundTrip(pipeline::RoundTripArgs),
    /// Scale-out: 1, 2 and 3 dispatcher processes (4 workers each) through the latency proxy,
    /// same rows, same rounds: do replicas add up? (`--latency 10ms` is 20 ms per round trip.)
    Scale(pipeline::RoundTripArgs),
    /// Commit -> publish latency at a steady rate of single-row transactions (NOTIFY, poll-only).
    Latency(pipeline::LatencyArgs),
    /// The real dispatcher binary's resident memory idle and draining.
    Resources(pipeline::ResourcesArgs),
    /// Steady load for an hour (or 170 s with --short) through 2 dispatcher processes, a
    /// REPEATABLE READ snapshot held in the middle; samples every 10 s, a plot, the verdict.
    Soak(soak::SoakArgs),
    /// Our DB-only drain against a one-row-per-transaction loop and Graphile Worker, interleaved.
    Peer(peer::PeerArgs),
    /// enqueue_batch (INSERT … SELECT FROM UNNEST) against binary COPY of the same rows.
    Enqueue(enqueue::EnqueueArgs),
    /// The real producer binary against a BigQuery stand-in (delay per call, transfer rate),
    /// with fetching alone (its dry run) and enqueueing alone in the same rounds.
    Producer(producer::ProducerArgs),
    /// The console's pages with a large outbox (10^6 rows, 10^5 dead letters): ms per page.
    Console(console::ConsoleArgs),
    /// What tracing costs the real dispatcher binary, unkeyed: off (before/after), off with a
    /// context in every row, on at 10 % and at 100 % sampled, exporting to a stand-in receiver.
    Tracing(trace_cost::TracingArgs),
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
        Command::Inbox(a) => a.workers,
        Command::Ceiling(a) => a.workers,
        Command::RoundTrip(_)
        | Command::Scale(_)
        | Command::Latency(_)
        | Command::Resources(_)
        | Command::Soak(_) => 4,
        Command::Peer(a) => a.workers,
        Command::Enqueue(_) | Command::Producer(_) | Command::Console(_) => 1,
        Command::Tracing(a) => a.workers,
    };
    println!("load average at start: {}", load_average());
    let db = Scratch::create(&cli.database_url, workers.max(1)).await?;
    let outcome = match &cli.command {
        Command::Claim(a) => interruptible(claim::claim_bench(&db, a)).await,
        Command::Dispatch(a) => dispatch::dispatch_bench(&db, a).await,
        Command::Inbox(a) => interruptible(inbox::inbox_bench(&db, a)).await,
        Command::Ceiling(a) => interruptible(pipeline::ceiling_bench(&db, a)).await,
        Command::RoundTrip(a) => {
            interruptible(pipeline::round_trip_bench(
                &db,
                a,
                pipeline::ROUND_TRIP_SHAPES,
            ))
            .await
        }
        Command::Scale(a) => {
            interruptible(pipeline::round_trip_bench(&db, a, pipeline::SCALE_SHAPES)).await
        }
        Command::Latency(a) => interruptible(pipeline::latency_bench(&db, a)).await,
        Command::Resources(a) => interruptible(pipeline::resources_bench(&db, a)).await,
        Command::Soak(a) => interruptible(soak::soak_bench(&db, a)).await,
        Command::Peer(a) => interruptible(peer::peer_bench(&db, a)).await,
        Command::Enqueue(a) => interruptible(enqueue::enqueue_bench(&db, a)).await,
        Command::Producer(a) => interruptible(producer::producer_bench(&db, a)).await,
        Command::Console(a) => interruptible(console::console_bench(&db, a)).await,
        Command::Tracing(a) => interruptible(trace_cost::tracing_bench(&db, a)).await,
    };
    db.pool.close().await;
    // Dropping the scratch database removes it.
    drop(db);
    println!("load average at end: {}", load_average());
    outcome
}

/// Waits for every worker and adds up what they did. The first failure returns at once, and
/// dropping the set (also on Ctrl-C) aborts the other workers.
pub async fn join_sum<T: std::iter::Sum<T> + Send + 'static>(
    mut workers: JoinSet<Result<T>>,
) -> Result<T> {
    let mut done = Vec::with_capacity(workers.len());
    while let Some(joined) = workers.join_next().await {
        done.push(joined.context("a worker task panicked")??);
    }
    Ok(done.into_iter().sum())
}

/// Runs `work` unless Ctrl-C comes first, so the caller still removes what it created.
pub async fn interruptible(work: impl Future<Output = Result<()>>) -> Result<()> {
    tokio::select! {
        r = work => r,
        _ = tokio::signal::ctrl_c() => Err(anyhow!("interrupted")),
    }
}
