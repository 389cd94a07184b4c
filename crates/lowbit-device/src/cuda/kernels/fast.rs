//! Launches of the fast kernels of `crates/lowbit-kernels/fast.cu`, which the ops take on CUDA
//! when the device computes in [`crate::MatmulMode::Bf16`]: per-row cross-entropy, RMSNorm
//! forward and backward, and float4 forms of RoPE, SwiGLU and the embedding lookup.
//!
//! Ids and targets are checked by the kernels, not downloaded and checked by the host: a bad
//! one sets a word of [`FastState`]'s error buffer, which the next synchronising host read of
//! the device ([`CudaDevice::check_fast_errors`], from `read_bytes_into` and `synchronize`)
//! turns into [`DeviceError::Invalid`] naming the op, the row and the value. Callers have
//! validated dtypes and shapes.

use std::cell::Cell;

use cudarc::driver::{CudaSlice, DevicePtr, result};

use super::{blocks, capped, dt};
use crate::cuda::{CudaDevice, cuda_err};
use crate::{DType, DeviceError, Result, RopeSpec, View};

/// Threads of an RMSNorm CTA (`RMS_T` in fast.cu; 128 for its `_t128` entries).
const RMS_T: usize = 256;
/// The row blocks of the RMSNorm weight gradient's first stage: at most this many, so the
/// partial sums are `[blocks, cols]` (a function of the shape only: the same blocks, the same
/// bits, on every run).
const RMS_DW_BLOCKS: usize = 1024;
/// Vocabularies below this take a warp per row (`fast_xent_warp`), larger ones a CTA.
const XENT_WARP_BELOW: usize = 4096;

/// The ops whose ids the kernels check, by their error word.
#[derive(Clone, Copy, Debug)]
enum Checked {
    CrossEntropy = 0,
    Embedding = 1,
}

const CHECKED: [(&str, &str); 2] = [("cross_entropy_rows", "target"), ("embedding", "id")];

/// The fast kernels' device state: the id-error words and the grow-only scratch of RMSNorm's
/// weight-gradient partials.
#[derive(Debug, Default)]
pub(crate) struct FastState {
    /// One u64 per [`Checked`] op, `u64::MAX` when clean, else `row << 32 | f32 bits` of the
    /// smallest bad row (the kernels' atomicMin).
    err: Option<CudaSlice<u64>>,
    err_ptr: u64,
    /// Per [`Checked`] op: its calls since the last check, and the id bound of the last one.
    armed: [Cell<(u64, u64)>; 2],
    /// RMSNorm's `[blocks, cols]` partial sums (not zeroed: every word read is written first).
    part: Option<CudaSlice<f32>>,
    /// Cross-entropy's gradient pass: 0 (the default) `__expf` times `1 / s`; 1 `exp` through
    /// double and the division, as the exact kernels (`set_cuda_kernel_variant("fast_xent_exp",
    /// 0 | 1)`). Measured on an H200 (crates/lowbit-kernels/NOTES.md): 0.61x of a copy against
    /// 0.47x at 4096 × 50,304.
    pub(crate) xent_exact_exp: u32,
    /// Threads of a cross-entropy CTA (`set_cuda_kernel_variant("fast_xent_threads", N)`,
    /// a multiple of 32 in 64..=1024; 0, the default, 1024: the fastest on an H200 at both
    /// vocabularies).
    pub(crate) xent_threads: u32,
    /// Threads of an RMSNorm CTA for float4 rows of at most 2048 columns: 0 (the default) 256,
    /// or 128 (`set_cuda_kernel_variant("fast_rms_threads", 0 | 128)`).
    pub(crate) rms_threads: u32,
    /// m16 tiles of query rows per warp of the flash attention's forward: 0 (the default) one
    /// at head dim 64 and two at 128, the faster of each on an H200; 1, one (64-row blocks);
    /// 2, two (128-row blocks) (`set_cuda_kernel_variant("flash_fwd_tiles", 0..=2)`). Same bits.
    pub(crate) flash_fwd_tiles: u32,
    /// Whether the sm_90a modules (`flash_wgmma.cu`, `mx_gemm_wgmma.cu`) are loaded: a compute
    /// capability 9.0 GPU.
    pub(crate) wgmma: bool,
    /// The flash attention's forward and backward on `flash_attention.cu`'s mma.sync kernels
    /// even where the wgmma ones are loaded (`set_cuda_kernel_variant("flash_wgmma", 1)`; 0,
    /// the default, takes wgmma where it can). Not the same bits: the tensor cores add in
    /// another order.
    pub(crate) flash_mma_sync: bool,
    /// How [`crate::Device::matmul_mx`] multiplies two rowwise planes: 0 (the default) their
    /// exact bf16 dequantization and cuBLASLt, 1 and 2 the block-scaled FP8 kernels v0 and v1
    /// (`mx_gemm.cu`), 3 the wgmma one (`mx_gemm_wgmma.cu`, v1 where it cannot run)
    /// (`set_cuda_kernel_variant("matmul_mx_kernel", 0..=3)`).
    pub(crate) mx_gemm: u32,
}

impl CudaDevice {
    /// The error words' address (allocated and set clean on first use).
    fn fast_err(&mut self) -> Result<u64> {
        if self.fast.err.is_none() {
            self.bind()?;
            let mem = self
                .stream
                .clone_htod(&[u64::MAX; 2])
                .map_err(cuda_err("allocating the id-error words"))?;
            self.fast.err_ptr = {
                let (p, _sync) = mem.device_ptr(&self.stream);
                p
            };
            self.fast.err = Some(mem);
        }
        Ok(self.fast.err_ptr)
    }

    fn arm(&self, op: Checked, bound: usize) {
        let c = &self.fast.armed[op as usize];
        c.set((c.get().0 + 1, bound as u64));
    }

    /// After a stream synchronisation: the first id error a fast kernel recorded since the
    /// last check, as [`DeviceError::Invalid`] (the words are then clean again); `Ok` when none
    /// was armed or none found.
    pub(in crate::cuda) fn check_fast_errors(&self) -> Result<()> {
        let armed: Vec<(u64, u64)> = self.fast.armed.iter().map(Cell::get).collect();
        if armed.iter().all(|a| a.0 == 0) {
            return Ok(());
        }
        self.fast.armed.iter().for_each(|c| c.set((0, 0)));
        let mut words = [0u64; 2];
        // SAFETY: `err_ptr` addresses the two live words of `fast.err` (armed implies
        // allocated); the stream is synchronised before `words` is read.
        unsafe {
            result::memcpy_dtoh_async(&mut words, self.fast.err_ptr, self.stream.cu_stream())
                .map_err(cuda_err("reading the id-error words"))?;
        }
        self.stream
            .synchronize()
            .map_err(cuda_err("waiting for the stream"))?;
        if words.iter().all(|&w| w == u64::MAX) {
            return Ok(());
        }
        let clean = [u64::MAX; 2];
        // SAFETY: as above; `clean` is pageable memory the driver stages before returning.
        unsafe {
            result::memcpy_htod_async(self.fast.err_ptr, &clean, self.stream.cu_stream())
                .map_err(cuda_err("clearing the id-error words"))?;
        }
        let (k, w) = words
            .iter()
            .enumerate()
            .find(|(_, w)| **w != u64::MAX)
            .map(|(k, w)| (k, *w))
            .unwrap_or((0, 0));
        let ((what, kind), (calls, bound)) = (CHECKED[k], armed[k]);
        let (row, v) = (w >> 32, f32::from_bits(w as u32));
        Err(DeviceError::Invalid {
            what,
            reason: format!(
                "{kind} {v} of row {row} is not an integer in 0..{bound} (found on the \
                 device by the fast kernels, in one of {calls} calls since the last host read; \
                 that row's outputs are NaN)"
            ),
        })
    }

    /// At least `n` f32 words of RMSNorm partial-sum scratch (grown, never shrunk).
    fn fast_part(&mut self, n: usize) -> Result<u64> {
        if self.fast.part.as_ref().is_none_or(|p| p.len() < n) {
            self.bind()?;
            self.fast.part = None;
            // SAFETY: the words are only read after the kernel that writes them (stage 1
            // writes every `[block, col]` word stage 2 reads).
            let mem = unsafe { self.stream.alloc::<f32>(n.max(1)) }
                .map_err(cuda_err("allocating RMSNorm scratch"))?;
            self.fast.part = Some(mem);
        }
        let p = self.fast.part.as_ref().map_or(0, |p| {
            let (p, _sync) = p.device_ptr(&self.stream);
            p
        });
        Ok(p)
    }

    /// Cross-entropy of each row, the CUDA fast path of `Device::cross_entropy_rows` (targets
    /// checked on the device).
    pub(crate) fn fast_cross_entropy_rows(
        &mut self,
        [logits, targets, losses]: [View; 3],
        classes: usize,
        grad: Option<f32>,
        dlogits: Option<View>,
    ) -> Result<()> {
        const WHAT: &str = "cross_entropy_rows";
        let rows = targets.len();
        let (xp, tp, lp, yp) = match (grad, dlogits) {
            (Some(_), Some(y)) => {
                let ([xp, tp], [lp, yp]) = self.ptrs(WHAT, [logits, targets], [losses, y])?;
                (xp, tp, lp, yp)
            }
            (Some(_), None) => {
                let ([tp], [xp, lp]) = self.ptrs(WHAT, [targets], [logits, losses])?;
                (xp, tp, lp, 0)
            }
            (None, _) => {
                let ([xp, tp], [lp]) = self.ptrs(WHAT, [logits, targets], [losses])?;
                (xp, tp, lp, 0)
            }
        };
        if rows == 0 {
            return Ok(());
        }
        let err = self.fast_err()?;
        self.arm(Checked::CrossEntropy, classes);
        let c = grad.unwrap_or(0.0);
        let args = args![
            xp,
            tp,
            lp,
            err,
            rows,
            classes,
            c,
            u32::from(grad.is_some()),
            1 - self.fast.xent_exact_exp,
            yp
        ];
        if classes < XENT_WARP_BELOW {
            let grid = capped(rows.div_ceil(8), 1 << 16);
            // SAFETY: views validated above (logits rows·classes, targets and losses rows,
            // the bf16 gradient, if any, rows·classes and disjoint from them); `err` is the
            // live error word; targets are checked in the kernel before use.
            unsafe { self.launch("fast_xent_warp", (grid, 1, 1), (256, 1, 1), &args) }
        } else {
            let t = match self.fast.xent_threads {
                0 => 1024,
                t => t,
            };
            let grid = capped(rows, 1 << 16);
            // SAFETY: as above; `t` is a multiple of 32 up to 1024 (set_kernel_variant).
            unsafe { self.launch("fast_xent_cta", (grid, 1, 1), (t, 1, 1), &args) }
        }
    }

    /// Which RMSNorm entry fits `cols` (`v1`..`v8` with float4 slots, `s4`..`s32` scalar; the
    /// `_t128` float4 entries with `fast_rms_threads` 128) and its threads, or `None` past 8192
    /// columns (the exact kernels then run).
    fn rms_entry(&self, cols: usize, vec: bool) -> Option<(&'static str, &'static str, u32)> {
        if vec && self.fast.rms_threads == 128 && cols <= 4 * 128 * 4 {
            let (f, b) = match cols.div_ceil(4 * 128) {
                0..=1 => ("fast_rms_fwd_v1_t128", "fast_rms_bwd_v1_t128"),
                2 => ("fast_rms_fwd_v2_t128", "fast_rms_bwd_v2_t128"),
                _ => ("fast_rms_fwd_v4_t128", "fast_rms_bwd_v4_t128"),
            };
            return Some((f, b, 128));
        }
        Self::rms_entry_256(cols, vec).map(|(f, b)| (f, b, RMS_T as u32))
    }

    /// The 256-thread entries of [`Self::rms_entry`].
    fn rms_entry_256(cols: usize, vec: bool) -> Option<(&'static str, &'static str)> {
        let per = if vec { 4 * RMS_T } else { RMS_T };
        let nv = cols.div_ceil(per);
        Some(match (vec, nv) {
            (true, 0..=1) => ("fast_rms_fwd_v1", "fast_rms_bwd_v1"),
            (true, 2) => ("fast_rms_fwd_v2", "fast_rms_bwd_v2"),
            (true, 3..=4) => ("fast_rms_fwd_v4", "fast_rms_bwd_v4"),
            (true, 5..=8) => ("fast_rms_fwd_v8", "fast_rms_bwd_v8"),
            (false, 0..=4) => ("fast_rms_fwd_s4", "fast_rms_bwd_s4"),
            (false, 5..=8) => ("fast_rms_fwd_s8", "fast_rms_bwd_s8"),
            (false, 9..=16) => ("fast_rms_fwd_s16", "fast_rms_bwd_s16"),
            (false, 17..=32) => ("fast_rms_fwd_s32", "fast_rms_bwd_s32"),
            _ => return None,
        })
    }

    /// Whether every address is 16-byte aligned and `cols` a multiple of 4 (float4 slots).
    fn vec4(cols: usize, ptrs: &[u64]) -> bool {
        cols.is_multiple_of(4) && ptrs.iter().all(|p| p.is_multiple_of(16))
    }

    /// RMSNorm forward, the fast path; `Ok(false)` when the shape has no fast kernel (the
    /// caller runs the exact one).
    pub(crate) fn fast_rms_norm(
        &mut self,
        ins: [View; 2],
        outs: [View; 2],
        eps: f32,
    ) -> Result<bool> {
        let ([xp, wp], [yp, rp]) = self.ptrs("rms_norm", ins, outs)?;
        let (rows, cols) = (outs[1].len(), ins[1].len());
        let vec = Self::vec4(cols, &[xp, wp, yp]);
        let Some((fwd, _, threads)) = self.rms_entry(cols, vec) else {
            return Ok(false);
        };
        if rows == 0 {
            return Ok(true);
        }
        let grid = capped(rows, 4096);
        let ybf16 = u32::from(outs[0].dtype() == DType::Bf16);
        let args = args![xp, wp, yp, rp, rows, cols, eps, ybf16];
        // SAFETY: views validated above (x, y rows·cols, weight cols, rstd rows); the entry's
        // slots cover cols (rms_entry), float4 slots only on aligned views with cols % 4 == 0.
        unsafe { self.launch(fwd, (grid, 1, 1), (threads, 1, 1), &args)? };
        Ok(true)
    }

    /// RMSNorm backward, the fast path (dx, and dweight accumulated through `[blocks, cols]`
    /// partials reduced in block order); `Ok(false)` when the shape has no fast kernel.
    pub(crate) fn fast_rms_norm_backward(
        &mut self,
        ins: [View; 4],
        outs: [View; 2],
    ) -> Result<bool> {
        let ([xp, wp, rp, dyp], [dxp, dwp]) = self.ptrs("rms_norm_backward", ins, outs)?;
        let (rows, cols) = (ins[2].len(), ins[1].len());
        let vec = Self::vec4(cols, &[xp, wp, dyp, dxp]);
        let Some((_, bwd, threads)) = self.rms_entry(cols, vec) else {
            return Ok(false);
        };
        if rows == 0 || cols == 0 {
            return Ok(true);
        }
        let rb = rows.div_ceil(RMS_DW_BLOCKS);
        let nb = rows.div_ceil(rb);
        let part = self.fast_part(nb * cols)?;
        let grid = u32::try_from(nb).map_err(|_| DeviceError::Unsupported("rows".into()))?;
        let args = args![xp, wp, rp, dyp, dxp, part, rows, cols, rb];
        // SAFETY: views validated above; `part` holds nb·cols words, block b < nb writes row
        // b of it; rows [b·rb, min(rows, (b+1)·rb)) are in bounds.
        unsafe { self.launch(bwd, (grid, 1, 1), (threads, 1, 1), &args)? };
        let gx = blocks(cols, 32)
            .ok_or_else(|| DeviceError::Unsupported(format!("rms_norm: {cols} columns")))?;
        // SAFETY: `part` holds nb·cols words written by the launch before; dweight cols.
        unsafe {
            self.launch(
                "fast_rms_dw_reduce",
                (gx, 1, 1),
                (32, 32, 1),
                &args![part, dwp, nb, cols],
            )?;
        }
        Ok(true)
    }

    /// RoPE, the fast path; `Ok(false)` when the views or `half` do not allow float4 items.
    pub(crate) fn fast_rope(
        &mut self,
        [x, y, cos, sin]: [View; 4],
        spec: &RopeSpec,
    ) -> Result<bool> {
        let (xp, yp, cp, sp) = if x == y {
            let ([cp, sp], [yp]) = self.ptrs("rope", [cos, sin], [y])?;
            (yp, yp, cp, sp)
        } else {
            let ([xp, cp, sp], [yp]) = self.ptrs("rope", [x, cos, sin], [y])?;
            (xp, yp, cp, sp)
        };
        let half = spec.head_dim / 2;
        if !Self::vec4(half, &[xp, yp, cp, sp]) {
            return Ok(false);
        }
        let n4 = x.len() / 8;
        let args = args![
            xp,
            yp,
            cp,
            sp,
            n4,
            spec.heads,
            half,
            spec.seq,
            u32::from(spec.inverse),
            u32::from(y.dtype() == DType::Bf16)
        ];
        // SAFETY: views validated above (x, y rows·heads·head_dim, y f32 or bf16 as the flag
        // says; cos, sin max_seq·half with seq ≤ max_seq); half % 4 == 0 and 16-byte aligned
        // addresses; x, y same or disjoint.
        unsafe { self.launch_n("fast_rope4", n4, &args)? };
        Ok(true)
    }

    /// SwiGLU forward (`dout` = `None`: `[gate, up] → out`) or backward (`[gate, up, dout] →
    /// [dgate, dup]`), the fast path; `Ok(false)` for views that are not 16-byte aligned.
    pub(crate) fn fast_swiglu(
        &mut self,
        gate: View,
        up: View,
        dout: Option<View>,
        outs: [View; 2],
    ) -> Result<bool> {
        let n = gate.len();
        match dout {
            None => {
                let ([g, u], [o]) = self.ptrs("swiglu", [gate, up], [outs[0]])?;
                if !Self::vec4(0, &[g, u, o]) {
                    return Ok(false);
                }
                let obf16 = u32::from(outs[0].dtype() == DType::Bf16);
                let args = args![g, u, o, n, obf16];
                // SAFETY: views validated above (n elements each, 16-byte aligned, out f32 or
                // bf16 and disjoint); items n / 4 (the tail by the first threads).
                unsafe { self.launch_n("fast_swiglu4", n.div_ceil(4), &args)? };
            }
            Some(d) => {
                let ([g, u, dp], [dg, du]) = self.ptrs("swiglu_backward", [gate, up, d], outs)?;
                if !Self::vec4(0, &[g, u, dp, dg, du]) {
                    return Ok(false);
                }
                let dbf16 = u32::from(outs[1].dtype() == DType::Bf16);
                let args = args![g, u, dp, dg, du, n, dbf16];
                // SAFETY: as above, outputs disjoint.
                unsafe { self.launch_n("fast_swiglu_bwd4", n.div_ceil(4), &args)? };
            }
        }
        Ok(true)
    }

    /// Embedding lookup, the fast path (ids checked on the device).
    pub(crate) fn fast_embedding(
        &mut self,
        table: View,
        ids: View,
        out: View,
        (dim, vocab): (usize, usize),
    ) -> Result<()> {
        let ([tp, ip], [op]) = self.ptrs("embedding", [table, ids], [out])?;
        let rows = ids.len();
        if rows == 0 {
            return Ok(());
        }
        // The embedding's own error word (the second): a bad id is then reported under its
        // name, not the cross-entropy's.
        let err = self.fast_err()? + 8 * Checked::Embedding as u64;
        self.arm(Checked::Embedding, vocab);
        let vec = table.dtype() == DType::F32 && Self::vec4(dim, &[tp, op]);
        let grid = capped(rows, 1 << 16);
        let threads = if dim >= 1024 { 256 } else { 128 };
        let args = args![
            tp,
            dt(table.dtype()),
            ip,
            op,
            err,
            rows,
            dim,
            vocab,
            u32::from(vec)
        ];
        // SAFETY: views validated above (out rows·dim, table vocab·dim of its dtype); `err` is
        // the second of the two live error words; the kernel checks each id against vocab
        // before reading the table.
        unsafe { self.launch("fast_embedding", (grid, 1, 1), (threads, 1, 1), &args) }
    }
}
