//! Target 3 of the expert-store issue: the MXFP4 and int8 matrix-vector kernels should process
//! weights at ≥ 50 % of the single-core memory read bandwidth, measured in the same process by a
//! plain streaming read (a sum of u64) over the same number of bytes.
//!
//! ```text
//! cargo bench -p deltafin-kernels --bench kernels
//! DELTAFIN_KERNELS_SIMD=avx2 cargo bench -p deltafin-kernels --bench kernels  # AVX2 kernels
//! ```
//!
//! Everything runs on one thread (a one-thread rayon pool, so `matvec` does not split rows).
//! Each kernel cycles through copies of a DeepSeek-V3-expert-shaped matrix totalling
//! [`WORKING_SET`] bytes, far larger than the last-level cache, so every pass streams from DRAM
//! as decoding a large MoE layer does. divan prints its table (throughput = weight bytes, scales
//! included, per second); then a summary measured the same way in this process prints GB/s and
//! each kernel's ratio to the streaming read.
//!
//! Batched products (issue 6): `matmul` of n = 1, 8, 64 tokens against `n` matvecs over the
//! first [`MM_SET`] bytes of the same matrices (larger than the L3 slice, so the first token
//! tile streams every weight from DRAM), printed as weight GB/s-equivalent (n × weight bytes
//! per second) and ns per token per matrix.

use std::hint::black_box;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use deltafin_kernels::{mxfp4, MatData, MatRef};
use divan::counter::BytesCount;

/// Bytes each measurement cycles through (≥ 8× a server L3 slice).
const WORKING_SET: usize = 256 << 20;
/// Expert matrix shape: DeepSeek-V3 `gate_proj` of the `bench` preset, `[1024, 2048]`, and a
/// square 4096 for int8 backbone matrices.
const MX_ROWS: usize = 1024;
const MX_COLS: usize = 2048;
const I8_N: usize = 4096;
/// Bytes of weights the batched benchmarks cycle through.
const MM_SET: usize = 64 << 20;
/// Token counts of the batched benchmarks.
const MM_N: [usize; 3] = [1, 8, 64];

/// splitmix64, to fill buffers without pulling in a generator.
fn fill(buf: &mut [u8], mut seed: u64) {
    for c in buf.chunks_mut(8) {
        seed = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = seed;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        c.copy_from_slice(&z.to_le_bytes()[..c.len()]);
    }
}

struct Mx {
    packed: Vec<u8>,
    scales: Vec<u8>,
}
struct I8 {
    q: Vec<i8>,
    scales: Vec<f32>,
}

struct Data {
    mx: Vec<Mx>,
    i8: Vec<I8>,
    /// Same bytes as one full pass over `mx` (the streaming reference for MXFP4).
    stream_mx: Vec<u64>,
    /// Same bytes as one full pass over `i8`.
    stream_i8: Vec<u64>,
    x_mx: Vec<f32>,
    x_i8: Vec<f32>,
    /// 64 tokens of activations for the batched benchmarks, `[64, cols]`.
    xs_mx: Vec<f32>,
    xs_i8: Vec<f32>,
}

fn data() -> &'static Data {
    static D: OnceLock<Data> = OnceLock::new();
    D.get_or_init(|| {
        let mx_bytes = MX_ROWS * (mxfp4::packed_row_bytes(MX_COLS) + mxfp4::scale_row_bytes(MX_COLS));
        let mx: Vec<Mx> = (0..WORKING_SET.div_ceil(mx_bytes))
            .map(|i| {
                let mut packed = vec![0u8; MX_ROWS * mxfp4::packed_row_bytes(MX_COLS)];
                fill(&mut packed, i as u64);
                // Scale 2^-7: weights ~0.01-0.05, as the bench preset's experts.
                let scales = vec![120u8; MX_ROWS * mxfp4::scale_row_bytes(MX_COLS)];
                Mx { packed, scales }
            })
            .collect();
        let i8_bytes = I8_N * I8_N + I8_N * 4;
        let i8: Vec<I8> = (0..WORKING_SET.div_ceil(i8_bytes))
            .map(|i| {
                let mut q = vec![0u8; I8_N * I8_N];
                fill(&mut q, 1000 + i as u64);
                I8 {
                    q: q.into_iter().map(|b| b as i8).collect(),
                    scales: vec![1.0 / 127.0; I8_N],
                }
            })
            .collect();
        let words = |n: usize| {
            let mut v = vec![0u64; n.div_ceil(8)];
            fill(bytemuck_u8(&mut v), 7);
            v
        };
        let x = |n: usize| (0..n).map(|i| ((i % 17) as f32 - 8.0) / 8.0).collect::<Vec<f32>>();
        Data {
            stream_mx: words(mx.len() * mx_bytes),
            stream_i8: words(i8.len() * i8_bytes),
            mx,
            i8,
            x_mx: x(MX_COLS),
            x_i8: x(I8_N),
            xs_mx: (0..64 * MX_COLS).map(|i| ((i % 23) as f32 - 11.0) / 11.0).collect(),
            xs_i8: (0..64 * I8_N).map(|i| ((i % 23) as f32 - 11.0) / 11.0).collect(),
        }
    })
}

fn bytemuck_u8(v: &mut [u64]) -> &mut [u8] {
    // SAFETY: u64 has no padding and any byte pattern is a valid u64; the length is exact.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), v.len() * 8) }
}

fn one_thread() -> &'static rayon::ThreadPool {
    static P: OnceLock<rayon::ThreadPool> = OnceLock::new();
    P.get_or_init(|| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .expect("rayon pool")
    })
}

fn mx_pass(d: &Data, y: &mut [f32]) {
    for m in &d.mx {
        let mat = MatRef::mxfp4(MX_ROWS, MX_COLS, &m.packed, &m.scales).expect("bench shape");
        mat.matvec(black_box(&d.x_mx), y);
    }
}

fn i8_pass(d: &Data, y: &mut [f32]) {
    for m in &d.i8 {
        let mat = MatRef::new(
            I8_N,
            I8_N,
            MatData::Int8 {
                q: &m.q,
                scales: &m.scales,
            },
        )
        .expect("bench shape");
        mat.matvec(black_box(&d.x_i8), y);
    }
}

fn mx_mat(m: &Mx) -> MatRef<'_> {
    MatRef::mxfp4(MX_ROWS, MX_COLS, &m.packed, &m.scales).expect("bench shape")
}

fn i8_mat(m: &I8) -> MatRef<'_> {
    let data = MatData::Int8 {
        q: &m.q,
        scales: &m.scales,
    };
    MatRef::new(I8_N, I8_N, data).expect("bench shape")
}

/// The first matrices of `mats` that together hold at least [`MM_SET`] bytes.
fn mm_set<'a>(mats: Vec<MatRef<'a>>) -> Vec<MatRef<'a>> {
    let per = mats[0].nbytes();
    mats.into_iter().take(MM_SET.div_ceil(per)).collect()
}

/// One pass of `n`-token products over `mats`: one `matmul`, or `n` matvecs per matrix.
fn mm_pass(mats: &[MatRef], xs: &[f32], n: usize, batched: bool, y: &mut [f32]) {
    for m in mats {
        let (rows, cols) = (m.rows, m.cols);
        let x = black_box(&xs[..n * cols]);
        if batched {
            m.matmul(x, n, &mut y[..n * rows]);
        } else {
            for t in 0..n {
                m.matvec(&x[t * cols..(t + 1) * cols], &mut y[t * rows..(t + 1) * rows]);
            }
        }
    }
}

/// The reference: every byte read once, the least work a kernel over these bytes can do.
fn stream(words: &[u64]) -> u64 {
    words.iter().fold(0u64, |a, &w| a.wrapping_add(w))
}

fn mx_bytes(d: &Data) -> usize {
    d.mx.iter().map(|m| m.packed.len() + m.scales.len()).sum()
}
fn i8_bytes(d: &Data) -> usize {
    d.i8.iter().map(|m| m.q.len() + m.scales.len() * 4).sum()
}

#[divan::bench(sample_count = 10, sample_size = 1)]
fn stream_read_mxfp4_size(b: divan::Bencher) {
    let d = data();
    b.counter(BytesCount::new(d.stream_mx.len() * 8))
        .bench(|| one_thread().install(|| stream(black_box(&d.stream_mx))));
}

#[divan::bench(sample_count = 10, sample_size = 1)]
fn matvec_mxfp4(b: divan::Bencher) {
    let d = data();
    let mut y = vec![0f32; MX_ROWS];
    b.counter(BytesCount::new(mx_bytes(d)))
        .bench_local(|| one_thread().install(|| mx_pass(d, &mut y)));
}

#[divan::bench(sample_count = 10, sample_size = 1)]
fn stream_read_int8_size(b: divan::Bencher) {
    let d = data();
    b.counter(BytesCount::new(d.stream_i8.len() * 8))
        .bench(|| one_thread().install(|| stream(black_box(&d.stream_i8))));
}

#[divan::bench(sample_count = 10, sample_size = 1)]
fn matvec_int8(b: divan::Bencher) {
    let d = data();
    let mut y = vec![0f32; I8_N];
    b.counter(BytesCount::new(i8_bytes(d)))
        .bench_local(|| one_thread().install(|| i8_pass(d, &mut y)));
}

#[divan::bench(args = MM_N, sample_count = 5, sample_size = 1)]
fn matmul_mxfp4(b: divan::Bencher, n: usize) {
    let d = data();
    let mats = mm_set(d.mx.iter().map(mx_mat).collect());
    let mut y = vec![0f32; 64 * MX_ROWS];
    let bytes: usize = mats.iter().map(|m| m.nbytes()).sum();
    b.counter(BytesCount::new(n * bytes))
        .bench_local(|| one_thread().install(|| mm_pass(&mats, &d.xs_mx, n, true, &mut y)));
}

#[divan::bench(args = MM_N, sample_count = 5, sample_size = 1)]
fn matmul_int8(b: divan::Bencher, n: usize) {
    let d = data();
    let mats = mm_set(d.i8.iter().map(i8_mat).collect());
    let mut y = vec![0f32; 64 * I8_N];
    let bytes: usize = mats.iter().map(|m| m.nbytes()).sum();
    b.counter(BytesCount::new(n * bytes))
        .bench_local(|| one_thread().install(|| mm_pass(&mats, &d.xs_i8, n, true, &mut y)));
}

/// Best-of-`n` seconds of `f` after one warm-up call (best-of filters noisy neighbours).
fn best(n: usize, mut f: impl FnMut()) -> f64 {
    f();
    (0..n)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

fn main() {
    // This benchmark's edge reads the level cap (the library reads no environment).
    if let Ok(cap) = std::env::var("DELTAFIN_KERNELS_SIMD") {
        let level = cap
            .parse()
            .unwrap_or_else(|e: String| panic!("DELTAFIN_KERNELS_SIMD: {e}"));
        deltafin_kernels::cap_simd_level(level).unwrap_or_else(|e| panic!("DELTAFIN_KERNELS_SIMD: {e}"));
    }
    divan::main();
    // divan runs each benchmark in turn but exposes no results, so the ratio is measured here
    // with the same data and thread, alternating kernel and reference to share any noise.
    let d = data();
    let pool = one_thread();
    let (mut y_mx, mut y_i8) = (vec![0f32; MX_ROWS], vec![0f32; I8_N]);
    let mut sink = 0u64;
    let mut t = [f64::INFINITY; 4];
    let deadline = Instant::now() + Duration::from_secs(6);
    while Instant::now() < deadline {
        t[0] = t[0].min(pool.install(|| best(1, || sink ^= stream(black_box(&d.stream_mx)))));
        t[1] = t[1].min(pool.install(|| best(1, || mx_pass(d, &mut y_mx))));
        t[2] = t[2].min(pool.install(|| best(1, || sink ^= stream(black_box(&d.stream_i8)))));
        t[3] = t[3].min(pool.install(|| best(1, || i8_pass(d, &mut y_i8))));
    }
    black_box((sink, &y_mx, &y_i8));
    let gbps = |bytes: usize, s: f64| bytes as f64 / s / 1e9;
    let s_mx = gbps(d.stream_mx.len() * 8, t[0]);
    let k_mx = gbps(mx_bytes(d), t[1]);
    let s_i8 = gbps(d.stream_i8.len() * 8, t[2]);
    let k_i8 = gbps(i8_bytes(d), t[3]);
    println!();
    println!(
        "summary (1 thread, {} MiB working sets from DRAM, simd {:?}, best of repeated passes over 6 s):",
        WORKING_SET >> 20,
        deltafin_kernels::simd_level()
    );
    println!(
        "  mxfp4 matvec [{MX_ROWS}x{MX_COLS}] {k_mx:6.2} GB/s   streaming read {s_mx:6.2} GB/s   ratio {:5.1} %  (target >= 50 %)",
        100.0 * k_mx / s_mx
    );
    println!(
        "  int8  matvec [{I8_N}x{I8_N}] {k_i8:6.2} GB/s   streaming read {s_i8:6.2} GB/s   ratio {:5.1} %  (target >= 50 %)",
        100.0 * k_i8 / s_i8
    );
    println!();
    println!(
        "batched products (1 thread, first {} MiB of the matrices, best of passes alternated over 3 s):",
        MM_SET >> 20
    );
    let sets: [(&str, Vec<MatRef>, &[f32]); 2] = [
        ("mxfp4 [1024x2048]", mm_set(d.mx.iter().map(mx_mat).collect()), &d.xs_mx),
        ("int8  [4096x4096]", mm_set(d.i8.iter().map(i8_mat).collect()), &d.xs_i8),
    ];
    let mut y = vec![0f32; 64 * I8_N.max(MX_ROWS)];
    for (name, mats, xs) in &sets {
        let bytes: usize = mats.iter().map(|m| m.nbytes()).sum();
        for n in MM_N {
            // Alternated for 3 s (at least 3 of each), the order swapped every round.
            let (mut tv, mut tm) = (f64::INFINITY, f64::INFINITY);
            let (start, mut round) = (Instant::now(), 0);
            while round < 3 || start.elapsed() < Duration::from_secs(3) {
                for batched in [round % 2 == 0, round % 2 != 0] {
                    let t = pool.install(|| best(1, || mm_pass(mats, xs, n, batched, &mut y)));
                    if batched {
                        tm = tm.min(t);
                    } else {
                        tv = tv.min(t);
                    }
                }
                round += 1;
            }
            let per_tok = |s: f64| s / (n * mats.len()) as f64 * 1e9;
            println!(
                "  {name} n={n:2}  matvec x n {:6.2} GB/s-eq ({:8.0} ns/token)   matmul {:6.2} GB/s-eq ({:8.0} ns/token)   speedup {:4.2}x",
                gbps(n * bytes, tv),
                per_tok(tv),
                gbps(n * bytes, tm),
                per_tok(tm),
                tv / tm
            );
        }
    }
}
