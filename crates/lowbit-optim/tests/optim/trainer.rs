//! The typestate driver (`Trainer → Iteration → GradsReady`) is the `protocol::` functions in
//! the only order that works: at dp 2 with MXFP8 weights staged through bf16 and overlapped
//! reduction and gathers, it gives bit for bit the masters, state, reports and weights of the
//! same steps driven by hand. What the types cannot say is refused at run time: an iteration
//! without a last microbatch, low-precision weights computed with as stored. An eval between
//! steps changes nothing; an error inside the one-call step leaves no reduction in flight.

use crate::common;

use common::model::Mlp;
use common::{
    BATCH, DIMS, MXFP8, batch, buffers, init_values, master_bits, optimizer, policy, protocol_err,
    run, specs, train_step, trainer, weight_bytes,
};
use lowbit_buffers::layout::GradDType;
use lowbit_buffers::protocol::StepProtocol;
use lowbit_buffers::{
    BufferError, ConfigError, DataParallelBuffers, DpHooks, HookMode, HookScratch, Hooks, Overlap,
    PrecisionPolicy, ProtocolError, Usage,
};
use lowbit_comm::{Communicator, LocalComm};
use lowbit_device::Device;
use lowbit_optim::{OptimError, Optimizer, OptimizerState};
use lowbit_train::{Trainer, protocol};

const DP: usize = 2;
const STEPS: usize = 4;
const MICRO: usize = 2;

/// Per step: (grad norm bits, skipped, clip coef bits), masters, state; then the final weights
/// after a forced sync.
type Trace = (
    Vec<(
        (u32, bool, u32),
        Vec<(usize, usize, Vec<u32>)>,
        Vec<OptimizerState>,
    )>,
    Vec<Vec<u8>>,
);

/// Rank `comm.rank()`'s buffers (MXFP8 matrices, overlapped reduction and gathers) and the
/// initial values they hold.
fn new_bufs(dev: &mut Device, comm: &LocalComm) -> (DataParallelBuffers, Vec<Vec<f32>>) {
    let specs = specs(MXFP8, GradDType::F32, true);
    let init = init_values(&specs);
    let overlap = Overlap::GradReduceAndParamGather;
    let b = buffers(dev, DP, comm.rank(), &specs, overlap, &init);
    assert!((0..b.specs().len()).any(|p| b.is_low_precision(p)));
    (b, init)
}

/// A trainer of [`new_bufs`] with the chained optimizer and MXFP8 compute, and the model.
fn new_trainer(dev: &mut Device, comm: &LocalComm) -> (Trainer, Mlp) {
    let (bufs, init) = new_bufs(dev, comm);
    let opt = optimizer(dev, &bufs, &init, true);
    (trainer(dev, bufs, opt, true), Mlp::new(dev, &DIMS, BATCH))
}

fn with_trainer() -> Vec<Trace> {
    run(DP, |mut comm, mut dev| {
        let dev = &mut dev;
        let (mut trainer, mlp) = new_trainer(dev, &comm);
        let mut steps = Vec::new();
        for s in 0..STEPS {
            let r = train_step(dev, &mut comm, &mut trainer, &mlp, s, MICRO, None);
            let o = trainer.optimizer();
            steps.push((
                (r.grad_norm.to_bits(), r.skipped, r.clip_coef.to_bits()),
                master_bits(dev, o),
                o.export_state(dev).unwrap(),
            ));
        }
        trainer.force_param_sync(dev, &mut comm).unwrap();
        (steps, weight_bytes(dev, trainer.buffers()))
    })
}

fn by_hand() -> Vec<Trace> {
    run(DP, |mut comm, mut dev| {
        let dev = &mut dev;
        let (mut bufs, init) = new_bufs(dev, &comm);
        let mut opt = optimizer(dev, &bufs, &init, true);
        let pol = policy(bufs.specs(), true);
        let scratch = HookScratch::new(dev, &bufs);
        let mlp = Mlp::new(dev, &DIMS, BATCH);
        let rank = comm.rank();
        let mut steps = Vec::new();
        for s in 0..STEPS {
            protocol::begin_iteration(dev, &mut comm, &mut bufs, &opt).unwrap();
            for m in 0..MICRO {
                bufs.set_last_microbatch(m + 1 == MICRO);
                let (x, y) = batch(&mlp, rank, s, m, false);
                let mut hooks = DpHooks::new(&mut bufs, &mut comm, &pol, &scratch, HookMode::Train);
                mlp.forward_backward(dev, &mut hooks, &x, &y, 1.0 / MICRO as f32)
                    .unwrap();
            }
            bufs.finish_grad_sync(dev, &mut comm).unwrap();
            let r = protocol::step(dev, &mut comm, &mut bufs, &mut opt).unwrap();
            steps.push((
                (r.grad_norm.to_bits(), r.skipped, r.clip_coef.to_bits()),
                master_bits(dev, &opt),
                opt.export_state(dev).unwrap(),
            ));
        }
        protocol::force_param_sync(dev, &mut comm, &mut bufs, &opt).unwrap();
        scratch.free(dev).unwrap();
        (steps, weight_bytes(dev, &bufs))
    })
}

#[test]
fn the_trainer_is_the_protocol_functions() {
    let (t, h) = (with_trainer(), by_hand());
    for (rank, (a, b)) in t.iter().zip(&h).enumerate() {
        for s in 0..STEPS {
            assert!(!a.0[s].0.1, "rank {rank}: step {s} skipped");
            assert!(a.0[s].0 == b.0[s].0, "rank {rank}: report of step {s}");
            assert!(a.0[s].1 == b.0[s].1, "rank {rank}: masters after step {s}");
            assert!(a.0[s].2 == b.0[s].2, "rank {rank}: state after step {s}");
        }
        assert!(
            a.0[0].1 != a.0[STEPS - 1].1,
            "rank {rank}: the masters never moved"
        );
        assert!(a.1 == b.1, "rank {rank}: final weights");
    }
    // Ranks hold the same weights after the forced sync.
    assert!(t[0].1 == t[1].1, "weights differ across ranks");
}

/// An iteration in which no microbatch was marked last is refused at the gradient sync (its
/// overlapped reductions would never start), on every rank; the next iteration is fine.
#[test]
fn an_iteration_without_a_last_microbatch_is_refused() {
    run(DP, |mut comm, mut dev| {
        let dev = &mut dev;
        let (mut trainer, mlp) = new_trainer(dev, &comm);
        let mut it = trainer.begin(dev, &mut comm).unwrap();
        for m in 0..MICRO {
            let (x, y) = batch(&mlp, comm.rank(), 0, m, false);
            let mut hooks = it.microbatch(&mut comm, false);
            mlp.forward_backward(dev, &mut hooks, &x, &y, 0.5).unwrap();
        }
        let e = it.finish_grad_sync(dev, &mut comm).unwrap_err();
        assert_eq!(protocol_err(e), ProtocolError::NoLastMicrobatch);
        assert_eq!(trainer.optimizer().steps(), 0);
        let r = train_step(dev, &mut comm, &mut trainer, &mlp, 1, MICRO, None);
        assert!(!r.skipped);
        assert_eq!(trainer.optimizer().steps(), 1);
    });
}

#[test]
fn low_precision_weights_computed_as_stored_are_refused() {
    let mut dev = Device::cpu();
    let specs = specs(MXFP8, GradDType::F32, true);
    let init = init_values(&specs);
    let bufs = buffers(&mut dev, 1, 0, &specs, Overlap::None, &init);
    let opt = optimizer(&mut dev, &bufs, &init, true);
    let e = Trainer::new(
        &mut dev,
        bufs,
        Box::new(opt),
        PrecisionPolicy::as_stored(specs.len()),
    )
    .unwrap_err();
    assert!(
        matches!(
            e,
            OptimError::Buffer(BufferError::Config(ConfigError::Policy(_)))
        ),
        "{e}"
    );
}

/// An eval between steps (a forced sync, then a forward whose gradients go to scratch) changes
/// neither the optimizer nor the next steps; in eval mode nothing is reported ready.
#[test]
fn an_eval_between_steps_changes_nothing() {
    let trace = |eval: bool| {
        run(DP, |mut comm, mut dev| {
            let dev = &mut dev;
            let (mut trainer, mlp) = new_trainer(dev, &comm);
            let mut out = Vec::new();
            for s in 0..3 {
                train_step(dev, &mut comm, &mut trainer, &mlp, s, MICRO, None);
                if eval && s == 1 {
                    let before = master_bits(dev, trainer.optimizer());
                    let (x, y) = batch(&mlp, comm.rank(), 99, 0, false);
                    let mut hooks = trainer.eval(dev, &mut comm).unwrap();
                    mlp.forward_backward(dev, &mut hooks, &x, &y, 1.0).unwrap();
                    // Weights are readable for both usages after the forced sync.
                    hooks.param(dev, 0, Usage::Backward).unwrap();
                    assert!(hooks.buffers().grad_reduce_in_flight().is_empty());
                    assert!(before == master_bits(dev, trainer.optimizer()));
                }
                out.push(master_bits(dev, trainer.optimizer()));
            }
            out
        })
    };
    let (with, without) = (trace(true), trace(false));
    assert!(with == without, "an eval changed the training run");
}

/// The chained optimizer, whose next gradient pieces (asked for by a one-call step before any
/// reduction in flight completes) include one the device cannot sum when `fail` is set;
/// otherwise it is the chain.
#[derive(Debug)]
struct FailsOnce {
    inner: lowbit_optim::ChainedOptimizer,
    fail: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// A byte view: not a float gradient, so its sum of squares is refused.
    not_a_gradient: lowbit_device::View,
}

impl Optimizer for FailsOnce {
    fn owners(&self) -> Vec<lowbit_buffers::layout::OptimizerId> {
        self.inner.owners()
    }
    fn grad_pieces(&self) -> Vec<lowbit_optim::GradPiece> {
        let mut pieces = self.inner.grad_pieces();
        if self.fail.swap(false, std::sync::atomic::Ordering::SeqCst) {
            pieces.push(lowbit_optim::GradPiece {
                param: 0,
                grad: self.not_a_gradient,
                grad32: self.not_a_gradient,
            });
        }
        pieces
    }
    fn fold_sum_squares(&self, sums: &[f64]) -> f64 {
        self.inner.fold_sum_squares(sums)
    }
    fn clip_grad(&self) -> Option<f32> {
        self.inner.clip_grad()
    }
    fn begin_step(&mut self) {
        self.inner.begin_step();
    }
    fn update(
        &mut self,
        dev: &mut Device,
        clip: f32,
        scope: lowbit_optim::UpdateScope<'_>,
    ) -> lowbit_optim::Result<Vec<lowbit_optim::MasterPiece>> {
        self.inner.update(dev, clip, scope)
    }
    fn updates_in_parts(&self, owner: lowbit_buffers::layout::OptimizerId) -> bool {
        self.inner.updates_in_parts(owner)
    }
    fn masters_to_stage(
        &self,
    ) -> Vec<(
        lowbit_buffers::layout::OptimizerId,
        Vec<lowbit_optim::MasterPiece>,
    )> {
        self.inner.masters_to_stage()
    }
    fn set_lr(&mut self, lr: f32) -> lowbit_optim::Result<()> {
        self.inner.set_lr(lr)
    }
    fn steps(&self) -> u64 {
        self.inner.steps()
    }
    fn export_state(&self, dev: &Device) -> lowbit_optim::Result<Vec<OptimizerState>> {
        self.inner.export_state(dev)
    }
    fn import_state(
        &mut self,
        dev: &mut Device,
        state: &[OptimizerState],
    ) -> lowbit_optim::Result<()> {
        self.inner.import_state(dev, state)
    }
    fn memory(&self) -> lowbit_optim::OptimizerMemory {
        self.inner.memory()
    }
}

/// An error while `Iteration::step` sums the squares of the groups already reduced (the last
/// reduction still in flight) leaves no reduction behind: the error comes back on every rank,
/// nothing stepped, and the next iteration begins and steps.
#[test]
fn an_error_in_the_one_call_step_leaves_no_reduction_in_flight() {
    run(DP, |mut comm, mut dev| {
        let dev = &mut dev;
        let (bufs, init) = new_bufs(dev, &comm);
        let fail = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let opt = FailsOnce {
            inner: optimizer(dev, &bufs, &init, true),
            fail: fail.clone(),
            not_a_gradient: dev.alloc(lowbit_device::DType::U8, 4),
        };
        let mut trainer = trainer(dev, bufs, opt, true);
        let mlp = Mlp::new(dev, &DIMS, BATCH);
        // The first batch records the golden counts; the second overlaps its reductions.
        train_step(dev, &mut comm, &mut trainer, &mlp, 0, MICRO, None);
        fail.store(true, std::sync::atomic::Ordering::SeqCst);
        let mut it = trainer.begin(dev, &mut comm).unwrap();
        for m in 0..MICRO {
            let (x, y) = batch(&mlp, comm.rank(), 1, m, false);
            let mut hooks = it.microbatch(&mut comm, m + 1 == MICRO);
            mlp.forward_backward(dev, &mut hooks, &x, &y, 0.5).unwrap();
        }
        assert!(!it.buffers().grad_reduce_in_flight().is_empty());
        let e = it.step(dev, &mut comm).unwrap_err();
        assert!(matches!(e, OptimError::Device(_)), "{e}");
        assert!(trainer.buffers().grad_reduce_in_flight().is_empty());
        assert_eq!(trainer.optimizer().steps(), 1);
        train_step(dev, &mut comm, &mut trainer, &mlp, 2, MICRO, None);
        assert_eq!(trainer.optimizer().steps(), 2);
    });
}

/// A non-finite gradient found while the one-call step launches the reductions (the first
/// batch: no golden counts yet, so the backward launched none) leaves no reduction in flight:
/// the groups launched before the failing one are completed, the error names the parameter on
/// every rank, and nothing stepped.
#[test]
fn a_non_finite_gradient_found_at_launch_leaves_no_reduction_in_flight() {
    run(DP, |mut comm, mut dev| {
        let dev = &mut dev;
        let specs = specs(MXFP8, GradDType::F32, true);
        let init = init_values(&specs);
        let cfg =
            common::ddp(Overlap::GradReduce).with_nan_check(lowbit_buffers::NanCheck::FirstParam);
        let mut bufs = DataParallelBuffers::new(dev, DP, comm.rank(), specs.clone(), cfg).unwrap();
        bufs.initialize_all(dev, |p| init[p].clone()).unwrap();
        let mut opt = optimizer(dev, &bufs, &init, true);
        let last = bufs.num_groups() - 1;
        assert!(last >= 2, "{} groups", bufs.num_groups());
        protocol::begin_iteration(dev, &mut comm, &mut bufs, &opt).unwrap();
        // The backward: parameters in reverse order; a NaN in one of the last group's.
        let bad = (0..specs.len())
            .find(|&p| bufs.group_of(p) == last)
            .unwrap();
        for p in (0..specs.len()).rev() {
            let dst = bufs.accumulation_view(dev, p).unwrap();
            let mut g = vec![0.25f32; specs[p].numel];
            if p == bad {
                g[specs[p].numel / 2] = f32::NAN;
            }
            dev.upload(dst, &g).unwrap();
            bufs.register_grad_ready(dev, &mut comm, p).unwrap();
        }
        assert!(bufs.grad_reduce_in_flight().is_empty());
        let e =
            protocol::finish_grad_sync_and_step(dev, &mut comm, &mut bufs, &mut opt).unwrap_err();
        let named = matches!(
            &e,
            OptimError::Buffer(BufferError::Protocol(ProtocolError::NonFiniteGrad { names, .. }))
                if names == &[specs[bad].name.clone()]
        );
        assert!(named, "{e}");
        assert!(bufs.grad_reduce_in_flight().is_empty());
        assert_eq!(opt.steps(), 0);
    });
}
