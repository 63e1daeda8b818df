//! Helpers of the GPU tests, shared by this crate's `tests/ops.rs` and the CUDA tests of the
//! crates above it (deltafin-engine `tests/cuda_route.rs`, `tests/kda_cuda_ops.rs`): opening
//! the device or skipping with one line, outputs poisoned with NaN, and the relative L2 error
//! every op is judged by (ggml `test-backend-ops` habit).

use crate::{CudaError, Gpu, GpuBuf};

/// Opens cuda:0, or prints `SKIPPED <test>: <why>` (the one-line reason) and gives `None`, so
/// that a test without a device returns at once.
pub fn gpu_or_skip(test: &str) -> Option<Gpu> {
    match Gpu::open(0) {
        Ok(g) => Some(g),
        Err(e) => {
            eprintln!("SKIPPED {test}: {e}");
            None
        }
    }
}

/// A device buffer of `n` NaNs: an output poisoned before its run, so that an element the
/// kernel leaves unwritten shows.
///
/// # Panics
/// When the upload fails (a test helper).
pub fn nans(g: &Gpu, n: usize) -> GpuBuf {
    g.upload(&vec![f32::NAN; n]).unwrap()
}

/// ‖a − b‖ / ‖b‖ in f64 of a GPU output `a` against its reference `b`.
///
/// # Panics
/// When the lengths differ or `a` holds a non-finite value (NaN marks an element the kernel
/// left unwritten, see [`nans`]).
pub fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    assert!(
        a.iter().all(|v| v.is_finite()),
        "non-finite GPU output (unwritten element?)"
    );
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((*x as f64) - (*y as f64)).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den.max(1e-300)).sqrt()
}

/// The message of the error an operation refused with (its one-line reason).
///
/// # Panics
/// When the operation succeeded.
#[track_caller]
pub fn refusal<T>(r: Result<T, CudaError>) -> String {
    match r {
        Ok(_) => panic!("the operation was expected to refuse"),
        Err(e) => e.to_string(),
    }
}
