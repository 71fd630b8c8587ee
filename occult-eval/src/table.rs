//! Markdown tables for people: a header, rows of cells, columns padded to line up.

/// A Markdown table under construction.
#[derive(Clone, Debug, Default)]
pub struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new<S: ToString>(header: &[S]) -> Self {
        Table {
            header: header.iter().map(|s| s.to_string()).collect(),
            rows: Vec::new(),
        }
    }

    pub fn row(&mut self, cells: Vec<String>) {
        debug_assert_eq!(cells.len(), self.header.len());
        self.rows.push(cells);
    }

    /// Renders the table; the first column is left-aligned, the others right-aligned.
    pub fn render(&self) -> String {
        let n = self.header.len();
        let width: Vec<usize> = (0..n)
            .map(|i| {
                self.rows
                    .iter()
                    .map(|r| r[i].chars().count())
                    .chain([self.header[i].chars().count(), 3])
                    .max()
                    .unwrap_or(3)
            })
            .collect();
        let line = |cells: &[String]| {
            let parts: Vec<String> = cells
                .iter()
                .enumerate()
                .map(|(i, c)| {
                    if i == 0 {
                        format!("{c:<w$}", w = width[i])
                    } else {
                        format!("{c:>w$}", w = width[i])
                    }
                })
                .collect();
            format!("| {} |\n", parts.join(" | "))
        };
        let mut out = line(&self.header);
        let rule: Vec<String> = (0..n)
            .map(|i| {
                if i == 0 {
                    "-".repeat(width[i])
                } else {
                    format!("{}:", "-".repeat(width[i] - 1))
                }
            })
            .collect();
        out.push_str(&format!("| {} |\n", rule.join(" | ")));
        for r in &self.rows {
            out.push_str(&line(r));
        }
        out
    }
}

/// Formats a float with `digits` decimals, or `-` for a missing value.
pub fn fmt_opt(v: Option<f64>, digits: usize) -> String {
    v.map_or("-".into(), |x| format!("{x:.digits$}"))
}

/// Formats a large count with thousands separators.
pub fn count(v: u64) -> String {
    let s = v.to_string();
    let mut out = String::new();
    for (i, ch) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(ch);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_aligned_markdown() {
        let mut t = Table::new(&["a", "value"]);
        t.row(vec!["xx".into(), "1.5".into()]);
        assert_eq!(
            t.render(),
            "| a   | value |\n| --- | ----: |\n| xx  |   1.5 |\n"
        );
        assert_eq!(count(1234567), "1,234,567");
        assert_eq!(count(12), "12");
    }
}
