//! The sharded 2D helpers (`mxfp8::sharded`, `nvfp4::sharded`) refuse ranges their tiles do not
//! cover, zero-column matrices, ranges past `usize` and tile slices of the wrong length with a
//! `FormatError`, never an out-of-bounds index, a division by zero or an overflow, and leave
//! their outputs untouched then.

use lowbit_formats::{FormatError, Fp8Kind, mxfp8, nvfp4};

/// `(start, len, cols, tiles)` cases every 2D helper must refuse: tiles one short of the range,
/// zero columns, a range past usize, a range beyond the tiles' rows.
fn bad_ranges(block: usize) -> Vec<(usize, usize, usize, usize)> {
    let h = usize::MAX;
    vec![
        (0, 2 * block * 2 * block, 2 * block, 3),
        (0, 8, 0, 4),
        (h - 3, 8, 8, 4),
        (4 * block * block, 8, block, 4),
    ]
}

fn is_refusal<T: std::fmt::Debug>(r: Result<T, FormatError>, what: &str) {
    assert!(
        matches!(r, Err(FormatError::Unsupported { .. })),
        "{what}: {r:?}"
    );
}

#[test]
fn mxfp8_sharded_helpers_refuse_bad_ranges() {
    use mxfp8::sharded::{fold_tile_amax_2d, quantize_2d_range, scales_2d, tile_count};
    for (start, len, cols, n) in bad_ranges(32) {
        let values = vec![1.0f32; len];
        let mut tiles = vec![0.5f32; n];
        let what = format!("start {start}, {len} values, {cols} columns, {n} tiles");
        is_refusal(fold_tile_amax_2d(&values, start, cols, &mut tiles), &what);
        assert!(tiles.iter().all(|&t| t == 0.5), "{what}: tiles written");
        let mut out = vec![7u8; len];
        is_refusal(
            quantize_2d_range(&values, start, cols, Fp8Kind::E4M3, &tiles, &mut out),
            &what,
        );
        assert!(out.iter().all(|&b| b == 7), "{what}: codes written");
    }
    // Scales: a tile slice of the wrong length, a shape past usize.
    is_refusal(
        scales_2d(64, 64, Fp8Kind::E4M3, &[0.5; 3]),
        "3 tiles for 64x64",
    );
    is_refusal(
        scales_2d(usize::MAX, usize::MAX, Fp8Kind::E4M3, &[0.5; 4]),
        "a shape past usize",
    );
    let (r, c) = scales_2d(64, 64, Fp8Kind::E4M3, &[0.5; 4]).unwrap();
    assert_eq!((r.len(), c.len()), (64 * 2, 2 * 64));
    assert_eq!(tile_count(64, 64), 4);
}

#[test]
fn nvfp4_sharded_helpers_refuse_bad_ranges() {
    use nvfp4::sharded::{fold_tile_amax_2d, quantize_2d_range};
    for (start, len, cols, n) in bad_ranges(16) {
        let values = vec![1.0f32; len];
        let mut tiles = vec![0.5f32; n];
        let what = format!("start {start}, {len} values, {cols} columns, {n} tiles");
        is_refusal(fold_tile_amax_2d(&values, start, cols, &mut tiles), &what);
        assert!(tiles.iter().all(|&t| t == 0.5), "{what}: tiles written");
        let mut out = vec![7u8; len / 2];
        // An odd start is refused for its own reason; the cases here start even.
        is_refusal(
            quantize_2d_range(&values, start & !1, cols, &tiles, &mut out),
            &what,
        );
        assert!(out.iter().all(|&b| b == 7), "{what}: codes written");
    }
}
