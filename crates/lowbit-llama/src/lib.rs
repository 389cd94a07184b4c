//! A Llama-3-style decoder built on lowbit's crates, as a downstream project would build it: only
//! their public APIs (`lowbit-nn`'s layers over `lowbit-buffers`' hooks, `lowbit-device`'s ops).
//!
//! # Purpose
//! - [`config`]: the model's shape ([`LlamaConfig`]), the presets (`llama-tiny`, `llama-125m`,
//!   `llama-1b`, `llama-8b-layers`) and config files (TOML, unknown keys and wrong types refused).
//! - [`params`]: every parameter with its Hugging Face Llama name and shape, in forward order, and
//!   the deterministic initialization.
//! - [`model`]: [`Llama`], the forward and hand-written backward of the decoder over a batch of
//!   token sequences (embedding, RMSNorm, RoPE, causal GQA attention, SwiGLU, a tied or untied
//!   head with a chunked cross-entropy), eval losses and next-token logits.
//! - [`recompute`]: which activations the backward recomputes instead of keeping
//!   ([`Recompute`]: off, selective, mlp, full; the same bits), and the activation memory's closed
//!   form ([`ActivationBytes`]).
//! - [`generate`]: greedy and temperature (top-k) sampling from next-token logits with a seeded
//!   generator, and the generation loop over any next-logits function.
//! - [`data`]: tokenizers (GPT-2 BPE, bytes), token shards on disk with a manifest, memory-mapped
//!   reading and a deterministic sample order.
//! - [`hf`]: the Hugging Face directory (`config.json`, `generation_config.json`, tokenizer
//!   files, safetensors under HF Llama names, sharded with an index) written and read back.
//!
//! # Invariants
//! - The model owns activations and scratch only; parameters and gradients are the hooks'. Its
//!   op sequence depends on the configuration and the batch shape only, so every trajectory is
//!   the same whatever storage (bf16, MXFP8, NVFP4) or sharding the hooks implement.
//! - Every GEMM weight (the attention and MLP projections) is a matrix parameter that a precision
//!   policy may store in low precision; the embedding, the norms and the head are not.
//! - Parameters are reported ready exactly once per microbatch, in the reverse of their id order
//!   ([`params::params`]), which is the order a bucketed reduction wants.
//! - Bad input (ids at or above the vocabulary, wrong lengths, a sequence over `max_seq`, a
//!   config that cannot be built) is a typed error ([`LlamaError`]) before any device op.
//! - `tests/gradcheck.rs` holds an independent f64 implementation of the whole forward; the
//!   model's gradients of every parameter element agree with its central differences.
//!
//! # Non-goals
//! Training loops, optimizers, ranks and checkpoints (those are `lowbit-train` and below, and the
//! command line); fast kernels (the exact ops here are the reference); KV caches (generation
//! reruns the window).

pub mod config;
pub mod data;
pub mod generate;
pub mod hf;
pub mod model;
pub mod params;
pub mod recompute;

mod error;

pub use config::{Llama3RopeScaling, LlamaConfig, presets};
pub use error::{LlamaError, Result};
pub use model::Llama;
pub use recompute::{ActivationBytes, Recompute};
