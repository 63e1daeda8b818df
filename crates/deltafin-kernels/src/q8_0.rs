//! ggml's `Q8_0` activation rounding, as a round trip in f32.
//!
//! ggml's CPU backend multiplies a quantized weight by an f32 activation vector by first
//! quantizing the vector to the weight type's `vec_dot_type`; for MXFP4 weights that is `Q8_0`
//! (ggml `ggml-cpu.c` type traits: `GGML_TYPE_MXFP4 → vec_dot_type GGML_TYPE_Q8_0`). The dot
//! product is then exact on the rounded values. [`round_trip`] reproduces that rounding so that
//! llama.cpp's CPU logits can be matched (see `CausalLm::set_numerics`).
//!
//! Per block of [`BLOCK`] = 32 consecutive values (ggml `quantize_row_q8_0_ref`):
//! ```text
//! d  = max|x_i| / 127                 (f32)
//! q_i = round(x_i · (1/d))            (half away from zero; 0 when d = 0)
//! x̂_i = q_i · f16(d)                  (the block stores d as f16)
//! ```
//! A trailing partial block is rounded the same way over the values it has.

use half::f16;

/// Values per `Q8_0` block (ggml `QK8_0`).
pub const BLOCK: usize = 32;

/// `x` rounded through ggml's `Q8_0` and back. x: `[n]` → `[n]`.
pub fn round_trip(x: &[f32]) -> Vec<f32> {
    let mut out = Vec::with_capacity(x.len());
    for b in x.chunks(BLOCK) {
        let amax = b.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let dh = f16::from_f32(d).to_f32();
        out.extend(b.iter().map(|v| (v * id).round() * dh));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_matches_hand_computed_blocks() {
        // Block 1: amax 2.54 → d = 0.02 (f16: 0.0200042724609375); 1.0 / 0.02 = 50 → q = 50,
        // -2.54 → q = -127, 0.011 → 0.55 → q = 1 (half away from zero would matter at 0.5).
        let mut x = vec![0f32; 32];
        x[0] = 1.0;
        x[1] = -2.54;
        x[2] = 0.011;
        let dh = f16::from_f32(2.54 / 127.0).to_f32();
        assert_eq!(dh, 0.020_004_272_f32);
        // Block 2 (partial, 3 values): all zeros stays zero (d = 0).
        x.extend([0.0, 0.0, 0.0]);
        let y = round_trip(&x);
        assert_eq!(y.len(), 35);
        assert_eq!(y[0], 50.0 * dh);
        assert_eq!(y[1], -127.0 * dh);
        assert_eq!(y[2], dh);
        assert!(y[3..].iter().all(|v| *v == 0.0));
        // Ties round away from zero: amax 127 → d = 1, 0.5 → 1, -2.5 → -3.
        let mut t = vec![0f32; 32];
        t[0] = 127.0;
        t[1] = 0.5;
        t[2] = -2.5;
        let y = round_trip(&t);
        assert_eq!(&y[..3], &[127.0, 1.0, -3.0]);
    }
}
