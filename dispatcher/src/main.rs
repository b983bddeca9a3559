//! The dispatcher binary: parse and validate configuration, start telemetry, hand over to the
//! library, map the result to an exit code (0 ok, 1 failed, 2 bad configuration, 3 nothing
//! matched (operator commands), 130 stopped by a second signal).

use std::process::ExitCode;

use anyhow::Context;
use outbox_dispatcher::cli::RunArgs;
use outbox_dispatcher::fault::FaultInjector;
use outbox_dispatcher::publisher::PubsubPublisher;
use outbox_dispatcher::{Cli, Command, Dispatcher, DispatcherConfig};
use outbox_runtime::operator::{Exit, describe};
use outbox_runtime::shutdown::{Shutdown, on_signals};

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse_args();
    outbox_runtime::telemetry::init(cli.telemetry());
    let args = match &cli.command {
        Command::Ops(op) => return op.run().await.into(),
        Command::Migrate(m) => return migrate(&m.database).await.into(),
        Command::Run(args) => args,
    };
    let config = match DispatcherConfig::try_from(args) {
        Ok(config) => config,
        Err(e) => {
            eprintln!("error: invalid configuration: {e}");
            return Exit::Usage.into();
        }
    };
    let signals = on_signals();
    let outcome = tokio::select! {
        outcome = run(args, config, signals.shutdown) => outcome,
        () = stopped(signals.abort) => {
            tracing::warn!("Second signal: exiting now; the rows in flight will be claimed again.");
            return ExitCode::from(130);
        }
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let text = describe(e.as_ref());
            tracing::error!(error = %text, "The dispatcher failed.");
            eprintln!("error: {text}");
            ExitCode::FAILURE
        }
    }
}

async fn migrate(database: &outbox_runtime::db::DatabaseArgs) -> Exit {
    let applied = async {
        let pool = outbox_runtime::db::connect(database, "pubsub-outbox-migrate").await?;
        outbox_shared::migrate(&pool).await?;
        pool.close().await;
        anyhow::Ok(())
    };
    match applied.await {
        Ok(()) => {
            tracing::info!("Migrations applied.");
            Exit::Ok
        }
        Err(e) => {
            eprintln!("error: {}", describe(e.as_ref()));
            Exit::Failed
        }
    }
}

async fn run(args: &RunArgs, config: DispatcherConfig, shutdown: Shutdown) -> anyhow::Result<()> {
    let pool = outbox_dispatcher::connect_database(&args.database, &config).await?;
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
