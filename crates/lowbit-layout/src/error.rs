//! Everything that can make a layout or plan request invalid.

use crate::{BufferKey, ParamStorage};

/// Everything that can make a layout request invalid.
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// The data-parallel size (or shard count) is zero.
    #[error("data-parallel size must be at least 1")]
    ZeroDataParallel,
    /// `bucket_size` is `Some(0)`.
    #[error("bucket size must be at least 1 element (use None for a single bucket)")]
    ZeroBucketSize,
    /// The parameter list is empty.
    #[error("a buffer layout needs at least one parameter")]
    NoParams,
    /// A parameter has zero elements.
    #[error("parameter {index} (`{name}`) has no elements")]
    EmptyParam {
        /// Index in the parameter list.
        index: usize,
        /// Parameter name.
        name: String,
    },
    /// A parameter's `numel` is not the product of its shape.
    #[error("parameter {index} (`{name}`): numel {numel} does not match shape {shape:?}")]
    ShapeMismatch {
        /// Index in the parameter list.
        index: usize,
        /// Parameter name.
        name: String,
        /// The declared numel.
        numel: usize,
        /// The declared shape.
        shape: Vec<usize>,
    },
    /// Parameters with different buffer keys were passed to one layout.
    #[error("parameter {index} (`{name}`) has key {found:?}, but the buffer's key is {expected:?}")]
    MixedKeys {
        /// Index in the parameter list.
        index: usize,
        /// Parameter name.
        name: String,
        /// Key of the first parameter.
        expected: BufferKey,
        /// Key of this parameter.
        found: BufferKey,
    },
    /// An offset computation overflowed `usize`.
    #[error("buffer offsets overflow usize")]
    Overflow,
    /// Buffers of more than [`crate::plan::MAX_PLAN_NUMEL`] elements together: their bytes
    /// would pass what this machine can address.
    #[error("buffers of {numel} elements or more are larger than this machine can address")]
    TooLarge {
        /// The elements planned when the limit was passed (padding included).
        numel: usize,
    },
    /// A rank outside `0..dp`.
    #[error("rank {rank} is out of range for {dp} shards")]
    RankOutOfRange {
        /// The rank asked for.
        rank: usize,
        /// The shard count.
        dp: usize,
    },
    /// A bucket's size is not divisible by the shard count.
    #[error("bucket [{start}, {end}) of {numel} elements cannot be split into {dp} equal shards")]
    BucketNotDivisible {
        /// Bucket start.
        start: usize,
        /// Bucket end.
        end: usize,
        /// Bucket numel.
        numel: usize,
        /// The shard count.
        dp: usize,
    },
    /// The layout's shard count differs from the collective group size (Megatron-LM PR #6048: some
    /// shards would be owned by no rank, or ranks would read past their shard).
    #[error("layout has {layout} shards per bucket but the collective group has {group} ranks")]
    ShardCountMismatch {
        /// `BufferLayout::num_shards`.
        layout: usize,
        /// The collective group size.
        group: usize,
    },
    /// A bucket shard that does not split evenly across replica groups (HFSDP).
    #[error("a bucket shard of {len} elements does not split into {replicas} equal parts")]
    UnevenReplicaSplit {
        /// The shard's elements.
        len: usize,
        /// The replica groups.
        replicas: usize,
    },
    /// [`crate::packed_layout`] was asked for a buffer that does not hold NVFP4 parameters.
    #[error("packed layouts exist only for NVFP4 buffers, not {storage:?}")]
    NotNvfp4 {
        /// The buffer's parameter storage.
        storage: ParamStorage,
    },
    /// An NVFP4 parameter with an odd element count cannot be packed two per byte.
    #[error("NVFP4 parameter {param} has an odd element count {numel}")]
    OddNvfp4Numel {
        /// Parameter index.
        param: usize,
        /// Its numel.
        numel: usize,
    },
    /// A bucket's per-rank shard has an odd number of elements, so its packed shard would not be
    /// a whole number of bytes (e.g. dp a multiple of 128 with an odd number of
    /// `lcm(dp, 128)` blocks in the bucket).
    #[error(
        "bucket starting at element {bucket_start}: shard of {shard_numel} elements is odd, so it \
         cannot be packed"
    )]
    OddPackedShard {
        /// The bucket's first element.
        bucket_start: usize,
        /// Elements per shard.
        shard_numel: usize,
    },
    /// A bucket index that does not exist.
    #[error("bucket {bucket} does not exist (the layout has {buckets})")]
    NoSuchBucket {
        /// The bucket index asked for.
        bucket: usize,
        /// Number of buckets.
        buckets: usize,
    },
    /// A parameter or bucket boundary at an odd element offset (only for hand-built layouts).
    #[error("element offset {offset} is odd, so it has no packed byte offset")]
    OddPackedBoundary {
        /// The offending element offset.
        offset: usize,
    },
    /// A grouped expert range cannot be split into equal expert slices.
    #[error("a range of {numel} elements cannot be split into {experts} equal expert slices")]
    ExpertSplit {
        /// Elements in the range.
        numel: usize,
        /// Number of experts asked for.
        experts: usize,
    },
    /// Replicated and sharded owners in one plan.
    #[error(
        "one plan mixes replicated (classic DDP) and sharded owners; use one kind for every \
         optimizer"
    )]
    MixedStrategies,
    /// Low-precision primary weights need a sharded strategy: their values travel through the
    /// parameter gather.
    #[error(
        "parameter `{name}` has low-precision primary weights, which need a sharded strategy \
         (distributed or layer-wise): they are rebuilt from the gathered masters"
    )]
    QuantizedNeedsGather {
        /// Parameter name.
        name: String,
    },
    /// An NVFP4 parameter whose matrix is not tiled by 16x16 tiles.
    #[error(
        "NVFP4 parameter `{name}` is {rows}x{cols}: its 16x16 tiles need both dimensions to be \
         multiples of 16"
    )]
    Nvfp4Tiles {
        /// Parameter name.
        name: String,
        /// Rows (leading dimensions folded).
        rows: usize,
        /// Columns.
        cols: usize,
    },
    /// A parameter index that does not exist.
    #[error("parameter {param} does not exist (the layout has {params})")]
    NoSuchParam {
        /// The parameter index asked for.
        param: usize,
        /// Number of parameters.
        params: usize,
    },
    /// A parameter that does not lie inside one shard of its bucket, so no single rank owns it
    /// whole (a distributed-optimizer layout, or a hand-built one).
    #[error("parameter {param} at [{start}, {end}) does not lie inside one shard of its bucket")]
    ParamNotInOneShard {
        /// Parameter index.
        param: usize,
        /// Its first element.
        start: usize,
        /// One past its last element.
        end: usize,
    },
}
