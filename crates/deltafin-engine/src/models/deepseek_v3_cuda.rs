//! DeepSeek-V3 / Kimi K2 on a CUDA device: the same forward pass as `deepseek_v3.rs`, one token
//! at a time, with the backbone resident in GPU memory, the MLA latent KV cache on the GPU, and
//! the routed experts read through the same expert store (host cache, O_DIRECT reads, traces,
//! prefetch) and computed on the GPU.
//!
//! Per layer, as the CPU file (transformers' `modeling_deepseek_v3.py`):
//! ```text
//! h = x + self_attn(input_layernorm(x))           # MLA, weight-absorbed (mla_decode kernel)
//! x = h + mlp(post_attention_layernorm(h))        # dense SwiGLU, or MoE
//! ```
//! What stays on the host: the token's embedding row (decoded from the int8 backbone exactly as
//! the CPU does), the router's choice (`moe::route` on the logits the GPU computed) and the
//! weighted sum of the routed experts' outputs (`RoutedExperts::run`, router order), RoPE's
//! cos/sin for the position (`RotaryEmbedding`'s own arithmetic, so RoPE is the CPU's bits).
//!
//! Numerics: f32 everywhere, fixed reduction orders (deltafin-cuda's kernels), so output is
//! deterministic run to run and agrees with the CPU path to f32 rounding; greedy ids are checked
//! against the CPU path (`deltafin run --device cuda` vs `--device cpu`, bench/NOTES.md).
//!
//! Routed experts: a GPU expert cache ([`crate::gpu_experts`]) holds the experts used most
//! recently within `--gpu-budget`; a miss is read through the expert store (the host cache is
//! the second tier) and copied to the device once.
//!
//! A prompt chunk runs in one batched pass ([`DeepseekV3Cuda::forward_batch`]: matrix-matrix
//! projections, MLA for the chunk, expert-major MoE) with every position's bits equal to
//! token-at-a-time decoding. With the research option `--batch-form fast` (as on the CPU), a
//! long chunk computes MLA in the decompressed form instead (`Gpu::mla_prefill_decompressed`:
//! about a third of the multiply-adds; within f32 rounding of decoding, not bit for bit).
//! Not on the GPU yet: self-drafting.

use std::sync::{Arc, Mutex};

use deltafin_cuda::{
    CudaError, CudaView, ExpertTable, Gpu, GpuBuf, GpuMat, GpuMatData, Graph, MlaPrefillForm, MlaPrepArg, MlaShape,
    MoeDown, MvJob, Pinned, PreNorm, RouteTailArg, RouterShape, MOE_MAX_K,
};
use deltafin_format::{ModelConfig, ModelDir};

use crate::compute::{chunk_logits, decoder_layers, swiglu_rows, Backend};
use crate::device::GpuOptions;
use crate::experts::StoreOptions;
use crate::gpu_experts::{GpuCacheStats, GpuExpert, GpuExpertCache};
use crate::model::{BatchOutput, FamilyModel, LayerRoutes, RoutedExperts};
use crate::models::deepseek_v3::{LayerNames, LATENT_NORM_EPS};
use crate::models::gpu_fetch::{
    cuda, download_routings, fetch_gpu_experts, gpu_expert_budget, grouped_swiglu_experts, lock, open_gpu_for,
    per_expert_rows, preload_in_file_order, CacheChange, ExpertMajor, GpuLayerCache, Upload,
};
use crate::models::mla_gpu::{device_mla_shape, MlaGpu, QProj};
use crate::models::DeepseekV3;
use crate::moe::RouterConfig;
use crate::EngineError;

/// A device buffer's address (to tell whether a captured graph still names it).
fn buf_ptr(g: &Gpu, b: &GpuBuf) -> u64 {
    use deltafin_cuda::DevicePtr;
    b.device_ptr(g.stream()).0
}

/// One layer's backbone on the GPU (tensor names as in the checkpoint).
struct GpuLayer {
    input_layernorm: GpuBuf,
    post_attention_layernorm: GpuBuf,
    /// `self_attn.*`.
    self_attn: MlaGpu,
    mlp: Mlp,
}

enum Mlp {
    Dense {
        gate: GpuMat,
        up: GpuMat,
        down: GpuMat,
    },
    Moe {
        router: GpuMat,
        /// `e_score_correction_bias` `[n_routed_experts]`.
        bias: GpuBuf,
        shared: Option<[GpuMat; 3]>,
    },
}

/// The GPU expert cache and, per MoE layer, a device table of its resident experts by id (what
/// lets a decode step whose chosen experts are all resident run without asking the host).
struct GpuExperts {
    cache: GpuExpertCache,
    /// `[num_hidden_layers]`, `Some` for MoE layers: entry `e` points at expert `e` while it is
    /// resident (cleared when it is evicted).
    tables: Vec<Option<ExpertTable>>,
}

/// The MLA latent KV cache of every layer in GPU memory: per layer the latents `c_kv`
/// `[capacity, kv_lora_rank]` and the rope keys `k_pe` `[capacity, qk_rope_head_dim]`.
pub type GpuKvCache = GpuLayerCache;

/// Device buffers of one token's forward pass, allocated once at load (no allocation on the
/// decode path except the attention scores, which grow with the context).
struct Work {
    /// The residual stream `[hidden]`.
    x: GpuBuf,
    /// The MoE block's normalized input `[hidden]` (read by the routed experts).
    xn: GpuBuf,
    /// RoPE `[cos[half], sin[half]]` of the position.
    cs: GpuBuf,
    // Attention: q `[n_heads * qk_head_dim]`, q_a_proj's output `[q_lora_rank]`, the raw latent
    // `[kv_lora_rank]` and rope key `[qk_rope_head_dim]`, the heads' outputs, the scores.
    q: GpuBuf,
    qa: GpuBuf,
    ckv: GpuBuf,
    k_pe: GpuBuf,
    heads: GpuBuf,
    scores: GpuBuf,
    /// The dense MLP's gated intermediate `[intermediate_size]`.
    dense_h: GpuBuf,
    /// The shared experts' gated intermediate `[n_shared * moe_intermediate_size]`.
    shared_h: GpuBuf,
    /// The routed experts' gated intermediates `[MOE_MAX_K, moe_intermediate_size]`, then their
    /// down projections' outputs `[MOE_MAX_K + 1, hidden]` (the split form).
    moe_h: GpuBuf,
    router_logits: GpuBuf,
    /// Every MoE layer's choice for the token: ids and weights `[num_hidden_layers, MOE_MAX_K]`
    /// (router order), written by the device router, read back once at the end of the token.
    ids: deltafin_cuda::CudaSlice<i32>,
    weights: GpuBuf,
    /// Page-locked copies of the step's inputs (embedding row, RoPE's cos/sin, position) and
    /// outputs (logits, every layer's ids and weights): the step waits for the device once.
    x_in: Pinned<f32>,
    cs_in: Pinned<f32>,
    pos_in: Pinned<i32>,
    logits_out: Pinned<f32>,
    ids_out: Pinned<i32>,
    weights_out: Pinned<f32>,
    /// The chosen experts of a layer that is not wholly resident, by slot, and `0..MOE_MAX_K`.
    slots: ExpertTable,
    slot_ids: deltafin_cuda::CudaSlice<i32>,
    logits: GpuBuf,
    /// The token's position `[1]`, read by the attention kernels on the device.
    pos: deltafin_cuda::CudaSlice<i32>,
    /// The decode step captured as a CUDA graph, for the buffers it was captured on.
    graph: Option<(GraphKey, Graph)>,
    /// A capture failed once: decode steps are queued launch by launch from then on.
    graph_failed: bool,
}

/// What a captured decode step is tied to: the KV cache's buffers and size, the scores buffer,
/// the number of experts a token (kernel arguments baked into the graph).
#[derive(Debug, Clone, PartialEq, Eq)]
struct GraphKey {
    /// Every layer's latent and rope-key cache buffer.
    cache: Vec<u64>,
    capacity: usize,
    scores: u64,
    top_k: usize,
}

/// DeepSeek-V3 with its forward pass on a CUDA device (see the module docs).
pub struct DeepseekV3Cuda {
    cpu: DeepseekV3,
    gpu: Arc<Gpu>,
    layers: Vec<GpuLayer>,
    norm: GpuBuf,
    lm_head: GpuMat,
    work: Mutex<Work>,
    /// Routed experts resident on the device (the tier above the host cache).
    experts: Mutex<GpuExperts>,
}

pub use crate::models::gpu_fetch::GPU_MARGIN_BYTES;

impl DeepseekV3Cuda {
    /// Loads the model as [`DeepseekV3::load_with`] does, then opens `cuda:ordinal`, uploads
    /// the backbone and sizes the GPU expert cache: `gpu_budget` bytes, or by default what the
    /// device has free after the backbone less [`GPU_MARGIN_BYTES`].
    ///
    /// Errors: everything `DeepseekV3::load_with` refuses; no such device; a backbone larger than
    /// the device memory (named with both sizes); a `gpu_budget` larger than the free memory
    /// after the backbone (both named); a driver or NVRTC failure.
    pub fn load_with(
        dir: &ModelDir,
        opts: StoreOptions,
        ordinal: usize,
        gpu_opts: GpuOptions,
    ) -> Result<Self, EngineError> {
        let cpu = DeepseekV3::load_with(dir, opts)?;
        let backbone = cpu.backbone_bytes() as u64;
        let gpu = open_gpu_for(ordinal, backbone, &cpu.routed.store)?;
        let c = cpu.cfg.clone();
        let upl = Upload {
            gpu: &gpu,
            backbone: &cpu.backbone,
        };
        let (up, vec) = (|name: &str| upl.mat(name), |name: &str| upl.vec(name));
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for l in 0..c.num_hidden_layers {
            let n: &LayerNames = &cpu.names[l];
            let mlp = if c.is_moe_layer(l) {
                let shared = if c.n_shared_experts > 0 {
                    Some([
                        up(&n.shared_experts.gate_proj)?,
                        up(&n.shared_experts.up_proj)?,
                        up(&n.shared_experts.down_proj)?,
                    ])
                } else {
                    None
                };
                Mlp::Moe {
                    router: up(&n.router)?,
                    bias: vec(&n.router_bias)?,
                    shared,
                }
            } else {
                Mlp::Dense {
                    gate: up(&n.mlp.gate_proj)?,
                    up: up(&n.mlp.up_proj)?,
                    down: up(&n.mlp.down_proj)?,
                }
            };
            layers.push(GpuLayer {
                input_layernorm: vec(&n.input_layernorm)?,
                post_attention_layernorm: vec(&n.post_attention_layernorm)?,
                self_attn: MlaGpu::upload(&upl, &cpu.w.layers[l].self_attn, c.kv_lora_rank, c.qk_rope_head_dim)?,
                mlp,
            });
        }
        let norm = vec("model.norm.weight")?;
        let lm_head = up("lm_head.weight")?;
        let z = |n: usize| gpu.zeros(n.max(1)).map_err(cuda);
        let h = c.hidden_size;
        let half = cpu.rope.inv_freq.len();
        let r = cpu.router_cfg();
        if r.top_k > MOE_MAX_K || r.n_group > 64 {
            return Err(EngineError::Invalid(format!(
                "the CUDA path routes at most {MOE_MAX_K} experts a token in at most 64 groups (this model: {} in {})",
                r.top_k, r.n_group
            )));
        }
        let slots = MOE_MAX_K * c.num_hidden_layers;
        let work = Work {
            x: z(h)?,
            xn: z(h)?,
            cs: z(2 * half)?,
            q: z(c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim))?,
            qa: z(c.q_lora_rank.unwrap_or(1))?,
            ckv: z(c.kv_lora_rank)?,
            k_pe: z(c.qk_rope_head_dim)?,
            heads: z(c.num_attention_heads * c.v_head_dim)?,
            scores: z(c.num_attention_heads * 64)?,
            dense_h: z(c.intermediate_size)?,
            shared_h: z(c.n_shared_experts * c.moe_intermediate_size)?,
            moe_h: z(MOE_MAX_K * c.moe_intermediate_size + (MOE_MAX_K + 1) * h)?,
            router_logits: z(c.n_routed_experts)?,
            ids: gpu.upload(&vec![0i32; slots]).map_err(cuda)?,
            weights: z(slots)?,
            x_in: gpu.pinned(h).map_err(cuda)?,
            cs_in: gpu.pinned(2 * half).map_err(cuda)?,
            pos_in: gpu.pinned(1).map_err(cuda)?,
            logits_out: gpu.pinned(lm_head.rows).map_err(cuda)?,
            ids_out: gpu.pinned(slots).map_err(cuda)?,
            weights_out: gpu.pinned(slots).map_err(cuda)?,
            slots: gpu.expert_table(MOE_MAX_K, c.moe_intermediate_size, h).map_err(cuda)?,
            slot_ids: gpu.upload(&(0..MOE_MAX_K as i32).collect::<Vec<_>>()).map_err(cuda)?,
            logits: z(lm_head.rows)?,
            pos: gpu.upload(&[0i32]).map_err(cuda)?,
            graph: None,
            graph_failed: false,
        };
        let mut tables = Vec::with_capacity(c.num_hidden_layers);
        for l in 0..c.num_hidden_layers {
            tables.push(if c.is_moe_layer(l) {
                Some(
                    gpu.expert_table(c.n_routed_experts, c.moe_intermediate_size, h)
                        .map_err(cuda)?,
                )
            } else {
                None
            });
        }
        let budget = gpu_expert_budget(&gpu, ordinal, gpu_opts.budget, backbone)?;
        let model = Self {
            cpu,
            gpu,
            layers,
            norm,
            lm_head,
            work: Mutex::new(work),
            experts: Mutex::new(GpuExperts {
                cache: GpuExpertCache::new(budget),
                tables,
            }),
        };
        if gpu_opts.preload {
            model.preload()?;
            if let Ok(mut c) = model.experts.lock() {
                c.cache.clear_counters();
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
            .map(|l| (l, c.n_routed_experts));
        let room = || Ok(self.gpu_cache_stats_now()?.records_free(record));
        preload_in_file_order(layers, room, |l, ids| Ok(self.experts_of(l, ids)?.len()))
    }

    fn gpu_cache_stats_now(&self) -> Result<GpuCacheStats, EngineError> {
        lock(&self.experts, "GPU expert cache").map(|c| c.cache.stats())
    }

    /// RoPE cos/sin of `pos` for the rope head width, `[cos[half], sin[half]]`, with the CPU's
    /// arithmetic (`RotaryEmbedding::apply`).
    fn rope_table(&self, pos: usize) -> Vec<f32> {
        let r = &self.cpu.rope;
        let half = r.inv_freq.len();
        let mut cs = vec![0f32; 2 * half];
        let p = pos as f32;
        for i in 0..half {
            let (s, c) = (p * r.inv_freq[i]).sin_cos();
            cs[i] = c * r.attention_factor;
            cs[half + i] = s * r.attention_factor;
        }
        cs
    }

    /// The MLA kernels' shape of every layer (the CPU model's, [`DeepseekV3::mla_shape`]).
    fn mla_shape(&self) -> MlaShape {
        device_mla_shape(&self.cpu.mla_shape())
    }

    /// The device router's shape for the current top-k.
    fn router_shape(&self) -> RouterShape {
        let r: RouterConfig = self.cpu.router_cfg();
        RouterShape {
            n_experts: r.n_routed_experts,
            top_k: r.top_k,
            n_group: r.n_group,
            topk_group: r.topk_group,
            norm_topk_prob: r.norm_topk_prob,
            routed_scaling_factor: r.routed_scaling_factor,
        }
    }

    /// MLA of layer `l` for the token in the residual stream `w.x`, added to it: the input norm
    /// and the three input projections (q or q_a, the latent, the rope key) in one launch, q_b
    /// after q_a's norm in one, the latent's norm and the key's RoPE into the cache rows of the
    /// position in one, the attention (q's RoPE inside), o_proj with the residual add in one.
    fn attention(&self, l: usize, w: &mut Work, cache: &mut GpuKvCache) -> Result<(), CudaError> {
        let c = &self.cpu.cfg;
        let g = &self.gpu;
        let lw = &self.layers[l];
        let pos = cache.len;
        let [c_kv, k_pe] = cache.layer_mut(l);
        let interleaved = self.cpu.rope.interleaved;
        // q_a_proj (q-LoRA) or q_proj, with the latent and the rope key.
        let (q_in, q_out) = match &lw.self_attn.q {
            QProj::Lora { q_a_proj, .. } => (q_a_proj, &mut w.qa),
            QProj::Full(q_proj) => (q_proj, &mut w.q),
        };
        g.mv_jobs(
            &w.x,
            Some(PreNorm::rms(&lw.input_layernorm, c.rms_norm_eps)),
            &mut [
                MvJob::set(q_in, q_out),
                MvJob::set(&lw.self_attn.kv_a_latent, &mut w.ckv),
                MvJob::set(&lw.self_attn.kv_a_rope, &mut w.k_pe),
            ],
        )?;
        let prep = MlaPrepArg {
            ckv_raw: &w.ckv,
            norm: &lw.self_attn.kv_a_layernorm,
            eps: LATENT_NORM_EPS,
            kpe_raw: &w.k_pe,
            cs: &w.cs,
            interleaved,
            pos,
            pos_dev: &w.pos,
            c_kv,
            k_pe,
        };
        match &lw.self_attn.q {
            QProj::Lora {
                q_a_layernorm,
                q_b_proj,
                ..
            } => {
                // q_b's launch also writes the latent and the rope key into the cache.
                let qn = PreNorm::rms(q_a_layernorm, LATENT_NORM_EPS);
                g.mv_jobs_prep(&w.qa, Some(qn), &mut [MvJob::set(q_b_proj, &mut w.q)], prep)?;
            }
            QProj::Full(_) => g.mla_prep(prep)?,
        }
        let shape = self.mla_shape();
        g.mla_decode(
            shape,
            &w.q,
            c_kv,
            k_pe,
            &lw.self_attn.kv_b_proj,
            pos + 1,
            self.cpu.softmax_scale,
            Some((&w.cs, interleaved)),
            Some(&w.pos),
            &mut w.scores,
            &mut w.heads,
        )?;
        g.mv_jobs(&w.heads, None, &mut [MvJob::add(&lw.self_attn.o_proj, &mut w.x)])
    }

    /// The MoE block of layer `l`, added to the residual stream `w.x`: the post-attention norm,
    /// the shared experts' gate/up and the router logits in one launch, the router on the device
    /// (ids and weights into `w.ids`/`w.weights` at the layer's slots), then the chosen experts,
    /// their weighted sum (router order), the shared output and the residual add in two launches
    /// ([`Gpu::moe_table`]). When every expert of the layer is resident the experts are found
    /// through the layer's device table and the host does not wait; otherwise the ids are read
    /// back, misses are fetched through the expert store (host cache, disk) and copied to the
    /// device, and the chosen experts are named slot by slot. Both give the same bits.
    /// Returns whether the layer ran from its table (its cache uses are counted at the end of
    /// the token).
    fn moe(&self, l: usize, w: &mut Work) -> Result<bool, EngineError> {
        let c = &self.cpu.cfg;
        let g = &self.gpu;
        let lw = &self.layers[l];
        let Mlp::Moe { router, bias, shared } = &lw.mlp else {
            return Err(EngineError::Invalid(format!("layer {l} is not a MoE layer")));
        };
        let rs = self.router_shape();
        let k = rs.top_k;
        let off = l * MOE_MAX_K;
        {
            let pn = PreNorm::rms(&lw.post_attention_layernorm, c.rms_norm_eps).kept_in(&mut w.xn);
            let mut jobs = vec![MvJob::set(router, &mut w.router_logits)];
            if let Some([gate, up, _]) = shared {
                jobs.push(MvJob::glu(gate, up, &mut w.shared_h));
            }
            // The router runs in the same launch, in its last block (`route_noaux`'s bits).
            let route = RouteTailArg {
                cfg: rs,
                bias,
                ids: &mut w.ids,
                weights: &mut w.weights,
                off,
            };
            g.mv_jobs_route(&w.x, Some(pn), &mut jobs, Some(route)).map_err(cuda)?;
        }
        let shared_pair = shared.as_ref().map(|[_, _, down]| (down, &w.shared_h));
        // The chosen experts through `table` (named there by `ids`), their weighted sum, the
        // shared output and the residual add.
        let mut moe_from = |table: &ExpertTable, ids: &CudaView<i32>| {
            g.moe_table(
                MOE_DOWN,
                table,
                ids,
                &w.weights.slice(off..off + k),
                k,
                &w.xn,
                &mut w.moe_h,
                shared_pair,
                &mut w.x,
            )
            .map_err(cuda)
        };
        let stand_in = self.cpu.routed.compute_only();
        {
            let ex = lock(&self.experts, "GPU expert cache")?;
            if let (false, Some(table)) = (stand_in, &ex.tables[l]) {
                if ex.cache.resident_in_layer(l) == c.n_routed_experts {
                    moe_from(table, &w.ids.slice(off..off + k))?;
                    return Ok(true);
                }
            }
        }
        let mut ids = vec![0i32; k];
        g.stream()
            .memcpy_dtoh(&w.ids.slice(off..off + k), &mut ids)
            .map_err(|e| cuda(CudaError::Shape(format!("reading the router's choice back: {e}"))))?;
        g.synchronize().map_err(cuda)?;
        let ids: Vec<usize> = ids.iter().map(|&e| e as usize).collect();
        if let Some(&bad) = ids.iter().find(|&&e| e >= c.n_routed_experts) {
            return Err(EngineError::Invalid(format!(
                "layer {l}: the device router chose expert {bad}"
            )));
        }
        let experts = self.experts_of(l, &ids)?;
        let refs: Vec<&[GpuMat; 3]> = experts.iter().map(|e| &**e).collect();
        w.slots.set(g, 0, &refs).map_err(cuda)?;
        moe_from(&w.slots, &w.slot_ids.slice(..k))?;
        // `experts` (and the device memory of any evicted among them) is released after the
        // launches above in stream order.
        drop(experts);
        Ok(false)
    }

    /// The device copies of `ids` (layer `l`), in that order ([`fetch_gpu_experts`]), each
    /// insertion entered in the layer's device table and each eviction cleared from its table.
    fn experts_of(&self, l: usize, ids: &[usize]) -> Result<Vec<GpuExpert>, EngineError> {
        let mut guard = lock(&self.experts, "GPU expert cache")?;
        let GpuExperts { cache, tables } = &mut *guard;
        let gpu = &self.gpu;
        fetch_gpu_experts(gpu, cache, &self.cpu.routed, l, ids, &mut |change| {
            let r = match change {
                CacheChange::Inserted(el, e, dev) => match tables.get_mut(el).and_then(Option::as_mut) {
                    Some(t) => t.set(gpu, e, &[&**dev]),
                    None => Ok(()),
                },
                CacheChange::Evicted(el, e) => match tables.get_mut(el).and_then(Option::as_mut) {
                    Some(t) => t.clear(gpu, e),
                    None => Ok(()),
                },
            };
            r.map_err(cuda)
        })
    }

    /// Whether every routed expert of every MoE layer is on the device (and ids are not stand-ins),
    /// so that no decode step asks the host for an expert.
    fn all_resident(&self) -> Result<bool, EngineError> {
        let c = &self.cpu.cfg;
        if self.cpu.routed.compute_only() {
            return Ok(false);
        }
        let ex = lock(&self.experts, "GPU expert cache")?;
        Ok((0..c.num_hidden_layers)
            .filter(|&l| c.is_moe_layer(l))
            .all(|l| ex.cache.resident_in_layer(l) == c.n_routed_experts))
    }

    /// Queues one decode step on the device (its inputs already in `w.x`, `w.cs`, `w.pos`):
    /// every layer, the final norm and the LM head into `w.logits`. Pushes the MoE layers whose
    /// experts were found through their tables to `from_table`.
    fn queue_step(&self, w: &mut Work, cache: &mut GpuKvCache, from_table: &mut Vec<usize>) -> Result<(), EngineError> {
        let c = &self.cpu.cfg;
        let g = &self.gpu;
        for l in 0..c.num_hidden_layers {
            let lw = &self.layers[l];
            self.cpu
                .routed
                .time_attention(|| self.attention(l, w, cache))
                .map_err(cuda)?;
            self.cpu.routed.time_mlp(|| -> Result<(), EngineError> {
                match &lw.mlp {
                    Mlp::Moe { .. } => {
                        if self.moe(l, w)? {
                            from_table.push(l);
                        }
                        Ok(())
                    }
                    Mlp::Dense { gate, up, down } => {
                        let pn = PreNorm::rms(&lw.post_attention_layernorm, c.rms_norm_eps);
                        g.mv_jobs(&w.x, Some(pn), &mut [MvJob::glu(gate, up, &mut w.dense_h)])
                            .map_err(cuda)?;
                        g.mv_jobs(&w.dense_h, None, &mut [MvJob::add(down, &mut w.x)])
                            .map_err(cuda)
                    }
                }
            })?;
        }
        let pn = PreNorm::rms(&self.norm, c.rms_norm_eps);
        g.mv_jobs(&w.x, Some(pn), &mut [MvJob::set(&self.lm_head, &mut w.logits)])
            .map_err(cuda)
    }

    fn forward_token(&self, cache: &mut GpuKvCache, token: u32) -> Result<(Vec<f32>, LayerRoutes), EngineError> {
        let c = &self.cpu.cfg;
        EngineError::check_tokens(&[token], c.vocab_size)?;
        let g = &self.gpu;
        g.bind_to_thread().map_err(cuda)?;
        cache.reserve(cache.len + 1).map_err(cuda)?;
        let mut guard = lock(&self.work, "CUDA work buffers")?;
        let w = &mut *guard;
        let mut x_host = vec![0f32; c.hidden_size];
        self.cpu.embed_tokens().row_into(token as usize, &mut x_host);
        w.x_in.write(&x_host).map_err(cuda)?;
        w.cs_in.write(&self.rope_table(cache.len)).map_err(cuda)?;
        w.pos_in.write(&[cache.len as i32]).map_err(cuda)?;
        g.upload_pinned(&w.x_in, &mut w.x).map_err(cuda)?;
        g.upload_pinned(&w.cs_in, &mut w.cs).map_err(cuda)?;
        g.upload_pinned(&w.pos_in, &mut w.pos).map_err(cuda)?;
        let mla = self.mla_shape();
        // MLA's scratch sized for the cache's capacity: the grid of a captured step covers
        // every position the cache can hold (the key below names the capacity).
        if w.scores.len() < mla.scratch_len(cache.capacity) {
            w.scores = g.zeros(mla.scratch_len(cache.capacity)).map_err(cuda)?;
        }
        let mut from_table = Vec::new();
        let mut launched = false;
        if !w.graph_failed && self.all_resident()? {
            // Every chosen expert will be found through the tables: the step needs no host
            // decision, so it runs as one captured graph (captured again when the buffers it
            // names change: the KV cache grew, another sequence's cache, another top-k).
            let key = GraphKey {
                cache: cache.buffers().map(|b| buf_ptr(g, b)).collect(),
                capacity: cache.capacity,
                scores: buf_ptr(g, &w.scores),
                top_k: self.cpu.router_cfg().top_k,
            };
            if w.graph.as_ref().is_none_or(|(k, _)| *k != key) {
                // Drop the old graph first: its device memory goes back before the new capture.
                w.graph = None;
                match g.capture(|| self.queue_step(w, cache, &mut Vec::new())) {
                    Ok(graph) => w.graph = Some((key, graph)),
                    Err(e) => {
                        eprintln!("note: decoding without a CUDA graph (the capture failed: {e})");
                        w.graph_failed = true;
                    }
                }
            }
            if let Some((_, graph)) = &w.graph {
                graph.launch().map_err(cuda)?;
                from_table = (0..c.num_hidden_layers).filter(|&l| c.is_moe_layer(l)).collect();
                launched = true;
            }
        }
        if !launched {
            self.queue_step(w, cache, &mut from_table)?;
        }
        cache.len += 1;
        self.cpu.routed.count_forward();
        // The logits and every layer's choice, read back with one wait.
        g.download_pinned(&w.logits, &mut w.logits_out).map_err(cuda)?;
        g.download_pinned(&w.ids, &mut w.ids_out).map_err(cuda)?;
        g.download_pinned(&w.weights, &mut w.weights_out).map_err(cuda)?;
        g.synchronize().map_err(cuda)?;
        let logits = w.logits_out.as_slice().map_err(cuda)?.to_vec();
        let ids_host = w.ids_out.as_slice().map_err(cuda)?;
        let weights_host = w.weights_out.as_slice().map_err(cuda)?;
        let k = self.cpu.router_cfg().top_k;
        let mut routes = Vec::new();
        for l in (0..c.num_hidden_layers).filter(|&l| c.is_moe_layer(l)) {
            let off = l * MOE_MAX_K;
            let experts: Vec<usize> = ids_host[off..off + k].iter().map(|&e| e as usize).collect();
            routes.push((
                l,
                crate::moe::Routing {
                    experts,
                    weights: weights_host[off..off + k].to_vec(),
                },
            ));
        }
        if !from_table.is_empty() {
            // The uses of experts found through a table count as hits and keep them recent.
            let mut ex = lock(&self.experts, "GPU expert cache")?;
            for (l, r) in routes.iter().filter(|(l, _)| from_table.contains(l)) {
                for &e in &r.experts {
                    ex.cache.get(*l, e);
                }
            }
        }
        Ok((logits, routes))
    }
}

/// How the routed experts' down projections run (both give the same bits). The fused form,
/// each warp's slots four at a time with their loads in flight together, measured 39.1 µs
/// against the split form's 42.9 µs a layer (bench/NOTES.md, 2026-12-02 `decode_profile`).
const MOE_DOWN: MoeDown = MoeDown::Fused;

/// Most bytes of attention scores one MLA launch of a chunk may use (the chunk's tokens are
/// split into groups that stay within it).
const PREFILL_SCORE_BYTES: usize = 256 << 20;

/// The most bytes of decompressed keys and values (`kv_b_proj` over every cached position) a
/// prompt chunk's MLA may take in the decompressed form; a longer context takes the absorbed
/// form.
const DECOMPRESSED_KV_BYTES: usize = 1 << 30;

impl DeepseekV3Cuda {
    /// A chunk of `tokens` at the next positions of `cache`, every position computed with the
    /// bits of [`Self::forward_token`] (the same kernels' arithmetic per token), but each weight
    /// read once per chunk: projections as matrix-matrix products, MLA for every token in one
    /// launch, and the MoE expert-major: every expert chosen by some token of the chunk runs once
    /// on the rows of the tokens that chose it (gathered), its outputs scattered to their
    /// (token, slot), then each token's weighted sum in router order.
    fn forward_chunk(
        &self,
        cache: &mut GpuKvCache,
        tokens: &[u32],
        all_logits: bool,
    ) -> Result<BatchOutput, EngineError> {
        let c = &self.cpu.cfg;
        let n = tokens.len();
        EngineError::check_tokens(tokens, c.vocab_size)?;
        let g = &self.gpu;
        g.bind_to_thread().map_err(cuda)?;
        let t0 = cache.len;
        cache.reserve(t0 + n).map_err(cuda)?;
        let h = c.hidden_size;
        let emb = self.cpu.embed_tokens();
        let mut x_host = vec![0f32; n * h];
        for (t, &tok) in tokens.iter().enumerate() {
            emb.row_into(tok as usize, &mut x_host[t * h..(t + 1) * h]);
        }
        let mut cs_host = Vec::new();
        for t in 0..n {
            cs_host.extend(self.rope_table(t0 + t));
        }
        let mut x = g.upload(&x_host).map_err(cuda)?;
        let cs = g.upload(&cs_host).map_err(cuda)?;
        let mut routes: Vec<LayerRoutes> = vec![Vec::new(); n];
        let layers = &self.layers;
        decoder_layers(
            &**g,
            &mut x,
            n,
            (c.num_hidden_layers, c.rms_norm_eps),
            |l| (&layers[l].input_layernorm, &layers[l].post_attention_layernorm),
            |l, xn, out| {
                *out = self
                    .cpu
                    .routed
                    .time_attention(|| self.attention_chunk(l, xn, &cs, n, cache))
                    .map_err(cuda)?;
                Ok(())
            },
            |l, xn, x| {
                self.cpu.routed.time_mlp(|| -> Result<(), EngineError> {
                    match &layers[l].mlp {
                        Mlp::Moe { .. } => {
                            let rs = self.moe_chunk(l, xn, n, x)?;
                            for (t, r) in rs.into_iter().enumerate() {
                                routes[t].push((l, r));
                            }
                            Ok(())
                        }
                        Mlp::Dense { gate, up, down } => {
                            let out = swiglu_rows(&**g, [gate, up, down], xn, n).map_err(cuda)?;
                            g.add_into(x, &out).map_err(cuda)
                        }
                    }
                })
            },
        )?;
        cache.len += n;
        for _ in 0..n {
            self.cpu.routed.count_forward();
        }
        Ok(BatchOutput {
            logits: chunk_logits(&**g, x, n, all_logits, (&self.norm, c.rms_norm_eps), &self.lm_head).map_err(cuda)?,
            routes,
        })
    }

    /// MLA of layer `l` for the `n` tokens of a chunk (`xn: [n, hidden]` normalized, `cs` their
    /// RoPE rows), appending their latents and rope keys to `cache` at positions
    /// `cache.len ..`; returns `[n, hidden]`.
    fn attention_chunk(
        &self,
        l: usize,
        xn: &GpuBuf,
        cs: &GpuBuf,
        n: usize,
        cache: &mut GpuKvCache,
    ) -> Result<GpuBuf, CudaError> {
        let c = &self.cpu.cfg;
        let g = &self.gpu;
        let lw = &self.layers[l];
        let shape = self.mla_shape();
        let (nh, nope, rope, kvl) = (shape.n_heads, shape.nope, shape.rope, shape.kv_lora_rank);
        let qk = nope + rope;
        let half = cs.len() / (2 * n);
        let t0 = cache.len;
        let [cached_latents, cached_rope_keys] = cache.layer_mut(l);
        let mut q = g.zeros(n * nh * qk)?;
        match &lw.self_attn.q {
            QProj::Lora {
                q_a_proj,
                q_a_layernorm,
                q_b_proj,
            } => {
                let mut qa = g.zeros(n * q_a_proj.rows)?;
                q_a_proj.matmul(g, xn, n, &mut qa)?;
                let mut qan = g.zeros(n * q_a_proj.rows)?;
                g.rms_norm(&qa, q_a_layernorm, n, LATENT_NORM_EPS, false, &mut qan)?;
                q_b_proj.matmul(g, &qan, n, &mut q)?;
            }
            QProj::Full(q_proj) => q_proj.matmul(g, xn, n, &mut q)?,
        }
        g.rope_tokens(&mut q, n, nh, qk, nope, cs, half, self.cpu.rope.interleaved)?;
        let mut ckv = g.zeros(n * kvl)?;
        lw.self_attn.kv_a_latent.matmul(g, xn, n, &mut ckv)?;
        let mut latent = g.zeros(n * kvl)?;
        g.rms_norm(
            &ckv,
            &lw.self_attn.kv_a_layernorm,
            n,
            LATENT_NORM_EPS,
            false,
            &mut latent,
        )?;
        let mut k_pe = g.zeros(n * rope)?;
        lw.self_attn.kv_a_rope.matmul(g, xn, n, &mut k_pe)?;
        g.rope_tokens(&mut k_pe, n, 1, rope, 0, cs, half, self.cpu.rope.interleaved)?;
        g.copy_into(&latent, cached_latents, t0 * kvl)?;
        g.copy_into(&k_pe, cached_rope_keys, t0 * rope)?;
        let mut heads = g.zeros(n * nh * c.v_head_dim)?;
        let t = t0 + n;
        // The decompressed form where the batch form asks for it (`--batch-form fast`: the
        // CPU's rule, `MlaForm::decompressed_for`) and its keys and values fit
        // DECOMPRESSED_KV_BYTES; else the weight-absorbed form below, with decode's bits.
        let decompressed = self
            .cpu
            .routed
            .batch_form()
            .mla()
            .decompressed_for(&self.cpu.mla_shape(), n, t0)
            && g.mla_decompressed_fits(shape)
            && t * lw.self_attn.kv_b_proj.rows * 4 <= DECOMPRESSED_KV_BYTES;
        if decompressed {
            let latents = g.copy_range(cached_latents, 0, t * kvl)?;
            let mut kv = g.zeros(t * lw.self_attn.kv_b_proj.rows)?;
            lw.self_attn.kv_b_proj.matmul(g, &latents, t, &mut kv)?;
            g.mla_prefill_decompressed(
                shape,
                &q,
                &kv,
                cached_rope_keys,
                t0,
                n,
                self.cpu.softmax_scale,
                &mut heads,
            )?;
            let mut out = g.zeros(n * c.hidden_size)?;
            lw.self_attn.o_proj.matmul(g, &heads, n, &mut out)?;
            return Ok(out);
        }
        // Token groups whose MLA scratch fits PREFILL_SCORE_BYTES; each group a launch.
        let per_token = shape.scratch_len(t0 + n) * 4;
        let group = (PREFILL_SCORE_BYTES / per_token.max(1)).clamp(1, 65_535).min(n);
        let mut scores = g.zeros(group * shape.scratch_len(t0 + n))?;
        let mut j0 = 0;
        while j0 < n {
            let m = group.min(n - j0);
            let qg = g.copy_range(&q, j0 * nh * qk, m * nh * qk)?;
            let mut og = g.zeros(m * nh * c.v_head_dim)?;
            g.mla_prefill(
                MlaPrefillForm::best(shape),
                shape,
                &qg,
                cached_latents,
                cached_rope_keys,
                &lw.self_attn.kv_b_proj,
                t0 + j0,
                m,
                self.cpu.softmax_scale,
                &mut scores,
                &mut og,
            )?;
            g.copy_into(&og, &mut heads, j0 * nh * c.v_head_dim)?;
            j0 += m;
        }
        let mut out = g.zeros(n * c.hidden_size)?;
        lw.self_attn.o_proj.matmul(g, &heads, n, &mut out)?;
        Ok(out)
    }

    /// The MoE block of layer `l` for the `n` tokens of a chunk (`xn: [n, hidden]`), added to
    /// `x: [n, hidden]`; returns each token's routing. Router logits for the chunk in one
    /// product and one download; the union of chosen experts from the GPU expert cache (misses
    /// through the store); per expert: gather its tokens' rows, the three products, scatter the
    /// outputs to `y[token, slot]`; then each token's combine in router order
    /// ([`Gpu::moe_combine_tokens`], the one-token arithmetic).
    fn moe_chunk(
        &self,
        l: usize,
        xn: &GpuBuf,
        n: usize,
        x: &mut GpuBuf,
    ) -> Result<Vec<crate::moe::Routing>, EngineError> {
        let c = &self.cpu.cfg;
        let g = &self.gpu;
        let h = c.hidden_size;
        let Mlp::Moe { router, bias, shared } = &self.layers[l].mlp else {
            return Err(EngineError::Invalid(format!("layer {l} is not a MoE layer")));
        };
        let shared_out = match shared {
            Some([gt, u, d]) => Some(swiglu_rows(&*self.gpu, [gt, u, d], xn, n).map_err(cuda)?),
            None => None,
        };
        let e_n = router.rows;
        let mut logits = g.zeros(n * e_n).map_err(cuda)?;
        router.matmul(g, xn, n, &mut logits).map_err(cuda)?;
        // The device router, as in decoding (the same kernel, so the same choice and weights).
        let rs = self.router_shape();
        let k = rs.top_k;
        let mut ids_d = g.upload(&vec![0i32; n * k]).map_err(cuda)?;
        let mut w_d = g.zeros(n * k).map_err(cuda)?;
        g.route_noaux(rs, &logits, n, bias, &mut ids_d, &mut w_d, 0)
            .map_err(cuda)?;
        let routings = download_routings(g, l, &ids_d, &w_d, k, e_n)?;
        let em = ExpertMajor::new(&routings, k);
        let src_d = g.upload(&em.src).map_err(cuda)?;
        let experts = self.experts_of(l, &em.union)?;
        let mut y = g.zeros(n * k * h).map_err(cuda)?;
        if experts
            .iter()
            .all(|e| e.iter().all(|m| matches!(m.data, GpuMatData::Mxfp4 { .. })))
        {
            // MXFP4 experts (the default layout): every expert of the chunk in two launches,
            // the same bits as the per-expert path below.
            let refs: Vec<&[GpuMat; 3]> = experts.iter().map(|e| &**e).collect();
            grouped_swiglu_experts(g, &refs, &em, &src_d, xn, &mut y).map_err(cuda)?;
            g.moe_combine_tokens(&y, &w_d, k, h, n, shared_out.as_ref(), x)
                .map_err(cuda)?;
            return Ok(routings);
        }
        per_expert_rows(g, &experts, &em, &src_d, (xn, h), &mut y, |e, xe, rows| {
            swiglu_rows(&**g, [&e[0], &e[1], &e[2]], xe, rows)
        })
        .map_err(cuda)?;
        g.moe_combine_tokens(&y, &w_d, k, h, n, shared_out.as_ref(), x)
            .map_err(cuda)?;
        Ok(routings)
    }
}

impl FamilyModel for DeepseekV3Cuda {
    type State = GpuKvCache;

    fn config(&self) -> &ModelConfig {
        FamilyModel::config(&self.cpu)
    }

    fn new_state(&self) -> GpuKvCache {
        let c = &self.cpu.cfg;
        GpuLayerCache::new(
            self.gpu.clone(),
            c.num_hidden_layers,
            [c.kv_lora_rank, c.qk_rope_head_dim],
        )
    }

    fn step(&self, cache: &mut GpuKvCache, token: u32) -> Result<(Vec<f32>, LayerRoutes), EngineError> {
        self.forward_token(cache, token)
    }

    fn chunk(&self, cache: &mut GpuKvCache, tokens: &[u32], all_logits: bool) -> Result<BatchOutput, EngineError> {
        self.forward_chunk(cache, tokens, all_logits)
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
        self.experts.lock().ok().map(|c| c.cache.stats())
    }
}
