//! Element-wise ops and reductions.

mod common;

use deltafin_kernels::*;

#[test]
fn rms_norm_matches_definition() {
    let x = [1.0f32, -2.0, 3.0, -4.0];
    let w = [1.0f32, 0.5, 2.0, 1.0];
    let eps = 1e-6;
    let inv = 1.0 / ((1.0f32 + 4.0 + 9.0 + 16.0) / 4.0 + eps).sqrt();
    let want: Vec<f32> = x.iter().zip(&w).map(|(a, b)| b * (a * inv)).collect();
    let mut out = [0.0f32; 4];
    rms_norm(&x, &w, eps, &mut out);
    assert_eq!(out.to_vec(), want);
    let mut y = x;
    rms_norm_inplace(&mut y, &w, eps);
    assert_eq!(y, out);
    // Long vector: against an f64 computation.
    let mut rng = common::rng(3);
    let x = common::random_vec(&mut rng, 7168);
    let w = common::random_vec(&mut rng, 7168);
    let mut out = vec![0.0f32; 7168];
    rms_norm(&x, &w, 1e-6, &mut out);
    let ms: f64 = x.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / 7168.0;
    let inv = 1.0 / (ms + 1e-6).sqrt();
    for i in 0..7168 {
        let e = w[i] as f64 * x[i] as f64 * inv;
        assert!((out[i] as f64 - e).abs() <= 1e-5 * e.abs() + 1e-7, "{i}");
    }
}

#[test]
fn softmax_values_and_edge_cases() {
    let mut x = [1.0f32, 2.0, 3.0, f32::NEG_INFINITY];
    softmax_inplace(&mut x);
    let e: Vec<f64> = [1.0f64, 2.0, 3.0].iter().map(|v| (v - 3.0).exp()).collect();
    let s: f64 = e.iter().sum();
    for i in 0..3 {
        assert!((x[i] as f64 - e[i] / s).abs() < 1e-7);
    }
    assert_eq!(x[3], 0.0);
    // Large logits do not overflow (max subtracted).
    let mut x = [1000.0f32, 1000.0];
    softmax_inplace(&mut x);
    assert_eq!(x, [0.5, 0.5]);
    // All -inf: all zeros, no NaN. Empty: no-op.
    let mut x = [f32::NEG_INFINITY; 3];
    softmax_inplace(&mut x);
    assert_eq!(x, [0.0; 3]);
    softmax_inplace(&mut []);
    let mut x = [0.0f32, f32::NAN];
    softmax_inplace(&mut x);
    assert!(x.iter().all(|v| v.is_nan()));
}

#[test]
fn silu_sigmoid() {
    assert_eq!(sigmoid(0.0), 0.5);
    assert_eq!(silu(0.0), 0.0);
    assert_eq!(sigmoid(100.0), 1.0);
    assert_eq!(sigmoid(-200.0), 0.0);
    assert_eq!(silu(-200.0), -0.0);
    for &v in &[-3.5f32, -0.1, 0.7, 2.0, 9.0] {
        let s = 1.0 / (1.0 + (-(v as f64)).exp());
        assert!((sigmoid(v) as f64 - s).abs() < 1e-7);
        assert!((silu(v) as f64 - v as f64 * s).abs() < 1e-6 * (1.0 + v.abs() as f64));
    }
}

#[test]
fn dot_axpy_argmax() {
    let mut rng = common::rng(4);
    for n in [0usize, 1, 7, 8, 31, 33, 1000] {
        let a = common::random_vec(&mut rng, n);
        let b = common::random_vec(&mut rng, n);
        let exact: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
        let mag: f64 = a.iter().zip(&b).map(|(x, y)| (*x as f64 * *y as f64).abs()).sum();
        common::assert_close("dot", &[dot(&a, &b)], &[exact], &[mag], n);
        let mut y = b.clone();
        axpy(0.75, &a, &mut y);
        let mut want = b.clone();
        for i in 0..n {
            want[i] += 0.75 * a[i];
        }
        assert_eq!(common::bits(&y), common::bits(&want), "axpy n={n}");
    }
    assert_eq!(argmax(&[1.0, 3.0, 2.0, 3.0]), 1);
    assert_eq!(argmax(&[f32::NAN, -1.0, -2.0]), 1);
    assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NEG_INFINITY]), 0);
    assert_eq!(argmax(&[]), 0);
}
