//! `Device::matmul_tc` on CUDA: cuBLASLt GEMMs with bf16 inputs on the tensor cores, f32
//! accumulation and epilogue, f32 or bf16 output.
//!
//! cuBLASLt (`libcublasLt`, loaded at run time by cudarc like the driver) is opened on the first
//! call, so devices that never call `matmul_tc` never need it. One handle per device, bound to
//! the device's stream, with a 32 MiB workspace (NVIDIA's recommendation for Hopper). Every
//! distinct call shape gets a plan (descriptors, layouts and the heuristic's first algorithm,
//! chosen for the operands' actual alignment) that is cached for the device's lifetime, so a
//! shape always runs the same algorithm: repeated calls give the same bits.
//!
//! Row-major products run as the column-major product of the transposes:
//! `Dᵀ[n, m] = op(B)ᵀ·op(A)ᵀ`, so cuBLASLt's A is our B and its B our A, with their stored
//! shapes and row pitches as column-major layouts.
//!
//! Symmetric products (`MatmulTcSpec::symmetric`, `D = alpha·op(X)·op(X)ᵀ + beta·C`, bf16 D,
//! `n ≥ SYMMETRIC_MIN` and even) are split 2x2 at `h = n/2`: the blocks (0,0), (0,1) and (1,1)
//! are three GEMMs of `h x h x k` (about one wave each of a full GPU at h = 2048), and (1,0) is
//! the transpose of (0,1), which makes D symmetric bit for bit: three quarters of the
//! multiply-adds of the full product. The mirror is `cublasLtMatrixTransform` (with B absent:
//! given B with `beta = 0`, cuBLAS 13.0 answered `CUBLAS_STATUS_INVALID_VALUE`); should the
//! library refuse it, a GEMM with the identity, `D₁₀ = I·D₀₁ᵀ`, runs from then on (`h³`
//! multiply-adds, exact: each output is one bf16 value times 1 plus zeros; a non-finite value
//! in D₀₁ would spread NaN along its row of D₁₀, which only matters for inputs that are already
//! garbage). On an H200 the blocks gave the same bits as the full GEMM on the Muon shapes and
//! took a Llama-3-8B layer's Muon step from 38.4 ms to 33.4 ms (34.1 ms with the identity
//! mirror).

use std::collections::HashMap;
use std::ffi::c_void;

use cudarc::cublaslt::result::CublasError;
use cudarc::cublaslt::sys as lt;
use cudarc::driver::CudaSlice;

use super::CudaDevice;
use crate::{DType, DeviceError, MatmulTcSpec, Result, View};

/// Workspace bytes handed to cuBLASLt.
const WORKSPACE: usize = 32 << 20;

/// The smallest side for which a symmetric product is computed by blocks (smaller blocks fill
/// too little of the GPU to pay off).
pub(super) const SYMMETRIC_MIN: usize = 2048;

fn lt_err(what: &'static str) -> impl FnOnce(CublasError) -> DeviceError {
    move |e| DeviceError::Cuda(format!("cuBLASLt {what}: {e:?}"))
}

fn lt_ok(what: &'static str, s: lt::cublasStatus_t) -> Result<()> {
    s.result().map_err(lt_err(what))
}

/// The largest power of two (at most 256) that divides a device address.
fn alignment(ptr: u64) -> u32 {
    if ptr == 0 {
        256
    } else {
        1u32 << ptr.trailing_zeros().min(8)
    }
}

fn cuda_type(d: DType) -> lt::cudaDataType {
    match d {
        DType::F32 => lt::cudaDataType::CUDA_R_32F,
        _ => lt::cudaDataType::CUDA_R_16BF,
    }
}

/// A column-major GEMM `D[m, n] = alpha·opA(A)·opB(B) + beta·C` as cuBLASLt sees it: operands
/// by their stored shape (`rows x cols`, leading dimension `ld`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Key {
    m: u64,
    n: u64,
    k: u64,
    trans_a: bool,
    trans_b: bool,
    lda: i64,
    ldb: i64,
    ldd: i64,
    out_f32: bool,
    align: [u32; 4],
}

/// The cached descriptors and algorithm of one [`Key`].
struct Plan {
    desc: lt::cublasLtMatmulDesc_t,
    a: lt::cublasLtMatrixLayout_t,
    b: lt::cublasLtMatrixLayout_t,
    d: lt::cublasLtMatrixLayout_t,
    algo: lt::cublasLtMatmulAlgo_t,
}

impl Plan {
    /// Frees the descriptors (each once).
    ///
    /// # Safety
    /// No launch using them may be enqueued afterwards.
    unsafe fn destroy(&mut self) {
        // SAFETY: created by `Gemm::plan` and destroyed once (the plan is dropped right after).
        unsafe {
            let _ = lt::cublasLtMatmulDescDestroy(self.desc);
            for l in [self.a, self.b, self.d] {
                let _ = lt::cublasLtMatrixLayoutDestroy(l);
            }
        }
    }
}

/// One device's cuBLASLt state.
pub(crate) struct Gemm {
    handle: lt::cublasLtHandle_t,
    /// Held for its `Drop` (freed in stream order).
    _workspace: CudaSlice<u8>,
    workspace_ptr: u64,
    plans: HashMap<Key, Plan>,
    /// Whether `cublasLtMatrixTransform` refused a mirror once (then the identity GEMM runs).
    transform_refused: bool,
    /// A bf16 identity matrix (`side x side`) for mirrors by GEMM, and its address.
    identity: Option<(usize, CudaSlice<u16>, u64)>,
}

impl std::fmt::Debug for Gemm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gemm")
            .field("plans", &self.plans.len())
            .finish_non_exhaustive()
    }
}

impl Drop for Gemm {
    fn drop(&mut self) {
        for (_, mut p) in self.plans.drain() {
            // SAFETY: the owning device synchronised its stream before dropping this.
            unsafe { p.destroy() };
        }
        // SAFETY: the handle was created by `Gemm::new` and is destroyed once.
        let _ = unsafe { lt::cublasLtDestroy(self.handle) };
    }
}

/// One operand of a row-major product: a device address, the row pitch of the matrix as
/// stored (elements) and whether it is used transposed.
#[derive(Clone, Copy, Debug)]
struct Operand {
    ptr: u64,
    ld: usize,
    trans: bool,
}

impl Gemm {
    fn new(dev: &CudaDevice) -> Result<Gemm> {
        // SAFETY: probing `dlopen`s libcublasLt, as any program using cuBLAS does. Without this
        // check cudarc panics on the first call when the library is missing.
        if !unsafe { lt::is_culib_present() } {
            return Err(DeviceError::Cuda(
                "matmul_tc needs cuBLASLt (libcublasLt.so), which was not found: add the CUDA \
                 toolkit's (or PyTorch's nvidia/cu13) lib folder to LD_LIBRARY_PATH"
                    .into(),
            ));
        }
        dev.bind()?;
        let mut handle = std::ptr::null_mut();
        // SAFETY: `handle` is a valid out-pointer.
        lt_ok("create", unsafe { lt::cublasLtCreate(&mut handle) })?;
        let (workspace, workspace_ptr) = match dev.zeroed::<u8>(WORKSPACE, "cuBLASLt workspace") {
            Ok(w) => w,
            Err(e) => {
                // SAFETY: created just above, destroyed once.
                let _ = unsafe { lt::cublasLtDestroy(handle) };
                return Err(e);
            }
        };
        Ok(Gemm {
            handle,
            _workspace: workspace,
            workspace_ptr,
            plans: HashMap::new(),
            transform_refused: false,
            identity: None,
        })
    }

    /// The plan of `key`, made (and cached) on first use.
    fn plan(&mut self, key: Key) -> Result<&Plan> {
        if !self.plans.contains_key(&key) {
            let plan = self.make_plan(key)?;
            self.plans.insert(key, plan);
        }
        Ok(&self.plans[&key])
    }

    fn make_plan(&self, key: Key) -> Result<Plan> {
        let layout = |dtype, rows: u64, cols: u64, ld: i64| -> Result<lt::cublasLtMatrixLayout_t> {
            let mut l = std::ptr::null_mut();
            // SAFETY: `l` is a valid out-pointer.
            lt_ok("layout", unsafe {
                lt::cublasLtMatrixLayoutCreate(&mut l, dtype, rows, cols, ld)
            })?;
            Ok(l)
        };
        let bf16 = lt::cudaDataType::CUDA_R_16BF;
        let out = if key.out_f32 {
            lt::cudaDataType::CUDA_R_32F
        } else {
            bf16
        };
        let (ar, ac) = if key.trans_a {
            (key.k, key.m)
        } else {
            (key.m, key.k)
        };
        let (br, bc) = if key.trans_b {
            (key.n, key.k)
        } else {
            (key.k, key.n)
        };
        let mut desc = std::ptr::null_mut();
        // SAFETY: `desc` is a valid out-pointer.
        lt_ok("matmul desc", unsafe {
            lt::cublasLtMatmulDescCreate(
                &mut desc,
                lt::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                lt::cudaDataType::CUDA_R_32F,
            )
        })?;
        let mut plan = Plan {
            desc,
            a: std::ptr::null_mut(),
            b: std::ptr::null_mut(),
            d: std::ptr::null_mut(),
            algo: lt::cublasLtMatmulAlgo_t { data: [0; 8] },
        };
        let made = (|| -> Result<()> {
            plan.a = layout(bf16, ar, ac, key.lda)?;
            plan.b = layout(bf16, br, bc, key.ldb)?;
            plan.d = layout(out, key.m, key.n, key.ldd)?;
            for (attr, t) in [
                (
                    lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                    key.trans_a,
                ),
                (
                    lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
                    key.trans_b,
                ),
            ] {
                let op = i32::from(t);
                // SAFETY: the attribute is a cublasOperation_t (an i32): 0 = N, 1 = T.
                lt_ok("transpose attribute", unsafe {
                    lt::cublasLtMatmulDescSetAttribute(
                        plan.desc,
                        attr,
                        (&op as *const i32).cast(),
                        std::mem::size_of::<i32>(),
                    )
                })?;
            }
            let mut pref = std::ptr::null_mut();
            // SAFETY: `pref` is a valid out-pointer.
            lt_ok("preference", unsafe {
                lt::cublasLtMatmulPreferenceCreate(&mut pref)
            })?;
            let found = (|| -> Result<lt::cublasLtMatmulAlgo_t> {
                let ws = WORKSPACE as u64;
                // SAFETY: a u64 attribute.
                lt_ok("workspace preference", unsafe {
                    lt::cublasLtMatmulPreferenceSetAttribute(
                        pref,
                        lt::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                        (&ws as *const u64).cast(),
                        8,
                    )
                })?;
                use lt::cublasLtMatmulPreferenceAttributes_t as P;
                for (attr, a) in [
                    P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                    P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                    P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                    P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                ]
                .into_iter()
                .zip(key.align)
                {
                    // SAFETY: a u32 attribute.
                    lt_ok("alignment preference", unsafe {
                        lt::cublasLtMatmulPreferenceSetAttribute(
                            pref,
                            attr,
                            (&a as *const u32).cast(),
                            4,
                        )
                    })?;
                }
                let mut result =
                    std::mem::MaybeUninit::<lt::cublasLtMatmulHeuristicResult_t>::zeroed();
                let mut count = 0i32;
                // SAFETY: every descriptor is live; one result slot is requested.
                lt_ok("heuristic", unsafe {
                    lt::cublasLtMatmulAlgoGetHeuristic(
                        self.handle,
                        plan.desc,
                        plan.a,
                        plan.b,
                        plan.d,
                        plan.d,
                        pref,
                        1,
                        result.as_mut_ptr(),
                        &mut count,
                    )
                })?;
                if count == 0 {
                    return Err(DeviceError::Cuda(format!(
                        "cuBLASLt has no algorithm for {key:?}"
                    )));
                }
                // SAFETY: the call succeeded with one result written.
                let result = unsafe { result.assume_init() };
                lt_ok("heuristic result", result.state)?;
                Ok(result.algo)
            })();
            // SAFETY: created above, destroyed once.
            let _ = unsafe { lt::cublasLtMatmulPreferenceDestroy(pref) };
            plan.algo = found?;
            Ok(())
        })();
        match made {
            Ok(()) => Ok(plan),
            Err(e) => {
                // SAFETY: nothing was launched with these descriptors.
                unsafe {
                    let _ = lt::cublasLtMatmulDescDestroy(plan.desc);
                    for l in [plan.a, plan.b, plan.d] {
                        if !l.is_null() {
                            let _ = lt::cublasLtMatrixLayoutDestroy(l);
                        }
                    }
                }
                Err(e)
            }
        }
    }
}

impl CudaDevice {
    fn gemm(&mut self) -> Result<&mut Gemm> {
        if self.gemm.is_none() {
            self.gemm = Some(Box::new(Gemm::new(self)?));
        }
        Ok(self.gemm.as_mut().expect("just created"))
    }

    /// `D = alpha·op(A)·op(B) + beta·C` (`Device::matmul_tc`, arguments validated there):
    /// `c_in` is a C disjoint from `d`; `has_c` without `c_in` means C is `d` itself.
    pub(crate) fn matmul_tc(
        &mut self,
        a: View,
        b: View,
        c_in: Option<View>,
        has_c: bool,
        d: View,
        spec: &MatmulTcSpec,
    ) -> Result<()> {
        let ins: Vec<View> = [a, b].into_iter().chain(c_in).collect();
        self.check_views("matmul_tc", &ins, &[d])?;
        let (ap, bp, dp) = (
            self.device_ptr(a)?,
            self.device_ptr(b)?,
            self.device_ptr(d)?,
        );
        let cp = match c_in {
            Some(c) => Some(self.device_ptr(c)?),
            None => has_c.then_some(dp),
        };
        let MatmulTcSpec { m, n, k, .. } = *spec;
        if m == 0 || n == 0 {
            return Ok(());
        }
        let beta = if cp.is_some() { spec.beta } else { 0.0 };
        let dt = d.dtype();
        // Stored row pitches of the operands.
        let lda = if spec.trans_a { m } else { k };
        let ldb = if spec.trans_b { k } else { n };
        let sym = spec.symmetric
            && self.tc_symmetric > 0
            && dt == DType::Bf16
            && n >= SYMMETRIC_MIN
            && n.is_multiple_of(2);
        if !sym {
            return self.gemm_rm(
                (m, n, k),
                Operand {
                    ptr: ap,
                    ld: lda,
                    trans: spec.trans_a,
                },
                Operand {
                    ptr: bp,
                    ld: ldb,
                    trans: spec.trans_b,
                },
                cp,
                (dp, n, dt),
                (spec.alpha, beta),
            );
        }
        // op(X) is n x k; row block r of op(X) as the left operand and (transposed) as the
        // right one.
        let h = n / 2;
        let tx = spec.trans_a;
        let left = |r0: usize| {
            if tx {
                // X stored [k, n]: rows r0.. of Xᵀ are columns r0.. of X, pitch n.
                Operand {
                    ptr: ap + 2 * r0 as u64,
                    ld: n,
                    trans: true,
                }
            } else {
                Operand {
                    ptr: ap + 2 * (r0 * k) as u64,
                    ld: k,
                    trans: false,
                }
            }
        };
        let right = |r0: usize| {
            if tx {
                Operand {
                    ptr: ap + 2 * r0 as u64,
                    ld: n,
                    trans: false,
                }
            } else {
                Operand {
                    ptr: ap + 2 * (r0 * k) as u64,
                    ld: k,
                    trans: true,
                }
            }
        };
        let es = dt.size() as u64;
        let at = |p: u64, i: usize, j: usize| p + es * (i * n + j) as u64;
        for (i, j) in [(0, 0), (0, h), (h, h)] {
            self.gemm_rm(
                (h, h, k),
                left(i),
                right(j),
                cp.map(|c| at(c, i, j)),
                (at(dp, i, j), n, dt),
                (spec.alpha, beta),
            )?;
        }
        let (src, dst) = (at(dp, 0, h), at(dp, h, 0));
        if self.tc_symmetric == 1 && !self.gemm()?.transform_refused {
            match self.transpose_block(src, dst, h, n, dt) {
                Ok(()) => return Ok(()),
                Err(_) => self.gemm()?.transform_refused = true,
            }
        }
        // D₁₀ = I·D₀₁ᵀ: D₀₁ stored [h, h] with pitch n, used transposed.
        let eye = self.identity(h)?;
        self.gemm_rm(
            (h, h, h),
            Operand {
                ptr: eye,
                ld: h,
                trans: false,
            },
            Operand {
                ptr: src,
                ld: n,
                trans: true,
            },
            None,
            (dst, n, dt),
            (1.0, 0.0),
        )
    }

    /// The address of a bf16 identity matrix of `side x side` (made once per side).
    fn identity(&mut self, side: usize) -> Result<u64> {
        if let Some((s, _, p)) = &self.gemm()?.identity
            && *s == side
        {
            return Ok(*p);
        }
        let mut host = vec![0u16; side * side];
        for i in 0..side {
            host[i * side + i] = 0x3F80; // bf16 1.0
        }
        self.bind()?;
        let mem = self
            .stream
            .clone_htod(&host)
            .map_err(super::cuda_err("uploading an identity matrix"))?;
        let ptr = {
            let (p, _sync) = cudarc::driver::DevicePtr::device_ptr(&mem, &self.stream);
            p
        };
        self.gemm()?.identity = Some((side, mem, ptr));
        Ok(ptr)
    }

    /// The row-major product `D[m, n] = alpha·op(A)[m, k]·op(B)[k, n] + beta·C` (C with D's
    /// layout; `None`: D = alpha·op(A)·op(B)) as the column-major `Dᵀ = op(B)ᵀ·op(A)ᵀ`.
    fn gemm_rm(
        &mut self,
        (m, n, k): (usize, usize, usize),
        a: Operand,
        b: Operand,
        c: Option<u64>,
        (d, ldd, dt): (u64, usize, DType),
        (alpha, beta): (f32, f32),
    ) -> Result<()> {
        let c_ptr = c.unwrap_or(d);
        let key = Key {
            m: n as u64,
            n: m as u64,
            k: k as u64,
            trans_a: b.trans,
            trans_b: a.trans,
            lda: b.ld as i64,
            ldb: a.ld as i64,
            ldd: ldd as i64,
            out_f32: dt == DType::F32,
            align: [b.ptr, a.ptr, c_ptr, d].map(alignment),
        };
        self.bind()?;
        let stream = self.stream.cu_stream() as lt::cudaStream_t;
        let g = self.gemm()?;
        let (handle, ws) = (g.handle, g.workspace_ptr);
        let plan = g.plan(key)?;
        // SAFETY: the addresses come from validated views (or sub-blocks of them computed by
        // the caller) with room for the shapes in `key`; the workspace holds WORKSPACE bytes;
        // alpha and beta are host f32 scalars read during the call.
        lt_ok("matmul", unsafe {
            lt::cublasLtMatmul(
                handle,
                plan.desc,
                (&alpha as *const f32).cast(),
                b.ptr as *const c_void,
                plan.a,
                a.ptr as *const c_void,
                plan.b,
                (&beta as *const f32).cast(),
                c_ptr as *const c_void,
                plan.d,
                d as *mut c_void,
                plan.d,
                &plan.algo,
                ws as *mut c_void,
                WORKSPACE,
                stream,
            )
        })
    }

    /// Writes the transpose of the `h x h` row-major block at `src` (row pitch `ld`) to the
    /// block at `dst` (same pitch), elements of `dt`.
    fn transpose_block(
        &mut self,
        src: u64,
        dst: u64,
        h: usize,
        ld: usize,
        dt: DType,
    ) -> Result<()> {
        self.bind()?;
        let stream = self.stream.cu_stream() as lt::cudaStream_t;
        let handle = self.gemm()?.handle;
        let ty = cuda_type(dt);
        let mut desc = std::ptr::null_mut();
        // SAFETY: `desc` is a valid out-pointer.
        lt_ok("transform desc", unsafe {
            lt::cublasLtMatrixTransformDescCreate(&mut desc, lt::cudaDataType::CUDA_R_32F)
        })?;
        let mut layout = std::ptr::null_mut();
        let run = (|| -> Result<()> {
            let op = 1i32;
            // SAFETY: a cublasOperation_t attribute (T).
            lt_ok("transform transpose", unsafe {
                lt::cublasLtMatrixTransformDescSetAttribute(
                    desc,
                    lt::cublasLtMatrixTransformDescAttributes_t::CUBLASLT_MATRIX_TRANSFORM_DESC_TRANSA,
                    (&op as *const i32).cast(),
                    4,
                )
            })?;
            // Column-major h x h views with leading dimension `ld` (both blocks square).
            // SAFETY: `layout` is a valid out-pointer.
            lt_ok("transform layout", unsafe {
                lt::cublasLtMatrixLayoutCreate(&mut layout, ty, h as u64, h as u64, ld as i64)
            })?;
            let (one, zero) = (1f32, 0f32);
            // SAFETY: both blocks lie inside the validated output view (h x h each, pitch
            // `ld`, disjoint); beta is 0 and B is absent (null, with a null layout).
            lt_ok("transform", unsafe {
                lt::cublasLtMatrixTransform(
                    handle,
                    desc,
                    (&one as *const f32).cast(),
                    src as *const c_void,
                    layout,
                    (&zero as *const f32).cast(),
                    std::ptr::null(),
                    std::ptr::null_mut(),
                    dst as *mut c_void,
                    layout,
                    stream,
                )
            })
        })();
        // SAFETY: created above, destroyed once (the transform copies what it needs at launch).
        unsafe {
            if !layout.is_null() {
                let _ = lt::cublasLtMatrixLayoutDestroy(layout);
            }
            let _ = lt::cublasLtMatrixTransformDescDestroy(desc);
        }
        run
    }
}
