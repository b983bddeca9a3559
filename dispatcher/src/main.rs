//! The dispatcher binary: parse and validate configuration, start telemetry, hand over to the
//! library, map the result to an exit code (0 ok, 1 failed, 2 bad configuration, 130 stopped by a
//! second signal).

use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use outbox_dispatcher::fault::FaultInjector;
use outbox_dispatcher::publisher::PubsubPublisher;
use outbox_dispatcher::{Cli, Command, Dispatcher, DispatcherConfig};
use outbox_runtime::shutdown::{Shutdown, on_signals};

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    outbox_runtime::telemetry::init(&cli.telemetry);
    let config = match DispatcherConfig::try_from(&cli) {
        Ok(config) => config,
        Err(e) => {
            eprintln!("error: invalid configuration: {e}");
            return ExitCode::from(2);
        }
    };
    let signals = on_signals();
    let outcome = tokio::select! {
        outcome = run(&cli, config, signals.shutdown) => outcome,
        () = stopped(signals.abort) => {
            tracing::warn!("Second signal: exiting now; the rows in flight will be claimed again.");
            return ExitCode::from(130);
        }
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = format!("{e:#}"), "The dispatcher failed.");
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: &Cli, config: DispatcherConfig, shutdown: Shutdown) -> anyhow::Result<()> {
    let pool = outbox_dispatcher::connect_database(&cli.database, &config).await?;
    if let Some(Command::Migrate) = cli.command {
        outbox_shared::migrate(&pool)
            .await
            .context("applying migrations")?;
        tracing::info!("Migrations applied.");
        return Ok(());
    }
    let publisher = PubsubPublisher::connect(&config.pubsub).await?;
    let publisher = FaultInjector::with_settings(publisher, &config.faults);
    let dispatcher = Dispatcher::build(config, pool, publisher).await?;
    dispatcher
        .run_until_stopped(shutdown)
        .await
        .context("running the dispatcher")
}

async fn stopped(mut abort: Shutdown) {
    abort.requested().await;
}
