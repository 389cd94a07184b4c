//! The update rules against PyTorch's formulas, over several steps of the distributed optimizer
//! driven through `protocol::` on one rank (the reduced gradient is then the gradient itself):
//! - bit for bit against a host f32 transcription of `torch.optim.AdamW` / `torch.optim.SGD`
//!   (single-tensor, non-fused) in PyTorch's operation order: host scalars in f64 rounded to f32
//!   once, per-element f32 without fused multiply-add, `torch.lerp`'s branch for the first
//!   moment, `addcdiv`'s `p + (s·m)/d`;
//! - within a stated tolerance against the same formulas evaluated in f64, which checks the
//!   formulas themselves rather than their op order;
//! - the fused bf16 parameter output is `bf16(master)`, and the exported moments are the
//!   reference's.

use crate::common;

use common::{assert_same_bits, download_f32, run, seed, values};
use lowbit_buffers::layout::{
    BufferKey, GradDType, OptimizerId, ParamSpec, ParamStorage, ShardingStrategy,
};
use lowbit_buffers::protocol::StepProtocol;
use lowbit_buffers::{DataParallelBuffers, DdpConfig, Overlap, Verify};
use lowbit_comm::Communicator;
use lowbit_device::bf16;
use lowbit_optim::{AdamW, DistributedOptimizer, OptimConfig, Optimizer, Sgd, init_from_full};
use lowbit_train::protocol;

const STEPS: usize = 6;
const LR: f32 = 1e-2;

fn specs(grad: GradDType) -> Vec<ParamSpec> {
    let key = BufferKey {
        param_storage: ParamStorage::Bf16,
        grad_dtype: grad,
        expert: false,
        owner: OptimizerId(0),
    };
    // A bucket holds its parameters in reverse order, each starting 64-element aligned: `w`
    // first, then `b` right after it (1920 is aligned), so their shards are one run.
    vec![
        ParamSpec::new("b", vec![300], key),
        ParamSpec::new("w", vec![48, 40], key),
    ]
}

fn init(specs: &[ParamSpec]) -> Vec<Vec<f32>> {
    specs
        .iter()
        .enumerate()
        .map(|(p, s)| values(seed(&[p as u64, 40]), s.numel, 2.0))
        .collect()
}

/// The gradient of step `t` (1-based), rounded to the gradient dtype as the buffer stores it;
/// every 11th element is zero (AdamW's `eps`-dominated case) and magnitudes span four binades.
fn grads(t: usize, p: usize, n: usize, grad: GradDType) -> Vec<f32> {
    values(seed(&[t as u64, p as u64, 41]), n, 1.0)
        .into_iter()
        .enumerate()
        .map(|(i, g)| {
            let g = if i % 11 == 3 {
                0.0
            } else {
                g * (1u32 << (i % 4)) as f32 / 4.0
            };
            match grad {
                GradDType::F32 => g,
                GradDType::Bf16 => bf16::from_f32(g).to_f32(),
            }
        })
        .collect()
}

#[derive(Clone, Copy, Debug)]
enum Rule {
    AdamW(AdamW),
    Sgd(Sgd),
}

/// What the optimizer holds after each step: masters, state tensors (by name), parameter
/// storage as f32, step count.
struct Seen {
    masters: Vec<Vec<f32>>,
    state: Vec<Vec<Vec<f32>>>,
    params: Vec<Vec<f32>>,
    steps: u64,
}

/// One optimizer step over `bufs` with the gradients of step `t`: begin, accumulate, reduce,
/// step.
fn step(
    dev: &mut lowbit_device::Device,
    comm: &mut dyn Communicator,
    bufs: &mut DataParallelBuffers,
    opt: &mut DistributedOptimizer,
    t: usize,
    grad: GradDType,
) -> lowbit_optim::StepReport {
    protocol::begin_iteration(dev, comm, bufs, opt).unwrap();
    for (p, s) in bufs.specs().to_vec().iter().enumerate() {
        let dst = bufs.accumulation_view(dev, p).unwrap();
        let g = dev.alloc(lowbit_device::DType::F32, s.numel);
        dev.upload(g, &grads(t, p, s.numel, grad)).unwrap();
        dev.add(g, dst).unwrap();
        dev.free(g).unwrap();
    }
    bufs.finish_grad_sync(dev, comm).unwrap();
    protocol::step(dev, comm, bufs, opt).unwrap()
}

fn drive(rule: Rule, grad: GradDType) -> Vec<Seen> {
    let specs = specs(grad);
    let init = init(&specs);
    run(1, |mut comm, mut dev| {
        let dev = &mut dev;
        let cfg = DdpConfig::default()
            .with_sharding(ShardingStrategy::Distributed)
            .with_overlap(Overlap::None)
            .with_verify(Verify::Full);
        let mut bufs = DataParallelBuffers::new(dev, 1, 0, specs.clone(), cfg).unwrap();
        bufs.initialize_all(dev, |p| init[p].clone()).unwrap();
        let mut cb = init_from_full(&init);
        let ocfg = OptimConfig::new(LR);
        let mut opt = match rule {
            Rule::AdamW(r) => {
                DistributedOptimizer::new(dev, &bufs, OptimizerId(0), r, ocfg, &mut cb)
            }
            Rule::Sgd(r) => DistributedOptimizer::new(dev, &bufs, OptimizerId(0), r, ocfg, &mut cb),
        }
        .unwrap();
        // Both parameters lie in one bucket, back to back: their shards are one run, one launch
        // a step (the references below check that it gives each shard's bits).
        assert_eq!(opt.update_launches(), 1);
        let mut seen = Vec::new();
        for t in 1..=STEPS {
            let report = step(dev, &mut comm, &mut bufs, &mut opt, t, grad);
            assert!(!report.skipped);
            assert_eq!(report.clip_coef, 1.0);
            let mut masters = opt.masters(dev).unwrap();
            masters.sort_by_key(|m| m.param);
            assert!(masters.iter().all(|m| m.range == (0..specs[m.param].numel)));
            let exported = opt.export_state(dev).unwrap();
            assert_eq!(exported.len(), 1);
            let names: Vec<&str> = match rule {
                Rule::AdamW(_) => vec!["exp_avg", "exp_avg_sq"],
                Rule::Sgd(_) => vec!["momentum_buffer"],
            };
            let state = names
                .iter()
                .map(|n| {
                    (0..specs.len())
                        .map(|p| {
                            exported[0]
                                .tensors
                                .iter()
                                .find(|x| x.name == *n && x.param == p)
                                .unwrap()
                                .values
                                .clone()
                        })
                        .collect()
                })
                .collect();
            seen.push(Seen {
                masters: masters.into_iter().map(|m| m.values).collect(),
                state,
                params: (0..specs.len())
                    .map(|p| download_f32(dev, bufs.param_view(p).unwrap()))
                    .collect(),
                steps: opt.steps(),
            });
        }
        seen
    })
    .pop()
    .unwrap()
}

/// `torch.optim.AdamW`'s step for one tensor, transcribed in f32 (see the module docs).
fn adamw_f32(r: &AdamW, t: usize, p: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32]) {
    let (lr, b1, b2) = (f64::from(LR), f64::from(r.beta1), f64::from(r.beta2));
    let decay = (1.0 - lr * f64::from(r.weight_decay)) as f32;
    let w = (1.0 - b1) as f32;
    let one_minus_w = 1.0 - w;
    let c2 = (1.0 - b2) as f32;
    let step_size = (-(lr / (1.0 - b1.powf(t as f64)))) as f32;
    let bc2_sqrt = (1.0 - b2.powf(t as f64)).sqrt() as f32;
    for i in 0..p.len() {
        p[i] *= decay;
        // torch.lerp(m, g, w): m + w·(g − m) for |w| < 0.5, else g − (g − m)·(1 − w).
        m[i] = if w.abs() < 0.5 {
            m[i] + w * (g[i] - m[i])
        } else {
            g[i] - (g[i] - m[i]) * one_minus_w
        };
        v[i] = v[i] * r.beta2 + c2 * g[i] * g[i];
        let denom = v[i].sqrt() / bc2_sqrt + r.eps;
        p[i] += step_size * m[i] / denom;
    }
}

/// The same step in f64 from the f32 values (PyTorch's formula, not its op order).
fn adamw_f64(r: &AdamW, t: usize, p: &mut [f64], m: &mut [f64], v: &mut [f64], g: &[f32]) {
    let (lr, b1, b2) = (f64::from(LR), f64::from(r.beta1), f64::from(r.beta2));
    for i in 0..p.len() {
        let g = f64::from(g[i]);
        p[i] *= 1.0 - lr * f64::from(r.weight_decay);
        m[i] = b1 * m[i] + (1.0 - b1) * g;
        v[i] = b2 * v[i] + (1.0 - b2) * g * g;
        let mhat = m[i] / (1.0 - b1.powf(t as f64));
        let vhat_sqrt = v[i].sqrt() / (1.0 - b2.powf(t as f64)).sqrt();
        p[i] -= lr * mhat / (vhat_sqrt + f64::from(r.eps));
    }
}

/// `torch.optim.SGD`'s step (momentum, L2 weight decay, no dampening, no Nesterov), in f32.
fn sgd_f32(r: &Sgd, t: usize, p: &mut [f32], buf: &mut [f32], g: &[f32]) {
    for i in 0..p.len() {
        let mut d = g[i];
        if r.weight_decay != 0.0 {
            d += r.weight_decay * p[i];
        }
        if r.momentum != 0.0 {
            buf[i] = if t == 1 { d } else { buf[i] * r.momentum + d };
            d = buf[i];
        }
        p[i] += -LR * d;
    }
}

fn sgd_f64(r: &Sgd, t: usize, p: &mut [f64], buf: &mut [f64], g: &[f32]) {
    for i in 0..p.len() {
        let d = f64::from(g[i]) + f64::from(r.weight_decay) * p[i];
        buf[i] = if t == 1 {
            d
        } else {
            f64::from(r.momentum) * buf[i] + d
        };
        let d = if r.momentum != 0.0 { buf[i] } else { d };
        p[i] -= f64::from(LR) * d;
    }
}

/// Checks every step of `seen` against both references. The f64 tolerance: each step performs
/// about eight f32 roundings on values of magnitude ≤ max(|p|, 1) (relative error 2^-24 each)
/// and the errors of earlier steps carry over, so after `t` steps the f32 result is within
/// `t · 8 · 2^-24 · max(|p|, 1)` of the exact value; we allow twice that. A formula error
/// (missing bias correction, coupled weight decay, wrong momentum) moves a master by O(lr·wd·p)
/// or O(lr) ≥ 1e-4 per step, orders of magnitude above it.
fn check(rule: Rule, grad: GradDType) {
    let seen = drive(rule, grad);
    let specs = specs(grad);
    let init = init(&specs);
    let what = format!("{rule:?}, {grad:?} gradients");
    let mut p32 = init.clone();
    let mut p64: Vec<Vec<f64>> = init
        .iter()
        .map(|v| v.iter().map(|&x| f64::from(x)).collect())
        .collect();
    let zeros32 = || {
        specs
            .iter()
            .map(|s| vec![0f32; s.numel])
            .collect::<Vec<_>>()
    };
    let zeros64 = || {
        specs
            .iter()
            .map(|s| vec![0f64; s.numel])
            .collect::<Vec<_>>()
    };
    let (mut s32a, mut s32b, mut s64a, mut s64b) = (zeros32(), zeros32(), zeros64(), zeros64());
    for (k, step) in seen.iter().enumerate() {
        let t = k + 1;
        assert_eq!(step.steps, t as u64, "{what}");
        for (p, s) in specs.iter().enumerate() {
            let g = grads(t, p, s.numel, grad);
            match rule {
                Rule::AdamW(r) => {
                    adamw_f32(&r, t, &mut p32[p], &mut s32a[p], &mut s32b[p], &g);
                    adamw_f64(&r, t, &mut p64[p], &mut s64a[p], &mut s64b[p], &g);
                }
                Rule::Sgd(r) => {
                    sgd_f32(&r, t, &mut p32[p], &mut s32a[p], &g);
                    sgd_f64(&r, t, &mut p64[p], &mut s64a[p], &g);
                }
            }
            let at = |x: &str| format!("{what}: step {t}, param {p}: {x}");
            assert_same_bits(
                &step.masters[p],
                &p32[p],
                &at("masters vs the f32 transcription"),
            );
            assert_same_bits(&step.state[0][p], &s32a[p], &at("state tensor 0"));
            if let Rule::AdamW(_) = rule {
                assert_same_bits(&step.state[1][p], &s32b[p], &at("state tensor 1"));
            }
            let bf: Vec<f32> = p32[p].iter().map(|&x| bf16::from_f32(x).to_f32()).collect();
            assert_same_bits(&step.params[p], &bf, &at("bf16 parameter output"));
            for (i, (&a, &b)) in step.masters[p].iter().zip(&p64[p]).enumerate() {
                let tol = 2.0 * t as f64 * 8.0 * 2f64.powi(-24) * b.abs().max(1.0);
                assert!(
                    (f64::from(a) - b).abs() <= tol,
                    "{what}: step {t}, param {p}[{i}]: {a} vs f64 {b} (tol {tol:e})"
                );
            }
        }
    }
    // The run moved the masters well beyond the tolerance (the comparison is not vacuous).
    let moved = (0..specs.len())
        .flat_map(|p| init[p].iter().zip(&p32[p]).map(|(a, b)| (a - b).abs()))
        .fold(0f32, f32::max);
    assert!(moved > 1e-3, "{what}: masters moved only {moved}");
}

/// [`check`] of `rule` with both gradient dtypes, then of `variant` (other hyper-parameters)
/// with f32 gradients.
fn check_rule(rule: Rule, variant: Rule) {
    for grad in [GradDType::F32, GradDType::Bf16] {
        check(rule, grad);
    }
    check(variant, GradDType::F32);
}

#[test]
fn adamw_follows_pytorch() {
    // β1 ≥ 0.5 takes torch.lerp's other branch.
    let low_beta1 = AdamW {
        beta1: 0.3,
        beta2: 0.999,
        eps: 1e-6,
        weight_decay: 0.0,
    };
    check_rule(Rule::AdamW(common::adamw()), Rule::AdamW(low_beta1));
}

#[test]
fn sgd_follows_pytorch() {
    let plain = Sgd {
        momentum: 0.0,
        weight_decay: 0.0,
    };
    check_rule(Rule::Sgd(common::sgd()), Rule::Sgd(plain));
}

#[test]
fn invalid_hyper_parameters_are_refused() {
    use lowbit_optim::{InvalidInput, OptimError, UpdateRule};
    let bad_adamw = [
        AdamW {
            beta1: 1.0,
            ..common::adamw()
        },
        AdamW {
            beta2: -0.1,
            ..common::adamw()
        },
        AdamW {
            eps: 0.0,
            ..common::adamw()
        },
    ];
    for r in bad_adamw {
        assert!(matches!(
            r.validate(),
            Err(OptimError::Invalid(InvalidInput::Hyper {
                rule: "AdamW",
                ..
            }))
        ));
    }
    let r = Sgd {
        momentum: 1.0,
        weight_decay: 0.0,
    };
    assert!(matches!(
        r.validate(),
        Err(OptimError::Invalid(InvalidInput::Hyper { rule: "SGD", .. }))
    ));
    for lr in [f32::NAN, -1.0, f32::INFINITY] {
        assert!(matches!(
            OptimConfig::new(lr).validate(),
            Err(OptimError::Invalid(InvalidInput::LearningRate(_)))
        ));
    }
    for clip in [0.0, -1.0, f32::NAN] {
        assert!(matches!(
            OptimConfig::new(1.0).with_clip_grad(Some(clip)).validate(),
            Err(OptimError::Invalid(InvalidInput::ClipGrad(_)))
        ));
    }
}

/// AdamW without its fused clipping: the optimizer scales the gradient first, then updates.
#[derive(Clone, Copy, Debug)]
struct Unfused(AdamW);

impl lowbit_optim::UpdateRule for Unfused {
    fn name(&self) -> &'static str {
        self.0.name()
    }
    fn state_names(&self) -> &'static [&'static str] {
        self.0.state_names()
    }
    fn validate(&self) -> lowbit_optim::Result<()> {
        self.0.validate()
    }
    fn update(
        &self,
        dev: &mut lowbit_device::Device,
        views: lowbit_optim::ShardViews<'_>,
        lr: f32,
        step: u64,
    ) -> lowbit_optim::Result<()> {
        self.0.update(dev, views, lr, step)
    }
}

/// Masters, moments and parameters after `STEPS` clipped steps at dp 2 (every step clips).
fn clipped(rule: impl lowbit_optim::UpdateRule + Copy + 'static, grad: GradDType) -> Vec<u32> {
    let specs = specs(grad);
    let init = init(&specs);
    let outs = run(2, |mut comm, mut dev| {
        let dev = &mut dev;
        let cfg = DdpConfig::default()
            .with_sharding(ShardingStrategy::Distributed)
            .with_overlap(Overlap::None);
        let mut bufs = DataParallelBuffers::new(dev, 2, comm.rank(), specs.clone(), cfg).unwrap();
        bufs.initialize_all(dev, |p| init[p].clone()).unwrap();
        let mut cb = init_from_full(&init);
        let ocfg = OptimConfig::new(LR).with_clip_grad(Some(1e-2));
        let mut opt =
            DistributedOptimizer::new(dev, &bufs, OptimizerId(0), rule, ocfg, &mut cb).unwrap();
        for t in 1..=STEPS {
            let report = step(dev, &mut comm, &mut bufs, &mut opt, t, grad);
            assert!(report.clip_coef < 1.0, "step {t} must clip");
        }
        let mut bits: Vec<u32> = Vec::new();
        for s in opt.export_state(dev).unwrap() {
            for t in s.tensors {
                bits.extend(t.values.iter().map(|x| x.to_bits()));
            }
        }
        for p in 0..specs.len() {
            let v = download_f32(dev, bufs.param_view(p).unwrap());
            bits.extend(v.iter().map(|x| x.to_bits()));
        }
        bits
    });
    outs.concat()
}

/// Clipping fused into AdamW's kernel (`UpdateRule::update_scaled`) gives the bits of scaling
/// the gradient first and updating after (what a rule without it gets). With bf16 gradients
/// this is also AdamW reading them as they are (`UpdateRule::reads_low_precision_grads`: no f32
/// copy; the norm over the bf16 shards) against the widened f32 copy that `Unfused` gets.
#[test]
fn fused_clipping_is_scale_then_update() {
    for grad in [GradDType::F32, GradDType::Bf16] {
        let fused = clipped(AdamW::default(), grad);
        let separate = clipped(Unfused(AdamW::default()), grad);
        assert!(
            fused == separate,
            "{grad:?} gradients: fused clipping differs"
        );
    }
}

/// Only a rule that reads low-precision gradients as they are goes without the f32 copy: AdamW
/// over bf16 gradients holds no gradient scratch, the same rule behind `Unfused` (which leaves
/// clipping to the caller) holds 4 bytes per owned element, and with f32 gradients neither does.
#[test]
fn only_rules_that_read_bf16_gradients_skip_the_f32_copy() {
    for grad in [GradDType::F32, GradDType::Bf16] {
        let specs = specs(grad);
        let init = init(&specs);
        let scratch = run(2, |comm, mut dev| {
            let dev = &mut dev;
            let cfg = DdpConfig::default()
                .with_sharding(ShardingStrategy::Distributed)
                .with_overlap(Overlap::None);
            let bufs = DataParallelBuffers::new(dev, 2, comm.rank(), specs.clone(), cfg).unwrap();
            let owned: usize = bufs
                .owned_shards()
                .unwrap()
                .iter()
                .map(|s| s.param_range.len())
                .sum();
            let ocfg = OptimConfig::new(LR);
            let mut cb = init_from_full(&init);
            let as_is = DistributedOptimizer::new(
                dev,
                &bufs,
                OptimizerId(0),
                AdamW::default(),
                ocfg,
                &mut cb,
            )
            .unwrap();
            let mut cb = init_from_full(&init);
            let widened = DistributedOptimizer::new(
                dev,
                &bufs,
                OptimizerId(0),
                Unfused(AdamW::default()),
                ocfg,
                &mut cb,
            )
            .unwrap();
            (
                owned,
                as_is.memory().grad_scratch,
                widened.memory().grad_scratch,
            )
        });
        for (owned, as_is, widened) in scratch {
            assert!(owned > 0, "rank owns nothing: the test would be vacuous");
            assert_eq!(as_is, 0, "{grad:?}: AdamW keeps an f32 gradient copy");
            let expected = if grad == GradDType::F32 { 0 } else { 4 * owned };
            assert_eq!(widened, expected, "{grad:?}: the widening rule's copy");
        }
    }
}
