//! Every strategy × communication dtype × main-gradient dtype reduces gradients exactly as a
//! host computes them in the buffers' order, with and without overlap, over one and three
//! microbatches, at 1 to 3 ranks: so no main gradient is ever the local gradient plus the
//! reduced one (Megatron-FSDP's `optim` double gradient), no `1/dp` scales the wrong tensor,
//! and a one-rank group does not rescale its shard every microbatch (Megatron-FSDP #6660).
//!
//! The host reference, per element, for rank r's microbatch-m gradient `g[r][m]` (f32), `M`
//! the main-gradient dtype, `C` the communication dtype, `inv = fl32(1/dp)`:
//! - whole gradients: `a[r] = M(M(g[r][0]) + g[r][1] …)` (one rounding per microbatch), then
//!   `x[r] = C(a[r])`, `y = C(Σ_r C(x[r]·inv))` (f32 sum in rank order), main = `M(y)`;
//! - sharded gradients, per microbatch: `y[m] = C(Σ_r C(C(g[r][m])·inv))`, main =
//!   `M(M(y[0]) + y[1] …)`.

use lowbit_buffers::layout::{BufferKey, GradDType, OptimizerId, ParamSpec, ParamStorage};
use lowbit_buffers::protocol::StepProtocol;
use lowbit_buffers::{DataParallelBuffers, Overlap, Verify};
use lowbit_comm::Communicator;
use lowbit_device::Device;
use lowbit_testkit::{assert_same_bits, download_f32, run, seed, upload_f32, values};
use lowbit_train::fsdp::{CommDtype, FsdpConfig, MainGradsDtype, MixedPrecisionPolicy, Sharding};

const BUCKET: usize = 1500;

fn specs() -> Vec<ParamSpec> {
    let shapes: [&[usize]; 6] = [&[64, 48], &[48], &[32, 64], &[64], &[96, 32], &[17]];
    shapes
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let key = BufferKey::new(ParamStorage::Bf16, GradDType::F32, OptimizerId(0));
            ParamSpec::new(format!("p{i}"), s.to_vec(), key)
        })
        .collect()
}

/// Rank `rank`'s microbatch-`mb` gradient of `p` in batch `batch`, over seven binades.
fn grad(batch: usize, mb: usize, rank: usize, p: usize, n: usize) -> Vec<f32> {
    values(
        seed(&[batch as u64, mb as u64, rank as u64, p as u64]),
        n,
        1.0,
    )
    .into_iter()
    .enumerate()
    .map(|(i, v)| v * (1u32 << (i % 7)) as f32)
    .collect()
}

fn round(d: GradDType, x: f32) -> f32 {
    match d {
        GradDType::F32 => x,
        _ => half::bf16::from_f32(x).to_f32(),
    }
}

struct Case {
    dp: usize,
    sharding: Sharding,
    main: GradDType,
    comm: GradDType,
    microbatches: usize,
}

fn expected(c: &Case, batch: usize, p: usize, n: usize) -> Vec<f32> {
    let inv = 1.0 / c.dp as f32;
    let (m, cd) = (c.main, c.comm);
    let reduce = |x: &dyn Fn(usize) -> f32| {
        let mut acc = round(cd, x(0) * inv);
        for r in 1..c.dp {
            acc += round(cd, x(r) * inv);
        }
        round(cd, acc)
    };
    let g: Vec<Vec<Vec<f32>>> = (0..c.dp)
        .map(|r| {
            (0..c.microbatches)
                .map(|mb| grad(batch, mb, r, p, n))
                .collect()
        })
        .collect();
    (0..n)
        .map(|i| {
            if c.sharding == Sharding::NoShard || c.sharding == Sharding::Optim {
                let a = |r: usize| {
                    (0..c.microbatches).fold(0.0f32, |acc, mb| round(m, acc + g[r][mb][i]))
                };
                round(m, reduce(&|r| round(cd, a(r))))
            } else {
                (0..c.microbatches).fold(0.0f32, |acc, mb| {
                    round(m, acc + reduce(&|r| round(cd, g[r][mb][i])))
                })
            }
        })
        .collect()
}

fn check(c: &Case, overlap: Overlap) {
    let what = format!(
        "dp {}, {}, main {:?}, comm {:?}, {} microbatches, {overlap:?}",
        c.dp, c.sharding, c.main, c.comm, c.microbatches
    );
    let main = match c.main {
        GradDType::F32 => MainGradsDtype::Fp32,
        _ => MainGradsDtype::Bf16,
    };
    let comm = match c.comm {
        GradDType::F32 => CommDtype::Fp32,
        _ => CommDtype::Bf16,
    };
    let cfg = FsdpConfig::new(c.sharding)
        .with_policy(
            MixedPrecisionPolicy::default()
                .with_main_grads_dtype(main)
                .with_grad_comm_dtype(comm),
        )
        .with_overlap(overlap)
        .with_bucket_size(Some(BUCKET))
        .with_verify(Verify::Full);
    let mut specs = specs();
    cfg.validate(&specs, c.dp).unwrap();
    cfg.apply(&mut specs);
    let counted = run(c.dp, |mut comm, mut dev| {
        let rank = comm.rank();
        let dev: &mut Device = &mut dev;
        let mut bufs =
            DataParallelBuffers::new(dev, c.dp, rank, specs.clone(), cfg.ddp_config()).unwrap();
        assert!(!overlap.grad_reduce() || bufs.num_groups() >= 3, "{what}");
        let mut counted = 0;
        for batch in 0..2 {
            bufs.zero_grad_buffer(dev).unwrap();
            for mb in 0..c.microbatches {
                bufs.set_last_microbatch(mb + 1 == c.microbatches);
                bufs.begin_microbatch(dev, &mut comm).unwrap();
                for p in (0..specs.len()).rev() {
                    let dst = bufs.accumulation_view(dev, p).unwrap();
                    let g = upload_f32(dev, &grad(batch, mb, rank, p, specs[p].numel));
                    dev.add(g, dst).unwrap();
                    dev.free(g).unwrap();
                    if overlap.grad_reduce() {
                        bufs.register_grad_ready(dev, &mut comm, p).unwrap();
                    }
                }
            }
            bufs.finish_grad_sync(dev, &mut comm).unwrap();
            for s in bufs.owned_shards().unwrap() {
                let want = expected(c, batch, s.param, specs[s.param].numel);
                let got = download_f32(dev, s.grad_view);
                assert_same_bits(
                    &got,
                    &want[s.param_range.clone()],
                    &format!("{what}: batch {batch}, rank {rank}, param {}", s.param),
                );
                counted += got.len();
            }
        }
        counted
    });
    let total: usize = specs.iter().map(|s| s.numel).sum();
    let owners = if c.sharding == Sharding::NoShard {
        c.dp
    } else {
        1
    };
    assert_eq!(
        counted.iter().sum::<usize>(),
        2 * owners * total,
        "{what}: coverage"
    );
}

#[test]
fn every_strategy_and_dtype_reduces_exactly() {
    const DT: [GradDType; 2] = [GradDType::F32, GradDType::Bf16];
    for dp in 1..=3 {
        for sharding in Sharding::ALL {
            for main in DT {
                for comm in DT {
                    for microbatches in [1, 3] {
                        let case = Case {
                            dp,
                            sharding,
                            main,
                            comm,
                            microbatches,
                        };
                        for overlap in [Overlap::None, Overlap::GradReduce] {
                            check(&case, overlap);
                        }
                    }
                }
            }
        }
    }
}

/// The policy may change between iterations: batch 0 reduces in fp32, batch 1 in bf16 (each
/// exactly as the host computes it in its dtype); changing it with a reduction pending is
/// refused.
#[test]
fn the_communication_dtype_may_change_between_iterations() {
    let dp = 2;
    for sharding in Sharding::ALL {
        let cfg = FsdpConfig::new(sharding)
            .with_overlap(Overlap::GradReduce)
            .with_bucket_size(Some(BUCKET))
            .with_verify(Verify::Full);
        let specs = specs();
        run(dp, |mut comm, mut dev| {
            let rank = comm.rank();
            let dev: &mut Device = &mut dev;
            let mut bufs =
                DataParallelBuffers::new(dev, dp, rank, specs.clone(), cfg.ddp_config()).unwrap();
            for (batch, comm_dtype) in [GradDType::F32, GradDType::Bf16].into_iter().enumerate() {
                bufs.set_grad_comm_dtype(Some(comm_dtype)).unwrap();
                bufs.zero_grad_buffer(dev).unwrap();
                bufs.set_last_microbatch(true);
                bufs.begin_microbatch(dev, &mut comm).unwrap();
                for p in (0..specs.len()).rev() {
                    let dst = bufs.accumulation_view(dev, p).unwrap();
                    let g = upload_f32(dev, &grad(batch, 0, rank, p, specs[p].numel));
                    dev.add(g, dst).unwrap();
                    dev.free(g).unwrap();
                    if p == 0 && sharding.layout().shards_grads() {
                        // Gradients wait in a communication bucket.
                        let e = bufs.set_grad_comm_dtype(None).unwrap_err();
                        assert!(e.protocol().is_some(), "{e}");
                    }
                    bufs.register_grad_ready(dev, &mut comm, p).unwrap();
                }
                bufs.finish_grad_sync(dev, &mut comm).unwrap();
                let case = Case {
                    dp,
                    sharding,
                    main: GradDType::F32,
                    comm: comm_dtype,
                    microbatches: 1,
                };
                for s in bufs.owned_shards().unwrap() {
                    let want = expected(&case, batch, s.param, specs[s.param].numel);
                    assert_same_bits(
                        &download_f32(dev, s.grad_view),
                        &want[s.param_range.clone()],
                        &format!("{sharding}, batch {batch}, {comm_dtype:?}"),
                    );
                }
            }
        });
    }
}
