//! Human tables for the operator commands of both binaries: a header line, left-aligned columns
//! padded to their widest cell (the last one is not padded).

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

#[cfg(test)]
mod tests {
    use super::Table;

    #[test]
    fn columns_line_up_under_their_header() {
        let mut t = Table::new(&["STREAM", "ROWS"]);
        t.row(vec!["orders".into(), "12".into()]);
        t.row(vec!["a".into(), "3".into()]);
        assert_eq!(t.render(), "STREAM  ROWS\norders  12\na       3\n");
    }
}
