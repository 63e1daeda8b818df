//! The grouped-query-attention families on a CUDA device: Qwen3-MoE, Mixtral and gpt-oss, one
//! forward pass parameterised by what differs between them (per-head q/k norms, dense layers,
//! attention biases and sinks, windows per layer, the router's form and bias, SwiGLU or clamped
//! SwiGLU experts with biases), with the backbone resident in GPU memory, the KV cache on the
//! GPU, and the routed experts read through the same expert store (host cache, O_DIRECT reads,
//! traces) into the GPU expert cache and computed on the GPU.
//!
//! Per layer, as the CPU files (`qwen3_moe.rs`, `mixtral.rs`, `gpt_oss.rs`, the attention of
//! `gqa.rs`):
//! ```text
//! q, k, v = q_proj(xn) + bq, k_proj(xn) + bk, v_proj(xn) + bv   # xn = input_layernorm(x)
//! q, k = rope(q_norm(q)), rope(k_norm(k))          # norms: Qwen3 only          [GQA_ATTENTION]
//! h = x + o_proj(attn(q, K, V; window_l, sinks)) + bo   # biases, sinks: gpt-oss [ATTN_SINKS]
//! x = h + mlp(post_attention_layernorm(h))         # dense SwiGLU, or MoE
//! logits = lm_head(norm(x))
//! ```
//! MoE: Mixtral and Qwen3-MoE route softmax-then-top-k [SOFTMAX_TOPK] to SwiGLU experts; gpt-oss
//! routes biased logits top-k-then-softmax [TOPK_THEN_SOFTMAX] to clamped-SwiGLU experts with
//! biases [CLAMPED_SWIGLU]; no shared experts.
//!
//! Every step is a device operation: the projections as matrix products (`GpuMat::matmul`), the
//! per-head q/k RMSNorm as `rms_norm` over the `[tokens * heads, head_dim]` rows, rotate-half
//! RoPE (`rope_tokens`, cos/sin of each position computed on the host with the CPU's
//! arithmetic), the attention core (`gqa_attend`: window, ascending-position sums), the router
//! (`route_softmax_topk`: the CPU router's sequence of operations, so its choice), and the MoE
//! expert-major: every expert chosen by a token of the chunk runs once on the rows of the tokens
//! that chose it (gathered), its outputs are scattered to `(token, slot)`, and each token's
//! weighted sum runs in router order (`moe_combine_tokens`). What stays on the host: the
//! embedding rows (decoded from the backbone as the CPU does), the expert lookups (ids read back
//! once per MoE layer: misses are fetched through the store).
//!
//! One pass serves decoding and prefill: a single token is a chunk of one, and every kernel
//! computes a token of a chunk with the arithmetic it uses for that token alone, so a prompt
//! processed in chunks gives the bits of token-at-a-time decoding (logits and routing). SwiGLU
//! experts take shorter routes with the same bits: a single token's in two fused launches
//! (`moe_table`), a chunk's MXFP4 experts all in two grouped launches (`moe_grouped`), in place
//! of the per-expert gather, products and scatter.
//!
//! Numerics: f32 everywhere, fixed reduction orders (deltafin-cuda's kernels), so output is
//! deterministic run to run and agrees with the CPU path to f32 rounding (greedy ids equal,
//! logits within relative L2 1e-5 on the fixtures: `crates/deltafin/tests/cuda_fixtures.rs`).
//!
//! Not on the GPU here: Qwen3-Next (refused at load, device.rs), self-drafting, next-layer
//! expert prefetch, the CUDA-graph decode step of the DeepSeek path.

use std::sync::{Arc, Mutex};

use deltafin_cuda::{
    CudaError, CudaSlice, ExpertTable, Gpu, GpuBuf, GpuMat, GpuMatData, GqaShape, MoeDown, SoftmaxRouter, MOE_MAX_K,
};
use deltafin_format::model_dir::Backbone;
use deltafin_format::{ModelConfig, ModelDir};
use deltafin_kernels::MatRef;

use crate::compute::{chunk_logits, decoder_layers, swiglu_rows, Backend};
use crate::device::GpuOptions;
use crate::experts::Expert;
use crate::experts::StoreOptions;
use crate::gpu_experts::{GpuCacheStats, GpuExpertCache};
use crate::gqa::{GqaAttention, GqaNames};
use crate::model::{BatchOutput, CausalLm, FamilyModel, LayerRoutes, RoutedExperts};
use crate::models::gpu_fetch::{
    cuda, download_routings, fetch_gpu_experts_with, gpu_expert_budget, grouped_swiglu_experts, lock, open_gpu_for,
    per_expert_rows, preload_in_file_order, ExpertMajor, GpuLayerCache,
};
use crate::moe::Routing;
use crate::EngineError;

/// Checkpoint names of one decoder layer of a GQA family, digested from its CPU model.
pub struct GqaLayerSpec {
    /// `input_layernorm.weight [hidden]`.
    pub input_layernorm: String,
    /// `post_attention_layernorm.weight [hidden]`.
    pub post_attention_layernorm: String,
    /// The attention's tensors (norms, biases, sinks, the layer's window).
    pub attn: GqaNames,
    /// The feed-forward block.
    pub mlp: MlpSpec,
}

/// The feed-forward block of one layer.
pub enum MlpSpec {
    /// A dense SwiGLU MLP: `gate_proj`, `up_proj`, `down_proj` (Qwen3-MoE's `mlp_only_layers`).
    Dense([String; 3]),
    /// A routed MoE block with this router matrix `[n_experts, hidden]` (and bias `[n_experts]`,
    /// gpt-oss) and the family's experts ([`GqaFamily::expert_kind`]).
    Moe {
        /// The router weight.
        router: String,
        /// The router bias, added to the logits.
        router_bias: Option<String>,
    },
}

/// What a routed expert computes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ExpertKind {
    /// `down(silu(gate x) * up x)` from a record `[gate_proj, up_proj, down_proj]` (Mixtral,
    /// Qwen3-MoE).
    SwiGlu,
    /// gpt-oss' clamped SwiGLU with biases from a record `[gate_up_proj (interleaved),
    /// gate_up_proj_bias, down_proj, down_proj_bias]` ([CLAMPED_SWIGLU]).
    ClampedSwiGlu {
        /// The gate's sigmoid slope (`swiglu_alpha`).
        alpha: f32,
        /// The clamp (`swiglu_limit`).
        limit: f32,
    },
}

impl ExpertKind {
    /// Parts of one expert record.
    fn parts(self) -> usize {
        match self {
            ExpertKind::SwiGlu => 3,
            ExpertKind::ClampedSwiGlu { .. } => 4,
        }
    }
}

/// One routed expert on the device: every part of its record, in record order (f32 parts as
/// `[1, width]` f32 matrices).
type GqaExpert = Arc<Vec<GpuMat>>;

/// The f32 storage of a `[1, width]` part (an expert bias).
fn f32_part(m: &GpuMat) -> Result<&GpuBuf, CudaError> {
    match &m.data {
        GpuMatData::F32(b) => Ok(b),
        _ => Err(CudaError::Shape(format!(
            "an expert bias [{}, {}] is not stored f32",
            m.rows, m.cols
        ))),
    }
}

/// What the GPU pass needs from a GQA family's CPU model (which loads and checks the backbone,
/// opens the expert store, and stays the reference).
pub trait GqaFamily: CausalLm {
    /// The resident backbone.
    fn backbone(&self) -> &Backbone;
    /// `model.embed_tokens.weight [vocab_size, hidden]` (resolved at load).
    fn embed_tokens(&self) -> MatRef<'_>;
    /// The attention block's shape and RoPE.
    fn attention(&self) -> &GqaAttention;
    /// Every layer's names and block kinds, in order.
    fn layer_specs(&self) -> Vec<GqaLayerSpec>;
    /// The router of the MoE layers.
    fn softmax_router(&self) -> SoftmaxRouter;
    /// eps of the decoder's RMSNorms.
    fn rms_norm_eps(&self) -> f32;
    /// What a routed expert computes.
    fn expert_kind(&self) -> ExpertKind {
        ExpertKind::SwiGlu
    }
}

/// One layer's backbone on the GPU (names as in the checkpoint).
struct GpuLayer {
    input_layernorm: GpuBuf,
    post_attention_layernorm: GpuBuf,
    q_proj: GpuMat,
    k_proj: GpuMat,
    v_proj: GpuMat,
    o_proj: GpuMat,
    /// Per-head RMSNorm weights `[head_dim]` (Qwen3).
    q_norm: Option<GpuBuf>,
    k_norm: Option<GpuBuf>,
    /// Projection biases q, k, v, o (gpt-oss).
    biases: Option<Box<[GpuBuf; 4]>>,
    /// Per-head sink logits `[n_heads]` (gpt-oss). [ATTN_SINKS]
    sinks: Option<GpuBuf>,
    /// The layer's attention window.
    window: Option<usize>,
    mlp: Mlp,
}

enum Mlp {
    Dense(Box<[GpuMat; 3]>),
    Moe { router: GpuMat, bias: Option<GpuBuf> },
}

/// The KV cache of every layer in GPU memory: per layer the rotated, normed keys and the values,
/// `[capacity, n_kv_heads * head_dim]` each.
pub type GpuGqaCache = GpuLayerCache;

/// A one-token MoE block's device work ([`Gpu::moe_table`]): the token's experts by slot,
/// the slot ids `0..MOE_MAX_K`, the intermediates `[MOE_MAX_K, inter]`.
struct SlotTable {
    table: ExpertTable,
    slot_ids: CudaSlice<i32>,
    h: GpuBuf,
    inter: usize,
}

/// Most bytes of attention scores one `gqa_attend` launch of a chunk may use (the chunk's
/// tokens are split into groups that stay within it).
const PREFILL_SCORE_BYTES: usize = 256 << 20;

/// A GQA family (Qwen3-MoE, Mixtral, gpt-oss) with its forward pass on a CUDA device (see the module
/// docs).
pub struct GqaCuda {
    cpu: Box<dyn GqaFamily>,
    gpu: Arc<Gpu>,
    layers: Vec<GpuLayer>,
    norm: GpuBuf,
    lm_head: GpuMat,
    router: SoftmaxRouter,
    expert_kind: ExpertKind,
    eps: f32,
    /// Routed experts resident on the device (the tier above the host cache).
    experts: Mutex<GpuExpertCache<GqaExpert>>,
    /// The one-token MoE path's table (made at the first decode step, for the experts' shape).
    slots: Mutex<Option<SlotTable>>,
}

impl GqaCuda {
    /// Loads the model in `dir` (Qwen3-MoE, Mixtral or gpt-oss) as its CPU family does, then opens
    /// `cuda:ordinal`, uploads the backbone and sizes the GPU expert cache: `gpu_opts.budget`
    /// bytes, or by default what the device has free after the backbone less
    /// [`GPU_MARGIN_BYTES`](crate::models::gpu_fetch::GPU_MARGIN_BYTES); with `gpu_opts.preload` fills it in file order.
    ///
    /// Errors: everything the CPU family's load refuses; another family; no such device; a
    /// backbone larger than the device memory (both sizes named); a budget larger than the free
    /// memory after the backbone (both named); a top-k above [`MOE_MAX_K`]; a driver or NVRTC
    /// failure.
    pub fn load_with(
        dir: &ModelDir,
        opts: StoreOptions,
        ordinal: usize,
        gpu_opts: GpuOptions,
    ) -> Result<Self, EngineError> {
        let cpu: Box<dyn GqaFamily> = match &dir.manifest.config {
            ModelConfig::Qwen3Moe(_) => Box::new(crate::models::Qwen3Moe::load_with(dir, opts)?),
            ModelConfig::Mixtral(_) => Box::new(crate::models::Mixtral::load_with(dir, opts)?),
            ModelConfig::GptOss(_) => Box::new(crate::models::GptOss::load_with(dir, opts)?),
            other => {
                return Err(EngineError::Invalid(format!(
                    "the {} family has no grouped-query-attention GPU path",
                    other.family()
                )))
            }
        };
        let k = cpu.routed().experts_per_token();
        if k > MOE_MAX_K {
            return Err(EngineError::Invalid(format!(
                "the CUDA path routes at most {MOE_MAX_K} experts a token (this model: {k})"
            )));
        }
        let backbone = cpu.backbone_bytes() as u64;
        let gpu = open_gpu_for(ordinal, backbone, &cpu.routed().store)?;
        let bb = cpu.backbone();
        let up = |name: &str| -> Result<GpuMat, EngineError> { GpuMat::upload(&gpu, &bb.matrix(name)?).map_err(cuda) };
        let vec = |name: &str| -> Result<GpuBuf, EngineError> { gpu.upload(bb.vector(name)?).map_err(cuda) };
        let opt_vec =
            |name: &Option<String>| -> Result<Option<GpuBuf>, EngineError> { name.as_deref().map(vec).transpose() };
        let mut layers = Vec::new();
        for s in cpu.layer_specs() {
            let a = &s.attn;
            let biases = match &a.biases {
                Some([bq, bk, bv, bo]) => Some(Box::new([vec(bq)?, vec(bk)?, vec(bv)?, vec(bo)?])),
                None => None,
            };
            layers.push(GpuLayer {
                input_layernorm: vec(&s.input_layernorm)?,
                post_attention_layernorm: vec(&s.post_attention_layernorm)?,
                q_proj: up(&a.q_proj)?,
                k_proj: up(&a.k_proj)?,
                v_proj: up(&a.v_proj)?,
                o_proj: up(&a.o_proj)?,
                q_norm: opt_vec(&a.q_norm)?,
                k_norm: opt_vec(&a.k_norm)?,
                biases,
                sinks: opt_vec(&a.sinks)?,
                window: a.sliding_window.or(cpu.attention().dims.sliding_window),
                mlp: match &s.mlp {
                    MlpSpec::Dense([g, u, d]) => Mlp::Dense(Box::new([up(g)?, up(u)?, up(d)?])),
                    MlpSpec::Moe { router, router_bias } => Mlp::Moe {
                        router: up(router)?,
                        bias: opt_vec(router_bias)?,
                    },
                },
            });
        }
        let norm = vec("model.norm.weight")?;
        let lm_head = up("lm_head.weight")?;
        let budget = gpu_expert_budget(&gpu, ordinal, gpu_opts.budget, backbone)?;
        let (router, expert_kind, eps) = (cpu.softmax_router(), cpu.expert_kind(), cpu.rms_norm_eps());
        let model = Self {
            cpu,
            gpu,
            layers,
            norm,
            lm_head,
            router,
            expert_kind,
            eps,
            experts: Mutex::new(GpuExpertCache::new(budget)),
            slots: Mutex::new(None),
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
        let record = self.cpu.routed().store.record_bytes();
        let layers = self.layers.iter().enumerate().filter_map(|(l, lw)| match &lw.mlp {
            Mlp::Moe { router, .. } => Some((l, router.rows)),
            Mlp::Dense(_) => None,
        });
        let room = || lock(&self.experts, "GPU expert cache").map(|c| c.stats().records_free(record));
        preload_in_file_order(layers, room, |l, ids| Ok(self.experts_of(l, ids)?.len()))
    }

    /// The device copies of experts `ids` of layer `l`, in that order
    /// ([`fetch_gpu_experts_with`]: every part of each record).
    fn experts_of(&self, l: usize, ids: &[usize]) -> Result<Vec<GqaExpert>, EngineError> {
        let mut cache = lock(&self.experts, "GPU expert cache")?;
        let parts = self.expert_kind.parts();
        let upload = |record: &Expert| -> Result<(GqaExpert, u64), CudaError> {
            let mats = (0..parts)
                .map(|i| GpuMat::upload(&self.gpu, &record.matrix(i)))
                .collect::<Result<Vec<_>, _>>()?;
            let bytes = mats.iter().map(|m| m.nbytes() as u64).sum();
            Ok((Arc::new(mats), bytes))
        };
        fetch_gpu_experts_with(&self.gpu, &mut cache, self.cpu.routed(), l, ids, &upload, &mut |_| {
            Ok(())
        })
    }

    /// RoPE cos/sin of `pos` over the head, `[cos[half], sin[half]]`, with the CPU's arithmetic
    /// (`RotaryEmbedding::apply`: the angle in f32, cos and sin times the attention factor).
    fn rope_row(&self, pos: usize, out: &mut Vec<f32>) {
        let r = self.cpu.attention().rope();
        let half = r.inv_freq.len();
        let p = pos as f32;
        let start = out.len();
        out.resize(start + 2 * half, 0.0);
        for i in 0..half {
            let (s, c) = (p * r.inv_freq[i]).sin_cos();
            out[start + i] = c * r.attention_factor;
            out[start + half + i] = s * r.attention_factor;
        }
    }

    /// The `n` tokens of a chunk at the next positions of `cache` (a single token is a chunk of
    /// one; see the module docs): returns the logits of every position (`all_logits`) or of the
    /// last, and every position's routing.
    ///
    /// Errors: a token outside the vocabulary; expert read or checksum failures; a driver error.
    fn forward_chunk(
        &self,
        cache: &mut GpuGqaCache,
        tokens: &[u32],
        all_logits: bool,
    ) -> Result<BatchOutput, EngineError> {
        let n = tokens.len();
        if n == 0 {
            return Ok(BatchOutput::default());
        }
        let vocab = self.cpu.vocab_size();
        EngineError::check_tokens(tokens, vocab)?;
        let g = &self.gpu;
        g.bind_to_thread().map_err(cuda)?;
        let t0 = cache.len;
        cache.reserve(t0 + n).map_err(cuda)?;
        let h = self.cpu.attention().dims.hidden;
        // x = embed_tokens(tokens): [n, hidden]
        let emb = self.cpu.embed_tokens();
        let mut x_host = vec![0f32; n * h];
        for (row, &tok) in x_host.chunks_exact_mut(h).zip(tokens) {
            emb.row_into(tok as usize, row);
        }
        // cs: [n, head_dim], each position's [cos, sin]
        let mut cs_host = Vec::new();
        for t in 0..n {
            self.rope_row(t0 + t, &mut cs_host);
        }
        let mut x = g.upload(&x_host).map_err(cuda)?;
        let cs = g.upload(&cs_host).map_err(cuda)?;
        let routed = self.cpu.routed();
        let mut routes: Vec<LayerRoutes> = vec![Vec::new(); n];
        let layers = &self.layers;
        decoder_layers(
            &**g,
            &mut x,
            n,
            (layers.len(), self.eps),
            |l| (&layers[l].input_layernorm, &layers[l].post_attention_layernorm),
            |l, xn, out| {
                *out = routed
                    .time_attention(|| self.attention(l, xn, &cs, n, cache))
                    .map_err(cuda)?;
                Ok(())
            },
            |l, xn, x| {
                routed.time_mlp(|| -> Result<(), EngineError> {
                    match &layers[l].mlp {
                        Mlp::Moe { router, bias } => {
                            let rs = self.moe_chunk(l, router, bias.as_ref(), xn, n, x)?;
                            for (t, r) in rs.into_iter().enumerate() {
                                routes[t].push((l, r));
                            }
                            Ok(())
                        }
                        Mlp::Dense(m) => {
                            let [gate, up, down] = &**m;
                            let out = swiglu_rows(&**g, [gate, up, down], xn, n).map_err(cuda)?;
                            g.add_into(x, &out).map_err(cuda)
                        }
                    }
                })
            },
        )?;
        cache.len += n;
        for _ in 0..n {
            routed.count_forward();
        }
        // logits = lm_head(norm(x)) of the last position, or of every position
        Ok(BatchOutput {
            logits: chunk_logits(&**g, x, n, all_logits, (&self.norm, self.eps), &self.lm_head).map_err(cuda)?,
            routes,
        })
    }

    /// Attention of layer `l` for the `n` tokens of a chunk (`xn: [n, hidden]` normalised, `cs`
    /// their RoPE rows), appending their keys and values to `cache` at positions
    /// `cache.len ..`; returns `[n, hidden]`.
    fn attention(
        &self,
        l: usize,
        xn: &GpuBuf,
        cs: &GpuBuf,
        n: usize,
        cache: &mut GpuGqaCache,
    ) -> Result<GpuBuf, CudaError> {
        let g = &self.gpu;
        let lw = &self.layers[l];
        let at = self.cpu.attention();
        let d = &at.dims;
        let (nh, nkv, hd) = (d.n_heads, d.n_kv_heads, d.head_dim);
        let kvd = nkv * hd;
        let t0 = cache.len;
        let [k_cache, v_cache] = cache.layer_mut(l);
        // q: [n, nh, hd], k, v: [n, nkv, hd]
        let mut q = g.zeros(n * nh * hd)?;
        let mut k = g.zeros(n * kvd)?;
        let mut v = g.zeros(n * kvd)?;
        lw.q_proj.matmul(g, xn, n, &mut q)?;
        lw.k_proj.matmul(g, xn, n, &mut k)?;
        lw.v_proj.matmul(g, xn, n, &mut v)?;
        if let Some(b) = &lw.biases {
            g.add_bias_rows(&mut q, &b[0], n)?;
            g.add_bias_rows(&mut k, &b[1], n)?;
            g.add_bias_rows(&mut v, &b[2], n)?;
        }
        // Qwen3: RMSNorm over each head's head_dim, before RoPE.
        if let Some(w) = &lw.q_norm {
            let mut qn = g.zeros(n * nh * hd)?;
            g.rms_norm(&q, w, n * nh, at.qk_norm_eps(), false, &mut qn)?;
            q = qn;
        }
        if let Some(w) = &lw.k_norm {
            let mut kn = g.zeros(n * kvd)?;
            g.rms_norm(&k, w, n * nkv, at.qk_norm_eps(), false, &mut kn)?;
            k = kn;
        }
        // Rotate-half RoPE over the whole head: pairs (i, i + hd/2).
        let half = at.rope().inv_freq.len();
        g.rope_tokens(&mut q, n, nh, hd, 0, cs, half, false)?;
        g.rope_tokens(&mut k, n, nkv, hd, 0, cs, half, false)?;
        g.copy_into(&k, k_cache, t0 * kvd)?;
        g.copy_into(&v, v_cache, t0 * kvd)?;
        let shape = GqaShape {
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: hd,
            window: lw.window,
        };
        // Token groups whose score scratch fits PREFILL_SCORE_BYTES; each group a launch.
        let per_token = nh * shape.span(t0, n) * 4;
        let group = (PREFILL_SCORE_BYTES / per_token.max(1)).clamp(1, 65_535).min(n);
        let mut scratch = g.zeros(group * nh * shape.span(t0, n))?;
        let mut ctx = g.zeros(n * nh * hd)?;
        if group == n {
            g.gqa_attend(
                shape,
                &q,
                k_cache,
                v_cache,
                t0,
                n,
                at.scale(),
                lw.sinks.as_ref(),
                &mut scratch,
                &mut ctx,
            )?;
        } else {
            let mut j0 = 0;
            while j0 < n {
                let m = group.min(n - j0);
                let qg = g.copy_range(&q, j0 * nh * hd, m * nh * hd)?;
                let mut og = g.zeros(m * nh * hd)?;
                g.gqa_attend(
                    shape,
                    &qg,
                    k_cache,
                    v_cache,
                    t0 + j0,
                    m,
                    at.scale(),
                    lw.sinks.as_ref(),
                    &mut scratch,
                    &mut og,
                )?;
                g.copy_into(&og, &mut ctx, j0 * nh * hd)?;
                j0 += m;
            }
        }
        let mut out = g.zeros(n * d.hidden)?;
        lw.o_proj.matmul(g, &ctx, n, &mut out)?;
        if let Some(b) = &lw.biases {
            g.add_bias_rows(&mut out, &b[3], n)?;
        }
        Ok(out)
    }

    /// One routed expert on `n` rows `x: [n, hidden]` → `[n, hidden]` ([`ExpertKind`]).
    fn expert_rows(&self, e: &[GpuMat], x: &GpuBuf, n: usize) -> Result<GpuBuf, CudaError> {
        let g = &self.gpu;
        match (self.expert_kind, e) {
            (ExpertKind::SwiGlu, [gate, up, down]) => swiglu_rows(&*self.gpu, [gate, up, down], x, n),
            (ExpertKind::ClampedSwiGlu { alpha, limit }, [gate_up, gu_bias, down, down_bias]) => {
                // gu: [n, 2I] interleaved gate/up; h: [n, I]; out: [n, hidden]
                let mut gu = g.zeros(n * gate_up.rows)?;
                gate_up.matmul(g, x, n, &mut gu)?;
                let mut hh = g.zeros(n * down.cols)?;
                g.clamped_swiglu(&gu, f32_part(gu_bias)?, n, alpha, limit, &mut hh)?;
                let mut out = g.zeros(n * down.rows)?;
                down.matmul(g, &hh, n, &mut out)?;
                g.add_bias_rows(&mut out, f32_part(down_bias)?, n)?;
                Ok(out)
            }
            (kind, parts) => Err(CudaError::Shape(format!(
                "a {kind:?} expert with {} parts",
                parts.len()
            ))),
        }
    }

    /// The routed SwiGLU experts of one token, `experts[j]` in slot `j` with weight `w[j]`,
    /// added to `x: [hidden]` ([`Gpu::moe_table`]: gate/up with SiLU in one launch, the
    /// down projections and the weighted sum from zero in slot order with the residual add in
    /// another; the bits of the expert-major path's `swiglu` products and
    /// `moe_combine_tokens` for that token, as the DeepSeek path's decode and prefill agree).
    fn moe_one_token(
        &self,
        experts: &[GqaExpert],
        w: &GpuBuf,
        k: usize,
        xn: &GpuBuf,
        x: &mut GpuBuf,
    ) -> Result<(), CudaError> {
        let g = &self.gpu;
        let refs = experts
            .iter()
            .map(|e| <&[GpuMat; 3]>::try_from(&e[..]))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|_| CudaError::Shape("a SwiGLU expert record without three matrices".into()))?;
        let (Some(first), true) = (refs.first(), refs.len() == k) else {
            return Err(CudaError::Shape(format!("{} experts for {k} slots", refs.len())));
        };
        let (inter, hidden) = (first[0].rows, first[0].cols);
        let mut guard = self
            .slots
            .lock()
            .map_err(|_| CudaError::Shape("MoE slot table lock poisoned".into()))?;
        if guard.as_ref().is_none_or(|s| s.inter != inter) {
            *guard = Some(SlotTable {
                table: g.expert_table(MOE_MAX_K, inter, hidden)?,
                slot_ids: g.upload(&(0..MOE_MAX_K as i32).collect::<Vec<_>>())?,
                h: g.zeros(MOE_MAX_K * inter)?,
                inter,
            });
        }
        let Some(st) = guard.as_mut() else {
            return Err(CudaError::Shape("MoE slot table missing".into()));
        };
        st.table.set(g, 0, &refs)?;
        g.moe_table(
            MoeDown::Fused,
            &st.table,
            &st.slot_ids.slice(..k),
            &w.slice(..k),
            k,
            xn,
            &mut st.h,
            None,
            x,
        )
    }

    /// The MoE block of layer `l` for the `n` tokens of a chunk (`xn: [n, hidden]`), added to
    /// `x: [n, hidden]`; returns each token's routing. Router logits for the chunk in one
    /// product, the router on the device ([`Gpu::route_softmax_topk`]), the ids and weights read
    /// back once; the union of chosen experts from the GPU expert cache (misses through the
    /// store); per expert: gather its tokens' rows, the SwiGLU, scatter the outputs to
    /// `y[token, slot]`; then each token's weighted sum in router order
    /// ([`Gpu::moe_combine_tokens`]: from zero, ascending expert id, then the residual add: the
    /// CPU's `RoutedExperts::run` arithmetic).
    #[allow(clippy::too_many_arguments)]
    fn moe_chunk(
        &self,
        l: usize,
        router: &GpuMat,
        bias: Option<&GpuBuf>,
        xn: &GpuBuf,
        n: usize,
        x: &mut GpuBuf,
    ) -> Result<Vec<Routing>, EngineError> {
        let g = &self.gpu;
        let h = xn.len() / n;
        let e_n = router.rows;
        let k = self.cpu.routed().experts_per_token();
        if k == 0 || k > MOE_MAX_K || k > e_n {
            return Err(EngineError::Invalid(format!(
                "layer {l}: the CUDA router takes 1 to {} experts a token (asked {k})",
                MOE_MAX_K.min(e_n)
            )));
        }
        // logits: [n, E]
        let mut logits = g.zeros(n * e_n).map_err(cuda)?;
        router.matmul(g, xn, n, &mut logits).map_err(cuda)?;
        if let Some(b) = bias {
            g.add_bias_rows(&mut logits, b, n).map_err(cuda)?;
        }
        let mut probs = g.zeros(n * e_n).map_err(cuda)?;
        let mut ids_d = g.upload(&vec![0i32; n * k]).map_err(cuda)?;
        let mut w_d = g.zeros(n * k).map_err(cuda)?;
        g.route_softmax_topk(self.router, &logits, n, e_n, k, &mut probs, &mut ids_d, &mut w_d)
            .map_err(cuda)?;
        let routings = download_routings(g, l, &ids_d, &w_d, k, e_n)?;
        let em = ExpertMajor::new(&routings, k);
        let src_d = g.upload(&em.src).map_err(cuda)?;
        let experts = self.experts_of(l, &em.union)?;
        // The fused launches read each slot's intermediate row with 16-byte loads: a width that
        // is a multiple of 4 floats keeps every row aligned.
        let aligned = experts.first().is_some_and(|e| e[0].rows % 4 == 0);
        if n == 1 && self.expert_kind == ExpertKind::SwiGlu && aligned {
            // One token: its experts (ascending id = router order = `experts`) in two launches.
            self.moe_one_token(&experts, &w_d, k, xn, x).map_err(cuda)?;
            drop(experts);
            return Ok(routings);
        }
        // y: [n, k, hidden], every (token, slot) written by its expert.
        let mut y = g.zeros(n * k * h).map_err(cuda)?;
        let mxfp4 = experts
            .iter()
            .all(|e| e.iter().all(|m| matches!(m.data, GpuMatData::Mxfp4 { .. })));
        if self.expert_kind == ExpertKind::SwiGlu && mxfp4 && aligned {
            // MXFP4 SwiGLU experts (the default layout): every expert of the chunk in two
            // launches (`Gpu::moe_grouped`), the bits of the per-expert path below.
            let refs = experts
                .iter()
                .map(|e| <&[GpuMat; 3]>::try_from(&e[..]))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|_| EngineError::Invalid("a SwiGLU expert record without three matrices".into()))?;
            grouped_swiglu_experts(g, &refs, &em, &src_d, xn, &mut y).map_err(cuda)?;
            g.moe_combine_tokens(&y, &w_d, k, h, n, None, x).map_err(cuda)?;
            drop(experts);
            return Ok(routings);
        }
        per_expert_rows(g, &experts, &em, &src_d, (xn, h), &mut y, |e, xe, rows| {
            self.expert_rows(e, xe, rows)
        })
        .map_err(cuda)?;
        g.moe_combine_tokens(&y, &w_d, k, h, n, None, x).map_err(cuda)?;
        // `experts` (and the device memory of any evicted among them) is released after the
        // launches above in stream order.
        drop(experts);
        Ok(routings)
    }
}

impl FamilyModel for GqaCuda {
    type State = GpuGqaCache;

    fn config(&self) -> &ModelConfig {
        self.cpu.config()
    }

    fn new_state(&self) -> GpuGqaCache {
        let d = &self.cpu.attention().dims;
        let kv_dim = d.n_kv_heads * d.head_dim;
        GpuLayerCache::new(self.gpu.clone(), self.layers.len(), [kv_dim, kv_dim])
    }

    /// A decode step is a chunk of one.
    fn step(&self, cache: &mut GpuGqaCache, token: u32) -> Result<(Vec<f32>, LayerRoutes), EngineError> {
        let mut out = self.forward_chunk(cache, &[token], false)?;
        match (out.logits.pop(), out.routes.pop()) {
            (Some(logits), Some(routes)) => Ok((logits, routes)),
            _ => Err(EngineError::Invalid("a one-token GPU pass returned no logits".into())),
        }
    }

    fn chunk(&self, cache: &mut GpuGqaCache, tokens: &[u32], all_logits: bool) -> Result<BatchOutput, EngineError> {
        self.forward_chunk(cache, tokens, all_logits)
    }

    fn batch_bytes_per_token(&self) -> usize {
        self.cpu.batch_bytes_per_token()
    }

    fn routed(&self) -> &RoutedExperts {
        self.cpu.routed()
    }

    fn routed_mut(&mut self) -> &mut RoutedExperts {
        self.cpu.routed_mut()
    }

    fn backbone_bytes(&self) -> usize {
        self.cpu.backbone_bytes()
    }

    fn gpu_cache_stats(&self) -> Option<GpuCacheStats> {
        self.experts.lock().ok().map(|c| c.stats())
    }
}
