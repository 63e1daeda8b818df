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

/// Checks the [`MxMm`] slice lengths (`packed` and `scales` hold whole MXFP4 rows of `cols`
/// values); returns the row count.
#[inline]
fn mx_mm_rows_of(packed_len: usize, scales_len: usize, cols: usize, x_len: usize, n: usize, yt_len: usize) -> usize {
    assert!(
        n > 0 && x_len == n * cols && yt_len.is_multiple_of(n),
        "mx_mm: x or yt length"
    );
    let rows = yt_len / n;
    assert!(
        packed_len == rows * crate::mxfp4::packed_row_bytes(cols)
            && scales_len == rows * crate::mxfp4::scale_row_bytes(cols),
        "mx_mm: packed or scales length"
    );
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
    let rows = mx_mm_rows_of(packed.len(), scales.len(), cols, x.len(), n, yt.len());
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
    mm_f32: avx2::tiles::mm_f32,
    mm_bf16: avx2::tiles::mm_bf16,
    mm_f16: avx2::tiles::mm_f16,
    mm_i8: avx2::tiles::mm_i8,
    mx_prepare_tokens: no_prepare_tokens,
    mx_mm: avx2::safe::mx_mm,
};

/// AVX2 for every format but MXFP4, which gets the AVX-512 multi-row kernel. The token-tile
/// products of the other formats ([`avx512::tiles`]) perform the AVX2 kernels' exact FMAs and
/// sums per (row, token) in 16-lane registers, 2 rows × 6 tokens per tile.
#[cfg(target_arch = "x86_64")]
static AVX512: Kernels = Kernels {
    level: SimdLevel::Avx512,
    mx_prepare: avx512::safe::mx_prepare,
    mx_rows: avx512::safe::mx_rows,
    mm_f32: avx512::tiles::mm_f32,
    mm_bf16: avx512::tiles::mm_bf16,
    mm_f16: avx512::tiles::mm_f16,
    mm_i8: avx512::tiles::mm_i8,
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

// The levels, one file each (macros above are in scope in them).
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
pub(crate) mod portable;

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
