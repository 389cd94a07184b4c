//! One rank's loop through the public driver, and the launch of a run on rank threads or GPUs.

use lowbit_train::Trainer;

use super::*;
use crate::model::regression::Mlp;

/// One rank's training loop, through the public step driver only.
pub fn rank_main(
    run: &Run,
    comm: &mut dyn Communicator,
    dev: &mut Device,
) -> Result<Outcome, String> {
    let e = |x: &dyn std::fmt::Display| x.to_string();
    let rank = comm.rank();
    let bufs = buffers(run, dev, rank).map_err(|x| e(&x))?;
    let init = SHAPE.init(7);
    let opt = optimizers(run, dev, &bufs, &init).map_err(|x| e(&x))?;
    let owned_low_precision_pieces = bufs
        .owned_shards()
        .map_err(|x| e(&x))?
        .iter()
        .filter(|s| bufs.is_low_precision(s.param))
        .count();
    let groups = (0..bufs.num_groups())
        .map(|g| {
            let p = bufs.group_params(g)[0];
            (bufs.specs()[p].owner().0, bufs.is_low_precision(p))
        })
        .collect();
    let mut trainer = Trainer::new(dev, bufs, Box::new(opt), policy(run)).map_err(|x| e(&x))?;
    let mut first = 0;
    if let Some(CkptHook::ResumeFrom(n, root)) = run.ckpt {
        let dir = root.join(lowbit_ckpt::step_dir_name(n as u64));
        let ck = lowbit_ckpt::Checkpoint::open(&dir).map_err(|x| e(&x))?;
        trainer
            .load_checkpoint(dev, comm, &ck, &lowbit_ckpt::LoadOptions::default())
            .map_err(|x| e(&x))?;
        first = n;
    }
    let mlp = Mlp::new(dev, SHAPE, run.rows);
    let mut out = Outcome {
        sharded: run.ddp.sharding.is_sharded(),
        losses: Vec::new(),
        eval_losses: Vec::new(),
        norms: Vec::new(),
        grads: Vec::new(),
        skipped: 0,
        masters: Vec::new(),
        weights: Vec::new(),
        gather_bytes: 0,
        low_precision_params: 0,
        probes: Vec::new(),
        owned_low_precision_pieces,
        groups,
    };
    // The masters of the last update (for the staging check), and the counters at the start of
    // the current phase.
    let mut masters = if run.probe {
        trainer.optimizer().masters(dev).map_err(|x| e(&x))?
    } else {
        Vec::new()
    };
    for step in first..run.steps {
        let mut probe = StepProbe::default();
        let mut clock = PhaseClock::start(dev, comm);
        let mut iteration = trainer.begin(dev, comm).map_err(|x| e(&x))?;
        if run.probe {
            clock.close(Phase::Begin, dev, comm, &mut probe);
            probe.after_begin = group_states(iteration.buffers());
            check_staging(dev, iteration.buffers(), &masters, &mut probe)?;
            clock = PhaseClock::start(dev, comm);
        }
        let mut loss = 0.0f32;
        for m in 0..run.microbatches {
            let (mut x, y) = batch(run, rank, step, m, false);
            if run.poison == Some((step, rank)) && m == 0 {
                x[0] = f32::NAN;
            }
            let mut hooks = iteration.microbatch(comm, m + 1 == run.microbatches);
            let r = mlp.forward_backward(dev, &mut hooks, &x, &y, 1.0 / run.microbatches as f32);
            loss += r.map_err(|x| e(&x))?;
        }
        out.losses.push(loss);
        if run.probe {
            clock.close(Phase::Microbatches, dev, comm, &mut probe);
            probe.after_microbatches = group_states(iteration.buffers());
        }
        if run.one_call_step && !run.probe {
            let report = iteration.step(dev, comm).map_err(|x| e(&x))?;
            out.norms.push(report.grad_norm);
        } else {
            let ready = iteration.finish_grad_sync(dev, comm).map_err(|x| e(&x))?;
            let mut grads = Vec::new();
            for s in ready.buffers().owned_shards().map_err(|x| e(&x))? {
                let tmp = dev.alloc(DType::F32, s.grad_view.len());
                dev.cast(s.grad_view, tmp).map_err(|x| e(&x))?;
                let values: Vec<f32> = dev.download(tmp).map_err(|x| e(&x))?;
                dev.free(tmp).map_err(|x| e(&x))?;
                grads.push(MasterShard {
                    param: s.param,
                    range: s.param_range,
                    values,
                });
            }
            out.grads.push(grads);
            if run.probe {
                // Downloading the reduced gradients above is not a quantization or a gather.
                clock = PhaseClock::start(dev, comm);
            }
            let report = ready.step(dev, comm).map_err(|x| e(&x))?;
            out.norms.push(report.grad_norm);
            if run.probe {
                clock.close(Phase::Step, dev, comm, &mut probe);
                probe.after_step = group_states(trainer.buffers());
                masters = trainer.optimizer().masters(dev).map_err(|x| e(&x))?;
                clock = PhaseClock::start(dev, comm);
            }
        }
        if run.force_sync_every_step {
            trainer.force_param_sync(dev, comm).map_err(|x| e(&x))?;
        }
        if run.eval_after.contains(&step) {
            let (x, y) = batch(run, rank, step, 0, true);
            let mut hooks = trainer.eval(dev, comm).map_err(|x| e(&x))?;
            let r = mlp.forward_backward(dev, &mut hooks, &x, &y, 0.0);
            out.eval_losses.push(r.map_err(|x| e(&x))?);
        }
        if let Some(CkptHook::SaveAfter(n, root)) = run.ckpt
            && n == step + 1
        {
            // Right after the step (under overlapped gathers: staged, not gathered): Megatron-LM PR #4994.
            trainer.force_param_sync(dev, comm).map_err(|x| e(&x))?;
            let meta = lowbit_ckpt::Meta {
                step: n as u64,
                ..Default::default()
            };
            let specs = trainer.buffers().specs().to_vec();
            let opts = lowbit_ckpt::SaveOptions::default();
            lowbit_ckpt::save(dev, comm, root, &meta, &specs, trainer.optimizer(), opts)
                .map_err(|x| e(&x))?;
        }
        if run.probe {
            clock.close(Phase::After, dev, comm, &mut probe);
            out.probes.push(probe);
        }
    }
    // The final forced sync (in `eval`) makes the weights reflect the last step on every path.
    let mut hooks = trainer.eval(dev, comm).map_err(|x| e(&x))?;
    for p in 0..SHAPE.params().len() {
        let v = hooks.param(dev, p, Usage::Forward).map_err(|x| e(&x))?;
        let tmp = dev.alloc(DType::F32, v.len());
        dev.cast(v, tmp).map_err(|x| e(&x))?;
        let w: Vec<f32> = dev.download(tmp).map_err(|x| e(&x))?;
        dev.free(tmp).map_err(|x| e(&x))?;
        out.weights.push(w.iter().map(|f| f.to_bits()).collect());
    }
    out.masters = trainer.optimizer().masters(dev).map_err(|x| e(&x))?;
    out.masters.sort_by_key(|m| (m.param, m.range.start));
    out.skipped = trainer.skipped_steps();
    out.gather_bytes = comm.stats().all_gather.bytes;
    out.low_precision_params = (0..SHAPE.params().len())
        .filter(|&p| trainer.buffers().is_low_precision(p))
        .count();
    if std::env::var_os("LOWBIT_DEBUG_STATS").is_some() {
        eprintln!("rank {rank}: {:?}", comm.stats());
    }
    trainer.into_parts(dev).map_err(|x| e(&x))?;
    Ok(out)
}

/// Trains `run` and returns every rank's outcome.
pub fn train(run: Run) -> Vec<Outcome> {
    if run.device == TestDevice::Cuda {
        return train_cuda(run);
    }
    let config = GroupConfig::default().with_timeout(Duration::from_secs(30));
    run_ranks(run.dp, config, |mut comm, mut dev| {
        rank_main(&run, &mut comm, &mut dev)
    })
    .into_iter()
    .map(|r| {
        r.expect("rank panicked")
            .unwrap_or_else(|e| panic!("{run:?}: {e}"))
    })
    .collect()
}

/// Full fp32 masters, assembled from every rank's shards (each element exactly once).
pub fn full_masters(outcomes: &[Outcome]) -> Vec<Vec<f32>> {
    assemble(owners(outcomes).iter().map(|o| &o.masters[..]))
}

/// The ranks whose shards together hold every element once.
fn owners(outcomes: &[Outcome]) -> &[Outcome] {
    if outcomes[0].sharded {
        outcomes
    } else {
        &outcomes[..1]
    }
}

/// The full reduced gradients of `step`, assembled from every rank's shards.
pub fn full_grads(outcomes: &[Outcome], step: usize) -> Vec<Vec<f32>> {
    assemble(owners(outcomes).iter().map(|o| &o.grads[step][..]))
}

fn assemble<'a>(pieces: impl Iterator<Item = &'a [MasterShard]>) -> Vec<Vec<f32>> {
    let sizes: Vec<usize> = SHAPE
        .params()
        .iter()
        .map(|(_, s)| s.iter().product())
        .collect();
    assemble_shards(&sizes, pieces.flatten())
}

#[cfg(feature = "cuda")]
fn train_cuda(run: Run) -> Vec<Outcome> {
    lowbit_comm::nccl::run_local_ranks(run.dp, |comm, dev| rank_main(&run, comm, dev))
        .unwrap_or_else(|e| panic!("{run:?}: {e}"))
        .into_iter()
        .map(|r| r.unwrap_or_else(|e| panic!("{run:?}: {e}")))
        .collect()
}

#[cfg(not(feature = "cuda"))]
fn train_cuda(run: Run) -> Vec<Outcome> {
    panic!("{run:?}: CUDA runs need the cuda feature");
}
