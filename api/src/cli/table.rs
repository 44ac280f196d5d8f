//! Aligned text tables for the client commands: columns as wide as their widest cell
//! (in terminal columns, so names in any script line up), numbers right-aligned.

use unicode_width::UnicodeWidthStr;

/// How a column's cells sit in its width.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Align {
    Left,
    Right,
}

/// A table: a header row, then rows of cells.
#[derive(Debug)]
pub(crate) struct Table {
    columns: Vec<(&'static str, Align)>,
    rows: Vec<Vec<String>>,
}

/// Between two columns.
const GAP: &str = "  ";

impl Table {
    pub(crate) fn new(columns: &[(&'static str, Align)]) -> Self {
        Self {
            columns: columns.to_vec(),
            rows: Vec::new(),
        }
    }

    /// Adds a row; missing cells are empty, extra ones dropped. Control characters (a
    /// server's strings may hold terminal escapes) are shown as `?`.
    pub(crate) fn row(&mut self, cells: Vec<String>) {
        let mut cells: Vec<String> = cells
            .into_iter()
            .take(self.columns.len())
            .map(|c| {
                c.chars()
                    .map(|ch| if ch.is_control() { '?' } else { ch })
                    .collect()
            })
            .collect();
        cells.resize(self.columns.len(), String::new());
        self.rows.push(cells);
    }

    /// [`render`](Self::render), or `none` on a line of its own when there are no rows.
    pub(crate) fn render_or(&self, none: &str) -> String {
        if self.rows.is_empty() {
            format!("{none}\n")
        } else {
            self.render()
        }
    }

    /// The header and the rows, one line each, without trailing spaces.
    pub(crate) fn render(&self) -> String {
        let mut widths: Vec<usize> = self.columns.iter().map(|(h, _)| h.width()).collect();
        for row in &self.rows {
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(cell.width());
            }
        }
        let header: Vec<String> = self.columns.iter().map(|(h, _)| (*h).to_owned()).collect();
        let mut out = String::new();
        for row in std::iter::once(&header).chain(&self.rows) {
            let mut line = String::new();
            for (i, cell) in row.iter().enumerate() {
                if i > 0 {
                    line.push_str(GAP);
                }
                let pad = " ".repeat(widths[i].saturating_sub(cell.width()));
                match self.columns[i].1 {
                    Align::Left => {
                        line.push_str(cell);
                        line.push_str(&pad);
                    }
                    Align::Right => {
                        line.push_str(&pad);
                        line.push_str(cell);
                    }
                }
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }
}

/// `label  value` lines, the values in one column (one object, e.g. `batches get`).
pub(crate) fn fields(pairs: &[(&'static str, String)]) -> String {
    let width = pairs.iter().map(|(l, _)| l.width()).max().unwrap_or(0);
    let mut out = String::new();
    for (label, value) in pairs {
        let value: String = value
            .chars()
            .map(|ch| if ch.is_control() { '?' } else { ch })
            .collect();
        out.push_str(&format!(
            "{label}{}{GAP}{value}",
            " ".repeat(width - label.width())
        ));
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_are_as_wide_as_their_widest_cell() {
        let mut t = Table::new(&[
            ("NAME", Align::Left),
            ("QUEUED", Align::Right),
            ("X", Align::Right),
        ]);
        t.row(vec!["acme".into(), "12".into(), "0".into()]);
        t.row(vec!["日本語テナント".into(), "1234567".into(), "6".into()]);
        let text = t.render();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], format!("NAME{}QUEUED  X", " ".repeat(13)));
        assert_eq!(lines[1], format!("acme{}12  0", " ".repeat(17)));
        // Wide characters count as two columns.
        assert_eq!(lines[2], "日本語テナント  1234567  6");
    }

    #[test]
    fn control_characters_do_not_reach_the_terminal() {
        let mut t = Table::new(&[("FILE", Align::Left)]);
        t.row(vec!["a\u{1b}[2Jb".into()]);
        assert_eq!(t.render().lines().nth(1), Some("a?[2Jb"));
        assert_eq!(
            fields(&[("ID", "x\ny".into()), ("STATUS", "ok".into())]),
            "ID      x?y\nSTATUS  ok\n"
        );
    }
}
