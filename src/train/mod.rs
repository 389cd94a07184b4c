//! `lowbit train`: the reference training job. A small MoE language model ([`lm`]) learns a
//! synthetic Markov source with a known entropy rate ([`data`]) across data-parallel ranks, with
//! low-precision primary weights, bucketed and overlapped gradient reduction, staged parameter
//! gathers and a sharded AdamW — every layer of the library in one run.
//!
//! [`train`] is deterministic: the same configuration gives the same losses, grad norms and
//! final fp32 masters, bit for bit (the report carries their f32 bit patterns and a checksum of
//! the masters), so runs can be compared exactly — e.g. `--param-gather on` against `off`.
//!
//! Decisions:
//! - The global batch is fixed and split over ranks × microbatches (both must divide it), so
//!   changing `--ranks` or `--microbatches` changes the arithmetic order, not the problem.
//! - Two AdamW groups: GEMM weights and the embedding decay, norms, biases and the router do
//!   not (as Megatron's default no-decay group). No clipping: the grad norm is reported. The
//!   learning rate warms up over 5% of the steps, then decays along a cosine to a tenth.
//! - With `--optimizer muon` the GEMM weights (the input projection, the dense blocks' fc1/fc2
//!   and the expert weights) move to a third owner updated by Muon, whose parameters the plan
//!   places whole on one rank each (`ShardingStrategy::LayerWise`; the AdamW owners keep the
//!   distributed rule), chained after the two AdamW groups: one gradient norm, one stage and
//!   gather per step. Muon's learning rate follows the same schedule at its own peak. The
//!   Newton–Schulz iterate is f32 by default, so runs are reproducible on every backend.
//! - The loss reported per step is the mean over the global batch (an f32 all-reduce, counted
//!   in the collective table); eval losses are over a fixed held-out sample set.

mod ckpt;
mod config;
pub mod data;
pub mod json;
mod llama;
pub mod lm;
mod models;
mod report;
mod schedule;
pub mod stop;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use lowbit_buffers::layout::{GradDType, ParamSpec, ParamStorage, ShardingPlan};
use lowbit_buffers::{DataParallelBuffers, Overlap, ReplicaMode};
use lowbit_ckpt::{Checkpoint, LoadOptions};
use lowbit_comm::{CommStats, Communicator};
use lowbit_device::{DType, Device};
use lowbit_optim::{
    ChainedOptimizer, DistributedOptimizer, MasterShard, Muon, OptimConfig, Optimizer, RankMemory,
    estimate_memory, init_from_full, memory_report,
};
use lowbit_train::Trainer;
use lowbit_train::launch::{self, LaunchEnv, LaunchError, RankFailure, World};

pub use ckpt::{
    Checkpointing, MAY_CHANGE, apply_model_settings, config_map, layout_options, shape_of,
};
pub use config::{
    Compute, DeviceChoice, HAS_CUDA, ModelChoice, MuonSettings, OptimizerChoice, Precision,
    TrainConfig, TrainError, gpu_count, owners,
};
pub use llama::{LlamaRun, tokenizer_of};
use lm::ParamInfo;
pub use lowbit_buffers::NanCheck;
pub use lowbit_train::fsdp::{
    CommDtype, FineGrainedGather, FsdpConfig, MainGradsDtype, MainParamsDtype,
    MixedPrecisionPolicy, OuterSharding, Sharding,
};
use models::{JobModel, RankModel};
pub use report::{MuonRankLoad, ParamOwner, Phases, RunMode, Sampling, StepLog, TrainReport};
pub use schedule::{Extend, Extension, Schedule};

/// What each rank returns.
struct RankOutcome {
    losses: Vec<f32>,
    norms: Vec<f32>,
    evals: Vec<(usize, f32)>,
    masters: Vec<MasterShard>,
    memory: RankMemory,
    comm: CommStats,
    phases: Phases,
    wall: Duration,
    saved: Vec<PathBuf>,
    generated: Vec<u32>,
    /// The signal and the step (from 1) of an agreed stop.
    stopped: Option<(i32, usize)>,
}

/// Runs `cfg` and reports; `progress` is called by rank 0 after every step.
pub fn train(
    cfg: &TrainConfig,
    progress: &(dyn Fn(&StepLog) + Sync),
) -> Result<TrainReport, TrainError> {
    train_with(cfg, &Checkpointing::default(), progress)
}

/// [`train`] with checkpoints: resumes from `ck.resume` (after checking that it fits `cfg`:
/// [`MAY_CHANGE`] lists what may differ) and runs steps from its step to `cfg.steps`, saving to
/// `ck.save` as it says. A resumed run reports only the steps it ran ([`TrainReport::first_step`]),
/// the same values the straight run had at those steps.
pub fn train_with(
    cfg: &TrainConfig,
    ck: &Checkpointing,
    progress: &(dyn Fn(&StepLog) + Sync),
) -> Result<TrainReport, TrainError> {
    execute(cfg, ck, &RunMode::Train, &stop::NEVER, progress)
}

/// [`train_with`] that stops early when `stop` is requested (e.g. [`stop::signals`]): every
/// rank finishes the current step, agrees on it through the step's loss all-gather, saves it
/// when `ck.save` is set, and the run returns [`TrainError::Stopped`]. A request during the
/// last step changes nothing.
///
/// # Errors
/// As [`train_with`], and [`TrainError::Stopped`].
pub fn train_until(
    cfg: &TrainConfig,
    ck: &Checkpointing,
    stop: &stop::StopRequest,
    progress: &(dyn Fn(&StepLog) + Sync),
) -> Result<TrainReport, TrainError> {
    execute(cfg, ck, &RunMode::Train, stop, progress)
}

/// Evaluates, or samples from, the weights of checkpoint `ckpt` under `cfg` (which must describe
/// the checkpoint's model and precision; `--steps` is set to the checkpoint's step). Weights are
/// exactly the training run's after that step: Q(bf16(master)) through the same buffers.
///
/// # Errors
/// As [`train_with`]; [`TrainError::Invalid`] for `mode` [`RunMode::Train`].
pub fn from_checkpoint(
    cfg: &TrainConfig,
    ckpt: &std::path::Path,
    mode: &RunMode,
) -> Result<TrainReport, TrainError> {
    if *mode == RunMode::Train {
        return Err(TrainError::Invalid(
            "from_checkpoint evaluates or generates; train with train_with".into(),
        ));
    }
    let ck = Checkpointing {
        resume: Some(ckpt.to_path_buf()),
        ..Checkpointing::default()
    };
    execute(cfg, &ck, mode, &stop::NEVER, &|_| {})
}

fn execute(
    cfg: &TrainConfig,
    ck: &Checkpointing,
    mode: &RunMode,
    stop: &stop::StopRequest,
    progress: &(dyn Fn(&StepLog) + Sync),
) -> Result<TrainReport, TrainError> {
    cfg.validate()?;
    if let (Some(dir), Some(_)) = (&cfg.init_from, &ck.resume) {
        return Err(TrainError::Invalid(format!(
            "--init-from {} with --resume: a resumed run's masters are the checkpoint's; start \
             from one or the other",
            dir.display()
        )));
    }
    let mut cfg = cfg.clone();
    let model = JobModel::build(&mut cfg)?;
    let data_id = model.fingerprint();
    let resume = match &ck.resume {
        Some(path) => {
            let c = Checkpoint::open(path).map_err(|e| TrainError::Checkpoint(e.to_string()))?;
            let step = if *mode == RunMode::Train {
                ckpt::check_resume(&mut cfg, &data_id, &c, ck.extend_schedule)?
            } else {
                ckpt::checkpoint_step(&c)?
            };
            if *mode != RunMode::Train {
                // Nothing to train: the schedule ends at the checkpoint.
                cfg.steps = step;
            }
            Some((c, step))
        }
        None if ck.extend_schedule.is_some() => {
            return Err(TrainError::Invalid(
                "--extend-schedule applies only with --resume (it says how a resumed run's \
                 schedule continues)"
                    .into(),
            ));
        }
        None => None,
    };
    // One process probes, locks, tidies and checks the save root (under a launcher every
    // process runs this function); the lock is held until the run returns.
    let _lock = if launched_rank()? == 0 && *mode == RunMode::Train {
        ckpt::prepare_save(ck, resume.as_ref().map(|(c, s)| (c, *s)))?
    } else {
        None
    };
    let info = cfg.model_params();
    let specs = cfg.specs(&info);
    // The plan is pure: make it once here for the report (and to refuse a bad one up front);
    // every rank makes the same one.
    let plan = cfg
        .plan(&specs)
        .map_err(|e| TrainError::Invalid(format!("sharding plan: {e}")))?;
    let (owners, muon_ranks) = ownership(&cfg, &info, &specs, &plan)?;
    let job = Job {
        cfg: &cfg,
        model: &model,
        info: &info,
        progress,
        ck,
        data_id: &data_id,
        resume: resume.as_ref().map(|(c, _)| c),
        load: match cfg.model {
            ModelChoice::Reference => ckpt::layout_options(&cfg.shape),
            ModelChoice::Llama(_) => LoadOptions::default(),
        },
        start: resume.as_ref().map_or(0, |(_, s)| *s),
        mode,
        stop,
    };
    let outcomes = run(&job)?;
    let o0 = &outcomes[0];
    if let Some((signal, step)) = o0.stopped {
        return Err(TrainError::Stopped {
            signal,
            step,
            steps: cfg.steps,
            saved: o0.saved.last().cloned(),
        });
    }
    let checksum = master_checksum(&info, outcomes.iter().map(|o| &o.masters[..]));
    let baseline_specs: Vec<ParamSpec> = specs
        .iter()
        .map(|s| {
            let mut s = s.clone();
            s.key.param_storage = ParamStorage::Bf16;
            s.key.grad_dtype = GradDType::F32;
            s
        })
        .collect();
    let base_ddp = cfg
        .ddp()
        .with_grad_comm_dtype(None)
        .with_sharding(lowbit_buffers::layout::ShardingStrategy::Replicated)
        .with_overlap(if cfg.overlap_grad_reduce {
            Overlap::GradReduce
        } else {
            Overlap::None
        });
    // AdamW: two fp32 state tensors per element; Muon: one (the momentum).
    let baseline = estimate_memory(&baseline_specs, 1, 0, &base_ddp, |o| {
        if o == owners::MUON { 1 } else { 2 }
    })
    .map_err(|e| TrainError::Invalid(e.to_string()))?;
    Ok(TrainReport {
        first_step: job.start,
        resumed_from: job.resume.map(|c| c.dir().to_path_buf()),
        saved: o0.saved.clone(),
        generated: o0.generated.clone(),
        losses: o0.losses.clone(),
        grad_norms: o0.norms.clone(),
        evals: o0.evals.clone(),
        floor: model.floor(),
        eval_set: model.eval_set(),
        params: info.iter().map(|p| p.shape.iter().product::<usize>()).sum(),
        master_checksum: checksum,
        memory: o0.memory.clone(),
        baseline,
        owners,
        muon_ranks,
        comm: o0.comm,
        phases: o0.phases,
        wall: o0.wall,
        config: cfg,
    })
}

/// Who updates each parameter and, for Muon, each rank's share, read off the plan.
fn ownership(
    cfg: &TrainConfig,
    info: &[ParamInfo],
    specs: &[ParamSpec],
    plan: &ShardingPlan,
) -> Result<(Vec<ParamOwner>, Vec<MuonRankLoad>), TrainError> {
    let muon = cfg.optimizer.muon();
    let mut out: Vec<ParamOwner> = info
        .iter()
        .zip(specs)
        .map(|(p, s)| {
            let owner = s.owner();
            let is_muon = owner == owners::MUON;
            ParamOwner {
                name: p.name.clone(),
                shape: p.shape.clone(),
                optimizer: if is_muon { "muon" } else { "adamw" },
                owner,
                weight_decay: match muon {
                    Some(m) if is_muon => m.weight_decay,
                    _ if owner == owners::ADAMW_DECAY => ADAMW_DECAY,
                    _ => 0.0,
                },
                ranks: Vec::new(),
                // Muon's parameters are `[out, in]` or `[experts, out, in]` (its constructor
                // refuses anything else).
                muon_lr_factor: match (muon, &p.shape[..]) {
                    (Some(m), [.., rows, cols]) if is_muon => Some(m.lr_scale.factor(*rows, *cols)),
                    _ => None,
                },
            }
        })
        .collect();
    let mut loads = Vec::new();
    for rank in 0..plan.dp() {
        let mut load = MuonRankLoad {
            rank,
            params: 0,
            matrices: 0,
            elements: 0,
        };
        let pieces = plan
            .owned(rank)
            .map_err(|e| TrainError::Invalid(format!("sharding plan: {e}")))?;
        for piece in pieces {
            let o = &mut out[piece.param];
            if o.ranks.last() != Some(&rank) {
                o.ranks.push(rank);
            }
            if o.owner == owners::MUON {
                load.params += 1;
                load.matrices += info[piece.param].experts;
                load.elements += piece.param_range.len();
            }
        }
        if muon.is_some() {
            loads.push(load);
        }
    }
    Ok((out, loads))
}

/// The weight decay of AdamW's decayed group.
const ADAMW_DECAY: f32 = 0.1;

/// What every rank of a run shares.
struct Job<'a> {
    cfg: &'a TrainConfig,
    /// The model and its data.
    model: &'a JobModel,
    info: &'a [ParamInfo],
    /// Called by rank 0 after every step.
    progress: &'a (dyn Fn(&StepLog) + Sync),
    /// Where and when to save.
    ck: &'a Checkpointing,
    /// The data source's fingerprint (recorded in every checkpoint).
    data_id: &'a str,
    /// The checkpoint to resume from, checked against the configuration.
    resume: Option<&'a Checkpoint>,
    /// The expert-layout conversion for loading it.
    load: LoadOptions,
    /// Steps done before this run.
    start: usize,
    /// Train, or only evaluate or generate.
    mode: &'a RunMode,
    /// Read after every step: stop there when asked.
    stop: &'a stop::StopRequest,
}

fn run(job: &Job) -> Result<Vec<RankOutcome>, TrainError> {
    let cfg = job.cfg;
    let world = match cfg.device {
        DeviceChoice::Cpu => World::CpuThreads(cfg.ranks),
        DeviceChoice::Cuda => match launched_env()? {
            Some(env) if env.world_size != cfg.ranks => {
                return Err(TrainError::Invalid(format!(
                    "--ranks {} does not match the launcher's WORLD_SIZE {}",
                    cfg.ranks, env.world_size
                )));
            }
            Some(env) => World::CudaProcess(env),
            None => World::CudaLocal(cfg.ranks),
        },
    };
    #[cfg(not(feature = "cuda"))]
    if cfg.device == DeviceChoice::Cuda {
        return Err(TrainError::Invalid(
            "--device cuda needs a build with the CUDA backend (--features cuda)".into(),
        ));
    }
    let results: Vec<Result<RankOutcome, TrainError>> =
        launch::run(world, Duration::from_secs(120), |comm, dev| {
            let mut own = rank_main(job, comm, dev)?;
            if world.is_process() {
                // One rank per process: every rank's masters, gathered after the run (so the
                // collective counts are the run's own), make the report and its checksum the same
                // as a one-process run's.
                let all = launch::all_gather_bytes(comm, dev, &encode_shards(&own.masters))
                    .map_err(|x| err(comm.rank())(&x))?;
                own.masters = all.iter().flat_map(|b| decode_shards(b)).collect();
            }
            Ok(own)
        });
    // The first failing rank's error is the cause; the others usually report the abort or the
    // lost peer it caused.
    let mut out = Vec::with_capacity(results.len());
    let mut first_err = None;
    for r in results {
        match r {
            Ok(o) => out.push(o),
            Err(e) => {
                let text = e.to_string();
                let is_abort = text.contains("abort") || text.contains(" was lost: ");
                if first_err.as_ref().is_none_or(|(a, _)| *a && !is_abort) {
                    first_err = Some((is_abort, e));
                }
            }
        }
    }
    match first_err {
        Some((_, e)) => Err(e),
        None => Ok(out),
    }
}

impl From<RankFailure> for TrainError {
    fn from(f: RankFailure) -> Self {
        TrainError::Rank {
            rank: f.rank,
            message: f.message,
        }
    }
}

/// The launcher's variables (torchrun, or anything that sets them), parsed strictly: `None`
/// without `WORLD_SIZE`.
fn launched_env() -> Result<Option<LaunchEnv>, TrainError> {
    LaunchEnv::from_env().map_err(|e: LaunchError| TrainError::Invalid(e.to_string()))
}

/// The world size a process launcher gave this process, if any: `WORLD_SIZE`. With `--device
/// cuda`, the process then runs one rank of that world on GPU `LOCAL_RANK` instead of one
/// thread per local GPU.
///
/// # Errors
/// Malformed launcher variables ([`LaunchEnv::from_lookup`]), naming the variable.
pub fn launched_world_size() -> Result<Option<usize>, TrainError> {
    Ok(launched_env()?.map(|e| e.world_size))
}

/// This process's rank under a launcher (`RANK`), 0 otherwise: only rank 0 prints.
///
/// # Errors
/// As [`launched_world_size`].
pub fn launched_rank() -> Result<usize, TrainError> {
    Ok(launched_env()?.map_or(0, |e| e.rank))
}

/// Master shards as bytes for a gather between processes: per shard, its parameter id, range
/// start and end as u64, then its values as f32, all little-endian.
fn encode_shards(shards: &[MasterShard]) -> Vec<u8> {
    let mut bytes = Vec::new();
    for m in shards {
        for v in [m.param, m.range.start, m.range.end] {
            bytes.extend((v as u64).to_le_bytes());
        }
        bytes.extend(m.values.iter().flat_map(|v| v.to_le_bytes()));
    }
    bytes
}

/// The shards of [`encode_shards`]' bytes, which may carry zero padding after the last shard.
fn decode_shards(bytes: &[u8]) -> Vec<MasterShard> {
    let mut shards = Vec::new();
    let mut at = 0;
    let word = |at: &mut usize| {
        let w = u64::from_le_bytes(bytes[*at..*at + 8].try_into().expect("8 bytes"));
        *at += 8;
        w as usize
    };
    while at + 24 <= bytes.len() {
        let (param, start, end) = (word(&mut at), word(&mut at), word(&mut at));
        // Padding reads as an empty range; a real shard is never empty.
        if end <= start || at + 4 * (end - start) > bytes.len() {
            break;
        }
        let values = bytes[at..at + 4 * (end - start)]
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
            .collect();
        at += 4 * (end - start);
        shards.push(MasterShard {
            param,
            range: start..end,
            values,
        });
    }
    shards
}

/// FNV-1a 64 over every parameter's fp32 master values in element order.
fn master_checksum<'a>(info: &[ParamInfo], ranks: impl Iterator<Item = &'a [MasterShard]>) -> u64 {
    let mut full: Vec<Vec<f32>> = info
        .iter()
        .map(|p| vec![f32::NAN; p.shape.iter().product()])
        .collect();
    for shards in ranks {
        for m in shards {
            full[m.param][m.range.clone()].copy_from_slice(&m.values);
        }
    }
    let bytes: Vec<u8> = full
        .iter()
        .flatten()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    lowbit_io::fnv1a64(&bytes)
}

fn err(rank: usize) -> impl Fn(&dyn std::fmt::Display) -> TrainError {
    move |e| TrainError::Rank {
        rank,
        message: e.to_string(),
    }
}

/// [`TrainError::Diverged`] for a non-finite mean loss unless the configuration allows it. The
/// value is all-reduced, so every rank stops at the same step and no collective is left waiting.
fn diverged(
    cfg: &TrainConfig,
    what: &'static str,
    value: f32,
    step: usize,
) -> Result<(), TrainError> {
    if value.is_finite() || cfg.allow_non_finite {
        return Ok(());
    }
    Err(TrainError::Diverged {
        what,
        value,
        step: step + 1,
        steps: cfg.steps,
    })
}

/// The trainer's communicator: the replica group's under hybrid sharding, else the world's.
fn tcomm<'a>(
    shard: &'a mut Option<Box<dyn Communicator>>,
    world: &'a mut dyn Communicator,
) -> &'a mut dyn Communicator {
    match shard {
        Some(s) => s.as_mut(),
        None => world,
    }
}

/// One rank's run.
fn rank_main(
    job: &Job,
    comm: &mut dyn Communicator,
    dev: &mut Device,
) -> Result<RankOutcome, TrainError> {
    let Job {
        cfg,
        model,
        info,
        progress,
        ..
    } = *job;
    let rank = comm.rank();
    let e = err(rank);
    dev.set_matmul_mode(cfg.compute.matmul_mode());
    // Hybrid sharding: the buffers, the optimizer and checkpoints live in this rank's replica
    // group (`shard`), the reduced gradients are all-reduced across replicas; data, the loss
    // and the eval stay over the world (`comm`).
    let groups = cfg.fsdp().split_groups(comm).map_err(|x| e(&x))?;
    let (mut shard, replicas) = match groups {
        Some(g) => (Some(g.shard), Some(g.replicas)),
        None => (None, None),
    };
    // One replica group writes checkpoints (every group holds the same shards); all load them.
    // HFSDP: the replica groups split the optimizer state, so every rank writes its pieces,
    // over the world.
    let split_state =
        replicas.is_some() && cfg.fsdp().replica_mode() == ReplicaMode::ShardOptimizer;
    let writes_checkpoints = split_state || replicas.as_ref().is_none_or(|r| r.rank() == 0);
    let shard_rank = shard.as_ref().map_or(rank, |s| s.rank());
    let specs = cfg.specs(info);
    let plan = cfg.plan(&specs).map_err(|x| e(&x))?;
    let mut bufs = DataParallelBuffers::with_plan(dev, shard_rank, specs, plan, cfg.ddp())
        .map_err(|x| e(&x))?;
    if let Some(r) = replicas {
        bufs.set_replica_group(r, cfg.fsdp().replica_mode())
            .map_err(|x| e(&x))?;
    }
    let init = model.init(cfg);
    bufs.initialize_all(dev, |p| init[p].clone())
        .map_err(|x| e(&x))?;
    let optim = OptimConfig::new(cfg.lr).with_master_dtype(cfg.fsdp().master_dtype());
    let mut parts: Vec<Box<dyn Optimizer>> = Vec::new();
    for (owner, decay) in [
        (owners::ADAMW_DECAY, ADAMW_DECAY),
        (owners::ADAMW_NO_DECAY, 0.0),
    ] {
        let rule = TrainConfig::adamw(decay);
        let mut pieces = init_from_full(&init);
        parts.push(Box::new(
            DistributedOptimizer::new(dev, &bufs, owner, rule, optim, &mut pieces)
                .map_err(|x| e(&x))?,
        ));
    }
    if let Some(m) = cfg.optimizer.muon() {
        let mut pieces = init_from_full(&init);
        // Muon's rate follows AdamW's warmup and decay at its own peak.
        let ratio = f64::from(m.lr) / f64::from(cfg.lr);
        let optim = OptimConfig::new(m.lr).with_lr_ratio(ratio);
        // The fast GEMMs extend to Newton-Schulz where its iterate is bf16 (cuBLASLt's GEMMs
        // round each result to bf16 as torch.optim.Muon does).
        let fast = cfg.compute == Compute::Bf16 && m.ns_dtype == lowbit_optim::NsDtype::Bf16;
        let mode = if fast {
            lowbit_optim::NsMode::Fast
        } else {
            lowbit_optim::NsMode::Exact
        };
        let muon_config = m.config().with_ns_mode(mode);
        let muon = Muon::new(dev, &bufs, owners::MUON, muon_config, optim, &mut pieces)
            .map_err(|x| e(&x))?;
        parts.push(Box::new(muon));
    }
    let opt = ChainedOptimizer::new(parts).map_err(|x| e(&x))?;
    let mut trainer =
        Trainer::new(dev, bufs, Box::new(opt), cfg.policy(info)).map_err(|x| e(&x))?;
    let mut phases = Phases::default();
    if let Some(c) = job.resume {
        // Masters and state from the checkpoint (resharded to this plan, expert layout
        // converted), then a forced sync: every weight is Q(bf16(loaded master)).
        let t = Instant::now();
        trainer
            .load_checkpoint(dev, tcomm(&mut shard, comm), c, &job.load)
            .map_err(|x| e(&x))?;
        phases.checkpoint += t.elapsed();
    }
    let mut saved = Vec::new();
    let mut saver = lowbit_ckpt::AsyncSaver::new();
    let rows = cfg.rows();
    let mut lm = model.rank(cfg, dev, rows).map_err(|x| e(&x))?;
    let scalar = dev.alloc(DType::F32, 1);
    let (mut losses, mut norms, mut evals) = (Vec::new(), Vec::new(), Vec::new());
    // The mean over the world of one value per rank: all-gathered and added in rank order on
    // the host, as the CPU backend's `Avg` adds (then divided in f32), so a reported loss has
    // the same bits at any rank count on any backend (NCCL's all-reduce order beyond 2 ranks is
    // its own).
    let gathered = dev.alloc(DType::F32, comm.size());
    let all_reduce_mean = |dev: &mut Device, comm: &mut dyn Communicator, v: f32| {
        dev.upload(scalar, &[v]).map_err(|x| e(&x))?;
        comm.all_gather(dev, scalar, gathered).map_err(|x| e(&x))?;
        let all = dev.download::<f32>(gathered).map_err(|x| e(&x))?;
        let sum = all[1..].iter().fold(all[0], |a, &b| a + b);
        Ok::<f32, TrainError>(sum / all.len() as f32)
    };
    let per_rank = model.eval_items() / cfg.ranks;
    // One evaluation of the current weights over the eval set, the loss averaged over the world.
    let evaluate = |dev: &mut Device,
                    comm: &mut dyn Communicator,
                    shard: &mut Option<Box<dyn Communicator>>,
                    trainer: &mut Trainer,
                    lm: &mut RankModel,
                    phases: &mut Phases,
                    step: usize| {
        // `eval` forces a parameter sync first (timed as such), so the forward reads the
        // weights of the step just taken.
        let t = Instant::now();
        let mut hooks = trainer.eval(dev, tcomm(shard, comm)).map_err(|x| e(&x))?;
        phases.param_sync += t.elapsed();
        let t = Instant::now();
        let total = lm
            .eval(dev, &mut hooks, rank * per_rank..(rank + 1) * per_rank)
            .map_err(|x| e(&x))?;
        // The weights sum to 1 over all ranks: the mean of the partial sums times ranks.
        let v = all_reduce_mean(dev, comm, total as f32)? * cfg.ranks as f32;
        diverged(cfg, "eval loss", v, step)?;
        phases.eval += t.elapsed();
        Ok::<f32, TrainError>(v)
    };
    let mut generated = Vec::new();
    match job.mode {
        RunMode::Train => {}
        RunMode::Eval => {
            let v = evaluate(
                dev,
                comm,
                &mut shard,
                &mut trainer,
                &mut lm,
                &mut phases,
                job.start,
            )?;
            evals.push((job.start, v));
        }
        RunMode::Generate(sampling) => {
            let mut hooks = trainer
                .eval(dev, tcomm(&mut shard, comm))
                .map_err(|x| e(&x))?;
            generated = lm.generate(dev, &mut hooks, sampling).map_err(|x| e(&x))?;
        }
    }
    if cfg.steps == 0 && writes_checkpoints && *job.mode == RunMode::Train {
        // `--init-from DIR --steps 0 --save ROOT`: the imported masters as a step-0 checkpoint.
        if let Some(root) = &job.ck.save {
            let meta = ckpt::meta(cfg, job.data_id, 0);
            let specs = trainer.buffers().specs().to_vec();
            let save_comm: &mut dyn Communicator = match shard.as_mut() {
                Some(s) if !split_state => s.as_mut(),
                _ => &mut *comm,
            };
            let opt = trainer.optimizer();
            let options = job.ck.options();
            let dir = lowbit_ckpt::save(dev, save_comm, root, &meta, &specs, opt, options)
                .map_err(|x| e(&x))?;
            saved.push(dir);
        }
    }
    // The step's loss gathered with each rank's stop request beside it (a second f32 per rank:
    // the loss's sum is the one above, over the first values in rank order, so no bit
    // changes); the request is the largest signal number asked for on any rank, 0 for none.
    let pair = dev.alloc(DType::F32, 2);
    let pairs = dev.alloc(DType::F32, 2 * comm.size());
    let mean_and_stop = |dev: &mut Device, comm: &mut dyn Communicator, v: f32, asked: i32| {
        dev.upload(pair, &[v, asked as f32]).map_err(|x| e(&x))?;
        comm.all_gather(dev, pair, pairs).map_err(|x| e(&x))?;
        let all = dev.download::<f32>(pairs).map_err(|x| e(&x))?;
        let sum = all[2..].iter().step_by(2).fold(all[0], |a, &b| a + b);
        let signal = all.iter().skip(1).step_by(2).fold(0f32, |a, &b| a.max(b));
        Ok::<(f32, i32), TrainError>((sum / comm.size() as f32, signal as i32))
    };
    let mut stopped = None;
    let start = Instant::now();
    for step in job.start..cfg.steps {
        // Errors of the step itself (a non-finite gradient found by `--nan-check`, a failed
        // reduction) name the step, from 1, as the divergence check does.
        let e = |x: &dyn std::fmt::Display| TrainError::Rank {
            rank,
            message: format!("step {}/{}: {x}", step + 1, cfg.steps),
        };
        trainer
            .optimizer_mut()
            .set_lr(cfg.lr_at(step))
            .map_err(|x| e(&x))?;
        let t = Instant::now();
        let mut iteration = trainer
            .begin(dev, tcomm(&mut shard, comm))
            .map_err(|x| e(&x))?;
        phases.param_sync += t.elapsed();
        let t = Instant::now();
        let mut loss = 0f32;
        for m in 0..cfg.microbatches {
            let mut hooks =
                iteration.microbatch(tcomm(&mut shard, comm), m + 1 == cfg.microbatches);
            let first = (step * cfg.batch + (m * cfg.ranks + rank) * rows) as u64;
            let scale = 1.0 / cfg.microbatches as f32;
            loss += lm.train(dev, &mut hooks, first, scale).map_err(|x| e(&x))?;
        }
        phases.forward_backward += t.elapsed();
        let t = Instant::now();
        let grads = iteration
            .finish_grad_sync(dev, tcomm(&mut shard, comm))
            .map_err(|x| e(&x))?;
        phases.grad_sync += t.elapsed();
        let t = Instant::now();
        let report = grads
            .step(dev, tcomm(&mut shard, comm))
            .map_err(|x| e(&x))?;
        phases.optimizer += t.elapsed();
        let asked = job.stop.requested().unwrap_or(0);
        let (loss, signal) = mean_and_stop(dev, comm, loss / cfg.microbatches as f32, asked)?;
        diverged(cfg, "training loss", loss, step)?;
        losses.push(loss);
        norms.push(report.grad_norm);
        let last = step + 1 == cfg.steps;
        // Every rank saw the same gathered values: all stop after this step, or none.
        let stopping = signal > 0 && !last;
        let mut eval = None;
        let evals_now = cfg.eval_every > 0 && (step + 1).is_multiple_of(cfg.eval_every);
        if last || (evals_now && !stopping) {
            let v = evaluate(
                dev,
                comm,
                &mut shard,
                &mut trainer,
                &mut lm,
                &mut phases,
                step,
            )?;
            evals.push((step + 1, v));
            eval = Some(v);
        }
        if let Some(root) = &job.ck.save
            && (job.ck.saves_after(step + 1, cfg.steps) || stopping)
            && writes_checkpoints
        {
            // A save right after the step under overlapped gathers: sync first (Megatron-LM PR #4994), so
            // the weights are Q(bf16) of the masters being saved and the next step's gathers
            // start from a clean state; the run's bits do not change.
            let t = Instant::now();
            trainer
                .force_param_sync(dev, tcomm(&mut shard, comm))
                .map_err(|x| e(&x))?;
            let meta = ckpt::meta(cfg, job.data_id, step + 1);
            let specs = trainer.buffers().specs().to_vec();
            let save_comm: &mut dyn Communicator = match shard.as_mut() {
                Some(s) if !split_state => s.as_mut(),
                _ => &mut *comm,
            };
            if job.ck.asynchronous {
                // Snapshot now, write during the next steps; the previous save commits here.
                let committed = saver
                    .save(
                        dev,
                        save_comm,
                        root,
                        &meta,
                        &specs,
                        trainer.optimizer(),
                        job.ck.options(),
                    )
                    .map_err(|x| e(&x))?;
                saved.extend(committed);
            } else {
                let dir = lowbit_ckpt::save(
                    dev,
                    save_comm,
                    root,
                    &meta,
                    &specs,
                    trainer.optimizer(),
                    job.ck.options(),
                )
                .map_err(|x| e(&x))?;
                saved.push(dir);
            }
            phases.checkpoint += t.elapsed();
        }
        if rank == 0 {
            let elapsed = start.elapsed();
            let secs = elapsed.as_secs_f64().max(1e-9);
            let tokens_per_step = cfg.batch * model.tokens_per_sample();
            let (lr, muon_lr) = StepLog::scheduled_lrs(cfg, step);
            progress(&StepLog {
                step: step + 1,
                steps: cfg.steps,
                first_step: job.start,
                loss,
                grad_norm: report.grad_norm,
                skipped: report.skipped,
                lr,
                muon_lr,
                eval,
                eval_tokens: model.eval_items() * model.tokens_per_sample(),
                tokens_per_step,
                tokens_per_s: ((step + 1 - job.start) * tokens_per_step) as f64 / secs,
                elapsed,
                device_peak_bytes: dev.peak_allocated_bytes(),
                flops_per_token: StepLog::flops_per_token(cfg, info),
            });
        }
        if stopping {
            stopped = Some((signal, step + 1));
            break;
        }
    }
    if writes_checkpoints {
        // The last asynchronous save commits before the run reports.
        let t = Instant::now();
        let save_comm: &mut dyn Communicator = match shard.as_mut() {
            Some(s) if !split_state => s.as_mut(),
            _ => &mut *comm,
        };
        saved.extend(saver.wait(save_comm).map_err(|x| e(&x))?);
        phases.checkpoint += t.elapsed();
    }
    let wall = start.elapsed();
    let masters = trainer.optimizer().masters(dev).map_err(|x| e(&x))?;
    let memory = memory_report(trainer.buffers(), trainer.optimizer());
    trainer.into_parts(dev).map_err(|x| e(&x))?;
    Ok(RankOutcome {
        losses,
        norms,
        evals,
        masters,
        memory,
        comm: shard.as_ref().map_or_else(|| comm.stats(), |s| s.stats()),
        phases,
        wall,
        saved,
        generated,
        stopped,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Shards survive the byte form a multi-process run gathers, zero padding included, with
    /// their exact bits (negative zero and NaN payloads too).
    #[test]
    fn master_shards_round_trip_through_bytes() {
        let shards = vec![
            MasterShard {
                param: 3,
                range: 10..13,
                values: vec![-0.0, f32::from_bits(0x7FC0_1234), 1.5],
            },
            MasterShard {
                param: 0,
                range: 0..1,
                values: vec![f32::MIN_POSITIVE],
            },
        ];
        let mut bytes = encode_shards(&shards);
        assert_eq!(bytes.len(), 2 * 24 + 4 * 4);
        bytes.resize(bytes.len() + 40, 0);
        let back = decode_shards(&bytes);
        assert_eq!(back.len(), 2);
        for (a, b) in shards.iter().zip(&back) {
            assert_eq!((a.param, a.range.clone()), (b.param, b.range.clone()));
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&a.values), bits(&b.values));
        }
        assert!(decode_shards(&[0; 64]).is_empty());
    }
}
