//! One opened device: context, stream, compiled kernels, and the element-wise operations.

use crate::device::{probe, DeviceInfo};
use crate::{CudaError, DriverContext};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::{CompileOptions, Ptx};
use std::path::PathBuf;
use std::sync::Arc;

/// The kernels' CUDA C source (compiled at run time by NVRTC): the one-operation kernels
/// (`ops.cu`), the fused launches and the device router built on their helpers (`fused.cu`),
/// then Kimi Linear / K3's (`kda.cu`, which uses `ops.cu`'s MXFP4 helpers), then grouped-query
/// attention and the softmax top-k routers (`gqa.cu`).
const SOURCE: &str = concat!(
    include_str!("kernels/ops.cu"),
    "\n",
    include_str!("kernels/fused.cu"),
    "\n",
    include_str!("kernels/kda.cu"),
    "\n",
    include_str!("kernels/gqa.cu")
);

/// Warps per thread block of the matrix kernels (one warp per output row).
pub(crate) const WARPS: u32 = 8;

/// Tokens per tile of the matmul kernels (must match `ops.cu`).
pub(crate) const TOKEN_TILE: u32 = 8;

/// A device-resident f32 activation buffer (`[len]`, or `[n, dim]` row-major).
pub type GpuBuf = CudaSlice<f32>;

/// Every kernel entry point of `ops.cu`, `fused.cu`, `kda.cu` and `gqa.cu` (all loaded when a [`Gpu`] opens).
pub const ENTRY_POINTS: &[&str] = &[
    "mxfp4_mv_const_r1",
    "mxfp4_mv_lds_r1",
    "mxfp4_mv_f16_r1",
    "mxfp4_mv_f16_r2",
    "mxfp4_mv_f16_r4",
    "mxfp4_mm_f16_r1",
    "mxfp4_mm_f16_r2",
    "mxfp4_mm_f16_r4",
    "mxfp4_mv_prmt_r1",
    "mxfp4_mv_prmt_r2",
    "mxfp4_mv_prmt_r4",
    "mxfp4_mm_prmt_r1",
    "mxfp4_mm_prmt_r2",
    "mxfp4_mm_prmt_r4",
    "mxfp4_mv_mix_r1",
    "mxfp4_mv_mix_r2",
    "mxfp4_mm_mix_r2",
    "mxfp4_mvp_f16_r1",
    "mxfp4_mvp_f16_r2",
    "mxfp4_mvp_prmt_r1",
    "mxfp4_mvp_prmt_r2",
    "mxfp4_mvp_mix_r1",
    "mxfp4_mvp_mix_r2",
    "mxfp4_mvp_mix_r4",
    "mxfp4_mvl_r1",
    "mxfp4_mvl_r2",
    "mxfp4_mvl_r4",
    "mxfp4_xs_np1_t1",
    "mxfp4_xs_np2_t1",
    "mxfp4_xs_np1_t2",
    "mxfp4_xs_np2_t2",
    "int8_mv_r1",
    "int8_mv_r2",
    "int8_mv_r4",
    "int8_mm_r1",
    "int8_mm_r2",
    "int8_mm_r4",
    "int8_mm_staged_r8t8b2",
    "int8_mm_staged_r4t8b3",
    "f32_matvec",
    "f32_matmul",
    "rms_norm",
    "rope_apply",
    "mla_decode_i8",
    "mla_decode_f32",
    "mla_qabs_i8",
    "mla_qabs_f32",
    "swiglu",
    "axpy",
    "copy16",
    "moe_gate_up_mxfp4",
    "moe_down_mxfp4",
    "moe_combine",
    "rope_apply_tokens",
    "mla_prefill_i8",
    "mla_prefill_f32",
    "mla_prefill_tiled",
    "mla_prefill_tiled_256",
    "mla_prefill_combine_i8",
    "mla_prefill_combine_f32",
    "mla_mha_prefill_v64",
    "mla_mha_prefill_v128",
    "gather_rows",
    "scatter_rows",
    "moe_combine_tokens",
    // fused.cu
    "mv_jobs",
    "mla_prep",
    "moe_gate_up_tab",
    "moe_down_combine_tab",
    "route_noaux",
    "moe_down_tab",
    "moe_gate_up_grouped_r2t8",
    "moe_gate_up_grouped_r2t8u2",
    "moe_gate_up_grouped_r1t8",
    "moe_gate_up_grouped_r1t8u2",
    "moe_gate_up_grouped_r1t16",
    "moe_gate_up_grouped_r2t4",
    "moe_gate_up_grouped_r4t4",
    "moe_down_grouped_r4t8",
    "moe_down_grouped_r2t8",
    "moe_down_grouped_r1t8",
    "moe_down_grouped_r2t16",
    "moe_down_grouped_r4t4",
    "moe_down_grouped_r2t4",
    "moe_gate_up_staged_r4t8b3",
    "moe_gate_up_staged_r4t8b3p",
    "moe_gate_up_staged_r4t8b2p",
    "moe_down_staged_r8t8b3",
    "moe_down_staged_r8t8b3p",
    "moe_down_staged_r8t8b2p",
    // kda.cu
    "situ_glu",
    "sigmoid_mul",
    "kda_conv_step",
    "kda_prepare",
    "kda_delta",
    "attn_res_mix",
    "moe_gate_up_situ_mxfp4",
    // gqa.cu
    "gqa_attend",
    "route_softmax_topk",
    "add_bias_rows",
    "clamped_swiglu",
];

pub(crate) struct Kernels(std::collections::HashMap<&'static str, CudaFunction>);

impl Kernels {
    /// The loaded function `name` (one of [`ENTRY_POINTS`]).
    pub(crate) fn get(&self, name: &str) -> Result<&CudaFunction, CudaError> {
        self.0
            .get(name)
            .ok_or_else(|| CudaError::Shape(format!("no CUDA kernel named {name}")))
    }
}

/// An opened CUDA device with deltafin's kernels loaded; every operation runs on its one stream,
/// in submission order.
pub struct Gpu {
    info: DeviceInfo,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    _module: Arc<CudaModule>,
    pub(crate) k: Kernels,
    /// Completion counters of the launches whose last block finishes the work (`last_block` in
    /// fused.cu); zero between launches.
    pub(crate) counters: CudaSlice<i32>,
}

/// Where compiled PTX is cached: `$DELTAFIN_CACHE_DIR/cuda`, else `$XDG_CACHE_HOME/deltafin/cuda`,
/// else `~/.cache/deltafin/cuda`; `None` when none of these is set (then nothing is cached).
pub fn ptx_cache_dir() -> Option<PathBuf> {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    var("DELTAFIN_CACHE_DIR")
        .or_else(|| var("XDG_CACHE_HOME").map(|p| p.join("deltafin")))
        .or_else(|| var("HOME").map(|p| p.join(".cache").join("deltafin")))
        .map(|p| p.join("cuda"))
}

/// NVRTC's version, or the one-line reason it cannot be loaded.
fn nvrtc_version() -> Result<(i32, i32), CudaError> {
    // SAFETY: only tries to dlopen NVRTC by its usual names.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(CudaError::Unavailable(
            "the NVRTC library (libnvrtc.so) is not installed: it compiles deltafin's kernels".into(),
        ));
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library is present; nvrtcVersion writes two ints.
    unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    Ok((major, minor))
}

/// Compiles the kernels to PTX for `arch` (`compute_XY`), through the on-disk cache
/// ([`ptx_cache_dir`]), keyed by source, options, target and NVRTC version.
///
/// # Errors
/// [`CudaError::Unavailable`] when NVRTC is missing; [`CudaError::Compile`] with its log.
pub fn compile_ptx(arch: &str) -> Result<Ptx, CudaError> {
    let (major, minor) = nvrtc_version()?;
    let options = vec![format!("--gpu-architecture={arch}"), "--std=c++17".to_string()];
    let key = xxhash_rust::xxh3::xxh3_64(format!("{SOURCE}\0{}\0nvrtc {major}.{minor}", options.join(" ")).as_bytes());
    let cached = ptx_cache_dir().map(|d| d.join(format!("ops-{arch}-{key:016x}.ptx")));
    if let Some(text) = cached.as_ref().and_then(|p| std::fs::read_to_string(p).ok()) {
        return Ok(Ptx::from_src(text));
    }
    let opts = CompileOptions {
        options,
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(SOURCE, opts).map_err(|e| CudaError::Compile {
        arch: arch.to_string(),
        log: e.to_string(),
    })?;
    if let Some(path) = cached {
        // Best effort: a cache that cannot be written only costs a recompilation next time.
        let _ = path.parent().map(std::fs::create_dir_all).and_then(|_| {
            let tmp = path.with_extension(format!("tmp{}", std::process::id()));
            std::fs::write(&tmp, ptx.to_src()).ok()?;
            std::fs::rename(&tmp, &path).ok()
        });
    }
    Ok(ptx)
}

impl Gpu {
    /// Opens `cuda:ordinal`, compiles (or loads from the PTX cache) the kernels and loads them.
    ///
    /// # Errors
    /// [`CudaError::Unavailable`] when there is no driver or no such device; `Compile` when NVRTC
    /// fails; `Driver` for a failed driver call.
    pub fn open(ordinal: usize) -> Result<Self, CudaError> {
        let devices = probe()?;
        let info = devices.get(ordinal).cloned().ok_or_else(|| {
            CudaError::Unavailable(format!(
                "cuda:{ordinal} does not exist ({} device{} found)",
                devices.len(),
                if devices.len() == 1 { "" } else { "s" }
            ))
        })?;
        let ctx = CudaContext::new(ordinal).ctx("cuCtxCreate")?;
        // SAFETY: every buffer deltafin allocates is used on the context's default stream only
        // (all work is queued there, in order), so the per-argument cross-stream events cudarc
        // records otherwise (an event record per kernel argument, measurable at decode's
        // hundreds of launches a token) guard nothing here.
        unsafe { ctx.disable_event_tracking() };
        // A created (non-blocking) stream, not the legacy default one: work queued on it can be
        // captured into a CUDA graph (the decode step's), which the default stream refuses.
        let stream = ctx.new_stream().ctx("cuStreamCreate")?;
        let (major, minor) = info.compute_capability;
        let ptx = compile_ptx(&format!("compute_{major}{minor}"))?;
        let module = ctx.load_module(ptx).ctx("cuModuleLoadData")?;
        let mut k = std::collections::HashMap::new();
        for &name in ENTRY_POINTS {
            k.insert(name, module.load_function(name).ctx("cuModuleGetFunction")?);
        }
        let k = Kernels(k);
        let counters = stream.alloc_zeros::<i32>(4).ctx("cuMemAlloc")?;
        Ok(Self {
            info,
            ctx,
            stream,
            _module: module,
            k,
            counters,
        })
    }

    /// The device this was opened on.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// The stream every operation is queued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Device time of `work` in milliseconds: the median of `reps` runs, each bracketed by CUDA
    /// events on the stream, after two warm-up runs (METHOD.md: events, warm-up, median).
    ///
    /// # Errors
    /// The first error `work` returns, or a driver error.
    pub fn time_ms(&self, reps: usize, mut work: impl FnMut() -> Result<(), CudaError>) -> Result<f32, CudaError> {
        use cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
        work()?;
        work()?;
        let mut times = Vec::with_capacity(reps.max(1));
        for _ in 0..reps.max(1) {
            let a = self.stream.record_event(Some(CU_EVENT_DEFAULT)).ctx("cuEventRecord")?;
            work()?;
            let b = self.stream.record_event(Some(CU_EVENT_DEFAULT)).ctx("cuEventRecord")?;
            b.synchronize().ctx("cuEventSynchronize")?;
            times.push(a.elapsed_ms(&b).ctx("cuEventElapsedTime")?);
        }
        times.sort_by(f32::total_cmp);
        Ok(times[times.len() / 2])
    }

    /// Copies `data` to a new device buffer.
    ///
    /// # Errors
    /// A driver error (out of memory, ...).
    pub fn upload<T: cudarc::driver::DeviceRepr>(&self, data: &[T]) -> Result<CudaSlice<T>, CudaError> {
        self.stream.clone_htod(data).ctx("cuMemcpyHtoD")
    }

    /// A zeroed device buffer of `len` f32.
    ///
    /// # Errors
    /// A driver error (out of memory, ...).
    pub fn zeros(&self, len: usize) -> Result<GpuBuf, CudaError> {
        self.stream.alloc_zeros::<f32>(len).ctx("cuMemAlloc")
    }

    /// Copies a device buffer back (waits for the stream).
    ///
    /// # Errors
    /// A driver error, including one raised by an earlier kernel on the stream.
    pub fn download<T: cudarc::driver::DeviceRepr>(&self, buf: &CudaSlice<T>) -> Result<Vec<T>, CudaError> {
        self.stream.clone_dtoh(buf).ctx("cuMemcpyDtoH")
    }

    /// Copies `data` into the existing buffer `dst` (same length). The host slice is pageable
    /// memory, so this returns after the copy (and everything queued before it) is done.
    ///
    /// # Errors
    /// `Shape` when the lengths differ; a driver error.
    pub fn upload_into(&self, data: &[f32], dst: &mut GpuBuf) -> Result<(), CudaError> {
        if data.len() != dst.len() {
            return Err(CudaError::Shape(format!(
                "upload_into: {} host elements into a buffer of {}",
                data.len(),
                dst.len()
            )));
        }
        self.stream.memcpy_htod(data, dst).ctx("cuMemcpyHtoD")
    }

    /// Copies the device buffer `src` into `dst` (same length); waits for the stream.
    ///
    /// # Errors
    /// `Shape` when the lengths differ; a driver error, including one raised by an earlier kernel.
    pub fn download_into(&self, src: &GpuBuf, dst: &mut [f32]) -> Result<(), CudaError> {
        if src.len() != dst.len() {
            return Err(CudaError::Shape(format!(
                "download_into: a buffer of {} into {} host elements",
                src.len(),
                dst.len()
            )));
        }
        self.stream.memcpy_dtoh(src, dst).ctx("cuMemcpyDtoH")?;
        self.synchronize()
    }

    /// Sets every element of `buf` to 0.0 (on the stream).
    ///
    /// # Errors
    /// A driver error.
    pub fn fill_zero(&self, buf: &mut GpuBuf) -> Result<(), CudaError> {
        self.stream.memset_zeros(buf).ctx("cuMemsetD8")
    }

    /// Free device memory now, bytes (`cuMemGetInfo`).
    ///
    /// # Errors
    /// A driver error.
    pub fn free_bytes(&self) -> Result<u64, CudaError> {
        let (free, _total) = self.ctx.mem_get_info().ctx("cuMemGetInfo")?;
        Ok(free as u64)
    }

    /// Waits until everything queued so far has finished.
    ///
    /// # Errors
    /// A driver error, including one raised by a kernel.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.stream.synchronize().ctx("cuStreamSynchronize")
    }

    /// RMSNorm of each row of `x: [n, dim]` into `y: [n, dim]`:
    /// `y = x / sqrt(mean(x^2) + eps) * w` (`(1 + w)` when `one_plus`), `weight: [dim]`
    /// (Zhang & Sennrich 2019; transformers' `DeepseekV3RMSNorm`, Qwen3-Next's zero-centred form).
    ///
    /// # Errors
    /// `Shape` when lengths disagree; a driver error.
    pub fn rms_norm(
        &self,
        x: &GpuBuf,
        weight: &GpuBuf,
        n: usize,
        eps: f32,
        one_plus: bool,
        y: &mut GpuBuf,
    ) -> Result<(), CudaError> {
        let dim = weight.len();
        if n == 0 || dim == 0 || x.len() != n * dim || y.len() != n * dim || n > i32::MAX as usize {
            return Err(CudaError::Shape(format!(
                "rms_norm: x has {} and y {} elements, expected [{n}, {dim}] from the weight",
                x.len(),
                y.len()
            )));
        }
        let (dim_i, flag) = (dim as i32, one_plus as i32);
        let cfg = LaunchConfig {
            grid_dim: (n as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream.launch_builder(self.k.get("rms_norm")?);
        b.arg(x).arg(weight).arg(&dim_i).arg(&eps).arg(&flag).arg(y);
        // SAFETY: argument types and order match `rms_norm` in ops.cu; lengths checked above.
        unsafe { b.launch(cfg) }.ctx("launch rms_norm")?;
        Ok(())
    }

    /// SwiGLU: `out[i] = silu(gate[i]) * up[i]`, all `[len]`.
    ///
    /// # Errors
    /// `Shape` when lengths disagree; a driver error.
    pub fn swiglu(&self, gate: &GpuBuf, up: &GpuBuf, out: &mut GpuBuf) -> Result<(), CudaError> {
        let len = gate.len();
        if up.len() != len || out.len() != len || len > i32::MAX as usize {
            return Err(CudaError::Shape(format!(
                "swiglu: gate {len}, up {}, out {} elements",
                up.len(),
                out.len()
            )));
        }
        if len == 0 {
            return Ok(());
        }
        let len_i = len as i32;
        let mut b = self.stream.launch_builder(self.k.get("swiglu")?);
        b.arg(gate).arg(up).arg(&len_i).arg(out);
        // SAFETY: argument types and order match `swiglu` in ops.cu; lengths checked above.
        unsafe { b.launch(LaunchConfig::for_num_elems(len as u32)) }.ctx("launch swiglu")?;
        Ok(())
    }

    /// `y[i] += alpha * x[i]`, both `[len]` (a multiply then an add, as the CPU `axpy`).
    ///
    /// # Errors
    /// `Shape` when lengths disagree; a driver error.
    pub fn axpy(&self, alpha: f32, x: &GpuBuf, y: &mut GpuBuf) -> Result<(), CudaError> {
        let len = x.len();
        if y.len() != len || len > i32::MAX as usize {
            return Err(CudaError::Shape(format!("axpy: x {len}, y {} elements", y.len())));
        }
        if len == 0 {
            return Ok(());
        }
        let len_i = len as i32;
        let mut b = self.stream.launch_builder(self.k.get("axpy")?);
        b.arg(&alpha).arg(x).arg(&len_i).arg(y);
        // SAFETY: argument types and order match `axpy` in ops.cu; lengths checked above.
        unsafe { b.launch(LaunchConfig::for_num_elems(len as u32)) }.ctx("launch axpy")?;
        Ok(())
    }

    /// Device-to-device copy of `src` into `dst` (same length, a multiple of 16 bytes) by a
    /// kernel with 16-byte loads: the bandwidth ceiling for the matrix kernels' benchmark.
    ///
    /// # Errors
    /// `Shape` when lengths disagree or are not a multiple of 16; a driver error.
    pub fn copy16(&self, src: &CudaSlice<u8>, dst: &mut CudaSlice<u8>) -> Result<(), CudaError> {
        if src.len() != dst.len() || !src.len().is_multiple_of(16) {
            return Err(CudaError::Shape(format!(
                "copy16: {} and {} bytes (equal multiples of 16 wanted)",
                src.len(),
                dst.len()
            )));
        }
        let n = src.len() / 16;
        let cfg = LaunchConfig {
            grid_dim: (132 * 8, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream.launch_builder(self.k.get("copy16")?);
        b.arg(src).arg(dst).arg(&n);
        // SAFETY: argument types and order match `copy16` in ops.cu; lengths checked above.
        unsafe { b.launch(cfg) }.ctx("launch copy16")?;
        Ok(())
    }
}
