//! The routed experts of one decode token in three launches (`moe_*` in `ops.cu`).

use cudarc::driver::{DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg};

use crate::gpu::{GpuBuf, WARPS};
use crate::mat::{GpuMat, GpuMatData};
use crate::{CudaError, DriverContext, Gpu};

/// Most experts one fused launch takes (`MOE_MAX_K` in `ops.cu`; Kimi K3 chooses 16).
pub const MOE_MAX_K: usize = 16;

/// Device pointers of one projection of up to [`MOE_MAX_K`] experts (`MoePtrs` in `ops.cu`).
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct MoePtrs {
    packed: [u64; MOE_MAX_K],
    scales: [u64; MOE_MAX_K],
}

// SAFETY: plain `#[repr(C)]` data matching the kernels' struct (device pointers as u64).
unsafe impl DeviceRepr for MoePtrs {}

/// Router weights in router order (`MoeWeights` in `ops.cu`).
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct MoeWeights {
    w: [f32; MOE_MAX_K],
}

// SAFETY: plain `#[repr(C)]` f32 array matching the kernels' struct.
unsafe impl DeviceRepr for MoeWeights {}

impl MoeWeights {
    /// `weights` (at most [`MOE_MAX_K`]) padded with zeros.
    pub(crate) fn new(weights: &[f32]) -> Self {
        let mut wts = MoeWeights { w: [0.0; MOE_MAX_K] };
        wts.w[..weights.len()].copy_from_slice(weights);
        wts
    }
}

/// The grid of a per-expert launch: blocks of [`WARPS`] warps, one warp a row of `rows`, one
/// grid row (y) an expert of `k`.
pub(crate) fn moe_grid(rows: usize, k: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((rows as u32).div_ceil(WARPS), k as u32, 1),
        block_dim: (32 * WARPS, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl Gpu {
    /// Whether [`Gpu::moe_fused`] takes `experts` (each `[gate_proj, up_proj, down_proj]`): 1 to
    /// [`MOE_MAX_K`] experts, all MXFP4 with the shapes of the first.
    pub fn moe_fusable(experts: &[&[GpuMat; 3]]) -> bool {
        let Some(first) = experts.first() else {
            return false;
        };
        experts.len() <= MOE_MAX_K
            && experts.iter().all(|e| {
                e.iter().all(|m| matches!(m.data, GpuMatData::Mxfp4 { .. }))
                    && (0..3).all(|i| e[i].rows == first[i].rows && e[i].cols == first[i].cols)
            })
            && first[0].rows == first[1].rows
            && first[0].cols == first[1].cols
            && first[2].cols == first[0].rows
            && first[2].rows == first[0].cols
    }

    /// The routed part of a MoE block for one token, added to the residual stream:
    /// `x += Σ_k weights[k] · down_k(silu(gate_k x̂) ⊙ up_k x̂) + shared` with the sum from zero
    /// in router order, then `shared` (when given), then the residual add (DeepSeek-V3's MoE;
    /// transformers' `DeepseekV3MoE`). `xn: [hidden]` is the normalized input x̂,
    /// `h: [MOE_MAX_K * inter]` and `y: [MOE_MAX_K * hidden]` scratch, `x: [hidden]`.
    /// Bit-identical to the unfused path (matvec, swiglu, axpy per expert; `ops.cu`).
    ///
    /// # Errors
    /// `Shape` when [`Gpu::moe_fusable`] refuses the experts or a length disagrees; a driver
    /// error.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_fused(
        &self,
        experts: &[&[GpuMat; 3]],
        weights: &[f32],
        xn: &GpuBuf,
        h: &mut GpuBuf,
        y: &mut GpuBuf,
        shared: Option<&GpuBuf>,
        x: &mut GpuBuf,
    ) -> Result<(), CudaError> {
        if !Self::moe_fusable(experts) || weights.len() != experts.len() {
            return Err(CudaError::Shape(format!(
                "moe_fused: {} experts with {} weights (1 to {MOE_MAX_K} MXFP4 experts of one shape wanted)",
                experts.len(),
                weights.len()
            )));
        }
        let (inter, hidden, k) = (experts[0][0].rows, experts[0][0].cols, experts.len());
        if xn.len() != hidden
            || x.len() != hidden
            || h.len() < k * inter
            || y.len() < k * hidden
            || shared.is_some_and(|s| s.len() != hidden)
            || inter > i32::MAX as usize
            || hidden > i32::MAX as usize
        {
            return Err(CudaError::Shape(format!(
                "moe_fused: buffers do not fit {k} experts of [{inter}, {hidden}]"
            )));
        }
        let s = self.stream();
        let (gate, up) = (self.moe_ptrs(experts, 0), self.moe_ptrs(experts, 1));
        let (inter_i, hidden_i, k_i) = (inter as i32, hidden as i32, k as i32);
        let wts = MoeWeights::new(weights);
        let mut b = s.launch_builder(self.k.get("moe_gate_up_mxfp4")?);
        b.arg(&gate).arg(&up).arg(&inter_i).arg(&hidden_i).arg(xn).arg(&mut *h);
        // SAFETY: matches `moe_gate_up_mxfp4` in ops.cu; every expert has [inter, hidden] gate/up
        // (moe_fusable), h holds k * inter.
        unsafe { b.launch(moe_grid(inter, k)) }.ctx("launch moe_gate_up_mxfp4")?;
        self.moe_down(experts, h, y)?;
        let null: u64 = 0;
        let shared_ptr = shared.map(|sh| sh.device_ptr(s));
        let mut b = s.launch_builder(self.k.get("moe_combine")?);
        b.arg(&*y).arg(&wts).arg(&k_i).arg(&hidden_i);
        match &shared_ptr {
            Some((p, _)) => b.arg(p),
            None => b.arg(&null),
        };
        b.arg(x);
        // SAFETY: matches `moe_combine`; shared is [hidden] or null, x is [hidden].
        unsafe { b.launch(LaunchConfig::for_num_elems(hidden as u32)) }.ctx("launch moe_combine")?;
        Ok(())
    }

    /// The device pointers of projection `i` (0 gate, 1 up, 2 down) of `experts`, which
    /// [`Gpu::moe_fusable`] took (all MXFP4). Event tracking is off on the context
    /// (`Gpu::open`), so the cudarc guards of the addresses order nothing and are dropped at once.
    pub(crate) fn moe_ptrs(&self, experts: &[&[GpuMat; 3]], i: usize) -> MoePtrs {
        let s = self.stream();
        let mut p = MoePtrs {
            packed: [0; MOE_MAX_K],
            scales: [0; MOE_MAX_K],
        };
        for (j, e) in experts.iter().enumerate() {
            if let GpuMatData::Mxfp4 { packed, scales } = &e[i].data {
                p.packed[j] = packed.device_ptr(s).0;
                p.scales[j] = scales.device_ptr(s).0;
            }
        }
        p
    }

    /// `y[k] = down_k h[k]` for each of the `k` `experts` (`moe_down_mxfp4` in `ops.cu`):
    /// `h: [k * inter]` in, `y: [k * hidden]` out, with down `[hidden, inter]`. The caller has
    /// checked the experts ([`Gpu::moe_fusable`]), the lengths and that both dimensions fit i32.
    pub(crate) fn moe_down(&self, experts: &[&[GpuMat; 3]], h: &GpuBuf, y: &mut GpuBuf) -> Result<(), CudaError> {
        let (inter, hidden, k) = (experts[0][0].rows, experts[0][0].cols, experts.len());
        let (hidden_i, inter_i) = (hidden as i32, inter as i32);
        let down = self.moe_ptrs(experts, 2);
        let mut b = self.stream().launch_builder(self.k.get("moe_down_mxfp4")?);
        b.arg(&down).arg(&hidden_i).arg(&inter_i).arg(h).arg(y);
        // SAFETY: matches `moe_down_mxfp4` in ops.cu; down is [hidden, inter], y holds k * hidden.
        unsafe { b.launch(moe_grid(hidden, k)) }.ctx("launch moe_down_mxfp4")?;
        Ok(())
    }
}
