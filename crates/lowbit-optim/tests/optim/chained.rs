//! Chains: nested chains step exactly like flat ones; an owner may appear once in a chain
//! (nested parts included); every parameter's owner must be in the optimizer the trainer gets;
//! clipping uses one global norm over every part and rank and one clip factor; an invalid
//! learning rate changes nothing.

use crate::common;

use common::model::Mlp;
use common::{
    BATCH, DIMS, assemble, bits, buffers, init_values, leaf, master_bits, policy, run, specs,
    train_step, trainer,
};
use lowbit_buffers::layout::{GradDType, OptimizerId, ParamStorage};
use lowbit_buffers::{DataParallelBuffers, Overlap};
use lowbit_comm::Communicator;
use lowbit_device::Device;
use lowbit_optim::{
    ChainedOptimizer, InvalidInput, MasterShard, OptimConfig, OptimError, Optimizer,
    OptimizerMemory, OptimizerState,
};
use lowbit_train::Trainer;

fn bufs(dev: &mut Device, dp: usize, rank: usize, overlap: Overlap) -> DataParallelBuffers {
    let specs = specs(ParamStorage::Bf16, GradDType::F32, true);
    buffers(dev, dp, rank, &specs, overlap, &init_values(&specs))
}

fn boxed(o: impl Optimizer + 'static) -> Box<dyn Optimizer> {
    Box::new(o)
}

/// The optimizer shapes compared: flat, nested and deeply nested chains of the same two parts.
fn chain(dev: &mut Device, b: &DataParallelBuffers, shape: usize) -> ChainedOptimizer {
    let init = init_values(b.specs());
    let adamw = || OptimConfig::new(1e-2);
    let sgd = || OptimConfig::new(5e-2);
    let a = leaf(dev, b, 0, false, adamw(), &init);
    let s = leaf(dev, b, 1, true, sgd(), &init);
    match shape {
        0 => ChainedOptimizer::new(vec![boxed(a), boxed(s)]),
        1 => ChainedOptimizer::new(vec![
            boxed(ChainedOptimizer::new(vec![boxed(a)]).unwrap()),
            boxed(s),
        ]),
        _ => ChainedOptimizer::new(vec![
            boxed(
                ChainedOptimizer::new(vec![boxed(ChainedOptimizer::new(vec![boxed(a)]).unwrap())])
                    .unwrap(),
            ),
            boxed(ChainedOptimizer::new(vec![boxed(s)]).unwrap()),
        ]),
    }
    .unwrap()
}

/// After each step: masters, exported state, memory.
type Observed = (
    Vec<(usize, usize, Vec<u32>)>,
    Vec<OptimizerState>,
    OptimizerMemory,
);

/// For each variant `0..variants`, 2 ranks train the test model: buffers with `overlap`, the
/// chain `make(dev, bufs, variant)` builds, compute as stored, `steps` steps of `micro`
/// microbatches; what the optimizer holds after every step (its step count checked), per rank.
fn train_variants(
    variants: usize,
    overlap: Overlap,
    (steps, micro): (usize, usize),
    make: impl Fn(&mut Device, &DataParallelBuffers, usize) -> ChainedOptimizer + Sync,
) -> Vec<Vec<Vec<Observed>>> {
    (0..variants)
        .map(|variant| {
            run(2, |mut comm, mut dev| {
                let dev = &mut dev;
                let b = bufs(dev, 2, comm.rank(), overlap);
                let opt = make(dev, &b, variant);
                let mut trainer = trainer(dev, b, opt, false);
                let mlp = Mlp::new(dev, &DIMS, BATCH);
                (0..steps)
                    .map(|s| {
                        train_step(dev, &mut comm, &mut trainer, &mlp, s, micro, None);
                        let o = trainer.optimizer();
                        assert_eq!(o.steps(), s as u64 + 1);
                        (
                            master_bits(dev, o),
                            o.export_state(dev).unwrap(),
                            o.memory(),
                        )
                    })
                    .collect()
            })
        })
        .collect()
}

#[test]
fn nested_chains_step_like_flat_ones() {
    let results = train_variants(
        3,
        Overlap::GradReduceAndParamGather,
        (4, 2),
        |dev, b, shape| {
            let opt = chain(dev, b, shape);
            assert_eq!(opt.owners(), vec![OptimizerId(0), OptimizerId(1)]);
            opt
        },
    );
    assert!(results[0] == results[1], "one level of nesting");
    assert!(results[0] == results[2], "two levels of nesting");
    // Two leaf states, in chain order, whatever the nesting.
    let owners: Vec<OptimizerId> = results[2][0][3].1.iter().map(|s| s.owner).collect();
    assert_eq!(owners, vec![OptimizerId(0), OptimizerId(1)]);
}

#[test]
fn duplicate_owners_are_refused_at_every_depth() {
    let mut dev = Device::cpu();
    let b = bufs(&mut dev, 1, 0, Overlap::None);
    let init = init_values(b.specs());
    let cfg = OptimConfig::new(1e-2);
    let dup = |dev: &mut Device| leaf(dev, &b, 0, true, cfg, &init);
    let e = ChainedOptimizer::new(vec![boxed(dup(&mut dev)), boxed(dup(&mut dev))]).unwrap_err();
    assert!(matches!(
        e,
        OptimError::Invalid(InvalidInput::DuplicateOwner(OptimizerId(0)))
    ));
    let inner = ChainedOptimizer::new(vec![
        boxed(dup(&mut dev)),
        boxed(leaf(&mut dev, &b, 1, true, cfg, &init)),
    ])
    .unwrap();
    let e = ChainedOptimizer::new(vec![boxed(inner), boxed(dup(&mut dev))]).unwrap_err();
    assert!(matches!(
        e,
        OptimError::Invalid(InvalidInput::DuplicateOwner(OptimizerId(0)))
    ));
}

#[test]
fn parameters_without_an_optimizer_are_refused() {
    let mut dev = Device::cpu();
    let b = bufs(&mut dev, 1, 0, Overlap::None);
    let init = init_values(b.specs());
    let pol = policy(b.specs(), false);
    let first_bias = b
        .specs()
        .iter()
        .find(|s| s.owner() == OptimizerId(1))
        .unwrap()
        .name
        .clone();
    let only_matrices = leaf(&mut dev, &b, 0, false, OptimConfig::new(1e-2), &init);
    let e = Trainer::new(&mut dev, b, Box::new(only_matrices), pol).unwrap_err();
    match e {
        OptimError::Invalid(InvalidInput::Unowned { name, owner }) => {
            assert_eq!(name, first_bias);
            assert_eq!(owner, OptimizerId(1));
        }
        other => panic!("expected Unowned, got {other}"),
    }
}

/// One clipped SGD step (no momentum, no weight decay, so `p' = p + (−lr)·(g·c)` exactly) of a
/// chain with different learning rates and clip values at dp 2: the norm is over every part and
/// rank, the chain clips to the smallest clip value, and one factor `c` scales every gradient.
#[test]
fn clipping_uses_one_global_norm_and_one_factor() {
    let dp = 2;
    let (lr0, lr1, clip0, clip1) = (0.3f32, 0.7f32, 0.05f32, 2.0f32);
    let plain = lowbit_optim::Sgd {
        momentum: 0.0,
        weight_decay: 0.0,
    };
    type RankOut = (
        Vec<MasterShard>,
        Vec<MasterShard>,
        Vec<MasterShard>,
        f32,
        f32,
    );
    let out: Vec<RankOut> = run(dp, |mut comm, mut dev| {
        let dev = &mut dev;
        let b = bufs(dev, dp, comm.rank(), Overlap::GradReduce);
        let init = init_values(b.specs());
        let mut cb = lowbit_optim::init_from_full(&init);
        let part =
            |dev: &mut Device,
             owner,
             lr,
             clip,
             cb: &mut dyn FnMut(usize, std::ops::Range<usize>) -> Vec<f32>| {
                lowbit_optim::DistributedOptimizer::new(
                    dev,
                    &b,
                    OptimizerId(owner),
                    plain,
                    OptimConfig::new(lr).with_clip_grad(Some(clip)),
                    cb,
                )
                .unwrap()
            };
        let p0 = part(dev, 0, lr0, clip0, &mut cb);
        let p1 = part(dev, 1, lr1, clip1, &mut cb);
        let opt = ChainedOptimizer::new(vec![boxed(p0), boxed(p1)]).unwrap();
        assert_eq!(opt.clip_grad(), Some(clip0));
        let mut trainer = trainer(dev, b, opt, false);
        let mlp = Mlp::new(dev, &DIMS, BATCH);
        let before = trainer.optimizer().masters(dev).unwrap();
        let mut it = trainer.begin(dev, &mut comm).unwrap();
        for m in 0..2 {
            let (x, y) = mlp.sample(comm.rank(), 0, m);
            let mut hooks = it.microbatch(&mut comm, m == 1);
            mlp.forward_backward(dev, &mut hooks, &x, &y, 0.5).unwrap();
        }
        let ready = it.finish_grad_sync(dev, &mut comm).unwrap();
        let grads: Vec<MasterShard> = ready
            .buffers()
            .owned_shards()
            .unwrap()
            .into_iter()
            .map(|s| MasterShard {
                param: s.param,
                range: s.param_range,
                values: common::download_f32(dev, s.grad_view),
            })
            .collect();
        let report = ready.step(dev, &mut comm).unwrap();
        assert!(!report.skipped);
        let after = trainer.optimizer().masters(dev).unwrap();
        (before, grads, after, report.grad_norm, report.clip_coef)
    });
    let sizes: Vec<usize> = specs(ParamStorage::Bf16, GradDType::F32, true)
        .iter()
        .map(|s| s.numel)
        .collect();
    let grads = assemble(&sizes, &out.iter().map(|o| o.1.clone()).collect::<Vec<_>>());
    let norm: f64 = grads
        .iter()
        .flatten()
        .map(|&g| f64::from(g) * f64::from(g))
        .sum::<f64>()
        .sqrt();
    let (reported, coef) = (out[0].3, out[0].4);
    for o in &out {
        assert_eq!(
            (o.3.to_bits(), o.4.to_bits()),
            (reported.to_bits(), coef.to_bits())
        );
    }
    // The rank-order sum of blocked per-rank sums and a plain f64 sum agree to far below an
    // f32 ulp.
    assert!(
        (f64::from(reported) - norm).abs() <= norm * 1e-6,
        "norm {reported} vs host {norm}"
    );
    assert!(
        norm > f64::from(clip0) * 2.0,
        "the test must clip: norm {norm}"
    );
    assert_eq!(
        coef.to_bits(),
        (clip0 / (reported + 1e-6)).min(1.0).to_bits()
    );
    let specs = specs(ParamStorage::Bf16, GradDType::F32, true);
    for (before, _, after, ..) in &out {
        for (b, a) in before.iter().zip(after) {
            assert_eq!((b.param, &b.range), (a.param, &a.range));
            let lr = if specs[b.param].owner() == OptimizerId(0) {
                lr0
            } else {
                lr1
            };
            let g = &grads[b.param][b.range.clone()];
            let want: Vec<f32> = b
                .values
                .iter()
                .zip(g)
                .map(|(&p, &g)| p + -lr * (g * coef))
                .collect();
            assert!(
                bits(&a.values) == bits(&want),
                "param {} {:?}",
                b.param,
                b.range
            );
        }
    }
}

/// An invalid learning rate is refused and changes nothing (the next step is bitwise the step
/// of an optimizer that never saw the call); a valid one reaches every part of a nested chain.
#[test]
fn set_lr_validates_and_reaches_every_part() {
    // 0: untouched; 1: invalid set_lr calls; 2: set_lr(2e-2) on the chain; 3: built with 2e-2.
    let runs = train_variants(4, Overlap::GradReduce, (2, 1), |dev, b, variant| {
        let init = init_values(b.specs());
        let lr = if variant == 3 { 2e-2 } else { 1e-2 };
        let a = leaf(dev, b, 0, false, OptimConfig::new(lr), &init);
        let s = leaf(dev, b, 1, true, OptimConfig::new(lr), &init);
        let inner = ChainedOptimizer::new(vec![boxed(a)]).unwrap();
        let mut opt = ChainedOptimizer::new(vec![boxed(inner), boxed(s)]).unwrap();
        if variant == 1 {
            for bad in [f32::NAN, -1e-3, f32::INFINITY] {
                let e = opt.set_lr(bad).unwrap_err();
                assert!(matches!(
                    e,
                    OptimError::Invalid(InvalidInput::LearningRate(_))
                ));
            }
        }
        if variant == 2 {
            opt.set_lr(2e-2).unwrap();
        }
        opt
    });
    // Only the masters are compared here.
    let runs: Vec<Vec<Vec<_>>> = runs
        .into_iter()
        .map(|ranks| {
            ranks
                .into_iter()
                .map(|steps| steps.into_iter().map(|s| s.0).collect())
                .collect()
        })
        .collect();
    assert!(runs[0] == runs[1], "a refused set_lr changed the optimizer");
    assert!(runs[2] == runs[3], "set_lr did not reach every part");
    assert!(runs[0] != runs[2]);

    // A leaf keeps its configuration on a refused call.
    let mut dev = Device::cpu();
    let b = bufs(&mut dev, 1, 0, Overlap::None);
    let init = init_values(b.specs());
    let mut a = leaf(
        &mut dev,
        &b,
        0,
        false,
        OptimConfig::new(1e-2).with_clip_grad(Some(1.0)),
        &init,
    );
    assert!(a.set_lr(f32::NAN).is_err());
    assert_eq!(a.config(), OptimConfig::new(1e-2).with_clip_grad(Some(1.0)));
    a.set_lr(3e-3).unwrap();
    assert_eq!(a.config(), OptimConfig::new(3e-3).with_clip_grad(Some(1.0)));
}
