//! What a conversion reports: round-trip error statistics, an aligned text table (returned to
//! the caller, which prints it) and a progress line on stderr for large files on a terminal.

use std::io::IsTerminal;

/// Inputs larger than this get a progress line (when stderr is a terminal).
const PROGRESS_THRESHOLD: usize = 64 << 20;

/// Round-trip error of one tensor (or a sum of them).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Stats {
    /// Largest |x| with NaN ignored (as the quantizers' amax); +Inf counts.
    pub amax: f32,
    /// Σx² over finite x.
    pub signal: f64,
    /// Σ(x − x̂)² over finite x.
    pub noise: f64,
    /// max |x − x̂| over finite x.
    pub max_err: f64,
}

impl Stats {
    /// The order-independent part of comparing original elements `x` (as f32 through `f`)
    /// with their reconstruction `xhat`: amax and max |err|, with zero sums. Chunks of a tensor
    /// can be measured in any order, on any thread, and merged with [`Stats::add`].
    pub fn extrema<T: Copy>(x: &[T], f: impl Fn(T) -> f32, xhat: &[f32]) -> Stats {
        // Eight independent lanes, so the maxima vectorize; a NaN error is tracked apart (it
        // wins whatever the order, as in [`Stats::add`]).
        const L: usize = 8;
        let (mut amax, mut err, mut nan) = ([0u32; L], [0f64; L], [false; L]);
        let mut lane = |l: usize, v: f32, y: f32| {
            // |v| as bits, NaN as 0: the amax ignores NaN, as the quantizers' does.
            let bits = v.to_bits() & 0x7FFF_FFFF;
            amax[l] = amax[l].max(if bits > 0x7F80_0000 { 0 } else { bits });
            let a = (f64::from(v) - f64::from(y)).abs();
            let a = if bits < 0x7F80_0000 { a } else { 0.0 };
            nan[l] |= a.is_nan();
            err[l] = if a > err[l] { a } else { err[l] };
        };
        let n = x.len().min(xhat.len());
        let whole = n / L * L;
        for (xs, ys) in x[..whole]
            .chunks_exact(L)
            .zip(xhat[..whole].chunks_exact(L))
        {
            for l in 0..L {
                lane(l, f(xs[l]), ys[l]);
            }
        }
        for (&v, &y) in x[whole..n].iter().zip(&xhat[whole..n]) {
            lane(0, f(v), y);
        }
        Stats {
            amax: f32::from_bits(amax.into_iter().max().unwrap_or(0)),
            max_err: if nan.contains(&true) {
                f64::NAN
            } else {
                err.into_iter().fold(0.0, f64::max)
            },
            ..Stats::default()
        }
    }

    /// Adds the sums of squares (signal, noise) over the finite elements of `x` against `xhat`,
    /// element by element in order: called on the chunks of a tensor in order, it gives the bits
    /// of one pass over the whole tensor (their rounding depends on the order).
    pub fn add_sums(&mut self, x: impl IntoIterator<Item = f32>, xhat: &[f32]) {
        // Branch-free, so the adds' latency is all that bounds the loop: a non-finite x adds
        // exact zeros, which changes nothing (the sums are never -0).
        for (v, &y) in x.into_iter().zip(xhat) {
            let finite = v.is_finite();
            let x = if finite { f64::from(v) } else { 0.0 };
            let d = if finite { x - f64::from(y) } else { 0.0 };
            self.signal += x * x;
            self.noise += d * d;
        }
    }

    /// Accumulates another tensor's statistics.
    pub fn add(&mut self, o: &Stats) {
        self.amax = self.amax.max(o.amax);
        self.signal += o.signal;
        self.noise += o.noise;
        if o.max_err.is_nan() || o.max_err > self.max_err {
            self.max_err = o.max_err;
        }
    }

    /// SQNR in dB, `inf` for an exact reconstruction.
    pub fn sqnr_db(&self) -> String {
        if self.noise == 0.0 {
            "inf".to_owned()
        } else {
            format!("{:.2}", 10.0 * (self.signal / self.noise).log10())
        }
    }
}

/// Column alignment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Align {
    /// Text.
    Left,
    /// Numbers.
    Right,
}

/// An aligned text table with an optional totals row.
#[derive(Clone, Debug, Default)]
pub struct Table {
    /// Lines printed above the table.
    pub title: Vec<String>,
    headers: Vec<(String, Align)>,
    rows: Vec<Vec<String>>,
    totals: Option<Vec<String>>,
    /// Lines printed below the table.
    pub footer: Vec<String>,
}

impl Table {
    /// A table with these columns.
    pub fn new(headers: &[(&str, Align)]) -> Self {
        Table {
            headers: headers.iter().map(|(h, a)| ((*h).to_owned(), *a)).collect(),
            ..Table::default()
        }
    }

    /// Appends a row (one cell per column).
    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    /// Sets the totals row, printed under a rule.
    pub fn totals(&mut self, cells: Vec<String>) {
        self.totals = Some(cells);
    }

    /// The table as text, ending in a newline. Cells of any length are laid out (padding is
    /// written by hand: `format!`'s width is limited to `u16::MAX`), and control characters in
    /// them are escaped ([`escape`]) so a tensor name cannot drive the terminal.
    pub fn render(&self) -> String {
        let n = self.headers.len();
        let esc = |cells: &[String]| -> Vec<String> {
            cells.iter().map(|c| escape(c).into_owned()).collect()
        };
        let headers: Vec<String> = esc(&self
            .headers
            .iter()
            .map(|(h, _)| h.clone())
            .collect::<Vec<_>>());
        let rows: Vec<Vec<String>> = self.rows.iter().map(|r| esc(r)).collect();
        let totals: Option<Vec<String>> = self.totals.as_ref().map(|t| esc(t));
        let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
        for r in rows.iter().chain(&totals) {
            for (w, c) in widths.iter_mut().zip(r) {
                *w = (*w).max(c.chars().count());
            }
        }
        let line = |cells: &[String]| {
            let mut s = String::new();
            for (i, ((_, align), &w)) in self.headers.iter().zip(&widths).enumerate() {
                let c = cells.get(i).map_or("", String::as_str);
                if i > 0 {
                    s.push_str("  ");
                }
                let pad = w.saturating_sub(c.chars().count());
                match align {
                    Align::Left if i + 1 == n => s.push_str(c),
                    Align::Left => {
                        s.push_str(c);
                        s.extend(std::iter::repeat_n(' ', pad));
                    }
                    Align::Right => {
                        s.extend(std::iter::repeat_n(' ', pad));
                        s.push_str(c);
                    }
                }
            }
            s.truncate(s.trim_end().len());
            s.push('\n');
            s
        };
        let rule = "-".repeat(widths.iter().sum::<usize>() + 2 * n.saturating_sub(1)) + "\n";
        let mut out = String::new();
        for t in &self.title {
            out += t;
            out.push('\n');
        }
        out += &line(&headers);
        out += &rule;
        if self.rows.is_empty() {
            out += "(no tensors)\n";
        }
        for r in &rows {
            out += &line(r);
        }
        if let Some(t) = &totals {
            out += &rule;
            out += &line(t);
        }
        for f in &self.footer {
            out += f;
            out.push('\n');
        }
        out
    }
}

/// A one-line progress indicator on stderr, active only for large inputs on a terminal.
pub struct Progress {
    enabled: bool,
    total: usize,
}

impl Progress {
    /// Progress over `total` tensors of `bytes` input bytes in all.
    pub fn new(total: usize, bytes: usize) -> Self {
        Progress {
            enabled: bytes > PROGRESS_THRESHOLD && std::io::stderr().is_terminal(),
            total,
        }
    }

    /// Announces tensor `i` (0-based).
    pub fn tick(&self, verb: &str, i: usize, name: &str) {
        if self.enabled {
            // \x1b[K clears what a longer previous name left on the line.
            eprint!("\r{verb} [{}/{}] {}\x1b[K", i + 1, self.total, escape(name));
        }
    }

    /// Clears the progress line.
    pub fn finish(&self) {
        if self.enabled {
            eprint!("\r\x1b[K");
        }
    }
}

/// `s` with control characters (C0, DEL, C1) written as Rust escapes (`\n`, `\u{1b}`), so
/// text from a file cannot move the cursor or send escape sequences to a terminal. Other
/// characters, backslashes included, are kept.
pub fn escape(s: &str) -> std::borrow::Cow<'_, str> {
    if !s.chars().any(char::is_control) {
        return std::borrow::Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
}

/// A path for a message: lossily decoded, its control characters (a newline, an escape)
/// escaped as [`escape`] does.
pub fn shown(path: &std::path::Path) -> String {
    escape(&path.to_string_lossy()).into_owned()
}

/// A byte count with thousands separators: `1,572,864`.
pub fn bytes_str(n: usize) -> String {
    let digits = n.to_string();
    let mut grouped = String::new();
    for (i, ch) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            grouped.push(',');
        }
        grouped.push(ch);
    }
    grouped
}

/// `1 tensor`, `3 tensors`.
pub fn count(n: usize, noun: &str) -> String {
    if n == 1 {
        format!("1 {noun}")
    } else {
        format!("{n} {noun}s")
    }
}

/// Human-readable size: `1.50 MiB`.
pub fn human_bytes(n: usize) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

/// A float in short scientific notation (`2.345e-2`), `inf`/`NaN` as such.
pub fn sci(v: f64) -> String {
    format!("{v:.3e}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_and_sqnr() {
        let x = [1.0f32, -2.0, f32::NAN, f32::INFINITY];
        let measure = |x: &[f32], xhat: &[f32]| {
            let mut s = Stats::default();
            s.add_sums(x.iter().copied(), xhat);
            s.add(&Stats::extrema(x, |v| v, xhat));
            s
        };
        let s = measure(&x, &[1.0, -2.0, 0.0, 0.0]);
        assert_eq!(s.amax, f32::INFINITY);
        assert_eq!(s.sqnr_db(), "inf");
        let s = measure(&x[..2], &[1.1, -2.0]);
        assert!((s.max_err - 0.1).abs() < 1e-6);
        assert_eq!(
            s.sqnr_db(),
            format!("{:.2}", 10.0 * (5.0f64 / 0.01).log10())
        );
    }

    #[test]
    fn chunked_statistics_are_the_one_pass_ones() {
        // The one-pass definition the report has always printed.
        fn one_pass(x: &[f32], xhat: &[f32]) -> Stats {
            let mut s = Stats::default();
            for (&v, &y) in x.iter().zip(xhat) {
                if !v.is_nan() {
                    s.amax = s.amax.max(v.abs());
                }
                if v.is_finite() {
                    let d = f64::from(v) - f64::from(y);
                    s.signal += f64::from(v) * f64::from(v);
                    s.noise += d * d;
                    let a = d.abs();
                    if a.is_nan() || a > s.max_err {
                        s.max_err = a;
                    }
                }
            }
            s
        }
        let x: Vec<f32> = (0..1000)
            .map(|i| match i % 101 {
                7 => f32::NAN,
                8 => f32::NEG_INFINITY,
                _ => (i as f32 * 0.37).sin() * 10f32.powi(i % 5 - 2),
            })
            .collect();
        let mut xhat: Vec<f32> = x.iter().map(|v| v * 1.01).collect();
        for nan_error in [false, true] {
            xhat[500] = if nan_error { f32::NAN } else { x[500] };
            let mut s = Stats::default();
            for (cx, cy) in x.chunks(96).zip(xhat.chunks(96)) {
                s.add_sums(cx.iter().copied(), cy);
                s.add(&Stats::extrema(cx, |v| v, cy));
            }
            assert_eq!(format!("{s:?}"), format!("{:?}", one_pass(&x, &xhat)));
        }
    }

    #[test]
    fn table_aligns() {
        let mut t = Table::new(&[("name", Align::Left), ("n", Align::Right)]);
        t.row(vec!["a".into(), "100".into()]);
        t.totals(vec!["total".into(), "1".into()]);
        assert_eq!(
            t.render(),
            "name     n\n----------\na      100\n----------\ntotal    1\n"
        );
    }

    #[test]
    fn long_cells_and_control_characters() {
        let mut t = Table::new(&[
            ("name", Align::Left),
            ("n", Align::Right),
            ("x", Align::Left),
        ]);
        let long = "w".repeat(70_000);
        t.row(vec![
            long.clone(),
            "1".repeat(70_000),
            "e\u{1b}[2J\u{9b}".into(),
        ]);
        let out = t.render();
        assert!(out.contains(&long));
        assert!(out.contains("e\\u{1b}[2J\\u{9b}"));
        assert!(!out.contains('\u{1b}') && !out.contains('\u{9b}'));
        assert_eq!(escape("plain"), "plain");
        assert_eq!(escape("a\nb"), "a\\nb");
    }

    #[test]
    fn byte_formats() {
        assert_eq!(bytes_str(0), "0");
        assert_eq!(bytes_str(1234567), "1,234,567");
        assert_eq!(human_bytes(1536), "1.50 KiB");
    }
}
