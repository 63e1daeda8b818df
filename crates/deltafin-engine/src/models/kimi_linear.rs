//! Kimi Linear and Kimi K3 forward pass, one token at a time, in f32.
//!
//! Kimi Linear matches transformers 5.24 `models/kimi_linear/modeling_kimi_linear.py`; the K3
//! additions follow `../shared/K3-SPEC.md` (§ numbers below), checked against llama.cpp's
//! goldens in `tests/fixtures/kimi_k3/`.
//!
//! Per decoder layer without attention residuals (Kimi Linear):
//! ```text
//! h = x + mixer(input_layernorm(x))            # KDA or NoPE MLA, by linear_attn_config
//! x = h + ffn(post_attention_layernorm(h))     # dense MLP below first_k_dense_replace, else MoE
//! ```
//! With attention residuals (K3, §1–2), a per-sequence-position bank `B` of block inputs replaces
//! the plain residual stream:
//! ```text
//! a_in = mix(B, h_l; w_attn_l)                 # depth softmax over RMS-normalised entries  [ATTN_RES]
//! if l % attn_res_block_size == 0: B.push(h_l); S = 0   else: S = h_l
//! S   += mixer(input_layernorm(a_in))
//! f_in = mix(B, S; w_mlp_l)
//! h_{l+1} = S + ffn(post_attention_layernorm(f_in))
//! logits = lm_head(norm(mix(B, h_L; w_out)))
//! ```
//! The MoE block (§5): sigmoid router with `e_score_correction_bias` for selection only; with
//! LatentMoE the routed experts run on `routed_expert_down_proj(x)`, their weighted sum is
//! RMS-normalised (`routed_expert_norm`) and projected back (`routed_expert_up_proj`); the
//! shared experts read the full-width `x`. SiTU-GLU or SwiGLU everywhere, per `hidden_act`.
//!
//! Weights: every tensor is resolved once at load into `Weights` (handles named as in the
//! checkpoint, each KDA layer's shapes checked there too) and read with the infallible
//! [`Backbone::mat`] / [`Backbone::vec`]: a forward pass looks nothing up by name.

use deltafin_format::kimi_linear::{GluActivation, KimiLinearConfig, MixerKind};
use deltafin_format::model_dir::{Backbone, MatHandle, VecHandle};
use deltafin_format::{ModelConfig, ModelDir};
use deltafin_kernels::{rms_norm, sigmoid, silu, softmax_inplace, MatData, MatRef};

use crate::blocks::kda::{DecayGate, Kda, KdaConfig, KdaState, KdaTensorNames, KdaTensors, DEFAULT_CHUNK_SIZE};
use crate::blocks::mla::{mla_chunk_layer, mla_token, MlaShape, MlaTensorNames, MlaTensors, MlaVariant};
use crate::experts::{Expert, StoreOptions};
use crate::model::{
    add_into, gather_rows, token_at_a_time, BatchOutput, FamilyModel, GluTensorNames, GluTensors, LayerRoutes,
    Numerics, RoutedExperts,
};
use crate::models::decoder::DecoderWeights;
use crate::models::family_config;
use crate::models::hybrid_state::{HybridState, LayerState};
use crate::moe::{route, route_masked, RouterConfig, Routing};
use crate::EngineError;

/// eps of `q_a_layernorm` and `kv_a_layernorm`: transformers' Kimi Linear builds them with the
/// `KimiLinearRMSNorm` default 1e-6 whatever `rms_norm_eps` says, and the K3 spec prefers 1e-6
/// too (§4: Moonshot-derived ports use 1e-6; llama.cpp uses `rms_norm_eps`, which
/// [`Numerics::LlamaCppCpu`] follows). [KL_LATENT_NORM_EPS]
pub(crate) use crate::blocks::mla::LATENT_NORM_EPS;

/// Tokens a KDA state can roll back without recomputation (speculative decoding drafts are
/// shorter); further back, the session starts over.
pub(crate) const KDA_ROLLBACK_WINDOW: usize = 32;
// A self-drafting run (up to MAX_DRAFT one-token forwards) and its verification pass
// (MAX_DRAFT + 1 positions) each fit in the rollback window.
const _: () = assert!(KDA_ROLLBACK_WINDOW > crate::speculate::MAX_DRAFT);

/// Tensor names of one decoder layer, as in the checkpoint.
pub(crate) struct LayerNames {
    pub(crate) input_layernorm: String,
    pub(crate) post_attention_layernorm: String,
    pub(crate) attn_res_norm: String,
    pub(crate) attn_res_proj: String,
    pub(crate) mlp_res_norm: String,
    pub(crate) mlp_res_proj: String,
    pub(crate) kda: KdaTensorNames,
    /// `self_attn.*` of an MLA layer.
    pub(crate) mla: MlaTensorNames,
    /// `mlp.{gate,up,down}_proj` of a dense layer.
    pub(crate) mlp: GluTensorNames,
    pub(crate) router: String,
    pub(crate) router_bias: String,
    pub(crate) latent_down: String,
    pub(crate) latent_norm: String,
    pub(crate) latent_up: String,
    /// `block_sparse_moe.shared_experts.{gate,up,down}_proj` of an MoE layer.
    pub(crate) shared_experts: GluTensorNames,
}

impl LayerNames {
    fn new(l: usize) -> Self {
        let p = format!("model.layers.{l}");
        let a = format!("{p}.self_attn");
        let m = format!("{p}.block_sparse_moe");
        LayerNames {
            input_layernorm: format!("{p}.input_layernorm.weight"),
            post_attention_layernorm: format!("{p}.post_attention_layernorm.weight"),
            attn_res_norm: format!("{p}.self_attention_res_norm.weight"),
            attn_res_proj: format!("{p}.self_attention_res_proj.weight"),
            mlp_res_norm: format!("{p}.mlp_res_norm.weight"),
            mlp_res_proj: format!("{p}.mlp_res_proj.weight"),
            kda: KdaTensorNames::new(&a),
            mla: MlaTensorNames::new(&a),
            mlp: GluTensorNames::new(&format!("{p}.mlp")),
            router: format!("{m}.gate.weight"),
            router_bias: format!("{m}.gate.e_score_correction_bias"),
            latent_down: format!("{m}.routed_expert_down_proj.weight"),
            latent_norm: format!("{m}.routed_expert_norm.weight"),
            latent_up: format!("{m}.routed_expert_up_proj.weight"),
            shared_experts: GluTensorNames::new(&format!("{m}.shared_experts")),
        }
    }
}

/// Every weight of the forward pass, resolved in the backbone once at load ([`resolve`]): KDA or
/// MLA token mixers and dense / MoE feed-forward blocks.
pub(crate) type Weights = DecoderWeights<Mixer, Ffn>;

/// One layer's token mixer, `self_attn.*`.
// Built once per layer at load and never moved afterwards: boxing the larger variant would
// only add an indirection.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Mixer {
    /// Kimi Delta Attention, with its hyperparameters (checked with the weights at load).
    Kda { cfg: KdaConfig, w: KdaTensors },
    /// NoPE MLA (K3's output gate in `g_proj` when configured).
    Mla(MlaTensors),
}

/// One layer's feed-forward block.
// Built once per layer at load and never moved afterwards: boxing the larger variant would
// only add an indirection.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Ffn {
    /// `mlp.{gate,up,down}_proj` (layers below `first_k_dense_replace`).
    Dense(GluTensors),
    /// `block_sparse_moe.*`.
    Moe(MoeTensors),
}

/// One MoE layer's backbone tensors, `block_sparse_moe.*` (the routed experts come from the
/// expert store).
pub(crate) struct MoeTensors {
    /// The router `gate.weight [num_experts, hidden]`.
    pub(crate) gate: MatHandle,
    /// `gate.e_score_correction_bias [num_experts]`.
    pub(crate) e_score_correction_bias: VecHandle,
    /// LatentMoE (`routed_expert_hidden_size` set).
    pub(crate) latent: Option<LatentTensors>,
    /// `shared_experts.{gate,up,down}_proj` (None when `num_shared_experts` is 0).
    pub(crate) shared_experts: Option<GluTensors>,
}

/// LatentMoE's projections around the routed experts (K3-SPEC §5).
pub(crate) struct LatentTensors {
    /// `routed_expert_down_proj.weight [latent, hidden]`.
    pub(crate) routed_expert_down_proj: MatHandle,
    /// `routed_expert_norm.weight [latent]` (with `latent_moe_use_norm`).
    pub(crate) routed_expert_norm: Option<VecHandle>,
    /// `routed_expert_up_proj.weight [hidden, latent]`.
    pub(crate) routed_expert_up_proj: MatHandle,
}

/// Resolves every tensor the forward pass of `cfg` reads, named by `names`, in `bb`; each KDA
/// layer's shapes are checked against its hyperparameters ([`Kda::new`]).
///
/// Errors: a missing or malformed tensor (named), a KDA layer whose shapes do not fit.
fn resolve(bb: &Backbone, cfg: &KimiLinearConfig, names: &[LayerNames]) -> Result<Weights, EngineError> {
    let c = cfg;
    let norms = |l: usize| {
        (
            names[l].input_layernorm.as_str(),
            names[l].post_attention_layernorm.as_str(),
        )
    };
    let mla_variant = MlaVariant {
        q_lora: c.q_lora_rank.is_some(),
        output_gate: c.mla_use_output_gate,
    };
    Weights::resolve(bb, names.len(), norms, |l| {
        let n = &names[l];
        let self_attn = match c.mixers[l] {
            MixerKind::Kda => {
                let kda_cfg = KdaConfig {
                    layer: l,
                    hidden_size: c.hidden_size,
                    num_heads: c.kda_num_heads,
                    head_dim: c.kda_head_dim,
                    conv_kernel_size: c.short_conv_kernel_size,
                    norm_eps: c.rms_norm_eps,
                    decay_gate: match c.gate_lower_bound {
                        Some(lower_bound) => DecayGate::ScaledSigmoid { lower_bound },
                        None => DecayGate::Softplus,
                    },
                    chunk_size: DEFAULT_CHUNK_SIZE,
                };
                let w = KdaTensors::resolve(bb, &n.kda, c.use_full_rank_gate)?;
                Kda::new(kda_cfg, w.view(bb)).map_err(|e| EngineError::Invalid(e.to_string()))?;
                Mixer::Kda { cfg: kda_cfg, w }
            }
            MixerKind::Mla => Mixer::Mla(MlaTensors::resolve(bb, &n.mla, mla_variant)?),
        };
        let ffn = if c.is_moe_layer(l) {
            Ffn::Moe(MoeTensors {
                gate: bb.matrix_handle(&n.router)?,
                e_score_correction_bias: bb.vector_handle(&n.router_bias)?,
                latent: match c.routed_expert_hidden_size {
                    Some(_) => Some(LatentTensors {
                        routed_expert_down_proj: bb.matrix_handle(&n.latent_down)?,
                        routed_expert_norm: if c.latent_moe_use_norm {
                            Some(bb.vector_handle(&n.latent_norm)?)
                        } else {
                            None
                        },
                        routed_expert_up_proj: bb.matrix_handle(&n.latent_up)?,
                    }),
                    None => None,
                },
                shared_experts: (c.num_shared_experts > 0)
                    .then(|| GluTensors::resolve(bb, &n.shared_experts))
                    .transpose()?,
            })
        } else {
            Ffn::Dense(GluTensors::resolve(bb, &n.mlp)?)
        };
        Ok((self_attn, ffn))
    })
}

/// Decode state of one Kimi Linear layer's token mixer (a [`HybridState`] layer).
#[derive(Debug, Clone)]
pub enum MixerState {
    /// A KDA layer's recurrent state (with its rollback log).
    Kda(KdaState),
    /// MLA latent cache: `c_kv: [n_tokens, kv_lora_rank]` (normalised) and the shared, un-rotated
    /// key part `k_pe: [n_tokens, qk_rope_head_dim]`.
    Mla { c_kv: Vec<f32>, k_pe: Vec<f32> },
}

impl LayerState for MixerState {
    fn commit(&mut self) {
        if let MixerState::Kda(k) = self {
            k.commit();
        }
    }

    fn bytes(&self) -> usize {
        match self {
            MixerState::Kda(k) => k.bytes(),
            MixerState::Mla { c_kv, k_pe } => (c_kv.capacity() + k_pe.capacity()) * 4,
        }
    }

    fn rollback_floor(&self) -> usize {
        match self {
            MixerState::Kda(k) => k.committed_len(),
            MixerState::Mla { .. } => 0,
        }
    }
}

/// Per-sequence decode state: one mixer state per layer; `dims` is `(kv_lora_rank,
/// qk_rope_head_dim)`, the widths of the MLA layers' cache rows. The attention-residual bank is
/// an activation of the current position only (§2), not part of the state.
pub type KimiLinearState = HybridState<MixerState, (usize, usize)>;

/// A loaded Kimi Linear / Kimi K3 model.
pub struct KimiLinear {
    config: ModelConfig,
    pub cfg: KimiLinearConfig,
    pub(crate) backbone: Backbone,
    /// Every weight, as handles into `backbone`.
    pub(crate) w: Weights,
    /// The names behind `w`, for the CUDA path's upload.
    pub(crate) names: Vec<LayerNames>,
    /// Fused attention-residual score vectors `norm ⊙ proj` per layer: (pre-attention,
    /// pre-MLP), and the output site's. Empty without attention residuals. [ATTN_RES]
    pub(crate) res_scores: Vec<(Vec<f32>, Vec<f32>)>,
    pub(crate) out_res_score: Vec<f32>,
    pub(crate) router: RouterConfig,
    /// MLA softmax scale `(qk_nope + qk_rope)^-0.5` (no YaRN: the model has no RoPE).
    pub(crate) softmax_scale: f32,
    /// Empty decode state of each layer's mixer, cloned for every new sequence.
    empty_states: Vec<MixerState>,
    pub(crate) routed: RoutedExperts,
    /// Reference math, or llama.cpp's CPU arithmetic (see [`Numerics`]).
    pub(crate) numerics: Numerics,
}

impl KimiLinear {
    /// Loads the backbone into memory and opens the expert store with `opts`.
    ///
    /// Errors: not a Kimi Linear directory, a missing or malformed backbone tensor (every tensor
    /// the forward pass uses is checked here), unreadable files.
    pub fn load_with(dir: &ModelDir, opts: StoreOptions) -> Result<Self, EngineError> {
        let config = dir.manifest.config.clone();
        let cfg = family_config(dir, "kimi_linear", ModelConfig::as_kimi_linear)?;
        let backbone = dir.load_backbone()?;
        let names: Vec<LayerNames> = (0..cfg.num_hidden_layers).map(LayerNames::new).collect();
        // Every tensor the forward pass reads is in the converter's table for this config;
        // check them all once so a bad directory fails at load.
        for t in dir.manifest.config.backbone_tensors() {
            backbone
                .f32_tensor(&t.name)
                .map(|_| ())
                .or_else(|_| backbone.matrix(&t.name).map(|_| ()))?;
        }
        let fused = |norm: &str, proj: &str| -> Result<Vec<f32>, EngineError> {
            let n = backbone.vector(norm)?;
            let (p, _) = backbone.f32_tensor(proj)?;
            Ok(n.iter().zip(p).map(|(a, b)| a * b).collect())
        };
        let mut res_scores = Vec::new();
        let mut out_res_score = Vec::new();
        if cfg.attn_res_block_size.is_some() {
            for n in &names {
                res_scores.push((
                    fused(&n.attn_res_norm, &n.attn_res_proj)?,
                    fused(&n.mlp_res_norm, &n.mlp_res_proj)?,
                ));
            }
            out_res_score = fused("model.output_attn_res_norm.weight", "model.output_attn_res_proj.weight")?;
        }
        // Every tensor the forward pass reads, resolved once (KDA shapes checked).
        let w = resolve(&backbone, &cfg, &names)?;
        let router = RouterConfig {
            n_routed_experts: cfg.num_experts,
            top_k: cfg.num_experts_per_token,
            n_group: cfg.n_group,
            topk_group: cfg.topk_group,
            norm_topk_prob: cfg.renormalize,
            routed_scaling_factor: cfg.routed_scaling_factor,
        };
        let softmax_scale = ((cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) as f32).powf(-0.5);
        let routed = RoutedExperts::open(dir, opts)?;
        let mut model = KimiLinear {
            config,
            cfg,
            backbone,
            w,
            names,
            res_scores,
            out_res_score,
            router,
            softmax_scale,
            empty_states: Vec::new(),
            routed,
            numerics: Numerics::Reference,
        };
        let empty = model
            .w
            .layers
            .iter()
            .map(|lw| match &lw.self_attn {
                Mixer::Kda { cfg, w } => MixerState::Kda(model.kda(cfg, w).new_state(KDA_ROLLBACK_WINDOW)),
                Mixer::Mla(_) => MixerState::Mla {
                    c_kv: Vec::new(),
                    k_pe: Vec::new(),
                },
            })
            .collect();
        model.empty_states = empty;
        Ok(model)
    }

    /// `model.embed_tokens.weight [vocab_size, hidden]`.
    pub(crate) fn embed_tokens(&self) -> MatRef<'_> {
        self.backbone.mat(&self.w.embed_tokens)
    }

    /// Layer `l`'s router `e_score_correction_bias [num_experts]` (None for a dense layer).
    pub(crate) fn router_bias(&self, l: usize) -> Option<&[f32]> {
        match &self.w.layers.get(l)?.mlp {
            Ffn::Moe(m) => Some(self.backbone.vec(&m.e_score_correction_bias)),
            Ffn::Dense(_) => None,
        }
    }

    /// A KDA block over the resident weights `w` with hyperparameters `cfg` (the pair that
    /// [`resolve`] checked with [`Kda::new`], so it is built here without checks).
    fn kda<'a>(&'a self, cfg: &KdaConfig, w: &KdaTensors) -> Kda<'a> {
        Kda {
            cfg: *cfg,
            w: w.view(&self.backbone),
        }
    }

    /// The start of layer `l` for one position (K3-SPEC §1 steps 1–2): the mixer's input before
    /// its norm, and the running sum the mixer adds to. With attention residuals the input is
    /// the depth mix of the bank and `x`, and at a block start `x` joins the bank and the sum
    /// restarts from 0 [ATTN_RES]; without them both are `x`.
    fn enter_layer(&self, l: usize, bank: &mut Vec<Vec<f32>>, x: Vec<f32>) -> (Vec<f32>, Vec<f32>) {
        let c = &self.cfg;
        match c.attn_res_block_size {
            Some(bs) => {
                let a_in = attn_res_mix(bank, &x, &self.res_scores[l].0, c.rms_norm_eps);
                if l.is_multiple_of(bs) {
                    let zero = vec![0f32; x.len()];
                    bank.push(x);
                    (a_in, zero)
                } else {
                    (a_in, x)
                }
            }
            None => (x.clone(), x),
        }
    }

    /// The FFN's input before its norm (step 4): the depth mix of the bank and the running sum
    /// `s` with attention residuals, else `s`.
    fn ffn_input<'a>(&self, l: usize, bank: &[Vec<f32>], s: &'a [f32]) -> std::borrow::Cow<'a, [f32]> {
        match self.cfg.attn_res_block_size {
            Some(_) => attn_res_mix(bank, s, &self.res_scores[l].1, self.cfg.rms_norm_eps).into(),
            None => s.into(),
        }
    }

    /// Runs one token at the next position of `st`; returns the logits `[vocab_size]` and the
    /// routing of every MoE layer. `draft`: route every MoE layer among the experts resident in
    /// the cache only (no reads; see [`CausalLm::forward_draft`]).
    fn forward_token(
        &self,
        st: &mut KimiLinearState,
        token: u32,
        draft: bool,
    ) -> Result<(Vec<f32>, LayerRoutes), EngineError> {
        let c = &self.cfg;
        EngineError::check_tokens(&[token], c.vocab_size)?;
        let pos = st.len;
        let h = c.hidden_size;
        // x: [hidden] = embed_tokens[token]
        let bb = &self.backbone;
        let mut x = vec![0f32; h];
        bb.mat(&self.w.embed_tokens).row_into(token as usize, &mut x);
        let mut xn = vec![0f32; h];
        let mut routes = Vec::new();
        // Attention-residual bank of this position: [n_entries][hidden]. [ATTN_RES]
        let mut bank: Vec<Vec<f32>> = Vec::new();
        for (l, lw) in self.w.layers.iter().enumerate() {
            // a_in: the mixer's input before its norm; s: the running sum the mixer adds to.
            let (a_in, mut s) = self.enter_layer(l, &mut bank, std::mem::take(&mut x));
            rms_norm(&a_in, bb.vec(&lw.input_layernorm), c.rms_norm_eps, &mut xn);
            let mixed = self.routed.time_attention(|| -> Result<Vec<f32>, EngineError> {
                match (&lw.self_attn, &mut st.layers[l]) {
                    (Mixer::Kda { cfg, w }, MixerState::Kda(ks)) => {
                        let mut out = vec![0f32; h];
                        self.kda(cfg, w)
                            .step(ks, &xn, &mut out)
                            .map_err(|e| EngineError::Invalid(e.to_string()))?;
                        Ok(out)
                    }
                    (Mixer::Mla(w), MixerState::Mla { c_kv, k_pe }) => Ok(self.mla(w, &xn, pos, c_kv, k_pe)),
                    _ => Err(other_state(l)),
                }
            })?;
            add_into(&mut s, &mixed);
            let f_in = self.ffn_input(l, &bank, &s);
            rms_norm(&f_in, bb.vec(&lw.post_attention_layernorm), c.rms_norm_eps, &mut xn);
            let ffn = self.routed.time_mlp(|| -> Result<Vec<f32>, EngineError> {
                match &lw.mlp {
                    Ffn::Moe(m) => {
                        let (out, r) = self.moe(l, m, &xn, draft)?;
                        routes.push((l, r));
                        Ok(out)
                    }
                    Ffn::Dense(d) => {
                        let [g, u, d] = d.view(bb);
                        Ok(glu_mlp(c.activation, g, u, d, &xn))
                    }
                }
            })?;
            add_into(&mut s, &ffn);
            x = s;
        }
        st.len += 1;
        self.routed.count_forward();
        let z = match c.attn_res_block_size {
            Some(_) => attn_res_mix(&bank, &x, &self.out_res_score, c.rms_norm_eps),
            None => x,
        };
        let mut y = vec![0f32; h];
        rms_norm(&z, bb.vec(&self.w.norm), c.rms_norm_eps, &mut y);
        let lm = bb.mat(&self.w.lm_head);
        let mut logits = vec![0f32; lm.rows];
        lm.matvec(&y, &mut logits);
        Ok((logits, routes))
    }

    /// Runs a chunk of tokens at the next positions of `st` ([`CausalLm::forward_batch`]): KDA
    /// layers run their chunked prefill over the whole chunk ([`Kda::prefill`], the same algebra
    /// as the recurrence up to f32 rounding), MLA layers attend token by token (causal, appending
    /// to the latent cache), MoE layers go expert-major (every expert the chunk selects is read
    /// once and applied to all its tokens, [`RoutedExperts::run_batch`]); attention residuals
    /// keep one bank per position, as the one-token path.
    fn forward_chunk(
        &self,
        st: &mut KimiLinearState,
        tokens: &[u32],
        all_logits: bool,
    ) -> Result<BatchOutput, EngineError> {
        let c = &self.cfg;
        let (h, nt) = (c.hidden_size, tokens.len());
        EngineError::check_tokens(tokens, c.vocab_size)?;
        let pos0 = st.len;
        let bb = &self.backbone;
        let embed = bb.mat(&self.w.embed_tokens);
        // xs: [nt][hidden], the residual stream of each position.
        let mut xs: Vec<Vec<f32>> = tokens
            .iter()
            .map(|&t| {
                let mut x = vec![0f32; h];
                embed.row_into(t as usize, &mut x);
                x
            })
            .collect();
        let mut banks: Vec<Vec<Vec<f32>>> = vec![Vec::new(); nt];
        let mut routes: Vec<LayerRoutes> = vec![Vec::new(); nt];
        // xn: [nt, hidden], normalised inputs of the current block.
        let mut xn = vec![0f32; nt * h];
        for (l, lw) in self.w.layers.iter().enumerate() {
            let mut sums = Vec::with_capacity(nt);
            let input_layernorm = bb.vec(&lw.input_layernorm);
            for t in 0..nt {
                let x = std::mem::take(&mut xs[t]);
                let (a_in, s) = self.enter_layer(l, &mut banks[t], x);
                rms_norm(&a_in, input_layernorm, c.rms_norm_eps, &mut xn[t * h..(t + 1) * h]);
                sums.push(s);
            }
            let mixed = self.routed.time_attention(|| -> Result<Vec<f32>, EngineError> {
                match (&lw.self_attn, &mut st.layers[l]) {
                    (Mixer::Kda { cfg, w }, MixerState::Kda(ks)) => {
                        let mut out = vec![0f32; nt * h];
                        self.kda(cfg, w)
                            .prefill(ks, &xn, &mut out)
                            .map_err(|e| EngineError::Invalid(e.to_string()))?;
                        Ok(out)
                    }
                    (Mixer::Mla(w), MixerState::Mla { c_kv, k_pe }) => Ok(self.mla_batch(w, &xn, nt, pos0, c_kv, k_pe)),
                    _ => Err(other_state(l)),
                }
            })?;
            let post_attention_layernorm = bb.vec(&lw.post_attention_layernorm);
            for (t, s) in sums.iter_mut().enumerate() {
                add_into(s, &mixed[t * h..(t + 1) * h]);
                let f_in = self.ffn_input(l, &banks[t], s);
                rms_norm(
                    &f_in,
                    post_attention_layernorm,
                    c.rms_norm_eps,
                    &mut xn[t * h..(t + 1) * h],
                );
            }
            let ffn = self.routed.time_mlp(|| -> Result<Vec<f32>, EngineError> {
                match &lw.mlp {
                    Ffn::Moe(m) => {
                        let (out, rs) = self.moe_batch(l, m, &xn, nt)?;
                        for (r, routing) in routes.iter_mut().zip(rs) {
                            r.push((l, routing));
                        }
                        Ok(out)
                    }
                    Ffn::Dense(d) => Ok(glu_mlp_batch(c.activation, d.view(bb), &xn, nt)),
                }
            })?;
            for (t, mut s) in sums.into_iter().enumerate() {
                add_into(&mut s, &ffn[t * h..(t + 1) * h]);
                xs[t] = s;
            }
        }
        st.len += nt;
        for _ in 0..nt {
            self.routed.count_forward();
        }
        let norm = bb.vec(&self.w.norm);
        let lm = bb.mat(&self.w.lm_head);
        let first = if all_logits { 0 } else { nt - 1 };
        let mut logits = Vec::with_capacity(nt - first);
        let mut y = vec![0f32; h];
        for t in first..nt {
            let z = match c.attn_res_block_size {
                Some(_) => attn_res_mix(&banks[t], &xs[t], &self.out_res_score, c.rms_norm_eps),
                None => xs[t].clone(),
            };
            rms_norm(&z, norm, c.rms_norm_eps, &mut y);
            let mut lg = vec![0f32; lm.rows];
            lm.matvec(&y, &mut lg);
            logits.push(lg);
        }
        Ok(BatchOutput { logits, routes })
    }

    /// Expert-major MoE block of layer `l` (weights `m`) for `nt` tokens (see [`Self::moe`] for
    /// one token): xn: `[nt, hidden]` → `[nt, hidden]`, plus each token's routing.
    fn moe_batch(
        &self,
        l: usize,
        m: &MoeTensors,
        xn: &[f32],
        nt: usize,
    ) -> Result<(Vec<f32>, Vec<Routing>), EngineError> {
        let c = &self.cfg;
        let bb = &self.backbone;
        let (h, w) = (c.hidden_size, c.expert_width());
        let gate = bb.mat(&m.gate);
        let mut logits = vec![0f32; nt * gate.rows];
        gate.matmul(xn, nt, &mut logits);
        let router = RouterConfig {
            top_k: self.routed.experts_per_token(),
            ..self.router
        };
        let bias = bb.vec(&m.e_score_correction_bias);
        let routings: Vec<Routing> = logits.chunks(gate.rows).map(|lg| route(&router, lg, bias)).collect();
        // xl: [nt, expert_width]
        let xl = match &m.latent {
            // expert_width() is the latent width with LatentMoE.
            Some(lt) => {
                let mut xl = vec![0f32; nt * w];
                bb.mat(&lt.routed_expert_down_proj).matmul(xn, nt, &mut xl);
                xl
            }
            None => xn.to_vec(),
        };
        let act = c.activation;
        let shared = m.shared_experts.as_ref().map(|s| {
            let w = s.view(bb);
            move || glu_mlp_batch(act, w, xn, nt)
        });
        let xl_ref = &xl;
        let (routed, shared_out) = self.routed.run_batch(
            l,
            &routings,
            w,
            |e, toks| {
                let rows = gather_rows(xl_ref, w, toks);
                glu_mlp_batch(act, expert_glu(e), &rows, toks.len())
            },
            shared,
        )?;
        let mut out = match &m.latent {
            Some(lt) => {
                let lat = w;
                let mut y = routed;
                if let Some(norm) = &lt.routed_expert_norm {
                    let norm = bb.vec(norm);
                    let mut yn = vec![0f32; lat];
                    for row in y.chunks_mut(lat) {
                        rms_norm(row, norm, c.rms_norm_eps, &mut yn);
                        row.copy_from_slice(&yn);
                    }
                }
                let mut up = vec![0f32; nt * h];
                bb.mat(&lt.routed_expert_up_proj).matmul(&y, nt, &mut up);
                up
            }
            None => routed,
        };
        if let Some(sh) = shared_out {
            add_into(&mut out, &sh);
        }
        Ok((out, routings))
    }

    /// The NoPE MLA shape (`mla_use_nope`: the `qk_rope_head_dim` part is a plain shared-key dot
    /// product) and the latent norms' eps for these numerics.
    fn mla_shape(&self) -> (MlaShape<'_>, f32) {
        let c = &self.cfg;
        let eps = match self.numerics {
            Numerics::Reference => LATENT_NORM_EPS,
            Numerics::LlamaCppCpu => c.rms_norm_eps,
        };
        let shape = MlaShape {
            n_heads: c.num_attention_heads,
            nope: c.qk_nope_head_dim,
            rope: c.qk_rope_head_dim,
            v_head_dim: c.v_head_dim,
            kv_lora_rank: c.kv_lora_rank,
            scale: self.softmax_scale,
            rotary: None,
        };
        (shape, eps)
    }

    /// NoPE MLA of a layer (weights `w`) for one token at position `pos` ([`mla_token`]; K3's
    /// output gate `o ⊙ σ(x W_gᵀ)` when configured, K3-SPEC §4). Appends this token's latent and
    /// key part to the cache. xn: `[hidden]` → `[hidden]`.
    fn mla(&self, w: &MlaTensors, xn: &[f32], pos: usize, c_kv: &mut Vec<f32>, k_pe_cache: &mut Vec<f32>) -> Vec<f32> {
        let (shape, eps) = self.mla_shape();
        mla_token(&shape, &w.view(&self.backbone), eps, xn, pos, c_kv, k_pe_cache)
    }

    /// [`Self::mla`] for a chunk of `nt` tokens at positions `pos0..pos0 + nt`
    /// ([`mla_chunk_layer`]); each token's result equals [`Self::mla`]'s bit for bit in the exact
    /// batch form. xn: `[nt, hidden]` → `[nt, hidden]`.
    fn mla_batch(
        &self,
        w: &MlaTensors,
        xn: &[f32],
        nt: usize,
        pos0: usize,
        c_kv: &mut Vec<f32>,
        k_pe_cache: &mut Vec<f32>,
    ) -> Vec<f32> {
        let (shape, eps) = self.mla_shape();
        let form = self.routed.batch_form().mla();
        let w = w.view(&self.backbone);
        mla_chunk_layer(&shape, &w, eps, xn, nt, pos0, c_kv, k_pe_cache, form)
    }

    /// MoE block (K3-SPEC §5; transformers `KimiLinearMoE`): routed experts through the store,
    /// in the latent width with LatentMoE, plus the shared experts on the full width. `draft`:
    /// the router restricted to the experts resident in the cache ([`route_masked`]), computed
    /// with those records (no reads). Layer `l`, weights `m`. x: `[hidden]` → `[hidden]`.
    fn moe(&self, l: usize, m: &MoeTensors, xn: &[f32], draft: bool) -> Result<(Vec<f32>, Routing), EngineError> {
        let c = &self.cfg;
        let bb = &self.backbone;
        // router_logits = x · W_gate^T in f32: [num_experts]
        let gate = bb.mat(&m.gate);
        let mut logits = vec![0f32; gate.rows];
        gate.matvec(xn, &mut logits);
        let router = RouterConfig {
            top_k: self.routed.experts_per_token(),
            ..self.router
        };
        let bias = bb.vec(&m.e_score_correction_bias);
        let routing = if draft {
            Routing::default()
        } else {
            route(&router, &logits, bias)
        };
        // xl: [expert_width] = routed_expert_down_proj(x) with LatentMoE, else x.
        let xl = match &m.latent {
            Some(lt) => {
                let mut xl = vec![0f32; c.expert_width()];
                bb.mat(&lt.routed_expert_down_proj).matvec(xn, &mut xl);
                xl
            }
            None => xn.to_vec(),
        };
        let shared = m.shared_experts.as_ref().map(|s| {
            let [g, u, d] = s.view(bb);
            move || glu_mlp(c.activation, g, u, d, xn)
        });
        let predict = || -> Result<Option<(usize, Vec<usize>)>, EngineError> {
            // The next MoE layer's router on this hidden state predicts its experts.
            let next = self.w.layers[l + 1..]
                .iter()
                .enumerate()
                .find_map(|(i, lw)| match &lw.mlp {
                    Ffn::Moe(nm) => Some((l + 1 + i, nm)),
                    Ffn::Dense(_) => None,
                });
            let Some((next, nm)) = next else {
                return Ok(None);
            };
            let mut next_logits = vec![0f32; c.num_experts];
            bb.mat(&nm.gate).matvec(xn, &mut next_logits);
            Ok(Some((
                next,
                route(&router, &next_logits, bb.vec(&nm.e_score_correction_bias)).experts,
            )))
        };
        let act = c.activation;
        let q8_0_inputs = self.numerics == Numerics::LlamaCppCpu;
        let xl_ref = &xl;
        let expert = |e: &Expert| glu_mlp_with(act, expert_glu(e), xl_ref, q8_0_inputs);
        let (routed, shared_out, routing) = if draft {
            self.routed.run_draft(
                l,
                c.num_experts,
                |allowed| route_masked(&router, &logits, bias, Some(allowed)),
                c.expert_width(),
                expert,
                shared,
            )
        } else {
            let (routed, shared_out) = self
                .routed
                .run(l, &routing, c.expert_width(), expert, shared, predict)?;
            (routed, shared_out, routing)
        };
        let mut out = match &m.latent {
            Some(lt) => {
                // y_r = up(rms(Σ w_i e_i; routed_expert_norm)) with latent_moe_use_norm.
                let mut y = routed;
                if let Some(norm) = &lt.routed_expert_norm {
                    let mut yn = vec![0f32; c.expert_width()];
                    rms_norm(&y, bb.vec(norm), c.rms_norm_eps, &mut yn);
                    y = yn;
                }
                let mut up = vec![0f32; c.hidden_size];
                bb.mat(&lt.routed_expert_up_proj).matvec(&y, &mut up);
                up
            }
            None => routed,
        };
        if let Some(sh) = shared_out {
            add_into(&mut out, &sh);
        }
        Ok((out, routing))
    }
}

/// The error of a decode state whose layer `l` does not fit this model's mixer there (a state
/// of another model).
fn other_state(l: usize) -> EngineError {
    EngineError::Invalid(format!(
        "layer {l}: the decode state is not this model's (another mixer kind)"
    ))
}

/// Attention-residual depth mix (K3-SPEC §2, [ATTN_RES]): scores `s_k = <v_k / rms(v_k), w>` for
/// each bank entry and for the current partial sum `c`, softmax over the `K + 1` scores (f32),
/// result `Σ α_k v_k + α_c c` over the RAW vectors. An empty bank returns `c`.
/// bank: `[K][hidden]`, c, w: `[hidden]` → `[hidden]`.
pub fn attn_res_mix(bank: &[Vec<f32>], c: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    if bank.is_empty() {
        return c.to_vec();
    }
    let score = |v: &[f32]| {
        let ms = v.iter().map(|x| x * x).sum::<f32>() / v.len() as f32;
        deltafin_kernels::dot(v, w) / (ms + eps).sqrt()
    };
    let mut alpha: Vec<f32> = bank.iter().map(|v| score(v)).chain(std::iter::once(score(c))).collect();
    softmax_inplace(&mut alpha);
    let mut out = vec![0f32; c.len()];
    for (v, a) in bank.iter().map(Vec::as_slice).chain(std::iter::once(c)).zip(&alpha) {
        deltafin_kernels::axpy(*a, v, &mut out);
    }
    out
}

/// SiTU-GLU (K3-SPEC §5, [SITU]): `β·tanh(g/β)·σ(g) · β_lin·tanh(u/β_lin)` (the up branch is `u`
/// when `β_lin` is None).
pub fn situ(g: f32, u: f32, beta: f32, linear_beta: Option<f32>) -> f32 {
    let gate = beta * (g / beta).tanh() * sigmoid(g);
    let up = match linear_beta {
        Some(b) => b * (u / b).tanh(),
        None => u,
    };
    gate * up
}

/// Gated feed-forward `down(act(gate(x), up(x)))` with SwiGLU or SiTU-GLU.
/// x: `[cols of gate]` → `[rows of down]`.
pub fn glu_mlp(act: GluActivation, gate: MatRef<'_>, up: MatRef<'_>, down: MatRef<'_>, x: &[f32]) -> Vec<f32> {
    glu_mlp_with(act, [gate, up, down], x, false)
}

/// [`glu_mlp`] of the block `w = [gate, up, down]`; with `q8_0_inputs`, the input of each MXFP4
/// matrix is first rounded through ggml's `Q8_0`, as llama.cpp's CPU backend does
/// ([`Numerics::LlamaCppCpu`], `deltafin_kernels::q8_0::round_trip`).
/// x: `[cols of gate]` → `[rows of down]`.
pub fn glu_mlp_with(act: GluActivation, w: [MatRef<'_>; 3], x: &[f32], q8_0_inputs: bool) -> Vec<f32> {
    let [gate, up, down] = w;
    let rounded = |m: &MatRef<'_>, v: &[f32]| -> Option<Vec<f32>> {
        (q8_0_inputs && matches!(m.data, MatData::Mxfp4 { .. })).then(|| deltafin_kernels::q8_0::round_trip(v))
    };
    let xq = rounded(&gate, x);
    let xg = xq.as_deref().unwrap_or(x);
    let mut g = vec![0f32; gate.rows];
    let mut u = vec![0f32; up.rows];
    gate.matvec(xg, &mut g);
    match rounded(&up, x) {
        Some(xu) => up.matvec(&xu, &mut u),
        None => up.matvec(x, &mut u),
    }
    glu_activate(act, &mut g, &u);
    let mut out = vec![0f32; down.rows];
    match rounded(&down, &g) {
        Some(gq) => down.matvec(&gq, &mut out),
        None => down.matvec(&g, &mut out),
    }
    out
}

/// A routed expert's record as a GLU block's `[gate, up, down]` (its matrices 0, 1, 2).
fn expert_glu(e: &Expert) -> [MatRef<'_>; 3] {
    [e.matrix(0), e.matrix(1), e.matrix(2)]
}

/// The GLU's gate applied in place: `g ← silu(g) · u` (SwiGLU) or `situ(g, u)` (SiTU-GLU),
/// element by element; `g`, `u`: `[rows of gate]` or `[n, rows of gate]`.
fn glu_activate(act: GluActivation, g: &mut [f32], u: &[f32]) {
    for (a, b) in g.iter_mut().zip(u) {
        *a = match act {
            GluActivation::Silu => silu(*a) * b,
            GluActivation::Situ { beta, linear_beta } => situ(*a, *b, beta, linear_beta),
        };
    }
}

/// [`glu_mlp`] of the block `w = [gate, up, down]` for `n` tokens at once (matrix-matrix
/// products): x `[n, cols of gate]` →
/// `[n, rows of down]`, each row equal to [`glu_mlp`] of that row (the kernels' `matmul` equals
/// `n` matvecs bit for bit).
pub fn glu_mlp_batch(act: GluActivation, w: [MatRef<'_>; 3], x: &[f32], n: usize) -> Vec<f32> {
    let [gate, up, down] = w;
    let mut g = vec![0f32; n * gate.rows];
    let mut u = vec![0f32; n * up.rows];
    gate.matmul(x, n, &mut g);
    up.matmul(x, n, &mut u);
    glu_activate(act, &mut g, &u);
    let mut out = vec![0f32; n * down.rows];
    down.matmul(&g, n, &mut out);
    out
}

impl FamilyModel for KimiLinear {
    type State = KimiLinearState;

    crate::model::resident_items!();

    fn new_state(&self) -> KimiLinearState {
        HybridState::new(
            self.empty_states.clone(),
            (self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim),
        )
    }

    fn step(&self, st: &mut KimiLinearState, token: u32) -> Result<(Vec<f32>, LayerRoutes), EngineError> {
        self.forward_token(st, token, false)
    }

    fn draft_step(&self, st: &mut KimiLinearState, token: u32) -> Result<Option<Vec<f32>>, EngineError> {
        Ok(Some(self.forward_token(st, token, true)?.0))
    }

    fn supports_draft(&self) -> bool {
        true
    }

    fn chunk(&self, st: &mut KimiLinearState, tokens: &[u32], all_logits: bool) -> Result<BatchOutput, EngineError> {
        if self.numerics != Numerics::Reference {
            // The peer-numerics mode (Q8_0-rounded expert inputs) lives in the one-token path.
            return token_at_a_time(tokens, all_logits, |t| self.forward_token(st, t, false));
        }
        self.forward_chunk(st, tokens, all_logits)
    }

    fn rollback(&self, st: &mut KimiLinearState, len: usize) -> bool {
        st.rollback(len, |l, &(kvl, rope), s| match s {
            MixerState::Kda(k) => {
                let Some(Mixer::Kda { cfg, w }) = self.w.layers.get(l).map(|lw| &lw.self_attn) else {
                    return false;
                };
                k.rollback(&self.kda(cfg, w), len).is_ok()
            }
            MixerState::Mla { c_kv, k_pe } => {
                c_kv.truncate(len * kvl);
                k_pe.truncate(len * rope);
                true
            }
        })
    }

    fn set_numerics(&mut self, numerics: Numerics) -> Result<(), EngineError> {
        self.numerics = numerics;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn situ_matches_hand_computed_values() {
        // g = 1, u = 2, β = 4, β_lin = 25: 4·tanh(0.25)·σ(1) · 25·tanh(0.08)
        let want = 4.0 * 0.244_918_66_f32 * 0.731_058_6 * 25.0 * 0.079_829_6;
        assert!((situ(1.0, 2.0, 4.0, Some(25.0)) - want).abs() < 1e-5);
        // Without β_lin the up branch passes through.
        let want = 4.0 * 0.244_918_66_f32 * 0.731_058_6 * 2.0;
        assert!((situ(1.0, 2.0, 4.0, None) - want).abs() < 1e-5);
        // Large gates saturate at β (σ → 1), large up values at β_lin.
        assert!((situ(100.0, 1000.0, 4.0, Some(25.0)) - 100.0).abs() < 1e-3);
    }

    #[test]
    fn attn_res_mix_matches_hand_computed_weights() {
        // Empty bank: identity.
        assert_eq!(attn_res_mix(&[], &[1.0, 2.0], &[1.0, 1.0], 0.0), vec![1.0, 2.0]);
        // v = [2, 0] (rms √2 → normalised [√2, 0]), c = [0, 1] (rms 1/√2 → [0, √2]), w = [1, 0]:
        // scores √2 and 0, α = softmax → [e^√2, 1] / (e^√2 + 1); result = α_v·v + α_c·c.
        let out = attn_res_mix(&[vec![2.0, 0.0]], &[0.0, 1.0], &[1.0, 0.0], 0.0);
        let e = std::f32::consts::SQRT_2.exp();
        let (av, ac) = (e / (e + 1.0), 1.0 / (e + 1.0));
        assert!(
            (out[0] - 2.0 * av).abs() < 1e-6 && (out[1] - ac).abs() < 1e-6,
            "{out:?}"
        );
        // The scores use the normalised vectors: scaling an entry changes its weight not at all,
        // but the sum uses the raw (scaled) entry.
        let out2 = attn_res_mix(&[vec![20.0, 0.0]], &[0.0, 1.0], &[1.0, 0.0], 0.0);
        assert!(
            (out2[0] - 20.0 * av).abs() < 1e-5 && (out2[1] - ac).abs() < 1e-6,
            "{out2:?}"
        );
    }
}
