//! Deterministic pseudo-random streams for test inputs and benchmark data: no state outside the
//! caller's, the same values on every machine and run.
//!
//! Each test or benchmark keeps its own seed scrambling (so its inputs stay what they were).
//! SplitMix64 is `lowbit_io`'s (re-exported here with its reference-stream test there); the
//! xorshift generators and the conversion of bits to floats are here once.

pub use lowbit_io::rng::{GOLDEN_GAMMA, SplitMix64, splitmix64};

/// The top 24 bits of `x` as an f32 in `[0, 1)` (exact: every such value is an f32).
pub fn unit24(x: u64) -> f32 {
    (x >> 40) as f32 / (1u64 << 24) as f32
}

/// Marsaglia's xorshift64 (shifts 13, 7, 17). The state is never zero.
#[derive(Clone, Debug)]
pub struct XorShift64(u64);

impl XorShift64 {
    /// A generator whose state is `seed · GOLDEN_GAMMA`, made odd (so never zero).
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(GOLDEN_GAMMA) | 1)
    }

    /// A generator whose state is `state` as given (a zero state stays zero).
    pub fn from_state(state: u64) -> Self {
        Self(state)
    }

    /// Advances the state and returns it.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// One step of Marsaglia's xorshift32 (shifts 13, 17, 5). A zero state stays zero: start from
/// an odd value.
pub fn xorshift32(x: u32) -> u32 {
    let x = x ^ (x << 13);
    let x = x ^ (x >> 17);
    x ^ (x << 5)
}

/// `n` values from the xorshift32 states after `state`: each state `s` gives
/// `s / u32::MAX · 2 − 1` (rounded in f32, about `[-1, 1]`) times `scale`.
pub fn xorshift32_signed(state: u32, n: usize, scale: f32) -> Vec<f32> {
    let mut s = state;
    (0..n)
        .map(|_| {
            s = xorshift32(s);
            (s as f32 / u32::MAX as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xorshift_states_follow_the_recurrences() {
        let mut r = XorShift64::new(0);
        let x = 1u64 ^ (1 << 13);
        let x = x ^ (x >> 7);
        assert_eq!(r.next_u64(), x ^ (x << 17));
        let x = 1u32 ^ (1 << 13);
        let x = x ^ (x >> 17);
        assert_eq!(xorshift32(1), x ^ (x << 5));
        assert_eq!(unit24(u64::MAX), 1.0 - 2f32.powi(-24));
        let v = xorshift32_signed(1, 100, 3.0);
        assert_eq!(
            v[0],
            (xorshift32(1) as f32 / u32::MAX as f32 * 2.0 - 1.0) * 3.0
        );
        assert!(v.iter().all(|v| v.abs() <= 3.0));
    }
}
