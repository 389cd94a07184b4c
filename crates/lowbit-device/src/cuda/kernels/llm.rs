//! Launches of the decoder kernels of `crates/lowbit-kernels/llm.cu`: embedding and its
//! scatter-add backward, rotary embedding, SwiGLU and its backward, per-row cross-entropy.
//! Callers have validated dtypes, shapes and the ids or targets (integers in range).

use super::dt;
use crate::cuda::CudaDevice;
use crate::ops::id_groups;
use crate::{Result, RopeSpec, View};

impl CudaDevice {
    /// `out[r, :] = table[ids[r], :]` over `dim` columns (the kernel reads the validated ids
    /// from their view).
    pub(crate) fn embedding(
        &mut self,
        table: View,
        ids: View,
        out: View,
        dim: usize,
    ) -> Result<()> {
        let ([tp, ip], [op]) = self.ptrs("embedding", [table, ids], [out])?;
        let n = out.len();
        // SAFETY: views validated above (out = rows·dim, ids rows valid indices into the table
        // of vocab·dim elements of dtype code dt).
        unsafe {
            self.launch_n(
                "llm_embedding",
                n,
                &args![tp, dt(table.dtype()), ip, op, n, dim],
            )
        }
    }

    /// The deterministic scatter-add: the host groups the rows by id (`id`, validated), one
    /// item per (distinct id, column).
    pub(crate) fn embedding_backward(
        &mut self,
        [ids, dy, grad]: [View; 3],
        id: &[usize],
        dim: usize,
    ) -> Result<()> {
        let ([_, dyp], [gp]) = self.ptrs("embedding_backward", [ids, dy], [grad])?;
        let groups = id_groups(id);
        if groups.is_empty() || dim == 0 {
            return Ok(());
        }
        let mut table = Vec::with_capacity(2 * groups.len() + 1 + id.len());
        table.extend(groups.iter().map(|(v, _)| *v as u64));
        let mut at = 0u64;
        table.push(0);
        for (_, rows) in &groups {
            at += rows.len() as u64;
            table.push(at);
        }
        table.extend(
            groups
                .iter()
                .flat_map(|(_, rows)| rows.iter().map(|&r| r as u64)),
        );
        let (mem, tp) = self.upload_table(&table)?;
        let n = groups.len() * dim;
        // SAFETY: views validated above; the table holds gid[groups], starts[groups + 1] and
        // order[rows] with every row < rows and every id < vocab (validated), so each item reads
        // rows of dy and writes one element of grad, no element twice.
        unsafe {
            self.launch_n(
                "llm_embedding_backward",
                n,
                &args![dyp, gp, tp, groups.len(), n, dim],
            )?;
        }
        drop(mem);
        Ok(())
    }

    /// Rotary embedding of `x` into `y` (the same view: in place).
    pub(crate) fn rope(&mut self, [x, y, cos, sin]: [View; 4], spec: &RopeSpec) -> Result<()> {
        let (xp, yp, cp, sp) = if x == y {
            let ([cp, sp], [yp]) = self.ptrs("rope", [cos, sin], [y])?;
            (yp, yp, cp, sp)
        } else {
            let ([xp, cp, sp], [yp]) = self.ptrs("rope", [x, cos, sin], [y])?;
            (xp, yp, cp, sp)
        };
        let half = spec.head_dim / 2;
        let n = x.len() / 2;
        let args = args![
            xp,
            yp,
            cp,
            sp,
            n,
            spec.heads,
            half,
            spec.seq,
            u32::from(spec.inverse),
            dt(y.dtype())
        ];
        // SAFETY: views validated above (x, y rows·heads·head_dim, y f32 or bf16 stored by its
        // code; cos, sin max_seq·half with seq ≤ max_seq); x and y identical or disjoint.
        unsafe { self.launch_n("llm_rope", n, &args) }
    }

    /// `out = silu(gate)·up`.
    pub(crate) fn swiglu(&mut self, gate: View, up: View, out: View) -> Result<()> {
        let ([g, u], [o]) = self.ptrs("swiglu", [gate, up], [out])?;
        let n = out.len();
        let od = dt(out.dtype());
        // SAFETY: as above; out is f32 or bf16 (checked by the caller), stored by its code.
        unsafe { self.launch_n("llm_swiglu", n, &args![g, u, o, n, od]) }
    }

    /// `[dgate, dup]` from `[gate, up, dout]`.
    pub(crate) fn swiglu_backward(&mut self, ins: [View; 3], outs: [View; 2]) -> Result<()> {
        let ([g, u, d], [dg, du]) = self.ptrs("swiglu_backward", ins, outs)?;
        let n = ins[0].len();
        let args = args![g, u, d, dg, du, n, dt(outs[1].dtype())];
        // SAFETY: views validated above (same lengths, outputs disjoint; dup f32 or bf16,
        // checked by the caller, stored by its dtype code).
        unsafe { self.launch_n("llm_swiglu_backward", n, &args) }
    }

    /// Per-row cross-entropy losses, and with `grad = Some(c)` the logits overwritten with their
    /// gradient (targets validated).
    pub(crate) fn cross_entropy_rows(
        &mut self,
        [logits, targets, losses]: [View; 3],
        classes: usize,
        grad: Option<f32>,
    ) -> Result<()> {
        const WHAT: &str = "cross_entropy_rows";
        let rows = targets.len();
        let (xp, tp, lp) = match grad {
            Some(_) => {
                let ([tp], [xp, lp]) = self.ptrs(WHAT, [targets], [logits, losses])?;
                (xp, tp, lp)
            }
            None => {
                let ([xp, tp], [lp]) = self.ptrs(WHAT, [logits, targets], [losses])?;
                (xp, tp, lp)
            }
        };
        if rows == 0 {
            return Ok(());
        }
        let stats = self.scratch(3 * rows)?;
        let sp = stats.ptr;
        let n = logits.len();
        let sum = u32::from(grad.is_none());
        // SAFETY: views validated above (logits rows·classes, targets rows valid indices,
        // losses rows); `stats` holds 3·rows words.
        unsafe {
            self.launch_n(
                "llm_xent_stats",
                rows,
                &args![xp, tp, sp, lp, rows, classes, sum],
            )?;
        }
        if let Some(c) = grad {
            // SAFETY: as above; the logits are an output of this op (disjoint from the rest).
            unsafe {
                self.launch_n("llm_xent_exp", n, &args![xp, sp, n, classes])?;
                self.launch_n("llm_xent_sum", rows, &args![xp, sp, lp, rows, classes])?;
                self.launch_n("llm_xent_grad", n, &args![xp, tp, sp, n, classes, c])?;
            }
        }
        drop(stats);
        Ok(())
    }
}
