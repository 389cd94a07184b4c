//! `lowbit quantize --include/--exclude/--all/--json` and column chunks through the binary.
//!
//! - The default quantizes GEMM weights only; kept tensors are copied bit for bit and the report
//!   (table and `--json`) says why each was kept; bad globs are refused naming the flag.
//! - Column chunks (forced with `LOWBIT_CHUNK_COLS=128` so small files cross many block
//!   boundaries) write, and read back, the bytes row chunks do: every recipe, layout, copies
//!   option and 2D, over odd shapes and NaN/Inf.

mod lowbit_cli;

use std::collections::HashMap;
use std::path::Path;
use std::process::Command;

use lowbit_cli::{Json, refused, stdout_ok};
use lowbit_dev_support::tempdir::TempDir;
use lowbit_io::files::{self, OutTensor};
use safetensors::Dtype;

fn f32s(n: usize, seed: u32) -> Vec<u8> {
    (0..n)
        .flat_map(|i| {
            let v = match (i + seed as usize) % 211 {
                5 => f32::NAN,
                9 => f32::NEG_INFINITY,
                _ => ((i as f32 + seed as f32) * 0.29).sin() * 10f32.powi((i % 5) as i32 - 2),
            };
            v.to_le_bytes()
        })
        .collect()
}

fn bf16s(n: usize, seed: u32) -> Vec<u8> {
    (0..n)
        .flat_map(|i| {
            let v = ((i as f32 + seed as f32) * 0.37).sin();
            half::bf16::from_f32(v).to_bits().to_le_bytes()
        })
        .collect()
}

fn write(path: &Path, tensors: Vec<(&str, Dtype, Vec<usize>, Vec<u8>)>) {
    let t = tensors
        .into_iter()
        .map(|(n, d, s, b)| (n.to_owned(), OutTensor::owned(d, s, b)))
        .collect();
    let bytes = files::serialize(path, t, HashMap::new()).unwrap();
    std::fs::write(path, bytes).unwrap();
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn default_keeps_non_gemm_tensors_and_reports_why() {
    let dir = TempDir::new("qsel-default");
    let (i, o) = (dir.path("in.safetensors"), dir.path("out.safetensors"));
    write(
        &i,
        vec![
            (
                "model.embed_tokens.weight",
                Dtype::BF16,
                vec![16, 64],
                bf16s(1024, 1),
            ),
            ("model.norm.weight", Dtype::BF16, vec![64], bf16s(64, 2)),
            (
                "model.layers.0.mlp.up_proj.weight",
                Dtype::BF16,
                vec![96, 64],
                bf16s(6144, 3),
            ),
            ("lm_head.weight", Dtype::BF16, vec![16, 64], bf16s(1024, 4)),
            ("ids", Dtype::I32, vec![2], vec![1, 0, 0, 0, 2, 0, 0, 0]),
        ],
    );
    let table = stdout_ok(&["quantize", s(&i), s(&o)]);
    for line in [
        "BF16 (kept: embedding)",
        "BF16 (kept: 1-D)",
        "BF16 (kept: output head)",
        "I32 (copied)",
        "1 tensor quantized, 4 copied (3 kept in their dtype by the selection)",
    ] {
        assert!(table.contains(line), "`{line}` in:\n{table}");
    }
    let input = std::fs::read(&i).unwrap();
    let output = std::fs::read(&o).unwrap();
    let (a, b) = (
        safetensors::SafeTensors::deserialize(&input).unwrap(),
        safetensors::SafeTensors::deserialize(&output).unwrap(),
    );
    for kept in [
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
        "ids",
    ] {
        let (x, y) = (a.tensor(kept).unwrap(), b.tensor(kept).unwrap());
        assert_eq!(
            (x.dtype(), x.shape(), x.data()),
            (y.dtype(), y.shape(), y.data())
        );
    }
    assert!(
        b.tensor("model.layers.0.mlp.up_proj.weight.rowwise_data")
            .is_ok()
    );

    // --json: one object, every tensor with its action and reason.
    let j = stdout_ok(&[
        "quantize",
        s(&i),
        s(&o),
        "--force",
        "--json",
        "--exclude",
        "*up_proj*",
    ]);
    let j = Json::parse(&j).unwrap();
    assert_eq!(j.key("quantized").number(), 0.0);
    assert_eq!(j.key("kept").number(), 4.0);
    let reasons: HashMap<String, String> = j
        .key("tensors")
        .arr()
        .iter()
        .map(|t| {
            (
                t.key("name").text().to_owned(),
                t.key("reason").text().to_owned(),
            )
        })
        .collect();
    assert_eq!(
        reasons["model.layers.0.mlp.up_proj.weight"],
        "--exclude *up_proj*"
    );
    assert_eq!(reasons["model.norm.weight"], "1-D");
    assert_eq!(reasons["ids"], "not a float tensor");

    // --all quantizes every float tensor; --include '*' is the same file.
    stdout_ok(&["quantize", s(&i), s(&o), "--force", "--all"]);
    let all = std::fs::read(&o).unwrap();
    stdout_ok(&["quantize", s(&i), s(&o), "--force", "--include", "*"]);
    assert!(std::fs::read(&o).unwrap() == all);
    let st = safetensors::SafeTensors::deserialize(&all).unwrap();
    assert!(st.tensor("model.norm.weight.rowwise_data").is_ok());
    assert!(st.tensor("ids").is_ok());
}

#[test]
fn bad_filters_are_refused_naming_the_flag() {
    let err = refused(&["quantize", "a", "b", "--include", "[abc"]);
    assert!(
        err.contains("--include") && err.contains("unterminated ["),
        "{err}"
    );
    let err = refused(&["quantize", "a", "b", "--exclude", "x\\"]);
    assert!(
        err.contains("--exclude") && err.contains("trailing backslash"),
        "{err}"
    );
    let err = refused(&["quantize", "a", "b", "--all", "--include", "*"]);
    assert!(err.contains("cannot be used with"), "{err}");
}

/// Column chunks against row chunks, byte for byte, for the file and its dequantization.
#[test]
fn column_chunks_write_and_read_the_bytes_of_row_chunks() {
    let dir = TempDir::new("qsel-wide");
    let i = dir.path("in.safetensors");
    write(
        &i,
        vec![
            ("one", Dtype::F32, vec![1000], f32s(1000, 1)),
            ("odd", Dtype::F32, vec![3, 777], f32s(2331, 2)),
            ("tall", Dtype::BF16, vec![130, 300], bf16s(39000, 3)),
            ("big", Dtype::F32, vec![2, 130, 513], f32s(133_380, 4)),
            ("thin", Dtype::F32, vec![64, 256], f32s(16384, 5)),
        ],
    );
    let run = |args: &[&str], env: Option<&str>| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_lowbit"));
        c.args(args);
        if let Some(w) = env {
            c.env("LOWBIT_CHUNK_COLS", w);
        }
        let out = c.output().unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    for flags in [
        "--recipe mxfp8",
        "--recipe mxfp8 --scale-layout swizzled",
        "--recipe mxfp8 --2d --copies columnwise",
        "--recipe mxfp8-e5m2 --scale-layout swizzled --2d",
        "--recipe nvfp4",
        "--recipe nvfp4 --scale-layout swizzled",
        "--recipe nvfp4 --2d --scale-layout swizzled",
        "--recipe nvfp4 --copies columnwise",
    ] {
        let mut files = Vec::new();
        for (tag, env) in [
            ("rows", None),
            ("cols", Some("128")),
            ("cols256", Some("200")),
        ] {
            let q = dir.path(&format!("q-{tag}.safetensors"));
            let b = dir.path(&format!("b-{tag}.safetensors"));
            let mut args = vec!["quantize", s(&i), s(&q), "--force", "--all"];
            args.extend(flags.split(' '));
            run(&args, env);
            run(&["dequantize", s(&q), s(&b), "--force"], env);
            files.push((std::fs::read(&q).unwrap(), std::fs::read(&b).unwrap()));
        }
        for (k, f) in files.iter().enumerate().skip(1) {
            assert!(
                f.0 == files[0].0,
                "{flags}: quantized file differs (run {k})"
            );
            assert!(
                f.1 == files[0].1,
                "{flags}: dequantized file differs (run {k})"
            );
        }
    }
}

/// A tampered scale read through column chunks is refused naming the byte, as row chunks do.
#[test]
fn column_chunks_refuse_tampered_scales() {
    let dir = TempDir::new("qsel-tamper");
    let (i, q, b) = (
        dir.path("in.safetensors"),
        dir.path("q.safetensors"),
        dir.path("b.safetensors"),
    );
    write(&i, vec![("w", Dtype::F32, vec![1000], f32s(1000, 7))]);
    stdout_ok(&["quantize", s(&i), s(&q), "--all"]);
    let mut bytes = std::fs::read(&q).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = std::str::from_utf8(&bytes[8..8 + header_len]).unwrap();
    let h = Json::parse(header).unwrap();
    let start = h.key("w.rowwise_scale_inv").key("data_offsets").arr()[0].number() as usize;
    // Byte 20 of the scales: in the second 128-column block.
    bytes[8 + header_len + start + 20] = 0xFF;
    std::fs::write(&q, &bytes).unwrap();
    for env in [None, Some("128")] {
        let mut c = Command::new(env!("CARGO_BIN_EXE_lowbit"));
        c.args(["dequantize", s(&q), s(&b)]);
        if let Some(w) = env {
            c.env("LOWBIT_CHUNK_COLS", w);
        }
        let out = c.output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(
            err.contains("w.rowwise_scale_inv byte 20 is 0xff, an E8M0 scale of 0xFF (NaN)"),
            "{env:?}: {err}"
        );
        assert!(!b.exists());
    }
}

/// `--naming compressed-tensors` through the binary: the three tensors per `X.weight`, and its
/// refusal of other recipes naming the flags.
#[test]
fn compressed_tensors_naming_through_the_binary() {
    let dir = TempDir::new("qsel-ct");
    let (i, o) = (dir.path("in.safetensors"), dir.path("out.safetensors"));
    write(
        &i,
        vec![
            ("m.q_proj.weight", Dtype::BF16, vec![32, 64], bf16s(2048, 1)),
            ("m.norm.weight", Dtype::BF16, vec![64], bf16s(64, 2)),
        ],
    );
    let base = ["quantize", s(&i), s(&o), "--naming", "compressed-tensors"];
    let err = refused(&base);
    assert!(
        err.contains("--recipe nvfp4 --copies rowwise --scale-layout compact"),
        "{err}"
    );
    stdout_ok(&[&base[..], &["--recipe", "nvfp4", "--copies", "rowwise"]].concat());
    let bytes = std::fs::read(&o).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut names: Vec<String> = st.names().into_iter().map(str::to_owned).collect();
    names.sort();
    assert_eq!(
        names,
        [
            "m.norm.weight",
            "m.q_proj.weight_global_scale",
            "m.q_proj.weight_packed",
            "m.q_proj.weight_scale"
        ]
    );
    assert_eq!(
        st.tensor("m.q_proj.weight_packed").unwrap().shape(),
        [32, 32]
    );
    assert_eq!(st.tensor("m.q_proj.weight_scale").unwrap().shape(), [32, 4]);
}
