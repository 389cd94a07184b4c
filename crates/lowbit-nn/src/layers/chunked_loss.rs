//! The output head and softmax cross-entropy, fused by chunks of rows so that the
//! `[rows, vocab]` logits never exist at once (a 128k vocabulary's logits for a whole microbatch
//! would outweigh the model): per chunk the logits are computed, turned into their gradient in
//! place ([`Device::cross_entropy_rows`]), and consumed by the two products of the backward.

use lowbit_device::{DType, Device, MatmulSpec, View};

use super::{Linear, Scratch, accumulate, load_f32};
use crate::error::check_len;
use crate::{Hooks, NnError, Result, Usage};

/// The output head `logits = x·Wᵀ` (`W [vocab, dim]`, no bias) and the mean softmax
/// cross-entropy of its rows, computed `chunk_rows` rows at a time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkedCrossEntropy {
    /// The head: `in_features = dim`, `out_features = vocab`, no bias.
    pub head: Linear,
    /// Rows per chunk (> 0); the last chunk may be shorter.
    pub chunk_rows: usize,
}

/// Where [`ChunkedCrossEntropy::forward_backward`] leaves the head's weight gradient.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeadGrad {
    /// Accumulated into the hooks' gradient (through `scratch.grad`) and reported ready.
    Report,
    /// Written (not added) into this f32 view of `vocab·dim` and **not** reported: a tied
    /// embedding adds its own gradient to it ([`super::GradStart::Add`]) and reports the weight.
    Keep(View),
}

/// The loss's own scratch (all f32, owned by the model).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LossScratch {
    /// At least `chunk_rows·vocab`: one chunk's logits, then their gradient.
    pub logits: View,
    /// At least `rows`: the per-row losses.
    pub losses: View,
    /// At least `vocab·dim`: the weight fetched with [`Usage::Forward`], as f32.
    pub weight_fwd: View,
    /// At least `vocab·dim`: the weight fetched with [`Usage::Backward`], as f32.
    pub weight_bwd: View,
    /// bf16, at least `chunk_rows·vocab` (optional): in a fast mode each chunk's logits
    /// gradient is written here rounded once to bf16 ([`Device::cross_entropy_rows_bf16_grad`]),
    /// the operand both backward products would round it to, which saves their two casts of
    /// the f32 gradient. The same bits as without it.
    pub dlogits: Option<View>,
}

fn spec(m: usize, n: usize, k: usize, trans_a: bool, trans_b: bool, acc: bool) -> MatmulSpec {
    MatmulSpec {
        m,
        n,
        k,
        trans_a,
        trans_b,
        accumulate: acc,
    }
}

/// The head's weight for every chunk's products, fetched once with `usage` into `work`: in the
/// bf16 mode cast once to bf16 (RNE) in the head of `work` seen as bf16 — each chunk's product
/// would round an f32 copy to the same bf16 values, once per chunk — else its f32 copy
/// ([`load_f32`]). The same bits either way.
fn head_weight(
    dev: &mut Device,
    hooks: &mut dyn Hooks,
    p: usize,
    usage: Usage,
    work: View,
) -> Result<View> {
    if !dev.matmul_mode().is_fast() {
        return load_f32(dev, hooks, p, usage, work);
    }
    let v = hooks.param(dev, p, usage)?;
    let n = v.len();
    let t = work
        .slice(0..n.div_ceil(2))?
        .reinterpret(DType::Bf16)?
        .slice(0..n)?;
    dev.cast(v, t)?;
    Ok(t)
}

impl ChunkedCrossEntropy {
    /// `(vocab, dim)`, after checking the views every entry point shares.
    fn check(
        &self,
        x: View,
        targets: View,
        rows: usize,
        work: &LossScratch,
    ) -> Result<(usize, usize)> {
        let (v, d) = (self.head.out_features, self.head.in_features);
        if self.chunk_rows == 0 {
            return Err(NnError::Input(
                "chunked cross-entropy: chunk_rows is 0".into(),
            ));
        }
        if rows == 0 {
            return Err(NnError::Input("chunked cross-entropy: no rows".into()));
        }
        if self.head.bias.is_some() {
            return Err(NnError::Input(
                "chunked cross-entropy: the head has a bias".into(),
            ));
        }
        check_len("loss input", x.len(), rows * d)?;
        check_len("loss targets", targets.len(), rows)?;
        let need = |what, view: View, n: usize| {
            if view.len() < n {
                Err(NnError::Shape {
                    what,
                    got: view.len(),
                    want: n,
                })
            } else {
                Ok(())
            }
        };
        need(
            "loss logits scratch",
            work.logits,
            self.chunk_rows.min(rows) * v,
        )?;
        need("loss losses scratch", work.losses, rows)?;
        need("loss weight scratch", work.weight_fwd, v * d)?;
        Ok((v, d))
    }

    /// The mean of the per-row losses: `Σ_r f64(losses[r])` in row order, divided by `rows` in
    /// f64 and rounded to f32, exactly as [`Device::softmax_cross_entropy`] averages. The one
    /// host computation of the layers: `rows` values come back (the device op does the same).
    fn mean(dev: &mut Device, losses: View) -> Result<f32> {
        let l = dev.download::<f32>(losses)?;
        let total = l.iter().fold(0f64, |s, &l| s + f64::from(l));
        Ok((total / l.len() as f64) as f32)
    }

    /// The mean loss of `x [rows, dim]` against `targets` (f32 `[rows]`, integers in
    /// `0..vocab`) and its gradients, per chunk of `chunk_rows` rows:
    /// `logits = x_c·Wᵀ`; [`Device::cross_entropy_rows`] with `c = fl32(scale / rows)` (f64)
    /// overwrites them with `dlogits`; `dx_c = dlogits·W` (written into `dx [rows, dim]`);
    /// `dW = dlogitsᵀ·x_c` (the first chunk writes, later chunks add) into `scratch.grad` or
    /// the [`HeadGrad::Keep`] view. After the last chunk, [`HeadGrad::Report`] accumulates `dW`
    /// and reports the head ready. The weight is fetched once with [`Usage::Forward`] (into
    /// `work.weight_fwd`, before the first chunk) and once with [`Usage::Backward`] (into
    /// `work.weight_bwd`, right before the first `dx`). The mean is that of
    /// [`Device::softmax_cross_entropy`] (row losses summed in f64 in row order), the per-row
    /// losses are left in `work.losses`.
    ///
    /// Chunking changes no bit of the loss or `dx` (both are per row). `dW` is the sum over
    /// chunks, in chunk order, of each chunk's product (itself summed over its rows from `+0`,
    /// [`Device::matmul`]'s order), so its bits depend on `chunk_rows` through that association
    /// (to f32 rounding), never on anything else.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_backward(
        &self,
        dev: &mut Device,
        hooks: &mut dyn Hooks,
        x: View,
        targets: View,
        dx: View,
        rows: usize,
        scale: f32,
        work: LossScratch,
        scratch: Scratch,
        head_grad: HeadGrad,
    ) -> Result<f32> {
        let (v, d) = self.check(x, targets, rows, &work)?;
        check_len("loss input gradient", dx.len(), rows * d)?;
        if work.weight_bwd.len() < v * d {
            return Err(NnError::Shape {
                what: "loss weight scratch",
                got: work.weight_bwd.len(),
                want: v * d,
            });
        }
        let dw = match head_grad {
            HeadGrad::Report => scratch.grad.slice(0..v * d)?,
            HeadGrad::Keep(view) => {
                check_len("loss kept head gradient", view.len(), v * d)?;
                view
            }
        };
        let c = (f64::from(scale) / rows as f64) as f32;
        let wf = head_weight(
            dev,
            hooks,
            self.head.weight,
            Usage::Forward,
            work.weight_fwd,
        )?;
        check_len("loss head weight", wf.len(), v * d)?;
        let mut wb = None;
        for r0 in (0..rows).step_by(self.chunk_rows) {
            let n = self.chunk_rows.min(rows - r0);
            let xc = x.slice(r0 * d..(r0 + n) * d)?;
            let logits = work.logits.slice(0..n * v)?;
            dev.matmul(xc, wf, logits, &spec(n, v, d, false, true, false))?;
            let (t, l) = (targets.slice(r0..r0 + n)?, work.losses.slice(r0..r0 + n)?);
            let g = match work.dlogits {
                Some(b) if dev.matmul_mode().is_fast() && b.len() >= n * v => {
                    let b = b.slice(0..n * v)?;
                    dev.cross_entropy_rows_bf16_grad(logits, t, l, c, b)?;
                    b
                }
                _ => {
                    dev.cross_entropy_rows(logits, t, l, Some(c))?;
                    logits
                }
            };
            let w = match wb {
                Some(w) => w,
                None => {
                    let w = head_weight(
                        dev,
                        hooks,
                        self.head.weight,
                        Usage::Backward,
                        work.weight_bwd,
                    )?;
                    wb = Some(w);
                    w
                }
            };
            let dxc = dx.slice(r0 * d..(r0 + n) * d)?;
            dev.matmul(g, w, dxc, &spec(n, d, v, false, false, false))?;
            dev.matmul(g, xc, dw, &spec(v, d, n, true, false, r0 > 0))?;
        }
        if head_grad == HeadGrad::Report {
            accumulate(dev, hooks, self.head.weight, dw)?;
        }
        Self::mean(dev, work.losses.slice(0..rows)?)
    }

    /// The same mean loss without gradients (evaluation): the weight fetched once with
    /// [`Usage::Forward`]; the per-row losses left in `work.losses` (`weight_bwd` unused).
    pub fn forward(
        &self,
        dev: &mut Device,
        hooks: &mut dyn Hooks,
        x: View,
        targets: View,
        rows: usize,
        work: LossScratch,
    ) -> Result<f32> {
        let (v, d) = self.check(x, targets, rows, &work)?;
        let wf = head_weight(
            dev,
            hooks,
            self.head.weight,
            Usage::Forward,
            work.weight_fwd,
        )?;
        check_len("loss head weight", wf.len(), v * d)?;
        for r0 in (0..rows).step_by(self.chunk_rows) {
            let n = self.chunk_rows.min(rows - r0);
            let xc = x.slice(r0 * d..(r0 + n) * d)?;
            let logits = work.logits.slice(0..n * v)?;
            dev.matmul(xc, wf, logits, &spec(n, v, d, false, true, false))?;
            let (t, l) = (targets.slice(r0..r0 + n)?, work.losses.slice(r0..r0 + n)?);
            dev.cross_entropy_rows(logits, t, l, None)?;
        }
        Self::mean(dev, work.losses.slice(0..rows)?)
    }
}

#[cfg(test)]
mod tests {
    use lowbit_device::{DType, MatmulMode};

    use super::*;
    use crate::layers::f64check::{central_diff, f64s, worst_rel};
    use crate::layers::{Embedding, GradStart};
    use crate::testing::{Call, TestHooks, scratch, upload, values};

    const ROWS: usize = 7;
    const V: usize = 6;
    const D: usize = 4;
    const T: [f32; ROWS] = [5.0, 0.0, 3.0, 3.0, 1.0, 5.0, 2.0];
    const SCALE: f32 = 0.75;

    /// `scale · mean_r(logsumexp(x_r·Wᵀ) − (x_r·Wᵀ)[t_r])` in f64.
    fn loss64(x: &[f64], w: &[f64]) -> f64 {
        let mut total = 0.0;
        for (r, xr) in x.chunks(D).enumerate() {
            let z: Vec<f64> = w
                .chunks(D)
                .map(|wr| xr.iter().zip(wr).map(|(a, b)| a * b).sum())
                .collect();
            let mx = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = mx + z.iter().map(|v| (v - mx).exp()).sum::<f64>().ln();
            total += lse - z[T[r] as usize];
        }
        f64::from(SCALE) * total / ROWS as f64
    }

    struct Run {
        loss: f32,
        losses: Vec<f32>,
        dx: Vec<f32>,
        dw: Vec<f32>,
        calls: Vec<Call>,
    }

    fn work(dev: &mut Device, chunk: usize) -> LossScratch {
        LossScratch {
            logits: dev.alloc(DType::F32, chunk.min(ROWS) * V),
            losses: dev.alloc(DType::F32, ROWS),
            weight_fwd: dev.alloc(DType::F32, V * D),
            weight_bwd: dev.alloc(DType::F32, V * D),
            dlogits: None,
        }
    }

    fn run(x: &[f32], w: &[f32], chunk: usize) -> Run {
        let mut dev = Device::cpu();
        let mut hooks = TestHooks::new(&mut dev, &[w.to_vec()]);
        let loss = ChunkedCrossEntropy {
            head: Linear::new(0, D, V),
            chunk_rows: chunk,
        };
        let (xv, t) = (upload(&mut dev, x), upload(&mut dev, &T));
        let dx = dev.alloc(DType::F32, ROWS * D);
        let (wk, s) = (work(&mut dev, chunk), scratch(&mut dev, V * D));
        let l = loss
            .forward_backward(
                &mut dev,
                &mut hooks,
                xv,
                t,
                dx,
                ROWS,
                SCALE,
                wk,
                s,
                HeadGrad::Report,
            )
            .unwrap();
        let calls = hooks.calls.clone();
        // The evaluation forward gives the same loss and per-row losses.
        let losses = dev.download::<f32>(wk.losses).unwrap();
        dev.zero(wk.losses).unwrap();
        let e = loss.forward(&mut dev, &mut hooks, xv, t, ROWS, wk).unwrap();
        assert_eq!(e.to_bits(), l.to_bits());
        assert_eq!(dev.download::<f32>(wk.losses).unwrap(), losses);
        Run {
            loss: l,
            losses,
            dx: dev.download(dx).unwrap(),
            dw: hooks.grad_of(&dev, 0),
            calls,
        }
    }

    fn inputs() -> (Vec<f32>, Vec<f32>) {
        let x: Vec<f32> = values(1, ROWS * D).iter().map(|v| 2.0 * v).collect();
        (x, values(2, V * D))
    }

    #[test]
    fn loss_and_gradients_match_f64_differences() {
        let (x, w) = inputs();
        let r = run(&x, &w, 3);
        let (x64, w64) = (f64s(&x), f64s(&w));
        let want = loss64(&x64, &w64) / f64::from(SCALE);
        assert!(
            (f64::from(r.loss) - want).abs() < 1e-6 * want,
            "{} vs {want}",
            r.loss
        );
        let dx = central_diff(&x64, 1e-6, |x| loss64(x, &w64));
        let dw = central_diff(&w64, 1e-6, |w| loss64(&x64, w));
        let (ex, ew) = (worst_rel(&r.dx, &dx), worst_rel(&r.dw, &dw));
        // Worst relative errors measured: dx 1.1e-7, dW 5.5e-8.
        assert!(ex < 1e-5 && ew < 1e-5, "dx {ex}, dW {ew}");
        let fwd_bwd = [
            Call::Param(0, Usage::Forward),
            Call::Param(0, Usage::Backward),
        ];
        assert_eq!(
            r.calls,
            [fwd_bwd.as_slice(), &[Call::Grad(0), Call::Ready(0)]].concat()
        );
    }

    /// The bf16 mode's head weight, cast to bf16 once, gives the bits of the products on its
    /// f32 copy (which round it to bf16 each): the loss, dx and dW of a reference built from
    /// the device ops.
    #[test]
    fn the_bf16_mode_head_weight_cast_once_changes_no_bit() {
        for bf16_grad in [false, true] {
            bf16_mode_case(bf16_grad);
        }
    }

    /// The case of the test above, the logits gradient in place or into a bf16 buffer.
    fn bf16_mode_case(bf16_grad: bool) {
        let (x, w) = inputs();
        let chunk = 3;
        let mut dev = Device::cpu();
        dev.set_matmul_mode(MatmulMode::Bf16);
        let mut hooks = TestHooks::new(&mut dev, std::slice::from_ref(&w));
        let loss = ChunkedCrossEntropy {
            head: Linear::new(0, D, V),
            chunk_rows: chunk,
        };
        let (xv, t) = (upload(&mut dev, &x), upload(&mut dev, &T));
        let dx = dev.alloc(DType::F32, ROWS * D);
        let (mut wk, s) = (work(&mut dev, chunk), scratch(&mut dev, V * D));
        if bf16_grad {
            wk.dlogits = Some(dev.alloc(DType::Bf16, chunk * V));
        }
        let l = loss
            .forward_backward(
                &mut dev,
                &mut hooks,
                xv,
                t,
                dx,
                ROWS,
                SCALE,
                wk,
                s,
                HeadGrad::Report,
            )
            .unwrap();
        // The reference: every product on the f32 weight and the f32 gradient.
        let wf = upload(&mut dev, &w);
        let (logits, losses) = (
            dev.alloc(DType::F32, chunk * V),
            dev.alloc(DType::F32, ROWS),
        );
        let (dx_ref, dw_ref) = (
            dev.alloc(DType::F32, ROWS * D),
            dev.alloc(DType::F32, V * D),
        );
        let c = (f64::from(SCALE) / ROWS as f64) as f32;
        for r0 in (0..ROWS).step_by(chunk) {
            let n = chunk.min(ROWS - r0);
            let xc = xv.slice(r0 * D..(r0 + n) * D).unwrap();
            let lg = logits.slice(0..n * V).unwrap();
            dev.matmul(xc, wf, lg, &spec(n, V, D, false, true, false))
                .unwrap();
            let (tc, lc) = (
                t.slice(r0..r0 + n).unwrap(),
                losses.slice(r0..r0 + n).unwrap(),
            );
            dev.cross_entropy_rows(lg, tc, lc, Some(c)).unwrap();
            let dxc = dx_ref.slice(r0 * D..(r0 + n) * D).unwrap();
            dev.matmul(lg, wf, dxc, &spec(n, D, V, false, false, false))
                .unwrap();
            dev.matmul(lg, xc, dw_ref, &spec(V, D, n, true, false, r0 > 0))
                .unwrap();
        }
        let bits = |v: Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let want = ChunkedCrossEntropy::mean(&mut dev, losses).unwrap();
        assert_eq!(l.to_bits(), want.to_bits(), "loss");
        assert_eq!(
            bits(dev.download(dx).unwrap()),
            bits(dev.download(dx_ref).unwrap()),
            "dx"
        );
        assert_eq!(
            bits(hooks.grad_of(&dev, 0)),
            bits(dev.download(dw_ref).unwrap()),
            "dW"
        );
    }

    #[test]
    fn chunks_change_no_bit_of_the_loss_or_dx() {
        let (x, w) = inputs();
        let one = run(&x, &w, ROWS);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for chunk in [1, 3, 4, 100] {
            let c = run(&x, &w, chunk);
            assert_eq!(c.loss.to_bits(), one.loss.to_bits(), "loss, chunk {chunk}");
            assert_eq!(bits(&c.losses), bits(&one.losses), "losses, chunk {chunk}");
            assert_eq!(bits(&c.dx), bits(&one.dx), "dx, chunk {chunk}");
            // dW adds the chunks' partial sums: equal to rounding, not bit for bit.
            let dw64 = f64s(&one.dw);
            assert!(worst_rel(&c.dw, &dw64) < 1e-6, "dW, chunk {chunk}");
        }
        assert_eq!(
            bits(&run(&x, &w, 100).dw),
            bits(&one.dw),
            "one chunk either way"
        );
    }

    #[test]
    fn a_tied_head_keeps_its_gradient_for_the_embedding_to_report() {
        let (x, w) = inputs();
        let mut dev = Device::cpu();
        let mut hooks = TestHooks::new(&mut dev, std::slice::from_ref(&w));
        let loss = ChunkedCrossEntropy {
            head: Linear::new(0, D, V),
            chunk_rows: 3,
        };
        let (xv, t) = (upload(&mut dev, &x), upload(&mut dev, &T));
        let dx = dev.alloc(DType::F32, ROWS * D);
        let (wk, s) = (work(&mut dev, 3), scratch(&mut dev, V * D));
        let kept = upload(&mut dev, &[9.0; V * D]); // overwritten, not added to
        let keep = HeadGrad::Keep(kept);
        loss.forward_backward(&mut dev, &mut hooks, xv, t, dx, ROWS, SCALE, wk, s, keep)
            .unwrap();
        let fwd_bwd = [
            Call::Param(0, Usage::Forward),
            Call::Param(0, Usage::Backward),
        ];
        assert_eq!(hooks.calls, fwd_bwd, "kept: not reported");
        let head_dw = dev.download::<f32>(kept).unwrap();
        assert_eq!(head_dw, run(&x, &w, 3).dw, "the same dW as reported untied");
        // The embedding's backward adds its rows and reports the tied weight once.
        let ids = upload(&mut dev, &[1.0, 4.0, 1.0]);
        let dy = upload(&mut dev, &values(3, 3 * D));
        let emb = Embedding {
            weight: 0,
            vocab: V,
            dim: D,
        };
        emb.backward(&mut dev, &mut hooks, ids, dy, 3, kept, GradStart::Add)
            .unwrap();
        assert_eq!(hooks.calls[2..], [Call::Grad(0), Call::Ready(0)]);
        let want = upload(&mut dev, &head_dw);
        dev.embedding_backward(ids, dy, want).unwrap();
        assert_eq!(hooks.grad_of(&dev, 0), dev.download::<f32>(want).unwrap());
    }

    #[test]
    fn bad_shapes_are_refused_before_any_call() {
        let mut dev = Device::cpu();
        let mut hooks = TestHooks::new(&mut dev, &[values(2, V * D)]);
        let (x, t) = (dev.alloc(DType::F32, ROWS * D), upload(&mut dev, &T));
        let dx = dev.alloc(DType::F32, ROWS * D);
        let (mut wk, s) = (work(&mut dev, 3), scratch(&mut dev, V * D));
        wk.logits = dev.alloc(DType::F32, 3 * V - 1);
        let loss = ChunkedCrossEntropy {
            head: Linear::new(0, D, V),
            chunk_rows: 3,
        };
        let r = loss.forward_backward(
            &mut dev,
            &mut hooks,
            x,
            t,
            dx,
            ROWS,
            1.0,
            wk,
            s,
            HeadGrad::Report,
        );
        assert!(matches!(r, Err(NnError::Shape { .. })));
        let zero = ChunkedCrossEntropy {
            chunk_rows: 0,
            ..loss
        };
        assert!(matches!(
            zero.forward(&mut dev, &mut hooks, x, t, ROWS, wk),
            Err(NnError::Input(_))
        ));
        assert!(hooks.calls.is_empty());
    }
}
