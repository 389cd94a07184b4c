//! Builders for runs of the tiny [`crate::model::Mlp`] (the `lowbit-optim` and FSDP tests):
//! parameter specs over its widths, the matrix compute policy, deterministic initial values,
//! the AdamW those tests train with, and full masters from every rank's shards. Each test crate
//! keeps only what is its own (its widths, its step loop); what two of them need is here once.

use lowbit_buffers::layout::{BufferKey, GradDType, OptimizerId, ParamSpec, ParamStorage};
use lowbit_buffers::{ComputeFormat, PrecisionPolicy};
use lowbit_optim::{AdamW, MasterShard};

use crate::model::Mlp;
use crate::{seed, values};

/// The tiny model's parameters for layer widths `dims`, in forward order: each matrix
/// (`w{l}`) in `matrix_storage`, each bias in bf16; gradients in `grad`; the owner of a
/// parameter is `owner(is_matrix)`.
pub fn tiny_specs(
    dims: &[usize],
    matrix_storage: ParamStorage,
    grad: GradDType,
    owner: impl Fn(bool) -> OptimizerId,
) -> Vec<ParamSpec> {
    Mlp::params(dims)
        .into_iter()
        .map(|(name, shape)| {
            let matrix = shape.len() == 2;
            let storage = if matrix {
                matrix_storage
            } else {
                ParamStorage::Bf16
            };
            ParamSpec::new(name, shape, BufferKey::new(storage, grad, owner(matrix)))
        })
        .collect()
}

/// Matrices (2-D parameters) computed with `format`, everything else as stored; `None`
/// computes every parameter as stored.
pub fn matrix_policy(specs: &[ParamSpec], format: Option<ComputeFormat>) -> PrecisionPolicy {
    match format {
        Some(f) => {
            PrecisionPolicy::matrices(f, specs.iter().map(|s| (s.shape.len() == 2).then_some(1)))
        }
        None => PrecisionPolicy::as_stored(specs.len()),
    }
}

/// Every parameter's initial values: [`values`] of `seed(&[p, salt])`, scale 0.25.
pub fn init_values(specs: &[ParamSpec], salt: u64) -> Vec<Vec<f32>> {
    specs
        .iter()
        .enumerate()
        .map(|(p, s)| values(seed(&[p as u64, salt]), s.numel, 0.25))
        .collect()
}

/// The AdamW of the tiny-model tests (weight decay 0.1; the regression harness's
/// [`super::adamw`] decays by 0.01).
pub fn tiny_adamw() -> AdamW {
    AdamW {
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    }
}

/// Full parameters of `sizes[p]` elements from master shards of every rank, each element
/// exactly once (see [`crate::assemble`]).
pub fn assemble_shards<'a>(
    sizes: &[usize],
    shards: impl IntoIterator<Item = &'a MasterShard>,
) -> Vec<Vec<f32>> {
    crate::assemble(
        sizes,
        shards
            .into_iter()
            .map(|s| (s.param, s.range.clone(), &s.values[..])),
    )
}
