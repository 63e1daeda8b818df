//! Storage formats worked by hand (OCP MX v1.0 MXFP4, per-row int8) and round-trip properties.

mod common;

use deltafin_kernels::{int8, mxfp4};
use rand::Rng;

fn decode(packed: &[u8], scales: &[u8], cols: usize) -> Vec<f32> {
    let mut out = vec![0.0; cols];
    mxfp4::dequantize(packed, scales, 1, cols, &mut out);
    out
}

#[test]
fn e8m0_scale_bytes() {
    assert_eq!(mxfp4::e8m0_to_f32(127), 1.0);
    assert_eq!(mxfp4::e8m0_to_f32(128), 2.0);
    assert_eq!(mxfp4::e8m0_to_f32(126), 0.5);
    assert_eq!(mxfp4::e8m0_to_f32(1), 2f32.powi(-126));
    assert_eq!(mxfp4::e8m0_to_f32(254), 2f32.powi(127));
    // s = 0 is 2^-127 (an f32 subnormal), not zero.
    let s0 = mxfp4::e8m0_to_f32(0);
    assert!(s0 > 0.0);
    assert_eq!(s0 as f64, 2f64.powi(-127));
    assert!(mxfp4::e8m0_to_f32(255).is_nan());
}

#[test]
fn e2m1_table_and_row_sizes() {
    let mags = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    for (n, m) in mags.iter().enumerate() {
        assert_eq!(mxfp4::E2M1_VALUES[n], *m);
        assert_eq!(mxfp4::E2M1_VALUES[n + 8], -*m);
    }
    assert!(mxfp4::E2M1_VALUES[8].is_sign_negative());
    for (cols, pb, sb) in [(0, 0, 0), (1, 16, 1), (32, 16, 1), (33, 32, 2), (2880, 1440, 90)] {
        assert_eq!(mxfp4::packed_row_bytes(cols), pb, "cols {cols}");
        assert_eq!(mxfp4::scale_row_bytes(cols), sb, "cols {cols}");
    }
    assert_eq!(mxfp4::BLOCK, 32);
}

#[test]
fn mxfp4_byte_0x2f_scale_128() {
    let mut packed = [0u8; 16];
    packed[0] = 0x2F;
    // Low nibble 0xF = -6, high nibble 0x2 = +1, times 2^(128-127).
    assert_eq!(decode(&packed, &[128], 2), vec![-12.0, 2.0]);
}

#[test]
fn mxfp4_nibble_order() {
    let mut packed = [0u8; 16];
    packed[3] = 0x71; // element 6 = code 1 (0.5), element 7 = code 7 (6.0)
    packed[15] = 0xA5; // element 30 = code 5 (3.0), element 31 = code 0xA (-1.0)
    let out = decode(&packed, &[127], 32);
    let mut want = vec![0.0; 32];
    want[6] = 0.5;
    want[7] = 6.0;
    want[30] = 3.0;
    want[31] = -1.0;
    assert_eq!(out, want);
    // The second block of a row uses the second scale byte.
    let mut packed2 = [0u8; 32];
    packed2[16] = 0x21;
    let out = decode(&packed2, &[127, 130], 34);
    assert_eq!(&out[32..], &[4.0, 8.0]);
}

#[test]
fn mxfp4_scale_zero_is_tiny_not_zero_and_255_is_nan() {
    let mut packed = [0u8; 16];
    packed[0] = 0x17; // 6.0, 0.5
    let out = decode(&packed, &[0], 2);
    assert_eq!(out[0] as f64, 6.0 * 2f64.powi(-127));
    assert_eq!(out[1] as f64, 2f64.powi(-128));
    assert!(out[0] > 0.0 && out[1] > 0.0);
    let out = decode(&packed, &[255], 2);
    assert!(out.iter().all(|v| v.is_nan()));
}

#[test]
fn mxfp4_quantize_block_by_hand() {
    // Block 0: amax 7 -> floor(log2 7) - 2 = 0 -> scale byte 127 (2^0).
    //   7.0 saturates to 6 (code 7); 5.0 ties 4|6 -> 4 (even code 6); 0.25 ties 0|0.5 -> 0;
    //   0.75 ties 0.5|1 -> 1 (code 2); -2.5 ties 2|3 -> -2 (code 0xC); 1.25 -> 1 (code 2);
    //   1.75 -> 2 (code 4); 3.5 -> 4 (code 6); -0.3 -> -0.5 (code 9); 1.0 -> code 2.
    // Block 1 (8 of 32 present): amax 0.75 -> floor(log2 0.75) - 2 = -3 -> byte 124 (1/8):
    //   0.75/0.125 = 6 (code 7); -0.0625/0.125 = -0.5 (code 9); 0.03125/0.125 = 0.25 -> 0.
    let mut w = vec![0.0f32; 40];
    w[..10].copy_from_slice(&[7.0, 5.0, 0.25, 0.75, -2.5, 1.25, 1.75, 3.5, -0.3, 1.0]);
    w[32..35].copy_from_slice(&[0.75, -0.0625, 0.03125]);
    let mut packed = vec![0xFFu8; 32];
    let mut scales = vec![0xFFu8; 2];
    mxfp4::quantize(&w, 1, 40, &mut packed, &mut scales);
    assert_eq!(scales, vec![127, 124]);
    let mut want = vec![0u8; 32];
    want[..5].copy_from_slice(&[0x67, 0x20, 0x2C, 0x64, 0x29]);
    want[16] = 0x97;
    assert_eq!(packed, want);
    let mut back = vec![0.0; 40];
    mxfp4::dequantize(&packed, &scales, 1, 40, &mut back);
    assert_eq!(&back[..10], &[6.0, 4.0, 0.0, 1.0, -2.0, 1.0, 2.0, 4.0, -0.5, 1.0]);
    assert_eq!(&back[32..35], &[0.75, -0.0625, 0.0]);
}

#[test]
fn mxfp4_quantize_special_blocks() {
    // All-zero (and negative-zero) block: scale byte 0, zero nibbles.
    let mut w = vec![0.0f32; 64];
    w[3] = -0.0;
    // Second block holds an infinity: NaN scale.
    w[40] = f32::INFINITY;
    let mut packed = vec![0xAAu8; 32];
    let mut scales = vec![7u8; 2];
    mxfp4::quantize(&w, 1, 64, &mut packed, &mut scales);
    assert_eq!(scales, vec![0, 255]);
    assert!(packed.iter().all(|&b| b == 0));
    // Huge and tiny amax clamp to the E8M0 range.
    let mut w = vec![0.0f32; 64];
    w[0] = f32::MAX;
    w[32] = 1e-45; // smallest subnormal
    mxfp4::quantize(&w, 1, 64, &mut packed, &mut scales);
    assert_eq!(scales, vec![127 + 125, 0]);
}

/// Nearest E2M1 magnitude by brute force, ties to the even code.
fn nearest_code(v: f32) -> u8 {
    let mut best = 0u8;
    for c in 1..8u8 {
        let (d, db) = (
            (v.abs() - mxfp4::E2M1_VALUES[c as usize]).abs(),
            (v.abs() - mxfp4::E2M1_VALUES[best as usize]).abs(),
        );
        if d < db || (d == db && c % 2 == 0) {
            best = c;
        }
    }
    if best != 0 && v < 0.0 {
        best | 8
    } else {
        best
    }
}

#[test]
fn mxfp4_round_trip_properties() {
    let mut rng = common::rng(7);
    for &(rows, cols) in &[(3, 32), (5, 77), (2, 1000)] {
        let w: Vec<f32> = (0..rows * cols)
            .map(|_| rng.random_range(-1.0f32..1.0) * 2f32.powi(rng.random_range(-20..20)))
            .collect();
        let (pb, sb) = (mxfp4::packed_row_bytes(cols), mxfp4::scale_row_bytes(cols));
        let mut packed = vec![0u8; rows * pb];
        let mut scales = vec![0u8; rows * sb];
        mxfp4::quantize(&w, rows, cols, &mut packed, &mut scales);
        let mut back = vec![0.0; rows * cols];
        mxfp4::dequantize(&packed, &scales, rows, cols, &mut back);
        for r in 0..rows {
            for c in 0..cols {
                let scale = mxfp4::e8m0_to_f32(scales[r * sb + c / 32]);
                let byte = packed[r * pb + c / 2];
                let code = if c % 2 == 0 { byte & 15 } else { byte >> 4 };
                let v = w[r * cols + c] / scale;
                assert!(v.abs() < 8.0, "scale too small at {r},{c}");
                assert_eq!(code, nearest_code(v), "value {v} at {r},{c}");
            }
        }
        // Idempotent: quantizing the decoded matrix gives the same bytes.
        let (mut p2, mut s2) = (vec![0u8; packed.len()], vec![0u8; scales.len()]);
        mxfp4::quantize(&back, rows, cols, &mut p2, &mut s2);
        assert_eq!((p2, s2), (packed, scales));
    }
}

#[test]
fn int8_rows_by_hand() {
    // Row 0: max 254 -> scale 2; 1/2 = 0.5 -> 1 and -3/2 = -1.5 -> -2 (half away from zero);
    //        0.5/2 = 0.25 -> 0; 254/2 = 127. Row 1: all zero -> scale 0, codes 0.
    let w = [1.0, -3.0, 0.5, 254.0, 0.0, -0.0, 0.0, 0.0];
    let mut q = [9i8; 8];
    let mut s = [9.0f32; 2];
    int8::quantize(&w, 2, 4, &mut q, &mut s);
    assert_eq!(s, [2.0, 0.0]);
    assert_eq!(q, [1, -2, 0, 127, 0, 0, 0, 0]);
    let mut back = [0.0f32; 8];
    int8::dequantize(&q, &s, 2, 4, &mut back);
    assert_eq!(back, [2.0, -4.0, 0.0, 254.0, 0.0, 0.0, 0.0, 0.0]);
}

#[test]
fn int8_round_trip_properties() {
    let mut rng = common::rng(8);
    let (rows, cols) = (7, 301);
    let w = common::random_vec(&mut rng, rows * cols);
    let mut q = vec![0i8; rows * cols];
    let mut s = vec![0.0f32; rows];
    int8::quantize(&w, rows, cols, &mut q, &mut s);
    let mut back = vec![0.0; rows * cols];
    int8::dequantize(&q, &s, rows, cols, &mut back);
    for r in 0..rows {
        let row = &q[r * cols..(r + 1) * cols];
        assert_eq!(row.iter().map(|v| v.unsigned_abs()).max(), Some(127));
        assert!(row.iter().all(|&v| v >= -127));
        for c in 0..cols {
            let err = (back[r * cols + c] - w[r * cols + c]).abs();
            assert!(err <= s[r] * 0.5001, "error {err} at {r},{c} scale {}", s[r]);
        }
    }
    let (mut q2, mut s2) = (vec![0i8; q.len()], vec![0.0; rows]);
    int8::quantize(&back, rows, cols, &mut q2, &mut s2);
    assert_eq!(q2, q);
}
