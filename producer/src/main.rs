//! The producer binary: parse configuration, start telemetry, hand over to the library.

use std::process::ExitCode;

use clap::Parser;
use outbox_producer::{Cli, Command};
use outbox_runtime::telemetry::LogFormat;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    outbox_runtime::telemetry::init(&cli.telemetry);
    match cli.command.unwrap_or(Command::Run) {
        Command::Migrate => match outbox_producer::migrate(&cli).await {
            Ok(()) => {
                tracing::info!("Migrations applied.");
                ExitCode::SUCCESS
            }
            Err(e) => fail(&cli, &e.to_string(), e.exit_code()),
        },
        Command::Run => {
            let signals = outbox_runtime::shutdown::on_signals();
            let execution = tokio::select! {
                result = outbox_producer::execute(&cli, &signals.shutdown) => result,
                _ = wait(signals.abort) => {
                    tracing::warn!("Second signal: stopping now; the page in flight rolls back and the next run reads it again.");
                    return ExitCode::from(130);
                }
            };
            match execution {
                Ok(report) => {
                    // Logs (stderr) carry the summaries; the table is for people at a terminal.
                    if cli.telemetry.log_format == LogFormat::Text {
                        print!("{}", report.render());
                    }
                    ExitCode::from(report.exit_code())
                }
                Err(e) => fail(&cli, &e.to_string(), e.exit_code()),
            }
        }
    }
}

async fn wait(mut abort: outbox_runtime::shutdown::Shutdown) {
    abort.requested().await;
}

/// Reports a start-up failure once: a JSON log line for Cloud Logging, plain text for people.
fn fail(cli: &Cli, message: &str, code: u8) -> ExitCode {
    match cli.telemetry.log_format {
        LogFormat::Json => tracing::error!(
            error = message,
            "The producer could not start; fix the error and rerun."
        ),
        LogFormat::Text => eprintln!("error: {message}"),
    }
    ExitCode::from(code)
}
