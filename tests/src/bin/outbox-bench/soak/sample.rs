//! One sample of the soak every 10 s: the dispatchers' counters (published, claim time), the
//! reader's latencies, the outbox's size and dead tuples, `dispatcher status`'s warnings; printed
//! as a line and written as `samples.csv`.

use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use harness::process::Spawn;
use sqlx::PgPool;
use std::fmt::Write as _;

use super::{Phases, Shared, SoakArgs, locked};
use harness::dispatcher::metric_sum;

use crate::binary::DispatcherProcess;

/// One sample (the interval ending at `t`).
#[derive(Debug, Clone, Default)]
pub(crate) struct Sample {
    pub(crate) t: f64,
    pub(crate) phase: &'static str,
    pub(crate) enqueued: f64,
    pub(crate) published: f64,
    pub(crate) arrived: f64,
    pub(crate) p50_ms: f64,
    pub(crate) p99_ms: f64,
    pub(crate) max_ms: f64,
    pub(crate) claims: f64,
    pub(crate) claim_mean_ms: f64,
    pub(crate) claim_p99_ms: f64,
    /// The dispatchers' publish round trips: the bucket of their p99 and of the slowest (ms).
    pub(crate) publish_p99_ms: f64,
    pub(crate) publish_max_ms: f64,
    pub(crate) heap_mb: f64,
    pub(crate) index_mb: f64,
    pub(crate) live: i64,
    pub(crate) dead: i64,
    pub(crate) vacuums: i64,
    pub(crate) analyzes: i64,
    pub(crate) backlog: f64,
    /// Each dispatcher's resident memory, MiB.
    pub(crate) rss_mb: Vec<f64>,
    /// Of it, each one's anonymous pages (the rest is file-backed), MiB.
    pub(crate) anon_mb: Vec<f64>,
    pub(crate) warnings: Vec<&'static str>,
}

/// The dispatchers' counters at one instant, summed over the replicas.
#[derive(Debug, Clone, Default)]
pub(crate) struct Counters {
    at: Option<Instant>,
    published: f64,
    enqueued: u64,
    arrived: u64,
    claim: Histogram,
    publish: Histogram,
    backlog: f64,
}

/// A Prometheus histogram summed over the replicas.
#[derive(Debug, Clone, Default)]
struct Histogram {
    count: f64,
    sum: f64,
    /// Cumulative buckets: (upper bound in seconds, count), ascending.
    buckets: Vec<(f64, f64)>,
}

impl Histogram {
    fn read(pages: &[String], name: &str) -> Self {
        let mut h = Self::default();
        let mut buckets: std::collections::BTreeMap<u64, (f64, f64)> = Default::default();
        let prefix = format!("{name}_bucket{{le=\"");
        for page in pages {
            h.count += metric_sum(page, &format!("{name}_count"));
            h.sum += metric_sum(page, &format!("{name}_sum"));
            for line in page.lines() {
                let Some(rest) = line.strip_prefix(prefix.as_str()) else {
                    continue;
                };
                let Some((le, count)) = rest.split_once("\"} ") else {
                    continue;
                };
                let le = if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().unwrap_or(f64::NAN)
                };
                let count: f64 = count.trim().parse().unwrap_or(0.0);
                buckets.entry(le.to_bits()).or_insert((le, 0.0)).1 += count;
            }
        }
        h.buckets = buckets.into_values().collect();
        h.buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        h
    }

    /// Observations since `before`, and the upper bound of the bucket holding their `q` quantile
    /// and of the highest non-empty bucket (seconds).
    fn since(&self, before: &Self, q: f64) -> (f64, f64, f64) {
        let n = self.count - before.count;
        let delta = |i: usize| self.buckets[i].1 - before.buckets.get(i).map_or(0.0, |b| b.1);
        let quantile = (0..self.buckets.len())
            .find(|i| delta(*i) >= q * n)
            .map_or(f64::NAN, |i| self.buckets[i].0);
        let max = (0..self.buckets.len())
            .find(|i| delta(*i) >= n)
            .map_or(f64::NAN, |i| self.buckets[i].0);
        (n, quantile, max)
    }
}

impl Counters {
    pub(crate) async fn read(dispatchers: &[DispatcherProcess]) -> Result<Self> {
        let mut pages = Vec::new();
        for d in dispatchers {
            pages.push(d.metrics_text().await?);
        }
        Ok(Self {
            at: Some(Instant::now()),
            published: pages
                .iter()
                .map(|p| metric_sum(p, "outbox_published_total"))
                .sum(),
            claim: Histogram::read(&pages, "outbox_claim_duration_seconds"),
            publish: Histogram::read(&pages, "outbox_publish_duration_seconds"),
            backlog: pages
                .iter()
                .map(|p| metric_sum(p, "outbox_backlog_rows"))
                .fold(0.0, f64::max),
            ..Self::default()
        })
    }
}

#[allow(clippy::too_many_arguments)]
pub(crate) async fn sample(
    pool: &PgPool,
    dispatchers: &[DispatcherProcess],
    shared: &Shared,
    before: &mut Counters,
    status_bin: &Path,
    database_url: &str,
    phases: Phases,
    t0: Instant,
    args: &SoakArgs,
) -> Result<Sample> {
    let mut now = Counters::read(dispatchers).await?;
    now.enqueued = shared.enqueued.load(Ordering::Relaxed);
    now.arrived = shared.arrived.load(Ordering::Relaxed);
    let secs = match (before.at, now.at) {
        (Some(a), Some(b)) => (b - a).as_secs_f64().max(1e-3),
        _ => args.sample_seconds as f64,
    };
    let mut latencies = std::mem::take(&mut *locked(&shared.latencies)?);
    latencies.sort_by(f64::total_cmp);
    let (claims, claim_p99, _) = now.claim.since(&before.claim, 0.99);
    let (_, publish_p99, publish_max) = now.publish.since(&before.publish, 0.99);
    let (heap, index, live, dead, vacuums, analyzes): (i64, i64, i64, i64, i64, i64) =
        sqlx::query_as(
            "SELECT pg_relation_size('pubsub_outbox'), pg_indexes_size('pubsub_outbox'),
                    n_live_tup, n_dead_tup, vacuum_count + autovacuum_count,
                    analyze_count + autoanalyze_count
             FROM pg_stat_user_tables WHERE relname = 'pubsub_outbox'",
        )
        .fetch_one(pool)
        .await?;
    let warnings = status_warnings(status_bin, database_url).await?;
    let t = t0.elapsed();
    let s = Sample {
        t: t.as_secs_f64(),
        phase: phases.name(t),
        enqueued: (now.enqueued - before.enqueued) as f64 / secs,
        published: (now.published - before.published) / secs,
        arrived: (now.arrived - before.arrived) as f64 / secs,
        p50_ms: percentile(&latencies, 0.50),
        p99_ms: percentile(&latencies, 0.99),
        max_ms: latencies.last().copied().unwrap_or(f64::NAN),
        claims: claims / secs,
        claim_mean_ms: if claims > 0.0 {
            (now.claim.sum - before.claim.sum) / claims * 1e3
        } else {
            f64::NAN
        },
        claim_p99_ms: claim_p99 * 1e3,
        publish_p99_ms: publish_p99 * 1e3,
        publish_max_ms: publish_max * 1e3,
        heap_mb: heap as f64 / 1048576.0,
        index_mb: index as f64 / 1048576.0,
        live,
        dead,
        vacuums,
        analyzes,
        backlog: now.backlog,
        rss_mb: dispatchers.iter().map(|d| d.memory_mb().0).collect(),
        anon_mb: dispatchers
            .iter()
            .map(DispatcherProcess::anonymous_mb)
            .collect(),
        warnings,
    };
    *before = now;
    Ok(s)
}

impl Sample {
    /// Each replica's RSS, space-separated.
    fn rss_text(&self) -> String {
        mib_list(&self.rss_mb)
    }

    /// Each replica's anonymous pages, space-separated.
    fn anon_text(&self) -> String {
        mib_list(&self.anon_mb)
    }
}

fn mib_list(values: &[f64]) -> String {
    values
        .iter()
        .map(|v| format!("{v:.1}"))
        .collect::<Vec<_>>()
        .join(" ")
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// `dispatcher status --json`'s warnings, by kind.
async fn status_warnings(bin: &Path, database_url: &str) -> Result<Vec<&'static str>> {
    let out = Spawn::program(bin)
        .args(["status", "--json", "--long-transaction", "10s"])
        .env("DATABASE_URL", database_url)
        .env("OUTBOX_LOG", "warn")
        .output(Duration::from_secs(30))
        .await?;
    if !out.status.success() {
        bail!(
            "dispatcher status failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let v: serde_json::Value =
        serde_json::from_slice(&out.stdout).context("parsing dispatcher status --json")?;
    let mut kinds: Vec<&'static str> = v["warnings"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|w| w.as_str())
        .map(|w| {
            if w.contains("has been open") {
                if w.contains("outbox-soak held snapshot") {
                    "long_tx(snapshot)"
                } else {
                    "long_tx(other)"
                }
            } else if w.contains("dead tuples") {
                "dead_rows"
            } else if w.contains("blocked by") {
                "blocked_key"
            } else if w.contains("dead-lettered") {
                "dead_lettered"
            } else if w.contains("heartbeat") {
                "replica_gone"
            } else if w.contains("Pub/Sub is unreachable") {
                "breaker_open"
            } else if w.contains("paused") {
                "paused"
            } else {
                "other"
            }
        })
        .collect();
    kinds.sort_unstable();
    kinds.dedup();
    Ok(kinds)
}

pub(crate) fn print_sample(s: &Sample) {
    println!(
        "  [{:>6.0}s {:<8}] enq {:>6.0}/s pub {:>6.0}/s arr {:>6.0}/s | commit->publish p50 {:>7.1} p99 {:>8.1} max {:>8.1} ms | claims {:>5.0}/s mean {:>6.2} p99 {:>7.1} ms | publish p99 {:>6.0} max {:>6.0} ms | heap {:>6.1} MB idx {:>5.1} MB live {:>7} dead {:>7} vac {} an {} | backlog {:>6.0} | RSS {} MiB (anonymous {}) | {}",
        s.t,
        s.phase,
        s.enqueued,
        s.published,
        s.arrived,
        s.p50_ms,
        s.p99_ms,
        s.max_ms,
        s.claims,
        s.claim_mean_ms,
        s.claim_p99_ms,
        s.publish_p99_ms,
        s.publish_max_ms,
        s.heap_mb,
        s.index_mb,
        s.live,
        s.dead,
        s.vacuums,
        s.analyzes,
        s.backlog,
        s.rss_text(),
        s.anon_text(),
        if s.warnings.is_empty() {
            "-".to_owned()
        } else {
            s.warnings.join(",")
        }
    );
}

pub(crate) fn write_csv(path: &Path, samples: &[Sample]) -> Result<()> {
    let mut out = String::from(
        "t_s,phase,enqueued_per_s,published_per_s,arrived_per_s,p50_ms,p99_ms,max_ms,claims_per_s,claim_mean_ms,claim_p99_ms,heap_mb,index_mb,live_tuples,dead_tuples,vacuums,analyzes,backlog,dispatcher_rss_mb,status_warnings,publish_p99_ms,publish_max_ms,rss_by_replica_mb,anonymous_by_replica_mb\n",
    );
    for s in samples {
        let _ = writeln!(
            out,
            "{:.1},{},{:.1},{:.1},{:.1},{:.2},{:.2},{:.2},{:.1},{:.3},{:.2},{:.2},{:.2},{},{},{},{},{:.0},{:.1},{},{:.1},{:.1},{},{}",
            s.t,
            s.phase,
            s.enqueued,
            s.published,
            s.arrived,
            s.p50_ms,
            s.p99_ms,
            s.max_ms,
            s.claims,
            s.claim_mean_ms,
            s.claim_p99_ms,
            s.heap_mb,
            s.index_mb,
            s.live,
            s.dead,
            s.vacuums,
            s.analyzes,
            s.backlog,
            s.rss_mb.iter().sum::<f64>(),
            s.warnings.join(" "),
            s.publish_p99_ms,
            s.publish_max_ms,
            s.rss_text(),
            s.anon_text()
        );
    }
    std::fs::write(path, out).with_context(|| format!("writing {}", path.display()))
}

/// Reads a `samples.csv` written by [`write_csv`] back (for redrawing; warnings are not kept).
pub(crate) fn read_csv(path: &Path) -> Result<Vec<Sample>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut samples = Vec::new();
    for (n, line) in text.lines().enumerate().skip(1) {
        let f: Vec<&str> = line.split(',').collect();
        if f.len() < 19 {
            bail!(
                "{}:{}: expected 20 columns, found {}",
                path.display(),
                n + 1,
                f.len()
            );
        }
        let num = |i: usize| f[i].parse::<f64>().unwrap_or(f64::NAN);
        let int = |i: usize| f[i].parse::<i64>().unwrap_or(0);
        samples.push(Sample {
            t: num(0),
            phase: match f[1] {
                "warmup" => "warmup",
                "steady" => "steady",
                "snapshot" => "snapshot",
                _ => "after",
            },
            enqueued: num(2),
            published: num(3),
            arrived: num(4),
            p50_ms: num(5),
            p99_ms: num(6),
            max_ms: num(7),
            claims: num(8),
            claim_mean_ms: num(9),
            claim_p99_ms: num(10),
            heap_mb: num(11),
            index_mb: num(12),
            live: int(13),
            dead: int(14),
            vacuums: int(15),
            analyzes: int(16),
            backlog: num(17),
            publish_p99_ms: f.get(20).map_or(f64::NAN, |_| num(20)),
            publish_max_ms: f.get(21).map_or(f64::NAN, |_| num(21)),
            // Older runs kept only the sum.
            rss_mb: match f.get(22) {
                Some(each) => each.split(' ').filter_map(|v| v.parse().ok()).collect(),
                None => vec![num(18)],
            },
            anon_mb: f
                .get(23)
                .map(|each| each.split(' ').filter_map(|v| v.parse().ok()).collect())
                .unwrap_or_default(),
            warnings: Vec::new(),
        });
    }
    Ok(samples)
}
