//! Line charts as SVG, drawn on the server (no charting library, no script): the last hour of
//! the console's samples, one line per series, the y axis from 0 to the largest value.

use super::html::esc;

/// One line: its name and its points (seconds before now, value), oldest first.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    /// The legend's text.
    pub name: String,
    /// (seconds ago, value).
    pub points: Vec<(f64, f64)>,
}

const PALETTE: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];
const W: f64 = 520.0;
const H: f64 = 200.0;
const LEFT: f64 = 56.0;
const BOTTOM: f64 = 22.0;
const TOP: f64 = 8.0;

/// A chart of `series` over the last `span` seconds, values in `unit`; `id` names it.
pub fn chart(id: &str, title: &str, unit: &str, span: f64, series: &[Series]) -> String {
    let max = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .fold(0.0_f64, f64::max);
    let top = if max > 0.0 { nice(max) } else { 1.0 };
    let x = |ago: f64| LEFT + (W - LEFT - 4.0) * (1.0 - (ago / span).clamp(0.0, 1.0));
    let y = |v: f64| TOP + (H - TOP - BOTTOM) * (1.0 - (v / top).clamp(0.0, 1.0));
    let mut svg = format!(
        "<svg id=\"{id}\" xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{H}\" \
         viewBox=\"0 0 {W} {H}\" role=\"img\" aria-label=\"{}\">",
        esc(title)
    );
    // Axes, the top value and the time marks.
    svg.push_str(&format!(
        "<line x1=\"{LEFT}\" y1=\"{TOP}\" x2=\"{LEFT}\" y2=\"{b}\" stroke=\"#999\"/>\
         <line x1=\"{LEFT}\" y1=\"{b}\" x2=\"{r}\" y2=\"{b}\" stroke=\"#999\"/>\
         <text x=\"{tx}\" y=\"{ty}\" font-size=\"10\" text-anchor=\"end\">{top} {unit}</text>\
         <text x=\"{tx}\" y=\"{b}\" font-size=\"10\" text-anchor=\"end\">0</text>",
        b = H - BOTTOM,
        r = W - 4.0,
        tx = LEFT - 4.0,
        ty = TOP + 8.0,
        top = format_value(top),
        unit = esc(unit),
    ));
    for minutes in [60.0, 45.0, 30.0, 15.0, 0.0] {
        let ago = minutes * 60.0;
        if ago > span {
            continue;
        }
        let (label, anchor) = if minutes == 0.0 {
            ("now".to_owned(), "end")
        } else {
            (format!("-{minutes:.0}m"), "middle")
        };
        svg.push_str(&format!(
            "<text x=\"{:.1}\" y=\"{:.1}\" font-size=\"10\" text-anchor=\"{anchor}\">{label}</text>",
            x(ago),
            H - 6.0
        ));
    }
    for (i, s) in series.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        let points: Vec<String> = s
            .points
            .iter()
            .map(|(ago, v)| format!("{:.1},{:.1}", x(*ago), y(*v)))
            .collect();
        if !points.is_empty() {
            svg.push_str(&format!(
                "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"1.5\" points=\"{}\"/>",
                points.join(" ")
            ));
        }
        svg.push_str(&format!(
            "<text x=\"{:.1}\" y=\"{:.1}\" font-size=\"10\" fill=\"{color}\">{}</text>",
            LEFT + 6.0,
            TOP + 12.0 + 11.0 * i as f64,
            esc(&s.name)
        ));
    }
    svg.push_str("</svg>");
    format!(
        "<figure><figcaption>{}</figcaption>{svg}</figure>",
        esc(title)
    )
}

/// The smallest of 1, 2, 5 x 10^k at or above `v`.
fn nice(v: f64) -> f64 {
    let exp = v.log10().floor();
    let base = 10f64.powf(exp);
    [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * base)
        .find(|c| *c >= v)
        .unwrap_or(10.0 * base)
}

fn format_value(v: f64) -> String {
    if v >= 1000.0 {
        format!("{:.0}k", v / 1000.0)
    } else if v >= 1.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.2}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chart_draws_each_series_and_escapes_its_names() {
        let svg = chart(
            "backlog",
            "Backlog",
            "rows",
            3600.0,
            &[
                Series {
                    name: "projects/p/topics/<a>".into(),
                    points: vec![(3600.0, 0.0), (1800.0, 40.0), (0.0, 10.0)],
                },
                Series {
                    name: "b".into(),
                    points: vec![],
                },
            ],
        );
        assert_eq!(
            svg.matches("<polyline").count(),
            1,
            "an empty series draws no line"
        );
        assert!(svg.contains("projects/p/topics/&lt;a&gt;"));
        assert!(
            svg.contains(">50 rows<"),
            "the top of the axis is a round 50: {svg}"
        );
        assert!(!svg.contains("<script"));
    }

    #[test]
    fn axis_tops_are_round() {
        assert_eq!(nice(0.3), 0.5);
        assert_eq!(nice(7.0), 10.0);
        assert_eq!(nice(120.0), 200.0);
        assert_eq!(nice(1000.0), 1000.0);
    }
}
