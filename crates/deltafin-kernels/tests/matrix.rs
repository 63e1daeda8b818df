//! Every storage format × every product against the scalar reference and an exact f64 sum, on
//! awkward shapes (rows = 1, cols off the block and SIMD widths, shapes large enough for rayon),
//! plus determinism across rayon pool sizes.

mod common;

use common::{assert_close, bits, exact_matvec, random_mat, random_vec, rng, FORMATS};
use deltafin_kernels::{mxfp4, reference, MatData, MatRef};
use half::bf16;

/// (rows, cols): the last three exceed 64K weights and take the rayon path.
const SHAPES: [(usize, usize); 13] = [
    (1, 1),
    (1, 33),
    (3, 7),
    (5, 31),
    (7, 32),
    (2, 63),
    (9, 64),
    (13, 100),
    (17, 257),
    (33, 1000),
    (300, 300),
    (1, 70_001),
    (700, 129),
];

#[test]
fn matvec_all_formats_vs_reference() {
    let mut rng = rng(11);
    for format in FORMATS {
        for &(rows, cols) in &SHAPES {
            let tm = random_mat(&mut rng, format, rows, cols);
            let m = tm.mat();
            let x = random_vec(&mut rng, cols);
            let mut y = vec![f32::NAN; rows];
            m.matvec(&x, &mut y);
            let (exact, mag) = exact_matvec(&m, &x);
            let what = format!("{format} matvec [{rows}, {cols}]");
            assert_close(&what, &y, &exact, &mag, cols);
            let mut yr = vec![0.0; rows];
            reference::matvec(&m, &x, &mut yr);
            assert_close(&format!("{what} (reference)"), &yr, &exact, &mag, cols);
        }
    }
}

#[test]
fn matmul_equals_matvecs_bit_for_bit() {
    let mut rng = rng(12);
    for format in FORMATS {
        for &(rows, cols) in &SHAPES {
            for n in [1usize, 3, 5, 7, 8, 9, 33] {
                let tm = random_mat(&mut rng, format, rows, cols);
                let m = tm.mat();
                let x = random_vec(&mut rng, n * cols);
                let mut y = vec![f32::NAN; n * rows];
                m.matmul(&x, n, &mut y);
                let mut want = vec![0.0; n * rows];
                for t in 0..n {
                    m.matvec(&x[t * cols..(t + 1) * cols], &mut want[t * rows..(t + 1) * rows]);
                }
                assert_eq!(bits(&y), bits(&want), "{format} matmul n={n} [{rows}, {cols}]");
            }
        }
    }
    // n = 0 is a no-op.
    let tm = random_mat(&mut rng, "f32", 4, 4);
    tm.mat().matmul(&[], 0, &mut []);
}

#[test]
fn matvec_t_and_row_into_match_reference_exactly() {
    let mut rng = rng(13);
    for format in FORMATS {
        for &(rows, cols) in &SHAPES {
            let tm = random_mat(&mut rng, format, rows, cols);
            let m = tm.mat();
            let x = random_vec(&mut rng, rows);
            let mut y = vec![f32::NAN; cols];
            m.matvec_t(&x, &mut y);
            let mut want = vec![0.0; cols];
            reference::matvec_t(&m, &x, &mut want);
            assert_eq!(bits(&y), bits(&want), "{format} matvec_t [{rows}, {cols}]");
            // And within the sum bound of the exact value.
            let dense = reference::dense(&m);
            let mut exact = vec![0.0f64; cols];
            let mut mag = vec![0.0f64; cols];
            for r in 0..rows {
                for c in 0..cols {
                    let p = x[r] as f64 * dense[r * cols + c] as f64;
                    exact[c] += p;
                    mag[c] += p.abs();
                }
            }
            assert_close(&format!("{format} matvec_t"), &y, &exact, &mag, rows);
            let mut out = vec![f32::NAN; cols];
            for r in [0, rows / 2, rows - 1] {
                m.row_into(r, &mut out);
                assert_eq!(bits(&out), bits(&reference::row(&m, r)), "{format} row_into {r}");
            }
        }
    }
}

#[test]
fn deterministic_across_pool_sizes() {
    let mut rng = rng(14);
    let pools: Vec<rayon::ThreadPool> = [1, 2, 3]
        .iter()
        .map(|&t| rayon::ThreadPoolBuilder::new().num_threads(t).build().unwrap())
        .collect();
    for format in FORMATS {
        for &(rows, cols) in &[(513, 1000), (1, 100_000), (2000, 33)] {
            let tm = random_mat(&mut rng, format, rows, cols);
            let m = tm.mat();
            let x = random_vec(&mut rng, 4 * cols);
            let xt = random_vec(&mut rng, rows);
            let run = |pool: &rayon::ThreadPool| {
                pool.install(|| {
                    let mut y = vec![0.0; rows];
                    m.matvec(&x[..cols], &mut y);
                    let mut ym = vec![0.0; 4 * rows];
                    m.matmul(&x, 4, &mut ym);
                    let mut yt = vec![0.0; cols];
                    m.matvec_t(&xt, &mut yt);
                    (bits(&y), bits(&ym), bits(&yt))
                })
            };
            let first = run(&pools[0]);
            for pool in &pools[1..] {
                assert!(run(pool) == first, "{format} [{rows}, {cols}] differs across pools");
            }
            // Each row on its own (the sequential path for a small matrix) gives the same bits.
            for r in 0..rows {
                let mut y1 = [0.0f32];
                m.rows(r, r + 1).matvec(&x[..cols], &mut y1);
                assert_eq!(y1[0].to_bits(), first.0[r], "{format} [{rows}, {cols}] row {r} alone");
            }
        }
    }
}

#[test]
fn mxfp4_nan_scale_poisons_its_row_only() {
    let cols = 100;
    let (pb, sb) = (mxfp4::packed_row_bytes(cols), mxfp4::scale_row_bytes(cols));
    let packed = vec![0x11u8; 2 * pb];
    let mut scales = vec![127u8; 2 * sb];
    scales[2] = 255;
    scales[sb] = 0; // 2^-127: tiny but not zero
    let m = MatRef::mxfp4(2, cols, &packed, &scales).unwrap();
    let x = vec![1.0f32; cols];
    let mut y = [0.0f32; 2];
    m.matvec(&x, &mut y);
    assert!(y[0].is_nan());
    // Row 1: 32 * 0.5 * 2^-127 + (cols - 32) * 0.5 = 34 + 2^-123.
    assert_eq!(y[1], 34.0);
    let mut t = vec![0.0f32; cols];
    m.row_into(1, &mut t);
    assert_eq!(t[0] as f64, 2f64.powi(-128));
}

#[test]
fn new_checks_lengths_and_rows_slices() {
    let w = vec![0.0f32; 12];
    assert!(MatRef::new(3, 4, MatData::F32(&w)).is_ok());
    let e = MatRef::new(4, 4, MatData::F32(&w)).unwrap_err();
    assert!(e.contains("12") && e.contains("16"), "{e}");
    let q = vec![0i8; 12];
    let s = vec![0.0f32; 2];
    assert!(MatRef::new(3, 4, MatData::Int8 { q: &q, scales: &s }).is_err());
    let p = vec![0u8; 3 * 32];
    let sc = vec![0u8; 3 * 2];
    assert!(MatRef::mxfp4(3, 33, &p, &sc).is_ok());
    assert!(MatRef::mxfp4(3, 32, &p, &sc).is_err());
    assert!(MatRef::new(usize::MAX, 2, MatData::F32(&w)).is_err());

    let mut rng = rng(15);
    for format in FORMATS {
        let tm = random_mat(&mut rng, format, 10, 45);
        let m = tm.mat();
        let sub = m.rows(3, 7);
        assert_eq!((sub.rows, sub.cols), (4, 45));
        for r in 0..4 {
            assert_eq!(reference::row(&sub, r), reference::row(&m, r + 3));
        }
        assert_eq!(m.rows(5, 5).rows, 0);
    }
}

#[test]
fn nbytes_per_format() {
    let mut rng = rng(16);
    let (rows, cols) = (6, 70);
    let want = [
        ("f32", rows * cols * 4),
        ("bf16", rows * cols * 2),
        ("f16", rows * cols * 2),
        ("int8", rows * cols + rows * 4),
        ("mxfp4", rows * (48 + 3)),
    ];
    for (format, n) in want {
        assert_eq!(random_mat(&mut rng, format, rows, cols).mat().nbytes(), n, "{format}");
    }
    let w = vec![bf16::ZERO; 4];
    assert_eq!(MatRef::new(2, 2, MatData::Bf16(&w)).unwrap().nbytes(), 8);
}
