//! The linear layer `y = x·Wᵀ (+ b)`, `W: [out, in]` (PyTorch's `nn.Linear` layout).

use lowbit_device::{
    DType, Device, Fp8Kind, MatmulMode, MatmulMxSpec, MatmulSpec, MxArg, MxLayout, View,
};

use super::{Scratch, accumulate, load_f32};
use crate::error::check_len;
use crate::{Hooks, Result, Usage};

/// A linear layer: parameter ids and widths. `weight` is `[out_features, in_features]`, `bias`
/// (if any) `[out_features]`.
///
/// The forward fetches the weight with [`Usage::Forward`] and the backward with
/// [`Usage::Backward`], so a low-precision weight is used rowwise for `x·Wᵀ` and columnwise for
/// `dY·W`, as block-scaled GEMMs do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Linear {
    /// The weight's parameter id.
    pub weight: usize,
    /// The bias's parameter id, if the layer has one.
    pub bias: Option<usize>,
    /// Input features (columns of the weight).
    pub in_features: usize,
    /// Output features (rows of the weight).
    pub out_features: usize,
}

/// Where [`Linear::backward`] puts the gradient of the layer's input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InputGrad {
    /// Not computed (the first layer of a model; the weight is not fetched again).
    Skip,
    /// Written over the view (`dx = dY·W`).
    Write(View),
    /// Added into the view (`dx += dY·W`), for an input that feeds several layers.
    Add(View),
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

/// The input several linear layers share (q, k, v of one norm's output; gate and up), cast
/// to bf16 once: under [`MatmulMode::Bf16`], with `x` f32 and `free` an f32 view of at least
/// `x.len() / 2` words that overlaps `x` in no byte and holds nothing needed until the layers
/// have run, `bf16(x)` (RNE, [`Device::cast`]) in the head of `free` seen as bf16; otherwise
/// `x` itself. The products then take it as it is instead of casting `x` once each, and their
/// bits do not change: the bf16 mode rounds an f32 operand to bf16 the same way
/// ([`Device::matmul`]). In the exact mode the layers keep the f32 input (nothing is cast).
pub fn shared_input(dev: &mut Device, x: View, free: View) -> Result<View> {
    let fits = x.dtype() == DType::F32
        && free.dtype() == DType::F32
        && 2 * free.len() >= x.len()
        && !free.overlaps(&x);
    if !dev.matmul_mode().is_fast() || !fits || x.is_empty() {
        return Ok(x);
    }
    let words = x.len().div_ceil(2);
    let t = free
        .slice(0..words)?
        .reinterpret(DType::Bf16)?
        .slice(0..x.len())?;
    dev.cast(x, t)?;
    Ok(t)
}

/// A weight for one product right away (nothing may call the hooks in between): under
/// [`MatmulMode::Bf16`] a bf16 parameter view as the hooks give it, since the product would
/// round its f32 copy back to the same bf16 values (bf16 → f32 is exact), which saves two casts
/// of the weight per product; otherwise its f32 copy in `scratch` ([`load_f32`]).
fn weight_operand(
    dev: &mut Device,
    hooks: &mut dyn Hooks,
    p: usize,
    usage: Usage,
    scratch: View,
) -> Result<View> {
    if !dev.matmul_mode().is_fast() {
        return load_f32(dev, hooks, p, usage, scratch);
    }
    let v = hooks.param(dev, p, usage)?;
    if v.dtype() == DType::Bf16 {
        return Ok(v);
    }
    let w = scratch.slice(0..v.len())?;
    dev.cast(v, w)?;
    Ok(w)
}

/// The element type of every operand of [`MatmulMode::Mxfp8`]'s GEMMs: E4M3 for activations,
/// weights and gradients alike, Transformer Engine's default for its MXFP8 recipe
/// (`MXFP8BlockScaling(fp8_format=Format.E4M3)`; per-32 scales leave E5M2's range unneeded).
pub const MXFP8_KIND: Fp8Kind = Fp8Kind::E4M3;

/// A float matrix as an MXFP8 operand, quantized along the product's contraction.
fn float_arg(values: View, layout: MxLayout) -> MxArg {
    MxArg::Float {
        values,
        layout,
        kind: MXFP8_KIND,
    }
}

/// The weight as an MXFP8 operand for `usage`: the stored plane when the primary weights are
/// MXFP8 (no dequantize pass), else the hooks' values quantized by the product (rowwise for the
/// forward, columnwise for the backward).
fn weight_mx(
    dev: &mut Device,
    hooks: &mut dyn Hooks,
    p: usize,
    usage: Usage,
    scratch: View,
) -> Result<MxArg> {
    if let Some(op) = hooks.param_mxfp8(dev, p, usage)? {
        return Ok(MxArg::Quantized(op));
    }
    let w = weight_operand(dev, hooks, p, usage, scratch)?;
    let layout = match usage {
        Usage::Forward => MxLayout::Rowwise,
        Usage::Backward => MxLayout::Columnwise,
    };
    Ok(float_arg(w, layout))
}

fn mx_spec(m: usize, n: usize, k: usize, accumulate: bool) -> MatmulMxSpec {
    MatmulMxSpec {
        m,
        n,
        k,
        accumulate,
    }
}

impl Linear {
    /// A layer without bias.
    pub fn new(weight: usize, in_features: usize, out_features: usize) -> Linear {
        Linear {
            weight,
            bias: None,
            in_features,
            out_features,
        }
    }

    /// The layer with bias parameter `bias`.
    pub fn with_bias(self, bias: usize) -> Linear {
        Linear {
            bias: Some(bias),
            ..self
        }
    }

    /// `y[rows, out] = x[rows, in]·Wᵀ`, then `+ b` per row. Ops: the weight cast into
    /// `scratch.param` (in the bf16 mode a bf16 weight is used as the hooks give it), one
    /// matmul, then the bias cast into the same scratch and `add_bias`.
    pub fn forward(
        &self,
        dev: &mut Device,
        hooks: &mut dyn Hooks,
        x: View,
        y: View,
        rows: usize,
        scratch: Scratch,
    ) -> Result<()> {
        self.forward_with(dev, hooks, x, None, y, rows, scratch)
    }

    /// `y = x·Wᵀ (+ b) + residual` (`residual` f32 `rows·out`, disjoint from `y`): the bits of
    /// [`Linear::forward`] followed by `Device::add(residual, y)`. Without a bias and outside
    /// [`MatmulMode::Mxfp8`] the product and the add are one [`Device::matmul_add`], which in
    /// the bf16 mode adds the residual in the GEMM's epilogue (no pass over `y`).
    #[allow(clippy::too_many_arguments)]
    pub fn forward_add(
        &self,
        dev: &mut Device,
        hooks: &mut dyn Hooks,
        x: View,
        residual: View,
        y: View,
        rows: usize,
        scratch: Scratch,
    ) -> Result<()> {
        self.forward_with(dev, hooks, x, Some(residual), y, rows, scratch)
    }

    /// [`Linear::forward`], then `+ residual` where one is given ([`Linear::forward_add`]).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward_with(
        &self,
        dev: &mut Device,
        hooks: &mut dyn Hooks,
        x: View,
        residual: Option<View>,
        y: View,
        rows: usize,
        scratch: Scratch,
    ) -> Result<()> {
        let (i, o) = (self.in_features, self.out_features);
        check_len("linear input", x.len(), rows * i)?;
        check_len("linear output", y.len(), rows * o)?;
        if let Some(r) = residual {
            check_len("linear residual", r.len(), rows * o)?;
        }
        // The residual still to add after the product (and the bias).
        let mut pending = residual;
        if dev.matmul_mode() == MatmulMode::Mxfp8 {
            // Y = X·Wᵀ: the rowwise copies of X and W.
            let w = weight_mx(dev, hooks, self.weight, Usage::Forward, scratch.param)?;
            let xa = float_arg(x, MxLayout::Rowwise);
            dev.matmul_mx(xa, w, y, &mx_spec(rows, o, i, false))?;
        } else {
            let w = weight_operand(dev, hooks, self.weight, Usage::Forward, scratch.param)?;
            check_len("linear weight", w.len(), o * i)?;
            let sp = spec(rows, o, i, false, true, false);
            match residual {
                Some(r) if self.bias.is_none() => {
                    dev.matmul_add(x, w, r, y, &sp)?;
                    pending = None;
                }
                _ => dev.matmul(x, w, y, &sp)?,
            }
        }
        if let Some(pb) = self.bias {
            let b = load_f32(dev, hooks, pb, Usage::Forward, scratch.param)?;
            check_len("linear bias", b.len(), o)?;
            dev.add_bias(y, b)?;
        }
        if let Some(r) = pending {
            dev.add(r, y)?;
        }
        Ok(())
    }

    /// The backward of [`Linear::forward`] given `dy[rows, out]` and the forward's input `x`:
    /// the bias gradient (column sums of `dy`) accumulated and reported ready, then the weight
    /// gradient `dYᵀ·x` accumulated and reported ready, then the input gradient `dY·W` as `dx`
    /// asks (the weight fetched again, for the backward). The bias gradient passes through
    /// `scratch.grad`; the weight gradient too unless the hooks' gradient is f32, which the
    /// product then accumulates into directly (same bits), and in [`MatmulMode::Mxfp8`].
    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &self,
        dev: &mut Device,
        hooks: &mut dyn Hooks,
        x: View,
        dy: View,
        dx: InputGrad,
        rows: usize,
        scratch: Scratch,
    ) -> Result<()> {
        let (i, o) = (self.in_features, self.out_features);
        check_len("linear input", x.len(), rows * i)?;
        check_len("linear output gradient", dy.len(), rows * o)?;
        if let Some(pb) = self.bias {
            let db = scratch.grad.slice(0..o)?;
            dev.bias_grad(dy, db, false)?;
            accumulate(dev, hooks, pb, db)?;
        }
        let mx = dev.matmul_mode() == MatmulMode::Mxfp8;
        let dw = scratch.grad.slice(0..o * i)?;
        // The bf16 mode: dY cast to bf16 once for both products (each would round it the same
        // way) where the gradient scratch has room past dW that nothing else of the backward
        // touches; otherwise each product casts it.
        let free = scratch.grad.slice(o * i..scratch.grad.len().max(o * i))?;
        let clear = |v: &View| !free.overlaps(v);
        let dx_view = match dx {
            InputGrad::Write(v) | InputGrad::Add(v) => Some(v),
            InputGrad::Skip => None,
        };
        let dy = if dev.matmul_mode() == MatmulMode::Bf16
            && clear(&x)
            && clear(&scratch.param)
            && dx_view.as_ref().is_none_or(clear)
        {
            shared_input(dev, dy, free)?
        } else {
            dy
        };
        if mx {
            // dW = dYᵀ·X contracts over the rows (tokens): the columnwise copies of dY and X.
            let (a, b) = (
                float_arg(dy, MxLayout::Columnwise),
                float_arg(x, MxLayout::Columnwise),
            );
            dev.matmul_mx(a, b, dw, &mx_spec(o, i, rows, false))?;
            accumulate(dev, hooks, self.weight, dw)?;
        } else {
            // dW = dYᵀ·X added straight into an f32 gradient (the product's `C ← C + s` is one
            // rounding of `old + s`, the bits of `s` into scratch then the add): Megatron's
            // gradient-accumulation fusion, which saves a pass over dW. Other gradient dtypes
            // take the scratch and the add.
            let g = hooks.grad(dev, self.weight)?;
            if g.dtype() == DType::F32 && g.len() == o * i {
                dev.matmul(dy, x, g, &spec(o, i, rows, true, false, true))?;
            } else {
                dev.matmul(dy, x, dw, &spec(o, i, rows, true, false, false))?;
                dev.add(dw, g)?;
            }
            hooks.grad_ready(dev, self.weight)?;
        }
        let (dx, add) = match dx {
            InputGrad::Skip => return Ok(()),
            InputGrad::Write(v) => (v, false),
            InputGrad::Add(v) => (v, true),
        };
        check_len("linear input gradient", dx.len(), rows * i)?;
        if mx {
            // dX = dY·W contracts over the outputs: dY's rowwise copy, W's columnwise one.
            let w = weight_mx(dev, hooks, self.weight, Usage::Backward, scratch.param)?;
            let a = float_arg(dy, MxLayout::Rowwise);
            dev.matmul_mx(a, w, dx, &mx_spec(rows, i, o, add))?;
            return Ok(());
        }
        let w = weight_operand(dev, hooks, self.weight, Usage::Backward, scratch.param)?;
        check_len("linear weight", w.len(), o * i)?;
        dev.matmul(dy, w, dx, &spec(rows, i, o, false, false, add))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use lowbit_device::DType;

    use super::*;
    use crate::testing::{
        Call, TestHooks, assert_close, central_diff, dot, scratch, upload, values,
    };

    const ROWS: usize = 3;
    const IN: usize = 4;
    const OUT: usize = 2;

    fn layer() -> Linear {
        Linear::new(0, IN, OUT).with_bias(1)
    }

    /// `Σ c ⊙ (x·Wᵀ + b)` with the layer's forward on the device.
    fn probe(dev: &mut Device, w: &[f32], b: &[f32], x: &[f32], c: &[f32]) -> f32 {
        let mut hooks = TestHooks::new(dev, &[w.to_vec(), b.to_vec()]);
        let (xv, y, s) = (
            upload(dev, x),
            dev.alloc(DType::F32, ROWS * OUT),
            scratch(dev, 8),
        );
        layer().forward(dev, &mut hooks, xv, y, ROWS, s).unwrap();
        dot(&dev.download::<f32>(y).unwrap(), c)
    }

    /// The bf16 mode's shared input changes no bit of the forward or the weight gradient, and
    /// the exact mode keeps the f32 input untouched.
    #[test]
    fn a_shared_bf16_input_gives_the_same_bits() {
        let (w, b, x, dy) = (
            values(1, OUT * IN),
            values(2, OUT),
            values(3, ROWS * IN),
            values(4, ROWS * OUT),
        );
        let run = |shared: bool| {
            let mut dev = Device::cpu();
            dev.set_matmul_mode(MatmulMode::Bf16);
            let mut hooks = TestHooks::new(&mut dev, &[w.clone(), b.clone()]);
            let (xv, y) = (upload(&mut dev, &x), dev.alloc(DType::F32, ROWS * OUT));
            let (dyv, s) = (upload(&mut dev, &dy), scratch(&mut dev, OUT * IN));
            let free = dev.alloc(DType::F32, ROWS * IN / 2);
            let xs = if shared {
                let t = shared_input(&mut dev, xv, free).unwrap();
                assert_eq!((t.dtype(), t.len()), (DType::Bf16, ROWS * IN));
                t
            } else {
                xv
            };
            layer()
                .forward(&mut dev, &mut hooks, xs, y, ROWS, s)
                .unwrap();
            layer()
                .backward(&mut dev, &mut hooks, xs, dyv, InputGrad::Skip, ROWS, s)
                .unwrap();
            let bits = |v: Vec<f32>| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            (bits(dev.download(y).unwrap()), bits(hooks.grad_of(&dev, 0)))
        };
        assert_eq!(run(true), run(false));
        let mut dev = Device::cpu();
        let (xv, free) = (upload(&mut dev, &x), dev.alloc(DType::F32, ROWS * IN));
        assert_eq!(shared_input(&mut dev, xv, free).unwrap(), xv, "exact mode");
        dev.set_matmul_mode(MatmulMode::Bf16);
        let small = free.slice(0..ROWS * IN / 2 - 1).unwrap();
        assert_eq!(shared_input(&mut dev, xv, small).unwrap(), xv, "too small");
    }

    #[test]
    fn forward_is_x_times_w_transposed_plus_bias() {
        let mut dev = Device::cpu();
        let (w, b, x) = (values(1, OUT * IN), values(2, OUT), values(3, ROWS * IN));
        let mut hooks = TestHooks::new(&mut dev, &[w.clone(), b.clone()]);
        let (xv, y) = (upload(&mut dev, &x), dev.alloc(DType::F32, ROWS * OUT));
        let s = scratch(&mut dev, OUT * IN);
        layer()
            .forward(&mut dev, &mut hooks, xv, y, ROWS, s)
            .unwrap();
        let want: Vec<f32> = (0..ROWS * OUT)
            .map(|e| {
                let (r, o) = (e / OUT, e % OUT);
                dot(&x[r * IN..(r + 1) * IN], &w[o * IN..(o + 1) * IN]) + b[o]
            })
            .collect();
        assert_close("y", &dev.download::<f32>(y).unwrap(), &want, 1e-6);
        let fwd = Usage::Forward;
        assert_eq!(hooks.calls, [Call::Param(0, fwd), Call::Param(1, fwd)]);
    }

    #[test]
    fn forward_computes_with_the_storage_the_hooks_hand_out() {
        // A bf16 weight computes exactly as its values in f32 do: the layer casts, never
        // assumes f32.
        let mut dev = Device::cpu();
        let (w, b, x) = (values(4, OUT * IN), values(5, OUT), values(6, ROWS * IN));
        let mut hooks = TestHooks::new(&mut dev, &[w, b.clone()]);
        let bf = dev.alloc(DType::Bf16, OUT * IN);
        dev.cast(hooks.params[0], bf).unwrap();
        hooks.params[0] = bf;
        let rounded = dev.alloc(DType::F32, OUT * IN);
        dev.cast(bf, rounded).unwrap();
        let rounded: Vec<f32> = dev.download(rounded).unwrap();
        let mut plain = TestHooks::new(&mut dev, &[rounded, b]);
        let xv = upload(&mut dev, &x);
        let s = scratch(&mut dev, OUT * IN);
        let mut out = Vec::new();
        for h in [&mut hooks, &mut plain] {
            let y = dev.alloc(DType::F32, ROWS * OUT);
            layer().forward(&mut dev, h, xv, y, ROWS, s).unwrap();
            out.push(dev.download::<f32>(y).unwrap());
        }
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&out[0]), bits(&out[1]));
    }

    #[test]
    fn backward_matches_central_differences() {
        let mut dev = Device::cpu();
        let (w, b, x) = (values(7, OUT * IN), values(8, OUT), values(9, ROWS * IN));
        let c = values(10, ROWS * OUT);
        let mut hooks = TestHooks::new(&mut dev, &[w.clone(), b.clone()]);
        let (xv, dy) = (upload(&mut dev, &x), upload(&mut dev, &c));
        let dx = upload(&mut dev, &[0.5; ROWS * IN]);
        let s = scratch(&mut dev, OUT * IN);
        let l = layer();
        l.backward(&mut dev, &mut hooks, xv, dy, InputGrad::Add(dx), ROWS, s)
            .unwrap();
        let (bwd, fwd) = (Usage::Backward, Usage::Forward);
        let order = [Call::Grad(1), Call::Ready(1), Call::Grad(0), Call::Ready(0)];
        assert_eq!(hooks.calls[..4], order);
        assert_eq!(hooks.calls[4..], [Call::Param(0, bwd)]);
        let h = 1e-2;
        let dw = central_diff(&w, h, |w| probe(&mut dev, w, &b, &x, &c));
        let db = central_diff(&b, h, |b| probe(&mut dev, &w, b, &x, &c));
        let dxn = central_diff(&x, h, |x| probe(&mut dev, &w, &b, x, &c));
        assert_close("dW", &hooks.grad_of(&dev, 0), &dw, 1e-3);
        assert_close("db", &hooks.grad_of(&dev, 1), &db, 1e-3);
        let added: Vec<f32> = dxn.iter().map(|g| g + 0.5).collect();
        assert_close(
            "dx (added)",
            &dev.download::<f32>(dx).unwrap(),
            &added,
            1e-3,
        );
        // Written, and skipped: the weight is not fetched again.
        hooks.calls.clear();
        l.backward(&mut dev, &mut hooks, xv, dy, InputGrad::Write(dx), ROWS, s)
            .unwrap();
        assert_close("dx", &dev.download::<f32>(dx).unwrap(), &dxn, 1e-3);
        hooks.calls.clear();
        l.backward(&mut dev, &mut hooks, xv, dy, InputGrad::Skip, ROWS, s)
            .unwrap();
        assert_eq!(hooks.calls, order);
        assert!(!hooks.calls.contains(&Call::Param(0, fwd)));
    }

    /// The bf16 mode's backward casts dY once into the gradient scratch past dW when there is
    /// room: the same bits of dX and dW as casting it in each product.
    #[test]
    fn the_bf16_backward_casting_dy_once_changes_no_bit() {
        let (w, b, x, dy) = (
            values(1, OUT * IN),
            values(2, OUT),
            values(3, ROWS * IN),
            values(4, ROWS * OUT),
        );
        let run = |room: usize| {
            let mut dev = Device::cpu();
            dev.set_matmul_mode(MatmulMode::Bf16);
            let mut hooks = TestHooks::new(&mut dev, &[w.clone(), b.clone()]);
            let (xv, dyv) = (upload(&mut dev, &x), upload(&mut dev, &dy));
            let dx = dev.alloc(DType::F32, ROWS * IN);
            let s = Scratch {
                param: dev.alloc(DType::F32, OUT * IN),
                grad: dev.alloc(DType::F32, OUT * IN + room),
            };
            layer()
                .backward(&mut dev, &mut hooks, xv, dyv, InputGrad::Write(dx), ROWS, s)
                .unwrap();
            assert_eq!(
                dev.download::<f32>(dyv).unwrap(),
                dy,
                "dY is left as it was"
            );
            let tail = dev.download::<f32>(s.grad).unwrap()[OUT * IN..].to_vec();
            let bits = |v: Vec<f32>| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            let used = tail.iter().any(|v| v.to_bits() != 0);
            (
                bits(dev.download(dx).unwrap()),
                bits(hooks.grad_of(&dev, 0)),
                used,
            )
        };
        let (dx0, dw0, used0) = run(0);
        let (dx1, dw1, used1) = run(ROWS * OUT);
        assert!(!used0 && used1, "the copy is made only where there is room");
        assert_eq!((dx0, dw0), (dx1, dw1));
    }

    /// The forward with a residual gives the bits of the forward and an add, in both modes.
    #[test]
    fn forward_add_is_forward_then_add() {
        let (w, x, r) = (
            values(1, OUT * IN),
            values(3, ROWS * IN),
            values(5, ROWS * OUT),
        );
        for mode in [MatmulMode::Exact, MatmulMode::Bf16] {
            let l = Linear::new(0, IN, OUT);
            let mut dev = Device::cpu();
            dev.set_matmul_mode(mode);
            let mut hooks = TestHooks::new(&mut dev, std::slice::from_ref(&w));
            let (xv, rv) = (upload(&mut dev, &x), upload(&mut dev, &r));
            let (y0, y1) = (
                dev.alloc(DType::F32, ROWS * OUT),
                dev.alloc(DType::F32, ROWS * OUT),
            );
            let s = scratch(&mut dev, OUT * IN);
            l.forward(&mut dev, &mut hooks, xv, y0, ROWS, s).unwrap();
            dev.add(rv, y0).unwrap();
            l.forward_add(&mut dev, &mut hooks, xv, rv, y1, ROWS, s)
                .unwrap();
            let bits = |v: Vec<f32>| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            let want = bits(dev.download(y0).unwrap());
            assert_eq!(bits(dev.download(y1).unwrap()), want, "{mode:?}");
            assert!(
                l.forward_add(&mut dev, &mut hooks, xv, y1, y1, ROWS, s)
                    .is_err()
            );
        }
    }

    #[test]
    fn shapes_are_checked_before_any_op() {
        let mut dev = Device::cpu();
        let mut hooks = TestHooks::new(&mut dev, &[values(1, OUT * IN), values(2, OUT)]);
        let (x, y) = (
            dev.alloc(DType::F32, ROWS * IN + 1),
            dev.alloc(DType::F32, ROWS * OUT),
        );
        let s = scratch(&mut dev, OUT * IN);
        let e = layer()
            .forward(&mut dev, &mut hooks, x, y, ROWS, s)
            .unwrap_err();
        assert!(
            matches!(
                e,
                crate::NnError::Shape {
                    what: "linear input",
                    ..
                }
            ),
            "{e}"
        );
        assert!(hooks.calls.is_empty());
    }

    /// `v` (`rows × cols`) through one MXFP8 copy and back to f32 (the device's quantizer and
    /// dequantizer): the values a product contracting along that copy's blocks multiplies.
    fn through_mxfp8(
        dev: &mut Device,
        v: &[f32],
        rows: usize,
        cols: usize,
        rowwise: bool,
    ) -> Vec<f64> {
        use lowbit_device::{Mxfp8Config, Mxfp8Views};
        let src = upload(dev, v);
        let data = dev.alloc(DType::U8, rows * cols);
        let (n_scales, copies) = if rowwise {
            (rows * cols.div_ceil(32), lowbit_device::Copies::Rowwise)
        } else {
            (rows.div_ceil(32) * cols, lowbit_device::Copies::Columnwise)
        };
        let scales = dev.alloc(DType::U8, n_scales);
        let cfg = Mxfp8Config {
            copies,
            ..Mxfp8Config::default()
        };
        let out = if rowwise {
            Mxfp8Views {
                rowwise: Some((data, scales)),
                columnwise: None,
            }
        } else {
            Mxfp8Views {
                rowwise: None,
                columnwise: Some((data, scales)),
            }
        };
        dev.quantize_mxfp8(src, rows, cols, &cfg, &out).unwrap();
        let dst = dev.alloc(DType::F32, rows * cols);
        let kind = MXFP8_KIND;
        if rowwise {
            dev.dequantize_mxfp8_rowwise(data, scales, rows, cols, kind, dst)
                .unwrap();
        } else {
            dev.dequantize_mxfp8_columnwise(data, scales, rows, cols, kind, dst)
                .unwrap();
        }
        dev.download::<f32>(dst)
            .unwrap()
            .into_iter()
            .map(f64::from)
            .collect()
    }

    /// `Σₜ a[i, t]·b[j, t]` over logical `[m, k]` and `[n, k]` given as closures, in f64, and
    /// `Σ |terms|` (the scale of f32 summation error).
    fn product(
        m: usize,
        n: usize,
        k: usize,
        a: impl Fn(usize, usize) -> f64,
        b: impl Fn(usize, usize) -> f64,
    ) -> (Vec<f64>, Vec<f64>) {
        let mut out = (vec![0.0; m * n], vec![0.0; m * n]);
        for i in 0..m {
            for j in 0..n {
                for t in 0..k {
                    out.0[i * n + j] += a(i, t) * b(j, t);
                    out.1[i * n + j] += (a(i, t) * b(j, t)).abs();
                }
            }
        }
        out
    }

    /// Under [`MatmulMode::Mxfp8`] every product multiplies the MXFP8 copies its contraction
    /// needs, TE's recipe: `Y = X·Wᵀ` the rowwise copies of X and W, `dW = dYᵀ·X` the
    /// columnwise copies of dY and X (blocks of 32 tokens), `dX = dY·W` dY's rowwise and W's
    /// columnwise copy; each equals the exact product of those dequantized values up to f32
    /// summation error, and differs from the unquantized product by MXFP8's rounding.
    #[test]
    fn mxfp8_mode_multiplies_the_copies_each_contraction_needs() {
        let (rows, inp, out) = (64, 96, 48);
        let layer = Linear::new(0, inp, out);
        let (w, x, dy) = (
            values(11, out * inp),
            values(12, rows * inp),
            values(13, rows * out),
        );
        let mut dev = Device::cpu();
        dev.set_matmul_mode(MatmulMode::Mxfp8);
        let mut hooks = TestHooks::new(&mut dev, std::slice::from_ref(&w));
        let (xv, dyv) = (upload(&mut dev, &x), upload(&mut dev, &dy));
        let (y, dx) = (
            dev.alloc(DType::F32, rows * out),
            dev.alloc(DType::F32, rows * inp),
        );
        let s = scratch(&mut dev, out * inp);
        layer.forward(&mut dev, &mut hooks, xv, y, rows, s).unwrap();
        layer
            .backward(&mut dev, &mut hooks, xv, dyv, InputGrad::Write(dx), rows, s)
            .unwrap();
        let got_y = dev.download::<f32>(y).unwrap();
        let got_dx = dev.download::<f32>(dx).unwrap();
        let got_dw = hooks.grad_of(&dev, 0);

        let mut r = Device::cpu();
        let (xr, wr) = (
            through_mxfp8(&mut r, &x, rows, inp, true),
            through_mxfp8(&mut r, &w, out, inp, true),
        );
        let (xc, wc) = (
            through_mxfp8(&mut r, &x, rows, inp, false),
            through_mxfp8(&mut r, &w, out, inp, false),
        );
        let (dyr, dyc) = (
            through_mxfp8(&mut r, &dy, rows, out, true),
            through_mxfp8(&mut r, &dy, rows, out, false),
        );
        let want_y = product(
            rows,
            out,
            inp,
            |i, t| xr[i * inp + t],
            |j, t| wr[j * inp + t],
        );
        let want_dw = product(
            out,
            inp,
            rows,
            |i, t| dyc[t * out + i],
            |j, t| xc[t * inp + j],
        );
        let want_dx = product(
            rows,
            inp,
            out,
            |i, t| dyr[i * out + t],
            |j, t| wc[t * inp + j],
        );
        let plain_y = product(
            rows,
            out,
            inp,
            |i, t| f64::from(x[i * inp + t]),
            |j, t| f64::from(w[j * inp + t]),
        );
        for (what, got, (want, scale), k) in [
            ("y", &got_y, want_y, inp),
            ("dW", &got_dw, want_dw, rows),
            ("dX", &got_dx, want_dx, out),
        ] {
            for (e, ((g, w), s)) in got.iter().zip(&want).zip(&scale).enumerate() {
                let err = (f64::from(*g) - w).abs();
                assert!(
                    err <= (k as f64) * 2f64.powi(-23) * s,
                    "{what}[{e}]: {g} vs {w}"
                );
            }
        }
        // The forward differs from the unquantized product by MXFP8's rounding, not more.
        let num: f64 = got_y
            .iter()
            .zip(&plain_y.0)
            .map(|(g, p)| (f64::from(*g) - p).powi(2))
            .sum();
        let den: f64 = plain_y.0.iter().map(|p| p * p).sum();
        let rel = (num / den).sqrt();
        assert!(
            (1e-3..0.1).contains(&rel),
            "MXFP8 forward vs unquantized: {rel:e}"
        );
    }
}
