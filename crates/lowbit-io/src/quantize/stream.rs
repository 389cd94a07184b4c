//! The streaming quantization of one tensor, block by block ([`crate::wide`]).

use std::collections::HashMap;
use std::ops::Range;

use half::slice::HalfBitsSliceExt;
use lowbit_formats::{
    FormatError, Matrix, Mxfp8Config, Mxfp8Tensor, Nvfp4Config, Nvfp4Tensor, QuantPlane, Source,
    f16, nvfp4_amax, quantize_mxfp8, quantize_nvfp4_piece,
};
use safetensors::Dtype;

use crate::error::Error;
use crate::files::{Entry, Input, Output, pipeline};
use crate::report::Stats;
use crate::schema::{self, CopyParts, Settings, Which};
use crate::wide::{self, Wide};

/// High-precision elements of one chunk (16-bit ones as their bits).
enum Elements {
    F32(Vec<f32>),
    Bf16(Vec<u16>),
    F16(Vec<u16>),
}

impl Elements {
    /// `n` elements of `dtype` at `offset`; `None` for a dtype that is not quantized.
    fn read(src: &Input, dtype: Dtype, offset: u64, n: usize) -> Option<Result<Self, Error>> {
        Some(match dtype {
            Dtype::F32 => src.read_elems(offset, n).map(Elements::F32),
            Dtype::BF16 => src.read_elems(offset, n).map(Elements::Bf16),
            Dtype::F16 => src.read_elems(offset, n).map(Elements::F16),
            _ => return None,
        })
    }

    /// Rows `rows`, columns `cols` of the `· × cols_all` tensor `e`, row after row.
    fn read_block(
        src: &Input,
        e: &Entry,
        cols_all: usize,
        rows: &Range<usize>,
        cols: &Range<usize>,
    ) -> Option<Result<Self, Error>> {
        let size = e.dtype.bitsize() / 8;
        let at = |r: usize| e.offset + ((r * cols_all + cols.start) * size) as u64;
        if cols.len() == cols_all {
            // Whole rows: one read.
            return Elements::read(src, e.dtype, at(rows.start), rows.len() * cols_all);
        }
        let mut all = match Elements::read(src, e.dtype, at(rows.start), cols.len())? {
            Ok(x) => x,
            Err(err) => return Some(Err(err)),
        };
        for r in rows.start + 1..rows.end {
            let next = match Elements::read(src, e.dtype, at(r), cols.len())? {
                Ok(x) => x,
                Err(err) => return Some(Err(err)),
            };
            match (&mut all, next) {
                (Elements::F32(a), Elements::F32(b)) => a.extend(b),
                (Elements::Bf16(a), Elements::Bf16(b)) | (Elements::F16(a), Elements::F16(b)) => {
                    a.extend(b)
                }
                _ => return None,
            }
        }
        Some(Ok(all))
    }

    fn source(&self) -> Source<'_> {
        match self {
            Elements::F32(v) => Source::F32(v),
            Elements::Bf16(v) => Source::Bf16(v.reinterpret_cast()),
            Elements::F16(v) => Source::F16(v.reinterpret_cast()),
        }
    }

    /// This chunk's amax and max |err| against its reconstruction (any thread, any order).
    fn extrema(&self, xhat: &[f32]) -> Stats {
        match self.source() {
            Source::F32(v) => Stats::extrema(v, |x| x, xhat),
            Source::Bf16(v) => Stats::extrema(v, |x| bf16_value(&x), xhat),
            Source::F16(v) => Stats::extrema(v, f16::to_f32, xhat),
        }
    }

    /// Adds this chunk's sums of squares (chunk after chunk, in order).
    fn add_sums(&self, stats: &mut Stats, xhat: &[f32]) {
        match self.source() {
            Source::F32(v) => stats.add_sums(v.iter().copied(), xhat),
            Source::Bf16(v) => stats.add_sums(v.iter().map(bf16_value), xhat),
            Source::F16(v) => stats.add_sums(v.iter().map(|x| x.to_f32()), xhat),
        }
    }
}

/// A bf16 is the top half of an f32 (`to_f32` also quiets NaNs, which the statistics skip
/// either way).
fn bf16_value(x: &lowbit_formats::bf16) -> f32 {
    f32::from_bits(u32::from(x.to_bits()) << 16)
}

/// A quantized chunk.
enum Quantized {
    Mxfp8(Mxfp8Tensor),
    Nvfp4(Nvfp4Tensor),
}

impl Quantized {
    fn plane(&self, which: Which) -> Option<&QuantPlane> {
        match (self, which) {
            (Quantized::Mxfp8(t), Which::Rowwise) => t.rowwise.as_ref(),
            (Quantized::Mxfp8(t), Which::Columnwise) => t.columnwise.as_ref(),
            (Quantized::Nvfp4(t), Which::Rowwise) => t.rowwise.as_ref(),
            (Quantized::Nvfp4(t), Which::Columnwise) => t.columnwise.as_ref(),
        }
    }

    /// The rowwise (else columnwise) copy dequantized, for the report.
    fn dequantize(&self) -> Vec<f32> {
        match self {
            Quantized::Mxfp8(t) => t.dequantize(),
            Quantized::Nvfp4(t) => t.dequantize(),
        }
    }
}

/// One copy's outputs: where its data and scale components start in the output.
pub(super) struct CopyOut {
    which: Which,
    data_offset: u64,
    scales_offset: u64,
}

impl CopyOut {
    pub(super) fn new(which: Which, cp: &CopyParts, offset_of: &HashMap<&str, u64>) -> Self {
        CopyOut {
            which,
            data_offset: offset_of[cp.data.name.as_str()],
            scales_offset: offset_of[cp.scales.name.as_str()],
        }
    }
}

/// The streaming quantization of one tensor.
pub(super) struct Job<'a> {
    pub(super) src: &'a Input,
    pub(super) out: &'a Output,
    pub(super) e: &'a Entry,
    pub(super) rows: usize,
    pub(super) cols: usize,
    pub(super) s: &'a Settings,
    pub(super) copies: Vec<CopyOut>,
    pub(super) amax_offset: Option<u64>,
    /// Store NVFP4's `S_enc` (compressed-tensors' `weight_global_scale`) instead of the amax.
    pub(super) global_scale: bool,
}

impl Job<'_> {
    /// Quantizes, writes and measures the tensor; returns its round-trip statistics.
    pub(super) fn run(self, threads: usize) -> Result<Stats, Error> {
        let workers = pipeline::threads(threads);
        let wide = Wide::new(self.rows, self.cols, workers);
        self.run_blocks(wide, workers)
    }

    /// Quantizes, writes and measures the tensor block by block ([`Wide`]), each piece written
    /// where it belongs at once; the report's sums are taken block after block.
    fn run_blocks(self, wide: Wide, workers: usize) -> Result<Stats, Error> {
        let n = wide.len();
        let lib_threads = (workers / n.max(1)).max(1);
        let ahead = workers + 1;
        let read = |k: usize| -> Result<(Range<usize>, Range<usize>, Elements), Error> {
            let (rows, cols) = wide.range(k);
            let x = Elements::read_block(self.src, self.e, self.cols, &rows, &cols)
                .ok_or_else(|| self.internal(format!("cannot decode {}", self.e.dtype)))??;
            Ok((rows, cols, x))
        };
        let amax = match self.s.recipe.fp8_kind() {
            Some(_) => None,
            None => {
                let mut bits = 0u32;
                pipeline::ordered(
                    n,
                    workers,
                    ahead,
                    |k| {
                        let (rows, cols, x) = read(k)?;
                        Ok(nvfp4_amax(
                            &self.block(rows.len(), cols.len(), &x)?,
                            lib_threads,
                        ))
                    },
                    |a| {
                        bits = bits.max(a.to_bits());
                        Ok(())
                    },
                )?;
                Some(f32::from_bits(bits))
            }
        };
        let mut stats = Stats::default();
        pipeline::ordered(
            n,
            workers,
            ahead,
            |k| {
                let (rows, cols, x) = read(k)?;
                let m = self.block(rows.len(), cols.len(), &x)?;
                let t = self.quantize(&m, lib_threads, amax).map_err(|f| {
                    // The library reports the block's coordinates.
                    let f = match f {
                        FormatError::NonFinite {
                            name,
                            row,
                            col,
                            value,
                            ..
                        } => FormatError::NonFinite {
                            name,
                            row: row + rows.start,
                            col: col + cols.start,
                            flat: (row + rows.start) * self.cols + col + cols.start,
                            value,
                        },
                        other => other,
                    };
                    self.format_error(f)
                })?;
                self.store_wide(&t, &rows, &cols)?;
                let xhat = t.dequantize();
                let extrema = x.extrema(&xhat);
                Ok((x, xhat, extrema))
            },
            |(x, xhat, extrema)| {
                x.add_sums(&mut stats, &xhat);
                stats.add(&extrema);
                Ok(())
            },
        )?;
        if let (Some(offset), Some(a)) = (self.amax_offset, amax) {
            let v = if self.global_scale { s_enc(a) } else { a };
            self.out.write_at(offset, &v.to_le_bytes())?;
        }
        Ok(stats)
    }

    /// Writes block `t` (rows `rows`, columns `cols`) of every copy where it belongs.
    fn store_wide(
        &self,
        t: &Quantized,
        rows: &Range<usize>,
        cols: &Range<usize>,
    ) -> Result<(), Error> {
        let whole = (self.rows, self.cols);
        for c in &self.copies {
            let p = t
                .plane(c.which)
                .ok_or_else(|| self.internal(format!("no {} copy", c.which.as_str())))?;
            let cp = schema::copy_parts(&self.e.name, self.s, c.which, rows.len(), cols.len());
            let stored = schema::store_scales(self.s, c.which, p.scales.clone(), cp.compact_scales);
            for (bytes, offset, scales) in [
                (&p.data, c.data_offset, false),
                (&stored, c.scales_offset, true),
            ] {
                let reg = wide::region(self.s, c.which, scales, whole, rows, cols);
                if reg.len() != bytes.len() {
                    return Err(self.internal(format!(
                        "{} block at row {}, column {} has {} bytes, its region {}",
                        c.which.as_str(),
                        rows.start,
                        cols.start,
                        bytes.len(),
                        reg.len()
                    )));
                }
                for (g, l, len) in reg.pieces() {
                    self.out.write_at(offset + g as u64, &bytes[l..l + len])?;
                }
            }
        }
        Ok(())
    }

    /// Block `x` of `rows × cols` as the library's input.
    fn block<'x>(&'x self, rows: usize, cols: usize, x: &'x Elements) -> Result<Matrix<'x>, Error> {
        Matrix::new(&self.e.name, rows, cols, x.source()).map_err(|f| self.format_error(f))
    }

    /// Quantizes one chunk with the library.
    fn quantize(
        &self,
        m: &Matrix<'_>,
        threads: usize,
        amax: Option<f32>,
    ) -> Result<Quantized, FormatError> {
        let s = self.s;
        Ok(match (s.recipe.fp8_kind(), amax) {
            (Some(kind), _) => {
                let cfg = Mxfp8Config {
                    kind,
                    copies: s.copies,
                    two_d: s.two_d,
                    nan_policy: s.nan_policy,
                    threads,
                };
                Quantized::Mxfp8(quantize_mxfp8(m, &cfg)?)
            }
            (None, amax) => {
                let cfg = Nvfp4Config {
                    copies: s.copies,
                    two_d: s.two_d,
                    nan_policy: s.nan_policy,
                    threads,
                    ..Nvfp4Config::default()
                };
                Quantized::Nvfp4(quantize_nvfp4_piece(m, &cfg, amax.unwrap_or(0.0))?)
            }
        })
    }

    fn internal(&self, msg: String) -> Error {
        Error::Invalid(format!(
            "{}: tensor {}: internal error: {msg}",
            crate::report::shown(self.src.path()),
            self.e.name
        ))
    }

    fn format_error(&self, f: FormatError) -> Error {
        super::format_error(self.src.path(), &self.e.shape, f)
    }
}

/// NVFP4's tensor encode scale from the global amax, as `lowbit_formats::nvfp4` computes it
/// (TE's `compute_global_encode_scaling_factor_FP4`): `min(448 · 6 / amax, FLT_MAX)`, or 1 when
/// amax is 0 or that is 0.
fn s_enc(amax: f32) -> f32 {
    let s = (448.0f32 * 6.0 / amax).min(f32::MAX);
    if amax == 0.0 || s == 0.0 { 1.0 } else { s }
}
