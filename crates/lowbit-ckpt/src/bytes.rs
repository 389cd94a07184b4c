//! The byte-level pieces that writing and reading checkpoint files share: f32 buffers seen as
//! their stored bytes (little-endian hosts), and FNV-1a over several slices at once.
//!
//! A leaf of the crate's modules: [`crate::write`] (files of one rank), [`crate::save`] (the
//! commit protocol above it), [`crate::read`] and [`crate::read_views`] all build on it, and it
//! imports none of them.

use std::sync::atomic::{AtomicUsize, Ordering};

use lowbit_io::hash::{FNV_BASIS, FNV_PRIME};

/// The memory of `values` as bytes: on a little-endian host, the values as stored.
pub(crate) fn raw_bytes(values: &[f32]) -> &[u8] {
    // SAFETY: `values` is a live, initialized `[f32]`; u8 has alignment 1 and no invalid bit
    // patterns, the length is the slice's size in bytes (it cannot overflow: the slice exists),
    // and the borrow ties the result to `values`.
    unsafe {
        std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), std::mem::size_of_val(values))
    }
}

/// The memory of `values` as writable bytes, so a read lands in the f32 buffer itself.
pub(crate) fn raw_bytes_mut(values: &mut [f32]) -> &mut [u8] {
    // SAFETY: as `raw_bytes`, with the exclusive borrow of `values` for the result's lifetime;
    // every bit pattern is a valid f32, so whatever bytes are written leave valid values.
    unsafe {
        std::slice::from_raw_parts_mut(
            values.as_mut_ptr().cast::<u8>(),
            std::mem::size_of_val(values),
        )
    }
}

/// Slices hashed side by side by one core.
pub(crate) const LANES: usize = 4;
/// Bytes hashed per lane between refills (bounds the dummy input of idle lanes).
const BLOCK: usize = 1 << 18;

/// One worker: keeps [`LANES`] slices in flight, taking the next from `next` when one ends;
/// idle lanes hash zeros into a state that is thrown away. Returns `(slice, hash)`. Slice `i`
/// is hashed on from the state `start(i)` ([`FNV_BASIS`] for a whole slice; a hash so far to
/// continue it).
pub(crate) fn hash_lanes(
    slices: &[&[u8]],
    next: &AtomicUsize,
    start: impl Fn(usize) -> u64,
) -> Vec<(usize, u64)> {
    let idle = vec![0u8; BLOCK];
    let mut lanes: [Option<(usize, &[u8], usize)>; LANES] = Default::default();
    let mut h = [FNV_BASIS; LANES];
    let mut done = Vec::new();
    loop {
        for (lane, state) in lanes.iter_mut().zip(&mut h) {
            while lane.is_none() {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(&bytes) = slices.get(i) else { break };
                if bytes.is_empty() {
                    done.push((i, start(i)));
                } else {
                    *lane = Some((i, bytes, 0));
                    *state = start(i);
                }
            }
        }
        let Some(step) = lanes
            .iter()
            .flatten()
            .map(|(_, b, at)| (b.len() - at).min(BLOCK))
            .min()
        else {
            return done;
        };
        let input: [&[u8]; LANES] = std::array::from_fn(|l| match &lanes[l] {
            Some((_, b, at)) => &b[*at..*at + step],
            None => &idle[..step],
        });
        for (((a, b), c), d) in input[0].iter().zip(input[1]).zip(input[2]).zip(input[3]) {
            for (state, byte) in h.iter_mut().zip([a, b, c, d]) {
                *state = (*state ^ u64::from(*byte)).wrapping_mul(FNV_PRIME);
            }
        }
        for (lane, state) in lanes.iter_mut().zip(&h) {
            if let Some((i, b, at)) = lane {
                *at += step;
                if *at == b.len() {
                    done.push((*i, *state));
                    *lane = None;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lowbit_io::hash::fnv1a64;

    /// A hash continued block by block from the state so far (what a load does) is the hash of
    /// the whole, in any lane arrangement.
    #[test]
    fn hashing_in_blocks_continues_the_hash() {
        let data: Vec<u8> = (0..100_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let whole = fnv1a64(&data);
        let (a, rest) = data.split_at(33_333);
        let (b, c) = rest.split_at(40_000);
        let mut h = FNV_BASIS;
        for block in [a, b, &[][..], c] {
            let blocks = [&data[..10], block, &data[5..]];
            let got = hash_lanes(&blocks, &AtomicUsize::new(0), |i| [7, h, 9][i]);
            h = got.iter().find(|x| x.0 == 1).map(|x| x.1).unwrap();
        }
        assert_eq!(h, whole);
    }
}
