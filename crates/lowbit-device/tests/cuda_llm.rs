//! The decoder ops (embedding, RoPE, SwiGLU, per-row cross-entropy) on the CUDA backend against
//! the CPU backend: random and edge-case inputs (NaN, ±Inf, ±0, subnormals), odd sizes, views at
//! non-zero offsets, repeated ids, in-place RoPE; identical bytes in every buffer (a NaN produced
//! by float arithmetic matches any NaN), identical errors, and no host fallback.
//!
//! Needs a CUDA GPU (fails without one, never skips); run with `--test-threads=1`.
#![cfg(feature = "cuda")]

use lowbit_device::{DType, RopeSpec};

mod support;
use support::*;

/// `n` integer ids in `0..vocab` as f32 (with repeats), from `seed`.
fn ids(n: usize, vocab: usize, seed: u64) -> Vec<f32> {
    let mut r = Rng::new(seed);
    (0..n).map(|_| (r.next() % vocab as u64) as f32).collect()
}

#[test]
fn embedding_and_its_backward_match() {
    check_native("embedding", true, |c| {
        let f = DType::F32;
        let mut errs = Vec::new();
        for (rows, vocab, dim, seed) in [
            (13usize, 7usize, 37usize, 1u64),
            (1, 1, 1, 2),
            (300, 50, 64, 3),
            (0, 3, 5, 4),
            (64, 1000, 3, 5),
        ] {
            for (k, d) in FLOATS.into_iter().enumerate() {
                let table = c.rand_mid(d, vocab * dim, 3, seed + k as u64);
                let idv = c.buf(f, &ids(rows, vocab, seed + 10));
                let out = c.rand_mid(f, rows * dim, 2, seed + 20);
                c.dev.embedding(table, idv, out)?;
            }
            let idv = c.buf(f, &ids(rows, vocab, seed + 30));
            let dy = c.rand_mid(f, rows * dim, 1, seed + 31);
            let grad = c.rand_mid(f, vocab * dim, 2, seed + 32);
            c.dev.embedding_backward(idv, dy, grad)?;
            // Finite values too, so that the sums are compared bit for bit, not as NaN.
            let dy = c.buf(f, &finite(rows * dim, seed + 33));
            let grad = c.buf(f, &finite(vocab * dim, seed + 34));
            c.dev.embedding_backward(idv, dy, grad)?;
        }
        // Bad ids: the same error on both backends, nothing written.
        let table = c.rand(f, 12, 40);
        let out = c.rand(f, 6, 41);
        for bad in [4.0f32, 0.5, -1.0, f32::NAN] {
            let idv = c.buf(f, &[0.0, bad]);
            errs.push(c.dev.embedding(table, idv, out).unwrap_err());
            errs.push(c.dev.embedding_backward(idv, out, table).unwrap_err());
        }
        Ok(messages(&errs))
    });
}

#[test]
fn rope_matches_in_place_and_not() {
    check_native("rope", true, |c| {
        let f = DType::F32;
        let mut errs = Vec::new();
        for (batch, seq, heads, hd, max_seq, seed) in [
            (2usize, 5usize, 3usize, 8usize, 7usize, 1u64),
            (1, 1, 1, 2, 1, 2),
            (3, 17, 4, 64, 17, 3),
            (0, 4, 2, 6, 4, 4),
        ] {
            let n = batch * seq * heads * hd;
            let cos = c.rand_mid(f, max_seq * hd / 2, 1, seed + 1);
            let sin = c.rand_mid(f, max_seq * hd / 2, 2, seed + 2);
            for inverse in [false, true] {
                let spec = RopeSpec {
                    seq,
                    heads,
                    head_dim: hd,
                    inverse,
                };
                let x = c.rand_mid(f, n, 3, seed + 3);
                let y = c.rand_mid(f, n, 1, seed + 4);
                c.dev.rope(x, y, cos, sin, &spec)?;
                c.dev.rope(x, x, cos, sin, &spec)?;
                let x = c.buf(f, &finite(n, seed + 5));
                c.dev.rope(x, x, cos, sin, &spec)?;
            }
        }
        let x = c.rand(f, 24, 50);
        let cs = c.rand(f, 6, 51);
        let ok = RopeSpec {
            seq: 2,
            heads: 2,
            head_dim: 6,
            inverse: false,
        };
        errs.push(
            c.dev
                .rope(x, x, cs, cs, &RopeSpec { head_dim: 5, ..ok })
                .unwrap_err(),
        );
        errs.push(
            c.dev
                .rope(x, x, cs, cs, &RopeSpec { seq: 3, ..ok })
                .unwrap_err(),
        );
        Ok(messages(&errs))
    });
}

#[test]
fn swiglu_and_its_backward_match() {
    check_native("swiglu", true, |c| {
        let f = DType::F32;
        for (n, seed) in [(1usize, 1u64), (37, 2), (4099, 3), (0, 4)] {
            for (gv, uv) in [
                (values(n, seed, true), values(n, seed + 1, true)),
                (finite(n, seed + 2), finite(n, seed + 3)),
            ] {
                let g = c.buf(f, &gv);
                let u = c.buf(f, &uv);
                let out = c.rand_mid(f, n, 1, seed + 4);
                c.dev.swiglu(g, u, out)?;
                let d = c.buf(f, &finite(n, seed + 5));
                let dg = c.rand_mid(f, n, 2, seed + 6);
                let du = c.rand_mid(f, n, 1, seed + 7);
                c.dev.swiglu_backward(g, u, d, dg, du)?;
            }
        }
        Ok(Vec::new())
    });
}

#[test]
fn cross_entropy_rows_matches() {
    check_native("cross_entropy_rows", true, |c| {
        let f = DType::F32;
        let mut out = Vec::new();
        let mut errs = Vec::new();
        for (rows, classes, seed) in [
            (13usize, 37usize, 1u64),
            (1, 1, 2),
            (64, 1000, 3),
            (0, 5, 4),
            (5, 50257, 5),
        ] {
            let t = c.buf(f, &ids(rows, classes, seed + 1));
            for logits in [
                finite(rows * classes, seed + 2),
                values(rows * classes, seed + 3, true),
            ] {
                for grad in [None, Some(0.37f32)] {
                    let l = c.buf(f, &logits);
                    let losses = c.rand_mid(f, rows, 1, seed + 4);
                    c.dev.cross_entropy_rows(l, t, losses, grad)?;
                    let back: Vec<f32> = c.dev.download(losses)?;
                    out.extend(back.iter().map(|&v| f64::from(v)));
                }
            }
        }
        // Large logits and a view at an offset.
        let big: Vec<f32> = (0..3 * 9).map(|i| 80.0 + (i % 9) as f32).collect();
        let l = c.rand_mid(f, 27, 2, 60);
        c.dev.upload(l, &big)?;
        let t = c.buf(f, &[8.0, 0.0, 4.0]);
        let losses = c.rand(f, 3, 61);
        c.dev.cross_entropy_rows(l, t, losses, Some(1.0))?;
        for bad in [9.0f32, 1.5, -1.0] {
            let t = c.buf(f, &[0.0, 1.0, bad]);
            errs.push(
                c.dev
                    .cross_entropy_rows(l, t, losses, Some(1.0))
                    .unwrap_err(),
            );
        }
        out.extend(messages(&errs));
        Ok(out)
    });
}
