//! MEASUREMENT ONLY: the MLA attention core of a batched pass at a given shape, per
//! (token, head) streaming (the loop `DeepseekV3::attend_head` runs: scores with `dot`, softmax,
//! `axpy` per position) against the blocked kernel (`blocked_attention::attend_rows`), on the
//! same random latents and queries, one thread, interleaved A B B A per round so that the
//! shared machine's load affects both alike. Checks the outputs are bit-identical.
//!
//! Usage: `attn_kernel <kv_lora_rank> <rope_dim> <heads> <cached> <tokens> <rounds>`, e.g. the
//! `bench` preset's last 8-token tile of a 2,000-token prefill:
//! `attn_kernel 256 32 16 1992 8 5`. Prints milliseconds per call (median over rounds) and the ratio. GQA shapes: `rope_dim` 0,
//! `kv_lora_rank` = head_dim and `heads` = query heads per key/value head.

use std::time::Instant;

use deltafin_engine::blocked_attention::{attend_rows, Values};
use deltafin_kernels::{axpy, dot, softmax_inplace};

fn main() {
    let a: Vec<usize> = std::env::args()
        .skip(1)
        .map(|s| s.parse().expect("numeric arguments"))
        .collect();
    let [kvl, rope, nh, cached, nt, rounds] = a[..] else {
        eprintln!("usage: attn_kernel <kv_lora_rank> <rope_dim> <heads> <cached> <tokens> <rounds>");
        std::process::exit(2);
    };
    let n = cached + nt;
    let mut seed = 1u32;
    let mut rnd = || {
        seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        (seed >> 8) as f32 / (1u32 << 24) as f32 - 0.5
    };
    let ckv: Vec<f32> = (0..n * kvl).map(|_| rnd()).collect();
    let kpe: Vec<f32> = (0..n * rope).map(|_| rnd()).collect();
    let rows = nt * nh;
    let q_abs: Vec<f32> = (0..rows * kvl).map(|_| rnd()).collect();
    let q_pe: Vec<f32> = (0..rows * rope).map(|_| rnd()).collect();
    let scale = 0.1f32;
    let score = |r: usize, t: usize| {
        (dot(&q_abs[r * kvl..(r + 1) * kvl], &ckv[t * kvl..(t + 1) * kvl])
            + dot(&q_pe[r * rope..(r + 1) * rope], &kpe[t * rope..(t + 1) * rope]))
            * scale
    };
    // A: per (token, head), as attend_head.
    let per_head = || -> Vec<f32> {
        let mut out = Vec::with_capacity(rows * kvl);
        for r in 0..rows {
            let pos = cached + r / nh;
            let mut s: Vec<f32> = (0..=pos).map(|t| score(r, t)).collect();
            softmax_inplace(&mut s);
            let mut ctx = vec![0f32; kvl];
            for (t, p) in s.iter().enumerate() {
                axpy(*p, &ckv[t * kvl..(t + 1) * kvl], &mut ctx);
            }
            out.extend(ctx);
        }
        out
    };
    // B: blocked.
    let windows: Vec<(usize, usize)> = (0..rows).map(|r| (0, cached + r / nh + 1)).collect();
    let mut scratch = Vec::new();
    let mut blocked = || -> Vec<f32> {
        let mut ctx = vec![0f32; rows * kvl];
        attend_rows(
            &windows,
            score,
            |_, s| softmax_inplace(s),
            Values {
                data: &ckv,
                stride: kvl,
                offset: 0,
                width: kvl,
            },
            &mut scratch,
            &mut ctx,
        );
        ctx
    };
    let (ra, rb) = (per_head(), blocked());
    assert!(
        ra.iter().zip(&rb).all(|(x, y)| x.to_bits() == y.to_bits()),
        "outputs differ"
    );
    let (mut ta, mut tb) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        for which in [0, 1, 1, 0] {
            let t = Instant::now();
            let o = if which == 0 { per_head() } else { blocked() };
            std::hint::black_box(o);
            let s = t.elapsed().as_secs_f64();
            if which == 0 {
                ta.push(s);
            } else {
                tb.push(s);
            }
        }
    }
    let med = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (a, b) = (med(&mut ta), med(&mut tb));
    println!(
        "kvl {kvl} rope {rope} heads {nh} keys {n} tokens {nt}: per (token, head) {:.3} ms, blocked {:.3} ms, ratio {:.2} (bit-identical)",
        a * 1e3,
        b * 1e3,
        a / b
    );
}
