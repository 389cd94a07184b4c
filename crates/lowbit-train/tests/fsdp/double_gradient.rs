//! The double-gradient bug class (Megatron-FSDP PR #3067: under `optim` rank 0's main gradient
//! became g1 + (g1 + g2)), as the issue states it: dp = 2, one microbatch, every strategy ×
//! communication dtype × main-gradient dtype. Rank 0 writes 0.75 and rank 1 writes 0.25 into
//! every gradient element (exact in bf16), so each rank's main gradient must be exactly the
//! reduced mean (g1 + g2) / 2 = 0.5: never 0.75 + 0.5 = 1.25 (the local gradient added to the
//! reduced one), 1.0 (the reduced sum added twice), 0.25 (scaled twice) or 1.0 unscaled (the
//! 1/dp on the wrong tensor). Prints one line per case.

use lowbit_buffers::layout::{BufferKey, GradDType, OptimizerId, ParamSpec, ParamStorage};
use lowbit_buffers::protocol::StepProtocol;
use lowbit_buffers::{DataParallelBuffers, Overlap};
use lowbit_comm::Communicator;
use lowbit_device::Device;
use lowbit_testkit::{download_f32, run, upload_f32};
use lowbit_train::fsdp::{CommDtype, FsdpConfig, MainGradsDtype, MixedPrecisionPolicy, Sharding};

#[test]
fn each_rank_main_gradient_is_the_reduced_mean_once() {
    let specs: Vec<ParamSpec> = [vec![64, 48], vec![48], vec![96, 32]]
        .into_iter()
        .enumerate()
        .map(|(i, s)| {
            let key = BufferKey::new(ParamStorage::Bf16, GradDType::F32, OptimizerId(0));
            ParamSpec::new(format!("p{i}"), s, key)
        })
        .collect();
    for sharding in Sharding::ALL {
        for main in [MainGradsDtype::Fp32, MainGradsDtype::Bf16] {
            for comm in [CommDtype::MainGrads, CommDtype::Fp32, CommDtype::Bf16] {
                for overlap in [Overlap::None, Overlap::GradReduce] {
                    let cfg = FsdpConfig::new(sharding)
                        .with_overlap(overlap)
                        .with_bucket_size(Some(2000))
                        .with_policy(
                            MixedPrecisionPolicy::default()
                                .with_main_grads_dtype(main)
                                .with_grad_comm_dtype(comm),
                        );
                    let mut sp = specs.clone();
                    cfg.apply(&mut sp);
                    let got = run(2, |mut c, mut dev| {
                        let dev: &mut Device = &mut dev;
                        let rank = c.rank();
                        let mut bufs =
                            DataParallelBuffers::new(dev, 2, rank, sp.clone(), cfg.ddp_config())
                                .unwrap();
                        bufs.zero_grad_buffer(dev).unwrap();
                        bufs.set_last_microbatch(true);
                        bufs.begin_microbatch(dev, &mut c).unwrap();
                        let g = if rank == 0 { 0.75 } else { 0.25 };
                        for p in (0..sp.len()).rev() {
                            let dst = bufs.accumulation_view(dev, p).unwrap();
                            let v = upload_f32(dev, &vec![g; sp[p].numel]);
                            dev.add(v, dst).unwrap();
                            dev.free(v).unwrap();
                            if overlap.grad_reduce() {
                                bufs.register_grad_ready(dev, &mut c, p).unwrap();
                            }
                        }
                        bufs.finish_grad_sync(dev, &mut c).unwrap();
                        let mut values: Vec<f32> = Vec::new();
                        for s in bufs.owned_shards().unwrap() {
                            values.extend(download_f32(dev, s.grad_view));
                        }
                        values
                    });
                    let what = format!("{sharding}, main {main:?}, comm {comm:?}, {overlap:?}");
                    for (rank, v) in got.iter().enumerate() {
                        assert!(!v.is_empty(), "{what}: rank {rank} owns nothing");
                        let wrong: Vec<f32> = v.iter().copied().filter(|&x| x != 0.5).collect();
                        assert!(
                            wrong.is_empty(),
                            "{what}: rank {rank}: {} of {} elements are not (g1 + g2)/2 = 0.5, \
                             e.g. {}",
                            wrong.len(),
                            v.len(),
                            wrong[0]
                        );
                    }
                    eprintln!(
                        "{what}: rank 0 {} elements, rank 1 {} elements, all 0.5 = (0.75 + \
                         0.25)/2 (g1 + (g1 + g2)/2 would be 1.25)",
                        got[0].len(),
                        got[1].len()
                    );
                }
            }
        }
    }
}
