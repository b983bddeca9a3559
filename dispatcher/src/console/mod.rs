//! `dispatcher console`: the operator's console in a browser. The overview (per topic: due,
//! held, waiting, oldest claimable age, dead letters, paused; the topics Pub/Sub refuses, held;
//! blocked keys; replicas; producer streams; the warnings `status` gives; plots of the last hour
//! from samples it keeps itself), the messages not yet sent (`pending.rs`: filters, paging), the
//! dead letters (filters, paging, a safe preview, the key each one holds back), the audit trail,
//! and, when started with `--actions`, pause/resume, replay/discard of dead letters and
//! cancel/retry-now of pending messages, each previewed (a dry run lists exactly the ids),
//! confirmed with a reason and audited with the identity.
//!
//! One source of truth: every query and action is an operator command of this binary
//! ([`crate::ops`]), parsed from the CLI's own flags and run on the console's pool.
//!
//! Security: loopback only in local mode, where a request must also name a loopback host
//! (`127.0.0.1`, `[::1]` or `localhost`: a page served under another name that resolves to
//! 127.0.0.1, DNS rebinding, is refused before anything renders); behind Identity-Aware Proxy every request needs the
//! proxy's signed assertion ([`auth`]); every change needs the identity's CSRF token and a
//! same-origin request ([`csrf`]); no payload beyond the safe preview; a strict
//! Content-Security-Policy and no external asset or script ([`html`]).

mod auth;
mod blocked;
mod csrf;
mod fields;
mod html;
mod pages;
mod pending;
mod samples;
mod svg;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{FromRequest, FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use axum::routing::{get, post};
use outbox_runtime::db::DatabaseArgs;
use outbox_runtime::exit::Exit;
use outbox_runtime::shutdown::{Shutdown, on_signals};
use outbox_runtime::telemetry::TelemetryArgs;
use sqlx::PgPool;

pub use auth::{AuthError, Claims, IAP_HEADER, IAP_ISSUER, Keys, parse_keys, verify};

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

/// The console's shared state.
#[derive(Debug)]
pub struct Console {
    pool: PgPool,
    auth: auth::Auth,
    csrf: csrf::Csrf,
    samples: Arc<samples::Samples>,
    /// The last `status` and when it was read: the overview renders it, so a page costs no
    /// query however large the outbox, and status runs once per interval however many
    /// browsers watch.
    status: std::sync::Mutex<Option<(std::time::Instant, serde_json::Value)>>,
    /// How long the last `status` read took (its next one waits at least 10 times that).
    status_took: std::sync::Mutex<Duration>,
    interval: Duration,
    actions: bool,
    skip_dead_letter_topics: Vec<String>,
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

/// Whether the `Host` of a request names this machine's loopback (`127.0.0.1`, `[::1]`,
/// `localhost`, with any port): in local mode nothing else is served, so a page an attacker
/// serves under a name that resolves to 127.0.0.1 (DNS rebinding) reads and posts nothing.
pub fn is_loopback_host(headers: &HeaderMap) -> bool {
    let Some(host) = headers
        .get(axum::http::header::HOST)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let name = match host.rsplit_once(':') {
        // IPv6 literals keep their brackets; a colon inside them is not a port.
        Some((name, port)) if !port.contains(']') && port.bytes().all(|b| b.is_ascii_digit()) => {
            name
        }
        _ => host,
    };
    name == "127.0.0.1" || name == "[::1]" || name.eq_ignore_ascii_case("localhost")
}

impl Console {
    /// The console for `args` on `pool`.
    pub fn new(args: &ConsoleArgs, pool: PgPool) -> Self {
        let auth = match args.auth {
            AuthMode::Local => auth::Auth::Local {
                user: outbox_runtime::operator::actor(args.local_user.as_deref())
                    .unwrap_or_else(|| "local operator".to_owned()),
            },
            AuthMode::Iap => auth::Auth::Iap(auth::Iap::new(
                args.iap_audience.clone().unwrap_or_default(),
                args.iap_keys_url.clone(),
            )),
        };
        Self {
            pool,
            auth,
            csrf: csrf::Csrf::new(args.csrf_key.as_deref()),
            samples: Arc::new(samples::Samples::default()),
            status: std::sync::Mutex::new(None),
            status_took: std::sync::Mutex::new(Duration::ZERO),
            interval: args.sample_interval,
            actions: args.actions,
            skip_dead_letter_topics: args.skip_dead_letters.topics.clone(),
        }
    }

    /// The identity of the request, or the refusal to send.
    async fn identify(&self, headers: &HeaderMap) -> Result<String, Response> {
        self.auth.identify(headers).await.map_err(|e| {
            tracing::info!(error = %e, "A console request was refused: no valid identity.");
            let status = match e {
                AuthError::Keys { .. } => StatusCode::SERVICE_UNAVAILABLE,
                _ => StatusCode::UNAUTHORIZED,
            };
            html::respond(status, "text/plain; charset=utf-8", format!("{e}\n"))
        })
    }

    /// A change request's form fields and ids, once the actions are on, the request is
    /// same-origin and the CSRF token is `who`'s.
    fn change_request(
        &self,
        who: &str,
        headers: &HeaderMap,
        body: &str,
    ) -> Result<(fields::Fields, Vec<String>), Box<Response>> {
        if !self.actions {
            return Err(Box::new(html::problem(
                StatusCode::FORBIDDEN,
                who,
                "this console only reads: start it with --actions to pause, resume, replay, discard, cancel or retry",
            )));
        }
        let mut fields = fields::Fields::new();
        let mut ids = Vec::new();
        for (k, v) in form_urlencoded::parse(body.as_bytes()) {
            if k == "id" {
                ids.push(v.into_owned());
            } else {
                fields.insert(k.into_owned(), v.into_owned());
            }
        }
        let token = fields.get("csrf").map_or("", String::as_str);
        let refused = if csrf::cross_site(headers) {
            Some(
                "refused: the request came from another site (its Origin or Sec-Fetch-Site is not \
                 this console): a change is made only from the console's own pages",
            )
        } else if !self.csrf.check(who, token) {
            Some(
                "refused: the form's token is missing or not yours (reload the page and try again)",
            )
        } else {
            None
        };
        if let Some(why) = refused {
            tracing::warn!(identity = %who, refused = why, "A console change was refused.");
            return Err(Box::new(html::problem(StatusCode::FORBIDDEN, who, why)));
        }
        Ok((fields, ids))
    }

    /// `status` (with the console's skip flags) as of at most one interval ago, and its age:
    /// the last one read, else read now.
    async fn status(&self) -> Result<(serde_json::Value, Duration), String> {
        let cached = self.status.lock().ok().and_then(|s| s.clone());
        match cached {
            Some((at, json)) if at.elapsed() <= self.status_every() * 2 => Ok((json, at.elapsed())),
            _ => self
                .refresh_status()
                .await
                .map(|json| (json, Duration::ZERO)),
        }
    }

    /// Reads `status` now and keeps it for the overview.
    async fn refresh_status(&self) -> Result<serde_json::Value, String> {
        let mut args = vec!["status".to_owned()];
        args.extend(self.skip_flags());
        let started = std::time::Instant::now();
        let json = self.json(&args).await?;
        if let Ok(mut took) = self.status_took.lock() {
            *took = started.elapsed();
        }
        if let Ok(mut s) = self.status.lock() {
            *s = Some((std::time::Instant::now(), json.clone()));
        }
        Ok(json)
    }

    /// How often `status` is read: every interval, or 10 times its own last duration when that
    /// is longer (a huge backlog: the read stays under a tenth of one connection's time).
    fn status_every(&self) -> Duration {
        let took = self.status_took.lock().map_or(Duration::ZERO, |t| *t);
        self.interval.max(took * 10)
    }

    /// After a change: the next overview reads `status` again.
    fn forget_status(&self) {
        if let Ok(mut s) = self.status.lock() {
            *s = None;
        }
    }

    /// Messages waiting behind a dead letter of `topic`'s `key` at `outbox_id`.
    async fn held_behind(
        &self,
        topic: &str,
        key: &str,
        outbox_id: Option<i64>,
    ) -> Result<i64, outbox_shared::Error> {
        let mut conn =
            self.pool
                .begin()
                .await
                .map_err(|source| outbox_shared::Error::Database {
                    context: "reading what a dead letter holds back",
                    source,
                })?;
        let n =
            outbox_shared::store::dead_letter::held_behind(&mut conn, topic, key, outbox_id).await;
        let _ = conn.rollback().await;
        n
    }
}

/// The identity of a request: every page and action takes it, and a request without a valid
/// one gets the refusal [`Console::identify`] gives.
pub struct Who(pub String);

impl FromRequestParts<Arc<Console>> for Who {
    type Rejection = Response;

    async fn from_request_parts(
        parts: &mut Parts,
        console: &Arc<Console>,
    ) -> Result<Self, Self::Rejection> {
        console.identify(&parts.headers).await.map(Who)
    }
}

/// A change (`POST /actions/...`): the identity, the form's fields and its ids, once the
/// actions are on, the request is same-origin and the CSRF token is the identity's
/// ([`Console::change_request`]); anything else gets the refusal as its response.
pub struct Change {
    /// Who asks.
    pub who: String,
    /// The form's fields but the ids.
    pub fields: fields::Fields,
    /// The form's `id` fields.
    pub ids: Vec<String>,
}

/// The most a change's form may hold (axum's own limit for a body read as text).
const FORM_LIMIT: usize = 2 * 1024 * 1024;

impl FromRequest<Arc<Console>> for Change {
    type Rejection = Response;

    async fn from_request(req: Request, console: &Arc<Console>) -> Result<Self, Self::Rejection> {
        let (mut parts, body) = req.into_parts();
        let Who(who) = Who::from_request_parts(&mut parts, console).await?;
        let body = axum::body::to_bytes(body, FORM_LIMIT)
            .await
            .ok()
            .and_then(|b| String::from_utf8(b.to_vec()).ok())
            .ok_or_else(|| {
                html::problem(
                    StatusCode::BAD_REQUEST,
                    &who,
                    "the form could not be read (over 2 MiB, or not UTF-8)",
                )
            })?;
        let (fields, ids) = console
            .change_request(&who, &parts.headers, &body)
            .map_err(|r| *r)?;
        Ok(Self { who, fields, ids })
    }
}

/// The console's routes on `console`.
pub fn router(console: Arc<Console>) -> Router {
    Router::new()
        .route("/", get(pages::overview))
        .route("/pending", get(pending::page_of))
        .route("/dead-letters", get(pages::dead_letters))
        .route("/dead-letters/{id}", get(pages::dead_letter))
        .route("/audit", get(pages::audit))
        .route("/actions/preview", post(pages::preview))
        .route("/actions/apply", post(pages::apply))
        .route("/console.css", get(stylesheet))
        .route("/blocked-keys", get(blocked::keys_page))
        .route("/healthz", get(healthz))
        .fallback(not_found)
        .layer(axum::middleware::from_fn_with_state(
            console.clone(),
            only_loopback_hosts,
        ))
        .layer(axum::middleware::map_response(html::secure_every))
        .with_state(console)
}

/// An unknown path.
async fn not_found() -> Response {
    html::respond(
        StatusCode::NOT_FOUND,
        "text/plain; charset=utf-8",
        "No such page: the console has /, /pending, /dead-letters, /blocked-keys and /audit.\n"
            .into(),
    )
}

/// Local mode: refuses a request whose `Host` is not a loopback name before anything renders
/// ([`is_loopback_host`]). Behind IAP the proxy's assertion decides instead.
async fn only_loopback_hosts(
    State(c): State<Arc<Console>>,
    request: Request,
    next: axum::middleware::Next,
) -> Response {
    if matches!(c.auth, auth::Auth::Local { .. }) && !is_loopback_host(request.headers()) {
        tracing::warn!(
            host = ?request.headers().get(axum::http::header::HOST),
            "A console request for another host name was refused (local mode answers to 127.0.0.1, [::1] and localhost only)."
        );
        return html::respond(
            StatusCode::MISDIRECTED_REQUEST,
            "text/plain; charset=utf-8",
            "This console (local mode) answers only to http://127.0.0.1, http://[::1] and \
             http://localhost with its port: a page under another host name cannot use it.\n"
                .into(),
        );
    }
    next.run(request).await
}

async fn stylesheet() -> Response {
    html::respond(
        StatusCode::OK,
        "text/css; charset=utf-8",
        html::CSS.to_owned(),
    )
}

/// Liveness for the load balancer's health check (which comes without an identity): the
/// database answers.
async fn healthz(State(c): State<Arc<Console>>) -> Response {
    match sqlx::query("SELECT 1").execute(&c.pool).await {
        Ok(_) => html::respond(StatusCode::OK, "text/plain; charset=utf-8", "ok\n".into()),
        Err(_) => html::respond(
            StatusCode::SERVICE_UNAVAILABLE,
            "text/plain; charset=utf-8",
            "the database does not answer\n".into(),
        ),
    }
}

/// Serves the console on `listener` until `shutdown` (the sampler runs beside it).
pub async fn serve(
    console: Arc<Console>,
    listener: tokio::net::TcpListener,
    interval: Duration,
    shutdown: Shutdown,
) -> std::io::Result<()> {
    let sampler = tokio::spawn(samples::sample(
        console.pool.clone(),
        console.samples.clone(),
        console.skip_dead_letter_topics.clone(),
        interval,
        shutdown.clone(),
    ));
    let refresher = tokio::spawn(refresh_status(console.clone(), shutdown.clone()));
    let mut stop = shutdown.clone();
    let served = axum::serve(listener, router(console))
        .with_graceful_shutdown(async move { stop.requested().await })
        .await;
    sampler.abort();
    refresher.abort();
    served
}

/// Reads `status` for the overview every interval (or 10 times its duration) until shutdown (a failure is logged; the
/// overview then reads it itself).
async fn refresh_status(console: Arc<Console>, mut shutdown: Shutdown) {
    loop {
        if let Err(e) = console.refresh_status().await {
            tracing::warn!(error = %e, "The console could not read the status; the overview will try again.");
        }
        let every = console.status_every();
        tokio::select! { _ = tokio::time::sleep(every) => {}, _ = shutdown.requested() => return }
    }
}

/// The console acts with its login's rights: an operator's (a member of `outbox_operator`, as
/// deploy/sql/bootstrap.sql makes one). A superuser can do anything the audit trail would not
/// show: said once at start.
async fn warn_if_superuser(pool: &PgPool) {
    let login = async {
        let mut tx = pool.begin().await.map_err(outbox_shared::Error::begin)?;
        let login = outbox_shared::store::status::login(&mut tx).await;
        let _ = tx.rollback().await;
        login
    };
    match login.await {
        Ok(l) if l.superuser => tracing::warn!(
            login = %l.name,
            "The console logs in as a superuser: it acts with more than an operator's rights. \
             Give it a login that is a member of outbox_operator only (deploy/sql/bootstrap.sql \
             -v operator=NAME)."
        ),
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "Reading the console's login failed."),
    }
}

/// Why the console cannot run.
#[derive(Debug, thiserror::Error)]
pub enum ConsoleError {
    /// The options contradict each other (exit 2).
    #[error("{0}")]
    Config(String),
    /// PostgreSQL cannot be reached, or DATABASE_URL is wrong.
    #[error(transparent)]
    Connect(#[from] outbox_runtime::db::ConnectError),
    /// The listen address is taken or not ours (exit 2).
    #[error("listening on {addr} failed: {source}; choose another --listen-addr")]
    Listen {
        /// The address.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// Serving failed.
    #[error("serving the console failed: {0}")]
    Serve(#[source] std::io::Error),
}

impl outbox_runtime::exit::Failure for ConsoleError {
    fn is_configuration(&self) -> bool {
        match self {
            Self::Config(_) | Self::Listen { .. } => true,
            Self::Connect(e) => e.is_configuration(),
            Self::Serve(_) => false,
        }
    }
}

/// `dispatcher console`: checks the options, connects, serves until SIGTERM/SIGINT.
pub async fn run(args: &ConsoleArgs) -> Exit {
    match start_and_serve(args).await {
        Ok(()) => Exit::Ok,
        Err(e) => outbox_runtime::exit::fail(args.telemetry.log_format, "The console failed", &e),
    }
}

async fn start_and_serve(args: &ConsoleArgs) -> Result<(), ConsoleError> {
    args.check().map_err(ConsoleError::Config)?;
    let pool = outbox_runtime::db::connect(&args.database, "pubsub-outbox-console").await?;
    let listener = tokio::net::TcpListener::bind(args.listen_addr)
        .await
        .map_err(|source| ConsoleError::Listen {
            addr: args.listen_addr,
            source,
        })?;
    let addr = listener.local_addr().map_or(args.listen_addr, |a| a);
    warn_if_superuser(&pool).await;
    let console = Arc::new(Console::new(args, pool));
    tracing::info!(addr = %addr, auth = ?args.auth, actions = args.actions,
        "The console is up: http://{addr}/");
    let signals = on_signals();
    serve(console, listener, args.sample_interval, signals.shutdown)
        .await
        .map_err(ConsoleError::Serve)
}
