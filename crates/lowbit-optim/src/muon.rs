//! [`Muon`]: momentum orthogonalized by Newton–Schulz over whole matrices, PyTorch's
//! `torch.optim.Muon` (2.9+, `torch/optim/_muon.py`, `_single_tensor_muon`) on device ops.
//!
//! Per owned parameter and step, in PyTorch's order:
//! ```text
//! buf ← lerp(buf, g, 1 − momentum)                        (buf.lerp_(grad, 1 - momentum))
//! u   ← nesterov ? lerp(g, buf, momentum) : buf
//! O   ← NS(u) per matrix (a grouped [experts, out, in] tensor: each expert on its own)
//! p   ← p · (1 − lr·wd)                                    (decoupled weight decay)
//! p   ← p + (−lr·scale(out, in)) · O                        (scale: MuonLrScale)
//! ```
//! `NS` is `newton_schulz.rs`. The `lerp`s are PyTorch's scalar formula (`|w| < 0.5 ?
//! a + w·(b − a) : b − (b − a)·(1 − w)`, `1 − w` in f32) as `copy`/`axpy`/`scale`/`add`; per-call
//! scalars are computed in f64 from the f32 hyper-parameters and rounded to f32 once, as
//! PyTorch's Python-float scalars are. In the default [`NsMode::Exact`] everything is a pure
//! function of the inputs (fixed summation orders, no FMA), so the CPU and CUDA backends give
//! the same bits, and so do one and several ranks (each matrix is updated whole by the rank that
//! owns it). [`NsMode::Fast`] runs the Newton–Schulz GEMMs on the tensor cores (cuBLASLt) on a
//! CUDA device: still deterministic for a given GPU and library, and one and several ranks still
//! agree bit for bit, but it is not the CPU's bits.
//!
//! Whole parameters only: the owner must be planned so that every rank owns whole parameters
//! (`ShardingStrategy::LayerWise`, or `Replicated`); a plan that splits one of its parameters
//! is refused on every rank ([`InvalidInput::PartialParameter`]), as is a parameter that is not
//! a matrix or a grouped expert tensor ([`InvalidInput::NotAMatrix`]).

mod newton_schulz;

use std::ops::Range;

use lowbit_buffers::DataParallelBuffers;
use lowbit_device::{DType, Device, View};
use lowbit_layout::OptimizerId;

use crate::error::{InvalidInput, Result};
use crate::optimizer::{
    GradPiece, Leaf, MasterPiece, OptimConfig, Optimizer, OptimizerMemory, OptimizerState,
    StateViews, UpdateScope,
};
use newton_schulz::{NsParams, NsScratch};

/// How Muon scales the learning rate of an `out x in` matrix (`rows x cols`; each expert of a
/// grouped tensor on its own).
#[non_exhaustive]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum MuonLrScale {
    /// `sqrt(max(1, rows / cols))`: Keller Jordan's original rule, PyTorch's
    /// `adjust_lr_fn=None` / `"original"` (`torch/optim/_muon.py`, `_adjust_lr`).
    #[default]
    #[cfg_attr(
        feature = "clap",
        value(
            name = "original",
            help = "max(1, out/in)^0.5 (Keller Jordan; torch.optim.Muon's default)"
        )
    )]
    Original,
    /// `0.2 · sqrt(max(rows, cols))`: Moonshot's rule matching AdamW's update RMS, PyTorch's
    /// `adjust_lr_fn="match_rms_adamw"`.
    #[cfg_attr(
        feature = "clap",
        value(
            name = "match_rms_adamw",
            help = "0.2 max(out, in)^0.5 (Moonshot: AdamW's update RMS)"
        )
    )]
    MatchRmsAdamW,
    /// `sqrt(max(rows, cols))`: Megatron-LM's default `muon_scale_mode="spectral"` (with
    /// `muon_extra_scale_factor` 1). Megatron's `TensorParallelMuon`
    /// (`megatron/core/optimizer/muon.py`) scales the orthogonalized update by
    /// `get_muon_scale_factor(size_out, size_in, mode="spectral")` of NVIDIA-NeMo's
    /// Emerging-Optimizers (`emerging_optimizers/orthogonalized_optimizers/muon.py`), which
    /// returns `max(size_out, size_in) ** 0.5`, with the sizes of the whole (unsharded) matrix;
    /// `OrthogonalizedOptimizer.step` then adds the update at `-lr`.
    #[cfg_attr(
        feature = "clap",
        value(name = "spectral", help = "max(out, in)^0.5 (Megatron-LM's default)")
    )]
    Spectral,
}

impl MuonLrScale {
    /// PyTorch's spelling (the command line's).
    pub fn name(self) -> &'static str {
        match self {
            MuonLrScale::Original => "original",
            MuonLrScale::MatchRmsAdamW => "match_rms_adamw",
            MuonLrScale::Spectral => "spectral",
        }
    }

    /// The factor for a `rows x cols` matrix, in f64 (PyTorch's and Megatron's Python floats).
    pub fn factor(self, rows: usize, cols: usize) -> f64 {
        let (r, c) = (rows as f64, cols as f64);
        match self {
            MuonLrScale::Original => (r / c).max(1.0).sqrt(),
            MuonLrScale::MatchRmsAdamW => 0.2 * r.max(c).sqrt(),
            MuonLrScale::Spectral => r.max(c).sqrt(),
        }
    }
}

/// The dtype of the Newton–Schulz iterate.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum NsDtype {
    /// f32 throughout (every GEMM result rounded to f32).
    #[cfg_attr(feature = "clap", value(name = "f32", help = "f32 throughout"))]
    F32,
    /// As `torch.optim.Muon`: the input, the normalized iterate and every GEMM result (`A`,
    /// `B`, the next `X`) rounded to bf16; sums in f32.
    #[default]
    #[cfg_attr(
        feature = "clap",
        value(
            name = "bf16",
            help = "bf16 iterate and GEMM results, f32 sums (torch.optim.Muon)"
        )
    )]
    Bf16,
}

impl NsDtype {
    /// The lower-case name (the command line's spelling).
    pub fn name(self) -> &'static str {
        match self {
            NsDtype::F32 => "f32",
            NsDtype::Bf16 => "bf16",
        }
    }
}

/// How the Newton–Schulz GEMMs run.
///
/// **Fast vs exact**, measured by `benches/muon_bench.rs` on an NVIDIA H200 (CUDA 13 cuBLASLt,
/// 2026-11-26): one Muon step (PyTorch's defaults, bf16 iterate, 5 NS steps) on a Gaussian
/// gradient, the orthogonalized update `O` of the two modes compared.
///
/// | shape (rows x cols) | ‖O_fast − O_exact‖_F / ‖O_exact‖_F | max \|O_fast − O_exact\| / max \|O_exact\| |
/// | --- | --- | --- |
/// | 256 x 1024 | 4.1e-3 | 1.6e-2 |
/// | 1024 x 256 | 4.0e-3 | 2.1e-2 |
/// | 512 x 512 | 6.5e-3 | 1.5e-2 |
/// | 1024 x 4096 (Llama-3-8B k, v) | 3.8e-3 | 2.0e-2 |
/// | 4096 x 4096 (q, o) | 4.7e-3 | 1.3e-2 |
/// | 14336 x 4096 (gate, up) | 4.6e-3 | 2.7e-2 |
/// | 4096 x 14336 (down) | 4.6e-3 | 2.4e-2 |
///
/// That is the size of a few bf16 roundings (a bf16 ulp is 2⁻⁸ = 3.9e-3 relative): both modes
/// round the iterate to bf16 after every GEMM, and a different f32 summation order flips some
/// of those roundings, which the remaining iterations carry along. It does not grow with the
/// matrix size. The symmetric-block GEMMs gave the same bits as full GEMMs at 4096 x 4096 and
/// 14336 x 4096 (relative difference 0).
#[non_exhaustive]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum NsMode {
    /// The device's deterministic `matmul` (f32 sums in index order, no FMA): the same bits on
    /// the CPU and on CUDA, and on one rank or many. Slow on a GPU (one thread per output).
    #[default]
    Exact,
    /// Tensor-core GEMMs (`Device::matmul_tc`: cuBLASLt, bf16 inputs, f32 accumulation, one
    /// rounding to bf16 per GEMM, `addmm`-style epilogues fused) on a CUDA device; the Gram
    /// matrix `X·Xᵀ` and `A·A` are computed as symmetric products (three quarters of the
    /// multiply-adds for sides of 2048 and more). The roundings are the bf16 mode's (every GEMM
    /// result rounded to bf16, as `torch.optim.Muon`); only the f32 summation order differs,
    /// so results are close to [`NsMode::Exact`] but not bit-identical, and not identical
    /// between GPU models or cuBLAS versions. Needs [`NsDtype::Bf16`]. The one other change is
    /// the momentum: the two lerps run as `buf ← μ·buf + (1−μ)·g` and `u ← (1−μ)·g + μ·buf`
    /// (`scale`/`axpy`: 48 bytes of memory traffic per element instead of the 72 of PyTorch's
    /// `lerp` formula, which the exact mode keeps; the two agree within about an f32 ulp per
    /// step). Normalization, weight decay and the update are the same code in both modes.
    ///
    /// **On the CPU backend Fast runs [`NsMode::Exact`]** (the CPU has no tensor cores, and the
    /// exact path is its fastest): a CPU run with Fast is bit-identical to one with Exact.
    ///
    /// Speed (`benches/muon_bench.rs`, one H200, one step over the seven matrices of a
    /// Llama-3-8B layer, f32 parameters and gradients): Fast 33.4 ms, `torch.optim.Muon` (2.11)
    /// 35.5 ms on the same card in the same run, Exact 21.8 s.
    Fast,
}

/// Muon's hyper-parameters (the learning rate is in [`OptimConfig`], as for every optimizer).
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MuonConfig {
    /// Momentum `μ`: `buf ← lerp(buf, g, 1 − μ)`. In `[0, 1)`.
    pub momentum: f32,
    /// Nesterov momentum: orthogonalize `lerp(g, buf, μ)` instead of `buf`.
    pub nesterov: bool,
    /// Newton–Schulz iterations, `1..100` (PyTorch refuses 100 and more).
    pub ns_steps: u32,
    /// The quintic's coefficients `(a, b, c)`: `X ← a·X + (b·A + c·A·A)·X`.
    pub ns_coefficients: [f32; 3],
    /// Lower bound of the Frobenius norm the input is divided by.
    pub eps: f32,
    /// Decoupled weight decay: `p ← p · (1 − lr·wd)` before the update.
    pub weight_decay: f32,
    /// The per-matrix learning-rate scale.
    pub lr_scale: MuonLrScale,
    /// The dtype of the Newton–Schulz iterate.
    pub ns_dtype: NsDtype,
    /// How the Newton–Schulz GEMMs run (exact by default).
    pub ns_mode: NsMode,
}

impl Default for MuonConfig {
    /// `torch.optim.Muon`'s defaults: momentum 0.95, Nesterov, 5 steps of
    /// (3.4445, −4.7750, 2.0315), eps 1e-7, weight decay 0.1, the original lr scale, bf16;
    /// the exact Newton–Schulz mode.
    fn default() -> Self {
        MuonConfig {
            momentum: 0.95,
            nesterov: true,
            ns_steps: 5,
            ns_coefficients: [3.4445, -4.7750, 2.0315],
            eps: 1e-7,
            weight_decay: 0.1,
            lr_scale: MuonLrScale::Original,
            ns_dtype: NsDtype::Bf16,
            ns_mode: NsMode::Exact,
        }
    }
}

impl MuonConfig {
    lowbit_layout::setters! {
        /// Sets the momentum.
        with_momentum => momentum: f32;
        /// Sets Nesterov momentum.
        with_nesterov => nesterov: bool;
        /// Sets the number of Newton–Schulz iterations.
        with_ns_steps => ns_steps: u32;
        /// Sets the Newton–Schulz coefficients `(a, b, c)`.
        with_ns_coefficients => ns_coefficients: [f32; 3];
        /// Sets the norm's lower bound.
        with_eps => eps: f32;
        /// Sets the decoupled weight decay.
        with_weight_decay => weight_decay: f32;
        /// Sets the learning-rate scale.
        with_lr_scale => lr_scale: MuonLrScale;
        /// Sets the dtype of the Newton–Schulz iterate.
        with_ns_dtype => ns_dtype: NsDtype;
        /// Sets how the Newton–Schulz GEMMs run.
        with_ns_mode => ns_mode: NsMode;
    }

    /// Checks the values.
    ///
    /// # Errors
    /// [`InvalidInput::Hyper`] naming the rule broken.
    pub fn validate(&self) -> Result<()> {
        let hyper = |what| Err(InvalidInput::Hyper { rule: "Muon", what }.into());
        if !(self.momentum.is_finite() && (0.0..1.0).contains(&self.momentum)) {
            return hyper("needs 0 ≤ momentum < 1");
        }
        if !(1..100).contains(&self.ns_steps) {
            return hyper("needs 1 ≤ ns_steps < 100");
        }
        if !self.ns_coefficients.iter().all(|c| c.is_finite()) {
            return hyper("needs finite ns_coefficients");
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return hyper("needs a finite eps > 0");
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return hyper("needs a finite weight_decay ≥ 0");
        }
        if self.ns_mode == NsMode::Fast && self.ns_dtype != NsDtype::Bf16 {
            return hyper("needs ns_dtype Bf16 with ns_mode Fast (tensor-core inputs are bf16)");
        }
        Ok(())
    }
}

/// `(matrices, rows, cols)` of a shape Muon orthogonalizes: `[out, in]` or `[experts, out, in]`.
fn matrices_of(shape: &[usize]) -> Option<(usize, usize, usize)> {
    match *shape {
        [r, c] if r > 0 && c > 0 => Some((1, r, c)),
        [e, r, c] if e > 0 && r > 0 && c > 0 => Some((e, r, c)),
        _ => None,
    }
}

/// One owned parameter (whole) with its master and momentum.
#[derive(Debug)]
struct Shard {
    param: usize,
    numel: usize,
    /// Matrices (experts) of `rows x cols`.
    matrices: usize,
    rows: usize,
    cols: usize,
    grad_view: View,
    fused_output: Option<View>,
    master: View,
    /// The fp32 gradient: the reduced gradient itself when it is fp32, otherwise a copy.
    grad32: View,
    momentum: View,
}

/// Device scratch of the update: two f32 element-wise temporaries and the Newton–Schulz
/// scratch, each sized for the largest owned parameter (or matrix).
#[derive(Debug)]
struct Scratch {
    /// The Nesterov update `lerp(g, buf, μ)` (without Nesterov the update is the momentum).
    update: Option<View>,
    /// `g − buf` for the momentum `lerp`.
    diff: View,
    ns: NsScratch,
}

/// Muon over the whole parameters of one owner that this rank owns (see the module docs).
#[derive(Debug)]
pub struct Muon {
    owner: OptimizerId,
    cfg: OptimConfig,
    muon: MuonConfig,
    shards: Vec<Shard>,
    /// `None` on a rank that owns none of the owner's parameters.
    scratch: Option<Scratch>,
    steps: u64,
}

/// The rule name in exported state.
const RULE: &str = "muon";

/// The state names of a Muon shard after `"master"`.
const STATE_NAMES: [&str; 1] = ["momentum_buffer"];

impl Muon {
    /// Builds fp32 masters and zeroed momentum for this rank's parameters of `owner`.
    /// `init(p, 0..numel)` returns parameter `p`'s high-precision initial values; only the
    /// parameters this rank owns are asked for.
    ///
    /// Every rank checks the whole plan, so all refuse the same plan: every parameter of
    /// `owner` must be a matrix `[out, in]` or a grouped `[experts, out, in]` tensor, and every
    /// rank's pieces of them must be whole parameters.
    ///
    /// # Errors
    /// [`InvalidInput::NotAMatrix`], [`InvalidInput::PartialParameter`], invalid
    /// hyper-parameters ([`InvalidInput::Hyper`], [`InvalidInput::LearningRate`],
    /// [`InvalidInput::ClipGrad`]) or initial values ([`InvalidInput::InitLength`]), buffer and
    /// device errors.
    pub fn new(
        dev: &mut Device,
        bufs: &DataParallelBuffers,
        owner: OptimizerId,
        muon: MuonConfig,
        cfg: OptimConfig,
        init: &mut dyn FnMut(usize, Range<usize>) -> Vec<f32>,
    ) -> Result<Self> {
        cfg.validate()?;
        muon.validate()?;
        if cfg.master_dtype != crate::MasterDtype::F32 {
            return Err(crate::InvalidInput::MasterDtype { optimizer: "Muon" }.into());
        }
        let specs = bufs.specs();
        for s in specs.iter().filter(|s| s.owner() == owner) {
            if matrices_of(&s.shape).is_none() {
                return Err(InvalidInput::NotAMatrix {
                    name: s.name.clone(),
                    shape: s.shape.clone(),
                }
                .into());
            }
        }
        let plan = bufs.plan();
        for rank in 0..plan.dp() {
            for piece in plan.owned(rank)? {
                let spec = &specs[piece.param];
                if spec.owner() == owner && piece.param_range != (0..spec.numel) {
                    return Err(InvalidInput::PartialParameter {
                        name: spec.name.clone(),
                        rank,
                        range: piece.param_range,
                        numel: spec.numel,
                    }
                    .into());
                }
            }
        }
        // Every parameter's values are asked for and checked before anything is allocated, so
        // a refusal leaks nothing.
        let owned = bufs.owned_shards_of(owner)?;
        let mut values = Vec::with_capacity(owned.len());
        for s in &owned {
            let numel = specs[s.param].numel;
            let v = init(s.param, 0..numel);
            if v.len() != numel {
                return Err(InvalidInput::InitLength {
                    param: s.param,
                    got: v.len(),
                    expected: numel,
                }
                .into());
            }
            values.push(v);
        }
        let mut shards: Vec<Shard> = Vec::with_capacity(owned.len());
        for (s, values) in owned.into_iter().zip(values) {
            let spec = &specs[s.param];
            let (matrices, rows, cols) = matrices_of(&spec.shape).expect("checked above");
            let numel = spec.numel;
            let master = dev.alloc(DType::F32, numel);
            dev.upload(master, &values)?;
            let grad32 = if s.grad_view.dtype() == DType::F32 {
                s.grad_view
            } else {
                dev.alloc(DType::F32, numel)
            };
            shards.push(Shard {
                param: s.param,
                numel,
                matrices,
                rows,
                cols,
                grad_view: s.grad_view,
                fused_output: s.fused_output,
                master,
                grad32,
                momentum: dev.alloc(DType::F32, numel),
            });
        }
        let scratch = (!shards.is_empty()).then(|| {
            let max_numel = shards.iter().map(|s| s.numel).max().unwrap_or(0);
            let max_len = shards.iter().map(|s| s.rows * s.cols).max().unwrap_or(0);
            let max_side = shards.iter().map(|s| s.rows.min(s.cols)).max().unwrap_or(0);
            Scratch {
                update: muon.nesterov.then(|| dev.alloc(DType::F32, max_numel)),
                diff: dev.alloc(DType::F32, max_numel),
                ns: NsScratch::new(dev, muon.ns_dtype, muon.ns_mode, max_len, max_side),
            }
        });
        Ok(Muon {
            owner,
            cfg,
            muon,
            shards,
            scratch,
            steps: 0,
        })
    }

    /// The owner id of the parameters this optimizer updates.
    pub fn owner(&self) -> OptimizerId {
        self.owner
    }

    /// The learning rate and clipping.
    pub fn config(&self) -> OptimConfig {
        self.cfg
    }

    /// Muon's hyper-parameters.
    pub fn muon_config(&self) -> MuonConfig {
        self.muon
    }

    /// The piece of shard `s` (a whole parameter), as the driver stages it.
    fn piece(s: &Shard) -> MasterPiece {
        MasterPiece {
            param: s.param,
            range: 0..s.numel,
            master: s.master,
            fused_output: s.fused_output,
        }
    }

    /// One update of one whole parameter (the gradient clipped already).
    fn update_matrix(
        dev: &mut Device,
        m: &MuonConfig,
        lr: f32,
        s: &Shard,
        sc: &Scratch,
    ) -> Result<()> {
        let n = s.numel;
        let (g, buf) = (s.grad32, s.momentum);
        let diff = sc.diff.slice(0..n)?;
        // buf.lerp_(grad, 1 - momentum): the weight is the f64 difference rounded to f32.
        let w = (1.0 - f64::from(m.momentum)) as f32;
        let fast = sc.ns.is_fast();
        if fast {
            // buf ← μ·buf + w·g (the fast mode's two-pass form).
            dev.scale(buf, m.momentum)?;
            dev.axpy(w, g, buf)?;
        } else {
            lerp(dev, buf, g, w, buf, diff)?;
        }
        // update = grad.lerp(buf, momentum) if nesterov else buf
        let update = match sc.update {
            Some(u) => {
                let u = u.slice(0..n)?;
                if fast {
                    // u ← w·g + μ·buf.
                    dev.copy(g, u)?;
                    dev.scale(u, w)?;
                    dev.axpy(m.momentum, buf, u)?;
                } else {
                    lerp(dev, g, buf, m.momentum, u, diff)?;
                }
                u
            }
            None => buf,
        };
        let decay = (1.0 - f64::from(lr) * f64::from(m.weight_decay)) as f32;
        let alpha = (-(f64::from(lr) * m.lr_scale.factor(s.rows, s.cols))) as f32;
        let ns = NsParams {
            steps: m.ns_steps,
            coefficients: m.ns_coefficients,
            eps: m.eps,
        };
        // p.mul_(1 - lr·wd) is exact for wd = 0 (p·1 = p), so it is skipped then.
        if m.weight_decay != 0.0 {
            dev.scale(s.master, decay)?;
        }
        let len = s.rows * s.cols;
        for e in 0..s.matrices {
            let range = e * len..(e + 1) * len;
            let o = sc
                .ns
                .orthogonalize(dev, update.slice(range.clone())?, s.rows, s.cols, ns)?;
            dev.axpy(alpha, o, s.master.slice(range)?)?;
        }
        if let Some(out) = s.fused_output {
            dev.cast(s.master, out)?;
        }
        Ok(())
    }

    /// The state methods' view of this optimizer: per parameter the master, then the momentum.
    fn leaf(&self) -> Leaf<'_, impl Iterator<Item = (&'static str, usize, Range<usize>, View)>> {
        let tensors = self.shards.iter().flat_map(|s| {
            [("master", s.master), (STATE_NAMES[0], s.momentum)]
                .map(|(name, view)| (name, s.param, 0..s.numel, view))
        });
        Leaf {
            owner: self.owner,
            rule: RULE,
            steps: self.steps,
            per_shard: 1 + STATE_NAMES.len(),
            tensors,
        }
    }
}

/// `out ← torch.lerp(start, end, w)` in f32, PyTorch's scalar formula: `start + w·(end − start)`
/// for `|w| < 0.5`, else `end − (end − start)·(1 − w)` with `1 − w` in f32. `out` may be `start`
/// (in place) but must not overlap `end` or `tmp`; `tmp` is scratch of the same length.
fn lerp(dev: &mut Device, start: View, end: View, w: f32, out: View, tmp: View) -> Result<()> {
    if w.abs() < 0.5 {
        dev.copy(end, tmp)?;
        dev.axpy(-1.0, start, tmp)?; // fl(end − start)
        if out != start {
            dev.copy(start, out)?;
        }
        dev.axpy(w, tmp, out)?; // fl(start + fl(w·d))
    } else {
        let d = if out == start { tmp } else { out };
        dev.copy(end, d)?;
        dev.axpy(-1.0, start, d)?; // fl(end − start)
        dev.scale(d, -(1.0 - w))?; // −fl(d·(1 − w)): negation is exact
        dev.add(end, d)?; // fl(end − fl(d·(1 − w)))
        if d != out {
            dev.copy(d, out)?;
        }
    }
    Ok(())
}

impl Optimizer for Muon {
    fn owners(&self) -> Vec<OptimizerId> {
        vec![self.owner]
    }

    /// Parameters in order (each summed in `Device::sum_squares`'s blocked order).
    fn grad_pieces(&self) -> Vec<GradPiece> {
        let pieces = self.shards.iter().map(|s| GradPiece {
            param: s.param,
            grad: s.grad_view,
            grad32: s.grad32,
        });
        pieces.collect()
    }

    fn clip_grad(&self) -> Option<f32> {
        self.cfg.clip_grad
    }

    fn begin_step(&mut self) {
        self.steps += 1;
    }

    /// Parameter by parameter, in order (each matrix on its own: the same bits whatever the
    /// scope).
    fn update(
        &mut self,
        dev: &mut Device,
        clip: f32,
        scope: UpdateScope<'_>,
    ) -> Result<Vec<MasterPiece>> {
        let mut updated = Vec::new();
        if let Some(sc) = &self.scratch {
            for s in self
                .shards
                .iter()
                .filter(|s| scope.covers(self.owner, s.param))
            {
                if clip < 1.0 {
                    dev.scale(s.grad32, clip)?;
                }
                Self::update_matrix(dev, &self.muon, self.cfg.lr, s, sc)?;
                updated.push(Self::piece(s));
            }
        }
        Ok(updated)
    }

    /// One entry for the owner even on a rank that owns none of its parameters (an empty piece
    /// list): staging is collective, so every rank stages every owner.
    fn masters_to_stage(&self) -> Vec<(OptimizerId, Vec<MasterPiece>)> {
        vec![(self.owner, self.shards.iter().map(Self::piece).collect())]
    }

    fn set_lr(&mut self, lr: f32) -> Result<()> {
        self.cfg = self.cfg.scheduled(lr)?;
        Ok(())
    }

    fn steps(&self) -> u64 {
        self.steps
    }

    /// One entry: rule `"muon"`, per parameter `"master"` then `"momentum_buffer"`.
    fn export_state(&self, dev: &Device) -> Result<Vec<OptimizerState>> {
        crate::optimizer::exported(self, dev)
    }

    fn export_state_into(&self, dev: &Device, out: &mut Vec<OptimizerState>) -> Result<()> {
        self.leaf().export_into(Some(dev), out)
    }

    fn export_template(&self, _: &Device) -> Result<Vec<OptimizerState>> {
        self.leaf().template()
    }

    fn check_import(&self, state: &[OptimizerState]) -> Result<()> {
        self.leaf().matched(state).map(drop)
    }

    fn import_state(&mut self, dev: &mut Device, state: &[OptimizerState]) -> Result<()> {
        self.steps = self.leaf().import(dev, state)?;
        Ok(())
    }

    fn state_views(&self) -> Option<Vec<StateViews>> {
        Some(vec![self.leaf().views()])
    }

    fn set_steps(&mut self, owner: OptimizerId, steps: u64) -> Result<()> {
        let steps = self.leaf().checked_steps(owner, steps)?;
        self.steps = steps;
        Ok(())
    }

    /// Masters, momentum (`state`) and scratch: the fp32 copies of non-fp32 gradients plus the
    /// update's temporaries and the Newton–Schulz scratch (`grad_scratch`).
    fn memory(&self) -> OptimizerMemory {
        let scratch = self.scratch.as_ref().map_or(0, |sc| {
            sc.update.map_or(0, |u| u.byte_len()) + sc.diff.byte_len() + sc.ns.bytes()
        });
        self.shards.iter().fold(
            OptimizerMemory {
                grad_scratch: scratch,
                ..OptimizerMemory::default()
            },
            |m, s| OptimizerMemory {
                masters: m.masters + s.master.byte_len(),
                state: m.state + s.momentum.byte_len(),
                grad_scratch: m.grad_scratch
                    + if s.grad32 == s.grad_view {
                        0
                    } else {
                        s.grad32.byte_len()
                    },
            },
        )
    }
}
