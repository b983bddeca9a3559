//! The command line's tests: flags and environment into a validated configuration, and the
//! refusals of unusable combinations.

use super::*;

fn parse(extra: &[&str]) -> Result<DispatcherConfig, String> {
    let mut args = vec!["dispatcher", "--database-url", "postgres://u@h/db"];
    args.extend_from_slice(extra);
    let cli = Cli::try_parse_args(args).map_err(|e| e.to_string())?;
    DispatcherConfig::try_from(cli.run_args().expect("run is implied"))
}

#[test]
fn the_flags_defaults_are_the_config_defaults() {
    let mut parsed = parse(&[]).expect("the defaults are valid");
    // The test environment points at the emulator (scripts/services exports these).
    parsed.pubsub.emulator_host = None;
    parsed.pubsub.project = String::new();
    assert_eq!(parsed, DispatcherConfig::default());
}

#[test]
fn the_removed_publish_delay_is_refused_with_what_to_do() {
    let e = parse(&["--publish-delay", "5ms"]).expect_err("removed");
    assert!(
        e.contains("--publish-delay") && e.contains("was removed"),
        "{e}"
    );
    assert!(e.contains("Remove the setting"), "{e}");
    assert!(parse(&["--publish-connections", "0"]).is_err());
    let c = parse(&["--publish-connections", "8", "--pubsub-ca-file", "/ca.pem"]).expect("valid");
    assert_eq!(c.pubsub.connections, 8);
    assert_eq!(
        c.pubsub.ca_file.as_deref(),
        Some(std::path::Path::new("/ca.pem"))
    );
}

#[test]
fn out_of_range_values_are_refused_naming_the_flag() {
    for (args, flag) in [
        (&["--batch-size", "0"][..], "--batch-size"),
        (&["--batch-size", "1001"], "--batch-size"),
        (&["--workers", "0"], "--workers"),
        (&["--max-attempts", "0"], "--max-attempts"),
        (&["--backoff-jitter", "1.5"], "--backoff-jitter"),
        (&["--inject-failure-rate=-0.1"], "--inject-failure-rate"),
        (&["--inject-failure-code", "BOGUS"], "--inject-failure-code"),
        (&["--lock-timeout", "5s"], "--lock-timeout"),
        (&["--liveness-timeout", "30s"], "--liveness-timeout"),
    ] {
        let err = parse(args).expect_err("refused");
        assert!(err.contains(flag), "{args:?}: {err}");
    }
}

#[test]
fn run_flags_are_accepted_after_the_run_subcommand_too() {
    let before = Cli::try_parse_args([
        "dispatcher",
        "--database-url",
        "postgres://u@h/d",
        "--workers",
        "7",
    ])
    .expect("flags before");
    let after = Cli::try_parse_args([
        "dispatcher",
        "run",
        "--database-url",
        "postgres://u@h/d",
        "--workers",
        "7",
    ])
    .expect("flags after run");
    assert_eq!(before.run_args().map(|a| a.dispatch.workers), Some(7));
    assert_eq!(after.run_args().map(|a| a.dispatch.workers), Some(7));
    // Other subcommands take only their own flags, and no run flag is required for them.
    let status =
        Cli::try_parse_args(["dispatcher", "status", "--database-url", "postgres://u@h/d"]);
    assert!(status.is_ok(), "{status:?}");
    let err = Cli::try_parse_args([
        "dispatcher",
        "migrate",
        "--database-url",
        "x",
        "--workers",
        "3",
    ])
    .expect_err("migrate takes no run flags");
    assert_eq!(err.exit_code(), 2);
}

#[test]
fn run_flags_may_precede_run_and_every_other_form_parses_as_before() {
    let url = "--database-url postgres://u@h/d";
    let parse = |args: &str| {
        Cli::try_parse_args(std::iter::once("dispatcher").chain(args.split_whitespace()))
    };
    let before = parse(&format!("--workers 3 run {url}")).expect("flags before run");
    let after = parse(&format!("run --workers 3 {url}")).expect("flags after run");
    let implied = parse(&format!("--workers 3 {url}")).expect("run implied");
    assert_eq!(format!("{before:?}"), format!("{after:?}"));
    assert_eq!(format!("{implied:?}"), format!("{after:?}"));
    assert_eq!(after.run_args().map(|a| a.dispatch.workers), Some(3));
    // No arguments: run (which may find --database-url in the environment or ask for it).
    assert_eq!(
        run_first(&Cli::command(), vec!["dispatcher".into()]),
        ["dispatcher", "run"]
    );
    match parse("") {
        Ok(cli) => assert!(cli.run_args().is_some(), "{cli:?}"),
        Err(e) => assert!(e.to_string().contains("--database-url"), "{e}"),
    }
    let status = parse(&format!("status {url}")).expect("status");
    assert!(matches!(status.command, Command::Ops(_)), "{status:?}");
    for (args, kind) in [
        ("--help", clap::error::ErrorKind::DisplayHelp),
        ("-h", clap::error::ErrorKind::DisplayHelp),
        ("--version", clap::error::ErrorKind::DisplayVersion),
        ("-V", clap::error::ErrorKind::DisplayVersion),
    ] {
        let e = parse(args).expect_err("prints and exits");
        assert_eq!((e.kind(), e.exit_code()), (kind, 0), "{args}: {e}");
    }
    let help = parse("--help").expect_err("help").to_string();
    assert!(
        help.contains("Usage: dispatcher <COMMAND>"),
        "the top level's: {help}"
    );
}

#[test]
fn an_invalid_log_filter_is_refused_naming_the_flag() {
    let err = Cli::try_parse_args([
        "dispatcher",
        "--database-url",
        "x",
        "--log-filter",
        "info,=[",
    ])
    .expect_err("refused");
    assert!(err.to_string().contains("--log-filter"), "{err}");
    assert_eq!(err.exit_code(), 2);
}

#[test]
fn code_names_parse_case_insensitively() {
    assert_eq!(grpc_code("UNAVAILABLE"), Ok(Code::Unavailable));
    assert_eq!(grpc_code("not_found"), Ok(Code::NotFound));
    assert!(grpc_code("bogus").is_err());
}

#[test]
fn short_topic_names_get_the_project_and_poll_only_drops_the_channel() {
    let c = parse(&[
        "--pubsub-project",
        "ops-project",
        "--topic",
        "orders,projects/billing-prod/topics/invoices",
        "--no-listen",
    ])
    .expect("valid");
    assert_eq!(
        c.batch.topics,
        Some(vec![
            "projects/ops-project/topics/orders".to_owned(),
            "projects/billing-prod/topics/invoices".to_owned()
        ])
    );
    assert_eq!(c.notify_channel, None);
}
