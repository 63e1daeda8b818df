//! Decoders for quantized source checkpoints: pure functions from the stored bytes to the values
//! the reference implementation computes with, so the converter reads these formats exactly
//! instead of through a detour (a bf16 copy, a re-quantization).
//!
//! | format | stored tensors | decoded value |
//! |---|---|---|
//! | DeepSeek / Kimi K2 block FP8 `[DS_FP8_BLOCK]` | `W` F8_E4M3 `[rows, cols]`, `W_scale_inv` f32/bf16 `[ceil(rows/bm), ceil(cols/bn)]` | `f32(e4m3(W[i,j]) × scale_inv[i/bm, j/bn])` |
//! | compressed-tensors `pack-quantized` `[CT_PACK_INT32]` | `weight_packed` I32 `[rows, ceil(cols·bits/32)]`, `weight_scale` bf16/f16/f32 `[rows, ceil(cols/group)]`, `weight_shape` `[2]` | `round_to_scale_dtype(q × scale[i, j/group])` |
//! | gpt-oss MXFP4 `[GPTOSS_MXFP4]` | `X_blocks` U8 `[.., rows, G, 16]`, `X_scales` U8 `[.., rows, G]` | `E2M1 × 2^(s−127)` |
//! | compressed-tensors `mxfp4-pack-quantized` `[CT_MXFP4]` | `weight_packed` U8 `[rows, cols/2]`, `weight_scale` U8 `[rows, ceil(cols/32)]` | `E2M1 × 2^(s−127)` |
//!
//! Conventions, read from the reference sources (facts only, no code copied):
//! - `[E4M3FN]` OCP 8-bit floating point (OFP8) E4M3 "FN" variant as in PyTorch's
//!   `torch.float8_e4m3fn`: 1 sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities;
//!   `S.1111.111` (0x7F, 0xFF) is NaN; exponent 0 is subnormal (`m/8 · 2^-6`); largest finite
//!   magnitude `S.1111.110` = 1.75 · 2^8 = 448.
//! - `[DS_FP8_BLOCK]` DeepSeek-V3 `inference/kernel.py` `weight_dequant` and transformers
//!   `integrations/finegrained_fp8.py` `_dequantize_fp8_weight`: the weight is the FP8 value
//!   *multiplied* by `weight_scale_inv` of its `[bm, bn]` block (the name notwithstanding);
//!   `bm, bn` = `quantization_config.weight_block_size`; the last block of a row or column is
//!   partial when the dimension is not a multiple of the block. The product is formed in f32 (one
//!   rounding); DeepSeek's own `fp8_cast_bf16.py` then rounds it to bf16, which we do not.
//! - `[CT_PACK_INT32]` compressed-tensors `compressors/quantized_compressors/pack_quantized.py`
//!   (`pack_to_int32` / `unpack_from_int32`, packed_dim 1) and
//!   `compressors/pack_quantized/helpers.py` (v0.20): each quantized value `q ∈ [−2^(b−1),
//!   2^(b−1)−1]` is stored as the unsigned `q + 2^(b−1)` (4 bits: `q + 8`); along a row, value `k`
//!   sits in word `k / (32/b)` at bits `b·(k mod 32/b)` (value 0 in the least significant bits);
//!   a row is padded with zero bits to whole words. Example (4 bits): the row
//!   `[−8, −1, 0, 1, 2, 3, 4, 7]` packs to the word `0xFCBA9870`.
//! - `[CT_DEQUANT]` compressed-tensors `quantization/lifecycle/forward.py` `_dequantize`: with
//!   symmetric weights (no zero point) the value is `q.to(scale.dtype) * scale`, i.e. the exact
//!   product rounded (to nearest, ties to even) to the scale's dtype; group `g` of a row covers
//!   columns `[g·group_size, (g+1)·group_size)`; the `channel` strategy is one group per row.
//! - `[GPTOSS_MXFP4]` transformers `integrations/mxfp4.py` `convert_moe_packed_tensors`: element
//!   `2i` of a block is the low nibble of byte `i`, element `2i+1` the high nibble; the scale byte
//!   `s` means `2^(s−127)`; blocks of 32 along the last (input) dimension.
//! - `[CT_MXFP4]` compressed-tensors `compressors/quantized_compressors/fp4_quantized.py`
//!   (`pack_fp4_to_uint8` / `unpack_fp4_from_uint8`) and `compressors/mx_utils.py`
//!   (`decompress_mx_scale`): element `2i` of a row in the low nibble of byte `i`, element `2i+1`
//!   in the high nibble, no padding between blocks; scale byte `s` means `2^(s−127)`.
//!
//! Both MXFP4 sources therefore use deltafin's nibble order (`deltafin_kernels::mxfp4`: E2M1 low
//! nibble first, rows of `ceil(cols/32)·16` bytes, then the E8M0 scales `[rows, ceil(cols/32)]`):
//! [`mxfp4_record`] copies their bytes unchanged.

use deltafin_kernels::mxfp4::{e8m0_to_f32, packed_row_bytes, scale_row_bytes, BLOCK, E2M1_VALUES};

/// What is wrong with a quantized source tensor's parts (the caller adds file and tensor names).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SourceError {
    /// A part does not have the length its shape requires.
    #[error("{part} has {found} elements, expected {expected} for a [{rows}, {cols}] weight")]
    Length {
        part: &'static str,
        rows: usize,
        cols: usize,
        expected: usize,
        found: usize,
    },
    /// A parameter outside what the format defines or what this decoder supports.
    #[error("{0}")]
    Unsupported(String),
}

/// Value of one `float8_e4m3fn` byte `[E4M3FN]`.
///
/// Examples: `0x38` → 1.0, `0x7E` → 448.0, `0x01` → 2^-9, `0x80` → -0.0, `0x7F` → NaN.
#[inline]
pub fn e4m3fn_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let exp = ((b >> 3) & 0x0F) as i32;
    let man = (b & 0x07) as f32;
    if exp == 0x0F && b & 0x07 == 0x07 {
        return f32::NAN;
    }
    let mag = if exp == 0 {
        // Subnormal: m/8 · 2^(1-7).
        man * (1.0 / 512.0)
    } else {
        (1.0 + man / 8.0) * f32::from_bits(((exp - 7 + 127) as u32) << 23)
    };
    sign * mag
}

/// Dequantizes a DeepSeek block-FP8 weight `[DS_FP8_BLOCK]`.
///
/// - `values`: `[rows, cols]` `float8_e4m3fn` bytes, row-major.
/// - `scale_inv`: `[ceil(rows/block[0]), ceil(cols/block[1])]` f32 block scales.
/// - Returns `[rows, cols]` f32: `e4m3(values[i,j]) × scale_inv[i/block[0], j/block[1]]`.
///
/// Errors: a zero block dimension, or a part whose length does not match.
pub fn dequant_block_fp8(
    values: &[u8],
    rows: usize,
    cols: usize,
    scale_inv: &[f32],
    block: [usize; 2],
) -> Result<Vec<f32>, SourceError> {
    if block[0] == 0 || block[1] == 0 {
        return Err(SourceError::Unsupported(format!(
            "weight_block_size {block:?} has a zero dimension"
        )));
    }
    check_len("values", values.len(), rows, cols, rows * cols)?;
    let (sr, sc) = (rows.div_ceil(block[0]), cols.div_ceil(block[1]));
    check_len("scale_inv", scale_inv.len(), rows, cols, sr * sc)?;
    let lut: [f32; 256] = std::array::from_fn(|b| e4m3fn_to_f32(b as u8));
    let mut out = vec![0f32; rows * cols];
    for (i, (orow, vrow)) in out
        .chunks_exact_mut(cols.max(1))
        .zip(values.chunks_exact(cols.max(1)))
        .enumerate()
    {
        let srow = &scale_inv[(i / block[0]) * sc..(i / block[0] + 1) * sc];
        for (j, (o, &v)) in orow.iter_mut().zip(vrow).enumerate() {
            *o = lut[v as usize] * srow[j / block[1]];
        }
    }
    Ok(out)
}

/// Dtype of a compressed-tensors `weight_scale`, which is also the dtype the reference
/// dequantizes into `[CT_DEQUANT]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScaleDtype {
    F32,
    Bf16,
    F16,
}

impl ScaleDtype {
    /// Rounds an f32 to this dtype (nearest, ties to even) and back.
    #[inline]
    pub fn round(self, x: f32) -> f32 {
        match self {
            ScaleDtype::F32 => x,
            ScaleDtype::Bf16 => half::bf16::from_f32(x).to_f32(),
            ScaleDtype::F16 => half::f16::from_f32(x).to_f32(),
        }
    }
}

/// Int32 words of one packed row: `ceil(cols · bits / 32)` `[CT_PACK_INT32]`.
pub fn packed_int32_row_words(cols: usize, num_bits: u32) -> usize {
    (cols * num_bits as usize).div_ceil(32)
}

/// Unpacks compressed-tensors `pack-quantized` int32 words into signed integers `[CT_PACK_INT32]`.
///
/// - `words`: `[rows, packed_int32_row_words(cols, num_bits)]`, the I32 tensor's bits as u32.
/// - Returns `[rows, cols]` values in `[−2^(b−1), 2^(b−1)−1]`.
///
/// Errors: `num_bits` other than 4 or 8 (the widths whose values never straddle a word), or a
/// length mismatch.
pub fn unpack_int32(words: &[u32], rows: usize, cols: usize, num_bits: u32) -> Result<Vec<i8>, SourceError> {
    if num_bits != 4 && num_bits != 8 {
        return Err(SourceError::Unsupported(format!(
            "num_bits {num_bits} (pack-quantized int4 and int8 are supported)"
        )));
    }
    let rw = packed_int32_row_words(cols, num_bits);
    check_len("weight_packed", words.len(), rows, cols, rows * rw)?;
    let per_word = (32 / num_bits) as usize;
    let mask = (1u32 << num_bits) - 1;
    let offset = 1i32 << (num_bits - 1);
    let mut out = Vec::with_capacity(rows * cols);
    for row in words.chunks_exact(rw.max(1)).take(rows) {
        for k in 0..cols {
            let w = row[k / per_word];
            let u = (w >> (num_bits as usize * (k % per_word))) & mask;
            out.push((u as i32 - offset) as i8);
        }
    }
    Ok(out)
}

/// Dequantizes a symmetric compressed-tensors `pack-quantized` weight `[CT_PACK_INT32]`
/// `[CT_DEQUANT]`.
///
/// - `words`: `[rows, ceil(cols·bits/32)]` packed values (see [`unpack_int32`]).
/// - `scales`: `[rows, ceil(cols/group_size)]` as f32 (exact widening of `scale_dtype`);
///   `group_size` `None` is the `channel` strategy (`[rows, 1]`).
/// - Returns `[rows, cols]`: `scale_dtype.round(q × scale)`, the value compressed-tensors'
///   decompressor produces.
///
/// Errors: as [`unpack_int32`], a zero group size, or a scale length mismatch.
pub fn dequant_pack_quantized(
    words: &[u32],
    rows: usize,
    cols: usize,
    num_bits: u32,
    group_size: Option<usize>,
    scales: &[f32],
    scale_dtype: ScaleDtype,
) -> Result<Vec<f32>, SourceError> {
    let gs = match group_size {
        Some(0) => return Err(SourceError::Unsupported("group_size 0".into())),
        Some(g) => g,
        None => cols.max(1),
    };
    let q = unpack_int32(words, rows, cols, num_bits)?;
    let ng = cols.div_ceil(gs);
    check_len("weight_scale", scales.len(), rows, cols, rows * ng)?;
    let mut out = Vec::with_capacity(rows * cols);
    for i in 0..rows {
        let srow = &scales[i * ng..(i + 1) * ng];
        for (j, &v) in q[i * cols..(i + 1) * cols].iter().enumerate() {
            // |q| ≤ 128 and the scale has ≤ 24 significant bits: the f32 product is exact.
            out.push(scale_dtype.round(v as f32 * srow[j / gs]));
        }
    }
    Ok(out)
}

/// Where an MXFP4 source tensor comes from; both put element `2i` in the low nibble.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mxfp4Source {
    /// gpt-oss `X_blocks` `[.., rows, G, 16]` + `X_scales` `[.., rows, G]` `[GPTOSS_MXFP4]`:
    /// rows are already whole blocks (`cols = 32·G`).
    GptOssBlocks,
    /// compressed-tensors `mxfp4-pack-quantized` `weight_packed` `[rows, cols/2]` +
    /// `weight_scale` `[rows, ceil(cols/32)]` `[CT_MXFP4]`: rows are not padded to whole blocks.
    CompressedTensors,
}

impl Mxfp4Source {
    /// Bytes of packed E2M1 data per row in this source.
    pub fn row_bytes(self, cols: usize) -> usize {
        match self {
            Mxfp4Source::GptOssBlocks => packed_row_bytes(cols),
            Mxfp4Source::CompressedTensors => cols.div_ceil(2),
        }
    }

    /// Checks the parts of a `[rows, cols]` matrix from this source: `packed` of
    /// [`Self::row_bytes`] per row, `scales` of `ceil(cols/32)` per row. Returns the row bytes.
    ///
    /// Errors: odd `cols` for compressed-tensors, or a part whose length does not match.
    fn check_parts(self, packed: &[u8], scales: &[u8], rows: usize, cols: usize) -> Result<usize, SourceError> {
        if self == Mxfp4Source::CompressedTensors && !cols.is_multiple_of(2) {
            return Err(SourceError::Unsupported(format!(
                "{cols} columns: MXFP4 rows hold pairs of values"
            )));
        }
        let src_rb = self.row_bytes(cols);
        check_len("packed values (bytes)", packed.len(), rows, cols, rows * src_rb)?;
        check_len("scales", scales.len(), rows, cols, rows * scale_row_bytes(cols))?;
        Ok(src_rb)
    }
}

/// Bytes of a deltafin MXFP4 matrix, bit for bit from an MXFP4 source: the E2M1 codes
/// `[rows, ceil(cols/32)·16]` (low nibble first, as in both sources) followed by the E8M0 scales
/// `[rows, ceil(cols/32)]` — the layout `deltafin_kernels::mxfp4` reads and
/// `convert::encode_matrix(Mxfp4, ..)` writes.
///
/// No value is re-quantized: every E2M1 code and every scale byte is copied. When the source rows
/// already have the deltafin stride (gpt-oss always; compressed-tensors when `cols` is a multiple
/// of 32) the result is exactly `packed ++ scales`; otherwise each row is followed by zero codes
/// (+0.0) up to its last block.
///
/// Errors: odd `cols` for compressed-tensors, or a part whose length does not match.
pub fn mxfp4_record(
    source: Mxfp4Source,
    packed: &[u8],
    scales: &[u8],
    rows: usize,
    cols: usize,
) -> Result<Vec<u8>, SourceError> {
    let src_rb = source.check_parts(packed, scales, rows, cols)?;
    let (rb, sb) = (packed_row_bytes(cols), scale_row_bytes(cols));
    let mut out = Vec::with_capacity(rows * (rb + sb));
    if src_rb == rb {
        out.extend_from_slice(packed);
    } else {
        for row in packed.chunks_exact(src_rb.max(1)).take(rows) {
            out.extend_from_slice(row);
            out.resize(out.len() + rb - src_rb, 0);
        }
    }
    out.extend_from_slice(scales);
    Ok(out)
}

/// Dequantizes an MXFP4 source matrix to f32 `[GPTOSS_MXFP4]` `[CT_MXFP4]`.
///
/// - `packed`: `[rows, source.row_bytes(cols)]` bytes; `scales`: `[rows, ceil(cols/32)]` E8M0.
/// - Returns `[rows, cols]`: `E2M1[code] × 2^(s−127)` (exact in f32; scale byte 255 gives NaN).
///
/// Errors: as [`mxfp4_record`].
pub fn dequant_mxfp4(
    source: Mxfp4Source,
    packed: &[u8],
    scales: &[u8],
    rows: usize,
    cols: usize,
) -> Result<Vec<f32>, SourceError> {
    let src_rb = source.check_parts(packed, scales, rows, cols)?;
    let sb = scale_row_bytes(cols);
    let mut out = Vec::with_capacity(rows * cols);
    for i in 0..rows {
        let prow = &packed[i * src_rb..(i + 1) * src_rb];
        let srow = &scales[i * sb..(i + 1) * sb];
        for j in 0..cols {
            let byte = prow[j / 2];
            let code = if j % 2 == 0 { byte & 0x0F } else { byte >> 4 };
            out.push(E2M1_VALUES[code as usize] * e8m0_to_f32(srow[j / BLOCK]));
        }
    }
    Ok(out)
}

fn check_len(part: &'static str, found: usize, rows: usize, cols: usize, expected: usize) -> Result<(), SourceError> {
    if found == expected {
        Ok(())
    } else {
        Err(SourceError::Length {
            part,
            rows,
            cols,
            expected,
            found,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3fn_hand_computed() {
        // (byte, value) worked by hand from S.EEEE.MMM, bias 7.
        let cases: &[(u8, f32)] = &[
            (0x00, 0.0),
            (0x38, 1.0),          // E=7, M=0
            (0x3C, 1.5),          // E=7, M=4: 1 + 4/8
            (0x40, 2.0),          // E=8
            (0xC0, -2.0),         // sign
            (0x30, 0.5),          // E=6
            (0x08, 0.015625),     // E=1: smallest normal 2^-6
            (0x01, 0.001953125),  // subnormal 1/8 · 2^-6 = 2^-9
            (0x07, 0.013671875),  // subnormal 7/8 · 2^-6
            (0x86, -0.01171875),  // -6/8 · 2^-6
            (0x77, 240.0),        // E=14, M=7: 1.875 · 128
            (0x78, 256.0),        // E=15, M=0: exponent 15 is finite (no infinities)
            (0x7E, 448.0),        // E=15, M=6: the largest finite value
            (0xFE, -448.0),       //
            (0x5B, 1.375 * 16.0), // E=11, M=3
            (0x1D, 0.1015625),    // E=3, M=5: 1.625 · 2^-4
        ];
        for &(b, want) in cases {
            assert_eq!(e4m3fn_to_f32(b), want, "byte {b:#04x}");
        }
        assert!(e4m3fn_to_f32(0x80).is_sign_negative() && e4m3fn_to_f32(0x80) == 0.0);
        assert!(e4m3fn_to_f32(0x7F).is_nan() && e4m3fn_to_f32(0xFF).is_nan());
        // Exactly two NaN codes; every other byte is finite and within ±448.
        let nans = (0..=255u8).filter(|&b| e4m3fn_to_f32(b).is_nan()).count();
        assert_eq!(nans, 2);
        assert!((0..=255u8)
            .map(e4m3fn_to_f32)
            .filter(|v| !v.is_nan())
            .all(|v| v.abs() <= 448.0));
        // Monotone over the positive codes 0x00..=0x7E.
        for b in 0..0x7Eu8 {
            assert!(e4m3fn_to_f32(b) < e4m3fn_to_f32(b + 1), "{b:#04x}");
        }
    }

    #[test]
    fn block_fp8_multiplies_by_the_scale_of_each_partial_block() {
        // [3, 5] with 2×2 blocks: scale grid [2, 3]; row 2 and column 4 are partial edge blocks.
        let v: Vec<u8> = vec![
            0x38, 0x40, 0x38, 0x40, 0x38, //
            0xC0, 0x30, 0x38, 0x38, 0x7E, //
            0x38, 0x38, 0x01, 0x38, 0x40,
        ];
        let s = [1.0, 10.0, 100.0, 0.5, 0.25, -2.0];
        let w = dequant_block_fp8(&v, 3, 5, &s, [2, 2]).unwrap();
        #[rustfmt::skip]
        let want = [
            1.0, 2.0, 10.0, 20.0, 100.0,
            -2.0, 0.5, 10.0, 10.0, 44800.0,
            0.5, 0.5, 0.25 * 0.001953125, 0.25, -4.0,
        ];
        assert_eq!(w, want);
        let e = dequant_block_fp8(&v, 3, 5, &s[..5], [2, 2]).unwrap_err();
        assert!(
            e.to_string().contains("scale_inv") && e.to_string().contains('6'),
            "{e}"
        );
        assert!(dequant_block_fp8(&v, 3, 5, &s, [0, 2]).is_err());
    }

    #[test]
    fn int4_packing_matches_compressed_tensors() {
        // Worked by hand (and checked against compressed-tensors 0.20.1 `pack_to_int32`):
        // q + 8 = [0, 7, 8, 9, 10, 11, 12, 15] → nibbles from bit 0 up → 0xFCBA9870;
        // [5, -3, 0 ×6] → [13, 5, 8 ×6] → 0x8888885D.
        let words = [0xFCBA_9870u32, 0x8888_885D];
        let q = unpack_int32(&words, 1, 16, 4).unwrap();
        assert_eq!(q, vec![-8, -1, 0, 1, 2, 3, 4, 7, 5, -3, 0, 0, 0, 0, 0, 0]);
        // A row of 12 values takes 2 words; the padding nibbles are ignored.
        let q = unpack_int32(&words, 1, 12, 4).unwrap();
        assert_eq!(q.len(), 12);
        // int8: four bytes per word, +128 offset.
        assert_eq!(unpack_int32(&[0x00FF_8081], 1, 4, 8).unwrap(), vec![1, 0, 127, -128]);
        assert!(unpack_int32(&words, 1, 16, 3).is_err());
        assert!(unpack_int32(&words, 2, 16, 4).is_err());
    }

    #[test]
    fn int4_dequant_rounds_the_product_to_the_scale_dtype() {
        // Two rows of 8, group 4: four groups.
        let words = [0xFCBA_9870u32, 0x8888_885D];
        let s = [
            0.5f32, 2.0, -1.0,
            // 1 + 2^-7: a bf16 value whose products with odd q need more than 8 significant bits.
            1.0078125,
        ];
        let w = dequant_pack_quantized(&words, 2, 8, 4, Some(4), &s, ScaleDtype::Bf16).unwrap();
        // Row 0: q = [-8, -1, 0, 1 | 2, 3, 4, 7]; row 1: q = [5, -3, 0, 0 | 0, 0, 0, 0].
        assert_eq!(
            w,
            vec![-4.0, -0.5, 0.0, 0.5, 4.0, 6.0, 8.0, 14.0, -5.0, 3.0, -0.0, -0.0, 0.0, 0.0, 0.0, 0.0]
        );
        let w = dequant_pack_quantized(&[0x7000_0000u32], 1, 8, 4, Some(8), &[1.0078125], ScaleDtype::Bf16).unwrap();
        // q = [-8 ×7, -1]: -8 × 1.0078125 = -8.0625 (exact in bf16), -1 × it exact.
        assert_eq!(w[0], -8.0625);
        assert_eq!(w[7], -1.0078125);
        let w = dequant_pack_quantized(&[0xF000_0000u32], 1, 8, 4, Some(8), &[1.0078125], ScaleDtype::Bf16).unwrap();
        // q[7] = 15 - 8 = 7: 7 × 1.0078125 = 7.0546875 lies between the bf16 neighbours 7.03125
        // and 7.0625 (spacing 2^-5 in [4, 8)) and rounds to the nearer 7.0625; f32 keeps it exact.
        assert_eq!(w[7], 7.0625);
        let w = dequant_pack_quantized(&[0xF000_0000u32], 1, 8, 4, Some(8), &[1.0078125], ScaleDtype::F32).unwrap();
        assert_eq!(w[7], 7.0546875);
        // Channel strategy: one scale per row.
        let w = dequant_pack_quantized(&words, 1, 16, 4, None, &[2.0], ScaleDtype::F16).unwrap();
        assert_eq!(w[..8], [-16.0, -2.0, 0.0, 2.0, 4.0, 6.0, 8.0, 14.0]);
        let e = dequant_pack_quantized(&words, 2, 8, 4, Some(4), &s[..3], ScaleDtype::Bf16).unwrap_err();
        assert!(e.to_string().contains("weight_scale"), "{e}");
    }

    #[test]
    fn mxfp4_sources_decode_and_copy_bit_for_bit() {
        // One row of 64 values (two blocks). Byte 0x2F: low nibble 0xF = -6 (element 0), high
        // nibble 0x2 = +1 (element 1). Scale 128 = 2, scale 126 = 0.5.
        let mut packed = vec![0u8; 32];
        packed[0] = 0x2F;
        packed[16] = 0x71; // element 32: 0x1 = 0.5, element 33: 0x7 = 6
        let scales = [128u8, 126];
        for src in [Mxfp4Source::GptOssBlocks, Mxfp4Source::CompressedTensors] {
            let w = dequant_mxfp4(src, &packed, &scales, 1, 64).unwrap();
            assert_eq!(w[0], -12.0);
            assert_eq!(w[1], 2.0);
            assert_eq!(w[32], 0.25);
            assert_eq!(w[33], 3.0);
            assert!(w
                .iter()
                .enumerate()
                .all(|(j, &x)| [0, 1, 32, 33].contains(&j) || x == 0.0));
            // Whole blocks: the record is the source bytes unchanged, values then scales.
            let rec = mxfp4_record(src, &packed, &scales, 1, 64).unwrap();
            assert_eq!(rec, [&packed[..], &scales[..]].concat());
            // deltafin's own MXFP4 reader sees the same values.
            let mut back = vec![0f32; 64];
            deltafin_kernels::mxfp4::dequantize(&rec[..32], &rec[32..], 1, 64, &mut back);
            assert_eq!(back, w);
        }
        // compressed-tensors with 40 columns: rows of 20 bytes, padded to 32 in the record.
        let ct: Vec<u8> = (0..40u8).collect(); // two rows
        let sc = [127u8, 127, 128, 128];
        let rec = mxfp4_record(Mxfp4Source::CompressedTensors, &ct, &sc, 2, 40).unwrap();
        assert_eq!(rec.len(), 2 * 32 + 4);
        assert_eq!(&rec[..20], &ct[..20]);
        assert!(rec[20..32].iter().all(|&b| b == 0));
        assert_eq!(&rec[32..52], &ct[20..40]);
        assert_eq!(&rec[64..], &sc);
        let mut back = vec![0f32; 80];
        deltafin_kernels::mxfp4::dequantize(&rec[..64], &rec[64..], 2, 40, &mut back);
        assert_eq!(
            back,
            dequant_mxfp4(Mxfp4Source::CompressedTensors, &ct, &sc, 2, 40).unwrap()
        );
        assert!(mxfp4_record(Mxfp4Source::CompressedTensors, &ct, &sc, 2, 41).is_err());
        assert!(mxfp4_record(Mxfp4Source::GptOssBlocks, &ct, &sc, 2, 40).is_err());
        assert!(dequant_mxfp4(Mxfp4Source::GptOssBlocks, &packed, &[255, 127], 1, 64).unwrap()[0].is_nan());
    }
}
