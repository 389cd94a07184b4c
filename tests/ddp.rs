//! Data parallelism end to end on CPU: the test model trained by N rank threads through
//! `lowbit-buffers` (buckets, grad sync, param sync) and `lowbit-optim` (distributed AdamW).
//!
//! Every comparison goes through one helper, [`train`], which returns each rank's losses, grad
//! norms, fp32 masters and final parameter bytes.

use std::time::{Duration, Instant};

use lowbit::buffers::layout::{BufferKey, GradDType, OptimizerId, ParamSpec, ParamStorage};
use lowbit::buffers::{DataParallelBuffers, DdpConfig};
use lowbit::comm::{Communicator, GroupConfig, run_ranks};
use lowbit::device::{DType, Device};
use lowbit::model::{Hooks, Mlp, MlpShape, ModelError, sample};
use lowbit::optim::{
    Algorithm, ChainedOptimizer, DistributedOptimizer, MasterShard, OptimConfig, initialize_params,
};

const SHAPE: MlpShape = MlpShape {
    input: 12,
    hidden: 24,
    blocks: 2,
    output: 5,
};

#[derive(Clone, Copy, Debug)]
struct Run {
    dp: usize,
    ddp: DdpConfig,
    grad: GradDType,
    microbatches: usize,
    /// Rows per rank per microbatch.
    rows: usize,
    steps: usize,
    clip: Option<f32>,
    /// Put biases and norms under a second optimizer (a chained optimizer of two owners).
    chained: bool,
    /// `(step, rank)` whose first input sample is made NaN.
    poison: Option<(usize, usize)>,
}

impl Run {
    fn new(dp: usize) -> Run {
        Run {
            dp,
            ddp: ddp(true, true, true, Some(600)),
            grad: GradDType::F32,
            microbatches: 2,
            rows: 4,
            steps: 6,
            clip: None,
            chained: true,
            poison: None,
        }
    }
}

fn ddp(distopt: bool, overlap_grad: bool, overlap_param: bool, bucket: Option<usize>) -> DdpConfig {
    DdpConfig {
        distributed_optimizer: distopt,
        overlap_grad_reduce: overlap_grad,
        overlap_param_gather: overlap_param,
        average_in_collective: false,
        bucket_size: bucket,
        high_busbw_padding: false,
    }
}

#[derive(Debug, PartialEq)]
struct Outcome {
    losses: Vec<f32>,
    norms: Vec<f32>,
    skipped: u64,
    /// This rank's masters.
    masters: Vec<MasterShard>,
    /// The whole param buffer of every parameter, as bytes.
    params: Vec<Vec<u8>>,
}

struct DpHooks<'a> {
    bufs: &'a mut DataParallelBuffers,
    comm: &'a mut dyn Communicator,
}

fn hook_err(e: impl std::fmt::Display) -> ModelError {
    ModelError::Hook(e.to_string())
}

impl Hooks for DpHooks<'_> {
    fn param(&mut self, dev: &mut Device, p: usize) -> Result<lowbit::device::View, ModelError> {
        let g = self.bufs.group_of(p);
        self.bufs
            .finish_param_sync(dev, self.comm, g)
            .map_err(hook_err)?;
        self.bufs.param_view(p).map_err(hook_err)
    }
    fn grad(&mut self, _dev: &mut Device, p: usize) -> Result<lowbit::device::View, ModelError> {
        self.bufs.grad_view(p).map_err(hook_err)
    }
    fn grad_ready(&mut self, dev: &mut Device, p: usize) -> Result<(), ModelError> {
        if self.bufs.config().overlap_grad_reduce {
            self.bufs
                .register_grad_ready(dev, self.comm, p)
                .map_err(hook_err)?;
        }
        Ok(())
    }
}

fn specs(run: &Run) -> Vec<ParamSpec> {
    SHAPE
        .params()
        .into_iter()
        .map(|(name, shape)| {
            let owner = if run.chained && !name.ends_with(".weight") {
                1
            } else {
                0
            };
            let key = BufferKey {
                param_storage: ParamStorage::Bf16,
                grad_dtype: run.grad,
                expert: false,
                owner: OptimizerId(owner),
            };
            ParamSpec::new(name, shape, key)
        })
        .collect()
}

fn adamw(lr: f32, clip: Option<f32>) -> OptimConfig {
    OptimConfig {
        algorithm: Algorithm::AdamW {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.01,
        },
        lr,
        clip_grad: clip,
    }
}

/// One rank's training loop.
fn rank_main(run: &Run, comm: &mut dyn Communicator, dev: &mut Device) -> Result<Outcome, String> {
    let e = |e: &dyn std::fmt::Display| e.to_string();
    let rank = comm.rank();
    let mut bufs =
        DataParallelBuffers::new(dev, run.dp, rank, specs(run), run.ddp).map_err(|x| e(&x))?;
    let init = SHAPE.init(7);
    initialize_params(dev, &bufs, &init).map_err(|x| e(&x))?;
    let mut parts = vec![
        DistributedOptimizer::new(dev, &bufs, OptimizerId(0), adamw(3e-3, run.clip), &init)
            .map_err(|x| e(&x))?,
    ];
    if run.chained {
        let sgd = OptimConfig {
            algorithm: Algorithm::Sgd {
                momentum: 0.9,
                weight_decay: 0.0,
            },
            lr: 1e-2,
            clip_grad: run.clip,
        };
        parts.push(
            DistributedOptimizer::new(dev, &bufs, OptimizerId(1), sgd, &init).map_err(|x| e(&x))?,
        );
    }
    let mut opt = ChainedOptimizer::new(parts).map_err(|x| e(&x))?;
    let mlp = Mlp::new(dev, SHAPE, run.rows);
    let (mut losses, mut norms) = (Vec::new(), Vec::new());
    for step in 0..run.steps {
        bufs.zero_grad_buffer(dev).map_err(|x| e(&x))?;
        let mut loss = 0.0f32;
        for m in 0..run.microbatches {
            bufs.set_last_microbatch(m + 1 == run.microbatches);
            let global_rows = run.rows * run.dp;
            let base = ((step * run.microbatches + m) * global_rows + rank * run.rows) as u64;
            let (mut x, mut y) = (Vec::new(), Vec::new());
            for i in 0..run.rows as u64 {
                let (xs, ys) = sample(&SHAPE, 11, base + i);
                x.extend(xs);
                y.extend(ys);
            }
            if run.poison == Some((step, rank)) && m == 0 {
                x[0] = f32::NAN;
            }
            let mut hooks = DpHooks {
                bufs: &mut bufs,
                comm,
            };
            loss += mlp
                .forward_backward(dev, &mut hooks, &x, &y, 1.0 / run.microbatches as f32)
                .map_err(|x| e(&x))?;
        }
        losses.push(loss);
        bufs.finish_grad_sync(dev, comm).map_err(|x| e(&x))?;
        let report = opt.step(dev, comm, &mut bufs).map_err(|x| e(&x))?;
        norms.push(report.grad_norm);
    }
    // Complete any deferred gather so the param buffers are final.
    bufs.sync_params(dev, comm).map_err(|x| e(&x))?;
    let mut masters = Vec::new();
    for p in opt.parts() {
        masters.extend(p.masters(dev).map_err(|x| e(&x))?);
    }
    masters.sort_by_key(|m| (m.param, m.range.start));
    let params = (0..SHAPE.params().len())
        .map(|p| dev.read_bytes(bufs.param_view(p).unwrap()).unwrap())
        .collect();
    Ok(Outcome {
        losses,
        norms,
        skipped: opt.skipped_steps(),
        masters,
        params,
    })
}

/// Trains `run` and returns every rank's outcome.
fn train(run: Run) -> Vec<Outcome> {
    let results = run_ranks(
        run.dp,
        GroupConfig::default().with_timeout(Duration::from_secs(30)),
        |mut comm, mut dev| rank_main(&run, &mut comm, &mut dev),
    );
    results
        .into_iter()
        .map(|r| {
            r.expect("rank panicked")
                .unwrap_or_else(|e| panic!("{run:?}: {e}"))
        })
        .collect()
}

/// Full fp32 masters, assembled from every rank's shards (each element exactly once).
fn full_masters(outcomes: &[Outcome]) -> Vec<Vec<f32>> {
    let sizes: Vec<usize> = SHAPE
        .params()
        .iter()
        .map(|(_, s)| s.iter().product())
        .collect();
    let mut full: Vec<Vec<Option<f32>>> = sizes.iter().map(|&n| vec![None; n]).collect();
    for o in outcomes {
        for m in &o.masters {
            let p = m.param;
            for (i, v) in m.range.clone().zip(&m.values) {
                assert!(full[p][i].is_none(), "param {p} element {i} owned twice");
                full[p][i] = Some(*v);
            }
        }
    }
    full.into_iter()
        .enumerate()
        .map(|(p, v)| {
            v.into_iter()
                .enumerate()
                .map(|(i, x)| x.unwrap_or_else(|| panic!("param {p} element {i} owned by nobody")))
                .collect()
        })
        .collect()
}

fn assert_ranks_identical(outcomes: &[Outcome]) {
    for o in &outcomes[1..] {
        assert_eq!(
            o.params, outcomes[0].params,
            "param buffers differ across ranks"
        );
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&o.norms),
            bits(&outcomes[0].norms),
            "grad norms differ across ranks"
        );
    }
}

#[test]
fn n_ranks_match_one_rank() {
    let one = train(Run {
        dp: 1,
        rows: 12,
        steps: 10,
        ..Run::new(1)
    });
    let reference10 = full_masters(&one);
    for dp in [2, 3, 4] {
        let run = Run {
            rows: 12 / dp,
            steps: 10,
            ..Run::new(dp)
        };
        let outs = train(run);
        assert_ranks_identical(&outs);
        let masters = full_masters(&outs);
        // Relative error per parameter tensor, ‖a − b‖ / ‖b‖ (elements near zero make an
        // element-wise relative bound meaningless after AdamW's sign-like updates).
        for (p, (a, b)) in masters.iter().zip(&reference10).enumerate() {
            let diff: f64 = a.iter().zip(b).map(|(x, y)| f64::from(x - y).powi(2)).sum();
            let norm: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
            let rel = (diff / norm).sqrt();
            assert!(rel <= 1e-6, "dp={dp} param {p}: relative error {rel:e}");
        }
    }
}

#[test]
fn overlap_and_bucketing_do_not_change_a_bit() {
    for dp in [2, 3] {
        for grad in [GradDType::F32, GradDType::Bf16] {
            let base = train(Run {
                ddp: ddp(true, false, false, None),
                grad,
                ..Run::new(dp)
            });
            assert_ranks_identical(&base);
            for (og, op) in [(true, false), (true, true)] {
                for bucket in [None, Some(300), Some(1)] {
                    let outs = train(Run {
                        ddp: ddp(true, og, op, bucket),
                        grad,
                        ..Run::new(dp)
                    });
                    let what = format!("dp={dp} {grad:?} overlap=({og},{op}) bucket={bucket:?}");
                    assert_ranks_identical(&outs);
                    assert_eq!(outs[0].losses, base[0].losses, "{what}: losses");
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&outs[0].norms), bits(&base[0].norms), "{what}: norms");
                    assert_eq!(full_masters(&outs), full_masters(&base), "{what}: masters");
                    assert_eq!(outs[0].params, base[0].params, "{what}: params");
                }
            }
        }
    }
}

#[test]
fn classic_ddp_matches_the_distributed_optimizer() {
    let dist = train(Run::new(2));
    let classic = train(Run {
        ddp: ddp(false, true, false, Some(600)),
        ..Run::new(2)
    });
    assert_ranks_identical(&classic);
    // Classic DDP all-reduces and every rank updates every parameter: same arithmetic per
    // element, so the same bits.
    assert_eq!(classic[0].losses, dist[0].losses);
    assert_eq!(classic[0].params, dist[0].params);
    assert_eq!(classic[0].masters.len(), SHAPE.params().len());
}

#[test]
fn microbatch_accumulation_matches_a_big_batch() {
    let accum = train(Run {
        microbatches: 3,
        rows: 2,
        ..Run::new(2)
    });
    let big = train(Run {
        microbatches: 1,
        rows: 6,
        ..Run::new(2)
    });
    // Same samples per step (rank r's microbatch m covers a different slice, so compare the
    // trajectories loosely: same data, different summation order).
    let (a, b) = (full_masters(&accum), full_masters(&big));
    for (x, y) in a.iter().flatten().zip(b.iter().flatten()) {
        assert!((x - y).abs() <= 2e-3 * y.abs().max(0.1), "{x} vs {y}");
    }
}

#[test]
fn non_finite_gradients_skip_the_step_and_change_nothing() {
    let poisoned = Run {
        steps: 3,
        poison: Some((2, 1)),
        ..Run::new(2)
    };
    let outs = train(poisoned);
    let clean = train(Run {
        steps: 2,
        ..poisoned
    });
    assert_ranks_identical(&outs);
    for o in &outs {
        assert_eq!(o.skipped, 1);
        assert!(!o.norms[2].is_finite());
    }
    // The skipped third step left masters and parameters bitwise as after two clean steps.
    assert_eq!(full_masters(&outs), full_masters(&clean));
    assert_eq!(outs[0].params, clean[0].params);
}

#[test]
fn clipping_bounds_the_update() {
    let outs = train(Run {
        clip: Some(1e-3),
        ..Run::new(2)
    });
    assert_ranks_identical(&outs);
    let free = train(Run::new(2));
    assert_ne!(full_masters(&outs), full_masters(&free));
    assert!(
        outs[0].norms.iter().all(|n| *n > 1e-3),
        "clip must have been active"
    );
}

/// Megatron's `test_grad_sync`: a gradient buffer filled with 1.0 reduces to 1 on the owner's
/// shard and is left at 1/dp (scaled, not reduced) elsewhere; with averaging in the
/// collective the owner gets 1 and the rest stays 1.
#[test]
fn grad_sync_of_ones() {
    for dp in [1, 2, 3, 4] {
        for average in [false, true] {
            let run = Run::new(dp);
            let results = run_ranks(dp, GroupConfig::default(), |mut comm, mut dev| {
                let cfg = DdpConfig {
                    average_in_collective: average,
                    ..ddp(true, false, false, None)
                };
                let mut bufs =
                    DataParallelBuffers::new(&mut dev, dp, comm.rank(), specs(&run), cfg).unwrap();
                for p in 0..bufs.specs().len() {
                    let g = bufs.grad_view(p).unwrap();
                    dev.fill(g, 1.0).unwrap();
                }
                bufs.finish_grad_sync(&mut dev, &mut comm).unwrap();
                let owned = bufs.owned_shards().unwrap();
                let mut seen = 0;
                for s in &owned {
                    let v: Vec<f32> = dev.download(s.grad_view).unwrap();
                    assert!(v.iter().all(|&x| x == 1.0), "dp={dp} owned {v:?}");
                    seen += v.len();
                }
                let other = if average || dp == 1 {
                    1.0
                } else {
                    1.0 / dp as f32
                };
                for p in 0..bufs.specs().len() {
                    let v: Vec<f32> = dev.download(bufs.grad_view(p).unwrap()).unwrap();
                    let mine: Vec<_> = owned
                        .iter()
                        .filter(|s| s.param == p)
                        .map(|s| s.param_range.clone())
                        .collect();
                    for (i, x) in v.iter().enumerate() {
                        if !mine.iter().any(|r| r.contains(&i)) {
                            assert_eq!(*x, other, "dp={dp} avg={average} non-owned");
                        }
                    }
                }
                seen
            });
            let total: usize = results.into_iter().map(|r| r.unwrap()).sum();
            let numel: usize = SHAPE
                .params()
                .iter()
                .map(|(_, s)| s.iter().product::<usize>())
                .sum();
            assert_eq!(total, numel, "every element owned exactly once");
        }
    }
}

#[test]
fn a_missing_grad_ready_is_an_error_not_a_hang() {
    let run = Run::new(2);
    let results = run_ranks(
        2,
        GroupConfig::default().with_timeout(Duration::from_secs(5)),
        |mut comm, mut dev| {
            let mut bufs =
                DataParallelBuffers::new(&mut dev, 2, comm.rank(), specs(&run), run.ddp).unwrap();
            // First batch: every parameter reports once; the golden counts are recorded.
            bufs.zero_grad_buffer(&mut dev).unwrap();
            for p in 0..bufs.specs().len() {
                bufs.register_grad_ready(&mut dev, &mut comm, p).unwrap();
            }
            bufs.finish_grad_sync(&mut dev, &mut comm).unwrap();
            bufs.zero_grad_buffer(&mut dev).unwrap();
            // Second batch: parameter 0 never reports.
            for p in 1..bufs.specs().len() {
                bufs.register_grad_ready(&mut dev, &mut comm, p).unwrap();
            }
            bufs.finish_grad_sync(&mut dev, &mut comm)
                .map_err(|e| e.to_string())
        },
    );
    for r in results {
        let err = r.unwrap().unwrap_err();
        assert!(err.contains("never started"), "{err}");
    }
}

#[test]
fn a_rank_that_dies_fails_the_others_quickly() {
    let run = Run::new(3);
    let start = Instant::now();
    let results = run_ranks(
        3,
        GroupConfig::default().with_timeout(Duration::from_secs(20)),
        |mut comm, mut dev| {
            if comm.rank() == 2 {
                panic!("rank 2 dies before training");
            }
            rank_main(&run, &mut comm, &mut dev)
        },
    );
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "peers waited for the dead rank"
    );
    assert!(results[2].is_err());
    for r in &results[..2] {
        let msg = r.as_ref().unwrap().as_ref().unwrap_err();
        assert!(msg.contains("abort") || msg.contains("rank 2"), "{msg}");
    }
}

#[test]
fn invalid_configurations_are_refused_up_front() {
    let mut dev = Device::cpu();
    let run = Run::new(1);
    for (cfg, needle) in [
        (ddp(false, true, true, None), "distributed optimizer"),
        (ddp(true, false, true, None), "overlapped grad reduce"),
        (ddp(true, true, false, Some(0)), "bucket size"),
    ] {
        let err = DataParallelBuffers::new(&mut dev, 1, 0, specs(&run), cfg).unwrap_err();
        assert!(err.to_string().contains(needle), "{err}");
    }
    let _ = DType::F32;
}
