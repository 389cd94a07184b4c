//! Host side of the kernels of `crates/lowbit-kernels/ops.cu` and `crates/lowbit-kernels/mxfp8.cu`, by op family
//! ([`elementwise`], [`optim`], [`model`], [`llm`], [`quant`], and [`fast`], the fast mode's), and the launch helpers every host side
//! shares: grid shapes, dtype codes, view checks, scratch buffers. Callers have validated
//! dtypes, lengths and shapes; each method validates its views (liveness, bounds, overlap)
//! before launching anything.

use cudarc::driver::CudaSlice;

use super::{Arg, CudaDevice};
use crate::{DType, Result, View};

mod attention;
mod elementwise;
mod fast;
mod flash;
mod llm;
mod model;
mod mx_gemm;
mod optim;
mod quant;

pub(super) use fast::FastState;
pub(super) use quant::NVFP4_FACTOR_INV;
pub(crate) use quant::{Mxfp8Quantize, Nvfp4Quantize, Quantize, Range2d};

/// The largest grid x dimension.
const MAX_GRID_X: usize = (1 << 31) - 1;

/// Grid size for `n` work items of `per_block` each (at least one block), or `None` past the
/// grid's x limit.
pub(super) fn blocks(n: usize, per_block: usize) -> Option<u32> {
    let b = n.div_ceil(per_block).max(1);
    if b > MAX_GRID_X {
        None
    } else {
        u32::try_from(b).ok()
    }
}

/// `u32::try_from` capped at `max` (grid dimensions of striding kernels).
pub(super) fn capped(n: usize, max: u32) -> u32 {
    u32::try_from(n).unwrap_or(max).clamp(1, max)
}

/// The kernels' dtype code of a float dtype (callers have checked it is one).
pub(super) fn dt(d: DType) -> u32 {
    match d {
        DType::F32 => 0,
        DType::Bf16 => 1,
        DType::F16 => 2,
        DType::U8 => 3,
    }
}

/// Whether an NVFP4 rowwise kernel may take its vector path (16-byte loads of `x`, 8-byte code
/// stores at `d`): bf16 input, whole blocks (the row pitches then keep the alignment of the
/// first row) and aligned addresses.
pub(super) fn nvfp4_rows_vec(src: DType, cols: usize, x: u64, d: u64) -> bool {
    src == DType::Bf16 && cols.is_multiple_of(16) && x.is_multiple_of(16) && d.is_multiple_of(8)
}

/// Threads per block of the grid-stride kernels.
const THREADS: u32 = 256;

/// Grid of a grid-stride kernel over `n` items (capped; the kernels loop).
fn stride_grid(n: usize) -> (u32, u32, u32) {
    let b = n.div_ceil(THREADS as usize).clamp(1, 1 << 16);
    (b as u32, 1, 1)
}

/// A zeroed device scratch buffer of u32 words and its address (freed in stream order when
/// dropped).
pub(super) struct Scratch {
    mem: CudaSlice<u32>,
    pub(super) ptr: u64,
}

impl Scratch {
    /// Its u32 words.
    pub(super) fn len(&self) -> usize {
        self.mem.len()
    }

    /// Whether it was allocated on `stream` (so work queued there is ordered after the
    /// kernels that wrote it).
    pub(super) fn is_on(&self, stream: &std::sync::Arc<cudarc::driver::CudaStream>) -> bool {
        std::sync::Arc::ptr_eq(self.mem.stream(), stream)
    }
}

/// Items per launch of `u32_max_many_p` (`U32MAX_PARAMS_MAX` in `crates/lowbit-kernels/ops.cu`: 2064 bytes of
/// parameters); longer lists upload their table to `u32_max_many`.
const U32MAX_PARAMS_MAX: usize = 128;

impl CudaDevice {
    /// Validates an op's views (as the CPU does) and returns their device addresses, inputs
    /// then outputs.
    pub(super) fn ptrs<const I: usize, const O: usize>(
        &self,
        what: &'static str,
        ins: [View; I],
        outs: [View; O],
    ) -> Result<([u64; I], [u64; O])> {
        self.check_views(what, &ins, &outs)?;
        let mut i = [0u64; I];
        for (p, v) in i.iter_mut().zip(ins) {
            *p = self.device_ptr(v)?;
        }
        let mut o = [0u64; O];
        for (p, v) in o.iter_mut().zip(outs) {
            *p = self.device_ptr(v)?;
        }
        Ok((i, o))
    }

    /// Launches a grid-stride kernel of 256-thread blocks over `n` items (nothing for `n == 0`).
    ///
    /// # Safety
    /// As [`CudaDevice::launch`].
    pub(super) unsafe fn launch_n(
        &mut self,
        name: &'static str,
        n: usize,
        args: &[Arg],
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        // SAFETY: forwarded to the caller.
        unsafe { self.launch(name, stride_grid(n), (THREADS, 1, 1), args) }
    }

    /// Uploads a table a launch reads (u64 words: addresses, lengths, offsets) and returns it
    /// with its device address. The copy is staged before this returns; dropped after the
    /// launch is enqueued, the slice is freed in stream order (after the kernel).
    pub(in crate::cuda) fn upload_table(
        &mut self,
        table: &[u64],
    ) -> Result<(cudarc::driver::CudaSlice<u64>, u64)> {
        self.bind()?;
        let mem = self
            .stream
            .clone_htod(table)
            .map_err(super::cuda_err("uploading a launch table"))?;
        let t = {
            let (t, _sync) = cudarc::driver::DevicePtr::device_ptr(&mem, &self.stream);
            t
        };
        Ok((mem, t))
    }

    /// Launches `u32_max_many`: word `i` at `out` becomes the max of its current value and
    /// the raw bits of the `len` f32 values at `views[i] = (address, len)` (the global amax of a
    /// matrix from its tile amaxes), one launch for all.
    ///
    /// # Safety
    /// Every `(address, len)` is a live, in-bounds f32 device view; `out` addresses
    /// `views.len()` u32 words of a live buffer; `views.len()` is at most 65535 (grid y).
    pub(in crate::cuda) unsafe fn launch_u32_max_many(
        &mut self,
        views: &[(u64, usize)],
        out: u64,
    ) -> Result<()> {
        let Some(rows) = u32::try_from(views.len()).ok().filter(|&n| n > 0) else {
            return Ok(());
        };
        let most = views.iter().map(|v| v.1).max().unwrap_or(0);
        // A CTA per 8192 words of the largest item (at least 32 words a thread): one per 256
        // made ~28k mostly idle CTAs for Llama-3.2-1B's 112 matrices (1x H100: 82.7 us against
        // 12.8 us for the same maxima).
        let gx = capped(most.div_ceil(8192), 1024);
        if views.len() <= U32MAX_PARAMS_MAX {
            // The table in the parameters (`U32MaxParams`): no allocation and no copy to the
            // device, which cost a copy-engine round trip per call (one per bucket group).
            let mut words = vec![0u64; 2 + 2 * U32MAX_PARAMS_MAX];
            words[0] = out;
            for (k, &(p, n)) in views.iter().enumerate() {
                words[2 + 2 * k..][..2].copy_from_slice(&[p, n as u64]);
            }
            // SAFETY: `words` is exactly `U32MaxParams` (2 + 2·128 words, the kernel's
            // U32MAX_PARAMS_MAX); its first `rows` rows are the callers' live f32 views and
            // `out` their `rows` words (forwarded from the caller); grid y = rows <= 128.
            return unsafe {
                self.launch_words("u32_max_many_p", (gx, rows, 1), (256, 1, 1), &mut words)
            };
        }
        let sizes: Vec<u64> = views.iter().flat_map(|&(p, n)| [p, n as u64]).collect();
        let (sizes_mem, s) = self.upload_table(&sizes)?;
        // SAFETY: forwarded to the caller (live views, `rows` words at `out`, grid y <= 65535);
        // `sizes_mem` is freed in stream order after the launch.
        unsafe {
            self.launch("u32_max_many", (gx, rows, 1), (256, 1, 1), &args![s, out])?;
        }
        drop(sizes_mem);
        Ok(())
    }

    /// A zeroed device scratch buffer of `n` u32 words.
    pub(super) fn scratch(&self, n: usize) -> Result<Scratch> {
        let (mem, ptr) = self.zeroed::<u32>(n, "allocating scratch")?;
        Ok(Scratch { mem, ptr })
    }

    /// Copies a scratch buffer to the host (synchronising).
    pub(super) fn fetch(&self, s: &Scratch) -> Result<Vec<u32>> {
        self.fetch_words(s, s.len())
    }

    /// The first word of a scratch buffer (synchronising; only that word is copied).
    pub(super) fn fetch_word(&self, s: &Scratch) -> Result<u32> {
        Ok(self.fetch_words(s, 1)?.first().copied().unwrap_or(0))
    }

    /// The first `n` words of a scratch buffer (synchronising).
    fn fetch_words(&self, s: &Scratch, n: usize) -> Result<Vec<u32>> {
        let v = self
            .stream
            .clone_dtoh(&s.mem.slice(0..n.min(s.len())))
            .map_err(super::cuda_err("copying to the host"))?;
        self.stream
            .synchronize()
            .map_err(super::cuda_err("waiting for the stream"))?;
        Ok(v)
    }

    /// The NVFP4 tensor factors (k and the 256-entry reciprocal table) from the amax word at
    /// `amax`.
    pub(super) fn nvfp4_params(&mut self, amax: u64) -> Result<Scratch> {
        let p = self.scratch(257)?;
        // SAFETY: `amax` is a live scratch word, `p` holds 257 words, the tables 512 floats
        // (the E4M3 values first).
        unsafe {
            self.launch(
                "nvfp4_params",
                (1, 1, 1),
                (256, 1, 1),
                &args![amax, self.tables_ptr, p.ptr],
            )?;
        }
        Ok(p)
    }

    /// The global amax of 2D NVFP4 tile amaxes (the max of the f32 words of a validated view
    /// at `tiles`, `n` of them) and the tensor factors made from it.
    pub(super) fn nvfp4_tile_params(&mut self, tiles: u64, n: usize) -> Result<[Scratch; 2]> {
        let amax = self.scratch(1)?;
        // SAFETY: `tiles` addresses `n` f32 words of a validated view; `amax` is one zeroed
        // word; one item.
        unsafe { self.launch_u32_max_many(&[(tiles, n)], amax.ptr)? };
        let params = self.nvfp4_params(amax.ptr)?;
        Ok([amax, params])
    }
}
