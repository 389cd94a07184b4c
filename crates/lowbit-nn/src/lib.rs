//! Layers over [`Hooks`]: the forward and the hand-written backward of each layer a model is
//! built from, on `lowbit-device`'s ops, written once for every model of the workspace (the
//! reference models of the command line, the test kit's model, the bring-your-own-model example)
//! and for the models downstream projects write.
//!
//! # Purpose
//! A model owns its activations and scratch; it never owns parameter or gradient memory. Each
//! layer in [`layers`] is a small `Copy` descriptor (the ids of its parameters, its widths) whose
//! `forward` and `backward` fetch the parameters through the model's [`Hooks`], compute with the
//! device ops, and hand the gradients back through the hooks. Because weights are fetched with the
//! [`Usage`] of the computation (rowwise for the forward's `X·Wᵀ`, columnwise for the backward's
//! `dY·W`) and cast to f32 from whatever dtype the hooks return, a layer computes with exactly the
//! primary-weight storage the buffers keep: bf16, MXFP8 (staged or 2D), or NVFP4.
//!
//! # The Hooks contract the layers keep
//! - **A parameter is fetched right before it is used**, once per use ([`Hooks::param`]): the
//!   forward pre-hook, where a lazily gathered bucket is awaited. A backward fetches again
//!   (with [`Usage::Backward`]) rather than keeping the forward's view.
//! - **Gradients accumulate, never overwrite**: a layer computes a parameter's gradient into the
//!   model's f32 scratch and *adds* it into the view [`Hooks::grad`] returns
//!   ([`layers::accumulate`]), so microbatches accumulate.
//! - **Each parameter is reported ready once per microbatch** ([`Hooks::grad_ready`]), right
//!   after its gradient is complete: the backward hook, where a bucket's reduction may start.
//!   Layers report in backward order: a linear layer's bias before its weight, then it computes
//!   its input's gradient.
//!
//! # Invariants
//! - **A layer issues a fixed sequence of device ops** that depends only on its descriptor and the
//!   call (never on the data or the hooks), so a model's op sequence — and with it every
//!   trajectory — is the same whatever storage or hooks it runs with.
//! - **Layers allocate nothing.** Views and scratch ([`layers::Scratch`]) come from the model, so
//!   a model sizes and reuses its memory; scratch is overwritten, never read before written.
//! - **No f64 and no host arithmetic**: everything a layer computes runs as device ops, so the
//!   CPU and CUDA backends give the same bits. The one exception is the mean of
//!   [`layers::ChunkedCrossEntropy`]'s per-row losses, summed in f64 on the host in row order
//!   from the downloaded losses (exactly what [`lowbit_device::Device::softmax_cross_entropy`]
//!   does inside), which is backend-independent too. [`layers::rope_tables`] is host code
//!   that builds constant tables in f64 once, before any step.
//!
//! # Adding a layer
//! One file per layer family under `layers/` (≲ 800 lines), a descriptor with the parameter ids
//! and widths, `forward`/`backward` taking `(dev, hooks, views…, rows, scratch)`, backward
//! reporting parameters in reverse forward order; unit tests check forward values on a tiny input
//! against an independent host computation and the backward against central differences.
//!
//! # Non-goals
//! Layers do not own parameters, schedule communication, fuse across layers, or decide precision
//! (that is the buffers' policy behind the hooks). There is no autograd: a model calls the
//! backwards itself, in reverse order. The decoder layers ([`layers::Embedding`], [`layers::Rope`],
//! [`layers::SwiGlu`], [`layers::ChunkedCrossEntropy`]) run in the exact arithmetic of the device
//! ops, not with fused or tensor-core kernels; grouped experts are not here.

pub mod layers;

mod error;

pub use error::{NnError, Result};
pub use lowbit_buffers::{Hooks, Usage};

#[cfg(test)]
mod testing;
