//! The 16-point random Hadamard transform (RHT) TE applies to NVFP4 columnwise copies (TE's
//! `transformer_engine/pytorch/tensor/nvfp4_tensor.py`: `get_wgrad_sign_vector`, `get_rht_matrix`;
//! the CUDA side in `transformer_engine/common/hadamard_transform/hadamard_transform.cu`).
//!
//! `A = diag(s) · H16 · 1/4`, with H16 the Sylvester Hadamard matrix (`H[i][j] = (−1)^popcount(i&j)`)
//! and `s` TE's fixed sign vector. A is orthogonal, so its inverse is its transpose. TE computes
//! `y = x · A` with fp32 accumulation and rounds `y` to bf16 before the amax and the cast; we
//! accumulate in fp32 in index order `i = 0..16` (every product `x_i · A[i][j]` is exact) and
//! round to bf16 with round-to-nearest-even. The CUDA backend uses the same order.

use half::bf16;

/// TE's RHT sign vector (`get_wgrad_sign_vector`).
pub const RHT_SIGNS: [f32; 16] = [
    1.0, 1.0, 1.0, -1.0, 1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, 1.0, -1.0, 1.0, -1.0, -1.0,
];

/// The sign vector as TE's 16-bit mask: bit i set when sign i is −1.
pub const RHT_SIGN_MASK: u16 = {
    let mut m = 0u16;
    let mut i = 0;
    while i < 16 {
        if RHT_SIGNS[i] < 0.0 {
            m |= 1 << i;
        }
        i += 1;
    }
    m
};

/// Entry `(i, j)` of `A = diag(s) · H16 / 4`.
#[inline]
pub fn rht_entry(i: usize, j: usize) -> f32 {
    let h = if (i & j).count_ones().is_multiple_of(2) {
        0.25
    } else {
        -0.25
    };
    RHT_SIGNS[i] * h
}

/// `y = bf16(x · A)`: the forward transform of 16 consecutive elements.
pub fn rht16(x: &[f32; 16]) -> [f32; 16] {
    std::array::from_fn(|j| {
        let acc = (0..16).fold(0.0f32, |acc, i| acc + x[i] * rht_entry(i, j));
        bf16::from_f32(acc).to_f32()
    })
}

/// `x = y · Aᵀ` in fp32 (no rounding to bf16): the inverse of [`rht16`] up to that rounding.
pub fn inverse_rht16(y: &[f32; 16]) -> [f32; 16] {
    std::array::from_fn(|i| (0..16).fold(0.0f32, |acc, j| acc + y[j] * rht_entry(i, j)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matrix_is_orthogonal_and_signed_by_rows() {
        for i in 0..16 {
            for k in 0..16 {
                let dot: f32 = (0..16).map(|j| rht_entry(i, j) * rht_entry(k, j)).sum();
                assert_eq!(dot, if i == k { 1.0 } else { 0.0 });
            }
        }
        // Row 0 of H/4 is all 0.25 and s_0 = +1 (TE's `get_rht_matrix`); row 3 carries s_3 = −1.
        assert!((0..16).all(|j| rht_entry(0, j) == 0.25));
        assert_eq!(rht_entry(3, 0), -0.25);
        assert_eq!(RHT_SIGN_MASK, 0b1101_0111_1110_1000);
    }

    #[test]
    fn transform_of_a_unit_vector_is_a_scaled_row() {
        let mut x = [0.0f32; 16];
        x[5] = 4.0;
        let y = rht16(&x);
        for (j, &v) in y.iter().enumerate() {
            assert_eq!(v, 4.0 * rht_entry(5, j));
        }
        assert_eq!(inverse_rht16(&y), x);
    }
}
