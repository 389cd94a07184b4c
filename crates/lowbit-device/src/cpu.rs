//! The CPU backend's storage: one byte vector per allocation, addressed by generation-checked ids.
//! Elements are read and written little-endian through byte slices, so no alignment (and no
//! `unsafe`) is involved.
//!
//! [`CpuDevice::split`] is the one way ops get at several views at once: it validates every view
//! (live buffer of this device, in bounds), enforces the overlap rule (outputs pairwise disjoint
//! and disjoint from every input; inputs may overlap each other) and then carves the buffers into
//! one `&mut` slice per output and shared slices for the inputs, with `split_at_mut` only.

use crate::slots::{Slot, Slots, check_bounds};
use crate::{BufferId, DType, DeviceError, Result, View};

/// The overlap rule of an op's views: outputs pairwise disjoint and disjoint from every input.
pub(crate) fn check_overlap(what: &'static str, ins: &[View], outs: &[View]) -> Result<()> {
    for (i, o) in outs.iter().enumerate() {
        if outs[i + 1..].iter().chain(ins).any(|v| o.overlaps(v)) {
            return Err(DeviceError::Overlap(what));
        }
    }
    Ok(())
}

/// Bytes per thread of a parallel copy at least (smaller copies do not pay for the threads).
const COPY_BYTES_PER_THREAD: usize = 8 << 20;

/// `dst.copy_from_slice(src)`, split over the cores when large: a copy into freshly allocated
/// memory (a snapshot of optimizer state) is bound by page faults, which the cores take in
/// parallel. The same bytes either way.
pub(crate) fn copy_parallel(src: &[u8], dst: &mut [u8]) {
    in_parallel(src, dst, 1, |x, d| d.copy_from_slice(x));
}

/// `f(src, dst)` over matching parts (`dst` has `per` elements per element of `src`), split
/// over the cores when `dst` is large ([`copy_parallel`]'s reason); the calling thread does the
/// first part itself.
pub(crate) fn in_parallel<T: Sync, U: Send>(
    src: &[T],
    dst: &mut [U],
    per: usize,
    f: impl Fn(&[T], &mut [U]) + Sync,
) {
    let threads = std::thread::available_parallelism()
        .map_or(1, usize::from)
        .min(std::mem::size_of_val(dst) / COPY_BYTES_PER_THREAD);
    if threads < 2 {
        return f(src, dst);
    }
    let chunk = src.len().div_ceil(threads);
    let mut parts = src.chunks(chunk).zip(dst.chunks_mut(chunk * per));
    let first = parts.next();
    let f = &f;
    std::thread::scope(|s| {
        parts.for_each(|(x, d)| drop(s.spawn(move || f(x, d))));
        if let Some((x, d)) = first {
            f(x, d);
        }
    });
}

#[derive(Debug)]
pub(crate) struct CpuDevice {
    /// One byte vector per live buffer.
    slots: Slots<Vec<u8>>,
}

/// The validated bytes of an op's views: shared input slices and exclusive output slices, in the
/// order the views were given.
pub(crate) type Split<'a> = (Vec<&'a [u8]>, Vec<&'a mut [u8]>);

impl CpuDevice {
    pub(crate) fn new() -> Self {
        CpuDevice {
            slots: Slots::new(),
        }
    }

    pub(crate) fn alloc(&mut self, bytes: usize) -> BufferId {
        self.slots
            .insert(vec![0u8; bytes])
            .expect("fewer than 2^32 allocations")
    }

    pub(crate) fn free(&mut self, id: BufferId) -> Result<()> {
        self.slots.remove(id)
    }

    pub(crate) fn allocated_bytes(&self) -> usize {
        self.slots.values().map(Vec::len).sum()
    }

    /// The bytes of `v`.
    pub(crate) fn bytes(&self, v: View) -> Result<&[u8]> {
        let data = self.slots.get(v.buffer())?;
        check_bounds(v, data.len())?;
        Ok(&data[v.byte_range()])
    }

    /// The bytes of `v`, mutably.
    pub(crate) fn bytes_mut(&mut self, v: View) -> Result<&mut [u8]> {
        let data = self.slots.get_mut(v.buffer())?;
        check_bounds(v, data.len())?;
        Ok(&mut data[v.byte_range()])
    }

    /// Copies the bytes of `src` over those of `dst` (same byte length; memmove semantics).
    pub(crate) fn copy_within(&mut self, src: View, dst: View) -> Result<()> {
        self.bytes(src)?;
        self.bytes(dst)?;
        if src.buffer() == dst.buffer() {
            let data = self.slots.get_mut(src.buffer())?;
            data.copy_within(src.byte_range(), dst.byte_offset());
        } else {
            let [s, d] = self
                .slots
                .slots_mut()
                .get_disjoint_mut([src.buffer().index as usize, dst.buffer().index as usize])
                .map_err(|_| DeviceError::Freed(src.buffer().index))?;
            let (s, d) = (s.data.as_ref(), d.data.as_mut());
            let (Some(s), Some(d)) = (s, d) else {
                return Err(DeviceError::Freed(src.buffer().index));
            };
            d[dst.byte_range()].copy_from_slice(&s[src.byte_range()]);
        }
        Ok(())
    }

    /// Reads the float elements of `v` as f32 (f32, bf16, f16 exactly).
    pub(crate) fn read_f32(&self, v: View) -> Result<Vec<f32>> {
        crate::check_float("read", v)?;
        Ok(decode_f32(v.dtype(), self.bytes(v)?))
    }

    /// Writes f32 values into the float view `v`, rounding to its dtype (RNE).
    pub(crate) fn write_f32(&mut self, v: View, vals: &[f32]) -> Result<()> {
        crate::check_float("write", v)?;
        crate::check_len("write", v.len(), vals.len())?;
        encode_f32(v.dtype(), vals, self.bytes_mut(v)?);
        Ok(())
    }

    /// Checks every view of an op before anything is written: each is a live buffer of this
    /// device and in bounds; outputs are pairwise disjoint and disjoint from every input.
    pub(crate) fn check_views(&self, op: &'static str, ins: &[View], outs: &[View]) -> Result<()> {
        for v in ins.iter().chain(outs) {
            self.bytes(*v)?;
        }
        check_overlap(op, ins, outs)
    }

    /// Simultaneous access to an op's views after [`CpuDevice::check_views`]: a shared slice per
    /// input and an exclusive slice per output, in the order given.
    ///
    /// Each buffer involved is cut at its outputs' boundaries; the gaps between outputs become
    /// shared slices, and every input (which overlaps no output) lies inside one gap.
    pub(crate) fn split(
        &mut self,
        what: &'static str,
        ins: &[View],
        outs: &[View],
    ) -> Result<Split<'_>> {
        self.check_views(what, ins, outs)?;
        let mut in_slices: Vec<&[u8]> = vec![&[]; ins.len()];
        let mut out_slices: Vec<&mut [u8]> = outs.iter().map(|_| Default::default()).collect();
        let mut buffers: Vec<u32> = ins
            .iter()
            .chain(outs)
            .filter(|v| !v.is_empty())
            .map(|v| v.buffer().index)
            .collect();
        buffers.sort_unstable();
        buffers.dedup();
        let mut rest: &mut [Slot<Vec<u8>>] = self.slots.slots_mut();
        let mut base = 0usize;
        for index in buffers {
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(index as usize + 1 - base);
            rest = tail;
            base = index as usize + 1;
            let Some(mut data) = head.last_mut().and_then(|s| s.data.as_deref_mut()) else {
                return Err(DeviceError::Freed(index));
            };
            let in_buffer = |v: &View| !v.is_empty() && v.buffer().index == index;
            let mut order: Vec<usize> = (0..outs.len()).filter(|&j| in_buffer(&outs[j])).collect();
            order.sort_unstable_by_key(|&j| outs[j].byte_offset());
            // (start byte, bytes) of the stretches between outputs.
            let mut gaps: Vec<(usize, &[u8])> = Vec::with_capacity(order.len() + 1);
            let mut pos = 0;
            for j in order {
                let r = outs[j].byte_range();
                let (gap, after) = std::mem::take(&mut data).split_at_mut(r.start - pos);
                let (out, after) = after.split_at_mut(r.len());
                gaps.push((pos, gap));
                out_slices[j] = out;
                data = after;
                pos = r.end;
            }
            gaps.push((pos, data));
            for (j, v) in ins.iter().enumerate().filter(|(_, v)| in_buffer(v)) {
                let r = v.byte_range();
                let (start, gap) = gaps
                    .iter()
                    .find(|(s, g)| *s <= r.start && r.end <= s + g.len())
                    .ok_or(DeviceError::Overlap(what))?;
                in_slices[j] = &gap[r.start - start..r.end - start];
            }
        }
        Ok((in_slices, out_slices))
    }
}

/// Decodes little-endian float bytes of `dtype` to f32.
pub(crate) fn decode_f32(dtype: DType, bytes: &[u8]) -> Vec<f32> {
    let mut out = vec![0f32; bytes.len() / dtype.size()];
    decode_into(dtype, bytes, &mut out);
    out
}

/// Decodes little-endian float bytes of `dtype` into `out` (exact; `out.len()` elements).
#[inline]
pub fn decode_into(dtype: DType, bytes: &[u8], out: &mut [f32]) {
    // `as_chunks` yields fixed-size arrays, which the compiler turns into plain (vector) loads.
    match dtype {
        DType::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.as_chunks::<4>().0) {
                *o = f32::from_le_bytes(*c);
            }
        }
        DType::Bf16 => {
            for (o, c) in out.iter_mut().zip(bytes.as_chunks::<2>().0) {
                *o = f32::from_bits(u32::from(u16::from_le_bytes(*c)) << 16);
            }
        }
        DType::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.as_chunks::<2>().0) {
                *o = half::f16::from_bits(u16::from_le_bytes(*c)).to_f32();
            }
        }
        DType::U8 => {
            for (o, b) in out.iter_mut().zip(bytes) {
                *o = f32::from(*b);
            }
        }
    }
}

/// Encodes f32 values as little-endian `dtype` bytes with round-to-nearest-even (bf16 and f16
/// exactly as `half`'s `from_f32`). `dtype` must be a float dtype: callers check.
#[inline]
pub fn encode_f32(dtype: DType, vals: &[f32], out: &mut [u8]) {
    match dtype {
        DType::F32 => {
            for (o, v) in out.as_chunks_mut::<4>().0.iter_mut().zip(vals) {
                *o = v.to_le_bytes();
            }
        }
        DType::Bf16 => {
            for (o, v) in out.as_chunks_mut::<2>().0.iter_mut().zip(vals) {
                *o = bf16_bits(*v).to_le_bytes();
            }
        }
        DType::F16 => {
            for (o, v) in out.as_chunks_mut::<2>().0.iter_mut().zip(vals) {
                *o = half::f16::from_f32(*v).to_bits().to_le_bytes();
            }
        }
        DType::U8 => unreachable!("callers check for float dtypes"),
    }
}

/// `half::bf16::from_f32(v).to_bits()` without branches, so that loops over it vectorise:
/// round to nearest even by adding `0x7FFF` plus the result's lowest bit (carries are exactly
/// the round-up cases, overflow goes to ±Inf), and NaN keeps its top mantissa bits with the
/// quiet bit set, as `half` does.
#[inline(always)]
pub(crate) fn bf16_bits(v: f32) -> u16 {
    let x = v.to_bits();
    // Wrapping: only negative NaNs can carry out, and their lane is discarded below.
    let rounded = x.wrapping_add(0x7FFF + ((x >> 16) & 1)) >> 16;
    let nan = (x >> 16) | 0x40;
    (if x & 0x7FFF_FFFF > 0x7F80_0000 {
        nan
    } else {
        rounded
    }) as u16
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A device with two u8 buffers whose every byte holds its own index (mod 256) plus a
    /// per-buffer offset, so a slice's contents identify where it came from.
    fn device() -> (CpuDevice, [View; 2]) {
        let mut c = CpuDevice::new();
        let views = [0u8, 100].map(|tag| {
            let buffer = c.alloc(64);
            let v = View {
                buffer,
                offset: 0,
                len: 64,
                dtype: DType::U8,
            };
            for (i, b) in c.bytes_mut(v).unwrap().iter_mut().enumerate() {
                *b = tag.wrapping_add(i as u8);
            }
            v
        });
        (c, views)
    }

    fn expected(v: &View) -> Vec<u8> {
        let tag = if v.buffer.index == 0 { 0u8 } else { 100 };
        v.byte_range().map(|i| tag.wrapping_add(i as u8)).collect()
    }

    proptest! {
        /// `split` hands out exactly each view's bytes, or refuses exactly when an output
        /// overlaps another output or an input.
        #[test]
        fn split_returns_each_views_bytes(
            specs in proptest::collection::vec((0usize..2, 0usize..64, 0usize..16, any::<bool>()), 1..7)
        ) {
            let (mut c, bufs) = device();
            let mut ins = Vec::new();
            let mut outs = Vec::new();
            for (b, start, len, is_out) in specs {
                let len = len.min(64 - start);
                let v = bufs[b].slice(start..start + len).unwrap();
                if is_out { outs.push(v) } else { ins.push(v) }
            }
            let clash = outs.iter().enumerate().any(|(i, o)| {
                outs[i + 1..].iter().chain(&ins).any(|v| o.overlaps(v))
            });
            match c.split("test", &ins, &outs) {
                Err(e) => {
                    prop_assert!(clash);
                    prop_assert_eq!(e, DeviceError::Overlap("test"));
                }
                Ok((i, o)) => {
                    prop_assert!(!clash);
                    for (s, v) in i.iter().zip(&ins) {
                        prop_assert_eq!(s.to_vec(), expected(v));
                    }
                    for (s, v) in o.iter().zip(&outs) {
                        prop_assert_eq!(s.to_vec(), expected(v));
                    }
                }
            }
        }
    }

    #[test]
    fn bf16_bits_is_halfs_rne() {
        // Every exponent and sign with mantissas around the rounding boundaries, plus a strided
        // sweep of all patterns.
        let low = [
            0u32, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x1_0000, 0x1_7FFF, 0x1_8000,
        ];
        let mut checked = 0u64;
        for hi in 0..=0x1FFu32 {
            for mid in [0u32, 1, 0x3F, 0x40, 0x7E, 0x7F] {
                for lo in low {
                    let x = (hi << 23) | (mid << 16) | lo;
                    assert_eq!(
                        bf16_bits(f32::from_bits(x)),
                        half::bf16::from_f32(f32::from_bits(x)).to_bits(),
                        "{x:#x}"
                    );
                    checked += 1;
                }
            }
        }
        for x in (0..=u32::MAX).step_by(65_521) {
            assert_eq!(
                bf16_bits(f32::from_bits(x)),
                half::bf16::from_f32(f32::from_bits(x)).to_bits(),
                "{x:#x}"
            );
            checked += 1;
        }
        assert!(checked > 90_000);
    }

    #[test]
    fn split_checks_liveness_and_device() {
        let (mut c, [a, b]) = device();
        c.free(b.buffer).unwrap();
        assert_eq!(c.split("t", &[a], &[b]).unwrap_err(), DeviceError::Freed(1));
        let other = CpuDevice::new();
        assert!(other.bytes(a).is_err());
    }

    /// Copies and uploads large enough to be split over the cores give the same bytes as one
    /// pass (odd lengths: the last part is shorter).
    #[test]
    fn parallel_copies_are_the_plain_copies() {
        use crate::HostElem;
        let n = 3 * COPY_BYTES_PER_THREAD / 4 + 3;
        let src: Vec<f32> = (0..n).map(|i| i as f32 * 0.37 - 5.0).collect();
        let mut bytes = vec![0u8; 4 * n];
        in_parallel(&src, &mut bytes, 4, f32::encode_into);
        assert_eq!(bytes, f32::to_bytes(&src));
        let mut copy = vec![0u8; bytes.len()];
        copy_parallel(&bytes, &mut copy);
        assert_eq!(copy, bytes);
    }
}
