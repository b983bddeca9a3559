//! The console's command line: [`ConsoleArgs`] (every flag with its env fallback and default),
//! [`AuthMode`], and the rules that tie the options together ([`ConsoleArgs::check`], exit 2
//! with the fix; [`is_iap_audience`]). Outside the console only `cli.rs`, above both the
//! console and the operator commands, knows them.

use std::net::SocketAddr;
use std::time::Duration;

use outbox_runtime::db::DatabaseArgs;
use outbox_runtime::telemetry::TelemetryArgs;

use crate::config::SkipDeadLetters;

/// How the console knows who asks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum AuthMode {
    /// The operator who started it; it listens on loopback only.
    Local,
    /// Behind Identity-Aware Proxy: every request carries the proxy's signed assertion.
    Iap,
}

/// `console` options.
#[derive(Debug, Clone, clap::Args)]
pub struct ConsoleArgs {
    #[command(flatten)]
    pub database: DatabaseArgs,
    #[command(flatten)]
    pub telemetry: TelemetryArgs,
    /// Where the console listens. Local mode takes only a loopback address.
    #[arg(
        long,
        env = "OUTBOX_CONSOLE_LISTEN_ADDR",
        default_value = "127.0.0.1:8080"
    )]
    pub listen_addr: SocketAddr,
    /// Who may use it: local (the operator who started it, loopback only) or iap (behind
    /// Identity-Aware Proxy: every request needs the proxy's signed assertion; the identity is
    /// its email).
    #[arg(long, env = "OUTBOX_CONSOLE_AUTH", value_enum, default_value = "local")]
    pub auth: AuthMode,
    /// IAP: the audience the proxy signs for, /projects/PROJECT_NUMBER/global/backendServices/SERVICE_ID
    /// (both numbers: checked at start, exit 2 otherwise).
    #[arg(long, env = "OUTBOX_CONSOLE_IAP_AUDIENCE")]
    pub iap_audience: Option<String>,
    /// IAP: where Google publishes the proxy's public keys (fetched on first use and once an
    /// hour; again when an assertion names a key not in the set, at most every 30 s).
    #[arg(
        long,
        env = "OUTBOX_CONSOLE_IAP_KEYS_URL",
        default_value = "https://www.gstatic.com/iap/verify/public_key-jwk"
    )]
    pub iap_keys_url: String,
    /// Local mode: the identity shown and audited (default: the OS user, as the CLI's actor).
    #[arg(long, env = "OUTBOX_CONSOLE_USER")]
    pub local_user: Option<String>,
    /// Offer the actions (pause/resume, replay/discard of dead letters, cancel/retry-now of
    /// pending messages); without it the console only reads.
    #[arg(long, env = "OUTBOX_CONSOLE_ACTIONS")]
    pub actions: bool,
    /// The key of the CSRF tokens, shared by the console's replicas (default: a random key per
    /// process; the forms of one replica are then refused by another).
    #[arg(long, env = "OUTBOX_CONSOLE_CSRF_KEY", hide_env_values = true)]
    pub csrf_key: Option<String>,
    /// How often the console samples the outbox for its plots.
    #[arg(long, env = "OUTBOX_CONSOLE_SAMPLE_INTERVAL", default_value = "10s", value_parser = humantime::parse_duration)]
    pub sample_interval: Duration,
    #[command(flatten)]
    pub skip_dead_letters: SkipDeadLetters,
}

impl ConsoleArgs {
    /// Checks the options that tie together (exit 2 with the fix).
    pub fn check(&self) -> Result<(), String> {
        match self.auth {
            AuthMode::Local if !self.listen_addr.ip().is_loopback() => Err(format!(
                "--auth local serves {} only to this machine: --listen-addr must be a loopback \
                 address (127.0.0.1:8080); behind Identity-Aware Proxy use --auth iap",
                self.listen_addr
            )),
            AuthMode::Iap if !self.iap_audience.as_deref().is_some_and(is_iap_audience) => {
                Err(format!(
                    "--auth iap needs --iap-audience (OUTBOX_CONSOLE_IAP_AUDIENCE) as \
                     /projects/PROJECT_NUMBER/global/backendServices/SERVICE_ID, both numbers \
                     (got {:?}): the backend service IAP protects, `gcloud compute \
                     backend-services describe NAME --global --format='value(id)'` and the \
                     project's number (deploy/README.md, \"The console\")",
                    self.iap_audience.as_deref().unwrap_or("")
                ))
            }
            _ if self.sample_interval < Duration::from_secs(1) => {
                Err("--sample-interval must be at least 1s".into())
            }
            _ => Ok(()),
        }
    }
}

/// Whether `aud` is an IAP audience of a backend service: `/projects/N/global/backendServices/M`
/// with N and M numbers (what IAP signs for; a placeholder such as PROJECT_NUMBER never matches).
pub fn is_iap_audience(aud: &str) -> bool {
    let numeric = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    aud.strip_prefix("/projects/")
        .and_then(|rest| rest.split_once("/global/backendServices/"))
        .is_some_and(|(project, service)| numeric(project) && numeric(service))
}
