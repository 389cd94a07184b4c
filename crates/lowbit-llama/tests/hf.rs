//! The Hugging Face directory: tokenizer files against GPT-2's published ones, config.json and
//! weights written and read back, and every refusal of the reader naming the file and key.

use std::fs;

use lowbit_dev_support::tempdir::TempDir;
use lowbit_io::{Json, fnv1a64};
use lowbit_llama::LlamaConfig;
use lowbit_llama::config::presets;
use lowbit_llama::data::Tokenizer;
use lowbit_llama::hf::{self, ExportOptions, HfError, WeightDtype};

/// Values for every parameter of `cfg`, distinct per element (not representable in bf16).
fn values(cfg: &LlamaConfig) -> Vec<Vec<f32>> {
    lowbit_llama::params::params(cfg)
        .iter()
        .enumerate()
        .map(|(p, info)| {
            (0..info.numel())
                .map(|i| (p as f32 + 1.0) * 1e-3 + i as f32 * 1.000_001e-5)
                .collect()
        })
        .collect()
}

fn tiny() -> LlamaConfig {
    presets::llama_tiny()
}

#[test]
fn gpt2_tokenizer_files_are_gpt2s() {
    let files = hf::tokenizer::files(Tokenizer::Gpt2, 1024).unwrap();
    let names: Vec<&str> = files.iter().map(|(n, _)| *n).collect();
    assert_eq!(names, hf::tokenizer::FILES);
    // merges.txt rebuilt from tiktoken's ranks is byte for byte OpenAI's GPT-2 `vocab.bpe`
    // (50001 lines, FNV-1a 64 of the published file, as shipped in the tiktoken-rs 0.12.1
    // sources' assets/vocab.bpe).
    let merges = &files[1].1;
    assert_eq!(merges.lines().count(), 50_001);
    assert_eq!(
        merges.lines().take(5).collect::<Vec<_>>(),
        ["#version: 0.2", "Ġ t", "Ġ a", "h e", "i n"]
    );
    assert_eq!(
        format!("{:016x}", fnv1a64(merges.as_bytes())),
        "d73386ba902b110d"
    );
    let vocab = Json::parse(&files[0].1).unwrap();
    assert_eq!(vocab.keys().len(), 50_257);
    assert_eq!(vocab.get("!").as_u64(), Some(0));
    assert_eq!(vocab.get("Ġthe").as_u64(), Some(262));
    assert_eq!(vocab.get("<|endoftext|>").as_u64(), Some(50_256));
    let tj = Json::parse(&files[2].1).unwrap();
    assert_eq!(tj.get("model").get("type").as_str(), Some("BPE"));
    assert_eq!(tj.get("model").get("merges").arr().len(), 50_000);
    assert_eq!(tj.get("model").get("vocab").keys().len(), 50_257);
    let tc = Json::parse(&files[3].1).unwrap();
    assert_eq!(tc.get("tokenizer_class").as_str(), Some("GPT2Tokenizer"));
    assert_eq!(tc.get("model_max_length").as_u64(), Some(1024));
    assert_eq!(tc.get("eos_token").as_str(), Some("<|endoftext|>"));
}

#[test]
fn config_json_round_trips_every_field() {
    let untied = presets::llama_8b_layers(2);
    for (cfg, tok) in [
        (tiny(), Tokenizer::Bytes),
        (presets::llama_1b(), Tokenizer::Gpt2),
        (untied, Tokenizer::Gpt2),
    ] {
        let t = TempDir::new("hf-config");
        let json = hf::config::config_json(&cfg, tok, WeightDtype::Bf16);
        fs::write(t.path("config.json"), json.to_text()).unwrap();
        let back = hf::read_config(t.dir()).unwrap();
        assert_eq!(back.model, cfg);
        assert_eq!(back.bos_token_id, Some(u64::from(tok.eot())));
        assert_eq!(back.eos_token_ids, vec![u64::from(tok.eot())]);
        assert_eq!(back.torch_dtype.as_deref(), Some("bfloat16"));
    }
    let j = hf::config::config_json(&presets::llama_1b(), Tokenizer::Gpt2, WeightDtype::F32);
    let text = j.to_string();
    for field in [
        r#""architectures":["LlamaForCausalLM"]"#,
        r#""model_type":"llama""#,
        r#""hidden_act":"silu""#,
        r#""attention_bias":false"#,
        r#""mlp_bias":false"#,
        r#""rope_theta":500000.0"#,
        r#""rms_norm_eps":1e-5"#,
        r#""tie_word_embeddings":true"#,
        r#""torch_dtype":"float32""#,
        r#""rope_scaling":{"factor":32.0,"high_freq_factor":4.0,"low_freq_factor":1.0,"original_max_position_embeddings":8192,"rope_type":"llama3"}"#,
        r#""vocab_size":128256"#,
        r#""max_position_embeddings":131072"#,
    ] {
        assert!(text.contains(field), "{field} not in {text}");
    }
}

#[test]
fn transformers_5_rope_parameters_are_read() {
    // What transformers 5.24's `save_pretrained` writes for an exported config: rope_theta and
    // the scaling inside `rope_parameters`, `dtype` for `torch_dtype`.
    let mut cfg = presets::llama_8b_layers(1);
    cfg.vocab = 288;
    for (scaling, params) in [
        (
            cfg.rope_scaling,
            r#"{"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
               "original_max_position_embeddings": 8192, "rope_theta": 500000.0,
               "rope_type": "llama3"}"#,
        ),
        (None, r#"{"rope_theta": 500000.0, "rope_type": "default"}"#),
    ] {
        let t = TempDir::new("hf-config-v5");
        let text = format!(
            r#"{{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "dtype": "bfloat16",
               "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 1,
               "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
               "vocab_size": 288, "max_position_embeddings": 131072, "rms_norm_eps": 1e-05,
               "rope_parameters": {params}, "tie_word_embeddings": false, "pad_token_id": null}}"#
        );
        fs::write(t.path("config.json"), text).unwrap();
        let back = hf::read_config(t.dir()).unwrap();
        assert_eq!(
            back.model,
            LlamaConfig {
                rope_scaling: scaling,
                ..cfg.clone()
            }
        );
    }
}

/// `config.json` of llama-tiny with `edit` applied, read back: the error's text.
fn config_refusal(edit: impl FnOnce(&mut lowbit_io::json::Object)) -> String {
    let t = TempDir::new("hf-config-bad");
    let Json::Obj(mut o) = hf::config::config_json(&tiny(), Tokenizer::Bytes, WeightDtype::F32)
    else {
        unreachable!()
    };
    edit(&mut o);
    fs::write(t.path("config.json"), Json::Obj(o).to_text()).unwrap();
    let e = hf::read_config(t.dir()).unwrap_err();
    assert!(matches!(e, HfError::Invalid { .. }), "{e:?}");
    let m = e.to_string();
    assert!(m.contains("config.json: "), "{m}");
    m
}

#[test]
fn config_json_refusals_name_the_key() {
    let m = config_refusal(|o| {
        o.insert(
            "architectures",
            Json::Arr(vec![Json::str("MistralForCausalLM")]),
        );
    });
    assert!(
        m.contains("architectures") && m.contains("MistralForCausalLM"),
        "{m}"
    );
    let m = config_refusal(|o| {
        o.insert("model_type", Json::str("gpt2"));
    });
    assert!(m.contains("model_type"), "{m}");
    let m = config_refusal(|o| {
        o.remove("hidden_size");
    });
    assert!(m.contains("hidden_size: missing"), "{m}");
    let m = config_refusal(|o| {
        o.insert("vocab_size", Json::UInt(1 << 40));
    });
    assert!(m.contains("vocab_size"), "{m}");
    let m = config_refusal(|o| {
        o.insert("num_key_value_heads", Json::UInt(3));
    });
    assert!(m.contains("num_key_value_heads"), "{m}");
    let m = config_refusal(|o| {
        o.insert("hidden_act", Json::str("gelu"));
    });
    assert!(m.contains("hidden_act"), "{m}");
    let m = config_refusal(|o| {
        o.insert("mlp_bias", Json::Bool(true));
    });
    assert!(m.contains("mlp_bias"), "{m}");
    let m = config_refusal(|o| {
        o.insert(
            "rope_scaling",
            Json::obj([
                ("rope_type", Json::str("linear")),
                ("factor", Json::Num(2.0)),
            ]),
        );
    });
    assert!(m.contains("rope_scaling") && m.contains("linear"), "{m}");
    let m = config_refusal(|o| {
        o.insert("num_hidden_layers", Json::Num(2.5));
    });
    assert!(m.contains("num_hidden_layers"), "{m}");
    // Not JSON, and not a file.
    let t = TempDir::new("hf-config-nojson");
    fs::write(t.path("config.json"), "{").unwrap();
    assert!(matches!(
        hf::read_config(t.dir()),
        Err(HfError::Json { .. })
    ));
    fs::remove_file(t.path("config.json")).unwrap();
    fs::create_dir(t.path("config.json")).unwrap();
    let e = hf::read_config(t.dir()).unwrap_err().to_string();
    assert!(e.contains("not a regular file"), "{e}");
}

#[test]
fn weights_round_trip_single_and_sharded() {
    let cfg = tiny();
    let v = values(&cfg);
    let total: u64 = v.iter().map(|t| t.len() as u64 * 4).sum();
    for (max, files) in [(u64::MAX, 1), (20_000, 0)] {
        let t = TempDir::new("hf-weights");
        let opts = ExportOptions::default().with_max_shard_bytes(max);
        let s = hf::export(t.dir(), &cfg, Tokenizer::Bytes, &v, &opts).unwrap();
        assert_eq!(s.tensor_bytes, total);
        let back = hf::read_weights(t.dir(), &cfg).unwrap();
        assert_eq!(back, v);
        if files == 1 {
            assert_eq!(s.weight_files, 1);
            assert!(t.path("model.safetensors").exists());
        } else {
            // 20 kB shards of llama-tiny's 73.7 kB embedding and 12–49 kB layers.
            assert!(s.weight_files > 2, "{s:?}");
            assert!(!t.path("model.safetensors").exists());
            let index =
                Json::parse(&fs::read_to_string(t.path("model.safetensors.index.json")).unwrap())
                    .unwrap();
            assert_eq!(
                index.get("metadata").get("total_size").as_u64(),
                Some(total)
            );
            let map = index.get("weight_map");
            assert_eq!(map.keys().len(), v.len());
            let n = s.weight_files;
            assert_eq!(
                map.get("model.embed_tokens.weight").as_str(),
                Some(format!("model-00001-of-{n:05}.safetensors").as_str())
            );
            for k in 1..=n {
                let shard = t.path(&format!("model-{k:05}-of-{n:05}.safetensors"));
                assert!(shard.exists(), "{}", shard.display());
            }
        }
    }
    // bf16: rounded to nearest even, read back as those values.
    let t = TempDir::new("hf-weights-bf16");
    let opts = ExportOptions::default().with_dtype(WeightDtype::Bf16);
    hf::export(t.dir(), &cfg, Tokenizer::Bytes, &v, &opts).unwrap();
    let back = hf::read_weights(t.dir(), &cfg).unwrap();
    for (a, b) in v.iter().flatten().zip(back.iter().flatten()) {
        assert_eq!(*b, half::bf16::from_f32(*a).to_f32());
    }
    let size = fs::metadata(t.path("model.safetensors")).unwrap().len();
    assert!(size > total / 2 && size < total / 2 + 4096, "{size}");
    // Determinism: a second export is the same bytes.
    let u = TempDir::new("hf-weights-bf16-again");
    hf::export(u.dir(), &cfg, Tokenizer::Bytes, &v, &opts).unwrap();
    for f in [
        "model.safetensors",
        "config.json",
        "tokenizer.json",
        "vocab.json",
    ] {
        assert_eq!(
            fs::read(t.path(f)).unwrap(),
            fs::read(u.path(f)).unwrap(),
            "{f}"
        );
    }
}

/// Writes `tensors` as `dir/model.safetensors`.
fn write_file(
    t: &TempDir,
    name: &str,
    tensors: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>,
) {
    let out: Vec<(String, lowbit_io::files::OutTensor<'_>)> = tensors
        .into_iter()
        .map(|(n, d, s, b)| (n, lowbit_io::files::OutTensor::owned(d, s, b)))
        .collect();
    let path = t.path(name);
    let bytes = lowbit_io::files::serialize(&path, out, Default::default()).unwrap();
    fs::write(path, bytes).unwrap();
}

/// llama-tiny's tensors as f32 bytes, by name.
fn tiny_tensors() -> Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> {
    let cfg = tiny();
    lowbit_llama::params::params(&cfg)
        .into_iter()
        .zip(values(&cfg))
        .map(|(p, v)| {
            let b = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            (p.name, safetensors::Dtype::F32, p.shape, b)
        })
        .collect()
}

fn weight_refusal(t: &TempDir) -> String {
    let e = hf::read_weights(t.dir(), &tiny()).unwrap_err();
    e.to_string()
}

#[test]
fn weight_refusals_name_the_tensor() {
    let t = TempDir::new("hf-w-extra");
    let mut ts = tiny_tensors();
    ts.push((
        "lm_head.weight".into(),
        safetensors::Dtype::F32,
        vec![288, 64],
        vec![0; 288 * 64 * 4],
    ));
    write_file(&t, "model.safetensors", ts);
    let m = weight_refusal(&t);
    assert!(m.contains("`lm_head.weight` is not a parameter"), "{m}");

    let t = TempDir::new("hf-w-missing");
    let mut ts = tiny_tensors();
    ts.retain(|x| x.0 != "model.layers.1.mlp.up_proj.weight");
    write_file(&t, "model.safetensors", ts);
    let m = weight_refusal(&t);
    assert!(
        m.contains("`model.layers.1.mlp.up_proj.weight` is missing"),
        "{m}"
    );

    let t = TempDir::new("hf-w-shape");
    let mut ts = tiny_tensors();
    let k = ts
        .iter()
        .position(|x| x.0 == "model.layers.0.self_attn.k_proj.weight")
        .unwrap();
    ts[k].2 = vec![64, 32];
    write_file(&t, "model.safetensors", ts);
    let m = weight_refusal(&t);
    assert!(m.contains("k_proj.weight` has shape [64, 32]"), "{m}");

    let t = TempDir::new("hf-w-dtype");
    let mut ts = tiny_tensors();
    ts[0].1 = safetensors::Dtype::I32;
    write_file(&t, "model.safetensors", ts);
    let m = weight_refusal(&t);
    assert!(m.contains("embed_tokens.weight` is I32"), "{m}");

    // f16 is read.
    let t = TempDir::new("hf-w-f16");
    let mut ts = tiny_tensors();
    ts[0].1 = safetensors::Dtype::F16;
    ts[0].3 = values(&tiny())[0]
        .iter()
        .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
        .collect();
    write_file(&t, "model.safetensors", ts);
    let back = hf::read_weights(t.dir(), &tiny()).unwrap();
    assert_eq!(
        back[0][5],
        half::f16::from_f32(values(&tiny())[0][5]).to_f32()
    );

    // Sharded: an index naming a file outside the directory, a tensor in the wrong file, a
    // tensor stored twice.
    let t = TempDir::new("hf-w-index");
    let ts = tiny_tensors();
    let (a, b) = ts.split_at(5);
    write_file(&t, "a.safetensors", a.to_vec());
    write_file(&t, "b.safetensors", b.to_vec());
    let index = |map: Vec<(String, &str)>| {
        let j = Json::obj([(
            "weight_map",
            Json::Obj(map.into_iter().map(|(k, v)| (k, Json::str(v))).collect()),
        )]);
        fs::write(t.path("model.safetensors.index.json"), j.to_text()).unwrap();
    };
    let good: Vec<(String, &str)> = a
        .iter()
        .map(|x| (x.0.clone(), "a.safetensors"))
        .chain(b.iter().map(|x| (x.0.clone(), "b.safetensors")))
        .collect();
    index(good.clone());
    assert_eq!(hf::read_weights(t.dir(), &tiny()).unwrap(), values(&tiny()));
    let mut evil = good.clone();
    evil[0].1 = "../a.safetensors";
    index(evil);
    let m = weight_refusal(&t);
    assert!(m.contains("not a .safetensors file name"), "{m}");
    let mut wrong = good.clone();
    wrong[0].1 = "b.safetensors";
    index(wrong);
    let m = weight_refusal(&t);
    assert!(m.contains("model.embed_tokens.weight"), "{m}");
    write_file(
        &t,
        "b.safetensors",
        [b.to_vec(), vec![a[0].clone()]].concat(),
    );
    // Both files hold it and the index names b: a's copy is refused.
    let mut twice = good;
    twice[0].1 = "b.safetensors";
    index(twice);
    let m = weight_refusal(&t);
    assert!(m.contains("model.embed_tokens.weight"), "{m}");

    let t = TempDir::new("hf-w-none");
    let m = weight_refusal(&t);
    assert!(m.contains("neither model.safetensors nor"), "{m}");
}
