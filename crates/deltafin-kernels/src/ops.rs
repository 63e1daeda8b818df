//! Element-wise and reduction ops on f32 activations.

use crate::kernels::kernels;

/// `sum_i a[i] b[i]` in f32, through the dispatched SIMD kernel (the same one F32 matvec rows
/// use): several independent accumulators with a fixed reduction order, so the result is
/// deterministic but may differ from a sequential sum within f32 rounding.
///
/// # Panics
/// If `a.len() != b.len()`.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot: length mismatch");
    (kernels().dot_f32)(a, b)
}

/// The four dot products `[a0·b0, a0·b1, a1·b0, a1·b1]`, each bit-identical to [`dot`] of that
/// pair on every SIMD level (on AVX-512 one pass that loads each vector once for two products;
/// elsewhere four `dot` calls). For attention scores: two query rows against two keys.
///
/// # Panics
/// If the four lengths differ.
pub fn dot_2x2(a0: &[f32], a1: &[f32], b0: &[f32], b1: &[f32]) -> [f32; 4] {
    let n = a0.len();
    assert!(
        a1.len() == n && b0.len() == n && b1.len() == n,
        "dot_2x2: length mismatch"
    );
    (kernels().dot_f32_2x2)(a0, a1, b0, b1)
}

/// `y[i] += alpha * x[i]` (BLAS saxpy), as a multiply then an add, bit-identical on every SIMD
/// level.
///
/// # Panics
/// If `x.len() != y.len()`.
pub fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), y.len(), "axpy: length mismatch");
    (kernels().axpy)(alpha, x, y)
}

/// RMSNorm as Hugging Face `LlamaRMSNorm`/`DeepseekV3RMSNorm` computes it in f32:
/// `out[i] = weight[i] * (x[i] * rsqrt(mean(x^2) + eps))` with `x, weight, out: [n]`
/// (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization"). The sum of squares uses
/// [`dot`]. An empty `x` is a no-op.
///
/// # Panics
/// If the three lengths differ.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    assert_eq!(x.len(), weight.len(), "rms_norm: weight length");
    assert_eq!(x.len(), out.len(), "rms_norm: out length");
    if x.is_empty() {
        return;
    }
    let inv = rms_inv(x, eps);
    for ((o, &xi), &wi) in out.iter_mut().zip(x).zip(weight) {
        *o = wi * (xi * inv);
    }
}

/// [`rms_norm`] writing back into `x: [n]`; same arithmetic, same bits.
///
/// # Panics
/// If `x.len() != weight.len()`.
pub fn rms_norm_inplace(x: &mut [f32], weight: &[f32], eps: f32) {
    assert_eq!(x.len(), weight.len(), "rms_norm_inplace: weight length");
    if x.is_empty() {
        return;
    }
    let inv = rms_inv(x, eps);
    for (xi, &wi) in x.iter_mut().zip(weight) {
        *xi = wi * (*xi * inv);
    }
}

#[inline]
fn rms_inv(x: &[f32], eps: f32) -> f32 {
    let mean_sq = dot(x, x) / x.len() as f32;
    1.0 / (mean_sq + eps).sqrt()
}

/// Softmax over `x: [n]` in place, in f32: `exp(x[i] - max) / sum_j exp(x[j] - max)`, the sum
/// taken in index order and each entry divided by it (as PyTorch does).
///
/// Edge cases: `-inf` entries become exactly 0 (use them as masks). A row that is empty or all
/// `-inf` (nothing may be attended) becomes all zeros rather than NaN, as a "safe softmax"
/// does. Any NaN, or a `+inf` entry, makes the whole row NaN.
pub fn softmax_inplace(x: &mut [f32]) {
    if x.iter().any(|v| v.is_nan()) {
        x.fill(f32::NAN);
        return;
    }
    let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    if max == f32::NEG_INFINITY {
        x.fill(0.0);
        return;
    }
    let mut sum = 0.0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    for v in x.iter_mut() {
        *v /= sum;
    }
}

/// SiLU (swish, Hendrycks & Gimpel 2016 / Ramachandran et al. 2017): `x / (1 + exp(-x))`,
/// the form PyTorch's CPU kernel evaluates.
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// Logistic sigmoid `1 / (1 + exp(-x))` in f32 (the `noaux_tc` router's score function);
/// saturates to exactly 0 and 1 for large |x|.
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Index of the largest entry of `x: [n]`, the first one on ties (greedy decoding). NaN entries
/// are never chosen; an empty or all-NaN `x` gives 0.
pub fn argmax(x: &[f32]) -> usize {
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in x.iter().enumerate() {
        if v.is_nan() {
            continue;
        }
        match best {
            Some((_, b)) if v <= b => {}
            _ => best = Some((i, v)),
        }
    }
    best.map_or(0, |(i, _)| i)
}
