//! `lowbit quantize`: every BF16/F16/F32 tensor of a safetensors file becomes the component
//! tensors of [`crate::schema`] (bit-identical to `lowbit_formats::quantize_*`), integer and
//! bool tensors are copied, and a table of round-trip errors is produced.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::Path;

use lowbit_formats::{
    Matrix, Mxfp8Config, Nvfp4Config, QuantPlane, Source, bf16, f16, quantize_mxfp8, quantize_nvfp4,
};
use safetensors::Dtype;

use crate::error::CliError;
use crate::files::{self, OutTensor, Parsed};
use crate::report::{self, Align, Progress, Stats, Table, bytes_str, human_bytes, sci};
use crate::schema::{self, Settings, Which};

/// Everything `quantize` needs besides the paths.
#[derive(Clone, Copy, Debug)]
pub struct Options {
    /// Recipe and layout, recorded in the output's metadata.
    pub settings: Settings,
    /// Worker threads for the library (0 = all cores); the bytes do not depend on it.
    pub threads: usize,
}

/// Quantizes `input` into `output` and returns the report to print.
pub fn run(input: &Path, output: &Path, opts: &Options, force: bool) -> Result<Table, CliError> {
    files::check_paths(input, output, force)?;
    let buf = files::read(input)?;
    let (bytes, mut table) = quantize_buffer(input, output, &buf, opts)?;
    files::write_atomic(output, &bytes)?;
    table.footer.push(format!(
        "wrote {} ({})",
        output.display(),
        human_bytes(bytes.len())
    ));
    Ok(table)
}

/// Decoded high-precision elements of one tensor (the file's bytes may be unaligned).
enum Elements {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
    F16(Vec<f16>),
}

impl Elements {
    fn decode(dtype: Dtype, bytes: &[u8]) -> Option<Self> {
        Some(match dtype {
            Dtype::F32 => Elements::F32(files::f32s(bytes)),
            Dtype::BF16 => Elements::Bf16(files::u16s(bytes).map(bf16::from_bits).collect()),
            Dtype::F16 => Elements::F16(files::u16s(bytes).map(f16::from_bits).collect()),
            _ => return None,
        })
    }

    fn source(&self) -> Source<'_> {
        match self {
            Elements::F32(v) => Source::F32(v),
            Elements::Bf16(v) => Source::Bf16(v),
            Elements::F16(v) => Source::F16(v),
        }
    }
}

/// Whether a tensor of this dtype is quantized (`Ok(true)`), copied (`Ok(false)`) or refused.
fn is_quantized(name: &str, dtype: Dtype) -> Result<bool, String> {
    match dtype {
        Dtype::BF16 | Dtype::F16 | Dtype::F32 => Ok(true),
        Dtype::BOOL
        | Dtype::U8
        | Dtype::I8
        | Dtype::I16
        | Dtype::U16
        | Dtype::I32
        | Dtype::U32
        | Dtype::I64
        | Dtype::U64 => Ok(false),
        // Other floats (F64, fp8, fp6, fp4, complex, future ones) would silently lose meaning
        // if copied or narrowed, so they are refused.
        other => Err(format!(
            "tensor {name}: unsupported dtype {other} (quantize accepts BF16, F16, F32)"
        )),
    }
}

/// The output tensor names an input tensor turns into.
fn output_names(name: &str, quantized: bool, s: &Settings) -> Vec<String> {
    if !quantized {
        return vec![name.to_owned()];
    }
    let mut names = Vec::new();
    // rows/cols do not affect names.
    for which in [Which::Rowwise, Which::Columnwise] {
        let wanted = match which {
            Which::Rowwise => s.copies.rowwise(),
            Which::Columnwise => s.copies.columnwise(),
        };
        if wanted {
            let p = schema::copy_parts(name, s, which, 0, 0);
            names.push(p.data.name);
            names.push(p.scales.name);
        }
    }
    if s.recipe.fp8_kind().is_none() {
        names.push(schema::amax_part(name).name);
    }
    names
}

/// Quantizes a whole safetensors file held in memory; returns the output file's bytes and the
/// report. Nothing is written.
pub fn quantize_buffer(
    input: &Path,
    output: &Path,
    buf: &[u8],
    opts: &Options,
) -> Result<(Vec<u8>, Table), CliError> {
    let s = &opts.settings;
    let ctx = |m: String| CliError::Msg(format!("{}: {m}", input.display()));
    let parsed = Parsed::new(input, buf)?;

    // Validate every tensor before the expensive part, so a bad tensor late in a large file
    // fails fast.
    let mut plan = Vec::with_capacity(parsed.tensors.len());
    let mut produced: HashMap<String, &str> = HashMap::new();
    for (name, view) in &parsed.tensors {
        let q = is_quantized(name, view.dtype()).map_err(ctx)?;
        for out in output_names(name, q, s) {
            if let Some(prev) = produced.insert(out.clone(), name) {
                return Err(ctx(format!(
                    "tensors {prev} and {name} would both write output tensor {out}; rename one"
                )));
            }
        }
        plan.push(q);
    }

    let mut table = Table::new(&[
        ("tensor", Align::Left),
        ("shape", Align::Left),
        ("dtype", Align::Left),
        ("amax", Align::Right),
        ("SQNR dB", Align::Right),
        ("max |err|", Align::Right),
        ("bytes in", Align::Right),
        ("bytes out", Align::Right),
    ]);
    table.title.push(format!(
        "quantize {} -> {}: recipe {}, copies {}, {} scales, {} scale layout, nan policy {}",
        input.display(),
        output.display(),
        s.recipe.as_str(),
        schema::copies_str(s.copies),
        if s.two_d { "2D" } else { "1D" },
        schema::layout_str(s.layout),
        schema::nan_policy_str(s.nan_policy),
    ));

    // Keep the input's own metadata, minus stale keys of ours that would misdescribe the output.
    let mut metadata: HashMap<String, String> = parsed
        .metadata
        .iter()
        .filter(|(k, _)| !k.starts_with(schema::KEY_PREFIX))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    s.write_metadata(&mut metadata);

    let total_in: usize = parsed.tensors.iter().map(|(_, v)| v.data().len()).sum();
    let progress = Progress::new(parsed.tensors.len(), total_in);
    let mut out: Vec<(String, OutTensor<'_>)> = Vec::new();
    let mut totals = Stats::default();
    let (mut bytes_in, mut bytes_out, mut n_quantized) = (0usize, 0usize, 0usize);
    for (i, ((name, view), &q)) in parsed.tensors.iter().zip(&plan).enumerate() {
        progress.tick("quantizing", i, name);
        let data = view.data();
        let shape = schema::shape_str(view.shape());
        bytes_in += data.len();
        if !q {
            bytes_out += data.len();
            out.push((
                name.clone(),
                OutTensor {
                    dtype: view.dtype(),
                    shape: view.shape().to_vec(),
                    data: Cow::Borrowed(data),
                },
            ));
            table.row(vec![
                name.clone(),
                shape,
                format!("{} (copied)", view.dtype()),
                "-".into(),
                "-".into(),
                "-".into(),
                bytes_str(data.len()),
                bytes_str(data.len()),
            ]);
            continue;
        }
        let (rows, cols) = schema::matrix_dims(view.shape())
            .ok_or_else(|| ctx(format!("tensor {name}: shape {shape} is too large")))?;
        let elements = Elements::decode(view.dtype(), data)
            .ok_or_else(|| ctx(format!("tensor {name}: cannot decode {}", view.dtype())))?;
        let fmt_err = |source| format_error(input, view.shape(), source);
        let m = Matrix::new(name, rows, cols, elements.source()).map_err(fmt_err)?;
        let (parts, xhat) = quantize_one(&m, s, opts.threads).map_err(|e| match e {
            OneError::Format(f) => fmt_err(f),
            OneError::Internal(msg) => ctx(format!("tensor {name}: internal error: {msg}")),
        })?;
        let stats = Stats::measure(rows * cols, |k| m.get(k), &xhat);
        totals.add(&stats);
        let size: usize = parts.iter().map(|(_, t)| t.data.len()).sum();
        bytes_out += size;
        n_quantized += 1;
        out.extend(parts);
        metadata.insert(
            schema::tensor_key(name),
            schema::encode_original(view.dtype(), view.shape()),
        );
        table.row(vec![
            name.clone(),
            shape,
            view.dtype().to_string(),
            sci(f64::from(stats.amax)),
            stats.sqnr_db(),
            sci(stats.max_err),
            bytes_str(data.len()),
            bytes_str(size),
        ]);
    }
    progress.finish();

    let n_copied = parsed.tensors.len() - n_quantized;
    table.totals(vec![
        format!("total ({})", report::count(parsed.tensors.len(), "tensor")),
        String::new(),
        String::new(),
        if n_quantized > 0 {
            sci(f64::from(totals.amax))
        } else {
            "-".into()
        },
        if n_quantized > 0 {
            totals.sqnr_db()
        } else {
            "-".into()
        },
        if n_quantized > 0 {
            sci(totals.max_err)
        } else {
            "-".into()
        },
        bytes_str(bytes_in),
        bytes_str(bytes_out),
    ]);
    let ratio = if bytes_in > 0 {
        format!(
            " ({:.1}% of the input)",
            100.0 * bytes_out as f64 / bytes_in as f64
        )
    } else {
        String::new()
    };
    table.footer.push(format!(
        "{} quantized, {n_copied} copied; tensor data {} -> {}{ratio}; \
         SQNR and max |err| compare the input with the dequantized {} copy over finite elements",
        report::count(n_quantized, "tensor"),
        human_bytes(bytes_in),
        human_bytes(bytes_out),
        if s.copies.rowwise() {
            "rowwise"
        } else {
            "columnwise"
        },
    ));
    let bytes = files::serialize(output, out, metadata)?;
    Ok((bytes, table))
}

/// A library error with the file as context; a non-finite element of a tensor that is not 2D
/// also gets its index in the original shape (the library reports matrix coordinates).
fn format_error(input: &Path, shape: &[usize], source: lowbit_formats::FormatError) -> CliError {
    if let lowbit_formats::FormatError::NonFinite { flat, .. } = source
        && shape.len() != 2
    {
        let mut rest = flat;
        let mut index = vec![0; shape.len()];
        for (i, &d) in index.iter_mut().zip(shape).rev() {
            if d > 0 {
                *i = rest % d;
                rest /= d;
            }
        }
        return CliError::Msg(format!(
            "{}: {source}, i.e. element {} of the {} tensor (--nan-policy error)",
            input.display(),
            schema::shape_str(&index),
            schema::shape_str(shape)
        ));
    }
    CliError::Format {
        path: input.to_owned(),
        source,
    }
}

/// Why one tensor could not be quantized.
enum OneError {
    /// The library refused the input (e.g. a NaN under `--nan-policy error`).
    Format(lowbit_formats::FormatError),
    /// The library's output disagrees with the schema: a bug, reported rather than panicking.
    Internal(String),
}

impl From<lowbit_formats::FormatError> for OneError {
    fn from(e: lowbit_formats::FormatError) -> Self {
        OneError::Format(e)
    }
}

type Parts = Vec<(String, OutTensor<'static>)>;

/// Quantizes one matrix; returns its component tensors and the dequantized rowwise (else
/// columnwise) copy for the report.
fn quantize_one(
    m: &Matrix<'_>,
    s: &Settings,
    threads: usize,
) -> Result<(Parts, Vec<f32>), OneError> {
    let mut parts = Vec::new();
    let xhat;
    let mut amax = None;
    let planes = match s.recipe.fp8_kind() {
        Some(kind) => {
            let cfg = Mxfp8Config {
                kind,
                copies: s.copies,
                two_d: s.two_d,
                nan_policy: s.nan_policy,
                threads,
            };
            let t = quantize_mxfp8(m, &cfg)?;
            xhat = t.dequantize();
            [
                (Which::Rowwise, t.rowwise),
                (Which::Columnwise, t.columnwise),
            ]
        }
        None => {
            let cfg = Nvfp4Config {
                copies: s.copies,
                two_d: s.two_d,
                nan_policy: s.nan_policy,
                threads,
                ..Nvfp4Config::default()
            };
            let t = quantize_nvfp4(m, &cfg)?;
            xhat = t.dequantize();
            amax = Some(t.amax_rowwise);
            [
                (Which::Rowwise, t.rowwise),
                (Which::Columnwise, t.columnwise),
            ]
        }
    };
    for (which, plane) in planes {
        if let Some(p) = plane {
            parts.extend(store_plane(m, s, which, p)?);
        }
    }
    if let Some(a) = amax {
        let part = schema::amax_part(m.name());
        parts.push((
            part.name,
            OutTensor::owned(part.dtype, part.shape, a.to_le_bytes().to_vec()),
        ));
    }
    Ok((parts, xhat))
}

/// The data and scale tensors of one copy, scales converted to the requested layout.
fn store_plane(
    m: &Matrix<'_>,
    s: &Settings,
    which: Which,
    p: QuantPlane,
) -> Result<Parts, OneError> {
    let cp = schema::copy_parts(m.name(), s, which, m.rows(), m.cols());
    let compact = [cp.compact_scales.0, cp.compact_scales.1];
    if cp.data.shape != p.data_shape || p.scale_shape != compact {
        return Err(OneError::Internal(format!(
            "{} copy has data {:?} and scales {:?}, the schema expects {:?} and {:?}",
            which.as_str(),
            p.data_shape,
            p.scale_shape,
            cp.data.shape,
            compact
        )));
    }
    let scales = schema::store_scales(s, which, p.scales, cp.compact_scales);
    Ok(vec![
        (
            cp.data.name,
            OutTensor::owned(cp.data.dtype, cp.data.shape, p.data),
        ),
        (
            cp.scales.name,
            OutTensor::owned(cp.scales.dtype, cp.scales.shape, scales),
        ),
    ])
}
