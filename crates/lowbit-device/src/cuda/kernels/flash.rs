//! Launches of the flash attention (`crates/lowbit-kernels/flash_attention.cu`, and on a compute
//! capability 9.0 GPU `flash_wgmma.cu`'s forward and dK/dV pass): the forward, and the backward
//! as a D pass, a dQ pass (one CTA per query block) and a dK/dV pass (one CTA per key block). The caller ([`crate::Device::flash_attention`]) has checked dtypes, lengths,
//! the spec and the head size (64 or 128); the views are validated here before anything is
//! launched. The tiles live in dynamic shared memory (up to 161 KiB, past the 48 KiB a launch
//! gets without asking), so these launches set the kernel's dynamic shared memory limit first.

use cudarc::driver::{result, sys};

use super::blocks;
use crate::cuda::{Arg, CudaDevice, arg_ptrs};
use crate::{AttentionSpec, DType, DeviceError, Result, View};

/// Threads per CTA of the mma.sync kernels (`FA_THREADS`: 4 warps) and per warpgroup of the
/// wgmma ones.
const THREADS: u32 = 128;
/// Query and key rows per block of the mma.sync kernels (`FA_BM`, `FA_BN`).
const BLOCK: usize = 64;

/// A kernel launch shape: name, rows of its own side per CTA, threads, dynamic shared memory.
#[derive(Clone, Copy)]
struct Shape {
    name: &'static str,
    rows: usize,
    threads: u32,
    smem: u32,
}

/// `flash_wgmma.cu`'s forward of `head_dim`: one warpgroup of 64 query rows per CTA at dim 64,
/// two at 128; smem 1024 (alignment) + (query rows + 4·128 key rows)·D·2 bytes.
fn forward_wgmma(head_dim: usize) -> Result<Shape> {
    let (name, wgs) = match head_dim {
        64 => ("flash_fwd_wg_hd64", 1),
        128 => ("flash_fwd_wg_hd128", 2),
        d => return Err(no_kernel(d)),
    };
    let smem = 1024 + (64 * wgs + 4 * 128) * head_dim * 2;
    Ok(Shape {
        name,
        rows: 64 * wgs,
        threads: THREADS * wgs as u32,
        smem: smem as u32,
    })
}

/// `flash_wgmma.cu`'s dQ pass at dim 128 (at 64 the mma.sync one measured faster): a
/// warpgroup of 64 query rows per CTA, key blocks of 64; smem 1024 + (2·64 + 4·64)·D·2 bytes
/// (Q, dO; K, V double-buffered).
fn dq_wgmma(head_dim: usize) -> Option<Shape> {
    (head_dim == 128).then(|| Shape {
        name: "flash_bwd_dq_wg_hd128",
        rows: 64,
        threads: THREADS,
        smem: (1024 + (2 * 64 + 4 * 64) * head_dim * 2) as u32,
    })
}

/// `flash_wgmma.cu`'s dK/dV pass: a warpgroup of 64 keys per CTA, steps of 64 query rows;
/// smem 1024 + (2·64 + 4·64)·D·2 + 16·64 bytes (K, V; Q, dO, lse, D double-buffered).
fn dkv_wgmma(head_dim: usize) -> Result<Shape> {
    let name = match head_dim {
        64 => "flash_bwd_dkv_wg_hd64",
        128 => "flash_bwd_dkv_wg_hd128",
        d => return Err(no_kernel(d)),
    };
    let smem = 1024 + (2 * 64 + 4 * 64) * head_dim * 2 + 16 * 64;
    Ok(Shape {
        name,
        rows: 64,
        threads: THREADS,
        smem: smem as u32,
    })
}

/// The backward's mma.sync kernels of one head size, their dynamic shared memory from the tile
/// shapes of `flash_attention.cu` (bf16 tiles of rows padded by 8 elements; the streamed side
/// double-buffered; the dK/dV pass also keeps two query blocks' lse and D as f32).
struct Kernels {
    dq: Shape,
    dkv: Shape,
}

/// An mma.sync kernel of `flash_attention.cu`: blocks of 64 rows, 4 warps.
fn mma_sync(name: &'static str, smem: u32) -> Shape {
    Shape {
        name,
        rows: BLOCK,
        threads: THREADS,
        smem,
    }
}

/// The mma.sync forward of `head_dim` with `tiles` m16 tiles of query rows per warp (1 or 2:
/// 64- or 128-row blocks) and its dynamic shared memory: Q's block + 2·(K, V).
fn forward(head_dim: usize, tiles: usize) -> Result<Shape> {
    let name = match (head_dim, tiles) {
        (64, 1) => "flash_fwd_hd64",
        (64, _) => "flash_fwd_hd64_m2",
        (128, 1) => "flash_fwd_hd128",
        (128, _) => "flash_fwd_hd128_m2",
        (d, _) => return Err(no_kernel(d)),
    };
    let rows = tiles * BLOCK + 4 * BLOCK;
    Ok(Shape {
        rows: tiles * BLOCK,
        ..mma_sync(name, (rows * (head_dim + 8) * 2) as u32)
    })
}

fn no_kernel(head_dim: usize) -> DeviceError {
    DeviceError::Unsupported(format!(
        "flash attention: head_dim {head_dim} has no kernel (64 and 128 have)"
    ))
}

fn kernels(head_dim: usize) -> Result<Kernels> {
    // Bytes of `rows` bf16 tile rows of `d` values, padded by 8.
    let tile = |rows: usize, d: usize| (rows * (d + 8) * 2) as u32;
    match head_dim {
        // Q, dO + 2·(K, V); K, V + 2·(Q, dO) of 64 query rows.
        64 => Ok(Kernels {
            dq: mma_sync("flash_bwd_dq_hd64", tile(6 * BLOCK, 64)),
            dkv: mma_sync("flash_bwd_dkv_hd64", tile(6 * BLOCK, 64) + 4 * 64 * 4),
        }),
        // As above; the dK/dV pass takes query blocks of 32 rows.
        128 => Ok(Kernels {
            dq: mma_sync("flash_bwd_dq_hd128", tile(6 * BLOCK, 128)),
            dkv: mma_sync(
                "flash_bwd_dkv_hd128",
                tile(2 * BLOCK + 4 * 32, 128) + 4 * 32 * 4,
            ),
        }),
        d => Err(no_kernel(d)),
    }
}

/// The grid of `seq` rows in blocks of `rows`, over `pairs` (batch, head) pairs.
fn grid(what: &str, seq: usize, rows: usize, pairs: usize) -> Result<(u32, u32, u32)> {
    let gx = u32::try_from(seq.div_ceil(rows))
        .map_err(|_| DeviceError::Unsupported(format!("{what}: seq = {seq} is too large")))?;
    match u32::try_from(pairs) {
        Ok(gy) if gy <= 65535 => Ok((gx, gy, 1)),
        _ => Err(DeviceError::Unsupported(format!(
            "{what}: {pairs} (batch, head) pairs exceed the grid's 65535"
        ))),
    }
}

impl CudaDevice {
    /// Whether the forward, the dK/dV pass and (at dim 128) the dQ pass take `flash_wgmma.cu`'s
    /// kernels (loaded, and not turned off by `set_cuda_kernel_variant("flash_wgmma", 1)`).
    /// Measured on one H200 (crates/lowbit-kernels/NOTES.md): forward 1.4–1.5×, dK/dV
    /// 1.1–1.6×, dQ at dim 128 1.27× the speed of the mma.sync kernels.
    fn wgmma_flash(&self) -> bool {
        self.fast.wgmma && !self.fast.flash_mma_sync
    }

    /// Launches `name` with `threads` threads per CTA and `smem` bytes of dynamic shared memory
    /// (raising the kernel's limit to it first).
    ///
    /// # Safety
    /// As [`CudaDevice::launch`]; `smem` is at most the device's opt-in shared memory per block
    /// (227 KiB on sm_90; the driver refuses more) and what the kernel indexes.
    pub(super) unsafe fn launch_smem(
        &mut self,
        name: &'static str,
        grid: (u32, u32, u32),
        threads: u32,
        smem: u32,
        args: &[Arg],
    ) -> Result<()> {
        let f = self.function(name)?;
        self.bind()?;
        let limit = i32::try_from(smem)
            .map_err(|_| DeviceError::Unsupported(format!("{name}: {smem} bytes of smem")))?;
        // SAFETY: `f` is a function of this device's context, bound above.
        unsafe {
            result::function::set_function_attribute(
                f.0,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                limit,
            )
        }
        .map_err(|e| DeviceError::Cuda(format!("setting the shared memory of {name}: {e}")))?;
        let mut vals: Vec<Arg> = args.to_vec();
        let mut params = arg_ptrs(&mut vals);
        let stream = self.stream.cu_stream();
        // SAFETY: `params` points at `vals`, which outlive the call; the caller guarantees the
        // arguments match the kernel and `smem` its shared memory.
        unsafe { result::launch_kernel(f.0, grid, (threads, 1, 1), smem, stream, &mut params) }
            .map_err(|e| DeviceError::Cuda(format!("launching {name}: {e}")))
    }

    /// The bf16 operands the kernels stream through cp.async: each bf16 view of `xs` (address,
    /// view) as it is, each f32 one rounded to a bf16 copy in one scratch buffer; returns the
    /// buffer and each operand's device address, in order.
    fn bf16_copies<const N: usize>(
        &mut self,
        what: &'static str,
        xs: [(u64, View); N],
    ) -> Result<(super::Scratch, [u64; N])> {
        // Every length is a multiple of head_dim (64 or 128), so of 8: each copy starts
        // 16-byte aligned in the u32 words of the scratch.
        let f32s = |&&(_, v): &&(u64, View)| v.dtype() == DType::F32;
        let words: usize = xs.iter().filter(f32s).map(|&(_, v)| v.len() / 2).sum();
        let buf = self.scratch(words)?;
        let mut at = [0u64; N];
        let mut off = buf.ptr;
        for (i, &(x, v)) in xs.iter().enumerate() {
            if v.dtype() != DType::F32 {
                at[i] = x;
                continue;
            }
            let n = v.len();
            at[i] = off;
            let n4 = n / 4;
            let grid = blocks(n4, 256).ok_or_else(|| {
                DeviceError::Unsupported(format!("{what}: {n} values exceed the grid"))
            })?;
            let args = args![x, off, n4];
            // SAFETY: `x` holds n f32 (a validated view), `off` n / 2 words of `buf` (the
            // lengths sum to its size); a thread per 4 values, those past n4 return.
            unsafe { self.launch("flash_to_bf16", (grid, 1, 1), (256, 1, 1), &args)? };
            off += (n * 2) as u64;
        }
        Ok((buf, at))
    }

    /// The forward of `[q, k, v]` into `[out, lse]`.
    pub(crate) fn flash_attention(
        &mut self,
        ins: [View; 3],
        outs: [View; 2],
        spec: &AttentionSpec,
    ) -> Result<()> {
        const WHAT: &str = "flash_attention";
        let ([q, k, v], [out, lse]) = self.ptrs(WHAT, ins, outs)?;
        let s = *spec;
        // Measured on one H200 (crates/lowbit-kernels/NOTES.md): two tiles pay at d128
        // (183 vs 141 TFLOP/s at 2×4096) but not at d64 (142 vs 147 at 8×2048).
        let tiles = match (self.fast.flash_fwd_tiles, s.head_dim) {
            (1, _) | (0, 64) => 1,
            _ => 2,
        };
        // Refuses a head size with no kernel, even for an empty batch.
        let fwd = if self.wgmma_flash() {
            forward_wgmma(s.head_dim)?
        } else {
            forward(s.head_dim, tiles)?
        };
        if s.batch == 0 || s.seq == 0 {
            return Ok(());
        }
        let grid = grid(WHAT, s.seq, fwd.rows, s.batch * s.heads)?;
        let [qv, kv, vv] = ins;
        let (copies, [q, k, v]) = self.bf16_copies(WHAT, [(q, qv), (k, kv), (v, vv)])?;
        let out_bf16 = u32::from(outs[0].dtype() == DType::Bf16);
        let args = args![
            q, k, v, out, lse, s.seq, s.heads, s.kv_heads, s.scale, out_bf16
        ];
        // SAFETY: views validated above with the spec's lengths (q, out b·s·h·hd; k, v
        // b·s·kvh·hd; lse b·h·s), q, k, v read as bf16 (the views or copies of those lengths),
        // out written as f32 or bf16 as `out_bf16` says; head_dim is the kernel's (64 or 128),
        // heads a multiple of kv_heads (checked by the caller); the grid covers
        // ceil(seq / rows) query blocks of batch·heads pairs, rows past seq neither read nor
        // written; threads and smem are the kernel's.
        unsafe { self.launch_smem(fwd.name, grid, fwd.threads, fwd.smem, &args)? };
        drop(copies);
        Ok(())
    }

    /// The backward of `[q, k, v, out, lse, dout]` into `[dq, dk, dv]`.
    pub(crate) fn flash_attention_backward(
        &mut self,
        ins: [View; 6],
        outs: [View; 3],
        spec: &AttentionSpec,
    ) -> Result<()> {
        const WHAT: &str = "flash_attention_backward";
        let ([q, k, v, out, lse, dout], [dq, dk, dv]) = self.ptrs(WHAT, ins, outs)?;
        let s = *spec;
        let ks = kernels(s.head_dim)?;
        let (dq_k, dkv) = if self.wgmma_flash() {
            (
                dq_wgmma(s.head_dim).unwrap_or(ks.dq),
                dkv_wgmma(s.head_dim)?,
            )
        } else {
            (ks.dq, ks.dkv)
        };
        if s.batch == 0 || s.seq == 0 {
            return Ok(());
        }
        let grid_q = grid(WHAT, s.seq, dq_k.rows, s.batch * s.heads)?;
        let grid_kv = grid(WHAT, s.seq, dkv.rows, s.batch * s.kv_heads)?;
        let rows = s.batch * s.seq * s.heads;
        let dd = self.scratch(rows)?;
        let d = dd.ptr;
        // One warp per row, 8 rows per block of 256 threads.
        let gd = blocks(rows, 8).ok_or_else(|| {
            DeviceError::Unsupported(format!("{WHAT}: {rows} rows exceed the grid"))
        })?;
        let bf = |v: View| u32::from(v.dtype() == DType::Bf16);
        let (ob, gb) = (bf(ins[3]), bf(ins[5]));
        let args = args![out, dout, d, rows, s.seq, s.heads, s.head_dim, ob, gb];
        // SAFETY: views validated above (out, dout b·s·h·hd, each f32 or bf16 as its flag
        // says); `d` holds b·h·s words; a warp per row, rows past `rows` return at once;
        // head_dim is even (64 or 128: pairs).
        unsafe { self.launch("flash_bwd_d", (gd, 1, 1), (256, 1, 1), &args)? };
        let [qv, kv, vv, _, _, gv] = ins;
        let (copies, [q, k, v, dout]) =
            self.bf16_copies(WHAT, [(q, qv), (k, kv), (v, vv), (dout, gv)])?;
        let (kvh, sc) = (s.kv_heads, s.scale);
        let args = args![q, k, v, lse, dout, d, dq, s.seq, s.heads, kvh, sc];
        // SAFETY: as the forward (q, k, v, dout now their bf16 copies of the same lengths); dq
        // has q's length, `d` the lse's.
        unsafe { self.launch_smem(dq_k.name, grid_q, dq_k.threads, dq_k.smem, &args)? };
        let args = args![q, k, v, lse, dout, d, dk, dv, s.seq, s.heads, kvh, sc];
        // SAFETY: as above; dk, dv have k's length; the grid covers the key blocks of
        // batch·kv_heads pairs.
        unsafe { self.launch_smem(dkv.name, grid_kv, dkv.threads, dkv.smem, &args)? };
        drop(copies);
        drop(dd);
        Ok(())
    }
}
