//! Symmetric per-output-row int8 weights: `W[r, c] = scales[r] * q[r, c]`.
//!
//! Storage: `q: [rows, cols]` i8 row-major, `scales: [rows]` f32. The scheme is the usual
//! absmax ("LLM.int8()"-style row-wise, no zero point) quantization; activations are never
//! quantized, so a product with these weights is exact up to the weight rounding.

/// Quantizes `w: [rows, cols]` row by row: `scale = max|row| / 127` (an all-zero row gets scale
/// 0 and zero codes), `q = round(w / scale)` rounding half away from zero, clamped to
/// [-127, 127] (-128 is never produced, keeping the range symmetric).
///
/// Non-finite inputs have no meaningful code: a NaN weight gets code 0; an infinite one makes
/// the row's scale infinite.
///
/// Output: `q: [rows, cols]`, `scales: [rows]`.
///
/// # Panics
/// If a slice length does not match `rows` and `cols`.
pub fn quantize(w: &[f32], rows: usize, cols: usize, q: &mut [i8], scales: &mut [f32]) {
    assert_eq!(w.len(), rows * cols, "int8::quantize: w length");
    assert_eq!(q.len(), rows * cols, "int8::quantize: q length");
    assert_eq!(scales.len(), rows, "int8::quantize: scales length");
    for r in 0..rows {
        let row = &w[r * cols..(r + 1) * cols];
        let qrow = &mut q[r * cols..(r + 1) * cols];
        let amax = row.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        if amax == 0.0 {
            scales[r] = 0.0;
            qrow.fill(0);
            continue;
        }
        let scale = amax / 127.0;
        scales[r] = scale;
        for (o, &v) in qrow.iter_mut().zip(row) {
            // f32::round rounds half away from zero; `as i8` maps NaN to 0.
            *o = (v / scale).round().clamp(-127.0, 127.0) as i8;
        }
    }
}

/// Dequantizes `q: [rows, cols]`, `scales: [rows]` into `out: [rows, cols]`:
/// `out[r, c] = q[r, c] as f32 * scales[r]`.
///
/// # Panics
/// If a slice length does not match `rows` and `cols`.
pub fn dequantize(q: &[i8], scales: &[f32], rows: usize, cols: usize, out: &mut [f32]) {
    assert_eq!(q.len(), rows * cols, "int8::dequantize: q length");
    assert_eq!(scales.len(), rows, "int8::dequantize: scales length");
    assert_eq!(out.len(), rows * cols, "int8::dequantize: out length");
    for r in 0..rows {
        decode_row_segment(
            &q[r * cols..(r + 1) * cols],
            scales[r],
            &mut out[r * cols..(r + 1) * cols],
        );
    }
}

/// Decodes a run of one row's codes: `out[i] = q[i] as f32 * scale`.
#[inline]
pub(crate) fn decode_row_segment(q: &[i8], scale: f32, out: &mut [f32]) {
    for (o, &v) in out.iter_mut().zip(q) {
        *o = v as f32 * scale;
    }
}
