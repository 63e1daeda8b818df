//! The fused launches of a decode step and the router on the device (`kernels/fused.cu`).
//!
//! A decode step of a small MoE is bound by launches and host round trips, not by bytes
//! (bench/NOTES.md, "`--device cuda`"). These operations cut both while keeping every value's
//! arithmetic that of the one-operation kernels (the tests in `tests/ops.rs` compare bits):
//!
//! - [`Gpu::mv_jobs`]: up to [`MAX_JOBS`] matrix-vector products of one input in one launch, in
//!   any weight layout, optionally after an RMSNorm of the input, each writing, adding to (the
//!   residual stream) or gating (SwiGLU pairs) its output;
//! - [`Gpu::mla_prep`]: the latent's RMSNorm and the rope key's RoPE written straight into the KV
//!   cache rows of the position;
//! - [`Gpu::route_noaux`]: DeepSeek-V3's `noaux_tc` router for a batch of tokens, so that a decode
//!   step whose experts are all on the device never waits for the host;
//! - [`ExpertTable`] and [`Gpu::moe_table`]: the chosen experts' SwiGLU, down projections, weighted
//!   sum, shared experts and residual add in two launches, the experts found through a device
//!   table indexed by the router's ids.

use cudarc::driver::{CudaSlice, CudaView, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg, ValidAsZeroBits};

use crate::gpu::{GpuBuf, WARPS};
use crate::mat::{GpuMat, GpuMatData};
use crate::moe::{moe_grid, MOE_MAX_K};
use crate::{CudaError, DriverContext, Gpu};

/// Most products one [`Gpu::mv_jobs`] launch takes (`MAX_JOBS` in `fused.cu`).
pub const MAX_JOBS: usize = 4;

/// Largest input one pre-normalizing launch keeps in shared memory, elements (48 KiB of f32);
/// a longer input is normalized by a separate `rms_norm` launch first (same bits).
const PRE_NORM_MAX: usize = 12 * 1024;

/// A matrix as the kernels see it (`Mat` in `fused.cu`): device pointers, shape, layout.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct MatDesc {
    w: u64,
    s: u64,
    rows: i32,
    cols: i32,
    fmt: i32,
    pad: i32,
}

// SAFETY: `#[repr(C)]` plain data matching `Mat` in fused.cu (pointers as u64).
unsafe impl DeviceRepr for MatDesc {}
// SAFETY: all-zero bits are a valid (empty) descriptor.
unsafe impl ValidAsZeroBits for MatDesc {}

impl GpuMat {
    /// This matrix's descriptor for the fused kernels (pointers stay valid while `self` lives).
    pub fn desc(&self, gpu: &Gpu) -> MatDesc {
        let s = gpu.stream();
        // The guards only record events when event tracking is on; `Gpu::open` turns it off
        // (one stream), so dropping them at once is sound.
        let (w, sc, fmt) = match &self.data {
            GpuMatData::F32(w) => (w.device_ptr(s).0, 0, 0),
            GpuMatData::Int8 { q, scales } => (q.device_ptr(s).0, scales.device_ptr(s).0, 1),
            GpuMatData::Mxfp4 { packed, scales } => (packed.device_ptr(s).0, scales.device_ptr(s).0, 2),
        };
        MatDesc {
            w,
            s: sc,
            rows: self.rows as i32,
            cols: self.cols as i32,
            fmt,
            pad: 0,
        }
    }
}

/// What a [`MvJob`] does with row `r` of its product.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MvKind {
    /// `y[r] = A[r] · x`.
    Set,
    /// `y[r] += A[r] · x` (a multiply by 1 then an add: `axpy`'s arithmetic; the residual stream).
    Add,
    /// `y[r] = silu(A[r] · x) · (B[r] · x)` (a SwiGLU gate/up pair; `swiglu`'s arithmetic).
    Glu,
}

/// One product of a [`Gpu::mv_jobs`] launch: `a: [rows, cols]` (and `b` of the same shape for
/// [`MvKind::Glu`]) against the launch's input `x: [cols]`, into `y: [rows]`.
pub struct MvJob<'a> {
    /// The matrix (the gate for `Glu`).
    pub a: &'a GpuMat,
    /// The up projection for `Glu`, else `None`.
    pub b: Option<&'a GpuMat>,
    /// What is done with the product.
    pub kind: MvKind,
    /// The output `[rows]`.
    pub y: &'a mut GpuBuf,
}

impl<'a> MvJob<'a> {
    /// The job `y = a · x` ([`MvKind::Set`]).
    pub fn set(a: &'a GpuMat, y: &'a mut GpuBuf) -> Self {
        Self {
            a,
            b: None,
            kind: MvKind::Set,
            y,
        }
    }

    /// The job `y += a · x` ([`MvKind::Add`]).
    pub fn add(a: &'a GpuMat, y: &'a mut GpuBuf) -> Self {
        Self {
            a,
            b: None,
            kind: MvKind::Add,
            y,
        }
    }

    /// The job `y = silu(gate · x) · (up · x)` ([`MvKind::Glu`]).
    pub fn glu(gate: &'a GpuMat, up: &'a GpuMat, y: &'a mut GpuBuf) -> Self {
        Self {
            a: gate,
            b: Some(up),
            kind: MvKind::Glu,
            y,
        }
    }
}

/// An RMSNorm applied to the input of a [`Gpu::mv_jobs`] launch first:
/// `x̂ = x / sqrt(mean(x²) + eps) · w` (`(1 + w)` when `one_plus`), `rms_norm`'s arithmetic.
pub struct PreNorm<'a> {
    /// `weight: [cols]`.
    pub weight: &'a GpuBuf,
    /// ε.
    pub eps: f32,
    /// Zero-centred weight (Qwen3-Next).
    pub one_plus: bool,
    /// Where x̂ is also written (for later launches that read it), when given.
    pub out: Option<&'a mut GpuBuf>,
}

impl<'a> PreNorm<'a> {
    /// The plain RMSNorm (`w`, not `1 + w`) with `weight` and ε `eps`, its output not kept.
    pub fn rms(weight: &'a GpuBuf, eps: f32) -> Self {
        Self {
            weight,
            eps,
            one_plus: false,
            out: None,
        }
    }

    /// This norm, its output `x̂` also written to `out` (for later launches that read it).
    pub fn kept_in(self, out: &'a mut GpuBuf) -> Self {
        Self { out: Some(out), ..self }
    }
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct JobC {
    a: MatDesc,
    b: MatDesc,
    y: u64,
    kind: i32,
    row0: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct JobsC {
    j: [JobC; MAX_JOBS],
    n: i32,
    pad: i32,
}

// SAFETY: `#[repr(C)]` plain data matching `Jobs` in fused.cu.
unsafe impl DeviceRepr for JobsC {}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct PreNormC {
    w: u64,
    out: u64,
    eps: f32,
    dim: i32,
    one_plus: i32,
    pad: i32,
}

// SAFETY: `#[repr(C)]` plain data matching `PreNorm` in fused.cu.
unsafe impl DeviceRepr for PreNormC {}

/// How [`Gpu::moe_table`] launches the down projections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MoeDown {
    /// One launch: a warp computes a row's k dot products and combines them.
    Fused,
    /// A warp per (row, slot) dot product; the block that finishes last combines.
    Split,
}

/// The `noaux_tc` router's hyperparameters (DeepSeek-V3 config names; `RouteCfg` in fused.cu).
#[derive(Debug, Clone, Copy)]
pub struct RouterShape {
    /// `n_routed_experts`.
    pub n_experts: usize,
    /// `num_experts_per_tok` (at most [`MOE_MAX_K`]).
    pub top_k: usize,
    /// `n_group` (at most 64; 1 for no grouping). At most 4,096 experts.
    pub n_group: usize,
    /// `topk_group`.
    pub topk_group: usize,
    /// `norm_topk_prob`.
    pub norm_topk_prob: bool,
    /// `routed_scaling_factor`.
    pub routed_scaling_factor: f32,
}

/// MLA's per-token preparation at position `pos` ([`Gpu::mla_prep`], or two more blocks of a
/// [`Gpu::mv_jobs_prep`] launch): `c_kv[pos] = RMSNorm(ckv_raw)` with the `kv_a_layernorm` weight
/// `norm: [kv_lora_rank]`, and `k_pe[pos] = RoPE(kpe_raw)` with `cs = [cos[rope/2], sin[rope/2]]`
/// (`rms_norm`'s and `rope_apply`'s arithmetic). `c_kv: [>= pos + 1, kv_lora_rank]`,
/// `k_pe: [>= pos + 1, rope]` (the layer's caches). The kernel reads the position from
/// `pos_dev` (one device int that must hold `pos`), so a captured graph serves every position.
pub struct MlaPrepArg<'a> {
    /// The latent before its norm `[kv_lora_rank]`.
    pub ckv_raw: &'a GpuBuf,
    /// `kv_a_layernorm` weight.
    pub norm: &'a GpuBuf,
    /// Its ε.
    pub eps: f32,
    /// The shared rope key before RoPE `[qk_rope_head_dim]`.
    pub kpe_raw: &'a GpuBuf,
    /// RoPE's `[cos, sin]` of the position.
    pub cs: &'a GpuBuf,
    /// Pairs `(2i, 2i + 1)` instead of `(i, i + half)`.
    pub interleaved: bool,
    /// The position (for the bounds checks).
    pub pos: usize,
    /// The same position in device memory (what the kernel reads).
    pub pos_dev: &'a CudaSlice<i32>,
    /// The layer's latent cache.
    pub c_kv: &'a mut GpuBuf,
    /// The layer's rope-key cache.
    pub k_pe: &'a mut GpuBuf,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct MlaPrepC {
    ckv_raw: u64,
    norm_w: u64,
    c_kv: u64,
    kpe_raw: u64,
    cs: u64,
    k_pe: u64,
    pos: u64,
    kvl: i32,
    eps: f32,
    rope: i32,
    interleaved: i32,
    enabled: i32,
    pad: i32,
}

// SAFETY: `#[repr(C)]` plain data matching `MlaPrep` in fused.cu.
unsafe impl DeviceRepr for MlaPrepC {}

/// The router's outputs for [`Gpu::mv_jobs_route`]: one token's ids and weights are written at
/// `ids[off..off + top_k]`, `weights[off..off + top_k]`.
pub struct RouteTailArg<'a> {
    /// The router's shape.
    pub cfg: RouterShape,
    /// `e_score_correction_bias` `[n_experts]`.
    pub bias: &'a GpuBuf,
    /// Expert ids out.
    pub ids: &'a mut CudaSlice<i32>,
    /// Weights out.
    pub weights: &'a mut GpuBuf,
    /// Where the token's `top_k` entries start.
    pub off: usize,
}

/// Checks a routing launch's shape and lengths (see [`Gpu::route_noaux`]).
fn route_check(
    cfg: RouterShape,
    n: usize,
    logits: usize,
    bias: &GpuBuf,
    ids: usize,
    weights: usize,
    off: usize,
) -> Result<(), CudaError> {
    let (e, k) = (cfg.n_experts, cfg.top_k);
    let groups_ok = cfg.n_group <= 1
        || (cfg.n_group <= 64 && e % cfg.n_group == 0 && cfg.topk_group >= 1 && cfg.topk_group <= cfg.n_group);
    if n == 0
        || k == 0
        || k > MOE_MAX_K
        || k > e
        || !groups_ok
        || logits != n * e
        || bias.len() != e
        || ids < off + n * k
        || weights < off + n * k
        || n > 65_535 * 1024
        || e > 4096
    {
        return Err(CudaError::Shape(format!(
            "route_noaux: {cfg:?} for {n} token(s): logits {logits}, bias {}, outputs {ids} and {weights} at {off}",
            bias.len()
        )));
    }
    Ok(())
}

fn route_c(cfg: RouterShape) -> RouteC {
    RouteC {
        n_experts: cfg.n_experts as i32,
        top_k: cfg.top_k as i32,
        n_group: cfg.n_group.max(1) as i32,
        topk_group: cfg.topk_group as i32,
        norm: cfg.norm_topk_prob as i32,
        scale: cfg.routed_scaling_factor,
    }
}

/// Dynamic shared memory of the router: scores and choices, then a taken flag per expert.
fn route_smem(n_experts: usize) -> u32 {
    (2 * n_experts * 4 + n_experts) as u32
}

#[repr(C)]
#[derive(Clone, Copy)]
struct RouteTailC {
    bias: u64,
    ids: u64,
    weights: u64,
    counter: u64,
    c: RouteC,
    enabled: i32,
}

// SAFETY: `#[repr(C)]` plain data matching `RouteTail` in fused.cu.
unsafe impl DeviceRepr for RouteTailC {}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct RouteC {
    n_experts: i32,
    top_k: i32,
    n_group: i32,
    topk_group: i32,
    norm: i32,
    scale: f32,
}

// SAFETY: `#[repr(C)]` plain data matching `RouteCfg` in fused.cu.
unsafe impl DeviceRepr for RouteC {}

/// One routed expert's three matrices as the kernels see them (`Expert` in fused.cu).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ExpertDesc {
    gate: MatDesc,
    up: MatDesc,
    down: MatDesc,
}

// SAFETY: `#[repr(C)]` plain data matching `Expert` in fused.cu.
unsafe impl DeviceRepr for ExpertDesc {}
// SAFETY: all-zero bits are a valid (empty) descriptor.
unsafe impl ValidAsZeroBits for ExpertDesc {}

/// A device table of routed experts `[n]` (`gate_proj` and `up_proj`: `[inter, hidden]`,
/// `down_proj`: `[hidden, inter]`, any layout), indexed by expert id or by slot. It holds only
/// pointers: the caller keeps every expert it names alive while launches that read it are queued
/// (the device frees memory in stream order, so dropping a handle after queuing is enough).
pub struct ExpertTable {
    buf: CudaSlice<ExpertDesc>,
    /// Whether entry i holds an expert whose three matrices are MXFP4 (what
    /// [`Gpu::moe_grouped`] takes).
    mxfp4: Vec<bool>,
    inter: usize,
    hidden: usize,
}

impl ExpertTable {
    /// Entries.
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    /// Whether the table has no entries.
    pub fn is_empty(&self) -> bool {
        self.buf.len() == 0
    }

    /// Points entries `first ..` at `experts` (each `[gate_proj, up_proj, down_proj]`).
    ///
    /// # Errors
    /// `Shape` when an expert's shapes are not the table's or the entries do not fit; a driver
    /// error.
    pub fn set(&mut self, gpu: &Gpu, first: usize, experts: &[&[GpuMat; 3]]) -> Result<(), CudaError> {
        if first + experts.len() > self.buf.len() {
            return Err(CudaError::Shape(format!(
                "expert table: entries {first}..{} of {}",
                first + experts.len(),
                self.buf.len()
            )));
        }
        let mut descs = Vec::with_capacity(experts.len());
        for (slot, e) in experts.iter().enumerate() {
            let (i, h) = (self.inter, self.hidden);
            if e[0].rows != i || e[0].cols != h || e[1].rows != i || e[1].cols != h || e[2].rows != h || e[2].cols != i
            {
                return Err(CudaError::Shape(format!(
                    "expert table of [{i}, {h}] experts: got gate [{}, {}], up [{}, {}], down [{}, {}]",
                    e[0].rows, e[0].cols, e[1].rows, e[1].cols, e[2].rows, e[2].cols
                )));
            }
            self.mxfp4[first + slot] = e.iter().all(|m| matches!(m.data, GpuMatData::Mxfp4 { .. }));
            descs.push(ExpertDesc {
                gate: e[0].desc(gpu),
                up: e[1].desc(gpu),
                down: e[2].desc(gpu),
            });
        }
        if descs.is_empty() {
            return Ok(());
        }
        let mut dst = self.buf.slice_mut(first..first + descs.len());
        gpu.stream().memcpy_htod(&descs, &mut dst).ctx("cuMemcpyHtoD")
    }

    /// Empties entry `i` (its expert left the device).
    ///
    /// # Errors
    /// `Shape` when `i` is out of range; a driver error.
    pub fn clear(&mut self, gpu: &Gpu, i: usize) -> Result<(), CudaError> {
        if i >= self.buf.len() {
            return Err(CudaError::Shape(format!(
                "expert table: entry {i} of {}",
                self.buf.len()
            )));
        }
        self.mxfp4[i] = false;
        let mut dst = self.buf.slice_mut(i..i + 1);
        gpu.stream().memset_zeros(&mut dst).ctx("cuMemsetD8")
    }
}

impl Gpu {
    /// An empty [`ExpertTable`] of `n` entries for experts of `[inter, hidden]`.
    ///
    /// # Errors
    /// A driver error (out of memory).
    pub fn expert_table(&self, n: usize, inter: usize, hidden: usize) -> Result<ExpertTable, CudaError> {
        Ok(ExpertTable {
            buf: self.stream().alloc_zeros::<ExpertDesc>(n.max(1)).ctx("cuMemAlloc")?,
            mxfp4: vec![false; n.max(1)],
            inter,
            hidden,
        })
    }

    /// Up to [`MAX_JOBS`] products of one input `x: [cols]` in one launch (see [`MvJob`]),
    /// after `norm` of `x` when given. Each output equals the unfused launches' bit for bit
    /// (`rms_norm`, then `GpuMat::matvec`, `swiglu`, `axpy`).
    ///
    /// # Errors
    /// `Shape` for no or too many jobs, or lengths that disagree; a driver error.
    pub fn mv_jobs(&self, x: &GpuBuf, norm: Option<PreNorm>, jobs: &mut [MvJob]) -> Result<(), CudaError> {
        self.mv_jobs_route(x, norm, jobs, None)
    }

    /// [`Gpu::mv_jobs`], then, with `route`, the token routed in the same launch (by the block
    /// that finishes last): `jobs[0]` must be the router (`Set`, `n_experts` rows; its output the
    /// logits), and the choice is [`Gpu::route_noaux`]'s for that one token, bit for bit.
    ///
    /// # Errors
    /// As [`Gpu::mv_jobs`] and [`Gpu::route_noaux`]; `Shape` when `jobs[0]` is not the router.
    pub fn mv_jobs_route(
        &self,
        x: &GpuBuf,
        norm: Option<PreNorm>,
        jobs: &mut [MvJob],
        route: Option<RouteTailArg>,
    ) -> Result<(), CudaError> {
        self.mv_jobs_impl(x, norm, jobs, route, None)
    }

    fn mv_jobs_impl(
        &self,
        x: &GpuBuf,
        norm: Option<PreNorm>,
        jobs: &mut [MvJob],
        route: Option<RouteTailArg>,
        prep: Option<MlaPrepC>,
    ) -> Result<(), CudaError> {
        if jobs.is_empty() || jobs.len() > MAX_JOBS {
            return Err(CudaError::Shape(format!(
                "mv_jobs: {} jobs (1 to {MAX_JOBS})",
                jobs.len()
            )));
        }
        for j in jobs.iter() {
            let b_ok = match (j.kind, j.b) {
                (MvKind::Glu, Some(b)) => b.rows == j.a.rows && b.cols == j.a.cols,
                (MvKind::Glu, None) => false,
                (_, b) => b.is_none(),
            };
            if j.a.cols != x.len() || j.y.len() != j.a.rows || !b_ok {
                return Err(CudaError::Shape(format!(
                    "mv_jobs: a [{}, {}] {:?} job with x of {} and y of {} elements",
                    j.a.rows,
                    j.a.cols,
                    j.kind,
                    x.len(),
                    j.y.len()
                )));
            }
        }
        let mut pn = PreNormC::default();
        let mut staged: Option<GpuBuf> = None;
        let mut shared_mem_bytes = 0u32;
        if let Some(n) = norm {
            if n.weight.len() != x.len() {
                return Err(CudaError::Shape(format!(
                    "mv_jobs: a norm weight of {} for x of {}",
                    n.weight.len(),
                    x.len()
                )));
            }
            if n.out.as_ref().is_some_and(|o| o.len() != x.len()) {
                return Err(CudaError::Shape(format!("mv_jobs: a norm output for x of {}", x.len())));
            }
            if x.len() > PRE_NORM_MAX {
                // Too long for shared memory: the same norm as its own launch.
                let mut t = self.zeros(x.len())?;
                self.rms_norm(x, n.weight, 1, n.eps, n.one_plus, &mut t)?;
                if let Some(out) = n.out {
                    self.stream().memcpy_dtod(&t, out).ctx("cuMemcpyDtoD")?;
                }
                staged = Some(t);
            } else {
                let s = self.stream();
                pn = PreNormC {
                    w: n.weight.device_ptr(s).0,
                    out: n.out.map_or(0, |o| o.device_ptr(s).0),
                    eps: n.eps,
                    dim: x.len() as i32,
                    one_plus: n.one_plus as i32,
                    pad: 0,
                };
                shared_mem_bytes = (x.len() * 4) as u32;
            }
        }
        let mut c = JobsC {
            n: jobs.len() as i32,
            ..Default::default()
        };
        let mut row0 = 0usize;
        for (i, j) in jobs.iter().enumerate() {
            let kind = match j.kind {
                MvKind::Set => 0,
                MvKind::Add => 1,
                MvKind::Glu => 2,
            };
            c.j[i] = JobC {
                a: j.a.desc(self),
                b: j.b.map(|b| b.desc(self)).unwrap_or_default(),
                y: j.y.device_ptr(self.stream()).0,
                kind,
                row0: row0 as i32,
            };
            row0 += j.a.rows;
        }
        if row0 > i32::MAX as usize {
            return Err(CudaError::Shape(format!("mv_jobs: {row0} rows in one launch")));
        }
        let cfg = LaunchConfig {
            grid_dim: ((row0 as u32).div_ceil(WARPS), 1, 1),
            block_dim: (32 * WARPS, 1, 1),
            shared_mem_bytes,
        };
        let mut rt = RouteTailC {
            bias: 0,
            ids: 0,
            weights: 0,
            counter: 0,
            c: RouteC::default(),
            enabled: 0,
        };
        let mut cfg = cfg;
        if let Some(r) = route {
            let router_ok = jobs[0].kind == MvKind::Set && jobs[0].a.rows == r.cfg.n_experts;
            let c = route_check(r.cfg, 1, jobs[0].y.len(), r.bias, r.ids.len(), r.weights.len(), r.off);
            if !router_ok || c.is_err() {
                return Err(CudaError::Shape(format!(
                    "mv_jobs with a router: job 0 must be the router's {} rows ({})",
                    r.cfg.n_experts,
                    c.err().map_or_else(String::new, |e| e.to_string())
                )));
            }
            let s = self.stream();
            rt = RouteTailC {
                bias: r.bias.device_ptr(s).0,
                ids: r.ids.device_ptr(s).0 + (r.off * 4) as u64,
                weights: r.weights.device_ptr(s).0 + (r.off * 4) as u64,
                counter: self.counters.device_ptr(s).0,
                c: route_c(r.cfg),
                enabled: 1,
            };
            cfg.shared_mem_bytes = cfg.shared_mem_bytes.max(route_smem(r.cfg.n_experts));
        }
        if prep.is_some() {
            // Two more blocks for the MLA preparation (never with the router tail, whose
            // completion count takes every block of the launch).
            cfg.grid_dim.0 += 2;
        }
        let prep = prep.unwrap_or_default();
        let input = staged.as_ref().unwrap_or(x);
        let mut b = self.stream().launch_builder(self.k.get("mv_jobs")?);
        b.arg(&c).arg(input).arg(&pn).arg(&rt).arg(&prep);
        // SAFETY: matches `mv_jobs` in fused.cu; every job's shapes were checked against x and y,
        // the outputs are distinct buffers borrowed mutably for the call.
        unsafe { b.launch(cfg) }.ctx("launch mv_jobs")?;
        Ok(())
    }

    /// MLA's per-token preparation (see [`MlaPrepArg`]) as its own launch of two blocks.
    ///
    /// # Errors
    /// `Shape` when lengths disagree; a driver error.
    pub fn mla_prep(&self, arg: MlaPrepArg) -> Result<(), CudaError> {
        let c = self.prep_c(arg)?;
        let cfg = LaunchConfig {
            grid_dim: (2, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream().launch_builder(self.k.get("mla_prep")?);
        b.arg(&c);
        // SAFETY: matches `mla_prep` in fused.cu; lengths checked by prep_c for the position the
        // caller put in `pos_dev`.
        unsafe { b.launch(cfg) }.ctx("launch mla_prep")?;
        Ok(())
    }

    fn prep_c(&self, m: MlaPrepArg) -> Result<MlaPrepC, CudaError> {
        let (kvl, rope, pos) = (m.ckv_raw.len(), m.kpe_raw.len(), m.pos);
        if m.norm.len() != kvl
            || m.cs.len() != rope
            || !rope.is_multiple_of(2)
            || m.c_kv.len() < (pos + 1) * kvl
            || m.k_pe.len() < (pos + 1) * rope
            || m.pos_dev.is_empty()
        {
            return Err(CudaError::Shape(format!(
                "mla_prep: latent {kvl}, norm {}, rope key {rope}, cos/sin {}, caches {} and {} at position {pos}",
                m.norm.len(),
                m.cs.len(),
                m.c_kv.len(),
                m.k_pe.len()
            )));
        }
        let s = self.stream();
        Ok(MlaPrepC {
            ckv_raw: m.ckv_raw.device_ptr(s).0,
            norm_w: m.norm.device_ptr(s).0,
            c_kv: m.c_kv.device_ptr(s).0,
            kpe_raw: m.kpe_raw.device_ptr(s).0,
            cs: m.cs.device_ptr(s).0,
            k_pe: m.k_pe.device_ptr(s).0,
            pos: m.pos_dev.device_ptr(s).0,
            kvl: kvl as i32,
            eps: m.eps,
            rope: rope as i32,
            interleaved: m.interleaved as i32,
            enabled: 1,
            pad: 0,
        })
    }

    /// [`Gpu::mv_jobs`] with MLA's per-token preparation ([`MlaPrepArg`]) done by two more blocks
    /// of the same launch (what `q_b_proj`'s launch takes along: it does not read their output).
    ///
    /// # Errors
    /// As [`Gpu::mv_jobs`] and [`Gpu::mla_prep`].
    pub fn mv_jobs_prep(
        &self,
        x: &GpuBuf,
        norm: Option<PreNorm>,
        jobs: &mut [MvJob],
        prep: MlaPrepArg,
    ) -> Result<(), CudaError> {
        let c = self.prep_c(prep)?;
        self.mv_jobs_impl(x, norm, jobs, None, Some(c))
    }

    /// Routes `n` tokens on the device (`noaux_tc`, see `route_noaux` in fused.cu and the host's
    /// `deltafin_engine::moe::route`): `logits: [n, n_experts]`, `bias: [n_experts]`
    /// (`e_score_correction_bias`); writes each token's `top_k` expert ids (ascending) to
    /// `ids[off + t * top_k ..]` and their weights to `weights[off + t * top_k ..]`.
    ///
    /// # Errors
    /// `Shape` for an unsupported shape (top_k above [`MOE_MAX_K`] or the expert count, more
    /// than 64 groups, groups that do not divide the experts) or lengths that disagree; a
    /// driver error.
    #[allow(clippy::too_many_arguments)]
    pub fn route_noaux(
        &self,
        cfg: RouterShape,
        logits: &GpuBuf,
        n: usize,
        bias: &GpuBuf,
        ids: &mut CudaSlice<i32>,
        weights: &mut GpuBuf,
        off: usize,
    ) -> Result<(), CudaError> {
        route_check(cfg, n, logits.len(), bias, ids.len(), weights.len(), off)?;
        let c = route_c(cfg);
        let k = cfg.top_k;
        let mut id_v = ids.slice_mut(off..off + n * k);
        let mut w_v = weights.slice_mut(off..off + n * k);
        let lc = LaunchConfig {
            grid_dim: (n as u32, 1, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: route_smem(cfg.n_experts),
        };
        let mut b = self.stream().launch_builder(self.k.get("route_noaux")?);
        b.arg(logits).arg(bias).arg(&c).arg(&mut id_v).arg(&mut w_v);
        // SAFETY: matches `route_noaux` in fused.cu; lengths and limits checked above.
        unsafe { b.launch(lc) }.ctx("launch route_noaux")?;
        Ok(())
    }

    /// The routed part of a MoE block for one token in two launches, added to the residual
    /// stream: `x += Σ_j w[j] · down_j(silu(gate_j x̂) ⊙ up_j x̂) + shared_down(shared_h)`, where
    /// slot `j`'s expert is `table[ids[j]]` (`ids: [k]`, `w: [k]` in router order, views of
    /// device buffers), `xn: [hidden]` is x̂, `h: [>= k * inter]` scratch and
    /// `shared = (shared_down, shared_h)` the shared experts' down projection `[hidden, s_inter]`
    /// and their gated intermediate `[s_inter]` (see [`MvKind::Glu`]). Bit-identical to
    /// `Gpu::moe_fused` and to the unfused path (matvec, swiglu, axpy per expert).
    ///
    /// The ids are not checked on the host: every id a launch reads must name an entry the
    /// caller filled ([`ExpertTable::set`]) and whose expert is alive.
    ///
    /// `form` chooses the down projections' launch: `MoeDown::Split` needs `h` to hold
    /// `k * inter + (k + 1) * hidden` elements (the slots' outputs follow the intermediates).
    /// Both forms give the same bits.
    ///
    /// # Errors
    /// `Shape` when lengths disagree; a driver error.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_table(
        &self,
        form: MoeDown,
        table: &ExpertTable,
        ids: &CudaView<i32>,
        w: &CudaView<f32>,
        k: usize,
        xn: &GpuBuf,
        h: &mut GpuBuf,
        shared: Option<(&GpuMat, &GpuBuf)>,
        x: &mut GpuBuf,
    ) -> Result<(), CudaError> {
        let (inter, hidden) = (table.inter, table.hidden);
        let shared_ok = shared.is_none_or(|(d, sh)| d.rows == hidden && d.cols == sh.len());
        if k == 0
            || k > MOE_MAX_K
            || ids.len() < k
            || w.len() < k
            || xn.len() != hidden
            || x.len() != hidden
            || h.len() < k * inter + if form == MoeDown::Split { (k + 1) * hidden } else { 0 }
            || !shared_ok
        {
            return Err(CudaError::Shape(format!(
                "moe_table: {k} slots of [{inter}, {hidden}] experts with xn {}, x {}, h {}",
                xn.len(),
                x.len(),
                h.len()
            )));
        }
        let (inter_i, hidden_i, k_i) = (inter as i32, hidden as i32, k as i32);
        let id_v = ids.slice(..k);
        let w_v = w.slice(..k);
        let mut b = self.stream().launch_builder(self.k.get("moe_gate_up_tab")?);
        b.arg(&table.buf).arg(&id_v).arg(&inter_i).arg(xn).arg(&mut *h);
        // SAFETY: matches `moe_gate_up_tab` in fused.cu; the table's entries have [inter, hidden]
        // gate/up (checked by ExpertTable::set), h holds k * inter.
        unsafe { b.launch(moe_grid(inter, k)) }.ctx("launch moe_gate_up_tab")?;
        let (sd, sh) = match shared {
            Some((d, sh)) => (d.desc(self), sh.device_ptr(self.stream()).0),
            None => (MatDesc::default(), 0u64),
        };
        // Both down forms take the table, the slots, their weights and the dimensions first.
        let name = match form {
            MoeDown::Split => "moe_down_tab",
            MoeDown::Fused => "moe_down_combine_tab",
        };
        let mut b = self.stream().launch_builder(self.k.get(name)?);
        b.arg(&table.buf)
            .arg(&id_v)
            .arg(&w_v)
            .arg(&k_i)
            .arg(&hidden_i)
            .arg(&inter_i);
        match form {
            MoeDown::Split => {
                let (mut hs, mut ys) = h.split_at_mut(k * inter);
                let slots = k + shared.is_some() as usize;
                b.arg(&mut hs).arg(&sd).arg(&sh).arg(&mut ys).arg(x).arg(&self.counters);
                // SAFETY: matches `moe_down_tab`; down is [hidden, inter] per the table, y (after
                // the intermediates) holds (k + 1) * hidden, x is [hidden]; the completion counter
                // is zero between launches (the last block resets it) and only this stream uses it.
                unsafe { b.launch(moe_grid(hidden, slots)) }.ctx("launch moe_down_tab")?;
            }
            MoeDown::Fused => {
                b.arg(&*h).arg(&sd).arg(&sh).arg(x);
                // SAFETY: matches `moe_down_combine_tab`; down is [hidden, inter] per the table,
                // the shared pair's shapes were checked, x is [hidden].
                unsafe { b.launch(moe_grid(hidden, 1)) }.ctx("launch moe_down_combine_tab")?;
            }
        }
        Ok(())
    }
}

/// A shape of the grouped expert kernels (`moe_gate_up_grouped_*` / `moe_down_grouped_*`, and
/// with `staged` the `*_staged_*` kernels that stage a tile's inputs in shared memory, in
/// fused.cu). Every shape gives the same bits; they differ only in speed (`examples/
/// grouped_bench.rs`, bench/NOTES.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupedShape {
    /// Most (token, slot) pairs a tile holds: 4, 8 or 16.
    pub tokens: usize,
    /// Rows of gate and of up one warp computes: 1, 2, 4 or 8.
    pub gate_up_rows: usize,
    /// Unroll of the gate/up kernel's MX-block loop: 1 or 2 (unstaged kernels only).
    pub gate_up_unroll: usize,
    /// Rows of down one warp computes: 1, 2, 4, 8 or 16.
    pub down_rows: usize,
    /// Whether a block of 4 warps stages the tile's inputs in shared memory and covers
    /// `cta_rows` rows (its warps `*_rows` at a time in turn); otherwise blocks of 8 warps read
    /// the inputs through L1, one pass of rows a warp.
    pub staged: bool,
    /// Rows a block covers (staged kernels only).
    pub cta_rows: usize,
    /// Blocks an SM the staged kernels' registers are capped for: 3 (168 registers a thread,
    /// a few spilled) or 2 (none spilled); 0 for unstaged shapes.
    pub blocks_per_sm: usize,
    /// Whether the staged kernels load the next MX block's codes before this block's
    /// arithmetic.
    pub prefetch: bool,
}

impl GroupedShape {
    /// The shape the engine uses where the staged kernels' shared memory does not fit the
    /// device (see [`Gpu::grouped_shape`]): the fastest unstaged shape measured on the H200
    /// (`grouped_bench`, 2,000 and 512 tokens of the `bench` preset's experts: 21.8 / 5.97 ms
    /// against 24.5 / 6.79 ms for the next; bench/NOTES.md).
    pub const DEFAULT: Self = Self::new(8, 1, 1, 2);

    /// The shape the engine uses where it fits (see [`Gpu::grouped_shape`]): the fastest
    /// measured on the H200 (`grouped_bench`, the `bench` preset's experts at 2,000 tokens:
    /// 8.77 ms, against 9.39 ms with prefetch at 2 blocks an SM and 21.83 ms for the fastest
    /// unstaged shape in the same run; bench/NOTES.md, session 9).
    /// Taken where three blocks' tiles fit an SM's shared memory (a hidden size up to about
    /// 2,000 columns), else [`GroupedShape::STAGED_WIDE`].
    pub const DEFAULT_STAGED: Self = Self::staged(8, 4, 8, 256, 3, false);

    /// The staged shape for rows too long for three tiles an SM: registers capped for two
    /// blocks, the next MX block's codes loaded ahead (the default before session 9's
    /// measurements; 9.39 ms in the run above).
    pub const STAGED_WIDE: Self = Self::staged(8, 4, 8, 256, 2, true);

    /// Every shape that has kernels.
    pub const ALL: [Self; 22] = [
        Self::new(8, 2, 1, 4),
        Self::new(8, 2, 1, 2),
        Self::new(8, 2, 1, 1),
        Self::new(8, 2, 2, 4),
        Self::new(8, 2, 2, 2),
        Self::new(8, 1, 1, 4),
        Self::new(8, 1, 1, 2),
        Self::new(8, 1, 1, 1),
        Self::new(8, 1, 2, 4),
        Self::new(8, 1, 2, 2),
        Self::new(16, 1, 1, 2),
        Self::new(4, 2, 1, 4),
        Self::new(4, 2, 1, 2),
        Self::new(4, 4, 1, 4),
        Self::new(4, 4, 1, 2),
        Self::new(8, 2, 2, 1),
        Self::staged(8, 4, 8, 256, 3, false),
        Self::staged(8, 4, 8, 128, 3, false),
        Self::staged(8, 4, 8, 256, 3, true),
        Self::staged(8, 4, 8, 128, 3, true),
        Self::staged(8, 4, 8, 256, 2, true),
        Self::staged(8, 4, 8, 128, 2, true),
    ];

    const fn new(tokens: usize, gate_up_rows: usize, gate_up_unroll: usize, down_rows: usize) -> Self {
        Self {
            tokens,
            gate_up_rows,
            gate_up_unroll,
            down_rows,
            staged: false,
            cta_rows: 0,
            blocks_per_sm: 0,
            prefetch: false,
        }
    }

    const fn staged(
        tokens: usize,
        gate_up_rows: usize,
        down_rows: usize,
        cta_rows: usize,
        blocks_per_sm: usize,
        prefetch: bool,
    ) -> Self {
        Self {
            tokens,
            gate_up_rows,
            gate_up_unroll: 1,
            down_rows,
            staged: true,
            cta_rows,
            blocks_per_sm,
            prefetch,
        }
    }

    /// The two kernels' names.
    fn names(&self) -> Result<(&'static str, &'static str), CudaError> {
        let no = |which: &str| Err(CudaError::Shape(format!("no grouped {which} kernel for {self:?}")));
        if self.staged {
            if self.cta_rows == 0
                || !self.cta_rows.is_multiple_of(4 * self.gate_up_rows)
                || !self.cta_rows.is_multiple_of(4 * self.down_rows)
            {
                return no("staged");
            }
            let gu = match (self.gate_up_rows, self.tokens, self.blocks_per_sm, self.prefetch) {
                (4, 8, 3, false) => "moe_gate_up_staged_r4t8b3",
                (4, 8, 3, true) => "moe_gate_up_staged_r4t8b3p",
                (4, 8, 2, true) => "moe_gate_up_staged_r4t8b2p",
                _ => return no("staged gate/up"),
            };
            let dn = match (self.down_rows, self.tokens, self.blocks_per_sm, self.prefetch) {
                (8, 8, 3, false) => "moe_down_staged_r8t8b3",
                (8, 8, 3, true) => "moe_down_staged_r8t8b3p",
                (8, 8, 2, true) => "moe_down_staged_r8t8b2p",
                _ => return no("staged down"),
            };
            return Ok((gu, dn));
        }
        let gu = match (self.gate_up_rows, self.tokens, self.gate_up_unroll) {
            (2, 8, 1) => "moe_gate_up_grouped_r2t8",
            (2, 8, 2) => "moe_gate_up_grouped_r2t8u2",
            (1, 8, 1) => "moe_gate_up_grouped_r1t8",
            (1, 8, 2) => "moe_gate_up_grouped_r1t8u2",
            (1, 16, 1) => "moe_gate_up_grouped_r1t16",
            (2, 4, 1) => "moe_gate_up_grouped_r2t4",
            (4, 4, 1) => "moe_gate_up_grouped_r4t4",
            _ => return no("gate/up"),
        };
        let dn = match (self.down_rows, self.tokens) {
            (4, 8) => "moe_down_grouped_r4t8",
            (2, 8) => "moe_down_grouped_r2t8",
            (1, 8) => "moe_down_grouped_r1t8",
            (2, 16) => "moe_down_grouped_r2t16",
            (4, 4) => "moe_down_grouped_r4t4",
            (2, 4) => "moe_down_grouped_r2t4",
            _ => return no("down"),
        };
        Ok((gu, dn))
    }

    /// Shared memory of the staged kernels for `cols` input columns: the tile's inputs, each MX
    /// block of 32 floats padded to 36 (`SX` in fused.cu). Zero for unstaged shapes.
    pub fn shared_bytes(&self, cols: usize) -> usize {
        if self.staged {
            self.tokens * cols.div_ceil(32) * 36 * 4
        } else {
            0
        }
    }
}

/// Most tiles one grouped launch takes (the grid's y extent).
const MAX_TILES_PER_LAUNCH: usize = 65_535;

/// Warps a block of the staged grouped kernels (`__launch_bounds__(128, …)` in fused.cu).
const STAGED_WARPS: u32 = 4;

impl Gpu {
    /// The shape [`Gpu::moe_grouped`] uses for `table`'s experts: [`GroupedShape::DEFAULT_STAGED`]
    /// when three blocks' tiles (plus each block's 1 KiB scale table and the 1 KiB the driver
    /// reserves) fit in the shared memory one block may opt into, else
    /// [`GroupedShape::STAGED_WIDE`] when one block's tile fits, else [`GroupedShape::DEFAULT`].
    /// Every shape gives the same bits. Tiles for `moe_grouped` hold at most its `tokens` pairs.
    pub fn grouped_shape(&self, table: &ExpertTable) -> GroupedShape {
        let need = |s: GroupedShape| s.shared_bytes(table.hidden).max(s.shared_bytes(table.inter));
        let optin = self.info().shared_bytes_optin;
        if 3 * (need(GroupedShape::DEFAULT_STAGED) + 2048) <= optin {
            GroupedShape::DEFAULT_STAGED
        } else if need(GroupedShape::STAGED_WIDE) <= optin {
            GroupedShape::STAGED_WIDE
        } else {
            GroupedShape::DEFAULT
        }
    }

    /// The routed experts of a prefill chunk, expert-major, in two launches for all experts
    /// (instead of five launches and three allocations per expert):
    /// `h[p] = silu(gate_e · xg[p]) ⊙ (up_e · xg[p])`, then `y[dst[p]] = down_e · h[p]` for every
    /// (token, slot) pair `p`, where `e` is the entry of `table` of the tile holding `p`.
    ///
    /// - `xg: [pairs, hidden]`: the pairs' inputs, sorted so that each expert's pairs are
    ///   consecutive (the "gathered order");
    /// - `tiles[i] = [entry, first, count]`: pairs `first .. first + count` (1 ≤ count ≤
    ///   [`Gpu::grouped_shape`]`.tokens`) use table entry `entry`; every pair in exactly one tile;
    /// - `dst[p]`: the row of `y: [rows, hidden]` that pair `p`'s output goes to, all distinct;
    /// - `h: [pairs, inter]`: work space.
    ///
    /// Every output is the one-token kernels' dot product for that row and token (`mx_rows`,
    /// then `warp_sum`), so the result equals `GpuMat::matmul` of gate and up, `Gpu::swiglu`,
    /// `GpuMat::matmul` of down and a scatter, bit for bit (test `grouped_experts_equal_…`).
    ///
    /// `shape` is the kernels' shape ([`Gpu::grouped_shape`] chooses one for the table; every
    /// shape gives the same bits), the tiles hold at most `shape.tokens` pairs.
    ///
    /// # Errors
    /// `Shape` when a tile names an entry that is not an MXFP4 expert of the table, the tiles
    /// do not cover the pairs once, a destination is out of range or repeated, or lengths
    /// disagree; `Shape` for a shape without kernels or whose shared memory does not fit this
    /// device; a driver error.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_grouped(
        &self,
        shape: GroupedShape,
        table: &ExpertTable,
        tiles: &[[i32; 3]],
        xg: &GpuBuf,
        dst: &[i32],
        h: &mut GpuBuf,
        y: &mut GpuBuf,
    ) -> Result<(), CudaError> {
        let (gu_name, dn_name) = shape.names()?;
        let tmax = shape.tokens;
        let (inter, hidden) = (table.inter, table.hidden);
        let pairs = dst.len();
        let bad = |why: String| Err(CudaError::Shape(format!("moe_grouped: {why}")));
        if pairs == 0
            || hidden == 0
            || inter == 0
            || xg.len() != pairs * hidden
            || h.len() != pairs * inter
            || !y.len().is_multiple_of(hidden)
        {
            return bad(format!(
                "{pairs} pairs of [{inter}, {hidden}] experts with xg {}, h {}, y {}",
                xg.len(),
                h.len(),
                y.len()
            ));
        }
        let (smem_gu, smem_dn) = (shape.shared_bytes(hidden), shape.shared_bytes(inter));
        if smem_gu.max(smem_dn) > self.info().shared_bytes_optin {
            return bad(format!(
                "{shape:?} needs {} bytes of shared memory a block; this device allows {}",
                smem_gu.max(smem_dn),
                self.info().shared_bytes_optin
            ));
        }
        let y_rows = y.len() / hidden;
        let mut covered = 0usize;
        for (i, &[e, first, count]) in tiles.iter().enumerate() {
            let ok_entry = usize::try_from(e).is_ok_and(|e| mxfp4_entry(table, e));
            if !ok_entry {
                return bad(format!("tile {i} names entry {e}, not an MXFP4 expert of the table"));
            }
            if first as usize != covered || count < 1 || count as usize > tmax {
                return bad(format!(
                    "tile {i} covers pairs {first}..+{count}; expected {covered}..+1..={tmax}"
                ));
            }
            covered += count as usize;
        }
        if covered != pairs {
            return bad(format!("the tiles cover {covered} of {pairs} pairs"));
        }
        let mut seen = vec![false; y_rows];
        for (p, &d) in dst.iter().enumerate() {
            match usize::try_from(d).ok().filter(|&d| d < y_rows) {
                Some(d) if !seen[d] => seen[d] = true,
                _ => {
                    return bad(format!(
                        "pair {p} goes to row {d} of {y_rows} (out of range or repeated)"
                    ))
                }
            }
        }
        let (inter_i, hidden_i) = (inter as i32, hidden as i32);
        let flat: Vec<i32> = tiles.iter().flatten().copied().collect();
        let tiles_d = self.upload(&flat)?;
        let dst_d = self.upload(dst)?;
        let (gu, dn) = (self.k.get(gu_name)?, self.k.get(dn_name)?);
        // Launch shape: (blocks over rows, tiles); staged kernels opt in to their shared memory.
        let cfg = |rows: usize, rows_a_warp: usize, smem: usize, nt: u32| {
            if shape.staged {
                LaunchConfig {
                    grid_dim: (rows.div_ceil(shape.cta_rows) as u32, nt, 1),
                    block_dim: (32 * STAGED_WARPS, 1, 1),
                    shared_mem_bytes: smem as u32,
                }
            } else {
                LaunchConfig {
                    grid_dim: (rows.div_ceil(WARPS as usize * rows_a_warp) as u32, nt, 1),
                    block_dim: (32 * WARPS, 1, 1),
                    shared_mem_bytes: 0,
                }
            }
        };
        if shape.staged {
            let attr = cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
            gu.set_attribute(attr, smem_gu as i32)
                .ctx("cuFuncSetAttribute (gate/up)")?;
            dn.set_attribute(attr, smem_dn as i32)
                .ctx("cuFuncSetAttribute (down)")?;
        }
        let cta_rows = shape.cta_rows as i32;
        for (t0, nt) in tile_batches(tiles.len()) {
            let mut b = self.stream().launch_builder(gu);
            b.arg(&table.buf).arg(&tiles_d).arg(&t0).arg(&inter_i).arg(&hidden_i);
            if shape.staged {
                b.arg(&cta_rows);
            }
            b.arg(xg).arg(&mut *h);
            // SAFETY: matches `moe_gate_up_grouped_*` / `moe_gate_up_staged_*` in fused.cu;
            // every tile names a filled MXFP4 entry of [inter, hidden] gate/up (checked above and
            // by ExpertTable::set) and pairs inside xg and h; the staged kernels' shared memory
            // is what they index (tokens × blocks × 36 floats) and was allowed above.
            unsafe { b.launch(cfg(inter, shape.gate_up_rows, smem_gu, nt)) }.ctx("launch grouped gate/up")?;
        }
        for (t0, nt) in tile_batches(tiles.len()) {
            let mut b = self.stream().launch_builder(dn);
            b.arg(&table.buf).arg(&tiles_d).arg(&t0).arg(&hidden_i).arg(&inter_i);
            if shape.staged {
                b.arg(&cta_rows);
            }
            b.arg(&*h).arg(&dst_d).arg(&mut *y);
            // SAFETY: matches `moe_down_grouped_*` / `moe_down_staged_*`; down is [hidden, inter]
            // per the table, every destination row is inside y and distinct (checked above).
            unsafe { b.launch(cfg(hidden, shape.down_rows, smem_dn, nt)) }.ctx("launch grouped down")?;
        }
        Ok(())
    }
}

/// The launches over `n_tiles` tiles: (first tile, tiles) of at most [`MAX_TILES_PER_LAUNCH`]
/// each (the grid's y extent).
fn tile_batches(n_tiles: usize) -> impl Iterator<Item = (i32, u32)> {
    (0..n_tiles)
        .step_by(MAX_TILES_PER_LAUNCH)
        .map(move |tile0| (tile0 as i32, (n_tiles - tile0).min(MAX_TILES_PER_LAUNCH) as u32))
}

/// Whether entry `e` of `table` holds an MXFP4 expert.
fn mxfp4_entry(table: &ExpertTable, e: usize) -> bool {
    table.mxfp4.get(e).copied().unwrap_or(false)
}
