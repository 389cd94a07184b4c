//! Counter-based random bits for stochastic rounding: Philox4x32-10 (Salmon et al., SC'11), the
//! generator TE and cuRAND use.
//!
//! Counter-based means the bits for an element are a pure function of (seed, stream, element
//! index), so results do not depend on thread count or visiting order, and a GPU kernel can draw
//! the same bits without sharing state.

const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

/// Philox4x32 with 10 rounds: four 32-bit outputs for a 128-bit counter and a 64-bit key.
#[inline]
pub fn philox4x32_10(ctr: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let (mut c, mut k) = (ctr, key);
    for round in 0..10 {
        if round > 0 {
            k = [k[0].wrapping_add(W0), k[1].wrapping_add(W1)];
        }
        let p0 = u64::from(M0) * u64::from(c[0]);
        let p1 = u64::from(M1) * u64::from(c[2]);
        c = [
            (p1 >> 32) as u32 ^ c[1] ^ k[0],
            p1 as u32,
            (p0 >> 32) as u32 ^ c[3] ^ k[1],
            p0 as u32,
        ];
    }
    c
}

/// Random bytes addressed by element index: element `i` of stream `stream` gets byte `i % 4` of
/// 32-bit word `i / 4` (one word per four elements, as TE's kernels draw them), words coming from
/// Philox with counter `[i / 16 (low), i / 16 (high), stream, 0]` and the seed as key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RandomBytes {
    key: [u32; 2],
    stream: u32,
}

impl RandomBytes {
    /// A generator for `seed` and `stream` (distinct streams give independent bits).
    pub fn new(seed: u64, stream: u32) -> Self {
        RandomBytes {
            key: [seed as u32, (seed >> 32) as u32],
            stream,
        }
    }

    /// The 16 random bytes of elements `16·g .. 16·g + 16`.
    #[inline]
    pub fn group(&self, g: u64) -> [u8; 16] {
        let w = philox4x32_10([g as u32, (g >> 32) as u32, self.stream, 0], self.key);
        let mut out = [0u8; 16];
        for (o, w) in out.chunks_exact_mut(4).zip(w) {
            o.copy_from_slice(&w.to_le_bytes());
        }
        out
    }

    /// The random bytes of elements `start .. start + out.len()`.
    pub fn fill(&self, start: u64, out: &mut [u8]) {
        let mut i = start;
        let mut rest = out;
        while !rest.is_empty() {
            let group = self.group(i / 16);
            let offset = (i % 16) as usize;
            let n = (16 - offset).min(rest.len());
            let (head, tail) = rest.split_at_mut(n);
            head.copy_from_slice(&group[offset..offset + n]);
            rest = tail;
            i += n as u64;
        }
    }

    /// The random byte of element `i`.
    pub fn byte(&self, i: u64) -> u8 {
        self.group(i / 16)[(i % 16) as usize]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Known-answer vectors of the Random123 distribution (`kat_vectors`, philox4x32_10).
    #[test]
    fn philox_known_answers() {
        assert_eq!(
            philox4x32_10([0; 4], [0; 2]),
            [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]
        );
        assert_eq!(
            philox4x32_10([u32::MAX; 4], [u32::MAX; 2]),
            [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd]
        );
        assert_eq!(
            philox4x32_10(
                [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344],
                [0xa409_3822, 0x299f_31d0]
            ),
            [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1]
        );
    }

    #[test]
    fn bytes_are_addressed_not_sequenced() {
        let r = RandomBytes::new(42, 1);
        let g = r.group(3);
        for k in 0..16 {
            assert_eq!(r.byte(48 + k), g[k as usize]);
        }
        assert_ne!(RandomBytes::new(42, 2).group(3), g);
        let mut run = [0u8; 37];
        r.fill(45, &mut run);
        for (k, b) in run.iter().enumerate() {
            assert_eq!(*b, r.byte(45 + k as u64));
        }
        assert_ne!(RandomBytes::new(43, 1).group(3), g);
    }
}
