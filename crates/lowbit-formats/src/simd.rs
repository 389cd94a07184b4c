//! Runtime selection of the instruction set the block kernels are compiled for.
//!
//! The kernels are plain scalar Rust written so that LLVM vectorises them (branch-free encoders,
//! integer amaxes). The default x86-64 target only guarantees SSE2, which lacks the unsigned
//! 32-bit min/max the amax and saturation need, so the loops stay scalar. [`dispatch`] runs a
//! kernel through a copy compiled with AVX2 when the CPU has it. Results are identical either
//! way: the arithmetic is the same IEEE operations (Rust never contracts `a * b + c` into an FMA).

/// Runs `f`, compiled for AVX2 when the CPU supports it. `f` must be `#[inline(always)]` (and
/// so must what it calls) for the AVX2 copy to contain the kernel.
#[inline(always)]
pub(crate) fn dispatch<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: `avx2` is available on this CPU (checked just above), which is the only
            // requirement of calling a function compiled with `target_feature(enable = "avx2")`.
            return unsafe { run_avx2(f) };
        }
    }
    f()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn run_avx2<R>(f: impl FnOnce() -> R) -> R {
    f()
}
