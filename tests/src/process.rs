//! Running the project's binaries as child processes (for SIGKILL / SIGTERM tests).

use std::path::PathBuf;
use std::process::Stdio;

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

/// A running child; killed when dropped.
#[derive(Debug)]
pub struct Process {
    /// The child.
    pub child: Child,
    /// Where its stdout and stderr go.
    pub log: PathBuf,
}

impl Process {
    /// Starts `binary` with `args` and `envs` (the parent's OUTBOX_* variables are not inherited).
    pub fn spawn(binary: &str, args: &[&str], envs: &[(&str, String)]) -> Self {
        Self::spawn_path(&self::binary(binary), args, envs, &[])
    }

    /// Like [`Self::spawn`], with the variables `unset` removed from the environment it inherits.
    pub fn spawn_without(
        binary: &str,
        args: &[&str],
        envs: &[(&str, String)],
        unset: &[&str],
    ) -> Self {
        Self::spawn_path(&self::binary(binary), args, envs, unset)
    }

    /// Starts the example `name` (see [`example`]) like [`Self::spawn`].
    pub fn spawn_example(name: &str, args: &[&str], envs: &[(&str, String)]) -> Self {
        Self::spawn_path(&self::example(name), args, envs, &[])
    }

    fn spawn_path(
        path: &std::path::Path,
        args: &[&str],
        envs: &[(&str, String)],
        unset: &[&str],
    ) -> Self {
        let name = path
            .file_name()
            .map_or_else(|| "child".into(), |n| n.to_string_lossy().into_owned());
        let log = std::env::temp_dir().join(format!("{}.log", crate::env::unique_name(&name)));
        let file = std::fs::File::create(&log).expect("create a log file");
        let mut cmd = Command::new(path);
        for (k, _) in std::env::vars() {
            if k.starts_with("OUTBOX_") || unset.contains(&k.as_str()) {
                cmd.env_remove(k);
            }
        }
        cmd.args(args)
            .envs(envs.iter().map(|(k, v)| (*k, v.as_str())))
            .stdin(Stdio::null())
            .stdout(Stdio::from(file.try_clone().expect("share the log file")))
            .stderr(Stdio::from(file))
            .kill_on_drop(true);
        let child = cmd.spawn().expect("spawn the binary");
        Self { child, log }
    }

    /// Sends a signal by name (TERM, INT, KILL).
    pub fn signal(&self, signal: &str) {
        let pid = self.child.id().expect("process is running");
        let status = std::process::Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(pid.to_string())
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{signal} {pid} failed");
    }

    /// The log so far (for assertion messages).
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// Runs `binary` with `args` and `envs` to its end (the parent's OUTBOX_* variables are not
/// inherited) and returns its exit status, stdout and stderr.
pub async fn output(binary: &str, args: &[&str], envs: &[(&str, String)]) -> std::process::Output {
    output_without(binary, args, envs, &[]).await
}

/// Like [`output`], with the variables `unset` removed from the environment it inherits.
pub async fn output_without(
    binary: &str,
    args: &[&str],
    envs: &[(&str, String)],
    unset: &[&str],
) -> std::process::Output {
    let mut cmd = Command::new(self::binary(binary));
    for (k, _) in std::env::vars() {
        if k.starts_with("OUTBOX_") || unset.contains(&k.as_str()) {
            cmd.env_remove(k);
        }
    }
    cmd.args(args)
        .envs(envs.iter().map(|(k, v)| (*k, v.as_str())))
        .stdin(Stdio::null())
        .kill_on_drop(true);
    let run = tokio::time::timeout(std::time::Duration::from_secs(60), cmd.output());
    run.await
        .unwrap_or_else(|_| panic!("{binary} {args:?} ends within 60 s"))
        .expect("run the binary")
}

/// Sends SIGTERM to every process and asserts each exits 0 within 30 s (its log otherwise).
pub async fn terminate_all(procs: Vec<Process>) {
    for p in &procs {
        p.signal("TERM");
    }
    for mut p in procs {
        let status = tokio::time::timeout(std::time::Duration::from_secs(30), p.child.wait())
            .await
            .expect("exits within 30 s of SIGTERM")
            .expect("exit status");
        assert!(status.success(), "clean exit; log:\n{}", p.log());
    }
}

/// A loopback port for a child service to bind, or for a connection that must be refused.
///
/// It comes from 20000..32000, below the kernel's ephemeral range (32768-60999 on Linux), so no
/// `bind(port 0)` or outgoing connection of a concurrent test can be handed it between this call
/// and the child's bind (the race of "bind port 0, release, hope"). Each call of a run returns a
/// port of a window of 30, offset by the process id so concurrent runs differ, in turn (after
/// the last it starts again at the first: a long run such as a benchmark starts hundreds of
/// children), skipping ports something already listens on.
pub fn unused_low_port() -> u16 {
    use std::sync::atomic::{AtomicU16, Ordering};
    const WINDOW: u16 = 30;
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let base = 20_000 + (std::process::id() % 400) as u16 * WINDOW;
    for _ in 0..WINDOW {
        let port = base + NEXT.fetch_add(1, Ordering::Relaxed) % WINDOW;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("every test port in {base}..{} is in use", base + WINDOW);
}

/// `GET path` over plain HTTP/1.0; returns (status, body).
pub async fn http_get(addr: &str, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr)
        .await
        .expect("connect to the HTTP endpoint");
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await
        .expect("send request");
    let mut out = String::new();
    s.read_to_string(&mut out).await.expect("read response");
    let status = out
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = out
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}
