//! deltafin's CUDA backend: device discovery, run-time kernel compilation, device-resident
//! weight matrices and the operations a layer needs, each checked against the CPU reference of
//! `deltafin-kernels` (tests/ops.rs, ggml `test-backend-ops` habit).
//!
//! Build and run without CUDA: the driver and NVRTC are loaded at run time (`cudarc` with
//! `dynamic-loading`), so this crate builds, lints and tests on machines with no GPU and no CUDA
//! toolkit. [`probe`] never panics: where `libcuda` or a device is missing it says why in one
//! line, and GPU tests skip with that line.
//!
//! Kernels are CUDA C (`src/kernels/ops.cu`, then `fused.cu`, `kda.cu`, `gqa.cu`), compiled by NVRTC for the device's compute
//! capability the first time a [`Gpu`] opens and cached on disk as PTX (see [`ptx_cache_dir`]).
//!
//! Numerics (issue #16, "the product's promise"): f32 activations and accumulation, weights
//! decoded exactly to f32, a fixed reduction order in every kernel (no atomics in reductions, no
//! tensor cores, no TF32), so results are bit-identical run to run and agree with the CPU path to
//! f32 rounding. The order is documented at the top of `ops.cu`.

mod attention;
mod batch;
mod device;
mod fused;
mod gpu;
mod gqa;
mod graph;
mod kda;
mod mat;
mod moe;
pub mod testing;

pub use attention::{MlaShape, MLA_SPLIT};
pub use batch::{MlaPrefillForm, RowCopy};
/// Device buffers and views of any element type (re-exported from `cudarc`).
pub use cudarc::driver::{CudaSlice, CudaView, DevicePtr};
pub use device::{probe, DeviceInfo};
pub use fused::{
    ExpertDesc, ExpertTable, GroupedShape, MatDesc, MlaPrepArg, MoeDown, MvJob, MvKind, PreNorm, RouteTailArg,
    RouterShape, MAX_JOBS,
};
pub use gpu::{compile_ptx, ptx_cache_dir, Gpu, GpuBuf, ENTRY_POINTS};
pub use gqa::{GqaShape, SoftmaxRouter};
pub use graph::{Graph, Pinned, StreamMark};
pub use kda::{KdaGate, ATTN_RES_MAX_BANK};
pub use mat::{Decode, GpuMat, GpuMatData, Kernel};
pub use moe::MOE_MAX_K;

/// Everything that can go wrong on the CUDA side, each with the context a user needs.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// No usable CUDA driver or device (the one-line reason: library missing, no device, ...).
    #[error("no CUDA device: {0}")]
    Unavailable(String),
    /// A CUDA driver call failed.
    #[error("CUDA driver error in {what}: {source}")]
    Driver {
        /// The operation that failed.
        what: &'static str,
        /// The driver's error.
        source: cudarc::driver::DriverError,
    },
    /// NVRTC could not compile the kernels (with its log).
    #[error("NVRTC could not compile the deltafin kernels for {arch}: {log}")]
    Compile {
        /// `compute_XY` of the device.
        arch: String,
        /// The compiler's log or error.
        log: String,
    },
    /// Operand shapes or lengths do not fit the operation.
    #[error("{0}")]
    Shape(String),
}

pub(crate) trait DriverContext<T> {
    fn ctx(self, what: &'static str) -> Result<T, CudaError>;
}

impl<T> DriverContext<T> for Result<T, cudarc::driver::DriverError> {
    fn ctx(self, what: &'static str) -> Result<T, CudaError> {
        self.map_err(|source| CudaError::Driver { what, source })
    }
}
