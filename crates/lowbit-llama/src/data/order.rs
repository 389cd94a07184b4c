//! The sample order: a deterministic permutation of a split's windows per epoch, so that a
//! run's position in its data is one number, the sample index.

use lowbit_io::SplitMix64;
use lowbit_io::rng::splitmix64;

use super::{DataError, Result};

/// Sample `i` (counted from 0 over the whole run) is window `perm_e[i mod n]` of epoch
/// `e = i / n`, where `n` is the number of windows and `perm_e` is the Fisher–Yates
/// (Durstenfeld) shuffle of `0..n` drawn from `SplitMix64(splitmix64(seed ^ splitmix64(e)))`:
/// for `i` from `n − 1` down to 1, swap `i` with `j = ⌊next_u64 · (i + 1) / 2^64⌋`
/// (Lemire's multiply-shift; its bias, below `n / 2^64`, is immaterial). The order depends on
/// `(seed, n, i)` only, so a checkpoint stores `i` and a resume continues exactly.
#[derive(Clone, Debug)]
pub struct SampleOrder {
    seed: u64,
    windows: u64,
    /// The epoch whose permutation `perm` holds.
    epoch: Option<u64>,
    perm: Vec<u32>,
}

impl SampleOrder {
    /// The order of `windows` windows under `seed`.
    ///
    /// # Errors
    /// [`DataError::Invalid`] for no windows (a split shorter than one window) or more than
    /// 2^32 (the permutation is held as u32).
    pub fn new(seed: u64, windows: u64) -> Result<SampleOrder> {
        if windows == 0 || windows > 1 << 32 {
            return Err(DataError::Invalid(format!(
                "a sample order needs 1 to 2^32 windows, got {windows} (is the split shorter \
                 than one window of seq + 1 tokens?)"
            )));
        }
        Ok(SampleOrder {
            seed,
            windows,
            epoch: None,
            perm: Vec::new(),
        })
    }

    /// The number of windows per epoch.
    pub fn windows(&self) -> u64 {
        self.windows
    }

    /// The epoch of sample `sample_index`.
    pub fn epoch_of(&self, sample_index: u64) -> u64 {
        sample_index / self.windows
    }

    /// The permutation of epoch `epoch` (window of each position).
    pub fn permutation(&self, epoch: u64) -> Vec<u32> {
        let n = self.windows as usize;
        // `windows ≤ 2^32`, so every index fits a u32 (the last is 2^32 − 1).
        let mut perm: Vec<u32> = (0..n).map(|i| i as u32).collect();
        let mut rng = SplitMix64(splitmix64(self.seed ^ splitmix64(epoch)));
        for i in (1..n).rev() {
            let j = ((u128::from(rng.next_u64()) * (i as u128 + 1)) >> 64) as usize;
            perm.swap(i, j);
        }
        perm
    }

    /// The window of sample `sample_index` (computing its epoch's permutation, O(windows), when
    /// the epoch changes).
    pub fn window_of(&mut self, sample_index: u64) -> u64 {
        let epoch = self.epoch_of(sample_index);
        if self.epoch != Some(epoch) {
            self.perm = self.permutation(epoch);
            self.epoch = Some(epoch);
        }
        u64::from(self.perm[(sample_index % self.windows) as usize])
    }
}
