//! Plain scalar reference implementations: one sequential loop per definition, no SIMD, no
//! threads. They are the oracle the fast paths are tested against (llama.cpp
//! `test-backend-ops` style) and a readable statement of each format's arithmetic.

use crate::mxfp4::{self, E2M1_VALUES};
use crate::{MatData, MatRef};

/// `sum_i a[i] b[i]`, summed in index order.
///
/// # Panics
/// If the lengths differ.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let mut s = 0.0f32;
    for (&x, &y) in a.iter().zip(b) {
        s += x * y;
    }
    s
}

/// Row `r` of `m` decoded to f32, `[cols]`: bf16/f16 widened exactly, int8 `q * scale[r]`,
/// MXFP4 `E2M1_VALUES[nibble] * 2^(s-127)` (OCP MX v1.0 §5.3.3, §5.4.1).
pub fn row(m: &MatRef, r: usize) -> Vec<f32> {
    let c = m.cols;
    let range = r * c..(r + 1) * c;
    match m.data {
        MatData::F32(w) => w[range].to_vec(),
        MatData::Bf16(w) => w[range].iter().map(|v| v.to_f32()).collect(),
        MatData::F16(w) => w[range].iter().map(|v| v.to_f32()).collect(),
        MatData::Int8 { q, scales } => q[range].iter().map(|&v| v as f32 * scales[r]).collect(),
        MatData::Mxfp4 { packed, scales } => {
            let (pb, sb) = (mxfp4::packed_row_bytes(c), mxfp4::scale_row_bytes(c));
            (0..c)
                .map(|i| {
                    let byte = packed[r * pb + i / 2];
                    let nib = if i % 2 == 0 { byte & 0x0F } else { byte >> 4 };
                    E2M1_VALUES[nib as usize] * mxfp4::e8m0_to_f32(scales[r * sb + i / 32])
                })
                .collect()
        }
    }
}

/// The whole matrix decoded to f32, `[rows, cols]` row-major.
pub fn dense(m: &MatRef) -> Vec<f32> {
    (0..m.rows).flat_map(|r| row(m, r)).collect()
}

/// `y[r] = sum_c W[r, c] x[c]` with `x: [cols]`, `y: [rows]`, following each format's stated
/// arithmetic: int8 `scale[r] * sum_c q x`; MXFP4 `sum_blocks scale_b * (sum_i e2m1_i x_i)`;
/// others `sum_c w x`; every sum in index order.
pub fn matvec(m: &MatRef, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), m.cols);
    assert_eq!(y.len(), m.rows);
    let c = m.cols;
    for (r, yr) in y.iter_mut().enumerate() {
        *yr = match m.data {
            MatData::F32(w) => dot(&w[r * c..(r + 1) * c], x),
            MatData::Bf16(_) | MatData::F16(_) => dot(&row(m, r), x),
            MatData::Int8 { q, scales } => {
                let mut s = 0.0f32;
                for (&qv, &xv) in q[r * c..(r + 1) * c].iter().zip(x) {
                    s += qv as f32 * xv;
                }
                scales[r] * s
            }
            MatData::Mxfp4 { packed, scales } => {
                let (pb, sb) = (mxfp4::packed_row_bytes(c), mxfp4::scale_row_bytes(c));
                let mut s = 0.0f32;
                for b in 0..sb {
                    let mut blk = 0.0f32;
                    for i in b * 32..((b + 1) * 32).min(c) {
                        let byte = packed[r * pb + i / 2];
                        let nib = if i % 2 == 0 { byte & 0x0F } else { byte >> 4 };
                        blk += E2M1_VALUES[nib as usize] * x[i];
                    }
                    s += blk * mxfp4::e8m0_to_f32(scales[r * sb + b]);
                }
                s
            }
        };
    }
}

/// `n` reference matvecs: `x: [n, cols]`, `y: [n, rows]`.
pub fn matmul(m: &MatRef, x: &[f32], n: usize, y: &mut [f32]) {
    for t in 0..n {
        matvec(
            m,
            &x[t * m.cols..(t + 1) * m.cols],
            &mut y[t * m.rows..(t + 1) * m.rows],
        );
    }
}

/// `y[c] = sum_r x[r] W[r, c]` with `x: [rows]`, `y: [cols]`: starting from 0, adds
/// `x[r] * W[r, c]` (decoded as [`row`]) for r in order.
pub fn matvec_t(m: &MatRef, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), m.rows);
    assert_eq!(y.len(), m.cols);
    y.fill(0.0);
    for (r, &xr) in x.iter().enumerate() {
        for (yc, w) in y.iter_mut().zip(row(m, r)) {
            *yc += xr * w;
        }
    }
}

/// [`crate::attention::qk_block`]'s definition: for rows `r < q.len() / dk` and keys
/// `t < ⌈w / DKB⌉ · DKB`, `s[r · wpad + t] = (Σ_d q[r][d] · kt[d · n_pad + t]) · scale` with the
/// sum a fused multiply-add chain in ascending `d` from 0.
///
/// # Panics
/// If a slice is too short for those indices.
#[allow(clippy::too_many_arguments)]
pub fn qk_block(q: &[f32], dk: usize, kt: &[f32], n_pad: usize, w: usize, wpad: usize, scale: f32, s: &mut [f32]) {
    let rn = q.len() / dk.max(1);
    let keys = w.div_ceil(crate::attention::DKB) * crate::attention::DKB;
    for r in 0..rn {
        for t in 0..keys {
            let mut acc = 0.0f32;
            for d in 0..dk {
                acc = q[r * dk + d].mul_add(kt[d * n_pad + t], acc);
            }
            s[r * wpad + t] = acc * scale;
        }
    }
}

/// [`crate::attention::pv_block`]'s definition: `ctx[r · vd_pad + j] = Σ_{t < w} p[r · wpad + t]
/// · v[t · vd_pad + j]`, a fused multiply-add chain in ascending `t` from 0, for `r < rn`,
/// `j < vd_pad`.
///
/// # Panics
/// If a slice is too short for those indices.
pub fn pv_block(p: &[f32], wpad: usize, rn: usize, v: &[f32], vd_pad: usize, w: usize, ctx: &mut [f32]) {
    for r in 0..rn {
        for j in 0..vd_pad {
            let mut acc = 0.0f32;
            for t in 0..w {
                acc = p[r * wpad + t].mul_add(v[t * vd_pad + j], acc);
            }
            ctx[r * vd_pad + j] = acc;
        }
    }
}

/// [`crate::attention::accumulate4`]'s definition: for each row `i < 4` and each `t` in `a..b`
/// in order, `ctx[i] += p[i][t - s] · values.row(t)` element by element, a multiply then an add.
///
/// # Panics
/// If a slice is too short for those indices.
pub fn accumulate4(
    p: [&[f32]; 4],
    values: &crate::attention::Values<'_>,
    s: usize,
    a: usize,
    b: usize,
    ctx: &mut [f32],
) {
    let dv = values.width;
    for (i, pi) in p.iter().enumerate() {
        for t in a..b {
            let pt = pi[t - s];
            for (c, &v) in ctx[i * dv..(i + 1) * dv].iter_mut().zip(values.row(t)) {
                *c += pt * v;
            }
        }
    }
}
