//! Zeroed output buffers that fault in as transparent huge pages.
//!
//! A fresh 33 MiB quantization output costs more in page faults (4 KiB at a time, each zeroed by
//! the kernel) than the quantization itself: 27 ms against 6 ms with 2 MiB pages on the CI
//! machines, whose kernels hand out huge pages only to memory advised with `MADV_HUGEPAGE`
//! (`transparent_hugepage=madvise`). So large outputs are advised before their first write. The
//! advice changes paging only, never contents; where it fails or the OS has no such call, the
//! buffer is an ordinary zeroed vector.

/// Below this, huge pages cannot cover a whole 2 MiB page of the buffer often enough to matter.
const THRESHOLD: usize = 4 << 20;

/// `n` zero bytes, advised for huge pages when large (Linux).
pub(crate) fn zeroed(n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    if n >= THRESHOLD {
        advise_huge(&mut v);
    }
    v
}

#[cfg(target_os = "linux")]
fn advise_huge(v: &mut [u8]) {
    const HUGE: usize = 2 << 20;
    const MADV_HUGEPAGE: core::ffi::c_int = 14;
    unsafe extern "C" {
        fn madvise(
            addr: *mut core::ffi::c_void,
            len: usize,
            advice: core::ffi::c_int,
        ) -> core::ffi::c_int;
    }
    let base = v.as_mut_ptr() as usize;
    let start = base.next_multiple_of(HUGE);
    let end = (base + v.len()) / HUGE * HUGE;
    if end > start {
        // SAFETY: `start..end` is a page-aligned range inside `v`'s allocation, which this
        // function borrows mutably; MADV_HUGEPAGE changes how the range is paged, not its
        // contents or validity. A failure (old kernel, THP disabled) is harmless and ignored.
        let _ = unsafe { madvise(start as *mut core::ffi::c_void, end - start, MADV_HUGEPAGE) };
    }
}

#[cfg(not(target_os = "linux"))]
fn advise_huge(_: &mut [u8]) {}

#[cfg(test)]
mod tests {
    #[test]
    fn large_and_small_buffers_are_zero() {
        for n in [0, 1, 4095, super::THRESHOLD, super::THRESHOLD + 12345] {
            let v = super::zeroed(n);
            assert_eq!(v.len(), n);
            assert!(v.iter().all(|&b| b == 0));
        }
    }
}
