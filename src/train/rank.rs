//! One rank's run of `lowbit train` ([`rank_main`]): the trainer built over the plan, the
//! checkpoint resumed, then the step loop (evaluations, saves, the stop agreement) and what the
//! rank reports. [`super::run`] starts one per rank (threads or launched processes).

use std::time::Instant;

use lowbit_buffers::{DataParallelBuffers, ReplicaMode};
use lowbit_comm::Communicator;
use lowbit_device::{DType, Device};
use lowbit_optim::{
    ChainedOptimizer, DistributedOptimizer, Muon, OptimConfig, Optimizer, init_from_full,
    memory_report,
};
use lowbit_train::Trainer;

use super::models::RankModel;
use super::{
    ADAMW_DECAY, Compute, Job, Phases, RankOutcome, RunMode, StepLog, TrainConfig, TrainError,
    ckpt, err, owners,
};

/// [`TrainError::Diverged`] for a non-finite mean loss unless the configuration allows it. The
/// value is all-reduced, so every rank stops at the same step and no collective is left waiting.
pub(super) fn diverged(
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
pub(super) fn rank_main(
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
        let fast = cfg.compute != Compute::Exact && m.ns_dtype == lowbit_optim::NsDtype::Bf16;
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
