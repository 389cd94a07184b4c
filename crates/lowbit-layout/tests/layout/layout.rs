//! Layout tests. The golden values are derived by hand from Megatron-LM's rules as the crate
//! documentation states them (`param_and_grad_buffer.py`: `_compute_default_per_buffer_param_layout`,
//! `shard_buffer`; `distrib_optimizer.py`: `_compute_per_buffer_param_layout`,
//! `_build_model_gbuf_param_range_map`), never from this implementation's output.

use crate::common;

use common::{bf16, key_of, nvfp4, param, ranges};
use lowbit_layout::{
    BufferKey, GradDType, LayoutConfig, LayoutError, OptimizerId, ParamSpec, ParamStorage,
    QuantKind, bucket_end_divisor, check_shard_count, compute_layout, default_bucket_size,
    expert_slices, group_params, packed_layout, packed_shard_range, pad_bucket_end,
    pad_param_start, param_shard_ranges, shard_range,
};
use proptest::prelude::*;

fn shared(name: &str, numel: usize) -> ParamSpec {
    param(name, numel).with_shared_embedding(true)
}

/// `(start, end, numel_unpadded)` of every bucket.
fn buckets(layout: &lowbit_layout::BufferLayout) -> Vec<(usize, usize, usize)> {
    layout
        .buckets
        .iter()
        .map(|b| (b.start, b.end, b.numel_unpadded))
        .collect()
}

/// The layout of `params` under `cfg`, after checking its param ranges and buckets.
fn layout_with(
    params: &[ParamSpec],
    cfg: LayoutConfig,
    want_ranges: Vec<(usize, usize, usize)>,
    want_buckets: Vec<(usize, usize, usize)>,
) -> lowbit_layout::BufferLayout {
    let layout = compute_layout(params, &cfg).unwrap();
    assert_eq!(ranges(&layout), want_ranges);
    assert_eq!(buckets(&layout), want_buckets);
    layout
}

// ---------------------------------------------------------------------------------------------
// test_param_layout (Megatron `distributed/test_param_layout.py`)
// ---------------------------------------------------------------------------------------------

#[test]
fn pad_param_start_rounds_to_64_elements() {
    assert_eq!(pad_param_start(0), 0);
    assert_eq!(pad_param_start(1), 64);
    assert_eq!(pad_param_start(64), 64);
    assert_eq!(pad_param_start(65), 128);
}

#[test]
fn pad_bucket_end_uses_lcm_of_dp_and_128() {
    // lcm(4, 128) = 128.
    assert_eq!(bucket_end_divisor(4, false), 128);
    assert_eq!(pad_bucket_end(1, 4, false), 128);
    // High bus bandwidth: lcm(4, 128, 2^16) = 65536.
    assert_eq!(bucket_end_divisor(4, true), 65536);
    assert_eq!(pad_bucket_end(1, 4, true), 65536);
    // Dense dp = 3: lcm(3, 128) = 384; expert edp = 256: lcm(256, 128) = 256.
    assert_eq!(bucket_end_divisor(3, false), 384);
    assert_eq!(bucket_end_divisor(256, false), 256);
    // lcm(3, 128, 65536) = 3 * 65536.
    assert_eq!(bucket_end_divisor(3, true), 196_608);
    assert_eq!(pad_bucket_end(384, 3, false), 384);
    assert_eq!(pad_bucket_end(385, 3, false), 768);
}

#[test]
fn default_bucket_size_is_max_of_40m_and_1m_per_rank() {
    assert_eq!(default_bucket_size(1), 40_000_000);
    assert_eq!(default_bucket_size(40), 40_000_000);
    assert_eq!(default_bucket_size(64), 64_000_000);
}

#[test]
fn default_layout_walks_params_in_reverse_without_padding() {
    // Two params; the second (2500 elements) comes first in the reversed walk: (0, 2500).
    let params = [param("p0", 1000), param("p1", 2500)];
    let layout = compute_layout(&params, &LayoutConfig::ddp(4, None)).unwrap();
    assert_eq!(ranges(&layout), vec![(2500, 3500, 0), (0, 2500, 0)]);
    assert_eq!(buckets(&layout), vec![(0, 3500, 3500)]);
    assert_eq!(layout.buckets[0].params, vec![1, 0]);
    assert_eq!(layout.numel, 3500);
    assert_eq!(layout.numel_unpadded, 3500);
    assert_eq!(layout.num_shards, 1);
}

#[test]
fn default_layout_crossing_param_stays_in_closing_bucket() {
    // 3 x 10000 with bucket 15000: p2 -> 10000 (< 15000), p1 -> 20000 (>= 15000, close),
    // p0 -> new bucket of 10000.
    let params = [param("p0", 10000), param("p1", 10000), param("p2", 10000)];
    let layout = compute_layout(&params, &LayoutConfig::ddp(2, Some(15000))).unwrap();
    let sizes: Vec<usize> = layout.buckets.iter().map(|b| b.numel()).collect();
    assert_eq!(sizes, vec![20000, 10000]);
    assert_eq!(
        ranges(&layout),
        vec![(20000, 30000, 1), (10000, 20000, 0), (0, 10000, 0)]
    );
    assert_eq!(layout.numel, layout.numel_unpadded);
}

#[test]
fn distopt_layout_pads_param_starts_and_bucket_ends() {
    // dp = 1 (lcm = 128), same 3 x 10000 with bucket 15000:
    // p2 at 0..10000; p1 at pad64(10000) = 10048 ..20048 >= 15000 -> close; padded end
    // ceil(20048/128)*128 = 20096; p0 at 20096..30096, last bucket end ceil(30096/128)*128 =
    // 30208.
    let params = [param("p0", 10000), param("p1", 10000), param("p2", 10000)];
    let layout = compute_layout(&params, &LayoutConfig::distributed(1, Some(15000))).unwrap();
    assert_eq!(
        ranges(&layout),
        vec![(20096, 30096, 1), (10048, 20048, 0), (0, 10000, 0)]
    );
    assert_eq!(
        buckets(&layout),
        vec![(0, 20096, 20048), (20096, 30208, 10000)]
    );
    assert_eq!(layout.numel, 30208);
    assert_eq!(layout.numel_unpadded, 30048);

    // dp = 4, no bucket size, awkward sizes: 333 at 0; 1 at pad64(333) = 384; 100 at
    // pad64(385) = 448; 7 at pad64(548) = 576; end 583 padded to 640 = 5 * 128.
    let params = [
        param("a", 7),
        param("b", 100),
        param("c", 1),
        param("d", 333),
    ];
    let layout = compute_layout(&params, &LayoutConfig::distributed(4, None)).unwrap();
    assert_eq!(
        ranges(&layout),
        vec![(576, 583, 0), (448, 548, 0), (384, 385, 0), (0, 333, 0)]
    );
    assert_eq!(buckets(&layout), vec![(0, 640, 583)]);
    assert_eq!(layout.num_shards, 4);
    for p in &layout.params {
        assert_eq!(p.start % 64, 0);
    }
    for b in &layout.buckets {
        assert_eq!(b.end % bucket_end_divisor(4, false), 0);
    }
}

#[test]
fn distopt_high_busbw_padding() {
    let params = [param("a", 100)];
    let cfg = LayoutConfig {
        high_busbw_padding: true,
        ..LayoutConfig::distributed(4, None)
    };
    let layout = compute_layout(&params, &cfg).unwrap();
    assert_eq!(buckets(&layout), vec![(0, 65536, 100)]);
    // The flag is ignored by the classic DDP layout.
    let cfg = LayoutConfig {
        high_busbw_padding: true,
        ..LayoutConfig::ddp(4, None)
    };
    assert_eq!(
        buckets(&compute_layout(&params, &cfg).unwrap()),
        vec![(0, 100, 100)]
    );
}

#[test]
fn shared_embedding_at_first_reversed_position_is_alone() {
    // Forward [a 100, emb 1000]: the embedding is placed first, closes its own bucket at 1000
    // (padded to 1024); a follows in bucket 1 [1024, 1152).
    let params = [param("a", 100), shared("emb", 1000)];
    let layout = layout_with(
        &params,
        LayoutConfig::distributed(4, None),
        vec![(1024, 1124, 1), (0, 1000, 0)],
        vec![(0, 1024, 1000), (1024, 1152, 100)],
    );
    assert_eq!(layout.buckets[0].params, vec![1]);
}

#[test]
fn shared_embedding_closes_pending_bucket_first() {
    // Forward [emb 1000, a 100, b 30], dp 4: b at 0..30, a at pad64(30) = 64..164; the
    // embedding's start pads to 192, which closes bucket 0 there (Megatron passes the padded
    // start: numel_unpadded 192), padded to 256; emb at 256..1256 alone, padded to 1280.
    let params = [shared("emb", 1000), param("a", 100), param("b", 30)];
    let layout = layout_with(
        &params,
        LayoutConfig::distributed(4, None),
        vec![(256, 1256, 1), (64, 164, 0), (0, 30, 0)],
        vec![(0, 256, 192), (256, 1280, 1000)],
    );
    assert_eq!(layout.buckets[0].params, vec![2, 1]);
    assert_eq!(layout.buckets[1].params, vec![0]);
    assert_eq!(layout.numel_unpadded, 1192);

    // In the middle, with a bucket size: a at 0..100; emb starts at pad64(100) = 128 and
    // closes bucket 0 at 128; emb 128..1128 padded to 1152 (lcm(2,128) = 128); x after it.
    let params = [param("x", 50), shared("emb", 1000), param("a", 100)];
    let layout = compute_layout(&params, &LayoutConfig::distributed(2, Some(10_000))).unwrap();
    assert_eq!(
        buckets(&layout),
        vec![(0, 128, 128), (128, 1152, 1000), (1152, 1280, 50)]
    );
    assert_eq!(layout.buckets[1].params, vec![1]);
}

#[test]
fn shared_embedding_is_ignored_by_classic_ddp_layout() {
    let params = [shared("emb", 1000), param("a", 100), param("b", 30)];
    layout_with(
        &params,
        LayoutConfig::ddp(4, None),
        vec![(130, 1130, 0), (30, 130, 0), (0, 30, 0)],
        vec![(0, 1130, 1130)],
    );
}

#[test]
fn dense_and_expert_buffers_have_separate_index_spaces() {
    let dense = bf16();
    let expert = BufferKey {
        expert: true,
        ..bf16()
    };
    let params = [
        ParamSpec::new("dense.w", vec![10, 10], dense),
        ParamSpec::new("experts.w", vec![4, 8, 8], expert),
        ParamSpec::new("dense.b", vec![10], dense),
    ];
    let groups = group_params(&params);
    assert_eq!(groups, vec![(dense, vec![0, 2]), (expert, vec![1])]);

    let dense_params: Vec<&ParamSpec> = groups[0].1.iter().map(|&i| &params[i]).collect();
    let expert_params: Vec<&ParamSpec> = groups[1].1.iter().map(|&i| &params[i]).collect();
    // Dense dp = 3 -> divisor 384; expert edp = 256 -> divisor 256.
    let d = compute_layout(&dense_params, &LayoutConfig::distributed(3, None)).unwrap();
    let e = compute_layout(&expert_params, &LayoutConfig::distributed(256, None)).unwrap();
    // Dense: b at 0..10, w at 64..164, end padded to 384.
    assert_eq!(ranges(&d), vec![(64, 164, 0), (0, 10, 0)]);
    assert_eq!(buckets(&d), vec![(0, 384, 164)]);
    assert_eq!(d.num_shards, 3);
    // Expert: 256 elements, already a multiple of 256.
    assert_eq!(ranges(&e), vec![(0, 256, 0)]);
    assert_eq!(buckets(&e), vec![(0, 256, 256)]);
    assert_eq!(e.num_shards, 256);
    assert_eq!(e.key, expert);
}

// ---------------------------------------------------------------------------------------------
// Grouping and validation
// ---------------------------------------------------------------------------------------------

#[test]
fn group_params_orders_groups_by_first_appearance() {
    let adam = BufferKey {
        owner: OptimizerId(1),
        ..bf16()
    };
    let muon_mx = BufferKey {
        param_storage: ParamStorage::Quantized(QuantKind::Mxfp8),
        owner: OptimizerId(0),
        ..bf16()
    };
    let muon_fp4 = BufferKey {
        param_storage: ParamStorage::Quantized(QuantKind::Nvfp4),
        ..muon_mx
    };
    let bf16_grads = BufferKey {
        grad_dtype: GradDType::Bf16,
        ..adam
    };
    let muon_bf16 = BufferKey {
        owner: OptimizerId(0),
        ..adam
    };
    let keys = [
        muon_mx, adam, muon_fp4, muon_mx, bf16_grads, adam, muon_bf16, muon_fp4,
    ];
    let params: Vec<ParamSpec> = keys
        .iter()
        .enumerate()
        .map(|(i, &k)| ParamSpec::new(format!("p{i}"), vec![2], k))
        .collect();
    let groups = group_params(&params);
    assert_eq!(
        groups,
        vec![
            (muon_mx, vec![0, 3]),
            (adam, vec![1, 5]),
            (muon_fp4, vec![2, 7]),
            (bf16_grads, vec![4]),
            (muon_bf16, vec![6]),
        ]
    );
    // Same storage and dtypes but different owners: never the same buffer.
    assert_ne!(adam, muon_bf16);
    assert!(group_params::<ParamSpec>(&[]).is_empty());
}

#[test]
fn compute_layout_validates_its_input() {
    let ok = [param("a", 10)];
    assert_eq!(
        compute_layout(&ok, &LayoutConfig::ddp(0, None)),
        Err(LayoutError::ZeroDataParallel)
    );
    assert_eq!(
        compute_layout(&ok, &LayoutConfig::distributed(2, Some(0))),
        Err(LayoutError::ZeroBucketSize)
    );
    assert_eq!(
        compute_layout::<ParamSpec>(&[], &LayoutConfig::ddp(1, None)),
        Err(LayoutError::NoParams)
    );
    let empty = [param("a", 10), ParamSpec::new("e", vec![0, 4], bf16())];
    assert!(matches!(
        compute_layout(&empty, &LayoutConfig::ddp(1, None)),
        Err(LayoutError::EmptyParam { index: 1, .. })
    ));
    let mut bad_shape = param("s", 10);
    bad_shape.shape = vec![3, 3];
    assert!(matches!(
        compute_layout(&[bad_shape], &LayoutConfig::ddp(1, None)),
        Err(LayoutError::ShapeMismatch { index: 0, .. })
    ));
    let mixed = [param("a", 10), ParamSpec::new("q", vec![10], nvfp4())];
    assert!(matches!(
        compute_layout(&mixed, &LayoutConfig::ddp(1, None)),
        Err(LayoutError::MixedKeys { index: 1, .. })
    ));
    // A scalar (empty shape) has one element.
    let scalar = ParamSpec::new("scale", vec![], bf16());
    assert_eq!(scalar.numel, 1);
    assert!(compute_layout(&[scalar], &LayoutConfig::distributed(2, None)).is_ok());
}

#[test]
fn bucket_local_ranges_include_padding() {
    // Megatron-LM PR #3007 (`param_to_index` ignored padding, so the MXFP8 copy-back read the
    // wrong slice). Forward [y 3, z 10, a 100, b 16, c 4], bucket 100, dp 1:
    // c 0..4, b 64..80, a 128..228 (close, end 256); z 256..266, y pad64(266) = 320..323,
    // end 384. Bucket-local: z (0, 10), y (64, 67), not the packed (10, 13).
    let params = [
        param("y", 3),
        param("z", 10),
        param("a", 100),
        param("b", 16),
        param("c", 4),
    ];
    let layout = compute_layout(&params, &LayoutConfig::distributed(1, Some(100))).unwrap();
    assert_eq!(buckets(&layout), vec![(0, 256, 228), (256, 384, 67)]);
    assert_eq!(layout.param_range_in_bucket(0), Some(64..67));
    assert_eq!(layout.param_range_in_bucket(1), Some(0..10));
    assert_eq!(layout.param_range_in_bucket(3), Some(64..80));
    assert_eq!(layout.param_range_in_bucket(5), None);
}

// ---------------------------------------------------------------------------------------------
// test_bucket_sizes (Megatron `distributed/test_param_and_grad_buffer.py`)
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq)]
enum Shared {
    None,
    /// An extra 95x95 input embedding flagged shared, before the layers (last in the reverse walk).
    First,
    /// An extra 95x95 output embedding flagged shared, after the layers (first in the reverse walk).
    Last,
}

const LAYERS: usize = 10;
const DIM: usize = 95;

fn model(bias: bool, shared_embedding: Shared) -> Vec<ParamSpec> {
    let mut params = Vec::new();
    if shared_embedding == Shared::First {
        params
            .push(ParamSpec::new("embedding", vec![DIM, DIM], bf16()).with_shared_embedding(true));
    }
    for l in 0..LAYERS {
        params.push(ParamSpec::new(
            format!("layers.{l}.weight"),
            vec![DIM, DIM],
            bf16(),
        ));
        if bias {
            params.push(ParamSpec::new(
                format!("layers.{l}.bias"),
                vec![DIM],
                bf16(),
            ));
        }
    }
    if shared_embedding == Shared::Last {
        params.push(ParamSpec::new("output", vec![DIM, DIM], bf16()).with_shared_embedding(true));
    }
    params
}

/// The expected buckets, re-derived from the research text: walk the sizes in reverse; under
/// the distributed optimizer round the running bucket size up to 64 before each param (bucket
/// starts are multiples of 128, so relative and absolute padding agree); a shared embedding
/// first closes a non-empty bucket at that padded size and then sits alone; a bucket closes
/// once its size reaches `bucket_size`. Returns (numel_unpadded, number of params) per bucket.
fn expected_buckets(
    sizes: &[(usize, bool)],
    bucket_size: Option<usize>,
    distopt: bool,
) -> Vec<(usize, usize)> {
    let pad = |n: usize| if distopt { n.div_ceil(64) * 64 } else { n };
    let mut out = Vec::new();
    let (mut numel, mut count) = (0usize, 0usize);
    for &(size, is_shared) in sizes.iter().rev() {
        let alone = is_shared && distopt;
        numel = pad(numel);
        if alone && count > 0 {
            out.push((numel, count));
            (numel, count) = (0, 0);
        }
        numel += size;
        count += 1;
        if alone || bucket_size.is_some_and(|b| numel >= b) {
            out.push((numel, count));
            (numel, count) = (0, 0);
        }
    }
    if count > 0 {
        out.push((numel, count));
    }
    out
}

#[test]
fn test_bucket_sizes() {
    let bucket_sizes = [
        None,
        Some(9000),
        Some(9025),
        Some(9050),
        Some(18000),
        Some(18050),
        Some(20000),
    ];
    for dp in [1, 2, 3, 4, 8] {
        for bucket_size in bucket_sizes {
            for distopt in [false, true] {
                for bias in [false, true] {
                    for shared_embedding in [Shared::None, Shared::First, Shared::Last] {
                        let params = model(bias, shared_embedding);
                        let cfg = LayoutConfig {
                            dp,
                            bucket_size,
                            distributed_optimizer: distopt,
                            high_busbw_padding: false,
                        };
                        let case = format!("{cfg:?} bias={bias} shared={shared_embedding:?}");
                        let layout = compute_layout(&params, &cfg).unwrap();
                        let sizes: Vec<(usize, bool)> = params
                            .iter()
                            .map(|p| (p.numel, p.shared_embedding))
                            .collect();
                        let expected = expected_buckets(&sizes, bucket_size, distopt);
                        let got: Vec<(usize, usize)> = layout
                            .buckets
                            .iter()
                            .map(|b| (b.numel_unpadded, b.params.len()))
                            .collect();
                        assert_eq!(got, expected, "{case}");

                        if bucket_size.is_none() {
                            let want = if distopt && shared_embedding != Shared::None {
                                2
                            } else {
                                1
                            };
                            assert_eq!(layout.buckets.len(), want, "{case}");
                        }
                        let divisor = dp / gcd(dp, 128) * 128;
                        let mut start = 0;
                        for bucket in &layout.buckets {
                            assert_eq!(bucket.start, start, "{case}");
                            let padded = if distopt {
                                bucket.numel_unpadded.div_ceil(divisor) * divisor
                            } else {
                                bucket.numel_unpadded
                            };
                            assert_eq!(bucket.numel(), padded, "{case}");
                            if distopt {
                                assert_eq!(bucket.numel() % dp, 0, "{case}");
                            }
                            start = bucket.end;
                        }
                        assert_eq!(layout.numel, start, "{case}");
                        let unpadded: usize = layout.buckets.iter().map(|b| b.numel_unpadded).sum();
                        assert_eq!(layout.numel_unpadded, unpadded, "{case}");
                        if distopt {
                            for (i, p) in params.iter().enumerate() {
                                if p.shared_embedding {
                                    let b = layout.params[i].bucket;
                                    assert_eq!(layout.buckets[b].params, vec![i], "{case}");
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// Hand-computed instances of the same matrix (9025 = 95 * 95; pad64(9025) = 9088;
/// pad64(95) = 128).
#[test]
fn bucket_sizes_hand_golden() {
    // (numel_unpadded, numel) of every bucket.
    let sizes = |params: Vec<ParamSpec>, cfg: LayoutConfig| -> Vec<(usize, usize)> {
        let layout = compute_layout(&params, &cfg).unwrap();
        let buckets = layout.buckets.iter();
        buckets.map(|b| (b.numel_unpadded, b.numel())).collect()
    };
    let ddp = |bucket_size| LayoutConfig {
        dp: 8,
        bucket_size,
        distributed_optimizer: false,
        high_busbw_padding: false,
    };
    let distopt = |bucket_size| LayoutConfig {
        distributed_optimizer: true,
        ..ddp(bucket_size)
    };
    let weights = || model(false, Shared::None);
    let biased = || model(true, Shared::None);
    // DDP, no bias: two weights reach 18050 >= 18050.
    assert_eq!(sizes(weights(), ddp(Some(18050))), vec![(18050, 18050); 5]);
    // DDP, no bias, 20000: three weights per bucket (27075), one left over.
    let want = vec![(27075, 27075), (27075, 27075), (27075, 27075), (9025, 9025)];
    assert_eq!(sizes(weights(), ddp(Some(20000))), want);
    // DistOpt, no bias, 18000: 9088 + 9025 = 18113, padded to 142 * 128 = 18176.
    assert_eq!(
        sizes(weights(), distopt(Some(18000))),
        vec![(18113, 18176); 5]
    );
    // DistOpt, no bias, 20000: 18176 + 9025 = 27201 -> 213 * 128 = 27264.
    let want = vec![(27201, 27264), (27201, 27264), (27201, 27264), (9025, 9088)];
    assert_eq!(sizes(weights(), distopt(Some(20000))), want);
    // DistOpt with bias, 9000: bias 0..95, weight 128..9153 -> 9153, padded to 9216.
    assert_eq!(sizes(biased(), distopt(Some(9000))), vec![(9153, 9216); 10]);
    // DDP with bias, 9000: 95 + 9025 = 9120.
    assert_eq!(sizes(biased(), ddp(Some(9000))), vec![(9120, 9120); 10]);
    // DistOpt, one bucket: 9 * 9088 + 9025 = 90817, padded to 710 * 128 = 90880.
    assert_eq!(sizes(weights(), distopt(None)), vec![(90817, 90880)]);
    // DistOpt, shared input embedding, one bucket: the layers end at 90817; the embedding
    // starts at pad64(90817) = 90880, which closes bucket 0 (unpadded 90880); it sits alone.
    let first = model(false, Shared::First);
    assert_eq!(
        sizes(first, distopt(None)),
        vec![(90880, 90880), (9025, 9088)]
    );
    // DistOpt, shared output embedding first in the reverse walk.
    let last = model(false, Shared::Last);
    assert_eq!(
        sizes(last, distopt(None)),
        vec![(9025, 9088), (90817, 90880)]
    );
}

// ---------------------------------------------------------------------------------------------
// Shards (`shard_buffer`, `_build_model_gbuf_param_range_map`)
// ---------------------------------------------------------------------------------------------

#[test]
fn param_shard_ranges_follow_megatron_formulas() {
    // Forward [a 100, b 30], dp 2: b 0..30, a 64..164, bucket [0, 256), S = 128.
    let params = [param("a", 100), param("b", 30)];
    let layout = compute_layout(&params, &LayoutConfig::distributed(2, None)).unwrap();
    assert_eq!(shard_range(&layout.buckets[0], 0, 2), Ok(0..128));
    assert_eq!(shard_range(&layout.buckets[0], 1, 2), Ok(128..256));

    let r0 = param_shard_ranges(&layout, 0).unwrap();
    assert_eq!(r0.len(), 2);
    assert_eq!(
        (
            r0[0].param,
            r0[0].gbuf_local.clone(),
            r0[0].param_range.clone()
        ),
        (1, 0..30, 0..30)
    );
    // a: local_start = 64, local_end = min(128, 164) = 128; param piece [0, 64).
    assert_eq!(r0[1].param, 0);
    assert_eq!(r0[1].gbuf_local, 64..128);
    assert_eq!(r0[1].gbuf_world, 64..128);
    assert_eq!(r0[1].gbuf_world_in_bucket, 64..128);
    assert_eq!(r0[1].param_range, 0..64);

    // Rank 1, W = [128, 256): a: local [0, 36), world [128, 164), param [64, 100).
    let r1 = param_shard_ranges(&layout, 1).unwrap();
    assert_eq!(r1.len(), 1);
    assert_eq!(r1[0].param, 0);
    assert_eq!(r1[0].gbuf_local, 0..36);
    assert_eq!(r1[0].gbuf_world, 128..164);
    assert_eq!(r1[0].gbuf_world_in_bucket, 128..164);
    assert_eq!(r1[0].param_range, 64..100);

    assert_eq!(
        param_shard_ranges(&layout, 2),
        Err(LayoutError::RankOutOfRange { rank: 2, dp: 2 })
    );
}

#[test]
fn param_shard_ranges_in_a_later_bucket_are_bucket_relative() {
    // Forward [x 300, y 200], dp 2, bucket 100: y 0..200 (bucket 0 [0, 256)), x 256..556
    // (bucket 1 [256, 640), S = 192). Rank 1 of bucket 1: W = [448, 640): x local [0, 108),
    // world [448, 556), in bucket [192, 300), param [192, 300).
    let params = [param("x", 300), param("y", 200)];
    let layout = compute_layout(&params, &LayoutConfig::distributed(2, Some(100))).unwrap();
    assert_eq!(buckets(&layout), vec![(0, 256, 200), (256, 640, 300)]);
    let r1 = param_shard_ranges(&layout, 1).unwrap();
    let last = r1.last().unwrap();
    assert_eq!(last.bucket, 1);
    assert_eq!(last.gbuf_local, 0..108);
    assert_eq!(last.gbuf_world, 448..556);
    assert_eq!(last.gbuf_world_in_bucket, 192..300);
    assert_eq!(last.param_range, 192..300);
}

#[test]
fn shard_count_must_match_group_size() {
    let params = [param("a", 1000)];
    let layout = compute_layout(&params, &LayoutConfig::distributed(4, None)).unwrap();
    assert_eq!(check_shard_count(&layout, 4), Ok(()));
    assert_eq!(
        check_shard_count(&layout, 2),
        Err(LayoutError::ShardCountMismatch {
            layout: 4,
            group: 2
        })
    );
    let ddp = compute_layout(&params, &LayoutConfig::ddp(4, None)).unwrap();
    assert_eq!(check_shard_count(&ddp, 1), Ok(()));
    assert!(check_shard_count(&ddp, 4).is_err());
}

#[test]
fn shard_range_rejects_bad_requests() {
    let params = [param("a", 1001)];
    let ddp = compute_layout(&params, &LayoutConfig::ddp(2, None)).unwrap();
    assert!(matches!(
        shard_range(&ddp.buckets[0], 0, 2),
        Err(LayoutError::BucketNotDivisible { numel: 1001, .. })
    ));
    assert_eq!(
        shard_range(&ddp.buckets[0], 0, 0),
        Err(LayoutError::ZeroDataParallel)
    );
    assert_eq!(
        shard_range(&ddp.buckets[0], 3, 3),
        Err(LayoutError::RankOutOfRange { rank: 3, dp: 3 })
    );
}

// ---------------------------------------------------------------------------------------------
// Packed NVFP4 (the packed map: element offsets / 2)
// ---------------------------------------------------------------------------------------------

fn fp4(name: &str, shape: Vec<usize>) -> ParamSpec {
    ParamSpec::new(name, shape, nvfp4())
}

#[test]
fn packed_layout_halves_the_element_layout() {
    // TestNVFP4IndexMaps: one param of 10000 -> elements (0, 10000), packed (0, 5000).
    let layout = compute_layout(
        &[fp4("w", vec![100, 100])],
        &LayoutConfig::distributed(2, None),
    )
    .unwrap();
    let packed = packed_layout(&layout).unwrap();
    assert_eq!((layout.params[0].start, layout.params[0].end), (0, 10000));
    assert_eq!((packed.params[0].start, packed.params[0].end), (0, 5000));
    // 10000 padded to 79 * 128 = 10112 elements -> 5056 bytes.
    assert_eq!(layout.numel, 10112);
    assert_eq!(packed.numel_bytes, 5056);

    // Two params: 30 at 0, 100 at 64 -> packed 0..15 and 32..82.
    let layout = compute_layout(
        &[fp4("a", vec![100]), fp4("b", vec![30])],
        &LayoutConfig::distributed(4, None),
    )
    .unwrap();
    let packed = packed_layout(&layout).unwrap();
    assert_eq!((packed.params[1].start, packed.params[1].end), (0, 15));
    assert_eq!((packed.params[0].start, packed.params[0].end), (32, 82));
}

#[test]
fn packed_shards_are_half_of_grad_shards_where_independent_padding_would_not_be() {
    // dp = 2, one NVFP4 param of 384 elements: grad bucket 384, shard 192. Padding packed ends
    // independently would give 256 bytes and a 128-byte (256-element) shard; derived by
    // construction, each rank ships exactly the 96 bytes of its 192 elements.
    let layout =
        compute_layout(&[fp4("w", vec![384])], &LayoutConfig::distributed(2, None)).unwrap();
    assert_eq!(buckets(&layout), vec![(0, 384, 384)]);
    let packed = packed_layout(&layout).unwrap();
    assert_eq!(packed.numel_bytes, 192);
    assert_eq!(shard_range(&layout.buckets[0], 0, 2), Ok(0..192));
    assert_eq!(shard_range(&layout.buckets[0], 1, 2), Ok(192..384));
    assert_eq!(packed.shard_range(0, 0), Ok(0..96));
    assert_eq!(packed.shard_range(0, 1), Ok(96..192));
    assert_eq!(packed_shard_range(&layout.buckets[0], 1, 2), Ok(96..192));
    assert!(matches!(
        packed.shard_range(1, 0),
        Err(LayoutError::NoSuchBucket { bucket: 1, .. })
    ));
    assert!(packed.shard_range(0, 2).is_err());
}

#[test]
fn packed_layout_rejects_what_cannot_be_halved() {
    // Not NVFP4.
    let layout = compute_layout(&[param("a", 10)], &LayoutConfig::distributed(2, None)).unwrap();
    assert!(matches!(
        packed_layout(&layout),
        Err(LayoutError::NotNvfp4 { .. })
    ));
    let mx = ParamSpec::new(
        "m",
        vec![64],
        key_of(ParamStorage::Quantized(QuantKind::Mxfp8)),
    );
    let layout = compute_layout(&[mx], &LayoutConfig::distributed(2, None)).unwrap();
    assert!(matches!(
        packed_layout(&layout),
        Err(LayoutError::NotNvfp4 { .. })
    ));
    // Odd numel (Megatron asserts).
    let layout = compute_layout(
        &[fp4("odd", vec![3, 5])],
        &LayoutConfig::distributed(2, None),
    )
    .unwrap();
    assert_eq!(
        packed_layout(&layout),
        Err(LayoutError::OddNvfp4Numel {
            param: 0,
            numel: 15
        })
    );
    // dp = 256: a 256-element bucket gives 1-element shards, which cannot be packed.
    let layout = compute_layout(
        &[fp4("w", vec![256])],
        &LayoutConfig::distributed(256, None),
    )
    .unwrap();
    assert_eq!(
        packed_layout(&layout),
        Err(LayoutError::OddPackedShard {
            bucket_start: 0,
            shard_numel: 1
        })
    );
    assert!(matches!(
        packed_shard_range(&layout.buckets[0], 0, 256),
        Err(LayoutError::OddPackedShard { .. })
    ));
    // dp = 256 with a 512-element bucket: 2-element shards are fine.
    let layout = compute_layout(
        &[fp4("w", vec![300])],
        &LayoutConfig::distributed(256, None),
    )
    .unwrap();
    assert_eq!(packed_layout(&layout).unwrap().buckets[0].shard_bytes, 1);
}

// ---------------------------------------------------------------------------------------------
// Grouped expert tensors
// ---------------------------------------------------------------------------------------------

#[test]
fn expert_slices_split_a_grouped_tensor() {
    let grouped = ParamSpec::new(
        "experts.w",
        vec![4, 8, 16],
        BufferKey {
            expert: true,
            ..bf16()
        },
    );
    assert_eq!(grouped.numel, 512);
    let layout = compute_layout(
        &[param_with_key("x", 10, grouped.key), grouped],
        &LayoutConfig::distributed(2, None),
    )
    .unwrap();
    // grouped at pad64(0) = 0 (reverse walk places it first), x at 512.
    let range = layout.params[1].range();
    assert_eq!(range, 0..512);
    assert_eq!(
        expert_slices(range, 4),
        Ok(vec![0..128, 128..256, 256..384, 384..512])
    );
    assert_eq!(
        expert_slices(1000..1600, 3),
        Ok(vec![1000..1200, 1200..1400, 1400..1600])
    );
    assert_eq!(
        expert_slices(0..10, 3),
        Err(LayoutError::ExpertSplit {
            numel: 10,
            experts: 3
        })
    );
    assert!(expert_slices(0..10, 0).is_err());
}

fn param_with_key(name: &str, numel: usize, key: BufferKey) -> ParamSpec {
    ParamSpec::new(name, vec![numel], key)
}

// ---------------------------------------------------------------------------------------------
// Properties over random layouts
// ---------------------------------------------------------------------------------------------

fn arb_params(max_numel: usize) -> impl Strategy<Value = Vec<(usize, bool)>> {
    prop::collection::vec((1..=max_numel, prop::bool::weighted(0.1)), 1..24)
}

fn build(sizes: &[(usize, bool)], key: BufferKey) -> Vec<ParamSpec> {
    sizes
        .iter()
        .enumerate()
        .map(|(i, &(n, s))| ParamSpec::new(format!("p{i}"), vec![n], key).with_shared_embedding(s))
        .collect()
}

/// Structural invariants every layout must satisfy.
fn check_structure(layout: &lowbit_layout::BufferLayout, cfg: &LayoutConfig) {
    let mut start = 0;
    for (b, bucket) in layout.buckets.iter().enumerate() {
        assert_eq!(bucket.start, start);
        assert!(bucket.end > bucket.start);
        assert!(bucket.numel_unpadded <= bucket.numel());
        let mut prev_end = bucket.start;
        for &p in &bucket.params {
            let r = layout.params[p];
            assert_eq!(r.bucket, b);
            assert!(r.start >= prev_end && r.end <= bucket.end);
            assert!(r.end <= bucket.start + bucket.numel_unpadded);
            if cfg.distributed_optimizer {
                assert_eq!(r.start % 64, 0);
            } else {
                assert_eq!(r.start, prev_end);
            }
            prev_end = r.end;
        }
        if cfg.distributed_optimizer {
            assert_eq!(
                bucket.end % bucket_end_divisor(cfg.dp, cfg.high_busbw_padding),
                0
            );
        } else {
            assert_eq!(bucket.numel(), bucket.numel_unpadded);
        }
        start = bucket.end;
    }
    assert_eq!(layout.numel, start);
    let listed: usize = layout.buckets.iter().map(|b| b.params.len()).sum();
    assert_eq!(listed, layout.params.len());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn every_element_is_owned_by_exactly_one_rank(
        sizes in arb_params(3000),
        bucket_size in prop::option::of(1usize..20_000),
        dp in prop::sample::select(vec![1usize, 2, 3, 4, 8]),
        distopt in any::<bool>(),
        high_busbw in any::<bool>(),
    ) {
        let params = build(&sizes, bf16());
        let cfg = LayoutConfig {
            dp,
            bucket_size,
            distributed_optimizer: distopt,
            high_busbw_padding: high_busbw,
        };
        let layout = compute_layout(&params, &cfg).unwrap();
        check_structure(&layout, &cfg);
        let shards = if distopt { dp } else { 1 };
        prop_assert_eq!(layout.num_shards, shards);
        prop_assert!(check_shard_count(&layout, shards).is_ok());

        // pieces[p] = (param sub-range start, end, rank).
        let mut pieces: Vec<Vec<(usize, usize, usize)>> = vec![Vec::new(); params.len()];
        let mut owned_total = 0;
        for rank in 0..shards {
            for piece in param_shard_ranges(&layout, rank).unwrap() {
                let bucket = &layout.buckets[piece.bucket];
                let world = shard_range(bucket, rank, shards).unwrap();
                let p = layout.params[piece.param];
                prop_assert_eq!(p.bucket, piece.bucket);
                prop_assert!(world.start <= piece.gbuf_world.start && piece.gbuf_world.end <= world.end);
                prop_assert_eq!(piece.gbuf_world.start, p.start + piece.param_range.start);
                prop_assert_eq!(piece.gbuf_world.end, p.start + piece.param_range.end);
                prop_assert_eq!(piece.gbuf_local.start, piece.gbuf_world.start - world.start);
                prop_assert_eq!(piece.gbuf_local.len(), piece.gbuf_world.len());
                prop_assert_eq!(piece.gbuf_world_in_bucket.start, piece.gbuf_world.start - bucket.start);
                prop_assert_eq!(piece.gbuf_world_in_bucket.len(), piece.gbuf_world.len());
                prop_assert!(!piece.param_range.is_empty());
                owned_total += piece.param_range.len();
                pieces[piece.param].push((piece.param_range.start, piece.param_range.end, rank));
            }
        }
        let total: usize = params.iter().map(|p| p.numel).sum();
        prop_assert_eq!(owned_total, total);
        for (p, mut list) in pieces.into_iter().enumerate() {
            list.sort();
            let mut next = 0;
            for (start, end, _) in list {
                prop_assert_eq!(start, next, "param {} has a gap or an overlap", p);
                next = end;
            }
            prop_assert_eq!(next, params[p].numel);
        }
    }

    #[test]
    fn packed_nvfp4_shard_is_exactly_the_bytes_of_the_grad_shard(
        halves in prop::collection::vec(1usize..1500, 1..16),
        bucket_size in prop::option::of(1usize..10_000),
        dp in prop::sample::select(vec![1usize, 2, 3, 4, 6, 8, 16, 128, 256]),
        distopt in any::<bool>(),
    ) {
        let params: Vec<ParamSpec> = halves
            .iter()
            .enumerate()
            .map(|(i, &h)| ParamSpec::new(format!("w{i}"), vec![2 * h], nvfp4()))
            .collect();
        let cfg = LayoutConfig { dp, bucket_size, distributed_optimizer: distopt, high_busbw_padding: false };
        let layout = compute_layout(&params, &cfg).unwrap();
        let shards = layout.num_shards;
        let odd_shard = layout.buckets.iter().any(|b| (b.numel() / shards) % 2 == 1);
        let packed = match packed_layout(&layout) {
            Ok(packed) => {
                prop_assert!(!odd_shard);
                packed
            }
            Err(e) => {
                prop_assert!(odd_shard, "unexpected error {:?}", e);
                prop_assert!(
                    matches!(e, LayoutError::OddPackedShard { .. }),
                    "wrong error {:?}",
                    e
                );
                return Ok(());
            }
        };
        prop_assert_eq!(packed.numel_bytes * 2, layout.numel);

        // byte_owner[i]: the rank whose packed shard holds byte i.
        let mut byte_owner = vec![usize::MAX; packed.numel_bytes];
        for (b, bucket) in layout.buckets.iter().enumerate() {
            for rank in 0..shards {
                let grad = shard_range(bucket, rank, shards).unwrap();
                let bytes = packed.shard_range(b, rank).unwrap();
                prop_assert_eq!(packed_shard_range(bucket, rank, shards).unwrap(), bytes.clone());
                // The packed shard holds exactly the bytes of the grad shard's elements.
                prop_assert_eq!(bytes.start * 2, grad.start);
                prop_assert_eq!(bytes.end * 2, grad.end);
                for byte in bytes {
                    prop_assert_eq!(byte_owner[byte], usize::MAX);
                    byte_owner[byte] = rank;
                }
            }
        }
        prop_assert!(byte_owner.iter().all(|&r| r != usize::MAX));

        // Every element a rank owns (per the grad/master map) lands, through the packed param
        // map, in a byte of that rank's packed shard; the byte's other nibble is also its own.
        for rank in 0..shards {
            for piece in param_shard_ranges(&layout, rank).unwrap() {
                let pp = packed.params[piece.param];
                prop_assert_eq!(pp.bucket, piece.bucket);
                prop_assert_eq!(pp.end - pp.start, params[piece.param].numel / 2);
                for element in piece.param_range.clone() {
                    let byte = pp.start + element / 2;
                    prop_assert_eq!(byte_owner[byte], rank);
                    let sibling = element ^ 1;
                    prop_assert!(piece.param_range.contains(&sibling));
                }
            }
        }
    }

    #[test]
    fn layouts_are_deterministic_and_group_by_key(
        sizes in arb_params(500),
        owners in prop::collection::vec(0u32..3, 24),
        dp in 1usize..10,
    ) {
        let params: Vec<ParamSpec> = sizes
            .iter()
            .enumerate()
            .map(|(i, &(n, s))| {
                let key = BufferKey { owner: OptimizerId(owners[i]), ..bf16() };
                ParamSpec::new(format!("p{i}"), vec![n], key).with_shared_embedding(s)
            })
            .collect();
        let groups = group_params(&params);
        prop_assert_eq!(&groups, &group_params(&params));
        let mut seen = vec![false; params.len()];
        for (key, members) in &groups {
            prop_assert!(members.windows(2).all(|w| w[0] < w[1]));
            let specs: Vec<&ParamSpec> = members.iter().map(|&i| &params[i]).collect();
            for &i in members {
                prop_assert_eq!(params[i].key, *key);
                prop_assert!(!seen[i]);
                seen[i] = true;
            }
            let cfg = LayoutConfig::distributed(dp, Some(700));
            let a = compute_layout(&specs, &cfg).unwrap();
            prop_assert_eq!(&a, &compute_layout(&specs, &cfg).unwrap());
            prop_assert_eq!(a.key, *key);
            check_structure(&a, &cfg);
        }
        prop_assert!(seen.into_iter().all(|s| s));
        // Groups appear in order of first appearance.
        let firsts: Vec<usize> = groups.iter().map(|(_, m)| m[0]).collect();
        prop_assert!(firsts.windows(2).all(|w| w[0] < w[1]));
    }
}
