//! `lowbit dequantize`: rebuilds each quantized tensor of a file written by `lowbit quantize`
//! from its rowwise copy (or its columnwise copy when that is all there is) with the library's
//! `from_parts` + `dequantize_*`, restores its original shape and dtype, and copies every other
//! tensor unchanged.
//!
//! Like `quantize` it streams: the header and every component's dtype and shape are checked
//! before any data is read; then each tensor's scales (a byte per 16 or 32 elements) and NVFP4
//! amax are read and checked, and its data is read, dequantized and written in chunks of whole
//! 32-row bands on all cores.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use lowbit_formats::{Mxfp8Tensor, Nvfp4Tensor, QuantPlane, bf16, f16};
use safetensors::Dtype;

use crate::error::Error;
use crate::files::{self, Entry, Input, Output, Spec, pipeline};
use crate::report::{self, Align, Progress, Table, bytes_str};
use crate::schema::{self, CopyParts, Part, Settings, Which};
use crate::wide::{self, Wide};

/// Element type of dequantized tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum OutDtype {
    /// bfloat16 (round to nearest even).
    Bf16,
    /// fp32: the library's values, exactly.
    F32,
}

impl OutDtype {
    fn dtype(self) -> Dtype {
        match self {
            OutDtype::Bf16 => Dtype::BF16,
            OutDtype::F32 => Dtype::F32,
        }
    }
}

/// Dequantizes `input` into `output` and returns the report to print.
pub fn run(
    input: &Path,
    output: &Path,
    dtype: Option<OutDtype>,
    force: bool,
) -> Result<Table, Error> {
    files::check_paths(input, output, force)?;
    let src = Input::open(input)?;
    let ctx = |m: String| Error::Invalid(format!("{}: {m}", crate::report::shown(input)));
    if let Some(n) = src.metadata.get(schema::KEY_NAMING) {
        return Err(ctx(format!(
            "its components are named for {} (metadata key {}), which lowbit dequantize does \
             not read; quantize with the default --naming lowbit to round-trip",
            report::escape(n),
            schema::KEY_NAMING
        )));
    }
    if !src.metadata.contains_key(schema::KEY_VERSION) {
        return Err(ctx(format!(
            "not a lowbit-quantized file (its __metadata__ has no {} key); dequantize reads \
             files written by `lowbit quantize`",
            schema::KEY_VERSION
        )));
    }
    let s = Settings::read_metadata(&src.metadata).map_err(ctx)?;

    let mut quantized: Vec<(String, Dtype, Vec<usize>)> = Vec::new();
    for (key, value) in &src.metadata {
        if let Some(name) = key.strip_prefix(schema::TENSOR_KEY_PREFIX) {
            let (dt, shape) = schema::decode_original(value).ok_or_else(|| {
                ctx(format!(
                    "metadata key {key} has a malformed value {value:?}"
                ))
            })?;
            quantized.push((name.to_owned(), dt, shape));
        }
    }
    quantized.sort_by(|a, b| a.0.cmp(&b.0));
    let consumed: HashSet<String> = quantized
        .iter()
        .flat_map(|(name, ..)| schema::ALL_SUFFIXES.map(|suf| schema::component(name, suf)))
        .collect();
    let which = if s.copies.rowwise() {
        Which::Rowwise
    } else {
        Which::Columnwise
    };

    // Every component is checked against the schema, and the output laid out, before any data
    // is read.
    let mut jobs = Vec::with_capacity(quantized.len());
    for (name, orig_dtype, shape) in &quantized {
        if src.get(name).is_some() {
            return Err(ctx(format!(
                "tensor {name} is listed as quantized but also stored as a plain tensor"
            )));
        }
        let target = dtype.map_or(*orig_dtype, OutDtype::dtype);
        jobs.push(Job::new(&src, &s, which, name, shape, target).map_err(ctx)?);
    }
    let copied: Vec<&Entry> = src
        .tensors
        .iter()
        .filter(|e| !consumed.contains(&e.name))
        .collect();
    // Components without their `lowbit.tensor.*` key (stripped by a tool that rewrote the
    // metadata) would pass through as raw codes and scales; a data tensor whose scale tensor
    // sits beside it is a quantized tensor, and it cannot be rebuilt without its key.
    for e in &copied {
        for (data, scale) in [
            (schema::ROWWISE_DATA, schema::ROWWISE_SCALE_INV),
            (schema::COLUMNWISE_DATA, schema::COLUMNWISE_SCALE_INV),
        ] {
            if let Some(base) = e.name.strip_suffix(data).and_then(|b| b.strip_suffix('.'))
                && src.get(&schema::component(base, scale)).is_some()
            {
                return Err(ctx(format!(
                    "tensor {} has quantized components ({}, {}) but no metadata key {}{}: \
                     its original dtype and shape are unknown, so it cannot be dequantized \
                     (was the __metadata__ stripped?)",
                    report::escape(base),
                    report::escape(&e.name),
                    report::escape(&schema::component(base, scale)),
                    schema::TENSOR_KEY_PREFIX,
                    report::escape(base),
                )));
            }
        }
    }
    let specs: Vec<Spec> = jobs
        .iter()
        .map(|j| j.out.clone())
        .chain(copied.iter().map(|e| Spec {
            name: e.name.clone(),
            dtype: e.dtype,
            shape: e.shape.clone(),
            len: e.len,
        }))
        .collect();
    // The output is plain high-precision data again: drop our keys, keep the user's.
    let metadata: HashMap<String, String> = src
        .metadata
        .iter()
        .filter(|(k, _)| !k.starts_with(schema::KEY_PREFIX))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let (header, offsets) = files::layout(output, &specs, &metadata)?;
    let file_len = header.len() + specs.iter().map(|sp| sp.len).sum::<usize>();
    let out = Output::create(output)?;
    out.write_at(0, &header)?;

    let mut table = Table::new(&[
        ("tensor", Align::Left),
        ("shape", Align::Left),
        ("dtype", Align::Left),
        ("from", Align::Left),
        ("bytes in", Align::Right),
        ("bytes out", Align::Right),
    ]);
    table.title.push(format!(
        "dequantize {} -> {}: recipe {}, {} scale layout",
        crate::report::shown(input),
        crate::report::shown(output),
        s.recipe.as_str(),
        schema::layout_str(s.layout),
    ));

    let (mut total_in, mut total_out) = (0usize, 0usize);
    let file_size = src.tensors.iter().map(|e| e.len).sum();
    let progress = Progress::new(jobs.len(), file_size);
    for (i, (job, &offset)) in jobs.iter().zip(&offsets).enumerate() {
        progress.tick("dequantizing", i, &job.out.name);
        job.run(&src, &out, offset).map_err(ctx)?;
        total_in += job.size_in;
        total_out += job.out.len;
        table.row(vec![
            job.out.name.clone(),
            schema::shape_str(&job.out.shape),
            job.out.dtype.to_string(),
            which.as_str().to_owned(),
            bytes_str(job.size_in),
            bytes_str(job.out.len),
        ]);
    }
    progress.finish();
    for (e, &offset) in copied.iter().zip(&offsets[jobs.len()..]) {
        src.copy_to(e.offset, e.len, &out, offset)?;
        total_in += e.len;
        total_out += e.len;
        table.row(vec![
            e.name.clone(),
            schema::shape_str(&e.shape),
            e.dtype.to_string(),
            "copied".into(),
            bytes_str(e.len),
            bytes_str(e.len),
        ]);
    }
    table.totals(vec![
        format!("total ({})", report::count(specs.len(), "tensor")),
        String::new(),
        String::new(),
        String::new(),
        bytes_str(total_in),
        bytes_str(total_out),
    ]);
    table.footer.push(format!(
        "{} dequantized, {} copied",
        report::count(jobs.len(), "tensor"),
        copied.len()
    ));
    files::commit_reported(out, file_len, table)
}

/// The stored component `part`, checked against its expected dtype and shape.
fn fetch<'a>(src: &'a Input, tensor: &str, part: &Part) -> Result<&'a Entry, String> {
    let v = src.get(&part.name).ok_or_else(|| {
        format!(
            "tensor {tensor}: component {} is missing from the file",
            part.name
        )
    })?;
    if v.dtype != part.dtype || v.shape != part.shape {
        return Err(format!(
            "tensor {tensor}: component {} is {} {}, expected {} {}",
            part.name,
            v.dtype,
            schema::shape_str(&v.shape),
            part.dtype,
            schema::shape_str(&part.shape)
        ));
    }
    Ok(v)
}

/// The streaming dequantization of one tensor from its rowwise (else columnwise) copy.
struct Job<'a> {
    s: &'a Settings,
    which: Which,
    rows: usize,
    cols: usize,
    parts: CopyParts,
    data: &'a Entry,
    scales: &'a Entry,
    amax: Option<&'a Entry>,
    /// Bytes of the components read.
    size_in: usize,
    /// The restored tensor.
    out: Spec,
}

impl<'a> Job<'a> {
    /// Checks the tensor's components against the schema (their bytes are not read yet).
    fn new(
        src: &'a Input,
        s: &'a Settings,
        which: Which,
        name: &str,
        shape: &[usize],
        target: Dtype,
    ) -> Result<Self, String> {
        let too_large = || format!("tensor {name}: recorded shape is too large");
        let (rows, cols) = schema::matrix_dims(shape).ok_or_else(too_large)?;
        let len = rows.checked_mul(cols).ok_or_else(too_large)?;
        let out_len = len
            .checked_mul(target.bitsize() / 8)
            .ok_or_else(too_large)?;
        let parts = schema::copy_parts(name, s, which, rows, cols);
        let data = fetch(src, name, &parts.data)?;
        let scales = fetch(src, name, &parts.scales)?;
        let amax = match s.recipe.fp8_kind() {
            Some(_) => None,
            None => Some(fetch(src, name, &schema::amax_part(name))?),
        };
        Ok(Job {
            s,
            which,
            rows,
            cols,
            size_in: data.len + scales.len + amax.map_or(0, |a| a.len),
            parts,
            data,
            scales,
            amax,
            out: Spec {
                name: name.to_owned(),
                dtype: target,
                shape: shape.to_vec(),
                len: out_len,
            },
        })
    }

    /// Reads, checks and dequantizes the tensor chunk by chunk into `out` at `offset`.
    fn run(&self, src: &Input, out: &Output, offset: u64) -> Result<(), String> {
        let (s, name) = (self.s, self.out.name.as_str());
        let (rows, cols) = (self.rows, self.cols);
        let read = |e: &Entry| src.read_vec(e.offset, e.len).map_err(|e| e.to_string());
        let amax = match self.amax {
            Some(e) => Some(amax_value(name, &read(e)?)?),
            None => None,
        };
        if rows * cols == 0 {
            // Nothing to reconstruct (the scale tensors are empty too, but checked all the same).
            let (stored, part) = (read(self.scales)?, &self.parts.scales.name);
            return check_scales(name, s, part, &stored);
        }
        let workers = pipeline::threads(0);
        self.run_blocks(src, out, offset, Wide::new(rows, cols, workers), amax)
    }
}

impl Job<'_> {
    /// [`Job::run`] block by block ([`Wide`]): each block's data and scales are read from where
    /// they lie (nothing whole), checked, dequantized and written.
    fn run_blocks(
        &self,
        src: &Input,
        out: &Output,
        offset: u64,
        wide: Wide,
        amax: Option<f32>,
    ) -> Result<(), String> {
        let (s, name, which) = (self.s, self.out.name.as_str(), self.which);
        let whole = (self.rows, self.cols);
        let size = self.out.dtype.bitsize() / 8;
        let workers = pipeline::threads(0);
        let gather = |e: &Entry, reg: &wide::Region| -> Result<Vec<u8>, String> {
            let mut buf = vec![0u8; reg.len()];
            for (g, l, len) in reg.pieces() {
                let piece = src
                    .read_vec(e.offset + g as u64, len)
                    .map_err(|e| e.to_string())?;
                buf[l..l + len].copy_from_slice(&piece);
            }
            Ok(buf)
        };
        pipeline::ordered(
            wide.len(),
            workers,
            workers + 1,
            |k| {
                let (rows, cols) = wide.range(k);
                let cp = schema::copy_parts(name, s, which, rows.len(), cols.len());
                let dreg = wide::region(s, which, false, whole, &rows, &cols);
                let sreg = wide::region(s, which, true, whole, &rows, &cols);
                let stored = gather(self.scales, &sreg)?;
                if let Err(i) = scales_ok(s, &stored) {
                    return Err(bad_scale(
                        name,
                        s,
                        &self.parts.scales.name,
                        sreg.global(i),
                        stored[i],
                    ));
                }
                let data = gather(self.data, &dreg)?;
                let plane = QuantPlane {
                    data,
                    data_shape: [cp.data.shape[0], cp.data.shape[1]],
                    scales: schema::load_scales(s, which, &stored, cp.compact_scales),
                    scale_shape: [cp.compact_scales.0, cp.compact_scales.1],
                };
                let values = dequantize_chunk(name, s, which, rows.len(), cols.len(), plane, amax)?;
                if values.len() != rows.len() * cols.len() {
                    return Err(format!(
                        "tensor {name}: internal error: {} values dequantized, {} expected",
                        values.len(),
                        rows.len() * cols.len()
                    ));
                }
                let bytes = encode(&values, self.out.dtype);
                let row_bytes = cols.len() * size;
                if cols.len() == self.cols {
                    // Whole rows: one write.
                    let at = offset + (rows.start * self.cols * size) as u64;
                    return out.write_at(at, &bytes).map_err(|e| e.to_string());
                }
                for (i, r) in rows.clone().enumerate() {
                    let at = offset + ((r * self.cols + cols.start) * size) as u64;
                    out.write_at(at, &bytes[i * row_bytes..(i + 1) * row_bytes])
                        .map_err(|e| e.to_string())?;
                }
                Ok(())
            },
            |()| Ok(()),
        )
    }
}

/// The NVFP4 global amax from its stored bytes, refused when no quantizer writes it.
fn amax_value(name: &str, bytes: &[u8]) -> Result<f32, String> {
    let amax = files::f32s(bytes)
        .first()
        .copied()
        .ok_or_else(|| format!("tensor {name}: NVFP4 amax missing"))?;
    // A tampered or corrupt amax would dequantize to NaN, zeros or flipped signs. +Inf is
    // what the quantizer (as Transformer Engine) records for a tensor holding ±Inf.
    if amax.is_nan() || amax.is_sign_negative() {
        return Err(format!(
            "tensor {name}: NVFP4 amax {amax} (bits 0x{:08x}) is not a number >= 0 (finite, \
             or +inf for a tensor holding infinities); the file is corrupt",
            amax.to_bits()
        ));
    }
    Ok(amax)
}

/// One chunk's fp32 values through the library's `from_parts` + `dequantize`.
fn dequantize_chunk(
    name: &str,
    s: &Settings,
    which: Which,
    rows: usize,
    cols: usize,
    plane: QuantPlane,
    amax: Option<f32>,
) -> Result<Vec<f32>, String> {
    let (row, col) = match which {
        Which::Rowwise => (Some(plane), None),
        Which::Columnwise => (None, Some(plane)),
    };
    Ok(match (s.recipe.fp8_kind(), amax) {
        (Some(kind), _) => Mxfp8Tensor::from_parts(name, rows, cols, kind, s.two_d, row, col)
            .map_err(|e| e.to_string())?
            .dequantize(),
        (None, Some(a)) => {
            Nvfp4Tensor::from_parts(name, rows, cols, s.two_d, false, a, a, row, col)
                .map_err(|e| e.to_string())?
                .dequantize()
        }
        (None, None) => return Err(format!("tensor {name}: NVFP4 amax missing")),
    })
}

/// Refuses scale bytes no quantizer writes: MXFP8's E8M0 0xFF (NaN); NVFP4's E4M3 block scales
/// with the sign bit set (negative, flipping the block's values) or NaN (0x7F).
fn check_scales(name: &str, s: &Settings, part: &str, scales: &[u8]) -> Result<(), String> {
    scales_ok(s, scales).map_err(|i| bad_scale(name, s, part, i, scales[i]))
}

/// The index of the first scale byte no quantizer writes ([`check_scales`]).
fn scales_ok(s: &Settings, scales: &[u8]) -> Result<(), usize> {
    let bad = |b: u8| match s.recipe.fp8_kind() {
        Some(_) => b == 0xFF,
        None => b & 0x80 != 0 || b == 0x7F,
    };
    match scales.iter().position(|&b| bad(b)) {
        Some(i) => Err(i),
        None => Ok(()),
    }
}

/// The message for scale byte `b` at index `i` of component `part`.
fn bad_scale(name: &str, s: &Settings, part: &str, i: usize, b: u8) -> String {
    let what = match s.recipe.fp8_kind() {
        Some(_) => "an E8M0 scale of 0xFF (NaN)",
        None if b & 0x7F == 0x7F => "an E4M3 block scale that is NaN",
        None => "an E4M3 block scale with the sign bit set",
    };
    format!("tensor {name}: {part} byte {i} is 0x{b:02x}, {what}; the file is corrupt")
}

/// fp32 values → little-endian bytes of `dtype` (F32, BF16 or F16).
fn encode(values: &[f32], dtype: Dtype) -> Vec<u8> {
    // Fixed-size element slots (rather than a flat_map of bytes) let the loops vectorize.
    fn each<const N: usize>(values: &[f32], f: impl Fn(f32) -> [u8; N]) -> Vec<u8> {
        let mut out = vec![0u8; values.len() * N];
        for (o, &v) in out.chunks_exact_mut(N).zip(values) {
            o.copy_from_slice(&f(v));
        }
        out
    }
    match dtype {
        Dtype::BF16 => each(values, |v| bf16::from_f32(v).to_bits().to_le_bytes()),
        Dtype::F16 => each(values, |v| {
            // A finite value just past the f16 range (the rounded-up top of a block) would
            // become Inf; saturate it like the fp8 encoders do.
            let v = if v.is_finite() {
                v.clamp(-f32::from(f16::MAX), f32::from(f16::MAX))
            } else {
                v
            };
            f16::from_f32(v).to_bits().to_le_bytes()
        }),
        _ => each(values, f32::to_le_bytes),
    }
}
