//! DeepSeek-V3 / Kimi K2 forward pass, one token at a time, matching transformers'
//! `models/deepseek_v3/modeling_deepseek_v3.py` in f32.
//!
//! Per decoder layer (PyTorch equivalent in the comments):
//! ```text
//! h = x + self_attn(input_layernorm(x))           # MLA, latent KV cache
//! x = h + mlp(post_attention_layernorm(h))        # dense MLP below first_k_dense_replace, else MoE
//! ```
//! then `logits = lm_head(norm(x))`.
//!
//! MLA (DeepSeek-V2 paper §2.1, arXiv:2405.04434) runs in its weight-absorbed form: the KV cache
//! holds, per position, the normalised latent `c_kv: [kv_lora_rank]` and the rotated shared key
//! `k_pe: [qk_rope_head_dim]`, never per-head keys and values. For head h,
//! `q_nope_h · (W_UK_h c_t) = (W_UK_h^T q_nope_h) · c_t` and `Σ_t p_t W_UV_h c_t = W_UV_h Σ_t p_t c_t`,
//! which equal the reference's expanded form up to f32 summation order. [MLA_ABSORB]
//!
//! Weights: every tensor is resolved once at load into `Weights` (handles named as in the
//! checkpoint; a missing or malformed tensor fails there with its name) and read with the
//! infallible [`Backbone::mat`] / [`Backbone::vec`]: a forward pass looks nothing up by name.

use deltafin_format::{DeepseekV3Config, ModelConfig, ModelDir, Rope};
use deltafin_kernels::MatRef;

use crate::blocks::mla::{mla_chunk_layer, mla_token, MlaShape, MlaTensorNames, MlaTensors, MlaVariant};
use crate::compute::{chunk_logits, decoder_layers, on_cpu, Cpu};
use crate::experts::StoreOptions;
use crate::model::{
    add_into, gather_rows, swiglu, swiglu_batch, BatchOutput, DecodeState, FamilyModel, GluTensorNames, GluTensors,
    LayerRoutes, RoutedExperts,
};
use crate::models::decoder::DecoderWeights;
use crate::models::family_config;
use crate::moe::{route, route_masked, RouterConfig, Routing};
use crate::rope::{yarn_mscale, RotaryEmbedding};
use crate::EngineError;

use deltafin_format::model_dir::{Backbone, MatHandle, VecHandle};

pub(crate) use crate::blocks::mla::LATENT_NORM_EPS;

/// Tensor names of one decoder layer, as in the Hugging Face checkpoint.
pub(crate) struct LayerNames {
    pub(crate) input_layernorm: String,
    pub(crate) post_attention_layernorm: String,
    /// `self_attn.*`.
    pub(crate) self_attn: MlaTensorNames,
    /// `mlp.{gate,up,down}_proj` of a dense layer.
    pub(crate) mlp: GluTensorNames,
    pub(crate) router: String,
    pub(crate) router_bias: String,
    /// `mlp.shared_experts.{gate,up,down}_proj` of an MoE layer.
    pub(crate) shared_experts: GluTensorNames,
}

impl LayerNames {
    pub(crate) fn new(l: usize) -> Self {
        let p = format!("model.layers.{l}");
        let m = format!("{p}.mlp");
        LayerNames {
            input_layernorm: format!("{p}.input_layernorm.weight"),
            post_attention_layernorm: format!("{p}.post_attention_layernorm.weight"),
            self_attn: MlaTensorNames::new(&format!("{p}.self_attn")),
            mlp: GluTensorNames::new(&m),
            router: format!("{m}.gate.weight"),
            router_bias: format!("{m}.gate.e_score_correction_bias"),
            shared_experts: GluTensorNames::new(&format!("{m}.shared_experts")),
        }
    }
}

/// Every weight of the forward pass, resolved in the backbone once at load ([`resolve`]): MLA
/// token mixers and dense / MoE feed-forward blocks.
pub(crate) type Weights = DecoderWeights<MlaTensors, Mlp>;

/// One layer's `mlp`.
pub(crate) enum Mlp {
    /// `DeepseekV3MLP` (layers below `first_k_dense_replace`): `mlp.{gate,up,down}_proj`.
    Dense(GluTensors),
    /// `DeepseekV3MoE`: the routed experts come from the expert store.
    Moe {
        /// The router `mlp.gate.weight [n_routed_experts, hidden]`.
        gate: MatHandle,
        /// `mlp.gate.e_score_correction_bias [n_routed_experts]`.
        e_score_correction_bias: VecHandle,
        /// `mlp.shared_experts.{gate,up,down}_proj` (None when `n_shared_experts` is 0).
        shared_experts: Option<GluTensors>,
    },
}

/// Resolves every tensor the forward pass of `cfg` reads, named by `names`, in `bb`.
///
/// Errors: a missing or malformed tensor (named).
fn resolve(bb: &Backbone, cfg: &DeepseekV3Config, names: &[LayerNames]) -> Result<Weights, EngineError> {
    let norms = |l: usize| {
        (
            names[l].input_layernorm.as_str(),
            names[l].post_attention_layernorm.as_str(),
        )
    };
    let variant = MlaVariant {
        q_lora: cfg.q_lora_rank.is_some(),
        output_gate: false,
    };
    Weights::resolve(bb, names.len(), norms, |l| {
        let n = &names[l];
        let self_attn = MlaTensors::resolve(bb, &n.self_attn, variant)?;
        let mlp = if cfg.is_moe_layer(l) {
            Mlp::Moe {
                gate: bb.matrix_handle(&n.router)?,
                e_score_correction_bias: bb.vector_handle(&n.router_bias)?,
                shared_experts: (cfg.n_shared_experts > 0)
                    .then(|| GluTensors::resolve(bb, &n.shared_experts))
                    .transpose()?,
            }
        } else {
            Mlp::Dense(GluTensors::resolve(bb, &n.mlp)?)
        };
        Ok((self_attn, mlp))
    })
}

/// Per-sequence decode state: the MLA latent KV cache of every layer.
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    kv_lora_rank: usize,
    rope_dim: usize,
    /// `[layer][n_tokens * kv_lora_rank]`: normalised latents `c_kv`.
    c_kv: Vec<Vec<f32>>,
    /// `[layer][n_tokens * qk_rope_head_dim]`: rotated shared rope keys.
    k_pe: Vec<Vec<f32>>,
    /// Tokens cached.
    len: usize,
}

impl DecodeState for KvCache {
    fn len(&self) -> usize {
        self.len
    }

    fn truncate(&mut self, len: usize) -> bool {
        if len < self.len {
            for v in &mut self.c_kv {
                v.truncate(len * self.kv_lora_rank);
            }
            for v in &mut self.k_pe {
                v.truncate(len * self.rope_dim);
            }
            self.len = len;
        }
        true
    }

    fn bytes(&self) -> usize {
        self.c_kv.iter().chain(&self.k_pe).map(|v| v.capacity() * 4).sum()
    }

    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

/// A loaded DeepSeek-V3-family model: resident backbone plus the routed-expert store.
pub struct DeepseekV3 {
    config: ModelConfig,
    pub cfg: DeepseekV3Config,
    pub(crate) backbone: Backbone,
    /// Every weight, as handles into `backbone`.
    pub(crate) w: Weights,
    /// The names behind `w`, for the CUDA path's upload.
    pub(crate) names: Vec<LayerNames>,
    pub(crate) rope: RotaryEmbedding,
    /// Softmax scale `qk_head_dim^-0.5 · mscale²`. [YARN_MSCALE]
    pub(crate) softmax_scale: f32,
    router: RouterConfig,
    pub(crate) routed: RoutedExperts,
}

impl DeepseekV3 {
    /// Loads the backbone into memory and opens the expert store with a cache of `ram_budget`
    /// bytes and default store options.
    ///
    /// Errors: a missing or malformed tensor in the backbone, unreadable files.
    pub fn load(dir: &ModelDir, ram_budget: u64) -> Result<Self, EngineError> {
        Self::load_with(dir, StoreOptions::new(ram_budget))
    }

    /// Loads the backbone into memory and opens the expert store with `opts` (prefetch of
    /// predicted experts is on when `opts.prefetch` is).
    ///
    /// Errors: a missing or malformed tensor in the backbone, unreadable files, O_DIRECT refused.
    pub fn load_with(dir: &ModelDir, opts: StoreOptions) -> Result<Self, EngineError> {
        let config = dir.manifest.config.clone();
        let cfg = family_config(dir, "deepseek_v3", ModelConfig::as_deepseek_v3)?;
        let backbone = dir.load_backbone()?;
        let names: Vec<LayerNames> = (0..cfg.num_hidden_layers).map(LayerNames::new).collect();
        // Every tensor the forward pass uses, resolved once, so a bad directory fails at load.
        let w = resolve(&backbone, &cfg, &names)?;
        let rope = RotaryEmbedding::new(&cfg.rope, cfg.qk_rope_head_dim, cfg.rope_interleave);
        let mut softmax_scale = (cfg.qk_head_dim() as f64).powf(-0.5);
        if let Rope::Yarn {
            factor,
            mscale_all_dim: Some(m),
            ..
        } = cfg.rope
        {
            let ms = yarn_mscale(factor, m);
            softmax_scale *= ms * ms;
        }
        let router = RouterConfig {
            n_routed_experts: cfg.n_routed_experts,
            top_k: cfg.num_experts_per_tok,
            n_group: cfg.n_group,
            topk_group: cfg.topk_group,
            norm_topk_prob: cfg.norm_topk_prob,
            routed_scaling_factor: cfg.routed_scaling_factor,
        };
        let routed = RoutedExperts::open(dir, opts)?;
        Ok(DeepseekV3 {
            config,
            cfg,
            backbone,
            w,
            names,
            rope,
            softmax_scale: softmax_scale as f32,
            router,
            routed,
        })
    }

    /// `model.embed_tokens.weight [vocab_size, hidden]`.
    pub(crate) fn embed_tokens(&self) -> MatRef<'_> {
        self.backbone.mat(&self.w.embed_tokens)
    }

    /// Runs one token at the next position of `cache`; returns the logits `[vocab_size]` and
    /// the routing of every MoE layer.
    ///
    /// Errors: token id outside the vocabulary, expert read or checksum failures.
    ///
    /// `draft`: route every MoE layer among the experts resident in the cache only (no reads;
    /// see [`CausalLm::forward_draft`]).
    fn forward_token(
        &self,
        cache: &mut KvCache,
        token: u32,
        draft: bool,
    ) -> Result<(Vec<f32>, LayerRoutes), EngineError> {
        let c = &self.cfg;
        EngineError::check_tokens(&[token], c.vocab_size)?;
        let pos = cache.len;
        let h = c.hidden_size;
        // x: [hidden]
        let bb = &self.backbone;
        let mut x = vec![0f32; h];
        bb.mat(&self.w.embed_tokens).row_into(token as usize, &mut x);
        let mut routes = Vec::new();
        let layers = &self.w.layers;
        decoder_layers(
            &Cpu,
            &mut x,
            1,
            (layers.len(), c.rms_norm_eps),
            |l| {
                (
                    bb.vec(&layers[l].input_layernorm),
                    bb.vec(&layers[l].post_attention_layernorm),
                )
            },
            |l, xn, out| {
                *out = self.routed.time_attention(|| self.attention(l, xn, pos, cache));
                Ok(())
            },
            |l, xn, x| {
                let mlp = self.routed.time_mlp(|| -> Result<Vec<f32>, EngineError> {
                    match &layers[l].mlp {
                        Mlp::Moe { .. } => {
                            let (out, r) = if draft { self.moe_draft(l, xn) } else { self.moe(l, xn)? };
                            routes.push((l, r));
                            Ok(out)
                        }
                        Mlp::Dense(d) => {
                            let [g, u, d] = d.view(bb);
                            Ok(swiglu(g, u, d, xn))
                        }
                    }
                })?;
                add_into(x, &mlp);
                Ok(())
            },
        )?;
        cache.len += 1;
        self.routed.count_forward();
        let (norm, lm_head) = (bb.vec(&self.w.norm), bb.mat(&self.w.lm_head));
        let logits = on_cpu(chunk_logits(&Cpu, x, 1, false, (norm, c.rms_norm_eps), &lm_head)).remove(0);
        Ok((logits, routes))
    }

    /// The MLA shape: RoPE (YaRN) on the shared-key part.
    pub(crate) fn mla_shape(&self) -> MlaShape<'_> {
        let c = &self.cfg;
        MlaShape {
            n_heads: c.num_attention_heads,
            nope: c.qk_nope_head_dim,
            rope: c.qk_rope_head_dim,
            v_head_dim: c.v_head_dim,
            kv_lora_rank: c.kv_lora_rank,
            scale: self.softmax_scale,
            rotary: Some(&self.rope),
        }
    }

    /// MLA of layer `l` for one token at position `pos` ([`mla_token`]). xn: `[hidden]` →
    /// `[hidden]`.
    fn attention(&self, l: usize, xn: &[f32], pos: usize, cache: &mut KvCache) -> Vec<f32> {
        let w = self.w.layers[l].self_attn.view(&self.backbone);
        let (c_kv, k_pe) = (&mut cache.c_kv[l], &mut cache.k_pe[l]);
        mla_token(&self.mla_shape(), &w, LATENT_NORM_EPS, xn, pos, c_kv, k_pe)
    }

    /// MLA of layer `l` for a chunk of `nt` tokens at positions `pos0..pos0 + nt`
    /// ([`mla_chunk_layer`]); each token's result equals [`Self::attention`] bit for bit in the
    /// exact batch form. xn: `[nt, hidden]` → `[nt, hidden]`.
    fn attention_batch(&self, l: usize, xn: &[f32], nt: usize, pos0: usize, cache: &mut KvCache) -> Vec<f32> {
        let w = self.w.layers[l].self_attn.view(&self.backbone);
        let (c_kv, k_pe) = (&mut cache.c_kv[l], &mut cache.k_pe[l]);
        let form = self.routed.batch_form().mla();
        mla_chunk_layer(&self.mla_shape(), &w, LATENT_NORM_EPS, xn, nt, pos0, c_kv, k_pe, form)
    }

    /// The router of MoE layer `l` with the current `--experts-per-token`.
    pub(crate) fn router_cfg(&self) -> RouterConfig {
        RouterConfig {
            top_k: self.routed.experts_per_token(),
            ..self.router
        }
    }

    /// MoE layer `l`'s router `gate`, its `e_score_correction_bias` and its shared experts'
    /// matrices (None without shared experts).
    ///
    /// # Panics
    /// If layer `l` is dense (callers route only MoE layers).
    fn moe_weights(&self, l: usize) -> (MatRef<'_>, &[f32], Option<[MatRef<'_>; 3]>) {
        let bb = &self.backbone;
        match &self.w.layers[l].mlp {
            Mlp::Moe {
                gate,
                e_score_correction_bias,
                shared_experts,
            } => (
                bb.mat(gate),
                bb.vec(e_score_correction_bias),
                shared_experts.as_ref().map(|s| s.view(bb)),
            ),
            Mlp::Dense(_) => panic!("layer {l} is dense, not MoE"),
        }
    }

    /// MoE block for a chunk of `nt` tokens, expert-major ([`RoutedExperts::run_batch`]): each
    /// expert chosen in the chunk is read once and applied to its tokens with matrix-matrix
    /// products; the shared experts run over the whole chunk meanwhile. Each token's result
    /// equals [`Self::moe`] bit for bit. xn: `[nt, hidden]` → `[nt, hidden]`.
    fn moe_batch(&self, l: usize, xn: &[f32], nt: usize) -> Result<(Vec<f32>, Vec<Routing>), EngineError> {
        let c = &self.cfg;
        let h = c.hidden_size;
        let (gate, bias, shared) = self.moe_weights(l);
        let mut logits = vec![0f32; nt * gate.rows];
        gate.matmul(xn, nt, &mut logits);
        let router = self.router_cfg();
        let routings: Vec<Routing> = logits.chunks(gate.rows).map(|lg| route(&router, lg, bias)).collect();
        let shared = shared.map(|[g, u, d]| move || swiglu_batch(g, u, d, xn, nt));
        let (mut out, shared_out) = self.routed.run_batch(
            l,
            &routings,
            h,
            |e, tokens| {
                let xs = gather_rows(xn, h, tokens);
                swiglu_batch(e.matrix(0), e.matrix(1), e.matrix(2), &xs, tokens.len())
            },
            shared,
        )?;
        if let Some(sh) = shared_out {
            add_into(&mut out, &sh);
        }
        Ok((out, routings))
    }

    /// MoE block of a self-drafting pass: the router restricted to the experts of layer `l`
    /// resident in the cache ([`route_masked`]), computed with those records (no reads), plus
    /// the shared experts. x: `[hidden]` → `[hidden]`.
    fn moe_draft(&self, l: usize, xn: &[f32]) -> (Vec<f32>, Routing) {
        let c = &self.cfg;
        let (gate, bias, shared) = self.moe_weights(l);
        let mut logits = vec![0f32; gate.rows];
        gate.matvec(xn, &mut logits);
        let router = self.router_cfg();
        let shared = shared.map(|[g, u, d]| move || swiglu(g, u, d, xn));
        let (mut out, shared_out, routing) = self.routed.run_draft(
            l,
            c.n_routed_experts,
            |allowed| route_masked(&router, &logits, bias, Some(allowed)),
            c.hidden_size,
            |e| swiglu(e.matrix(0), e.matrix(1), e.matrix(2), xn),
            shared,
        );
        if let Some(sh) = shared_out {
            add_into(&mut out, &sh);
        }
        (out, routing)
    }

    /// Runs a chunk of tokens at the next positions of `cache` (batched attention, expert-major
    /// MoE); see [`CausalLm::forward_batch`]. Every position's logits equal
    /// [`Self::forward_token`]'s bit for bit: the batched kernels compute each row as the
    /// one-token kernels do, attention runs the same per-head operations, and the routed
    /// experts are summed in the same order.
    fn forward_chunk(&self, cache: &mut KvCache, tokens: &[u32], all_logits: bool) -> Result<BatchOutput, EngineError> {
        let c = &self.cfg;
        EngineError::check_tokens(tokens, c.vocab_size)?;
        let nt = tokens.len();
        if nt == 0 {
            return Ok(BatchOutput::default());
        }
        let pos0 = cache.len;
        let h = c.hidden_size;
        // x: [nt, hidden]
        let bb = &self.backbone;
        let mut x = vec![0f32; nt * h];
        let embed = bb.mat(&self.w.embed_tokens);
        for (row, &t) in x.chunks_mut(h).zip(tokens) {
            embed.row_into(t as usize, row);
        }
        let mut routes: Vec<LayerRoutes> = vec![Vec::new(); nt];
        let layers = &self.w.layers;
        decoder_layers(
            &Cpu,
            &mut x,
            nt,
            (layers.len(), c.rms_norm_eps),
            |l| {
                (
                    bb.vec(&layers[l].input_layernorm),
                    bb.vec(&layers[l].post_attention_layernorm),
                )
            },
            |l, xn, out| {
                *out = self
                    .routed
                    .time_attention(|| self.attention_batch(l, xn, nt, pos0, cache));
                Ok(())
            },
            |l, xn, x| {
                let mlp = self.routed.time_mlp(|| -> Result<Vec<f32>, EngineError> {
                    match &layers[l].mlp {
                        Mlp::Moe { .. } => {
                            let (out, rs) = self.moe_batch(l, xn, nt)?;
                            for (r, routing) in routes.iter_mut().zip(rs) {
                                r.push((l, routing));
                            }
                            Ok(out)
                        }
                        Mlp::Dense(d) => {
                            let [g, u, d] = d.view(bb);
                            Ok(swiglu_batch(g, u, d, xn, nt))
                        }
                    }
                })?;
                add_into(x, &mlp);
                Ok(())
            },
        )?;
        cache.len += nt;
        for _ in 0..nt {
            self.routed.count_forward();
        }
        let (norm, lm_head) = (bb.vec(&self.w.norm), bb.mat(&self.w.lm_head));
        let logits = on_cpu(chunk_logits(&Cpu, x, nt, all_logits, (norm, c.rms_norm_eps), &lm_head));
        Ok(BatchOutput { logits, routes })
    }

    /// MoE block: routed experts (read through the expert store) weighted by the router, plus
    /// the shared experts. x: `[hidden]` → `[hidden]`.
    fn moe(&self, l: usize, xn: &[f32]) -> Result<(Vec<f32>, Routing), EngineError> {
        let c = &self.cfg;
        // router_logits = x · W_gate^T in f32: [n_routed_experts]
        let (gate, bias, shared) = self.moe_weights(l);
        let mut logits = vec![0f32; gate.rows];
        gate.matvec(xn, &mut logits);
        let router = self.router_cfg();
        let routing = route(&router, &logits, bias);
        let shared = shared.map(|[g, u, d]| move || swiglu(g, u, d, xn));
        // Next MoE layer's experts predicted by applying its router to this hidden state.
        let predict = || -> Result<Option<(usize, Vec<usize>)>, EngineError> {
            let Some(next) = (l + 1..c.num_hidden_layers).find(|&k| c.is_moe_layer(k)) else {
                return Ok(None);
            };
            let (next_gate, next_bias, _) = self.moe_weights(next);
            let mut next_logits = vec![0f32; c.n_routed_experts];
            next_gate.matvec(xn, &mut next_logits);
            Ok(Some((next, route(&router, &next_logits, next_bias).experts)))
        };
        let (mut out, shared_out) = self.routed.run(
            l,
            &routing,
            c.hidden_size,
            |e| swiglu(e.matrix(0), e.matrix(1), e.matrix(2), xn),
            shared,
            predict,
        )?;
        if let Some(sh) = shared_out {
            add_into(&mut out, &sh);
        }
        Ok((out, routing))
    }
}

impl FamilyModel for DeepseekV3 {
    type State = KvCache;

    crate::model::resident_items!();

    fn new_state(&self) -> KvCache {
        KvCache {
            kv_lora_rank: self.cfg.kv_lora_rank,
            rope_dim: self.cfg.qk_rope_head_dim,
            c_kv: vec![Vec::new(); self.cfg.num_hidden_layers],
            k_pe: vec![Vec::new(); self.cfg.num_hidden_layers],
            len: 0,
        }
    }

    fn step(&self, cache: &mut KvCache, token: u32) -> Result<(Vec<f32>, LayerRoutes), EngineError> {
        self.forward_token(cache, token, false)
    }

    fn chunk(&self, cache: &mut KvCache, tokens: &[u32], all_logits: bool) -> Result<BatchOutput, EngineError> {
        self.forward_chunk(cache, tokens, all_logits)
    }

    fn draft_step(&self, cache: &mut KvCache, token: u32) -> Result<Option<Vec<f32>>, EngineError> {
        Ok(Some(self.forward_token(cache, token, true)?.0))
    }

    fn supports_draft(&self) -> bool {
        true
    }

    fn batch_bytes_per_token(&self) -> usize {
        // x, xn, attention and MLP outputs, q, compressed kv, router logits, shared expert
        // activations (f32), plus the gathered expert inputs and outputs.
        let c = &self.cfg;
        let q = c.num_attention_heads * c.qk_head_dim();
        4 * (8 * c.hidden_size + 2 * q + c.n_routed_experts + 3 * c.moe_intermediate_size * c.n_shared_experts.max(1))
    }
}
