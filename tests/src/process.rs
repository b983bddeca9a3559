//! The project's binaries as child processes: one builder ([`Spawn`]) for the tests, the
//! benchmarks and the chaos run, so every child starts the same way: its own environment (the
//! parent's `OUTBOX_*` variables are never inherited), its output in a log file, killed when
//! dropped, and a listening child's address read back from its own log ([`Process::bound_addr`]:
//! children bind port 0, nothing guesses a free port).
//!
//! A port that must refuse connections (an unreachable database), or one for a child that cannot
//! bind port 0 and say where it is (the emulators, PgBouncer), is a [`ReservedPort`].

use std::ffi::{OsStr, OsString};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Output, Stdio};
use std::time::Duration;

use tokio::process::{Child, Command};

/// Path of a workspace binary next to the test executable (`target/<profile>/<name>`).
pub fn binary(name: &str) -> PathBuf {
    built(name)
}

/// Path of a workspace example (`target/<profile>/examples/<name>`), e.g. the inbox's
/// `invoice_consumer`.
pub fn example(name: &str) -> PathBuf {
    built(&format!("examples/{name}"))
}

fn built(relative: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/integration-<hash> -> target/<profile>/<relative>
    let dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target profile dir");
    let path = dir.join(relative);
    assert!(
        path.exists(),
        "{} is missing: build the binaries and examples first (cargo build --workspace --bins --examples)",
        path.display()
    );
    path
}

/// How to start a child: the program, its arguments and environment, where its output goes.
#[derive(Debug, Clone)]
#[must_use]
pub struct Spawn {
    program: PathBuf,
    args: Vec<OsString>,
    envs: Vec<(OsString, OsString)>,
    removed: Vec<OsString>,
    clear: bool,
    log: Option<(PathBuf, bool)>,
}

impl Spawn {
    /// A workspace binary built beside the test executable ([`binary`]).
    pub fn binary(name: &str) -> Self {
        Self::program(binary(name))
    }

    /// A workspace example built beside the test executable ([`example`]).
    pub fn example(name: &str) -> Self {
        Self::program(example(name))
    }

    /// Any program by path (the benchmarks' and the chaos run's binaries, an older build).
    pub fn program(path: impl Into<PathBuf>) -> Self {
        Self {
            program: path.into(),
            args: Vec::new(),
            envs: Vec::new(),
            removed: Vec::new(),
            clear: false,
            log: None,
        }
    }

    /// Adds an argument.
    pub fn arg(mut self, arg: impl AsRef<OsStr>) -> Self {
        self.args.push(arg.as_ref().to_owned());
        self
    }

    /// Adds arguments.
    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        self.args
            .extend(args.into_iter().map(|a| a.as_ref().to_owned()));
        self
    }

    /// Sets a variable.
    pub fn env(mut self, key: impl AsRef<OsStr>, value: impl AsRef<OsStr>) -> Self {
        self.envs
            .push((key.as_ref().to_owned(), value.as_ref().to_owned()));
        self
    }

    /// Sets variables (the tests' `(name, value)` lists).
    pub fn envs(mut self, envs: &[(&str, String)]) -> Self {
        for (k, v) in envs {
            self = self.env(k, v);
        }
        self
    }

    /// Removes a variable the child would inherit (`USER`, `PUBSUB_PROJECT_ID`, …).
    pub fn env_remove(mut self, key: impl AsRef<OsStr>) -> Self {
        self.removed.push(key.as_ref().to_owned());
        self
    }

    /// Removes `keys` from what the child would inherit.
    pub fn env_remove_all(self, keys: &[&str]) -> Self {
        keys.iter().fold(self, |s, k| s.env_remove(k))
    }

    /// Inherits nothing but `PATH`: only what [`Self::env`] sets.
    pub fn env_clear(mut self) -> Self {
        self.clear = true;
        self
    }

    /// Its stdout and stderr go to `path` (created or truncated). Default: a fresh file in the
    /// temporary directory named after the program.
    pub fn log(mut self, path: impl Into<PathBuf>) -> Self {
        self.log = Some((path.into(), false));
        self
    }

    /// Like [`Self::log`], appending (a schedule of runs sharing one log).
    pub fn append_log(mut self, path: impl Into<PathBuf>) -> Self {
        self.log = Some((path.into(), true));
        self
    }

    /// The program's file name, for messages.
    pub fn name(&self) -> String {
        self.program
            .file_name()
            .map_or_else(|| "child".into(), |n| n.to_string_lossy().into_owned())
    }

    fn std_command(&self) -> std::process::Command {
        let mut cmd = std::process::Command::new(&self.program);
        if self.clear {
            cmd.env_clear()
                .env("PATH", std::env::var_os("PATH").unwrap_or_default());
        } else {
            for (k, _) in std::env::vars_os() {
                if k.to_string_lossy().starts_with("OUTBOX_") || self.removed.contains(&k) {
                    cmd.env_remove(k);
                }
            }
        }
        cmd.args(&self.args)
            .envs(self.envs.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null());
        cmd
    }

    fn command(&self) -> Command {
        let mut cmd = Command::from(self.std_command());
        cmd.kill_on_drop(true);
        cmd
    }

    /// Starts it, its output to its log file.
    pub fn start(self) -> std::io::Result<Process> {
        let (log, append) = self.log.clone().unwrap_or_else(|| {
            let file = format!("{}.log", crate::env::unique_name(&self.name()));
            (std::env::temp_dir().join(file), false)
        });
        let file = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .append(append)
            .truncate(!append)
            .open(&log)?;
        let child = self
            .command()
            .stdout(Stdio::from(file.try_clone()?))
            .stderr(Stdio::from(file))
            .spawn()
            .map_err(|e| {
                std::io::Error::new(
                    e.kind(),
                    format!("starting {}: {e}", self.program.display()),
                )
            })?;
        let pid = child.id().unwrap_or(0);
        Ok(Process { child, pid, log })
    }

    /// Runs it to its end within `limit` and returns its exit status, stdout and stderr (an
    /// error of kind `TimedOut` past the limit; the child is killed).
    pub async fn output(self, limit: Duration) -> std::io::Result<Output> {
        let run = self.command().output();
        tokio::time::timeout(limit, run).await.map_err(|_| {
            std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "{} {:?} did not end within {limit:?}",
                    self.name(),
                    self.args
                ),
            )
        })?
    }
}

impl Spawn {
    /// [`Self::output`] for a synchronous caller (no time limit).
    pub fn output_blocking(&self) -> std::io::Result<Output> {
        self.std_command().output()
    }
}

/// A running child; killed when dropped.
#[derive(Debug)]
pub struct Process {
    /// The child.
    pub child: Child,
    /// Its process id (0 if it exited before it could be read).
    pub pid: u32,
    /// Where its stdout and stderr go.
    pub log: PathBuf,
}

impl Process {
    /// Starts the workspace binary `binary` with `args` and `envs` (a test's short-hand for
    /// [`Spawn`]; panics if it cannot start).
    pub fn spawn(binary: &str, args: &[&str], envs: &[(&str, String)]) -> Self {
        Spawn::binary(binary)
            .args(args)
            .envs(envs)
            .start()
            .expect("spawn the binary")
    }

    /// Sends a signal by name (TERM, INT, KILL); asserts it was delivered.
    pub fn signal(&self, signal: &str) {
        assert!(
            self.try_signal(signal),
            "kill -{signal} {} failed",
            self.pid
        );
    }

    /// Sends a signal by name; false if the process is gone.
    pub fn try_signal(&self, signal: &str) -> bool {
        std::process::Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.pid.to_string())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    /// The log so far (for assertion messages).
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The last `n` lines of its log.
    pub fn log_tail(&self, n: usize) -> String {
        let text = self.log();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// The address it listens on, read back from its log: the dispatcher logs `addr=HOST:PORT`
    /// (text) or `"addr":"HOST:PORT"` (JSON) as it starts, at INFO for `outbox_dispatcher`.
    /// Fails if it exits first or logs none within `within`.
    pub async fn bound_addr(&mut self, within: Duration) -> std::io::Result<SocketAddr> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            if let Some(addr) = logged_addr(&self.log()) {
                return Ok(addr);
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(std::io::Error::other(format!(
                    "it exited ({status}) before logging its address; log:\n{}",
                    self.log()
                )));
            }
            if tokio::time::Instant::now() > deadline {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "no listening address in its log within {within:?} (is INFO on for \
                         outbox_dispatcher?); log:\n{}",
                        self.log()
                    ),
                ));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Runs the workspace binary `binary` with `args` and `envs` to its end (a test's short-hand for
/// [`Spawn::output`], 60 s at most; panics if it cannot run or takes longer).
pub async fn output(binary: &str, args: &[&str], envs: &[(&str, String)]) -> Output {
    Spawn::binary(binary)
        .args(args)
        .envs(envs)
        .output(Duration::from_secs(60))
        .await
        .unwrap_or_else(|e| panic!("{binary} {args:?}: {e}"))
}

/// The first `addr=…` / `"addr":"…"` field of a log that parses as a socket address.
fn logged_addr(log: &str) -> Option<SocketAddr> {
    log.lines().find_map(|line| {
        let at = line
            .find("addr=")
            .map(|i| i + "addr=".len())
            .or_else(|| line.find("\"addr\":\"").map(|i| i + "\"addr\":\"".len()))?;
        let rest = &line[at..];
        let end = rest
            .find(|c: char| c.is_whitespace() || c == '"' || c == ',')
            .unwrap_or(rest.len());
        rest[..end].parse().ok()
    })
}

/// Sends SIGTERM to every process and asserts each exits 0 within 30 s (its log otherwise).
pub async fn terminate_all(procs: Vec<Process>) {
    for p in &procs {
        p.signal("TERM");
    }
    for mut p in procs {
        let status = tokio::time::timeout(Duration::from_secs(30), p.child.wait())
            .await
            .expect("exits within 30 s of SIGTERM")
            .expect("exit status");
        assert!(status.success(), "clean exit; log:\n{}", p.log());
    }
}

/// A loopback port reserved for as long as this value lives: bound with `SO_REUSEADDR` and never
/// listened on. Until a server takes it, connecting is refused at once (an unreachable
/// database); no `bind(0)` or outgoing connection is handed it meanwhile; and a server that binds
/// with `SO_REUSEADDR` (PostgreSQL, PgBouncer, the Pub/Sub emulator, bqemulator, tokio's
/// listeners) can still take it. For children that cannot bind port 0 and say where they are.
#[derive(Debug)]
pub struct ReservedPort {
    socket: tokio::net::TcpSocket,
    port: u16,
}

impl ReservedPort {
    /// Reserves a free loopback port.
    pub fn new() -> Self {
        let socket = tokio::net::TcpSocket::new_v4().expect("a TCP socket");
        socket.set_reuseaddr(true).expect("SO_REUSEADDR");
        socket
            .bind(SocketAddr::from(([127, 0, 0, 1], 0)))
            .expect("bind 127.0.0.1:0");
        let port = socket.local_addr().expect("its address").port();
        Self { socket, port }
    }

    /// The port.
    pub fn port(&self) -> u16 {
        // The socket field holds the reservation until drop.
        let _ = &self.socket;
        self.port
    }
}

impl Default for ReservedPort {
    fn default() -> Self {
        Self::new()
    }
}

/// `GET path` over plain HTTP/1.0; returns (status, body).
pub async fn http_get(addr: &str, path: &str) -> (u16, String) {
    let r = http_request(addr, "GET", path, &[], "").await;
    (r.status, r.body)
}

/// An answer to [`http_request`].
#[derive(Debug, Clone)]
pub struct HttpResponse {
    /// The status code (0 when the answer had none).
    pub status: u16,
    /// The headers, names in lower case.
    pub headers: Vec<(String, String)>,
    /// The body.
    pub body: String,
}

impl HttpResponse {
    /// The first value of header `name` (lower case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// `method path` over plain HTTP/1.0 with `headers` (`Host: addr` unless they name one) and
/// `body` (a form when not empty).
pub async fn http_request(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> HttpResponse {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr)
        .await
        .expect("connect to the HTTP endpoint");
    // The address as the Host, unless the caller sends one of its own.
    let mut request = format!("{method} {path} HTTP/1.0\r\n");
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
        request.push_str(&format!("Host: {addr}\r\n"));
    }
    for (k, v) in headers {
        request.push_str(&format!("{k}: {v}\r\n"));
    }
    if !body.is_empty() {
        request.push_str(&format!(
            "Content-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\n",
            body.len()
        ));
    }
    request.push_str("\r\n");
    request.push_str(body);
    s.write_all(request.as_bytes()).await.expect("send request");
    let mut out = String::new();
    s.read_to_string(&mut out).await.expect("read response");
    let (head, body) = out.split_once("\r\n\r\n").unwrap_or((&out, ""));
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    HttpResponse {
        status,
        headers,
        body: body.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_listening_address_is_read_from_text_and_json_logs() {
        let text = "2026-12-03T07:00:00Z  INFO outbox_dispatcher::service: The dispatcher started. \
                    addr=127.0.0.1:41234 workers=4";
        let json = r#"{"severity":"INFO","addr":"127.0.0.1:41235","workers":4}"#;
        assert_eq!(logged_addr(text), "127.0.0.1:41234".parse().ok());
        assert_eq!(logged_addr(json), "127.0.0.1:41235".parse().ok());
        assert_eq!(logged_addr("peer_addr=nothing here"), None);
    }

    #[tokio::test]
    async fn a_reserved_port_refuses_connections_until_a_server_takes_it() {
        let reserved = ReservedPort::new();
        let addr = SocketAddr::from(([127, 0, 0, 1], reserved.port()));
        let err = tokio::net::TcpStream::connect(addr)
            .await
            .expect_err("nothing listens");
        assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused);
        let server = tokio::net::TcpListener::bind(addr)
            .await
            .expect("a server binding with SO_REUSEADDR takes it");
        tokio::net::TcpStream::connect(addr)
            .await
            .expect("and is reached there");
        drop(server);
    }
}
