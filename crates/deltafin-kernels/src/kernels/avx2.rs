//! The AVX2 level (AVX2 + FMA + F16C): 8-lane kernels and their token-tile products.

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
    /// Only reachable through the `AVX512` table (AVX-512F and AVX-512VL checked).
    pub fn dot_f32_2x2_vl(a0: &[f32], a1: &[f32], b0: &[f32], b1: &[f32]) -> [f32; 4] {
        unsafe { super::dot_f32_2x2_vl(a0, a1, b0, b1) }
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
    pub fn mx_mm(packed: &[u8], scales: &[u8], cols: usize, x: &[f32], n: usize, _: &[f32], yt: &mut [f32]) {
        super::mx_mm(packed, scales, cols, x, n, yt)
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

/// [`dot_f32`] of the four pairs `(a_i, b_j)` at once: per pair the same four 8-lane
/// accumulators over 32 elements, 8-wide steps into the first, `hsum((p0 + p1) + (p2 +
/// p3))` and the scalar tail, so each result equals `dot_f32(a_i, b_j)` bit for bit (the
/// product inside an FMA is commutative); each load serves two pairs. Compiled with
/// AVX-512VL for the 32 vector registers its 16 accumulators need.
#[target_feature(enable = "avx2,fma,avx512f,avx512vl")]
#[allow(clippy::needless_range_loop)] // q indexes the accumulators of all four pairs
unsafe fn dot_f32_2x2_vl(a0: &[f32], a1: &[f32], b0: &[f32], b1: &[f32]) -> [f32; 4] {
    let n = a0.len();
    assert!(a1.len() == n && b0.len() == n && b1.len() == n, "dot_f32_2x2: lengths");
    let (pa, pb) = ([a0.as_ptr(), a1.as_ptr()], [b0.as_ptr(), b1.as_ptr()]);
    // acc[2i + j][q]: pair (a_i, b_j), accumulator q.
    let mut acc = [[_mm256_setzero_ps(); 4]; 4];
    let mut k = 0usize;
    while k + 32 <= n {
        for q in 0..4 {
            let i = k + 8 * q;
            let va = [_mm256_loadu_ps(pa[0].add(i)), _mm256_loadu_ps(pa[1].add(i))];
            let vb = [_mm256_loadu_ps(pb[0].add(i)), _mm256_loadu_ps(pb[1].add(i))];
            for ia in 0..2 {
                for jb in 0..2 {
                    acc[2 * ia + jb][q] = _mm256_fmadd_ps(va[ia], vb[jb], acc[2 * ia + jb][q]);
                }
            }
        }
        k += 32;
    }
    while k + 8 <= n {
        let va = [_mm256_loadu_ps(pa[0].add(k)), _mm256_loadu_ps(pa[1].add(k))];
        let vb = [_mm256_loadu_ps(pb[0].add(k)), _mm256_loadu_ps(pb[1].add(k))];
        for ia in 0..2 {
            for jb in 0..2 {
                acc[2 * ia + jb][0] = _mm256_fmadd_ps(va[ia], vb[jb], acc[2 * ia + jb][0]);
            }
        }
        k += 8;
    }
    let (a, b) = ([a0, a1], [b0, b1]);
    let mut out = [0f32; 4];
    for ia in 0..2 {
        for jb in 0..2 {
            let p = &acc[2 * ia + jb];
            let mut s = hsum(_mm256_add_ps(_mm256_add_ps(p[0], p[1]), _mm256_add_ps(p[2], p[3])));
            for e in k..n {
                s += a[ia][e] * b[jb][e];
            }
            out[2 * ia + jb] = s;
        }
    }
    out
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

/// One 32-element block's doubled E2M1 values (exact small integers) as four 8-lane f32
/// vectors, elements 0..8, 8..16, 16..24, 24..32. `p` points at the block's 16 packed bytes.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn mx_decode(p: *const u8) -> [__m256; 4] {
    let tbl = _mm_loadu_si128(E2M1_X2.as_ptr() as *const __m128i);
    let m = _mm_set1_epi8(0x0F);
    let v = _mm_loadu_si128(p as *const __m128i);
    let lo = _mm_shuffle_epi8(tbl, _mm_and_si128(v, m));
    let hi = _mm_shuffle_epi8(tbl, _mm_and_si128(_mm_srli_epi16(v, 4), m));
    // Element 2i is the low nibble of byte i: interleave low and high codes.
    let e0 = _mm_unpacklo_epi8(lo, hi); // elements 0..16
    let e1 = _mm_unpackhi_epi8(lo, hi); // elements 16..32
    [
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(e0)),
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(e0, e0))),
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(e1)),
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(e1, e1))),
    ]
}

/// 8 lane sums of the decoded block `w` times its 32 activations at `x`.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn mx_apply(w: &[__m256; 4], x: *const f32) -> __m256 {
    let sa = _mm256_mul_ps(w[0], _mm256_loadu_ps(x));
    let sb = _mm256_mul_ps(w[1], _mm256_loadu_ps(x.add(8)));
    let sa = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(x.add(16)), sa);
    let sb = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(x.add(24)), sb);
    _mm256_add_ps(sa, sb)
}

/// One 32-element block: 8 lane sums of (2 * E2M1 value) * x. `p` points at the block's 16
/// packed bytes, `x` at its 32 activations.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn mx_block(p: *const u8, x: *const f32) -> __m256 {
    mx_apply(&mx_decode(p), x)
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

/// [`dot_mxfp4`] of one row (`p`: its packed bytes, `s`: its scale bytes) for the `T`
/// tokens `x + t * n` (each `[n]`) at once, over blocks `[b0, b1)`: each block decoded once,
/// then per token the same operations into the same accumulator as `dot_mxfp4` (full block
/// b into `a0` when b is even, else `a1`; a partial last block into `a1`). The accumulators
/// are carried in `st: [2 * T]` between segments; the last segment (b1 = blocks of the row)
/// writes `out[t] = hsum(a0 + a1)`.
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn mx_tile<const T: usize>(
    p: *const u8,
    s: *const u8,
    n: usize,
    x: *const f32,
    b0: usize,
    b1: usize,
    st: *mut __m256,
    out: *mut f32,
) {
    let full = n / BLOCK;
    let nb = n.div_ceil(BLOCK);
    let scale = |b: usize| _mm256_set1_ps(E8M0_HALF[*s.add(b) as usize]);
    let mut a0 = [_mm256_setzero_ps(); T];
    let mut a1 = [_mm256_setzero_ps(); T];
    if b0 > 0 {
        for t in 0..T {
            a0[t] = *st.add(2 * t);
            a1[t] = *st.add(2 * t + 1);
        }
    }
    for b in b0..b1.min(full) {
        let w = mx_decode(p.add(b * BLOCK_BYTES));
        let sc = scale(b);
        let acc = if b % 2 == 0 { &mut a0 } else { &mut a1 };
        for (t, at) in acc.iter_mut().enumerate() {
            *at = _mm256_fmadd_ps(mx_apply(&w, x.add(t * n + b * BLOCK)), sc, *at);
        }
    }
    if b1 < nb {
        for t in 0..T {
            *st.add(2 * t) = a0[t];
            *st.add(2 * t + 1) = a1[t];
        }
        return;
    }
    if full < nb {
        let w = mx_decode(p.add(full * BLOCK_BYTES));
        let sc = scale(full);
        for (t, at) in a1.iter_mut().enumerate() {
            let mut xpad = [0.0f32; BLOCK];
            std::ptr::copy_nonoverlapping(x.add(t * n + full * BLOCK), xpad.as_mut_ptr(), n - full * BLOCK);
            *at = _mm256_fmadd_ps(mx_apply(&w, xpad.as_ptr()), sc, *at);
        }
    }
    for t in 0..T {
        *out.add(t) = hsum(_mm256_add_ps(a0[t], a1[t]));
    }
}

/// Tokens per MXFP4 tile (16 registers: 4 decoded vectors, 2 accumulators per token).
const MX_TILE: usize = 6;

/// [`super::MxMm`] for this level: [`mx_tile`] over row blocks, token tiles and segments.
pub(super) fn mx_mm(packed: &[u8], scales: &[u8], n: usize, x: &[f32], nt: usize, yt: &mut [f32]) {
    let (pb, sb) = (crate::mxfp4::packed_row_bytes(n), crate::mxfp4::scale_row_bytes(n));
    let rows = super::mx_mm_rows_of(packed.len(), scales.len(), n, x.len(), nt, yt.len());
    let nb = sb;
    let seg = (super::SEG_X_BYTES / (4 * MX_TILE) / BLOCK).max(1);
    // SAFETY (all `unsafe` below): lengths checked above; the level's table is handed out
    // only after the run-time AVX2/FMA check.
    let mut st = vec![
        unsafe { _mm256_setzero_ps() };
        if nb > seg {
            2 * MX_TILE * super::row_block(rows, pb)
        } else {
            0
        }
    ];
    let (pp, sp, xp, yp, stp) = (
        packed.as_ptr(),
        scales.as_ptr(),
        x.as_ptr(),
        yt.as_mut_ptr(),
        st.as_mut_ptr(),
    );
    super::for_tiles(rows, nt, MX_TILE, pb, nb, seg, |i, r, t0, tn, b0, b1| unsafe {
        let out = if b1 == nb {
            yp.add(r * nt + t0)
        } else {
            std::ptr::null_mut()
        };
        let str = if st.is_empty() { stp } else { stp.add(2 * MX_TILE * i) };
        by_tile!(
            tn,
            mx_tile(pp.add(r * pb), sp.add(r * sb), n, xp.add(t0 * n), b0, b1, str, out)
        )
    });
}

/// Same arithmetic as the portable `axpy` (no FMA contraction), at AVX2 width.
#[target_feature(enable = "avx2,fma")]
unsafe fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), y.len());
    for (yi, &xi) in y.iter_mut().zip(x) {
        *yi += alpha * xi;
    }
}

/// The main loop of the AVX2 level's `dot4!` over elements `[k, $k1)` for the `T` tokens
/// `x + t * cols` at once, on the accumulators `a: [[__m256; 4]; T]`: each 8-weight vector
/// `$load` is decoded once and fed to every token's own accumulators, in exactly the order
/// `dot4!` uses for one token. Advances `k`.
macro_rules! dot4_tile {
    ($a:ident, $k:ident, $k1:expr, $x:expr, $cols:expr, |$i:ident| $load:expr) => {{
        let k1: usize = $k1;
        let x: *const f32 = $x;
        let cols: usize = $cols;
        while $k + 32 <= k1 {
            for j in 0..4 {
                let $i = $k + 8 * j;
                let w = $load;
                for (t, at) in $a.iter_mut().enumerate() {
                    at[j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x.add(t * cols + $i)), at[j]);
                }
            }
            $k += 32;
        }
    }};
}

/// Token-tile products ([`super::Mm`]) for f32, bf16, f16 and int8 with the AVX2 kernels' arithmetic,
/// compiled for `$feat` with tiles of up to `$tile` tokens.
macro_rules! dot_tile_level {
    ($name:ident, $feat:literal, $tile:literal) => {
        pub(super) mod $name {
            // The AVX2 level's `hsum` (`$feat` includes its features, so it inlines).
            use super::hsum;
            use crate::kernels::{for_tiles, mm_rows_of, row_block, SEG_X_BYTES};
            use half::{bf16, f16};
            use std::arch::x86_64::*;

            /// Tokens per tile.
            const TILE: usize = $tile;

            /// One row `w: [cols]` against tokens `x + t * cols` over elements `[k0, k1)`
            /// (k0, and k1 unless it is `cols`, multiples of 32), partial sums carried in `st:
            /// [4 * T]` between segments; the last segment (k1 = cols) finishes as the level's
            /// `dot_*` does (8-wide steps into the first accumulator, `hsum((a0 + a1) + (a2 +
            /// a3))`, the scalar tail in order) and writes `out[t]`.
            macro_rules! tile_fn {
                ($fname:ident, $W:ty, |$w:ident, $i:ident| $load:expr, |$v:ident| $scalar:expr) => {
                    #[target_feature(enable = $feat)]
                    unsafe fn $fname<const T: usize>(
                        $w: *const $W,
                        cols: usize,
                        x: *const f32,
                        k0: usize,
                        k1: usize,
                        st: *mut __m256,
                        out: *mut f32,
                    ) {
                        let mut a = [[_mm256_setzero_ps(); 4]; T];
                        if k0 > 0 {
                            for (t, at) in a.iter_mut().enumerate() {
                                for (j, v) in at.iter_mut().enumerate() {
                                    *v = *st.add(4 * t + j);
                                }
                            }
                        }
                        let mut k = k0;
                        dot4_tile!(a, k, k1, x, cols, |$i| $load);
                        if k1 < cols {
                            for (t, at) in a.iter().enumerate() {
                                for (j, v) in at.iter().enumerate() {
                                    *st.add(4 * t + j) = *v;
                                }
                            }
                            return;
                        }
                        while k + 8 <= cols {
                            let $i = k;
                            let w = $load;
                            for (t, at) in a.iter_mut().enumerate() {
                                at[0] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x.add(t * cols + $i)), at[0]);
                            }
                            k += 8;
                        }
                        for (t, at) in a.iter().enumerate() {
                            let mut acc = hsum(_mm256_add_ps(
                                _mm256_add_ps(at[0], at[1]),
                                _mm256_add_ps(at[2], at[3]),
                            ));
                            for i in k..cols {
                                let $v = *$w.add(i);
                                acc += $scalar * *x.add(t * cols + i);
                            }
                            *out.add(t) = acc;
                        }
                    }
                };
            }

            tile_fn!(tile_f32, f32, |w, i| _mm256_loadu_ps(w.add(i)), |v| v);
            tile_fn!(
                tile_bf16,
                u16,
                |w, i| _mm256_castsi256_ps(_mm256_slli_epi32(
                    _mm256_cvtepu16_epi32(_mm_loadu_si128(w.add(i) as *const __m128i)),
                    16
                )),
                |v| f32::from_bits((v as u32) << 16)
            );
            tile_fn!(
                tile_f16,
                u16,
                |w, i| _mm256_cvtph_ps(_mm_loadu_si128(w.add(i) as *const __m128i)),
                |v| f16::from_bits(v).to_f32()
            );
            tile_fn!(
                tile_i8,
                i8,
                |w, i| _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(w.add(i) as *const __m128i))),
                |v| v as f32
            );

            // Safe entry points: only reachable through the level's table, which `detect` hands
            // out after checking the CPU features `$feat` names; that check is the safety
            // argument for the `unsafe` calls. Bounds: `mm_rows_of` checks every length, each
            // tile reads row `r < rows` and tokens `t0 + tn <= n`.
            macro_rules! mm_fn {
                ($mname:ident, $W:ty, $P:ty, $tname:ident) => {
                    pub(in crate::kernels) fn $mname(w: &[$W], cols: usize, x: &[f32], n: usize, yt: &mut [f32]) {
                        let rows = mm_rows_of(w.len(), cols, x.len(), n, yt.len());
                        let (wp, xp, yp) = (w.as_ptr() as *const $P, x.as_ptr(), yt.as_mut_ptr());
                        let rb = cols * std::mem::size_of::<$W>();
                        let seg = (SEG_X_BYTES / (4 * TILE) / 32 * 32).max(32);
                        // Partial sums of the block's rows between segments.
                        let mut st = vec![
                            unsafe { _mm256_setzero_ps() };
                            if cols > seg {
                                4 * TILE * row_block(rows, rb)
                            } else {
                                0
                            }
                        ];
                        let sp = st.as_mut_ptr();
                        for_tiles(
                            rows,
                            n,
                            TILE,
                            rb,
                            cols,
                            seg,
                            |i, r, t0, tn, k0, k1| unsafe {
                                let out = if k1 == cols {
                                    yp.add(r * n + t0)
                                } else {
                                    std::ptr::null_mut()
                                };
                                let s = if st.is_empty() {
                                    sp
                                } else {
                                    sp.add(4 * TILE * i)
                                };
                                by_tile!(
                                    tn,
                                    $tname(wp.add(r * cols), cols, xp.add(t0 * cols), k0, k1, s, out)
                                )
                            },
                        );
                    }
                };
            }
            mm_fn!(mm_f32, f32, f32, tile_f32);
            mm_fn!(mm_bf16, bf16, u16, tile_bf16);
            mm_fn!(mm_f16, f16, u16, tile_f16);
            mm_fn!(mm_i8, i8, i8, tile_i8);
        }
    };
}

dot_tile_level!(tiles, "avx2,fma,f16c", 3);
