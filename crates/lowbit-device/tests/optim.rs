//! AdamW and SGD with momentum against scalar references.

mod common;

use common::{bits, upload};
use lowbit_dev_support::rng::xorshift32_signed;
use lowbit_device::{AdamW, DType, Device, DeviceError, SgdMomentum, View, bf16, f16};

fn values(n: usize, seed: u32, scale: f32) -> Vec<f32> {
    xorshift32_signed(
        seed.wrapping_mul(747_796_405).wrapping_add(2_891_336_453) | 1,
        n,
        scale,
    )
}

/// An f32 view of AdamW's parameters holding `p0`, and f32 views of its two moments (zero, as
/// fresh allocations are).
fn adamw_views(dev: &mut Device, p0: &[f32]) -> (View, View, View) {
    let n = p0.len();
    let p = upload(dev, p0);
    (p, dev.alloc(DType::F32, n), dev.alloc(DType::F32, n))
}

/// `torch.optim.AdamW` (single tensor, not capturable), transcribed: Python-float scalars are
/// f64 and become f32 when they meet an f32 tensor; each tensor op rounds to f32.
struct TorchAdamW {
    p: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
}

impl TorchAdamW {
    #[allow(clippy::needless_range_loop)] // a transcription, index for index
    fn step(&mut self, g: &[f32], hp: &AdamW) {
        let (lr, beta1, beta2) = (f64::from(hp.lr), f64::from(hp.beta1), f64::from(hp.beta2));
        let step = hp.step as f64;
        // param.mul_(1 - lr * weight_decay)
        let decay = (1.0 - lr * f64::from(hp.weight_decay)) as f32;
        // exp_avg.lerp_(grad, 1 - beta1)
        let weight = (1.0 - beta1) as f32;
        // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        let value = (1.0 - beta2) as f32;
        let bias_correction1 = 1.0 - beta1.powf(step);
        let bias_correction2 = 1.0 - beta2.powf(step);
        let step_size = lr / bias_correction1;
        let bias_correction2_sqrt = bias_correction2.sqrt();
        for i in 0..g.len() {
            self.p[i] *= decay;
            let (m, e) = (self.m[i], g[i]);
            self.m[i] = if weight.abs() < 0.5 {
                m + weight * (e - m)
            } else {
                e - (e - m) * (1.0 - weight)
            };
            self.v[i] *= hp.beta2;
            self.v[i] += value * g[i] * g[i];
            // denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
            let denom = self.v[i].sqrt() / bias_correction2_sqrt as f32 + hp.eps;
            // param.addcdiv_(exp_avg, denom, value=-step_size): self + value * t1 / t2
            self.p[i] += (-step_size) as f32 * self.m[i] / denom;
        }
    }
}

/// The same algorithm in f64 throughout.
#[allow(clippy::needless_range_loop)]
fn adamw_f64(p: &mut [f64], m: &mut [f64], v: &mut [f64], g: &[f64], hp: &AdamW) {
    let (lr, b1, b2) = (f64::from(hp.lr), f64::from(hp.beta1), f64::from(hp.beta2));
    let (eps, wd) = (f64::from(hp.eps), f64::from(hp.weight_decay));
    let t = hp.step as i32;
    for i in 0..g.len() {
        p[i] *= 1.0 - lr * wd;
        m[i] = b1 * m[i] + (1.0 - b1) * g[i];
        v[i] = b2 * v[i] + (1.0 - b2) * g[i] * g[i];
        let mhat = m[i] / (1.0 - b1.powi(t));
        let vhat = v[i] / (1.0 - b2.powi(t));
        // PyTorch's eps placement: sqrt(v)/sqrt(bc2) + eps.
        p[i] -= lr * mhat / (vhat.sqrt() + eps);
    }
}

fn hp(step: u64) -> AdamW {
    AdamW {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
        step,
        grad_scale: 1.0,
    }
}

#[test]
fn adamw_is_torchs_formula_bit_for_bit() {
    // 2500 elements: two full chunks and a partial one. Both lerp branches (beta1 = 0.9 gives
    // weight 0.1; beta1 = 0.3 gives weight 0.7).
    let n = 2500;
    for beta1 in [0.9f32, 0.3] {
        let mut dev = Device::cpu();
        let p0 = values(n, 1, 1.0);
        let (p, m, v) = adamw_views(&mut dev, &p0);
        let out = dev.alloc(DType::Bf16, n);
        let mut r = TorchAdamW {
            p: p0,
            m: vec![0.0; n],
            v: vec![0.0; n],
        };
        for step in 1..=4 {
            let h = AdamW { beta1, ..hp(step) };
            let gv = values(n, 10 + step as u32, 0.5 * step as f32);
            let g = upload(&mut dev, &gv);
            dev.adamw(p, g, m, v, &h, Some(out)).unwrap();
            r.step(&gv, &h);
            assert_eq!(
                bits(&dev.download::<f32>(p).unwrap()),
                bits(&r.p),
                "step {step}"
            );
            assert_eq!(bits(&dev.download::<f32>(m).unwrap()), bits(&r.m));
            assert_eq!(bits(&dev.download::<f32>(v).unwrap()), bits(&r.v));
            let want: Vec<bf16> = r.p.iter().map(|&x| bf16::from_f32(x)).collect();
            assert_eq!(dev.download::<bf16>(out).unwrap(), want);
        }
    }
}

#[test]
fn adamw_close_to_f64_over_several_steps() {
    let n = 1000;
    let mut dev = Device::cpu();
    let p0 = values(n, 3, 1.0);
    let (p, m, v) = adamw_views(&mut dev, &p0);
    let mut p64: Vec<f64> = p0.iter().map(|&x| f64::from(x)).collect();
    let (mut m64, mut v64) = (vec![0f64; n], vec![0f64; n]);
    for step in 1..=10 {
        let gv = values(n, 100 + step as u32, 1.0);
        let g = upload(&mut dev, &gv);
        dev.adamw(p, g, m, v, &hp(step), None).unwrap();
        let g64: Vec<f64> = gv.iter().map(|&x| f64::from(x)).collect();
        adamw_f64(&mut p64, &mut m64, &mut v64, &g64, &hp(step));
    }
    let got = dev.download::<f32>(p).unwrap();
    for (i, (&a, &b)) in got.iter().zip(&p64).enumerate() {
        let moved = (b - f64::from(p0[i])).abs();
        // Two f32 roundings of p per step (decay, update: half an ulp each, 2^-24 relative)
        // plus a small relative error of the accumulated update.
        let tol = 20.0 * 2f64.powi(-24) * b.abs() + 1e-4 * moved + 1e-9;
        assert!((f64::from(a) - b).abs() <= tol, "{i}: {a} vs {b}");
    }
}

#[test]
fn adamw_out_dtypes_and_bf16_grads() {
    let n = 300;
    let p0 = values(n, 5, 2.0);
    let gv = values(n, 6, 1.0);
    let mut expect = None;
    for od in [DType::F32, DType::Bf16, DType::F16] {
        let mut dev = Device::cpu();
        let (p, m, v) = adamw_views(&mut dev, &p0);
        let g = upload(&mut dev, &gv);
        let out = dev.alloc(od, n);
        dev.adamw(p, g, m, v, &hp(1), Some(out)).unwrap();
        let pn = dev.download::<f32>(p).unwrap();
        match od {
            DType::F32 => assert_eq!(bits(&dev.download::<f32>(out).unwrap()), bits(&pn)),
            DType::Bf16 => assert_eq!(
                dev.download::<bf16>(out).unwrap(),
                pn.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>()
            ),
            _ => assert_eq!(
                dev.download::<f16>(out).unwrap(),
                pn.iter().map(|&x| f16::from_f32(x)).collect::<Vec<_>>()
            ),
        }
        assert_eq!(*expect.get_or_insert(pn.clone()), pn);
    }
    // bf16 gradients are read exactly: same result as their f32 widening.
    let gb: Vec<bf16> = gv.iter().map(|&x| bf16::from_f32(x)).collect();
    let gw: Vec<f32> = gb.iter().map(|x| x.to_f32()).collect();
    let mut results = Vec::new();
    for bf in [true, false] {
        let mut dev = Device::cpu();
        let (p, m, v) = adamw_views(&mut dev, &p0);
        let g = if bf {
            let g = dev.alloc(DType::Bf16, n);
            dev.upload(g, &gb).unwrap();
            g
        } else {
            upload(&mut dev, &gw)
        };
        dev.adamw(p, g, m, v, &hp(3), None).unwrap();
        results.push(bits(&dev.download::<f32>(p).unwrap()));
    }
    assert_eq!(results[0], results[1]);
}

#[test]
fn adamw_state_in_one_buffer_and_errors() {
    // One allocation holding [param | m | v | grad], as a flat optimizer shard would.
    let n = 64;
    let mut dev = Device::cpu();
    let all = dev.alloc(DType::F32, 4 * n);
    let [p, m, v, g] = [0, 1, 2, 3].map(|i| all.slice(i * n..(i + 1) * n).unwrap());
    dev.upload(p, &values(n, 1, 1.0)).unwrap();
    dev.upload(g, &values(n, 2, 1.0)).unwrap();
    let mut r = TorchAdamW {
        p: values(n, 1, 1.0),
        m: vec![0.0; n],
        v: vec![0.0; n],
    };
    dev.adamw(p, g, m, v, &hp(1), None).unwrap();
    r.step(&values(n, 2, 1.0), &hp(1));
    assert_eq!(bits(&dev.download::<f32>(p).unwrap()), bits(&r.p));

    let before = dev.read_bytes(all).unwrap();
    let out_over_grad = g.reinterpret(DType::Bf16).unwrap().slice(0..n).unwrap();
    let cases: Vec<(Result<(), DeviceError>, &str)> = vec![
        (dev.adamw(p, g, m, v, &hp(0), None), "step 0"),
        (dev.adamw(p, g, m, m, &hp(1), None), "m == v"),
        (dev.adamw(p, p, m, v, &hp(1), None), "grad == param"),
        (
            dev.adamw(p, g, m, v, &hp(1), Some(out_over_grad)),
            "out over grad",
        ),
        (dev.adamw(p, g, m, v, &hp(1), Some(p)), "out == param"),
        (
            dev.adamw(p, g.slice(0..n - 1).unwrap(), m, v, &hp(1), None),
            "length",
        ),
        (
            dev.adamw(out_over_grad, g, m, v, &hp(1), None),
            "bf16 param",
        ),
    ];
    for (res, name) in cases {
        assert!(res.is_err(), "{name}");
    }
    assert_eq!(dev.read_bytes(all).unwrap(), before, "errors write nothing");
    assert!(matches!(
        dev.adamw(p, g, m, v, &hp(0), None),
        Err(DeviceError::Invalid { what: "adamw", .. })
    ));
    assert_eq!(
        dev.adamw(p, g, m, m, &hp(1), None),
        Err(DeviceError::Overlap("adamw"))
    );
}

/// `torch.optim.SGD(momentum, weight_decay)`, transcribed, no dampening or Nesterov.
fn torch_sgd(p: &mut [f32], g: &[f32], buf: &mut Option<Vec<f32>>, hp: &SgdMomentum) {
    let mut d: Vec<f32> = g.to_vec();
    if hp.weight_decay != 0.0 {
        // grad.add(param, alpha=weight_decay)
        d.iter_mut()
            .zip(p.iter())
            .for_each(|(d, p)| *d += hp.weight_decay * *p);
    }
    if hp.momentum != 0.0 {
        match buf {
            None => *buf = Some(d.clone()),
            Some(b) => b
                .iter_mut()
                .zip(&d)
                .for_each(|(b, d)| *b = *b * hp.momentum + *d),
        }
        d = buf.clone().unwrap();
    }
    p.iter_mut().zip(&d).for_each(|(p, d)| *p += -hp.lr * *d);
}

#[test]
fn sgd_momentum_matches_torch() {
    let n = 1500;
    for (momentum, weight_decay) in [(0.9f32, 0.0f32), (0.9, 1e-2), (0.0, 1e-2)] {
        let h = SgdMomentum {
            lr: 0.05,
            momentum,
            weight_decay,
        };
        let mut dev = Device::cpu();
        let mut p_ref = values(n, 7, 1.0);
        let p = upload(&mut dev, &p_ref);
        let buf = dev.alloc(DType::F32, n);
        dev.fill(buf, 123.0).unwrap(); // garbage: first_step must not read it
        let mut buf_ref = None;
        for step in 0..3 {
            let gv = values(n, 20 + step, 1.0);
            let g = upload(&mut dev, &gv);
            dev.sgd_momentum(p, g, buf, &h, step == 0).unwrap();
            torch_sgd(&mut p_ref, &gv, &mut buf_ref, &h);
            assert_eq!(bits(&dev.download::<f32>(p).unwrap()), bits(&p_ref));
            if let Some(b) = &buf_ref {
                assert_eq!(bits(&dev.download::<f32>(buf).unwrap()), bits(b));
            } else {
                assert_eq!(
                    dev.download::<f32>(buf).unwrap(),
                    vec![123.0; n],
                    "untouched"
                );
            }
        }
    }
}

#[test]
fn sgd_errors() {
    let mut dev = Device::cpu();
    let h = SgdMomentum {
        lr: 0.1,
        momentum: 0.9,
        weight_decay: 0.0,
    };
    let p = upload(&mut dev, &[1.0; 4]);
    let g = upload(&mut dev, &[1.0; 4]);
    let b16 = dev.alloc(DType::Bf16, 4);
    assert_eq!(
        dev.sgd_momentum(p, g, p, &h, false),
        Err(DeviceError::Overlap("sgd_momentum"))
    );
    assert!(matches!(
        dev.sgd_momentum(p, g, b16, &h, false),
        Err(DeviceError::DType { .. })
    ));
    let short = g.slice(0..3).unwrap();
    assert!(matches!(
        dev.sgd_momentum(p, short, g, &h, false),
        Err(DeviceError::Length { .. })
    ));
    assert_eq!(dev.download::<f32>(p).unwrap(), [1.0; 4]);
}

/// `grad_scale` (the clip coefficient fused into the step) is bit for bit `Device::scale` of
/// the gradient followed by the step, for f32 and bf16 gradients, both lerp branches.
#[test]
fn adamw_grad_scale_is_scale_then_step() {
    let n = 2500;
    for (beta1, scale) in [(0.9f32, 0.3712f32), (0.3, 0.9999), (0.9, 1e-3)] {
        for gdt in [DType::F32, DType::Bf16] {
            let p0 = values(n, 3, 1.0);
            let gv: Vec<f32> = values(n, 4, 2.0);
            let run = |fused: bool| {
                let mut dev = Device::cpu();
                let (p, m, v) = adamw_views(&mut dev, &p0);
                let g = dev.alloc(gdt, n);
                match gdt {
                    DType::Bf16 => {
                        let b: Vec<bf16> = gv.iter().map(|&x| bf16::from_f32(x)).collect();
                        dev.upload(g, &b).unwrap();
                    }
                    _ => dev.upload(g, &gv).unwrap(),
                }
                // The unfused path scales an f32 copy, as the optimizer's f32 gradient is.
                let g32 = dev.alloc(DType::F32, n);
                dev.cast(g, g32).unwrap();
                let out = dev.alloc(DType::Bf16, n);
                for step in 1..=3 {
                    let h = AdamW { beta1, ..hp(step) };
                    if fused {
                        let h = AdamW {
                            grad_scale: scale,
                            ..h
                        };
                        dev.adamw(p, g, m, v, &h, Some(out)).unwrap();
                    } else {
                        dev.cast(g, g32).unwrap();
                        dev.scale(g32, scale).unwrap();
                        dev.adamw(p, g32, m, v, &h, Some(out)).unwrap();
                    }
                }
                [p, m, v, out].map(|x| dev.read_bytes(x).unwrap())
            };
            let (fused, separate) = (run(true), run(false));
            assert!(
                fused == separate,
                "beta1 {beta1}, scale {scale}, {gdt:?} gradients: the fused scale differs"
            );
        }
    }
}
