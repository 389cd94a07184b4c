//! Fused optimizer steps over a shard: AdamW (PyTorch's formula and operation order) and SGD
//! with momentum.
//!
//! # Arithmetic contract (the CUDA kernels must match it)
//! Per-call scalars are computed on the host in f64 from the f32 hyper-parameters and rounded
//! to f32 once — what PyTorch does, where hyper-parameters are Python floats (doubles) and the
//! tensor kernels convert the resulting scalars to the f32 compute type. Per-element math is f32,
//! one IEEE operation at a time, no fused multiply-add, in the order written in each op's docs.

use super::{CHUNK, chunks, elems, elems_mut, invalid};
use crate::cpu::{decode_into, encode_f32};
use crate::{AdamW, DType, Device, Result, SgdMomentum, View, check_dtype, check_float, check_len};

/// The per-call f32 scalars of one AdamW step (the CUDA kernel takes them as they are).
#[derive(Clone, Copy, Debug)]
pub(crate) struct AdamWScalars {
    /// `fl32(1 − lr·wd)`.
    pub(crate) decay: f32,
    /// Lerp weight `w = fl32(1 − β1)`.
    pub(crate) w: f32,
    /// `fl32(1 − w)`, computed in f32 as PyTorch's lerp does per element.
    pub(crate) one_minus_w: f32,
    /// `β2`.
    pub(crate) beta2: f32,
    /// `fl32(1 − β2)`.
    pub(crate) c2: f32,
    /// `fl32(−lr / (1 − β1^step))`.
    pub(crate) neg_step_size: f32,
    /// `fl32(sqrt(1 − β2^step))`.
    pub(crate) bc2_sqrt: f32,
    /// `ε`.
    pub(crate) eps: f32,
    /// The gradient's factor (1: none).
    pub(crate) grad_scale: f32,
}

impl AdamWScalars {
    fn new(hp: &AdamW) -> Self {
        let (lr, b1, b2) = (f64::from(hp.lr), f64::from(hp.beta1), f64::from(hp.beta2));
        // `step` is at least 1 and below 2^53 for any real run, so the conversion is exact.
        let step = hp.step as f64;
        let bc1 = 1.0 - b1.powf(step);
        let bc2 = 1.0 - b2.powf(step);
        let w = (1.0 - b1) as f32;
        AdamWScalars {
            decay: (1.0 - lr * f64::from(hp.weight_decay)) as f32,
            w,
            one_minus_w: 1.0 - w,
            beta2: hp.beta2,
            c2: (1.0 - b2) as f32,
            neg_step_size: (-(lr / bc1)) as f32,
            bc2_sqrt: bc2.sqrt() as f32,
            eps: hp.eps,
            grad_scale: hp.grad_scale,
        }
    }

    /// One element: `(p, g, m, v) → (p', m', v')`. `SMALL` is PyTorch's `|w| < 0.5` lerp branch.
    #[inline(always)]
    fn step<const SMALL: bool>(&self, p: f32, g: f32, m: f32, v: f32) -> (f32, f32, f32) {
        let p = p * self.decay;
        let m = if SMALL {
            m + self.w * (g - m)
        } else {
            g - (g - m) * self.one_minus_w
        };
        let v = v * self.beta2 + self.c2 * g * g;
        let denom = v.sqrt() / self.bc2_sqrt + self.eps;
        (p + self.neg_step_size * m / denom, m, v)
    }
}

/// One AdamW chunk: f32 `p`, `m`, `v` updated in place in their little-endian bytes, `g`
/// already decoded; the new parameters are also left in `p_new` for the optional output copy.
#[inline(always)]
fn adamw_chunk<const SMALL: bool>(
    k: &AdamWScalars,
    [p, m, v]: [&mut [[u8; 4]]; 3],
    g: &[f32],
    p_new: &mut [f32],
) {
    for ((((p, m), v), g), pn) in p.iter_mut().zip(m).zip(v).zip(g).zip(p_new) {
        let (np, nm, nv) = k.step::<SMALL>(
            f32::from_le_bytes(*p),
            *g,
            f32::from_le_bytes(*m),
            f32::from_le_bytes(*v),
        );
        (*p, *m, *v, *pn) = (np.to_le_bytes(), nm.to_le_bytes(), nv.to_le_bytes(), np);
    }
}

impl Device {
    /// One fused AdamW step over a shard: f32 `param`, `exp_avg` (m) and `exp_avg_sq` (v) updated
    /// in place from `grad` (any float dtype, read exactly), all the same length; `out`, when
    /// given (f32, bf16 or f16, same length), receives the updated parameter rounded to its
    /// dtype — the fused "master → staging copy", 30 bytes of traffic per parameter for f32
    /// grads and bf16 `out`.
    ///
    /// PyTorch's `torch.optim.AdamW` (single-tensor, non-capturable) step, operation for
    /// operation. Host scalars, f64 then rounded to f32: `decay = 1 − lr·wd`, `w = 1 − β1`,
    /// `c2 = 1 − β2`, `bc1 = 1 − β1^step`, `bc2 = 1 − β2^step` (`powf` with the step as f64),
    /// `s = −(lr / bc1)`, `r = sqrt(bc2)`. Per element, in f32 without fused multiply-add:
    /// ```text
    /// g ← g · grad_scale                                      (only if grad_scale ≠ 1)
    /// p ← p · decay
    /// m ← |w| < 0.5 ? m + w·(g − m) : g − (g − m)·(1 − w)      (torch.lerp; 1 − w in f32)
    /// v ← v·β2 + (c2·g)·g
    /// d ← sqrt(v) / r + ε
    /// p ← p + (s·m) / d                                       (addcdiv's CPU order)
    /// ```
    /// `param`, `exp_avg`, `exp_avg_sq` and `out` must be pairwise disjoint and `grad` must
    /// overlap none of them. `hp.step` must be at least 1.
    pub fn adamw(
        &mut self,
        param: View,
        grad: View,
        exp_avg: View,
        exp_avg_sq: View,
        hp: &AdamW,
        out: Option<View>,
    ) -> Result<()> {
        const WHAT: &str = "adamw";
        for v in [param, exp_avg, exp_avg_sq] {
            check_dtype(WHAT, v, DType::F32)?;
            check_len(WHAT, v.len(), grad.len())?;
        }
        check_float(WHAT, grad)?;
        if let Some(o) = out {
            check_float(WHAT, o)?;
            check_len(WHAT, o.len(), grad.len())?;
        }
        if hp.step == 0 {
            return Err(invalid(WHAT, "step is 1-based; got 0"));
        }
        let k = AdamWScalars::new(hp);
        let outs: Vec<View> = [param, exp_avg, exp_avg_sq]
            .into_iter()
            .chain(out)
            .collect();
        on_cuda!(self, g => g.adamw([param, grad, exp_avg, exp_avg_sq], &k, out));
        self.host_op_dyn(WHAT, &[grad], &outs, |ins, mut outs| {
            let ([g], [p, m, v, rest @ ..]) = (&ins[..], &mut outs[..]) else {
                unreachable!("one slice per view");
            };
            let mut out = out.map(|o| o.dtype()).zip(rest.first_mut());
            let (f, gd) = (DType::F32, grad.dtype());
            let (mut gb, mut pb) = ([0f32; CHUNK], [0f32; CHUNK]);
            for r in chunks(grad.len()) {
                let n = r.len();
                decode_into(gd, elems(g, gd, &r), &mut gb[..n]);
                // As `Device::scale` would have left the gradient: `scale · g` in f32.
                if k.grad_scale != 1.0 {
                    gb[..n].iter_mut().for_each(|g| *g *= k.grad_scale);
                }
                let pmv =
                    [&mut **p, &mut **m, &mut **v].map(|b| elems_mut(b, f, &r).as_chunks_mut().0);
                if k.w.abs() < 0.5 {
                    adamw_chunk::<true>(&k, pmv, &gb[..n], &mut pb[..n]);
                } else {
                    adamw_chunk::<false>(&k, pmv, &gb[..n], &mut pb[..n]);
                }
                if let Some((od, o)) = &mut out {
                    encode_f32(*od, &pb[..n], elems_mut(o, *od, &r));
                }
            }
            Ok(())
        })
    }

    /// One SGD-with-momentum step (PyTorch's `torch.optim.SGD`, no dampening, no Nesterov) over
    /// f32 `param` and momentum `buf`, from `grad` (any float dtype), all the same length. Per
    /// element in f32, no fused multiply-add:
    /// ```text
    /// g ← g + wd·p                  (skipped when wd == 0, as PyTorch does)
    /// buf ← first_step ? g : buf·momentum + g
    /// p ← p + (−lr)·buf
    /// ```
    /// `first_step` is PyTorch's "no buffer yet" case (`buf = clone(g)`); it differs from
    /// `buf = 0` only where `0·momentum + g` is not `g` (a −0 gradient). With
    /// `momentum == 0`, `buf` is neither read nor written and `p ← p + (−lr)·g`, again as PyTorch.
    /// `param` and `buf` must be disjoint and `grad` must overlap neither.
    pub fn sgd_momentum(
        &mut self,
        param: View,
        grad: View,
        buf: View,
        hp: &SgdMomentum,
        first_step: bool,
    ) -> Result<()> {
        const WHAT: &str = "sgd_momentum";
        check_dtype(WHAT, param, DType::F32)?;
        check_dtype(WHAT, buf, DType::F32)?;
        check_float(WHAT, grad)?;
        check_len(WHAT, param.len(), grad.len())?;
        check_len(WHAT, buf.len(), grad.len())?;
        on_cuda!(self, g => {
            let step = (hp.weight_decay, hp.momentum, -hp.lr);
            g.sgd_momentum([param, grad, buf], step, first_step)
        });
        self.host_op(WHAT, [grad], [param, buf], |[g], [p, b]| {
            let (f, gd) = (DType::F32, grad.dtype());
            let (wd, mom, neg_lr) = (hp.weight_decay, hp.momentum, -hp.lr);
            let (mut pb, mut gb, mut bb) = ([0f32; CHUNK], [0f32; CHUNK], [0f32; CHUNK]);
            for r in chunks(grad.len()) {
                let n = r.len();
                let (ps, gs, bs) = (&mut pb[..n], &mut gb[..n], &mut bb[..n]);
                decode_into(f, elems(p, f, &r), ps);
                decode_into(gd, elems(g, gd, &r), gs);
                if wd != 0.0 {
                    gs.iter_mut()
                        .zip(ps.iter())
                        .for_each(|(g, p)| *g += wd * *p);
                }
                if mom == 0.0 {
                    bs.copy_from_slice(gs);
                } else {
                    if first_step {
                        bs.copy_from_slice(gs);
                    } else {
                        decode_into(f, elems(b, f, &r), bs);
                        bs.iter_mut()
                            .zip(gs.iter())
                            .for_each(|(b, g)| *b = *b * mom + *g);
                    }
                    encode_f32(f, bs, elems_mut(b, f, &r));
                }
                ps.iter_mut()
                    .zip(bs.iter())
                    .for_each(|(p, b)| *p += neg_lr * *b);
                encode_f32(f, ps, elems_mut(p, f, &r));
            }
            Ok(())
        })
    }
}
