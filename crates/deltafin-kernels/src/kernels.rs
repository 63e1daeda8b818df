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
    /// AVX2 as above for every format but MXFP4, which gets an AVX-512F kernel: 64 packed
    /// bytes (4 blocks) per load, nibbles shifted into place and decoded by 16-entry `vpermps`
    /// lookups, against `x` rearranged once per product; one scale FMA per 4 blocks and lane.
    /// Needs AVX-512F and AVX-512VL (the token-tile products of the other formats use the
    /// AVX2 arithmetic with 32 registers).
    Avx512,
}

/// The level in use: AVX-512 when the CPU also has AVX-512F and AVX-512VL, else AVX2 when it has AVX2, FMA
/// and F16C, else portable. The MXFP4 kernels of different levels group their partial sums
/// differently, so their results may differ within f32 rounding; within one level (one
/// process) every product is deterministic. [`cap_simd_level`], called before the first kernel,
/// caps the level (for debugging and benchmarks).
pub fn simd_level() -> SimdLevel {
    kernels().level
}

/// Caps the level every kernel of this process uses at `cap`: the best level the CPU supports
/// that is not above `cap` ([`SimdLevel::Avx512`] caps nothing). For debugging and benchmarks
/// (the command line's research option `--simd`). Returns the level in use.
///
/// Errors: the level was already chosen (a kernel ran, or an earlier call) and differs from
/// the one `cap` gives; the message names both.
pub fn cap_simd_level(cap: SimdLevel) -> Result<SimdLevel, String> {
    let want = detect(cap).level;
    let got = SELECTED.get_or_init(|| detect(cap)).level;
    if got == want {
        Ok(got)
    } else {
        Err(format!(
            "SIMD level {want:?} asked for after the kernels already chose {got:?} (cap the level before the first kernel runs)"
        ))
    }
}

impl std::str::FromStr for SimdLevel {
    type Err = String;

    /// `portable`, `avx2` or `avx512` (case-insensitive).
    fn from_str(s: &str) -> Result<SimdLevel, String> {
        match s.to_ascii_lowercase().as_str() {
            "portable" => Ok(SimdLevel::Portable),
            "avx2" => Ok(SimdLevel::Avx2),
            "avx512" => Ok(SimdLevel::Avx512),
            _ => Err(format!("unknown SIMD level {s:?} (expected portable, avx2 or avx512)")),
        }
    }
}

/// `(a0, a1, b0, b1)`: see [`Kernels::dot_f32_2x2`].
pub(crate) type Dot2x2 = fn(&[f32], &[f32], &[f32], &[f32]) -> [f32; 4];

/// [`Dot2x2`] as four calls of a level's `dot_f32`.
#[inline(always)]
fn dot_2x2_by(dot: fn(&[f32], &[f32]) -> f32, a0: &[f32], a1: &[f32], b0: &[f32], b1: &[f32]) -> [f32; 4] {
    [dot(a0, b0), dot(a0, b1), dot(a1, b0), dot(a1, b1)]
}

/// `(packed, scales, x, xp, y)`: see [`Kernels::mx_rows`].
pub(crate) type MxRows = fn(&[u8], &[u8], &[f32], &[f32], &mut [f32]);

/// `(w, cols, x, n, yt)`: token-tile products for one weight format. `w: [rows * cols]`,
/// `x: [n * cols]` (n ≥ 1 tokens), `yt: [rows * n]`; sets `yt[r * n + t]` to exactly the value
/// the level's `dot_*` gives for row r and token t (same operations in the same order), each
/// weight decoded once per tile of tokens.
pub(crate) type Mm<W> = fn(&[W], usize, &[f32], usize, &mut [f32]);

/// `(packed, scales, cols, x, n, xps, yt)`: MXFP4 token-tile products, `yt[r * n + t]` equal
/// bit for bit to `mx_rows` of row r and token t; `xps = mx_prepare_tokens(x, n)`.
pub(crate) type MxMm = fn(&[u8], &[u8], usize, &[f32], usize, &[f32], &mut [f32]);

/// One row kernel per weight format, plus `axpy`.
pub(crate) struct Kernels {
    pub level: SimdLevel,
    /// `sum_i w[i] x[i]`, `w.len() == x.len()`.
    pub dot_f32: fn(&[f32], &[f32]) -> f32,
    /// `[dot_f32(a0, b0), dot_f32(a0, b1), dot_f32(a1, b0), dot_f32(a1, b1)]` bit for bit, all
    /// four slices of one length: each loaded vector serves two products.
    pub dot_f32_2x2: Dot2x2,
    pub dot_bf16: fn(&[bf16], &[f32]) -> f32,
    pub dot_f16: fn(&[f16], &[f32]) -> f32,
    /// Unscaled `sum_i q[i] x[i]`; the caller multiplies by the row scale.
    pub dot_i8: fn(&[i8], &[f32]) -> f32,
    /// `y[i] = y[i] + alpha * x[i]` (a multiply then an add: identical on every level).
    pub axpy: fn(f32, &[f32], &mut [f32]),
    /// Activations rearranged once per product for [`Kernels::mx_rows`] (empty on levels that
    /// read `x` directly).
    pub mx_prepare: fn(&[f32]) -> Vec<f32>,
    /// MXFP4 rows `y[r] = sum_c W[r, c] x[c]` for `r < y.len()`: `packed:
    /// [y.len() * packed_row_bytes(n)]`, `scales: [y.len() * scale_row_bytes(n)]`, `x: [n]`,
    /// `xp = mx_prepare(x)`. Each row's result depends on that row and `x` only (one fixed
    /// sequence of operations per row, whichever rows share a call).
    pub mx_rows: MxRows,
    /// Token-tile products ([`Mm`]); `mm_i8` is unscaled like `dot_i8`.
    pub mm_f32: Mm<f32>,
    pub mm_bf16: Mm<bf16>,
    pub mm_f16: Mm<f16>,
    pub mm_i8: Mm<i8>,
    /// `n` tokens `x: [n * cols]` rearranged once per product for [`Kernels::mx_mm`] (empty on
    /// levels that read `x` directly).
    pub mx_prepare_tokens: fn(&[f32], usize) -> Vec<f32>,
    pub mx_mm: MxMm,
}

/// `mx_rows` through a one-row kernel that reads `x` directly.
#[inline(always)]
fn rows_by_dot(dot: fn(&[u8], &[u8], &[f32]) -> f32, packed: &[u8], scales: &[u8], x: &[f32], y: &mut [f32]) {
    let (pb, sb) = (
        crate::mxfp4::packed_row_bytes(x.len()),
        crate::mxfp4::scale_row_bytes(x.len()),
    );
    assert!(packed.len() == y.len() * pb && scales.len() == y.len() * sb);
    for (r, yr) in y.iter_mut().enumerate() {
        *yr = dot(&packed[r * pb..(r + 1) * pb], &scales[r * sb..(r + 1) * sb], x);
    }
}

fn no_prepare(_: &[f32]) -> Vec<f32> {
    Vec::new()
}

fn no_prepare_tokens(_: &[f32], _: usize) -> Vec<f32> {
    Vec::new()
}

/// Weight bytes of a row block that the tile loops keep hot in L2 while every token tile passes
/// over it.
const ROW_BLOCK_BYTES: usize = 64 << 10;

/// Checks the [`Mm`] slice lengths; returns the row count.
#[inline]
fn mm_rows_of(w_len: usize, cols: usize, x_len: usize, n: usize, yt_len: usize) -> usize {
    assert!(
        n > 0 && x_len == n * cols && yt_len.is_multiple_of(n),
        "mm: x or yt length"
    );
    let rows = yt_len / n;
    assert_eq!(w_len, rows * cols, "mm: w length");
    rows
}

/// Visits every (row r, token tile `[t0, t0 + tn)` with tn ≤ `tile`, tiles of balanced sizes, segment `[k0, k1)` of
/// the row's `units` (columns, blocks or chunks)) as `f(i, r, t0, tn, k0, k1)`, `i` = r's
/// index in its row block. Rows go in blocks of about [`ROW_BLOCK_BYTES`]; for each block,
/// each token tile, each segment (`seg` units, the last one ending at `units`), every row of
/// the block. So a segment of the tile's activations stays in L1 while the block's rows pass
/// over it, and the block's weights stay in L2 for all tiles; a row's segments come in order,
/// the kernels carry their partial sums from one to the next (state slot `i`).
#[inline(always)]
fn for_tiles(
    rows: usize,
    n: usize,
    tile: usize,
    row_bytes: usize,
    units: usize,
    seg: usize,
    mut f: impl FnMut(usize, usize, usize, usize, usize, usize),
) {
    for_row_tiles(rows, 1, n, tile, row_bytes, units, seg, |i, r, _, t0, tn, k0, k1| {
        f(i, r, t0, tn, k0, k1)
    });
}

/// [`for_tiles`] for kernels that take `rstep` rows at a time: visits rows `[r, r + nr)`,
/// `nr` = `rstep` except at the end of the matrix, as `f(i, r, nr, t0, tn, k0, k1)`, `i` = r's
/// index in its row block (blocks are a multiple of `rstep` rows; the rows' state slots are
/// `i .. i + nr`).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn for_row_tiles(
    rows: usize,
    rstep: usize,
    n: usize,
    tile: usize,
    row_bytes: usize,
    units: usize,
    seg: usize,
    mut f: impl FnMut(usize, usize, usize, usize, usize, usize, usize),
) {
    let rb = row_block(rows, row_bytes).next_multiple_of(rstep);
    let mut r0 = 0;
    while r0 < rows {
        let r1 = (r0 + rb).min(rows);
        // n.div_ceil(tile) tiles of balanced sizes (8 tokens in tiles of 6: 4 + 4, not 6 + 2).
        let tiles = n.div_ceil(tile);
        let mut t0 = 0;
        for j in 0..tiles {
            let tn = n / tiles + usize::from(j < n % tiles);
            let mut k0 = 0;
            loop {
                let k1 = if units - k0 <= seg { units } else { k0 + seg };
                for r in (r0..r1).step_by(rstep) {
                    f(r - r0, r, rstep.min(r1 - r), t0, tn, k0, k1);
                }
                if k1 == units {
                    break;
                }
                k0 = k1;
            }
            t0 += tn;
        }
        r0 = r1;
    }
}

/// Rows per block of [`for_tiles`].
#[inline]
fn row_block(rows: usize, row_bytes: usize) -> usize {
    (ROW_BLOCK_BYTES / row_bytes.max(1)).clamp(1, rows.max(1))
}

/// Bytes of one token tile's activations that a segment of [`for_tiles`] keeps in L1.
const SEG_X_BYTES: usize = 24 << 10;

/// `f::<tn>(args)` for a run-time tile size `tn` in 1..=8, or `f::<R, tn>(args)` in 1..=6.
#[cfg(target_arch = "x86_64")]
macro_rules! by_tile {
    ($tn:expr, $f:ident($($a:expr),* $(,)?)) => {
        match $tn {
            1 => $f::<1>($($a),*),
            2 => $f::<2>($($a),*),
            3 => $f::<3>($($a),*),
            4 => $f::<4>($($a),*),
            5 => $f::<5>($($a),*),
            6 => $f::<6>($($a),*),
            7 => $f::<7>($($a),*),
            8 => $f::<8>($($a),*),
            _ => unreachable!("tile size"),
        }
    };
    ($tn:expr, $f:ident::<$r:literal>($($a:expr),* $(,)?)) => {
        match $tn {
            1 => $f::<$r, 1>($($a),*),
            2 => $f::<$r, 2>($($a),*),
            3 => $f::<$r, 3>($($a),*),
            4 => $f::<$r, 4>($($a),*),
            5 => $f::<$r, 5>($($a),*),
            6 => $f::<$r, 6>($($a),*),
            _ => unreachable!("tile size"),
        }
    };
}

/// [`Mm`] through a one-row dot product (the portable level: no decode to share).
#[inline(always)]
fn mm_by_dot<W>(dot: fn(&[W], &[f32]) -> f32, w: &[W], cols: usize, x: &[f32], n: usize, yt: &mut [f32]) {
    let rows = mm_rows_of(w.len(), cols, x.len(), n, yt.len());
    for r in 0..rows {
        for t in 0..n {
            yt[r * n + t] = dot(&w[r * cols..(r + 1) * cols], &x[t * cols..(t + 1) * cols]);
        }
    }
}

/// [`MxMm`] through a one-row MXFP4 dot product that reads `x` directly.
#[inline(always)]
fn mx_mm_by_dot(
    dot: fn(&[u8], &[u8], &[f32]) -> f32,
    packed: &[u8],
    scales: &[u8],
    cols: usize,
    x: &[f32],
    n: usize,
    yt: &mut [f32],
) {
    let (pb, sb) = (
        crate::mxfp4::packed_row_bytes(cols),
        crate::mxfp4::scale_row_bytes(cols),
    );
    assert!(
        n > 0 && x.len() == n * cols && yt.len().is_multiple_of(n),
        "mx_mm: x or yt length"
    );
    let rows = yt.len() / n;
    assert!(
        packed.len() == rows * pb && scales.len() == rows * sb,
        "mx_mm: packed or scales length"
    );
    for r in 0..rows {
        for t in 0..n {
            yt[r * n + t] = dot(
                &packed[r * pb..(r + 1) * pb],
                &scales[r * sb..(r + 1) * sb],
                &x[t * cols..(t + 1) * cols],
            );
        }
    }
}

static PORTABLE: Kernels = Kernels {
    level: SimdLevel::Portable,
    dot_f32: portable::dot_f32,
    dot_f32_2x2: |a0, a1, b0, b1| dot_2x2_by(portable::dot_f32, a0, a1, b0, b1),
    dot_bf16: portable::dot_bf16,
    dot_f16: portable::dot_f16,
    dot_i8: portable::dot_i8,
    axpy: portable::axpy,
    mx_prepare: no_prepare,
    mx_rows: |p, s, x, _, y| rows_by_dot(portable::dot_mxfp4, p, s, x, y),
    mm_f32: |w, c, x, n, y| mm_by_dot(portable::dot_f32, w, c, x, n, y),
    mm_bf16: |w, c, x, n, y| mm_by_dot(portable::dot_bf16, w, c, x, n, y),
    mm_f16: |w, c, x, n, y| mm_by_dot(portable::dot_f16, w, c, x, n, y),
    mm_i8: |w, c, x, n, y| mm_by_dot(portable::dot_i8, w, c, x, n, y),
    mx_prepare_tokens: no_prepare_tokens,
    mx_mm: |p, s, c, x, n, _, y| mx_mm_by_dot(portable::dot_mxfp4, p, s, c, x, n, y),
};

#[cfg(target_arch = "x86_64")]
static AVX2: Kernels = Kernels {
    level: SimdLevel::Avx2,
    dot_f32: avx2::safe::dot_f32,
    dot_f32_2x2: |a0, a1, b0, b1| dot_2x2_by(avx2::safe::dot_f32, a0, a1, b0, b1),
    dot_bf16: avx2::safe::dot_bf16,
    dot_f16: avx2::safe::dot_f16,
    dot_i8: avx2::safe::dot_i8,
    axpy: avx2::safe::axpy,
    mx_prepare: no_prepare,
    mx_rows: |p, s, x, _, y| rows_by_dot(avx2::safe::dot_mxfp4, p, s, x, y),
    mm_f32: tiles_avx2::mm_f32,
    mm_bf16: tiles_avx2::mm_bf16,
    mm_f16: tiles_avx2::mm_f16,
    mm_i8: tiles_avx2::mm_i8,
    mx_prepare_tokens: no_prepare_tokens,
    mx_mm: avx2::safe::mx_mm,
};

/// AVX2 for every format but MXFP4, which gets the AVX-512 multi-row kernel. The token-tile
/// products of the other formats ([`tiles_avx512`]) perform the AVX2 kernels' exact FMAs and
/// sums per (row, token) in 16-lane registers, 2 rows × 6 tokens per tile.
#[cfg(target_arch = "x86_64")]
static AVX512: Kernels = Kernels {
    level: SimdLevel::Avx512,
    mx_prepare: avx512::safe::mx_prepare,
    mx_rows: avx512::safe::mx_rows,
    mm_f32: tiles_avx512::mm_f32,
    mm_bf16: tiles_avx512::mm_bf16,
    mm_f16: tiles_avx512::mm_f16,
    mm_i8: tiles_avx512::mm_i8,
    mx_prepare_tokens: avx512::safe::mx_prepare_tokens,
    mx_mm: avx512::safe::mx_mm,
    dot_f32_2x2: avx2::safe::dot_f32_2x2_vl,
    ..AVX2
};

#[cfg(target_arch = "x86_64")]
fn has_avx2() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
}

#[cfg(target_arch = "x86_64")]
fn has_avx512() -> bool {
    has_avx2() && is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512vl")
}

static SELECTED: OnceLock<&'static Kernels> = OnceLock::new();

#[inline]
pub(crate) fn kernels() -> &'static Kernels {
    SELECTED.get_or_init(|| detect(SimdLevel::Avx512))
}

/// The best kernels the CPU supports at or below level `cap`.
fn detect(cap: SimdLevel) -> &'static Kernels {
    if cap == SimdLevel::Portable {
        return &PORTABLE;
    }
    #[cfg(target_arch = "x86_64")]
    {
        if cap == SimdLevel::Avx512 && has_avx512() {
            return &AVX512;
        }
        if has_avx2() {
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
        assert!(
            nt > 0 && x.len() == nt * n && yt.len().is_multiple_of(nt),
            "mx_mm: x or yt length"
        );
        let rows = yt.len() / nt;
        assert!(
            packed.len() == rows * pb && scales.len() == rows * sb,
            "mx_mm: packed or scales length"
        );
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
}

/// The main loop of the AVX2 level's `dot4!` over elements `[k, $k1)` for the `T` tokens
/// `x + t * cols` at once, on the accumulators `a: [[__m256; 4]; T]`: each 8-weight vector
/// `$load` is decoded once and fed to every token's own accumulators, in exactly the order
/// `dot4!` uses for one token. Advances `k`.
#[cfg(target_arch = "x86_64")]
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

/// Token-tile products ([`Mm`]) for f32, bf16, f16 and int8 with the AVX2 kernels' arithmetic,
/// compiled for `$feat` with tiles of up to `$tile` tokens.
#[cfg(target_arch = "x86_64")]
macro_rules! dot_tile_level {
    ($name:ident, $feat:literal, $tile:literal) => {
        mod $name {
            use super::{for_tiles, mm_rows_of, row_block, SEG_X_BYTES};
            use half::{bf16, f16};
            use std::arch::x86_64::*;

            /// Tokens per tile.
            const TILE: usize = $tile;

            /// The AVX2 level's `hsum` (same operations).
            #[target_feature(enable = $feat)]
            #[inline]
            unsafe fn hsum(v: __m256) -> f32 {
                let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
                let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
                let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 0b01));
                _mm_cvtss_f32(s)
            }

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
                    pub(in super::super) fn $mname(w: &[$W], cols: usize, x: &[f32], n: usize, yt: &mut [f32]) {
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

#[cfg(target_arch = "x86_64")]
dot_tile_level!(tiles_avx2, "avx2,fma,f16c", 3);

/// Token-tile products ([`Mm`]) for f32, bf16, f16 and int8 on the AVX-512 level: tiles of 2
/// rows × up to [`tiles_avx512::TILE`] tokens, bit-identical to the AVX2 `dot_*` of each (row,
/// token).
///
/// The AVX2 `dot4!` keeps four 8-lane accumulators `a0..a3` over elements `k + 8j .. k + 8j + 8`
/// of each 32-element step. Here `[a0 | a1]` and `[a2 | a3]` are the low and high halves of two
/// 16-lane registers, so one 16-lane FMA over elements `k .. k + 16` performs exactly the FMAs
/// of `a0` and `a1` (likewise `k + 16 .. k + 32` for `a2`, `a3`); the 8-wide steps after the
/// main loop go to lanes 0..8 of the first register under a mask, and the end is `hsum((a0 +
/// a1) + (a2 + a3))` from the halves and the scalar tail, as `dot_*` does. Each 16-lane `x` load
/// serves both rows and each decoded 16-weight vector all tokens of the tile.
#[cfg(target_arch = "x86_64")]
mod tiles_avx512 {
    use super::{for_row_tiles, mm_rows_of, row_block, SEG_X_BYTES};
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
            pub(in super::super) fn $mname(w: &[$W], cols: usize, x: &[f32], n: usize, yt: &mut [f32]) {
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

#[cfg(target_arch = "x86_64")]
mod avx512 {
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
        assert!(
            n > 0 && x.len() == n * cols && yt.len().is_multiple_of(n),
            "mx_mm: x or yt length"
        );
        let rows = yt.len() / n;
        assert!(
            packed.len() == rows * pb && scales.len() == rows * nb,
            "mx_mm: packed or scales length"
        );
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
}

/// Every level side by side, for tests that pit each against the scalar reference.
#[cfg(test)]
pub(crate) fn all_levels() -> Vec<&'static Kernels> {
    #[allow(unused_mut)]
    let mut v = vec![&PORTABLE];
    #[cfg(target_arch = "x86_64")]
    {
        if has_avx2() {
            v.push(&AVX2);
        }
        if has_avx512() {
            v.push(&AVX512);
        }
    }
    v
}
