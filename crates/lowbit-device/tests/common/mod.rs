//! Host-side helpers of the CPU op tests (`elementwise`, `matmul`, `model`, `optim`, `quant`):
//! uploads and downloads that convert on the host with `half` (never with the device's own
//! cast, which some of these tests check), rounding to a dtype, and bit patterns.

#![allow(dead_code)] // each test file uses part of the helpers

use lowbit_device::{DType, Device, View, bf16, f16};

/// Rounds an f32 to `d` and back (the host reference of "rounded to the dtype, RNE").
pub fn round_to(d: DType, v: f32) -> f32 {
    match d {
        DType::F32 => v,
        DType::Bf16 => bf16::from_f32(v).to_f32(),
        DType::F16 => f16::from_f32(v).to_f32(),
        DType::U8 => unreachable!(),
    }
}

/// Allocates a `d` view holding `vals` rounded to `d`.
pub fn upload_as(dev: &mut Device, d: DType, vals: &[f32]) -> View {
    let v = dev.alloc(d, vals.len());
    match d {
        DType::F32 => dev.upload(v, vals),
        DType::Bf16 => dev.upload(v, &narrow(vals, bf16::from_f32)),
        DType::F16 => dev.upload(v, &narrow(vals, f16::from_f32)),
        DType::U8 => unreachable!(),
    }
    .unwrap();
    v
}

fn narrow<T>(vals: &[f32], from_f32: fn(f32) -> T) -> Vec<T> {
    vals.iter().map(|&x| from_f32(x)).collect()
}

/// Allocates an f32 view holding `vals`.
pub fn upload(dev: &mut Device, vals: &[f32]) -> View {
    upload_as(dev, DType::F32, vals)
}

/// A float view's elements as f32.
pub fn download(dev: &Device, v: View) -> Vec<f32> {
    match v.dtype() {
        DType::F32 => dev.download::<f32>(v).unwrap(),
        DType::Bf16 => widen(dev.download::<bf16>(v).unwrap(), bf16::to_f32),
        DType::F16 => widen(dev.download::<f16>(v).unwrap(), f16::to_f32),
        DType::U8 => unreachable!(),
    }
}

fn widen<T: Copy>(v: Vec<T>, to_f32: fn(T) -> f32) -> Vec<f32> {
    v.into_iter().map(to_f32).collect()
}

/// Bit patterns, so that NaN payloads and signed zeros compare exactly.
pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}
