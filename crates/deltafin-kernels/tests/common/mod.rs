//! Random matrices in every storage format, and a tolerance check against an exact f64 sum.
//! Shared by the integration tests and (through `#[path]`) the crate's unit tests.
#![allow(dead_code)]

use deltafin_kernels::{mxfp4, reference, MatData, MatRef};
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

pub const FORMATS: [&str; 5] = ["f32", "bf16", "f16", "int8", "mxfp4"];

/// Owned storage behind a [`MatRef`].
pub enum Owned {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
    F16(Vec<f16>),
    Int8(Vec<i8>, Vec<f32>),
    Mxfp4(Vec<u8>, Vec<u8>),
}

pub struct TestMat {
    pub rows: usize,
    pub cols: usize,
    pub store: Owned,
}

impl TestMat {
    pub fn mat(&self) -> MatRef<'_> {
        let data = match &self.store {
            Owned::F32(w) => MatData::F32(w),
            Owned::Bf16(w) => MatData::Bf16(w),
            Owned::F16(w) => MatData::F16(w),
            Owned::Int8(q, s) => MatData::Int8 { q, scales: s },
            Owned::Mxfp4(p, s) => MatData::Mxfp4 { packed: p, scales: s },
        };
        MatRef::new(self.rows, self.cols, data).expect("test matrix shape")
    }
}

pub fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}

pub fn random_vec(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

/// A random `[rows, cols]` matrix in `format`. Int8 includes an all-zero row (scale 0) when
/// rows > 2; MXFP4 uses random codes and scale bytes around 2^0 (120..=134), so padding nibbles
/// of a partial last block are random too (they must be ignored).
pub fn random_mat(rng: &mut StdRng, format: &str, rows: usize, cols: usize) -> TestMat {
    let n = rows * cols;
    let store = match format {
        "f32" => Owned::F32(random_vec(rng, n)),
        "bf16" => Owned::Bf16(random_vec(rng, n).into_iter().map(bf16::from_f32).collect()),
        "f16" => Owned::F16(random_vec(rng, n).into_iter().map(f16::from_f32).collect()),
        "int8" => {
            let mut q: Vec<i8> = (0..n).map(|_| rng.random_range(-127i8..=127)).collect();
            let mut s: Vec<f32> = (0..rows).map(|_| rng.random_range(1e-3f32..0.1)).collect();
            if rows > 2 {
                q[cols..2 * cols].fill(0);
                s[1] = 0.0;
            }
            Owned::Int8(q, s)
        }
        "mxfp4" => {
            let p = (0..rows * mxfp4::packed_row_bytes(cols))
                .map(|_| rng.random())
                .collect();
            let s = (0..rows * mxfp4::scale_row_bytes(cols))
                .map(|_| rng.random_range(120u8..=134))
                .collect();
            Owned::Mxfp4(p, s)
        }
        _ => unreachable!("unknown format {format}"),
    };
    TestMat { rows, cols, store }
}

/// Exact (f64) `y = W x` and the matching bound `sum_c |W[r,c] x[c]|` per row.
pub fn exact_matvec(m: &MatRef, x: &[f32]) -> (Vec<f64>, Vec<f64>) {
    let mut y = vec![0.0; m.rows];
    let mut mag = vec![0.0; m.rows];
    for r in 0..m.rows {
        for (w, &xv) in reference::row(m, r).iter().zip(x) {
            let p = *w as f64 * xv as f64;
            y[r] += p;
            mag[r] += p.abs();
        }
    }
    (y, mag)
}

/// `|got - exact| <= (n + 4) * eps * sum|terms|`: the classic bound for a recursive f32 sum of
/// n products (Higham, "Accuracy and Stability of Numerical Algorithms" §3.1), loose enough for
/// any summation order.
pub fn assert_close(what: &str, got: &[f32], exact: &[f64], mag: &[f64], n: usize) {
    assert_eq!(got.len(), exact.len());
    for i in 0..got.len() {
        let tol = (n as f64 + 4.0) * f32::EPSILON as f64 * mag[i] + 1e-30;
        let err = (got[i] as f64 - exact[i]).abs();
        assert!(
            err <= tol,
            "{what}: element {i}: got {} exact {} err {err:e} tol {tol:e}",
            got[i],
            exact[i]
        );
    }
}

pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}
