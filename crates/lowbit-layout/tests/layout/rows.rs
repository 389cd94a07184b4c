//! The row-aligned layout of low-precision parameters under `optim_grads_params`: every matrix
//! is one bucket of `dp` equal chunks of whole row blocks, so every rank's shard is whole rows of
//! one matrix, and the owned pieces of all ranks cover every element exactly once.

use lowbit_layout::{
    BufferKey, GradDType, OptimizerId, ParamSpec, ParamStorage, PlanConfig, QuantKind,
    ShardingPlan, ShardingStrategy, chunk_rows, matrix_dims,
};

#[test]
fn shards_are_whole_row_blocks_and_cover_every_element_once() {
    // NVFP4 needs 16-row multiples; MXFP8 any rows.
    let shapes: [&[usize]; 5] = [&[80, 64], &[208, 96], &[32, 32], &[16, 64], &[2, 64, 32]];
    for (q, block) in [(QuantKind::Mxfp8, 32), (QuantKind::Nvfp4, 16)] {
        let specs: Vec<ParamSpec> = shapes
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let key =
                    BufferKey::new(ParamStorage::Quantized(q), GradDType::F32, OptimizerId(0));
                ParamSpec::new(format!("w{i}"), s.to_vec(), key)
            })
            .collect();
        for dp in 1..=5 {
            let cfg = PlanConfig::new(dp, ShardingStrategy::OptimGradsParams);
            let plan = ShardingPlan::new(&specs, &cfg).unwrap();
            let bp = &plan.buffers()[0];
            assert_eq!(bp.layout.buckets.len(), specs.len(), "a bucket per matrix");
            let mut seen: Vec<Vec<u32>> = specs.iter().map(|s| vec![0; s.numel]).collect();
            for rank in 0..dp {
                for piece in plan.owned(rank).unwrap() {
                    let (rows, cols) = matrix_dims(&specs[piece.param].shape);
                    let chunk = chunk_rows(rows, dp, block);
                    assert_eq!(chunk % block, 0);
                    // Whole rows, starting at this rank's chunk.
                    assert_eq!(
                        piece.param_range.start,
                        rank * chunk * cols,
                        "{q:?} dp {dp}"
                    );
                    assert_eq!(piece.param_range.len() % cols, 0);
                    assert!(piece.param_range.len() <= chunk * cols);
                    for e in piece.param_range {
                        seen[piece.param][e] += 1;
                    }
                }
            }
            assert!(
                seen.iter().flatten().all(|&c| c == 1),
                "{q:?} dp {dp}: coverage"
            );
        }
    }
}

/// Shapes whose sizes pass usize and data-parallel sizes near usize::MAX are errors that name
/// the problem, under every strategy and storage, never a panic (`ParamSpec::new`'s product,
/// `matrix_dims`' leading product and `chunk_rows`' `dp · block` overflowed).
#[test]
fn absurd_sizes_are_errors_not_panics() {
    use lowbit_layout::LayoutError;
    let h = usize::MAX;
    assert_eq!(matrix_dims(&[h, 2, 16]), (h, 16));
    assert_eq!(chunk_rows(64, h, 32), 32);
    let storages = [
        ParamStorage::Bf16,
        ParamStorage::Quantized(QuantKind::Mxfp8),
        ParamStorage::Quantized(QuantKind::Nvfp4),
    ];
    let cases: [(&[usize], usize); 5] = [
        (&[h, 2], 2),
        (&[h, 2, 16], 2),
        (&[1 << 40, 1 << 40, 16], 2),
        (&[64, 64], h),
        (&[64, 64], h / 2),
    ];
    for (shape, dp) in cases {
        for storage in storages {
            for strategy in [
                ShardingStrategy::Distributed,
                ShardingStrategy::OptimGradsParams,
            ] {
                let key = BufferKey::new(storage, GradDType::F32, OptimizerId(0));
                let spec = ParamSpec::new("w", shape.to_vec(), key);
                let cfg = PlanConfig::new(dp, strategy);
                let err = ShardingPlan::new(&[spec], &cfg).unwrap_err();
                let overflowed = shape
                    .iter()
                    .try_fold(1usize, |n, &d| n.checked_mul(d))
                    .is_none();
                if overflowed {
                    assert!(
                        matches!(err, LayoutError::ShapeMismatch { .. }),
                        "{shape:?} {storage:?} {strategy:?}: {err}"
                    );
                } else {
                    assert!(
                        matches!(err, LayoutError::Overflow),
                        "{shape:?} dp {dp} {storage:?} {strategy:?}: {err}"
                    );
                }
            }
        }
    }
}

/// Buffers that each fit but together pass `MAX_PLAN_NUMEL` are `TooLarge`: every sum of their
/// byte counts (a rank's memory) must fit `usize` too.
#[test]
fn buffers_too_large_together_are_refused() {
    use lowbit_layout::{LayoutError, MAX_PLAN_NUMEL};
    let each = MAX_PLAN_NUMEL / 4 + 1;
    let specs: Vec<ParamSpec> = (0..4)
        .map(|owner| {
            let key = BufferKey::new(ParamStorage::Bf16, GradDType::F32, OptimizerId(owner));
            ParamSpec::new(format!("w{owner}"), vec![each], key)
        })
        .collect();
    let cfg = PlanConfig::new(1, ShardingStrategy::Distributed);
    assert!(ShardingPlan::new(&specs[..3], &cfg).is_ok());
    let err = ShardingPlan::new(&specs, &cfg).unwrap_err();
    assert!(matches!(err, LayoutError::TooLarge { .. }), "{err}");
}
