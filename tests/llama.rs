//! `lowbit train --model llama-tiny` on the embedded text sample: the parity matrix on the
//! decoder (every path that must compute the same thing gives the same bits, for bf16, MXFP8 and
//! NVFP4 primary weights, AdamW and Muon), save/resume bit for bit, eval and generation from a
//! checkpoint, refusals, activation recompute, and the MXFP8 GEMMs of `--compute mxfp8`.

use lowbit::train::{
    self, Checkpointing, Compute, LlamaRun, ModelChoice, OptimizerChoice, Precision, Recompute,
    Sharding, TrainConfig, TrainReport,
};
use lowbit_llama::config::presets;

mod lowbit_cli;

use lowbit_cli::{lowbit, run_json};

/// llama-tiny, 2 CPU ranks, 4 sequences of 32 tokens per step, 3 steps.
fn tiny(precision: Precision) -> TrainConfig {
    TrainConfig {
        ranks: 2,
        precision,
        param_gather: precision != Precision::Bf16,
        microbatches: 1,
        batch: 4,
        steps: 3,
        eval_every: 0,
        eval_samples: 4,
        lr: 3e-3,
        bucket_size: Some(20_000),
        model: ModelChoice::Llama(LlamaRun {
            preset: "llama-tiny".into(),
            config: presets::llama_tiny(),
            seq: 32,
        }),
        ..TrainConfig::default()
    }
}

fn run(cfg: &TrainConfig) -> TrainReport {
    train::train(cfg, &|_| {}).unwrap_or_else(|e| panic!("{cfg:?}: {e}"))
}

/// Every loss, grad norm and eval as bits, and the masters' checksum.
type Bits = (Vec<u32>, Vec<u32>, Vec<(usize, u32)>, u64);

/// The trajectory's bits.
fn bits(r: &TrainReport) -> Bits {
    (
        r.losses.iter().map(|x| x.to_bits()).collect(),
        r.grad_norms.iter().map(|x| x.to_bits()).collect(),
        r.evals.iter().map(|(s, x)| (*s, x.to_bits())).collect(),
        r.master_checksum,
    )
}

const PRECISIONS: [Precision; 3] = [Precision::Bf16, Precision::Mxfp8, Precision::Nvfp4];

#[test]
fn llama_tiny_trains_and_its_loss_falls() {
    let mut cfg = tiny(Precision::Mxfp8);
    cfg.steps = 12;
    let r = run(&cfg);
    assert_eq!(r.losses.len(), 12);
    assert!(r.losses.iter().all(|l| l.is_finite()));
    // Bytes of English: from ~ln(288) = 5.66 nats the loss must drop fast.
    assert!(
        r.losses[11] < r.losses[0] - 0.5,
        "loss {:?} did not fall",
        r.losses
    );
    assert_eq!(
        r.params,
        lowbit_llama::params::param_count(&presets::llama_tiny())
    );
}

#[test]
fn llama_param_gather_on_and_off_are_bitwise_identical() {
    for p in [Precision::Mxfp8, Precision::Nvfp4] {
        let on = tiny(p);
        let off = TrainConfig {
            param_gather: false,
            ..on.clone()
        };
        assert_eq!(bits(&run(&on)), bits(&run(&off)), "{p:?}");
    }
}

#[test]
fn llama_overlap_buckets_strategies_and_eval_schedule_change_no_bit() {
    for p in PRECISIONS {
        let base = tiny(p);
        let want = bits(&run(&base));
        let mut variants = vec![
            TrainConfig {
                overlap_param_gather: false,
                ..base.clone()
            },
            TrainConfig {
                overlap_grad_reduce: false,
                overlap_param_gather: false,
                bucket_size: None,
                ..base.clone()
            },
            TrainConfig {
                bucket_size: Some(3_000),
                ..base.clone()
            },
            TrainConfig {
                sharding: Sharding::OptimGrads,
                ..base.clone()
            },
            TrainConfig {
                sharding: Sharding::OptimGradsParams,
                ..base.clone()
            },
        ];
        if p == Precision::Bf16 {
            variants.push(TrainConfig {
                sharding: Sharding::NoShard,
                overlap_param_gather: false,
                ..base.clone()
            });
        }
        for v in &variants {
            assert_eq!(bits(&run(v)).3, want.3, "{p:?}: {v:?}");
            assert_eq!(bits(&run(v)).0, want.0, "{p:?} losses: {v:?}");
        }
        // Evaluating every step reads the weights without changing them.
        let eval = TrainConfig {
            eval_every: 1,
            ..base.clone()
        };
        let e = bits(&run(&eval));
        assert_eq!(
            (e.0, e.1, e.3),
            (want.0.clone(), want.1.clone(), want.3),
            "{p:?}"
        );
        assert_eq!(e.2.last(), want.2.last(), "{p:?}: the last eval");
    }
}

#[test]
fn llama_muon_param_gather_and_overlap_change_no_bit() {
    for p in [Precision::Bf16, Precision::Mxfp8] {
        let base = TrainConfig {
            optimizer: OptimizerChoice::Muon(Default::default()),
            ..tiny(p)
        };
        let want = bits(&run(&base));
        let mut other = vec![TrainConfig {
            overlap_grad_reduce: false,
            overlap_param_gather: false,
            bucket_size: None,
            ..base.clone()
        }];
        if p != Precision::Bf16 {
            other.push(TrainConfig {
                param_gather: false,
                ..base.clone()
            });
        }
        for v in &other {
            assert_eq!(bits(&run(v)), want, "{p:?}: {v:?}");
        }
    }
}

#[test]
fn llama_save_and_resume_continue_bit_for_bit() {
    for p in PRECISIONS {
        let dir = tempdir(&format!("resume-{p:?}"));
        let mut full = tiny(p);
        full.steps = 4;
        let straight = run(&full);
        let half = Checkpointing {
            save: Some(dir.clone()),
            save_every: 2,
            ..Checkpointing::default()
        };
        train::train_with(&full, &half, &|_| {}).unwrap();
        let resume = Checkpointing {
            resume: Some(dir.join("step-2")),
            ..Checkpointing::default()
        };
        // Resumed under another sharding strategy: the plan reshards on load (another rank
        // count would split the batch differently, which changes the sums' order).
        let again = TrainConfig {
            sharding: Sharding::OptimGradsParams,
            ..full.clone()
        };
        let r = train::train_with(&again, &resume, &|_| {}).unwrap();
        assert_eq!(r.first_step, 2);
        assert_eq!(r.master_checksum, straight.master_checksum, "{p:?}");
        assert_eq!(
            r.losses.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            straight.losses[2..]
                .iter()
                .map(|x| x.to_bits())
                .collect::<Vec<_>>(),
            "{p:?}"
        );
        std::fs::remove_dir_all(&dir).ok();
    }
}

fn tempdir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("lowbit-llama-{name}-{}", std::process::id()));
    std::fs::remove_dir_all(&d).ok();
    d
}

#[test]
fn eval_and_generate_read_a_decoder_checkpoint() {
    let dir = tempdir("cli");
    let d = dir.to_str().unwrap();
    let common = [
        "train",
        "--model",
        "llama-tiny",
        "--ranks",
        "2",
        "--batch",
        "4",
        "--seq",
        "32",
        "--steps",
        "4",
        "--eval-samples",
        "4",
        "--json",
        "--save",
        d,
    ];
    let out = lowbit(&common);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    // The training run's last eval, as bits.
    let at = text.find("\"evals\"").unwrap();
    let bits_at = text[at..].find("\"loss_bits\":\"0x").unwrap() + at + 15;
    let want = &text[bits_at..bits_at + 8];
    let out = lowbit(&["eval", d, "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let e = String::from_utf8(out.stdout).unwrap();
    assert!(
        e.contains(&format!("\"eval_loss_bits\":\"{want}\"")),
        "{e} vs {want}"
    );
    assert!(e.contains("\"step\":4"), "{e}");
    let greedy = [
        "generate",
        d,
        "--prompt",
        "ROMEO:",
        "--max-new-tokens",
        "20",
        "--temperature",
        "0",
        "--json",
    ];
    let out = lowbit(&greedy);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let g = String::from_utf8(out.stdout).unwrap();
    assert!(g.contains("\"prompt\":\"ROMEO:\""), "{g}");
    // Greedy decoding is deterministic.
    let again = lowbit(&greedy);
    assert_eq!(String::from_utf8(again.stdout).unwrap(), g);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn decoder_settings_are_refused_with_the_flag() {
    let cases: [(&[&str], &str); 6] = [
        (
            &["train", "--recompute", "selective"],
            "--recompute selective: the reference model",
        ),
        (&["train", "--model", "llama-huge"], "--model llama-huge"),
        (&["train", "--seq", "8"], "--seq applies only to a decoder"),
        (
            &["train", "--model", "llama-tiny", "--seq", "100000"],
            "--seq 100000",
        ),
        (
            &[
                "train",
                "--model",
                "llama-tiny",
                "--batch",
                "3",
                "--ranks",
                "2",
            ],
            "does not split",
        ),
        (&["generate", "/nonexistent/ckpt"], "/nonexistent/ckpt"),
    ];
    for (args, want) in cases {
        let out = lowbit(args);
        assert!(!out.status.success(), "{args:?} succeeded");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

/// `--compute mxfp8` (the linear layers' GEMMs in MXFP8) trains llama-tiny as the bf16 GEMMs
/// do, within MXFP8's error, under every primary-weight precision, and is not the bf16 path.
#[test]
fn llama_mxfp8_gemms_train_close_to_bf16_gemms() {
    for p in PRECISIONS {
        let mut bf = tiny(p);
        bf.steps = 12;
        bf.compute = Compute::Bf16;
        let mx = TrainConfig {
            compute: Compute::Mxfp8,
            ..bf.clone()
        };
        let (rb, rm) = (run(&bf), run(&mx));
        assert_ne!(
            bits(&rb).0,
            bits(&rm).0,
            "{p:?}: the MXFP8 GEMMs were not used"
        );
        assert!(rm.losses.iter().all(|l| l.is_finite()), "{p:?}");
        assert!(rm.losses[11] < rm.losses[0] - 0.5, "{p:?}: {:?}", rm.losses);
        let rel = (rm.losses[11] - rb.losses[11]).abs() / rb.losses[11];
        assert!(
            rel < 0.03,
            "{p:?}: final loss {} vs bf16 GEMMs {}",
            rm.losses[11],
            rb.losses[11]
        );
    }
}

/// Under `--compute mxfp8` too, param gather, overlap and every sharded strategy change no bit.
#[test]
fn llama_mxfp8_gemms_param_gather_and_strategies_change_no_bit() {
    for p in PRECISIONS {
        let base = TrainConfig {
            compute: Compute::Mxfp8,
            ..tiny(p)
        };
        let want = bits(&run(&base));
        let mut variants = vec![
            TrainConfig {
                overlap_grad_reduce: false,
                overlap_param_gather: false,
                bucket_size: None,
                ..base.clone()
            },
            TrainConfig {
                sharding: Sharding::OptimGrads,
                ..base.clone()
            },
            TrainConfig {
                sharding: Sharding::OptimGradsParams,
                ..base.clone()
            },
        ];
        if p != Precision::Bf16 {
            variants.push(TrainConfig {
                param_gather: false,
                ..base.clone()
            });
        }
        for v in &variants {
            assert_eq!(bits(&run(v)), want, "{p:?}: {v:?}");
        }
    }
}

/// Every recompute level trains the same bits as keeping every activation, for each primary
/// weight precision, with parameters gathered per use (fully sharded: the recomputation fetches
/// them again in the backward; MXFP8 units then gather one copy per use) and with MXFP8 GEMMs.
#[test]
fn llama_recompute_levels_change_no_bit() {
    for p in PRECISIONS {
        for compute in [Compute::Exact, Compute::Mxfp8] {
            let base = TrainConfig {
                sharding: Sharding::OptimGradsParams,
                compute,
                ..tiny(p)
            };
            let want = bits(&run(&base));
            for r in [Recompute::Selective, Recompute::Mlp, Recompute::Full] {
                let v = TrainConfig {
                    recompute: r,
                    ..base.clone()
                };
                assert_eq!(bits(&run(&v)), want, "{p:?} {compute:?} --recompute {r}");
            }
        }
    }
}

/// Rank 0's peak device memory falls by exactly what the closed form says each recompute level
/// stops keeping (bf16 weights: no other allocation depends on the level).
#[test]
fn llama_recompute_saves_the_closed_form_bytes() {
    use std::sync::Mutex;
    let peak = |r: Recompute| {
        let cfg = TrainConfig {
            recompute: r,
            ..tiny(Precision::Bf16)
        };
        let seen = Mutex::new(0);
        train::train(&cfg, &|log| {
            let mut p = seen.lock().unwrap();
            *p = (*p).max(log.device_peak_bytes)
        })
        .unwrap();
        seen.into_inner().unwrap()
    };
    let c = presets::llama_tiny();
    // 4 sequences over 2 ranks, one microbatch: 2 sequences of 32 tokens per rank.
    let bytes = |r| lowbit_llama::Llama::activation_bytes_with(&c, 2, 32, r).unwrap();
    let off = peak(Recompute::Off);
    for r in [Recompute::Selective, Recompute::Mlp, Recompute::Full] {
        assert_eq!(off - peak(r), bytes(Recompute::Off) - bytes(r), "{r}");
    }
}

/// The report names the level and gives the activations' closed form for the rank's microbatch;
/// `on` is `full`.
#[test]
fn the_report_gives_the_recompute_level_and_the_activation_bytes() {
    let c = presets::llama_tiny();
    for (flag, r) in [("selective", Recompute::Selective), ("on", Recompute::Full)] {
        let args = [
            "--model",
            "llama-tiny",
            "--steps",
            "1",
            "--ranks",
            "2",
            "--batch",
            "4",
        ];
        let j = run_json(&[&args[..], &["--microbatches", "1", "--recompute", flag]].concat());
        assert_eq!(j.key("fsdp").key("recompute_level").text(), r.name());
        assert!(j.key("fsdp").key("recompute").flag());
        // 4 sequences over 2 ranks, one microbatch, the preset's 64 tokens.
        let want = lowbit_llama::Llama::activation_bytes_with(&c, 2, 64, r).unwrap();
        let got = j.key("memory").key("activations_per_rank").number();
        assert_eq!(got, want as f64, "--recompute {flag}");
    }
}
