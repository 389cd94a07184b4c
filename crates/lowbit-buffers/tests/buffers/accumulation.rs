//! `GradAccumulation::Fused` (straight into the buffer) and `Unfused` (a per-parameter f32
//! gradient added into the buffer when the parameter is reported ready) give the same gradient
//! bytes: the buffer element gets one rounding of `old + g` either way. Checked with a small
//! model trained through `DpHooks` over several microbatches, for f32 and bf16 gradients, on
//! every byte of every rank's gradient buffer after the reduction.

use crate::common;

use common::model::Mlp;
use common::{run, spec};
use lowbit_buffers::layout::{GradDType, ParamSpec, ParamStorage, ShardingStrategy};
use lowbit_buffers::protocol::StepProtocol;
use lowbit_buffers::{
    DataParallelBuffers, DdpConfig, DpHooks, GradAccumulation, HookMode, HookScratch, Overlap,
    PrecisionPolicy, Verify,
};
use lowbit_comm::Communicator;

const DIMS: [usize; 4] = [16, 32, 48, 16];
const MICROBATCHES: usize = 3;

fn specs(grad: GradDType) -> Vec<ParamSpec> {
    Mlp::params(&DIMS)
        .iter()
        .map(|(name, shape)| spec(name, shape, ParamStorage::Bf16, grad))
        .collect()
}

/// Every rank's gradient buffer bytes (per parameter) after each of two iterations.
fn gradients(acc: GradAccumulation, grad: GradDType, dp: usize) -> Vec<Vec<Vec<Vec<u8>>>> {
    let specs = specs(grad);
    let init: Vec<Vec<f32>> = specs
        .iter()
        .enumerate()
        .map(|(p, s)| common::values(common::seed(&[p as u64, 5]), s.numel, 0.3))
        .collect();
    run(dp, |mut comm, mut dev| {
        let dev = &mut dev;
        let cfg = DdpConfig::default()
            .with_sharding(ShardingStrategy::Distributed)
            .with_overlap(Overlap::GradReduce)
            .with_bucket_size(Some(1000))
            .with_grad_accumulation(acc)
            .with_verify(Verify::Full);
        let mut bufs = DataParallelBuffers::new(dev, dp, comm.rank(), specs.clone(), cfg).unwrap();
        bufs.initialize_all(dev, |p| init[p].clone()).unwrap();
        let mlp = Mlp::new(dev, &DIMS, 4);
        let policy = PrecisionPolicy::as_stored(specs.len());
        let scratch = HookScratch::new(dev, &bufs);
        let mut out = Vec::new();
        for step in 0..2 {
            bufs.zero_grad_buffer(dev).unwrap();
            for m in 0..MICROBATCHES {
                bufs.set_last_microbatch(m + 1 == MICROBATCHES);
                let (x, y) = mlp.sample(comm.rank(), step, m);
                let mut hooks =
                    DpHooks::new(&mut bufs, &mut comm, &policy, &scratch, HookMode::Train);
                mlp.forward_backward(dev, &mut hooks, &x, &y, 1.0 / MICROBATCHES as f32)
                    .unwrap();
            }
            bufs.finish_grad_sync(dev, &mut comm).unwrap();
            out.push(
                (0..specs.len())
                    .map(|p| dev.read_bytes(bufs.grad_view(p).unwrap()).unwrap())
                    .collect(),
            );
        }
        scratch.free(dev).unwrap();
        out
    })
}

#[test]
fn fused_and_unfused_accumulation_give_the_same_bytes() {
    for grad in [GradDType::F32, GradDType::Bf16] {
        let fused = gradients(GradAccumulation::Fused, grad, 2);
        let unfused = gradients(GradAccumulation::Unfused, grad, 2);
        // The comparison means something: gradients are non-trivial and change per step.
        for rank in &fused {
            for step in rank {
                assert!(step.iter().all(|g| g.iter().any(|&b| b != 0)), "{grad:?}");
            }
            assert_ne!(rank[0], rank[1], "{grad:?}");
        }
        assert!(
            fused == unfused,
            "{grad:?}: fused and unfused gradients differ"
        );
    }
}

/// Microbatches accumulate: the buffer after three microbatches is the f32 sum, in microbatch
/// order, of the three gradients computed one microbatch per iteration.
#[test]
fn microbatches_accumulate_into_the_buffer() {
    let accumulated = gradients(GradAccumulation::Fused, GradDType::F32, 1);
    let specs = specs(GradDType::F32);
    let init: Vec<Vec<f32>> = specs
        .iter()
        .enumerate()
        .map(|(p, s)| common::values(common::seed(&[p as u64, 5]), s.numel, 0.3))
        .collect();
    let single = run(1, |mut comm, mut dev| {
        let dev = &mut dev;
        let cfg = DdpConfig::default().with_verify(Verify::Full);
        let mut bufs = DataParallelBuffers::new(dev, 1, 0, specs.clone(), cfg).unwrap();
        bufs.initialize_all(dev, |p| init[p].clone()).unwrap();
        let mlp = Mlp::new(dev, &DIMS, 4);
        let policy = PrecisionPolicy::as_stored(specs.len());
        let scratch = HookScratch::new(dev, &bufs);
        let mut per_micro = Vec::new();
        for m in 0..MICROBATCHES {
            bufs.zero_grad_buffer(dev).unwrap();
            let (x, y) = mlp.sample(0, 0, m);
            let mut hooks = DpHooks::new(&mut bufs, &mut comm, &policy, &scratch, HookMode::Train);
            mlp.forward_backward(dev, &mut hooks, &x, &y, 1.0 / MICROBATCHES as f32)
                .unwrap();
            bufs.finish_grad_sync(dev, &mut comm).unwrap();
            let grads: Vec<Vec<f32>> = (0..specs.len())
                .map(|p| common::download_f32(dev, bufs.grad_view(p).unwrap()))
                .collect();
            per_micro.push(grads);
        }
        per_micro
    });
    let per_micro = &single[0];
    for (p, want) in accumulated[0][0].iter().enumerate() {
        let mut sum = vec![0.0f32; specs[p].numel];
        for grads in per_micro {
            sum.iter_mut().zip(&grads[p]).for_each(|(a, b)| *a += *b);
        }
        let got: Vec<u8> = sum.iter().flat_map(|x| x.to_le_bytes()).collect();
        assert_eq!(*want, got, "param {p}");
    }
}
