//! Causal grouped-query attention on the CPU: exact bits against a straightforward f32
//! transcription of the documented order (materialising each head's `[seq, seq]` scores, which
//! the op never does), values against a plain f64 softmax over the full causal row, the
//! backward against the f64 analytic gradient, independence of the batch split, and the shape
//! errors.

// The transcription indexes as the formulas do.
#![allow(clippy::needless_range_loop)]

mod common;

use common::{download, upload};
use lowbit_dev_support::rng::xorshift32_signed;
use lowbit_device::{AttentionSpec, Device, DeviceError};

fn values(n: usize, seed: u32, scale: f32) -> Vec<f32> {
    xorshift32_signed(
        seed.wrapping_mul(2_246_822_519).wrapping_add(374_761_393) | 1,
        n,
        scale,
    )
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

/// Element offsets of `q[b, i, h, d]` / `k[b, j, g, d]` / `lse[b, h, i]`.
fn qi(s: &AttentionSpec, b: usize, i: usize, h: usize) -> usize {
    ((b * s.seq + i) * s.heads + h) * s.head_dim
}
fn ki(s: &AttentionSpec, b: usize, j: usize, g: usize) -> usize {
    ((b * s.seq + j) * s.kv_heads + g) * s.head_dim
}
fn li(s: &AttentionSpec, b: usize, h: usize, i: usize) -> usize {
    (b * s.heads + h) * s.seq + i
}

fn exp32(x: f32) -> f32 {
    f64::from(x).exp() as f32
}

struct Inputs {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    dout: Vec<f32>,
}

fn inputs(s: &AttentionSpec, seed: u32, mag: f32) -> Inputs {
    let qn = s.batch * s.seq * s.heads * s.head_dim;
    let kn = s.batch * s.seq * s.kv_heads * s.head_dim;
    Inputs {
        q: values(qn, seed, mag),
        k: values(kn, seed + 1, mag),
        v: values(kn, seed + 2, 1.0),
        dout: values(qn, seed + 3, 1.0),
    }
}

/// The f32 transcription: full score matrices per (b, h), the sums written out index by index.
#[allow(clippy::type_complexity)]
fn reference_f32(
    s: &AttentionSpec,
    x: &Inputs,
) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
    let (n, hd, rep) = (s.seq, s.head_dim, s.heads / s.kv_heads);
    let mut out = vec![0f32; x.q.len()];
    let mut lse = vec![0f32; s.batch * s.heads * n];
    let mut dq = vec![0f32; x.q.len()];
    let (mut dk, mut dv) = (vec![0f32; x.k.len()], vec![0f32; x.k.len()]);
    // p[h][i][j], ds[h][i][j] of one batch element.
    for b in 0..s.batch {
        let mut p = vec![vec![vec![0f32; n]; n]; s.heads];
        let mut ds = vec![vec![vec![0f32; n]; n]; s.heads];
        for h in 0..s.heads {
            let g = h / rep;
            let mut sc = vec![vec![0f32; n]; n];
            for i in 0..n {
                for j in 0..=i {
                    let mut acc = 0f32;
                    for d in 0..hd {
                        acc += x.q[qi(s, b, i, h) + d] * x.k[ki(s, b, j, g) + d];
                    }
                    sc[i][j] = acc * s.scale;
                }
                let mut m = f32::NEG_INFINITY;
                for j in 0..=i {
                    if sc[i][j] > m {
                        m = sc[i][j];
                    }
                }
                let e: Vec<f32> = (0..=i).map(|j| exp32(sc[i][j] - m)).collect();
                let l = e.iter().fold(0f32, |a, &e| a + e);
                for d in 0..hd {
                    let mut acc = 0f32;
                    for j in 0..=i {
                        acc += e[j] * x.v[ki(s, b, j, g) + d];
                    }
                    out[qi(s, b, i, h) + d] = acc / l;
                }
                lse[li(s, b, h, i)] = m + (f64::from(l).ln() as f32);
            }
            for i in 0..n {
                let mut dd = 0f32;
                for d in 0..hd {
                    dd += x.dout[qi(s, b, i, h) + d] * out[qi(s, b, i, h) + d];
                }
                for j in 0..=i {
                    let pij = exp32(sc[i][j] - lse[li(s, b, h, i)]);
                    let mut dp = 0f32;
                    for d in 0..hd {
                        dp += x.dout[qi(s, b, i, h) + d] * x.v[ki(s, b, j, g) + d];
                    }
                    p[h][i][j] = pij;
                    ds[h][i][j] = (pij * (dp - dd)) * s.scale;
                }
                for d in 0..hd {
                    let mut acc = 0f32;
                    for j in 0..=i {
                        acc += ds[h][i][j] * x.k[ki(s, b, j, g) + d];
                    }
                    dq[qi(s, b, i, h) + d] = acc;
                }
            }
        }
        for g in 0..s.kv_heads {
            for j in 0..n {
                for d in 0..hd {
                    let (mut ak, mut av) = (0f32, 0f32);
                    for h in g * rep..(g + 1) * rep {
                        for i in j..n {
                            ak += ds[h][i][j] * x.q[qi(s, b, i, h) + d];
                            av += p[h][i][j] * x.dout[qi(s, b, i, h) + d];
                        }
                    }
                    dk[ki(s, b, j, g) + d] = ak;
                    dv[ki(s, b, j, g) + d] = av;
                }
            }
        }
    }
    (out, lse, dq, dk, dv)
}

/// Runs both ops on `dev` (inputs placed at an offset inside larger buffers).
#[allow(clippy::type_complexity)]
fn run(
    dev: &mut Device,
    s: &AttentionSpec,
    x: &Inputs,
) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
    let at = |dev: &mut Device, vals: &[f32]| {
        let pad = [vec![7.0f32; 3], vals.to_vec(), vec![7.0; 5]].concat();
        upload(dev, &pad).slice(3..3 + vals.len()).unwrap()
    };
    let (q, k, v, dout) = (
        at(dev, &x.q),
        at(dev, &x.k),
        at(dev, &x.v),
        at(dev, &x.dout),
    );
    let out = at(dev, &vec![1.0; x.q.len()]);
    let lse = at(dev, &vec![1.0; s.batch * s.heads * s.seq]);
    let dq = at(dev, &vec![1.0; x.q.len()]);
    let (dk, dv) = (
        at(dev, &vec![1.0; x.k.len()]),
        at(dev, &vec![1.0; x.k.len()]),
    );
    dev.attention(q, k, v, out, lse, s).unwrap();
    dev.attention_backward(q, k, v, out, lse, dout, dq, dk, dv, s)
        .unwrap();
    (
        download(dev, out),
        download(dev, lse),
        download(dev, dq),
        download(dev, dk),
        download(dev, dv),
    )
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn exact_bits_against_the_f32_transcription() {
    for (i, &(b, n, h, g, hd)) in [
        (1, 1, 1, 1, 1),
        (2, 5, 2, 2, 3),
        (1, 7, 4, 2, 8),
        (3, 6, 4, 1, 16),
        (2, 9, 8, 2, 5),
    ]
    .iter()
    .enumerate()
    {
        let s = spec(b, n, h, g, hd);
        let x = inputs(&s, 10 * i as u32 + 1, 3.0);
        let got = run(&mut Device::cpu(), &s, &x);
        let want = reference_f32(&s, &x);
        for (name, g, w) in [
            ("out", &got.0, &want.0),
            ("lse", &got.1, &want.1),
            ("dq", &got.2, &want.2),
            ("dk", &got.3, &want.3),
            ("dv", &got.4, &want.4),
        ] {
            assert_eq!(bits(g), bits(w), "{name} of {s:?}");
        }
    }
}

/// The f64 forward, a plain softmax over the causal row: `(out, lse)`.
fn forward_f64(s: &AttentionSpec, q: &[f64], k: &[f64], v: &[f64]) -> (Vec<f64>, Vec<f64>) {
    let (n, hd, rep) = (s.seq, s.head_dim, s.heads / s.kv_heads);
    let sc = f64::from(s.scale);
    let mut out = vec![0f64; q.len()];
    let mut lse = vec![0f64; s.batch * s.heads * n];
    for b in 0..s.batch {
        for h in 0..s.heads {
            for i in 0..n {
                let sco: Vec<f64> = (0..=i)
                    .map(|j| {
                        (0..hd)
                            .map(|d| q[qi(s, b, i, h) + d] * k[ki(s, b, j, h / rep) + d])
                            .sum::<f64>()
                            * sc
                    })
                    .collect();
                let z: f64 = sco.iter().map(|x| x.exp()).sum();
                lse[li(s, b, h, i)] = z.ln();
                for d in 0..hd {
                    out[qi(s, b, i, h) + d] = (0..=i)
                        .map(|j| sco[j].exp() / z * v[ki(s, b, j, h / rep) + d])
                        .sum();
                }
            }
        }
    }
    (out, lse)
}

fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| f64::from(x)).collect()
}

fn max_rel(got: &[f32], want: &[f64]) -> f64 {
    let mag = want.iter().fold(0f64, |m, w| m.max(w.abs())).max(1e-30);
    got.iter()
        .zip(want)
        .fold(0f64, |m, (&g, &w)| m.max((f64::from(g) - w).abs() / mag))
}

#[test]
fn values_against_f64_softmax_and_gradients_against_f64_differences() {
    let s = spec(2, 6, 4, 2, 8);
    let x = inputs(&s, 99, 2.0);
    let (out, lse, dq, dk, dv) = run(&mut Device::cpu(), &s, &x);
    let (q, k, v, dout) = (f64s(&x.q), f64s(&x.k), f64s(&x.v), f64s(&x.dout));
    let (want_out, want_lse) = forward_f64(&s, &q, &k, &v);
    assert!(max_rel(&out, &want_out) < 1e-5, "out");
    assert!(max_rel(&lse, &want_lse) < 1e-5, "lse");
    // L = Σ dout·out; central differences of the f64 forward.
    let loss = |q: &[f64], k: &[f64], v: &[f64]| {
        let (o, _) = forward_f64(&s, q, k, v);
        o.iter().zip(&dout).map(|(o, d)| o * d).sum::<f64>()
    };
    let h = 1e-6;
    let diff = |which: usize, len: usize| -> Vec<f64> {
        (0..len)
            .map(|e| {
                let mut xs = [q.clone(), k.clone(), v.clone()];
                xs[which][e] += h;
                let lp = loss(&xs[0], &xs[1], &xs[2]);
                xs[which][e] -= 2.0 * h;
                let lm = loss(&xs[0], &xs[1], &xs[2]);
                (lp - lm) / (2.0 * h)
            })
            .collect()
    };
    for (name, got, which) in [("dq", &dq, 0), ("dk", &dk, 1), ("dv", &dv, 2)] {
        let rel = max_rel(got, &diff(which, got.len()));
        assert!(
            rel < 1e-4,
            "{name}: worst error {rel:e} of the max gradient"
        );
    }
}

#[test]
fn batch_split_does_not_change_bytes() {
    let s = spec(5, 4, 2, 1, 6);
    let x = inputs(&s, 7, 3.0);
    let whole = run(&mut Device::cpu(), &s, &x);
    let one = AttentionSpec { batch: 1, ..s };
    let (qn, kn) = (4 * 2 * 6, 4 * 6);
    for b in 0..5 {
        let xb = Inputs {
            q: x.q[b * qn..(b + 1) * qn].to_vec(),
            k: x.k[b * kn..(b + 1) * kn].to_vec(),
            v: x.v[b * kn..(b + 1) * kn].to_vec(),
            dout: x.dout[b * qn..(b + 1) * qn].to_vec(),
        };
        let part = run(&mut Device::cpu(), &one, &xb);
        assert_eq!(bits(&part.0), bits(&whole.0[b * qn..(b + 1) * qn]));
        assert_eq!(bits(&part.1), bits(&whole.1[b * 8..(b + 1) * 8]));
        assert_eq!(bits(&part.2), bits(&whole.2[b * qn..(b + 1) * qn]));
        assert_eq!(bits(&part.3), bits(&whole.3[b * kn..(b + 1) * kn]));
        assert_eq!(bits(&part.4), bits(&whole.4[b * kn..(b + 1) * kn]));
    }
}

#[test]
fn large_scores_stay_finite() {
    // Scores far beyond exp's range: the maximum subtraction keeps every row finite.
    let s = AttentionSpec {
        scale: 1.0,
        ..spec(1, 8, 2, 1, 4)
    };
    let x = inputs(&s, 3, 30.0);
    let (out, lse, dq, dk, dv) = run(&mut Device::cpu(), &s, &x);
    for v in [&out, &lse, &dq, &dk, &dv] {
        assert!(v.iter().all(|x| x.is_finite()));
    }
}

#[test]
fn bad_shapes_are_errors_and_write_nothing() {
    let mut dev = Device::cpu();
    let ok = spec(1, 3, 4, 2, 4);
    let qv = dev.alloc(lowbit_device::DType::F32, 3 * 4 * 4);
    let kv = dev.alloc(lowbit_device::DType::F32, 3 * 2 * 4);
    let vv = dev.alloc(lowbit_device::DType::F32, 3 * 2 * 4);
    let out = upload(&mut dev, &[5.0; 3 * 4 * 4]);
    let lse = upload(&mut dev, &[5.0; 4 * 3]);
    let bad = |dev: &mut Device, s: AttentionSpec, k: lowbit_device::View, contains: &str| {
        let e = dev.attention(qv, k, vv, out, lse, &s).unwrap_err();
        assert!(
            matches!(&e, DeviceError::Invalid { what: "attention", reason } if reason.contains(contains)),
            "{e}"
        );
        let e = dev
            .attention_backward(qv, k, vv, out, lse, out, out, kv, vv, &s)
            .unwrap_err();
        assert!(matches!(e, DeviceError::Invalid { .. }), "{e}");
    };
    bad(
        &mut dev,
        AttentionSpec { kv_heads: 3, ..ok },
        kv,
        "kv heads",
    );
    bad(
        &mut dev,
        AttentionSpec { kv_heads: 0, ..ok },
        kv,
        "kv heads",
    );
    bad(
        &mut dev,
        AttentionSpec { head_dim: 0, ..ok },
        kv,
        "head_dim",
    );
    bad(
        &mut dev,
        AttentionSpec {
            head_dim: 257,
            ..ok
        },
        kv,
        "head_dim",
    );
    bad(&mut dev, AttentionSpec { seq: 4, ..ok }, kv, "q has");
    bad(&mut dev, ok, kv.slice(0..20).unwrap(), "k has");
    let half = dev.alloc(lowbit_device::DType::Bf16, 3 * 2 * 4);
    let e = dev.attention(qv, half, vv, out, lse, &ok).unwrap_err();
    assert!(
        matches!(e, DeviceError::Invalid { .. } | DeviceError::DType { .. }),
        "{e}"
    );
    assert!(download(&dev, out).iter().all(|&x| x == 5.0));
    assert!(download(&dev, lse).iter().all(|&x| x == 5.0));
    // Aliased outputs are refused by the view checks.
    assert!(dev.attention(qv, kv, vv, qv, lse, &ok).is_err());
    // Empty shapes are fine.
    let empty = spec(0, 0, 4, 2, 4);
    let z = dev.alloc(lowbit_device::DType::F32, 0);
    dev.attention(z, z, z, z, z, &empty).unwrap();
}
