//! FNV-1a, 64 bits (Fowler, Noll and Vo; offset basis 0xcbf29ce484222325, prime 0x100000001b3,
//! as in draft-eastlake-fnv): the hash of checkpoint pieces and manifests. It detects torn
//! writes and bit rot, not tampering. Its value is part of the checkpoint format: it never
//! changes, or old manifests stop verifying.

/// The offset basis: the hash of no bytes.
pub const FNV_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
/// The multiplier of each step.
pub const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// FNV-1a 64 of `bytes`.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    fnv1a64_continue(FNV_BASIS, bytes)
}

/// FNV-1a 64 of `bytes` continued from `h`, the hash of what came before them: hashing a
/// whole in pieces, each continued from the last, gives the hash of the whole.
pub fn fnv1a64_continue(h: u64, bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .fold(h, |h, &b| (h ^ u64::from(b)).wrapping_mul(FNV_PRIME))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_published_vectors() {
        // draft-eastlake-fnv, FNV-1a 64 test vectors.
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64(b"foobar"), 0x8594_4171_f739_67e8);
        let (a, b) = b"foobar".split_at(2);
        assert_eq!(fnv1a64_continue(fnv1a64(a), b), fnv1a64(b"foobar"));
    }
}
