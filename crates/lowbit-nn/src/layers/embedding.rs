//! Token embedding: `out[r] = W[ids[r]]`, `W: [vocab, dim]` (PyTorch's `nn.Embedding`), with the
//! scatter-add backward that also serves a tied output head.

use lowbit_device::{Device, View};

use super::accumulate;
use crate::error::check_len;
use crate::{Hooks, Result, Usage};

/// An embedding table: the weight's parameter id and its shape `[vocab, dim]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Embedding {
    /// The table's parameter id (`[vocab, dim]`).
    pub weight: usize,
    /// Rows of the table.
    pub vocab: usize,
    /// Width of a row.
    pub dim: usize,
}

/// What the gradient buffer of [`Embedding::backward`] holds on entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GradStart {
    /// Nothing: it is zeroed first.
    Zero,
    /// A partial gradient of the same weight (a tied output head's, from
    /// [`super::HeadGrad::Keep`]), which the rows of `dy` are added to.
    Add,
}

impl Embedding {
    /// `out [rows, dim]` = the table rows of `ids` (f32 `[rows]` holding integers in
    /// `0..vocab`). The table is fetched with [`Usage::Forward`] and read in whatever float dtype
    /// the hooks hand out (one device op, no cast of the whole table).
    pub fn forward(
        &self,
        dev: &mut Device,
        hooks: &mut dyn Hooks,
        ids: View,
        out: View,
        rows: usize,
    ) -> Result<()> {
        check_len("embedding ids", ids.len(), rows)?;
        check_len("embedding output", out.len(), rows * self.dim)?;
        let w = hooks.param(dev, self.weight, Usage::Forward)?;
        check_len("embedding weight", w.len(), self.vocab * self.dim)?;
        dev.embedding(w, ids, out)?;
        Ok(())
    }

    /// The backward given `dy [rows, dim]`: `grad_buf` (f32, `vocab·dim`) is zeroed first unless
    /// `start` is [`GradStart::Add`]; the rows of `dy` are scatter-added into it (each id's rows
    /// summed in row order, then added: [`Device::embedding_backward`]); then it is accumulated
    /// into the weight's gradient, which is reported ready once.
    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &self,
        dev: &mut Device,
        hooks: &mut dyn Hooks,
        ids: View,
        dy: View,
        rows: usize,
        grad_buf: View,
        start: GradStart,
    ) -> Result<()> {
        check_len("embedding ids", ids.len(), rows)?;
        check_len("embedding output gradient", dy.len(), rows * self.dim)?;
        check_len(
            "embedding gradient buffer",
            grad_buf.len(),
            self.vocab * self.dim,
        )?;
        if start == GradStart::Zero {
            dev.zero(grad_buf)?;
        }
        dev.embedding_backward(ids, dy, grad_buf)?;
        accumulate(dev, hooks, self.weight, grad_buf)
    }
}

#[cfg(test)]
mod tests {
    use lowbit_device::DType;

    use super::*;
    use crate::layers::f64check::{central_diff, f64s, worst_rel};
    use crate::testing::{Call, TestHooks, upload, values};

    const VOCAB: usize = 5;
    const DIM: usize = 3;
    const IDS: [f32; 6] = [4.0, 1.0, 4.0, 0.0, 1.0, 4.0];

    /// `Σ c ⊙ W[ids]` in f64, the layer's forward written independently.
    fn loss64(w: &[f64], c: &[f64]) -> f64 {
        let mut l = 0.0;
        for (r, &id) in IDS.iter().enumerate() {
            for d in 0..DIM {
                l += c[r * DIM + d] * w[id as usize * DIM + d];
            }
        }
        l
    }

    #[test]
    fn forward_gathers_rows_and_backward_matches_f64_differences() {
        let mut dev = Device::cpu();
        let w = values(1, VOCAB * DIM);
        let c = values(2, IDS.len() * DIM);
        let mut hooks = TestHooks::new(&mut dev, std::slice::from_ref(&w));
        let e = Embedding {
            weight: 0,
            vocab: VOCAB,
            dim: DIM,
        };
        let (ids, out) = (
            upload(&mut dev, &IDS),
            dev.alloc(DType::F32, IDS.len() * DIM),
        );
        e.forward(&mut dev, &mut hooks, ids, out, IDS.len())
            .unwrap();
        let want: Vec<f32> = IDS
            .iter()
            .flat_map(|&i| w[i as usize * DIM..(i as usize + 1) * DIM].to_vec())
            .collect();
        assert_eq!(dev.download::<f32>(out).unwrap(), want);
        assert_eq!(hooks.calls, [Call::Param(0, Usage::Forward)]);

        hooks.calls.clear();
        let dy = upload(&mut dev, &c);
        // A dirty buffer: GradStart::Zero must clear it.
        let buf = upload(&mut dev, &[9.0; VOCAB * DIM]);
        e.backward(
            &mut dev,
            &mut hooks,
            ids,
            dy,
            IDS.len(),
            buf,
            GradStart::Zero,
        )
        .unwrap();
        assert_eq!(hooks.calls, [Call::Grad(0), Call::Ready(0)]);
        let want = central_diff(&f64s(&w), 1e-6, |w| loss64(w, &f64s(&c)));
        let err = worst_rel(&hooks.grad_of(&dev, 0), &want);
        // Worst relative error measured: 8.1e-11 (the differences' own rounding).
        assert!(err < 1e-6, "worst relative error {err}");
        // Row 2 and 3 of the table hold no id: zero gradient.
        assert_eq!(hooks.grad_of(&dev, 0)[2 * DIM..4 * DIM], [0.0; 2 * DIM]);

        // GradStart::Add keeps what the buffer held.
        let part = values(3, VOCAB * DIM);
        let buf = upload(&mut dev, &part);
        let mut fresh = TestHooks::new(&mut dev, std::slice::from_ref(&w));
        e.backward(
            &mut dev,
            &mut fresh,
            ids,
            dy,
            IDS.len(),
            buf,
            GradStart::Add,
        )
        .unwrap();
        let total: Vec<f64> = want
            .iter()
            .zip(&part)
            .map(|(a, b)| a + f64::from(*b))
            .collect();
        assert!(worst_rel(&fresh.grad_of(&dev, 0), &total) < 1e-6);
    }

    #[test]
    fn shapes_are_checked_before_any_call() {
        let mut dev = Device::cpu();
        let mut hooks = TestHooks::new(&mut dev, &[values(1, VOCAB * DIM)]);
        let e = Embedding {
            weight: 0,
            vocab: VOCAB,
            dim: DIM,
        };
        let (ids, out) = (
            upload(&mut dev, &IDS),
            dev.alloc(DType::F32, IDS.len() * DIM + 1),
        );
        assert!(
            e.forward(&mut dev, &mut hooks, ids, out, IDS.len())
                .is_err()
        );
        let buf = dev.alloc(DType::F32, VOCAB * DIM - 1);
        let dy = dev.alloc(DType::F32, IDS.len() * DIM);
        let r = e.backward(
            &mut dev,
            &mut hooks,
            ids,
            dy,
            IDS.len(),
            buf,
            GradStart::Zero,
        );
        assert!(r.is_err());
        assert!(hooks.calls.is_empty());
    }
}
