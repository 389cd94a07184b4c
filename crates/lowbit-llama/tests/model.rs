//! The model's surface: bad input refused before any op, next-token logits against the f64
//! reference, the memory pre-check equal to what is allocated, generation through the model, and
//! `llama-tiny` at the CI batch shape.

mod support;

use lowbit_device::Device;
use lowbit_llama::generate::{Sampler, Sampling, generate};
use lowbit_llama::{Llama, LlamaConfig, LlamaError, params, presets};
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
    // The 1B preset's chunk keeps its logits within 64 MiB.
    let c = presets::llama_1b();
    let bytes = Llama::activation_bytes(&c, 1, 2048).unwrap();
    assert!(bytes > 0);
    assert!(Llama::activation_bytes(&c, usize::MAX, 2).is_err());
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
