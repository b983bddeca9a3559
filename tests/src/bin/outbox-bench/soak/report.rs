//! The targets of issue #26, judged from the soak's samples and printed as a table.

use super::sample::Sample;
use super::{Phases, SoakArgs};

/// The targets of issue #26, judged from the samples and printed as a table.
pub(crate) fn judge(samples: &[Sample], phases: Phases, args: &SoakArgs, labels: &[String]) {
    let of = |phase: &'static str| samples.iter().filter(move |s| s.phase == phase);
    let mean = |v: Vec<f64>| {
        let v: Vec<f64> = v.into_iter().filter(|x| x.is_finite()).collect();
        if v.is_empty() {
            f64::NAN
        } else {
            v.iter().sum::<f64>() / v.len() as f64
        }
    };
    let max = |v: Vec<f64>| {
        v.into_iter()
            .filter(|x| x.is_finite())
            .fold(f64::NAN, f64::max)
    };
    let min = |v: Vec<f64>| {
        v.into_iter()
            .filter(|x| x.is_finite())
            .fold(f64::NAN, f64::min)
    };
    let steady_rate = mean(of("steady").map(|s| s.published).collect());
    let steady_claim = mean(of("steady").map(|s| s.claim_mean_ms).collect());
    let held_min_rate = min(of("snapshot").map(|s| s.published).collect());
    let held_p99 = max(of("snapshot").map(|s| s.p99_ms).collect());
    let after: Vec<&Sample> = of("after").collect();
    let end_snapshot = phases.snapshot_end.as_secs_f64();
    let recovered = after.iter().position(|s| {
        (s.published - steady_rate).abs() <= 0.1 * steady_rate
            && s.claim_mean_ms <= 1.1 * steady_claim
    });
    let recovery_s = recovered.map(|i| after[i].t - end_snapshot);
    let relapses = recovered.map_or(0, |i| {
        after[i..]
            .iter()
            .filter(|s| s.published < 0.7 * steady_rate || s.p99_ms > 1000.0)
            .count()
    });
    // Without a snapshot: steady and after, leaving out the 2 minutes the release is allowed.
    let unheld: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.phase == "steady" || (s.phase == "after" && s.t > end_snapshot + 120.0))
        .collect();
    let unheld_max_p99 = max(unheld.iter().map(|s| s.p99_ms).collect());
    let unheld_over = unheld.iter().filter(|s| s.p99_ms > 250.0).count();
    let window_max_p99 = max(after
        .iter()
        .filter(|s| s.t <= end_snapshot + 120.0)
        .map(|s| s.p99_ms)
        .collect());
    let size = |s: &Sample| s.heap_mb + s.index_mb;
    let at_recovery = recovered.map(|i| size(after[i]));
    let at_end = samples.last().map(size);
    let peak_size = max(samples.iter().map(size).collect());
    let warm = |r: usize| {
        let rss = |s: &&Sample| s.rss_mb.get(r).copied().unwrap_or(f64::NAN);
        let judged: Vec<&Sample> = samples
            .iter()
            .filter(|s| s.t >= phases.warmup_end.as_secs_f64())
            .collect();
        (
            judged.first().map(rss),
            max(judged.iter().map(rss).collect()),
        )
    };
    let yes = |ok: bool| if ok { "**yes**" } else { "no" };
    println!(
        "\n{} msgs/s (+{} rows/s from BigQuery), {} dispatcher(s); steady: {:.0} published/s, claim mean {:.2} ms",
        args.rate, args.bigquery_rate, args.replicas, steady_rate, steady_claim
    );
    println!("| target | measured | met |");
    println!("|---|---|---|");
    println!(
        "| held snapshot: throughput ≥ 0.7 × steady | lowest sample {:.0}/s = {:.2} × | {} |",
        held_min_rate,
        held_min_rate / steady_rate,
        yes(held_min_rate >= 0.7 * steady_rate)
    );
    println!(
        "| held snapshot: p99 commit→publish ≤ 1 s | worst sample {:.0} ms | {} |",
        held_p99,
        yes(held_p99 <= 1000.0)
    );
    let after_claim = mean(
        after
            .iter()
            .rev()
            .take(6)
            .map(|s| s.claim_mean_ms)
            .collect(),
    );
    println!(
        "| back within 10 % (throughput, claim time) ≤ 2 min after the release | {} (claim mean over the last minute {:.2} ms = {:.2} × steady) | {} |",
        recovery_s.map_or("never".to_owned(), |s| format!("{s:.0} s")),
        after_claim,
        after_claim / steady_claim,
        yes(recovery_s.is_some_and(|s| s <= 120.0))
    );
    println!(
        "| no relapse afterwards (≥ 0.7 × steady, p99 ≤ 1 s) | {relapses} sample(s) off | {} |",
        yes(recovered.is_some() && relapses == 0)
    );
    println!(
        "| table stops growing after the release | {} MB at recovery, {} MB at the end (peak {:.1}) | {} |",
        at_recovery.map_or("–".to_owned(), |v| format!("{v:.1}")),
        at_end.map_or("–".to_owned(), |v| format!("{v:.1}")),
        peak_size,
        yes(matches!((at_recovery, at_end), (Some(a), Some(e)) if e <= a * 1.1 + 1.0))
    );
    println!(
        "| no snapshot held: p99 ≤ 0.25 s in every sample (steady, and after the 2 minutes the release may take) | worst {:.0} ms; {} of {} samples over (worst in those 2 minutes: {:.0} ms) | {} |",
        unheld_max_p99,
        unheld_over,
        unheld.len(),
        window_max_p99,
        yes(unheld_over == 0)
    );
    for (r, label) in labels.iter().enumerate() {
        let (warm_rss, max_rss) = warm(r);
        println!(
            "| dispatcher {label} RSS: growth ≤ 10 % after warm-up | {} MiB after warm-up, peak {:.1} MiB | {} |",
            warm_rss.map_or("–".to_owned(), |v| format!("{v:.1}")),
            max_rss,
            yes(warm_rss.is_some_and(|w| max_rss <= 1.1 * w))
        );
    }
}
