//! The producer binary: parse configuration, start telemetry, hand over to the library, map the
//! result to an exit code (`outbox_runtime::exit`: 0 ok, 1 failed at run time, 2 configuration or
//! usage, 3 nothing matched, 130 stopped by a second signal).

use std::process::ExitCode;

use outbox_producer::sidecar::SidecarQuit;
use outbox_producer::{Cli, Command, RunArgs, StartupError};
use outbox_runtime::exit::fail;
use outbox_runtime::telemetry::LogFormat;
use outbox_runtime::telemetry::start_with_logs;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse_args();
    let format = cli.telemetry().log_format;
    let traces = match start_with_logs(cli.telemetry(), cli.traces(), SERVICE).await {
        Ok(traces) => traces,
        Err(e) => {
            return fail(
                format,
                "The producer could not start; fix the error and rerun",
                &e,
            )
            .into();
        }
    };
    let code = match &cli.command {
        Command::Migrate(args) => outbox_runtime::db::migrate_command(args).await.into(),
        Command::Ops(op) => op.run().await.into(),
        Command::Run(args) => run(args).await,
    };
    // The run's spans go out before the execution ends (a Cloud Run Job's container stops).
    traces.shutdown().await;
    code
}

/// The name the producer's spans are exported under (`service.name`).
const SERVICE: &str = "pubsub-outbox-producer";

/// `producer run`, then the sidecar told to exit (once, whatever the outcome).
async fn run(args: &RunArgs) -> ExitCode {
    let sidecar = match args.job.sidecar_quit_url.as_deref().map(SidecarQuit::new) {
        None => None,
        Some(Ok(s)) => Some(s),
        Some(Err(e)) => {
            return fail(
                args.telemetry.log_format,
                "The producer could not start; fix the error and rerun",
                &StartupError::Config(e),
            )
            .into();
        }
    };
    let code = run_execution(args).await;
    if let Some(s) = sidecar {
        s.quit().await;
    }
    code
}

async fn run_execution(args: &RunArgs) -> ExitCode {
    let signals = outbox_runtime::shutdown::on_signals();
    let mut abort = signals.abort;
    let execution = tokio::select! {
        result = outbox_producer::execute(args, &signals.shutdown) => result,
        () = abort.requested() => {
            tracing::warn!("Second signal: stopping now; the page in flight rolls back and the next run reads it again.");
            return ExitCode::from(130);
        }
    };
    match execution {
        Ok(report) => {
            // Logs (stderr) carry the summaries; the table is for people at a terminal (a
            // closed pipe is theirs to close: no panic, the run's exit code stands).
            if args.telemetry.log_format == LogFormat::Text {
                let mut out = std::io::stdout().lock();
                let _ = std::io::Write::write_all(&mut out, report.render().as_bytes());
            }
            ExitCode::from(report.exit_code())
        }
        Err(e) => fail(
            args.telemetry.log_format,
            "The producer could not start; fix the error and rerun",
            &e,
        )
        .into(),
    }
}
