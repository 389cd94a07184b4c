//! `quantize::run_report` as a downstream project calls it: the default selection (GEMM weights
//! only), `--include`/`--exclude`/`--all` through [`Select`], kept tensors copied bit for bit,
//! and column-chunked (1-D and wide) tensors byte-identical to the library's whole-tensor
//! quantization, through `dequantize` too.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use lowbit_formats::{
    Copies, Matrix, Mxfp8Config, NanPolicy, Nvfp4Config, ScaleLayout, Source, layout,
    quantize_mxfp8, quantize_nvfp4,
};
use lowbit_io::files::{self, OutTensor};
use lowbit_io::quantize::{self, Options, Outcome};
use lowbit_io::schema::{Naming, Recipe, Settings};
use lowbit_io::select::{Glob, Keep, Select};
use safetensors::{Dtype, SafeTensors};

/// A fresh directory under the system temporary directory (removed on drop).
struct Dir(PathBuf);

impl Dir {
    fn new(tag: &str) -> Self {
        let p = std::env::temp_dir().join(format!("lowbit-io-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Dir(p)
    }
    fn path(&self, f: &str) -> PathBuf {
        self.0.join(f)
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn bf16s(n: usize, seed: u32) -> Vec<u8> {
    (0..n)
        .flat_map(|i| {
            let v = ((i as f32 + seed as f32) * 0.37).sin() * 3.0;
            half::bf16::from_f32(v).to_bits().to_le_bytes()
        })
        .collect()
}

fn write(path: &Path, tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) {
    let t = tensors
        .iter()
        .map(|(n, d, s, b)| ((*n).to_owned(), OutTensor::owned(*d, s.clone(), b.clone())))
        .collect();
    let bytes = files::serialize(path, t, HashMap::new()).unwrap();
    std::fs::write(path, bytes).unwrap();
}

fn opts(recipe: Recipe, layout: ScaleLayout, select: Select) -> Options {
    Options {
        settings: Settings {
            recipe,
            copies: Copies::Both,
            two_d: false,
            layout,
            nan_policy: NanPolicy::Te,
        },
        threads: 2,
        only: None,
        select,
        naming: Naming::Lowbit,
    }
}

fn model() -> Vec<(&'static str, Dtype, Vec<usize>, Vec<u8>)> {
    vec![
        (
            "model.embed_tokens.weight",
            Dtype::BF16,
            vec![8, 64],
            bf16s(512, 1),
        ),
        (
            "model.layers.0.input_layernorm.weight",
            Dtype::BF16,
            vec![64],
            bf16s(64, 2),
        ),
        (
            "model.layers.0.self_attn.q_proj.weight",
            Dtype::BF16,
            vec![64, 64],
            bf16s(4096, 3),
        ),
        (
            "model.layers.0.mlp.down_proj.weight",
            Dtype::BF16,
            vec![64, 96],
            bf16s(6144, 4),
        ),
        (
            "model.layers.0.mlp.up_proj.bias",
            Dtype::BF16,
            vec![2, 96],
            bf16s(192, 5),
        ),
        ("lm_head.weight", Dtype::BF16, vec![8, 64], bf16s(512, 6)),
        // Empty: quantized into empty components.
        (
            "model.layers.0.mlp.gate_proj.weight",
            Dtype::BF16,
            vec![0, 64],
            Vec::new(),
        ),
        ("step", Dtype::I64, vec![1], 7i64.to_le_bytes().to_vec()),
    ]
}

/// Runs a selection over [`model`]; returns each tensor's outcome as `q` (quantized), the
/// keep reason, or `copied`, and checks that every kept tensor is its input's bytes.
fn outcomes(tag: &str, select: Select) -> Vec<(String, String)> {
    let d = Dir::new(tag);
    let (i, o) = (d.path("in.safetensors"), d.path("out.safetensors"));
    let tensors = model();
    write(&i, &tensors);
    let r = quantize::run_report(
        &i,
        &o,
        &opts(Recipe::Mxfp8, ScaleLayout::Compact, select),
        false,
    )
    .unwrap();
    let bytes = std::fs::read(&o).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut out = Vec::new();
    assert_eq!(r.tensors.len(), tensors.len());
    for (name, dtype, shape, data) in &tensors {
        let rec = r.tensors.iter().find(|t| t.name == *name).unwrap();
        let what = match &rec.outcome {
            Outcome::Quantized(_) => {
                assert!(st.tensor(name).is_err(), "{name} stored whole");
                let q = st.tensor(&format!("{name}.rowwise_data")).unwrap();
                assert_eq!(q.dtype(), Dtype::F8_E4M3);
                "q".to_owned()
            }
            kept => {
                let t = st.tensor(name).unwrap();
                assert_eq!(
                    (t.dtype(), t.shape(), t.data()),
                    (*dtype, &shape[..], &data[..])
                );
                match kept {
                    Outcome::Kept(k) => k.to_string(),
                    _ => "copied".to_owned(),
                }
            }
        };
        out.push((name.to_string(), what));
    }
    // The JSON report says the same.
    let j = r.to_json().to_text();
    for (name, what) in &out {
        let action = match what.as_str() {
            "q" => "quantized",
            "copied" => "copied",
            _ => "kept",
        };
        let needle = format!("\"name\": \"{name}\",\n");
        let at = j.find(&needle).unwrap_or_else(|| panic!("{name} in {j}"));
        assert!(
            j[at..].contains(&format!("\"action\": \"{action}\"")),
            "{j}"
        );
    }
    out
}

fn g(p: &str) -> Glob {
    Glob::new(p).unwrap()
}

#[test]
fn default_selection_keeps_norms_embeddings_biases_head_and_1d() {
    let got = outcomes("default", Select::default());
    let want = [
        "embedding",
        "1-D",
        "q",
        "q",
        "bias",
        "output head",
        "q",
        "copied",
    ];
    assert_eq!(
        got.iter().map(|(_, w)| w.as_str()).collect::<Vec<_>>(),
        want
    );
}

#[test]
fn include_exclude_and_all() {
    let names = |v: Vec<(String, String)>| -> Vec<String> {
        v.into_iter()
            .filter(|(_, w)| w == "q")
            .map(|(n, _)| n)
            .collect()
    };
    // --all: every float tensor (the behaviour before filters).
    let all = names(outcomes("all", Select::all()));
    assert_eq!(all.len(), 7);
    // --include: exactly the matches, 1-D and embedding included when named.
    let inc = Select {
        include: vec![g("*.mlp.*"), g("*layernorm*")],
        ..Select::default()
    };
    assert_eq!(
        names(outcomes("inc", inc)),
        [
            "model.layers.0.input_layernorm.weight",
            "model.layers.0.mlp.down_proj.weight",
            "model.layers.0.mlp.up_proj.bias",
            "model.layers.0.mlp.gate_proj.weight"
        ]
    );
    // --exclude wins over --all.
    let exc = Select {
        all: true,
        exclude: vec![g("*_proj.*")],
        ..Select::default()
    };
    let got = outcomes("exc", exc);
    assert_eq!(got[2].1, "--exclude *_proj.*");
    assert_eq!(
        names(got),
        [
            "model.embed_tokens.weight",
            "model.layers.0.input_layernorm.weight",
            "lm_head.weight"
        ]
    );
    // A tensor matching no include is kept, naming why.
    let none = Select {
        include: vec![g("nothing")],
        ..Select::default()
    };
    assert!(
        outcomes("none", none)[..7]
            .iter()
            .all(|(_, w)| *w == Keep::NotIncluded.to_string())
    );
}

/// A `[1, n]` tensor (column chunks) quantized through the file equals the library's whole
/// tensor, component by component, in both recipes and scale layouts; dequantize (column
/// chunks too) gives the library's values.
#[test]
fn one_dimensional_tensor_in_column_chunks_is_the_whole_tensors_bytes() {
    // Past the 4 Mi column-chunk threshold, not a multiple of 128 (a partial last block).
    let n = (4 << 20) + 1000 + 37;
    let mut vals: Vec<f32> = (0..n)
        .map(|i| ((i as f32) * 0.011).sin() * 10f32.powi((i % 5) as i32 - 2))
        .collect();
    vals[12_345] = f32::NAN;
    vals[n - 3] = f32::INFINITY;
    let bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
    let d = Dir::new("wide");
    let i = d.path("in.safetensors");
    write(&i, &[("w", Dtype::F32, vec![n], bytes)]);
    let m = Matrix::new("w", 1, n, Source::F32(&vals)).unwrap();
    for recipe in [Recipe::Mxfp8, Recipe::Nvfp4] {
        let (planes, xhat) = match recipe {
            Recipe::Nvfp4 => {
                let t = quantize_nvfp4(&m, &Nvfp4Config::default()).unwrap();
                let amax = t.amax_rowwise;
                (
                    vec![t.rowwise.clone().unwrap(), t.columnwise.clone().unwrap()],
                    (t.dequantize(), Some(amax)),
                )
            }
            _ => {
                let t = quantize_mxfp8(&m, &Mxfp8Config::default()).unwrap();
                (
                    vec![t.rowwise.clone().unwrap(), t.columnwise.clone().unwrap()],
                    (t.dequantize(), None),
                )
            }
        };
        for lay in [ScaleLayout::Compact, ScaleLayout::Swizzled] {
            let o = d.path("q.safetensors");
            let b = d.path("back.safetensors");
            quantize::run(&i, &o, &opts(recipe, lay, Select::all()), true).unwrap();
            let file = std::fs::read(&o).unwrap();
            let st = SafeTensors::deserialize(&file).unwrap();
            for (k, which) in ["rowwise", "columnwise"].into_iter().enumerate() {
                let p = &planes[k];
                let data = st.tensor(&format!("w.{which}_data")).unwrap();
                assert!(data.data() == p.data, "{recipe:?} {lay:?} {which} data");
                let [r, c] = p.scale_shape;
                let want = match (lay, recipe, which) {
                    (ScaleLayout::Compact, ..) => p.scales.clone(),
                    (_, Recipe::Nvfp4, _) | (_, _, "rowwise") => layout::swizzle(&p.scales, r, c),
                    _ => layout::swizzle_mxfp8_columnwise(&p.scales, r, c),
                };
                let scales = st.tensor(&format!("w.{which}_scale_inv")).unwrap();
                assert!(scales.data() == want, "{recipe:?} {lay:?} {which} scales");
            }
            if let Some(a) = xhat.1 {
                let amax = st.tensor("w.amax").unwrap();
                assert_eq!(amax.data(), a.to_le_bytes());
            }
            lowbit_io::dequantize::run(&o, &b, None, true).unwrap();
            let back = std::fs::read(&b).unwrap();
            let st = SafeTensors::deserialize(&back).unwrap();
            let got = st.tensor("w").unwrap();
            let want: Vec<u8> = xhat.0.iter().flat_map(|v| v.to_le_bytes()).collect();
            assert!(got.data() == want, "{recipe:?} {lay:?} dequantized");
        }
    }
}

/// `--naming compressed-tensors`: the rowwise NVFP4 components under compressed-tensors' names,
/// byte for byte lowbit's own, with the global scale `448 · 6 / amax`; `lowbit dequantize`
/// refuses the file; settings and tensors it cannot name are refused before writing.
#[test]
fn compressed_tensors_naming() {
    let d = Dir::new("ct");
    let (i, a, b) = (
        d.path("in.safetensors"),
        d.path("lowbit.safetensors"),
        d.path("ct.safetensors"),
    );
    write(&i, &model());
    let mut o = opts(Recipe::Nvfp4, ScaleLayout::Compact, Select::default());
    o.settings.copies = Copies::Rowwise;
    quantize::run(&i, &a, &o, false).unwrap();
    o.naming = Naming::CompressedTensors;
    // The default selection's GEMM weights are named X.weight with even columns.
    quantize::run(&i, &b, &o, false).unwrap();
    let (fa, fb) = (std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
    let (sa, sb) = (
        SafeTensors::deserialize(&fa).unwrap(),
        SafeTensors::deserialize(&fb).unwrap(),
    );
    for base in [
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.mlp.down_proj",
    ] {
        let w = format!("{base}.weight");
        for (ours, theirs) in [
            ("rowwise_data", "weight_packed"),
            ("rowwise_scale_inv", "weight_scale"),
        ] {
            let x = sa.tensor(&format!("{w}.{ours}")).unwrap();
            let y = sb.tensor(&format!("{base}.{theirs}")).unwrap();
            assert_eq!(
                (x.dtype(), x.shape(), x.data()),
                (y.dtype(), y.shape(), y.data()),
                "{w}"
            );
        }
        let amax = f32::from_le_bytes(
            sa.tensor(&format!("{w}.amax"))
                .unwrap()
                .data()
                .try_into()
                .unwrap(),
        );
        let g = sb.tensor(&format!("{base}.weight_global_scale")).unwrap();
        assert_eq!((g.dtype(), g.shape()), (Dtype::F32, &[1][..]));
        let g = f32::from_le_bytes(g.data().try_into().unwrap());
        assert!(amax > 0.0);
        assert_eq!(g.to_bits(), (448.0f32 * 6.0 / amax).to_bits(), "{w}");
        assert!(sb.tensor(&format!("{w}.rowwise_data")).is_err());
    }
    // Kept tensors are still copied under their own names.
    assert!(sb.tensor("model.embed_tokens.weight").is_ok());
    let err = lowbit_io::dequantize::run(&b, &d.path("back.safetensors"), None, false).unwrap_err();
    assert!(
        err.to_string().contains("named for compressed-tensors"),
        "{err}"
    );
    // Refusals: other settings, a name that is not X.weight, an odd last dimension.
    let mut bad = o.clone();
    bad.settings.copies = Copies::Both;
    let err = quantize::run(&i, &d.path("x.safetensors"), &bad, false).unwrap_err();
    assert!(
        err.to_string().contains("--recipe nvfp4 --copies rowwise"),
        "{err}"
    );
    let mut bias = o.clone();
    bias.select = Select::all();
    let err = quantize::run(&i, &d.path("x.safetensors"), &bias, false).unwrap_err();
    assert!(
        err.to_string().contains("names a Linear's X.weight"),
        "{err}"
    );
    let odd = d.path("odd.safetensors");
    write(
        &odd,
        &[("l.weight", Dtype::BF16, vec![4, 33], bf16s(132, 9))],
    );
    let err = quantize::run(&odd, &d.path("x.safetensors"), &o, false).unwrap_err();
    assert!(err.to_string().contains("has 33"), "{err}");
    assert!(!d.path("x.safetensors").exists());
}
