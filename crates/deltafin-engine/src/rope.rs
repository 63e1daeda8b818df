//! Rotary position embeddings: plain RoPE (Su et al. 2021, arXiv:2104.09864) and YaRN (Peng et
//! al. 2023, arXiv:2309.00071), with the frequencies and attention factor computed as transformers'
//! `modeling_rope_utils._compute_default_rope_parameters` / `_compute_yarn_parameters`.

use deltafin_format::Rope;

/// `yarn_get_mscale` of the DeepSeek-V3 reference: `0.1 · mscale · ln(scale) + 1` for scale > 1,
/// else 1. [YARN_MSCALE]
pub fn yarn_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

/// Precomputed rotary tables for one head width.
#[derive(Debug, Clone)]
pub struct RotaryEmbedding {
    /// `[dim/2]` inverse frequencies (f32, as the reference computes them).
    pub inv_freq: Vec<f32>,
    /// Multiplier on cos and sin (YaRN's attention factor; 1 for plain RoPE).
    pub attention_factor: f32,
    /// Rotary pairs are `(x[2i], x[2i+1])` when true, `(x[i], x[i+dim/2])` when false.
    pub interleaved: bool,
}

impl RotaryEmbedding {
    /// Builds the tables for rotary width `dim` (even).
    pub fn new(rope: &Rope, dim: usize, interleaved: bool) -> Self {
        let half = dim / 2;
        // base^(2i/dim) in f32 like torch's `base ** (arange(0, dim, 2).float() / dim)`.
        let pos_freqs = |base: f64| -> Vec<f32> {
            (0..half)
                .map(|i| {
                    let e = (2 * i) as f32 / dim as f32;
                    (base as f32).powf(e)
                })
                .collect()
        };
        match *rope {
            Rope::Default { theta } => RotaryEmbedding {
                inv_freq: pos_freqs(theta).iter().map(|p| 1.0 / p).collect(),
                attention_factor: 1.0,
                interleaved,
            },
            Rope::Yarn {
                theta,
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                mscale,
                mscale_all_dim,
                attention_factor,
                truncate,
            } => {
                let af = match attention_factor {
                    Some(a) => a,
                    None => match (mscale, mscale_all_dim) {
                        (Some(m), Some(ma)) => yarn_mscale(factor, m) / yarn_mscale(factor, ma),
                        _ => yarn_mscale(factor, 1.0),
                    },
                };
                let correction_dim = |rot: f64| {
                    (dim as f64 * (original_max_position_embeddings / (rot * 2.0 * std::f64::consts::PI)).ln())
                        / (2.0 * theta.ln())
                };
                let (mut low, mut high) = (correction_dim(beta_fast), correction_dim(beta_slow));
                if truncate {
                    low = low.floor();
                    high = high.ceil();
                }
                let low = low.max(0.0);
                let high = high.min(dim as f64 - 1.0);
                let high = if low == high { high + 0.001 } else { high };
                let pf = pos_freqs(theta);
                let inv_freq = (0..half)
                    .map(|i| {
                        let ramp = (((i as f32) - low as f32) / (high as f32 - low as f32)).clamp(0.0, 1.0);
                        let extrapolation_factor = 1.0 - ramp;
                        let extra = 1.0 / pf[i];
                        let inter = 1.0 / (factor as f32 * pf[i]);
                        inter * (1.0 - extrapolation_factor) + extra * extrapolation_factor
                    })
                    .collect();
                RotaryEmbedding {
                    inv_freq,
                    attention_factor: af as f32,
                    interleaved,
                }
            }
        }
    }

    /// Rotates `x: [dim]` in place for position `pos`, and multiplies by the attention factor.
    pub fn apply(&self, x: &mut [f32], pos: usize) {
        let half = self.inv_freq.len();
        let p = pos as f32;
        for i in 0..half {
            let angle = p * self.inv_freq[i];
            let (s, c) = angle.sin_cos();
            let (c, s) = (c * self.attention_factor, s * self.attention_factor);
            let (a, b) = if self.interleaved {
                (2 * i, 2 * i + 1)
            } else {
                (i, i + half)
            };
            let (xa, xb) = (x[a], x[b]);
            x[a] = xa * c - xb * s;
            x[b] = xb * c + xa * s;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mscale_formula() {
        assert_eq!(yarn_mscale(1.0, 1.0), 1.0);
        assert!((yarn_mscale(40.0, 1.0) - (0.1 * 40f64.ln() + 1.0)).abs() < 1e-12);
        assert!((yarn_mscale(4.0, 0.707) - (0.0707 * 4f64.ln() + 1.0)).abs() < 1e-12);
    }

    #[test]
    fn plain_rope_rotates_pairs() {
        let r = RotaryEmbedding::new(&Rope::Default { theta: 10000.0 }, 4, false);
        assert_eq!(r.inv_freq, vec![1.0, 0.01]);
        let mut x = [1.0, 0.0, 0.0, 0.0];
        r.apply(&mut x, 1);
        assert!((x[0] - 1f32.cos()).abs() < 1e-6 && (x[2] - 1f32.sin()).abs() < 1e-6);
        // Interleaved layout pairs adjacent elements.
        let r = RotaryEmbedding::new(&Rope::Default { theta: 10000.0 }, 4, true);
        let mut x = [1.0, 0.0, 0.0, 0.0];
        r.apply(&mut x, 1);
        assert!((x[0] - 1f32.cos()).abs() < 1e-6 && (x[1] - 1f32.sin()).abs() < 1e-6);
    }

    #[test]
    fn yarn_interpolates_low_frequencies_only() {
        let y = Rope::Yarn {
            theta: 10000.0,
            factor: 4.0,
            original_max_position_embeddings: 64.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            mscale: None,
            mscale_all_dim: None,
            attention_factor: None,
            truncate: true,
        };
        let plain = RotaryEmbedding::new(&Rope::Default { theta: 10000.0 }, 16, true);
        let r = RotaryEmbedding::new(&y, 16, true);
        assert_eq!(r.inv_freq[0], plain.inv_freq[0]); // highest frequency extrapolated
        assert!((r.inv_freq[7] - plain.inv_freq[7] / 4.0).abs() < 1e-9); // lowest interpolated
        assert!((r.attention_factor - (0.1 * 4f32.ln() + 1.0)).abs() < 1e-6);
    }
}
