//! The CUDA backend's storage and launch machinery (feature `cuda`).
//!
//! One [`CudaDevice`] owns one CUDA stream on one GPU (the primary context of its ordinal) and
//! every allocation it made. Buffers are driver allocations (`cudarc` `CudaSlice<u8>`, freed in
//! stream order) in the same generation-checked slot table as the CPU backend, so stale and
//! foreign views are rejected with the same errors. Every op is enqueued on the one stream in
//! call order, so ops need no further synchronisation among themselves; host reads
//! (`read_bytes_into`, reductions) synchronise the stream before they return.
//!
//! Kernels come from the embedded PTX ([`crate::ptx::MODULES`]), loaded once when the device is
//! created, and are launched with raw device addresses (`base + view offset`): the views were
//! validated (live, in bounds, overlap rule) before, which is what makes the launches sound.

use std::collections::BTreeMap;
use std::ffi::{CString, c_void};
use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaSlice, CudaStream, DevicePtr, DeviceRepr, DriverError, ValidAsZeroBits,
    result, sys,
};

use crate::slots::{Slots, check_bounds};
use crate::{BufferId, DType, DeviceError, Result, View};

/// Kernel arguments from plain values, each by its type: `u64` (device addresses) and `usize`
/// (counts, widened to 64 bits) as [`Arg::U64`], `u32` (flags, dtype codes) as [`Arg::U32`],
/// `f32` as [`Arg::F32`]: `args![x, n, dt(d), alpha]`.
macro_rules! args {
    ($($a:expr),* $(,)?) => {
        [$($crate::cuda::Arg::from($a)),*]
    };
}

mod gemm;
mod kernels;
mod mxfp8x;
mod nvfp4;
mod prepared;

pub(crate) use kernels::{Quantize, Range2d};
pub(crate) use nvfp4::{Finished, PendingWords};

/// A driver error as a [`DeviceError::Cuda`], with what was being done.
pub(crate) fn cuda_err(what: &str) -> impl FnOnce(DriverError) -> DeviceError + '_ {
    move |e| DeviceError::Cuda(format!("{what}: {e}"))
}

#[derive(Debug)]
struct Allocation {
    /// The driver allocation (at least one byte, so that empty buffers have an address too),
    /// held for its `Drop`, which frees it in stream order.
    _mem: CudaSlice<u8>,
    /// Its device address.
    base: u64,
    /// The buffer's size in bytes as requested.
    len: usize,
}

/// A loaded PTX module and its kernels by name.
#[derive(Debug)]
struct Module {
    handle: sys::CUmodule,
}

/// A kernel handle.
#[derive(Clone, Copy, Debug)]
struct Function(sys::CUfunction);

/// One kernel argument, passed by value.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Arg {
    /// A device address or a 64-bit count.
    U64(u64),
    /// A 32-bit float.
    F32(f32),
    /// A 32-bit unsigned integer.
    U32(u32),
}

impl From<u64> for Arg {
    fn from(v: u64) -> Self {
        Arg::U64(v)
    }
}

/// A count, passed as 64 bits.
impl From<usize> for Arg {
    fn from(v: usize) -> Self {
        Arg::U64(v as u64)
    }
}

impl From<u32> for Arg {
    fn from(v: u32) -> Self {
        Arg::U32(v)
    }
}

impl From<f32> for Arg {
    fn from(v: f32) -> Self {
        Arg::F32(v)
    }
}

#[derive(Debug)]
pub(crate) struct CudaDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// The driver allocations, by buffer.
    slots: Slots<Allocation>,
    modules: Vec<Module>,
    functions: BTreeMap<&'static str, Function>,
    fallbacks: BTreeMap<&'static str, u64>,
    /// Constant tables on the device, f32: the 256 E4M3 values, then the 256 E5M2 values (from
    /// `lowbit_formats::scalar`, so decoding is the library's by construction).
    tables: Option<CudaSlice<u32>>,
    /// The address of `tables`.
    tables_ptr: u64,
    /// Which kernel version runs MXFP8 rowwise + columnwise: 4 (the default: register tile,
    /// amaxes on packed bf16 pairs, an interior tile's four loads issued together, streaming;
    /// 0.86x copy bandwidth on an H200), 5 (two tiles per CTA, eight loads in flight, 0.82x) or
    /// 1 (shared-memory tile, 0.40x; also the path for unaligned views). All give the same
    /// bytes. (Versions 2 and 3, at 0.58x and 0.69x, were removed; `crates/lowbit-kernels/NOTES.md` has them.)
    mxfp8_both_version: u32,
    /// How `quantize_mxfp8_many` launches version 4: 2 (one launch per group of matrices of
    /// one shape, `mxfp8_both_e4m3_bf16_v4_same`, grid (tiles across, tile rows, matrices): no
    /// lookup at CTA start), 1 (every shape in one launch, `mxfp8_both_e4m3_bf16_v4_many`, each
    /// CTA searching its matrix in the parameter table) or 0 (the default: 2 where its launches
    /// average at least four matrices, else 1). Same bytes.
    mxfp8_many_version: u32,
    /// Which kernels run the bf16 amax pass and the NVFP4 codes: 10 (the default: 9's kernels,
    /// the both-copies one launched as the parameters kernel's programmatic dependent), 9 and 8
    /// (see `Device::set_cuda_kernel_variant`), 7 (6 with the codes' selects and bit merges as
    /// integer multiply-adds), 6 (5 and 4 with
    /// a CTA per pair of 256-row tiles, each column's scales of the pair stored as one 32-byte
    /// sector where version 4 stored 4-byte pieces, each a partial-sector write; on an H100
    /// with the amax pass both copies 0.70x of a copy, the columnwise copy 0.88x against 0.76x),
    /// 5 (both copies from one read of the input, `nvfp4_quantize_both_v5`'s 256x64 shared tile, 0.66x of a
    /// copy on an H100 with the amax pass), 4 (version 3 with the columnwise copy of
    /// `nvfp4_quantize_cols_v4`, both copies 0.59x where version 3 gives 0.36x), 3 (
    /// v2's amax pass and loads, the codes by comparing the bf16 inputs with a per-scale
    /// threshold table from `nvfp4_params_v3`, `nvfp4_quantize_rows_v3`; NVFP4 rowwise with
    /// its amax pass 0.85x on an H200), 2 (`max_abs_bits_bf16_v2`, `nvfp4_quantize_rows_v2`:
    /// four 16-byte loads in flight per thread, the shorter E2M1 encoder; 0.66x) or 1
    /// (`max_abs_bits`, `nvfp4_quantize_rows`, 0.63x). Version 4's columnwise kernel stages a
    /// 256x64 bf16 tile through shared memory (coalesced loads and stores) where the view
    /// allows it. Same bytes.
    nvfp4_version: u32,
    /// How `nvfp4_finish_2d_many` completes gathered 2D NVFP4 weights: 7 (the default: 5's
    /// 512x512 blocks of every shape in one `nvfp4x_finish_2d_mixed` launch per 128 matrices,
    /// where the call has at least 128 blocks, else as 5), 5 (4 with
    /// `nvfp4x_finish_2d_same_v5`'s 512x512 blocks, whose scale copies go out in whole 32-byte
    /// sectors, where a launch has enough of them; 6: wherever it can, for tests), 4 (one amax launch, one
    /// `nvfp4x_finish_2d_same_v4` launch per shape for the codes and both scale copies, the
    /// matrix a grid index, and one host read for all matrices), 3 (the same
    /// with the codes and the scales in two launches per shape), 2 (the same with one `nvfp4x_finish_2d_many` launch for
    /// every shape, each CTA searching its matrix in a global table) or 1 (one
    /// `nvfp4_finish_2d` per matrix, a host read each). Same bytes.
    nvfp4_finish_version: u32,
    /// Which kernels compute the blocked sums of squares (`sum_squares`, `sum_squares_each`,
    /// `mse_loss`): 0 (the default) picks per dtype, 3 for f32 and 2 for 16-bit inputs (3 where
    /// a 16-bit view is not 16-byte aligned); 1 (each warp instruction loads 128 bytes of each
    /// of 32 blocks), 2 (`*_v2`: 512 contiguous bytes of one block per instruction, a swizzled
    /// shared tile; 16-byte aligned views only, version 1 otherwise) or 3 (version 1 with the
    /// 256-byte L2 prefetch hint; the many-view launches of `sum_squares_each` only, the
    /// single-view ones of `mse_loss` run version 1) for every dtype. On an H200, f32: 0.82x /
    /// 0.75x / 0.87x of a copy (versions 1 / 2 / 3); bf16: 0.49x / 0.79x / 0.72x (`cuda_bench`,
    /// 1 GiB). With 0, the stages of a staged norm launched while later reductions run take 3
    /// for 16-bit views too (version 2's CTAs slowed NCCL's bf16 reduction beside them). Same
    /// bits.
    sum_squares_version: u32,
    /// The most CTAs of a sum-of-squares launch that runs beside collectives (a staged norm's
    /// stages before the last), striding over the warps; 0: no cap
    /// (`set_cuda_kernel_variant("sum_squares_beside", N)`). By default a quarter of the
    /// multiprocessors: a launch as wide as the work put a CTA on nearly every SM, and NCCL's
    /// reduce-scatter beside it slowed (4x H200, Llama-3-8B layers: the norm as the one-call
    /// step ran it 0.96-0.97 ms; 32 CTAs 0.12-0.25 ms, 8 CTAs 1.12-1.14 ms: too slow to keep
    /// up with the reductions). See `crates/lowbit-kernels/NOTES.md`.
    sum_squares_beside: u32,
    /// AdamW: 1 (the default: `adamw`, an element a thread) or 2 (`adamw_x4`, four elements a
    /// thread with vector loads and stores, where n % 4 == 0 and every view is aligned to its
    /// vector width; else 1). Same bits. Version 2 is faster alone (H200: 0.91 -> 0.98x of a
    /// copy with f32 gradients, 0.89 -> 0.97x with bf16) but makes the one-call step slower on
    /// 2x H200, where the update runs beside the gathers (1B MXFP8 17.4-17.5 -> 18.2 ms; also
    /// on a grid of four CTAs per multiprocessor: 18.3-18.5 ms). See `crates/lowbit-kernels/NOTES.md`.
    adamw_version: u32,
    /// Which kernels of `crates/lowbit-kernels/mxfp8x.cu` take bf16 inputs: 3 (the default, mxfp8.cu v4's
    /// technique: an interior tile's loads issued together, packed bf16 amaxes, four CTAs per
    /// SM) or 2 (`set_cuda_kernel_variant("mxfp8x", 2 | 3)`; see `cuda/mxfp8x.rs`). Same bytes.
    mxfp8x_version: u32,
    /// cuBLASLt for `matmul_tc`, opened on its first call.
    gemm: Option<Box<gemm::Gemm>>,
    /// How symmetric `matmul_tc` products run: 1 by blocks (3/4 of the work) with the mirror
    /// by `cublasLtMatrixTransform`, or by an identity GEMM where cuBLASLt refuses that (the
    /// default); 2 by blocks with the identity GEMM; 0 as one full GEMM
    /// (`set_cuda_kernel_variant("matmul_tc_symmetric", 0..=2)`).
    tc_symmetric: u32,
    /// Page-locked host memory the block sums of `sum_squares_each` are copied into, piece by
    /// piece (grown on demand, kept between calls; not write-combined: the host reads it).
    /// Boxed: the device is one variant of `Device`'s backend enum, kept small.
    partials_host: Option<Box<cudarc::driver::PinnedHostSlice<f64>>>,
    /// Whether batched calls that repeat launch the graphs an earlier call prepared
    /// (`prepared.rs`): 1 (the default) or 0 (every call fresh;
    /// `set_cuda_kernel_variant("prepared", 0 | 1)`).
    prepare: bool,
    /// The prepared calls of `mxfp8_scales_2d_many`.
    scales2d_prepared: prepared::Cache<crate::ops::Scales2dItem>,
    /// Calls that launched prepared graphs (`Device::prepared_calls`).
    prepared_calls: u64,
    /// The fast kernels' id-error words and scratch (`kernels/fast.rs`).
    fast: kernels::FastState,
}

/// Lets the device's default memory pool (where stream-ordered allocations come from) keep
/// the memory freed into it. Its default release threshold is 0: every synchronization hands
/// the pool's free memory back to the driver, and the next allocation maps pages again (the
/// norm's per-step scratch paid ~0.1 ms for that on an H100). Memory stays reserved for this
/// process, as a caching allocator (PyTorch's) keeps it.
fn keep_pool_memory(ctx: &Arc<CudaContext>) -> Result<()> {
    ctx.bind_to_thread()
        .map_err(cuda_err("binding the context"))?;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: a valid out pointer and the context's device; the pool handle is owned by the
    // driver (the device's default pool) and outlives the call below.
    unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) }
        .result()
        .map_err(cuda_err("cuDeviceGetDefaultMemPool"))?;
    let mut threshold = u64::MAX;
    // SAFETY: the release threshold attribute takes a pointer to a u64, read during the call.
    unsafe {
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&raw mut threshold).cast::<c_void>(),
        )
    }
    .result()
    .map_err(cuda_err("setting the memory pool's release threshold"))
}

/// That kernel `name` takes one struct parameter of `words` 8-byte words, as its PTX declares.
fn check_struct_param(name: &'static str, words: usize) -> Result<()> {
    let bytes = 8 * words;
    match crate::ptx::struct_param_bytes(name) {
        Some(n) if n == bytes => Ok(()),
        n => Err(DeviceError::Cuda(format!(
            "launching {name}: the host built {bytes} parameter bytes, the kernel takes {}",
            n.map_or("other parameters".into(), |n| format!("{n} bytes"))
        ))),
    }
}

/// Pointers to each argument's value, as a launch takes them (`vals` must outlive the launch).
fn arg_ptrs(vals: &mut [Arg]) -> Vec<*mut c_void> {
    vals.iter_mut()
        .map(|a| match a {
            Arg::U64(v) => (v as *mut u64).cast(),
            Arg::F32(v) => (v as *mut f32).cast(),
            Arg::U32(v) => (v as *mut u32).cast(),
        })
        .collect()
}

// SAFETY: the raw module and function handles are plain driver handles, valid in the context
// they were loaded in from any thread; every driver call below binds that context to the
// calling thread first. The device is used by one thread at a time (`&mut self`), it is not
// `Sync`.
unsafe impl Send for CudaDevice {}

impl CudaDevice {
    pub(crate) fn new(ordinal: usize) -> Result<Self> {
        // SAFETY: probing loads the CUDA driver library with `dlopen`, which runs its
        // initialisers; loading the system's libcuda is exactly what every CUDA program does.
        // Without this check, cudarc panics on the first driver call when the library is
        // missing.
        if !unsafe { sys::is_culib_present() } {
            return Err(DeviceError::Cuda(
                "the CUDA driver library (libcuda) was not found".into(),
            ));
        }
        let count = CudaContext::device_count().map_err(cuda_err("cuDeviceGetCount"))?;
        if ordinal >= usize::try_from(count).unwrap_or(0) {
            return Err(DeviceError::Cuda(format!(
                "no GPU with ordinal {ordinal} ({count} visible)"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(cuda_err("creating the context"))?;
        if ctx.has_async_alloc() {
            keep_pool_memory(&ctx)?;
        }
        let stream = ctx.new_stream().map_err(cuda_err("creating a stream"))?;
        let sms = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(cuda_err("cuDeviceGetAttribute"))?;
        let major = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
            .map_err(cuda_err("cuDeviceGetAttribute"))?;
        let minor = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
            .map_err(cuda_err("cuDeviceGetAttribute"))?;
        let mut dev = CudaDevice {
            ctx,
            stream,
            slots: Slots::new(),
            modules: Vec::new(),
            functions: BTreeMap::new(),
            fallbacks: BTreeMap::new(),
            tables: None,
            tables_ptr: 0,
            mxfp8_both_version: 4,
            mxfp8_many_version: 0,
            nvfp4_version: 10,
            nvfp4_finish_version: 7,
            sum_squares_version: 0,
            sum_squares_beside: u32::try_from(sms / 4).unwrap_or(0).max(1),
            adamw_version: 1,
            mxfp8x_version: 3,
            gemm: None,
            tc_symmetric: 1,
            partials_host: None,
            prepare: true,
            scales2d_prepared: prepared::Cache::default(),
            prepared_calls: 0,
            fast: kernels::FastState::default(),
        };
        // sm_90a PTX (wgmma) loads on compute capability 9.0 only; elsewhere its work runs
        // on the sm_90 kernels (`FastState::wgmma` stays false).
        let hopper = (major, minor) == (9, 0);
        for m in crate::ptx::MODULES {
            if m.arch == "sm_90a" && !hopper {
                continue;
            }
            dev.load_module(m)?;
        }
        dev.fast.wgmma = hopper;
        // The table `launch_words` checks against, read from the PTX (~10 ms, once per
        // process): here, beside the modules' load, not in the first launch of a table.
        let _ = crate::ptx::struct_param_bytes("");
        let values: Vec<u32> = (0..=255u8)
            .map(lowbit_formats::scalar::e4m3_to_f32)
            .chain((0..=255u8).map(lowbit_formats::scalar::e5m2_to_f32))
            .map(f32::to_bits)
            .collect();
        let tables = dev
            .stream
            .clone_htod(&values)
            .map_err(cuda_err("uploading the decode tables"))?;
        dev.tables_ptr = {
            let (p, _sync) = tables.device_ptr(&dev.stream);
            p
        };
        dev.tables = Some(tables);
        Ok(dev)
    }

    /// Whether the blocked sums of squares of `dtype` run the version-2 kernels (where the
    /// views are 16-byte aligned).
    pub(crate) fn sum_squares_v2(&self, dtype: DType) -> bool {
        match self.sum_squares_version {
            0 => dtype != DType::F32,
            v => v == 2,
        }
    }

    fn load_module(&mut self, m: &crate::ptx::Module) -> Result<()> {
        self.bind()?;
        let src = CString::new(m.ptx)
            .map_err(|_| DeviceError::Cuda(format!("PTX module {} holds a NUL byte", m.name)))?;
        // SAFETY: `src` is a NUL-terminated PTX image that outlives the call; the context is
        // bound to this thread.
        let handle = unsafe { result::module::load_data(src.as_ptr().cast()) }
            .map_err(|e| DeviceError::Cuda(format!("loading PTX module {}: {e}", m.name)))?;
        self.modules.push(Module { handle });
        Ok(())
    }

    /// The kernel `name`, looked up in the loaded modules once and cached.
    fn function(&mut self, name: &'static str) -> Result<Function> {
        if let Some(f) = self.functions.get(name) {
            return Ok(*f);
        }
        self.bind()?;
        for m in &self.modules {
            let cname = CString::new(name).map_err(|_| DeviceError::Cuda(name.into()))?;
            // SAFETY: `m.handle` is a module loaded by this device and not yet unloaded.
            if let Ok(f) = unsafe { result::module::get_function(m.handle, cname) } {
                self.functions.insert(name, Function(f));
                return Ok(Function(f));
            }
        }
        Err(DeviceError::Cuda(format!(
            "kernel {name} is in no loaded module"
        )))
    }

    /// Binds this device's context to the calling thread (a device may move between threads).
    fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(cuda_err("binding the context"))
    }

    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub(crate) fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// A zeroed allocation of `n` elements (at least one, so that it has an address) on this
    /// device's stream, and its address; dropping it frees it in stream order.
    fn zeroed<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        n: usize,
        what: &str,
    ) -> Result<(CudaSlice<T>, u64)> {
        let mem = self
            .stream
            .alloc_zeros::<T>(n.max(1))
            .map_err(cuda_err(what))?;
        let ptr = {
            let (ptr, _sync) = mem.device_ptr(&self.stream);
            ptr
        };
        Ok((mem, ptr))
    }

    pub(crate) fn alloc(&mut self, bytes: usize) -> Result<BufferId> {
        self.bind()?;
        let (mem, base) = self.zeroed::<u8>(bytes, "allocating device memory")?;
        self.slots
            .insert(Allocation {
                _mem: mem,
                base,
                len: bytes,
            })
            .ok_or_else(|| DeviceError::Cuda("more than 2^32 allocations".into()))
    }

    pub(crate) fn free(&mut self, id: BufferId) -> Result<()> {
        self.slots.get(id)?;
        self.bind()?;
        // Dropping the allocation frees it in stream order, after the work queued before.
        self.slots.remove(id)
    }

    pub(crate) fn allocated_bytes(&self) -> usize {
        self.slots.values().map(|a| a.len).sum()
    }

    /// The device address of `v`'s first byte, after checking liveness and bounds.
    pub(crate) fn device_ptr(&self, v: View) -> Result<u64> {
        let a = self.slots.get(v.buffer())?;
        check_bounds(v, a.len)?;
        Ok(a.base + v.byte_offset() as u64)
    }

    /// The same checks as `CpuDevice::check_views`, with the same errors.
    pub(crate) fn check_views(&self, op: &'static str, ins: &[View], outs: &[View]) -> Result<()> {
        for v in ins.iter().chain(outs) {
            self.device_ptr(*v)?;
        }
        crate::cpu::check_overlap(op, ins, outs)
    }

    pub(crate) fn write_bytes(&mut self, dst: View, src: &[u8]) -> Result<()> {
        let ptr = self.device_ptr(dst)?;
        if src.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: `ptr .. ptr + src.len()` lies inside a live allocation of this device
        // (checked above; `src.len()` equals the view's byte length). The source is pageable
        // host memory, which the driver stages before the call returns, so `src` may be dropped
        // right after.
        unsafe { result::memcpy_htod_async(ptr, src, self.stream.cu_stream()) }
            .map_err(cuda_err("copying to the device"))
    }

    /// `out` has `src`'s byte length (checked by the caller).
    pub(crate) fn read_bytes_into(&self, src: View, out: &mut [u8]) -> Result<()> {
        let ptr = self.device_ptr(src)?;
        if out.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the source range lies inside a live allocation (checked above) and `out` has
        // exactly its length; the stream is synchronised before `out` is read (or dropped).
        unsafe { result::memcpy_dtoh_async(out, ptr, self.stream.cu_stream()) }
            .map_err(cuda_err("copying to the host"))?;
        self.stream
            .synchronize()
            .map_err(cuda_err("waiting for the stream"))?;
        self.check_fast_errors()
    }

    pub(crate) fn zero(&mut self, view: View) -> Result<()> {
        let ptr = self.device_ptr(view)?;
        if view.byte_len() == 0 {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the range lies inside a live allocation of this device (checked above).
        unsafe { result::memset_d8_async(ptr, 0, view.byte_len(), self.stream.cu_stream()) }
            .map_err(cuda_err("zeroing"))
    }

    /// `memmove` semantics: overlapping views go through a temporary device buffer.
    pub(crate) fn copy(&mut self, src: View, dst: View) -> Result<()> {
        let (s, d) = (self.device_ptr(src)?, self.device_ptr(dst)?);
        let n = src.byte_len();
        if n == 0 || s == d {
            return Ok(());
        }
        self.bind()?;
        let stream = self.stream.cu_stream();
        if src.overlaps(&dst) {
            // SAFETY: the temporary has `n` bytes and lives until the copies are enqueued;
            // it is freed in stream order after them. Both view ranges are in live
            // allocations (checked above).
            let tmp = unsafe { self.stream.alloc::<u8>(n) }.map_err(cuda_err("allocating"))?;
            let (t, _sync) = tmp.device_ptr(&self.stream);
            // SAFETY: as above.
            unsafe {
                result::memcpy_dtod_async(t, s, n, stream).map_err(cuda_err("copying"))?;
                result::memcpy_dtod_async(d, t, n, stream).map_err(cuda_err("copying"))?;
            }
            return Ok(());
        }
        // SAFETY: both ranges lie inside live allocations (checked above) and do not overlap.
        unsafe { result::memcpy_dtod_async(d, s, n, stream) }.map_err(cuda_err("copying"))
    }

    pub(crate) fn synchronize(&mut self) -> Result<()> {
        self.bind()?;
        self.stream
            .synchronize()
            .map_err(cuda_err("waiting for the stream"))?;
        self.check_fast_errors()
    }

    /// Selects a kernel version (for benchmarks and tests of alternatives).
    pub(crate) fn set_kernel_variant(&mut self, kernel: &str, version: u32) -> Result<()> {
        match (kernel, version) {
            ("mxfp8_both", 1 | 4 | 5) => self.mxfp8_both_version = version,
            ("mxfp8_many", 0..=2) => self.mxfp8_many_version = version,
            ("nvfp4", 1..=10) => self.nvfp4_version = version,
            ("nvfp4_finish_2d", 1..=7) => self.nvfp4_finish_version = version,
            ("sum_squares", 0..=3) => self.sum_squares_version = version,
            ("sum_squares_beside", _) => self.sum_squares_beside = version,
            ("adamw", 1 | 2) => self.adamw_version = version,
            ("mxfp8x", 2 | 3) => self.mxfp8x_version = version,
            ("matmul_tc_symmetric", 0..=2) => self.tc_symmetric = version,
            ("fast_xent_exp", 0 | 1) => self.fast.xent_exact_exp = version,
            ("fast_rms_threads", 0 | 128) => self.fast.rms_threads = version,
            ("flash_fwd_tiles", 0..=2) => self.fast.flash_fwd_tiles = version,
            ("flash_wgmma", 0 | 1) => self.fast.flash_mma_sync = version == 1,
            ("matmul_mx_kernel", 0..=3) => self.fast.mx_gemm = version,
            ("fast_xent_threads", 0) => self.fast.xent_threads = 0,
            ("fast_xent_threads", 64..=1024) if version.is_multiple_of(32) => {
                self.fast.xent_threads = version;
            }
            ("prepared", 0 | 1) => {
                self.prepare = version == 1;
                // Bound: dropping the entries destroys their graphs.
                self.bind()?;
                self.scales2d_prepared.clear();
            }
            _ => {
                return Err(DeviceError::Unsupported(format!(
                    "no version {version} of kernel {kernel}"
                )));
            }
        }
        Ok(())
    }

    pub(crate) fn note_fallback(&mut self, what: &'static str) {
        *self.fallbacks.entry(what).or_insert(0) += 1;
    }

    pub(crate) fn prepared_calls(&self) -> u64 {
        self.prepared_calls
    }

    pub(crate) fn fallback_calls(&self) -> Vec<(&'static str, u64)> {
        self.fallbacks.iter().map(|(k, v)| (*k, *v)).collect()
    }

    /// Launches kernel `name` on this device's stream with `args` passed by value.
    ///
    /// # Safety
    /// `args` must match the kernel's parameter list, and every device address among them must
    /// point into a live allocation with room for everything the kernel touches under this
    /// launch configuration (callers pass addresses from [`CudaDevice::device_ptr`] of views
    /// validated for the op).
    pub(crate) unsafe fn launch(
        &mut self,
        name: &'static str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        args: &[Arg],
    ) -> Result<()> {
        // SAFETY: forwarded to the caller.
        unsafe { self.launch_with(name, grid, block, args, false) }
    }

    /// Launches `name` with one by-value struct parameter whose bytes are `words` (a launch
    /// table in the kernel's parameter space: the constant bank, read through the SM's
    /// constant cache).
    ///
    /// # Errors
    /// The kernel does not take exactly one struct parameter of `8 · words.len()` bytes (as its
    /// PTX declares it: a host table and a kernel struct that disagree), or the launch fails.
    ///
    /// # Safety
    /// The kernel's only parameter is a struct of 8-byte aligned words, and the words satisfy
    /// the kernel's contract.
    pub(crate) unsafe fn launch_words(
        &mut self,
        name: &'static str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        words: &mut [u64],
    ) -> Result<()> {
        check_struct_param(name, words.len())?;
        // SAFETY: the one parameter points at `words`, which outlive the call, and is as long
        // as the kernel's parameter (checked above); the caller guarantees its contents.
        unsafe { self.launch_params(name, grid, block, &mut [words.as_mut_ptr().cast()], false) }
    }

    /// [`Self::launch`], and with `dependent` as the programmatic dependent of the kernel queued
    /// just before it on the stream (programmatic stream serialization, sm_90): its CTAs may
    /// start while that kernel still runs, once its CTAs have executed
    /// `griddepcontrol.launch_dependents` (or exited), so its prologue and the launch overlap
    /// that kernel's end.
    ///
    /// # Safety
    /// As [`Self::launch`]; with `dependent`, also: the kernel executes `griddepcontrol.wait`
    /// before it reads anything the kernel before it writes, and writes nothing that kernel
    /// reads or writes (everything queued before that kernel has completed when it starts: only
    /// that kernel may still run).
    pub(crate) unsafe fn launch_with(
        &mut self,
        name: &'static str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        args: &[Arg],
        dependent: bool,
    ) -> Result<()> {
        let mut vals: Vec<Arg> = args.to_vec();
        let mut params = arg_ptrs(&mut vals);
        // SAFETY: `params` points at `vals`, which outlive the call; the caller guarantees the
        // arguments match the kernel, and the dependent contract where it asks for one.
        unsafe { self.launch_params(name, grid, block, &mut params, dependent) }
    }

    /// A CUDA graph of one launch of `name` with one by-value struct parameter whose bytes
    /// are `words` (copied into the graph's node: a launch of the graph passes them without
    /// copying them again), instantiated for this device's stream.
    ///
    /// # Errors
    /// As [`Self::launch_words`]: the kernel does not take exactly these parameter bytes; or
    /// the driver refuses the graph.
    ///
    /// # Safety
    /// As [`Self::launch_words`], for every launch of the graph: the words' addresses stay
    /// valid while the graph may be launched.
    pub(in crate::cuda) unsafe fn kernel_graph(
        &mut self,
        name: &'static str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        words: &mut [u64],
    ) -> Result<prepared::KernelGraph> {
        check_struct_param(name, words.len())?;
        let f = self.function(name)?;
        self.bind()?;
        let err = |what: &'static str, e: sys::CUresult| {
            DeviceError::Cuda(format!("{what} of {name}: {e:?}"))
        };
        let mut params: [*mut c_void; 1] = [words.as_mut_ptr().cast()];
        let node = sys::CUDA_KERNEL_NODE_PARAMS {
            func: f.0,
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block.0,
            blockDimY: block.1,
            blockDimZ: block.2,
            sharedMemBytes: 0,
            kernelParams: params.as_mut_ptr(),
            extra: std::ptr::null_mut(),
            kern: std::ptr::null_mut(),
            ctx: std::ptr::null_mut(),
        };
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: a valid out pointer; flags must be 0.
        let r = unsafe { sys::cuGraphCreate(&mut graph, 0) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(err("creating a graph", r));
        }
        let mut g = prepared::KernelGraph {
            graph,
            exec: std::ptr::null_mut(),
        };
        let mut n: sys::CUgraphNode = std::ptr::null_mut();
        // SAFETY: `node` describes a launch of a function of this context, its one parameter
        // pointing at `words` (copied by the driver during the call; the caller guarantees
        // their contents); no dependencies.
        let r =
            unsafe { sys::cuGraphAddKernelNode_v2(&mut n, g.graph, std::ptr::null(), 0, &node) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(err("adding the kernel node", r));
        }
        // SAFETY: a graph of one kernel node, instantiated into a valid out pointer.
        let r = unsafe { sys::cuGraphInstantiateWithFlags(&mut g.exec, g.graph, 0) };
        if r != sys::CUresult::CUDA_SUCCESS {
            g.exec = std::ptr::null_mut();
            return Err(err("instantiating the graph", r));
        }
        Ok(g)
    }

    /// Launches instantiated graphs on this device's stream, in order.
    ///
    /// # Safety
    /// The graphs' launches satisfy their kernels' contracts now ([`Self::kernel_graph`]).
    pub(in crate::cuda) unsafe fn launch_graphs(
        &mut self,
        graphs: &[prepared::KernelGraph],
    ) -> Result<()> {
        self.bind()?;
        for g in graphs {
            // SAFETY: an executable graph of this context; forwarded to the caller.
            unsafe { sys::cuGraphLaunch(g.exec, self.stream.cu_stream()) }
                .result()
                .map_err(|e| DeviceError::Cuda(format!("launching a graph: {e}")))?;
        }
        Ok(())
    }

    /// The launch behind [`Self::launch_with`] and [`Self::launch_words`] (`dependent`: with
    /// programmatic stream serialization).
    ///
    /// # Safety
    /// `params` point at the kernel's parameters, in order and of their sizes, alive for the
    /// call (the driver copies them at launch), with the contract of the callers above.
    unsafe fn launch_params(
        &mut self,
        name: &'static str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        params: &mut [*mut c_void],
        dependent: bool,
    ) -> Result<()> {
        let f = self.function(name)?;
        self.bind()?;
        let stream = self.stream.cu_stream();
        let launched = if dependent {
            let mut attr = sys::CUlaunchAttribute {
                id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
                pad: [0; 4],
                value: sys::CUlaunchAttributeValue {
                    programmaticStreamSerializationAllowed: 1,
                },
            };
            let config = sys::CUlaunchConfig {
                gridDimX: grid.0,
                gridDimY: grid.1,
                gridDimZ: grid.2,
                blockDimX: block.0,
                blockDimY: block.1,
                blockDimZ: block.2,
                sharedMemBytes: 0,
                hStream: stream,
                attrs: &raw mut attr,
                numAttrs: 1,
            };
            // SAFETY: `config` and its one attribute outlive the call; the rest is forwarded
            // to the caller.
            unsafe {
                sys::cuLaunchKernelEx(&config, f.0, params.as_mut_ptr(), std::ptr::null_mut())
            }
            .result()
        } else {
            // SAFETY: forwarded to the caller.
            unsafe { result::launch_kernel(f.0, grid, block, 0, stream, params) }
        };
        launched.map_err(|e| DeviceError::Cuda(format!("launching {name}: {e}")))
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        // Finish queued work before the allocations and modules go away; errors cannot be
        // reported from here.
        if self.bind().is_ok() {
            let _ = self.stream.synchronize();
        }
        self.slots.clear();
        // The prepared graphs before the modules whose kernels they launch.
        self.scales2d_prepared.clear();
        for m in self.modules.drain(..) {
            // SAFETY: the module was loaded by this device and is unloaded once; no kernel of
            // it is queued any more (the stream was synchronised).
            let _ = unsafe { result::module::unload(m.handle) };
        }
    }
}
