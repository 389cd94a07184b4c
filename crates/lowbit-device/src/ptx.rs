//! PTX of the CUDA kernels, embedded for the CUDA backend (so a build needs no CUDA compiler).
//!
//! The sources, the headers they share, the committed PTX and the check that the PTX is fresh
//! live in the `lowbit-kernels` package (`crates/lowbit-kernels/` in the repository); this module
//! re-exports it, so `lowbit_device::ptx::*` is the path the backend and the training command use
//! (`xtask`, which needs no device, depends on `lowbit-kernels` itself). Each PTX file starts
//! with a comment recording a hash of the source and the shared headers it was built from;
//! `lowbit-kernels`' tests fail when either changed without the PTX being rebuilt
//! (`cargo xtask ptx`).

pub use lowbit_kernels::{
    HASH_HEADER, INCLUDE_DIR, MODULES, Module, ModuleHashError, headers, module_hash,
    recorded_hash, source_hash, struct_param_bytes,
};
