//! Launches of causal grouped-query attention (`crates/lowbit-kernels/attention.cu`): the
//! forward, and the backward as a D pass, a dQ pass (per query row) and a dK/dV pass (per key
//! row). The caller ([`crate::Device::attention`]) has checked dtypes, lengths and the spec;
//! the views are validated here before anything is launched.

use super::blocks;
use crate::cuda::CudaDevice;
use crate::{AttentionSpec, DeviceError, Result, View};

/// Rows (threads) per block of the row kernels (`ROWS` in `attention.cu`).
const ROWS: usize = 64;

/// The grid of a row kernel over `seq` rows of `pairs` (batch, head) pairs.
fn row_grid(what: &str, seq: usize, pairs: usize) -> Result<(u32, u32, u32)> {
    let gx = u32::try_from(seq.div_ceil(ROWS))
        .map_err(|_| DeviceError::Unsupported(format!("{what}: seq = {seq} is too large")))?;
    match u32::try_from(pairs) {
        Ok(gy) if gy <= 65535 => Ok((gx, gy, 1)),
        _ => Err(DeviceError::Unsupported(format!(
            "{what}: {pairs} (batch, head) pairs exceed the grid's 65535"
        ))),
    }
}

impl CudaDevice {
    /// The forward of `[q, k, v]` into `[out, lse]`.
    pub(crate) fn attention(
        &mut self,
        ins: [View; 3],
        outs: [View; 2],
        spec: &AttentionSpec,
    ) -> Result<()> {
        const WHAT: &str = "attention";
        let ([q, k, v], [out, lse]) = self.ptrs(WHAT, ins, outs)?;
        let s = *spec;
        if s.batch == 0 || s.seq == 0 {
            return Ok(());
        }
        let grid = row_grid(WHAT, s.seq, s.batch * s.heads)?;
        let args = args![
            q, k, v, out, lse, s.seq, s.heads, s.kv_heads, s.head_dim, s.scale
        ];
        // SAFETY: views validated above with the spec's lengths (q, out b·s·h·hd; k, v
        // b·s·kvh·hd; lse b·h·s), head_dim ≤ 256 (the kernel's local arrays), heads a multiple
        // of kv_heads (checked by the caller).
        unsafe { self.launch("attention_fwd", grid, (ROWS as u32, 1, 1), &args) }
    }

    /// The backward of `[q, k, v, out, lse, dout]` into `[dq, dk, dv]`.
    pub(crate) fn attention_backward(
        &mut self,
        ins: [View; 6],
        outs: [View; 3],
        spec: &AttentionSpec,
    ) -> Result<()> {
        const WHAT: &str = "attention_backward";
        let ([q, k, v, out, lse, dout], [dq, dk, dv]) = self.ptrs(WHAT, ins, outs)?;
        let s = *spec;
        if s.batch == 0 || s.seq == 0 {
            return Ok(());
        }
        let grid_q = row_grid(WHAT, s.seq, s.batch * s.heads)?;
        let grid_kv = row_grid(WHAT, s.seq, s.batch * s.kv_heads)?;
        let rows = s.batch * s.seq * s.heads;
        let dd = self.scratch(rows)?;
        let d = dd.ptr;
        let gd = blocks(rows, 256).ok_or_else(|| {
            DeviceError::Unsupported(format!("{WHAT}: {rows} rows exceed the grid"))
        })?;
        let args = args![out, dout, d, rows, s.seq, s.heads, s.head_dim];
        // SAFETY: views validated above (out, dout b·s·h·hd); `d` holds b·h·s words.
        unsafe { self.launch("attention_bwd_d", (gd, 1, 1), (256, 1, 1), &args)? };
        let (hd, kvh) = (s.head_dim, s.kv_heads);
        let args = args![q, k, v, lse, dout, d, dq, s.seq, s.heads, kvh, hd, s.scale];
        // SAFETY: as above; dq has q's length, head_dim ≤ 256, heads % kv_heads == 0.
        unsafe { self.launch("attention_bwd_dq", grid_q, (ROWS as u32, 1, 1), &args)? };
        let args = args![
            q, k, v, lse, dout, d, dk, dv, s.seq, s.heads, kvh, hd, s.scale
        ];
        // SAFETY: as above; dk, dv have k's length.
        unsafe { self.launch("attention_bwd_dkv", grid_kv, (ROWS as u32, 1, 1), &args)? };
        drop(dd);
        Ok(())
    }
}
