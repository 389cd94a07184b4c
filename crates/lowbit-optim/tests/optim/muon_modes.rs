//! Muon's Newton–Schulz modes on the CPU: `NsMode::Fast` falls back to the exact mode there, bit
//! for bit (wide, tall and square matrices, a grouped expert tensor, three steps), and Fast with
//! an f32 iterate is refused (tensor-core inputs are bf16). The GPU side (Fast on cuBLASLt, its
//! deviation from Exact) is `benches/muon_bench.rs`.

use lowbit_buffers::protocol::StepProtocol;
use std::time::Duration;

use lowbit_buffers::layout::{
    BufferKey, GradDType, OptimizerId, ParamSpec, ParamStorage, PlanConfig, ShardingPlan,
    ShardingStrategy,
};
use lowbit_buffers::{DataParallelBuffers, DdpConfig, Overlap, Verify};
use lowbit_comm::{GroupConfig, run_ranks};
use lowbit_device::Device;
use lowbit_optim::{
    InvalidInput, Muon, MuonConfig, NsDtype, NsMode, OptimConfig, OptimError, Optimizer,
    init_from_full,
};
use lowbit_train::protocol;

fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect()
}

/// Masters after each of `steps` steps with `cfg`, one rank.
fn train(cfg: MuonConfig, steps: usize) -> Vec<Vec<Vec<u32>>> {
    let shapes: Vec<Vec<usize>> = vec![vec![6, 20], vec![20, 6], vec![12, 12], vec![3, 8, 5]];
    let key = BufferKey::new(ParamStorage::F32, GradDType::F32, OptimizerId(0));
    let specs: Vec<ParamSpec> = shapes
        .iter()
        .enumerate()
        .map(|(i, s)| ParamSpec::new(format!("w{i}"), s.clone(), key))
        .collect();
    let init: Vec<Vec<f32>> = specs
        .iter()
        .enumerate()
        .map(|(i, s)| values(i as u64, s.numel))
        .collect();
    run_ranks(
        1,
        GroupConfig::default().with_timeout(Duration::from_secs(60)),
        |mut comm, mut dev: Device| {
            let dev = &mut dev;
            let plan = ShardingPlan::new(&specs, &PlanConfig::new(1, ShardingStrategy::LayerWise))
                .unwrap();
            let dcfg = DdpConfig::default()
                .with_sharding(ShardingStrategy::LayerWise)
                .with_overlap(Overlap::None)
                .with_verify(Verify::Full);
            let mut bufs =
                DataParallelBuffers::with_plan(dev, 0, specs.clone(), plan, dcfg).unwrap();
            bufs.initialize_all(dev, |p| init[p].clone()).unwrap();
            let mut opt = Muon::new(
                dev,
                &bufs,
                OptimizerId(0),
                cfg,
                OptimConfig::new(0.05),
                &mut init_from_full(&init),
            )
            .unwrap();
            let mut out = Vec::new();
            for t in 0..steps {
                protocol::begin_iteration(dev, &mut comm, &mut bufs, &opt).unwrap();
                for (p, s) in specs.iter().enumerate() {
                    let g = bufs.accumulation_view(dev, p).unwrap();
                    dev.upload(g, &values(100 + (t * 10 + p) as u64, s.numel))
                        .unwrap();
                }
                bufs.finish_grad_sync(dev, &mut comm).unwrap();
                protocol::step(dev, &mut comm, &mut bufs, &mut opt).unwrap();
                let mut m = opt.masters(dev).unwrap();
                m.sort_by_key(|s| s.param);
                out.push(
                    m.into_iter()
                        .map(|s| s.values.iter().map(|v| v.to_bits()).collect())
                        .collect(),
                );
            }
            out
        },
    )
    .pop()
    .unwrap()
    .unwrap()
}

#[test]
fn fast_is_exact_on_the_cpu() {
    let exact = train(MuonConfig::default(), 3);
    let fast = train(MuonConfig::default().with_ns_mode(NsMode::Fast), 3);
    assert_eq!(exact, fast);
    // And the steps did something.
    assert_ne!(exact[0], exact[2]);
}

#[test]
fn exact_is_the_default() {
    assert_eq!(MuonConfig::default().ns_mode, NsMode::Exact);
    assert_eq!(NsMode::default(), NsMode::Exact);
}

#[test]
fn fast_needs_a_bf16_iterate() {
    let cfg = MuonConfig::default()
        .with_ns_mode(NsMode::Fast)
        .with_ns_dtype(NsDtype::F32);
    assert!(matches!(
        cfg.validate(),
        Err(OptimError::Invalid(InvalidInput::Hyper {
            rule: "Muon",
            ..
        }))
    ));
    assert!(
        MuonConfig::default()
            .with_ns_mode(NsMode::Fast)
            .validate()
            .is_ok()
    );
}
