//! `lowbit quantize`: every BF16/F16/F32 tensor of a safetensors file becomes the component
//! tensors of [`crate::schema`] (bit-identical to `lowbit_formats::quantize_*`), integer and
//! bool tensors are copied, and a table of round-trip errors is produced.
//!
//! The file is streamed, never held whole: its header is read and validated first
//! ([`files::Input`]), then every tensor is checked against the recipe and the output's header
//! is computed from the shapes, and only then is data read, in chunks of whole 32-row bands.
//! Each chunk is quantized by the library (chunks split at multiples of 32 rows give the whole
//! matrix's bytes), written at its place in the output, and dequantized for the report, whose
//! sums are taken chunk after chunk in element order: the figures are those of one pass over
//! the tensor. NVFP4 needs the tensor's global amax first, so its tensors are read twice. Scales
//! (a byte per 16 or 32 elements) and NVFP4's transposed columnwise data (half a byte per
//! element) are gathered in memory and written when their tensor is done.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Mutex, PoisonError};

use half::slice::HalfBitsSliceExt;
use lowbit_formats::{
    FormatError, Matrix, Mxfp8Config, Mxfp8Tensor, Nvfp4Config, Nvfp4Tensor, QuantPlane, Source,
    f16, nvfp4_amax, quantize_mxfp8, quantize_nvfp4_piece,
};
use safetensors::Dtype;

use crate::error::Error;
use crate::files::{self, Entry, Input, Output, pipeline};
use crate::report::{self, Align, Progress, Stats, Table, bytes_str, human_bytes, sci};
use crate::schema::{self, CopyParts, Part, Placement, Settings, Which};

/// Everything `quantize` needs besides the paths.
#[derive(Clone, Debug)]
pub struct Options {
    /// Recipe and layout, recorded in the output's metadata.
    pub settings: Settings,
    /// Worker threads (0 = all cores); the bytes do not depend on it.
    pub threads: usize,
    /// Quantize only the float tensors with these names and copy the others (`None`: every
    /// float tensor). `lowbit ckpt export` quantizes a model's GEMM weights this way.
    pub only: Option<std::collections::HashSet<String>>,
}

/// What one input tensor becomes.
enum Plan {
    /// Copied through.
    Copied,
    /// Quantized as a `rows × cols` matrix into these copies (and an NVFP4 amax).
    Quantized {
        rows: usize,
        cols: usize,
        copies: Vec<(Which, CopyParts)>,
        amax: Option<Part>,
    },
}

impl Plan {
    /// The output tensors, in the order the file's header lists a tensor's components.
    fn parts(&self, e: &Entry) -> Vec<Part> {
        match self {
            Plan::Copied => vec![Part {
                name: e.name.clone(),
                dtype: e.dtype,
                shape: e.shape.clone(),
            }],
            Plan::Quantized { copies, amax, .. } => copies
                .iter()
                .flat_map(|(_, cp)| [cp.data.clone(), cp.scales.clone()])
                .chain(amax.clone())
                .collect(),
        }
    }
}

/// Quantizes `input` into `output` and returns the report to print.
pub fn run(input: &Path, output: &Path, opts: &Options, force: bool) -> Result<Table, Error> {
    files::check_paths(input, output, force)?;
    let src = Input::open(input)?;
    let s = &opts.settings;
    let ctx = |m: String| Error::Invalid(format!("{}: {m}", crate::report::shown(input)));

    // Validate every tensor and lay out the output before any data is read, so a bad tensor
    // late in a large file fails fast.
    let mut plans = Vec::with_capacity(src.tensors.len());
    let mut produced: HashMap<String, &str> = HashMap::new();
    for e in &src.tensors {
        let name = &e.name;
        let chosen = opts.only.as_ref().is_none_or(|o| o.contains(name));
        let plan = if is_quantized(name, e.dtype).map_err(ctx)? && chosen {
            let (rows, cols) = schema::matrix_dims(&e.shape).ok_or_else(|| {
                let shape = schema::shape_str(&e.shape);
                ctx(format!("tensor {name}: shape {shape} is too large"))
            })?;
            let copies = [Which::Rowwise, Which::Columnwise]
                .into_iter()
                .filter(|w| match w {
                    Which::Rowwise => s.copies.rowwise(),
                    Which::Columnwise => s.copies.columnwise(),
                })
                .map(|w| (w, schema::copy_parts(name, s, w, rows, cols)))
                .collect();
            let amax = s
                .recipe
                .fp8_kind()
                .is_none()
                .then(|| schema::amax_part(name));
            Plan::Quantized {
                rows,
                cols,
                copies,
                amax,
            }
        } else {
            Plan::Copied
        };
        for out in plan.parts(e) {
            if let Some(prev) = produced.insert(out.name.clone(), name) {
                return Err(ctx(format!(
                    "tensors {prev} and {name} would both write output tensor {}; rename one",
                    out.name
                )));
            }
        }
        plans.push(plan);
    }

    // Keep the input's own metadata, minus stale keys of ours that would misdescribe the output.
    let mut metadata: HashMap<String, String> = src
        .metadata
        .iter()
        .filter(|(k, _)| !k.starts_with(schema::KEY_PREFIX))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    s.write_metadata(&mut metadata);
    let mut specs = Vec::new();
    for (e, plan) in src.tensors.iter().zip(&plans) {
        if matches!(plan, Plan::Quantized { .. }) {
            metadata.insert(
                schema::tensor_key(&e.name),
                schema::encode_original(e.dtype, &e.shape),
            );
        }
        specs.extend(plan.parts(e).into_iter().map(|p| p.spec()));
    }
    let (header, offsets) = files::layout(output, &specs, &metadata)?;
    let offset_of: HashMap<&str, u64> = specs
        .iter()
        .zip(&offsets)
        .map(|(sp, &o)| (sp.name.as_str(), o))
        .collect();
    let file_len = header.len() + specs.iter().map(|sp| sp.len).sum::<usize>();
    let out = Output::create(output)?;
    out.write_at(0, &header)?;

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
        crate::report::shown(input),
        crate::report::shown(output),
        s.recipe.as_str(),
        schema::copies_str(s.copies),
        if s.two_d { "2D" } else { "1D" },
        schema::layout_str(s.layout),
        schema::nan_policy_str(s.nan_policy),
    ));

    let total_in: usize = src.tensors.iter().map(|e| e.len).sum();
    let progress = Progress::new(src.tensors.len(), total_in);
    let mut totals = Stats::default();
    let (mut bytes_in, mut bytes_out, mut n_quantized) = (0usize, 0usize, 0usize);
    for (i, (e, plan)) in src.tensors.iter().zip(&plans).enumerate() {
        progress.tick("quantizing", i, &e.name);
        let shape = schema::shape_str(&e.shape);
        bytes_in += e.len;
        let Plan::Quantized {
            rows,
            cols,
            copies,
            amax,
        } = plan
        else {
            src.copy_to(e.offset, e.len, &out, offset_of[e.name.as_str()])?;
            bytes_out += e.len;
            table.row(vec![
                e.name.clone(),
                shape,
                format!("{} (copied)", e.dtype),
                "-".into(),
                "-".into(),
                "-".into(),
                bytes_str(e.len),
                bytes_str(e.len),
            ]);
            continue;
        };
        let job = Job {
            src: &src,
            out: &out,
            e,
            rows: *rows,
            cols: *cols,
            s,
            copies: copies
                .iter()
                .map(|(which, cp)| CopyOut::new(*which, cp, s, &offset_of))
                .collect(),
            amax_offset: amax.as_ref().map(|p| offset_of[p.name.as_str()]),
        };
        let stats = job.run(opts.threads)?;
        totals.add(&stats);
        let size: usize = plan.parts(e).iter().map(|p| p.spec().len).sum();
        bytes_out += size;
        n_quantized += 1;
        table.row(vec![
            e.name.clone(),
            shape,
            e.dtype.to_string(),
            sci(f64::from(stats.amax)),
            stats.sqnr_db(),
            sci(stats.max_err),
            bytes_str(e.len),
            bytes_str(size),
        ]);
    }
    progress.finish();

    let n_copied = src.tensors.len() - n_quantized;
    table.totals(vec![
        format!("total ({})", report::count(src.tensors.len(), "tensor")),
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
    files::commit_reported(out, file_len, table)
}

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

/// One copy's outputs: data chunks go straight to the file unless the plane is transposed
/// (NVFP4 columnwise: a chunk is a segment of every row), which is gathered here like the
/// scales (compact, converted to the file's layout at the end).
struct CopyOut {
    which: Which,
    parts: CopyParts,
    data_offset: u64,
    scales_offset: u64,
    data: Option<Mutex<Vec<u8>>>,
    scales: Mutex<Vec<u8>>,
}

impl CopyOut {
    fn new(which: Which, cp: &CopyParts, s: &Settings, offset_of: &HashMap<&str, u64>) -> Self {
        let transposed = Placement::of(s, which, false).transposed;
        CopyOut {
            which,
            data_offset: offset_of[cp.data.name.as_str()],
            scales_offset: offset_of[cp.scales.name.as_str()],
            data: transposed.then(|| Mutex::new(vec![0; cp.data.spec().len])),
            scales: Mutex::new(vec![0; cp.compact_scales.0 * cp.compact_scales.1]),
            parts: cp.clone(),
        }
    }
}

/// The streaming quantization of one tensor.
struct Job<'a> {
    src: &'a Input,
    out: &'a Output,
    e: &'a Entry,
    rows: usize,
    cols: usize,
    s: &'a Settings,
    copies: Vec<CopyOut>,
    amax_offset: Option<u64>,
}

impl Job<'_> {
    /// Quantizes, writes and measures the tensor; returns its round-trip statistics.
    fn run(self, threads: usize) -> Result<Stats, Error> {
        let (rows, cols) = (self.rows, self.cols);
        let workers = pipeline::threads(threads);
        let chunks = pipeline::Chunks::new(rows, cols, workers);
        let n = chunks.len();
        // Few chunks (a small tensor): the library's own threads split each one.
        let lib_threads = (workers / n).max(1);
        let ahead = workers + 1;
        // Chunk k: its first row, its row count and its elements.
        let read = |k: usize| -> Result<(usize, usize, Elements), Error> {
            let (r0, r1) = chunks.range(k);
            let size = self.e.dtype.bitsize() / 8;
            let offset = self.e.offset + (r0 * cols * size) as u64;
            let x = Elements::read(self.src, self.e.dtype, offset, (r1 - r0) * cols)
                .ok_or_else(|| self.internal(format!("cannot decode {}", self.e.dtype)))??;
            Ok((r0, r1 - r0, x))
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
                        let (_, rows, x) = read(k)?;
                        Ok(nvfp4_amax(&self.matrix(rows, &x)?, lib_threads))
                    },
                    // Non-negative floats order as their bits.
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
                let (r0, rows, x) = read(k)?;
                let m = self.matrix(rows, &x)?;
                let t = self.quantize(&m, lib_threads, amax).map_err(|f| {
                    // The library reports the chunk's coordinates.
                    let f = match f {
                        FormatError::NonFinite {
                            name,
                            row,
                            col,
                            flat,
                            value,
                        } => FormatError::NonFinite {
                            name,
                            row: row + r0,
                            col,
                            flat: flat + r0 * cols,
                            value,
                        },
                        other => other,
                    };
                    self.format_error(f)
                })?;
                self.store(&t, r0, m.rows())?;
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

        for c in self.copies {
            if let Some(data) = c.data {
                let data = data.into_inner().unwrap_or_else(PoisonError::into_inner);
                self.out.write_at(c.data_offset, &data)?;
            }
            let compact = c
                .scales
                .into_inner()
                .unwrap_or_else(PoisonError::into_inner);
            let stored = schema::store_scales(self.s, c.which, compact, c.parts.compact_scales);
            self.out.write_at(c.scales_offset, &stored)?;
        }
        if let (Some(offset), Some(a)) = (self.amax_offset, amax) {
            self.out.write_at(offset, &a.to_le_bytes())?;
        }
        Ok(stats)
    }

    /// Chunk `x` of `rows` rows as the library's input.
    fn matrix<'x>(&'x self, rows: usize, x: &'x Elements) -> Result<Matrix<'x>, Error> {
        Matrix::new(&self.e.name, rows, self.cols, x.source()).map_err(|f| self.format_error(f))
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

    /// Writes (or gathers) chunk `t` of `rows` rows starting at row `r0`.
    fn store(&self, t: &Quantized, r0: usize, rows: usize) -> Result<(), Error> {
        for c in &self.copies {
            let p = t
                .plane(c.which)
                .ok_or_else(|| self.internal(format!("no {} copy", c.which.as_str())))?;
            // The schema's shapes for this chunk; the library's must agree.
            let cp = schema::copy_parts(&self.e.name, self.s, c.which, rows, self.cols);
            let compact = [cp.compact_scales.0, cp.compact_scales.1];
            if cp.data.shape != p.data_shape || p.scale_shape != compact {
                return Err(self.internal(format!(
                    "{} copy has data {:?} and scales {:?}, the schema expects {:?} and {:?}",
                    c.which.as_str(),
                    p.data_shape,
                    p.scale_shape,
                    cp.data.shape,
                    compact
                )));
            }
            let misfit = || {
                self.internal(format!(
                    "{} chunk at row {r0} does not fit",
                    c.which.as_str()
                ))
            };
            let dp = Placement::of(self.s, c.which, false);
            let width = p.data_shape[1];
            match &c.data {
                Some(whole) => {
                    let mut whole = whole.lock().unwrap_or_else(PoisonError::into_inner);
                    dp.put(&mut whole, c.parts.data.shape[1], &p.data, width, r0)
                        .ok_or_else(misfit)?;
                }
                None => {
                    let offset = c.data_offset + dp.stacked_offset(r0, width) as u64;
                    self.out.write_at(offset, &p.data)?;
                }
            }
            let sp = Placement::of(self.s, c.which, true);
            let mut scales = c.scales.lock().unwrap_or_else(PoisonError::into_inner);
            sp.put(
                &mut scales,
                c.parts.compact_scales.1,
                &p.scales,
                p.scale_shape[1],
                r0,
            )
            .ok_or_else(misfit)?;
        }
        Ok(())
    }

    fn internal(&self, msg: String) -> Error {
        Error::Invalid(format!(
            "{}: tensor {}: internal error: {msg}",
            crate::report::shown(self.src.path()),
            self.e.name
        ))
    }

    fn format_error(&self, f: FormatError) -> Error {
        format_error(self.src.path(), &self.e.shape, f)
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

/// A library error with the file as context; a non-finite element of a tensor that is not 2D
/// also gets its index in the original shape (the library reports matrix coordinates).
fn format_error(input: &Path, shape: &[usize], source: lowbit_formats::FormatError) -> Error {
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
        return Error::Invalid(format!(
            "{}: {source}, i.e. element {} of the {} tensor (--nan-policy error)",
            crate::report::shown(input),
            schema::shape_str(&index),
            schema::shape_str(shape)
        ));
    }
    Error::Format {
        path: input.to_owned(),
        source,
    }
}
