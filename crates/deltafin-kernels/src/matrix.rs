//! Borrowed weight matrices in any storage format, and the products over them.

use crate::kernels::{kernels, Kernels};
use crate::{int8, mxfp4};
use half::{bf16, f16, slice::HalfFloatSliceExt};
use rayon::prelude::*;
use std::fmt;

/// Above this many weights (`rows * cols`, times `n` for [`MatRef::matmul`]) the products split
/// rows (or columns) across the current rayon pool.
pub(crate) const PAR_MIN_WEIGHTS: usize = 1 << 16;

/// Smallest share of weights worth sending to another thread.
const CHUNK_MIN_WEIGHTS: usize = 1 << 14;

/// Columns decoded at a time into a stack buffer (a multiple of the MXFP4 block).
const SEG: usize = 256;

/// A borrowed weight matrix `W: [rows, cols]` (rows = output features, cols = input features,
/// i.e. a PyTorch `nn.Linear` weight), in one of the storage formats. All formats are row-major.
#[derive(Clone, Copy)]
pub enum MatData<'a> {
    /// `[rows * cols]` f32.
    F32(&'a [f32]),
    /// `[rows * cols]` bfloat16 (the high 16 bits of an f32).
    Bf16(&'a [bf16]),
    /// `[rows * cols]` IEEE 754 binary16.
    F16(&'a [f16]),
    /// Per-row symmetric int8 (see [`crate::int8`]): `W[r, c] = scales[r] * q[r, c]`;
    /// `q: [rows * cols]`, `scales: [rows]`.
    Int8 {
        /// Codes, `[rows * cols]`.
        q: &'a [i8],
        /// One f32 scale per row, `[rows]`.
        scales: &'a [f32],
    },
    /// OCP MX v1.0 MXFP4 in the Hugging Face layout (see [`crate::mxfp4`]):
    /// `packed: [rows * packed_row_bytes(cols)]`, `scales: [rows * scale_row_bytes(cols)]`.
    Mxfp4 {
        /// Two E2M1 codes per byte, element 2i in the low nibble; rows padded to 32 elements.
        packed: &'a [u8],
        /// One E8M0 byte per 32-element block.
        scales: &'a [u8],
    },
}

/// A weight matrix `W: [rows, cols]` with its storage; cheap to copy.
#[derive(Clone, Copy)]
pub struct MatRef<'a> {
    /// Output features.
    pub rows: usize,
    /// Input features.
    pub cols: usize,
    /// The stored weights.
    pub data: MatData<'a>,
}

impl fmt::Debug for MatRef<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let format = match self.data {
            MatData::F32(_) => "f32",
            MatData::Bf16(_) => "bf16",
            MatData::F16(_) => "f16",
            MatData::Int8 { .. } => "int8",
            MatData::Mxfp4 { .. } => "mxfp4",
        };
        write!(f, "MatRef({format} [{}, {}])", self.rows, self.cols)
    }
}

fn check_len(what: &str, got: usize, want: Option<usize>, rows: usize, cols: usize) -> Result<(), String> {
    match want {
        Some(w) if w == got => Ok(()),
        Some(w) => Err(format!(
            "{what}: length {got}, expected {w} for a [{rows}, {cols}] matrix"
        )),
        None => Err(format!("{what}: [{rows}, {cols}] overflows usize")),
    }
}

impl<'a> MatRef<'a> {
    /// Wraps `data` as a `[rows, cols]` matrix after checking every slice length against the
    /// shape (see [`MatData`] for the expected lengths).
    ///
    /// # Errors
    /// A message naming the slice, its length and the expected one.
    pub fn new(rows: usize, cols: usize, data: MatData<'a>) -> Result<Self, String> {
        let n = rows.checked_mul(cols);
        match data {
            MatData::F32(w) => check_len("f32 weights", w.len(), n, rows, cols)?,
            MatData::Bf16(w) => check_len("bf16 weights", w.len(), n, rows, cols)?,
            MatData::F16(w) => check_len("f16 weights", w.len(), n, rows, cols)?,
            MatData::Int8 { q, scales } => {
                check_len("int8 codes", q.len(), n, rows, cols)?;
                check_len("int8 row scales", scales.len(), Some(rows), rows, cols)?;
            }
            MatData::Mxfp4 { packed, scales } => {
                let pb = rows.checked_mul(mxfp4::packed_row_bytes(cols));
                let sb = rows.checked_mul(mxfp4::scale_row_bytes(cols));
                check_len("mxfp4 packed bytes", packed.len(), pb, rows, cols)?;
                check_len("mxfp4 scale bytes", scales.len(), sb, rows, cols)?;
            }
        }
        Ok(Self { rows, cols, data })
    }

    /// An MXFP4 `[rows, cols]` matrix from its codes (`rows * packed_row_bytes(cols)` bytes)
    /// and E8M0 block scales (`rows * scale_row_bytes(cols)` bytes): [`MatRef::new`] of
    /// [`MatData::Mxfp4`].
    ///
    /// # Errors
    /// As [`MatRef::new`].
    pub fn mxfp4(rows: usize, cols: usize, packed: &'a [u8], scales: &'a [u8]) -> Result<Self, String> {
        Self::new(rows, cols, MatData::Mxfp4 { packed, scales })
    }

    /// Rows `[start, end)` as a `[end - start, cols]` matrix, borrowing the same storage.
    ///
    /// # Panics
    /// If `start > end` or `end > rows`.
    pub fn rows(&self, start: usize, end: usize) -> MatRef<'a> {
        assert!(
            start <= end && end <= self.rows,
            "MatRef::rows({start}, {end}) out of range for {} rows",
            self.rows
        );
        let c = self.cols;
        let data = match self.data {
            MatData::F32(w) => MatData::F32(&w[start * c..end * c]),
            MatData::Bf16(w) => MatData::Bf16(&w[start * c..end * c]),
            MatData::F16(w) => MatData::F16(&w[start * c..end * c]),
            MatData::Int8 { q, scales } => MatData::Int8 {
                q: &q[start * c..end * c],
                scales: &scales[start..end],
            },
            MatData::Mxfp4 { packed, scales } => {
                let (pb, sb) = (mxfp4::packed_row_bytes(c), mxfp4::scale_row_bytes(c));
                MatData::Mxfp4 {
                    packed: &packed[start * pb..end * pb],
                    scales: &scales[start * sb..end * sb],
                }
            }
        };
        MatRef {
            rows: end - start,
            cols: c,
            data,
        }
    }

    /// Bytes of the stored matrix (all slices, scales included).
    pub fn nbytes(&self) -> usize {
        match self.data {
            MatData::F32(w) => std::mem::size_of_val(w),
            MatData::Bf16(w) => std::mem::size_of_val(w),
            MatData::F16(w) => std::mem::size_of_val(w),
            MatData::Int8 { q, scales } => q.len() + std::mem::size_of_val(scales),
            MatData::Mxfp4 { packed, scales } => packed.len() + scales.len(),
        }
    }

    /// `y[r] = sum_c W[r, c] x[c]` for `x: [cols]`, `y: [rows]`.
    ///
    /// Accumulates in f32. Int8: `scales[r] * sum_c (q[r, c] * x[c])`. MXFP4: partial sums of
    /// exactly decoded E2M1 values times `x` within each block, times the block's E8M0 scale,
    /// accumulated across blocks (OCP MX v1.0 §5; the grouping of the partial sums depends on
    /// the SIMD level, see [`crate::simd_level`]). Rows are split across the current rayon pool
    /// when `rows * cols > 65536`; every row's reduction order is fixed, so results are
    /// bit-identical for any thread count.
    ///
    /// # Panics
    /// If `x.len() != cols` or `y.len() != rows`.
    pub fn matvec(&self, x: &[f32], y: &mut [f32]) {
        self.matvec_with(kernels(), x, y)
    }

    pub(crate) fn matvec_with(&self, k: &Kernels, x: &[f32], y: &mut [f32]) {
        assert_eq!(x.len(), self.cols, "matvec: x length");
        assert_eq!(y.len(), self.rows, "matvec: y length");
        if let MatData::Mxfp4 { .. } = self.data {
            let xp = (k.mx_prepare)(x);
            if self.rows * self.cols <= PAR_MIN_WEIGHTS {
                self.mx_rows(k, 0, x, &xp, y);
            } else {
                let chunk = self.row_chunk();
                y.par_chunks_mut(chunk)
                    .enumerate()
                    .for_each(|(i, yc)| self.mx_rows(k, i * chunk, x, &xp, yc));
            }
            return;
        }
        if self.rows * self.cols <= PAR_MIN_WEIGHTS {
            for (r, yr) in y.iter_mut().enumerate() {
                *yr = self.row_dot(k, r, x);
            }
            return;
        }
        let chunk = self.row_chunk();
        y.par_chunks_mut(chunk).enumerate().for_each(|(i, yc)| {
            let r0 = i * chunk;
            for (j, yr) in yc.iter_mut().enumerate() {
                *yr = self.row_dot(k, r0 + j, x);
            }
        });
    }

    /// `y = x W^T` for `n` tokens: `x: [n, cols]`, `y: [n, rows]`. Each output element is
    /// computed exactly as [`MatRef::matvec`] computes it (the same partial-sum chains, scale
    /// applications and horizontal reduction, in the same order), so the result equals `n`
    /// matvecs bit for bit. The level's tile kernels decode each weight vector (an MXFP4
    /// 64-byte chunk, 8 int8/bf16/f16 weights) once and apply it to a tile of up to 4–6 tokens,
    /// each with its own accumulators; rows are split across the current rayon pool when
    /// `rows * cols * n > 65536` (results do not depend on the split).
    ///
    /// # Panics
    /// If `x.len() != n * cols` or `y.len() != n * rows`.
    pub fn matmul(&self, x: &[f32], n: usize, y: &mut [f32]) {
        self.matmul_with(kernels(), x, n, y)
    }

    pub(crate) fn matmul_with(&self, k: &Kernels, x: &[f32], n: usize, y: &mut [f32]) {
        let (rows, cols) = (self.rows, self.cols);
        assert_eq!(x.len(), n * cols, "matmul: x length");
        assert_eq!(y.len(), n * rows, "matmul: y length");
        if n == 0 || rows == 0 {
            return;
        }
        if n == 1 {
            return self.matvec_with(k, x, y);
        }
        let xps = match self.data {
            MatData::Mxfp4 { .. } => (k.mx_prepare_tokens)(x, n),
            _ => Vec::new(),
        };
        // Rows (in parallel when large) into a [rows, n] scratch, then transposed into [n, rows].
        let mut yt = vec![0.0f32; rows * n];
        if (rows * cols).saturating_mul(n) <= PAR_MIN_WEIGHTS {
            self.mm_rows(k, 0, x, n, &xps, &mut yt);
        } else {
            let chunk = self.row_chunk();
            yt.par_chunks_mut(chunk * n)
                .enumerate()
                .for_each(|(i, yc)| self.mm_rows(k, i * chunk, x, n, &xps, yc));
        }
        transpose_into(&yt, rows, n, y);
    }

    /// Rows `[r0, r0 + yt.len() / n)` of the product for all `n` tokens into `yt: [rows', n]`
    /// through the level's tile kernels; `xps` is `mx_prepare_tokens(x, n)` for MXFP4.
    fn mm_rows(&self, k: &Kernels, r0: usize, x: &[f32], n: usize, xps: &[f32], yt: &mut [f32]) {
        let c = self.cols;
        let r1 = r0 + yt.len() / n;
        match self.data {
            MatData::F32(w) => (k.mm_f32)(&w[r0 * c..r1 * c], c, x, n, yt),
            MatData::Bf16(w) => (k.mm_bf16)(&w[r0 * c..r1 * c], c, x, n, yt),
            MatData::F16(w) => (k.mm_f16)(&w[r0 * c..r1 * c], c, x, n, yt),
            MatData::Int8 { q, scales } => {
                (k.mm_i8)(&q[r0 * c..r1 * c], c, x, n, yt);
                // As `row_dot`: the row scale times the unscaled dot product (IEEE multiplication
                // is commutative, so `v * s` is the same number).
                for (yrow, &s) in yt.chunks_mut(n).zip(&scales[r0..r1]) {
                    for v in yrow {
                        *v *= s;
                    }
                }
            }
            MatData::Mxfp4 { packed, scales } => {
                let (pb, sb) = (mxfp4::packed_row_bytes(c), mxfp4::scale_row_bytes(c));
                (k.mx_mm)(&packed[r0 * pb..r1 * pb], &scales[r0 * sb..r1 * sb], c, x, n, xps, yt)
            }
        }
    }

    /// `y[c] = sum_r x[r] W[r, c]` for `x: [rows]`, `y: [cols]` (`y` is overwritten): the
    /// transposed product used for MLA weight absorption.
    ///
    /// Each `y[c]` starts at 0 and adds `x[r] * W[r, c]` (a multiply then an add, `W` decoded
    /// exactly as [`MatRef::row_into`]) for r = 0, 1, …, in that order, so the result is the same
    /// on every SIMD level and thread count (columns are split across the rayon pool when
    /// `rows * cols > 65536`).
    ///
    /// # Panics
    /// If `x.len() != rows` or `y.len() != cols`.
    pub fn matvec_t(&self, x: &[f32], y: &mut [f32]) {
        self.matvec_t_with(kernels(), x, y)
    }

    pub(crate) fn matvec_t_with(&self, k: &Kernels, x: &[f32], y: &mut [f32]) {
        assert_eq!(x.len(), self.rows, "matvec_t: x length");
        assert_eq!(y.len(), self.cols, "matvec_t: y length");
        y.fill(0.0);
        if self.rows * self.cols <= PAR_MIN_WEIGHTS {
            self.accumulate_t(k, x, 0, y);
            return;
        }
        let threads = rayon::current_num_threads().max(1);
        // Column chunks are whole MXFP4 blocks (64 is a multiple of 32).
        let chunk = self
            .cols
            .div_ceil(4 * threads)
            .max(CHUNK_MIN_WEIGHTS / self.rows.max(1))
            .next_multiple_of(64);
        y.par_chunks_mut(chunk)
            .enumerate()
            .for_each(|(i, yc)| self.accumulate_t(k, x, i * chunk, yc));
    }

    /// `y[j] += x[r] * W[r, c0 + j]` for every row r in order; `c0` is a multiple of 32.
    fn accumulate_t(&self, k: &Kernels, x: &[f32], c0: usize, y: &mut [f32]) {
        let cols = self.cols;
        if let MatData::F32(w) = self.data {
            for (r, &xr) in x.iter().enumerate() {
                (k.axpy)(xr, &w[r * cols + c0..r * cols + c0 + y.len()], y);
            }
            return;
        }
        let mut buf = [0.0f32; SEG];
        for (r, &xr) in x.iter().enumerate() {
            for (s, ys) in y.chunks_mut(SEG).enumerate() {
                let tmp = &mut buf[..ys.len()];
                self.decode_segment(r, c0 + s * SEG, tmp);
                (k.axpy)(xr, tmp, ys);
            }
        }
    }

    /// Dequantized row `r` into `out: [cols]` (embedding lookup). Exact: every format's values
    /// are representable in f32 (MXFP4 within the f32 range, int8 as `q as f32 * scale`).
    ///
    /// # Panics
    /// If `r >= rows` or `out.len() != cols`.
    pub fn row_into(&self, r: usize, out: &mut [f32]) {
        assert!(r < self.rows, "row_into: row {r} of {}", self.rows);
        assert_eq!(out.len(), self.cols, "row_into: out length");
        self.decode_segment(r, 0, out);
    }

    /// Decodes `W[r, c0 .. c0 + out.len()]`; `c0` is a multiple of 32 for MXFP4.
    fn decode_segment(&self, r: usize, c0: usize, out: &mut [f32]) {
        let c = self.cols;
        let range = r * c + c0..r * c + c0 + out.len();
        match self.data {
            MatData::F32(w) => out.copy_from_slice(&w[range]),
            MatData::Bf16(w) => w[range].convert_to_f32_slice(out),
            MatData::F16(w) => w[range].convert_to_f32_slice(out),
            MatData::Int8 { q, scales } => int8::decode_row_segment(&q[range], scales[r], out),
            MatData::Mxfp4 { packed, scales } => {
                let (pb, sb) = (mxfp4::packed_row_bytes(c), mxfp4::scale_row_bytes(c));
                mxfp4::decode_row_segment(&packed[r * pb..(r + 1) * pb], &scales[r * sb..(r + 1) * sb], c0, out)
            }
        }
    }

    /// `sum_c W[r, c] x[c]` through the level's row kernel.
    #[inline]
    fn row_dot(&self, k: &Kernels, r: usize, x: &[f32]) -> f32 {
        let c = self.cols;
        match self.data {
            MatData::F32(w) => (k.dot_f32)(&w[r * c..(r + 1) * c], x),
            MatData::Bf16(w) => (k.dot_bf16)(&w[r * c..(r + 1) * c], x),
            MatData::F16(w) => (k.dot_f16)(&w[r * c..(r + 1) * c], x),
            MatData::Int8 { q, scales } => scales[r] * (k.dot_i8)(&q[r * c..(r + 1) * c], x),
            MatData::Mxfp4 { .. } => {
                let mut y = [0.0f32];
                self.mx_rows(k, r, x, &(k.mx_prepare)(x), &mut y);
                y[0]
            }
        }
    }

    /// MXFP4 rows `[r0, r0 + y.len())` through the level's row kernel; `xp` is
    /// `mx_prepare(x)`.
    fn mx_rows(&self, k: &Kernels, r0: usize, x: &[f32], xp: &[f32], y: &mut [f32]) {
        let MatData::Mxfp4 { packed, scales } = self.data else {
            unreachable!("mx_rows on a non-MXFP4 matrix")
        };
        let c = self.cols;
        let (pb, sb) = (mxfp4::packed_row_bytes(c), mxfp4::scale_row_bytes(c));
        let r1 = r0 + y.len();
        (k.mx_rows)(&packed[r0 * pb..r1 * pb], &scales[r0 * sb..r1 * sb], x, xp, y)
    }

    /// Rows per parallel task: about four tasks per thread, none smaller than
    /// `CHUNK_MIN_WEIGHTS` weights. Only load balance depends on it, never the results.
    fn row_chunk(&self) -> usize {
        let threads = rayon::current_num_threads().max(1);
        let min_rows = CHUNK_MIN_WEIGHTS.div_ceil(self.cols.max(1));
        self.rows.div_ceil(4 * threads).max(min_rows).max(1)
    }
}

/// `y: [n, rows]` = the transpose of `yt: [rows, n]`, in 64 × 64 blocks (a row-major walk
/// with a stride of `rows` f32 misses the cache and the TLB on every store once `n` is in the
/// thousands), token blocks in parallel when the matrix is large.
fn transpose_into(yt: &[f32], rows: usize, n: usize, y: &mut [f32]) {
    const B: usize = 64;
    let block = |t0: usize, yb: &mut [f32]| {
        let tn = yb.len() / rows;
        let mut r0 = 0;
        while r0 < rows {
            let r1 = (r0 + B).min(rows);
            for t in 0..tn {
                let dst = &mut yb[t * rows + r0..t * rows + r1];
                for (d, r) in dst.iter_mut().zip(r0..r1) {
                    *d = yt[r * n + t0 + t];
                }
            }
            r0 = r1;
        }
    };
    if rows * n <= PAR_MIN_WEIGHTS {
        block(0, y);
    } else {
        y.par_chunks_mut(B * rows)
            .enumerate()
            .for_each(|(i, yb)| block(i * B, yb));
    }
}
