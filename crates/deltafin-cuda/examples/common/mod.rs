//! Helpers shared by the GPU examples (`mod common;` in each; Cargo builds only
//! `examples/*.rs`, so this folder is no example of its own) and by `tests/ops.rs` (through
//! `#[path]`), which checks the shapes the benches time.

#![allow(dead_code)]

use deltafin_cuda::{Gpu, GpuMat, MlaShape};
use deltafin_kernels::{int8, mxfp4, MatData, MatRef};
use rand::{rngs::StdRng, Rng};

/// Opens cuda:0, or prints `<example>: <why>` and exits with status 2.
pub fn open_gpu(example: &str) -> Gpu {
    match Gpu::open(0) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("{example}: {e}");
            std::process::exit(2);
        }
    }
}

/// The `bench` preset's attention: 16 heads of 64 + 32, latent rank 256, v 64 (the tiled MLA
/// prefill kernel's small instance).
pub const MLA_BENCH: MlaShape = MlaShape {
    n_heads: 16,
    nope: 64,
    rope: 32,
    v_head_dim: 64,
    kv_lora_rank: 256,
};

/// DeepSeek-V3's attention dims (nope 128, rope 64, v 128, latent rank 512: the tiled MLA
/// prefill kernel's large instance) on 16 heads.
pub const MLA_DEEPSEEK_V3_16_HEADS: MlaShape = MlaShape {
    n_heads: 16,
    nope: 128,
    rope: 64,
    v_head_dim: 128,
    kv_lora_rank: 512,
};

/// `n` values drawn uniformly from [-1, 1).
pub fn rand_vec(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

/// `w: [rows, cols]` quantized to int8 (a scale a row) on the device.
pub fn int8_upload(g: &Gpu, w: &[f32], rows: usize, cols: usize) -> GpuMat {
    let (mut q, mut s) = (vec![0i8; rows * cols], vec![0f32; rows]);
    int8::quantize(w, rows, cols, &mut q, &mut s);
    GpuMat::upload(
        g,
        &MatRef::new(rows, cols, MatData::Int8 { q: &q, scales: &s }).unwrap(),
    )
    .unwrap()
}

/// `w: [rows, cols]` quantized to MXFP4 on the device.
pub fn mxfp4_upload(g: &Gpu, w: &[f32], rows: usize, cols: usize) -> GpuMat {
    let mut packed = vec![0u8; rows * mxfp4::packed_row_bytes(cols)];
    let mut scales = vec![0u8; rows * mxfp4::scale_row_bytes(cols)];
    mxfp4::quantize(w, rows, cols, &mut packed, &mut scales);
    let m = MatRef::mxfp4(rows, cols, &packed, &scales).unwrap();
    GpuMat::upload(g, &m).unwrap()
}

/// A random MXFP4 matrix `[rows, cols]` on the device.
pub fn mxfp4_mat(g: &Gpu, rng: &mut StdRng, rows: usize, cols: usize) -> GpuMat {
    mxfp4_upload(g, &rand_vec(rng, rows * cols), rows, cols)
}

/// One random MXFP4 expert: gate and up `[inter, hidden]`, then down `[hidden, inter]`.
pub fn mxfp4_expert(g: &Gpu, rng: &mut StdRng, inter: usize, hidden: usize) -> [GpuMat; 3] {
    [
        mxfp4_mat(g, rng, inter, hidden),
        mxfp4_mat(g, rng, inter, hidden),
        mxfp4_mat(g, rng, hidden, inter),
    ]
}
