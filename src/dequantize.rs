//! `lowbit dequantize`: rebuilds each quantized tensor of a file written by `lowbit quantize`
//! from its rowwise copy (or its columnwise copy when that is all there is) with the library's
//! `from_parts` + `dequantize_*`, restores its original shape and dtype, and copies every other
//! tensor unchanged.

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::path::Path;

use clap::ValueEnum;
use lowbit_formats::{Mxfp8Tensor, Nvfp4Tensor, QuantPlane, bf16, f16};
use safetensors::Dtype;
use safetensors::tensor::TensorView;

use crate::error::CliError;
use crate::files::{self, OutTensor, Parsed};
use crate::report::{self, Align, Progress, Table, bytes_str, human_bytes};
use crate::schema::{self, Part, Settings, Which};

/// Element type of dequantized tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
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
) -> Result<Table, CliError> {
    files::check_paths(input, output, force)?;
    let buf = files::read(input)?;
    let (bytes, mut table) = dequantize_buffer(input, output, &buf, dtype)?;
    files::write_atomic(output, &bytes)?;
    table.footer.push(format!(
        "wrote {} ({})",
        output.display(),
        human_bytes(bytes.len())
    ));
    Ok(table)
}

/// Dequantizes a whole quantized file held in memory; returns the output's bytes and the report.
pub fn dequantize_buffer(
    input: &Path,
    output: &Path,
    buf: &[u8],
    dtype: Option<OutDtype>,
) -> Result<(Vec<u8>, Table), CliError> {
    let ctx = |m: String| CliError::Msg(format!("{}: {m}", input.display()));
    let parsed = Parsed::new(input, buf)?;
    if !parsed.metadata.contains_key(schema::KEY_VERSION) {
        return Err(ctx(format!(
            "not a lowbit-quantized file (its __metadata__ has no {} key); dequantize reads \
             files written by `lowbit quantize`",
            schema::KEY_VERSION
        )));
    }
    let s = Settings::read_metadata(&parsed.metadata).map_err(ctx)?;

    let mut quantized: Vec<(String, Dtype, Vec<usize>)> = Vec::new();
    for (key, value) in &parsed.metadata {
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
        input.display(),
        output.display(),
        s.recipe.as_str(),
        schema::layout_str(s.layout),
    ));

    let mut out: Vec<(String, OutTensor<'_>)> = Vec::new();
    let (mut total_in, mut total_out) = (0usize, 0usize);
    let progress = Progress::new(quantized.len(), buf.len());
    for (i, (name, orig_dtype, shape)) in quantized.iter().enumerate() {
        progress.tick("dequantizing", i, name);
        if parsed.get(name).is_some() {
            return Err(ctx(format!(
                "tensor {name} is listed as quantized but also stored as a plain tensor"
            )));
        }
        let target = dtype.map_or(*orig_dtype, OutDtype::dtype);
        let (values, size_in) = dequantize_one(&parsed, &s, which, name, shape).map_err(ctx)?;
        let data = encode(&values, target);
        total_in += size_in;
        total_out += data.len();
        table.row(vec![
            name.clone(),
            schema::shape_str(shape),
            target.to_string(),
            which.as_str().to_owned(),
            bytes_str(size_in),
            bytes_str(data.len()),
        ]);
        out.push((name.clone(), OutTensor::owned(target, shape.clone(), data)));
    }
    progress.finish();
    for (name, view) in &parsed.tensors {
        if consumed.contains(name) {
            continue;
        }
        let n = view.data().len();
        total_in += n;
        total_out += n;
        table.row(vec![
            name.clone(),
            schema::shape_str(view.shape()),
            view.dtype().to_string(),
            "copied".into(),
            bytes_str(n),
            bytes_str(n),
        ]);
        out.push((
            name.clone(),
            OutTensor {
                dtype: view.dtype(),
                shape: view.shape().to_vec(),
                data: Cow::Borrowed(view.data()),
            },
        ));
    }
    table.totals(vec![
        format!("total ({})", report::count(out.len(), "tensor")),
        String::new(),
        String::new(),
        String::new(),
        bytes_str(total_in),
        bytes_str(total_out),
    ]);
    table.footer.push(format!(
        "{} dequantized, {} copied",
        report::count(quantized.len(), "tensor"),
        out.len() - quantized.len()
    ));
    // The output is plain high-precision data again: drop our keys, keep the user's.
    let metadata: HashMap<String, String> = parsed
        .metadata
        .iter()
        .filter(|(k, _)| !k.starts_with(schema::KEY_PREFIX))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let bytes = files::serialize(output, out, metadata)?;
    Ok((bytes, table))
}

/// The stored component `part`, checked against its expected dtype and shape.
fn fetch<'a>(parsed: &Parsed<'a>, tensor: &str, part: &Part) -> Result<&'a [u8], String> {
    let v: &TensorView<'a> = parsed.get(&part.name).ok_or_else(|| {
        format!(
            "tensor {tensor}: component {} is missing from the file",
            part.name
        )
    })?;
    if v.dtype() != part.dtype || v.shape() != part.shape.as_slice() {
        return Err(format!(
            "tensor {tensor}: component {} is {} {}, expected {} {}",
            part.name,
            v.dtype(),
            schema::shape_str(v.shape()),
            part.dtype,
            schema::shape_str(&part.shape)
        ));
    }
    Ok(v.data())
}

/// Reconstructs one tensor's fp32 values; also returns the bytes of the components read.
fn dequantize_one(
    parsed: &Parsed<'_>,
    s: &Settings,
    which: Which,
    name: &str,
    shape: &[usize],
) -> Result<(Vec<f32>, usize), String> {
    let too_large = || format!("tensor {name}: recorded shape is too large");
    let (rows, cols) = schema::matrix_dims(shape).ok_or_else(too_large)?;
    let len = rows.checked_mul(cols).ok_or_else(too_large)?;
    let cp = schema::copy_parts(name, s, which, rows, cols);
    let data = fetch(parsed, name, &cp.data)?;
    let stored_scales = fetch(parsed, name, &cp.scales)?;
    let mut size = data.len() + stored_scales.len();
    let amax = if s.recipe.fp8_kind().is_none() {
        let a = fetch(parsed, name, &schema::amax_part(name))?;
        size += a.len();
        let amax = files::f32s(a)
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
        Some(amax)
    } else {
        None
    };
    check_scales(name, s, &cp.scales.name, stored_scales)?;
    if len == 0 {
        // Nothing to reconstruct; also spares the library loops over a zero-sized dimension.
        return Ok((Vec::new(), size));
    }
    let plane = QuantPlane {
        data: data.to_vec(),
        data_shape: [cp.data.shape[0], cp.data.shape[1]],
        scales: schema::load_scales(s, which, stored_scales, cp.compact_scales),
        scale_shape: [cp.compact_scales.0, cp.compact_scales.1],
    };
    let (row, col) = match which {
        Which::Rowwise => (Some(plane), None),
        Which::Columnwise => (None, Some(plane)),
    };
    let values = match (s.recipe.fp8_kind(), amax) {
        (Some(kind), _) => Mxfp8Tensor::from_parts(name, rows, cols, kind, s.two_d, row, col)
            .map_err(|e| e.to_string())?
            .dequantize(),
        (None, Some(a)) => {
            Nvfp4Tensor::from_parts(name, rows, cols, s.two_d, false, a, a, row, col)
                .map_err(|e| e.to_string())?
                .dequantize()
        }
        (None, None) => return Err(format!("tensor {name}: NVFP4 amax missing")),
    };
    if values.len() != len {
        return Err(format!(
            "tensor {name}: internal error: {} values dequantized, {len} expected",
            values.len()
        ));
    }
    Ok((values, size))
}

/// Refuses scale bytes no quantizer writes: MXFP8's E8M0 0xFF (NaN); NVFP4's E4M3 block scales
/// with the sign bit set (negative, flipping the block's values) or NaN (0x7F).
fn check_scales(name: &str, s: &Settings, part: &str, scales: &[u8]) -> Result<(), String> {
    let bad = |b: u8| match s.recipe.fp8_kind() {
        Some(_) => b == 0xFF,
        None => b & 0x80 != 0 || b == 0x7F,
    };
    if let Some(i) = scales.iter().position(|&b| bad(b)) {
        let what = match s.recipe.fp8_kind() {
            Some(_) => "an E8M0 scale of 0xFF (NaN)",
            None if scales[i] & 0x7F == 0x7F => "an E4M3 block scale that is NaN",
            None => "an E4M3 block scale with the sign bit set",
        };
        return Err(format!(
            "tensor {name}: {part} byte {i} is 0x{:02x}, {what}; the file is corrupt",
            scales[i]
        ));
    }
    Ok(())
}

/// fp32 values → little-endian bytes of `dtype` (F32, BF16 or F16).
fn encode(values: &[f32], dtype: Dtype) -> Vec<u8> {
    match dtype {
        Dtype::BF16 => values
            .iter()
            .flat_map(|&v| bf16::from_f32(v).to_bits().to_le_bytes())
            .collect(),
        Dtype::F16 => values
            .iter()
            .flat_map(|&v| {
                // A finite value just past the f16 range (the rounded-up top of a block) would
                // become Inf; saturate it like the fp8 encoders do.
                let v = if v.is_finite() {
                    v.clamp(-f32::from(f16::MAX), f32::from(f16::MAX))
                } else {
                    v
                };
                f16::from_f32(v).to_bits().to_le_bytes()
            })
            .collect(),
        _ => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}
