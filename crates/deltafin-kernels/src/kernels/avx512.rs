//! The AVX-512 level (AVX-512F with AVX2, FMA, F16C): 16-lane kernels and token tiles.

use crate::mxfp4::{e8m0_to_f32, BLOCK, BLOCK_BYTES, E2M1_VALUES};
use std::arch::x86_64::*;

/// Safe entry points. Only reachable through the `AVX512` table, which `detect` hands out
/// after checking AVX-512F (and AVX2, FMA, F16C) at run time; that check is the safety
/// argument for every `unsafe` call below.
pub(super) mod safe {
    pub fn mx_prepare(x: &[f32]) -> Vec<f32> {
        super::prepare(x)
    }
    pub fn mx_rows(packed: &[u8], scales: &[u8], x: &[f32], xp: &[f32], y: &mut [f32]) {
        unsafe { super::mx_rows(packed, scales, x, xp, y) }
    }
    pub fn mx_prepare_tokens(x: &[f32], n: usize) -> Vec<f32> {
        super::prepare_tokens(x, n)
    }
    pub fn mx_mm(packed: &[u8], scales: &[u8], cols: usize, x: &[f32], n: usize, xps: &[f32], yt: &mut [f32]) {
        unsafe { super::mx_mm(packed, scales, cols, x, n, xps, yt) }
    }
}

/// Blocks per chunk: one 64-byte load of packed codes, 16 dword lanes of 8 nibbles each.
const CHUNK_BLOCKS: usize = 4;
/// Elements per chunk.
const CHUNK: usize = CHUNK_BLOCKS * BLOCK;

/// E8M0 byte to its value, `e8m0_to_f32` as a table.
static E8M0: [f32; 256] = {
    let mut t = [0.0f32; 256];
    let mut s = 0;
    while s < 256 {
        t[s] = e8m0_to_f32(s as u8);
        s += 1;
    }
    t
};

/// `x` rearranged to match the packed codes. A chunk's 64 bytes, read as 16 dwords, hold
/// elements `8d .. 8d + 8` of the chunk in dword `d` (nibble `m` = element `8d + m`), so
/// `xp[128c + 16m + d] = x[128c + 8d + m]`; zero beyond `x.len()`.
///
/// The data starts at the buffer's first 64-byte boundary ([`aligned_part`] finds it
/// again), so that each 16-lane load of `x` is one aligned cache line.
fn prepare(x: &[f32]) -> Vec<f32> {
    let len = x.len().div_ceil(CHUNK) * CHUNK;
    let mut buf = vec![0.0f32; len + 15];
    let off = align_offset(&buf);
    unsafe { arrange(x, &mut buf[off..off + len]) };
    buf
}

/// `xp[128c + 16m + d] = x[128c + 8d + m]` ([`prepare`]'s order) for every element of `x`;
/// `xp` is `x.len()` rounded up to whole chunks and zero beyond `x.len()`.
///
/// A whole chunk is the transpose of `x`'s 16 rows of 8 (row `d` = elements `8d .. 8d + 8`)
/// into 8 rows of 16: registers `r_j = [row j | row j + 8]` go through the usual 8 × 8
/// transpose in each 256-bit half (`unpacklo/hi`, `shufps`), and one two-source permute
/// per output joins the 128-bit lanes (rows 0–3, 4–7, 8–11, 12–15 of column `m`). The rest
/// of `x` goes one element at a time.
#[target_feature(enable = "avx512f")]
fn arrange(x: &[f32], xp: &mut [f32]) {
    let whole = x.len() / CHUNK * CHUNK;
    assert!(xp.len() >= whole, "arrange: xp length");
    // Output lanes 0-3 and 8-11 from `a`, 4-7 and 12-15 from `b`: 128-bit lane `h` of both
    // for column m, lane `h + 1` for column m + 4.
    let join = |h: i32| {
        _mm512_setr_epi32(
            h,
            h + 1,
            h + 2,
            h + 3,
            16 + h,
            17 + h,
            18 + h,
            19 + h,
            8 + h,
            9 + h,
            10 + h,
            11 + h,
            24 + h,
            25 + h,
            26 + h,
            27 + h,
        )
    };
    let (lo, hi) = (join(0), join(4));
    for c in (0..whole).step_by(CHUNK) {
        // SAFETY: c + 128 <= whole <= x.len() and <= xp.len() (asserted); unaligned loads and
        // stores.
        unsafe {
            let src = x.as_ptr().add(c);
            let r = |j: usize| {
                let a = _mm512_castps256_ps512(_mm256_loadu_ps(src.add(8 * j)));
                let b = _mm256_loadu_ps(src.add(8 * j + 64));
                _mm512_castpd_ps(_mm512_insertf64x4::<1>(_mm512_castps_pd(a), _mm256_castps_pd(b)))
            };
            let (r0, r1, r2, r3, r4, r5, r6, r7) = (r(0), r(1), r(2), r(3), r(4), r(5), r(6), r(7));
            let (t0, t1) = (_mm512_unpacklo_ps(r0, r1), _mm512_unpackhi_ps(r0, r1));
            let (t2, t3) = (_mm512_unpacklo_ps(r2, r3), _mm512_unpackhi_ps(r2, r3));
            let (t4, t5) = (_mm512_unpacklo_ps(r4, r5), _mm512_unpackhi_ps(r4, r5));
            let (t6, t7) = (_mm512_unpacklo_ps(r6, r7), _mm512_unpackhi_ps(r6, r7));
            // u_k: columns k and k + 4 of rows 0-3 (first four) or 4-7 (last four) in each half.
            let u = [
                _mm512_shuffle_ps::<0x44>(t0, t2),
                _mm512_shuffle_ps::<0xEE>(t0, t2),
                _mm512_shuffle_ps::<0x44>(t1, t3),
                _mm512_shuffle_ps::<0xEE>(t1, t3),
                _mm512_shuffle_ps::<0x44>(t4, t6),
                _mm512_shuffle_ps::<0xEE>(t4, t6),
                _mm512_shuffle_ps::<0x44>(t5, t7),
                _mm512_shuffle_ps::<0xEE>(t5, t7),
            ];
            let dst = xp.as_mut_ptr().add(c);
            for k in 0..4 {
                _mm512_storeu_ps(dst.add(16 * k), _mm512_permutex2var_ps(u[k], lo, u[k + 4]));
                _mm512_storeu_ps(dst.add(16 * (k + 4)), _mm512_permutex2var_ps(u[k], hi, u[k + 4]));
            }
        }
    }
    for (i, &v) in x.iter().enumerate().skip(whole) {
        let e = i % CHUNK;
        xp[i - e + (e % 8) * 16 + e / 8] = v;
    }
}

/// [`prepare`] for `n` tokens `x: [n * cols]` into one buffer: token t's prepared floats
/// start `t * cols.div_ceil(128) * 128` floats after the first 64-byte boundary.
fn prepare_tokens(x: &[f32], n: usize) -> Vec<f32> {
    assert!(n > 0 && x.len().is_multiple_of(n), "mx_prepare_tokens: x length");
    let cols = x.len() / n;
    let len = cols.div_ceil(CHUNK) * CHUNK;
    let mut buf = vec![0.0f32; n * len + 15];
    let off = align_offset(&buf);
    for (t, xt) in x.chunks_exact(cols.max(1)).enumerate().take(n) {
        unsafe { arrange(xt, &mut buf[off + t * len..off + (t + 1) * len]) };
    }
    buf
}

/// Floats from the start of `buf` to its first 64-byte boundary.
fn align_offset(buf: &[f32]) -> usize {
    (64 - (buf.as_ptr() as usize) % 64) % 64 / 4
}

/// The `len` prepared floats of a [`prepare`] buffer.
fn aligned_part(buf: &[f32], len: usize) -> &[f32] {
    assert_eq!(buf.len(), len + 15, "mx_rows: xp is not mx_prepare(x)");
    let off = align_offset(buf);
    &buf[off..off + len]
}

/// Horizontal sum in a fixed order: 256-bit halves, 128-bit halves, then pairs.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn hsum(v: __m512) -> f32 {
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
    let h = _mm256_add_ps(_mm512_castps512_ps256(v), hi);
    let s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps::<0b01>(s, s));
    _mm_cvtss_f32(s)
}

/// True when a byte of `w` is 0 or 255 (scales whose value is not `2^(s-127)` as a normal
/// f32 built from the exponent bits alone).
#[inline(always)]
fn has_special(w: u32) -> bool {
    let zero = |v: u32| v.wrapping_sub(0x0101_0101) & !v & 0x8080_8080 != 0;
    zero(w) || zero(!w)
}

/// [`has_special`] for eight scale bytes.
#[inline(always)]
fn has_special64(w: u64) -> bool {
    let zero = |v: u64| v.wrapping_sub(0x0101_0101_0101_0101) & !v & 0x8080_8080_8080_8080 != 0;
    zero(w) || zero(!w)
}

/// Chunks whose scale bytes [`row`] converts together (16 blocks, one 16-byte load).
const GROUP: usize = 4;

/// `vpermps` indices taking chunk `j` of a group's 16 block scales to its lanes: lane `d`
/// gets block `4j + d / 4`.
static GROUP_LANES: [[i32; 16]; GROUP] = {
    let mut t = [[0i32; 16]; GROUP];
    let mut j = 0;
    while j < GROUP {
        let mut d = 0;
        while d < 16 {
            t[j][d] = (4 * j + d / 4) as i32;
            d += 1;
        }
        j += 1;
    }
    t
};

/// Lane `d` of a chunk belongs to block `d / 4`: the scale of that block as 16 lanes, from
/// the chunk's four scale bytes `w` (little-endian). Normal case: rotate byte `d / 4` into
/// the exponent field and mask (`2^(s-127)` exactly); bytes 0 and 255 go through the table.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn scale_lanes(w: u32, rot: __m512i) -> __m512 {
    if !has_special(w) {
        let v = _mm512_rolv_epi32(_mm512_set1_epi32(w as i32), rot);
        return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(0x7F80_0000)));
    }
    let b = w.to_le_bytes().map(|s| E8M0[s as usize]);
    let q = _mm_setr_ps(b[0], b[1], b[2], b[3]);
    let lane_block = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    _mm512_permutexvar_ps(lane_block, _mm512_castps128_ps512(q))
}

/// The chunk's 16 dword lanes `v` shifted right by `4m` give, through `vpermps` (index bits
/// 0..3), the E2M1 values of elements `8d + m`; their products with `x` sum in order of `m`
/// into `g0` (even `m`) and `g1` (odd `m`). `x` is 64-byte aligned.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn chunk_sums(v: __m512i, x: *const f32, tbl: __m512) -> (__m512, __m512) {
    macro_rules! wx {
        ($m:literal) => {
            (
                _mm512_permutexvar_ps(_mm512_srli_epi32::<{ 4 * $m }>(v), tbl),
                _mm512_load_ps(x.add($m * 16)),
            )
        };
    }
    let (w, xm) = wx!(0);
    let g0 = _mm512_mul_ps(w, xm);
    let (w, xm) = wx!(1);
    let g1 = _mm512_mul_ps(w, xm);
    let (w, xm) = wx!(2);
    let g0 = _mm512_fmadd_ps(w, xm, g0);
    let (w, xm) = wx!(3);
    let g1 = _mm512_fmadd_ps(w, xm, g1);
    let (w, xm) = wx!(4);
    let g0 = _mm512_fmadd_ps(w, xm, g0);
    let (w, xm) = wx!(5);
    let g1 = _mm512_fmadd_ps(w, xm, g1);
    let (w, xm) = wx!(6);
    let g0 = _mm512_fmadd_ps(w, xm, g0);
    let (w, xm) = wx!(7);
    let g1 = _mm512_fmadd_ps(w, xm, g1);
    (g0, g1)
}

/// One row: `p` its `nb * 16` packed bytes, `s` its `nb >= 1` scale bytes, `xp` the
/// aligned prepared activations. Per chunk of 4 blocks: [`chunk_sums`], then
/// `acc += (g0 + g1) * scale` lane by lane (each lane sees one block), in chunk order.
/// Result: `hsum(acc)`.
///
/// Rows are contiguous in the caller's slices, so prefetching `dist` bytes ahead of the
/// current chunk runs into the following rows; `wrapping_add` because the address may lie
/// past the slice (a prefetch never faults).
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn row(p: *const u8, s: *const u8, nb: usize, xp: *const f32) -> f32 {
    let dist = (2 * nb * BLOCK_BYTES).max(2048);
    let tbl = _mm512_loadu_ps(E2M1_VALUES.as_ptr());
    let rot = _mm512_setr_epi32(23, 23, 23, 23, 15, 15, 15, 15, 7, 7, 7, 7, 31, 31, 31, 31);
    let group_idx = GROUP_LANES.map(|l| _mm512_loadu_si512(l.as_ptr() as *const __m512i));
    let pf = |c: usize| {
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(c * 64 + dist) as *const i8);
        if c.is_multiple_of(16) {
            _mm_prefetch::<_MM_HINT_T0>(s.wrapping_add(c * CHUNK_BLOCKS + dist / 16) as *const i8);
        }
    };
    let load = |c: usize| _mm512_loadu_si512(p.add(c * 64) as *const __m512i);
    let scale = |c: usize| scale_lanes((s.add(c * CHUNK_BLOCKS) as *const u32).read_unaligned(), rot);
    let mut acc = _mm512_setzero_ps();
    let mut c = 0;
    // Chunks of four full blocks, in groups of four whose 16 scale bytes are all normal:
    // one widening load and shift gives the 16 block scales, one `vpermps` per chunk
    // spreads them to the lanes (the same values as `scale_lanes`).
    let full = nb / CHUNK_BLOCKS;
    while c + GROUP <= full {
        for j in 0..GROUP {
            pf(c + j);
        }
        let sp = s.add(c * CHUNK_BLOCKS);
        let (lo, hi) = (
            (sp as *const u64).read_unaligned(),
            (sp.add(8) as *const u64).read_unaligned(),
        );
        if has_special64(lo) || has_special64(hi) {
            for j in c..c + GROUP {
                let (a0, a1) = chunk_sums(load(j), xp.add(j * CHUNK), tbl);
                let sa = scale(j);
                acc = _mm512_fmadd_ps(_mm512_add_ps(a0, a1), sa, acc);
            }
        } else {
            let bs = _mm512_slli_epi32::<23>(_mm512_cvtepu8_epi32(_mm_loadu_si128(sp as *const __m128i)));
            let bs = _mm512_castsi512_ps(bs);
            for (j, idx) in group_idx.iter().enumerate() {
                let (a0, a1) = chunk_sums(load(c + j), xp.add((c + j) * CHUNK), tbl);
                let sa = _mm512_permutexvar_ps(*idx, bs);
                acc = _mm512_fmadd_ps(_mm512_add_ps(a0, a1), sa, acc);
            }
        }
        c += GROUP;
    }
    while c < full {
        pf(c);
        let (a0, a1) = chunk_sums(load(c), xp.add(c * CHUNK), tbl);
        let sa = scale(c);
        acc = _mm512_fmadd_ps(_mm512_add_ps(a0, a1), sa, acc);
        c += 1;
    }
    // A last chunk of 1..=3 blocks, read without passing the row's end; missing blocks are
    // zero codes with scale byte 1.
    let vb = nb - full * CHUNK_BLOCKS;
    if vb > 0 {
        let dmask = ((1u32 << (4 * vb)) - 1) as __mmask16;
        let v = _mm512_maskz_loadu_epi32(dmask, p.add(full * 64) as *const i32);
        let mut sb = [1u8; 4];
        for (i, b) in sb.iter_mut().enumerate().take(vb) {
            *b = *s.add(full * CHUNK_BLOCKS + i);
        }
        let (a0, a1) = chunk_sums(v, xp.add(full * CHUNK), tbl);
        let sa = scale_lanes(u32::from_le_bytes(sb), rot);
        acc = _mm512_fmadd_ps(_mm512_add_ps(a0, a1), sa, acc);
    }
    hsum(acc)
}

#[target_feature(enable = "avx512f")]
unsafe fn mx_rows(packed: &[u8], scales: &[u8], x: &[f32], xp: &[f32], y: &mut [f32]) {
    let nb = x.len().div_ceil(BLOCK);
    let pb = nb * BLOCK_BYTES;
    assert!(packed.len() == y.len() * pb && scales.len() == y.len() * nb);
    if nb == 0 {
        y.fill(0.0);
        return;
    }
    let xp = aligned_part(xp, nb.div_ceil(CHUNK_BLOCKS) * CHUNK);
    for (r, yr) in y.iter_mut().enumerate() {
        *yr = row(
            packed.as_ptr().add(r * pb),
            scales.as_ptr().add(r * nb),
            nb,
            xp.as_ptr(),
        );
    }
}

/// [`row`] for the `T` tokens whose prepared activations start at `xp + t * xstride` (each
/// aligned), over chunks `[c0, c1)`, results to `out[t]`. Each 64-byte chunk is decoded
/// once (7 shifts, 8 lookups, the scale lanes); then every token runs exactly [`row`]'s
/// operations on it: the [`chunk_sums`] chains `g0` (even m, first a multiply) and `g1` (odd
/// m), then `acc += (g0 + g1) * scale` in chunk order, the same masked last chunk, and
/// `hsum(acc)`. `acc` is carried in `st: [T]` between segments; the last segment (c1 =
/// chunks of the row) writes `out`.
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn row_tile<const T: usize>(
    p: *const u8,
    s: *const u8,
    nb: usize,
    xp: *const f32,
    xstride: usize,
    c0: usize,
    c1: usize,
    st: *mut __m512,
    out: *mut f32,
) {
    let nc = nb.div_ceil(CHUNK_BLOCKS);
    let last = nc - 1;
    let dist = (2 * nb * BLOCK_BYTES).max(2048);
    let tbl = _mm512_loadu_ps(E2M1_VALUES.as_ptr());
    let rot = _mm512_setr_epi32(23, 23, 23, 23, 15, 15, 15, 15, 7, 7, 7, 7, 31, 31, 31, 31);
    let mut acc = [_mm512_setzero_ps(); T];
    if c0 > 0 {
        for (t, a) in acc.iter_mut().enumerate() {
            *a = *st.add(t);
        }
    }
    // One chunk `$v` with scale lanes `$sc` at prepared offset `$xo` into every token's sums
    // (a macro, not a closure, so that the tile's vectors stay in registers).
    macro_rules! step {
        ($v:expr, $sc:expr, $xo:expr) => {{
            let (v, sc, xo): (__m512i, __m512, usize) = ($v, $sc, $xo);
            let mut g0 = [_mm512_setzero_ps(); T];
            let mut g1 = [_mm512_setzero_ps(); T];
            macro_rules! m {
                ($m:literal, $g:ident, $first:literal) => {
                    let w = _mm512_permutexvar_ps(_mm512_srli_epi32::<{ 4 * $m }>(v), tbl);
                    for t in 0..T {
                        let xm = _mm512_load_ps(xp.add(t * xstride + xo + $m * 16));
                        $g[t] = if $first {
                            _mm512_mul_ps(w, xm)
                        } else {
                            _mm512_fmadd_ps(w, xm, $g[t])
                        };
                    }
                };
            }
            m!(0, g0, true);
            m!(1, g1, true);
            m!(2, g0, false);
            m!(3, g1, false);
            m!(4, g0, false);
            m!(5, g1, false);
            m!(6, g0, false);
            m!(7, g1, false);
            for t in 0..T {
                acc[t] = _mm512_fmadd_ps(_mm512_add_ps(g0[t], g1[t]), sc, acc[t]);
            }
        }};
    }
    for c in c0..c1.min(last) {
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(c * 64 + dist) as *const i8);
        if c.is_multiple_of(16) {
            _mm_prefetch::<_MM_HINT_T0>(s.wrapping_add(c * CHUNK_BLOCKS + dist / 16) as *const i8);
        }
        let v = _mm512_loadu_si512(p.add(c * 64) as *const __m512i);
        let sc = scale_lanes((s.add(c * CHUNK_BLOCKS) as *const u32).read_unaligned(), rot);
        step!(v, sc, c * CHUNK);
    }
    if c1 < nc {
        for (t, a) in acc.iter().enumerate() {
            *st.add(t) = *a;
        }
        return;
    }
    let vb = nb - last * CHUNK_BLOCKS;
    let dmask = ((1u32 << (4 * vb)) - 1) as __mmask16;
    let v = _mm512_maskz_loadu_epi32(dmask, p.add(last * 64) as *const i32);
    let mut sb = [1u8; 4];
    for (i, b) in sb.iter_mut().enumerate().take(vb) {
        *b = *s.add(last * CHUNK_BLOCKS + i);
    }
    step!(v, scale_lanes(u32::from_le_bytes(sb), rot), last * CHUNK);
    for (t, a) in acc.iter().enumerate() {
        *out.add(t) = hsum(*a);
    }
}

/// Tokens per tile: 3 vectors per token (g0, g1, acc) in 32 registers (7 or 8 tokens
/// measured no faster with `warm_tile`).
const MX_TILE: usize = 6;

/// [`super::MxMm`]: [`row_tile`] over row blocks, token tiles and segments of
/// [`super::for_tiles`]; `xps = prepare_tokens(x, n)`.
#[target_feature(enable = "avx512f")]
unsafe fn mx_mm(packed: &[u8], scales: &[u8], cols: usize, x: &[f32], n: usize, xps: &[f32], yt: &mut [f32]) {
    let nb = cols.div_ceil(BLOCK);
    let pb = nb * BLOCK_BYTES;
    let rows = super::mx_mm_rows_of(packed.len(), scales.len(), cols, x.len(), n, yt.len());
    if nb == 0 {
        yt.fill(0.0);
        return;
    }
    let nc = nb.div_ceil(CHUNK_BLOCKS);
    let len = nc * CHUNK;
    assert_eq!(xps.len(), n * len + 15, "mx_mm: xps is not mx_prepare_tokens(x, n)");
    let seg = (super::SEG_X_BYTES / (4 * MX_TILE) / CHUNK).max(1);
    let mut st = vec![
        _mm512_setzero_ps();
        if nc > seg {
            MX_TILE * super::row_block(rows, pb)
        } else {
            0
        }
    ];
    let xa = xps.as_ptr().add(align_offset(xps));
    let (pp, sp, yp, stp) = (packed.as_ptr(), scales.as_ptr(), yt.as_mut_ptr(), st.as_mut_ptr());
    super::for_tiles(rows, n, MX_TILE, pb, nc, seg, |i, r, t0, tn, c0, c1| {
        let out = if c1 == nc {
            yp.add(r * n + t0)
        } else {
            std::ptr::null_mut()
        };
        let str = if st.is_empty() { stp } else { stp.add(MX_TILE * i) };
        by_tile!(
            tn,
            row_tile(
                pp.add(r * pb),
                sp.add(r * nb),
                nb,
                xa.add(t0 * len),
                len,
                c0,
                c1,
                str,
                out
            )
        )
    });
}

/// Token-tile products ([`super::Mm`]) for f32, bf16, f16 and int8 on the AVX-512 level: tiles of 2
/// rows × up to [`tiles::TILE`] tokens, bit-identical to the AVX2 `dot_*` of each (row,
/// token).
///
/// The AVX2 `dot4!` keeps four 8-lane accumulators `a0..a3` over elements `k + 8j .. k + 8j + 8`
/// of each 32-element step. Here `[a0 | a1]` and `[a2 | a3]` are the low and high halves of two
/// 16-lane registers, so one 16-lane FMA over elements `k .. k + 16` performs exactly the FMAs
/// of `a0` and `a1` (likewise `k + 16 .. k + 32` for `a2`, `a3`); the 8-wide steps after the
/// main loop go to lanes 0..8 of the first register under a mask, and the end is `hsum((a0 +
/// a1) + (a2 + a3))` from the halves and the scalar tail, as `dot_*` does. Each 16-lane `x` load
/// serves both rows and each decoded 16-weight vector all tokens of the tile.
pub(super) mod tiles {
    use crate::kernels::{for_row_tiles, mm_rows_of, row_block, SEG_X_BYTES};
    use half::{bf16, f16};
    use std::arch::x86_64::*;

    /// Tokens per tile (2 rows × 6 tokens × 2 accumulators = 24 of the 32 registers).
    pub(super) const TILE: usize = 6;
    /// Rows per tile.
    const ROWS: usize = 2;

    /// The AVX2 level's `hsum` (same operations).
    #[target_feature(enable = "avx2,fma,avx512f,avx512vl")]
    #[inline]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 0b01));
        _mm_cvtss_f32(s)
    }

    /// Low plus high 8 lanes: `a0 + a1` of `[a0 | a1]`.
    #[target_feature(enable = "avx2,fma,avx512f,avx512vl")]
    #[inline]
    unsafe fn halves(v: __m512) -> __m256 {
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
        _mm256_add_ps(_mm512_castps512_ps256(v), hi)
    }

    /// Rows `w + rr * cols` (rr < R) against tokens `x + t * cols` (t < T) over elements
    /// `[k0, k1)` (k0, and k1 unless it is `cols`, multiples of 32), partial sums carried in
    /// `st: [R * T * 2]` 16-lane slots between segments; the last segment (k1 = cols) finishes
    /// as the level's `dot_*` does and writes `out[rr * ostride + t]`.
    ///
    /// `avx512vl` matters although every vector op is 512 bits wide: with `avx512f` alone the
    /// compiler allocated only zmm0–23 for this loop and spilled accumulators to the stack.
    macro_rules! tile_fn {
        ($fname:ident, $W:ty, |$w:ident, $i:ident| $load16:expr, $load8:expr, |$v:ident| $scalar:expr) => {
            #[allow(clippy::too_many_arguments)]
            #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
            unsafe fn $fname<const R: usize, const T: usize>(
                w0: *const $W,
                cols: usize,
                x: *const f32,
                k0: usize,
                k1: usize,
                st: *mut [f32; 16],
                out: *mut f32,
                ostride: usize,
            ) {
                let mut a = [[[_mm512_setzero_ps(); 2]; T]; R];
                if k0 > 0 {
                    for (rr, ar) in a.iter_mut().enumerate() {
                        for (t, at) in ar.iter_mut().enumerate() {
                            for (j, v) in at.iter_mut().enumerate() {
                                *v = _mm512_loadu_ps(st.add((rr * T + t) * 2 + j) as *const f32);
                            }
                        }
                    }
                }
                let mut k = k0;
                while k + 32 <= k1 {
                    for j in 0..2 {
                        let $i = k + 16 * j;
                        let mut wv = [_mm512_setzero_ps(); R];
                        for (rr, v) in wv.iter_mut().enumerate() {
                            let $w = w0.add(rr * cols);
                            *v = $load16;
                        }
                        for t in 0..T {
                            let xv = _mm512_loadu_ps(x.add(t * cols + $i));
                            for rr in 0..R {
                                a[rr][t][j] = _mm512_fmadd_ps(wv[rr], xv, a[rr][t][j]);
                            }
                        }
                    }
                    k += 32;
                }
                if k1 < cols {
                    for (rr, ar) in a.iter().enumerate() {
                        for (t, at) in ar.iter().enumerate() {
                            for (j, v) in at.iter().enumerate() {
                                _mm512_storeu_ps(st.add((rr * T + t) * 2 + j) as *mut f32, *v);
                            }
                        }
                    }
                    return;
                }
                // 8-wide steps into a0: lanes 0..8 of the first register (the others keep a1;
                // lanes 8..16 of the loads are zero or ignored).
                while k + 8 <= cols {
                    let $i = k;
                    let mut wv = [_mm512_setzero_ps(); R];
                    for (rr, v) in wv.iter_mut().enumerate() {
                        let $w = w0.add(rr * cols);
                        *v = $load8;
                    }
                    for t in 0..T {
                        let xv = _mm512_maskz_loadu_ps(0x00FF, x.add(t * cols + $i));
                        for rr in 0..R {
                            a[rr][t][0] = _mm512_mask3_fmadd_ps(wv[rr], xv, a[rr][t][0], 0x00FF);
                        }
                    }
                    k += 8;
                }
                for (rr, ar) in a.iter().enumerate() {
                    let $w = w0.add(rr * cols);
                    for (t, at) in ar.iter().enumerate() {
                        let mut acc = hsum(_mm256_add_ps(halves(at[0]), halves(at[1])));
                        for i in k..cols {
                            let $v = *$w.add(i);
                            acc += $scalar * *x.add(t * cols + i);
                        }
                        *out.add(rr * ostride + t) = acc;
                    }
                }
            }
        };
    }

    tile_fn!(
        tile_f32,
        f32,
        |w, i| _mm512_loadu_ps(w.add(i)),
        _mm512_maskz_loadu_ps(0x00FF, w.add(i)),
        |v| v
    );
    tile_fn!(
        tile_bf16,
        u16,
        |w, i| _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(w.add(i) as *const __m256i)),
            16
        )),
        _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_zextsi128_si256(_mm_loadu_si128(w.add(i) as *const __m128i))),
            16
        )),
        |v| f32::from_bits((v as u32) << 16)
    );
    tile_fn!(
        tile_f16,
        u16,
        |w, i| _mm512_cvtph_ps(_mm256_loadu_si256(w.add(i) as *const __m256i)),
        _mm512_cvtph_ps(_mm256_zextsi128_si256(_mm_loadu_si128(w.add(i) as *const __m128i))),
        |v| f16::from_bits(v).to_f32()
    );
    tile_fn!(
        tile_i8,
        i8,
        |w, i| _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(w.add(i) as *const __m128i))),
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadl_epi64(w.add(i) as *const __m128i))),
        |v| v as f32
    );

    // Safe entry points: only reachable through the AVX512 table, which `detect` hands out
    // after checking AVX-512F (and AVX2, FMA, F16C); that check is the safety argument for the
    // `unsafe` calls. Bounds: `mm_rows_of` checks every length, each tile reads rows `r + rr <
    // rows` and tokens `t0 + tn <= n`.
    macro_rules! mm_fn {
        ($mname:ident, $W:ty, $P:ty, $tname:ident) => {
            pub(in crate::kernels) fn $mname(w: &[$W], cols: usize, x: &[f32], n: usize, yt: &mut [f32]) {
                let rows = mm_rows_of(w.len(), cols, x.len(), n, yt.len());
                let (wp, xp, yp) = (w.as_ptr() as *const $P, x.as_ptr(), yt.as_mut_ptr());
                let rb = cols * std::mem::size_of::<$W>();
                let seg = (SEG_X_BYTES / (4 * TILE) / 32 * 32).max(32);
                // Partial sums of the block's rows between segments: 2 × TILE slots per row.
                let mut st = vec![
                    [0f32; 16];
                    if cols > seg {
                        2 * TILE * row_block(rows, rb).next_multiple_of(ROWS)
                    } else {
                        0
                    }
                ];
                let sp = st.as_mut_ptr();
                for_row_tiles(
                    rows,
                    ROWS,
                    n,
                    TILE,
                    rb,
                    cols,
                    seg,
                    |i, r, nr, t0, tn, k0, k1| unsafe {
                        let out = if k1 == cols {
                            yp.add(r * n + t0)
                        } else {
                            std::ptr::null_mut()
                        };
                        let s = if st.is_empty() { sp } else { sp.add(2 * TILE * i) };
                        let (w, x) = (wp.add(r * cols), xp.add(t0 * cols));
                        if nr == 2 {
                            by_tile!(tn, $tname::<2>(w, cols, x, k0, k1, s, out, n))
                        } else {
                            by_tile!(tn, $tname::<1>(w, cols, x, k0, k1, s, out, n))
                        }
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
