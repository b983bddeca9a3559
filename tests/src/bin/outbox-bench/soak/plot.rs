//! The soak's series over time as one SVG (no plotting dependency): throughput, latency (log
//! scale), the outbox's size and dead tuples, the dispatchers' memory; the held snapshot shaded.

use std::fmt::Write as _;

use super::Phases;
use super::sample::Sample;

/// The series over time as an SVG: throughput, latency (log scale), the outbox's size and dead
/// tuples, the dispatchers' memory; the held snapshot shaded.
/// The RSS series' names, by replica.
const RSS_LABELS: [&str; 3] = ["RSS replica 1", "RSS replica 2", "RSS replica 3"];

pub(crate) fn plot(samples: &[Sample], phases: Phases) -> String {
    const W: f64 = 960.0;
    const PANEL: f64 = 190.0;
    const LEFT: f64 = 70.0;
    const RIGHT: f64 = 20.0;
    const TOP: f64 = 48.0;
    let t_max = samples
        .last()
        .map_or(phases.end.as_secs_f64(), |s| s.t)
        .max(1.0);
    let x = |t: f64| LEFT + (W - LEFT - RIGHT) * t / t_max;
    type Series<'a> = (&'a str, &'a str, Box<dyn Fn(&Sample) -> f64 + 'a>);
    let panels: Vec<(&str, bool, Vec<Series>)> = vec![
        (
            "messages/s",
            false,
            vec![
                ("enqueued", "#1f77b4", Box::new(|s: &Sample| s.enqueued)),
                ("published", "#2ca02c", Box::new(|s: &Sample| s.published)),
            ],
        ),
        (
            "ms (log)",
            true,
            vec![
                (
                    "commit→publish p50",
                    "#9467bd",
                    Box::new(|s: &Sample| s.p50_ms),
                ),
                (
                    "commit→publish p99",
                    "#d62728",
                    Box::new(|s: &Sample| s.p99_ms),
                ),
                (
                    "claim mean",
                    "#ff7f0e",
                    Box::new(|s: &Sample| s.claim_mean_ms),
                ),
                (
                    "claim p99 (bucket)",
                    "#8c564b",
                    Box::new(|s: &Sample| s.claim_p99_ms),
                ),
                (
                    "publish p99 (bucket)",
                    "#e377c2",
                    Box::new(|s: &Sample| s.publish_p99_ms),
                ),
            ],
        ),
        (
            "MB / thousand tuples",
            false,
            vec![
                (
                    "heap+index MB",
                    "#1f77b4",
                    Box::new(|s: &Sample| s.heap_mb + s.index_mb),
                ),
                (
                    "dead tuples (k)",
                    "#d62728",
                    Box::new(|s: &Sample| s.dead as f64 / 1e3),
                ),
            ],
        ),
        (
            "MiB",
            false,
            ["#17becf", "#bcbd22", "#7f7f7f"]
                .iter()
                .zip(RSS_LABELS)
                .enumerate()
                .filter(|(r, _)| samples.iter().any(|s| s.rss_mb.len() > *r))
                .map(|(r, (colour, label))| -> Series {
                    (
                        label,
                        colour,
                        Box::new(move |s: &Sample| s.rss_mb.get(r).copied().unwrap_or(f64::NAN)),
                    )
                })
                .collect(),
        ),
    ];
    let height = TOP + panels.len() as f64 * (PANEL + 40.0) + 30.0;
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(svg, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        svg,
        r#"<text x="{LEFT}" y="18" font-size="13">outbox soak: {} samples over {:.0} min (shaded: REPEATABLE READ snapshot held)</text>"#,
        samples.len(),
        t_max / 60.0
    );
    for (i, (unit, log, series)) in panels.iter().enumerate() {
        let top = TOP + i as f64 * (PANEL + 40.0);
        let bottom = top + PANEL;
        let values: Vec<f64> = series
            .iter()
            .flat_map(|(_, _, f)| samples.iter().map(f))
            .filter(|v| v.is_finite() && (!log || *v > 0.0))
            .collect();
        let (lo, hi) = if *log {
            let lo = values
                .iter()
                .copied()
                .fold(f64::INFINITY, f64::min)
                .max(0.01);
            let hi = values.iter().copied().fold(0.0, f64::max).max(lo * 10.0);
            (lo.log10().floor(), hi.log10().ceil())
        } else {
            (
                0.0,
                nice(values.iter().copied().fold(0.0, f64::max).max(1.0) * 1.05),
            )
        };
        let y = |v: f64| {
            let v = if *log {
                v.max(10f64.powf(lo)).log10()
            } else {
                v
            };
            bottom - PANEL * (v - lo) / (hi - lo)
        };
        let _ = writeln!(
            svg,
            r##"<rect x="{:.1}" y="{top}" width="{:.1}" height="{PANEL}" fill="#f3e6c4"/>"##,
            x(phases.snapshot_start.as_secs_f64()),
            x(phases.snapshot_end.as_secs_f64()) - x(phases.snapshot_start.as_secs_f64())
        );
        let _ = writeln!(
            svg,
            r##"<rect x="{LEFT}" y="{top}" width="{:.1}" height="{PANEL}" fill="none" stroke="#888"/>"##,
            W - LEFT - RIGHT
        );
        // Gridlines: 5 linear steps or each decade.
        let ticks: Vec<f64> = if *log {
            (lo as i32..=hi as i32).map(|e| 10f64.powi(e)).collect()
        } else {
            (0..=4).map(|k| hi * f64::from(k) / 4.0).collect()
        };
        for v in ticks {
            let _ = writeln!(
                svg,
                r##"<line x1="{LEFT}" x2="{:.1}" y1="{:.1}" y2="{:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
                W - RIGHT,
                y(v),
                y(v),
                LEFT - 4.0,
                y(v) + 4.0,
                tick_label(v)
            );
        }
        let _ = writeln!(
            svg,
            r#"<text x="12" y="{:.1}" transform="rotate(-90 12 {:.1})" text-anchor="middle">{unit}</text>"#,
            top + PANEL / 2.0,
            top + PANEL / 2.0
        );
        let mut legend_x = LEFT + 6.0;
        for (name, colour, f) in series {
            let points: Vec<String> = samples
                .iter()
                .filter_map(|s| {
                    let v = f(s);
                    (v.is_finite() && (!log || v > 0.0))
                        .then(|| format!("{:.1},{:.1}", x(s.t), y(v)))
                })
                .collect();
            let _ = writeln!(
                svg,
                r#"<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{}"/>"#,
                points.join(" ")
            );
            let _ = writeln!(
                svg,
                r#"<text x="{legend_x:.1}" y="{:.1}" fill="{colour}">{name}</text>"#,
                top - 4.0
            );
            legend_x += 7.0 * name.chars().count() as f64 + 24.0;
        }
        // Time axis: every 5 minutes (every 30 s in a short run).
        let step = if t_max > 900.0 { 300.0 } else { 30.0 };
        let mut t = 0.0;
        while t <= t_max {
            let _ = writeln!(
                svg,
                r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
                x(t),
                bottom + 14.0,
                if step >= 60.0 {
                    format!("{:.0} min", t / 60.0)
                } else {
                    format!("{t:.0} s")
                }
            );
            t += step;
        }
    }
    svg.push_str("</svg>\n");
    svg
}

/// The smallest 1, 2 or 5 x 10^k at or above `v` (a round axis maximum).
fn nice(v: f64) -> f64 {
    let decade = 10f64.powf(v.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * decade)
        .find(|c| *c >= v)
        .unwrap_or(10.0 * decade)
}

/// An axis label: whole numbers from 10 up, one or two decimals below.
fn tick_label(v: f64) -> String {
    if v == 0.0 || v.abs() >= 10.0 {
        format!("{v:.0}")
    } else if v.abs() >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}
