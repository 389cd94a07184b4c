//! The whole decoder in the fast mode ([`MatmulMode::Bf16`]) on CUDA: tensor-core GEMMs and
//! the fast memory-bound kernels. Two runs give the same bits (the step is deterministic), and
//! the loss and every gradient stay within stated tolerances of the CPU in the same mode
//! (which multiplies the same bf16 operands, summing in index order). Needs a CUDA GPU
//! (ordinal 0) and cuBLASLt on the library path.
#![cfg(feature = "cuda")]

mod support;

use lowbit_device::{Device, MatmulMode};
use lowbit_llama::{Llama, LlamaConfig, presets};
use support::{TestHooks, test_params, test_tokens};

/// Loss, gradients and eval loss.
type Run = (f32, Vec<Vec<f32>>, f32);

fn run(dev: &mut Device, cfg: &LlamaConfig, batch: usize, seq: usize) -> Run {
    dev.set_matmul_mode(MatmulMode::Bf16);
    let values = test_params(cfg, 31, 0.2);
    let mut hooks = TestHooks::new(dev, &values);
    let model = Llama::new(dev, cfg, batch, seq).unwrap();
    let tokens = test_tokens(1, batch * seq, cfg.vocab);
    let targets = test_tokens(2, batch * seq, cfg.vocab);
    let loss = model
        .forward_backward(dev, &mut hooks, &tokens, &targets, 1.0)
        .unwrap();
    let grads = hooks.grads(dev);
    let eval = model.eval_loss(dev, &mut hooks, &tokens, &targets).unwrap();
    model.free(dev).unwrap();
    (loss, grads, eval)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Stated tolerances against the CPU's bf16 mode: the loss within 1e-4 relative, each
/// parameter's gradient within 2e-2 of its largest CPU magnitude (the GEMMs' summation order
/// differs too, and bf16 rounding of activations that differ in their last f32 bits can flip).
fn fast_model_within_tolerance(cfg: &LlamaConfig, batch: usize, seq: usize) {
    let mut gpu = Device::cuda(0).expect("this test needs a CUDA GPU (ordinal 0)");
    let a = run(&mut gpu, cfg, batch, seq);
    let b = run(&mut gpu, cfg, batch, seq);
    assert_eq!(a.0.to_bits(), b.0.to_bits(), "loss: two runs");
    assert_eq!(a.2.to_bits(), b.2.to_bits(), "eval loss: two runs");
    for (p, (x, y)) in a.1.iter().zip(&b.1).enumerate() {
        assert_eq!(bits(x), bits(y), "parameter {p}'s gradient: two runs");
    }
    let want = run(&mut Device::cpu(), cfg, batch, seq);
    let dl = ((a.0 - want.0) / want.0).abs();
    let de = ((a.2 - want.2) / want.2).abs();
    let mut worst = 0f32;
    for (g, w) in a.1.iter().zip(&want.1) {
        let scale = w.iter().fold(f32::MIN_POSITIVE, |m, v| m.max(v.abs()));
        let d = g.iter().zip(w).fold(0f32, |m, (g, w)| m.max((g - w).abs()));
        worst = worst.max(d / scale);
    }
    println!(
        "fast vs CPU bf16 mode: loss {dl:.2e}, eval {de:.2e} relative; gradients {worst:.2e} of their scale"
    );
    assert!(dl <= 1e-4 && de <= 1e-4, "loss {dl}, eval {de}");
    assert!(worst <= 2e-2, "gradients {worst}");
    assert!(
        gpu.host_fallback_calls().is_empty(),
        "{:?}",
        gpu.host_fallback_calls()
    );
}

#[test]
fn llama_tiny_fast_mode_is_deterministic_and_close_to_the_cpu() {
    fast_model_within_tolerance(&presets::llama_tiny(), 8, 32);
}

/// A vocabulary past 4096 takes the CTA-per-row cross-entropy.
#[test]
fn large_vocab_fast_mode_is_deterministic_and_close_to_the_cpu() {
    let cfg = LlamaConfig {
        vocab: 5003,
        ..presets::llama_tiny()
    };
    fast_model_within_tolerance(&cfg, 2, 16);
}
