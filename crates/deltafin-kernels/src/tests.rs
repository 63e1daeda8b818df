//! Every SIMD level this CPU supports (not just the dispatched one) against the scalar
//! reference: the portable path is otherwise untested on x86.

#[path = "../tests/common/mod.rs"]
mod common;

use crate::kernels::all_levels;
use crate::reference;
use common::{assert_close, bits, exact_matvec, random_mat, random_vec, rng, FORMATS};

const SHAPES: [(usize, usize); 9] = [
    (1, 1),
    (1, 33),
    (3, 7),
    (5, 31),
    (9, 64),
    (17, 257),
    (33, 1000),
    (300, 300),
    (1, 70_001),
];

#[test]
fn every_level_matches_reference() {
    let levels = all_levels();
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        assert_eq!(levels.len(), 2, "AVX2 level not exercised");
    }
    let mut rng = rng(21);
    for k in &levels {
        for format in FORMATS {
            for &(rows, cols) in &SHAPES {
                let tm = random_mat(&mut rng, format, rows, cols);
                let m = tm.mat();
                let what = format!("{:?} {format} [{rows}, {cols}]", k.level);
                let n = 3;
                let x = random_vec(&mut rng, n * cols);
                let mut y = vec![f32::NAN; n * rows];
                m.matmul_with(k, &x, n, &mut y);
                for t in 0..n {
                    let xt = &x[t * cols..(t + 1) * cols];
                    let mut yv = vec![f32::NAN; rows];
                    m.matvec_with(k, xt, &mut yv);
                    assert_eq!(bits(&yv), bits(&y[t * rows..(t + 1) * rows]), "{what} matmul");
                    let (exact, mag) = exact_matvec(&m, xt);
                    assert_close(&what, &yv, &exact, &mag, cols);
                }
                let xr = random_vec(&mut rng, rows);
                let mut yt = vec![f32::NAN; cols];
                m.matvec_t_with(k, &xr, &mut yt);
                let mut want = vec![0.0; cols];
                reference::matvec_t(&m, &xr, &mut want);
                assert_eq!(bits(&yt), bits(&want), "{what} matvec_t");
            }
        }
    }
}

#[test]
fn every_level_dot_and_axpy() {
    let mut rng = rng(22);
    for k in all_levels() {
        for n in [0usize, 1, 5, 8, 9, 31, 32, 33, 64, 100, 1001] {
            let a = random_vec(&mut rng, n);
            let b = random_vec(&mut rng, n);
            let exact: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            let mag: f64 = a.iter().zip(&b).map(|(x, y)| (*x as f64 * *y as f64).abs()).sum();
            assert_close("dot", &[(k.dot_f32)(&a, &b)], &[exact], &[mag], n);
            let mut y = b.clone();
            (k.axpy)(-1.5, &a, &mut y);
            let mut want = b.clone();
            for i in 0..n {
                want[i] += -1.5 * a[i];
            }
            assert_eq!(bits(&y), bits(&want));
        }
    }
}
