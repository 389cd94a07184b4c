//! `lowbit ckpt export --format hf` and `lowbit train --init-from`, end to end: a llama-tiny run
//! (CPU, deterministic) exported to a Hugging Face directory, its config.json and tensors
//! checked, the export → import → export round trip byte-identical (f32 and bf16, sharded), and
//! lowbit's eval loss compared with the committed output of the independent numpy reference
//! (`scripts/hf_reference.py`) over the same export (`tests/golden/hf_reference.json`, written
//! by `scripts/check_hf.sh --write-fixture`; tolerance 1e-6 on the mean loss, measured 1.2e-7).

mod lowbit_cli;

use std::fs;
use std::path::Path;

use lowbit_cli::{Json, lowbit, refused, stdout_ok};
use lowbit_dev_support::tempdir::TempDir;

/// The flags of the fixture's run (`scripts/check_hf.sh`, run A), after `--data DIR`.
const RUN: [&str; 14] = [
    "--model",
    "llama-tiny",
    "--precision",
    "bf16",
    "--ranks",
    "1",
    "--microbatches",
    "1",
    "--batch",
    "4",
    "--seq",
    "32",
    "--eval-samples",
    "8",
];

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// Every file of `dir` by name, with its bytes.
fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<(String, Vec<u8>)> = fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    v.sort();
    v
}

fn train_args<'a>(data: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec!["train", "--data", data];
    a.extend_from_slice(&RUN);
    a.extend_from_slice(extra);
    a
}

#[test]
fn export_import_round_trip_and_the_reference() {
    let t = TempDir::new("hf-cli");
    let sample = t.path("sample.txt");
    fs::write(&sample, lowbit_llama::data::embedded_sample()).unwrap();
    let data = t.path("data");
    stdout_ok(&[
        "data",
        "prepare",
        "--tokenizer",
        "bytes",
        "--out",
        s(&data),
        s(&sample),
    ]);
    let ck = t.path("ck");
    stdout_ok(&train_args(s(&data), &["--steps", "3", "--save", s(&ck)]));

    // lowbit's own eval of the checkpoint against the reference's loss over the bf16 export.
    let eval = Json::parse(&stdout_ok(&["eval", s(&ck), "--json"])).unwrap();
    let fixture: Json = Json::parse(
        &fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/golden/hf_reference.json"
        ))
        .unwrap(),
    )
    .unwrap();
    let tol = fixture.key("tolerance").number();
    assert_eq!(tol, 1e-6);
    let (ours, theirs) = (
        eval.key("eval_loss").number(),
        fixture.key("mean_loss").number(),
    );
    assert_eq!(
        eval.key("eval_items").number(),
        fixture.key("items").number()
    );
    assert!(
        (ours - theirs).abs() <= tol,
        "lowbit eval {ours} vs the numpy reference {theirs}"
    );

    // bf16, sharded at 30 kB: the files the fixture was computed from.
    let hf16 = t.path("hf16");
    let out = stdout_ok(&[
        "ckpt",
        "export",
        s(&ck),
        s(&hf16),
        "--format",
        "hf",
        "--dtype",
        "bf16",
        "--max-shard-size",
        "30000",
    ]);
    assert!(out.contains("9 weight files"), "{out}");
    let Json::Obj(pinned) = fixture.key("weight_files_fnv1a64") else {
        panic!("fixture: weight_files_fnv1a64")
    };
    let shards: Vec<(String, Vec<u8>)> = files(&hf16)
        .into_iter()
        .filter(|(n, _)| n.ends_with(".safetensors"))
        .collect();
    assert_eq!(shards.len(), pinned.len());
    for (name, bytes) in &shards {
        let want = pinned.get(name.as_str()).map(|j| j.text().to_string());
        assert_eq!(
            Some(format!("{:016x}", lowbit_io::fnv1a64(bytes))),
            want,
            "{name}: not the export the fixture was computed from (scripts/check_hf.sh \
             --write-fixture after a deliberate change of the training numerics)"
        );
    }

    // f32, one file: config.json and the tensors.
    let hf32 = t.path("hf32");
    stdout_ok(&["ckpt", "export", s(&ck), s(&hf32), "--format", "hf"]);
    let names: Vec<String> = files(&hf32).into_iter().map(|(n, _)| n).collect();
    assert_eq!(
        names,
        [
            "config.json",
            "generation_config.json",
            "merges.txt",
            "model.safetensors",
            "special_tokens_map.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "vocab.json"
        ]
    );
    let cfg = Json::parse(&fs::read_to_string(hf32.join("config.json")).unwrap()).unwrap();
    for (key, want) in [
        ("vocab_size", 288.0),
        ("hidden_size", 64.0),
        ("intermediate_size", 192.0),
        ("num_hidden_layers", 2.0),
        ("num_attention_heads", 4.0),
        ("num_key_value_heads", 2.0),
        ("head_dim", 16.0),
        ("max_position_embeddings", 64.0),
        ("rope_theta", 10000.0),
        ("rms_norm_eps", 1e-5),
        ("bos_token_id", 256.0),
        ("eos_token_id", 256.0),
    ] {
        assert_eq!(cfg.key(key).number(), want, "{key}");
    }
    assert_eq!(cfg.key("model_type").text(), "llama");
    assert_eq!(cfg.key("architectures").arr()[0].text(), "LlamaForCausalLM");
    assert_eq!(cfg.key("torch_dtype").text(), "float32");
    assert_eq!(cfg.key("hidden_act").text(), "silu");
    assert!(cfg.key("tie_word_embeddings").flag());
    assert!(!cfg.key("attention_bias").flag() && !cfg.key("mlp_bias").flag());
    assert_eq!(cfg.key("rope_scaling"), &Json::Null);
    let input = lowbit_io::files::Input::open(&hf32.join("model.safetensors")).unwrap();
    assert_eq!(input.tensors.len(), 2 + 2 * 9);
    let shape = |n: &str| input.get(n).unwrap_or_else(|| panic!("{n}")).shape.clone();
    assert_eq!(shape("model.embed_tokens.weight"), [288, 64]);
    assert_eq!(shape("model.layers.1.self_attn.q_proj.weight"), [64, 64]);
    assert_eq!(shape("model.layers.1.self_attn.k_proj.weight"), [32, 64]);
    assert_eq!(shape("model.layers.0.self_attn.o_proj.weight"), [64, 64]);
    assert_eq!(shape("model.layers.0.mlp.down_proj.weight"), [64, 192]);
    assert_eq!(
        shape("model.layers.0.post_attention_layernorm.weight"),
        [64]
    );
    assert_eq!(shape("model.norm.weight"), [64]);
    assert!(input.get("lm_head.weight").is_none(), "tied");
    assert_eq!(input.metadata.get("format").map(String::as_str), Some("pt"));

    // Export → --init-from → save (--steps 0: the imported masters as step 0) → export.
    for (hf, dtype, extra) in [
        (&hf32, "f32", &[][..]),
        (&hf16, "bf16", &["--max-shard-size", "30000"][..]),
    ] {
        let ck2 = t.path(&format!("ck-{dtype}"));
        // The run's own flags, --model included (it agrees with config.json).
        let mut args = train_args(s(&data), &["--steps", "0", "--save", s(&ck2)]);
        args.extend_from_slice(&["--init-from", s(hf)]);
        let out = stdout_ok(&args);
        assert!(out.contains("checksum"), "{out}");
        let e2 = Json::parse(&stdout_ok(&["eval", s(&ck2), "--json"])).unwrap();
        assert_eq!(e2.key("step").number(), 0.0);
        if dtype == "f32" {
            // The same masters and precision: the imported model evaluates to the same bits.
            assert_eq!(
                e2.key("eval_loss_bits").text(),
                eval.key("eval_loss_bits").text()
            );
        }
        let again = t.path(&format!("again-{dtype}"));
        let mut args = vec!["ckpt", "export", s(&ck2), s(&again), "--format", "hf"];
        args.extend_from_slice(&["--dtype", dtype]);
        args.extend_from_slice(extra);
        stdout_ok(&args);
        assert_eq!(files(hf), files(&again), "round trip of the {dtype} export");
    }

    // Refusals: a --model that disagrees, --resume, an existing output, outputs inside the
    // checkpoint, a non-decoder format request.
    let e = refused(&[
        "train",
        "--init-from",
        s(&hf32),
        "--data",
        s(&data),
        "--model",
        "llama-125m",
    ]);
    assert!(
        e.contains("config.json has vocab_size = 288") && e.contains("llama-125m"),
        "{e}"
    );
    // The bytes model cannot read GPT-2's ids: its vocabulary of 288 does not hold them.
    let text = t.path("words.txt");
    fs::write(
        &text,
        "A few words of text.\nAnd a second line of them.\n".repeat(20),
    )
    .unwrap();
    let g2 = t.path("gpt2-data");
    stdout_ok(&["data", "prepare", "--out", s(&g2), s(&text)]);
    let e = refused(&[
        "train",
        "--init-from",
        s(&hf32),
        "--data",
        s(&g2),
        "--steps",
        "0",
    ]);
    assert!(
        e.contains("vocab 288 is smaller than the gpt2 tokenizer's 50257"),
        "{e}"
    );
    let e = refused(&["train", "--init-from", s(&hf32), "--resume", s(&ck)]);
    assert!(e.contains("--resume"), "{e}");
    let e = refused(&[
        "train",
        "--data",
        s(&data),
        "--model",
        "llama-tiny",
        "--steps",
        "0",
    ]);
    assert!(e.contains("--steps must be at least 1"), "{e}");
    let e = refused(&["ckpt", "export", s(&ck), s(&hf32), "--format", "hf"]);
    assert!(e.contains("already exists"), "{e}");
    let inside = ck.join("step-3").join("hf");
    let e = refused(&["ckpt", "export", s(&ck), s(&inside), "--format", "hf"]);
    assert!(e.contains("inside the checkpoint"), "{e}");
    let e = refused(&[
        "ckpt",
        "export",
        s(&ck),
        s(&t.path("q")),
        "--format",
        "hf",
        "--dtype",
        "mxfp8",
    ]);
    assert!(e.contains("f32 or bf16"), "{e}");
    // --force replaces an earlier export, never a directory of other files or one holding
    // the checkpoint.
    let e = refused(&[
        "ckpt",
        "export",
        s(&ck),
        s(&data),
        "--format",
        "hf",
        "--force",
    ]);
    assert!(e.contains("no config.json"), "{e}");
    let e = refused(&[
        "ckpt",
        "export",
        s(&ck),
        t.dir().to_str().unwrap(),
        "--format",
        "hf",
        "--force",
    ]);
    assert!(e.contains("holds the checkpoint"), "{e}");
    assert!(data.join("manifest.json").is_file() && ck.join("latest").is_file());
    stdout_ok(&[
        "ckpt",
        "export",
        s(&ck),
        s(&hf32),
        "--format",
        "hf",
        "--force",
    ]);
    assert_eq!(files(&hf32).len(), 8);
    assert!(
        !lowbit(&[
            "ckpt",
            "export",
            s(&ck),
            s(&t.path("x.safetensors")),
            "--max-shard-size",
            "9"
        ])
        .status
        .success()
    );
}
