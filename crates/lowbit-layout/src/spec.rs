//! Parameter specs and buffer keys: what the layout rules are computed from.

use std::borrow::Borrow;
use std::collections::HashMap;

/// Identifies the optimizer instance that owns a parameter (and therefore its buffer).
///
/// A small `Copy` id; the optimizer layer decides the numbering.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct OptimizerId(pub u32);

/// A block-scaled low-precision storage format for primary weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum QuantKind {
    /// MXFP8: E4M3/E5M2 elements with an E8M0 scale per 32 elements. The parameter buffer holds
    /// one byte per element.
    Mxfp8,
    /// NVFP4: E2M1 elements, two per byte. The parameter buffer holds packed bytes (see
    /// [`crate::packed_layout`]); the gradient buffer keeps one element per parameter element.
    Nvfp4,
}

/// How a parameter's primary weights are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ParamStorage {
    /// bfloat16.
    Bf16,
    /// IEEE half precision.
    F16,
    /// IEEE single precision.
    F32,
    /// A quantized format (raw bytes plus scales).
    Quantized(QuantKind),
}

impl ParamStorage {
    /// Whether the storage is a quantized format.
    pub fn is_quantized(self) -> bool {
        matches!(self, Self::Quantized(_))
    }
}

/// The dtype gradients are accumulated and reduced in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum GradDType {
    /// fp32 gradients (`grad_reduce_in_fp32`).
    F32,
    /// bfloat16 gradients.
    Bf16,
}

/// What decides which buffer a parameter goes to: parameters share a buffer if and only if their
/// keys are equal.
///
/// Field order is the order of the derived `Ord`, which makes sorted key collections
/// deterministic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BufferKey {
    /// Storage of the primary weights.
    pub param_storage: ParamStorage,
    /// Dtype of the gradient buffer.
    pub grad_dtype: GradDType,
    /// Expert-parallel parameter: reduced over the expert data-parallel group, so it lives in its
    /// own buffer.
    pub expert: bool,
    /// The optimizer instance that owns the parameter.
    pub owner: OptimizerId,
}

impl BufferKey {
    /// A dense (not expert-parallel) parameter's key.
    pub fn new(param_storage: ParamStorage, grad_dtype: GradDType, owner: OptimizerId) -> Self {
        BufferKey {
            param_storage,
            grad_dtype,
            expert: false,
            owner,
        }
    }
}

/// One parameter, as the layout functions see it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ParamSpec {
    /// Fully qualified name (for error messages and checkpoints).
    pub name: String,
    /// Number of elements; must equal the product of `shape` and be at least 1.
    pub numel: usize,
    /// Logical shape. A grouped expert weight is one parameter of shape `[experts, out, in]`.
    pub shape: Vec<usize>,
    /// Which buffer the parameter belongs to.
    pub key: BufferKey,
    /// A tied embedding shared across pipeline stages. Under the distributed optimizer it gets a
    /// bucket of its own; the classic DDP layout ignores the flag.
    pub shared_embedding: bool,
}

impl ParamSpec {
    /// A parameter of the given shape (`numel` is the product of `shape`, or `usize::MAX` where
    /// the product overflows, which every layout rejects as a shape mismatch), not a shared
    /// embedding.
    pub fn new(name: impl Into<String>, shape: Vec<usize>, key: BufferKey) -> Self {
        Self {
            name: name.into(),
            numel: shape
                .iter()
                .try_fold(1usize, |n, &d| n.checked_mul(d))
                .unwrap_or(usize::MAX),
            shape,
            key,
            shared_embedding: false,
        }
    }

    /// Sets the shared-embedding flag.
    pub fn with_shared_embedding(mut self, shared_embedding: bool) -> Self {
        self.shared_embedding = shared_embedding;
        self
    }

    /// The optimizer that owns this parameter.
    pub fn owner(&self) -> OptimizerId {
        self.key.owner
    }
}

/// Groups parameters (given in forward order) by [`BufferKey`].
///
/// Returns one entry per distinct key, with the indices (into `params`) of its parameters in
/// forward order. Groups are ordered by the first appearance of their key in `params`, so the
/// result depends only on the parameter list. Pass each group, in that order, to
/// [`crate::compute_layout`].
pub fn group_params<P: Borrow<ParamSpec>>(params: &[P]) -> Vec<(BufferKey, Vec<usize>)> {
    let mut groups: Vec<(BufferKey, Vec<usize>)> = Vec::new();
    let mut slot: HashMap<BufferKey, usize> = HashMap::new();
    for (index, param) in params.iter().enumerate() {
        let key = param.borrow().key;
        let group = *slot.entry(key).or_insert_with(|| {
            groups.push((key, Vec::new()));
            groups.len() - 1
        });
        groups[group].1.push(index);
    }
    groups
}
