//! MXFP4 / int8 matrix-vector and expert-major matrix-matrix rates on the GPU against the
//! device's own copy bandwidth, measured in one process (issue #16 target 4: MXFP4 GEMV at
//! >= 70 % of a device-to-device copy).
//!
//! `cargo run --release -p deltafin-cuda --example gemv_bench` (or the built binary on the GPU
//! machine). Bytes counted: a copy moves its buffer twice (read + write); a matvec reads the
//! weights (codes + scales) once, plus x, and writes y. Every matrix is far larger than L2 so
//! the weights come from device memory on every run. The last section (prefill-sized int8
//! matmul, issue #16 target 2) is compute-bound: its weights fit L2 and are re-read per tile of
//! 8 tokens; it compares the staged kernel with `int8_mm_r4` on the same inputs, bits included.

use deltafin_cuda::{Decode, GpuMat, Kernel};
use rand::{rngs::StdRng, SeedableRng};

mod common;

fn main() {
    let g = common::open_gpu("gemv_bench");
    let info = g.info();
    println!(
        "device: cuda:{} {} (compute {}.{}), {:.1} GiB",
        info.ordinal,
        info.name,
        info.compute_capability.0,
        info.compute_capability.1,
        info.total_bytes as f64 / (1u64 << 30) as f64
    );
    let reps = 20;
    let gbps = |bytes: f64, ms: f32| bytes / (ms as f64 * 1e-3) / 1e9;

    // Copy ceilings: the driver's cuMemcpyDtoD and a plain 16-byte-load kernel.
    let copy_bytes = 1usize << 30;
    let src = g.stream().alloc_zeros::<u8>(copy_bytes).unwrap();
    let mut dst = g.stream().alloc_zeros::<u8>(copy_bytes).unwrap();
    let t_memcpy = g
        .time_ms(reps, || {
            g.stream()
                .memcpy_dtod(&src, &mut dst)
                .map_err(|e| deltafin_cuda::CudaError::Shape(e.to_string()))
        })
        .unwrap();
    let t_copy16 = g.time_ms(reps, || g.copy16(&src, &mut dst)).unwrap();
    let memcpy_bw = gbps(2.0 * copy_bytes as f64, t_memcpy);
    let copy16_bw = gbps(2.0 * copy_bytes as f64, t_copy16);
    println!(
        "copy  cuMemcpyDtoD 1 GiB: {:.3} ms = {memcpy_bw:.0} GB/s (read + write)",
        t_memcpy
    );
    println!(
        "copy  copy16 kernel 1 GiB: {:.3} ms = {copy16_bw:.0} GB/s (read + write)",
        t_copy16
    );
    drop((src, dst));
    let ceiling = memcpy_bw.max(copy16_bw);

    let mut rng = StdRng::seed_from_u64(4);
    let mut row = |label: &str, m: &GpuMat, decode: Decode, r: u32, n: usize| {
        // r = 0 stands for the x-stationary kernels; a label starting "pipelined" for the
        // pipelined matvec, "lean" for the lean one.
        let kernel = Kernel {
            decode,
            rows_per_warp: r.max(1),
            stationary_x: r == 0,
            pipelined: label.starts_with("pipelined"),
            staged: false,
            lean: label.starts_with("lean"),
        };
        let dx = g.upload(&common::rand_vec(&mut rng, n * m.cols)).unwrap();
        let mut dy = g.zeros(n * m.rows).unwrap();
        let ms = if n == 1 {
            g.time_ms(reps, || m.matvec_with(&g, kernel, &dx, &mut dy)).unwrap()
        } else {
            g.time_ms(reps, || m.matmul_with(&g, kernel, &dx, n, &mut dy)).unwrap()
        };
        let bytes = m.nbytes() as f64 + 4.0 * (n * (m.rows + m.cols)) as f64;
        let bw = gbps(bytes, ms);
        let flops = 2.0 * (m.rows * m.cols * n) as f64 / (ms as f64 * 1e-3) / 1e12;
        println!(
            "{label:<28} r={r} [{:>6}, {:>5}] n={n:<4} {ms:>8.3} ms  {bw:>6.0} GB/s  {:>5.1} % of copy  {flops:>6.2} TFLOP/s",
            m.rows,
            m.cols,
            100.0 * bw / ceiling
        );
    };

    // MXFP4: 64 Ki rows x 7168 (DeepSeek-V3 hidden) = 235 MB of codes + 14.7 MB of scales.
    let (rows, cols) = (65_536usize, 7168usize);
    let w: Vec<f32> = (0..rows * cols).map(|_| rng_f32()).collect();
    let mx = common::mxfp4_upload(&g, &w, rows, cols);
    row("mxfp4 matvec, const table", &mx, Decode::ConstTable, 1, 1);
    row("mxfp4 matvec, shared table", &mx, Decode::SharedTable, 1, 1);
    for r in [1, 2, 4, 0] {
        row("mxfp4 matvec, f16 bits", &mx, Decode::F16Bits, r, 1);
    }
    for r in [1, 2, 4] {
        row("mxfp4 matvec, byte permutes", &mx, Decode::BytePermute, r, 1);
    }
    for r in [1, 2] {
        row("mxfp4 matvec, mixed", &mx, Decode::Mixed, r, 1);
    }
    for r in [1, 2] {
        row("pipelined mxfp4, f16 bits", &mx, Decode::F16Bits, r, 1);
        row("pipelined mxfp4, byte permutes", &mx, Decode::BytePermute, r, 1);
    }
    for r in [1, 2, 4] {
        row("pipelined mxfp4, mixed", &mx, Decode::Mixed, r, 1);
    }
    for r in [1, 2, 4] {
        row("lean mxfp4, f16 bits", &mx, Decode::F16Bits, r, 1);
    }
    for n in [8usize, 64] {
        for r in [1, 2, 4, 0] {
            row("mxfp4 matmul, f16 bits", &mx, Decode::F16Bits, r, n);
        }
        for r in [1, 2, 4] {
            row("mxfp4 matmul, byte permutes", &mx, Decode::BytePermute, r, n);
        }
        row("mxfp4 matmul, mixed", &mx, Decode::Mixed, 2, n);
    }
    drop(mx);
    // int8 rows: 16 Ki rows x 7168 = 117 MB.
    let rows8 = 16_384usize;
    let m8 = common::int8_upload(&g, &w[..rows8 * cols], rows8, cols);
    for r in [1, 2, 4] {
        row("int8 matvec", &m8, Decode::F16Bits, r, 1);
    }
    for r in [1, 2, 4] {
        row("int8 matmul", &m8, Decode::F16Bits, r, 8);
    }
    drop(m8);

    // Prefill-sized int8 matmul: [2048, 2048] (the `bench` preset's largest projections) against
    // n tokens, int8_mm_r4 against the staged kernels on the same x; "bits equal" compares each
    // output with int8_mm_r4's.
    let (rows, cols) = (2048usize, 2048usize);
    let m = common::int8_upload(&g, &w[..rows * cols], rows, cols);
    let kernel = |rows_per_warp, staged| Kernel {
        decode: Decode::F16Bits,
        rows_per_warp,
        stationary_x: false,
        pipelined: false,
        staged,
        lean: false,
    };
    for n in [2000usize, 512, 64, 8] {
        let x: Vec<f32> = (0..n * cols).map(|_| rng_f32()).collect();
        let dx = g.upload(&x).unwrap();
        let best = Kernel::best_for(&m, n, g.info());
        let mut base: Option<Vec<u32>> = None;
        for (label, k) in [
            ("int8_mm_r4", kernel(4, false)),
            ("int8_mm_staged_r8t8b2", kernel(8, true)),
            ("int8_mm_staged_r4t8b3", kernel(4, true)),
        ] {
            let mut dy = g.zeros(n * rows).unwrap();
            let ms = g.time_ms(reps, || m.matmul_with(&g, k, &dx, n, &mut dy)).unwrap();
            let out: Vec<u32> = g.download(&dy).unwrap().iter().map(|v| v.to_bits()).collect();
            let same = match &base {
                None => {
                    base = Some(out);
                    "reference"
                }
                Some(b) if *b == out => "bits equal",
                Some(_) => "BITS DIFFER",
            };
            let flops = 2.0 * (rows * cols * n) as f64 / (ms as f64 * 1e-3) / 1e12;
            println!(
                "int8 prefill {label:<22} [{rows}, {cols}] n={n:<4} {ms:>8.3} ms  {flops:>6.2} TFLOP/s  {same}{}",
                if k == best { "  (default)" } else { "" }
            );
        }
    }
}

/// Deterministic pseudo-random weights without holding the closure's borrow of `rng`.
fn rng_f32() -> f32 {
    use std::cell::Cell;
    thread_local!(static S: Cell<u64> = const { Cell::new(0x9E37_79B9_7F4A_7C15) });
    S.with(|s| {
        let mut v = s.get();
        v ^= v << 13;
        v ^= v >> 7;
        v ^= v << 17;
        s.set(v);
        ((v >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    })
}
