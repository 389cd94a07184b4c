//! PTX of the CUDA kernels, embedded for the CUDA backend (so a build needs no CUDA compiler).
//!
//! The sources, the committed PTX and the check that the PTX is fresh live in the
//! `lowbit-kernels` package (the repository's `cuda/` folder); this module re-exports it, so
//! `lowbit_device::ptx::*` stays the one path the backend, `xtask` and the training command use.
//! Each PTX file starts with a comment recording a hash of the source it was built from;
//! `lowbit-kernels`' tests fail when a `.cu` file changed without its PTX being rebuilt
//! (`cargo xtask ptx`).

pub use lowbit_kernels::{
    HASH_HEADER, MODULES, Module, recorded_hash, source_hash, struct_param_bytes,
};
