//! `run` is the default command of both binaries, and its flags may come before or after it:
//! `producer --config x run`, `producer run --config x` and `producer --config x` are the same,
//! as are `dispatcher --workers 3 run`, `dispatcher run --workers 3` and `dispatcher --workers 3`.
//!
//! [`run_first`] makes that so before clap parses, from the binary's own `clap::Command` (its
//! `run` subcommand says which flags take a value). clap itself cannot: it refuses flags before
//! a subcommand that conflict with it, and a top-level copy of the run flags would make
//! `--database-url` required on the top level even when a command gives it. Flags before any
//! other command stay where they are, and clap refuses them.

use std::ffi::OsString;

/// The default command.
const RUN: &str = "run";

/// Makes `run`'s flags parse as `run`'s wherever they stand in `args` (the program name first):
/// moves a `run` that follows flags to just after the program name, or inserts `run` when no
/// command is named (unless the arguments only ask for help); a version flag before the command
/// is the binary's, and leaves the arguments as they are. Values of `run`'s
/// flags are skipped (a config file named `run` stays a value); anything else is left for clap to
/// judge against `cli`.
pub fn run_first(cli: &clap::Command, mut args: Vec<OsString>) -> Vec<OsString> {
    let takes_value = |long: &str| {
        cli.find_subcommand(RUN).is_some_and(|run| {
            run.get_arguments()
                .any(|a| a.get_long() == Some(long) && a.get_action().takes_values())
        })
    };
    let mut only_help = true;
    let mut i = 1;
    while i < args.len() {
        let Some(token) = args[i].to_str() else {
            return args;
        };
        if token == "--" {
            break;
        }
        if !token.starts_with('-') || token == "-" {
            // The first positional: the command.
            if token == RUN && i > 1 {
                let run = args.remove(i);
                args.insert(1, run);
            }
            return args;
        }
        if matches!(token, "-V" | "--version") {
            // The binary's version, whatever follows (`dispatcher --version run`).
            return args;
        }
        only_help &= matches!(token, "-h" | "--help");
        if let Some(long) = token.strip_prefix("--")
            && !long.contains('=')
            && takes_value(long)
        {
            i += 1;
        }
        i += 1;
    }
    if !(only_help && args.len() > 1) {
        args.insert(1.min(args.len()), OsString::from(RUN));
    }
    args
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{Arg, ArgAction, Command};

    /// A binary with `run` (a flag with a value, a switch) and `status`.
    fn cli() -> Command {
        Command::new("bin")
            .subcommand(
                Command::new("run")
                    .arg(Arg::new("config").long("config"))
                    .arg(Arg::new("dry").long("dry-run").action(ArgAction::SetTrue)),
            )
            .subcommand(Command::new("status"))
    }

    fn order(args: &str) -> String {
        let args = std::iter::once("bin")
            .chain(args.split_whitespace())
            .map(OsString::from)
            .collect();
        let out: Vec<String> = run_first(&cli(), args)
            .into_iter()
            .map(|a| a.into_string().expect("utf-8"))
            .collect();
        out[1..].join(" ")
    }

    #[test]
    fn run_comes_first_whether_moved_inserted_or_given() {
        for (given, parsed) in [
            ("--config x run --dry-run", "run --config x --dry-run"),
            ("--dry-run run", "run --dry-run"),
            ("--config x", "run --config x"),
            ("", "run"),
            ("run --config x", "run --config x"),
            ("--config run", "run --config run"),
            ("--config run run", "run --config run"),
            ("--config=x run", "run --config=x"),
            ("--dry-run -- x", "run --dry-run -- x"),
        ] {
            assert_eq!(order(given), parsed, "{given:?}");
        }
    }

    #[test]
    fn other_commands_help_and_version_are_left_alone() {
        for given in [
            "status",
            "--config x status",
            "help",
            "--help",
            "-h",
            "-V",
            "--version",
            "--help --version",
            "--version run",
            "-V run --config x",
        ] {
            assert_eq!(order(given), given, "{given:?}");
        }
        assert_eq!(order("--dry-run --help"), "run --dry-run --help");
    }
}
