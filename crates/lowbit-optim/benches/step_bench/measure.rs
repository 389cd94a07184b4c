//! What one rank measures: the bounds (plain collectives and device copies of the step's
//! sizes), the step phase by phase and whole, and the step interleaved with compute.

use lowbit_buffers::protocol::StepProtocol;
use std::collections::BTreeMap;
use std::time::Instant;

use lowbit_buffers::layout::{GradDType, ShardingPlan};
use lowbit_buffers::{
    DataParallelBuffers, DdpConfig, StorageKind, Usage, mxfp8_weight_config, transient_bound,
};
use lowbit_comm::{Communicator, ReduceOp};
use lowbit_device::{DType, Device, Fp8Kind, MatmulSpec, View, mxfp8_tile_count};
use lowbit_optim::{MasterDtype, Optimizer, RuleMemory, estimate_memory, memory_report};
use lowbit_train::protocol;

use crate::setup::{Config, GradSource, Param, Precision, Res, build};

/// The phases, in step order (the keys of `torch_step.py`'s `phases_ms`).
pub const PHASES: [&str; 6] = [
    "reduce_scatter",
    "norm",
    "optimizer",
    "staging",
    "gather",
    "requantize",
];
pub const RS: usize = 0;
pub const NORM: usize = 1;
pub const GATHER: usize = 4;
pub const REQUANT: usize = 5;

/// How long and how much: warm-up and timed iterations, whether the device is a GPU (sizes of
/// the gradient pattern and of the compute kernel), the overlap mode's compute per layer
/// (forward; the backward gets twice as much) and bucket elements (`None`: one layer).
#[derive(Clone, Debug)]
pub struct Settings {
    pub reps: (usize, usize),
    pub gpu: bool,
    pub compute_us: Option<f64>,
    pub bucket: Option<usize>,
    /// The buckets of the step without compute.
    pub step_buckets: StepBuckets,
    /// The step: `Iteration::step`'s one call (the norm beside the reductions in flight), or
    /// `finish_grad_sync` then `step` (for comparison).
    pub one_call_step: bool,
}

/// How the step without compute buckets its gradients (`--step-buckets`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepBuckets {
    /// One bucket per buffer, nothing overlapped (Megatron-LM without overlap).
    One,
    /// One transformer layer per bucket, as the overlap mode: reductions in buckets, gathers
    /// after the step (the norm trails the reductions, each group's gather its update).
    Layer,
    /// Buckets of this many elements, otherwise as `Layer`.
    Elems(usize),
}

impl StepBuckets {
    pub fn name(self) -> String {
        match self {
            StepBuckets::One => "one".into(),
            StepBuckets::Layer => "layer".into(),
            StepBuckets::Elems(n) => n.to_string(),
        }
    }
}

/// The elements of the last transformer layer (a bucket per layer).
fn layer_numel(params: &[Param]) -> usize {
    let last = params.iter().map(|p| p.layer).max().unwrap_or(0);
    params
        .iter()
        .filter(|p| p.layer == last)
        .map(|p| p.shape.iter().product::<usize>())
        .sum::<usize>()
        .max(1)
}

impl Settings {
    fn pattern(&self) -> usize {
        if self.gpu { 1 << 20 } else { 4096 }
    }
    /// Side of the square f32 product that stands in for compute.
    fn spin_dim(&self) -> usize {
        if self.gpu { 512 } else { 16 }
    }
}

/// Seconds of `f`, the device idle and the ranks aligned before, the device finished after.
fn timed<T>(
    dev: &mut Device,
    comm: &mut dyn Communicator,
    f: impl FnOnce(&mut Device, &mut dyn Communicator) -> Res<T>,
) -> Res<(T, f64)> {
    dev.synchronize()?;
    comm.barrier()?;
    let t = Instant::now();
    let out = f(dev, comm)?;
    dev.synchronize()?;
    Ok((out, t.elapsed().as_secs_f64()))
}

/// Storage classes of the byte model: persistent bf16, MXFP8 staged, 2D MXFP8, NVFP4.
fn class(cfg: &Config, p: &Param) -> usize {
    match (p.linear, cfg.precision) {
        (false, _) | (_, Precision::Bf16) => 0,
        (_, Precision::Mxfp8) => 1,
        (_, Precision::Mxfp8Direct) => 2,
        (_, Precision::Nvfp4) => 3,
    }
}

/// What the step moves on one rank, from the plan alone.
#[derive(Clone, Debug)]
pub struct Traffic {
    /// Gradient buffer bytes: the reduce-scatter's input.
    pub grad_bytes: usize,
    /// Parameter region bytes: the gather's output.
    pub region_bytes: usize,
    /// Tile amax bytes MAX-reduced while staging 2D formats.
    pub tile_bytes: usize,
    grad_size: usize,
    /// Owned elements per storage class.
    owned: [usize; 4],
    /// Elements of the low-precision matrices per storage class.
    matrix: [usize; 4],
}

impl Traffic {
    pub fn new(
        cfg: &Config,
        params: &[Param],
        ddp: &DdpConfig,
        dp: usize,
        rank: usize,
    ) -> Res<Self> {
        let specs = cfg.specs(params);
        let plan = ShardingPlan::new(&specs, &ddp.plan_config(dp))?;
        let grad_size = if cfg.grads == GradDType::F32 { 4 } else { 2 };
        let (mut grad_bytes, mut region_bytes) = (0, 0);
        for b in plan.buffers() {
            grad_bytes += b.layout.numel * grad_size;
            region_bytes += cfg
                .precision
                .region_bytes(b.key.param_storage, b.layout.numel);
        }
        let mut owned = [0; 4];
        for piece in plan.owned(rank)? {
            owned[class(cfg, &params[piece.param])] += piece.param_range.len();
        }
        let (mut matrix, mut tile_bytes) = ([0; 4], 0);
        for p in params {
            let (c, n) = (class(cfg, p), p.shape.iter().product::<usize>());
            matrix[c] += n;
            let (r, k) = (p.shape[0], n / p.shape[0]);
            tile_bytes += match c {
                2 => 4 * mxfp8_tile_count(r, k),
                3 => 4 * (r / 16) * (k / 16),
                _ => 0,
            };
        }
        Ok(Traffic {
            grad_bytes,
            region_bytes,
            tile_bytes,
            grad_size,
            owned,
            matrix,
        })
    }

    /// Device bytes (read + written) of each phase's kernels; 0 for the collectives.
    pub fn kernel_bytes(&self) -> [f64; 6] {
        let o = self.owned.map(|n| n as f64);
        let m = self.matrix.map(|n| n as f64);
        let all: f64 = o.iter().sum();
        // The sum reads the reduced gradient as it is (AdamW reads bf16 gradients directly:
        // no f32 copy).
        let g = self.grad_size as f64;
        let norm = g * all;
        // AdamW: master, two moments read and written, the gradient read (24 + 4 or 2 B); the
        // bf16 output fused for persistent weights; clipping rides along in the kernel.
        let optimizer = (24.0 + g) * all + 2.0 * o[0];
        // Casts of the masters (4 + 2); 2D formats also fold (2) and quantize (2 + 1 or 0.5).
        // Persistent weights stage nothing: the fused update wrote them (counted above).
        let staging = 6.0 * o[1] + 11.0 * o[2] + 10.5 * o[3];
        // Staged MXFP8: read bf16, write both copies and scales, zero the staging view; 2D
        // MXFP8: scales from the tiles; NVFP4: the columnwise copy and both scales.
        let requant = m[1] * (2.0 + 2.0 * (1.0 + 1.0 / 32.0) + 2.0)
            + m[2] * (2.0 / 32.0 + 4.0 / 1024.0)
            + m[3] * (0.5 + 0.5 + 2.0 / 16.0 + 4.0 / 256.0);
        [0.0, norm, optimizer, staging, 0.0, requant]
    }

    /// Bytes each rank sends per collective (ring algorithms, as nccl-tests count them).
    pub fn wire(&self, dp: usize) -> [(&'static str, f64); 4] {
        let ring = (dp - 1) as f64 / dp as f64;
        [
            ("reduce_scatter", self.grad_bytes as f64 * ring),
            ("norm", 8.0 * (dp - 1) as f64),
            ("staging", 2.0 * self.tile_bytes as f64 * ring),
            ("gather", self.region_bytes as f64 * ring),
        ]
    }
}

/// One rank's bounds: plain collectives of the step's sizes, and per kernel phase a device copy
/// whose reads and writes are that phase's bytes (at most 2 GiB).
#[derive(Debug, Default)]
pub struct Bounds {
    pub reduce_scatter: Vec<f64>,
    pub gather: Vec<f64>,
    /// Per phase: (bytes the copy reads and writes, seconds per copy).
    pub copy: Vec<Option<(f64, Vec<f64>)>>,
}

fn measure_bounds(
    dev: &mut Device,
    comm: &mut dyn Communicator,
    t: &Traffic,
    kernel_bytes: &[f64; 6],
    s: &Settings,
) -> Res<Bounds> {
    let w = comm.size();
    let reps = s.reps.0 + s.reps.1;
    let mut out = Bounds::default();
    let gdt = if t.grad_size == 4 {
        DType::F32
    } else {
        DType::Bf16
    };
    let n = t.grad_bytes / t.grad_size / w * w;
    let (big, part) = (dev.try_alloc(gdt, n)?, dev.try_alloc(gdt, n / w)?);
    dev.fill(big, 1e-3)?;
    for i in 0..reps {
        let (_, secs) = timed(dev, comm, |d, c| {
            Ok(c.start_reduce_scatter(d, big, part, ReduceOp::Avg)?
                .wait(d)?)
        })?;
        if i >= s.reps.0 {
            out.reduce_scatter.push(secs);
        }
    }
    for i in 0..reps {
        let bytes = big.reinterpret(DType::U8)?;
        let (whole, mine) = (
            bytes.slice(0..t.region_bytes / w * w)?,
            part.reinterpret(DType::U8)?,
        );
        let mine = mine.slice(0..t.region_bytes / w)?;
        let (_, secs) = timed(dev, comm, |d, c| {
            Ok(c.start_all_gather(d, mine, whole)?.wait(d)?)
        })?;
        if i >= s.reps.0 {
            out.gather.push(secs);
        }
    }
    dev.free(big)?;
    dev.free(part)?;
    for &b in kernel_bytes {
        if b <= 0.0 {
            out.copy.push(None);
            continue;
        }
        let c = ((b / 2.0) as usize).clamp(4096, 1 << 30) / 4 * 4;
        let (src, dst) = (dev.try_alloc(DType::U8, c)?, dev.try_alloc(DType::U8, c)?);
        let mut times = Vec::new();
        for i in 0..reps {
            let (_, secs) = timed(dev, comm, |d, _| Ok(d.copy(src, dst)?))?;
            if i >= s.reps.0 {
                times.push(secs);
            }
        }
        dev.free(src)?;
        dev.free(dst)?;
        out.copy.push(Some((2.0 * c as f64, times)));
    }
    Ok(out)
}

/// Replays what the gather's completion does to the low-precision weights, on the buffers'
/// own views, so the re-quantization can be timed apart from the gather (`sync_params` does
/// both): staged MXFP8 quantizes both copies of every matrix (from a bf16 scratch of pattern
/// values: the staging view is zero again after the gather) and zeroes its staging view; 2D
/// MXFP8 derives scales from tile amaxes (a scratch of constant amaxes: the reduced ones are
/// private); NVFP4 finishes every matrix from its own reduced tiles, one
/// `nvfp4_finish_2d_many_deferred` call per bucket group as the gather's completion makes it,
/// and reads the amaxes of every group after the last one with one wait
/// (`read_amaxes_many`), as `sync_params` does.
struct Replay {
    src: Option<View>,
    tiles: Option<View>,
}

impl Replay {
    fn new(dev: &mut Device, bufs: &DataParallelBuffers, grads: &GradSource) -> Res<Self> {
        let (mut staged, mut tiles) = (0, 0);
        for p in 0..bufs.specs().len() {
            let Some(w) = bufs.mxfp8_weights(p) else {
                continue;
            };
            match bufs.storage_kind(p) {
                StorageKind::Mxfp8Staged => staged = staged.max(w.rows * w.cols),
                _ => tiles = tiles.max(mxfp8_tile_count(w.rows, w.cols)),
            }
        }
        let src = (staged > 0).then(|| dev.alloc(DType::Bf16, staged));
        if let Some(v) = src {
            grads.fill(dev, v)?;
        }
        let tiles = (tiles > 0).then(|| dev.alloc(DType::F32, tiles));
        if let Some(v) = tiles {
            dev.fill(v, 0.02)?;
        }
        Ok(Replay { src, tiles })
    }

    fn bytes(&self) -> usize {
        [self.src, self.tiles]
            .iter()
            .flatten()
            .map(View::byte_len)
            .sum()
    }

    fn run(&self, dev: &mut Device, bufs: &DataParallelBuffers) -> Res<()> {
        // Staged MXFP8: as the gather's completion does it, one quantization call for every
        // matrix of a bucket group, then the group's staging zeroed.
        let mut staged: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        for p in 0..bufs.specs().len() {
            if bufs.storage_kind(p) == StorageKind::Mxfp8Staged && bufs.mxfp8_weights(p).is_some() {
                staged.entry(bufs.group_of(p)).or_default().push(p);
            }
        }
        if let Some(src) = self.src {
            for ps in staged.values() {
                let mut items = Vec::with_capacity(ps.len());
                for &p in ps {
                    let Some(w) = bufs.mxfp8_weights(p) else {
                        continue;
                    };
                    items.push((src.slice(0..w.rows * w.cols)?, w.rows, w.cols, w.views()));
                }
                dev.quantize_mxfp8_many(&items, &mxfp8_weight_config())?;
                // As the completion zeroes its buckets: one zero per run of consecutive views
                // of the group's parameters in the staging buffer (not one launch per matrix).
                let staging = bufs.param_view(ps[0])?.buffer();
                let mut views = Vec::new();
                for &p in bufs.group_params(bufs.group_of(ps[0])) {
                    let v = bufs.param_view(p)?;
                    if v.buffer() == staging {
                        views.push(v);
                    }
                }
                views.sort_by_key(View::byte_offset);
                let mut run: Option<View> = None;
                for v in views {
                    run = match run.map(|r| (r, r.joined(&v))) {
                        Some((_, Some(j))) => Some(j),
                        Some((r, None)) => {
                            dev.zero(r)?;
                            Some(v)
                        }
                        None => Some(v),
                    };
                }
                if let Some(r) = run {
                    dev.zero(r)?;
                }
            }
        }
        // 2D MXFP8 and NVFP4: as the gather's completion does it, one call for every matrix of
        // a group.
        let mut direct: BTreeMap<usize, Vec<_>> = BTreeMap::new();
        let mut nvfp4: BTreeMap<usize, Vec<_>> = BTreeMap::new();
        for p in 0..bufs.specs().len() {
            match (bufs.storage_kind(p), bufs.low_precision_weights(p)) {
                (StorageKind::Mxfp8Staged, _) => {}
                (StorageKind::Mxfp8Direct, _) => {
                    let (Some(w), Some(t)) = (bufs.mxfp8_weights(p), self.tiles) else {
                        continue;
                    };
                    let t = t.slice(0..mxfp8_tile_count(w.rows, w.cols))?;
                    let (rs, cs) = (w.rowwise.1, w.columnwise.1);
                    direct.entry(bufs.group_of(p)).or_default().push((
                        w.rows,
                        w.cols,
                        Fp8Kind::E4M3,
                        t,
                        rs,
                        cs,
                    ));
                }
                (StorageKind::Nvfp4Packed, _) => {
                    if let Some((w, _)) = bufs.nvfp4_weights(p) {
                        nvfp4.entry(bufs.group_of(p)).or_default().push(w);
                    }
                }
                _ => {}
            }
        }
        for items in direct.values() {
            dev.mxfp8_scales_2d_many(items)?;
        }
        // As `sync_params` completes the groups: the amaxes stay on the device until every
        // group is done, then one read for all of them.
        let mut pending = Vec::with_capacity(nvfp4.len());
        for ws in nvfp4.values() {
            let items: Vec<_> = ws
                .iter()
                .map(|w| (w.rows, w.cols, w.tiles, w.views()))
                .collect();
            pending.push(dev.nvfp4_finish_2d_many_deferred(&items)?);
        }
        dev.read_amaxes_many(pending)?;
        Ok(())
    }
}

/// One rank's measurements of the step without compute.
#[derive(Debug)]
pub struct StepRun {
    /// Per iteration: the six phases, with the gather holding the gather and its completion
    /// (`sync_params`) and the re-quantization its replay alone.
    pub phases: Vec<[f64; 6]>,
    /// Per iteration: zeroing the gradient buffer as `begin_iteration` does it (after staging).
    pub zero: Vec<f64>,
    /// Per iteration: `protocol::finish_grad_sync_and_norm` (the reduce-scatter and the norm as
    /// the one-call step runs them), and `finish_grad_sync` alone in the iterations between.
    pub rs_norm: Vec<f64>,
    pub rs_alone: Vec<f64>,
    /// Whole steps (`protocol::finish_grad_sync_and_step`, or with `--step-call two`
    /// `finish_grad_sync` + `protocol::step`), no synchronization inside.
    pub totals: Vec<f64>,
    pub bounds: Bounds,
    pub traffic: Traffic,
    pub clipped: bool,
    /// Largest allocation seen at a phase boundary (the benchmark's own scratch excluded),
    /// live memory (`memory_report`) and the closed form (`estimate_memory`).
    pub peak: usize,
    pub live: usize,
    pub closed: usize,
    pub card: String,
    pub fallbacks: Vec<String>,
}

/// The step without compute on this rank: bounds first (their memory is freed before the
/// buffers exist), then the per-phase iterations, then whole steps.
pub fn step_rank(
    comm: &mut dyn Communicator,
    dev: &mut Device,
    cfg: &Config,
    params: &[Param],
    s: &Settings,
) -> Res<StepRun> {
    let (dp, rank) = (comm.size(), comm.rank());
    let ddp = match s.step_buckets {
        StepBuckets::One => cfg.ddp(None),
        StepBuckets::Layer => cfg.ddp_buckets(layer_numel(params)),
        StepBuckets::Elems(n) => cfg.ddp_buckets(n),
    };
    let traffic = Traffic::new(cfg, params, &ddp, dp, rank)?;
    let bounds = measure_bounds(dev, comm, &traffic, &traffic.kernel_bytes(), s)?;
    let specs = cfg.specs(params);
    // The distributed AdamW over f32 masters (it reads bf16 gradients as they are).
    let adamw = RuleMemory::of(&lowbit_optim::AdamW::default(), MasterDtype::F32);
    let closed = estimate_memory(&specs, dp, rank, &ddp, |_| adamw)?.total();
    let base = dev.allocated_bytes();
    let (mut bufs, mut opt) = build(dev, dp, rank, specs, ddp)?;
    let live = memory_report(&bufs, &opt).total();
    let grads = GradSource::new(dev, s.pattern())?;
    let replay = Replay::new(dev, &bufs, &grads)?;
    // Diagnostics (`LOWBIT_STEP_NORM_SPIN=us`): that much compute between the reduce-scatter
    // and the timed norm, the device synchronized after it, so that the norm starts as it does
    // after a backward (busy SMs) rather than after the collectives alone. The phase is then
    // not the default measurement; for telling the first read's extra cost apart (clocks vs
    // memory state), not for the tables.
    let norm_spin = match std::env::var("LOWBIT_STEP_NORM_SPIN").ok() {
        Some(us) => Some((Spin::new(dev, s.spin_dim())?, us.parse::<f64>()?)),
        None => None,
    };
    let own = base + grads.bytes() + replay.bytes();
    let n = bufs.specs().len();
    // In buckets, the step starts with every gradient reported ready (backward order), as a
    // backward that wrote them all at once would leave them: each group's reduction launches
    // at its last report, inside the timed step.
    let bucketed = s.step_buckets != StepBuckets::One;
    let ready =
        |d: &mut Device, c: &mut dyn Communicator, b: &mut DataParallelBuffers| -> Res<()> {
            if bucketed {
                for p in (0..n).rev() {
                    b.register_grad_ready(d, c, p)?;
                }
            }
            Ok(())
        };
    let (mut peak, mut clipped) = (0, false);
    let (mut phases, mut zero) = (Vec::new(), Vec::new());
    for i in 0..s.reps.0 + s.reps.1 {
        protocol::begin_iteration(dev, comm, &mut bufs, &opt)?;
        bufs.set_last_microbatch(true);
        grads.backward(dev, &mut bufs, 0..n)?;
        let mut t = [0.0; 6];
        let b = &mut bufs;
        let o = &mut opt;
        (_, t[0]) = timed(dev, comm, |d, c| {
            ready(d, c, b)?;
            Ok(b.finish_grad_sync(d, c)?)
        })?;
        if let Some((spin, us)) = &norm_spin {
            spin.run(dev, *us)?;
        }
        let (norm, secs) = timed(dev, comm, |d, c| {
            Ok(protocol::global_grad_norm(d, c, b, o)?)
        })?;
        t[1] = secs;
        if std::env::var_os("LOWBIT_STEP_NORM_SPLIT").is_some() {
            // Diagnostics: the local sum of squares alone (no exchange of the result), the
            // exchange alone (`protocol::sum_across_ranks`: a fresh buffer, the rank's 8 bytes
            // written, an all-gather, the read), and a bare all-gather of those bytes.
            // The norm once more, right after the first: what the first read after the
            // reduce-scatter costs.
            let (_, again) = timed(dev, comm, |d, c| {
                Ok(protocol::global_grad_norm(d, c, b, o)?)
            })?;
            let (_, local) = timed(dev, comm, |d, _| Ok(protocol::local_sum_squares(d, o)?))?;
            let (_, exchange) =
                timed(dev, comm, |d, c| Ok(protocol::sum_across_ranks(d, c, 1.0)?))?;
            let buf = dev.alloc(DType::U8, 8 * dp);
            let mine = buf.slice(8 * rank..8 * (rank + 1))?;
            let (_, bare) = timed(dev, comm, |d, c| {
                Ok(c.start_all_gather(d, mine, buf)?.wait(d)?)
            })?;
            dev.free(buf)?;
            // The two in a row, as `global_grad_norm` runs them, with a host clock between.
            let mut split = 0.0;
            let (_, both) = timed(dev, comm, |d, c| {
                let t = Instant::now();
                let l = protocol::local_sum_squares(d, o)?;
                split = t.elapsed().as_secs_f64();
                Ok(protocol::sum_across_ranks(d, c, l)?)
            })?;
            eprintln!(
                "rank {rank}: norm {:.3} ms (again {:.3}), of which the local sum of squares {:.3} ms; exchange alone {:.3} ms, bare all-gather {:.3} ms; the two in a row {:.3} ms (local {:.3})",
                secs * 1e3,
                again * 1e3,
                local * 1e3,
                exchange * 1e3,
                bare * 1e3,
                both * 1e3,
                split * 1e3
            );
        }
        let clip = protocol::clip_or_skip(norm, o.clip_grad()).unwrap_or(1.0);
        clipped = clip < 1.0;
        (_, t[2]) = timed(dev, comm, |d, _| apply(d, b, o, clip))?;
        peak = peak.max(dev.allocated_bytes() - own);
        // As `protocol::step` stages: the owners that stepped, fused persistent outputs kept.
        (_, t[3]) = timed(dev, comm, |d, c| Ok(protocol::stage(d, c, b, o, true)?))?;
        // Not a phase of the step: the zeroing of the gradient buffer as `begin_iteration` does
        // it with overlapped gathers (after staging, the staged bytes kept), a local kernel the
        // overlap mode cannot hide either.
        let (_, z) = timed(dev, comm, |d, _| Ok(b.zero_grad_buffer(d)?))?;
        (_, t[4]) = timed(dev, comm, |d, c| Ok(b.sync_params(d, c)?))?;
        peak = peak.max(dev.allocated_bytes() - own);
        (_, t[5]) = timed(dev, comm, |d, _| replay.run(d, b))?;
        if i >= s.reps.0 {
            phases.push(t);
            zero.push(z);
        }
    }
    // The reduce-scatter and the norm as the one-call step runs them (each group's sum of
    // squares launched as soon as its reduction completes), alternating with the
    // reduce-scatter alone in the same loop, so that the difference of their medians is the
    // norm's share and not a difference between two loops; the rest of the step untimed.
    let (mut rs_norm, mut rs_alone) = (Vec::new(), Vec::new());
    for i in 0..2 * (s.reps.0 + s.reps.1) {
        protocol::begin_iteration(dev, comm, &mut bufs, &opt)?;
        bufs.set_last_microbatch(true);
        grads.backward(dev, &mut bufs, 0..n)?;
        let (b, o) = (&mut bufs, &mut opt);
        let with_norm = i % 2 == 1;
        let (norm, secs) = if with_norm {
            timed(dev, comm, |d, c| {
                ready(d, c, b)?;
                Ok(protocol::finish_grad_sync_and_norm(d, c, b, o)?)
            })?
        } else {
            let ((), secs) = timed(dev, comm, |d, c| {
                ready(d, c, b)?;
                Ok(b.finish_grad_sync(d, c)?)
            })?;
            (protocol::global_grad_norm(dev, comm, b, o)?, secs)
        };
        let clip = protocol::clip_or_skip(norm, o.clip_grad()).unwrap_or(1.0);
        apply(dev, b, o, clip)?;
        protocol::stage(dev, comm, b, o, true)?;
        b.sync_params(dev, comm)?;
        if i >= 2 * s.reps.0 {
            if with_norm {
                rs_norm.push(secs);
            } else {
                rs_alone.push(secs);
            }
        }
    }
    let mut totals = Vec::new();
    for i in 0..s.reps.0 + s.reps.1 {
        protocol::begin_iteration(dev, comm, &mut bufs, &opt)?;
        bufs.set_last_microbatch(true);
        grads.backward(dev, &mut bufs, 0..n)?;
        let (b, o) = (&mut bufs, &mut opt);
        let (_, secs) = timed(dev, comm, |d, c| {
            ready(d, c, b)?;
            if s.one_call_step {
                protocol::finish_grad_sync_and_step(d, c, b, o)?;
            } else {
                b.finish_grad_sync(d, c)?;
                protocol::step(d, c, b, o)?;
            }
            Ok(())
        })?;
        if i >= s.reps.0 {
            totals.push(secs);
        }
    }
    Ok(StepRun {
        phases,
        zero,
        rs_norm,
        rs_alone,
        totals,
        bounds,
        traffic,
        clipped,
        peak,
        live,
        closed,
        card: card(dev),
        fallbacks: dev
            .host_fallback_calls()
            .into_iter()
            .map(|(op, n)| format!("{op}: {n}"))
            .collect(),
    })
}

fn card(dev: &Device) -> String {
    #[cfg(feature = "cuda")]
    if let Some(s) = dev.cuda_stream() {
        return s.context().name().unwrap_or_default();
    }
    let _ = dev;
    "cpu".into()
}

/// A point on the device's stream (a CUDA event); nothing on the CPU.
struct Mark(#[cfg(feature = "cuda")] Option<lowbit_device::cudarc::driver::CudaEvent>);

impl Mark {
    fn record(dev: &Device) -> Res<Mark> {
        #[cfg(feature = "cuda")]
        {
            use lowbit_device::cudarc::driver::sys::CUevent_flags;
            let e = match dev.cuda_stream() {
                Some(s) => Some(s.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?),
                None => None,
            };
            Ok(Mark(e))
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = dev;
            Ok(Mark())
        }
    }

    /// Milliseconds per segment: each mark after the first closes an interval of the segment
    /// it names (`SEGMENTS`), measured from the mark before it; `None` unless all are events.
    fn segments(marks: &[(Mark, usize)]) -> Res<Option<Vec<f64>>> {
        #[cfg(feature = "cuda")]
        {
            let mut out = vec![0.0; SEGMENTS.len()];
            for w in marks.windows(2) {
                let (Some(a), Some(b)) = (&w[0].0.0, &w[1].0.0) else {
                    return Ok(None);
                };
                out[w[1].1] += f64::from(a.elapsed_ms(b)?);
            }
            Ok(Some(out))
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = marks;
            Ok(None)
        }
    }
}

/// Where the device's stream spends an overlapped iteration.
pub const SEGMENTS: [&str; 6] = [
    "begin",
    "forward_params",
    "forward_compute",
    "backward_compute",
    "backward_grads",
    "grad_sync_rest_and_step",
];

/// A square f32 product repeated to last about a given time: compute that needs no kernel of
/// its own.
struct Spin {
    a: View,
    c: View,
    spec: MatmulSpec,
    per_call: f64,
}

impl Spin {
    fn new(dev: &mut Device, dim: usize) -> Res<Self> {
        let a = lowbit_testkit::upload_f32(dev, &lowbit_testkit::values(3, dim * dim, 1.0));
        let c = dev.alloc(DType::F32, dim * dim);
        let spec = MatmulSpec {
            m: dim,
            n: dim,
            k: dim,
            trans_a: false,
            trans_b: false,
            accumulate: false,
        };
        let mut spin = Spin {
            a,
            c,
            spec,
            per_call: 1.0,
        };
        spin.calls(dev, 3)?;
        let calls = 20;
        dev.synchronize()?;
        let t = Instant::now();
        spin.calls(dev, calls)?;
        dev.synchronize()?;
        spin.per_call = t.elapsed().as_secs_f64() / calls as f64;
        Ok(spin)
    }

    fn calls(&self, dev: &mut Device, n: usize) -> Res<()> {
        for _ in 0..n {
            dev.matmul(self.a, self.a, self.c, &self.spec)?;
        }
        Ok(())
    }

    fn run(&self, dev: &mut Device, us: f64) -> Res<()> {
        self.calls(dev, ((us * 1e-6 / self.per_call).round() as usize).max(1))
    }
}

/// One rank's measurements of the step interleaved with compute.
#[derive(Debug)]
pub struct OverlapRun {
    /// Whole iterations: begin, forward (gathers on demand, prefetch), backward (units
    /// gathered again where parameters are sharded; bucket reductions as gradients become
    /// ready), the rest of the reduction, the step.
    pub with_dp: Vec<f64>,
    /// The same compute and gradient writes, nothing else.
    pub compute: Vec<f64>,
    pub per_call_us: f64,
    /// Per timed iteration, where the device's stream spent the step with compute (ms per
    /// `SEGMENTS` entry, from events on it; GPUs only).
    pub segments: Vec<Option<Vec<f64>>>,
    /// The device's allocation peak during the iterations above what was allocated before
    /// them (transient buckets and units), and its closed form (`transient_bound`).
    pub transient_peak: usize,
    pub transient_closed: usize,
}

/// The step with overlap on, interleaved with `us` of compute per layer in the forward and
/// twice that in the backward.
pub fn overlap_rank(
    comm: &mut dyn Communicator,
    dev: &mut Device,
    cfg: &Config,
    params: &[Param],
    s: &Settings,
    us: f64,
) -> Res<OverlapRun> {
    let (dp, rank) = (comm.size(), comm.rank());
    let layers = params.iter().map(|p| p.layer + 1).max().unwrap_or(0);
    let by_layer: Vec<Vec<usize>> = (0..layers)
        .map(|l| {
            (0..params.len())
                .filter(|&p| params[p].layer == l)
                .collect()
        })
        .collect();
    // One transformer layer per bucket unless told otherwise.
    let ddp = cfg.ddp(Some(s.bucket.unwrap_or_else(|| layer_numel(params))));
    let (mut bufs, mut opt) = build(dev, dp, rank, cfg.specs(params), ddp)?;
    let transient_closed = transient_bound(bufs.plan(), bufs.specs(), &ddp);
    let grads = GradSource::new(dev, s.pattern())?;
    let spin = Spin::new(dev, s.spin_dim())?;
    // Where the compute-alone run writes its gradients (sharded strategies have no whole
    // gradient buffer to write into).
    let widest = params
        .iter()
        .map(|p| p.shape.iter().product())
        .max()
        .unwrap_or(1);
    let scratch = dev.alloc(
        if cfg.grads == GradDType::F32 {
            DType::F32
        } else {
            DType::Bf16
        },
        widest,
    );
    dev.reset_peak();
    let before = dev.allocated_bytes();
    let (mut with_dp, mut compute, mut segments) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..s.reps.0 + s.reps.1 {
        let (b, o) = (&mut bufs, &mut opt);
        let (w, with) = timed(dev, comm, |d, c| {
            // Each mark closes an interval of the segment it names (SEGMENTS).
            let mut w = vec![(Mark::record(d)?, 0)];
            protocol::begin_iteration(d, c, b, o)?;
            b.set_last_microbatch(true);
            w.push((Mark::record(d)?, 0));
            for ps in &by_layer {
                for &p in ps {
                    let g = b.group_of(p);
                    b.prepare_params(d, c, g, Usage::Forward)?;
                }
                w.push((Mark::record(d)?, 1));
                spin.run(d, us)?;
                w.push((Mark::record(d)?, 2));
            }
            for ps in by_layer.iter().rev() {
                spin.run(d, 2.0 * us)?;
                w.push((Mark::record(d)?, 3));
                for &p in ps.iter().rev() {
                    let g = b.group_of(p);
                    b.prepare_params(d, c, g, Usage::Backward)?;
                    grads.backward(d, b, std::iter::once(p))?;
                    b.register_grad_ready(d, c, p)?;
                }
                w.push((Mark::record(d)?, 4));
            }
            // As `Iteration::step`: the norm of the groups already reduced runs beside the
            // last reduction.
            if s.one_call_step {
                protocol::finish_grad_sync_and_step(d, c, b, o)?;
            } else {
                b.finish_grad_sync(d, c)?;
                protocol::step(d, c, b, o)?;
            }
            w.push((Mark::record(d)?, 5));
            Ok(w)
        })?;
        let ((), alone) = timed(dev, comm, |d, _| {
            for _ in &by_layer {
                spin.run(d, us)?;
            }
            for ps in by_layer.iter().rev() {
                spin.run(d, 2.0 * us)?;
                for &p in ps.iter().rev() {
                    let n: usize = params[p].shape.iter().product();
                    grads.fill(d, scratch.slice(0..n)?)?;
                }
            }
            Ok(())
        })?;
        if i >= s.reps.0 {
            with_dp.push(with);
            compute.push(alone);
            segments.push(Mark::segments(&w)?);
        }
    }
    Ok(OverlapRun {
        with_dp,
        compute,
        segments,
        per_call_us: spin.per_call * 1e6,
        transient_peak: dev.peak_allocated_bytes() - before,
        transient_closed,
    })
}

/// The update of every piece as the driver runs it when nothing is pipelined: the step counted,
/// every piece updated, every owner's low-precision weights marked stale (timed apart from the
/// staging).
fn apply(
    dev: &mut Device,
    bufs: &mut DataParallelBuffers,
    opt: &mut dyn Optimizer,
    clip: f32,
) -> Res<()> {
    opt.begin_step();
    opt.update(dev, clip, lowbit_optim::UpdateScope::All)?;
    for owner in opt.owners() {
        bufs.mark_stale(owner);
    }
    Ok(())
}
