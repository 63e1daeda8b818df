//! Kimi Linear and Kimi K3 on a CUDA device: the forward pass of `kimi_linear.rs`, one token at a
//! time, with the backbone resident in GPU memory, every per-sequence state on the GPU (KDA
//! recurrent states, short-conv histories and their rollback log, the MLA latent caches; K3's
//! attention-residual bank is an activation of the current position, a work buffer), and the
//! routed experts read through the same expert store and computed on the GPU.
//!
//! Per layer, as the CPU file (K3-SPEC §1–2; without attention residuals `a_in = S = h_l`):
//! ```text
//! a_in = mix(B, h_l; w_attn_l)                   # attn_res_mix kernel              [ATTN_RES]
//! if l % attn_res_block_size == 0: B.push(h_l); S = 0   else: S = h_l
//! S   += mixer(input_layernorm(a_in))            # KDA (kda_* kernels) or NoPE MLA (mla_decode)
//! f_in = mix(B, S; w_mlp_l)
//! h_{l+1} = S + ffn(post_attention_layernorm(f_in))   # dense GLU, or (Latent)MoE
//! logits = lm_head(norm(mix(B, h_L; w_out)))
//! ```
//! KDA decode per token ([KDA_*] tags in `blocks/kda.rs`): q/k/v projections, `kda_conv_step`
//! (depthwise causal conv + SiLU, the token's row appended to the device conv history),
//! `f_a`/`f_b`/`b` projections, `kda_prepare` (L2 norms, q scale, decay gate, β), `kda_delta`
//! (the delta rule, one thread per value column in the CPU's order), then the gated per-head
//! RMSNorm and `o_proj`.
//!
//! What stays on the host: the token's embedding row (decoded from the backbone as the CPU
//! does), the router's choice (`moe::route` on the logits the GPU computed, the CPU's code).
//!
//! Numerics: f32 everywhere, fixed reduction orders, so output is deterministic run to run and
//! agrees with the CPU path to f32 rounding (greedy ids equal, logits within relative L2 1e-5 on
//! the fixtures: `crates/deltafin/tests/cuda_fixtures.rs`). Only the reference numerics
//! ([`Numerics::Reference`](crate::model::Numerics)) run here; llama.cpp's `Q8_0` emulation is
//! refused.
//!
//! Routed experts: the GPU expert cache ([`crate::gpu_experts`]) first, misses through the
//! expert store; MXFP4 experts of one shape run fused (three launches for all of a token's
//! experts, SiTU or SwiGLU), other layouts expert by expert with the same bits.
//!
//! Rollback (speculative decoding): as the CPU's `KdaState`, each KDA layer keeps the recurrent
//! state at the last commit in a second buffer, and logs every token since (k, v, g, β and its
//! conv input row) up to [`KDA_ROLLBACK_WINDOW`] tokens; rolling back replays the logged
//! updates from the committed state, which gives the bits of the original updates.
//!
//! First version, stated plainly: a prompt chunk ([`CausalLm::forward_batch`]) runs token at a
//! time (every position exactly the decode step: no chunked KDA, no expert-major MoE yet), and
//! self-drafting is not on the GPU.

use std::sync::{Arc, Mutex};

use deltafin_cuda::{CudaError, Gpu, GpuBuf, GpuMat, KdaGate, MlaShape, ATTN_RES_MAX_BANK, MOE_MAX_K};
use deltafin_format::kimi_linear::{GluActivation, MixerKind};
use deltafin_format::{ModelConfig, ModelDir};

use crate::device::GpuOptions;
use crate::experts::StoreOptions;
use crate::gpu_experts::{GpuCacheStats, GpuExpert, GpuExpertCache};
use crate::model::{token_at_a_time, BatchOutput, DecodeState, FamilyModel, LayerRoutes, RoutedExperts};
use crate::models::gpu_fetch::{
    cuda, fetch_gpu_experts, gpu_expert_budget, lock, open_gpu_for, preload_in_file_order, Upload,
};
use crate::models::kimi_linear::{KimiLinear, LayerNames, KDA_ROLLBACK_WINDOW, LATENT_NORM_EPS};
use crate::models::mla_gpu::{MlaGpu, QProj};
use crate::moe::{route, RouterConfig, Routing};
use crate::EngineError;

/// KDA output gate weights.
enum OutGate {
    /// K3 `g_proj` `[P, hidden]`.
    Full(GpuMat),
    /// Kimi Linear `g_a_proj` `[d, hidden]`, `g_b_proj` `[P, d]`.
    LowRank(GpuMat, GpuMat),
}

/// One KDA layer's weights on the device (checkpoint names).
struct KdaGpu {
    q_proj: GpuMat,
    k_proj: GpuMat,
    v_proj: GpuMat,
    /// `[P, K]` each.
    conv: [GpuBuf; 3],
    f_a_proj: GpuMat,
    f_b_proj: GpuMat,
    /// `[nh]`, `[P]`.
    a_log: GpuBuf,
    dt_bias: GpuBuf,
    b_proj: GpuMat,
    gate: OutGate,
    /// `[d]`.
    o_norm: GpuBuf,
    o_proj: GpuMat,
}

enum Mixer {
    Kda(Box<KdaGpu>),
    Mla(Box<MlaGpu>),
}

// One per layer, built once and never moved on the decode path: boxing buys nothing.
#[allow(clippy::large_enum_variant)]
enum Ffn {
    /// `[gate_proj, up_proj, down_proj]`.
    Dense([GpuMat; 3]),
    Moe {
        router: GpuMat,
        /// LatentMoE: `routed_expert_down_proj`, `routed_expert_norm` (when
        /// `latent_moe_use_norm`), `routed_expert_up_proj`.
        latent: Option<(GpuMat, Option<GpuBuf>, GpuMat)>,
        shared: Option<[GpuMat; 3]>,
    },
}

struct GpuLayer {
    input_layernorm: GpuBuf,
    post_attention_layernorm: GpuBuf,
    /// Fused attention-residual score vectors (pre-mixer, pre-FFN), K3 only.
    res: Option<(GpuBuf, GpuBuf)>,
    mixer: Mixer,
    ffn: Ffn,
}

/// Per-sequence state of one layer on the device (one per layer, built once: unboxed).
#[allow(clippy::large_enum_variant)]
enum LayerState {
    Kda {
        /// Recurrent state `[nh, d, d]`: the current one and the one at the last commit (the
        /// same buffer when nothing was added since).
        rec: [GpuBuf; 2],
        /// Conv input rows `[q' | k' | v']` (`3P` each): `K - 1` rows before the commit point,
        /// then one per token since; room for `K - 1 + window` rows.
        conv: GpuBuf,
        /// `[K - 1, 3P]` scratch for moving the last rows to the front at a commit.
        scratch: GpuBuf,
        /// Per token since the commit: `k`, `v`, `g` `[window, P]`, `β` `[window, nh]`.
        log: [GpuBuf; 4],
    },
    Mla {
        /// `[capacity, kv_lora_rank]` normalised latents (empty until the first token).
        c_kv: GpuBuf,
        /// `[capacity, qk_rope_head_dim]` un-rotated shared keys.
        k_pe: GpuBuf,
    },
}

/// The decode state of a [`KimiLinearCuda`] sequence (all on the device).
pub struct KimiGpuState {
    gpu: Arc<Gpu>,
    layers: Vec<LayerState>,
    len: usize,
    /// Length at the last commit; rollback reaches back to it.
    base_len: usize,
    /// Index (0 or 1) of the recurrent buffer holding the state at `len`, and at `base_len`.
    cur: usize,
    base: usize,
    window: usize,
    kernel: usize,
    row: usize,
    kvl: usize,
    rope: usize,
    mla_capacity: usize,
    /// A commit that failed on the device (reported by the next forward).
    broken: Option<String>,
}

impl KimiGpuState {
    /// Grows the MLA caches to hold `n` positions (doubling).
    fn reserve(&mut self, n: usize) -> Result<(), CudaError> {
        if n <= self.mla_capacity {
            return Ok(());
        }
        let cap = n.max(2 * self.mla_capacity).max(64);
        let (len, kvl, rope) = (self.len, self.kvl, self.rope);
        for s in &mut self.layers {
            if let LayerState::Mla { c_kv, k_pe } = s {
                for (buf, width) in [(c_kv, kvl), (k_pe, rope)] {
                    let mut nb = self.gpu.zeros(cap * width)?;
                    if len > 0 {
                        let old = buf.slice(..len * width);
                        let mut dst = nb.slice_mut(..len * width);
                        self.gpu
                            .stream()
                            .memcpy_dtod(&old, &mut dst)
                            .map_err(|e| CudaError::Shape(format!("MLA cache growth: {e}")))?;
                    }
                    *buf = nb;
                }
            }
        }
        self.mla_capacity = cap;
        Ok(())
    }

    /// Accepts every token so far (see [`DecodeState::commit`]): the conv history's last
    /// `K - 1` rows move to the front and the current recurrent buffer becomes the committed one.
    fn try_commit(&mut self) -> Result<(), CudaError> {
        let m = self.len - self.base_len;
        let keep = (self.kernel - 1) * self.row;
        if m > 0 && keep > 0 {
            for s in &mut self.layers {
                if let LayerState::Kda { conv, scratch, .. } = s {
                    let src = conv.slice(m * self.row..m * self.row + keep);
                    self.gpu
                        .stream()
                        .memcpy_dtod(&src, scratch)
                        .map_err(|e| CudaError::Shape(format!("KDA commit: {e}")))?;
                    let mut dst = conv.slice_mut(..keep);
                    self.gpu
                        .stream()
                        .memcpy_dtod(&*scratch, &mut dst)
                        .map_err(|e| CudaError::Shape(format!("KDA commit: {e}")))?;
                }
            }
        }
        self.base = self.cur;
        self.base_len = self.len;
        Ok(())
    }

    /// `(source buffer or None for in place, destination buffer)` of the next recurrent update,
    /// and the buffer that holds the state after it (the CPU's `update_buffers`).
    fn update_buffers(&self) -> (Option<usize>, usize) {
        if self.cur == self.base {
            (Some(self.base), 1 - self.base)
        } else {
            (None, self.cur)
        }
    }
}

impl DecodeState for KimiGpuState {
    fn len(&self) -> usize {
        self.len
    }

    /// KDA states roll back through the model only ([`CausalLm::rollback`]); a bare truncate
    /// succeeds only when nothing is dropped (as the CPU state).
    fn truncate(&mut self, len: usize) -> bool {
        len >= self.len
    }

    fn commit(&mut self) {
        if let Err(e) = self.try_commit() {
            self.broken = Some(e.to_string());
        }
    }

    fn bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|s| match s {
                LayerState::Kda {
                    rec,
                    conv,
                    scratch,
                    log,
                } => {
                    rec.iter().map(|b| b.len()).sum::<usize>()
                        + conv.len()
                        + scratch.len()
                        + log.iter().map(|b| b.len()).sum::<usize>()
                }
                LayerState::Mla { c_kv, k_pe } => c_kv.len() + k_pe.len(),
            })
            .sum::<usize>()
            * 4
    }

    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

/// Device buffers of one token's forward pass, allocated once at load.
struct Work {
    /// The running sum `S` / residual stream `[hidden]`.
    x: GpuBuf,
    /// Mixer and FFN inputs before their norms (attention residuals) `[hidden]`.
    mixed: GpuBuf,
    /// A normalised input `[hidden]`.
    xn: GpuBuf,
    /// A block's output `[hidden]`.
    out: GpuBuf,
    /// The attention-residual bank of this position `[max_entries, hidden]`.
    bank: GpuBuf,
    // KDA: projections `[P]`, conv output `[3P]`, f_a `[d]`, u `[P]`, b `[nh]`, q `[P]`,
    // output `[P]`, its normalised form `[P]`, the gate `[P]` and the low-rank gate's `[d]`.
    kda_p: [GpuBuf; 3],
    kda_conv: GpuBuf,
    kda_fa: GpuBuf,
    kda_u: GpuBuf,
    kda_b: GpuBuf,
    kda_q: GpuBuf,
    kda_o: GpuBuf,
    kda_on: GpuBuf,
    kda_gate: GpuBuf,
    kda_ga: GpuBuf,
    // MLA.
    q: GpuBuf,
    qa: GpuBuf,
    qan: GpuBuf,
    ckv: GpuBuf,
    latent: GpuBuf,
    k_pe: GpuBuf,
    heads: GpuBuf,
    mla_gate: GpuBuf,
    scores: GpuBuf,
    // FFN: dense `[intermediate]`, shared `[n_shared * moe_intermediate]`, one expert
    // `[moe_intermediate]`.
    dense: [GpuBuf; 3],
    shared_t: [GpuBuf; 3],
    shared_out: GpuBuf,
    expert_t: [GpuBuf; 3],
    /// One expert's output, the routed sum and its norm `[expert width]`; the latent input.
    eout: GpuBuf,
    acc: GpuBuf,
    accn: GpuBuf,
    xl: GpuBuf,
    /// Fused experts' scratch `[MOE_MAX_K, moe_intermediate]`, `[MOE_MAX_K, expert width]`.
    moe_h: GpuBuf,
    moe_y: GpuBuf,
    router_logits: GpuBuf,
    router_host: Vec<f32>,
    logits: GpuBuf,
}

/// Kimi Linear / Kimi K3 with its forward pass on a CUDA device (see the module docs).
pub struct KimiLinearCuda {
    cpu: KimiLinear,
    gpu: Arc<Gpu>,
    layers: Vec<GpuLayer>,
    out_res: Option<GpuBuf>,
    norm: GpuBuf,
    lm_head: GpuMat,
    gate: KdaGate,
    work: Mutex<Work>,
    experts: Mutex<GpuExpertCache>,
}

/// Why this configuration cannot run on the GPU path, or `None` when it can.
fn unsupported(cpu: &KimiLinear) -> Option<String> {
    let c = &cpu.cfg;
    if c.mixers.contains(&MixerKind::Mla) && c.qk_rope_head_dim == 0 {
        return Some("kimi_linear on CUDA: qk_rope_head_dim 0 is not supported".into());
    }
    if let Some(bs) = c.attn_res_block_size {
        let entries = c.num_hidden_layers.div_ceil(bs.max(1));
        if entries > ATTN_RES_MAX_BANK {
            return Some(format!(
                "kimi_linear on CUDA: {entries} attention-residual blocks (at most {ATTN_RES_MAX_BANK})"
            ));
        }
    }
    None
}

impl KimiLinearCuda {
    /// Loads the model as [`KimiLinear::load_with`] does, then opens `cuda:ordinal`, uploads the
    /// backbone and sizes the GPU expert cache: `gpu_budget` bytes, or by default what the device
    /// has free after the backbone less [`GPU_MARGIN_BYTES`](crate::models::gpu_fetch::GPU_MARGIN_BYTES) (which also covers the per-sequence
    /// state: KDA states and logs, MLA caches).
    ///
    /// Errors: everything `KimiLinear::load_with` refuses; a configuration the GPU path does not
    /// take (one line naming it); no such device; a backbone larger than the device memory (both
    /// sizes named); a `gpu_budget` larger than the free memory (both named); a driver or NVRTC
    /// failure.
    pub fn load_with(
        dir: &ModelDir,
        opts: StoreOptions,
        ordinal: usize,
        gpu_opts: GpuOptions,
    ) -> Result<Self, EngineError> {
        let cpu = KimiLinear::load_with(dir, opts)?;
        if let Some(why) = unsupported(&cpu) {
            return Err(EngineError::Invalid(why));
        }
        let backbone = cpu.backbone_bytes() as u64;
        let gpu = open_gpu_for(ordinal, backbone, &cpu.routed.store)?;
        let c = cpu.cfg.clone();
        let upl = Upload {
            gpu: &gpu,
            backbone: &cpu.backbone,
        };
        let (up, vec) = (|name: &str| upl.mat(name), |name: &str| upl.vec(name));
        let flat =
            |name: &str| -> Result<GpuBuf, EngineError> { gpu.upload(cpu.backbone.f32_tensor(name)?.0).map_err(cuda) };
        let fused = |scores: &[f32]| gpu.upload(scores).map_err(cuda);
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for l in 0..c.num_hidden_layers {
            let n: &LayerNames = &cpu.names[l];
            let mixer = match c.mixers[l] {
                MixerKind::Kda => {
                    let k = &n.kda;
                    Mixer::Kda(Box::new(KdaGpu {
                        q_proj: up(&k.q_proj)?,
                        k_proj: up(&k.k_proj)?,
                        v_proj: up(&k.v_proj)?,
                        conv: [flat(&k.q_conv1d)?, flat(&k.k_conv1d)?, flat(&k.v_conv1d)?],
                        f_a_proj: up(&k.f_a_proj)?,
                        f_b_proj: up(&k.f_b_proj)?,
                        a_log: flat(&k.a_log)?,
                        dt_bias: flat(&k.dt_bias)?,
                        b_proj: up(&k.b_proj)?,
                        gate: if c.use_full_rank_gate {
                            OutGate::Full(up(&k.g_proj)?)
                        } else {
                            OutGate::LowRank(up(&k.g_a_proj)?, up(&k.g_b_proj)?)
                        },
                        o_norm: vec(&k.o_norm)?,
                        o_proj: up(&k.o_proj)?,
                    }))
                }
                MixerKind::Mla => {
                    let crate::models::kimi_linear::Mixer::Mla(t) = &cpu.w.layers[l].self_attn else {
                        return Err(EngineError::Invalid(format!(
                            "layer {l}: the CPU model has no MLA here"
                        )));
                    };
                    Mixer::Mla(Box::new(MlaGpu::upload(&upl, t, c.kv_lora_rank, c.qk_rope_head_dim)?))
                }
            };
            let ffn = if c.is_moe_layer(l) {
                Ffn::Moe {
                    router: up(&n.router)?,
                    latent: match c.routed_expert_hidden_size {
                        Some(_) => Some((
                            up(&n.latent_down)?,
                            if c.latent_moe_use_norm {
                                Some(vec(&n.latent_norm)?)
                            } else {
                                None
                            },
                            up(&n.latent_up)?,
                        )),
                        None => None,
                    },
                    shared: if c.num_shared_experts > 0 {
                        Some([
                            up(&n.shared_experts.gate_proj)?,
                            up(&n.shared_experts.up_proj)?,
                            up(&n.shared_experts.down_proj)?,
                        ])
                    } else {
                        None
                    },
                }
            } else {
                Ffn::Dense([up(&n.mlp.gate_proj)?, up(&n.mlp.up_proj)?, up(&n.mlp.down_proj)?])
            };
            let res = match cpu.res_scores.get(l) {
                Some((a, m)) if c.attn_res_block_size.is_some() => Some((fused(a)?, fused(m)?)),
                _ => None,
            };
            layers.push(GpuLayer {
                input_layernorm: vec(&n.input_layernorm)?,
                post_attention_layernorm: vec(&n.post_attention_layernorm)?,
                res,
                mixer,
                ffn,
            });
        }
        let out_res = match c.attn_res_block_size {
            Some(_) => Some(fused(&cpu.out_res_score)?),
            None => None,
        };
        let norm = vec("model.norm.weight")?;
        let lm_head = up("lm_head.weight")?;
        let gate = match c.gate_lower_bound {
            Some(lower_bound) => KdaGate::ScaledSigmoid { lower_bound },
            None => KdaGate::Softplus,
        };
        let z = |n: usize| gpu.zeros(n.max(1)).map_err(cuda);
        let h = c.hidden_size;
        let (p, d, nh) = (c.kda_width(), c.kda_head_dim, c.kda_num_heads);
        let ew = c.expert_width();
        let shared_inter = c.num_shared_experts * c.moe_intermediate_size;
        let bank_rows = c
            .attn_res_block_size
            .map_or(0, |bs| c.num_hidden_layers.div_ceil(bs.max(1)));
        let work = Work {
            x: z(h)?,
            mixed: z(h)?,
            xn: z(h)?,
            out: z(h)?,
            bank: z(bank_rows * h)?,
            kda_p: [z(p)?, z(p)?, z(p)?],
            kda_conv: z(3 * p)?,
            kda_fa: z(d)?,
            kda_u: z(p)?,
            kda_b: z(nh)?,
            kda_q: z(p)?,
            kda_o: z(p)?,
            kda_on: z(p)?,
            kda_gate: z(p)?,
            kda_ga: z(d)?,
            q: z(c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim))?,
            qa: z(c.q_lora_rank.unwrap_or(1))?,
            qan: z(c.q_lora_rank.unwrap_or(1))?,
            ckv: z(c.kv_lora_rank)?,
            latent: z(c.kv_lora_rank)?,
            k_pe: z(c.qk_rope_head_dim)?,
            heads: z(c.num_attention_heads * c.v_head_dim)?,
            mla_gate: z(c.num_attention_heads * c.v_head_dim)?,
            scores: z(c.num_attention_heads * 64)?,
            dense: [
                z(c.intermediate_size)?,
                z(c.intermediate_size)?,
                z(c.intermediate_size)?,
            ],
            shared_t: [z(shared_inter)?, z(shared_inter)?, z(shared_inter)?],
            shared_out: z(h)?,
            expert_t: [
                z(c.moe_intermediate_size)?,
                z(c.moe_intermediate_size)?,
                z(c.moe_intermediate_size)?,
            ],
            eout: z(ew)?,
            acc: z(ew)?,
            accn: z(ew)?,
            xl: z(ew)?,
            moe_h: z(MOE_MAX_K * c.moe_intermediate_size)?,
            moe_y: z(MOE_MAX_K * ew)?,
            router_logits: z(c.num_experts)?,
            router_host: vec![0.0; c.num_experts.max(1)],
            logits: z(lm_head.rows)?,
        };
        let budget = gpu_expert_budget(&gpu, ordinal, gpu_opts.budget, backbone)?;
        let model = Self {
            cpu,
            gpu,
            layers,
            out_res,
            norm,
            lm_head,
            gate,
            work: Mutex::new(work),
            experts: Mutex::new(GpuExpertCache::new(budget)),
        };
        if gpu_opts.preload {
            model.preload()?;
            if let Ok(mut c) = model.experts.lock() {
                c.clear_counters();
            }
        }
        Ok(model)
    }

    /// Reads routed experts into the GPU expert cache in file order (layer by layer, ascending
    /// id), 32 records per store fetch, until the next one would not fit in the budget.
    /// Returns the number of experts made resident.
    ///
    /// Errors: expert read or checksum failures; a driver error.
    pub fn preload(&self) -> Result<usize, EngineError> {
        let c = &self.cpu.cfg;
        let record = self.cpu.routed.store.record_bytes();
        let layers = (0..c.num_hidden_layers)
            .filter(|&l| c.is_moe_layer(l))
            .map(|l| (l, c.num_experts));
        let room = || lock(&self.experts, "GPU expert cache").map(|c| c.stats().records_free(record));
        preload_in_file_order(layers, room, |l, ids| Ok(self.experts_of(l, ids)?.len()))
    }

    fn experts_of(&self, l: usize, ids: &[usize]) -> Result<Vec<GpuExpert>, EngineError> {
        let mut cache = lock(&self.experts, "GPU expert cache")?;
        fetch_gpu_experts(&self.gpu, &mut cache, &self.cpu.routed, l, ids, &mut |_| Ok(()))
    }

    /// `down(act(gate x, up x))` (SwiGLU or SiTU-GLU, per `hidden_act`) into `out`, with
    /// `t: [3][rows of gate]` scratch.
    fn glu(
        &self,
        [gate, up, down]: [&GpuMat; 3],
        x: &GpuBuf,
        t: &mut [GpuBuf; 3],
        out: &mut GpuBuf,
    ) -> Result<(), CudaError> {
        let g = &self.gpu;
        let [a, b, h] = t;
        gate.matvec(g, x, a)?;
        up.matvec(g, x, b)?;
        match self.cpu.cfg.activation {
            GluActivation::Silu => g.swiglu(a, b, h)?,
            GluActivation::Situ { beta, linear_beta } => g.situ_glu(a, b, beta, linear_beta, h)?,
        }
        down.matvec(g, h, out)
    }

    /// KDA of layer `l` on `w.xn` into `w.out`, updating the layer's state (see the module docs).
    /// `src`/`dst`: the recurrent buffers of this update; `row0`: the first of the `K - 1`
    /// history rows; `slot`: the token's log row.
    fn kda(
        &self,
        k: &KdaGpu,
        w: &mut Work,
        state: &mut LayerState,
        (src, dst): (Option<usize>, usize),
        row0: usize,
        slot: usize,
    ) -> Result<(), CudaError> {
        let g = &self.gpu;
        let c = &self.cpu.cfg;
        let LayerState::Kda { rec, conv, log, .. } = state else {
            return Err(CudaError::Shape("KDA layer without a KDA state".into()));
        };
        let [qp, kp, vp] = &mut w.kda_p;
        k.q_proj.matvec(g, &w.xn, qp)?;
        k.k_proj.matvec(g, &w.xn, kp)?;
        k.v_proj.matvec(g, &w.xn, vp)?;
        g.kda_conv_step(
            conv,
            row0,
            [qp, kp, vp],
            [&k.conv[0], &k.conv[1], &k.conv[2]],
            c.short_conv_kernel_size,
            &mut w.kda_conv,
        )?;
        k.f_a_proj.matvec(g, &w.xn, &mut w.kda_fa)?;
        k.f_b_proj.matvec(g, &w.kda_fa, &mut w.kda_u)?;
        k.b_proj.matvec(g, &w.xn, &mut w.kda_b)?;
        let d = c.kda_head_dim;
        let q_scale = 1.0 / (d as f32).sqrt();
        {
            let [lk, lv, lg, lb] = log;
            g.kda_prepare(
                &w.kda_conv,
                &w.kda_u,
                &w.kda_b,
                &k.a_log,
                &k.dt_bias,
                d,
                self.gate,
                q_scale,
                &mut w.kda_q,
                [lk, lv, lg, lb],
                slot,
            )?;
        }
        let [lk, lv, lg, lb] = &*log;
        delta(
            g,
            rec,
            (src, dst),
            d,
            [lk, lv, lg, lb],
            slot,
            Some((&w.kda_q, &mut w.kda_o)),
        )?;
        // Gated per-head RMSNorm of o ([KDA_OUT_NORM]), then o_proj.
        let nh = c.kda_num_heads;
        g.rms_norm(&w.kda_o, &k.o_norm, nh, c.rms_norm_eps, false, &mut w.kda_on)?;
        match &k.gate {
            OutGate::Full(gp) => gp.matvec(g, &w.xn, &mut w.kda_gate)?,
            OutGate::LowRank(a, b) => {
                a.matvec(g, &w.xn, &mut w.kda_ga)?;
                b.matvec(g, &w.kda_ga, &mut w.kda_gate)?;
            }
        }
        g.sigmoid_mul(&mut w.kda_on, &w.kda_gate)?;
        k.o_proj.matvec(g, &w.kda_on, &mut w.out)
    }

    /// NoPE MLA of layer `l` at position `pos` on `w.xn` into `w.out` (absorbed form, no
    /// rotation, K3's output gate when configured), appending the token's latent and key part
    /// to the layer's cache.
    fn mla(&self, m: &MlaGpu, w: &mut Work, state: &mut LayerState, pos: usize) -> Result<(), CudaError> {
        let g = &self.gpu;
        let c = &self.cpu.cfg;
        let LayerState::Mla { c_kv, k_pe } = state else {
            return Err(CudaError::Shape("MLA layer without an MLA cache".into()));
        };
        let (nh, nope, rope, kvl) = (
            c.num_attention_heads,
            c.qk_nope_head_dim,
            c.qk_rope_head_dim,
            c.kv_lora_rank,
        );
        match &m.q {
            QProj::Lora {
                q_a_proj,
                q_a_layernorm,
                q_b_proj,
            } => {
                q_a_proj.matvec(g, &w.xn, &mut w.qa)?;
                g.rms_norm(&w.qa, q_a_layernorm, 1, LATENT_NORM_EPS, false, &mut w.qan)?;
                q_b_proj.matvec(g, &w.qan, &mut w.q)?;
            }
            QProj::Full(q_proj) => q_proj.matvec(g, &w.xn, &mut w.q)?,
        }
        m.kv_a_latent.matvec(g, &w.xn, &mut w.ckv)?;
        g.rms_norm(&w.ckv, &m.kv_a_layernorm, 1, LATENT_NORM_EPS, false, &mut w.latent)?;
        m.kv_a_rope.matvec(g, &w.xn, &mut w.k_pe)?;
        g.copy_into(&w.latent, c_kv, pos * kvl)?;
        g.copy_into(&w.k_pe, k_pe, pos * rope)?;
        let shape = MlaShape {
            n_heads: nh,
            nope,
            rope,
            v_head_dim: c.v_head_dim,
            kv_lora_rank: kvl,
        };
        if w.scores.len() < shape.scratch_len(pos + 1) {
            w.scores = g.zeros(shape.scratch_len((pos + 1).next_power_of_two()))?;
        }
        g.mla_decode(
            shape,
            &w.q,
            c_kv,
            k_pe,
            &m.kv_b_proj,
            pos + 1,
            self.cpu.softmax_scale,
            None,
            None,
            &mut w.scores,
            &mut w.heads,
        )?;
        if let Some(gp) = &m.g_proj {
            gp.matvec(g, &w.xn, &mut w.mla_gate)?;
            g.sigmoid_mul(&mut w.heads, &w.mla_gate)?;
        }
        m.o_proj.matvec(g, &w.heads, &mut w.out)
    }

    /// The MoE block of layer `l` on `w.xn`, added to the running sum `w.x` (K3-SPEC §5): router
    /// logits on the GPU, the choice on the host (`moe::route`), the routed sum `Σ w_i e_i` in
    /// the expert width from zero in router order (fused MXFP4 launches, or expert by expert
    /// with the same bits), with LatentMoE its RMSNorm and `routed_expert_up_proj`, then the
    /// shared experts' output, then the residual add: the CPU's order.
    fn moe(&self, l: usize, w: &mut Work) -> Result<Routing, EngineError> {
        let g = &self.gpu;
        let c = &self.cpu.cfg;
        let Ffn::Moe { router, latent, shared } = &self.layers[l].ffn else {
            return Err(EngineError::Invalid(format!("layer {l} is not a MoE layer")));
        };
        if let Some([gt, u, d]) = shared {
            self.glu([gt, u, d], &w.xn, &mut w.shared_t, &mut w.shared_out)
                .map_err(cuda)?;
        }
        router.matvec(g, &w.xn, &mut w.router_logits).map_err(cuda)?;
        g.download_into(&w.router_logits, &mut w.router_host).map_err(cuda)?;
        let rcfg = RouterConfig {
            top_k: self.cpu.routed.experts_per_token(),
            ..self.cpu.router
        };
        let bias = self
            .cpu
            .router_bias(l)
            .ok_or_else(|| EngineError::Invalid(format!("layer {l} is not a MoE layer")))?;
        let routing = route(&rcfg, &w.router_host, bias);
        // xl: the experts' input, routed_expert_down_proj(x) with LatentMoE, else x.
        let xin: &GpuBuf = match latent {
            Some((down, _, _)) => {
                down.matvec(g, &w.xn, &mut w.xl).map_err(cuda)?;
                &w.xl
            }
            None => &w.xn,
        };
        let experts = self.experts_of(l, &routing.experts)?;
        let refs: Vec<&[GpuMat; 3]> = experts.iter().map(|e| &**e).collect();
        let fusable = Gpu::moe_fusable(&refs);
        match (fusable, c.activation) {
            (true, GluActivation::Situ { beta, linear_beta }) => g
                .moe_situ_fused(
                    &refs,
                    &routing.weights,
                    (beta, linear_beta),
                    xin,
                    &mut w.moe_h,
                    &mut w.moe_y,
                    &mut w.acc,
                )
                .map_err(cuda)?,
            (true, GluActivation::Silu) => {
                g.fill_zero(&mut w.acc).map_err(cuda)?;
                g.moe_fused(
                    &refs,
                    &routing.weights,
                    xin,
                    &mut w.moe_h,
                    &mut w.moe_y,
                    None,
                    &mut w.acc,
                )
                .map_err(cuda)?;
            }
            (false, _) => {
                g.fill_zero(&mut w.acc).map_err(cuda)?;
                for (e, &weight) in refs.iter().zip(&routing.weights) {
                    self.glu([&e[0], &e[1], &e[2]], xin, &mut w.expert_t, &mut w.eout)
                        .map_err(cuda)?;
                    g.axpy(weight, &w.eout, &mut w.acc).map_err(cuda)?;
                }
            }
        }
        let out: &mut GpuBuf = match latent {
            Some((_, norm, up)) => {
                let y = match norm {
                    Some(nw) => {
                        g.rms_norm(&w.acc, nw, 1, c.rms_norm_eps, false, &mut w.accn)
                            .map_err(cuda)?;
                        &w.accn
                    }
                    None => &w.acc,
                };
                up.matvec(g, y, &mut w.out).map_err(cuda)?;
                &mut w.out
            }
            None => &mut w.acc,
        };
        if shared.is_some() {
            g.axpy(1.0, &w.shared_out, out).map_err(cuda)?;
        }
        g.axpy(1.0, out, &mut w.x).map_err(cuda)?;
        Ok(routing)
    }

    /// The device buffers of a new sequence's state: per KDA layer two recurrent states
    /// `[nh, d, d]`, the conv history `[K - 1 + window, 3P]` and its scratch, the rollback log;
    /// per MLA layer an empty cache (grown by [`KimiGpuState::reserve`]).
    fn allocate(&self, st: &mut KimiGpuState) -> Result<(), CudaError> {
        let c = &self.cpu.cfg;
        let (p, nh, d, kk, window) = (
            c.kda_width(),
            c.kda_num_heads,
            c.kda_head_dim,
            c.short_conv_kernel_size,
            st.window,
        );
        let g = &self.gpu;
        let z = |n: usize| g.zeros(n.max(1));
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for m in &c.mixers {
            layers.push(match m {
                MixerKind::Kda => LayerState::Kda {
                    rec: [z(nh * d * d)?, z(nh * d * d)?],
                    conv: z((kk - 1 + window) * 3 * p)?,
                    scratch: z((kk - 1) * 3 * p)?,
                    log: [z(window * p)?, z(window * p)?, z(window * p)?, z(window * nh)?],
                },
                MixerKind::Mla => LayerState::Mla {
                    c_kv: z(1)?,
                    k_pe: z(1)?,
                },
            });
        }
        st.layers = layers;
        Ok(())
    }

    fn forward_token(&self, st: &mut KimiGpuState, token: u32) -> Result<(Vec<f32>, LayerRoutes), EngineError> {
        let c = &self.cpu.cfg;
        EngineError::check_tokens(&[token], c.vocab_size)?;
        if let Some(e) = st.broken.take() {
            return Err(EngineError::Invalid(format!("CUDA: a KDA state commit failed: {e}")));
        }
        let g = &self.gpu;
        g.bind_to_thread().map_err(cuda)?;
        if st.layers.is_empty() {
            self.allocate(st).map_err(cuda)?;
        }
        // A full rollback log commits first (the CPU's KdaState::run rule for one token).
        if st.len - st.base_len >= st.window {
            st.try_commit().map_err(cuda)?;
        }
        st.reserve(st.len + 1).map_err(cuda)?;
        let mut guard = lock(&self.work, "CUDA work buffers")?;
        let w = &mut *guard;
        let h = c.hidden_size;
        let mut x_host = vec![0f32; h];
        self.cpu.embed_tokens().row_into(token as usize, &mut x_host);
        g.upload_into(&x_host, &mut w.x).map_err(cuda)?;
        let pos = st.len;
        let slot = st.len - st.base_len;
        let bufs = st.update_buffers();
        let mut routes = Vec::new();
        let mut n_bank = 0usize;
        for l in 0..c.num_hidden_layers {
            let lw = &self.layers[l];
            // Steps 1–2: the mixer's input, the bank push at a block start. [ATTN_RES]
            match (&lw.res, c.attn_res_block_size) {
                (Some((wa, _)), Some(bs)) => {
                    g.attn_res_mix(&w.bank, n_bank, &w.x, wa, c.rms_norm_eps, &mut w.mixed)
                        .map_err(cuda)?;
                    if l.is_multiple_of(bs) {
                        g.copy_into(&w.x, &mut w.bank, n_bank * h).map_err(cuda)?;
                        n_bank += 1;
                        g.fill_zero(&mut w.x).map_err(cuda)?;
                    }
                    g.rms_norm(&w.mixed, &lw.input_layernorm, 1, c.rms_norm_eps, false, &mut w.xn)
                        .map_err(cuda)?;
                }
                _ => g
                    .rms_norm(&w.x, &lw.input_layernorm, 1, c.rms_norm_eps, false, &mut w.xn)
                    .map_err(cuda)?,
            }
            // Step 3: S += mixer(input_layernorm(a_in)).
            self.cpu
                .routed
                .time_attention(|| match &lw.mixer {
                    Mixer::Kda(k) => self.kda(k, w, &mut st.layers[l], bufs, slot, slot),
                    Mixer::Mla(m) => self.mla(m, w, &mut st.layers[l], pos),
                })
                .map_err(cuda)?;
            g.axpy(1.0, &w.out, &mut w.x).map_err(cuda)?;
            // Steps 4–5: f_in, then S += ffn(post_attention_layernorm(f_in)).
            match &lw.res {
                Some((_, wm)) => {
                    g.attn_res_mix(&w.bank, n_bank, &w.x, wm, c.rms_norm_eps, &mut w.mixed)
                        .map_err(cuda)?;
                    g.rms_norm(
                        &w.mixed,
                        &lw.post_attention_layernorm,
                        1,
                        c.rms_norm_eps,
                        false,
                        &mut w.xn,
                    )
                    .map_err(cuda)?;
                }
                None => g
                    .rms_norm(&w.x, &lw.post_attention_layernorm, 1, c.rms_norm_eps, false, &mut w.xn)
                    .map_err(cuda)?,
            }
            self.cpu.routed.time_mlp(|| -> Result<(), EngineError> {
                match &lw.ffn {
                    Ffn::Moe { .. } => {
                        let r = self.moe(l, w)?;
                        routes.push((l, r));
                        Ok(())
                    }
                    Ffn::Dense([gt, u, d]) => {
                        self.glu([gt, u, d], &w.xn, &mut w.dense, &mut w.out).map_err(cuda)?;
                        g.axpy(1.0, &w.out, &mut w.x).map_err(cuda)
                    }
                }
            })?;
        }
        st.cur = bufs.1;
        st.len += 1;
        self.cpu.routed.count_forward();
        let z: &GpuBuf = match &self.out_res {
            Some(wo) => {
                g.attn_res_mix(&w.bank, n_bank, &w.x, wo, c.rms_norm_eps, &mut w.mixed)
                    .map_err(cuda)?;
                &w.mixed
            }
            None => &w.x,
        };
        g.rms_norm(z, &self.norm, 1, c.rms_norm_eps, false, &mut w.xn)
            .map_err(cuda)?;
        self.lm_head.matvec(g, &w.xn, &mut w.logits).map_err(cuda)?;
        Ok((g.download(&w.logits).map_err(cuda)?, routes))
    }

    /// Returns `st` to length `to` (`committed..=len`): every KDA layer back to its committed
    /// recurrent state, then the logged updates replayed (update only); MLA caches and conv
    /// histories simply forget the positions past `to`.
    fn try_rollback(&self, st: &mut KimiGpuState, to: usize) -> Result<bool, CudaError> {
        if to >= st.len {
            return Ok(true);
        }
        if to < st.base_len {
            return Ok(false);
        }
        self.gpu.bind_to_thread()?;
        let d = self.cpu.cfg.kda_head_dim;
        st.cur = st.base;
        st.len = st.base_len;
        for slot in 0..to - st.base_len {
            let bufs = st.update_buffers();
            for s in &mut st.layers {
                if let LayerState::Kda { rec, log, .. } = s {
                    let [lk, lv, lg, lb] = &*log;
                    delta(&self.gpu, rec, bufs, d, [lk, lv, lg, lb], slot, None)?;
                }
            }
            st.cur = bufs.1;
            st.len += 1;
        }
        Ok(true)
    }
}

/// One delta-rule update on the recurrent buffers `rec` (`src` → `dst`, or in place).
fn delta(
    g: &Gpu,
    rec: &mut [GpuBuf; 2],
    (src, dst): (Option<usize>, usize),
    d: usize,
    log: [&GpuBuf; 4],
    slot: usize,
    qo: Option<(&GpuBuf, &mut GpuBuf)>,
) -> Result<(), CudaError> {
    let (a, b) = rec.split_at_mut(1);
    let (s, t) = if dst == 1 {
        (&a[0], &mut b[0])
    } else {
        (&b[0], &mut a[0])
    };
    let src = match src {
        Some(i) if i != dst => Some(s),
        _ => None,
    };
    g.kda_delta(src, t, d, log, slot, qo)
}

impl FamilyModel for KimiLinearCuda {
    type State = KimiGpuState;

    fn config(&self) -> &ModelConfig {
        FamilyModel::config(&self.cpu)
    }

    fn new_state(&self) -> KimiGpuState {
        let c = &self.cpu.cfg;
        let (p, kk) = (c.kda_width(), c.short_conv_kernel_size);
        let window = KDA_ROLLBACK_WINDOW;
        // The device buffers are allocated by the first forward ([`Self::allocate`]), where a
        // failure can be reported.
        KimiGpuState {
            gpu: self.gpu.clone(),
            layers: Vec::new(),
            len: 0,
            base_len: 0,
            cur: 0,
            base: 0,
            window,
            kernel: kk,
            row: 3 * p,
            kvl: c.kv_lora_rank,
            rope: c.qk_rope_head_dim,
            mla_capacity: 0,
            broken: None,
        }
    }

    fn step(&self, st: &mut KimiGpuState, token: u32) -> Result<(Vec<f32>, LayerRoutes), EngineError> {
        self.forward_token(st, token)
    }

    /// Token at a time (see the module docs): every position computed exactly as
    /// [`CausalLm::forward`]. A chunk that would overflow the rollback log commits first, so a
    /// verification pass of speculative decoding can always be rolled back (the CPU's rule).
    fn chunk(&self, st: &mut KimiGpuState, tokens: &[u32], all_logits: bool) -> Result<BatchOutput, EngineError> {
        if (st.len - st.base_len) + tokens.len() > st.window {
            st.try_commit().map_err(cuda)?;
        }
        token_at_a_time(tokens, all_logits, |t| self.forward_token(st, t))
    }

    fn rollback(&self, st: &mut KimiGpuState, len: usize) -> bool {
        match self.try_rollback(st, len) {
            Ok(ok) => ok,
            Err(e) => {
                st.broken = Some(e.to_string());
                false
            }
        }
    }

    fn routed(&self) -> &RoutedExperts {
        &self.cpu.routed
    }

    fn routed_mut(&mut self) -> &mut RoutedExperts {
        &mut self.cpu.routed
    }

    fn backbone_bytes(&self) -> usize {
        FamilyModel::backbone_bytes(&self.cpu)
    }

    fn gpu_cache_stats(&self) -> Option<GpuCacheStats> {
        self.experts.lock().ok().map(|c| c.stats())
    }
}
