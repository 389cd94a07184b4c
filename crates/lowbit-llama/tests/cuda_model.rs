//! The whole decoder on the CUDA backend gives the CPU backend's bytes: the loss, every
//! parameter's gradient, the eval loss and next-token logits, on `llama-tiny` at the CI batch
//! shape and on a grouped, untied shape with llama3 RoPE scaling. Needs a CUDA GPU (ordinal 0).
#![cfg(feature = "cuda")]

mod support;

use lowbit_device::Device;
use lowbit_llama::{Llama, Llama3RopeScaling, LlamaConfig, presets};
use support::{TestHooks, test_params, test_tokens};

/// Loss, gradients, eval loss and next logits as bits.
type Bits = (u32, Vec<Vec<u32>>, u32, Vec<u32>);

fn run(dev: &mut Device, cfg: &LlamaConfig, batch: usize, seq: usize) -> Bits {
    let values = test_params(cfg, 31, 0.2);
    let mut hooks = TestHooks::new(dev, &values);
    let model = Llama::new(dev, cfg, batch, seq).unwrap();
    let tokens = test_tokens(1, batch * seq, cfg.vocab);
    let targets = test_tokens(2, batch * seq, cfg.vocab);
    let loss = model
        .forward_backward(dev, &mut hooks, &tokens, &targets, 1.0)
        .unwrap();
    let grads = hooks
        .grads(dev)
        .iter()
        .map(|g| g.iter().map(|v| v.to_bits()).collect())
        .collect();
    let eval = model.eval_loss(dev, &mut hooks, &tokens, &targets).unwrap();
    let logits = model
        .next_logits(dev, &mut hooks, &tokens[..seq - 1])
        .unwrap();
    (
        loss.to_bits(),
        grads,
        eval.to_bits(),
        logits.iter().map(|v| v.to_bits()).collect(),
    )
}

fn same_bits(cfg: &LlamaConfig, batch: usize, seq: usize) {
    let mut cpu = Device::cpu();
    let mut gpu = Device::cuda(0).expect("this test needs a CUDA GPU (ordinal 0)");
    let want = run(&mut cpu, cfg, batch, seq);
    let got = run(&mut gpu, cfg, batch, seq);
    assert_eq!(got.0, want.0, "loss");
    for (p, (g, w)) in got.1.iter().zip(&want.1).enumerate() {
        let diff = g.iter().zip(w).filter(|(a, b)| a != b).count();
        assert_eq!(
            diff,
            0,
            "parameter {p}: {diff} of {} gradient bits differ",
            w.len()
        );
    }
    assert_eq!(got.2, want.2, "eval loss");
    assert_eq!(got.3, want.3, "next logits");
    assert!(
        gpu.host_fallback_calls().is_empty(),
        "{:?}",
        gpu.host_fallback_calls()
    );
}

#[test]
fn llama_tiny_on_cuda_is_the_cpu_bit_for_bit() {
    same_bits(&presets::llama_tiny(), 8, 32);
}

#[test]
fn grouped_untied_scaled_on_cuda_is_the_cpu_bit_for_bit() {
    let cfg = LlamaConfig {
        vocab: 77,
        dim: 48,
        layers: 2,
        heads: 6,
        kv_heads: 2,
        head_dim: 8,
        ffn: 80,
        rope_scaling: Some(Llama3RopeScaling {
            factor: 4.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 32,
        }),
        tied: false,
        max_seq: 64,
        ..presets::llama_tiny()
    };
    same_bits(&cfg, 3, 17);
}
