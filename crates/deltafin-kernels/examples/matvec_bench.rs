//! Matvec throughput per weight format on a 4096 x 4096 matrix, in GB/s of stored weight bytes
//! (scales included).
//!
//! ```text
//! cargo run --release -p deltafin-kernels --example matvec_bench            # cache-warm
//! cargo run --release -p deltafin-kernels --example matvec_bench -- --cold  # from DRAM
//! cargo run --release -p deltafin-kernels --example matvec_bench -- --simd portable  # portable path
//! ```
//!
//! Warm mode reuses one matrix, so formats smaller than the last-level cache measure compute
//! speed; `--cold` cycles through enough copies (>= 512 MiB) that every pass streams from DRAM,
//! which is what decoding a large MoE layer does.

use deltafin_kernels::{int8, mxfp4, simd_level, MatData, MatRef};
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::time::{Duration, Instant};

const N: usize = 4096;

enum Store {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
    F16(Vec<f16>),
    Int8(Vec<i8>, Vec<f32>),
    Mxfp4(Vec<u8>, Vec<u8>),
}

impl Store {
    fn mat(&self) -> MatRef<'_> {
        let data = match self {
            Store::F32(w) => MatData::F32(w),
            Store::Bf16(w) => MatData::Bf16(w),
            Store::F16(w) => MatData::F16(w),
            Store::Int8(q, s) => MatData::Int8 { q, scales: s },
            Store::Mxfp4(p, s) => MatData::Mxfp4 { packed: p, scales: s },
        };
        MatRef::new(N, N, data).expect("bench shape")
    }
}

fn build(format: &str, w: &[f32]) -> Store {
    match format {
        "f32" => Store::F32(w.to_vec()),
        "bf16" => Store::Bf16(w.iter().map(|&v| bf16::from_f32(v)).collect()),
        "f16" => Store::F16(w.iter().map(|&v| f16::from_f32(v)).collect()),
        "int8" => {
            let (mut q, mut s) = (vec![0i8; N * N], vec![0.0f32; N]);
            int8::quantize(w, N, N, &mut q, &mut s);
            Store::Int8(q, s)
        }
        _ => {
            let mut p = vec![0u8; N * mxfp4::packed_row_bytes(N)];
            let mut s = vec![0u8; N * mxfp4::scale_row_bytes(N)];
            mxfp4::quantize(w, N, N, &mut p, &mut s);
            Store::Mxfp4(p, s)
        }
    }
}

/// Seconds per matvec: the best of five windows of at least `window` each (the mean within a
/// window), after one warm-up pass over all copies. Best-of filters out noisy neighbours.
fn time_matvec(mats: &[MatRef], x: &[f32], y: &mut [f32], window: Duration) -> f64 {
    for m in mats {
        m.matvec(x, y);
    }
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let start = Instant::now();
        let mut iters = 0usize;
        while start.elapsed() < window {
            for m in mats {
                m.matvec(x, y);
            }
            iters += mats.len();
        }
        best = best.min(start.elapsed().as_secs_f64() / iters as f64);
    }
    best
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let cold = args.iter().any(|a| a == "--cold");
    // `--simd LEVEL` caps the kernels' SIMD level (portable, avx2, avx512).
    if let Some(i) = args.iter().position(|a| a == "--simd") {
        let level = args
            .get(i + 1)
            .map_or(Err("--simd needs a level".to_string()), |s| s.parse());
        if let Err(e) = level.and_then(deltafin_kernels::cap_simd_level) {
            eprintln!("matvec_bench: --simd: {e}");
            std::process::exit(2);
        }
    }
    let mut rng = StdRng::seed_from_u64(1);
    let w: Vec<f32> = (0..N * N).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let x: Vec<f32> = (0..N).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let mut y = vec![0.0f32; N];
    let pool1 = rayon::ThreadPoolBuilder::new().num_threads(1).build().expect("pool");
    let threads = rayon::current_num_threads();
    println!(
        "matvec {N}x{N}, simd {:?}, {} mode; GB/s of weight bytes",
        simd_level(),
        if cold {
            "cold (DRAM)"
        } else {
            "warm (cache-resident when it fits)"
        }
    );
    println!(
        "{:>6} {:>10} {:>14} {:>14}",
        "format",
        "MiB",
        "1 thread",
        format!("{threads} threads")
    );
    for format in ["f32", "bf16", "f16", "int8", "mxfp4"] {
        let first = build(format, &w);
        let bytes = first.mat().nbytes();
        let copies = if cold { (512usize << 20).div_ceil(bytes) } else { 1 };
        let mut stores = vec![first];
        for _ in 1..copies {
            stores.push(build(format, &w));
        }
        let mats: Vec<MatRef> = stores.iter().map(Store::mat).collect();
        let t1 = pool1.install(|| time_matvec(&mats, &x, &mut y, Duration::from_millis(200)));
        let tn = time_matvec(&mats, &x, &mut y, Duration::from_millis(200));
        println!(
            "{format:>6} {:>10.1} {:>9.1} GB/s {:>9.1} GB/s",
            bytes as f64 / (1 << 20) as f64,
            bytes as f64 / t1 / 1e9,
            bytes as f64 / tn / 1e9
        );
    }
    std::hint::black_box(&y);
}
