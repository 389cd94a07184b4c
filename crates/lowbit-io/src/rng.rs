//! SplitMix64 (Steele, Lea and Flood, "Fast splittable pseudorandom number generators",
//! OOPSLA 2014; the `splitmix64.c` reference of Vigna): the deterministic generator behind the
//! reference model's initial values and data, the demo file, benchmark inputs and test data.
//! Its streams are part of what tests pin (checksums of trained weights), so its bits never
//! change.

/// The golden-ratio increment of splitmix64, also a common seed scrambler.
pub const GOLDEN_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// splitmix64's output for the state before `x`: the finalizer of `x + GOLDEN_GAMMA`. Called
/// on a counter it is a stream; called on a hash of small integers it is a seed mixer.
pub fn splitmix64(x: u64) -> u64 {
    let x = x.wrapping_add(GOLDEN_GAMMA);
    let x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    let x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// A SplitMix64 generator; the field is its state (the seed, before any output).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    /// The next 64 random bits (the state advances by [`GOLDEN_GAMMA`]).
    pub fn next_u64(&mut self) -> u64 {
        let out = splitmix64(self.0);
        self.0 = self.0.wrapping_add(GOLDEN_GAMMA);
        out
    }

    /// The generator after `draws` more outputs, in O(1): the state only ever moves by
    /// [`GOLDEN_GAMMA`], so a stream can be cut into pieces generated in parallel.
    #[must_use]
    pub fn advanced(self, draws: u64) -> SplitMix64 {
        SplitMix64(self.0.wrapping_add(draws.wrapping_mul(GOLDEN_GAMMA)))
    }

    /// Uniform in `[0, 1)` from the top 24 bits (exact: every such value is an f32).
    pub fn unit_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Uniform in `[-1, 1)`: [`SplitMix64::unit_f32`] scaled.
    pub fn uniform(&mut self) -> f32 {
        self.unit_f32() * 2.0 - 1.0
    }

    /// Uniform in `(0, 1]` from the top 53 bits: never 0, so its logarithm is finite.
    pub fn unit_open_f64(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advanced_is_that_many_draws() {
        let mut g = SplitMix64(0x1234_5678_9ABC_DEF0);
        let start = g;
        for n in 0..1000u64 {
            assert_eq!(start.advanced(n), g, "after {n} draws");
            g.next_u64();
        }
        assert_eq!(
            g.advanced(u64::MAX).advanced(1),
            g,
            "the state wraps modulo 2^64"
        );
    }

    #[test]
    fn splitmix64_matches_the_reference_stream() {
        // The first outputs of the reference splitmix64 seeded with 0 (state += gamma, then mix).
        assert_eq!(splitmix64(0), 0xE220_A839_7B1D_CDAF);
        assert_eq!(splitmix64(GOLDEN_GAMMA), 0x6E78_9E6A_A1B9_65F4);
        let mut g = SplitMix64(0);
        assert_eq!(g.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(g.next_u64(), 0x6E78_9E6A_A1B9_65F4);
        assert_eq!(g.0, GOLDEN_GAMMA.wrapping_mul(2));
    }

    #[test]
    fn floats_come_from_the_top_bits() {
        let mut a = SplitMix64(7);
        let mut b = a;
        let x = a.next_u64();
        assert_eq!(b.unit_f32(), (x >> 40) as f32 / (1u64 << 24) as f32);
        let mut c = SplitMix64(7);
        assert_eq!(
            c.uniform(),
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        );
        let mut d = SplitMix64(7);
        assert_eq!(
            d.unit_open_f64(),
            ((x >> 11) + 1) as f64 / (1u64 << 53) as f64
        );
    }
}
