//! Helpers shared by the integration tests: dtype codecs on the host, a host reference of the
//! rank-order reduction, and group settings that keep every test from hanging.

#![allow(dead_code)]

use std::time::Duration;

use half::{bf16, f16};
use lowbit_comm::{GroupConfig, LocalComm, RankError, ReduceOp, run_ranks};
use lowbit_device::{DType, Device, View};

pub const FLOATS: [DType; 3] = [DType::F32, DType::Bf16, DType::F16];
pub const ALL_DTYPES: [DType; 4] = [DType::F32, DType::Bf16, DType::F16, DType::U8];
pub const WORLDS: [usize; 4] = [1, 2, 3, 4];
pub const OPS: [ReduceOp; 3] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max];

/// A timeout long enough for any working test, short enough that a broken one fails fast.
pub fn cfg() -> GroupConfig {
    GroupConfig::default().with_timeout(Duration::from_secs(10))
}

/// Unwraps every rank's result (a panic on any rank fails the test with its message).
pub fn ok<T>(results: Vec<Result<T, RankError>>) -> Vec<T> {
    results
        .into_iter()
        .map(|r| r.unwrap_or_else(|e| panic!("{e}")))
        .collect()
}

/// Every `(world, dtype)` of [`WORLDS`] and `dtypes`.
pub fn worlds_and(dtypes: &[DType]) -> impl Iterator<Item = (usize, DType)> + '_ {
    WORLDS
        .into_iter()
        .flat_map(move |w| dtypes.iter().map(move |&d| (w, d)))
}

/// Every `(world, float dtype, reduction)` of [`WORLDS`], [`FLOATS`] and [`OPS`].
pub fn reduction_cases() -> impl Iterator<Item = (usize, DType, ReduceOp)> {
    worlds_and(&FLOATS).flat_map(|(w, d)| OPS.map(|op| (w, d, op)))
}

/// Runs `f` on `world` ranks and asserts that rank `r` returned the bytes `want(r)`; `what`
/// names the case in a failure.
pub fn assert_ranks(
    world: usize,
    what: &str,
    f: impl Fn(LocalComm, Device) -> Vec<u8> + Sync,
    want: impl Fn(usize) -> Vec<u8>,
) {
    let got = ok(run_ranks(world, cfg(), f));
    for (r, g) in got.iter().enumerate() {
        assert_eq!(g, &want(r), "{what} rank {r}");
    }
}

/// Every rank's [`vals`]: `n` each, ranks `0..world`.
pub fn all_vals(dtype: DType, world: usize, n: usize) -> Vec<Vec<f32>> {
    (0..world).map(|q| vals(dtype, q, n)).collect()
}

/// Rounds `x` to `dtype` (RNE) and back.
pub fn round(dtype: DType, x: f32) -> f32 {
    match dtype {
        DType::F32 => x,
        DType::Bf16 => bf16::from_f32(x).to_f32(),
        DType::F16 => f16::from_f32(x).to_f32(),
        DType::U8 => x as u8 as f32,
    }
}

/// Little-endian bytes of `vals` as `dtype` (RNE; u8 truncates).
pub fn encode(dtype: DType, vals: &[f32]) -> Vec<u8> {
    vals.iter()
        .flat_map(|&v| match dtype {
            DType::F32 => v.to_le_bytes().to_vec(),
            DType::Bf16 => bf16::from_f32(v).to_bits().to_le_bytes().to_vec(),
            DType::F16 => f16::from_f32(v).to_bits().to_le_bytes().to_vec(),
            DType::U8 => vec![v as u8],
        })
        .collect()
}

/// Values of little-endian `dtype` bytes.
pub fn decode(dtype: DType, bytes: &[u8]) -> Vec<f32> {
    match dtype {
        DType::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        DType::Bf16 => bytes
            .chunks_exact(2)
            .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        DType::F16 => bytes
            .chunks_exact(2)
            .map(|c| f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        DType::U8 => bytes.iter().map(|&b| f32::from(b)).collect(),
    }
}

/// A new buffer holding `vals` as `dtype`.
pub fn put(dev: &mut Device, dtype: DType, vals: &[f32]) -> View {
    let v = dev.alloc(dtype, vals.len());
    dev.write_bytes(v, &encode(dtype, vals)).unwrap();
    v
}

/// The values of `view`.
pub fn get(dev: &Device, view: View) -> Vec<f32> {
    decode(view.dtype(), &dev.read_bytes(view).unwrap())
}

/// Rank-dependent values, already representable in `dtype`: not representable in bf16 before
/// rounding, with mixed signs, so sums exercise rounding. u8 gets integers.
pub fn vals(dtype: DType, rank: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            if dtype == DType::U8 {
                ((rank * 17 + i * 29 + 3) % 256) as f32
            } else {
                let k = ((rank * 37 + i * 11) % 101) as f32;
                round(dtype, k * 0.173_1 - 7.5 + rank as f32 * 0.010_3)
            }
        })
        .collect()
}

/// The reference: f32 fold in rank order, `/ size` for Avg, one rounding to `dtype`.
pub fn host_reduce(dtype: DType, op: ReduceOp, per_rank: &[Vec<f32>]) -> Vec<f32> {
    let n = per_rank[0].len();
    (0..n)
        .map(|i| {
            let mut acc = per_rank[0][i];
            for r in &per_rank[1..] {
                let v = r[i];
                acc = match op {
                    ReduceOp::Sum | ReduceOp::Avg => acc + v,
                    ReduceOp::Max => {
                        if acc.is_nan() {
                            acc
                        } else if v.is_nan() || v > acc {
                            v
                        } else {
                            acc
                        }
                    }
                };
            }
            if op == ReduceOp::Avg {
                acc /= per_rank.len() as f32;
            }
            round(dtype, acc)
        })
        .collect()
}

/// A loopback port free at the time of asking (for a rendezvous between child processes).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// This test binary running only its test `test`, as rank `rank` of `world` with torchrun's
/// variables (rank 0 at `127.0.0.1:port`) and `child_var` set, which makes `test` act.
pub fn rank_command(
    test: &str,
    child_var: &str,
    rank: usize,
    world: usize,
    port: u16,
) -> std::process::Command {
    let mut c = std::process::Command::new(std::env::current_exe().unwrap());
    c.args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(child_var, "1")
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string());
    c
}
