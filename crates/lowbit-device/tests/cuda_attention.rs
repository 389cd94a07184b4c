//! Causal grouped-query attention on CUDA (`crates/lowbit-kernels/attention.cu`) against the
//! CPU backend, byte for byte: seq 1, odd lengths across the kernels' 64-row blocks and 16-row
//! tiles, GQA ratios 1, 2 and 4, head sizes 1 to 256, views at offsets inside larger buffers,
//! special values, the errors; and an ignored timing test of a 125M-model layer's shape. Needs a
//! GPU; fails, never skips, without one.
#![cfg(feature = "cuda")]

use lowbit_device::{AttentionSpec, DType, Result, View};

mod support;
use support::*;

/// `n` values in `[-mag, mag)`.
fn moderate(n: usize, seed: u64, mag: f32) -> Vec<f32> {
    let mut r = Rng::new(seed);
    (0..n).map(|_| r.unit() * mag).collect()
}

fn spec(batch: usize, seq: usize, heads: usize, kv_heads: usize, head_dim: usize) -> AttentionSpec {
    AttentionSpec {
        batch,
        seq,
        heads,
        kv_heads,
        head_dim,
        scale: (1.0 / (head_dim as f64).sqrt()) as f32,
    }
}

/// A recorded f32 buffer of `pad + vals + pad` and the view of `vals`.
fn mid(c: &mut Ctx, vals: &[f32], pad: usize, seed: u64) -> View {
    let around = moderate(pad, seed ^ 0x55, 1.0);
    let all = [&around[..], vals, &around[..]].concat();
    c.buf(DType::F32, &all)
        .slice(pad..pad + vals.len())
        .unwrap()
}

/// Forward then backward of `s` on `c`'s device; every buffer recorded. `specials`: about one
/// in eight inputs an edge case (NaN, ±Inf, subnormals, extremes).
fn scenario(c: &mut Ctx, s: &AttentionSpec, seed: u64, pad: usize, specials: bool) -> Result<()> {
    let qn = s.batch * s.seq * s.heads * s.head_dim;
    let kn = s.batch * s.seq * s.kv_heads * s.head_dim;
    let ln = s.batch * s.heads * s.seq;
    let input = |n: usize, sd: u64, mag: f32| {
        if specials {
            values(n, sd, true)
        } else {
            moderate(n, sd, mag)
        }
    };
    let q = mid(c, &input(qn, seed, 2.0), pad, seed + 1);
    let k = mid(c, &input(kn, seed + 2, 2.0), pad, seed + 3);
    let v = mid(c, &input(kn, seed + 4, 1.0), pad, seed + 5);
    let dout = mid(c, &input(qn, seed + 6, 1.0), pad, seed + 7);
    let out = mid(c, &moderate(qn, seed + 8, 9.0), pad, seed + 9);
    let lse = mid(c, &moderate(ln, seed + 10, 9.0), pad, seed + 11);
    let dq = mid(c, &moderate(qn, seed + 12, 9.0), pad, seed + 13);
    let dk = mid(c, &moderate(kn, seed + 14, 9.0), pad, seed + 15);
    let dv = mid(c, &moderate(kn, seed + 16, 9.0), pad, seed + 17);
    c.dev.attention(q, k, v, out, lse, s)?;
    c.dev
        .attention_backward(q, k, v, out, lse, dout, dq, dk, dv, s)
}

#[test]
fn attention_matches_the_cpu_bytes() {
    let shapes = [
        // (batch, seq, heads, kv_heads, head_dim)
        (1, 1, 1, 1, 16),
        (2, 1, 4, 2, 64),
        (1, 17, 2, 2, 16),
        (2, 37, 4, 1, 64),
        (1, 67, 8, 2, 128),
        (3, 65, 4, 4, 64),
        (1, 129, 2, 1, 32),
        (2, 19, 4, 2, 3),
        (1, 9, 2, 1, 1),
        (1, 33, 2, 1, 256),
    ];
    for (n, &(b, sq, h, g, hd)) in shapes.iter().enumerate() {
        let s = spec(b, sq, h, g, hd);
        for (pad, specials) in [(0, false), (5, false), (3, true)] {
            let name = format!("attention {s:?}, pad {pad}, specials {specials}");
            check_native(&name, specials, |c| {
                scenario(c, &s, 100 * n as u64 + pad as u64, pad, specials)?;
                Ok(vec![])
            });
        }
    }
}

#[test]
fn attention_with_large_scores_and_a_custom_scale_matches_the_cpu_bytes() {
    // Scores far beyond exp's range (the maximum subtraction) and a scale that is not
    // 1/sqrt(head_dim).
    let s = AttentionSpec {
        scale: 0.7,
        ..spec(2, 40, 4, 2, 32)
    };
    check_native("attention, large scores", false, |c| {
        let qn = 2 * 40 * 4 * 32;
        let kn = 2 * 40 * 2 * 32;
        let q = c.buf(DType::F32, &moderate(qn, 1, 30.0));
        let k = c.buf(DType::F32, &moderate(kn, 2, 30.0));
        let v = c.buf(DType::F32, &moderate(kn, 3, 1.0));
        let dout = c.buf(DType::F32, &moderate(qn, 4, 1.0));
        let [out, dq] = [5, 6].map(|sd| c.buf(DType::F32, &moderate(qn, sd, 1.0)));
        let lse = c.buf(DType::F32, &moderate(2 * 4 * 40, 7, 1.0));
        let [dk, dv] = [8, 9].map(|sd| c.buf(DType::F32, &moderate(kn, sd, 1.0)));
        c.dev.attention(q, k, v, out, lse, &s)?;
        c.dev
            .attention_backward(q, k, v, out, lse, dout, dq, dk, dv, &s)?;
        Ok(vec![])
    });
}

#[test]
fn attention_errors_match_the_cpu() {
    check("attention errors", false, |c| {
        let ok = spec(1, 4, 4, 2, 8);
        let q = c.buf(DType::F32, &moderate(4 * 4 * 8, 1, 1.0));
        let k = c.buf(DType::F32, &moderate(4 * 2 * 8, 2, 1.0));
        let out = c.buf(DType::F32, &moderate(4 * 4 * 8, 3, 1.0));
        let lse = c.buf(DType::F32, &moderate(4 * 4, 4, 1.0));
        let bad = [
            AttentionSpec { kv_heads: 3, ..ok },
            AttentionSpec { head_dim: 0, ..ok },
            AttentionSpec { seq: 5, ..ok },
        ];
        let mut errs: Vec<_> = bad
            .iter()
            .map(|s| c.dev.attention(q, k, k, out, lse, s).unwrap_err())
            .collect();
        // An output aliasing an input.
        errs.push(c.dev.attention(q, k, k, q, lse, &ok).unwrap_err());
        errs.push(
            c.dev
                .attention_backward(q, k, k, out, lse, out, q, k, k, &ok)
                .unwrap_err(),
        );
        Ok(messages(&errs))
    });
}

/// One layer of a 125M model (12 heads of 64, batch 8, seq 1024): the forward and the
/// backward's time on the GPU. `cargo test -p lowbit-device --features cuda --release --test
/// cuda_attention -- --ignored --nocapture`.
#[test]
#[ignore = "timing"]
fn attention_timing() {
    let mut g = gpu();
    for (b, sq) in [(8, 256), (8, 1024)] {
        let s = spec(b, sq, 12, 12, 64);
        let qn = b * sq * 12 * 64;
        let put = |g: &mut lowbit_device::Device, n: usize, seed: u64| {
            let v = g.alloc(DType::F32, n);
            g.upload(v, &moderate(n, seed, 1.0)).unwrap();
            v
        };
        let [q, k, v, dout, out, dq, dk, dv] =
            [1, 2, 3, 4, 5, 6, 7, 8].map(|sd| put(&mut g, qn, sd));
        let lse = put(&mut g, b * 12 * sq, 9);
        let fwd = time(&mut g, 5, |g| g.attention(q, k, v, out, lse, &s).unwrap());
        let bwd = time(&mut g, 5, |g| {
            g.attention_backward(q, k, v, out, lse, dout, dq, dk, dv, &s)
                .unwrap()
        });
        println!(
            "attention b{b} s{sq} h12 d64: forward {:.3} ms, backward {:.3} ms",
            fwd / 1e3,
            bwd / 1e3
        );
    }
}
