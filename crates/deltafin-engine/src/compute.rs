//! The compute seam (issue #15, part 3; docs/ARCHITECTURE.md, "The compute seam"): the
//! operations a layer needs, over a backend's own weight and activation handles, and the pieces
//! of layers written once over them.
//!
//! [`Backend`] is implemented by [`Cpu`] (weights are [`MatRef`] views of the resident backbone or
//! of an expert record, activations `Vec<f32>` / `[f32]`, the kernels of `deltafin-kernels`) and
//! by the CUDA device [`Gpu`] (weights [`GpuMat`], activations [`GpuBuf`], the kernels of
//! `deltafin-cuda`). A piece written over `B: Backend` issues the same operations in the same
//! order on either, so each backend keeps its own bits (the exactness contract of
//! docs/ARCHITECTURE.md: every kernel has a fixed reduction order, a matmul row equals the
//! matvec of that token). Each backend's operations are tested against the CPU reference op by
//! op (`deltafin-cuda/tests/ops.rs`); a piece written here is tested through the families that
//! use it (the fixtures on each backend).
//!
//! Written over the seam so far: [`swiglu_rows`] (the dense MLP, the shared experts and a routed
//! SwiGLU expert on its gathered rows, in every family on both backends).

use std::borrow::Borrow;
use std::convert::Infallible;

use deltafin_cuda::{CudaError, Gpu, GpuBuf, GpuMat};
use deltafin_kernels::{silu, MatRef};

/// One compute backend: weight matrices, f32 activations and the operations between them.
pub trait Backend {
    /// A weight matrix `[rows, cols]` (int8 rows, MXFP4, bf16/f16/f32), decoded exactly.
    type Mat<'a>;
    /// Owned f32 activations.
    type Buf: Borrow<Self::Slice>;
    /// Borrowed f32 activations (what an operation reads).
    type Slice: ?Sized;
    /// What an operation can fail with (nothing on the CPU; a driver error on a device).
    type Error;

    /// `len` zeros. Errors: out of device memory.
    fn zeros(&self, len: usize) -> Result<Self::Buf, Self::Error>;

    /// Rows of `w` (its output width).
    fn rows(w: &Self::Mat<'_>) -> usize;

    /// `y = x Wᵀ` for `n` tokens: `x: [n, cols]` → `y: [n, rows]`, row t bit-identical to the
    /// backend's matvec of token t. Errors: shapes that disagree; a driver failure.
    fn matmul(&self, w: &Self::Mat<'_>, x: &Self::Slice, n: usize, y: &mut Self::Buf) -> Result<(), Self::Error>;

    /// `gate[i] = silu(gate[i]) · up[i]` (SwiGLU's gating). Errors: lengths that disagree; a
    /// driver failure.
    fn silu_mul(&self, gate: &mut Self::Buf, up: &Self::Slice) -> Result<(), Self::Error>;
}

/// The CPU backend: the kernels of `deltafin-kernels` at the process's SIMD level.
pub struct Cpu;

impl Backend for Cpu {
    type Mat<'a> = MatRef<'a>;
    type Buf = Vec<f32>;
    type Slice = [f32];
    type Error = Infallible;

    fn zeros(&self, len: usize) -> Result<Vec<f32>, Infallible> {
        Ok(vec![0f32; len])
    }

    fn rows(w: &MatRef<'_>) -> usize {
        w.rows
    }

    fn matmul(&self, w: &MatRef<'_>, x: &[f32], n: usize, y: &mut Vec<f32>) -> Result<(), Infallible> {
        w.matmul(x, n, y);
        Ok(())
    }

    fn silu_mul(&self, gate: &mut Vec<f32>, up: &[f32]) -> Result<(), Infallible> {
        for (a, b) in gate.iter_mut().zip(up) {
            *a = silu(*a) * b;
        }
        Ok(())
    }
}

/// The CUDA backend: a device opened by [`Gpu::open`], its kernels on its stream.
impl Backend for Gpu {
    type Mat<'a> = GpuMat;
    type Buf = GpuBuf;
    type Slice = GpuBuf;
    type Error = CudaError;

    fn zeros(&self, len: usize) -> Result<GpuBuf, CudaError> {
        Gpu::zeros(self, len)
    }

    fn rows(w: &GpuMat) -> usize {
        w.rows
    }

    fn matmul(&self, w: &GpuMat, x: &GpuBuf, n: usize, y: &mut GpuBuf) -> Result<(), CudaError> {
        w.matmul(self, x, n, y)
    }

    fn silu_mul(&self, gate: &mut GpuBuf, up: &GpuBuf) -> Result<(), CudaError> {
        let mut out = Gpu::zeros(self, gate.len())?;
        self.swiglu(gate, up, &mut out)?;
        *gate = out;
        Ok(())
    }
}

/// `down(silu(gate X) ⊙ up X)` for `n` rows `x: [n, cols]` → `[n, rows of down]`: the SwiGLU MLP
/// (a dense layer's MLP, the shared experts, one routed expert on its gathered rows), as
/// transformers' `DeepseekV3MLP` / `Qwen3MoeMLP` / `MixtralBlockSparseTop2MLP` compute it.
///
/// Errors: a backend failure (none on the CPU).
pub fn swiglu_rows<B: Backend>(
    b: &B,
    [gate, up, down]: [&B::Mat<'_>; 3],
    x: &B::Slice,
    n: usize,
) -> Result<B::Buf, B::Error> {
    let mut g = b.zeros(n * B::rows(gate))?;
    let mut u = b.zeros(n * B::rows(up))?;
    b.matmul(gate, x, n, &mut g)?;
    b.matmul(up, x, n, &mut u)?;
    b.silu_mul(&mut g, u.borrow())?;
    let mut out = b.zeros(n * B::rows(down))?;
    b.matmul(down, g.borrow(), n, &mut out)?;
    Ok(out)
}

/// The value of a CPU result (its error type has no values).
pub fn on_cpu<T>(r: Result<T, Infallible>) -> T {
    match r {
        Ok(v) => v,
        Err(never) => match never {},
    }
}
