//! Masters come from the high-precision init callback, asked exactly for this rank's owned
//! pieces of the optimizer's owner (so no rank needs a full model copy), never from the rounded
//! or quantized parameter storage (bug class E).

use crate::common;

use std::ops::Range;

use common::{MXFP8, adamw, buffers, ddp, init_values, leaf_from, run, specs, weight_bytes};
use lowbit_buffers::layout::{GradDType, OptimizerId, ParamStorage};
use lowbit_buffers::{DataParallelBuffers, Overlap};
use lowbit_comm::Communicator;
use lowbit_device::{Device, bf16};
use lowbit_optim::{DistributedOptimizer, InvalidInput, OptimConfig, OptimError, Optimizer};
use lowbit_train::protocol;

/// High-precision initial values that bf16 cannot represent (2^-20 steps around 1) and that
/// differ from what the buffers were initialized with.
fn high_precision(p: usize, range: Range<usize>) -> Vec<f32> {
    range
        .map(|i| 1.0 + ((p * 4099 + i) % 1000) as f32 * 2f32.powi(-20))
        .collect()
}

#[test]
fn masters_come_from_the_callback_for_owned_pieces_only() {
    for (storage, dp) in [(ParamStorage::Bf16, 2), (MXFP8, 3)] {
        let specs = specs(storage, GradDType::F32, true);
        let stored = init_values(&specs);
        let calls = run(dp, |comm, mut dev| {
            let dev = &mut dev;
            let overlap = Overlap::GradReduceAndParamGather;
            let bufs = buffers(dev, dp, comm.rank(), &specs, overlap, &stored);
            let mut all = Vec::new();
            for owner in [0, 1] {
                let mut calls: Vec<(usize, Range<usize>)> = Vec::new();
                let mut cb = |p: usize, r: Range<usize>| {
                    calls.push((p, r.clone()));
                    high_precision(p, r)
                };
                let cfg = OptimConfig::new(1e-3);
                let id = OptimizerId(owner);
                let opt = leaf_from(dev, &bufs, owner, owner == 1, cfg, &mut cb);
                let owned: Vec<(usize, Range<usize>)> = bufs
                    .owned_shards_of(id)
                    .unwrap()
                    .into_iter()
                    .map(|s| (s.param, s.param_range))
                    .collect();
                assert_eq!(calls, owned, "{storage:?}: the callback's calls");
                for (p, _) in &calls {
                    assert_eq!(specs[*p].owner(), id);
                }
                for m in opt.masters(dev).unwrap() {
                    let want = high_precision(m.param, m.range.clone());
                    assert_eq!(common::bits(&m.values), common::bits(&want));
                    // Not bf16 values: the storage could not have produced them.
                    assert!(m.values.iter().any(|&x| bf16::from_f32(x).to_f32() != x));
                }
                all.extend(calls);
            }
            all
        });
        // Over all ranks, every element of every parameter was asked for exactly once.
        let mut seen: Vec<Vec<u8>> = specs.iter().map(|s| vec![0; s.numel]).collect();
        for (p, r) in calls.into_iter().flatten() {
            for i in r {
                seen[p][i] += 1;
            }
        }
        assert!(
            seen.iter().flatten().all(|&c| c == 1),
            "{storage:?}: coverage"
        );
    }
}

/// The weights a forced sync builds come from the masters (here deliberately different from
/// what the buffers were initialized with): `Q(bf16(master))`, the same bytes as buffers
/// initialized with the masters' values.
#[test]
fn low_precision_weights_are_rebuilt_from_the_masters() {
    let dp = 2;
    let specs = specs(MXFP8, GradDType::F32, true);
    let stored = init_values(&specs);
    let masters: Vec<Vec<f32>> = specs
        .iter()
        .enumerate()
        .map(|(p, s)| high_precision(p, 0..s.numel))
        .collect();
    run(dp, |mut comm, mut dev| {
        let dev = &mut dev;
        let make = |dev: &mut Device, values: &[Vec<f32>]| {
            buffers(dev, dp, comm.rank(), &specs, Overlap::None, values)
        };
        let mut bufs = make(dev, &stored);
        let reference = make(dev, &masters);
        let opt = common::optimizer(dev, &bufs, &masters, true);
        let before = weight_bytes(dev, &bufs);
        protocol::force_param_sync(dev, &mut comm, &mut bufs, &opt).unwrap();
        let (got, want) = (weight_bytes(dev, &bufs), weight_bytes(dev, &reference));
        for p in (0..specs.len()).filter(|&p| bufs.is_low_precision(p)) {
            assert!(got[p] != before[p], "param {p}: the sync changed nothing");
            assert!(
                got[p] == want[p],
                "param {p}: weights are not Q(bf16(master))"
            );
        }
    });
}

/// A callback whose last piece is short; earlier pieces were already given device memory.
fn short_last(bufs: &DataParallelBuffers) -> impl FnMut(usize, Range<usize>) -> Vec<f32> {
    let last = bufs.owned_shards().unwrap().last().unwrap().param;
    move |p: usize, r: Range<usize>| vec![0.0; r.len() - usize::from(p == last)]
}

fn refused(dev: &mut Device, bufs: &DataParallelBuffers) -> OptimError {
    let mut cb = short_last(bufs);
    DistributedOptimizer::new(
        dev,
        bufs,
        OptimizerId(0),
        adamw(),
        OptimConfig::new(1e-3),
        &mut cb,
    )
    .unwrap_err()
}

fn one_rank_bufs(dev: &mut Device) -> DataParallelBuffers {
    let specs = specs(ParamStorage::Bf16, GradDType::F32, false);
    DataParallelBuffers::new(dev, 1, 0, specs, ddp(Overlap::None)).unwrap()
}

#[test]
fn init_values_of_the_wrong_length_are_refused() {
    let mut dev = Device::cpu();
    let bufs = one_rank_bufs(&mut dev);
    match refused(&mut dev, &bufs) {
        OptimError::Invalid(InvalidInput::InitLength {
            param,
            got,
            expected,
        }) => {
            assert_eq!(got + 1, expected);
            assert_eq!(expected, bufs.specs()[param].numel);
        }
        other => panic!("expected InitLength, got {other}"),
    }
}

#[test]
fn a_refused_optimizer_frees_what_it_allocated() {
    let mut dev = Device::cpu();
    let bufs = one_rank_bufs(&mut dev);
    let before = dev.allocated_bytes();
    refused(&mut dev, &bufs);
    let leaked = dev.allocated_bytes() - before;
    assert_eq!(
        leaked, 0,
        "a refused optimizer left {leaked} bytes allocated"
    );
}
