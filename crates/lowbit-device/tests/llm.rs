//! Decoder ops (embedding, RoPE, SwiGLU, per-row cross-entropy) on the CPU: values against
//! independent host computations, gradients against f64 central differences, and the argument
//! checks (bad ids, wrong lengths, odd head_dim, seq > max_seq).

mod common;

use common::{download, round_to, upload, upload_as};
use lowbit_dev_support::rng::xorshift32_signed;
use lowbit_device::{DType, Device, DeviceError, RopeSpec};

fn values(n: usize, seed: u32, scale: f32) -> Vec<f32> {
    xorshift32_signed(
        seed.wrapping_mul(2_246_822_519).wrapping_add(374_761_393) | 1,
        n,
        scale,
    )
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn invalid(e: DeviceError, what: &str, needle: &str) {
    match &e {
        DeviceError::Invalid { what: w, reason } => {
            assert_eq!(*w, what, "{e}");
            assert!(reason.contains(needle), "{e}");
        }
        _ => panic!("expected Invalid from {what}, got {e}"),
    }
}

#[test]
fn embedding_gathers_rows_of_any_float_table() {
    let (vocab, dim) = (6, 5);
    let ids = [3.0f32, 0.0, 5.0, 3.0];
    for d in [DType::F32, DType::Bf16, DType::F16] {
        let mut dev = Device::cpu();
        let tv = values(vocab * dim, 1, 2.0);
        let table = upload_as(&mut dev, d, &tv);
        let rounded: Vec<f32> = tv.iter().map(|&v| common::round_to(d, v)).collect();
        let idv = upload(&mut dev, &ids);
        let out = dev.alloc(DType::F32, ids.len() * dim);
        dev.embedding(table, idv, out).unwrap();
        let want: Vec<f32> = ids
            .iter()
            .flat_map(|&i| rounded[i as usize * dim..(i as usize + 1) * dim].to_vec())
            .collect();
        assert_eq!(bits(&download(&dev, out)), bits(&want), "{d:?}");
    }
}

#[test]
fn embedding_rejects_bad_ids_and_shapes() {
    let mut dev = Device::cpu();
    let table = upload(&mut dev, &values(12, 2, 1.0));
    let out = dev.alloc(DType::F32, 6);
    for (bad, needle) in [
        (4.0f32, "row 1"),
        (1.5, "1.5"),
        (-1.0, "-1"),
        (f32::NAN, "NaN"),
    ] {
        let ids = upload(&mut dev, &[0.0, bad]);
        invalid(
            dev.embedding(table, ids, out).unwrap_err(),
            "embedding",
            needle,
        );
        let e = dev.embedding_backward(ids, out, table).unwrap_err();
        invalid(e, "embedding_backward", needle);
    }
    assert_eq!(download(&dev, out), [0.0; 6], "nothing written");
    let ids = upload(&mut dev, &[0.0, 1.0]);
    let odd = dev.alloc(DType::F32, 7);
    assert!(dev.embedding(table, ids, odd).is_err());
    let table5 = dev.alloc(DType::F32, 10);
    assert!(
        dev.embedding(table5, ids, out).is_err(),
        "10 is no whole rows of 3"
    );
    let f16_ids = dev.alloc(DType::F16, 2);
    assert!(matches!(
        dev.embedding(table, f16_ids, out),
        Err(DeviceError::DType { .. })
    ));
}

#[test]
fn embedding_backward_scatter_adds_in_row_order() {
    let (vocab, dim) = (5, 3);
    let ids = [2.0f32, 4.0, 2.0, 0.0, 2.0, 4.0];
    let mut dev = Device::cpu();
    let dyv = values(ids.len() * dim, 3, 1.0);
    let gv = values(vocab * dim, 4, 1.0);
    let (idv, dy, grad) = (
        upload(&mut dev, &ids),
        upload(&mut dev, &dyv),
        upload(&mut dev, &gv),
    );
    dev.embedding_backward(idv, dy, grad).unwrap();
    let mut want = gv.clone();
    for v in 0..vocab {
        let rows: Vec<usize> = (0..ids.len()).filter(|&r| ids[r] as usize == v).collect();
        if rows.is_empty() {
            continue;
        }
        for c in 0..dim {
            let s = rows.iter().fold(0f32, |s, &r| s + dyv[r * dim + c]);
            want[v * dim + c] = gv[v * dim + c] + s;
        }
    }
    assert_eq!(bits(&download(&dev, grad)), bits(&want));
    // Rows 1 and 3 hold no id: untouched, bit for bit.
    assert_eq!(
        bits(&download(&dev, grad)[dim..2 * dim]),
        bits(&gv[dim..2 * dim])
    );
}

/// The rotation in f64 of the rounded products, as the spec orders it (independent code).
fn rope_ref(x: &[f32], cos: &[f32], sin: &[f32], spec: &RopeSpec) -> Vec<f32> {
    let (hd, half) = (spec.head_dim, spec.head_dim / 2);
    let mut y = vec![0f32; x.len()];
    for (e, y) in y.iter_mut().enumerate() {
        let row = e / (spec.heads * hd);
        let i = e % hd;
        let base = e - i;
        let pos = row % spec.seq;
        let j = i % half;
        let (a, b) = (x[base + j], x[base + j + half]);
        let (c, s) = (cos[pos * half + j], sin[pos * half + j]);
        let sign = if spec.inverse { -1.0 } else { 1.0 };
        *y = if i < half {
            a * c - sign * (b * s)
        } else {
            b * c + sign * (a * s)
        };
    }
    y
}

#[test]
fn rope_rotates_halves_in_place_or_not() {
    let (seq, heads, hd, max_seq) = (3, 2, 6, 5);
    let rows = 2 * seq;
    let mut dev = Device::cpu();
    let xv = values(rows * heads * hd, 5, 2.0);
    let (cv, sv) = (
        values(max_seq * hd / 2, 6, 1.0),
        values(max_seq * hd / 2, 7, 1.0),
    );
    let (cos, sin) = (upload(&mut dev, &cv), upload(&mut dev, &sv));
    for inverse in [false, true] {
        let spec = RopeSpec {
            seq,
            heads,
            head_dim: hd,
            inverse,
        };
        let want = rope_ref(&xv, &cv, &sv, &spec);
        let (x, y) = (upload(&mut dev, &xv), dev.alloc(DType::F32, xv.len()));
        dev.rope(x, y, cos, sin, &spec).unwrap();
        assert_eq!(bits(&download(&dev, y)), bits(&want), "inverse {inverse}");
        // Into bf16: each value rounded once (RNE).
        let yb = dev.alloc(DType::Bf16, xv.len());
        dev.rope(x, yb, cos, sin, &spec).unwrap();
        let rounded: Vec<f32> = want.iter().map(|&w| round_to(DType::Bf16, w)).collect();
        assert_eq!(bits(&download(&dev, yb)), bits(&rounded), "bf16 y");
        dev.rope(x, x, cos, sin, &spec).unwrap();
        assert_eq!(bits(&download(&dev, x)), bits(&want), "in place");
    }
    // A real rotation (cos² + sin² = 1): the inverse undoes the forward (to rounding).
    let ang: Vec<f64> = (0..max_seq * hd / 2).map(|i| 0.37 * i as f64).collect();
    let cv: Vec<f32> = ang.iter().map(|a| a.cos() as f32).collect();
    let sv: Vec<f32> = ang.iter().map(|a| a.sin() as f32).collect();
    let (cos, sin) = (upload(&mut dev, &cv), upload(&mut dev, &sv));
    let x = upload(&mut dev, &xv);
    let mut spec = RopeSpec {
        seq,
        heads,
        head_dim: hd,
        inverse: false,
    };
    dev.rope(x, x, cos, sin, &spec).unwrap();
    spec.inverse = true;
    dev.rope(x, x, cos, sin, &spec).unwrap();
    for (g, w) in download(&dev, x).iter().zip(&xv) {
        assert!((g - w).abs() < 1e-5, "{g} vs {w}");
    }
}

#[test]
fn rope_rejects_bad_shapes() {
    let mut dev = Device::cpu();
    let x = dev.alloc(DType::F32, 2 * 2 * 6);
    let y = dev.alloc(DType::F32, 2 * 2 * 6);
    let (cos, sin) = (dev.alloc(DType::F32, 4 * 3), dev.alloc(DType::F32, 4 * 3));
    let ok = RopeSpec {
        seq: 2,
        heads: 2,
        head_dim: 6,
        inverse: false,
    };
    dev.rope(x, y, cos, sin, &ok).unwrap();
    let odd = RopeSpec { head_dim: 5, ..ok };
    invalid(dev.rope(x, y, cos, sin, &odd).unwrap_err(), "rope", "even");
    let long = RopeSpec { seq: 5, ..ok };
    invalid(
        dev.rope(x, y, cos, sin, &long).unwrap_err(),
        "rope",
        "exceeds",
    );
    let short = dev.alloc(DType::F32, 11);
    assert!(dev.rope(x, y, short, short, &ok).is_err());
    let y2 = dev.alloc(DType::F32, 23);
    assert!(matches!(
        dev.rope(x, y2, cos, sin, &ok),
        Err(DeviceError::Length { .. })
    ));
    // Partly overlapping x and y are refused (only the same view is in place).
    let buf = dev.alloc(DType::F32, 30);
    let (a, b) = (buf.slice(0..24).unwrap(), buf.slice(6..30).unwrap());
    assert!(matches!(
        dev.rope(a, b, cos, sin, &ok),
        Err(DeviceError::Overlap(_))
    ));
}

fn silu64(g: f64) -> f64 {
    g / (1.0 + (-g).exp())
}

#[test]
fn swiglu_values_and_gradients() {
    let n = 37;
    let mut dev = Device::cpu();
    let mut gv = values(n, 8, 6.0);
    gv[0] = 0.0;
    gv[1] = -30.0;
    gv[2] = 30.0;
    let (uv, dv) = (values(n, 9, 2.0), values(n, 10, 1.0));
    let (g, u, d) = (
        upload(&mut dev, &gv),
        upload(&mut dev, &uv),
        upload(&mut dev, &dv),
    );
    let out = dev.alloc(DType::F32, n);
    dev.swiglu(g, u, out).unwrap();
    let want: Vec<f32> = gv
        .iter()
        .zip(&uv)
        .map(|(&g, &u)| {
            let sg = 1.0 / (1.0 + ((-g as f64).exp() as f32));
            (g * sg) * u
        })
        .collect();
    assert_eq!(bits(&download(&dev, out)), bits(&want));
    let o = download(&dev, out);
    for i in 0..n {
        let w = silu64(gv[i].into()) * f64::from(uv[i]);
        assert!((f64::from(o[i]) - w).abs() <= 1e-6 * (1.0 + w.abs()), "{i}");
    }
    let (dg, du) = (dev.alloc(DType::F32, n), dev.alloc(DType::F32, n));
    dev.swiglu_backward(g, u, d, dg, du).unwrap();
    let (dgv, duv) = (download(&dev, dg), download(&dev, du));
    let h = 1e-6;
    for i in 0..n {
        let (g, u, d) = (f64::from(gv[i]), f64::from(uv[i]), f64::from(dv[i]));
        let want_dg = d * (silu64(g + h) - silu64(g - h)) / (2.0 * h) * u;
        let want_du = d * silu64(g);
        assert!(
            (f64::from(dgv[i]) - want_dg).abs() <= 1e-5 * (1.0 + want_dg.abs()),
            "dg {i}"
        );
        assert!(
            (f64::from(duv[i]) - want_du).abs() <= 1e-6 * (1.0 + want_du.abs()),
            "du {i}"
        );
    }
    let short = dev.alloc(DType::F32, n - 1);
    assert!(dev.swiglu(g, short, out).is_err());
    assert!(dev.swiglu_backward(g, u, d, dg, short).is_err());
    assert!(matches!(dev.swiglu(g, u, g), Err(DeviceError::Overlap(_))));
}

#[test]
fn cross_entropy_rows_matches_the_mean_op_and_its_backward() {
    let (rows, classes) = (5, 9);
    let mut dev = Device::cpu();
    let mut zv = values(rows * classes, 11, 8.0);
    zv[3] = 80.0; // a large logit: the max subtraction keeps it finite
    let tv = [3.0f32, 0.0, 8.0, 4.0, 4.0];
    let (z, t) = (upload(&mut dev, &zv), upload(&mut dev, &tv));
    let losses = dev.alloc(DType::F32, rows);
    dev.cross_entropy_rows(z, t, losses, None).unwrap();
    assert_eq!(
        bits(&download(&dev, z)),
        bits(&zv),
        "logits kept without grad"
    );
    let l = download(&dev, losses);
    let mean = l.iter().fold(0f64, |s, &l| s + f64::from(l)) / rows as f64;
    let want = dev.softmax_cross_entropy(z, t).unwrap();
    assert_eq!((mean as f32).to_bits(), want.to_bits());
    for (r, row) in zv.chunks(classes).enumerate() {
        let x: Vec<f64> = row.iter().map(|&v| f64::from(v)).collect();
        let mx = x.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let lse = mx + x.iter().map(|v| (v - mx).exp()).sum::<f64>().ln();
        let w = lse - x[tv[r] as usize];
        assert!((f64::from(l[r]) - w).abs() <= 1e-5 * (1.0 + w), "row {r}");
    }
    let scale = 0.75f32;
    let c = (f64::from(scale) / rows as f64) as f32;
    let dz = dev.alloc(DType::F32, rows * classes);
    dev.softmax_cross_entropy_backward(z, t, dz, scale).unwrap();
    dev.cross_entropy_rows(z, t, losses, Some(c)).unwrap();
    assert_eq!(bits(&download(&dev, z)), bits(&download(&dev, dz)));
    assert_eq!(bits(&download(&dev, losses)), bits(&l));
}

#[test]
fn cross_entropy_rows_rejects_bad_targets_and_shapes() {
    let mut dev = Device::cpu();
    let zv = values(12, 12, 1.0);
    let z = upload(&mut dev, &zv);
    let losses = dev.alloc(DType::F32, 3);
    for (bad, needle) in [(4.0f32, "row 2"), (0.5, "0.5"), (-2.0, "-2")] {
        let t = upload(&mut dev, &[0.0, 1.0, bad]);
        let e = dev.cross_entropy_rows(z, t, losses, Some(1.0)).unwrap_err();
        invalid(e, "cross_entropy_rows", needle);
    }
    assert_eq!(bits(&download(&dev, z)), bits(&zv), "nothing written");
    let t = upload(&mut dev, &[0.0, 1.0, 2.0]);
    let l2 = dev.alloc(DType::F32, 2);
    assert!(matches!(
        dev.cross_entropy_rows(z, t, l2, None),
        Err(DeviceError::Length { .. })
    ));
    let z13 = dev.alloc(DType::F32, 13);
    assert!(dev.cross_entropy_rows(z13, t, losses, None).is_err());
    let zl = z.slice(0..3).unwrap();
    assert!(matches!(
        dev.cross_entropy_rows(z, t, zl, None),
        Err(DeviceError::Overlap(_))
    ));
}
