//! The dispatcher binary: parse configuration, start telemetry, hand over to the library.

use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use outbox_dispatcher::{Cli, Command};

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    outbox_shared::telemetry::init(&cli.telemetry);
    match run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = format!("{e:#}"), "dispatcher failed");
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command.unwrap_or(Command::Run) {
        Command::Migrate => {
            let pool = outbox_shared::db::connect(&cli.database, "pubsub-outbox-migrate").await?;
            outbox_shared::db::migrate(&pool)
                .await
                .context("applying migrations")?;
            tracing::info!("migrations applied");
            Ok(())
        }
        Command::Run => {
            let shutdown = outbox_shared::shutdown::on_signals();
            outbox_dispatcher::service::run(&cli, shutdown)
                .await
                .context("running the dispatcher")
        }
    }
}
