//! Helpers shared by the layout tests (`layout.rs`, `layerwise.rs`): buffer keys, parameter
//! specs and the parameter ranges of a layout.

#![allow(dead_code)] // each test file uses part of the helpers

use lowbit_layout::QuantKind;
use lowbit_layout::{BufferKey, BufferLayout, GradDType, OptimizerId, ParamSpec, ParamStorage};

/// The key of optimizer 0's parameters stored as `param_storage`, with f32 gradients.
pub fn key_of(param_storage: ParamStorage) -> BufferKey {
    BufferKey::new(param_storage, GradDType::F32, OptimizerId(0))
}

/// bf16 parameters.
pub fn bf16() -> BufferKey {
    key_of(ParamStorage::Bf16)
}

/// NVFP4 parameters.
pub fn nvfp4() -> BufferKey {
    key_of(ParamStorage::Quantized(QuantKind::Nvfp4))
}

/// A bf16 vector of `numel` elements.
pub fn param(name: &str, numel: usize) -> ParamSpec {
    ParamSpec::new(name, vec![numel], bf16())
}

/// A bf16 `rows × cols` matrix.
pub fn mat(name: &str, rows: usize, cols: usize) -> ParamSpec {
    ParamSpec::new(name, vec![rows, cols], bf16())
}

/// `(start, end, bucket)` of every parameter, indexed like the input.
pub fn ranges(layout: &BufferLayout) -> Vec<(usize, usize, usize)> {
    layout
        .params
        .iter()
        .map(|p| (p.start, p.end, p.bucket))
        .collect()
}
