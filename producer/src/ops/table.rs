//! Plain-text tables for people: one header line, columns padded to their widest cell.

/// A table being built.
#[derive(Debug)]
pub struct Table {
    rows: Vec<Vec<String>>,
}

impl Table {
    /// A table with these column names.
    pub fn new(header: &[&str]) -> Self {
        Self {
            rows: vec![header.iter().map(|h| (*h).to_owned()).collect()],
        }
    }

    /// Appends a row (one cell per column).
    pub fn push(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    /// The table as lines of text; the last column is not padded.
    pub fn render(&self) -> String {
        let columns = self.rows.iter().map(Vec::len).max().unwrap_or(0);
        let width = |i: usize| {
            self.rows
                .iter()
                .filter_map(|r| r.get(i))
                .map(|c| c.chars().count())
                .max()
                .unwrap_or(0)
        };
        let widths: Vec<usize> = (0..columns).map(width).collect();
        let mut out = String::new();
        for row in &self.rows {
            let mut line = String::new();
            for (i, cell) in row.iter().enumerate() {
                if i + 1 < row.len() {
                    let pad = widths[i].saturating_sub(cell.chars().count()) + 2;
                    line.push_str(cell);
                    line.extend(std::iter::repeat_n(' ', pad));
                } else {
                    line.push_str(cell);
                }
            }
            out.push_str(line.trim_end());
            out.push('\n');
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
        t.push(vec!["orders".into(), "12".into()]);
        t.push(vec!["a".into(), "3".into()]);
        assert_eq!(t.render(), "STREAM  ROWS\norders  12\na       3\n");
    }
}
