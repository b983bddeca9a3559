//! Human tables for the operator commands of both binaries: a header line, left-aligned columns
//! padded to their widest cell (the last one is not padded); and the one way their text gives an
//! instant ([`instant`]: RFC 3339 in UTC, to the second) and a length of time ([`duration`]:
//! `3.2s`, `4m 12s`, `2h 5m`, `3d 4h`). JSON keeps its own, exact forms.

/// A table to print.
#[derive(Debug, Default)]
pub struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// A table with these column names.
    pub fn new(header: &[&str]) -> Self {
        Self {
            header: header.iter().map(|h| (*h).to_owned()).collect(),
            rows: Vec::new(),
        }
    }

    /// Adds a row.
    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    /// Whether it has no rows.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// The table as text.
    pub fn render(&self) -> String {
        let mut widths: Vec<usize> = self.header.iter().map(|h| h.chars().count()).collect();
        for row in &self.rows {
            for (i, cell) in row.iter().enumerate() {
                if let Some(w) = widths.get_mut(i) {
                    *w = (*w).max(cell.chars().count());
                }
            }
        }
        let line = |cells: &[String]| {
            let mut out = String::new();
            for (i, cell) in cells.iter().enumerate() {
                let w = widths.get(i).copied().unwrap_or(0);
                out.push_str(cell);
                if i + 1 < cells.len() {
                    out.push_str(&" ".repeat(w.saturating_sub(cell.chars().count()) + 2));
                }
            }
            out.push('\n');
            out
        };
        let mut out = line(&self.header);
        for row in &self.rows {
            out.push_str(&line(row));
        }
        out
    }
}

/// `text` for a terminal: control characters escaped (`\n`, `\u{1b}`) and so backslashes too
/// (`\\`: a payload's own `\n` is not read as a newline), everything else as is.
pub fn printable(text: &str) -> String {
    text.chars()
        .flat_map(|c| {
            let escaped: Vec<char> = if c.is_control() || c == '\\' {
                c.escape_default().collect()
            } else {
                vec![c]
            };
            escaped
        })
        .collect()
}

/// An instant for people: RFC 3339 in UTC, to the second (`2026-12-04T15:30:33Z`).
pub fn instant(t: chrono::DateTime<chrono::Utc>) -> String {
    t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
}

/// A length of time for people, in its two largest units (`3.2s` under a minute).
pub fn duration(seconds: f64) -> String {
    if !seconds.is_finite() || seconds < 0.0 {
        return "-".to_owned();
    }
    if seconds < 60.0 {
        return format!("{seconds:.1}s");
    }
    let s = seconds.round() as u64;
    let (d, h, m) = (s / 86_400, s % 86_400 / 3600, s % 3600 / 60);
    match (d, h) {
        (0, 0) => format!("{m}m {}s", s % 60),
        (0, _) => format!("{h}h {m}m"),
        _ => format!("{d}d {h}h"),
    }
}

#[cfg(test)]
mod tests {
    use super::{Table, duration, instant, printable};

    #[test]
    fn controls_and_backslashes_are_escaped_and_nothing_else() {
        assert_eq!(printable(r#"{"seq":3}"#), r#"{"seq":3}"#);
        assert_eq!(printable("a\nb\u{1b}[0m"), "a\\nb\\u{1b}[0m");
        assert_eq!(
            printable(r"a\nb"),
            r"a\\nb",
            "a backslash in the payload is not an escape"
        );
    }

    #[test]
    fn instants_and_durations_have_one_form() {
        let t = chrono::DateTime::parse_from_rfc3339("2026-12-04T15:30:33.123456+01:00")
            .expect("a time")
            .to_utc();
        assert_eq!(instant(t), "2026-12-04T14:30:33Z");
        assert_eq!(duration(3.24), "3.2s");
        assert_eq!(duration(252.0), "4m 12s");
        assert_eq!(duration(7_500.0), "2h 5m");
        assert_eq!(duration(273_600.0), "3d 4h");
        assert_eq!(duration(-1.0), "-");
    }

    #[test]
    fn columns_line_up_under_their_header() {
        let mut t = Table::new(&["STREAM", "ROWS"]);
        t.row(vec!["orders".into(), "12".into()]);
        t.row(vec!["a".into(), "3".into()]);
        assert_eq!(t.render(), "STREAM  ROWS\norders  12\na       3\n");
    }
}
