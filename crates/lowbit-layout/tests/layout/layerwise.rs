//! Layer-wise layout tests. Golden offsets are derived by hand from the rule in the module
//! documentation of `layerwise.rs` (Megatron-LM's `LayerWiseDistributedOptimizer` layout), in
//! the comments next to each case, never from this implementation's output.
//!
//! Notation: `D` is the shard divisor `lcm(64, lcm(dp, 128) / dp)`; `cap` is the LPT size cap
//! `1.3 * chunk_numel / dp`; `cost` is `max(m, n) * min(m, n)^2` for matrices, numel otherwise.
//! "Walk order" is reverse forward order.

use crate::common;

use common::{bf16, mat, nvfp4, param, ranges};
use lowbit_layout::{
    BucketRange, BufferLayout, LayoutConfig, LayoutError, OptimizerId, ParamRange, ParamSpec,
    ParamStorage, PlanConfig, QuantKind, ShardingPlan, ShardingStrategy, bucket_end_divisor,
    check_shard_count, compute_layerwise_layout, compute_layout, layerwise_cost, owner_of_param,
    packed_layout, param_shard_ranges, shard_range,
};
use proptest::prelude::*;

fn cfg(dp: usize, bucket_size: Option<usize>) -> LayoutConfig {
    LayoutConfig::distributed(dp, bucket_size)
}

/// `(start, end, numel_unpadded, params)` of every bucket.
fn buckets(layout: &BufferLayout) -> Vec<(usize, usize, usize, Vec<usize>)> {
    layout
        .buckets
        .iter()
        .map(|b| (b.start, b.end, b.numel_unpadded, b.params.clone()))
        .collect()
}

fn owners(layout: &BufferLayout) -> Vec<usize> {
    (0..layout.params.len())
        .map(|p| owner_of_param(layout, p).unwrap())
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Golden layouts
// ---------------------------------------------------------------------------------------------

#[test]
fn golden_dp2_four_params_sorted_by_cost() {
    // dp = 2: lcm(2, 128) = 128, D = lcm(64, 64) = 64. One chunk (bucket_size None).
    //   p0 [128, 64]: numel 8192, cost 128 * 64^2 = 524288
    //   p1 [256]:     numel  256, cost 256
    //   p2 [64, 64]:  numel 4096, cost 64^3 = 262144
    //   p3 [32, 96]:  numel 3072, cost 96 * 32^2 = 98304
    // chunk_numel = 15616, cap = 1.3 * 7808 = 10150.4. Order by cost: p0, p2, p3, p1.
    //   p0: both fit, loads tie -> s0; cursors [8192, 0], loads [524288, 0]
    //   p2: s0 8192+4096 > cap, s1 4096 fits -> s1; cursors [8192, 4096]
    //   p3: s0 11264 > cap, s1 7168 fits -> s1; cursors [8192, 7168], loads [524288, 360448]
    //   p1: s0 8448 fits, s1 7424 fits; least load s1 -> s1 at 7168; cursors [8192, 7424]
    // padded shard = pad(8192, 64) = 8192; bucket [0, 16384); shard 1 starts at 8192:
    //   p2 8192..12288, p3 12288..15360, p1 15360..15616.
    let params = [
        mat("p0", 128, 64),
        param("p1", 256),
        mat("p2", 64, 64),
        mat("p3", 32, 96),
    ];
    let layout = compute_layerwise_layout(&params, &cfg(2, None)).unwrap();
    assert_eq!(
        ranges(&layout),
        vec![
            (0, 8192, 0),
            (15360, 15616, 0),
            (8192, 12288, 0),
            (12288, 15360, 0)
        ]
    );
    assert_eq!(buckets(&layout), vec![(0, 16384, 15616, vec![0, 2, 3, 1])]);
    assert_eq!(layout.numel, 16384);
    assert_eq!(layout.numel_unpadded, 15616);
    assert_eq!(layout.num_shards, 2);
    assert_eq!(owners(&layout), vec![0, 1, 1, 1]);
}

#[test]
fn golden_dp2_size_cap_overrides_least_cost_and_ties_keep_walk_order() {
    // A [64, 64] (cost 262144), B, C, D [4096] (cost 4096 each). dp = 2, D = 64.
    // chunk_numel = 16384, cap = 1.3 * 8192 = 10649.6. Walk order D, C, B, A; sorted by cost
    // (stable): A, D, C, B.
    //   A: tie -> s0; cursors [4096, 0], loads [262144, 0]
    //   D: both fit -> least load s1; cursors [4096, 4096], loads [262144, 4096]
    //   C: both fit (8192) -> s1; cursors [4096, 8192], loads [262144, 8192]
    //   B: s0 8192 fits, s1 12288 > cap -> s0 (although s1 has the smaller load)
    // padded 8192: s0 = A 0..4096, B 4096..8192; s1 = D 8192..12288, C 12288..16384.
    let params = [
        mat("A", 64, 64),
        param("B", 4096),
        param("C", 4096),
        param("D", 4096),
    ];
    let layout = compute_layerwise_layout(&params, &cfg(2, None)).unwrap();
    assert_eq!(
        ranges(&layout),
        vec![
            (0, 4096, 0),
            (4096, 8192, 0),
            (12288, 16384, 0),
            (8192, 12288, 0)
        ]
    );
    assert_eq!(buckets(&layout), vec![(0, 16384, 16384, vec![0, 1, 3, 2])]);
    assert_eq!(owners(&layout), vec![0, 0, 1, 1]);
}

#[test]
fn golden_dp2_no_candidate_falls_back_to_least_filled_shard() {
    // M [128, 128]: numel 16384, cost 128^3 = 2097152
    // R [64, 384]:  numel 24576, cost 384 * 64^2 = 1572864
    // Q [30720]:    numel 30720, cost 30720
    // dp = 2, chunk_numel = 71680, cap = 1.3 * 35840 = 46592. Sorted: M, R, Q.
    //   M: tie -> s0; cursors [16384, 0], loads [2097152, 0]
    //   R: s0 40960 fits, s1 24576 fits -> least load s1; cursors [16384, 24576]
    //   Q: s0 47104 > cap, s1 55296 > cap -> no candidate -> least filled s0 (16384 < 24576),
    //      although s1 has the smaller load.
    // cursors [47104, 24576]; padded = pad(47104, 64) = 47104; bucket 94208.
    //   M 0..16384, Q 16384..47104, R 47104..71680.
    let params = [mat("M", 128, 128), mat("R", 64, 384), param("Q", 30720)];
    let layout = compute_layerwise_layout(&params, &cfg(2, None)).unwrap();
    assert_eq!(
        ranges(&layout),
        vec![(0, 16384, 0), (47104, 71680, 0), (16384, 47104, 0)]
    );
    assert_eq!(buckets(&layout), vec![(0, 94208, 71680, vec![0, 2, 1])]);
    assert_eq!(owners(&layout), vec![0, 1, 0]);
}

#[test]
fn golden_dp4_shared_embedding_gets_shard_zero_and_counts_as_load() {
    // Forward: x0..x3 [64, 64], emb [512, 64] (shared), a, b, c, d [64, 64].
    // dp = 4: lcm(4, 128) = 128, 128 / 4 = 32, D = lcm(64, 32) = 64. bucket_size None.
    // Walk: d, c, b, a form a chunk; emb closes it and gets its own bucket; x3..x0 the last.
    // Bucket 0: chunk 16384, cap = 1.3 * 4096 = 5324.8; equal costs keep walk order d, c, b, a;
    //   each goes to the least-loaded fitting shard: d s0, c s1, b s2, a s3 (a second matrix
    //   never fits: 8192 > cap). Padded 4096, bucket [0, 16384). Loads 262144 each.
    // Bucket 1: emb (32768) in shard 0, padded 32768, bucket [16384, 16384 + 4*32768 = 147456).
    //   Shard 0 load += 512 * 64^2 = 2097152.
    // Bucket 2: x3, x2, x1, x0; cap 5324.8 again. Loads [2359296, 262144, 262144, 262144]:
    //   x3 -> s1, x2 -> s2, x1 -> s3, x0 -> s0 (only s0 still fits). Padded 4096,
    //   bucket [147456, 163840): x0 147456, x3 151552, x2 155648, x1 159744.
    let mut params: Vec<ParamSpec> = (0..4).map(|i| mat(&format!("x{i}"), 64, 64)).collect();
    params.push(mat("emb", 512, 64).with_shared_embedding(true));
    params.extend(["a", "b", "c", "d"].map(|n| mat(n, 64, 64)));
    let layout = compute_layerwise_layout(&params, &cfg(4, None)).unwrap();
    assert_eq!(
        ranges(&layout),
        vec![
            (147456, 151552, 2),
            (159744, 163840, 2),
            (155648, 159744, 2),
            (151552, 155648, 2),
            (16384, 49152, 1),
            (12288, 16384, 0),
            (8192, 12288, 0),
            (4096, 8192, 0),
            (0, 4096, 0),
        ]
    );
    assert_eq!(
        buckets(&layout),
        vec![
            (0, 16384, 16384, vec![8, 7, 6, 5]),
            (16384, 147456, 32768, vec![4]),
            (147456, 163840, 16384, vec![0, 3, 2, 1]),
        ]
    );
    assert_eq!(layout.numel, 163840);
    assert_eq!(layout.numel_unpadded, 65536);
    assert_eq!(owners(&layout), vec![0, 3, 2, 1, 0, 3, 2, 1, 0]);
}

#[test]
fn golden_dp2_bucket_size_closes_chunks_and_loads_persist() {
    // Forward: a, b, c [64, 64], t [32], e [64, 64]; dp = 2, bucket_size 8192, D = 64.
    // Threshold = max(8192, floor(2 * 4096 * 0.9) = 7372) = 8192 once a matrix is in the chunk.
    // Walk (mirror = least-filled placement at pad64(fill) + numel):
    //   e: chunk [e] 4096, mirror [4096, 0]
    //   t: 4096 < 8192 -> add; mirror [4096, 32]; chunk 4128
    //   c: 4128 < 8192 -> add; mirror [4096, 64 + 4096 = 4160]; chunk 8224
    //   b: 8224 >= 8192; absorbs(4096)? pad64(4096) + 4096 = 8192 > pad(4160, 64) = 4160: no
    //      -> emit [e, t, c]; chunk [b]
    //   a: 4096 < 8192 -> add; end -> emit [b, a].
    // Bucket 0: chunk 8224, cap = 1.3 * 4112 = 5345.6; sorted e, c, t (e, c tie: walk order).
    //   e -> s0; c: s0 8192 > cap -> s1; t: both fit, loads tie (262144) -> s0 at 4096.
    //   cursors [4128, 4096] -> padded pad(4128, 64) = 4160, bucket [0, 8320).
    //   e 0..4096, t 4096..4128, c 4160..8256. Loads [262176, 262144].
    // Bucket 1: chunk 8192, cap 5324.8; sorted b, a. b: both fit, least load s1 (persisting
    //   loads: 262144 < 262176) -> s1; a: s1 8192 > cap -> s0. Padded 4096,
    //   bucket [8320, 16512): a 8320..12416, b 12416..16512.
    let params = [
        mat("a", 64, 64),
        mat("b", 64, 64),
        mat("c", 64, 64),
        param("t", 32),
        mat("e", 64, 64),
    ];
    let layout = compute_layerwise_layout(&params, &cfg(2, Some(8192))).unwrap();
    assert_eq!(
        ranges(&layout),
        vec![
            (8320, 12416, 1),
            (12416, 16512, 1),
            (4160, 8256, 0),
            (4096, 4128, 0),
            (0, 4096, 0),
        ]
    );
    assert_eq!(
        buckets(&layout),
        vec![
            (0, 8320, 8224, vec![4, 3, 2]),
            (8320, 16512, 8192, vec![0, 1]),
        ]
    );
    assert_eq!(owners(&layout), vec![0, 1, 1, 0, 0]);
}

#[test]
fn golden_dp2_padding_floor_and_absorb_keep_the_chunk_open() {
    // Forward: y [64, 64], s [64], x [18, 64], a [47, 64], b [64, 64]; dp = 2, bucket_size 4096.
    //   numels: y 4096, s 64, x 1152, a 3008, b 4096
    //   costs:  y 262144, s 64, x 64 * 18^2 = 20736, a 64 * 47^2 = 141376, b 262144
    // Threshold = max(4096, floor(2 * 4096 * 0.9) = 7372) = 7372 (the padding floor).
    // Walk:
    //   b: chunk 4096, mirror [4096, 0]
    //   a: 4096 < 7372 -> add; mirror [4096, 3008]; chunk 7104
    //   x: 7104 < 7372 -> add; mirror [4096, pad64(3008) + 1152 = 4160]; chunk 8256
    //   s: 8256 >= 7372, but absorbs(64): pad64(4096) + 64 = 4160 <= pad(4160, 64) = 4160 -> add;
    //      mirror [4160, 4160]; chunk 8320
    //   y: 8320 >= 7372; absorbs(4096)? 4160 + 4096 > 4160: no -> emit [b, a, x, s]; chunk [y].
    // Bucket 0: cap = 1.3 * 4160 = 5408; sorted b, a, x, s.
    //   b -> s0 (tie); a: s0 7104 > cap -> s1 at 0; x: s0 5248 and s1 4160 fit, least load s1 ->
    //   s1 at 3008; s: both fit, least load s1 (162112) -> s1 at 4160. cursors [4096, 4224].
    //   padded 4224, bucket [0, 8448): b 0..4096, a 4224..7232, x 7232..8384, s 8384..8448.
    // Bucket 1: y alone, cap 2662.4: nothing fits -> least filled s0 (tie). Padded 4096,
    //   bucket [8448, 16640): y 8448..12544.
    let params = [
        mat("y", 64, 64),
        param("s", 64),
        mat("x", 18, 64),
        mat("a", 47, 64),
        mat("b", 64, 64),
    ];
    let layout = compute_layerwise_layout(&params, &cfg(2, Some(4096))).unwrap();
    assert_eq!(
        ranges(&layout),
        vec![
            (8448, 12544, 1),
            (8384, 8448, 0),
            (7232, 8384, 0),
            (4224, 7232, 0),
            (0, 4096, 0),
        ]
    );
    assert_eq!(
        buckets(&layout),
        vec![
            (0, 8448, 8320, vec![4, 3, 2, 1]),
            (8448, 16640, 4096, vec![0]),
        ]
    );
    assert_eq!(owners(&layout), vec![0, 1, 1, 1, 0]);
}

#[test]
fn golden_dp3_shard_divisor_is_128_and_packs_for_nvfp4() {
    // dp = 3: lcm(3, 128) = 384, 384 / 3 = 128, D = lcm(64, 128) = 128.
    // a [100] (cost 100), b [10, 20] (numel 200, cost 20 * 10^2 = 2000). chunk 300,
    // cap = 1.3 * 100 = 130. Sorted b, a.
    //   b: 200 > cap everywhere -> least filled, tie -> s0; cursors [200, 0, 0]
    //   a: s0 256 + 100 > cap; s1, s2 fit, loads tie -> s1 at 0; cursors [200, 100, 0]
    // padded = pad(200, 128) = 256; bucket [0, 768): b 0..200, a 256..356.
    let key = nvfp4();
    let params = [
        ParamSpec::new("a", vec![100], key),
        ParamSpec::new("b", vec![10, 20], key),
    ];
    let layout = compute_layerwise_layout(&params, &cfg(3, None)).unwrap();
    assert_eq!(ranges(&layout), vec![(256, 356, 0), (0, 200, 0)]);
    assert_eq!(buckets(&layout), vec![(0, 768, 300, vec![1, 0])]);
    assert_eq!(owners(&layout), vec![1, 0]);
    // Packed bytes are element offsets / 2; shards 128 bytes.
    let packed = packed_layout(&layout).unwrap();
    assert_eq!((packed.params[0].start, packed.params[0].end), (128, 178));
    assert_eq!((packed.params[1].start, packed.params[1].end), (0, 100));
    assert_eq!(packed.buckets[0].shard_bytes, 128);
    assert_eq!(packed.shard_range(0, 2).unwrap(), 256..384);
}

#[test]
fn golden_dp4_high_busbw_pads_shards_to_16384() {
    // dp = 4 with high bus bandwidth: lcm(4, 128, 2^16) = 65536, / 4 = 16384,
    // D = lcm(64, 16384) = 16384. p0, p1 [64, 64]; chunk 8192, cap = 1.3 * 2048 = 2662.4:
    // nothing fits, so least filled: p1 -> s0, then p0 -> s1 (cursor 0 < 4096).
    // padded = pad(4096, 16384) = 16384; bucket [0, 65536): p1 0..4096, p0 16384..20480.
    let params = [mat("p0", 64, 64), mat("p1", 64, 64)];
    let lcfg = LayoutConfig {
        high_busbw_padding: true,
        ..cfg(4, None)
    };
    let layout = compute_layerwise_layout(&params, &lcfg).unwrap();
    assert_eq!(ranges(&layout), vec![(16384, 20480, 0), (0, 4096, 0)]);
    assert_eq!(buckets(&layout), vec![(0, 65536, 8192, vec![1, 0])]);
    assert_eq!(owners(&layout), vec![1, 0]);
}

#[test]
fn distributed_optimizer_flag_is_ignored() {
    let params = [mat("p0", 128, 64), param("p1", 256), mat("p2", 64, 64)];
    let sharded = compute_layerwise_layout(&params, &cfg(2, None)).unwrap();
    let plain = compute_layerwise_layout(&params, &LayoutConfig::ddp(2, None)).unwrap();
    assert_eq!(sharded, plain);
    assert_eq!(plain.num_shards, 2);
}

#[test]
fn huge_dp_needs_no_per_shard_memory() {
    // 2^40 shards: D = lcm(64, 2^40 / 2^40) = 64. Three params, one chunk; each goes to its own
    // shard (nothing fits the cap of 1.3 * 3 * 64 / 2^40), shards 0, 1, 2 in sorted order.
    let dp = 1usize << 40;
    let params = [param("a", 64), param("b", 64), param("c", 64)];
    let layout = compute_layerwise_layout(&params, &cfg(dp, None)).unwrap();
    assert_eq!(layout.buckets.len(), 1);
    assert_eq!(layout.numel, dp * 64);
    // Equal costs keep walk order: c, b, a -> shards 0, 1, 2.
    assert_eq!(owners(&layout), vec![2, 1, 0]);
}

// ---------------------------------------------------------------------------------------------
// layerwise_cost and owner_of_param
// ---------------------------------------------------------------------------------------------

#[test]
fn layerwise_cost_is_max_times_min_squared() {
    assert_eq!(layerwise_cost(&[3, 5]), 5 * 3 * 3);
    assert_eq!(layerwise_cost(&[5, 3]), 5 * 3 * 3);
    // Leading dims fold into rows: [2, 3, 4] is 6 x 4 -> 6 * 4^2.
    assert_eq!(layerwise_cost(&[2, 3, 4]), 96);
    assert_eq!(layerwise_cost(&[4, 1]), 4);
    assert_eq!(layerwise_cost(&[64, 64]), 262_144);
    // 1-D and scalars: numel.
    assert_eq!(layerwise_cost(&[7]), 7);
    assert_eq!(layerwise_cost(&[]), 1);
    // Saturates instead of overflowing: (2^64 - 1)^3 > 2^128.
    assert_eq!(layerwise_cost(&[usize::MAX, usize::MAX]), u128::MAX);
    let m = usize::MAX as u128;
    assert_eq!(layerwise_cost(&[usize::MAX, 2]), m * 4);
}

#[test]
fn owner_of_param_errors() {
    let params = [mat("p0", 64, 64), mat("p1", 64, 64)];
    let layout = compute_layerwise_layout(&params, &cfg(2, None)).unwrap();
    assert_eq!(
        owner_of_param(&layout, 2),
        Err(LayoutError::NoSuchParam {
            param: 2,
            params: 2
        })
    );

    // The distributed-optimizer layout splits a 1000-element parameter across two shards.
    let split = compute_layout(&[param("w", 1000)], &cfg(2, None)).unwrap();
    assert_eq!(split.buckets[0].numel(), 1024);
    assert_eq!(
        owner_of_param(&split, 0),
        Err(LayoutError::ParamNotInOneShard {
            param: 0,
            start: 0,
            end: 1000
        })
    );
    // Every parameter of a classic DDP layout is owned by its single shard.
    let ddp = compute_layout(&params, &LayoutConfig::ddp(2, None)).unwrap();
    assert_eq!(owners(&ddp), vec![0, 0]);

    // Hand-built layouts.
    let hand = |params: Vec<ParamRange>, buckets: Vec<BucketRange>, num_shards| BufferLayout {
        key: bf16(),
        params,
        buckets,
        numel: 128,
        numel_unpadded: 128,
        num_shards,
    };
    let bucket = |start, end| BucketRange {
        start,
        end,
        numel_unpadded: 0,
        params: vec![0],
    };
    let p = |start, end, bucket| ParamRange {
        param: 0,
        start,
        end,
        bucket,
    };
    assert_eq!(
        owner_of_param(&hand(vec![p(0, 8, 3)], vec![bucket(0, 128)], 2), 0),
        Err(LayoutError::NoSuchBucket {
            bucket: 3,
            buckets: 1
        })
    );
    assert_eq!(
        owner_of_param(&hand(vec![p(0, 8, 0)], vec![bucket(0, 128)], 0), 0),
        Err(LayoutError::ZeroDataParallel)
    );
    assert_eq!(
        owner_of_param(&hand(vec![p(0, 8, 0)], vec![bucket(0, 127)], 2), 0),
        Err(LayoutError::BucketNotDivisible {
            start: 0,
            end: 127,
            numel: 127,
            dp: 2
        })
    );
    let outside = |start, end| {
        Err(LayoutError::ParamNotInOneShard {
            param: 0,
            start,
            end,
        })
    };
    // Shards of [0, 128) are [0, 64) and [64, 128).
    let one = |s, e, bucket_start, bucket_end| {
        owner_of_param(
            &hand(vec![p(s, e, 0)], vec![bucket(bucket_start, bucket_end)], 2),
            0,
        )
    };
    // Crossing the shard end at 64.
    assert_eq!(one(60, 70, 0, 128), outside(60, 70));
    // Before its bucket, past its bucket's end, empty at the bucket end.
    assert_eq!(one(10, 20, 64, 192), outside(10, 20));
    assert_eq!(one(120, 130, 0, 128), outside(120, 130));
    assert_eq!(one(128, 128, 0, 128), outside(128, 128));
    // An inverted bucket.
    assert_eq!(one(0, 8, 64, 0), outside(0, 8));
    // Inside shard 1 of [0, 128): owner 1.
    assert_eq!(
        owner_of_param(&hand(vec![p(64, 128, 0)], vec![bucket(0, 128)], 2), 0),
        Ok(1)
    );
}

// ---------------------------------------------------------------------------------------------
// Validation errors
// ---------------------------------------------------------------------------------------------

#[test]
fn validation_errors_match_compute_layout() {
    let ok = [mat("p0", 64, 64)];
    assert_eq!(
        compute_layerwise_layout(&ok, &cfg(0, None)),
        Err(LayoutError::ZeroDataParallel)
    );
    assert_eq!(
        compute_layerwise_layout(&ok, &cfg(2, Some(0))),
        Err(LayoutError::ZeroBucketSize)
    );
    let none: [ParamSpec; 0] = [];
    assert_eq!(
        compute_layerwise_layout(&none, &cfg(2, None)),
        Err(LayoutError::NoParams)
    );
    let mixed = [mat("p0", 64, 64), ParamSpec::new("q", vec![64], nvfp4())];
    assert_eq!(
        compute_layerwise_layout(&mixed, &cfg(2, None)),
        Err(LayoutError::MixedKeys {
            index: 1,
            name: "q".into(),
            expected: bf16(),
            found: nvfp4(),
        })
    );
    let mut bad = mat("bad", 2, 3);
    bad.numel = 5;
    let shape = [mat("p0", 4, 4), bad];
    assert_eq!(
        compute_layerwise_layout(&shape, &cfg(2, None)),
        Err(LayoutError::ShapeMismatch {
            index: 1,
            name: "bad".into(),
            numel: 5,
            shape: vec![2, 3],
        })
    );
    // A shape whose product overflows is a mismatch, not a panic.
    let huge = ParamSpec {
        name: "huge".into(),
        numel: 1,
        shape: vec![usize::MAX, 2],
        key: bf16(),
        shared_embedding: false,
    };
    assert!(matches!(
        compute_layerwise_layout(&[huge], &cfg(2, None)),
        Err(LayoutError::ShapeMismatch { index: 0, .. })
    ));
    let empty = [mat("p0", 4, 4), param("z", 0)];
    assert_eq!(
        compute_layerwise_layout(&empty, &cfg(2, None)),
        Err(LayoutError::EmptyParam {
            index: 1,
            name: "z".into()
        })
    );
    // Every invalid input gets the same error from both layout rules.
    for (params, c) in [
        (&ok[..], cfg(0, None)),
        (&ok[..], cfg(2, Some(0))),
        (&none[..], cfg(2, None)),
        (&mixed[..], cfg(2, None)),
        (&shape[..], cfg(2, None)),
        (&empty[..], cfg(2, None)),
    ] {
        assert_eq!(
            compute_layerwise_layout(params, &c),
            compute_layout(params, &c)
        );
    }
}

#[test]
fn overflow_is_an_error_not_a_panic() {
    // The padded shard of a usize::MAX parameter overflows.
    let big = [param("big", usize::MAX)];
    assert_eq!(
        compute_layerwise_layout(&big, &cfg(1, None)),
        Err(LayoutError::Overflow)
    );
    // The shard divisor overflows: lcm(usize::MAX, 128) (usize::MAX is odd).
    let small = [param("s", 64)];
    assert_eq!(
        compute_layerwise_layout(&small, &cfg(usize::MAX, None)),
        Err(LayoutError::Overflow)
    );
    // dp = 3 * 2^60: D = 64, but the bucket (dp * 64) overflows.
    assert_eq!(
        compute_layerwise_layout(&small, &cfg(3 << 60, None)),
        Err(LayoutError::Overflow)
    );
    // Two half-address-space parameters: the second bucket's end overflows.
    let halves = [param("a", usize::MAX / 2), param("b", usize::MAX / 2)];
    assert_eq!(
        compute_layerwise_layout(&halves, &cfg(1, Some(1))),
        Err(LayoutError::Overflow)
    );
}

// ---------------------------------------------------------------------------------------------
// The plan uses the layer-wise layout for LayerWise owners
// ---------------------------------------------------------------------------------------------

#[test]
fn plan_layerwise_owner_owns_whole_params() {
    let muon = OptimizerId(1);
    let with_owner = |mut p: ParamSpec, owner| {
        p.key.owner = owner;
        p
    };
    let mut specs = Vec::new();
    for layer in 0..3 {
        specs.push(param(&format!("norm{layer}"), 96));
        specs.push(with_owner(mat(&format!("qkv{layer}"), 96, 32), muon));
        let mut fp4 = ParamSpec::new(format!("mlp{layer}"), vec![64, 32], nvfp4());
        fp4.key.owner = muon;
        specs.push(fp4);
    }
    let cfg = PlanConfig::new(4, ShardingStrategy::Distributed)
        .with_owner_strategy(muon, ShardingStrategy::LayerWise)
        .with_bucket_size(Some(3000));
    let plan = ShardingPlan::new(&specs, &cfg).unwrap();
    let mut pieces: Vec<Vec<(usize, std::ops::Range<usize>)>> = vec![Vec::new(); specs.len()];
    for rank in 0..4 {
        for piece in plan.owned(rank).unwrap() {
            pieces[piece.param].push((rank, piece.param_range));
        }
    }
    for (b, buf) in plan.buffers().iter().enumerate() {
        assert_eq!(buf.layout.num_shards, 4);
        if buf.key.owner != muon {
            continue;
        }
        assert_eq!(buf.strategy, ShardingStrategy::LayerWise);
        assert_eq!(
            buf.packed.is_some(),
            buf.key.param_storage == ParamStorage::Quantized(QuantKind::Nvfp4)
        );
        for (i, &p) in buf.params.iter().enumerate() {
            let owner = owner_of_param(&buf.layout, i).unwrap();
            assert_eq!(pieces[p], vec![(owner, 0..specs[p].numel)], "buffer {b}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Properties
// ---------------------------------------------------------------------------------------------

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// `D = lcm(64, bucket_end_divisor(dp) / dp)`, from the rule.
fn shard_divisor(dp: usize, busbw: bool) -> usize {
    let per = bucket_end_divisor(dp, busbw) / dp;
    64 / gcd(64, per) * per
}

#[derive(Debug, Clone)]
struct Case {
    shapes: Vec<(Vec<usize>, bool)>,
    dp: usize,
    bucket_size: Option<usize>,
    busbw: bool,
    nvfp4: bool,
}

impl Case {
    fn specs(&self) -> Vec<ParamSpec> {
        let key = if self.nvfp4 { nvfp4() } else { bf16() };
        self.shapes
            .iter()
            .enumerate()
            .map(|(i, (shape, shared))| {
                ParamSpec::new(format!("p{i}"), shape.clone(), key).with_shared_embedding(*shared)
            })
            .collect()
    }

    fn cfg(&self) -> LayoutConfig {
        LayoutConfig {
            dp: self.dp,
            bucket_size: self.bucket_size,
            distributed_optimizer: true,
            high_busbw_padding: self.busbw,
        }
    }
}

fn shape(nvfp4: bool) -> BoxedStrategy<Vec<usize>> {
    if nvfp4 {
        // NVFP4 parameters need 16x16 tiles (rows folded).
        prop_oneof![
            (1usize..=8, 1usize..=8).prop_map(|(r, c)| vec![16 * r, 16 * c]),
            (1usize..=3, 1usize..=4, 1usize..=4).prop_map(|(e, r, c)| vec![e, 16 * r, 16 * c]),
        ]
        .boxed()
    } else {
        prop_oneof![
            (1usize..3000).prop_map(|n| vec![n]),
            (1usize..100, 1usize..100).prop_map(|(r, c)| vec![r, c]),
        ]
        .boxed()
    }
}

fn case() -> impl Strategy<Value = Case> {
    (
        any::<bool>(),
        1usize..=8,
        prop::option::of(1usize..40_000),
        prop::bool::weighted(0.2),
    )
        .prop_flat_map(|(nvfp4, dp, bucket_size, busbw)| {
            let param = (shape(nvfp4), prop::bool::weighted(0.1));
            prop::collection::vec(param, 1..24).prop_map(move |shapes| Case {
                shapes,
                dp,
                bucket_size,
                busbw,
                nvfp4,
            })
        })
}

fn check_layout(
    case: &Case,
    specs: &[ParamSpec],
    layout: &BufferLayout,
) -> Result<(), TestCaseError> {
    let dp = case.dp;
    let n = specs.len();
    let divisor = shard_divisor(dp, case.busbw);
    prop_assert_eq!(layout.num_shards, dp);
    prop_assert!(check_shard_count(layout, dp).is_ok());
    prop_assert_eq!(layout.params.len(), n);

    // Buckets tile [0, numel) in order, each a multiple of the bucket-end divisor.
    let end_divisor = bucket_end_divisor(dp, case.busbw);
    let mut cursor = 0;
    let mut seen = vec![false; n];
    for (b, bucket) in layout.buckets.iter().enumerate() {
        prop_assert_eq!(bucket.start, cursor);
        prop_assert!(bucket.end > bucket.start);
        prop_assert_eq!(bucket.numel() % end_divisor, 0);
        cursor = bucket.end;
        prop_assert!(!bucket.params.is_empty());
        let sum: usize = bucket.params.iter().map(|&p| specs[p].numel).sum();
        prop_assert_eq!(bucket.numel_unpadded, sum);
        // Ascending offsets; every parameter listed once, in the bucket it names.
        for w in bucket.params.windows(2) {
            prop_assert!(layout.params[w[0]].start < layout.params[w[1]].start);
        }
        for &p in &bucket.params {
            prop_assert!(!seen[p]);
            seen[p] = true;
            prop_assert_eq!(layout.params[p].bucket, b);
        }
        // Each bucket is a contiguous backward range of forward indices.
        let lo = *bucket.params.iter().min().unwrap();
        let hi = *bucket.params.iter().max().unwrap();
        prop_assert_eq!(hi - lo + 1, bucket.params.len());
        if b > 0 {
            let prev = &layout.buckets[b - 1].params;
            prop_assert!(hi < *prev.iter().min().unwrap());
        }
        // Shard starts are 64-aligned; the padded shard is the fullest shard rounded up to D.
        let shard = bucket.numel() / dp;
        prop_assert_eq!(shard % divisor, 0);
        let mut fill = vec![0usize; dp];
        let mut last_end: Vec<Option<usize>> = vec![None; dp];
        for &p in &bucket.params {
            let r = layout.params[p];
            let owner = owner_of_param(layout, p).unwrap();
            let world = shard_range(bucket, owner, dp).unwrap();
            prop_assert_eq!(world.start % 64, 0);
            prop_assert!(world.start <= r.start && r.end <= world.end);
            prop_assert_eq!(r.start % 64, 0);
            // Packed tightly: each parameter at pad64 of the previous end in its shard.
            let expected = last_end[owner].map_or(world.start, |e| e.next_multiple_of(64));
            prop_assert_eq!(r.start, expected);
            last_end[owner] = Some(r.end);
            fill[owner] = r.end - world.start;
            // Exactly one shard of the bucket intersects the parameter.
            let hits = (0..dp)
                .filter(|&s| {
                    let w = shard_range(bucket, s, dp).unwrap();
                    w.start < r.end && r.start < w.end
                })
                .count();
            prop_assert_eq!(hits, 1);
        }
        let max_fill = fill.iter().copied().max().unwrap();
        prop_assert_eq!(shard, max_fill.next_multiple_of(divisor));
    }
    prop_assert_eq!(cursor, layout.numel);
    prop_assert!(seen.iter().all(|&s| s));
    prop_assert_eq!(
        layout.numel_unpadded,
        specs.iter().map(|s| s.numel).sum::<usize>()
    );
    for (i, (r, spec)) in layout.params.iter().zip(specs).enumerate() {
        prop_assert_eq!(r.param, i);
        prop_assert_eq!(r.numel(), spec.numel);
    }

    // Shared embeddings: alone, at the start of shard 0, every shard padded to its size.
    for (i, spec) in specs.iter().enumerate() {
        if !spec.shared_embedding {
            continue;
        }
        let r = layout.params[i];
        let bucket = &layout.buckets[r.bucket];
        prop_assert_eq!(&bucket.params, &vec![i]);
        prop_assert_eq!(r.start, bucket.start);
        prop_assert_eq!(bucket.numel(), dp * spec.numel.next_multiple_of(divisor));
    }

    // Without a bucket size: one bucket per shared embedding and per run between them.
    if case.bucket_size.is_none() {
        let mut expected = 0;
        let mut in_run = false;
        for spec in specs {
            if spec.shared_embedding {
                expected += 1;
                in_run = false;
            } else if !in_run {
                expected += 1;
                in_run = true;
            }
        }
        prop_assert_eq!(layout.buckets.len(), expected);
    }

    // Owned pieces over all ranks: every parameter whole, on exactly its owner.
    let mut pieces: Vec<Vec<(usize, std::ops::Range<usize>)>> = vec![Vec::new(); n];
    for rank in 0..dp {
        for piece in param_shard_ranges(layout, rank).unwrap() {
            prop_assert_eq!(piece.gbuf_world.clone(), layout.params[piece.param].range());
            pieces[piece.param].push((rank, piece.param_range));
        }
    }
    for (p, got) in pieces.iter().enumerate() {
        let owner = owner_of_param(layout, p).unwrap();
        prop_assert_eq!(got, &vec![(owner, 0..specs[p].numel)]);
    }

    // NVFP4: the packed map exists and halves every offset.
    if case.nvfp4 {
        let packed = packed_layout(layout);
        prop_assert!(packed.is_ok(), "{:?}", packed);
        let packed = packed.unwrap();
        for (b, bucket) in layout.buckets.iter().enumerate() {
            prop_assert_eq!(packed.buckets[b].shard_bytes * 2, bucket.numel() / dp);
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn layerwise_layout_invariants(case in case()) {
        let specs = case.specs();
        let layout = compute_layerwise_layout(&specs, &case.cfg()).unwrap();
        check_layout(&case, &specs, &layout)?;
        // Deterministic, and the same whether params are owned or borrowed.
        let refs: Vec<&ParamSpec> = specs.iter().collect();
        prop_assert_eq!(&compute_layerwise_layout(&refs, &case.cfg()).unwrap(), &layout);
        prop_assert_eq!(&compute_layerwise_layout(&specs, &case.cfg()).unwrap(), &layout);
    }

    #[test]
    fn equal_matrices_balance_across_ranks(
        dp in 1usize..=8,
        k in 1usize..=5,
        rows in 1usize..80,
        cols in 1usize..80,
        bucket_size in prop::option::of(1usize..40_000),
        busbw in prop::bool::weighted(0.2),
    ) {
        // k * dp equal matrices: the absorb rule only closes a chunk when every shard has the
        // same count, so every bucket, and the whole buffer, gives each rank the same count.
        let specs: Vec<ParamSpec> = (0..k * dp).map(|i| mat(&format!("w{i}"), rows, cols)).collect();
        let lcfg = LayoutConfig {
            high_busbw_padding: busbw,
            ..cfg(dp, bucket_size)
        };
        let layout = compute_layerwise_layout(&specs, &lcfg).unwrap();
        let mut total = vec![0usize; dp];
        for bucket in &layout.buckets {
            let mut count = vec![0usize; dp];
            for &p in &bucket.params {
                count[owner_of_param(&layout, p).unwrap()] += 1;
            }
            prop_assert!(count.iter().all(|&c| c == count[0]), "bucket counts {:?}", count);
            for (t, c) in total.iter_mut().zip(count) {
                *t += c;
            }
        }
        prop_assert_eq!(total, vec![k; dp]);
    }
}
