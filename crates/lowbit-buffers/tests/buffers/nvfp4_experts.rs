//! NVFP4 primary storage of grouped expert tensors (`[experts, out, in]`, Megatron-LM PR #5464): every
//! expert is a 2D NVFP4 matrix of its own with its own global amax. After `initialize` and
//! after a stage + gather from owned pieces that cut through experts (dp 1 to 4), each expert's
//! copies and amax equal quantizing that expert's `bf16(values)` alone; what compute reads
//! (`DpHooks::param`, forward and backward) is bit for bit the same with primary storage (gather
//! on), with bf16 weights quantized on the fly (gather off) and with discrete per-expert
//! parameters. Tiles that would straddle experts, policies that count other experts and
//! tampered weights are typed errors; memory equals its closed form and the allocations.

use crate::common;

use common::{
    NVFP4, download_f32, free_pieces, run, seed, spec, stage_pieces, upload_f32, values,
    write_fused_outputs,
};
use lowbit_buffers::layout::{GradDType, LayoutError, OptimizerId, ParamSpec, ParamStorage};
use lowbit_buffers::protocol::StepProtocol;
use lowbit_buffers::{
    BufferError, ComputeFormat, ConfigError, DataParallelBuffers, DdpConfig, DpHooks, HookMode,
    HookScratch, Hooks, Overlap, ParamCompute, PrecisionPolicy, Usage, Verify, dequant_nvfp4,
    estimate_buffer_memory, nvfp4_weight_config, plan_buffer_memory,
};
use lowbit_comm::Communicator;
use lowbit_device::{DType, Device, Nvfp4Views};

/// Grouped tensors of 4, 3 and 2 experts and a plain matrix between them.
const SHAPES: [&[usize]; 4] = [&[4, 32, 48], &[64, 32], &[3, 16, 64], &[2, 48, 32]];

/// Experts of a shape (`[experts, out, in]`), 1 for a matrix.
fn experts(shape: &[usize]) -> usize {
    if shape.len() == 3 { shape[0] } else { 1 }
}

fn grouped(storage: ParamStorage) -> Vec<ParamSpec> {
    let names = SHAPES.iter().enumerate();
    names
        .map(|(i, s)| spec(&format!("w{i}"), s, storage, GradDType::F32))
        .collect()
}

/// The same parameters with every expert a matrix of its own (`w0.1`, …).
fn discrete(storage: ParamStorage) -> Vec<ParamSpec> {
    let mut out = Vec::new();
    for (i, s) in SHAPES.iter().enumerate() {
        let m = &s[s.len() - 2..];
        for e in 0..experts(s) {
            out.push(spec(&format!("w{i}.{e}"), m, storage, GradDType::F32));
        }
    }
    out
}

/// Values whose experts differ in magnitude by powers of 4 (so one amax for the whole tensor
/// would give other bits), rows by powers of 2, with a few outliers.
fn weights(version: u64) -> Vec<Vec<f32>> {
    SHAPES
        .iter()
        .enumerate()
        .map(|(p, s)| {
            let n: usize = s.iter().product();
            let (per, cols) = (n / experts(s), s[s.len() - 1]);
            values(seed(&[version, p as u64, 4]), n, 1.0)
                .into_iter()
                .enumerate()
                .map(|(i, v)| {
                    let outlier = if i % 397 == 5 { 40.0 } else { 1.0 };
                    let scale = (1u32 << (2 * (i / per) + (i / cols) % 5)) as f32;
                    v * scale / 16.0 * outlier
                })
                .collect()
        })
        .collect()
}

/// `weights` split into the discrete parameters.
fn split(full: &[Vec<f32>]) -> Vec<Vec<f32>> {
    let mut out = Vec::new();
    for (s, v) in SHAPES.iter().zip(full) {
        out.extend(v.chunks(v.len() / experts(s)).map(<[f32]>::to_vec));
    }
    out
}

fn cfg(dp: usize) -> DdpConfig {
    DdpConfig::default()
        .with_sharding(lowbit_buffers::layout::ShardingStrategy::Distributed)
        .with_overlap(if dp == 2 {
            Overlap::GradReduce
        } else {
            Overlap::None
        })
        .with_bucket_size(Some(2500))
        .with_verify(Verify::Full)
}

/// Per expert: rowwise data and scales, columnwise data and scales, amax.
type ExpertBytes = Vec<Vec<Vec<u8>>>;

/// The stored NVFP4 weights of parameter `p`, expert by expert.
fn stored(dev: &mut Device, bufs: &DataParallelBuffers, p: usize) -> ExpertBytes {
    let (w, amax) = bufs.nvfp4_weights(p).expect("NVFP4 weights");
    assert_eq!(w.amaxes.len(), experts(&bufs.specs()[p].shape));
    assert_eq!(amax.to_bits(), w.amax().to_bits(), "the largest expert's");
    let experts = w.per_expert().unwrap();
    let mut out = Vec::new();
    for x in experts {
        let views = [x.rowwise.0, x.rowwise.1, x.columnwise.0, x.columnwise.1];
        let mut parts: Vec<Vec<u8>> = views.iter().map(|&v| dev.read_bytes(v).unwrap()).collect();
        parts.push(x.amax().to_le_bytes().to_vec());
        out.push(parts);
    }
    out
}

/// 2D NVFP4 of `bf16(vals)` as one `rows x cols` matrix, in [`stored`]'s parts.
fn quantized(dev: &mut Device, vals: &[f32], rows: usize, cols: usize) -> Vec<Vec<u8>> {
    let n = rows * cols;
    let f32v = upload_f32(dev, vals);
    let src = dev.alloc(DType::Bf16, n);
    dev.cast(f32v, src).unwrap();
    let v = [n / 2, n / 16, n / 2, n / 16].map(|k| dev.alloc(DType::U8, k));
    let views = Nvfp4Views {
        rowwise: Some((v[0], v[1])),
        columnwise: Some((v[2], v[3])),
    };
    let cfg = nvfp4_weight_config();
    let amax = dev.quantize_nvfp4(src, rows, cols, &cfg, &views).unwrap();
    let mut out: Vec<Vec<u8>> = v.iter().map(|&x| dev.read_bytes(x).unwrap()).collect();
    out.push(amax.rowwise.to_le_bytes().to_vec());
    for x in [f32v, src].into_iter().chain(v) {
        dev.free(x).unwrap();
    }
    out
}

/// Each expert of `vals` (a tensor of `shape`) quantized alone.
fn reference(dev: &mut Device, shape: &[usize], vals: &[f32]) -> ExpertBytes {
    let (e, cols) = (experts(shape), shape[shape.len() - 1]);
    let per = vals.len() / e;
    let rows = per / cols;
    vals.chunks(per)
        .map(|x| quantized(dev, x, rows, cols))
        .collect()
}

/// Whether some rank's owned piece of a grouped parameter starts or ends inside an expert.
fn cuts_through_an_expert(bufs: &DataParallelBuffers) -> bool {
    bufs.owned_shards().unwrap().iter().any(|s| {
        let shape = &bufs.specs()[s.param].shape;
        let per = shape.iter().product::<usize>() / experts(shape);
        let inside = |x: usize| !x.is_multiple_of(per);
        experts(shape) > 1 && (inside(s.param_range.start) || inside(s.param_range.end))
    })
}

/// Stages `next` (the owners' new masters) and gathers: the optimizer's side of a step.
fn stage_and_gather(
    dev: &mut Device,
    comm: &mut dyn Communicator,
    bufs: &mut DataParallelBuffers,
    next: &[Vec<f32>],
) {
    bufs.zero_grad_buffer(dev).unwrap();
    if bufs.is_low_precision(0) {
        bufs.mark_stale(OptimizerId(0));
        let pieces = stage_pieces(dev, bufs, next);
        bufs.stage(dev, comm, OptimizerId(0), &pieces).unwrap();
        free_pieces(dev, pieces);
    } else {
        write_fused_outputs(dev, bufs, next);
    }
    bufs.sync_params(dev, comm).unwrap();
}

#[test]
fn every_expert_is_quantized_alone_with_its_own_amax() {
    let specs = grouped(NVFP4);
    let (v0, v1) = (weights(0), weights(1));
    for dp in 1..=4 {
        let seen = run(dp, |mut comm, mut dev| {
            let dev = &mut dev;
            let mut bufs =
                DataParallelBuffers::new(dev, dp, comm.rank(), specs.clone(), cfg(dp)).unwrap();
            bufs.initialize_all(dev, |p| v0[p].clone()).unwrap();
            let init: Vec<_> = (0..specs.len()).map(|p| stored(dev, &bufs, p)).collect();
            stage_and_gather(dev, &mut comm, &mut bufs, &v1);
            let gathered: Vec<_> = (0..specs.len()).map(|p| stored(dev, &bufs, p)).collect();
            (init, gathered, cuts_through_an_expert(&bufs))
        });
        if dp > 1 {
            assert!(seen.iter().any(|s| s.2), "dp {dp}: no shard cuts an expert");
        }
        let mut dev = Device::cpu();
        for (p, s) in SHAPES.iter().enumerate() {
            let want0 = reference(&mut dev, s, &v0[p]);
            let want1 = reference(&mut dev, s, &v1[p]);
            for (rank, (init, gathered, _)) in seen.iter().enumerate() {
                let what = format!("dp {dp}, rank {rank}, w{p}");
                assert!(init[p] == want0, "{what}: initial weights");
                assert!(gathered[p] == want1, "{what}: gathered weights");
            }
            if experts(s) > 1 {
                // The test can tell: one amax for the whole tensor gives other bytes.
                let (cols, rows) = (s[2], v1[p].len() / s[2]);
                let whole = quantized(&mut dev, &v1[p], rows, cols);
                assert_ne!(whole[4], want1[0][4], "w{p}: one amax would do");
            }
        }
    }
}

/// What compute reads of every parameter (forward, then backward), as f32 bits.
fn computed(
    dev: &mut Device,
    comm: &mut dyn Communicator,
    bufs: &mut DataParallelBuffers,
    policy: &PrecisionPolicy,
) -> Vec<Vec<u32>> {
    let scratch = HookScratch::new(dev, bufs);
    let n = bufs.specs().len();
    let mut out = Vec::new();
    {
        let mut hooks = DpHooks::new(bufs, comm, policy, &scratch, HookMode::Eval);
        for usage in [Usage::Forward, Usage::Backward] {
            for p in 0..n {
                let v = hooks.param(dev, p, usage).unwrap();
                out.push(download_f32(dev, v).iter().map(|x| x.to_bits()).collect());
            }
        }
    }
    scratch.free(dev).unwrap();
    out
}

/// Grouped and discrete, stored NVFP4 and bf16 quantized on the fly: the compute weights after
/// `initialize` and after a stage + gather, concatenated per grouped parameter.
fn compute_weights(discrete_experts: bool, storage: ParamStorage, dp: usize) -> Vec<Vec<u32>> {
    let specs = if discrete_experts {
        discrete(storage)
    } else {
        grouped(storage)
    };
    let policy = PrecisionPolicy::new(
        specs
            .iter()
            .map(|s| ParamCompute::new(ComputeFormat::Nvfp4).with_experts(experts(&s.shape)))
            .collect(),
    );
    policy.validate(&specs).unwrap();
    let (mut v0, mut v1) = (weights(0), weights(1));
    if discrete_experts {
        (v0, v1) = (split(&v0), split(&v1));
    }
    let per_rank = run(dp, |mut comm, mut dev| {
        let dev = &mut dev;
        let mut bufs =
            DataParallelBuffers::new(dev, dp, comm.rank(), specs.clone(), cfg(dp)).unwrap();
        bufs.initialize_all(dev, |p| v0[p].clone()).unwrap();
        let mut seen = computed(dev, &mut comm, &mut bufs, &policy);
        stage_and_gather(dev, &mut comm, &mut bufs, &v1);
        seen.extend(computed(dev, &mut comm, &mut bufs, &policy));
        seen
    });
    for other in &per_rank[1..] {
        assert!(*other == per_rank[0], "ranks compute with the same weights");
    }
    // Discrete experts concatenated back into their grouped tensors.
    let mut groups = Vec::new();
    let mut it = per_rank[0].iter();
    for _ in 0..4 {
        for s in SHAPES {
            let k = if discrete_experts { experts(s) } else { 1 };
            groups.push(it.by_ref().take(k).flatten().copied().collect());
        }
    }
    groups
}

#[test]
fn stored_on_the_fly_grouped_and_discrete_compute_the_same_bits() {
    for dp in 1..=4 {
        let on = compute_weights(false, NVFP4, dp);
        assert_eq!(on.len(), 4 * SHAPES.len());
        let cases = [
            (false, ParamStorage::Bf16, "grouped, gather off"),
            (true, NVFP4, "discrete, gather on"),
            (true, ParamStorage::Bf16, "discrete, gather off"),
        ];
        for (discrete_experts, storage, what) in cases {
            let other = compute_weights(discrete_experts, storage, dp);
            for (i, (a, b)) in on.iter().zip(&other).enumerate() {
                assert!(a == b, "dp {dp}: {what}: weights {i} differ");
            }
        }
    }
}

#[test]
fn tiles_straddling_experts_are_refused() {
    // 16 rows in all (the plan's check passes) but 8 per expert.
    let specs = vec![spec("moe.fc1", &[2, 8, 32], NVFP4, GradDType::F32)];
    let refused = |e: BufferError| match e {
        BufferError::Layout(LayoutError::Nvfp4Tiles { name, rows, cols }) => {
            assert_eq!((rows, cols), (8, 32));
            assert!(
                name.contains("moe.fc1") && name.contains("2 experts"),
                "{name}"
            );
        }
        other => panic!("expected the tile error, got {other}"),
    };
    let mut dev = Device::cpu();
    refused(DataParallelBuffers::new(&mut dev, 1, 0, specs.clone(), cfg(1)).unwrap_err());
    refused(estimate_buffer_memory(&specs, 2, &cfg(2)).unwrap_err());
    // bf16 storage has no tiles.
    let bf16 = vec![spec(
        "moe.fc1",
        &[2, 8, 32],
        ParamStorage::Bf16,
        GradDType::F32,
    )];
    DataParallelBuffers::new(&mut dev, 1, 0, bf16, cfg(1)).unwrap();
}

#[test]
fn a_policy_counting_other_experts_is_refused() {
    let shape = [4usize, 32, 48];
    for (storage, experts, ok) in [
        (NVFP4, 4, true),
        (NVFP4, 1, false),
        (NVFP4, 2, false),
        (NVFP4, 3, false),
        (ParamStorage::Bf16, 4, true),
        (ParamStorage::Bf16, 2, true),
        (ParamStorage::Bf16, 3, false),
    ] {
        let specs = vec![spec("w", &shape, storage, GradDType::F32)];
        let policy = PrecisionPolicy::new(vec![
            ParamCompute::new(ComputeFormat::Nvfp4).with_experts(experts),
        ]);
        match policy.validate(&specs) {
            Ok(()) => assert!(ok, "{storage:?}, {experts} experts accepted"),
            Err(BufferError::Config(ConfigError::Policy(m))) => {
                assert!(!ok, "{storage:?}, {experts} experts refused: {m}");
                assert!(m.contains("`w`"), "{m}");
            }
            Err(other) => panic!("expected a policy error, got {other}"),
        }
    }
}

#[test]
fn tampered_expert_counts_are_errors_not_panics() {
    let specs = grouped(NVFP4);
    let mut dev = Device::cpu();
    let mut bufs = DataParallelBuffers::new(&mut dev, 1, 0, specs, cfg(1)).unwrap();
    let v0 = weights(0);
    bufs.initialize_all(&mut dev, |p| v0[p].clone()).unwrap();
    let (w, _) = bufs.nvfp4_weights(0).unwrap();
    let out = dev.alloc(DType::F32, w.rows * w.cols);
    for amaxes in [vec![], vec![1.0; 3], vec![1.0; 5]] {
        let bad = lowbit_buffers::Nvfp4Weights {
            amaxes: amaxes.clone(),
            ..w.clone()
        };
        let split = |e: BufferError| {
            assert!(
                matches!(e, BufferError::Layout(LayoutError::ExpertSplit { .. })),
                "{} experts: {e}",
                amaxes.len()
            )
        };
        split(bad.per_expert().unwrap_err());
        split(dequant_nvfp4(&mut dev, &bad, Usage::Forward, out).unwrap_err());
    }
    // And an output of the wrong size is the device's error.
    let short = out.slice(0..w.rows * w.cols - 16).unwrap();
    assert!(dequant_nvfp4(&mut dev, &w, Usage::Backward, short).is_err());
}

#[test]
fn memory_is_the_closed_form_and_the_allocations() {
    for dp in 1..=3 {
        let specs = grouped(NVFP4);
        let mut dev = Device::cpu();
        let before = dev.allocated_bytes();
        let bufs = DataParallelBuffers::new(&mut dev, dp, dp - 1, specs.clone(), cfg(dp)).unwrap();
        let allocated = dev.allocated_bytes() - before;
        let measured = bufs.memory();
        assert_eq!(measured, plan_buffer_memory(bufs.plan(), &specs, &cfg(dp)));
        assert_eq!(
            measured,
            estimate_buffer_memory(&specs, dp, &cfg(dp)).unwrap()
        );
        let total: usize = measured.iter().map(|b| b.weights + b.grads).sum();
        assert_eq!(allocated, total, "dp {dp}");
        // Per expert the same bytes as a matrix of its own: the outside parts (rowwise
        // scales, the columnwise copy, tile amaxes) of grouped and discrete storage agree.
        let outside = |specs: &[ParamSpec]| -> usize {
            let mem = estimate_buffer_memory(specs, dp, &cfg(dp)).unwrap();
            mem.iter().map(|b| b.weights - b.numel / 2).sum()
        };
        assert_eq!(outside(&specs), outside(&discrete(NVFP4)), "dp {dp}");
    }
}
