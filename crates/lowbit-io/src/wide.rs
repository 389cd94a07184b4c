//! The blocks quantize and dequantize stream a tensor in: bands of whole 128-row tiles over all
//! columns, and, for tensors whose 32-row band is larger than a chunk (1-D tensors, wide
//! matrices), bands of [`BAND`] rows cut into multiples of [`STEP`] columns — so memory is
//! bounded by the chunk size whatever the tensor's.
//!
//! A block starting at row `r0` (a multiple of 128) and column `c0` (a multiple of 128) holds
//! whole MXFP8 blocks and 32x32 tiles, whole NVFP4 blocks and 16x16 tiles, and whole 128x4
//! tiles of every swizzled scale matrix (MXFP8 rowwise: 128 rows × 4 blocks of 32 columns;
//! columnwise, swizzled as its transpose: 128 columns × 4 blocks of 32 rows; NVFP4: 128 rows
//! or columns × 4 blocks of 16). So a block quantized alone gives, in each stored component,
//! the bytes of a rectangle of that component ([`Region`]) — in compact layout a rectangle of
//! its row-major bytes, in swizzled layout a rectangle of its 512-byte tiles — and those bytes
//! are written (or read) where they belong, piece by piece, nothing gathered.

use std::ops::Range;

use lowbit_formats::ScaleLayout;

use crate::schema::{Settings, Which};

/// Rows of a block: one 128-row tile of every swizzled scale matrix.
pub const BAND: usize = 128;
/// Block widths are multiples of this many columns (see the module doc).
pub const STEP: usize = 128;

/// A tensor takes column chunks when one 32-row band (or the whole of a thinner tensor) holds
/// more elements than this: 4 Mi, a [32, 128 Ki] band (typical matrices keep their row chunks,
/// so their reports sum in element order as before).
pub const WIDE_BAND_ELEMS: usize = 4 << 20;
/// Elements of one column chunk: 256 Ki, so the `2 · workers + 1` chunks in flight hold under
/// 10 bytes an element (input, f32 values, planes) · 256 Ki · 33 ≈ 86 MB at 16 workers. Fixed,
/// not scaled by the thread count, so the chunks (and the report's sums) do not depend on it.
pub const WIDE_CHUNK_ELEMS: usize = 256 << 10;

/// The blocks of a `rows × cols` matrix: bands of whole 128-row tiles over all columns, or,
/// when one 32-row band holds more than [`WIDE_BAND_ELEMS`] elements, 128-row bands cut into
/// column chunks. Either way blocks come band after band, columns in order within a band.
#[derive(Clone, Copy, Debug)]
pub struct Wide {
    rows: usize,
    cols: usize,
    band: usize,
    width: usize,
    per_band: usize,
}

impl Wide {
    /// The blocks for `workers` threads. Full-width bands hold about `12 Mi / (2 · workers + 1)`
    /// elements (`LOWBIT_CHUNK_ELEMS` overrides that, so tests cross many bands on small
    /// files) rounded to whole 128-row bands; column chunks hold [`WIDE_CHUNK_ELEMS`];
    /// `LOWBIT_CHUNK_COLS=N` forces column chunks of `N` columns rounded up to [`STEP`]. Blocks
    /// of full-width bands are in element order, so the report's sums are one pass's.
    pub fn new(rows: usize, cols: usize, workers: usize) -> Self {
        let env = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<usize>().ok());
        let (band, width) = match env("LOWBIT_CHUNK_COLS") {
            Some(w) => (BAND, w.max(1).div_ceil(STEP) * STEP),
            None if rows.min(32).saturating_mul(cols) > WIDE_BAND_ELEMS => (
                BAND,
                (WIDE_CHUNK_ELEMS / rows.clamp(1, BAND) / STEP * STEP).max(STEP),
            ),
            None => {
                let elems = env("LOWBIT_CHUNK_ELEMS").unwrap_or((12 << 20) / (2 * workers + 1));
                ((elems / cols.max(1) / BAND * BAND).max(BAND), cols)
            }
        };
        let width = width.min(cols).max(1);
        Wide {
            rows,
            cols,
            band,
            width,
            per_band: if rows == 0 || cols == 0 {
                0
            } else {
                cols.div_ceil(width)
            },
        }
    }

    /// How many blocks (none for an empty matrix).
    pub fn len(&self) -> usize {
        self.rows.div_ceil(self.band) * self.per_band
    }

    /// Rows and columns of block `k`.
    pub fn range(&self, k: usize) -> (Range<usize>, Range<usize>) {
        let (b, c) = (k / self.per_band, k % self.per_band);
        let r0 = b * self.band;
        let c0 = c * self.width;
        (
            r0..(r0 + self.band).min(self.rows),
            c0..(c0 + self.width).min(self.cols),
        )
    }
}

/// A rectangle of a stored component: its rows `rows` and bytes `bytes` of a row-major plane
/// whose rows are `width` bytes long. Its own bytes (what a block alone gives) are the
/// rectangle's rows one after the other.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Region {
    width: usize,
    rows: Range<usize>,
    bytes: Range<usize>,
}

impl Region {
    /// Bytes of the rectangle.
    pub fn len(&self) -> usize {
        self.rows.len() * self.bytes.len()
    }

    /// `(offset in the component, offset in the rectangle's bytes, length)` of each contiguous
    /// piece: one per row, or one in all when the rectangle spans whole rows.
    pub fn pieces(&self) -> Vec<(usize, usize, usize)> {
        let n = self.bytes.len();
        if n == 0 || self.rows.is_empty() {
            return Vec::new();
        }
        if n == self.width {
            return vec![(self.rows.start * self.width, 0, self.len())];
        }
        self.rows
            .clone()
            .enumerate()
            .map(|(i, r)| (r * self.width + self.bytes.start, i * n, n))
            .collect()
    }

    /// The component offset of byte `local` of the rectangle.
    pub fn global(&self, local: usize) -> usize {
        let n = self.bytes.len().max(1);
        (self.rows.start + local / n) * self.width + self.bytes.start + local % n
    }
}

/// Where block `rows × cols` of a `m × n` matrix lies in copy `which`'s data (`scales` false)
/// or scales, in the layout of `s`.
pub fn region(
    s: &Settings,
    which: Which,
    scales: bool,
    (m, n): (usize, usize),
    rows: &Range<usize>,
    cols: &Range<usize>,
) -> Region {
    let per = |r: &Range<usize>, k: usize| r.start / k..r.end.div_ceil(k);
    let mx = s.recipe.fp8_kind().is_some();
    let b = if mx {
        lowbit_formats::mxfp8::BLOCK
    } else {
        lowbit_formats::nvfp4::BLOCK
    };
    // The component as a row-major matrix of bytes (for scales: the K-major scale matrix the
    // swizzle tiles), and the block's rows and columns in it.
    let (width, r, c) = match (mx, which, scales) {
        (true, _, false) => (n, rows.clone(), cols.clone()),
        (true, Which::Rowwise, true) => (n.div_ceil(b), rows.clone(), per(cols, b)),
        // Compact MXFP8 columnwise scales are [row blocks, cols]; swizzled ones tile the
        // transpose [cols, row blocks] (handled below).
        (true, Which::Columnwise, true) => (n, per(rows, b), cols.clone()),
        (false, Which::Rowwise, false) => (n.div_ceil(2), rows.clone(), per(cols, 2)),
        (false, Which::Rowwise, true) => (n.div_ceil(b), rows.clone(), per(cols, b)),
        (false, Which::Columnwise, false) => (m.div_ceil(2), cols.clone(), per(rows, 2)),
        (false, Which::Columnwise, true) => (m.div_ceil(b), cols.clone(), per(rows, b)),
    };
    if !scales || s.layout == ScaleLayout::Compact {
        return Region {
            width,
            rows: r,
            bytes: c,
        };
    }
    let (kr, kc, kw) = if mx && which == Which::Columnwise {
        (c, r, m.div_ceil(b))
    } else {
        (r, c, width)
    };
    // 128 × 4 tiles of 512 bytes, row-major: a plane of tile rows, `ceil(K/4) · 512` bytes each.
    Region {
        width: kw.div_ceil(4) * 512,
        rows: per(&kr, 128),
        bytes: kc.start / 4 * 512..kc.end.div_ceil(4) * 512,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::{self, Recipe};
    use lowbit_formats::{Copies, NanPolicy};

    /// Writing every block's stored bytes (from a compact matrix of distinct bytes, through the
    /// schema's own layout conversion of the block alone) at its regions rebuilds the whole
    /// stored component byte for byte, and covers it exactly once.
    #[test]
    fn blocks_tile_every_component() {
        for recipe in [Recipe::Mxfp8, Recipe::Nvfp4] {
            for layout in [ScaleLayout::Compact, ScaleLayout::Swizzled] {
                let s = Settings {
                    recipe,
                    copies: Copies::Both,
                    two_d: false,
                    layout,
                    nan_policy: NanPolicy::Te,
                };
                for (m, n) in [(1, 1000), (3, 777), (130, 300), (260, 513), (64, 256)] {
                    for which in [Which::Rowwise, Which::Columnwise] {
                        check(&s, which, m, n);
                    }
                }
            }
        }
    }

    fn check(s: &Settings, which: Which, m: usize, n: usize) {
        let whole = schema::copy_parts("t", s, which, m, n);
        let (sr, sc) = whole.compact_scales;
        // A compact scale matrix with distinct-ish bytes (never 0, so padding shows).
        let compact: Vec<u8> = (0..sr * sc).map(|i| (i % 251 + 1) as u8).collect();
        let stored = schema::store_scales(s, which, compact.clone(), (sr, sc));
        let mut rebuilt = vec![0u8; stored.len()];
        let mut hits = vec![0u8; stored.len()];
        let widths = [128, 256, n];
        for w in widths {
            rebuilt.fill(0);
            hits.fill(0);
            let mut dhits = vec![0u8; whole.data.spec().len];
            let wide = Wide {
                rows: m,
                cols: n,
                band: if w == 128 { BAND } else { 2 * BAND },
                width: w.min(n),
                per_band: n.div_ceil(w.min(n)),
            };
            for k in 0..wide.len() {
                let (rows, cols) = wide.range(k);
                let part = schema::copy_parts("t", s, which, rows.len(), cols.len());
                let (br, bc) = part.compact_scales;
                // The block's compact scales, cut from the whole compact matrix.
                let (r0, c0) = match (s.recipe.fp8_kind(), which) {
                    (Some(_), Which::Rowwise) => (rows.start, cols.start / 32),
                    (Some(_), Which::Columnwise) => (rows.start / 32, cols.start),
                    (None, Which::Rowwise) => (rows.start, cols.start / 16),
                    (None, Which::Columnwise) => (cols.start, rows.start / 16),
                };
                let mut block = Vec::with_capacity(br * bc);
                for r in 0..br {
                    block.extend_from_slice(&compact[(r0 + r) * sc + c0..][..bc]);
                }
                let local = schema::store_scales(s, which, block, (br, bc));
                let reg = region(s, which, true, (m, n), &rows, &cols);
                assert_eq!(reg.len(), local.len(), "{s:?} {which:?} {m}x{n} block {k}");
                for (g, l, len) in reg.pieces() {
                    rebuilt[g..g + len].copy_from_slice(&local[l..l + len]);
                    hits[g..g + len].iter_mut().for_each(|h| *h += 1);
                    assert_eq!(reg.global(l), g);
                }
                // Data regions have the block's data shape.
                let dreg = region(s, which, false, (m, n), &rows, &cols);
                assert_eq!(dreg.len(), part.data.spec().len);
                for (g, _, len) in dreg.pieces() {
                    dhits[g..g + len].iter_mut().for_each(|h| *h += 1);
                }
            }
            assert!(
                dhits.iter().all(|&h| h == 1),
                "data {s:?} {which:?} {m}x{n}"
            );
            assert_eq!(rebuilt, stored, "{s:?} {which:?} {m}x{n} width {w}");
            assert!(hits.iter().all(|&h| h == 1), "{s:?} {which:?} {m}x{n}");
        }
    }
}
