//! Attention tiles: the inner loops of blocked (many-query) attention in the engine
//! (`deltafin-engine/src/blocked_attention.rs`), where a tile of query rows meets a block of
//! cached keys and values.
//!
//! - [`qk_block`]: scores of up to [`DRB`] query rows against a block of transposed keys, each an
//!   FMA chain in ascending head dimension from 0, then times the scale;
//! - [`pv_block`]: probability-weighted sums of value rows, each element an FMA chain in
//!   ascending position from 0;
//! - [`accumulate4`]: four rows of `ctx += p_t · v_t` as a multiply then an add in ascending
//!   position: the exact sequence of [`crate::axpy`] calls it replaces.
//!
//! Each is plain Rust compiled once per SIMD level (AVX-512F + FMA, AVX2 + FMA, portable) and
//! chosen by the kernels' level switch ([`crate::simd_level`], capped by `--simd`); the compiler
//! vectorises the independent lanes, and every level performs the same operations in the same
//! order, so the bits do not depend on the level. The scalar references are in
//! [`crate::reference`] (`qk_block`, `pv_block`, `accumulate4`) and every level is tested
//! against them bit for bit.

use crate::SimdLevel;

/// Keys per score block of [`qk_block`] (its lanes).
pub const DKB: usize = 32;

/// Most query rows one [`qk_block`] or [`pv_block`] call takes (its register block).
pub const DRB: usize = 4;

/// Lanes of [`pv_block`]'s value columns: `vd_pad` must be a multiple of it.
pub const PV_LANES: usize = 16;

/// Value vectors at a fixed stride: position `t`'s is `data[t * stride + offset ..][..width]`
/// (GQA: one key/value head's slice of `[n_tokens, n_kv_heads * head_dim]`; MLA: the latents
/// `[n_tokens, kv_lora_rank]`).
#[derive(Debug, Clone, Copy)]
pub struct Values<'a> {
    pub data: &'a [f32],
    pub stride: usize,
    pub offset: usize,
    pub width: usize,
}

impl<'a> Values<'a> {
    /// Position `t`'s vector `[width]`.
    ///
    /// # Panics
    /// If it lies outside `data`.
    #[inline]
    pub fn row(&self, t: usize) -> &'a [f32] {
        let o = t * self.stride + self.offset;
        &self.data[o..o + self.width]
    }
}

/// `pub fn $name(args)` running `$body(args)` at the kernels' SIMD level, and `$at(level, args)`
/// at a given level (a level the CPU lacks runs the next lower one): `$body` is
/// `#[inline(always)]` scalar code compiled for AVX-512F + FMA, AVX2 + FMA and the baseline.
macro_rules! by_level {
    ($(#[$m:meta])* pub fn $name:ident / $at:ident($($a:ident: $t:ty),* $(,)?) => $body:ident) => {
        $(#[$m])*
        pub fn $name($($a: $t),*) {
            $at(crate::simd_level(), $($a),*)
        }

        #[allow(clippy::too_many_arguments)]
        pub(crate) fn $at(level: SimdLevel, $($a: $t),*) {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,fma")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn v512($($a: $t),*) {
                    $body($($a),*)
                }
                #[target_feature(enable = "avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn v256($($a: $t),*) {
                    $body($($a),*)
                }
                let fma = std::arch::is_x86_feature_detected!("fma");
                if level == SimdLevel::Avx512 && fma && std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: the features were detected at run time just above.
                    return unsafe { v512($($a),*) };
                }
                if level != SimdLevel::Portable && fma && std::arch::is_x86_feature_detected!("avx2") {
                    // SAFETY: as above.
                    return unsafe { v256($($a),*) };
                }
            }
            let _ = level;
            $body($($a),*)
        }
    };
}

by_level! {
    /// Scores of `rn ≤ DRB` query rows `q: [rn, dk]` against keys `0..w` of `kt: [dk, n_pad]`
    /// (transposed keys): `s[r · wpad + t] = (Σ_d q[r][d] · k_t[d]) · scale`, each sum an FMA
    /// chain in ascending `d` starting from 0; keys `w..` up to the next multiple of [`DKB`] are
    /// computed too (padding, `n_pad` and `wpad` cover them).
    ///
    /// # Panics
    /// If `rn > DRB`, `n_pad` or `wpad` is below `w` rounded up to [`DKB`], or a slice is short.
    #[allow(clippy::too_many_arguments)]
    pub fn qk_block / qk_block_at(q: &[f32], dk: usize, kt: &[f32], n_pad: usize, w: usize, wpad: usize, scale: f32, s: &mut [f32]) => qk_block_body
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn qk_block_body(q: &[f32], dk: usize, kt: &[f32], n_pad: usize, w: usize, wpad: usize, scale: f32, s: &mut [f32]) {
    let rn = q.len() / dk.max(1);
    assert!(rn <= DRB && w <= n_pad && w <= wpad && s.len() >= rn * wpad && kt.len() >= dk * n_pad);
    let mut k0 = 0;
    while k0 < w {
        let acc = fma_rows::<DKB>(q, dk, rn, kt, n_pad, k0, dk);
        for (r, a) in acc.iter().enumerate().take(rn) {
            for (dst, &x) in s[r * wpad + k0..r * wpad + k0 + DKB].iter_mut().zip(a) {
                *dst = x * scale;
            }
        }
        k0 += DKB;
    }
}

by_level! {
    /// `ctx[r · vd_pad + j] = Σ_{t < w} p[r · wpad + t] · v[t · vd_pad + j]` for `rn ≤ DRB` rows,
    /// `v: [w.., vd_pad]`, `ctx: [rn, vd_pad]` (overwritten); each element an FMA chain in
    /// ascending `t` from 0.
    ///
    /// # Panics
    /// If `rn > DRB`, `vd_pad` is not a multiple of [`PV_LANES`], or a slice is short.
    pub fn pv_block / pv_block_at(p: &[f32], wpad: usize, rn: usize, v: &[f32], vd_pad: usize, w: usize, ctx: &mut [f32]) => pv_block_body
}

#[inline(always)]
fn pv_block_body(p: &[f32], wpad: usize, rn: usize, v: &[f32], vd_pad: usize, w: usize, ctx: &mut [f32]) {
    const VB: usize = PV_LANES;
    assert!(rn <= DRB && w <= wpad && p.len() >= rn * wpad && v.len() >= w * vd_pad && vd_pad.is_multiple_of(VB));
    assert_eq!(ctx.len(), rn * vd_pad);
    let mut j = 0;
    // Four 16-lane blocks per pass where the width allows (16 accumulators), else one.
    while j + 4 * VB <= vd_pad {
        pv_lanes::<{ 4 * VB }>(p, wpad, rn, v, vd_pad, w, j, ctx);
        j += 4 * VB;
    }
    while j < vd_pad {
        pv_lanes::<VB>(p, wpad, rn, v, vd_pad, w, j, ctx);
        j += VB;
    }
}

/// [`pv_block_body`] for value elements `j..j + L`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn pv_lanes<const L: usize>(
    p: &[f32],
    wpad: usize,
    rn: usize,
    v: &[f32],
    vd_pad: usize,
    w: usize,
    j: usize,
    ctx: &mut [f32],
) {
    let acc = fma_rows::<L>(p, wpad, rn, v, vd_pad, j, w);
    for (r, a) in acc.iter().enumerate().take(rn) {
        ctx[r * vd_pad + j..r * vd_pad + j + L].copy_from_slice(a);
    }
}

/// `acc[r][i] = Σ_{t < n} a[r · a_stride + t] · b[t · b_stride + off + i]` for rows `r < rn`
/// (rows `rn..DRB` stay 0) and lanes `i < L`, each element an FMA chain in ascending `t` from 0:
/// the scores of [`qk_block_body`] (`a` the queries, `b` the transposed keys) and the sums of
/// [`pv_lanes`] (`a` the probabilities, `b` the values).
///
/// # Panics
/// If `rn > DRB` or a slice is short.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn fma_rows<const L: usize>(
    a: &[f32],
    a_stride: usize,
    rn: usize,
    b: &[f32],
    b_stride: usize,
    off: usize,
    n: usize,
) -> [[f32; L]; DRB] {
    let mut acc = [[0f32; L]; DRB];
    for t in 0..n {
        let bt: &[f32; L] = b[t * b_stride + off..t * b_stride + off + L]
            .try_into()
            .expect("L lanes");
        for (r, row) in acc.iter_mut().enumerate().take(rn) {
            let ar = a[r * a_stride + t];
            for (x, &y) in row.iter_mut().zip(bt) {
                *x = ar.mul_add(y, *x);
            }
        }
    }
    acc
}

by_level! {
    /// `ctx[i] += Σ_{t ∈ a..b} p[i][t - s] · values.row(t)` for four rows `ctx: [4, width]`,
    /// every element accumulated in ascending `t` as a multiply then an add: exactly the
    /// sequence of [`crate::axpy`] calls it replaces (multiply, then add, on every SIMD level),
    /// so the bits are the same; each value load serves the four rows (Rust never fuses
    /// `a * b + c`, so no level contracts it).
    ///
    /// # Panics
    /// If `ctx` is not `[4, width]` or a `p[i]` does not cover `a - s .. b - s`.
    pub fn accumulate4 / accumulate4_at(p: [&[f32]; 4], values: &Values<'_>, s: usize, a: usize, b: usize, ctx: &mut [f32]) => accumulate4_body
}

#[inline(always)]
fn accumulate4_body(p: [&[f32]; 4], values: &Values<'_>, s: usize, a: usize, b: usize, ctx: &mut [f32]) {
    const CB: usize = 16;
    let dv = values.width;
    assert_eq!(ctx.len(), 4 * dv);
    for pi in &p {
        assert!(b <= s + pi.len() && a >= s);
    }
    let mut j = 0;
    while j + CB <= dv {
        let mut acc = [[0f32; CB]; 4];
        for (i, ai) in acc.iter_mut().enumerate() {
            ai.copy_from_slice(&ctx[i * dv + j..i * dv + j + CB]);
        }
        for t in a..b {
            let v: &[f32; CB] = values.row(t)[j..j + CB].try_into().expect("CB columns");
            let ps = [p[0][t - s], p[1][t - s], p[2][t - s], p[3][t - s]];
            for (ai, &pi) in acc.iter_mut().zip(&ps) {
                for k in 0..CB {
                    ai[k] += pi * v[k];
                }
            }
        }
        for (i, ai) in acc.iter().enumerate() {
            ctx[i * dv + j..i * dv + j + CB].copy_from_slice(ai);
        }
        j += CB;
    }
    for jj in j..dv {
        for (i, pi) in p.iter().enumerate() {
            let mut x = ctx[i * dv + jj];
            for t in a..b {
                x += pi[t - s] * values.row(t)[jj];
            }
            ctx[i * dv + jj] = x;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    fn levels() -> Vec<SimdLevel> {
        vec![SimdLevel::Portable, SimdLevel::Avx2, SimdLevel::Avx512]
    }

    fn rand_vec(rng: &mut StdRng, n: usize) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    fn same_bits(a: &[f32], b: &[f32]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
    }

    /// Every level's tiles equal the scalar references bit for bit, on head dimensions, row
    /// counts and key counts that are not multiples of the blocks.
    #[test]
    fn every_level_equals_the_references() {
        let mut rng = StdRng::seed_from_u64(29);
        for &(dk, rn, w) in &[
            (1usize, 1usize, 1usize),
            (33, 3, 31),
            (64, 4, 64),
            (576, 2, 97),
            (128, 4, 130),
        ] {
            let n_pad = w.div_ceil(DKB) * DKB;
            let wpad = n_pad + 8;
            let q = rand_vec(&mut rng, rn * dk);
            let kt = rand_vec(&mut rng, dk * n_pad);
            let mut want = vec![f32::NAN; rn * wpad];
            reference::qk_block(&q, dk, &kt, n_pad, w, wpad, 0.125, &mut want);
            for level in levels() {
                let mut got = vec![f32::NAN; rn * wpad];
                qk_block_at(level, &q, dk, &kt, n_pad, w, wpad, 0.125, &mut got);
                assert!(same_bits(&got, &want), "qk_block {level:?} dk {dk} rn {rn} w {w}");
            }
            for vd_pad in [16usize, 80, 512] {
                let p = rand_vec(&mut rng, rn * wpad);
                let v = rand_vec(&mut rng, w * vd_pad);
                let mut want = vec![f32::NAN; rn * vd_pad];
                reference::pv_block(&p, wpad, rn, &v, vd_pad, w, &mut want);
                for level in levels() {
                    let mut got = vec![f32::NAN; rn * vd_pad];
                    pv_block_at(level, &p, wpad, rn, &v, vd_pad, w, &mut got);
                    assert!(
                        same_bits(&got, &want),
                        "pv_block {level:?} vd_pad {vd_pad} rn {rn} w {w}"
                    );
                }
            }
            for width in [1usize, 16, 35, 512] {
                let stride = width + 3;
                let data = rand_vec(&mut rng, (w + 2) * stride);
                let values = Values {
                    data: &data,
                    stride,
                    offset: 2,
                    width,
                };
                let (s, a, b) = (1usize, 2usize, w + 1);
                let ps: Vec<Vec<f32>> = (0..4).map(|_| rand_vec(&mut rng, w + 1)).collect();
                let p = [&ps[0][..], &ps[1][..], &ps[2][..], &ps[3][..]];
                let ctx0 = rand_vec(&mut rng, 4 * width);
                let mut want = ctx0.clone();
                reference::accumulate4(p, &values, s, a, b, &mut want);
                for level in levels() {
                    let mut got = ctx0.clone();
                    accumulate4_at(level, p, &values, s, a, b, &mut got);
                    assert!(same_bits(&got, &want), "accumulate4 {level:?} width {width} w {w}");
                }
            }
        }
    }
}
