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

/// A page-locked host buffer for a step's small inputs and outputs: copies from and to it are
/// queued without waiting (pageable memory makes every copy a round trip), so a decode step
/// waits for the device once, at the end.
pub struct Pinned<T: cudarc::driver::DeviceRepr>(cudarc::driver::PinnedHostSlice<T>);

impl<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits + Copy + Default> Pinned<T> {
    /// The host elements, after every copy queued on them has finished.
    ///
    /// # Errors
    /// A driver error (including one raised by the copies).
    pub fn as_slice(&self) -> Result<&[T], CudaError> {
        self.0.as_slice().ctx("cuEventSynchronize")
    }

    /// Overwrites the host elements with `data` (same length) once the copies queued on them
    /// have finished.
    ///
    /// # Errors
    /// `Shape` when the lengths differ; a driver error.
    pub fn write(&mut self, data: &[T]) -> Result<(), CudaError> {
        let dst = self.0.as_mut_slice().ctx("cuEventSynchronize")?;
        if dst.len() != data.len() {
            return Err(CudaError::Shape(format!(
                "pinned buffer: {} elements into {}",
                data.len(),
                dst.len()
            )));
        }
        dst.copy_from_slice(data);
        Ok(())
    }
}

impl Gpu {
    /// A zeroed page-locked host buffer of `len` elements.
    ///
    /// # Errors
    /// A driver error (page-locked memory is limited).
    pub fn pinned<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits + Copy + Default>(
        &self,
        len: usize,
    ) -> Result<Pinned<T>, CudaError> {
        // SAFETY: the memory is initialized right below before anything reads it.
        let mut p = unsafe { self.stream().context().alloc_pinned::<T>(len.max(1)) }.ctx("cuMemHostAlloc")?;
        p.as_mut_slice().ctx("cuEventSynchronize")?.fill(T::default());
        Ok(Pinned(p))
    }

    /// Queues a copy of all of `src` to `dst` (same length) without waiting.
    ///
    /// # Errors
    /// `Shape` when the lengths differ; a driver error.
    pub fn upload_pinned<T: cudarc::driver::DeviceRepr>(
        &self,
        src: &Pinned<T>,
        dst: &mut cudarc::driver::CudaSlice<T>,
    ) -> Result<(), CudaError> {
        if src.0.len() != dst.len() {
            return Err(CudaError::Shape(format!(
                "upload_pinned: {} host elements into {}",
                src.0.len(),
                dst.len()
            )));
        }
        self.stream().memcpy_htod(&src.0, dst).ctx("cuMemcpyHtoDAsync")
    }

    /// Queues a copy of all of `src` into `dst` (same length) without waiting; read it with
    /// [`Pinned::as_slice`], which waits for the copy.
    ///
    /// # Errors
    /// `Shape` when the lengths differ; a driver error.
    pub fn download_pinned<T: cudarc::driver::DeviceRepr>(
        &self,
        src: &cudarc::driver::CudaSlice<T>,
        dst: &mut Pinned<T>,
    ) -> Result<(), CudaError> {
        if src.len() != dst.0.len() {
            return Err(CudaError::Shape(format!(
                "download_pinned: {} device elements into {}",
                src.len(),
                dst.0.len()
            )));
        }
        self.stream().memcpy_dtoh(src, &mut dst.0).ctx("cuMemcpyDtoHAsync")
    }
}

/// A point in the stream's queue ([`Gpu::mark`]): wait for everything queued before it.
pub struct StreamMark(cudarc::driver::CudaEvent);

impl StreamMark {
    /// Blocks until everything queued before the mark has run.
    ///
    /// # Errors
    /// A driver error, including one raised by the queued work.
    pub fn wait(&self) -> Result<(), CudaError> {
        self.0.synchronize().ctx("cuEventSynchronize")
    }

    /// Whether everything queued before the mark has run (does not wait).
    ///
    /// # Errors
    /// A driver error, including one raised by the queued work.
    pub fn passed(&self) -> Result<bool, CudaError> {
        self.0.try_is_complete().ctx("cuEventQuery")
    }
}

impl Gpu {
    /// Page-locks (`cuMemHostRegister`, portable to every context) the `len` host bytes at
    /// `ptr`, so that copies from them run by DMA without waiting for the host: a copy queued
    /// from page-locked memory returns at once, and the memory must stay unchanged until the
    /// copy has run (see [`Gpu::mark`]).
    ///
    /// # Safety
    /// `ptr..ptr + len` must be mapped host memory that stays mapped until
    /// [`Gpu::unregister_host`] of `ptr`.
    ///
    /// # Errors
    /// A driver error (the system's page-locked memory limit, an address already registered).
    pub unsafe fn register_host(&self, ptr: *mut u8, len: usize) -> Result<(), CudaError> {
        self.bind_to_thread()?;
        let flags = cudarc::driver::sys::CU_MEMHOSTREGISTER_PORTABLE;
        // SAFETY: the caller keeps the range mapped until it is unregistered.
        let r = unsafe { cudarc::driver::sys::cuMemHostRegister_v2(ptr.cast(), len, flags) };
        r.result().ctx("cuMemHostRegister")
    }

    /// Releases a [`Gpu::register_host`] registration.
    ///
    /// # Safety
    /// No queued copy may still read the memory.
    ///
    /// # Errors
    /// A driver error (`ptr` was not registered).
    pub unsafe fn unregister_host(&self, ptr: *mut u8) -> Result<(), CudaError> {
        self.bind_to_thread()?;
        // SAFETY: registered by `register_host` (else the driver returns an error).
        let r = unsafe { cudarc::driver::sys::cuMemHostUnregister(ptr.cast()) };
        r.result().ctx("cuMemHostUnregister")
    }

    /// Marks the stream's queue as it is now (an event recorded on it).
    ///
    /// # Errors
    /// A driver error.
    pub fn mark(&self) -> Result<StreamMark, CudaError> {
        let ev = self
            .stream()
            .record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .ctx("cuEventRecord")?;
        Ok(StreamMark(ev))
    }
}
