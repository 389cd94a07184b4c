//! The row-aligned layout of low-precision parameters sharded by `optim_grads_params`: every
//! matrix is a bucket of its own, split into `dp` equal chunks of whole row blocks (32 rows for
//! MXFP8, 16 for NVFP4), padded with zero rows at the end. A rank's shard of the bucket is then
//! a run of whole rows of one matrix, so it quantizes its rows alone (every MXFP8 32x1 block,
//! every NVFP4 16x16 tile lies in one rank's rows) and the gathered bytes are the whole
//! matrix's quantization in row order, then padding: the BlockAtomic placement of
//! Megatron-FSDP's v2 design, with FSDP2's per-parameter dim-0 chunks.

use std::borrow::Borrow;

use crate::{BucketRange, BufferLayout, LayoutError, ParamRange, ParamSpec, matrix_dims};

/// Rows per chunk of a matrix of `rows` rows over `dp` ranks, in whole blocks of `block` rows.
pub fn chunk_rows(rows: usize, dp: usize, block: usize) -> usize {
    // Saturating: where dp·block passes usize it exceeds `rows`, and ceil(rows / it) is 1 (0
    // for no rows) either way.
    rows.div_ceil(dp.saturating_mul(block)) * block
}

/// The row-aligned layout of `params` (forward order; buckets in reverse, as every layout) over
/// `dp` ranks in blocks of `block` rows.
///
/// # Errors
/// [`LayoutError::ShapeMismatch`], [`LayoutError::EmptyParam`], [`LayoutError::Overflow`].
pub fn compute_row_aligned_layout<P: Borrow<ParamSpec>>(
    params: &[P],
    dp: usize,
    block: usize,
) -> Result<BufferLayout, LayoutError> {
    let first = params.first().ok_or(LayoutError::NoParams)?.borrow();
    let mut ranges = vec![
        ParamRange {
            param: 0,
            start: 0,
            end: 0,
            bucket: 0,
        };
        params.len()
    ];
    let mut buckets = Vec::with_capacity(params.len());
    let mut at = 0usize;
    for (i, p) in params.iter().enumerate().rev() {
        let p = p.borrow();
        if p.shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d)) != Some(p.numel) {
            return Err(LayoutError::ShapeMismatch {
                index: i,
                name: p.name.clone(),
                numel: p.numel,
                shape: p.shape.clone(),
            });
        }
        if p.numel == 0 {
            return Err(LayoutError::EmptyParam {
                index: i,
                name: p.name.clone(),
            });
        }
        let (rows, cols) = matrix_dims(&p.shape);
        let numel = chunk_rows(rows, dp, block)
            .checked_mul(dp)
            .and_then(|r| r.checked_mul(cols))
            .ok_or(LayoutError::Overflow)?;
        let end = at.checked_add(numel).ok_or(LayoutError::Overflow)?;
        ranges[i] = ParamRange {
            param: i,
            start: at,
            end: at + p.numel,
            bucket: buckets.len(),
        };
        buckets.push(BucketRange {
            start: at,
            end,
            numel_unpadded: p.numel,
            params: vec![i],
        });
        at = end;
    }
    Ok(BufferLayout {
        key: first.key,
        numel_unpadded: params.iter().map(|p| p.borrow().numel).sum(),
        params: ranges,
        buckets,
        numel: at,
        num_shards: dp,
    })
}
