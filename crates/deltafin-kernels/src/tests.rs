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
    {
        use crate::SimdLevel;
        let has = |l: SimdLevel| levels.iter().any(|k| k.level == l);
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            assert!(has(SimdLevel::Avx2), "AVX2 level not exercised");
        }
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("avx512f") {
            assert!(has(SimdLevel::Avx512), "AVX-512 level not exercised");
        }
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

/// The tile kernels on every level: `matmul` must equal `n` matvecs bit for bit for every
/// format, token counts around the tile sizes (1, 3, 7, 8, 9, 33), odd row counts, widths with
/// partial MXFP4 blocks / chunks and scalar tails, and matrices large enough to span several
/// row blocks and to be split across threads.
#[test]
fn every_level_matmul_equals_matvecs() {
    let mut rng = rng(24);
    let shapes = [
        (1usize, 1usize),
        (3, 7),
        (5, 33),
        (7, 129),
        (13, 257),
        (33, 1000),
        (31, 2100),
        (5, 3300),
        (129, 520),
    ];
    for k in all_levels() {
        for format in FORMATS {
            for &(rows, cols) in &shapes {
                let tm = random_mat(&mut rng, format, rows, cols);
                let m = tm.mat();
                for n in [1usize, 2, 3, 7, 8, 9, 33] {
                    let x = random_vec(&mut rng, n * cols);
                    let mut y = vec![f32::NAN; n * rows];
                    m.matmul_with(k, &x, n, &mut y);
                    let mut want = vec![f32::NAN; n * rows];
                    for t in 0..n {
                        m.matvec_with(k, &x[t * cols..(t + 1) * cols], &mut want[t * rows..(t + 1) * rows]);
                    }
                    let what = format!("{:?} {format} [{rows}, {cols}] n={n}", k.level);
                    assert_eq!(bits(&y), bits(&want), "{what}");
                }
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

/// `dot_f32_2x2` on every level equals the level's `dot_f32` of each pair bit for bit, for
/// lengths around the 8- and 32-element steps.
#[test]
fn every_level_dot_2x2_equals_four_dots() {
    let mut rng = rng(26);
    for k in all_levels() {
        for n in [0usize, 1, 5, 8, 9, 31, 32, 33, 64, 100, 256, 288, 1001] {
            let v: Vec<Vec<f32>> = (0..4).map(|_| random_vec(&mut rng, n)).collect();
            let got = (k.dot_f32_2x2)(&v[0], &v[1], &v[2], &v[3]);
            let want = [
                (k.dot_f32)(&v[0], &v[2]),
                (k.dot_f32)(&v[0], &v[3]),
                (k.dot_f32)(&v[1], &v[2]),
                (k.dot_f32)(&v[1], &v[3]),
            ];
            assert_eq!(bits(&got), bits(&want), "{:?} n={n}", k.level);
        }
    }
}

/// MXFP4 on every level: row counts and widths around the AVX-512 kernel's 4-block chunks and
/// partial last block, scale bytes 0 (2^-127; alone, and among others), 1 ..= 220 (with and
/// without a 0 among them) and 255 (NaN), large activations; each row's result must not depend
/// on the rows computed with it.
#[test]
fn every_level_mxfp4_edges() {
    use crate::{mxfp4, MatRef};
    use rand::Rng;
    let mut rng = rng(23);
    let special = [0u8, 1, 2, 3, 125, 127, 130, 200, 220];
    for k in all_levels() {
        for cols in [
            1usize, 31, 32, 33, 64, 96, 100, 127, 128, 129, 160, 255, 256, 257, 511, 640, 1000,
        ] {
            let rows = 7;
            let (pb, sb) = (mxfp4::packed_row_bytes(cols), mxfp4::scale_row_bytes(cols));
            let packed: Vec<u8> = (0..rows * pb).map(|_| rng.random()).collect();
            let mut scales: Vec<u8> = (0..rows * sb).map(|_| rng.random_range(120u8..=134)).collect();
            // Row 1: every scale class; row 2: one NaN block; row 3: extreme finite scales.
            for (i, s) in scales[sb..2 * sb].iter_mut().enumerate() {
                *s = special[i % special.len()];
            }
            scales[2 * sb + (sb - 1) / 2] = 255;
            for (i, s) in scales[3 * sb..4 * sb].iter_mut().enumerate() {
                *s = if i % 2 == 0 { 0 } else { 200 };
            }
            // Row 4: every finite class but 0, so the AVX-512 row converts whole groups of 16
            // scale bytes at once.
            for (i, s) in scales[4 * sb..5 * sb].iter_mut().enumerate() {
                *s = special[1 + i % (special.len() - 1)];
            }
            // Row 5: every block 2^-127, whose products are lost unless that scale is right.
            scales[5 * sb..6 * sb].fill(0);
            let m = MatRef::mxfp4(rows, cols, &packed, &scales).unwrap();
            let mut x = random_vec(&mut rng, cols);
            x[cols / 2] = 3.0e4;
            let what = format!("{:?} mxfp4 [{rows}, {cols}]", k.level);
            let mut y = vec![f32::NAN; rows];
            m.matvec_with(k, &x, &mut y);
            assert!(y[2].is_nan(), "{what}: NaN scale row");
            let (exact, mag) = exact_matvec(&m, &x);
            for r in [0, 1, 3, 4, 5, 6] {
                assert_close(
                    &format!("{what} row {r}"),
                    &y[r..r + 1],
                    &exact[r..r + 1],
                    &mag[r..r + 1],
                    cols,
                );
            }
            for r in 0..rows {
                for len in [1, 2, 3] {
                    if r + len > rows {
                        continue;
                    }
                    let mut ys = vec![f32::NAN; len];
                    m.rows(r, r + len).matvec_with(k, &x, &mut ys);
                    assert_eq!(bits(&ys), bits(&y[r..r + len]), "{what}: rows {r}..{} alone", r + len);
                }
            }
            // The tile kernels on the same rows (special scales, NaN row): 7 tokens, token 3 is x.
            let n = 7;
            let mut xs = random_vec(&mut rng, n * cols);
            xs[3 * cols..4 * cols].copy_from_slice(&x);
            let mut ym = vec![f32::NAN; n * rows];
            m.matmul_with(k, &xs, n, &mut ym);
            assert_eq!(bits(&ym[3 * rows..4 * rows]), bits(&y), "{what}: matmul token 3");
            for t in 0..n {
                let mut yv = vec![f32::NAN; rows];
                m.matvec_with(k, &xs[t * cols..(t + 1) * cols], &mut yv);
                assert_eq!(
                    bits(&ym[t * rows..(t + 1) * rows]),
                    bits(&yv),
                    "{what}: matmul token {t}"
                );
            }
        }
    }
}

/// Zero-width MXFP4 matrices give zeros on every level (no blocks to read).
#[test]
fn every_level_mxfp4_zero_cols() {
    use crate::MatRef;
    for k in all_levels() {
        let m = MatRef::mxfp4(3, 0, &[], &[]).unwrap();
        let mut y = [f32::NAN; 3];
        m.matvec_with(k, &[], &mut y);
        assert_eq!(y, [0.0; 3]);
        let mut y2 = [f32::NAN; 6];
        m.matmul_with(k, &[], 2, &mut y2);
        assert_eq!(y2, [0.0; 6]);
    }
}
