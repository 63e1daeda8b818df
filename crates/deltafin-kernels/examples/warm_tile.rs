//! Warm (L2-resident) cost of the products per 32 weights and token: `matvec` × n against
//! `matmul` of n tokens, MXFP4 and int8 `[64, 2048]`, one thread, best of 15 windows. Isolates
//! the arithmetic from DRAM (the `kernels` bench measures from DRAM).
//!
//! ```text
//! cargo run --release -p deltafin-kernels --example warm_tile
//! ```

use deltafin_kernels::{MatData, MatRef};
use std::time::Instant;
fn main() {
    let (rows, cols) = (64usize, 2048usize);
    let packed: Vec<u8> = (0..rows * cols / 2)
        .map(|i| ((i * 2654435761usize) >> 7) as u8)
        .collect();
    let scales = vec![120u8; rows * cols / 32];
    let m = MatRef::mxfp4(rows, cols, &packed, &scales).unwrap();
    let q: Vec<i8> = (0..rows * cols).map(|i| ((i * 2654435761usize) >> 7) as i8).collect();
    let qs = vec![0.01f32; rows];
    let mi = MatRef::new(rows, cols, MatData::Int8 { q: &q, scales: &qs }).unwrap();
    let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    for (name, m) in [("mxfp4", m), ("int8", mi)] {
        for n in [1usize, 4, 6, 8, 12, 64] {
            let x: Vec<f32> = (0..n * cols).map(|i| (i % 13) as f32 * 0.1 - 0.6).collect();
            let mut y = vec![0f32; n * rows];
            let reps = 2000 / n + 1;
            let mut bv = f64::INFINITY;
            let mut bm = f64::INFINITY;
            pool.install(|| {
                for _ in 0..15 {
                    let t = Instant::now();
                    for _ in 0..reps {
                        for tt in 0..n {
                            m.matvec(&x[tt * cols..(tt + 1) * cols], &mut y[tt * rows..(tt + 1) * rows]);
                        }
                    }
                    bv = bv.min(t.elapsed().as_secs_f64());
                    let t = Instant::now();
                    for _ in 0..reps {
                        m.matmul(&x, n, &mut y);
                    }
                    bm = bm.min(t.elapsed().as_secs_f64());
                }
            });
            let per = |s: f64| s / (reps * n * rows * cols / 32) as f64 * 1e9;
            println!(
                "{name} n={n:2}: matvec x n {:.3} ns/32w/token   matmul {:.3}   speedup {:.2}",
                per(bv),
                per(bm),
                bv / bm
            );
        }
    }
}
