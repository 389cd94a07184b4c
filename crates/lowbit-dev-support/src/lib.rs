//! Development helpers shared by lowbit's benchmarks, tests and `xtask`.
//!
//! # Purpose
//! Benchmarks and tests of different packages cannot share a module except through a crate, and
//! `#[path]` includes across package boundaries break `cargo package` and make crates depend on
//! the repository layout. This crate holds what they share:
//! - [`cli`]: the benchmark binaries' numeric flags, checked against a range;
//! - [`criterion_estimates`]: where criterion writes its results and the median time of a
//!   benchmark this run measured, for the benchmark mains that print a ratio to a baseline of the
//!   same run (`lowbit-formats`, `lowbit-device`, `lowbit-comm` and the root `formats` bench);
//! - [`tempdir`]: a per-test scratch directory removed on drop;
//! - [`cpu_load`]: how many cores other processes kept busy while a benchmark ran (Linux), so
//!   a table says when its figures were taken on a loaded machine;
//! - [`json`]: `lowbit_io`'s JSON codec, for cargo's machine-readable output (`xtask`) and
//!   `lowbit train --json` (the root package's `tests/train.rs`);
//! - [`rng`]: the deterministic generators behind test inputs and benchmark data (xorshift
//!   here, splitmix64 re-exported from `lowbit_io`);
//! - [`alloc`]: counting global allocators for tests that bound heap memory;
//! - [`fuzz_cases`]: the case count of the byte-mutation fuzz tests (`LOWBIT_FUZZ_CASES`).
//!
//! # Invariants
//! - One dependency, `lowbit-io` without its default features (its JSON codec, hash and
//!   generator: nothing but `thiserror`), so adding it as a dev-dependency costs little build
//!   time.
//! - It is a dev-dependency of every library that uses it (`xtask`, never packaged, is the one
//!   normal user), and its workspace entry has no version, so `cargo package` drops it from the
//!   packaged manifests.
//!
//! # Non-goals
//! Code of its own for what `lowbit-io` holds (JSON, SplitMix64); anything a library crate
//! needs at run time; publication (`publish = false`).

pub mod alloc;
pub mod cli;
pub mod cpu_load;
pub mod criterion_estimates;
pub mod json;
pub mod rng;
pub mod tempdir;

/// How many cases a fuzz test runs: `LOWBIT_FUZZ_CASES` if set to a number, else `default`
/// (small, so that CI stays fast; raise it for a longer hunt).
pub fn fuzz_cases(default: u32) -> u32 {
    std::env::var("LOWBIT_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}
