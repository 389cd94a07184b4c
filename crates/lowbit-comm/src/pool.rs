//! Recycled host buffers for input snapshots and shared results.
//!
//! Every launch copies its inputs to host memory that the other rank threads can read. Fresh
//! allocations of that size come straight from the kernel and page-fault on first touch, which
//! costs more than the copy itself; recycling the buffers of finished collectives avoids that.
//! The device API reads only into new vectors, so snapshots are read in small pieces (served from
//! the allocator's free lists, still in cache) and appended to a recycled buffer.

use std::sync::{Mutex, PoisonError};

use lowbit_device::{Device, DeviceError, View};

/// Bytes read per `read_bytes` call when snapshotting: small enough for the allocator to reuse
/// the same chunk and for it to stay in cache.
const PIECE_BYTES: usize = 32 << 10;

pub(crate) struct Pool {
    /// Most bytes of capacity kept.
    cap: usize,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    bufs: Vec<Vec<u8>>,
    bytes: usize,
}

impl Pool {
    pub(crate) fn new(cap: usize) -> Pool {
        Pool {
            cap,
            inner: Mutex::new(Inner::default()),
        }
    }

    /// An empty vector with capacity for at least `len` bytes: the smallest pooled one that fits
    /// without wasting more than half of itself (so a small snapshot does not pin a large
    /// buffer), else a new one.
    pub(crate) fn take(&self, len: usize) -> Vec<u8> {
        let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let best = inner
            .bufs
            .iter()
            .enumerate()
            .filter(|(_, b)| {
                b.capacity() >= len && b.capacity() <= len.saturating_mul(2).max(PIECE_BYTES)
            })
            .min_by_key(|(_, b)| b.capacity())
            .map(|(i, _)| i);
        match best {
            Some(i) => {
                let mut buf = inner.bufs.swap_remove(i);
                inner.bytes -= buf.capacity();
                buf.clear();
                buf
            }
            None => Vec::with_capacity(len),
        }
    }

    /// Keeps `buf` for reuse, evicting the oldest buffers beyond the capacity limit.
    pub(crate) fn give(&self, buf: Vec<u8>) {
        if buf.capacity() == 0 || buf.capacity() > self.cap {
            return;
        }
        let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        inner.bytes += buf.capacity();
        inner.bufs.push(buf);
        while inner.bytes > self.cap {
            let old = inner.bufs.remove(0);
            inner.bytes -= old.capacity();
        }
    }

    /// A copy of `view`'s bytes in a recycled buffer.
    pub(crate) fn snapshot(&self, dev: &Device, view: View) -> Result<Vec<u8>, DeviceError> {
        if view.is_empty() {
            dev.read_bytes(view)?; // validates the view
            return Ok(Vec::new());
        }
        let mut buf = self.take(view.byte_len());
        let per = (PIECE_BYTES / view.dtype().size()).max(1);
        let mut at = 0;
        while at < view.len() {
            let end = (at + per).min(view.len());
            buf.extend_from_slice(&dev.read_bytes(view.slice(at..end)?)?);
            at = end;
        }
        Ok(buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reuses_the_smallest_fit_and_respects_the_cap() {
        let pool = Pool::new(100);
        pool.give(Vec::with_capacity(40));
        pool.give(Vec::with_capacity(60));
        assert!(pool.take(50).capacity() >= 60);
        assert!(pool.take(10).capacity() >= 40);
        let big = Pool::new(1 << 30);
        big.give(Vec::with_capacity(1 << 20));
        assert_eq!(
            big.take(1000).capacity(),
            1000,
            "a 1 MiB buffer is not used for 1000 bytes"
        );
        assert_eq!(big.take(600 << 10).capacity(), 1 << 20);
        pool.give(Vec::with_capacity(70));
        pool.give(Vec::with_capacity(70)); // evicts the first
        assert_eq!(pool.inner.lock().unwrap().bytes, 70);
        pool.give(Vec::with_capacity(200)); // larger than the cap: dropped
        assert_eq!(pool.inner.lock().unwrap().bufs.len(), 1);
    }

    #[test]
    fn snapshots_in_pieces() {
        let mut dev = Device::cpu();
        let v = dev.alloc(lowbit_device::DType::F32, 20_000);
        let vals: Vec<f32> = (0..20_000).map(|i| i as f32).collect();
        dev.upload(v, &vals).unwrap();
        let pool = Pool::new(1 << 20);
        let snap = pool.snapshot(&dev, v.slice(3..19_999).unwrap()).unwrap();
        assert_eq!(snap, dev.read_bytes(v.slice(3..19_999).unwrap()).unwrap());
    }
}
