//! The real `dispatcher` binary as a child process: started with environment configuration
//! (which every version reads), ready when `/readyz` says so, observed through `/metrics` and
//! `/proc` (published count, resident memory, CPU time).

use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use harness::dispatcher::metric_sum;
use harness::process::{Process, Spawn};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A dispatcher binary to measure, named for the tables: `after=target/release/dispatcher`.
#[derive(Debug, Clone)]
pub struct Contender {
    pub label: String,
    pub path: PathBuf,
}

impl FromStr for Contender {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (label, path) = s.split_once('=').unwrap_or(("dispatcher", s));
        let path = PathBuf::from(path);
        if !path.is_file() {
            return Err(format!(
                "{} is not a file: build it first (cargo build --release -p pubsub-outbox-dispatcher)",
                path.display()
            ));
        }
        Ok(Self {
            label: label.to_owned(),
            path,
        })
    }
}

/// The `dispatcher` built beside this bench (same profile), labelled `dispatcher`.
pub fn default_contender() -> Result<Contender> {
    let exe = std::env::current_exe().context("locating outbox-bench")?;
    let path = exe
        .parent()
        .map(|d| d.join("dispatcher"))
        .ok_or_else(|| anyhow!("outbox-bench has no parent directory"))?;
    if !path.is_file() {
        bail!(
            "{} is missing: build the dispatcher in the same profile as the bench, or pass --dispatcher-bin",
            path.display()
        );
    }
    Ok(Contender {
        label: "dispatcher".to_owned(),
        path,
    })
}

/// A running dispatcher process; killed when dropped.
pub struct DispatcherProcess {
    process: Process,
    addr: String,
}

impl DispatcherProcess {
    /// Starts `binary` against `database_url` and the emulator at `emulator` with the `OUTBOX_*`
    /// settings in `env` (the bench's own `OUTBOX_*` variables are not inherited) on port 0, reads
    /// its address back from its log, and waits until it is ready.
    pub async fn start(
        binary: &Path,
        database_url: &str,
        emulator: &str,
        env: &[(&str, String)],
    ) -> Result<Self> {
        let mut process = Spawn::program(binary)
            .env("DATABASE_URL", database_url)
            .env("PUBSUB_EMULATOR_HOST", emulator)
            .env("OUTBOX_LISTEN_ADDR", "127.0.0.1:0")
            // Warnings only, and the start line that names the bound address.
            .env("OUTBOX_LOG", "warn,outbox_dispatcher::service=info")
            .envs(env)
            .start()?;
        let addr = process
            .bound_addr(Duration::from_secs(30))
            .await
            .context("reading the dispatcher's address from its log")?
            .to_string();
        let mut p = Self { process, addr };
        let started = Instant::now();
        loop {
            if let Ok(Some(status)) = p.process.child.try_wait() {
                bail!("the dispatcher exited with {status}; log:\n{}", p.log());
            }
            if matches!(get(&p.addr, "/readyz").await, Ok((200, _))) {
                return Ok(p);
            }
            if started.elapsed() > Duration::from_secs(30) {
                bail!(
                    "the dispatcher was not ready within 30 s; log:\n{}",
                    p.log()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Messages it published so far (`outbox_published_total`, summed over topics).
    pub async fn published(&self) -> Result<u64> {
        Ok(self.metric("outbox_published_total").await? as u64)
    }

    /// The `/metrics` page.
    pub async fn metrics_text(&self) -> Result<String> {
        let (status, body) = get(&self.addr, "/metrics").await?;
        if status != 200 {
            bail!("/metrics answered {status}");
        }
        Ok(body)
    }

    /// A metric's value summed over its label sets (0 when absent).
    pub async fn metric(&self, name: &str) -> Result<f64> {
        Ok(metric_sum(&self.metrics_text().await?, name))
    }

    /// Whether it is still running.
    pub fn running(&mut self) -> bool {
        matches!(self.process.child.try_wait(), Ok(None))
    }

    /// Resident memory now and at its peak, in MiB (VmRSS, VmHWM).
    pub fn memory_mb(&self) -> (f64, f64) {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.process.pid))
            .unwrap_or_default();
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
                .map_or(f64::NAN, |kb| kb / 1024.0)
        };
        (field("VmRSS:"), field("VmHWM:"))
    }

    /// Of its resident memory, the anonymous pages (heap, stacks, what the allocator keeps), in
    /// MiB; the rest is file-backed (the binary's and libraries' pages). NaN when unreadable.
    pub fn anonymous_mb(&self) -> f64 {
        std::fs::read_to_string(format!("/proc/{}/smaps_rollup", self.process.pid))
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("Anonymous:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
            .map_or(f64::NAN, |kb| kb / 1024.0)
    }

    /// CPU seconds it used so far (user + system, all threads).
    pub fn cpu_seconds(&self) -> f64 {
        cpu_seconds(self.process.pid)
    }

    /// The log so far.
    pub fn log(&self) -> String {
        self.process.log()
    }

    /// SIGTERM, then waits for the exit (SIGKILL after 30 s).
    pub async fn stop(mut self) -> Result<()> {
        self.process.try_signal("TERM");
        match tokio::time::timeout(Duration::from_secs(30), self.process.child.wait()).await {
            Ok(Ok(s)) if s.success() => {
                let _ = std::fs::remove_file(&self.process.log);
                Ok(())
            }
            Ok(Ok(s)) => bail!("the dispatcher exited with {s}; log:\n{}", self.log()),
            Ok(Err(e)) => Err(e).context("waiting for the dispatcher"),
            Err(_) => {
                let _ = self.process.child.kill().await;
                bail!("the dispatcher did not stop within 30 s of SIGTERM")
            }
        }
    }
}

/// CPU seconds of process `pid` (utime + stime from /proc/<pid>/stat; clock ticks of 1/100 s).
pub fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name (which is in parentheses and may hold spaces).
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // utime and stime are fields 14 and 15 of the whole line: 11 and 12 after the name.
    (ticks(11) + ticks(12)) / 100.0
}

/// CPU seconds used so far by the machine's PostgreSQL processes and by the Pub/Sub emulator (a
/// Java process whose command line names the emulator), read from /proc: where a drain's CPU
/// goes besides the dispatcher.
pub fn service_cpu_seconds() -> (f64, f64) {
    let (mut postgres, mut emulator) = (0.0, 0.0);
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return (f64::NAN, f64::NAN);
    };
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
        if comm.trim() == "postgres" {
            postgres += cpu_seconds(pid);
        } else if comm.trim() == "java"
            && std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains("pubsub-emulator"))
        {
            emulator += cpu_seconds(pid);
        }
    }
    (postgres, emulator)
}

/// Waits until the processes together published `n` messages; returns the rate from the first
/// publish seen to the last (so start-up does not count), and the most memory any reached.
pub async fn drain(procs: &[DispatcherProcess], n: u64, limit: Duration) -> Result<Drained> {
    let started = Instant::now();
    let mut first: Option<(Instant, u64)> = None;
    let cpu = |procs: &[DispatcherProcess]| {
        let (pg, emu) = service_cpu_seconds();
        let own: f64 = procs.iter().map(DispatcherProcess::cpu_seconds).sum();
        [own, pg, emu, cpu_seconds(std::process::id())]
    };
    let before = cpu(procs);
    loop {
        let mut total = 0;
        for p in procs {
            total += p.published().await?;
        }
        let now = Instant::now();
        if first.is_none() && total > 0 {
            first = Some((now, total));
        }
        if total >= n {
            // Timed from the first publish seen; a drain that finished within one poll is timed
            // from the start of the wait instead (tiny smoke runs).
            let (t0, c0) = match first {
                Some((t0, c0)) if c0 < n => (t0, c0),
                _ => (started, 0),
            };
            let secs = now.duration_since(t0).as_secs_f64();
            let after = cpu(procs);
            let per_message = |i: usize| (after[i] - before[i]) * 1e6 / n as f64;
            let peak_mb = procs
                .iter()
                .map(|p| p.memory_mb().1)
                .fold(f64::NAN, f64::max);
            return Ok(Drained {
                rate: (n - c0.min(n)) as f64 / secs.max(1e-3),
                peak_mb,
                cpu_us: [per_message(0), per_message(1), per_message(2)],
                bench_us: per_message(3),
            });
        }
        if started.elapsed() > limit {
            bail!(
                "published {total} of {n} within {limit:?}; log of the first dispatcher:\n{}",
                procs
                    .first()
                    .map(DispatcherProcess::log)
                    .unwrap_or_default()
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// One measured drain by dispatcher processes.
#[derive(Debug, Clone, Copy)]
pub struct Drained {
    pub rate: f64,
    pub peak_mb: f64,
    /// CPU µs per message of the dispatcher(s), PostgreSQL and the emulator, over the whole run
    /// (start-up included, a few ms).
    pub cpu_us: [f64; 3],
    /// CPU µs per message of this bench process (the latency proxy, when one runs, copies every
    /// byte in it).
    pub bench_us: f64,
}

impl Drained {
    /// Cores the whole pipeline kept busy during the drain (dispatchers, PostgreSQL, the
    /// emulator and this process).
    pub fn cores(&self) -> f64 {
        (self.cpu_us.iter().sum::<f64>() + self.bench_us) * self.rate / 1e6
    }
}

/// `GET path` over HTTP/1.0 on loopback; (status, body).
async fn get(addr: &str, path: &str) -> Result<(u16, String)> {
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await?;
    let mut out = String::new();
    s.read_to_string(&mut out).await?;
    let status = out
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| anyhow!("no HTTP status from {addr}{path}"))?;
    let body = out.split_once("\r\n\r\n").map_or("", |(_, b)| b).to_owned();
    Ok((status, body))
}
