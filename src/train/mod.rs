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
mod rank;
mod report;
mod schedule;
pub mod stop;

use std::path::PathBuf;
use std::time::Duration;

use lowbit_buffers::Overlap;
use lowbit_buffers::layout::{GradDType, ParamSpec, ParamStorage, ShardingPlan};
use lowbit_ckpt::{Checkpoint, LoadOptions};
use lowbit_comm::CommStats;
use lowbit_optim::{MasterShard, RankMemory, estimate_memory};
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
pub use lowbit_llama::Recompute;
pub use lowbit_train::fsdp::{
    CommDtype, FineGrainedGather, FsdpConfig, MainGradsDtype, MainParamsDtype,
    MixedPrecisionPolicy, OuterSharding, Sharding,
};
use models::JobModel;
use rank::rank_main;
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
    // Hashed a piece at a time (the bytes of a 1B model's masters are 5 GB).
    let mut bytes = Vec::with_capacity(4 << 12);
    full.iter()
        .flat_map(|p| p.chunks(1 << 12))
        .fold(lowbit_io::fnv1a64(&[]), |h, piece| {
            bytes.clear();
            bytes.extend(piece.iter().flat_map(|v| v.to_le_bytes()));
            lowbit_io::hash::fnv1a64_continue(h, &bytes)
        })
}

fn err(rank: usize) -> impl Fn(&dyn std::fmt::Display) -> TrainError {
    move |e| TrainError::Rank {
        rank,
        message: e.to_string(),
    }
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
