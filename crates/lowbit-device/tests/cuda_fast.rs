//! The fast kernels of [`MatmulMode::Bf16`] on CUDA (`crates/lowbit-kernels/fast.cu`): per-row
//! cross-entropy and RMSNorm against f64 references within the tolerances their op docs
//! state, NaN where the exact op gives NaN, and the CPU op's results beside them; RoPE, SwiGLU
//! and the embedding lookup, which keep the exact formulas, byte for byte against the CPU op;
//! every kernel twice with identical bytes; bad ids reported by the next host read. The
//! ignored `bandwidth` test prints each kernel's bytes, time, GB/s and ratio to a device copy
//! of the same bytes at the 125M and 1B shapes.
//!
//! Needs a CUDA GPU (fails without one, never skips); run with `--test-threads=1`.
#![cfg(feature = "cuda")]

use lowbit_device::{DType, Device, DeviceError, MatmulMode, RopeSpec, View};

mod support;
use support::*;

/// A GPU in the fast mode.
fn fast_gpu() -> Device {
    let mut g = gpu();
    g.set_matmul_mode(MatmulMode::Bf16);
    g
}

fn up(dev: &mut Device, v: &[f32]) -> View {
    let b = dev.alloc(DType::F32, v.len());
    dev.upload(b, v).unwrap();
    b
}

fn down(dev: &Device, v: View) -> Vec<f32> {
    dev.download::<f32>(v).unwrap()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Logits in about ±`scale`, with the edge cases of `edges` rows: row 0 holds a NaN, row 1 a
/// +Inf, row 2 -Inf entries, row 3 only -Inf (when there are that many rows).
fn logits(rows: usize, classes: usize, scale: f32, seed: u64, edges: bool) -> Vec<f32> {
    let mut r = Rng::new(seed);
    let mut x: Vec<f32> = (0..rows * classes).map(|_| r.unit() * scale).collect();
    if edges && classes > 2 {
        let row = |k: usize| k * classes..(k + 1) * classes;
        if rows > 0 {
            x[classes / 2] = f32::NAN;
        }
        if rows > 1 {
            x[row(1)][1] = f32::INFINITY;
        }
        if rows > 2 {
            x[row(2)]
                .iter_mut()
                .step_by(3)
                .for_each(|v| *v = f32::NEG_INFINITY);
        }
        if rows > 3 {
            x[row(3)].fill(f32::NEG_INFINITY);
        }
    }
    x
}

/// The f64 loss and gradient of a row: `lse − x_t` and `c (p_j − [j = t])`.
fn xent64(x: &[f32], t: usize, c: f32) -> (f64, Vec<f64>) {
    let mx = x.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let s: f64 = x.iter().map(|&v| (v as f64 - mx).exp()).sum();
    let lse = mx + s.ln();
    let g = x
        .iter()
        .enumerate()
        .map(|(j, &v)| f64::from(c) * ((v as f64 - lse).exp() - if j == t { 1.0 } else { 0.0 }))
        .collect();
    (lse - x[t] as f64, g)
}

/// Worst `|got − want| / tol` of a finite reference (and NaN agreement where it is NaN).
fn worst(got: f32, want: f64, tol: f64) -> f64 {
    if want.is_nan() || got.is_nan() {
        assert!(want.is_nan() && got.is_nan(), "got {got}, want {want}");
        return 0.0;
    }
    (f64::from(got) - want).abs() / tol
}

/// One fast cross-entropy call, twice (identical bytes asserted): (losses, gradient rows).
fn fast_xent(g: &mut Device, x: &[f32], t: &[f32], grad: Option<f32>) -> (Vec<f32>, Vec<f32>) {
    let mut out = Vec::new();
    for _ in 0..2 {
        let (xv, tv) = (up(g, x), up(g, t));
        let lv = g.alloc(DType::F32, t.len());
        g.cross_entropy_rows(xv, tv, lv, grad).unwrap();
        out.push((down(g, lv), down(g, xv)));
        for v in [xv, tv, lv] {
            g.free(v).unwrap();
        }
    }
    assert_eq!(bits(&out[0].0), bits(&out[1].0), "losses: two runs");
    assert_eq!(bits(&out[0].1), bits(&out[1].1), "gradients: two runs");
    out.swap_remove(0)
}

/// The stated tolerance of the fast cross-entropy (`Device::cross_entropy_rows`): loss within
/// 1e-5 · (1 + |x_t − max| + ln s) of the f64 value, each gradient element within
/// |c| · (1e-5 · p_j + 2e-7).
#[test]
fn cross_entropy_rows_within_tolerance_of_f64() {
    let mut g = fast_gpu();
    let mut cpu = Device::cpu();
    let mut worst_all = (0f64, 0f64, 0f64);
    for (rows, classes, scale, seed) in [
        (7usize, 50_304usize, 8.0f32, 1u64),
        (5, 128_256, 4.0, 2),
        (33, 50_257, 16.0, 3),
        (9, 4_097, 30.0, 4),
        (64, 4_095, 8.0, 5),
        (300, 1_000, 8.0, 6),
        (33_000, 3, 4.0, 7),
        (2, 1, 1.0, 8),
        (1, 50_304, 0.0, 9),
    ] {
        let x = logits(rows, classes, scale, seed, true);
        let mut r = Rng::new(seed + 100);
        let t: Vec<f32> = (0..rows)
            .map(|_| (r.next() % classes as u64) as f32)
            .collect();
        for grad in [Some(0.37f32), None] {
            let (l, gr) = fast_xent(&mut g, &x, &t, grad);
            // The CPU op beside it: NaN in the same rows.
            let (xc, tc) = (up(&mut cpu, &x), up(&mut cpu, &t));
            let lc = cpu.alloc(DType::F32, rows);
            cpu.cross_entropy_rows(xc, tc, lc, grad).unwrap();
            let lcpu = down(&cpu, lc);
            for r in 0..rows {
                assert_eq!(l[r].is_nan(), lcpu[r].is_nan(), "row {r}: NaN as the CPU's");
                let xr = &x[r * classes..(r + 1) * classes];
                let ti = t[r] as usize;
                let (l64, g64) = xent64(xr, ti, grad.unwrap_or(1.0));
                let mx = xr.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
                let tol = 1e-5 * (1.0 + (xr[ti] as f64 - mx).abs() + (l64 + xr[ti] as f64 - mx));
                let w = worst(l[r], if lcpu[r].is_nan() { f64::NAN } else { l64 }, tol);
                worst_all.0 = worst_all.0.max(w);
                worst_all.2 = worst_all.2.max((l[r] - lcpu[r]).abs() as f64);
                if let Some(c) = grad {
                    for (j, &gv) in gr[r * classes..(r + 1) * classes].iter().enumerate() {
                        let p = g64[j] / f64::from(c) + if j == ti { 1.0 } else { 0.0 };
                        let want = if lcpu[r].is_nan() { f64::NAN } else { g64[j] };
                        let tol = f64::from(c.abs()) * (1e-5 * p.abs() + 2e-7);
                        worst_all.1 = worst_all.1.max(worst(gv, want, tol));
                    }
                }
            }
            for v in [xc, tc, lc] {
                cpu.free(v).unwrap();
            }
        }
    }
    println!(
        "cross_entropy_rows: worst loss error {:.3} of its tolerance, gradient {:.3}; \
         largest |fast − CPU| loss {:.3e}",
        worst_all.0, worst_all.1, worst_all.2
    );
    assert!(worst_all.0 <= 1.0 && worst_all.1 <= 1.0, "{worst_all:?}");
}

/// `cross_entropy_rows_bf16_grad`: the losses and the bf16 gradient are exactly the in-place
/// op's followed by a cast (rows of both kernels, edge rows, unaligned starts), on the fast and
/// the exact CUDA paths, and the fast kernel leaves the logits as they were.
#[test]
fn the_bf16_logits_gradient_is_the_in_place_one_cast() {
    for mode in [MatmulMode::Bf16, MatmulMode::Exact] {
        let mut g = gpu();
        g.set_matmul_mode(mode);
        for (rows, classes, off) in [(9, 50_304, 0), (5, 50_305, 1), (7, 300, 3), (6, 4099, 2)] {
            let x = logits(rows, classes, 8.0, 7, true);
            let t: Vec<f32> = (0..rows)
                .map(|r| ((r * 7919 + 13) % classes) as f32)
                .collect();
            let (want_l, want_g) = fast_xent(&mut g, &x, &t, Some(0.37));
            let buf = g.alloc(DType::F32, x.len() + off);
            let xv = buf.slice(off..off + x.len()).unwrap();
            g.upload(xv, &x).unwrap();
            let (tv, lv) = (up(&mut g, &t), g.alloc(DType::F32, rows));
            let yb = g.alloc(DType::Bf16, x.len() + off);
            let yv = yb.slice(off..off + x.len()).unwrap();
            g.cross_entropy_rows_bf16_grad(xv, tv, lv, 0.37, yv)
                .unwrap();
            let want_bf: Vec<u16> = want_g
                .iter()
                .map(|&v| half::bf16::from_f32(v).to_bits())
                .collect();
            let got_bf: Vec<u16> = g
                .download::<half::bf16>(yv)
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect();
            let what = format!("{mode:?} {rows}x{classes} +{off}");
            assert_eq!(bits(&down(&g, lv)), bits(&want_l), "losses {what}");
            assert_eq!(got_bf, want_bf, "bf16 gradient {what}");
            if mode == MatmulMode::Bf16 {
                assert_eq!(bits(&down(&g, xv)), bits(&x), "logits kept {what}");
            }
            for v in [buf, tv, lv, yb] {
                g.free(v).unwrap();
            }
        }
        let (x, t, l, y) = (
            g.alloc(DType::F32, 8),
            g.alloc(DType::F32, 2),
            g.alloc(DType::F32, 2),
            g.alloc(DType::F32, 8),
        );
        assert!(
            g.cross_entropy_rows_bf16_grad(x, t, l, 1.0, y).is_err(),
            "f32 dlogits"
        );
    }
}

#[test]
fn cross_entropy_and_embedding_report_bad_ids_at_the_next_read() {
    let mut g = fast_gpu();
    let classes = 5000;
    let x = up(&mut g, &logits(3, classes, 1.0, 1, false));
    for bad in [5000.0f32, 0.5, -1.0, f32::NAN] {
        let t = up(&mut g, &[1.0, bad, 2.0]);
        let l = g.alloc(DType::F32, 3);
        g.cross_entropy_rows(x, t, l, None).unwrap();
        let e = g.download::<f32>(l).unwrap_err();
        match &e {
            DeviceError::Invalid { what, reason } => {
                assert_eq!(*what, "cross_entropy_rows");
                assert!(
                    reason.contains("of row 1 ") && reason.contains("0..5000"),
                    "{reason}"
                );
            }
            e => panic!("{e}"),
        }
        // Reported once; the bad row's loss is NaN, the others are not.
        let ls = down(&g, l);
        assert!(
            ls[1].is_nan() && ls[0].is_finite() && ls[2].is_finite(),
            "{ls:?}"
        );
        let table = up(&mut g, &[1.0; 12]);
        let out = g.alloc(DType::F32, 6);
        let ids = up(&mut g, &[0.0, if bad == 5000.0 { 4.0 } else { bad }]);
        g.embedding(table, ids, out).unwrap();
        match g.synchronize().unwrap_err() {
            DeviceError::Invalid { what, reason } => {
                assert_eq!(what, "embedding");
                assert!(reason.contains("of row 1 "), "{reason}");
            }
            e => panic!("{e}"),
        }
        let o = down(&g, out);
        assert_eq!(&o[..3], &[1.0; 3]);
        assert!(o[3..].iter().all(|v| v.is_nan()));
    }
}

/// RMSNorm forward and backward in the fast mode against f64: `y`, `rstd` within 1e-5 relative;
/// `dx` within 1e-5 · rstd · (|g| + |x̂| · Σ|g x̂| / cols); `dweight` within
/// 1e-5 · (|dweight₀| + Σ_r |dy x̂|). Twice, identical bytes.
#[test]
fn rms_norm_within_tolerance_of_f64() {
    let mut g = fast_gpu();
    let mut worst_all = [0f64; 4];
    let eps = 1e-5f32;
    for (rows, cols, pad, seed) in [
        (7usize, 768usize, 0usize, 1u64),
        (33, 2048, 0, 2),
        (5, 4096, 0, 3),
        (1000, 64, 0, 4),
        (3, 37, 0, 5),
        (4, 8000, 0, 6),
        (6, 768, 1, 7),
        (2, 8193, 0, 8),
        (33_000, 64, 0, 9),
        (1, 1, 0, 10),
    ] {
        let mut r = Rng::new(seed);
        let mut draw = |n: usize, s: f32| (0..n).map(|_| r.unit() * s).collect::<Vec<f32>>();
        let (x, w, dy, dw0) = (
            draw(rows * cols, 3.0),
            draw(cols, 1.5),
            draw(rows * cols, 1.0),
            draw(cols, 0.1),
        );
        let mut runs = Vec::new();
        // Both runs at one CTA size of the float4 entries (`fast_rms_threads`), by case.
        let threads = if seed % 2 == 0 { 128 } else { 0 };
        g.set_cuda_kernel_variant("fast_rms_threads", threads)
            .unwrap();
        for _ in 0..2 {
            // `pad` puts the views off 16-byte alignment (the scalar slots).
            let buf = |g: &mut Device, v: &[f32]| {
                let b = g.alloc(DType::F32, v.len() + pad);
                let b = b.slice(pad..pad + v.len()).unwrap();
                g.upload(b, v).unwrap();
                b
            };
            let (xv, wv, dyv, dwv) = (
                buf(&mut g, &x),
                buf(&mut g, &w),
                buf(&mut g, &dy),
                buf(&mut g, &dw0),
            );
            let (yv, rv, dxv) = (buf(&mut g, &x), g.alloc(DType::F32, rows), buf(&mut g, &x));
            g.rms_norm(xv, wv, yv, rv, eps).unwrap();
            g.rms_norm_backward(xv, wv, rv, dyv, dxv, dwv).unwrap();
            runs.push([yv, rv, dxv, dwv].map(|v| down(&g, v)));
        }
        for (k, (a, b)) in runs[0].iter().zip(&runs[1]).enumerate() {
            assert_eq!(bits(a), bits(b), "output {k}: two runs");
        }
        let [y, rs, dx, dw] = &runs[0];
        let mut dw64: Vec<f64> = dw0.iter().map(|&v| v as f64).collect();
        let mut dw_mag: Vec<f64> = dw0.iter().map(|&v| (v as f64).abs()).collect();
        for r in 0..rows {
            let xr = &x[r * cols..(r + 1) * cols];
            let ss: f64 = xr.iter().map(|&v| (v as f64).powi(2)).sum();
            let r64 = 1.0 / (ss / cols as f64 + eps as f64).sqrt();
            worst_all[1] = worst_all[1].max(((rs[r] as f64 - r64) / r64).abs() / 1e-5);
            let rsf = rs[r] as f64; // the backward's input
            let (mut dot, mut mag) = (0f64, 0f64);
            for j in 0..cols {
                let (xh, gg) = (xr[j] as f64 * rsf, dy[r * cols + j] as f64 * w[j] as f64);
                dot += gg * xh;
                mag += (gg * xh).abs();
                dw64[j] += dy[r * cols + j] as f64 * xh;
                dw_mag[j] += (dy[r * cols + j] as f64 * xh).abs();
            }
            for j in 0..cols {
                let y64 = xr[j] as f64 * r64 * w[j] as f64;
                let tol = 1e-5 * y64.abs() + 1e-30;
                worst_all[0] = worst_all[0].max(worst(y[r * cols + j], y64, tol));
                let (xh, gg) = (xr[j] as f64 * rsf, dy[r * cols + j] as f64 * w[j] as f64);
                let dx64 = rsf * (gg - xh * dot / cols as f64);
                let tol = 1e-5 * rsf * (gg.abs() + xh.abs() * mag / cols as f64) + 1e-30;
                worst_all[2] = worst_all[2].max(worst(dx[r * cols + j], dx64, tol));
            }
        }
        for j in 0..cols {
            worst_all[3] = worst_all[3].max(worst(dw[j], dw64[j], 1e-5 * dw_mag[j] + 1e-30));
        }
    }
    println!("rms_norm: worst errors / tolerance: y, rstd, dx, dweight = {worst_all:.3?}");
    assert!(worst_all.iter().all(|&w| w <= 1.0), "{worst_all:?}");
}

/// RMSNorm's NaN rules: a NaN or Inf in a row makes that row's outputs NaN (as the exact op),
/// and other rows finite.
#[test]
fn rms_norm_non_finite_rows_as_the_exact_op() {
    let (rows, cols) = (4, 1024);
    let mut x = logits(rows, cols, 2.0, 3, false);
    x[5] = f32::NAN;
    x[cols + 7] = f32::INFINITY;
    let w = vec![1.0f32; cols];
    let run = |dev: &mut Device| {
        let (xv, wv) = (up(dev, &x), up(dev, &w));
        let (yv, rv) = (
            dev.alloc(DType::F32, rows * cols),
            dev.alloc(DType::F32, rows),
        );
        dev.rms_norm(xv, wv, yv, rv, 1e-6).unwrap();
        (down(dev, yv), down(dev, rv))
    };
    let (yf, rf) = run(&mut fast_gpu());
    let (yc, rc) = run(&mut Device::cpu());
    for r in 0..rows {
        assert_eq!(
            rf[r].is_nan(),
            rc[r].is_nan(),
            "rstd of row {r}: {} vs {}",
            rf[r],
            rc[r]
        );
        for j in 0..cols {
            let (a, b) = (yf[r * cols + j], yc[r * cols + j]);
            assert_eq!(a.is_nan(), b.is_nan(), "y[{r}, {j}]: {a} vs {b}");
        }
    }
}

/// RMSNorm into a bf16 `y` is the f32 `y` rounded once (the same rstd), on the fast and the
/// exact CUDA paths, aligned (float4 entries) and not.
#[test]
fn rms_norm_into_bf16_is_the_f32_output_rounded() {
    for mode in [MatmulMode::Bf16, MatmulMode::Exact] {
        let mut g = gpu();
        g.set_matmul_mode(mode);
        for (rows, cols, pad) in [(37usize, 2048usize, 0usize), (5, 768, 1), (3, 1001, 0)] {
            let n = rows * cols;
            let xb = g.alloc(DType::F32, n + pad);
            let x = xb.slice(pad..pad + n).unwrap();
            g.upload(x, &logits(rows, cols, 3.0, 9, false)).unwrap();
            let w = up(&mut g, &logits(1, cols, 1.5, 10, false));
            let (y, r1, r2) = (
                g.alloc(DType::F32, n),
                g.alloc(DType::F32, rows),
                g.alloc(DType::F32, rows),
            );
            let yh = g.alloc(DType::Bf16, n);
            g.rms_norm(x, w, y, r1, 1e-5).unwrap();
            g.rms_norm(x, w, yh, r2, 1e-5).unwrap();
            let want: Vec<u16> = down(&g, y)
                .iter()
                .map(|&v| half::bf16::from_f32(v).to_bits())
                .collect();
            let got: Vec<u16> = g
                .download::<half::bf16>(yh)
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect();
            assert_eq!(got, want, "{mode:?} {rows}x{cols}+{pad}: y");
            assert_eq!(bits(&down(&g, r1)), bits(&down(&g, r2)), "rstd");
            for v in [xb, w, y, r1, r2, yh] {
                g.free(v).unwrap();
            }
        }
    }
}

/// Runs `f` on the CPU and on the fast GPU (twice) and asserts identical bytes of `outs(f)`
/// (NaN matches NaN).
fn same_bytes(name: &str, f: impl Fn(&mut Device) -> Vec<Vec<f32>>) {
    let cpu = f(&mut Device::cpu());
    let mut g = fast_gpu();
    let a = f(&mut g);
    let b = f(&mut g);
    assert!(
        g.host_fallback_calls().is_empty(),
        "{name}: no host fallback"
    );
    for (k, ((c, x), y)) in cpu.iter().zip(&a).zip(&b).enumerate() {
        assert_eq!(bits(x), bits(y), "{name}: output {k}, two runs");
        assert_eq!(c.len(), x.len());
        for (i, (p, q)) in c.iter().zip(x).enumerate() {
            assert!(
                p.to_bits() == q.to_bits() || (p.is_nan() && q.is_nan()),
                "{name}: output {k}[{i}]: cpu {p:e} vs fast {q:e}"
            );
        }
    }
}

#[test]
fn rope_swiglu_and_embedding_give_the_exact_bytes() {
    for (rows, heads, hd, seq, pad) in [
        (64usize, 12usize, 64usize, 16usize, 0usize),
        (7, 3, 8, 7, 0),
        (5, 2, 6, 5, 0),
        (9, 4, 128, 3, 1),
    ] {
        for (inverse, in_place) in [(false, false), (true, true), (false, true)] {
            same_bytes("rope", |dev| {
                let n = rows * heads * hd;
                let half = hd / 2;
                let xb = dev.alloc(DType::F32, n + pad);
                let x = xb.slice(pad..pad + n).unwrap();
                dev.upload(x, &values(n, 3, true)).unwrap();
                let (c, s) = (
                    up(dev, &finite(seq * half, 4)),
                    up(dev, &finite(seq * half, 5)),
                );
                let y = if in_place {
                    x
                } else {
                    dev.alloc(DType::F32, n)
                };
                let spec = RopeSpec {
                    seq,
                    heads,
                    head_dim: hd,
                    inverse,
                };
                dev.rope(x, y, c, s, &spec).unwrap();
                let mut got = vec![down(dev, y)];
                if !in_place {
                    // A bf16 y: the same values rounded once.
                    let yb = dev.alloc(DType::Bf16, n + pad).slice(pad..pad + n).unwrap();
                    dev.rope(x, yb, c, s, &spec).unwrap();
                    let h = dev.download::<half::bf16>(yb).unwrap();
                    got.push(h.iter().map(|x| x.to_f32()).collect());
                }
                got
            });
        }
    }
    for (n, pad) in [(1usize, 0usize), (3, 0), (4, 0), (1_000_003, 0), (1001, 1)] {
        same_bytes("swiglu", |dev| {
            let buf = |dev: &mut Device, seed| {
                let b = dev.alloc(DType::F32, n + pad).slice(pad..pad + n).unwrap();
                dev.upload(b, &values(n, seed, true)).unwrap();
                b
            };
            let (gt, u, d) = (buf(dev, 1), buf(dev, 2), buf(dev, 3));
            let (o, dg, du) = (buf(dev, 4), buf(dev, 5), buf(dev, 6));
            dev.swiglu(gt, u, o).unwrap();
            dev.swiglu_backward(gt, u, d, dg, du).unwrap();
            // The bf16 outputs (the product, dup): the same values rounded once.
            let half = |dev: &mut Device| dev.alloc(DType::Bf16, n + pad).slice(pad..pad + n);
            let (ob, dgb, dub) = (half(dev).unwrap(), buf(dev, 7), half(dev).unwrap());
            dev.swiglu(gt, u, ob).unwrap();
            dev.swiglu_backward(gt, u, d, dgb, dub).unwrap();
            let wide = |dev: &Device, v: View| -> Vec<f32> {
                let h = dev.download::<half::bf16>(v).unwrap();
                h.iter().map(|x| x.to_f32()).collect()
            };
            vec![
                down(dev, o),
                down(dev, dg),
                down(dev, du),
                wide(dev, ob),
                down(dev, dgb),
                wide(dev, dub),
            ]
        });
    }
    for (rows, vocab, dim, dtype) in [
        (300usize, 50usize, 768usize, DType::F32),
        (13, 7, 37, DType::F32),
        (64, 1000, 64, DType::Bf16),
    ] {
        same_bytes("embedding", |dev| {
            let table = dev.alloc(dtype, vocab * dim);
            dev.write_bytes(table, &encode(dtype, &values(vocab * dim, 1, true)))
                .unwrap();
            let mut r = Rng::new(2);
            let ids: Vec<f32> = (0..rows)
                .map(|_| (r.next() % vocab as u64) as f32)
                .collect();
            let idv = up(dev, &ids);
            let out = dev.alloc(DType::F32, rows * dim);
            dev.embedding(table, idv, out).unwrap();
            vec![down(dev, out)]
        });
    }
}

/// Median µs of one call of `f`: seven samples of ten calls queued back to back, each sample
/// then synchronised (so one stream sync, and the fast mode's id-error check, spreads over ten
/// calls instead of adding to each), after three warm-up calls.
fn us(g: &mut Device, mut f: impl FnMut(&mut Device)) -> f64 {
    for _ in 0..3 {
        f(g);
    }
    g.synchronize().unwrap();
    let mut t: Vec<f64> = (0..7)
        .map(|_| {
            let s = std::time::Instant::now();
            for _ in 0..10 {
                f(g);
            }
            g.synchronize().unwrap();
            s.elapsed().as_secs_f64() * 1e6 / 10.0
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[3]
}

/// One row of the bandwidth table: `bytes` moved by the kernel in `t` µs against a device copy
/// of `bytes / 2` (which moves `bytes`).
fn report(g: &mut Device, name: &str, shape: &str, bytes: usize, t: f64) -> f64 {
    let half = (bytes / 2).div_ceil(4);
    let (a, b) = (g.alloc(DType::F32, half), g.alloc(DType::F32, half));
    let tc = us(g, |g| g.copy(a, b).unwrap());
    g.free(a).unwrap();
    g.free(b).unwrap();
    let ratio = tc / t;
    println!(
        "{name:<22} {shape:<28} {:>9.1} MB {t:>9.1} us {:>7.0} GB/s  copy {tc:>8.1} us  {ratio:.2}x",
        bytes as f64 / 1e6,
        bytes as f64 / t / 1e3
    );
    ratio
}

/// The bandwidth table of every fast kernel at the 125M and 1B shapes (rows 8192 and 16384,
/// dim 768 / 2048, ffn 2048 / 8192, vocab 50,304 / 128,256; the cross-entropy on one chunk of
/// the model's 64 MiB of logits, and on 4096 rows), beside the exact kernels.
#[test]
#[ignore = "a benchmark: cargo test --release --features cuda --test cuda_fast -- --ignored --nocapture"]
fn bandwidth() {
    let mut g = gpu();
    println!(
        "{:<22} {:<28} {:>12} {:>12} {:>12}",
        "kernel", "shape", "bytes", "time", "GB/s"
    );
    for (label, rows, dim, ffn, vocab) in [
        ("125M", 8192usize, 768usize, 2048usize, 50_304usize),
        ("1B", 16_384, 2048, 8192, 128_256),
    ] {
        for mode in [MatmulMode::Bf16, MatmulMode::Exact] {
            g.set_matmul_mode(mode);
            let m = if mode == MatmulMode::Bf16 {
                "fast"
            } else {
                "exact"
            };
            let n = rows * dim;
            let x = g.alloc(DType::F32, n);
            g.upload(x, &logits(rows, dim, 2.0, 1, false)).unwrap();
            let (w, y, dy, dx) = (
                g.alloc(DType::F32, dim),
                g.alloc(DType::F32, n),
                g.alloc(DType::F32, n),
                g.alloc(DType::F32, n),
            );
            g.upload(w, &vec![1.0; dim]).unwrap();
            g.copy(x, dy).unwrap();
            let (rs, dw) = (g.alloc(DType::F32, rows), g.alloc(DType::F32, dim));
            let shape = format!("{label} {rows}x{dim}");
            let t = us(&mut g, |g| g.rms_norm(x, w, y, rs, 1e-5).unwrap());
            report(&mut g, &format!("rms_norm {m}"), &shape, 8 * n, t);
            let t = us(&mut g, |g| {
                g.rms_norm_backward(x, w, rs, dy, dx, dw).unwrap()
            });
            report(&mut g, &format!("rms_norm_bwd {m}"), &shape, 12 * n, t);
            if mode == MatmulMode::Bf16 {
                g.set_cuda_kernel_variant("fast_rms_threads", 128).unwrap();
                let t = us(&mut g, |g| g.rms_norm(x, w, y, rs, 1e-5).unwrap());
                report(&mut g, "rms_norm t128", &shape, 8 * n, t);
                let t = us(&mut g, |g| {
                    g.rms_norm_backward(x, w, rs, dy, dx, dw).unwrap()
                });
                report(&mut g, "rms_norm_bwd t128", &shape, 12 * n, t);
                g.set_cuda_kernel_variant("fast_rms_threads", 0).unwrap();
            }
            let half = 32;
            let (c, s) = (
                g.alloc(DType::F32, 1024 * half),
                g.alloc(DType::F32, 1024 * half),
            );
            let spec = RopeSpec {
                seq: 1024,
                heads: dim / 64,
                head_dim: 64,
                inverse: false,
            };
            let t = us(&mut g, |g| g.rope(x, x, c, s, &spec).unwrap());
            report(&mut g, &format!("rope {m}"), &shape, 8 * n, t);
            let ids: Vec<f32> = (0..rows).map(|r| ((r * 7919) % vocab) as f32).collect();
            let idv = up(&mut g, &ids);
            let table = g.alloc(DType::F32, vocab * dim);
            let t = us(&mut g, |g| g.embedding(table, idv, y).unwrap());
            report(&mut g, &format!("embedding {m}"), &shape, 8 * n, t);
            let t = us(&mut g, |g| g.embedding_backward(idv, dy, table).unwrap());
            report(&mut g, &format!("embedding_bwd {m}"), &shape, 12 * n, t);
            for v in [y, dy, dx, table] {
                g.free(v).unwrap();
            }
            let nf = rows * ffn;
            let (gt, u, o, dg, du) = (
                g.alloc(DType::F32, nf),
                g.alloc(DType::F32, nf),
                g.alloc(DType::F32, nf),
                g.alloc(DType::F32, nf),
                g.alloc(DType::F32, nf),
            );
            let shape = format!("{label} {rows}x{ffn}");
            let t = us(&mut g, |g| g.swiglu(gt, u, o).unwrap());
            report(&mut g, &format!("swiglu {m}"), &shape, 12 * nf, t);
            let t = us(&mut g, |g| g.swiglu_backward(gt, u, o, dg, du).unwrap());
            report(&mut g, &format!("swiglu_bwd {m}"), &shape, 20 * nf, t);
            for v in [gt, u, o, dg, du, x] {
                g.free(v).unwrap();
            }
            let chunk = (64usize << 20) / 4 / vocab;
            // The exact kernels take a thread per row: the model's chunk only.
            let sizes = if mode == MatmulMode::Bf16 {
                vec![chunk, 4096]
            } else {
                vec![chunk]
            };
            for xr in sizes {
                let lg = g.alloc(DType::F32, xr * vocab);
                g.upload(lg, &logits(xr, vocab, 8.0, 2, false)).unwrap();
                let t: Vec<f32> = (0..xr).map(|r| ((r * 31) % vocab) as f32).collect();
                let (tv, lv) = (up(&mut g, &t), g.alloc(DType::F32, xr));
                let shape = format!("{label} {xr}x{vocab}");
                // The gradient path overwrites its logits: re-running it on its own output
                // is the same traffic (finite values throughout).
                let t = us(&mut g, |g| {
                    g.cross_entropy_rows(lg, tv, lv, Some(1e-4)).unwrap()
                });
                report(&mut g, &format!("xent+grad {m}"), &shape, 8 * xr * vocab, t);
                let yb = g.alloc(DType::Bf16, xr * vocab);
                let t = us(&mut g, |g| {
                    g.cross_entropy_rows_bf16_grad(lg, tv, lv, 1e-4, yb)
                        .unwrap()
                });
                report(
                    &mut g,
                    &format!("xent+bf16 grad {m}"),
                    &shape,
                    6 * xr * vocab,
                    t,
                );
                g.free(yb).unwrap();
                if mode == MatmulMode::Bf16 {
                    // The variants (`Device::set_cuda_kernel_variant`), then the defaults again.
                    for (exp, threads) in [(1, 1024), (0, 512), (0, 256), (1, 512)] {
                        g.set_cuda_kernel_variant("fast_xent_exp", exp).unwrap();
                        g.set_cuda_kernel_variant("fast_xent_threads", threads)
                            .unwrap();
                        let t = us(&mut g, |g| {
                            g.cross_entropy_rows(lg, tv, lv, Some(1e-4)).unwrap()
                        });
                        let name = format!("xent+grad e{exp} t{threads}");
                        report(&mut g, &name, &shape, 8 * xr * vocab, t);
                    }
                    g.set_cuda_kernel_variant("fast_xent_exp", 0).unwrap();
                    g.set_cuda_kernel_variant("fast_xent_threads", 0).unwrap();
                }
                let t = us(&mut g, |g| g.cross_entropy_rows(lg, tv, lv, None).unwrap());
                report(&mut g, &format!("xent {m}"), &shape, 4 * xr * vocab, t);
                for v in [lg, tv, lv] {
                    g.free(v).unwrap();
                }
            }
            for v in [w, rs, dw, c, s, idv] {
                g.free(v).unwrap();
            }
        }
    }
}
