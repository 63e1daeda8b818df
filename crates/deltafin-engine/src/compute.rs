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
//! SwiGLU expert on its gathered rows, in every family on both backends) and [`chunk_logits`]
//! (the final norm and the LM head of a prompt chunk: DeepSeek-V3 and the GQA families on both),
//! and [`decoder_layers`], the pre-norm residual skeleton of a chunk's pass through the layers
//! (the same four models: each says only what its attention and its MLP compute).

use std::borrow::Borrow;
use std::convert::Infallible;

use deltafin_cuda::{CudaError, Gpu, GpuBuf, GpuMat};
use deltafin_kernels::{rms_norm, silu, MatRef};

use crate::EngineError;

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

    /// Elements of `x`.
    fn len(x: &Self::Slice) -> usize;

    /// Rows of `w` (its output width).
    fn rows(w: &Self::Mat<'_>) -> usize;

    /// Columns of `w` (its input width).
    fn cols(w: &Self::Mat<'_>) -> usize;

    /// `y = x Wᵀ` for `n` tokens: `x: [n, cols]` → `y: [n, rows]`, row t bit-identical to the
    /// backend's matvec of token t. Errors: shapes that disagree; a driver failure.
    fn matmul(&self, w: &Self::Mat<'_>, x: &Self::Slice, n: usize, y: &mut Self::Buf) -> Result<(), Self::Error>;

    /// `gate[i] = silu(gate[i]) · up[i]` (SwiGLU's gating). Errors: lengths that disagree; a
    /// driver failure.
    fn silu_mul(&self, gate: &mut Self::Buf, up: &Self::Slice) -> Result<(), Self::Error>;

    /// RMSNorm of each of the `n` rows of `x: [n, dim]` into `y: [n, dim]`, `weight: [dim]`:
    /// `y = x / sqrt(mean(x²) + eps) · weight` (Zhang & Sennrich 2019; transformers'
    /// `DeepseekV3RMSNorm`). Errors: lengths that disagree; a driver failure.
    fn rms_norm_rows(
        &self,
        x: &Self::Slice,
        weight: &Self::Slice,
        n: usize,
        eps: f32,
        y: &mut Self::Buf,
    ) -> Result<(), Self::Error>;

    /// Elements `[start, start + len)` of `x` as their own buffer (`x` itself when that is all
    /// of it). Errors: a range outside `x`; a driver failure.
    fn take_range(&self, x: Self::Buf, start: usize, len: usize) -> Result<Self::Buf, Self::Error>;

    /// `x: [n, width]` in host memory, one `Vec` a row. Errors: a driver failure.
    fn host_rows(&self, x: &Self::Slice, width: usize) -> Result<Vec<Vec<f32>>, Self::Error>;

    /// `x += y` element by element (a residual add: one rounding an element). Errors: lengths
    /// that disagree; a driver failure.
    fn add_into(&self, x: &mut Self::Buf, y: &Self::Slice) -> Result<(), Self::Error>;

    /// The engine's error for a backend failure (`CUDA: …` on the device).
    fn engine_error(e: Self::Error) -> EngineError;
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

    fn len(x: &[f32]) -> usize {
        x.len()
    }

    fn rows(w: &MatRef<'_>) -> usize {
        w.rows
    }

    fn cols(w: &MatRef<'_>) -> usize {
        w.cols
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

    fn rms_norm_rows(&self, x: &[f32], weight: &[f32], n: usize, eps: f32, y: &mut Vec<f32>) -> Result<(), Infallible> {
        let dim = weight.len();
        for (xr, yr) in x.chunks_exact(dim).zip(y.chunks_exact_mut(dim)).take(n) {
            rms_norm(xr, weight, eps, yr);
        }
        Ok(())
    }

    fn take_range(&self, x: Vec<f32>, start: usize, len: usize) -> Result<Vec<f32>, Infallible> {
        Ok(if start == 0 && len == x.len() {
            x
        } else {
            x[start..start + len].to_vec()
        })
    }

    fn host_rows(&self, x: &[f32], width: usize) -> Result<Vec<Vec<f32>>, Infallible> {
        Ok(x.chunks(width).map(<[f32]>::to_vec).collect())
    }

    fn add_into(&self, x: &mut Vec<f32>, y: &[f32]) -> Result<(), Infallible> {
        for (a, b) in x.iter_mut().zip(y) {
            *a += b;
        }
        Ok(())
    }

    fn engine_error(e: Infallible) -> EngineError {
        match e {}
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

    fn len(x: &GpuBuf) -> usize {
        x.len()
    }

    fn rows(w: &GpuMat) -> usize {
        w.rows
    }

    fn cols(w: &GpuMat) -> usize {
        w.cols
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

    fn rms_norm_rows(&self, x: &GpuBuf, weight: &GpuBuf, n: usize, eps: f32, y: &mut GpuBuf) -> Result<(), CudaError> {
        self.rms_norm(x, weight, n, eps, false, y)
    }

    fn take_range(&self, x: GpuBuf, start: usize, len: usize) -> Result<GpuBuf, CudaError> {
        if start == 0 && len == x.len() {
            Ok(x)
        } else {
            self.copy_range(&x, start, len)
        }
    }

    fn host_rows(&self, x: &GpuBuf, width: usize) -> Result<Vec<Vec<f32>>, CudaError> {
        Ok(self.download(x)?.chunks(width).map(<[f32]>::to_vec).collect())
    }

    /// `x += 1.0 · y` (an exact product, so one rounding an element as on the CPU).
    fn add_into(&self, x: &mut GpuBuf, y: &GpuBuf) -> Result<(), CudaError> {
        self.axpy(1.0, y, x)
    }

    fn engine_error(e: CudaError) -> EngineError {
        EngineError::Invalid(format!("CUDA: {e}"))
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

/// Logits of a prompt chunk: `lm_head(rms_norm(x))` `[vocab]` for every position of
/// `x: [n, hidden]` (`all_logits`) or for the last one, in host memory. `norm` is `model.norm`
/// (`[hidden]`, eps `eps`), `lm_head` is `lm_head.weight` `[vocab, hidden]`. Row t equals the
/// decode step's logits of that position bit for bit (a matmul row is the matvec of that row).
///
/// Errors: a backend failure (none on the CPU).
pub fn chunk_logits<B: Backend>(
    b: &B,
    x: B::Buf,
    n: usize,
    all_logits: bool,
    (norm, eps): (&B::Slice, f32),
    lm_head: &B::Mat<'_>,
) -> Result<Vec<Vec<f32>>, B::Error> {
    let h = B::cols(lm_head);
    let (first, rows) = if all_logits { (0, n) } else { (n - 1, 1) };
    let xl = b.take_range(x, first * h, rows * h)?;
    let mut xf = b.zeros(rows * h)?;
    b.rms_norm_rows(xl.borrow(), norm, rows, eps, &mut xf)?;
    let vocab = B::rows(lm_head);
    let mut logits = b.zeros(rows * vocab)?;
    b.matmul(lm_head, xf.borrow(), rows, &mut logits)?;
    b.host_rows(logits.borrow(), vocab)
}

/// A chunk of `n` tokens through the layers of a pre-norm decoder (transformers'
/// `*DecoderLayer.forward`): for each layer `l < layers`, with `(input_layernorm,
/// post_attention_layernorm) = norms(l)` (`[hidden]` each, eps `eps`),
/// `h = x + self_attn(input_layernorm(x))` and then `x = h + mlp(post_attention_layernorm(h))`.
/// `x: [n, hidden]` is the residual stream, updated in place. `attention(l, xn, out)` puts the
/// layer's attention output `[n, hidden]` into `out` (filling it or replacing it); `mlp(l, xn,
/// x)` adds the layer's feed-forward output into `x` itself (a backend may fuse that add).
///
/// Errors: the first error of `attention` or `mlp`; a backend failure.
pub fn decoder_layers<'w, B: Backend>(
    b: &B,
    x: &mut B::Buf,
    n: usize,
    (layers, eps): (usize, f32),
    norms: impl Fn(usize) -> (&'w B::Slice, &'w B::Slice),
    mut attention: impl FnMut(usize, &B::Slice, &mut B::Buf) -> Result<(), EngineError>,
    mut mlp: impl FnMut(usize, &B::Slice, &mut B::Buf) -> Result<(), EngineError>,
) -> Result<(), EngineError>
where
    B::Slice: 'w,
{
    let len = B::len((*x).borrow());
    let mut xn = b.zeros(len).map_err(B::engine_error)?;
    let mut out = b.zeros(len).map_err(B::engine_error)?;
    for l in 0..layers {
        let (input_layernorm, post_attention_layernorm) = norms(l);
        b.rms_norm_rows((*x).borrow(), input_layernorm, n, eps, &mut xn)
            .map_err(B::engine_error)?;
        attention(l, xn.borrow(), &mut out)?;
        b.add_into(x, out.borrow()).map_err(B::engine_error)?;
        b.rms_norm_rows((*x).borrow(), post_attention_layernorm, n, eps, &mut xn)
            .map_err(B::engine_error)?;
        mlp(l, xn.borrow(), x)?;
    }
    Ok(())
}

/// The value of a CPU result (its error type has no values).
pub fn on_cpu<T>(r: Result<T, Infallible>) -> T {
    match r {
        Ok(v) => v,
        Err(never) => match never {},
    }
}
