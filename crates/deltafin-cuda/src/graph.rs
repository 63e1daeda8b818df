//! CUDA graphs: a decode step's launches captured once and replayed as one launch.
//!
//! A decode step of a small MoE is a few hundred short kernels; replaying them from a graph
//! saves the host's per-launch work and most of the device's gaps between them. The kernels'
//! arithmetic is unchanged (the same launches with the same arguments), so a replay gives the
//! bits of queuing them one by one. Everything a step varies must then live in device memory
//! the kernels read (the token's embedding, RoPE's cos/sin, the position: see `Gpu::mla_prep`,
//! `Gpu::mla_decode`).

use cudarc::driver::{sys, CudaGraph};

use crate::{CudaError, DriverContext, Gpu};

/// A captured sequence of launches on a [`Gpu`]'s stream.
pub struct Graph(CudaGraph);

// SAFETY: a CUDA graph may be used from any thread as long as calls on it are serialized
// (CUDA driver API, "Graph object thread safety"); deltafin keeps each graph inside the lock of
// the work buffers it was captured on, so no two threads touch it at once.
unsafe impl Send for Graph {}

impl Graph {
    /// Queues the captured launches on the stream, in capture order.
    ///
    /// # Errors
    /// A driver error.
    pub fn launch(&self) -> Result<(), CudaError> {
        self.0.launch().ctx("cuGraphLaunch")
    }
}

impl Gpu {
    /// Captures the launches `queue` makes on this GPU's stream into a [`Graph`] instead of
    /// running them (nothing runs until [`Graph::launch`]). `queue` must only launch kernels:
    /// a copy from pageable host memory, an allocation or a synchronization fails the capture.
    ///
    /// # Errors
    /// `queue`'s error (the capture is abandoned), or the driver's refusal of what was queued.
    pub fn capture<E: From<CudaError>>(&self, queue: impl FnOnce() -> Result<(), E>) -> Result<Graph, E> {
        self.stream()
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .ctx("cuStreamBeginCapture")?;
        let queued = queue();
        let graph = self
            .stream()
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .ctx("cuStreamEndCapture");
        queued?;
        match graph? {
            Some(g) => Ok(Graph(g)),
            None => Err(CudaError::Shape("the capture recorded nothing".into()).into()),
        }
    }
}
