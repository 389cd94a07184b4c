//! End-to-end tests of the `lowbit` binary: real safetensors files in, real files out, compared
//! against `lowbit_formats` called directly on the same data.

use lowbit_dev_support::tempdir::TempDir;
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use lowbit_dev_support::rng::{XorShift64, unit24};
use lowbit_formats::layout;
use lowbit_formats::{
    Copies, Fp8Kind, Matrix, Mxfp8Config, Mxfp8Tensor, Nvfp4Config, Nvfp4Tensor, QuantPlane,
    Source, bf16, f16, quantize_mxfp8, quantize_nvfp4,
};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

const BIN: &str = env!("CARGO_BIN_EXE_lowbit");

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// A fresh directory holding `in.safetensors` with `tensors` (no metadata), and that path.
fn with_input(tag: &str, tensors: &[(&str, T)]) -> (TempDir, PathBuf) {
    let dir = TempDir::new(&format!("cli-{tag}"));
    let input = dir.path("in.safetensors");
    write_st(&input, tensors, None);
    (dir, input)
}

fn lowbit<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> Output {
    Command::new(BIN).args(args).output().expect("run lowbit")
}

fn path_args(pre: &[&str], paths: &[&Path], post: &[&str]) -> Vec<std::ffi::OsString> {
    pre.iter()
        .map(|s| s.into())
        .chain(paths.iter().map(|p| p.as_os_str().to_owned()))
        .chain(post.iter().map(|s| s.into()))
        .collect()
}

/// `flags` with `--all` for quantize: these tests pin quantizing every float tensor (the
/// behaviour before the default selection, which tests/quantize_select.rs covers).
fn all<'a>(sub: &str, flags: &[&'a str]) -> Vec<&'a str> {
    let mut f = flags.to_vec();
    if sub == "quantize" {
        f.push("--all");
    }
    f
}

/// Runs `lowbit SUB IN OUT FLAGS…`, asserting success; returns stdout.
fn run_ok(sub: &str, input: &Path, output: &Path, flags: &[&str]) -> String {
    let out = lowbit(&path_args(&[sub], &[input, output], &all(sub, flags)));
    assert!(
        out.status.success(),
        "lowbit {sub} {flags:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 stdout")
}

/// Quantizes `input` into `output` with `recipe` and `--copies copies`, and reads it back.
fn quantize_copies(
    input: &Path,
    output: &Path,
    recipe: &str,
    copies: &str,
) -> (HashMap<String, T>, HashMap<String, String>) {
    run_ok(
        "quantize",
        input,
        output,
        &["--recipe", recipe, "--copies", copies],
    );
    read_st(output)
}

/// [`run_err`] of a run that must be refused without writing `output`; its error line must
/// contain every one of `needles`.
fn refused(sub: &str, input: &Path, output: &Path, flags: &[&str], needles: &[&str]) {
    let err = run_err(sub, input, output, flags);
    for n in needles {
        assert!(err.contains(n), "expected `{n}` in: {err}");
    }
    assert!(!output.exists(), "a refused run wrote {}", output.display());
}

/// Runs `lowbit SUB IN OUT FLAGS…`, asserting exit status 1 with a single `error: ` line on stderr
/// and nothing on stdout; returns that line.
fn run_err(sub: &str, input: &Path, output: &Path, flags: &[&str]) -> String {
    let out = lowbit(&path_args(&[sub], &[input, output], &all(sub, flags)));
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(
        out.status.code(),
        Some(1),
        "expected exit 1, stderr: {stderr}"
    );
    assert!(stderr.starts_with("error: "), "stderr: {stderr}");
    assert_eq!(
        stderr.trim_end().lines().count(),
        1,
        "one line expected: {stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(
        out.stdout.is_empty(),
        "stdout on error: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    stderr
}

/// An owned tensor.
#[derive(Clone, Debug, PartialEq)]
struct T {
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

fn t(dtype: Dtype, shape: &[usize], data: Vec<u8>) -> T {
    T {
        dtype,
        shape: shape.to_vec(),
        data,
    }
}

fn write_st(path: &Path, tensors: &[(&str, T)], metadata: Option<HashMap<String, String>>) {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, t)| {
            let v = TensorView::new(t.dtype, t.shape.clone(), &t.data).expect("tensor view");
            ((*n).to_owned(), v)
        })
        .collect();
    let bytes = safetensors::serialize(views, metadata).expect("serialize");
    std::fs::write(path, bytes).expect("write input");
}

fn read_st(path: &Path) -> (HashMap<String, T>, HashMap<String, String>) {
    let buf = std::fs::read(path).expect("read output");
    let (_, header) = SafeTensors::read_metadata(&buf).expect("output header");
    let st = SafeTensors::deserialize(&buf).expect("output parses");
    let tensors = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, t(v.dtype(), v.shape(), v.data().to_vec())))
        .collect();
    (tensors, header.metadata().clone().unwrap_or_default())
}

fn names(m: &HashMap<String, T>) -> BTreeSet<String> {
    m.keys().cloned().collect()
}

fn set(items: &[String]) -> BTreeSet<String> {
    items.iter().cloned().collect()
}

/// Deterministic values whose magnitude changes every 7 elements (so blocks get different
/// scales), with some exact zeros.
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut r = XorShift64::new(seed);
    (0..n)
        .map(|i| {
            let u = unit24(r.next_u64()) * 2.0 - 1.0;
            if i % 23 == 5 {
                0.0
            } else {
                u * 2f32.powi((i / 7 % 9) as i32 - 4)
            }
        })
        .collect()
}

/// Elements in one of the three source types, decoded from file bytes.
enum Elems {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
    F16(Vec<f16>),
}

impl Elems {
    fn of(t: &T) -> Elems {
        let u16s = || {
            t.data
                .chunks_exact(2)
                .map(|c| u16::from_le_bytes([c[0], c[1]]))
        };
        match t.dtype {
            Dtype::F32 => Elems::F32(f32s(&t.data)),
            Dtype::BF16 => Elems::Bf16(u16s().map(bf16::from_bits).collect()),
            Dtype::F16 => Elems::F16(u16s().map(f16::from_bits).collect()),
            d => panic!("not a float dtype: {d}"),
        }
    }
    fn source(&self) -> Source<'_> {
        match self {
            Elems::F32(v) => Source::F32(v),
            Elems::Bf16(v) => Source::Bf16(v),
            Elems::F16(v) => Source::F16(v),
        }
    }
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn f32_tensor(shape: &[usize], seed: u64) -> T {
    let n = shape.iter().product();
    t(
        Dtype::F32,
        shape,
        values(n, seed)
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
    )
}

/// A 16-bit float tensor of `dtype`, each value's bits given by `bits`.
fn half_tensor(dtype: Dtype, shape: &[usize], seed: u64, bits: impl Fn(f32) -> u16) -> T {
    let n = shape.iter().product();
    let data = values(n, seed)
        .iter()
        .flat_map(|&v| bits(v).to_le_bytes())
        .collect();
    t(dtype, shape, data)
}

fn bf16_tensor(shape: &[usize], seed: u64) -> T {
    half_tensor(Dtype::BF16, shape, seed, |v| bf16::from_f32(v).to_bits())
}

fn f16_tensor(shape: &[usize], seed: u64) -> T {
    half_tensor(Dtype::F16, shape, seed, |v| f16::from_f32(v).to_bits())
}

fn i64_tensor(shape: &[usize]) -> T {
    let n: usize = shape.iter().product();
    let data = (0..n as i64)
        .flat_map(|v| (v * 1_000_003 - 7).to_le_bytes())
        .collect();
    t(Dtype::I64, shape, data)
}

/// `(rows, cols)` of the matrix view of a shape (scalar → 1×1, 1D → one row).
fn dims(shape: &[usize]) -> (usize, usize) {
    match shape.split_last() {
        None => (1, 1),
        Some((&n, lead)) => (lead.iter().product(), n),
    }
}

fn mx_kind(recipe: &str) -> Fp8Kind {
    match recipe {
        "mxfp8" => Fp8Kind::E4M3,
        "mxfp8-e5m2" => Fp8Kind::E5M2,
        r => panic!("not an mxfp8 recipe: {r}"),
    }
}

fn fp8_dtype(kind: Fp8Kind) -> Dtype {
    match kind {
        Fp8Kind::E4M3 => Dtype::F8_E4M3,
        Fp8Kind::E5M2 => Dtype::F8_E5M2,
    }
}

/// The library's MXFP8 result for a stored input tensor.
fn lib_mxfp8(name: &str, input: &T, kind: Fp8Kind, copies: Copies, two_d: bool) -> Mxfp8Tensor {
    let (rows, cols) = dims(&input.shape);
    let e = Elems::of(input);
    let m = Matrix::new(name, rows, cols, e.source()).expect("matrix");
    let cfg = Mxfp8Config {
        kind,
        copies,
        two_d,
        threads: 1,
        ..Mxfp8Config::default()
    };
    quantize_mxfp8(&m, &cfg).expect("library quantize")
}

/// The library's NVFP4 result for a stored input tensor.
fn lib_nvfp4(name: &str, input: &T, copies: Copies, two_d: bool) -> Nvfp4Tensor {
    let (rows, cols) = dims(&input.shape);
    let e = Elems::of(input);
    let m = Matrix::new(name, rows, cols, e.source()).expect("matrix");
    let cfg = Nvfp4Config {
        copies,
        two_d,
        threads: 1,
        ..Nvfp4Config::default()
    };
    quantize_nvfp4(&m, &cfg).expect("library quantize")
}

/// One quantized copy as the expected output lists it: (side, plane, data shape, scale shape).
type PlaneEntry<'a> = (&'a str, &'a Option<QuantPlane>, [usize; 2], [usize; 2]);

/// Inserts the data and scale tensors of each present plane, the data and scales having the
/// given pair of dtypes.
fn insert_planes(
    e: &mut HashMap<String, T>,
    name: &str,
    (data_dt, scale_dt): (Dtype, Dtype),
    planes: [PlaneEntry<'_>; 2],
) {
    for (side, plane, data_shape, scale_shape) in planes {
        if let Some(p) = plane {
            e.insert(
                format!("{name}.{side}_data"),
                t(data_dt, &data_shape, p.data.clone()),
            );
            e.insert(
                format!("{name}.{side}_scale_inv"),
                t(scale_dt, &scale_shape, p.scales.clone()),
            );
        }
    }
}

/// The compact output tensors the spec prescribes for MXFP8, from the library's result.
fn expected_mxfp8(name: &str, q: &Mxfp8Tensor) -> HashMap<String, T> {
    let (m, n) = (q.rows, q.cols);
    let mut e = HashMap::new();
    let planes = [
        ("rowwise", &q.rowwise, [m, n], [m, n.div_ceil(32)]),
        ("columnwise", &q.columnwise, [m, n], [m.div_ceil(32), n]),
    ];
    insert_planes(&mut e, name, (fp8_dtype(q.kind), Dtype::F8_E8M0), planes);
    e
}

/// The compact output tensors the spec prescribes for NVFP4, from the library's result.
fn expected_nvfp4(name: &str, q: &Nvfp4Tensor) -> HashMap<String, T> {
    let (m, n) = (q.rows, q.cols);
    let mut e = HashMap::new();
    let planes = [
        (
            "rowwise",
            &q.rowwise,
            [m, n.div_ceil(2)],
            [m, n.div_ceil(16)],
        ),
        (
            "columnwise",
            &q.columnwise,
            [n, m.div_ceil(2)],
            [n, m.div_ceil(16)],
        ),
    ];
    insert_planes(&mut e, name, (Dtype::U8, Dtype::F8_E4M3), planes);
    e.insert(
        format!("{name}.amax"),
        t(Dtype::F32, &[1], q.amax_rowwise.to_le_bytes().to_vec()),
    );
    e
}

/// What the binary should write for `inputs` (compact layout), computed with the library.
fn expected_output(
    inputs: &[(&str, T)],
    recipe: &str,
    copies: Copies,
    two_d: bool,
) -> HashMap<String, T> {
    let mut e = HashMap::new();
    for (name, input) in inputs {
        match input.dtype {
            Dtype::F32 | Dtype::BF16 | Dtype::F16 if recipe == "nvfp4" => {
                e.extend(expected_nvfp4(name, &lib_nvfp4(name, input, copies, two_d)));
            }
            Dtype::F32 | Dtype::BF16 | Dtype::F16 => {
                let q = lib_mxfp8(name, input, mx_kind(recipe), copies, two_d);
                e.extend(expected_mxfp8(name, &q));
            }
            _ => {
                e.insert((*name).to_owned(), input.clone());
            }
        }
    }
    e
}

/// Asserts that two tensor maps are equal, with a readable first difference.
fn assert_tensors_eq(got: &HashMap<String, T>, want: &HashMap<String, T>) {
    assert_eq!(names(got), names(want), "tensor names");
    for (name, w) in want {
        let g = &got[name];
        assert_eq!(
            (g.dtype, &g.shape),
            (w.dtype, &w.shape),
            "{name}: dtype and shape"
        );
        assert!(g.data == w.data, "{name}: bytes differ from the library's");
    }
}

/// A small file with odd shapes in all three float dtypes, a scalar, an empty tensor and
/// non-float tensors.
fn mixed_inputs() -> Vec<(&'static str, T)> {
    vec![
        ("layer.w3d", f32_tensor(&[3, 37, 45], 1)),
        ("layer.bias", bf16_tensor(&[100], 2)),
        ("layer.h", f16_tensor(&[40, 33], 3)),
        ("scalar", f32_tensor(&[], 4)),
        ("empty", f32_tensor(&[0, 8], 5)),
        ("step", i64_tensor(&[])),
        ("ids", i64_tensor(&[2, 3])),
        ("mask", t(Dtype::BOOL, &[5], vec![1, 0, 1, 1, 0])),
        ("bytes", t(Dtype::U8, &[3], vec![7, 8, 9])),
    ]
}

// ---------------------------------------------------------------------------------------------
// Output layout and bit-exactness
// ---------------------------------------------------------------------------------------------

#[test]
fn mxfp8_output_matches_library_bit_for_bit() {
    let inputs = mixed_inputs();
    let (dir, input) = with_input("mxfp8", &inputs);
    for recipe in ["mxfp8", "mxfp8-e5m2"] {
        let out = dir.path(&format!("out.{recipe}.safetensors"));
        let stdout = run_ok("quantize", &input, &out, &["--recipe", recipe]);
        let (got, meta) = read_st(&out);
        assert_tensors_eq(&got, &expected_output(&inputs, recipe, Copies::Both, false));
        // Spot-check the spec's shapes literally for the odd 3D tensor.
        let w = |s: &str| &got[&format!("layer.w3d.{s}")];
        assert_eq!(w("rowwise_data").shape, [111, 45]);
        assert_eq!(w("rowwise_scale_inv").shape, [111, 2]);
        assert_eq!(w("columnwise_data").shape, [111, 45]);
        assert_eq!(w("columnwise_scale_inv").shape, [4, 45]);
        assert_eq!(got["layer.bias.rowwise_data"].shape, [1, 100]);
        assert_eq!(got["scalar.rowwise_data"].shape, [1, 1]);
        assert_eq!(got["empty.columnwise_scale_inv"].shape, [0, 8]);
        assert_eq!(meta["lowbit.recipe"], recipe);
        assert_eq!(meta["lowbit.format_version"], "1");
        assert_eq!(meta["lowbit.copies"], "both");
        assert_eq!(meta["lowbit.scale_layout"], "compact");
        assert_eq!(
            meta["lowbit.tensor.layer.w3d"],
            r#"{"dtype":"F32","shape":[3,37,45]}"#
        );
        assert_eq!(
            meta["lowbit.tensor.scalar"],
            r#"{"dtype":"F32","shape":[]}"#
        );
        assert!(!meta.contains_key("lowbit.tensor.step"));
        for name in [
            "layer.w3d",
            "layer.bias",
            "layer.h",
            "step",
            "SQNR dB",
            "bytes out",
        ] {
            assert!(stdout.contains(name), "report lacks {name}:\n{stdout}");
        }
    }
    assert_eq!(
        dir.entries(),
        [
            "in.safetensors",
            "out.mxfp8-e5m2.safetensors",
            "out.mxfp8.safetensors"
        ],
        "no temporary files left"
    );
}

#[test]
fn nvfp4_output_matches_library_bit_for_bit() {
    let inputs = mixed_inputs();
    let (dir, input) = with_input("nvfp4", &inputs);
    let out = dir.path("out.safetensors");
    run_ok("quantize", &input, &out, &["--recipe", "nvfp4"]);
    let (got, meta) = read_st(&out);
    assert_tensors_eq(
        &got,
        &expected_output(&inputs, "nvfp4", Copies::Both, false),
    );
    let w = |s: &str| &got[&format!("layer.w3d.{s}")];
    assert_eq!(w("rowwise_data").shape, [111, 23]);
    assert_eq!(w("rowwise_scale_inv").shape, [111, 3]);
    assert_eq!(w("columnwise_data").shape, [45, 56]);
    assert_eq!(w("columnwise_scale_inv").shape, [45, 7]);
    assert_eq!(w("amax").shape, [1]);
    assert_eq!(got["empty.columnwise_data"].shape, [8, 0]);
    assert_eq!(meta["lowbit.recipe"], "nvfp4");
}

#[test]
fn two_d_scaling_matches_library() {
    let dir = TempDir::new("cli-2d");
    let inputs = vec![
        ("w", f32_tensor(&[70, 45], 9)),
        ("v", bf16_tensor(&[33], 10)),
    ];
    let input = dir.path("in.safetensors");
    write_st(&input, &inputs, None);
    for recipe in ["mxfp8", "nvfp4"] {
        let out = dir.path(&format!("{recipe}.safetensors"));
        run_ok("quantize", &input, &out, &["--recipe", recipe, "--2d"]);
        let (got, meta) = read_st(&out);
        assert_tensors_eq(&got, &expected_output(&inputs, recipe, Copies::Both, true));
        assert_eq!(meta["lowbit.2d"], "true");
    }
}

#[test]
fn thread_count_does_not_change_the_bytes() {
    let (dir, input) = with_input("threads", &[("w", f32_tensor(&[200, 64], 11))]);
    for recipe in ["mxfp8", "nvfp4"] {
        let (a, b) = (dir.path("a"), dir.path("b"));
        run_ok(
            "quantize",
            &input,
            &a,
            &["--recipe", recipe, "--threads", "1", "--force"],
        );
        run_ok(
            "quantize",
            &input,
            &b,
            &["--recipe", recipe, "--threads", "4", "--force"],
        );
        assert!(
            std::fs::read(&a).unwrap() == std::fs::read(&b).unwrap(),
            "{recipe}"
        );
    }
}

#[test]
fn rowwise_only_omits_columnwise_tensors() {
    let dir = TempDir::new("cli-rowwise");
    let inputs = vec![
        ("w", f32_tensor(&[3, 37, 45], 12)),
        ("b", f16_tensor(&[100], 13)),
    ];
    let input = dir.path("in.safetensors");
    write_st(&input, &inputs, None);
    for recipe in ["mxfp8", "mxfp8-e5m2", "nvfp4"] {
        let out = dir.path(&format!("{recipe}.safetensors"));
        let (got, meta) = quantize_copies(&input, &out, recipe, "rowwise");
        let mut want: Vec<String> = Vec::new();
        for n in ["w", "b"] {
            want.push(format!("{n}.rowwise_data"));
            want.push(format!("{n}.rowwise_scale_inv"));
            if recipe == "nvfp4" {
                want.push(format!("{n}.amax"));
            }
        }
        assert_eq!(names(&got), set(&want), "{recipe}");
        assert_tensors_eq(
            &got,
            &expected_output(&inputs, recipe, Copies::Rowwise, false),
        );
        assert_eq!(meta["lowbit.copies"], "rowwise");
    }
}

#[test]
fn columnwise_only_round_trips_through_the_columnwise_copy() {
    let w = f32_tensor(&[3, 37, 45], 14);
    let (dir, input) = with_input("colwise", &[("w", w.clone())]);
    for recipe in ["mxfp8", "nvfp4"] {
        let q = dir.path(&format!("{recipe}.q"));
        let d = dir.path(&format!("{recipe}.d"));
        let (got, _) = quantize_copies(&input, &q, recipe, "columnwise");
        assert!(
            got.keys().all(|n| !n.contains("rowwise")),
            "{:?}",
            names(&got)
        );
        run_ok("dequantize", &q, &d, &[]);
        let (back, _) = read_st(&d);
        let want = if recipe == "nvfp4" {
            lib_nvfp4("w", &w, Copies::Columnwise, false).dequantize_columnwise()
        } else {
            lib_mxfp8("w", &w, Fp8Kind::E4M3, Copies::Columnwise, false).dequantize_columnwise()
        };
        let want: Vec<u8> = want.unwrap().iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(back["w"].shape, [3, 37, 45]);
        assert!(
            back["w"].data == want,
            "{recipe}: columnwise dequantization differs"
        );
    }
}

#[test]
fn swizzled_scales_are_zero_padded_and_unswizzle_to_the_compact_bytes() {
    let dir = TempDir::new("cli-swizzle");
    // 150 rows: two 128-row tiles; 70 columns: 3 MXFP8 / 5 NVFP4 blocks, neither a multiple of 4.
    let inputs = vec![
        ("w", f32_tensor(&[150, 70], 15)),
        ("v", bf16_tensor(&[2, 3, 33], 16)),
    ];
    let input = dir.path("in.safetensors");
    write_st(&input, &inputs, None);
    for recipe in ["mxfp8", "mxfp8-e5m2", "nvfp4"] {
        let c = dir.path(&format!("{recipe}.compact"));
        let s = dir.path(&format!("{recipe}.swizzled"));
        run_ok("quantize", &input, &c, &["--recipe", recipe]);
        run_ok(
            "quantize",
            &input,
            &s,
            &["--recipe", recipe, "--scale-layout", "swizzled"],
        );
        let (compact, _) = read_st(&c);
        let (swz, meta) = read_st(&s);
        assert_eq!(meta["lowbit.scale_layout"], "swizzled");
        assert_eq!(names(&compact), names(&swz));
        for (name, input) in &inputs {
            let (m, n) = dims(&input.shape);
            let nvfp4 = recipe == "nvfp4";
            let block = if nvfp4 { 16 } else { 32 };
            let up = |x: usize, k: usize| x.div_ceil(k) * k;
            // (compact rows, compact cols, expected stored shape) per scale tensor.
            let row = (
                m,
                n.div_ceil(block),
                vec![up(m, 128), up(n.div_ceil(block), 4)],
            );
            let col = if nvfp4 {
                let b = m.div_ceil(16);
                (n, b, vec![up(n, 128), up(b, 4)])
            } else {
                let b = m.div_ceil(32);
                (b, n, vec![up(b, 4), up(n, 128)])
            };
            for (suffix, (r, k, shape)) in
                [("rowwise_scale_inv", row), ("columnwise_scale_inv", col)]
            {
                let key = format!("{name}.{suffix}");
                let (cs, ss) = (&compact[&key], &swz[&key]);
                assert_eq!(ss.shape, shape, "{recipe} {key}: swizzled shape");
                assert_eq!(ss.dtype, cs.dtype, "{recipe} {key}");
                assert_eq!(cs.data.len(), r * k);
                let mx_col = !nvfp4 && suffix.starts_with("columnwise");
                let unswizzled = if mx_col {
                    layout::unswizzle_mxfp8_columnwise(&ss.data, r, k)
                } else {
                    layout::unswizzle(&ss.data, r, k)
                };
                assert!(
                    unswizzled == cs.data,
                    "{recipe} {key}: unswizzle != compact"
                );
                // Every byte that no scale maps to is padding and must be zero. MXFP8
                // columnwise scales are swizzled as their [cols, row blocks] transpose.
                let (sr, sk) = if mx_col { (k, r) } else { (r, k) };
                let mut used = vec![false; ss.data.len()];
                for i in 0..sr {
                    for j in 0..sk {
                        used[layout::swizzle_offset(i, j, sk)] = true;
                    }
                }
                let padding = used.iter().filter(|u| !**u).count();
                assert!(
                    padding > 0,
                    "{recipe} {key}: test shape should need padding"
                );
                for (b, u) in ss.data.iter().zip(&used) {
                    assert!(*u || *b == 0, "{recipe} {key}: non-zero padding byte");
                }
                assert!(
                    cs.data.iter().any(|b| *b != 0),
                    "{recipe} {key}: scales all zero"
                );
            }
            for suffix in ["rowwise_data", "columnwise_data"] {
                let key = format!("{name}.{suffix}");
                assert!(
                    compact[&key] == swz[&key],
                    "{recipe} {key}: data must not change"
                );
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Dequantize
// ---------------------------------------------------------------------------------------------

/// The library's dequantized values of an input tensor under a recipe (rowwise copy).
fn lib_dequantized(name: &str, input: &T, recipe: &str) -> Vec<f32> {
    if recipe == "nvfp4" {
        lib_nvfp4(name, input, Copies::Both, false).dequantize()
    } else {
        lib_mxfp8(name, input, mx_kind(recipe), Copies::Both, false).dequantize()
    }
}

fn encode_as(values: &[f32], dtype: Dtype) -> Vec<u8> {
    match dtype {
        Dtype::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        Dtype::BF16 => values
            .iter()
            .flat_map(|&v| bf16::from_f32(v).to_bits().to_le_bytes())
            .collect(),
        Dtype::F16 => values
            .iter()
            .flat_map(|&v| f16::from_f32(v).to_bits().to_le_bytes())
            .collect(),
        d => panic!("{d}"),
    }
}

#[test]
fn dequantize_restores_names_shapes_dtypes_and_library_values() {
    let dir = TempDir::new("cli-dequant");
    let inputs = mixed_inputs();
    let input = dir.path("in.safetensors");
    let user_meta = HashMap::from([("format".to_owned(), "pt".to_owned())]);
    write_st(&input, &inputs, Some(user_meta));
    for recipe in ["mxfp8", "mxfp8-e5m2", "nvfp4"] {
        let q = dir.path(&format!("{recipe}.q"));
        run_ok("quantize", &input, &q, &["--recipe", recipe]);
        assert_eq!(read_st(&q).1["format"], "pt", "input metadata kept");
        for (flag, forced) in [
            (None, None),
            (Some("f32"), Some(Dtype::F32)),
            (Some("bf16"), Some(Dtype::BF16)),
        ] {
            let d = dir.path(&format!("{recipe}.{}.d", flag.unwrap_or("orig")));
            let flags: Vec<&str> = flag.map(|f| vec!["--dtype", f]).unwrap_or_default();
            let stdout = run_ok("dequantize", &q, &d, &flags);
            assert!(stdout.contains("layer.w3d"), "{stdout}");
            let (got, meta) = read_st(&d);
            assert_eq!(
                names(&got),
                inputs
                    .iter()
                    .map(|(n, _)| (*n).to_owned())
                    .collect::<BTreeSet<_>>()
            );
            assert_eq!(meta.get("format").map(String::as_str), Some("pt"));
            assert!(meta.keys().all(|k| !k.starts_with("lowbit.")), "{meta:?}");
            for (name, orig) in &inputs {
                let g = &got[*name];
                assert_eq!(g.shape, orig.shape, "{recipe} {name}: shape");
                if matches!(orig.dtype, Dtype::F32 | Dtype::BF16 | Dtype::F16) {
                    let dtype = forced.unwrap_or(orig.dtype);
                    assert_eq!(g.dtype, dtype, "{recipe} {name}: dtype");
                    let want = encode_as(&lib_dequantized(name, orig, recipe), dtype);
                    assert!(g.data == want, "{recipe} {name} ({flag:?}): values differ");
                } else {
                    assert_eq!(g, orig, "{recipe} {name}: pass-through");
                }
            }
        }
    }
}

#[test]
fn dequantize_of_swizzled_equals_dequantize_of_compact() {
    let dir = TempDir::new("cli-dequant-swz");
    let input = dir.path("in.safetensors");
    write_st(
        &input,
        &[("w", f32_tensor(&[150, 70], 17)), ("s", i64_tensor(&[4]))],
        None,
    );
    for recipe in ["mxfp8", "nvfp4"] {
        for copies in ["both", "columnwise"] {
            let tag = format!("{recipe}-{copies}");
            let (qc, qs) = (
                dir.path(&format!("{tag}.qc")),
                dir.path(&format!("{tag}.qs")),
            );
            let (dc, ds) = (
                dir.path(&format!("{tag}.dc")),
                dir.path(&format!("{tag}.ds")),
            );
            let base = ["--recipe", recipe, "--copies", copies];
            run_ok("quantize", &input, &qc, &base);
            run_ok(
                "quantize",
                &input,
                &qs,
                &[&base[..], &["--scale-layout", "swizzled"]].concat(),
            );
            run_ok("dequantize", &qc, &dc, &[]);
            run_ok("dequantize", &qs, &ds, &[]);
            assert_eq!(read_st(&dc).0, read_st(&ds).0, "{tag}");
        }
    }
}

#[test]
fn passthrough_tensors_are_copied_unchanged() {
    let dir = TempDir::new("cli-passthrough");
    let step = i64_tensor(&[]);
    let ids = i64_tensor(&[3, 5]);
    let input = dir.path("in.safetensors");
    write_st(
        &input,
        &[
            ("step", step.clone()),
            ("ids", ids.clone()),
            ("w", f32_tensor(&[4, 4], 18)),
        ],
        None,
    );
    let (q, d) = (dir.path("q"), dir.path("d"));
    let stdout = run_ok("quantize", &input, &q, &["--recipe", "nvfp4"]);
    assert!(stdout.contains("I64 (copied)"), "{stdout}");
    let (got, _) = read_st(&q);
    assert_eq!(got["step"], step);
    assert_eq!(got["ids"], ids);
    run_ok("dequantize", &q, &d, &[]);
    let (back, _) = read_st(&d);
    assert_eq!(back["step"], step);
    assert_eq!(back["ids"], ids);
}

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

#[test]
fn missing_input_is_a_clean_error() {
    let dir = TempDir::new("cli-missing");
    let (input, out) = (dir.path("nope.safetensors"), dir.path("out.safetensors"));
    let err = run_err("quantize", &input, &out, &[]);
    assert!(err.contains("nope.safetensors"), "{err}");
    let err = run_err("dequantize", &input, &out, &[]);
    assert!(err.contains("nope.safetensors"), "{err}");
    assert!(dir.entries().is_empty(), "{:?}", dir.entries());
}

#[test]
fn corrupt_and_truncated_inputs_are_clean_errors() {
    let dir = TempDir::new("cli-corrupt");
    let out = dir.path("out.safetensors");
    let random = dir.path("random.safetensors");
    let mut r = XorShift64::from_state(0x1234_5678_9ABC_DEF0);
    let bytes: Vec<u8> = (0..4096).map(|_| r.next_u64() as u8).collect();
    std::fs::write(&random, bytes).unwrap();
    let good = dir.path("good.safetensors");
    write_st(&good, &[("w", f32_tensor(&[8, 64], 19))], None);
    let full = std::fs::read(&good).unwrap();
    let truncated = dir.path("truncated.safetensors");
    std::fs::write(&truncated, &full[..full.len() - 100]).unwrap();
    let header_cut = dir.path("header-cut.safetensors");
    std::fs::write(&header_cut, &full[..20]).unwrap();
    let empty = dir.path("empty.safetensors");
    std::fs::write(&empty, b"").unwrap();
    for bad in [&random, &truncated, &header_cut, &empty] {
        for sub in ["quantize", "dequantize"] {
            refused(sub, bad, &out, &[], &["not a valid safetensors file"]);
        }
    }
    assert!(
        dir.entries().iter().all(|e| !e.contains(".tmp-")),
        "{:?}",
        dir.entries()
    );
}

#[test]
fn f64_tensor_is_refused_with_the_tensor_named() {
    let dir = TempDir::new("cli-f64");
    let input = dir.path("in.safetensors");
    let f64s: Vec<u8> = [1.0f64, 2.0, 3.0]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    write_st(
        &input,
        &[
            ("w", f32_tensor(&[4, 4], 20)),
            ("x", t(Dtype::F64, &[3], f64s)),
        ],
        None,
    );
    let out = dir.path("out.safetensors");
    let why = "tensor x: unsupported dtype F64 (quantize accepts BF16, F16, F32)";
    refused("quantize", &input, &out, &[], &[why]);
}

#[test]
fn existing_output_needs_force_and_stays_untouched_without_it() {
    let (dir, input) = with_input("force", &[("w", f32_tensor(&[4, 40], 21))]);
    let out = dir.path("out.safetensors");
    std::fs::write(&out, b"keep me").unwrap();
    let err = run_err("quantize", &input, &out, &[]);
    assert!(
        err.contains("already exists") && err.contains("--force"),
        "{err}"
    );
    assert_eq!(std::fs::read(&out).unwrap(), b"keep me");
    run_ok("quantize", &input, &out, &["--force"]);
    assert!(read_st(&out).0.contains_key("w.rowwise_data"));
    // Same rule for dequantize.
    let d = dir.path("d.safetensors");
    std::fs::write(&d, b"keep me too").unwrap();
    run_err("dequantize", &out, &d, &[]);
    assert_eq!(std::fs::read(&d).unwrap(), b"keep me too");
    run_ok("dequantize", &out, &d, &["--force"]);
    assert_eq!(
        dir.entries(),
        ["d.safetensors", "in.safetensors", "out.safetensors"]
    );
}

#[test]
fn output_equal_to_input_is_refused_even_with_force() {
    let (dir, input) = with_input("same", &[("w", f32_tensor(&[4, 40], 22))]);
    let before = std::fs::read(&input).unwrap();
    // Spelled differently, still the same file.
    let alias = dir.dir().join(".").join("in.safetensors");
    let err = run_err("quantize", &input, &alias, &["--force"]);
    assert!(err.contains("is the input path"), "{err}");
    assert_eq!(std::fs::read(&input).unwrap(), before);
}

#[test]
fn nan_with_error_policy_names_tensor_and_index_and_leaves_no_file() {
    let dir = TempDir::new("cli-nan");
    let input = dir.path("in.safetensors");
    let mut v = values(4 * 8, 23);
    v[2 * 8 + 5] = f32::NAN;
    let w = t(
        Dtype::F32,
        &[4, 8],
        v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    );
    write_st(
        &input,
        &[("a_fine", f32_tensor(&[4, 8], 24)), ("w", w)],
        None,
    );
    let out = dir.path("out.safetensors");
    for recipe in ["mxfp8", "nvfp4"] {
        let err = run_err(
            "quantize",
            &input,
            &out,
            &["--recipe", recipe, "--nan-policy", "error"],
        );
        assert!(
            err.contains("`w`") && err.contains("[2, 5]") && err.contains("NaN"),
            "{err}"
        );
        assert_eq!(
            dir.entries(),
            ["in.safetensors"],
            "no output or temporary file"
        );
    }
    // The default (TE) policy accepts it.
    run_ok("quantize", &input, &out, &[]);
    // Beyond 2D the message also gives the index in the original shape.
    let mut v = values(2 * 3 * 10, 27);
    v[47] = f32::NEG_INFINITY;
    let x = t(
        Dtype::F32,
        &[2, 3, 10],
        v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    );
    let input3 = dir.path("in3.safetensors");
    write_st(&input3, &[("blk.x", x)], None);
    let out3 = dir.path("out3.safetensors");
    let flags = ["--nan-policy", "error"];
    refused(
        "quantize",
        &input3,
        &out3,
        &flags,
        &["`blk.x`", "[1, 1, 7]", "inf"],
    );
}

#[test]
fn failed_rename_removes_the_temporary_file() {
    let (dir, input) = with_input("rename", &[("w", f32_tensor(&[4, 40], 28))]);
    // A non-empty directory cannot be replaced by a file, so the final rename fails.
    let out = dir.path("out.safetensors");
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("inside"), b"x").unwrap();
    run_err("quantize", &input, &out, &["--force"]);
    assert_eq!(dir.entries(), ["in.safetensors", "out.safetensors"]);
    assert_eq!(std::fs::read(out.join("inside")).unwrap(), b"x");
}

#[test]
fn dequantize_rejects_files_without_lowbit_metadata() {
    let dir = TempDir::new("cli-not-lowbit");
    let input = dir.path("plain.safetensors");
    write_st(&input, &[("w", f32_tensor(&[4, 4], 25))], None);
    let out = dir.path("out.safetensors");
    refused(
        "dequantize",
        &input,
        &out,
        &[],
        &["not a lowbit-quantized file"],
    );
}

#[test]
fn dequantize_reports_a_missing_component() {
    let (dir, input) = with_input("missing-part", &[("w", f32_tensor(&[4, 40], 26))]);
    let q = dir.path("q.safetensors");
    run_ok("quantize", &input, &q, &[]);
    let (tensors, meta) = read_st(&q);
    let kept: Vec<(&str, T)> = tensors
        .iter()
        .filter(|(n, _)| n.as_str() != "w.rowwise_scale_inv")
        .map(|(n, t)| (n.as_str(), t.clone()))
        .collect();
    let broken = dir.path("broken.safetensors");
    write_st(&broken, &kept, Some(meta));
    let out = dir.path("out.safetensors");
    refused(
        "dequantize",
        &broken,
        &out,
        &[],
        &["w.rowwise_scale_inv", "missing"],
    );
}

// ---------------------------------------------------------------------------------------------
// Command line surface and demo
// ---------------------------------------------------------------------------------------------

#[test]
fn help_texts_and_usage_errors() {
    let out = lowbit(&["--help"]);
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(
        help.contains("quantize") && help.contains("dequantize"),
        "{help}"
    );
    let out = lowbit(&["quantize", "--help"]);
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--recipe",
        "--copies",
        "--2d",
        "--scale-layout",
        "--nan-policy",
        "--threads",
        "--force",
        "--demo",
        "mxfp8-e5m2",
    ] {
        assert!(help.contains(flag), "quantize help lacks {flag}");
    }
    let out = lowbit(&["dequantize", "--help"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("--dtype"));
    // Usage errors keep clap's exit status 2.
    assert_eq!(lowbit(&["quantize"]).status.code(), Some(2));
    assert_eq!(
        lowbit(&["quantize", "a", "b", "--recipe", "fp3"])
            .status
            .code(),
        Some(2)
    );
    assert_eq!(lowbit(&["frobnicate"]).status.code(), Some(2));
    assert_eq!(
        lowbit(&["quantize", "a", "b", "--threads", "5000"])
            .status
            .code(),
        Some(2)
    );
}

#[test]
fn train_help_is_true_and_every_flag_has_a_line() {
    let out = lowbit(&["train", "--help"]);
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    // Both were false: hybrid sharding runs, and bf16 / none main parameters are built.
    for stale in ["not wired", "only fp32 is built", "(not built)"] {
        assert!(
            !help.contains(stale),
            "train help still says {stale:?}:\n{help}"
        );
    }
    let lines: Vec<&str> = help.lines().collect();
    let mut flags = 0;
    for (i, line) in lines.iter().enumerate() {
        let t = line.trim_start();
        if !(t.starts_with("--") || (t.starts_with('-') && t.len() > 1 && !t.starts_with("- "))) {
            continue;
        }
        flags += 1;
        // Long help: the flag on its own line, its help on the next, indented further.
        let next = lines.get(i + 1).map_or("", |l| l.trim());
        assert!(
            !next.is_empty() && !next.starts_with('-'),
            "{t} has no help line:\n{help}"
        );
    }
    assert!(flags > 30, "{flags} flags in:\n{help}");
    // Every value list keeps its names (the library's enums, under the spellings of old).
    for value in [
        "no_shard",
        "optim_grads_params",
        "match_rms_adamw",
        "spectral",
        "compute",
        "auto",
        "grad",
        "param",
        "nvfp4",
    ] {
        assert!(help.contains(value), "train help lacks {value}");
    }
}

#[test]
fn train_refusals_name_the_flag() {
    for (args, flag) in [
        (&["--lr", "inf"][..], "--lr"),
        (&["--lr=0"][..], "--lr"),
        (&["--lr=-1"][..], "--lr"),
        (&["--ranks", "0"][..], "--ranks"),
        (&["--outer-dp", "3"][..], "--outer-dp"),
    ] {
        let out = lowbit(&[&["train"][..], args].concat());
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains(flag), "{args:?} does not name {flag}: {err}");
    }
}

#[test]
fn demo_writes_quantizes_and_dequantizes_its_example() {
    let dir = TempDir::new("cli-demo");
    let target = dir.path("target");
    for (recipe, flags) in [("mxfp8", vec![]), ("nvfp4", vec!["--recipe", "nvfp4"])] {
        let out = Command::new(BIN)
            .args([&["quantize", "--demo"][..], &flags].concat())
            .env("CARGO_TARGET_DIR", &target)
            .current_dir(dir.dir())
            .output()
            .expect("run demo");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let demo = target.join("lowbit-demo");
        let q = demo.join(format!("example.{recipe}.safetensors"));
        let d = demo.join(format!("example.{recipe}.dequantized.safetensors"));
        assert!(
            stdout.contains("dequantized") && stdout.contains(&*d.to_string_lossy()),
            "{stdout}"
        );
        let (example, _) = read_st(&demo.join("example.safetensors"));
        assert!(example.len() >= 5);
        assert_eq!(example["step"].dtype, Dtype::I64);
        let (quantized, meta) = read_st(&q);
        assert_eq!(meta["lowbit.recipe"], recipe);
        assert!(quantized.contains_key("model.layers.0.mlp.weight.rowwise_data"));
        assert_eq!(quantized["step"], example["step"]);
        let (back, _) = read_st(&d);
        assert_eq!(names(&back), names(&example));
        for (n, e) in &example {
            assert_eq!((back[n].dtype, &back[n].shape), (e.dtype, &e.shape), "{n}");
        }
    }
    let mut files: Vec<String> = std::fs::read_dir(target.join("lowbit-demo"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert_eq!(
        files,
        [
            "example.mxfp8.dequantized.safetensors",
            "example.mxfp8.safetensors",
            "example.nvfp4.dequantized.safetensors",
            "example.nvfp4.safetensors",
            "example.safetensors",
        ],
        "demo files only, no temporary files"
    );
}
