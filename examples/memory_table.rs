//! Prints the per-rank memory of a 1B-parameter decoder layout at dp = 8: MXFP8 primary weights
//! (staged gather, fp32 gradients, distributed AdamW) beside the bf16 baseline (bf16 weights,
//! fp32 gradients, fp32 masters and AdamW state, no sharding). Closed form from the layouts; no
//! memory is allocated.
//!
//! `cargo run --release --example memory_table [-- DP]`

use lowbit::buffers::layout::{
    BufferKey, GradDType, OptimizerId, ParamSpec, ParamStorage, QuantKind, ShardingStrategy,
};
use lowbit::buffers::{DdpConfig, Overlap};
use lowbit::optim::{RankMemory, estimate_memory};

/// A 1.04B-parameter decoder: 18 layers of hidden 2048 with a 4x MLP (bf16 norms), and a
/// 32768-entry embedding and output head kept in bf16 (as low-precision recipes do).
fn layout(matrix_storage: ParamStorage) -> Vec<ParamSpec> {
    let (h, f, vocab, layers) = (2048, 8192, 32768, 18);
    let key = |storage, owner| BufferKey {
        param_storage: storage,
        grad_dtype: GradDType::F32,
        expert: false,
        owner: OptimizerId(owner),
    };
    let mut v = vec![ParamSpec::new(
        "embed",
        vec![vocab, h],
        key(ParamStorage::Bf16, 1),
    )];
    for l in 0..layers {
        for (name, shape) in [
            ("qkv", vec![3 * h, h]),
            ("proj", vec![h, h]),
            ("fc1", vec![f, h]),
            ("fc2", vec![h, f]),
        ] {
            v.push(ParamSpec::new(
                format!("layers.{l}.{name}"),
                shape,
                key(matrix_storage, 0),
            ));
        }
        for name in ["norm1", "norm2"] {
            v.push(ParamSpec::new(
                format!("layers.{l}.{name}"),
                vec![h],
                key(ParamStorage::Bf16, 1),
            ));
        }
    }
    v.push(ParamSpec::new(
        "head",
        vec![vocab, h],
        key(ParamStorage::Bf16, 1),
    ));
    v
}

fn gib(b: usize) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

fn main() {
    let dp: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(8);
    // AdamW keeps two fp32 state tensors per element.
    let adamw = |_| 2;
    let ours_cfg = DdpConfig::default()
        .with_overlap(Overlap::GradReduceAndParamGather)
        .with_bucket_size(Some(40_000_000));
    let base_cfg = ours_cfg
        .with_sharding(ShardingStrategy::Replicated)
        .with_overlap(Overlap::GradReduce);
    let ours_specs = layout(ParamStorage::Quantized(QuantKind::Mxfp8));
    let params: usize = ours_specs.iter().map(|s| s.numel).sum();
    let ours: RankMemory = estimate_memory(&ours_specs, dp, 0, &ours_cfg, adamw).expect("layout");
    let base: RankMemory =
        estimate_memory(&layout(ParamStorage::Bf16), 1, 0, &base_cfg, adamw).expect("layout");
    println!(
        "{:.3}B parameters, rank 0 of dp = {dp}",
        params as f64 / 1e9
    );
    println!(
        "{:<22} {:>16} {:>22}",
        "category", "MXFP8 + ZeRO-1", "bf16, no sharding"
    );
    let rows = [
        ("weights", ours.weights(), base.weights()),
        ("staging (aliased)", ours.staging(), base.staging()),
        ("gradients (fp32)", ours.grads(), base.grads()),
        ("fp32 masters", ours.masters, base.masters),
        (
            "optimizer state",
            ours.optimizer_state,
            base.optimizer_state,
        ),
        ("fp32 grad scratch", ours.grad_scratch, base.grad_scratch),
        ("total", ours.total(), base.total()),
    ];
    for (name, a, b) in rows {
        println!("{name:<22} {:>16} {:>22}", gib(a), gib(b));
    }
    println!(
        "bytes per parameter: {:.2} vs {:.2}",
        ours.total() as f64 / params as f64,
        base.total() as f64 / params as f64
    );
}
