//! The attention core of one MLA layer for a prompt chunk, in-process and warm: both batched
//! forms (`mla_chunk` absorbed and decompressed) on random data at the `bench` preset's shape
//! (16 heads, nope 64, rope 32, v 64, kv_lora_rank 256, int8 `kv_b_proj`), seconds per call (best of 5) on the
//! rayon pool (RAYON_NUM_THREADS to pin the thread count).
//!
//! ```text
//! cargo run --release -p deltafin-engine --example mla_attention -- [TOKENS]
//! ```

use deltafin_engine::blocks::mla::{mla_chunk, MlaShape};
use deltafin_engine::rope::RotaryEmbedding;
use deltafin_engine::MlaForm;
use deltafin_kernels::{MatData, MatRef};
use std::time::Instant;

fn main() {
    let nt: usize = std::env::args()
        .nth(1)
        .map(|s| s.parse().expect("TOKENS"))
        .unwrap_or(1000);
    let (nh, nope, rope, vd, kvl) = (16usize, 64usize, 32usize, 64usize, 256usize);
    let mut seed = 7u32;
    let mut rnd = || {
        seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        (seed >> 8) as f32 / (1u32 << 24) as f32 - 0.5
    };
    let rot = RotaryEmbedding::new(&deltafin_format::Rope::Default { theta: 10000.0 }, rope, false);
    let shape = MlaShape {
        n_heads: nh,
        nope,
        rope,
        v_head_dim: vd,
        kv_lora_rank: kvl,
        scale: 0.1,
        rotary: Some(&rot),
    };
    // kv_b_proj as the default layout stores it: int8 rows with one f32 scale each.
    let wq: Vec<i8> = (0..nh * (nope + vd) * kvl).map(|_| (rnd() * 254.0) as i8).collect();
    let ws: Vec<f32> = (0..nh * (nope + vd)).map(|_| 0.01 + rnd().abs() * 0.01).collect();
    let kv_b = MatRef::new(nh * (nope + vd), kvl, MatData::Int8 { q: &wq, scales: &ws }).expect("kv_b");
    let ckv: Vec<f32> = (0..nt * kvl).map(|_| rnd()).collect();
    let kpe: Vec<f32> = (0..nt * rope).map(|_| rnd()).collect();
    let q: Vec<f32> = (0..nt * nh * (nope + rope)).map(|_| rnd()).collect();
    for form in [MlaForm::Absorbed, MlaForm::Decompressed] {
        let mut best = f64::INFINITY;
        for _ in 0..5 {
            let t = Instant::now();
            std::hint::black_box(mla_chunk(&shape, kv_b, &q, 0, &ckv, &kpe, form));
            best = best.min(t.elapsed().as_secs_f64());
        }
        println!(
            "{form:?}: {nt} tokens, {} threads: {best:.3} s",
            rayon::current_num_threads()
        );
    }
}
