//! OCP Microscaling Formats (MX) v1.0 MXFP4 in the Hugging Face byte layout
//! (gpt-oss `*_blocks`/`*_scales`, compressed-tensors `mxfp4-pack-quantized`).
//!
//! A row of `cols` values (the input dimension) is cut into blocks of [`BLOCK`] = 32 consecutive
//! values; a row whose length is not a multiple of 32 is padded with zeros to a whole block.
//! Each block stores:
//!
//! ```text
//! packed: 16 bytes, two E2M1 values per byte (MX v1.0 §5.3.3)
//!   byte i:  bit 7      6 5      4      | 3      2 1      0
//!            [sign  exponent  mantissa] | [sign  exponent  mantissa]
//!             element 2i+1 (high nibble)   element 2i (low nibble)
//! scales: 1 byte, E8M0 (MX v1.0 §5.4.1): value 2^(s-127); s = 0 is 2^-127 (not zero),
//!         s = 255 is NaN
//! ```
//!
//! Decoded element = `E2M1_VALUES[nibble] * e8m0_to_f32(scale)`, exact in f32 whenever the
//! product is in the f32 range. Example: byte `0x2F` with scale byte 128 decodes to
//! `[-12.0, +2.0]` (low nibble 0xF = -6, high nibble 0x2 = +1, both times 2).
//!
//! ggml's `block_mxfp4` pairs element j with j+16 in a byte: a different layout, never mixed here
//! (REFERENCES.md §2).

/// Elements per MX block (OCP MX v1.0 §5, block size k = 32).
pub const BLOCK: usize = 32;

/// Bytes of packed E2M1 data per block (two elements per byte).
pub const BLOCK_BYTES: usize = BLOCK / 2;

/// E2M1 values indexed by the 4-bit code: bit 3 sign, bits 2-1 exponent (bias 1), bit 0
/// mantissa; code 1 is the subnormal 0.5 (OCP MX v1.0 §5.3.3, table "FP4 E2M1"). Code 8 is -0.
pub const E2M1_VALUES: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// Largest E2M1 exponent, `emax_elem` in OCP MX v1.0 §6.3 (6.0 = 1.5 * 2^2).
const E2M1_EMAX: i32 = 2;

/// E8M0 scale byte to its value `2^(s-127)` (OCP MX v1.0 §5.4.1): `s = 0` is `2^-127` (an f32
/// subnormal, not zero), `s = 255` is NaN.
#[inline]
pub const fn e8m0_to_f32(s: u8) -> f32 {
    match s {
        255 => f32::NAN,
        // 2^-127 is below f32's normal range: mantissa bit 22 of a zero exponent.
        0 => f32::from_bits(0x0040_0000),
        _ => f32::from_bits((s as u32) << 23),
    }
}

/// Bytes of packed E2M1 data for one row of `cols` values: `ceil(cols / 32) * 16`.
#[inline]
pub const fn packed_row_bytes(cols: usize) -> usize {
    cols.div_ceil(BLOCK) * BLOCK_BYTES
}

/// E8M0 scale bytes for one row of `cols` values: `ceil(cols / 32)`.
#[inline]
pub const fn scale_row_bytes(cols: usize) -> usize {
    cols.div_ceil(BLOCK)
}

/// Rounds a value already divided by the block scale to the nearest E2M1 code, ties to even
/// (the code with mantissa bit 0), saturating at ±6 (OCP MX v1.0 §6.3: conversion to an FP4
/// element clamps to the largest normal). Values that round to zero get code 0 (no -0).
#[inline]
fn e2m1_code(v: f32) -> u8 {
    let a = v.abs();
    // Midpoints between neighbouring magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}; at each midpoint
    // the even code (0, 2, 4, 6) wins, hence `<=` towards even and `<` towards odd codes.
    let m: u8 = if a <= 0.25 {
        0
    } else if a < 0.75 {
        1
    } else if a <= 1.25 {
        2
    } else if a < 1.75 {
        3
    } else if a <= 2.5 {
        4
    } else if a < 3.5 {
        5
    } else if a <= 5.0 {
        6
    } else {
        7
    };
    if m != 0 && v.is_sign_negative() {
        m | 8
    } else {
        m
    }
}

/// Quantizes one block (at most 32 values; shorter means zero padding) into 16 packed bytes and
/// returns its scale byte.
fn quantize_block(vals: &[f32], packed: &mut [u8]) -> u8 {
    packed.fill(0);
    if vals.iter().any(|v| !v.is_finite()) {
        // No Inf/NaN in E2M1: the whole block becomes NaN through its scale.
        return 255;
    }
    let amax = vals.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    if amax == 0.0 {
        return 0;
    }
    let biased = ((amax.to_bits() >> 23) & 0xFF) as i32;
    // floor(log2(amax)); subnormal amax is below 2^-126 and clamps to the minimum anyway.
    let floor_log2 = if biased == 0 { -127 } else { biased - 127 };
    let shared_exp = (floor_log2 - E2M1_EMAX).clamp(-127, 127);
    let s = (shared_exp + 127) as u8;
    let scale = e8m0_to_f32(s);
    for (i, &v) in vals.iter().enumerate() {
        let code = e2m1_code(v / scale);
        packed[i / 2] |= code << (4 * (i % 2));
    }
    s
}

/// Quantizes `w: [rows, cols]` (row-major f32) to MXFP4.
///
/// Per block, as OCP MX v1.0 §6.3: `shared_exp = floor(log2(amax)) - 2` (2 = emax of E2M1),
/// clamped to the E8M0 range [-127, 127]; each value is divided by `2^shared_exp` and rounded to
/// the nearest E2M1 value, ties to even, saturating at ±6. An all-zero block gets scale byte 0
/// and zero nibbles; a block holding Inf or NaN gets scale byte 255 (NaN) and zero nibbles.
/// Padding elements of a partial last block are zero nibbles.
///
/// Output: `packed: [rows, packed_row_bytes(cols)]`, `scales: [rows, scale_row_bytes(cols)]`.
///
/// # Panics
/// If a slice length does not match `rows` and `cols`.
pub fn quantize(w: &[f32], rows: usize, cols: usize, packed: &mut [u8], scales: &mut [u8]) {
    let (pb, sb) = (packed_row_bytes(cols), scale_row_bytes(cols));
    assert_eq!(w.len(), rows * cols, "mxfp4::quantize: w length");
    assert_eq!(packed.len(), rows * pb, "mxfp4::quantize: packed length");
    assert_eq!(scales.len(), rows * sb, "mxfp4::quantize: scales length");
    for r in 0..rows {
        let row = &w[r * cols..(r + 1) * cols];
        let prow = &mut packed[r * pb..(r + 1) * pb];
        let srow = &mut scales[r * sb..(r + 1) * sb];
        for (b, vals) in row.chunks(BLOCK).enumerate() {
            srow[b] = quantize_block(vals, &mut prow[b * BLOCK_BYTES..(b + 1) * BLOCK_BYTES]);
        }
    }
}

/// Decodes columns `[c0, c0 + out.len())` of one row; `c0` must be a multiple of [`BLOCK`].
/// `prow`/`srow` are the whole row's packed bytes and scales.
#[inline]
pub(crate) fn decode_row_segment(prow: &[u8], srow: &[u8], c0: usize, out: &mut [f32]) {
    debug_assert_eq!(c0 % BLOCK, 0);
    let b0 = c0 / BLOCK;
    for (j, chunk) in out.chunks_mut(BLOCK).enumerate() {
        let b = b0 + j;
        let scale = e8m0_to_f32(srow[b]);
        let bytes = &prow[b * BLOCK_BYTES..(b + 1) * BLOCK_BYTES];
        for (i, o) in chunk.iter_mut().enumerate() {
            let nib = (bytes[i / 2] >> (4 * (i % 2))) & 0x0F;
            *o = E2M1_VALUES[nib as usize] * scale;
        }
    }
}

/// Dequantizes MXFP4 `packed: [rows, packed_row_bytes(cols)]`,
/// `scales: [rows, scale_row_bytes(cols)]` into `out: [rows, cols]` f32 (padding dropped).
///
/// ```
/// use deltafin_kernels::mxfp4;
/// let mut packed = [0u8; 16];
/// packed[0] = 0x2F; // element 0: low nibble 0xF = -6; element 1: high nibble 0x2 = +1
/// let mut out = [0.0f32; 2];
/// mxfp4::dequantize(&packed, &[128], 1, 2, &mut out); // scale 2^(128-127)
/// assert_eq!(out, [-12.0, 2.0]);
/// ```
///
/// # Panics
/// If a slice length does not match `rows` and `cols`.
pub fn dequantize(packed: &[u8], scales: &[u8], rows: usize, cols: usize, out: &mut [f32]) {
    let (pb, sb) = (packed_row_bytes(cols), scale_row_bytes(cols));
    assert_eq!(packed.len(), rows * pb, "mxfp4::dequantize: packed length");
    assert_eq!(scales.len(), rows * sb, "mxfp4::dequantize: scales length");
    assert_eq!(out.len(), rows * cols, "mxfp4::dequantize: out length");
    for r in 0..rows {
        decode_row_segment(
            &packed[r * pb..(r + 1) * pb],
            &scales[r * sb..(r + 1) * sb],
            0,
            &mut out[r * cols..(r + 1) * cols],
        );
    }
}
