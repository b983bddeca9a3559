//! `outbox-chaos`: proves "nothing lost, order kept" while dispatchers, the producer, Pub/Sub and
//! PostgreSQL fail at random moments (docs/testing.md, "Chaos"; `scripts/chaos` starts its stack).
//!
//! One run: a scratch database on the private cluster, three topics on the private emulator
//! (one with a schema), a BigQuery table on bqemulator; applications write a steady stream of
//! keyed and unkeyed rows (a few deliberately unpublishable), the producer runs on a short
//! schedule against the growing table, three dispatcher processes publish through a
//! fault-injecting proxy, and a seeded schedule of faults hits them. An independent subscriber
//! records every arrival; the verdict (`DeliveryLedger`) then judges the run. The application
//! topic has a second subscription consumed through the inbox (`outbox_inbox`; aborted and
//! restarted at seeded moments with `--inbox-kills`): every key delivered must have its effect
//! exactly once.
//!
//! Modules: `plan` (what a mode does, the seeded fault schedule), `stack` (the services, the
//! proxy, child processes, PostgreSQL restarts), `load` (writers, BigQuery rows, producer
//! schedule), `faults` (executing the schedule), `verdict` (the subscriber and the checks),
//! `inbox` (the inbox consumer, its kills and its exactly-once check),
//! `report` (figures, JSON, the summary line), `session` (one run, start to verdict).

mod faults;
mod inbox;
mod load;
mod plan;
mod report;
mod session;
mod stack;
mod verdict;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Result, anyhow};
use clap::Parser;

use crate::plan::{Mode, Plan};

/// Chaos run of the whole pipeline: faults at random moments, then an independent verdict.
///
/// Normally started by `scripts/chaos --short|--long`, which brings up a private stack
/// (PostgreSQL cluster, Pub/Sub emulator, bqemulator) and passes its locations here.
#[derive(Debug, Parser)]
#[command(name = "outbox-chaos")]
struct Cli {
    /// The CI mode: about 20,000 rows, every fault kind at least once, a few minutes.
    #[arg(long, conflicts_with = "long")]
    short: bool,
    /// 1,000,000 rows, >= 20 dispatcher kills, >= 2 Pub/Sub outages of each kind, 2 PostgreSQL
    /// restarts (run by hand; tens of minutes).
    #[arg(long)]
    long: bool,
    /// Seed of the load and the fault schedule (printed at the start; replays a run's schedule).
    #[arg(long, env = "OUTBOX_CHAOS_SEED")]
    seed: Option<u64>,
    /// Override the mode's number of source rows.
    #[arg(long)]
    rows: Option<usize>,
    /// Override the mode's load duration in seconds (faults happen within it).
    #[arg(long)]
    load_seconds: Option<u64>,
    /// Abort and restart the inbox consumer this many times at seeded moments. Off by default:
    /// the emulator never ends a stream its client dropped, and on the ordered subscription such
    /// a stream keeps its ordering keys, so their messages go nowhere (docs/testing.md, "Chaos").
    #[arg(long, env = "OUTBOX_CHAOS_INBOX_KILLS", default_value_t = 0)]
    inbox_kills: usize,
    /// Admin URL of the private PostgreSQL cluster (a scratch database is created on it).
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database_url: String,
    /// Data directory of the private cluster (restarted with `pg_ctl restart -m fast`).
    #[arg(long, env = "OUTBOX_CHAOS_PG_DATA")]
    pg_data: PathBuf,
    /// Directory holding pg_ctl.
    #[arg(long, env = "OUTBOX_CHAOS_PG_BINDIR")]
    pg_bindir: PathBuf,
    /// Server log file for the restarted cluster.
    #[arg(long, env = "OUTBOX_CHAOS_PG_LOG")]
    pg_log: PathBuf,
    /// OS user owning the cluster (pg_ctl runs as it when this process runs as root).
    #[arg(long, env = "OUTBOX_PG_OS_USER", default_value = "postgres")]
    pg_os_user: String,
    /// Where the dispatcher and producer binaries are (default: next to this one).
    #[arg(long)]
    bin_dir: Option<PathBuf>,
    /// Directory for child logs and the JSON report (default: a fresh one under the temp dir).
    #[arg(long)]
    work_dir: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("outbox-chaos: error: {e:#}");
            ExitCode::from(2)
        }
    }
}

/// Runs the chaos run unless Ctrl-C or SIGTERM comes first (everything started is dropped, and so
/// stopped, either way). `Ok(passed)`.
async fn run(cli: Cli) -> Result<bool> {
    let mode = match (cli.short, cli.long) {
        (_, true) => Mode::Long,
        _ => Mode::Short,
    };
    let seed = cli.seed.unwrap_or_else(|| fastrand::u64(1..1_000_000));
    let mut plan = Plan::new(mode, seed);
    if let Some(rows) = cli.rows {
        plan.rows = rows;
    }
    if let Some(s) = cli.load_seconds {
        plan.load = std::time::Duration::from_secs(s);
    }
    plan.inbox_kills = cli.inbox_kills;
    plan.schedule();
    let work_dir = match cli.work_dir {
        Some(d) => d,
        None => std::env::temp_dir().join(format!("outbox-chaos-{seed}-{}", std::process::id())),
    };
    std::fs::create_dir_all(&work_dir)?;
    println!(
        "outbox-chaos {} seed={seed} rows={} load={}s (replay: scripts/chaos --{} --seed {seed}); logs in {}",
        mode.name(),
        plan.rows,
        plan.load.as_secs(),
        mode.name(),
        work_dir.display()
    );
    let bin_dir = match cli.bin_dir {
        Some(d) => d,
        None => std::env::current_exe()?
            .parent()
            .map(PathBuf::from)
            .ok_or_else(|| anyhow!("cannot tell this binary's directory; pass --bin-dir"))?,
    };
    let pg = stack::PgControl {
        bindir: cli.pg_bindir,
        data: cli.pg_data,
        log: cli.pg_log,
        os_user: cli.pg_os_user,
    };
    let stack = stack::Stack::start(&cli.database_url, pg, bin_dir, work_dir.clone()).await?;
    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let outcome = tokio::select! {
        r = session::run(&stack, &plan) => r,
        _ = tokio::signal::ctrl_c() => Err(anyhow!("interrupted (Ctrl-C)")),
        _ = sigterm.recv() => Err(anyhow!("interrupted (SIGTERM)")),
    };
    stack.stop().await;
    let report = outcome?;
    let path = work_dir.join("report.json");
    std::fs::write(&path, serde_json::to_string_pretty(&report.json())?)?;
    report.print(&path);
    Ok(report.passed())
}
