//! The dispatcher binary: parse and validate configuration, start telemetry, hand over to the
//! library, map the result to an exit code (`outbox_runtime::exit`: 0 ok, 1 failed at run time, 2
//! configuration or usage, 3 nothing matched (operator commands), 130 stopped by a second signal).

use std::process::ExitCode;

use outbox_dispatcher::cli::RunArgs;
use outbox_dispatcher::fault::FaultInjector;
use outbox_dispatcher::publisher::PubsubPublisher;
use outbox_dispatcher::{Cli, Command, Dispatcher, DispatcherConfig, DispatcherError};
use outbox_runtime::exit::fail;
use outbox_runtime::shutdown::{Shutdown, on_signals};
use outbox_runtime::telemetry::start_with_logs;
use outbox_runtime::traces::Traces;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse_args();
    let format = cli.telemetry().log_format;
    let traces = match start_with_logs(cli.telemetry(), cli.traces(), SERVICE).await {
        Ok(traces) => traces,
        Err(e) => return fail(format, "The dispatcher cannot start", &e).into(),
    };
    let code = command(&cli, &traces).await;
    traces.shutdown().await;
    code
}

/// The name the dispatcher's spans are exported under (`service.name`).
const SERVICE: &str = "pubsub-outbox-dispatcher";

async fn command(cli: &Cli, traces: &Traces) -> ExitCode {
    let args = match &cli.command {
        Command::Ops(op) => return op.run().await.into(),
        Command::Migrate(m) => return outbox_runtime::db::migrate_command(m).await.into(),
        Command::Console(c) => return outbox_dispatcher::console::run(c).await.into(),
        Command::Run(args) => args,
    };
    let format = args.telemetry.log_format;
    let config = match DispatcherConfig::try_from(args) {
        Ok(config) => config,
        Err(e) => {
            return fail(
                format,
                "The dispatcher cannot start",
                &DispatcherError::Config(e),
            )
            .into();
        }
    };
    let signals = on_signals();
    let outcome = tokio::select! {
        outcome = run(args, config, traces, signals.shutdown) => outcome,
        () = stopped(signals.abort) => {
            tracing::warn!("Second signal: exiting now; the rows in flight will be claimed again.");
            return ExitCode::from(130);
        }
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(format, "The dispatcher failed", &e).into(),
    }
}

async fn run(
    args: &RunArgs,
    config: DispatcherConfig,
    traces: &Traces,
    shutdown: Shutdown,
) -> Result<(), DispatcherError> {
    let pool = outbox_dispatcher::connect_database(&args.database, &config).await?;
    let publisher = PubsubPublisher::connect(&config.pubsub)
        .await?
        .with_tracer(traces.tracer(SERVICE));
    let publisher = FaultInjector::with_settings(publisher, &config.faults);
    let dispatcher = Dispatcher::build(config, pool, publisher).await?;
    dispatcher.run_until_stopped(shutdown).await
}

async fn stopped(mut abort: Shutdown) {
    abort.requested().await;
}
