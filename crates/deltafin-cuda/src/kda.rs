//! Kimi Linear / Kimi K3 operations (`kernels/kda.cu`): the KDA decode step (short causal conv,
//! per-token activations, delta-rule update), SiTU-GLU, the sigmoid output gate, the
//! attention-residual depth mix, and the routed experts of one token fused with SiTU.
//!
//! The math and its sources are in deltafin-engine `blocks/kda.rs` (transformers'
//! `modeling_kimi_linear.py`, [KDA_*] tags) and `models/kimi_linear.rs` (K3-SPEC §2, §5); each
//! kernel does the CPU reference's operations in the CPU's order (see the top of `kda.cu`).
//!
//! Buffers are addressed as (buffer, element offset) where a kernel works on part of one (a
//! row of the conv history, a slot of the rollback log): the wrappers check the extent and pass
//! the device address. Event tracking is off on the context (`Gpu::open`), so the cudarc guards
//! of those addresses order nothing and are dropped at once; all work is on the one stream.

use cudarc::driver::{DevicePtr, LaunchConfig, PushKernelArg};

use crate::gpu::GpuBuf;
use crate::mat::GpuMat;
use crate::moe::{moe_grid, MoeWeights};
use crate::{CudaError, DriverContext, Gpu, MOE_MAX_K};

/// Threads of a KDA per-head block.
const HEAD_THREADS: u32 = 128;

/// Most bank entries [`Gpu::attn_res_mix`] takes (`alpha[64]` in `kda.cu`).
pub const ATTN_RES_MAX_BANK: usize = 63;

/// The channel-wise log-decay activation of KDA (deltafin-engine `DecayGate`). [KDA_GATE]
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KdaGate {
    /// Kimi Linear: `g = -exp(A_log) · softplus(u)` (softplus threshold 20).
    Softplus,
    /// Kimi K3: `g = lower_bound · σ(exp(A_log) · u)`.
    ScaledSigmoid {
        /// `linear_attn_config.gate_lower_bound` (negative).
        lower_bound: f32,
    },
}

fn shape(what: &str, detail: String) -> CudaError {
    CudaError::Shape(format!("{what}: {detail}"))
}

fn i32_of(what: &str, v: usize) -> Result<i32, CudaError> {
    i32::try_from(v).map_err(|_| shape(what, format!("{v} is too large for the kernel")))
}

/// One thread an element, blocks of 256 (well inside any register budget of these kernels).
fn grid1(len: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((len as u32).div_ceil(256), 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl Gpu {
    /// The device address of `buf[offset..offset + len]`, checked.
    fn addr(&self, what: &str, buf: &GpuBuf, offset: usize, len: usize) -> Result<u64, CudaError> {
        if offset.checked_add(len).is_none_or(|end| end > buf.len()) {
            return Err(shape(
                what,
                format!("{len} elements at {offset} past the end of {}", buf.len()),
            ));
        }
        let (p, _guard) = buf.device_ptr(self.stream());
        Ok(p + (offset * std::mem::size_of::<f32>()) as u64)
    }

    /// SiTU-GLU (K3-SPEC §5, [SITU]): `out[i] = β·tanh(g/β)·σ(g) · β_lin·tanh(u/β_lin)` (the up
    /// branch is `u` when `linear_beta` is `None`); gate, up, out: `[len]`.
    ///
    /// # Errors
    /// `Shape` when lengths disagree; a driver error.
    pub fn situ_glu(
        &self,
        gate: &GpuBuf,
        up: &GpuBuf,
        beta: f32,
        linear_beta: Option<f32>,
        out: &mut GpuBuf,
    ) -> Result<(), CudaError> {
        let len = gate.len();
        if up.len() != len || out.len() != len {
            return Err(shape(
                "situ_glu",
                format!("gate {len}, up {}, out {} elements", up.len(), out.len()),
            ));
        }
        if len == 0 {
            return Ok(());
        }
        let (len_i, lb, has) = (
            i32_of("situ_glu", len)?,
            linear_beta.unwrap_or(1.0),
            linear_beta.is_some() as i32,
        );
        let mut b = self.stream().launch_builder(self.k.get("situ_glu")?);
        b.arg(gate).arg(up).arg(&len_i).arg(&beta).arg(&lb).arg(&has).arg(out);
        // SAFETY: matches `situ_glu` in kda.cu; lengths checked above.
        unsafe { b.launch(grid1(len)) }.ctx("launch situ_glu")?;
        Ok(())
    }

    /// `o[i] *= σ(g[i])` (KDA's gated output, K3's MLA output gate); both `[len]`.
    ///
    /// # Errors
    /// `Shape` when lengths disagree; a driver error.
    pub fn sigmoid_mul(&self, o: &mut GpuBuf, g: &GpuBuf) -> Result<(), CudaError> {
        let len = o.len();
        if g.len() != len {
            return Err(shape("sigmoid_mul", format!("o {len}, g {} elements", g.len())));
        }
        if len == 0 {
            return Ok(());
        }
        let len_i = i32_of("sigmoid_mul", len)?;
        let mut b = self.stream().launch_builder(self.k.get("sigmoid_mul")?);
        b.arg(o).arg(g).arg(&len_i);
        // SAFETY: matches `sigmoid_mul` in kda.cu; lengths checked above.
        unsafe { b.launch(grid1(len)) }.ctx("launch sigmoid_mul")?;
        Ok(())
    }

    /// KDA short causal convolution of one token over all `3P` channels, then SiLU
    /// [KDA_CONV]: the `K - 1` previous rows are `hist[row0 * 3P ..]` (`3P` floats a row, oldest
    /// first); the token's row `[qp | kp | vp]` is written after them (row `row0 + K - 1`), and
    /// `out: [3P] = silu(Σ_j w[c, j] · row_j[c])`. `wq`, `wk`, `wv`: `[P, K]`; `qp`, `kp`, `vp`: `[P]`.
    ///
    /// # Errors
    /// `Shape` when an operand does not fit; a driver error.
    #[allow(clippy::too_many_arguments)]
    pub fn kda_conv_step(
        &self,
        hist: &mut GpuBuf,
        row0: usize,
        [qp, kp, vp]: [&GpuBuf; 3],
        [wq, wk, wv]: [&GpuBuf; 3],
        kernel: usize,
        out: &mut GpuBuf,
    ) -> Result<(), CudaError> {
        let p = qp.len();
        let ok = p > 0
            && kernel > 0
            && kp.len() == p
            && vp.len() == p
            && [wq, wk, wv].iter().all(|w| w.len() == p * kernel)
            && out.len() == 3 * p;
        if !ok {
            return Err(shape(
                "kda_conv_step",
                format!(
                    "inputs of {} / {} / {}, weights of {} (P·K = {}·{kernel}), out {}",
                    p,
                    kp.len(),
                    vp.len(),
                    wq.len(),
                    p,
                    out.len()
                ),
            ));
        }
        let h = self.addr("kda_conv_step history", hist, row0 * 3 * p, kernel * 3 * p)?;
        let (p_i, k_i) = (i32_of("kda_conv_step", 3 * p)? / 3, i32_of("kda_conv_step", kernel)?);
        let mut b = self.stream().launch_builder(self.k.get("kda_conv_step")?);
        b.arg(&h)
            .arg(qp)
            .arg(kp)
            .arg(vp)
            .arg(wq)
            .arg(wk)
            .arg(wv)
            .arg(&p_i)
            .arg(&k_i)
            .arg(out);
        // SAFETY: matches `kda_conv_step` in kda.cu; the history range and every length are
        // checked above.
        unsafe { b.launch(grid1(3 * p)) }.ctx("launch kda_conv_step")?;
        Ok(())
    }

    /// KDA per-token activations for every head [KDA_L2NORM, KDA_GATE]: from `conv: [3P]`
    /// (`kda_conv_step`'s output), `u: [P]` (`f_b_proj(f_a_proj(x))`) and `braw: [nh]`
    /// (`b_proj(x)`): `q_out: [P] = l2norm(q_h)·q_scale`, and the token's log row at element
    /// offsets `slot·P` / `slot·nh` of `k_out`, `v_out`, `g_out` (`[·, P]`) and `beta_out`
    /// (`[·, nh]`): `k = l2norm(k_h)`, `v`, `g = gate(A_log[h], u + dt_bias)`, `β = σ(braw)`.
    /// `a_log: [nh]`, `dt_bias: [P]`; `head_dim` = `d`, `P = nh · d`.
    ///
    /// # Errors
    /// `Shape` when an operand does not fit; a driver error.
    #[allow(clippy::too_many_arguments)]
    pub fn kda_prepare(
        &self,
        conv: &GpuBuf,
        u: &GpuBuf,
        braw: &GpuBuf,
        a_log: &GpuBuf,
        dt_bias: &GpuBuf,
        head_dim: usize,
        gate: KdaGate,
        q_scale: f32,
        q_out: &mut GpuBuf,
        [k_out, v_out, g_out, beta_out]: [&mut GpuBuf; 4],
        slot: usize,
    ) -> Result<(), CudaError> {
        let nh = a_log.len();
        let p = nh * head_dim;
        let ok =
            p > 0 && conv.len() == 3 * p && u.len() == p && braw.len() == nh && dt_bias.len() == p && q_out.len() == p;
        if !ok {
            return Err(shape(
                "kda_prepare",
                format!(
                    "conv {}, u {}, b {}, dt_bias {}, q {} for {nh} heads of {head_dim}",
                    conv.len(),
                    u.len(),
                    braw.len(),
                    dt_bias.len(),
                    q_out.len()
                ),
            ));
        }
        let k = self.addr("kda_prepare k log", k_out, slot * p, p)?;
        let v = self.addr("kda_prepare v log", v_out, slot * p, p)?;
        let g = self.addr("kda_prepare g log", g_out, slot * p, p)?;
        let bt = self.addr("kda_prepare beta log", beta_out, slot * nh, nh)?;
        let (kind, lb) = match gate {
            KdaGate::Softplus => (0i32, 0f32),
            KdaGate::ScaledSigmoid { lower_bound } => (1, lower_bound),
        };
        let (p_i, d_i) = (i32_of("kda_prepare", p)?, i32_of("kda_prepare", head_dim)?);
        let cfg = LaunchConfig {
            grid_dim: (nh as u32, 1, 1),
            block_dim: (HEAD_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream().launch_builder(self.k.get("kda_prepare")?);
        b.arg(conv).arg(u).arg(braw).arg(a_log).arg(dt_bias);
        b.arg(&p_i).arg(&d_i).arg(&kind).arg(&lb).arg(&q_scale).arg(q_out);
        b.arg(&k).arg(&v).arg(&g).arg(&bt);
        // SAFETY: matches `kda_prepare` in kda.cu; every extent checked above.
        unsafe { b.launch(cfg) }.ctx("launch kda_prepare")?;
        Ok(())
    }

    /// One KDA delta-rule update of every head [KDA_RECURRENCE]: the state
    /// `[nh, d (key), d (value)]` is read from `src` (or `dst` itself when `None`) and written to
    /// `dst`; the token's `k`, `v`, `g` (`[P]`) and `β` (`[nh]`) are log row `slot` of `log`
    /// (`[k, v, g, beta]` as [`Gpu::kda_prepare`] wrote them). With `q: [P]` and `o: [P]`, also
    /// `o_h = S_h^T q_h`; without, an update only (a rollback replay).
    ///
    /// # Errors
    /// `Shape` when an operand does not fit; a driver error.
    #[allow(clippy::too_many_arguments)]
    pub fn kda_delta(
        &self,
        src: Option<&GpuBuf>,
        dst: &mut GpuBuf,
        head_dim: usize,
        [k, v, g, beta]: [&GpuBuf; 4],
        slot: usize,
        qo: Option<(&GpuBuf, &mut GpuBuf)>,
    ) -> Result<(), CudaError> {
        let d = head_dim;
        let nh = if d == 0 { 0 } else { dst.len() / (d * d) };
        let p = nh * d;
        if p == 0 || dst.len() != nh * d * d || src.is_some_and(|s| s.len() != dst.len()) {
            return Err(shape(
                "kda_delta",
                format!("a state of {} elements for heads of {d}", dst.len()),
            ));
        }
        let kp = self.addr("kda_delta k", k, slot * p, p)?;
        let vp = self.addr("kda_delta v", v, slot * p, p)?;
        let gp = self.addr("kda_delta g", g, slot * p, p)?;
        let bp = self.addr("kda_delta beta", beta, slot * nh, nh)?;
        let dp = self.addr("kda_delta state", dst, 0, dst.len())?;
        let sp = match src {
            Some(s) => self.addr("kda_delta state", s, 0, s.len())?,
            None => dp,
        };
        let (qp, op) = match qo {
            Some((q, o)) => (self.addr("kda_delta q", q, 0, p)?, self.addr("kda_delta o", o, 0, p)?),
            None => (0u64, 0u64),
        };
        let d_i = i32_of("kda_delta", d)?;
        let cfg = LaunchConfig {
            grid_dim: (nh as u32, 1, 1),
            block_dim: (HEAD_THREADS, 1, 1),
            shared_mem_bytes: (3 * d * 4) as u32,
        };
        let mut b = self.stream().launch_builder(self.k.get("kda_delta")?);
        b.arg(&sp)
            .arg(&dp)
            .arg(&qp)
            .arg(&kp)
            .arg(&vp)
            .arg(&gp)
            .arg(&bp)
            .arg(&d_i)
            .arg(&op);
        // SAFETY: matches `kda_delta` in kda.cu; every range checked above (q and o null
        // together).
        unsafe { b.launch(cfg) }.ctx("launch kda_delta")?;
        Ok(())
    }

    /// Attention-residual depth mix (K3-SPEC §2, [ATTN_RES]) of the first `n_bank` rows of
    /// `bank: [≥ n_bank, dim]` and `cur: [dim]` with the fused score vector `w: [dim]`
    /// (`norm ⊙ proj`): scores `<v, w> / rms(v)`, softmax over the `n_bank + 1` scores, result
    /// `Σ α_k v_k` over the raw vectors into `out: [dim]`.
    ///
    /// # Errors
    /// `Shape` when lengths disagree or `n_bank` exceeds [`ATTN_RES_MAX_BANK`]; a driver error.
    pub fn attn_res_mix(
        &self,
        bank: &GpuBuf,
        n_bank: usize,
        cur: &GpuBuf,
        w: &GpuBuf,
        eps: f32,
        out: &mut GpuBuf,
    ) -> Result<(), CudaError> {
        let dim = w.len();
        if dim == 0 || cur.len() != dim || out.len() != dim || bank.len() < n_bank * dim || n_bank > ATTN_RES_MAX_BANK {
            return Err(shape(
                "attn_res_mix",
                format!(
                    "{n_bank} bank rows in {} elements, cur {}, out {}, w {dim} (at most {ATTN_RES_MAX_BANK} rows)",
                    bank.len(),
                    cur.len(),
                    out.len()
                ),
            ));
        }
        let (n_i, dim_i) = (n_bank as i32, i32_of("attn_res_mix", dim)?);
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream().launch_builder(self.k.get("attn_res_mix")?);
        b.arg(bank).arg(&n_i).arg(cur).arg(w).arg(&dim_i).arg(&eps).arg(out);
        // SAFETY: matches `attn_res_mix` in kda.cu; lengths checked above.
        unsafe { b.launch(cfg) }.ctx("launch attn_res_mix")?;
        Ok(())
    }

    /// The routed experts of one token with SiTU-GLU, fused (K3-SPEC §5): `y[k] =
    /// down_k(situ(gate_k x, up_k x))` for each expert (`moe_gate_up_situ_mxfp4` then `ops.cu`'s
    /// `moe_down_mxfp4`), then `acc = Σ_k weights[k] · y[k]` from zero in router order
    /// (`moe_combine` into a zeroed `acc`, no shared part). `x: [cols]`, `h: [MOE_MAX_K * inter]`
    /// and `y: [MOE_MAX_K * cols]` scratch, `acc: [cols]`. Bit-identical to the unfused path
    /// (matvec, [`Gpu::situ_glu`], matvec, axpy per expert into a zeroed `acc`).
    ///
    /// # Errors
    /// `Shape` when [`Gpu::moe_fusable`] refuses the experts or a length disagrees; a driver
    /// error.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_situ_fused(
        &self,
        experts: &[&[GpuMat; 3]],
        weights: &[f32],
        (beta, linear_beta): (f32, Option<f32>),
        x: &GpuBuf,
        h: &mut GpuBuf,
        y: &mut GpuBuf,
        acc: &mut GpuBuf,
    ) -> Result<(), CudaError> {
        if !Self::moe_fusable(experts) || weights.len() != experts.len() {
            return Err(shape(
                "moe_situ_fused",
                format!(
                    "{} experts with {} weights (1 to {MOE_MAX_K} MXFP4 experts of one shape wanted)",
                    experts.len(),
                    weights.len()
                ),
            ));
        }
        let (inter, cols, k) = (experts[0][0].rows, experts[0][0].cols, experts.len());
        if x.len() != cols || acc.len() != cols || h.len() < k * inter || y.len() < k * cols {
            return Err(shape(
                "moe_situ_fused",
                format!("buffers do not fit {k} experts of [{inter}, {cols}]"),
            ));
        }
        let s = self.stream();
        let (gate, up) = (self.moe_ptrs(experts, 0), self.moe_ptrs(experts, 1));
        let (inter_i, cols_i, k_i) = (
            i32_of("moe_situ_fused", inter)?,
            i32_of("moe_situ_fused", cols)?,
            k as i32,
        );
        let (lb, has) = (linear_beta.unwrap_or(1.0), linear_beta.is_some() as i32);
        let wts = MoeWeights::new(weights);
        let mut b = s.launch_builder(self.k.get("moe_gate_up_situ_mxfp4")?);
        b.arg(&gate).arg(&up).arg(&inter_i).arg(&cols_i).arg(x);
        b.arg(&beta).arg(&lb).arg(&has).arg(&mut *h);
        // SAFETY: matches `moe_gate_up_situ_mxfp4` in kda.cu; every expert has [inter, cols]
        // gate/up (moe_fusable), h holds k * inter.
        unsafe { b.launch(moe_grid(inter, k)) }.ctx("launch moe_gate_up_situ_mxfp4")?;
        self.moe_down(experts, h, y)?;
        self.fill_zero(acc)?;
        let null: u64 = 0;
        let mut b = s.launch_builder(self.k.get("moe_combine")?);
        b.arg(&*y).arg(&wts).arg(&k_i).arg(&cols_i).arg(&null).arg(acc);
        // SAFETY: matches `moe_combine` in ops.cu; shared is null, acc is [cols].
        unsafe { b.launch(grid1(cols)) }.ctx("launch moe_combine")?;
        Ok(())
    }
}
