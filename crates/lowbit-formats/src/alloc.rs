//! Output buffers: advised for transparent huge pages, and handed to workers as chunks that may
//! start uninitialized.
//!
//! A fresh 33 MiB quantization output costs more in page faults (4 KiB at a time, each zeroed by
//! the kernel) than the quantization itself: 27 ms against 6 ms with 2 MiB pages on the CI
//! machines, whose kernels hand out huge pages only to memory advised with `MADV_HUGEPAGE`
//! (`transparent_hugepage=madvise`). So large outputs are advised before their first write. The
//! advice changes paging only, never contents; where it fails or the OS has no such call, the
//! buffer is an ordinary vector.

use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Below this, huge pages cannot cover a whole 2 MiB page of the buffer often enough to matter.
const THRESHOLD: usize = 4 << 20;

/// Room for `n` output bytes, not yet initialized (length 0): [`chunks`] hands it out and
/// [`finish`] sets the length. Advised for huge pages when large (Linux).
///
/// Not zeroing up front matters: `calloc` of a reused heap block zeroes all of it on the calling
/// thread before any worker starts, while the quantizer overwrites every byte anyway. Each
/// worker zero-fills only its own chunk, right before writing it, so fresh pages also fault in
/// on the workers, in parallel.
pub(crate) fn uninit(n: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(n);
    if n >= THRESHOLD {
        advise_huge(v.as_mut_ptr() as usize, n);
    }
    v
}

/// One chunk of an output buffer: its bytes, or fresh room the holder initializes on first use.
pub(crate) enum Chunk<'a> {
    Init(&'a mut [u8]),
    Fresh(&'a mut [MaybeUninit<u8>], &'a AtomicUsize),
}

impl<'a> Chunk<'a> {
    /// The chunk's bytes; fresh room is zero-filled first and counted as initialized.
    pub(crate) fn bytes(self) -> &'a mut [u8] {
        match self {
            Chunk::Init(b) => b,
            Chunk::Fresh(b, done) => {
                b.fill(MaybeUninit::new(0));
                done.fetch_add(b.len(), Ordering::Relaxed);
                // SAFETY: every element of `b` was initialized on the line above, and an
                // initialized `MaybeUninit<u8>` has the size, alignment and validity of `u8`.
                unsafe { &mut *(std::ptr::from_mut(b) as *mut [u8]) }
            }
        }
    }
}

/// `v`'s first `n` bytes in chunks of `chunk`: the bytes themselves when `v` holds them (a
/// reused buffer), else the room [`uninit`] left, counted into `done` as chunks are used.
pub(crate) fn chunks<'a>(
    v: &'a mut Vec<u8>,
    n: usize,
    chunk: usize,
    done: &'a AtomicUsize,
) -> Vec<Chunk<'a>> {
    let chunk = chunk.max(1);
    if v.len() >= n {
        v[..n].chunks_mut(chunk).map(Chunk::Init).collect()
    } else {
        v.spare_capacity_mut()[..n]
            .chunks_mut(chunk)
            .map(|c| Chunk::Fresh(c, done))
            .collect()
    }
}

/// Gives `v` its length `n` once every byte of fresh room has been initialized through
/// [`Chunk::bytes`] (`done` counts them); a no-op for a reused buffer.
pub(crate) fn finish(v: &mut Vec<u8>, n: usize, done: &AtomicUsize) {
    if v.len() >= n {
        return;
    }
    // Workers are joined before this runs, so their counts are all in.
    assert_eq!(
        done.load(Ordering::Acquire),
        n,
        "quantizer left output bytes uninitialized"
    );
    // SAFETY: the capacity is at least `n` (`uninit`), and all `n` bytes were initialized:
    // `done` counts exactly the bytes `Chunk::bytes` zero-filled, over disjoint chunks of 0..n.
    unsafe { v.set_len(n) };
}

/// Advises the whole 2 MiB pages inside the `len` bytes at `base` (memory this module just
/// allocated) for transparent huge pages.
#[cfg(target_os = "linux")]
fn advise_huge(base: usize, len: usize) {
    const HUGE: usize = 2 << 20;
    const MADV_HUGEPAGE: core::ffi::c_int = 14;
    unsafe extern "C" {
        fn madvise(
            addr: *mut core::ffi::c_void,
            len: usize,
            advice: core::ffi::c_int,
        ) -> core::ffi::c_int;
    }
    let start = base.next_multiple_of(HUGE);
    let end = (base + len) / HUGE * HUGE;
    if end > start {
        // SAFETY: `start..end` is a page-aligned range inside an allocation this module owns
        // (the callers pass a buffer they just allocated); MADV_HUGEPAGE changes how the range
        // is paged, not its contents or validity. A failure (old kernel, THP disabled) is
        // harmless and ignored.
        let _ = unsafe { madvise(start as *mut core::ffi::c_void, end - start, MADV_HUGEPAGE) };
    }
}

#[cfg(not(target_os = "linux"))]
fn advise_huge(_: usize, _: usize) {}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    /// Fresh room becomes a buffer of length `n` only when every chunk was used, and reads as
    /// what was written; a reused buffer hands out its own bytes.
    #[test]
    fn fresh_chunks_fill_the_buffer() {
        for n in [0, 1, 100, super::THRESHOLD + 7] {
            let mut v = super::uninit(n);
            let done = AtomicUsize::new(0);
            for (i, c) in super::chunks(&mut v, n, 4096, &done)
                .into_iter()
                .enumerate()
            {
                c.bytes().fill((i % 251) as u8 + 1);
            }
            super::finish(&mut v, n, &done);
            assert_eq!(v.len(), n);
            assert!(
                v.iter()
                    .enumerate()
                    .all(|(j, &b)| b == (j / 4096 % 251) as u8 + 1)
            );
            let again = AtomicUsize::new(0);
            let chunks = super::chunks(&mut v, n, 4096, &again);
            assert!(chunks.iter().all(|c| matches!(c, super::Chunk::Init(_))));
        }
    }

    #[test]
    #[should_panic(expected = "left output bytes uninitialized")]
    fn unused_fresh_chunks_are_refused() {
        let mut v = super::uninit(10_000);
        let done = AtomicUsize::new(0);
        let mut chunks = super::chunks(&mut v, 10_000, 4096, &done);
        chunks.pop();
        chunks.into_iter().for_each(|c| c.bytes().fill(1));
        super::finish(&mut v, 10_000, &done);
    }
}
