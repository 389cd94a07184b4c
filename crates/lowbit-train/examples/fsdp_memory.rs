//! Bytes per parameter on one rank for each FSDP strategy, for a 1B and an 8B decoder layout at
//! dp = 8 (closed form, nothing allocated): weights, gradients, fp32 masters and AdamW state,
//! and the transient peak of a step (communication buckets, gathered units; a unit is one
//! transformer layer, overlap on). bf16 weights with fp32 main gradients and communication;
//! then MXFP8 primary weights (`no_shard` cannot hold them: nothing would gather them).
//!
//! `cargo run --release -p lowbit-train --example fsdp_memory [-- DP]`

use lowbit_buffers::Overlap;
use lowbit_buffers::layout::{
    BufferKey, GradDType, OptimizerId, ParamSpec, ParamStorage, QuantKind,
};
use lowbit_train::fsdp::{FsdpConfig, Sharding, estimate_memory};

/// A decoder: (name, layers, hidden, ffn, kv width, vocab); embeddings and norms bf16.
const MODELS: [(&str, usize, usize, usize, usize, usize); 2] = [
    (
        "1B (18 x 2048, ffn 8192, vocab 32768)",
        18,
        2048,
        8192,
        2048,
        32768,
    ),
    (
        "8B (Llama-3-8B: 32 x 4096, ffn 14336, kv 1024, vocab 128256)",
        32,
        4096,
        14336,
        1024,
        128_256,
    ),
];

fn layout(m: (&str, usize, usize, usize, usize, usize), matrices: ParamStorage) -> Vec<ParamSpec> {
    let (_, layers, h, f, kv, vocab) = m;
    let key = |s| BufferKey::new(s, GradDType::F32, OptimizerId(0));
    let mut v = vec![ParamSpec::new(
        "embed",
        vec![vocab, h],
        key(ParamStorage::Bf16),
    )];
    for l in 0..layers {
        for (name, shape) in [
            ("qkv", vec![h + 2 * kv, h]),
            ("proj", vec![h, h]),
            ("fc1", vec![2 * f, h]),
            ("fc2", vec![h, f]),
        ] {
            v.push(ParamSpec::new(
                format!("layers.{l}.{name}"),
                shape,
                key(matrices),
            ));
        }
        for name in ["norm1", "norm2"] {
            v.push(ParamSpec::new(
                format!("layers.{l}.{name}"),
                vec![h],
                key(ParamStorage::Bf16),
            ));
        }
    }
    v.push(ParamSpec::new(
        "head",
        vec![vocab, h],
        key(ParamStorage::Bf16),
    ));
    v
}

fn main() {
    let dp = std::env::args().nth(1).map_or(8, |a| {
        lowbit_dev_support::cli::bounded_or_exit("fsdp_memory", "DP", &a, 1..=65536)
    });
    for m in MODELS {
        let (_, _, h, f, kv, _) = m;
        let unit = (h + 2 * kv) * h + h * h + 3 * f * h;
        for (label, storage) in [
            ("bf16 weights", ParamStorage::Bf16),
            ("MXFP8 weights", ParamStorage::Quantized(QuantKind::Mxfp8)),
        ] {
            let specs = layout(m, storage);
            let params: usize = specs.iter().map(|s| s.numel).sum();
            println!(
                "\n{}, {label}, dp {dp}: bytes per parameter on one rank",
                m.0
            );
            println!("| | no_shard | optim | optim_grads | optim_grads_params |");
            println!("|---|---|---|---|---|");
            let mut rows: Vec<(&str, Vec<String>)> = [
                "weights",
                "gradients",
                "masters + AdamW",
                "transient peak",
                "total",
            ]
            .iter()
            .map(|r| (*r, Vec::new()))
            .collect();
            for sharding in Sharding::ALL {
                let overlap = match sharding {
                    Sharding::NoShard => Overlap::GradReduce,
                    _ => Overlap::GradReduceAndParamGather,
                };
                let cfg = FsdpConfig::new(sharding)
                    .with_overlap(overlap)
                    .with_bucket_size(Some(unit));
                let Ok(mem) = estimate_memory(&specs, dp, &cfg) else {
                    rows.iter_mut().for_each(|r| r.1.push("-".into()));
                    continue;
                };
                let mut s = specs.clone();
                cfg.apply(&mut s);
                let owned: usize = if sharding == Sharding::NoShard {
                    params
                } else {
                    params.div_ceil(dp)
                };
                let weights: usize = mem.buffers.iter().map(|b| b.weights + b.staging_own).sum();
                let grads: usize = mem.buffers.iter().map(|b| b.grads).sum();
                // fp32 master and two fp32 AdamW moments per owned element.
                let opt = 12 * owned;
                let per = |b: usize| format!("{:.2}", b as f64 / params as f64);
                let total = weights + grads + opt + mem.transient;
                for (r, b) in rows
                    .iter_mut()
                    .zip([weights, grads, opt, mem.transient, total])
                {
                    r.1.push(per(b));
                }
            }
            for (name, cells) in rows {
                println!("| {name} | {} |", cells.join(" | "));
            }
        }
    }
}
