//! The model's surface: bad input refused before any op, next-token logits against the f64
//! reference, the memory pre-check equal to what is allocated, generation through the model, and
//! `llama-tiny` at the CI batch shape.

mod support;

use lowbit_device::{Device, MatmulMode};
use lowbit_llama::generate::{Sampler, Sampling, generate};
use lowbit_llama::{Llama, LlamaConfig, LlamaError, Recompute, params, presets};
use support::{TestHooks, ref_logits, test_params, test_tokens, to_f64};

fn small() -> LlamaConfig {
    LlamaConfig {
        vocab: 13,
        dim: 8,
        layers: 1,
        heads: 2,
        kv_heads: 2,
        head_dim: 4,
        ffn: 10,
        max_seq: 6,
        ..presets::llama_tiny()
    }
}

fn input_err<T: std::fmt::Debug>(r: lowbit_llama::Result<T>) -> String {
    match r {
        Err(LlamaError::Input(m)) => m,
        other => panic!("expected an input error, got {other:?}"),
    }
}

#[test]
fn bad_input_is_refused_before_any_op() {
    let cfg = small();
    let mut dev = Device::cpu();
    let mut hooks = TestHooks::new(&mut dev, &test_params(&cfg, 1, 0.5));
    let m = input_err(Llama::new(&mut dev, &cfg, 2, 7));
    assert!(m.contains("max_seq 6"), "{m}");
    assert!(Llama::new(&mut dev, &cfg, 0, 4).is_err());
    let bad_cfg = LlamaConfig {
        kv_heads: 3,
        ..cfg.clone()
    };
    assert!(matches!(
        Llama::new(&mut dev, &bad_cfg, 1, 4),
        Err(LlamaError::Config(_))
    ));
    let model = Llama::new(&mut dev, &cfg, 2, 3).unwrap();
    let ok = [1u32, 2, 3, 4, 5, 6];
    let mut big = ok;
    big[4] = 13;
    let m = input_err(model.forward_backward(&mut dev, &mut hooks, &big, &ok, 1.0));
    assert!(m.contains("tokens[4] = 13") && m.contains("13"), "{m}");
    let m = input_err(model.forward_backward(&mut dev, &mut hooks, &ok, &big, 1.0));
    assert!(m.contains("targets[4]"), "{m}");
    let m = input_err(model.eval_loss(&mut dev, &mut hooks, &ok[..5], &ok[..5]));
    assert!(m.contains("5 ids") && m.contains("needs 6"), "{m}");
    input_err(model.forward_backward(&mut dev, &mut hooks, &ok, &ok[..5], 1.0));
    input_err(model.next_logits(&mut dev, &mut hooks, &[]));
    input_err(model.next_logits(&mut dev, &mut hooks, &[1, 2, 3, 4]));
    input_err(model.next_logits(&mut dev, &mut hooks, &[99]));
    assert!(hooks.calls.is_empty(), "{:?}", hooks.calls);
}

#[test]
fn next_logits_are_the_last_positions() {
    let cfg = small();
    let mut dev = Device::cpu();
    let values = test_params(&cfg, 2, 0.5);
    let mut hooks = TestHooks::new(&mut dev, &values);
    let model = Llama::new(&mut dev, &cfg, 2, 5).unwrap();
    let tokens = test_tokens(7, 3, cfg.vocab);
    let got = model.next_logits(&mut dev, &mut hooks, &tokens).unwrap();
    let want = ref_logits(&cfg, &to_f64(&values), &tokens, 1, 3);
    let want = &want[2 * cfg.vocab..];
    assert_eq!(got.len(), cfg.vocab);
    for (g, w) in got.iter().zip(want) {
        assert!(
            (f64::from(*g) - w).abs() < 1e-5 * w.abs().max(1.0),
            "{g} vs {w}"
        );
    }
    assert!(hooks.ready().is_empty());
    // Through the generation loop: greedy picks the reference's argmax.
    let mut s = Sampler::new(Sampling::Greedy).unwrap();
    let mut f = |ctx: &[u32]| model.next_logits(&mut dev, &mut hooks, ctx);
    let out = generate(&tokens, 4, 5, &mut f, &mut s).unwrap();
    assert_eq!(out.len(), 4);
    let best = (0..cfg.vocab)
        .max_by(|&a, &b| want[a].total_cmp(&want[b]).then(b.cmp(&a)))
        .unwrap();
    assert_eq!(out[0] as usize, best);
}

#[test]
fn activation_bytes_is_what_new_allocates() {
    for (cfg, batch, seq) in [(small(), 2, 5), (presets::llama_tiny(), 8, 32)] {
        let mut dev = Device::cpu();
        let before = dev.allocated_bytes();
        let model = Llama::new(&mut dev, &cfg, batch, seq).unwrap();
        let want = Llama::activation_bytes(&cfg, batch, seq).unwrap();
        assert_eq!(dev.allocated_bytes() - before, want);
        model.free(&mut dev).unwrap();
        assert_eq!(dev.allocated_bytes(), before);
    }
    // The 1B preset's size is computed; an absurd batch overflows into an error.
    let c = presets::llama_1b();
    let bytes = Llama::activation_bytes(&c, 1, 2048).unwrap();
    assert!(bytes > 0);
    assert!(Llama::activation_bytes(&c, usize::MAX, 2).is_err());
}

/// Loss, gradients (two microbatches accumulated) and ready order of one model build.
fn step_bits(
    cfg: &LlamaConfig,
    mode: MatmulMode,
    r: Recompute,
) -> (Vec<u32>, Vec<Vec<u32>>, Vec<usize>, usize) {
    step_bits_built(cfg, mode, mode, r)
}

/// [`step_bits`] of a model built with the device in mode `built` and run in `mode`.
fn step_bits_built(
    cfg: &LlamaConfig,
    built: MatmulMode,
    mode: MatmulMode,
    r: Recompute,
) -> (Vec<u32>, Vec<Vec<u32>>, Vec<usize>, usize) {
    let (batch, seq) = (2, 5);
    let mut dev = Device::cpu();
    dev.set_matmul_mode(built);
    let mut hooks = TestHooks::new(&mut dev, &test_params(cfg, 4, 0.5));
    let before = dev.allocated_bytes();
    let model = Llama::with_recompute(&mut dev, cfg, batch, seq, r).unwrap();
    let bytes = dev.allocated_bytes() - before;
    dev.set_matmul_mode(mode);
    assert_eq!(model.recompute(), r);
    let mut losses = Vec::new();
    for mb in 0..2 {
        let tokens = test_tokens(10 + mb, batch * seq, cfg.vocab);
        let targets = test_tokens(20 + mb, batch * seq, cfg.vocab);
        let loss = model
            .forward_backward(&mut dev, &mut hooks, &tokens, &targets, 0.5)
            .unwrap();
        losses.push(loss.to_bits());
    }
    let grads = hooks.grads(&dev);
    let bits = grads
        .iter()
        .map(|g| g.iter().map(|v| v.to_bits()).collect())
        .collect();
    (losses, bits, hooks.ready(), bytes)
}

#[test]
fn recompute_changes_no_bit_and_keeps_less() {
    let base = LlamaConfig {
        layers: 2,
        heads: 4,
        kv_heads: 2,
        ..small()
    };
    let untied = LlamaConfig {
        tied: false,
        ..base.clone()
    };
    for cfg in [base, untied] {
        for mode in [MatmulMode::Exact, MatmulMode::Bf16] {
            let off = step_bits(&cfg, mode, Recompute::Off);
            let mut last = off.3;
            for r in &Recompute::ALL[1..] {
                let got = step_bits(&cfg, mode, *r);
                assert_eq!(got.0, off.0, "{r} {mode:?}: losses");
                let differs = (0..off.1.len()).find(|&p| got.1[p] != off.1[p]);
                assert_eq!(
                    differs, None,
                    "{r} {mode:?}: the first parameter whose gradient differs"
                );
                assert_eq!(got.2, off.2, "{r} {mode:?}: ready order");
                assert!(got.3 < last, "{r}: {} bytes, the level below {last}", got.3);
                let want = Llama::activation_bytes_in(&cfg, 2, 5, *r, mode).unwrap();
                assert_eq!(got.3, want);
                last = got.3;
            }
        }
    }
}

/// Built in the bf16 mode, the model keeps n₁, n₂ and SwiGLU's product in bf16 (and, at a head
/// size the flash attention serves, the rotated q and k and the attention's output): the same
/// bits as the f32 copies the bf16 products and the flash attention would round (a model built
/// in the exact mode, run in the bf16 mode), at every recompute level, in fewer bytes.
#[test]
fn bf16_activations_change_no_bit_of_the_bf16_mode() {
    let heads4 = LlamaConfig {
        layers: 2,
        heads: 4,
        kv_heads: 2,
        ..small()
    };
    // ffn ≥ (q + k widths) / 2: the q and k gradients go to the MLP work buffer in bf16.
    let flash = LlamaConfig {
        head_dim: 64,
        heads: 2,
        kv_heads: 1,
        ffn: 128,
        ..heads4.clone()
    };
    for (cfg, r) in [heads4, flash]
        .iter()
        .flat_map(|c| Recompute::ALL.map(|r| (c, r)))
    {
        let f32_acts = step_bits_built(cfg, MatmulMode::Exact, MatmulMode::Bf16, r);
        let bf16_acts = step_bits(cfg, MatmulMode::Bf16, r);
        assert_eq!(bf16_acts.0, f32_acts.0, "{r} hd {}: losses", cfg.head_dim);
        assert_eq!(
            bf16_acts.1, f32_acts.1,
            "{r} hd {}: gradients",
            cfg.head_dim
        );
        assert_eq!(bf16_acts.2, f32_acts.2, "{r}: ready order");
        if r != Recompute::Full {
            assert!(bf16_acts.3 < f32_acts.3, "{r}: {} bytes", bf16_acts.3);
        }
    }
}

#[test]
fn activation_memory_follows_the_closed_form() {
    // Llama-3.2-1B at 8 × 2048: per layer 4 bytes × rows × the kept widths (x, n₁, h, n₂: 2048;
    // q, attention output: 32 × 64; k, v: 8 × 64; 32 log-sum-exps; gate, up, product: 8192; two
    // inverse RMS).
    let c = presets::llama_1b();
    let rows = 8 * 2048;
    let widths = [
        (
            Recompute::Off,
            2048 * 4 + 2048 * 2 + 512 * 2 + 32 + 8192 * 3 + 2,
        ),
        (
            Recompute::Selective,
            2048 * 2 + 2048 * 2 + 512 * 2 + 32 + 8192 * 2,
        ),
        (Recompute::Mlp, 2048 * 2 + 2048 * 2 + 512 * 2 + 32),
        (Recompute::Full, 2048),
    ];
    let fixed = Llama::activation_breakdown(&c, 8, 2048, Recompute::Off, MatmulMode::Exact)
        .unwrap()
        .fixed;
    for (r, w) in widths {
        let b = Llama::activation_breakdown(&c, 8, 2048, r, MatmulMode::Exact).unwrap();
        assert_eq!(b.per_layer, 4 * rows * w, "{r}");
        assert_eq!(
            b.total(c.layers),
            Some(Llama::activation_bytes_with(&c, 8, 2048, r).unwrap())
        );
        // What the layers no longer keep comes back once, in the shared slot.
        let shared = 4 * rows * (widths[0].1 - w);
        assert_eq!(b.fixed, fixed + shared, "{r}");
        eprintln!(
            "llama-1b 8x2048 recompute {r}: {:.2} GiB per layer, {:.2} GiB in all",
            b.per_layer as f64 / (1u64 << 30) as f64,
            b.total(c.layers).unwrap() as f64 / (1u64 << 30) as f64
        );
    }
}

#[test]
fn llama_tiny_trains_a_step_at_the_ci_shape() {
    let cfg = presets::llama_tiny();
    let mut dev = Device::cpu();
    let values = params::init(&cfg, 3);
    let mut hooks = TestHooks::new(&mut dev, &values);
    let model = Llama::new(&mut dev, &cfg, 8, 32).unwrap();
    let tokens = test_tokens(8, 8 * 32, 257);
    let targets = test_tokens(9, 8 * 32, 257);
    let t = std::time::Instant::now();
    let loss = model
        .forward_backward(&mut dev, &mut hooks, &tokens, &targets, 1.0)
        .unwrap();
    eprintln!("llama-tiny 8x32 forward+backward: {:?}", t.elapsed());
    // At init the logits are near zero: the loss is near ln(vocab).
    assert!((loss - (288f32).ln()).abs() < 0.1, "{loss}");
    let n = params::params(&cfg).len();
    assert_eq!(hooks.ready(), (0..n).rev().collect::<Vec<_>>());
    assert!(
        hooks
            .grads(&dev)
            .iter()
            .all(|g| g.iter().all(|v| v.is_finite()))
    );
}
