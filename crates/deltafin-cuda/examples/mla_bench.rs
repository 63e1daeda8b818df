//! MLA over the chunks of a 2,000-token prompt on the GPU in both kernel forms of
//! [`Gpu::mla_prefill`] (one block a (split, token); tiled: one block a (split, group of
//! tokens)), on the `bench` preset's attention (16 heads, latent rank 256, nope 64, rope 32,
//! v 64, int8 `kv_b_proj`) and DeepSeek-V3's (rank 512, nope 128, rope 64, v 128). Checks that
//! both forms give the same bits and prints each chunk's time (median of CUDA-event timings)
//! and the ratio (issue #16 target 2).
//!
//! `cargo run --release -p deltafin-cuda --example mla_bench [TOKENS] [CHUNK]` on a GPU machine.

use deltafin_cuda::MlaPrefillForm;
use rand::{rngs::StdRng, SeedableRng};

mod common;

fn main() {
    let g = common::open_gpu("mla_bench");
    let arg = |i: usize, d: usize| std::env::args().nth(i).and_then(|a| a.parse().ok()).unwrap_or(d);
    let (total, chunk) = (arg(1, 2000), arg(2, 507));
    let mut rng = StdRng::seed_from_u64(9);
    let mut rand = |n: usize| common::rand_vec(&mut rng, n);
    for (label, s) in [
        ("bench preset", common::MLA_BENCH),
        ("DeepSeek-V3 dims, 16 heads", common::MLA_DEEPSEEK_V3_16_HEADS),
    ] {
        let (nh, qk, kvl) = (s.n_heads, s.nope + s.rope, s.kv_lora_rank);
        let rows = nh * (s.nope + s.v_head_dim);
        let kvb = common::int8_upload(&g, &rand(rows * kvl), rows, kvl);
        let ckv = g.upload(&rand(total * kvl)).unwrap();
        let kpe = g.upload(&rand(total * s.rope)).unwrap();
        println!("{label}: {s:?}, {total} tokens in chunks of {chunk}");
        let (mut sum_a, mut sum_b) = (0f32, 0f32);
        for t0 in (0..total).step_by(chunk) {
            let n = chunk.min(total - t0);
            let q = g.upload(&rand(n * nh * qk)).unwrap();
            let mut sc = g.zeros(n * s.scratch_len(t0 + n)).unwrap();
            let mut outs = Vec::new();
            let mut times = Vec::new();
            for form in [MlaPrefillForm::PerToken, MlaPrefillForm::Tiled] {
                let mut out = g.zeros(n * nh * s.v_head_dim).unwrap();
                let ms = g
                    .time_ms(5, || {
                        g.mla_prefill(form, s, &q, &ckv, &kpe, &kvb, t0, n, 0.1, &mut sc, &mut out)
                    })
                    .unwrap();
                times.push(ms);
                outs.push(g.download(&out).unwrap());
            }
            let same = outs[0].iter().zip(&outs[1]).all(|(a, b)| a.to_bits() == b.to_bits());
            println!(
                "  chunk {t0:>5}+{n:<4} per token {:>8.3} ms   tiled {:>8.3} ms   {:>5.2}x   bits equal: {same}",
                times[0],
                times[1],
                times[0] / times[1]
            );
            sum_a += times[0];
            sum_b += times[1];
        }
        println!(
            "  whole prompt: per token {sum_a:.3} ms, tiled {sum_b:.3} ms, {:.2}x",
            sum_a / sum_b
        );
    }
}
