//! Helpers shared by the `lowbit-buffers` integration tests: rank threads, parameter specs,
//! deterministic values, host rounding, and a tiny model that reads parameters and writes
//! gradients only through [`Hooks`].

#![allow(dead_code)] // each test file uses part of the helpers

pub mod model;

use std::time::Duration;

use lowbit_buffers::layout::{
    BufferKey, GradDType, OptimizerId, ParamSpec, ParamStorage, QuantKind,
};
use lowbit_buffers::{BufferError, DataParallelBuffers, ProtocolError, StagePiece};
use lowbit_comm::{Communicator, GroupConfig, LocalComm, run_ranks};
use lowbit_device::{DType, Device, View, bf16};

/// MXFP8 primary weights.
pub const MXFP8: ParamStorage = ParamStorage::Quantized(QuantKind::Mxfp8);
/// NVFP4 primary weights.
pub const NVFP4: ParamStorage = ParamStorage::Quantized(QuantKind::Nvfp4);

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

/// A buffer key.
pub fn key(storage: ParamStorage, grad: GradDType, owner: u32) -> BufferKey {
    BufferKey {
        param_storage: storage,
        grad_dtype: grad,
        expert: false,
        owner: OptimizerId(owner),
    }
}

/// A parameter spec.
pub fn spec(name: &str, shape: &[usize], storage: ParamStorage, grad: GradDType) -> ParamSpec {
    ParamSpec::new(name, shape.to_vec(), key(storage, grad, 0))
}

/// The protocol violation inside an error, or a panic naming what came instead.
pub fn protocol_err(e: BufferError) -> ProtocolError {
    match e {
        BufferError::Protocol(p) => p,
        other => panic!("expected a protocol violation, got {other}"),
    }
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// `n` deterministic values in `[-scale, scale)` with full 24-bit significands (so most of them
/// are not bf16 values and roundings are visible).
pub fn values(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let x = splitmix(seed.wrapping_mul(0x1000_0001) ^ i as u64);
            let u = (x >> 40) as f32 / (1u32 << 24) as f32;
            (2.0 * u - 1.0) * scale
        })
        .collect()
}

/// A seed from small integers.
pub fn seed(parts: &[u64]) -> u64 {
    parts
        .iter()
        .fold(0x5EED, |s, &p| splitmix(s ^ p.wrapping_mul(0x100_0193)))
}

/// `x` rounded to bf16 (RNE) and widened back.
pub fn bf16_round(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}

/// `x` rounded to the gradient dtype.
pub fn round_to(grad: GradDType, x: f32) -> f32 {
    match grad {
        GradDType::F32 => x,
        GradDType::Bf16 => bf16_round(x),
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

/// Adds `vals` into `dst` (any float dtype): one rounding of `dst + vals`, as a backward does.
pub fn add_into(dev: &mut Device, vals: &[f32], dst: View) {
    let tmp = upload_f32(dev, vals);
    dev.add(tmp, dst).unwrap();
    dev.free(tmp).unwrap();
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

/// Bits of f32 values, for bitwise comparisons with readable failures.
pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The new master values of this rank's owned pieces of `owner`'s low-precision parameters,
/// as device views (freed by [`free_pieces`]), taken from `full[p]`.
pub fn stage_pieces(
    dev: &mut Device,
    bufs: &DataParallelBuffers,
    full: &[Vec<f32>],
) -> Vec<StagePiece> {
    bufs.owned_shards()
        .unwrap()
        .into_iter()
        .filter(|s| s.fused_output.is_none())
        .map(|s| StagePiece {
            param: s.param,
            master: upload_f32(dev, &full[s.param][s.param_range.clone()]),
            param_range: s.param_range,
        })
        .collect()
}

/// Frees the views of [`stage_pieces`].
pub fn free_pieces(dev: &mut Device, pieces: Vec<StagePiece>) {
    for p in pieces {
        dev.free(p.master).unwrap();
    }
}

/// Writes `bf16(full[p][piece])` into every owned piece's fused output (what an optimizer's
/// fused update does for persistent storage).
pub fn write_fused_outputs(dev: &mut Device, bufs: &DataParallelBuffers, full: &[Vec<f32>]) {
    for s in bufs.owned_shards().unwrap() {
        if let Some(out) = s.fused_output {
            let tmp = upload_f32(dev, &full[s.param][s.param_range.clone()]);
            dev.cast(tmp, out).unwrap();
            dev.free(tmp).unwrap();
        }
    }
}

/// A split of `comm` holding this rank alone (a communicator of the wrong size for any plan of
/// more than one rank). Collective: every rank calls it.
pub fn solo(comm: &mut LocalComm) -> Box<dyn Communicator> {
    let r = comm.rank() as u32;
    comm.split(r, 0).unwrap()
}
