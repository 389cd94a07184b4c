//! Test and benchmark helpers shared by lowbit's packages that need the lowbit crates
//! themselves (the dependency-free ones are in `lowbit-dev-support`).
//!
//! # Purpose
//! Integration tests and benchmarks of different packages cannot share a module except through
//! a crate. This one holds, once, what the `lowbit-buffers` and `lowbit-optim` tests and the
//! crates' benchmarks used to copy:
//! - [`run`]: rank threads with a collective timeout, a panicking rank failing the test;
//! - [`values`] and [`seed`]: deterministic f32 inputs from small integers;
//! - [`assert_same_bits`], [`bits`]: bitwise comparisons with readable failures;
//! - device round trips ([`upload_f32`], [`download_f32`]) and what a compute path reads of a
//!   parameter ([`weight_parts`]);
//! - [`assemble`]: full tensors from every rank's owned pieces, each element exactly once;
//! - [`model::Mlp`]: a tiny model that reads parameters and writes gradients only through
//!   `Hooks`, and [`model::regression`], the regression MLP of the parity suites;
//! - `harness` (feature `harness`): the one training harness of the parity suites — the run
//!   description, the spec/plan/buffer/policy/optimizer builders, the rank loop through the
//!   public driver (`lowbit_train::Trainer`), the outcome record, bitwise trajectory assertions
//!   and the parity matrices;
//! - [`mod@bench`]: criterion set-up, read-back and the timed rank pool of the benchmark mains.
//!
//! # Invariants
//! - Dev-only: a `[dev-dependencies]` path entry without a version (so `cargo package` drops
//!   it), never a normal dependency. The crates it depends on may dev-depend on it: their
//!   integration tests and benchmarks link the same library this crate links, so types unify.
//! - Without the `harness` feature it does not depend on `lowbit-optim`, `lowbit-train` or
//!   `lowbit-ckpt`, so `cargo test -p lowbit-device` (or comm, buffers, …) builds none of them
//!   and a change there cannot break the tests of the crates below them. Only the crates whose
//!   tests run whole steps (`lowbit-train`, `lowbit-optim`, the root package) turn it on.
//! - Feature unification: in a workspace build (`cargo test --workspace`, clippy
//!   `--workspace`) cargo builds this crate once, with the union of the features its dependents
//!   ask for, so the crates below also link a testkit with `harness` on (and with `cuda` on
//!   under `--features cuda`). That is harmless — it adds code their tests do not call, never
//!   changes what the rest of the crate does — but it is why nothing outside `harness` may be
//!   gated on the feature: a test of a lower crate must mean the same in both builds.
//!
//! # Non-goals
//! Not a library for users: no stability promise, no typed errors (helpers panic with the
//! failing case, as a test should). Not a benchmark harness beyond [`mod@bench`]'s set-up.

#[cfg(feature = "harness")]
pub mod harness;

pub mod bench;
pub mod model;

use std::ops::Range;
use std::time::Duration;

use lowbit_buffers::{DataParallelBuffers, LowPrecisionWeights};
use lowbit_comm::{GroupConfig, LocalComm, run_ranks};
use lowbit_dev_support::rng::{splitmix64, unit24};
use lowbit_device::{DType, Device, View};

/// Runs `f` on `dp` rank threads (30 s collective timeout) and returns each rank's result; a
/// panicking rank fails the test with its message.
pub fn run<T: Send>(dp: usize, f: impl Fn(LocalComm, Device) -> T + Sync) -> Vec<T> {
    run_ranks(
        dp,
        GroupConfig::default().with_timeout(Duration::from_secs(30)),
        f,
    )
    .into_iter()
    .map(|r| r.unwrap_or_else(|e| panic!("{e}")))
    .collect()
}

/// `n` deterministic values in `[-scale, scale)` with full 24-bit significands (so most of them
/// are not bf16 values and roundings are visible).
pub fn values(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let u = unit24(splitmix64(seed.wrapping_mul(0x1000_0001) ^ i as u64));
            (2.0 * u - 1.0) * scale
        })
        .collect()
}

/// A seed from small integers.
pub fn seed(parts: &[u64]) -> u64 {
    parts
        .iter()
        .fold(0x5EED, |s, &p| splitmix64(s ^ p.wrapping_mul(0x100_0193)))
}

/// Bits of f32 values, for bitwise (NaN-safe) comparisons with readable failures.
pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Asserts two f32 slices are bitwise equal, naming the first difference (not dumping both).
#[track_caller]
pub fn assert_same_bits(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let diffs: Vec<usize> = (0..got.len())
        .filter(|&i| got[i].to_bits() != want[i].to_bits())
        .collect();
    if let Some(&i) = diffs.first() {
        panic!(
            "{what}: {} of {} elements differ; first at {i}: {} vs {} expected",
            diffs.len(),
            got.len(),
            got[i],
            want[i]
        );
    }
}

/// A float view's values as f32 (cast through a temporary for bf16/f16 views).
pub fn download_f32(dev: &mut Device, v: View) -> Vec<f32> {
    if v.dtype() == DType::F32 {
        return dev.download(v).unwrap();
    }
    let tmp = dev.alloc(DType::F32, v.len());
    dev.cast(v, tmp).unwrap();
    let out = dev.download(tmp).unwrap();
    dev.free(tmp).unwrap();
    out
}

/// A fresh f32 device view holding `vals` (the caller frees it).
pub fn upload_f32(dev: &mut Device, vals: &[f32]) -> View {
    let v = dev.alloc(DType::F32, vals.len());
    dev.upload(v, vals).unwrap();
    v
}

/// Every byte a compute path reads for parameter `p`, in parts: the persistent values, or the
/// copies and scales (rowwise data and scales, then columnwise) and, for NVFP4, the global amax
/// of its low-precision weights.
pub fn weight_parts(dev: &mut Device, bufs: &DataParallelBuffers, p: usize) -> Vec<Vec<u8>> {
    let (copies, amax) = match bufs.low_precision_weights(p) {
        None => return vec![dev.read_bytes(bufs.param_view(p).unwrap()).unwrap()],
        Some(LowPrecisionWeights::Mxfp8(w)) => ([w.rowwise, w.columnwise], None),
        Some(LowPrecisionWeights::Nvfp4 { weights: w, amax }) => {
            ([w.rowwise, w.columnwise], Some(amax))
        }
        Some(other) => panic!("unknown weights {other:?}"),
    };
    let mut out: Vec<Vec<u8>> = copies
        .iter()
        .flat_map(|&(data, scales)| [data, scales])
        .map(|v| dev.read_bytes(v).unwrap())
        .collect();
    out.extend(amax.map(|a| a.to_le_bytes().to_vec()));
    out
}

/// Full tensors of `sizes[p]` elements assembled from pieces `(param, range, values)` (every
/// rank's owned shards): each element must come exactly once.
pub fn assemble<'a>(
    sizes: &[usize],
    pieces: impl IntoIterator<Item = (usize, Range<usize>, &'a [f32])>,
) -> Vec<Vec<f32>> {
    let mut full: Vec<Vec<Option<f32>>> = sizes.iter().map(|&n| vec![None; n]).collect();
    for (p, range, vals) in pieces {
        for (i, &v) in range.zip(vals) {
            assert!(full[p][i].is_none(), "param {p} element {i} twice");
            full[p][i] = Some(v);
        }
    }
    full.into_iter()
        .enumerate()
        .map(|(p, v)| {
            v.into_iter()
                .enumerate()
                .map(|(i, x)| x.unwrap_or_else(|| panic!("param {p} element {i} missing")))
                .collect()
        })
        .collect()
}
