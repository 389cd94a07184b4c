//! Helpers shared by the `lowbit-buffers` integration tests: parameter specs, host rounding,
//! staging pieces; with `lowbit-testkit`'s rank threads, deterministic values, bitwise
//! assertions and tiny model (re-exported here).

#![allow(dead_code, unused_imports)] // each test file uses part of the helpers

pub use lowbit_testkit::{
    assert_same_bits, bits, download_f32, model, run, seed, upload_f32, values, weight_parts,
};

use lowbit_buffers::layout::{
    BufferKey, GradDType, OptimizerId, ParamSpec, ParamStorage, QuantKind,
};
use lowbit_buffers::{BufferError, DataParallelBuffers, ProtocolError, StagePiece};
use lowbit_comm::{Communicator, LocalComm};
use lowbit_device::{Device, View, bf16};

/// MXFP8 primary weights.
pub const MXFP8: ParamStorage = ParamStorage::Quantized(QuantKind::Mxfp8);
/// NVFP4 primary weights.
pub const NVFP4: ParamStorage = ParamStorage::Quantized(QuantKind::Nvfp4);

/// A buffer key.
pub fn key(storage: ParamStorage, grad: GradDType, owner: u32) -> BufferKey {
    BufferKey::new(storage, grad, OptimizerId(owner))
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

/// Adds `vals` into `dst` (any float dtype): one rounding of `dst + vals`, as a backward does.
pub fn add_into(dev: &mut Device, vals: &[f32], dst: View) {
    let tmp = upload_f32(dev, vals);
    dev.add(tmp, dst).unwrap();
    dev.free(tmp).unwrap();
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

/// Every parameter's MXFP8 bytes (both copies, data and scales), for buffers of MXFP8 staged
/// weights only.
pub fn mxfp8_bytes(dev: &Device, bufs: &DataParallelBuffers) -> Vec<Vec<u8>> {
    (0..bufs.specs().len())
        .flat_map(|p| {
            let w = bufs.mxfp8_weights(p).expect("MXFP8 storage");
            [w.rowwise.0, w.rowwise.1, w.columnwise.0, w.columnwise.1]
        })
        .map(|v| dev.read_bytes(v).unwrap())
        .collect()
}
