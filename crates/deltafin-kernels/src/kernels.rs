//! Per-row inner kernels and their run-time dispatch.
//!
//! Each kernel computes one output element with one fixed sequence of operations, so the
//! callers may split rows across threads in any way without changing a bit of the result.
//! The level is detected once ([`simd_level`]); every matvec, matmul and [`crate::dot`] then uses
//! the same kernel, which is what makes `matmul` equal `n` matvecs bit for bit.

use half::{bf16, f16};
use std::sync::OnceLock;

/// Instruction-set level the kernels run at, chosen once per process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SimdLevel {
    /// Plain Rust with independent accumulators (auto-vectorized for the baseline target).
    Portable,
    /// x86-64 AVX2 + FMA + F16C intrinsics.
    Avx2,
}

/// The level in use: AVX2 when the CPU has AVX2, FMA and F16C, else portable. Setting the
/// environment variable `DELTAFIN_KERNELS_SIMD=portable` before the first kernel call forces the
/// portable path (for debugging and benchmarks).
///
/// AVX-512 is not used: its intrinsics need Rust 1.89 and the workspace pins `rust-version`
/// 1.85.
pub fn simd_level() -> SimdLevel {
    kernels().level
}

/// One row kernel per weight format, plus `axpy`.
pub(crate) struct Kernels {
    pub level: SimdLevel,
    /// `sum_i w[i] x[i]`, `w.len() == x.len()`.
    pub dot_f32: fn(&[f32], &[f32]) -> f32,
    pub dot_bf16: fn(&[bf16], &[f32]) -> f32,
    pub dot_f16: fn(&[f16], &[f32]) -> f32,
    /// Unscaled `sum_i q[i] x[i]`; the caller multiplies by the row scale.
    pub dot_i8: fn(&[i8], &[f32]) -> f32,
    /// One MXFP4 row: `packed: [packed_row_bytes(n)]`, `scales: [scale_row_bytes(n)]`,
    /// `x: [n]`.
    pub dot_mxfp4: fn(&[u8], &[u8], &[f32]) -> f32,
    /// `y[i] = y[i] + alpha * x[i]` (a multiply then an add: identical on every level).
    pub axpy: fn(f32, &[f32], &mut [f32]),
}

static PORTABLE: Kernels = Kernels {
    level: SimdLevel::Portable,
    dot_f32: portable::dot_f32,
    dot_bf16: portable::dot_bf16,
    dot_f16: portable::dot_f16,
    dot_i8: portable::dot_i8,
    dot_mxfp4: portable::dot_mxfp4,
    axpy: portable::axpy,
};

#[cfg(target_arch = "x86_64")]
static AVX2: Kernels = Kernels {
    level: SimdLevel::Avx2,
    dot_f32: avx2::safe::dot_f32,
    dot_bf16: avx2::safe::dot_bf16,
    dot_f16: avx2::safe::dot_f16,
    dot_i8: avx2::safe::dot_i8,
    dot_mxfp4: avx2::safe::dot_mxfp4,
    axpy: avx2::safe::axpy,
};

static SELECTED: OnceLock<&'static Kernels> = OnceLock::new();

#[inline]
pub(crate) fn kernels() -> &'static Kernels {
    SELECTED.get_or_init(detect)
}

fn detect() -> &'static Kernels {
    if std::env::var("DELTAFIN_KERNELS_SIMD").is_ok_and(|v| v.eq_ignore_ascii_case("portable")) {
        return &PORTABLE;
    }
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c") {
            return &AVX2;
        }
    }
    &PORTABLE
}

/// `2^(s-128)`: the E8M0 scale halved, for kernels that hold E2M1 values doubled (as the
/// integers {0, 1, 2, 3, 4, 6, 8, 12}). Index 255 is NaN.
static E8M0_HALF: [f32; 256] = {
    let mut t = [0.0f32; 256];
    let mut s = 0;
    while s < 256 {
        t[s] = match s {
            255 => f32::NAN,
            0 => f32::from_bits(0x0020_0000), // 2^-128
            1 => f32::from_bits(0x0040_0000), // 2^-127
            _ => f32::from_bits(((s - 1) as u32) << 23),
        };
        s += 1;
    }
    t
};

/// Doubled E2M1 values by nibble, as i8 (exact: every E2M1 value times 2 is an integer).
const E2M1_X2: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// Plain Rust kernels: 8 independent lanes per accumulator, which LLVM vectorizes for the
/// baseline target (SSE2 on x86-64, NEON on aarch64).
pub(crate) mod portable {
    use super::{bf16, f16, E2M1_X2, E8M0_HALF};
    use crate::mxfp4::{BLOCK, BLOCK_BYTES};

    const L: usize = 8;

    /// Lane-parallel dot product with a fixed reduction order: lanes, then a pairwise tree over
    /// the 8 lane sums, then the tail in order.
    #[inline(always)]
    fn dot_with<T: Copy>(w: &[T], x: &[f32], f: impl Fn(T) -> f32) -> f32 {
        assert_eq!(w.len(), x.len());
        let mut acc = [0.0f32; L];
        let wc = w.chunks_exact(L);
        let xc = x.chunks_exact(L);
        let (wt, xt) = (wc.remainder(), xc.remainder());
        for (wc, xc) in wc.zip(xc) {
            for i in 0..L {
                acc[i] += f(wc[i]) * xc[i];
            }
        }
        let mut s = reduce8(acc);
        for (&a, &b) in wt.iter().zip(xt) {
            s += f(a) * b;
        }
        s
    }

    #[inline(always)]
    fn reduce8(a: [f32; 8]) -> f32 {
        ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
    }

    pub fn dot_f32(w: &[f32], x: &[f32]) -> f32 {
        dot_with(w, x, |v| v)
    }

    pub fn dot_bf16(w: &[bf16], x: &[f32]) -> f32 {
        dot_with(w, x, |v| f32::from_bits((v.to_bits() as u32) << 16))
    }

    pub fn dot_f16(w: &[f16], x: &[f32]) -> f32 {
        dot_with(w, x, f16::to_f32)
    }

    pub fn dot_i8(q: &[i8], x: &[f32]) -> f32 {
        dot_with(q, x, |v| v as f32)
    }

    /// Per block: 8 lane sums of doubled E2M1 values times x, then `lanes += block * scale/2`.
    pub fn dot_mxfp4(packed: &[u8], scales: &[u8], x: &[f32]) -> f32 {
        let n = x.len();
        let nb = n.div_ceil(BLOCK);
        assert!(packed.len() >= nb * BLOCK_BYTES && scales.len() >= nb);
        let mut acc = [0.0f32; L];
        let mut xpad = [0.0f32; BLOCK];
        for b in 0..nb {
            let xb = if (b + 1) * BLOCK <= n {
                &x[b * BLOCK..(b + 1) * BLOCK]
            } else {
                // Partial last block: its padding nibbles meet zeros.
                xpad[..n - b * BLOCK].copy_from_slice(&x[b * BLOCK..]);
                &xpad[..]
            };
            let bytes = &packed[b * BLOCK_BYTES..(b + 1) * BLOCK_BYTES];
            let mut w = [0.0f32; BLOCK];
            for (i, &byte) in bytes.iter().enumerate() {
                w[2 * i] = E2M1_X2[(byte & 0x0F) as usize] as f32;
                w[2 * i + 1] = E2M1_X2[(byte >> 4) as usize] as f32;
            }
            let mut blk = [0.0f32; L];
            for g in 0..BLOCK / L {
                for i in 0..L {
                    blk[i] += w[g * L + i] * xb[g * L + i];
                }
            }
            let scale = E8M0_HALF[scales[b] as usize];
            for i in 0..L {
                acc[i] += blk[i] * scale;
            }
        }
        reduce8(acc)
    }

    pub fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
        assert_eq!(x.len(), y.len());
        for (yi, &xi) in y.iter_mut().zip(x) {
            *yi += alpha * xi;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{bf16, f16, E2M1_X2, E8M0_HALF};
    use crate::mxfp4::{BLOCK, BLOCK_BYTES};
    use std::arch::x86_64::*;

    /// Safe entry points. Only reachable through the `AVX2` table, which `detect` hands out
    /// after checking AVX2, FMA and F16C at run time; that check is the safety argument for
    /// every `unsafe` call below.
    pub(super) mod safe {
        use super::*;

        pub fn dot_f32(w: &[f32], x: &[f32]) -> f32 {
            unsafe { super::dot_f32(w, x) }
        }
        pub fn dot_bf16(w: &[bf16], x: &[f32]) -> f32 {
            unsafe { super::dot_bf16(w, x) }
        }
        pub fn dot_f16(w: &[f16], x: &[f32]) -> f32 {
            unsafe { super::dot_f16(w, x) }
        }
        pub fn dot_i8(q: &[i8], x: &[f32]) -> f32 {
            unsafe { super::dot_i8(q, x) }
        }
        pub fn dot_mxfp4(packed: &[u8], scales: &[u8], x: &[f32]) -> f32 {
            unsafe { super::dot_mxfp4(packed, scales, x) }
        }
        pub fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
            unsafe { super::axpy(alpha, x, y) }
        }
    }

    /// Horizontal sum in a fixed order: high half + low half, then pairs.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 0b01));
        _mm_cvtss_f32(s)
    }

    /// Four 8-lane accumulators over 32 elements per step, then 8 per step into the first, then
    /// `(a0 + a1) + (a2 + a3)` summed horizontally. `$load(i)` yields 8 weights from index `i`.
    /// Evaluates to `(sum, elements consumed)`; the caller adds the scalar tail.
    macro_rules! dot4 {
        ($n:expr, $x:expr, |$i:ident| $load:expr) => {{
            let n: usize = $n;
            let xp: *const f32 = $x.as_ptr();
            let mut a0 = _mm256_setzero_ps();
            let mut a1 = _mm256_setzero_ps();
            let mut a2 = _mm256_setzero_ps();
            let mut a3 = _mm256_setzero_ps();
            let mut k = 0usize;
            while k + 32 <= n {
                let $i = k;
                a0 = _mm256_fmadd_ps($load, _mm256_loadu_ps(xp.add($i)), a0);
                let $i = k + 8;
                a1 = _mm256_fmadd_ps($load, _mm256_loadu_ps(xp.add($i)), a1);
                let $i = k + 16;
                a2 = _mm256_fmadd_ps($load, _mm256_loadu_ps(xp.add($i)), a2);
                let $i = k + 24;
                a3 = _mm256_fmadd_ps($load, _mm256_loadu_ps(xp.add($i)), a3);
                k += 32;
            }
            while k + 8 <= n {
                let $i = k;
                a0 = _mm256_fmadd_ps($load, _mm256_loadu_ps(xp.add($i)), a0);
                k += 8;
            }
            let s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
            (s, k)
        }};
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn dot_f32(w: &[f32], x: &[f32]) -> f32 {
        assert_eq!(w.len(), x.len());
        let wp = w.as_ptr();
        let (mut s, k) = dot4!(w.len(), x, |i| _mm256_loadu_ps(wp.add(i)));
        for i in k..w.len() {
            s += w[i] * x[i];
        }
        s
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn dot_bf16(w: &[bf16], x: &[f32]) -> f32 {
        assert_eq!(w.len(), x.len());
        let wp = w.as_ptr() as *const u16;
        // bf16 is the high half of an f32: widen to 32 bits and shift left by 16.
        let (mut s, k) = dot4!(w.len(), x, |i| _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128(wp.add(i) as *const __m128i)),
            16
        )));
        for i in k..w.len() {
            s += f32::from_bits((w[i].to_bits() as u32) << 16) * x[i];
        }
        s
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_f16(w: &[f16], x: &[f32]) -> f32 {
        assert_eq!(w.len(), x.len());
        let wp = w.as_ptr() as *const u16;
        let (mut s, k) = dot4!(w.len(), x, |i| _mm256_cvtph_ps(_mm_loadu_si128(
            wp.add(i) as *const __m128i
        )));
        for i in k..w.len() {
            s += w[i].to_f32() * x[i];
        }
        s
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn dot_i8(q: &[i8], x: &[f32]) -> f32 {
        assert_eq!(q.len(), x.len());
        let qp = q.as_ptr();
        let (mut s, k) = dot4!(q.len(), x, |i| _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
            _mm_loadl_epi64(qp.add(i) as *const __m128i)
        )));
        for i in k..q.len() {
            s += q[i] as f32 * x[i];
        }
        s
    }

    /// One 32-element block: 8 lane sums of (2 * E2M1 value) * x. `p` points at the block's 16
    /// packed bytes, `x` at its 32 activations.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn mx_block(p: *const u8, x: *const f32) -> __m256 {
        let tbl = _mm_loadu_si128(E2M1_X2.as_ptr() as *const __m128i);
        let m = _mm_set1_epi8(0x0F);
        let v = _mm_loadu_si128(p as *const __m128i);
        let lo = _mm_shuffle_epi8(tbl, _mm_and_si128(v, m));
        let hi = _mm_shuffle_epi8(tbl, _mm_and_si128(_mm_srli_epi16(v, 4), m));
        // Element 2i is the low nibble of byte i: interleave low and high codes.
        let e0 = _mm_unpacklo_epi8(lo, hi); // elements 0..16
        let e1 = _mm_unpackhi_epi8(lo, hi); // elements 16..32
        let w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(e0));
        let w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(e0, e0)));
        let w2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(e1));
        let w3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(e1, e1)));
        let sa = _mm256_mul_ps(w0, _mm256_loadu_ps(x));
        let sb = _mm256_mul_ps(w1, _mm256_loadu_ps(x.add(8)));
        let sa = _mm256_fmadd_ps(w2, _mm256_loadu_ps(x.add(16)), sa);
        let sb = _mm256_fmadd_ps(w3, _mm256_loadu_ps(x.add(24)), sb);
        _mm256_add_ps(sa, sb)
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn dot_mxfp4(packed: &[u8], scales: &[u8], x: &[f32]) -> f32 {
        let n = x.len();
        let full = n / BLOCK;
        let nb = n.div_ceil(BLOCK);
        assert!(packed.len() >= nb * BLOCK_BYTES && scales.len() >= nb);
        let (pp, xp) = (packed.as_ptr(), x.as_ptr());
        let scale = |b: usize| _mm256_set1_ps(E8M0_HALF[*scales.get_unchecked(b) as usize]);
        let mut a0 = _mm256_setzero_ps();
        let mut a1 = _mm256_setzero_ps();
        let mut b = 0;
        while b + 2 <= full {
            let s0 = mx_block(pp.add(b * BLOCK_BYTES), xp.add(b * BLOCK));
            let s1 = mx_block(pp.add((b + 1) * BLOCK_BYTES), xp.add((b + 1) * BLOCK));
            a0 = _mm256_fmadd_ps(s0, scale(b), a0);
            a1 = _mm256_fmadd_ps(s1, scale(b + 1), a1);
            b += 2;
        }
        if b < full {
            let s0 = mx_block(pp.add(b * BLOCK_BYTES), xp.add(b * BLOCK));
            a0 = _mm256_fmadd_ps(s0, scale(b), a0);
            b += 1;
        }
        if b < nb {
            // Partial last block: its padding nibbles meet zeros.
            let mut xpad = [0.0f32; BLOCK];
            xpad[..n - b * BLOCK].copy_from_slice(&x[b * BLOCK..]);
            let s1 = mx_block(pp.add(b * BLOCK_BYTES), xpad.as_ptr());
            a1 = _mm256_fmadd_ps(s1, scale(b), a1);
        }
        hsum(_mm256_add_ps(a0, a1))
    }

    /// Same arithmetic as the portable `axpy` (no FMA contraction), at AVX2 width.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
        assert_eq!(x.len(), y.len());
        for (yi, &xi) in y.iter_mut().zip(x) {
            *yi += alpha * xi;
        }
    }
}

/// Both levels side by side, for tests that pit each against the scalar reference.
#[cfg(test)]
pub(crate) fn all_levels() -> Vec<&'static Kernels> {
    #[allow(unused_mut)]
    let mut v = vec![&PORTABLE];
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c") {
        v.push(&AVX2);
    }
    v
}
