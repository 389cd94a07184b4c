//! `lowbit quantize`: the selected BF16/F16/F32 tensors of a safetensors file become the
//! component tensors of [`crate::schema`] (bit-identical to `lowbit_formats::quantize_*`); the
//! other tensors (integers, bools, and floats the selection keeps, see [`crate::select`]) are
//! copied bit for bit, and a report of round-trip errors is produced.
//!
//! The file is streamed, never held whole: its header is read and validated first
//! ([`files::Input`]), then every tensor is checked against the recipe and the output's header
//! is computed from the shapes, and only then is data read, block by block (`wide`:
//! full-width bands of whole 128-row tiles, or, for 1-D and wide tensors, 128-row bands cut
//! into multiples of 128 columns). Each block is quantized by the library (blocks on tile
//! boundaries give the whole matrix's bytes), its pieces written where they belong in the
//! output (nothing is gathered), and dequantized for the report, whose sums are taken block
//! after block: in element order for full-width bands (the figures of one pass over the
//! tensor). NVFP4 needs the tensor's global amax first, so its tensors are read twice.

mod stream;

use std::collections::HashMap;
use std::path::Path;

use safetensors::Dtype;

use crate::error::Error;
use crate::files::{self, Entry, Input, Output};
use crate::json::Json;
use crate::report::{self, Align, Progress, Stats, Table, bytes_str, human_bytes, sci};
use crate::schema::{self, CopyParts, Naming, Part, Settings, Which};
use crate::select::{Keep, Select};

/// Everything `quantize` needs besides the paths.
#[derive(Clone, Debug)]
pub struct Options {
    /// Recipe and layout, recorded in the output's metadata.
    pub settings: Settings,
    /// Worker threads (0 = all cores); the bytes do not depend on it.
    pub threads: usize,
    /// Quantize only the float tensors with these names and copy the others (`None`: every
    /// float tensor the selection chooses). `lowbit ckpt export` quantizes a model's GEMM
    /// weights this way.
    pub only: Option<std::collections::HashSet<String>>,
    /// Which float tensors are quantized ([`Select::default`]: the GEMM weights by the default
    /// rule; [`Select::all`]: every one).
    pub select: Select,
    /// How the components are named (compressed-tensors: NVFP4 rowwise compact only, every
    /// quantized tensor named `*.weight` with an even last dimension).
    pub naming: Naming,
}

/// What happened to one input tensor.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    /// Quantized, with its round-trip statistics.
    Quantized(Stats),
    /// A float tensor kept in its dtype (copied bit for bit), and why.
    Kept(Keep),
    /// An integer or bool tensor, copied bit for bit.
    Copied,
}

/// One input tensor of a [`Report`].
#[derive(Clone, Debug, PartialEq)]
pub struct TensorRecord {
    /// Its name.
    pub name: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Its dtype in the input.
    pub dtype: Dtype,
    /// What it became.
    pub outcome: Outcome,
    /// Its bytes in the input.
    pub bytes_in: usize,
    /// The bytes of what it became in the output.
    pub bytes_out: usize,
}

/// What a quantization returns: the table to print and the same facts as records (for
/// `--json`).
#[derive(Clone, Debug)]
pub struct Report {
    /// The aligned table.
    pub table: Table,
    /// Every input tensor, in file order.
    pub tensors: Vec<TensorRecord>,
    /// The settings written.
    pub settings: Settings,
}

impl Report {
    /// The report as one JSON object: the settings, and per tensor `action` (`quantized`,
    /// `kept`, `copied`), `reason` (for kept tensors), the statistics of quantized ones (a
    /// non-finite figure as the string `inf` or `NaN`) and the byte counts.
    pub fn to_json(&self) -> Json {
        let s = &self.settings;
        let num = |v: f64| {
            if v.is_finite() {
                Json::Num(v)
            } else {
                Json::str(format!("{v}"))
            }
        };
        let tensors = self
            .tensors
            .iter()
            .map(|t| {
                let mut o = crate::json::Object::new();
                o.insert("name", Json::str(&t.name));
                o.insert(
                    "shape",
                    Json::Arr(t.shape.iter().map(|&d| Json::uint(d)).collect()),
                );
                o.insert("dtype", Json::str(t.dtype.to_string()));
                let (action, reason) = match &t.outcome {
                    Outcome::Quantized(_) => ("quantized", Json::Null),
                    Outcome::Kept(k) => ("kept", Json::str(k.to_string())),
                    Outcome::Copied => ("copied", Json::str("not a float tensor")),
                };
                o.insert("action", Json::str(action));
                o.insert("reason", reason);
                if let Outcome::Quantized(st) = &t.outcome {
                    o.insert("amax", num(f64::from(st.amax)));
                    let sqnr = if st.noise == 0.0 {
                        f64::INFINITY
                    } else {
                        10.0 * (st.signal / st.noise).log10()
                    };
                    o.insert("sqnr_db", num(sqnr));
                    o.insert("max_err", num(st.max_err));
                }
                o.insert("bytes_in", Json::uint(t.bytes_in));
                o.insert("bytes_out", Json::uint(t.bytes_out));
                Json::Obj(o)
            })
            .collect();
        let count = |f: fn(&Outcome) -> bool| {
            Json::uint(self.tensors.iter().filter(|t| f(&t.outcome)).count())
        };
        Json::obj([
            ("recipe", Json::str(s.recipe.as_str())),
            ("copies", Json::str(schema::copies_str(s.copies))),
            ("2d", Json::Bool(s.two_d)),
            ("scale_layout", Json::str(schema::layout_str(s.layout))),
            (
                "nan_policy",
                Json::str(schema::nan_policy_str(s.nan_policy)),
            ),
            ("quantized", count(|o| matches!(o, Outcome::Quantized(_)))),
            ("kept", count(|o| matches!(o, Outcome::Kept(_)))),
            ("copied", count(|o| matches!(o, Outcome::Copied))),
            (
                "bytes_in",
                Json::uint(self.tensors.iter().map(|t| t.bytes_in).sum::<usize>()),
            ),
            (
                "bytes_out",
                Json::uint(self.tensors.iter().map(|t| t.bytes_out).sum::<usize>()),
            ),
            ("tensors", Json::Arr(tensors)),
        ])
    }
}

/// What one input tensor becomes.
enum Plan {
    /// Copied through: an integer/bool tensor (`None`) or a kept float tensor.
    Copied(Option<Keep>),
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
            Plan::Copied(_) => vec![Part {
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

/// Quantizes `input` into `output` and returns the table to print ([`run_report`]'s).
pub fn run(input: &Path, output: &Path, opts: &Options, force: bool) -> Result<Table, Error> {
    run_report(input, output, opts, force).map(|r| r.table)
}

/// Quantizes `input` into `output` and returns the report.
pub fn run_report(
    input: &Path,
    output: &Path,
    opts: &Options,
    force: bool,
) -> Result<Report, Error> {
    files::check_paths(input, output, force)?;
    let src = Input::open(input)?;
    let s = &opts.settings;
    let ctx = |m: String| Error::Invalid(format!("{}: {m}", crate::report::shown(input)));

    let ct = opts.naming == Naming::CompressedTensors;
    if ct
        && (s.recipe != schema::Recipe::Nvfp4
            || s.copies != lowbit_formats::Copies::Rowwise
            || s.layout != lowbit_formats::ScaleLayout::Compact)
    {
        return Err(Error::Invalid(
            "--naming compressed-tensors writes NVFP4 rowwise weights with compact scales: \
             pass --recipe nvfp4 --copies rowwise --scale-layout compact"
                .into(),
        ));
    }
    // Validate every tensor and lay out the output before any data is read, so a bad tensor
    // late in a large file fails fast.
    let mut plans = Vec::with_capacity(src.tensors.len());
    let mut produced: HashMap<String, &str> = HashMap::new();
    for e in &src.tensors {
        let name = &e.name;
        let keep = match opts.only.as_ref() {
            Some(o) if !o.contains(name) => Some(Keep::NotListed),
            _ => opts.select.keep(name, &e.shape),
        };
        let plan = match (is_float(e.dtype), keep) {
            (false, _) => Plan::Copied(None),
            (true, Some(k)) => Plan::Copied(Some(k)),
            (true, None) => {
                check_dtype(name, e.dtype).map_err(ctx)?;
                let (rows, cols) = schema::matrix_dims(&e.shape).ok_or_else(|| {
                    let shape = schema::shape_str(&e.shape);
                    ctx(format!("tensor {name}: shape {shape} is too large"))
                })?;
                let mut copies: Vec<(Which, CopyParts)> = [Which::Rowwise, Which::Columnwise]
                    .into_iter()
                    .filter(|w| match w {
                        Which::Rowwise => s.copies.rowwise(),
                        Which::Columnwise => s.copies.columnwise(),
                    })
                    .map(|w| (w, schema::copy_parts(name, s, w, rows, cols)))
                    .collect();
                let mut amax = s
                    .recipe
                    .fp8_kind()
                    .is_none()
                    .then(|| schema::amax_part(name));
                if ct {
                    compressed_tensors_names(name, cols, &mut copies, &mut amax).map_err(ctx)?;
                }
                Plan::Quantized {
                    rows,
                    cols,
                    copies,
                    amax,
                }
            }
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
    if ct {
        // Not lowbit's naming: `lowbit dequantize` refuses the file rather than copying
        // components through.
        metadata.insert(schema::KEY_NAMING.into(), "compressed-tensors".into());
    }
    let mut specs = Vec::new();
    for (e, plan) in src.tensors.iter().zip(&plans) {
        if matches!(plan, Plan::Quantized { .. }) && !ct {
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
    let mut records = Vec::with_capacity(src.tensors.len());
    let (mut bytes_in, mut bytes_out, mut n_quantized, mut n_kept) = (0usize, 0, 0, 0);
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
            let (cell, outcome) = match plan {
                Plan::Copied(Some(k)) => {
                    n_kept += 1;
                    (format!("{} (kept: {k})", e.dtype), Outcome::Kept(k.clone()))
                }
                _ => (format!("{} (copied)", e.dtype), Outcome::Copied),
            };
            table.row(vec![
                e.name.clone(),
                shape,
                cell,
                "-".into(),
                "-".into(),
                "-".into(),
                bytes_str(e.len),
                bytes_str(e.len),
            ]);
            records.push(TensorRecord {
                name: e.name.clone(),
                shape: e.shape.clone(),
                dtype: e.dtype,
                outcome,
                bytes_in: e.len,
                bytes_out: e.len,
            });
            continue;
        };
        let job = stream::Job {
            src: &src,
            out: &out,
            e,
            rows: *rows,
            cols: *cols,
            s,
            copies: copies
                .iter()
                .map(|(which, cp)| stream::CopyOut::new(*which, cp, &offset_of))
                .collect(),
            amax_offset: amax.as_ref().map(|p| offset_of[p.name.as_str()]),
            global_scale: ct,
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
        records.push(TensorRecord {
            name: e.name.clone(),
            shape: e.shape.clone(),
            dtype: e.dtype,
            outcome: Outcome::Quantized(stats),
            bytes_in: e.len,
            bytes_out: size,
        });
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
    // Said only when the selection kept something, so a run of every tensor prints as before.
    let kept = if n_kept > 0 {
        format!(
            " ({} kept in {} dtype by the selection)",
            n_kept,
            if n_kept == 1 { "its" } else { "their" }
        )
    } else {
        String::new()
    };
    table.footer.push(format!(
        "{} quantized, {n_copied} copied{kept}; tensor data {} -> {}{ratio}; \
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
    let table = files::commit_reported(out, file_len, table)?;
    Ok(Report {
        table,
        tensors: records,
        settings: *s,
    })
}

/// Renames tensor `name`'s components as compressed-tensors' `nvfp4-pack-quantized` does
/// (`X.weight` → `X.weight_packed`, `X.weight_scale`, `X.weight_global_scale`).
fn compressed_tensors_names(
    name: &str,
    cols: usize,
    copies: &mut [(Which, CopyParts)],
    amax: &mut Option<Part>,
) -> Result<(), String> {
    let Some(base) = name.strip_suffix(".weight") else {
        return Err(format!(
            "tensor {name}: --naming compressed-tensors names a Linear's X.weight; \
             --exclude this tensor"
        ));
    };
    if !cols.is_multiple_of(2) {
        return Err(format!(
            "tensor {name}: --naming compressed-tensors packs pairs of columns, and this tensor \
             has {cols}; --exclude it"
        ));
    }
    for (_, cp) in copies.iter_mut() {
        cp.data.name = format!("{base}.weight_packed");
        cp.scales.name = format!("{base}.weight_scale");
    }
    if let Some(a) = amax {
        a.name = format!("{base}.weight_global_scale");
    }
    Ok(())
}

/// Whether a dtype is a float (quantized when selected; an unsupported one is then refused).
fn is_float(dtype: Dtype) -> bool {
    !matches!(
        dtype,
        Dtype::BOOL
            | Dtype::U8
            | Dtype::I8
            | Dtype::I16
            | Dtype::U16
            | Dtype::I32
            | Dtype::U32
            | Dtype::I64
            | Dtype::U64
    )
}

/// Refuses a selected float tensor the library cannot quantize.
fn check_dtype(name: &str, dtype: Dtype) -> Result<(), String> {
    match dtype {
        Dtype::BF16 | Dtype::F16 | Dtype::F32 => Ok(()),
        // Other floats (F64, fp8, fp6, fp4, complex, future ones) would silently lose meaning
        // if narrowed, so they are refused unless the selection keeps them.
        other => Err(format!(
            "tensor {name}: unsupported dtype {other} (quantize accepts BF16, F16, F32)"
        )),
    }
}
/// A library error with the file as context; a non-finite element of a tensor that is not 2D
/// also gets its index in the original shape (the library reports matrix coordinates).
pub(crate) fn format_error(
    input: &Path,
    shape: &[usize],
    source: lowbit_formats::FormatError,
) -> Error {
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
