//! Optimizers over fp32 master shards: AdamW and SGD with momentum, the distributed (ZeRO-1)
//! optimizer that owns one shard of every bucket per rank, chaining, global gradient-norm
//! clipping and the skipping of non-finite steps.
//!
//! # Purpose
//! After [`DataParallelBuffers::finish_grad_sync`] each rank holds the reduced gradients of its
//! shards. The optimizer copies them into fp32, computes the global gradient norm, clips, skips
//! the step if the norm is not finite, updates its fp32 masters and writes the result back into
//! the parameter buffer (rounded to the parameter dtype, fused into the update), from where the
//! all-gather spreads it — now, or in the next forward when parameter gather is overlapped.
//!
//! # Invariants
//! - **Masters come from the high-precision initial values** given to [`DistributedOptimizer::new`],
//!   never from the (rounded or quantized) parameter buffer (Megatron bug class E).
//! - **A skipped step changes nothing**: masters, moments, step count and parameter buffer are left
//!   bitwise as they were, and the skip is counted.
//! - **One sync per step, after every optimizer stepped**: a [`ChainedOptimizer`] steps all of its
//!   parts before the (single) parameter gather, so no bucket group is gathered before its owner
//!   updated it (Megatron bug class D).
//! - **The gradient norm does not depend on the thread timing**: each rank's sum of squares is an
//!   f64 computed in a fixed order; the ranks exchange those f64 values and add them in rank order.
//!
//! # Non-goals
//! Muon and the layer-wise optimizer (later), loss scaling for fp16, optimizer-state offload,
//! checkpoints (`lowbit-ckpt`).

use lowbit_buffers::layout::OptimizerId;
use lowbit_buffers::{BufKind, BufferError, DataParallelBuffers};
use lowbit_comm::{CommError, Communicator};
use lowbit_device::{AdamW, DType, Device, DeviceError, SgdMomentum, View};

/// Errors of the optimizers.
#[derive(Debug, thiserror::Error)]
pub enum OptimError {
    /// A device operation failed.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// A collective failed.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// A buffer operation failed.
    #[error(transparent)]
    Buffer(#[from] BufferError),
    /// Bad input: initial values of the wrong size, invalid hyper-parameters.
    #[error("{0}")]
    Invalid(String),
}

/// Result of this crate.
pub type Result<T, E = OptimError> = std::result::Result<T, E>;

/// The update rule.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Algorithm {
    /// AdamW with decoupled weight decay (PyTorch's formula order).
    AdamW {
        /// First-moment decay.
        beta1: f32,
        /// Second-moment decay.
        beta2: f32,
        /// Denominator epsilon.
        eps: f32,
        /// Decoupled weight decay.
        weight_decay: f32,
    },
    /// SGD with momentum (PyTorch's formula order).
    Sgd {
        /// Momentum factor.
        momentum: f32,
        /// L2 weight decay.
        weight_decay: f32,
    },
}

/// An optimizer's configuration.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OptimConfig {
    /// The update rule.
    pub algorithm: Algorithm,
    /// Learning rate.
    pub lr: f32,
    /// Clip the global gradient norm to this value (`None`: no clipping).
    pub clip_grad: Option<f32>,
}

impl OptimConfig {
    fn validate(&self) -> Result<()> {
        let bad = |what: &str| Err(OptimError::Invalid(format!("optimizer: {what}")));
        if !(self.lr.is_finite() && self.lr >= 0.0) {
            return bad("learning rate must be finite and non-negative");
        }
        if let Some(c) = self.clip_grad
            && !(c.is_finite() && c > 0.0)
        {
            return bad("clip_grad must be finite and positive");
        }
        match self.algorithm {
            Algorithm::AdamW {
                beta1, beta2, eps, ..
            } if !((0.0..1.0).contains(&beta1) && (0.0..1.0).contains(&beta2) && eps > 0.0) => {
                bad("AdamW needs 0 ≤ beta1, beta2 < 1 and eps > 0")
            }
            Algorithm::Sgd { momentum, .. } if !(0.0..1.0).contains(&momentum) => {
                bad("SGD needs 0 ≤ momentum < 1")
            }
            _ => Ok(()),
        }
    }
}

/// What one step did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepReport {
    /// Global gradient norm before clipping.
    pub grad_norm: f32,
    /// Whether the step was skipped because the norm was not finite.
    pub skipped: bool,
    /// The factor gradients were multiplied by (1 when not clipped).
    pub clip_coef: f32,
}

/// A downloaded piece of the fp32 masters.
#[derive(Clone, Debug, PartialEq)]
pub struct MasterShard {
    /// Global parameter id.
    pub param: usize,
    /// Range within the flattened parameter.
    pub range: std::ops::Range<usize>,
    /// The master values of that range.
    pub values: Vec<f32>,
}

/// One owned piece of a parameter with its fp32 master and optimizer state.
#[derive(Debug)]
struct Shard {
    /// What `param_view` is (persistent weights, staging view, packed NVFP4 bytes).
    storage: BufKind,
    param: usize,
    param_range: std::ops::Range<usize>,
    param_view: View,
    grad_view: View,
    master: View,
    grad32: View,
    state1: View,
    state2: View,
}

/// The distributed optimizer of one owner: fp32 masters and state for this rank's shards of the
/// owner's parameters (all of them without a distributed optimizer).
#[derive(Debug)]
pub struct DistributedOptimizer {
    owner: OptimizerId,
    cfg: OptimConfig,
    shards: Vec<Shard>,
    steps: u64,
}

impl DistributedOptimizer {
    /// Builds masters for the shards of `owner`'s parameters from `init[p]`, the high-precision
    /// initial values of every parameter (flattened, full size).
    pub fn new(
        dev: &mut Device,
        bufs: &DataParallelBuffers,
        owner: OptimizerId,
        cfg: OptimConfig,
        init: &[Vec<f32>],
    ) -> Result<Self> {
        cfg.validate()?;
        check_init(bufs, init)?;
        let mut shards = Vec::new();
        for s in bufs.owned_shards()? {
            if bufs.specs()[s.param].owner() != owner {
                continue;
            }
            let n = s.param_range.len();
            let master = dev.alloc(DType::F32, n);
            dev.upload(master, &init[s.param][s.param_range.clone()])?;
            shards.push(Shard {
                storage: s.storage,
                param: s.param,
                param_range: s.param_range,
                param_view: s.param_view,
                grad_view: s.grad_view,
                master,
                // fp32 gradients are used in place (they are dead after the step); others are
                // widened into a scratch copy.
                grad32: if s.grad_view.dtype() == DType::F32 {
                    s.grad_view
                } else {
                    dev.alloc(DType::F32, n)
                },
                state1: dev.alloc(DType::F32, n),
                // SGD keeps one state tensor (momentum), AdamW two.
                state2: dev.alloc(
                    DType::F32,
                    state_tensors(cfg.algorithm).saturating_sub(1) * n,
                ),
            });
        }
        Ok(DistributedOptimizer {
            owner,
            cfg,
            shards,
            steps: 0,
        })
    }

    /// The owner id of the parameters this optimizer updates.
    pub fn owner(&self) -> OptimizerId {
        self.owner
    }

    /// Changes the learning rate for the following steps (a schedule). Rejected unless finite
    /// and non-negative; the optimizer is unchanged then.
    pub fn set_lr(&mut self, lr: f32) -> Result<()> {
        let cfg = OptimConfig { lr, ..self.cfg };
        cfg.validate()?;
        self.cfg = cfg;
        Ok(())
    }

    /// Steps taken (skipped steps not counted).
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// This rank's fp32 masters, shard by shard.
    pub fn masters(&self, dev: &Device) -> Result<Vec<MasterShard>> {
        self.shards
            .iter()
            .map(|s| {
                Ok(MasterShard {
                    param: s.param,
                    range: s.param_range.clone(),
                    values: dev.download(s.master)?,
                })
            })
            .collect()
    }

    /// Bytes on this rank: (fp32 masters, optimizer state, fp32 gradient scratch).
    pub fn memory_bytes(&self) -> (usize, usize, usize) {
        self.shards.iter().fold((0, 0, 0), |(m, st, g), s| {
            (
                m + s.master.byte_len(),
                st + s.state1.byte_len() + s.state2.byte_len(),
                g + if s.grad32 == s.grad_view {
                    0
                } else {
                    s.grad32.byte_len()
                },
            )
        })
    }

    /// Copies the reduced gradients into fp32 and returns this rank's sum of squares (f64, shards
    /// in order; within a shard, `Device::sum_squares`'s blocked order: 4096-element partials in
    /// index order, then the partials in index order, the same bits on every backend).
    fn prepare(&mut self, dev: &mut Device) -> Result<f64> {
        let mut sum = 0.0;
        for s in &self.shards {
            if s.grad32 != s.grad_view {
                dev.cast(s.grad_view, s.grad32)?;
            }
            sum += dev.sum_squares(s.grad32)?;
        }
        Ok(sum)
    }

    /// Clips and updates every shard, writing the new parameter values into the param buffer.
    fn apply(&mut self, dev: &mut Device, clip_coef: f32) -> Result<()> {
        self.steps += 1;
        for s in &self.shards {
            if clip_coef < 1.0 {
                dev.scale(s.grad32, clip_coef)?;
            }
            match self.cfg.algorithm {
                Algorithm::AdamW {
                    beta1,
                    beta2,
                    eps,
                    weight_decay,
                } => {
                    let hp = AdamW {
                        lr: self.cfg.lr,
                        beta1,
                        beta2,
                        eps,
                        weight_decay,
                        step: self.steps,
                    };
                    // Staging views alias the gradients and are written only by `stage`.
                    let out = (s.storage == BufKind::Persistent).then_some(s.param_view);
                    dev.adamw(s.master, s.grad32, s.state1, s.state2, &hp, out)?;
                }
                Algorithm::Sgd {
                    momentum,
                    weight_decay,
                } => {
                    let hp = SgdMomentum {
                        lr: self.cfg.lr,
                        momentum,
                        weight_decay,
                    };
                    dev.sgd_momentum(s.master, s.grad32, s.state1, &hp, self.steps == 1)?;
                    if s.storage == BufKind::Persistent {
                        dev.cast(s.master, s.param_view)?;
                    }
                }
            }
        }
        Ok(())
    }
}

impl DistributedOptimizer {
    /// Stages the owner's low-precision weights from the masters: `bf16(master)` into every
    /// staging view (MXFP8; the group then waits for its gather), and NVFP4 or direct 2D MXFP8
    /// shards quantized into the buffer after a MAX-reduction of their tile amaxes
    /// (collective).
    fn stage(
        &self,
        dev: &mut Device,
        comm: &mut dyn Communicator,
        bufs: &mut DataParallelBuffers,
    ) -> Result<()> {
        for s in self.shards.iter().filter(|s| s.storage == BufKind::Staging) {
            dev.cast(s.master, s.param_view)?;
        }
        bufs.mark_staged(self.owner)?;
        let mut pieces = Vec::new();
        for s in self
            .shards
            .iter()
            .filter(|s| matches!(s.storage, BufKind::Packed | BufKind::Direct))
        {
            let tmp = dev.alloc(DType::Bf16, s.master.len());
            dev.cast(s.master, tmp)?;
            pieces.push((s.param, s.param_range.clone(), tmp));
        }
        let r = bufs.stage_packed(dev, comm, self.owner, &pieces);
        for (_, _, tmp) in pieces {
            dev.free(tmp)?;
        }
        Ok(r?)
    }
}

/// fp32 state tensors per element of an update rule.
fn state_tensors(a: Algorithm) -> usize {
    match a {
        Algorithm::AdamW { .. } => 2,
        Algorithm::Sgd { .. } => 1,
    }
}

/// Memory of one rank by category, in bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankMemory {
    /// Every parameter/gradient buffer.
    pub buffers: Vec<lowbit_buffers::BufferMemory>,
    /// fp32 master shards.
    pub masters: usize,
    /// Optimizer state (AdamW moments, SGD momentum).
    pub optimizer_state: usize,
    /// fp32 copies of the reduced gradient shards the update reads (zero with fp32 gradients,
    /// which are used in place).
    pub grad_scratch: usize,
}

impl RankMemory {
    /// Weight bytes (persistent parameter buffers and low-precision storage).
    pub fn weights(&self) -> usize {
        self.buffers.iter().map(|b| b.weights).sum()
    }
    /// Staging bytes (aliased with the gradients: not allocated).
    pub fn staging(&self) -> usize {
        self.buffers.iter().map(|b| b.staging).sum()
    }
    /// Gradient buffer bytes.
    pub fn grads(&self) -> usize {
        self.buffers.iter().map(|b| b.grads).sum()
    }
    /// Everything allocated (staging excluded: it is the gradient memory).
    pub fn total(&self) -> usize {
        self.weights() + self.grads() + self.masters + self.optimizer_state + self.grad_scratch
    }
}

/// What this rank holds, measured from the live buffers and optimizer.
pub fn memory_report(bufs: &DataParallelBuffers, opt: &ChainedOptimizer) -> RankMemory {
    let (mut masters, mut optimizer_state, mut grad_scratch) = (0, 0, 0);
    for p in opt.parts() {
        let (m, s, g) = p.memory_bytes();
        masters += m;
        optimizer_state += s;
        grad_scratch += g;
    }
    RankMemory {
        buffers: bufs.memory(),
        masters,
        optimizer_state,
        grad_scratch,
    }
}

/// What rank `rank` of `dp` would hold for `specs`, from the layouts alone (closed form, no
/// allocation), with `algorithm(owner)` the update rule of each owner.
pub fn estimate_memory(
    specs: &[lowbit_buffers::layout::ParamSpec],
    dp: usize,
    rank: usize,
    cfg: &lowbit_buffers::DdpConfig,
    algorithm: impl Fn(OptimizerId) -> Algorithm,
) -> Result<RankMemory> {
    use lowbit_buffers::layout;
    let buffers = lowbit_buffers::estimate_buffer_memory(specs, dp, cfg)?;
    let lcfg = layout::LayoutConfig {
        dp,
        bucket_size: if cfg.overlap_grad_reduce {
            cfg.bucket_size
        } else {
            None
        },
        distributed_optimizer: cfg.distributed_optimizer,
        high_busbw_padding: cfg.high_busbw_padding,
    };
    let (mut masters, mut optimizer_state, mut grad_scratch) = (0, 0, 0);
    for (key, members) in layout::group_params(specs) {
        let group: Vec<&layout::ParamSpec> = members.iter().map(|&i| &specs[i]).collect();
        let owned: usize = if cfg.distributed_optimizer {
            let lay = layout::compute_layout(&group, &lcfg).map_err(BufferError::from)?;
            layout::param_shard_ranges(&lay, rank)
                .map_err(BufferError::from)?
                .iter()
                .map(|r| r.param_range.len())
                .sum()
        } else {
            group.iter().map(|s| s.numel).sum()
        };
        masters += 4 * owned;
        optimizer_state += 4 * owned * state_tensors(algorithm(key.owner));
        if key.grad_dtype != layout::GradDType::F32 {
            grad_scratch += 4 * owned;
        }
    }
    Ok(RankMemory {
        buffers,
        masters,
        optimizer_state,
        grad_scratch,
    })
}

fn check_init(bufs: &DataParallelBuffers, init: &[Vec<f32>]) -> Result<()> {
    if init.len() != bufs.specs().len() {
        return Err(OptimError::Invalid(format!(
            "{} initial values for {} parameters",
            init.len(),
            bufs.specs().len()
        )));
    }
    for (spec, v) in bufs.specs().iter().zip(init) {
        if v.len() != spec.numel {
            return Err(OptimError::Invalid(format!(
                "parameter `{}`: {} initial values for {} elements",
                spec.name,
                v.len(),
                spec.numel
            )));
        }
    }
    Ok(())
}

/// Writes every parameter's initial value, rounded to its storage dtype, into the param buffer,
/// or as `Q(bf16(init))` into its low-precision storage (every rank writes every parameter, so
/// all ranks start identical).
pub fn initialize_params(
    dev: &mut Device,
    bufs: &mut DataParallelBuffers,
    init: &[Vec<f32>],
) -> Result<()> {
    check_init(bufs, init)?;
    for (p, v) in init.iter().enumerate() {
        if bufs.is_low_precision(p) {
            // Low-precision primary weights start as Q(bf16(init)), written directly.
            bufs.initialize_quantized(dev, p, v)?;
            continue;
        }
        let view = bufs.param_view(p)?;
        let tmp = dev.alloc(DType::F32, v.len());
        dev.upload(tmp, v)?;
        dev.cast(tmp, view)?;
        dev.free(tmp)?;
    }
    Ok(())
}

/// Several optimizers over one set of buffers (for example AdamW for matrices and another
/// configuration for biases), stepped together: one global gradient norm, one clip factor, one
/// skip decision, then one parameter sync.
#[derive(Debug)]
pub struct ChainedOptimizer {
    parts: Vec<DistributedOptimizer>,
    skipped: u64,
}

impl ChainedOptimizer {
    /// Chains `parts` (their owners must differ).
    pub fn new(parts: Vec<DistributedOptimizer>) -> Result<Self> {
        for (i, a) in parts.iter().enumerate() {
            if parts[..i].iter().any(|b| b.owner == a.owner) {
                return Err(OptimError::Invalid(format!(
                    "two chained optimizers own {:?}",
                    a.owner
                )));
            }
        }
        Ok(ChainedOptimizer { parts, skipped: 0 })
    }

    /// The chained optimizers.
    pub fn parts(&self) -> &[DistributedOptimizer] {
        &self.parts
    }

    /// Sets every part's learning rate to `lr` (see [`DistributedOptimizer::set_lr`]); nothing
    /// changes if it is invalid.
    pub fn set_lr(&mut self, lr: f32) -> Result<()> {
        OptimConfig {
            lr,
            ..self.parts.first().map_or(
                OptimConfig {
                    algorithm: Algorithm::Sgd {
                        momentum: 0.0,
                        weight_decay: 0.0,
                    },
                    lr,
                    clip_grad: None,
                },
                |p| p.cfg,
            )
        }
        .validate()?;
        self.parts.iter_mut().try_for_each(|p| p.set_lr(lr))
    }

    /// Steps skipped because the gradient norm was not finite.
    pub fn skipped_steps(&self) -> u64 {
        self.skipped
    }

    /// One optimizer step after `finish_grad_sync`: grad norm over all parts and ranks, clip,
    /// skip if not finite, update, then gather parameters unless the gather is overlapped with
    /// the next forward.
    pub fn step(
        &mut self,
        dev: &mut Device,
        comm: &mut dyn Communicator,
        bufs: &mut DataParallelBuffers,
    ) -> Result<StepReport> {
        let mut local = 0.0f64;
        for p in &mut self.parts {
            local += p.prepare(dev)?;
        }
        let total = if bufs.config().distributed_optimizer {
            sum_across_ranks(dev, comm, local)?
        } else {
            local
        };
        let grad_norm = total.sqrt() as f32;
        if !grad_norm.is_finite() {
            self.skipped += 1;
            return Ok(StepReport {
                grad_norm,
                skipped: true,
                clip_coef: 1.0,
            });
        }
        let clip = self
            .parts
            .iter()
            .filter_map(|p| p.cfg.clip_grad)
            .reduce(f32::min);
        let clip_coef = clip.map_or(1.0, |c| (c / (grad_norm + 1e-6)).min(1.0));
        for p in &mut self.parts {
            p.apply(dev, clip_coef)?;
            bufs.mark_stale(p.owner);
        }
        if !bufs.config().overlap_param_gather {
            // Gradients are dead (copied to fp32 in `prepare`), so the staging views that alias
            // them can be written now; every part stages before the one gather of each group.
            for p in &self.parts {
                p.stage(dev, comm, bufs)?;
            }
            bufs.sync_params(dev, comm)?;
        }
        Ok(StepReport {
            grad_norm,
            skipped: false,
            clip_coef,
        })
    }
}

impl ChainedOptimizer {
    /// Starts an iteration: zeroes the gradient buffers (and with them the staging views), then
    /// stages `bf16(master)` for every owner whose low-precision weights are stale, so that the
    /// forward's lazy gathers ship the new values. This is the only order that works (zero →
    /// stage → gather → re-quantize → zero the group's staging view → backward), so it is one
    /// call.
    pub fn begin_iteration(
        &self,
        dev: &mut Device,
        comm: &mut dyn Communicator,
        bufs: &mut DataParallelBuffers,
    ) -> Result<()> {
        bufs.zero_grad_buffer(dev)?;
        for p in &self.parts {
            if bufs.has_stale(p.owner) {
                p.stage(dev, comm, bufs)?;
            }
        }
        Ok(())
    }

    /// A forced parameter sync (eval, checkpoint save): completes gathers in flight, zeroes the
    /// gradients, restages every owner's `bf16(master)` and gathers every group now. Right after
    /// a normal step it leaves every weight bitwise unchanged. Gradients are destroyed, so call
    /// it between steps.
    pub fn force_param_sync(
        &self,
        dev: &mut Device,
        comm: &mut dyn Communicator,
        bufs: &mut DataParallelBuffers,
    ) -> Result<()> {
        bufs.complete_param_sync(dev)?;
        bufs.zero_grad_buffer(dev)?;
        for p in &self.parts {
            p.stage(dev, comm, bufs)?;
        }
        bufs.sync_params(dev, comm)?;
        Ok(())
    }
}

/// Adds one f64 per rank in rank order: the values travel as bytes (an all-gather), so the sum
/// is the same on every rank and independent of timing.
fn sum_across_ranks(dev: &mut Device, comm: &mut dyn Communicator, local: f64) -> Result<f64> {
    let n = comm.size();
    let buf = dev.alloc(DType::U8, 8 * n);
    let mine = buf.slice(8 * comm.rank()..8 * (comm.rank() + 1))?;
    dev.write_bytes(mine, &local.to_le_bytes())?;
    let result = comm
        .start_all_gather(dev, mine, buf)
        .and_then(|w| w.wait(dev));
    let bytes = dev.read_bytes(buf);
    dev.free(buf)?;
    result?;
    Ok(bytes?
        .chunks_exact(8)
        .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")))
        .sum())
}
