//! The routed experts of a prefill chunk on the GPU, expert-major, in every kernel shape of
//! [`Gpu::moe_grouped`] and in the per-expert form the engine used before it (per expert:
//! a copy of its tokens' inputs, gate and up `matmul`, `swiglu`, down `matmul`), on the `bench`
//! preset's shape (256 MXFP4 experts of [1,024, 2,048], top-8) for a 2,000-token chunk with
//! uniformly random routing. Checks that every form gives the same bits and prints each one's
//! time (median of CUDA-event timings) and exact-f32 rate (issue #16 target 2).
//!
//! `cargo run --release -p deltafin-cuda --example grouped_bench [TOKENS]` on a GPU machine.

use deltafin_cuda::{GpuMat, GroupedShape, RowCopy};
use rand::{rngs::StdRng, seq::SliceRandom, SeedableRng};

mod common;

fn main() {
    let g = common::open_gpu("grouped_bench");
    let n: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(2000);
    let (n_exp, top_k, inter, hidden) = (256usize, 8usize, 1024usize, 2048usize);
    println!(
        "device: {}; {n} tokens, top-{top_k} of {n_exp} MXFP4 experts [{inter}, {hidden}]",
        g.info().name
    );
    let mut rng = StdRng::seed_from_u64(5);
    let experts: Vec<[GpuMat; 3]> = (0..n_exp)
        .map(|_| common::mxfp4_expert(&g, &mut rng, inter, hidden))
        .collect();
    let mut table = g.expert_table(n_exp, inter, hidden).unwrap();
    let refs: Vec<&[GpuMat; 3]> = experts.iter().collect();
    table.set(&g, 0, &refs).unwrap();
    // Routing: top_k distinct experts a token; pairs grouped by expert, outputs at t * k + slot.
    let mut members: Vec<Vec<usize>> = vec![Vec::new(); n_exp];
    let mut ids: Vec<usize> = (0..n_exp).collect();
    for t in 0..n {
        ids.shuffle(&mut rng);
        for (slot, &e) in ids[..top_k].iter().enumerate() {
            members[e].push(t * top_k + slot);
        }
    }
    let dst: Vec<i32> = members.iter().flatten().map(|&d| d as i32).collect();
    let pairs = dst.len();
    let mut rng = StdRng::seed_from_u64(6);
    let xg = g.upload(&common::rand_vec(&mut rng, pairs * hidden)).unwrap();
    let flop = 2.0 * pairs as f64 * 3.0 * (inter * hidden) as f64;
    let reps = 5;
    let tiles_of = |tmax: usize| {
        let mut tiles = Vec::new();
        let mut off = 0usize;
        for (e, m) in members.iter().enumerate() {
            for t0 in (0..m.len()).step_by(tmax) {
                tiles.push([e as i32, (off + t0) as i32, (m.len() - t0).min(tmax) as i32]);
            }
            off += m.len();
        }
        tiles
    };
    // The per-expert form.
    let mut y_ref = g.zeros(n * top_k * hidden).unwrap();
    let dst_d = g.upload(&dst).unwrap();
    let per_expert = |y: &mut deltafin_cuda::GpuBuf| -> Result<(), deltafin_cuda::CudaError> {
        let mut off = 0;
        for (e, m) in experts.iter().zip(&members) {
            let rows = m.len();
            if rows == 0 {
                continue;
            }
            let xe = g.copy_range(&xg, off * hidden, rows * hidden)?;
            let (mut a, mut b, mut hh, mut o) = (
                g.zeros(rows * inter)?,
                g.zeros(rows * inter)?,
                g.zeros(rows * inter)?,
                g.zeros(rows * hidden)?,
            );
            e[0].matmul(&g, &xe, rows, &mut a)?;
            e[1].matmul(&g, &xe, rows, &mut b)?;
            g.swiglu(&a, &b, &mut hh)?;
            e[2].matmul(&g, &hh, rows, &mut o)?;
            g.copy_rows(RowCopy::Scatter, &o, &dst_d, off, rows, hidden, y)?;
            off += rows;
        }
        Ok(())
    };
    let ms = g.time_ms(reps, || per_expert(&mut y_ref)).unwrap();
    let want = g.download(&y_ref).unwrap();
    println!(
        "per-expert matmuls (before)           {ms:>8.3} ms  {:>6.2} TFLOP/s",
        flop / (ms as f64 * 1e-3) / 1e12
    );
    let mut h = g.zeros(pairs * inter).unwrap();
    for shape in GroupedShape::ALL {
        let tiles = tiles_of(shape.tokens);
        let mut y = g.zeros(n * top_k * hidden).unwrap();
        let ms = g
            .time_ms(reps, || g.moe_grouped(shape, &table, &tiles, &xg, &dst, &mut h, &mut y))
            .unwrap();
        let got = g.download(&y).unwrap();
        let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
        let form = if shape.staged {
            format!(
                "staged, {} rows, {} blocks/SM{}",
                shape.cta_rows,
                shape.blocks_per_sm,
                if shape.prefetch { ", prefetch" } else { "" }
            )
        } else {
            format!("through L1, U={}", shape.gate_up_unroll)
        };
        println!(
            "grouped T={:<2} gate/up R={} down R={:<2} {form:<24} {ms:>8.3} ms  {:>6.2} TFLOP/s  bits equal: {same}",
            shape.tokens,
            shape.gate_up_rows,
            shape.down_rows,
            flop / (ms as f64 * 1e-3) / 1e12
        );
    }
}
