//! Layer-wise plans (`PlanConfig::new(dp, ShardingStrategy::LayerWise)` through
//! `DataParallelBuffers::with_plan`): every owned shard is a whole parameter, every parameter
//! has exactly one owner, the reduce-scatter delivers the whole reduced gradient to that owner
//! (pre-scaled by `1/dp`, summed in rank order, bit for bit), and the gather spreads the owner's
//! new values to every rank.

use crate::common;

use common::{
    add_into, assert_same_bits, bf16_round, download_f32, run, seed, spec, values,
    write_fused_outputs,
};
use lowbit_buffers::layout::ShardingStrategy;
use lowbit_buffers::layout::{GradDType, ParamSpec, ParamStorage, PlanConfig, ShardingPlan};
use lowbit_buffers::protocol::StepProtocol;
use lowbit_buffers::{DataParallelBuffers, DdpConfig, Overlap, Verify};
use lowbit_comm::Communicator;

fn specs() -> Vec<ParamSpec> {
    let shapes: [&[usize]; 8] = [
        &[64, 32],
        &[64],
        &[48, 64],
        &[48],
        &[96, 48],
        &[96],
        &[16, 96],
        &[16],
    ];
    shapes
        .iter()
        .enumerate()
        .map(|(i, s)| spec(&format!("p{i}"), s, ParamStorage::Bf16, GradDType::F32))
        .collect()
}

fn grad_values(rank: usize, p: usize, n: usize) -> Vec<f32> {
    values(seed(&[rank as u64, p as u64, 11]), n, 3.0)
}

fn check(dp: usize, bucket: Option<usize>, overlap: Overlap) {
    let what = format!("dp {dp}, bucket {bucket:?}, {overlap:?}");
    let specs = specs();
    let new: Vec<Vec<f32>> = specs
        .iter()
        .enumerate()
        .map(|(p, s)| values(seed(&[p as u64, 12]), s.numel, 1.0))
        .collect();
    let owned = run(dp, |mut comm, mut dev| {
        let dev = &mut dev;
        let rank = comm.rank();
        let plan_cfg = PlanConfig::new(dp, ShardingStrategy::LayerWise).with_bucket_size(bucket);
        let plan = ShardingPlan::new(&specs, &plan_cfg).unwrap();
        let cfg = DdpConfig::default()
            .with_sharding(ShardingStrategy::LayerWise)
            .with_overlap(overlap)
            .with_verify(Verify::Full);
        let mut bufs = DataParallelBuffers::with_plan(dev, rank, specs.clone(), plan, cfg).unwrap();
        bufs.initialize_all(dev, |p| vec![0.0; specs[p].numel])
            .unwrap();
        bufs.zero_grad_buffer(dev).unwrap();
        for p in (0..specs.len()).rev() {
            let dst = bufs.accumulation_view(dev, p).unwrap();
            add_into(dev, &grad_values(rank, p, specs[p].numel), dst);
            if overlap.grad_reduce() {
                bufs.register_grad_ready(dev, &mut comm, p).unwrap();
            }
        }
        bufs.finish_grad_sync(dev, &mut comm).unwrap();
        let mut mine = Vec::new();
        for s in bufs.owned_shards().unwrap() {
            let n = specs[s.param].numel;
            assert_eq!(s.param_range, 0..n, "{what}: a piece of param {}", s.param);
            // The whole reduced gradient, in the buffers' order.
            let inv = 1.0 / dp as f32;
            let per_rank: Vec<Vec<f32>> = (0..dp).map(|r| grad_values(r, s.param, n)).collect();
            let want: Vec<f32> = (0..n)
                .map(|i| (1..dp).fold(per_rank[0][i] * inv, |a, r| a + per_rank[r][i] * inv))
                .collect();
            assert_same_bits(
                &download_f32(dev, s.grad_view),
                &want,
                &format!("{what}: reduced gradient of param {}", s.param),
            );
            assert!(s.fused_output.is_some());
            mine.push(s.param);
        }
        // The owners' new values reach every rank.
        write_fused_outputs(dev, &bufs, &new);
        if overlap.param_gather() {
            for g in (0..bufs.num_groups()).rev() {
                bufs.finish_param_sync(dev, &mut comm, g).unwrap();
            }
        } else {
            bufs.sync_params(dev, &mut comm).unwrap();
        }
        for (p, v) in new.iter().enumerate() {
            let want: Vec<f32> = v.iter().map(|&x| bf16_round(x)).collect();
            let got = download_f32(dev, bufs.param_view(p).unwrap());
            assert_same_bits(&got, &want, &format!("{what}: rank {rank}, param {p}"));
        }
        mine
    });
    let mut all: Vec<usize> = owned.concat();
    all.sort_unstable();
    assert_eq!(all, (0..specs.len()).collect::<Vec<_>>(), "{what}: owners");
    if dp > 1 {
        assert!(
            owned.iter().filter(|o| !o.is_empty()).count() > 1,
            "{what}: one rank owns everything"
        );
    }
}

#[test]
fn layer_wise_owners_get_whole_reduced_gradients() {
    for dp in 1..=4 {
        check(dp, None, Overlap::None);
        check(dp, Some(3000), Overlap::GradReduce);
        check(dp, Some(3000), Overlap::GradReduceAndParamGather);
    }
}
