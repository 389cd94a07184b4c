//! Model ops: forwards against f32/f64 host references, backwards against f64 central
//! differences of the f64 forward.

mod common;

use common::{download, upload};
use lowbit_dev_support::rng::xorshift32_signed;
use lowbit_device::{DType, Device, DeviceError};

fn values(n: usize, seed: u32, scale: f32) -> Vec<f32> {
    xorshift32_signed(
        seed.wrapping_mul(2_246_822_519).wrapping_add(374_761_393) | 1,
        n,
        scale,
    )
}

fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| f64::from(x)).collect()
}

/// Central difference of `f` at `x` along each coordinate.
fn numeric_grad(x: &[f64], f: impl Fn(&[f64]) -> f64) -> Vec<f64> {
    let h = 1e-6;
    (0..x.len())
        .map(|i| {
            let mut xp = x.to_vec();
            let mut xm = x.to_vec();
            xp[i] += h;
            xm[i] -= h;
            (f(&xp) - f(&xm)) / (2.0 * h)
        })
        .collect()
}

fn assert_close(got: &[f32], want: &[f64], rel: f64, abs: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (f64::from(g) - w).abs();
        assert!(err <= abs + rel * w.abs(), "{what}[{i}]: {g} vs {w}");
    }
}

#[test]
fn add_bias_and_bias_grad() {
    let (rows, cols) = (5, 7);
    let mut dev = Device::cpu();
    let xv = values(rows * cols, 1, 2.0);
    let bv = values(cols, 2, 1.0);
    let (x, b) = (upload(&mut dev, &xv), upload(&mut dev, &bv));
    dev.add_bias(x, b).unwrap();
    let want: Vec<f32> = xv
        .iter()
        .enumerate()
        .map(|(i, v)| v + bv[i % cols])
        .collect();
    assert_eq!(download(&dev, x), want);

    let db = upload(&mut dev, &bv);
    dev.bias_grad(x, db, false).unwrap();
    let mut sums = vec![0f32; cols];
    for (i, v) in want.iter().enumerate() {
        sums[i % cols] += v;
    }
    assert_eq!(download(&dev, db), sums);
    dev.bias_grad(x, db, true).unwrap();
    let twice: Vec<f32> = sums.iter().map(|s| s + s).collect();
    assert_eq!(download(&dev, db), twice);

    let bad = upload(&mut dev, &[0.0; 6]);
    assert!(matches!(
        dev.add_bias(x, bad),
        Err(DeviceError::Invalid { .. })
    ));
    assert_eq!(
        dev.bias_grad(x, x.slice(0..cols).unwrap(), false),
        Err(DeviceError::Overlap("bias_grad"))
    );
}

/// f64 RMSNorm of one matrix, and `Σ dy·y` for gradient checks.
fn rms_norm_f64(x: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
    let cols = w.len();
    x.chunks(cols)
        .flat_map(|r| {
            let ms = r.iter().map(|v| v * v).sum::<f64>() / cols as f64;
            let rstd = 1.0 / (ms + eps).sqrt();
            r.iter().zip(w).map(move |(v, w)| v * rstd * w)
        })
        .collect()
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(a, b)| a * b).sum()
}

#[test]
fn rms_norm_forward_and_backward() {
    let (rows, cols, eps) = (4, 24, 1e-5f32);
    let mut dev = Device::cpu();
    let xv = values(rows * cols, 3, 3.0);
    let wv: Vec<f32> = values(cols, 4, 0.5).iter().map(|w| 1.0 + w).collect();
    let dyv = values(rows * cols, 5, 1.0);
    let (x, w, dy) = (
        upload(&mut dev, &xv),
        upload(&mut dev, &wv),
        upload(&mut dev, &dyv),
    );
    let (y, rstd) = (
        dev.alloc(DType::F32, rows * cols),
        dev.alloc(DType::F32, rows),
    );
    dev.rms_norm(x, w, y, rstd, eps).unwrap();

    // Exact against the documented f32 order.
    for r in 0..rows {
        let xr = &xv[r * cols..(r + 1) * cols];
        let ss = xr.iter().fold(0f32, |s, v| s + v * v);
        let rs = 1.0 / (ss / cols as f32 + eps).sqrt();
        assert_eq!(download(&dev, rstd)[r].to_bits(), rs.to_bits());
        let yr: Vec<f32> = xr.iter().zip(&wv).map(|(x, w)| (x * rs) * w).collect();
        assert_eq!(download(&dev, y)[r * cols..(r + 1) * cols], yr[..]);
    }
    let (x64, w64, dy64) = (f64s(&xv), f64s(&wv), f64s(&dyv));
    assert_close(
        &download(&dev, y),
        &rms_norm_f64(&x64, &w64, f64::from(eps)),
        1e-6,
        1e-7,
        "y",
    );

    // Backward: dweight accumulates onto what is there.
    let (dx, dw) = (
        dev.alloc(DType::F32, rows * cols),
        upload(&mut dev, &vec![0.25; cols]),
    );
    dev.rms_norm_backward(x, w, rstd, dy, dx, dw).unwrap();
    let loss_x = |x: &[f64]| dot(&dy64, &rms_norm_f64(x, &w64, f64::from(eps)));
    let loss_w = |w: &[f64]| dot(&dy64, &rms_norm_f64(&x64, w, f64::from(eps)));
    assert_close(
        &download(&dev, dx),
        &numeric_grad(&x64, loss_x),
        1e-4,
        1e-5,
        "dx",
    );
    let dw_want: Vec<f64> = numeric_grad(&w64, loss_w)
        .iter()
        .map(|g| g + 0.25)
        .collect();
    assert_close(&download(&dev, dw), &dw_want, 1e-4, 1e-5, "dweight");

    // Shape and overlap errors.
    assert!(matches!(
        dev.rms_norm(x, w, y, dy.slice(0..3).unwrap(), eps),
        Err(DeviceError::Length { .. })
    ));
    assert_eq!(
        dev.rms_norm(x, w, x, rstd, eps),
        Err(DeviceError::Overlap("rms_norm"))
    );
    let empty = dev.alloc(DType::F32, 0);
    assert!(matches!(
        dev.rms_norm(empty, empty, empty, rstd, eps),
        Err(DeviceError::Length { .. })
    ));
}

fn gelu_f64(x: f64) -> f64 {
    let c = (2.0 / std::f64::consts::PI).sqrt();
    0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())
}

#[test]
fn gelu_forward_and_backward() {
    let n = 2100;
    let mut dev = Device::cpu();
    let xv = values(n, 6, 6.0);
    let dyv = values(n, 7, 1.0);
    let (x, dy) = (upload(&mut dev, &xv), upload(&mut dev, &dyv));
    let (y, dx) = (dev.alloc(DType::F32, n), dev.alloc(DType::F32, n));
    dev.gelu(x, y).unwrap();
    let x64 = f64s(&xv);
    let want: Vec<f64> = x64.iter().map(|&v| gelu_f64(v)).collect();
    assert_close(&download(&dev, y), &want, 1e-6, 1e-7, "gelu");
    // Bitwise: PyTorch's f32 expression with tanh evaluated in f64 and rounded.
    let beta = (2f64.sqrt() * std::f64::consts::FRAC_2_SQRT_PI * 0.5) as f32;
    let torch: Vec<f32> = xv
        .iter()
        .map(|&x| {
            let inner = beta * (x + 0.044715f32 * (x * x * x));
            0.5 * x * (1.0 + (f64::from(inner).tanh() as f32))
        })
        .collect();
    assert_eq!(download(&dev, y), torch);
    dev.gelu_backward(x, dy, dx).unwrap();
    let h = 1e-6;
    let want: Vec<f64> = x64
        .iter()
        .zip(&dyv)
        .map(|(&v, &d)| f64::from(d) * (gelu_f64(v + h) - gelu_f64(v - h)) / (2.0 * h))
        .collect();
    assert_close(&download(&dev, dx), &want, 1e-5, 1e-6, "gelu'");
    assert_eq!(dev.gelu(x, x), Err(DeviceError::Overlap("gelu")));
    assert_eq!(
        dev.gelu_backward(x, dy, dy),
        Err(DeviceError::Overlap("gelu_backward"))
    );
}

#[test]
fn mse_loss_and_backward() {
    let n = 777;
    let mut dev = Device::cpu();
    let (pv, tv) = (values(n, 8, 2.0), values(n, 9, 2.0));
    let (p, t) = (upload(&mut dev, &pv), upload(&mut dev, &tv));
    let (p64, t64) = (f64s(&pv), f64s(&tv));
    let mse = |p: &[f64]| {
        p.iter()
            .zip(&t64)
            .map(|(a, b)| (a - b) * (a - b))
            .sum::<f64>()
            / n as f64
    };
    assert_eq!(dev.mse_loss(p, t).unwrap(), mse(&p64) as f32);
    let dp = dev.alloc(DType::F32, n);
    dev.mse_loss_backward(p, t, dp, 3.0).unwrap();
    let c = (2.0 * 3.0 / n as f64) as f32;
    let exact: Vec<f32> = pv.iter().zip(&tv).map(|(a, b)| c * (a - b)).collect();
    assert_eq!(download(&dev, dp), exact);
    let fd: Vec<f64> = numeric_grad(&p64, |p| 3.0 * mse(p));
    assert_close(&download(&dev, dp), &fd, 1e-5, 1e-7, "dmse");
    // More than one block: the blocked order of `sum_squares` (4096-element f64 partials in
    // index order, then the partials in index order: one group of 32 blocks here).
    let n2 = 3 * 4096 + 5;
    let (pv2, tv2) = (values(n2, 10, 2.0), values(n2, 11, 2.0));
    let (p2, t2) = (upload(&mut dev, &pv2), upload(&mut dev, &tv2));
    let diffs: Vec<f64> = pv2
        .iter()
        .zip(&tv2)
        .map(|(a, b)| f64::from(*a) - f64::from(*b))
        .collect();
    let mut total = 0f64;
    for block in diffs.chunks(4096) {
        let mut partial = 0f64;
        for d in block {
            partial += d * d;
        }
        total += partial;
    }
    assert_eq!(dev.mse_loss(p2, t2).unwrap(), (total / n2 as f64) as f32);
    let empty = dev.alloc(DType::F32, 0);
    assert!(dev.mse_loss(empty, empty).unwrap().is_nan());
    assert!(matches!(
        dev.mse_loss(p, empty),
        Err(DeviceError::Length { .. })
    ));
}

fn xent_f64(x: &[f64], targets: &[usize]) -> f64 {
    let classes = x.len() / targets.len();
    x.chunks(classes)
        .zip(targets)
        .map(|(r, &t)| {
            let mx = r.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let lse = r.iter().map(|v| (v - mx).exp()).sum::<f64>().ln() + mx;
            lse - r[t]
        })
        .sum::<f64>()
        / targets.len() as f64
}

#[test]
fn softmax_cross_entropy_and_backward() {
    let (rows, classes) = (6, 11);
    let mut dev = Device::cpu();
    let xv = values(rows * classes, 10, 5.0);
    let tv = [0usize, 10, 3, 3, 7, 1];
    let x = upload(&mut dev, &xv);
    let t = upload(&mut dev, &tv.map(|t| t as f32));
    let x64 = f64s(&xv);
    let loss = dev.softmax_cross_entropy(x, t).unwrap();
    assert!((f64::from(loss) - xent_f64(&x64, &tv)).abs() < 1e-6 * xent_f64(&x64, &tv));
    let dx = dev.alloc(DType::F32, rows * classes);
    dev.softmax_cross_entropy_backward(x, t, dx, 2.0).unwrap();
    let fd = numeric_grad(&x64, |x| 2.0 * xent_f64(x, &tv));
    assert_close(&download(&dev, dx), &fd, 1e-4, 1e-6, "dlogits");

    // Large logits do not overflow (max subtraction).
    let big = upload(&mut dev, &[1000.0, 1001.0, 0.0, 0.0]);
    let t2 = upload(&mut dev, &[1.0, 0.0]);
    let l = dev.softmax_cross_entropy(big, t2).unwrap();
    let want = xent_f64(&[1000.0, 1001.0, 0.0, 0.0], &[1, 0]);
    assert!((f64::from(l) - want).abs() < 1e-6);

    // Targets must be integral class indices; nothing is written on error.
    for bad in [[1.0, 11.0], [0.5, 1.0], [-1.0, 0.0], [f32::NAN, 0.0]] {
        let bt = upload(&mut dev, &bad);
        let two_rows = x.slice(0..2 * classes).unwrap();
        assert!(matches!(
            dev.softmax_cross_entropy(two_rows, bt),
            Err(DeviceError::Invalid { .. })
        ));
        let before = dev.read_bytes(dx).unwrap();
        let d2 = dx.slice(0..2 * classes).unwrap();
        assert!(
            dev.softmax_cross_entropy_backward(two_rows, bt, d2, 1.0)
                .is_err()
        );
        assert_eq!(dev.read_bytes(dx).unwrap(), before);
    }
    let t5 = upload(&mut dev, &[0.0; 5]);
    assert!(matches!(
        dev.softmax_cross_entropy(x, t5),
        Err(DeviceError::Invalid { .. })
    ));
    assert_eq!(
        dev.softmax_cross_entropy_backward(x, t, x, 1.0),
        Err(DeviceError::Overlap("softmax_cross_entropy_backward"))
    );
}
