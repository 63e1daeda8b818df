//! Numeric building blocks for deltafin: weight formats (MXFP4, int8 rows, bf16, f16, f32),
//! matrix-vector products over them, and the small element-wise ops a transformer forward pass
//! needs. No model logic lives here.
//!
//! Conventions:
//! - Matrices are row-major `[rows, cols]` with rows = output features and cols = input features
//!   (a PyTorch `nn.Linear` weight), so a matvec computes `y = W x`.
//! - Activations are always `f32` and every product accumulates in `f32`; quantization touches
//!   weights only (REFERENCES.md §3: "Accumulate in f32").
//! - Every fast path has a plain scalar twin in [`mod@reference`], used as the test oracle.
//! - SIMD is chosen once at run time ([`simd_level`]); results never depend on the number of
//!   rayon threads, because each output element is produced by one fixed sequence of operations.

mod kernels;
mod matrix;
mod ops;

pub mod attention;
pub mod int8;
pub mod mxfp4;
pub mod q8_0;
pub mod reference;

pub use kernels::{cap_simd_level, simd_level, SimdLevel};
pub use matrix::{MatData, MatRef};
pub use ops::{argmax, axpy, dot, dot_2x2, rms_norm, rms_norm_inplace, sigmoid, silu, softmax_inplace};

// Lets the shared test helpers (tests/common) name this crate from inside its unit tests.
#[cfg(test)]
extern crate self as deltafin_kernels;

#[cfg(test)]
mod tests;
