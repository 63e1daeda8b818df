//! Qwen3-MoE forward pass, one token at a time or a chunk at once (batched GQA, expert-major
//! MoE; bit-identical to token at a time), matching transformers'
//! `models/qwen3_moe/modeling_qwen3_moe.py` in f32.
//!
//! Per decoder layer (PyTorch equivalent in the comments):
//! ```text
//! h = x + self_attn(input_layernorm(x))       # GQA, per-head q_norm/k_norm before RoPE
//! x = h + mlp(post_attention_layernorm(h))    # Qwen3MoeSparseMoeBlock or dense Qwen3MoeMLP
//! ```
//! then `logits = lm_head(norm(x))`.
//!
//! A layer is MoE unless it is in `mlp_only_layers` or `(l + 1) % decoder_sparse_step != 0`
//! [QWEN3_MOE_LAYERS]; dense layers run a SwiGLU MLP of `intermediate_size`. The MoE block has
//! no shared expert (unlike `qwen2_moe`): softmax over all experts, top-k, renormalised when
//! `norm_topk_prob` [SOFTMAX_TOPK]. Attention: [GQA_ATTENTION] with `q_norm`/`k_norm`
//! (RMSNorm over each head's `head_dim`, eps `rms_norm_eps`) applied to q and k before RoPE.

use deltafin_format::model_dir::Backbone;
use deltafin_format::{ModelConfig, ModelDir, Qwen3MoeConfig};
use deltafin_kernels::{rms_norm, MatRef};

use crate::experts::StoreOptions;
use crate::gqa::{GqaAttention, GqaDecoder, GqaDims, GqaLayer, GqaNames, KvCache};
use crate::model::{
    one_or_chunk, softmax_moe, softmax_moe_batch, state_as, swiglu_batch, swiglu_into, BatchOutput, CausalLm,
    DecodeState, LayerRoutes, RoutedExperts,
};
use crate::EngineError;

/// Tensor names of one decoder layer, as in the Hugging Face checkpoint.
struct LayerNames {
    input_layernorm: String,
    post_attention_layernorm: String,
    attn: GqaNames,
    /// `mlp.gate.weight [num_experts, hidden]` (MoE layers).
    router: String,
    /// Dense MLP (non-MoE layers).
    gate_proj: String,
    up_proj: String,
    down_proj: String,
}

impl LayerNames {
    fn new(l: usize) -> Self {
        let p = format!("model.layers.{l}");
        let m = format!("{p}.mlp");
        LayerNames {
            input_layernorm: format!("{p}.input_layernorm.weight"),
            post_attention_layernorm: format!("{p}.post_attention_layernorm.weight"),
            attn: GqaNames::new(&p, true),
            router: format!("{m}.gate.weight"),
            gate_proj: format!("{m}.gate_proj.weight"),
            up_proj: format!("{m}.up_proj.weight"),
            down_proj: format!("{m}.down_proj.weight"),
        }
    }
}

/// A loaded Qwen3-MoE model: resident backbone plus the routed-expert store.
pub struct Qwen3Moe {
    config: ModelConfig,
    pub cfg: Qwen3MoeConfig,
    backbone: Backbone,
    names: Vec<LayerNames>,
    attn: GqaAttention,
    /// For each layer, the next MoE layer after it (prefetch prediction).
    next_moe: Vec<Option<usize>>,
    routed: RoutedExperts,
}

impl Qwen3Moe {
    /// Loads the backbone into memory and opens the expert store with `opts`.
    ///
    /// Errors: not a `qwen3_moe` directory, a missing or malformed tensor in the backbone,
    /// unreadable files, O_DIRECT refused.
    pub fn load_with(dir: &ModelDir, opts: StoreOptions) -> Result<Self, EngineError> {
        let config = dir.manifest.config.clone();
        let cfg = config
            .as_qwen3_moe()
            .ok_or_else(|| EngineError::Invalid(format!("{}: not a qwen3_moe model", dir.path.display())))?
            .clone();
        let backbone = dir.load_backbone()?;
        let names: Vec<LayerNames> = (0..cfg.num_hidden_layers).map(LayerNames::new).collect();
        // Check every tensor the forward pass uses once, so a bad directory fails at load.
        backbone.matrix("model.embed_tokens.weight")?;
        backbone.matrix("lm_head.weight")?;
        backbone.vector("model.norm.weight")?;
        for (l, n) in names.iter().enumerate() {
            backbone.vector(&n.input_layernorm)?;
            backbone.vector(&n.post_attention_layernorm)?;
            n.attn.check(&backbone)?;
            if cfg.is_moe_layer(l) {
                backbone.matrix(&n.router)?;
            } else {
                backbone.matrix(&n.gate_proj)?;
                backbone.matrix(&n.up_proj)?;
                backbone.matrix(&n.down_proj)?;
            }
        }
        let dims = GqaDims {
            hidden: cfg.hidden_size,
            n_heads: cfg.num_attention_heads,
            n_kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
            sliding_window: cfg.sliding_window,
        };
        let attn = GqaAttention::new(dims, &cfg.rope, cfg.rms_norm_eps);
        let next_moe = (0..cfg.num_hidden_layers)
            .map(|l| (l + 1..cfg.num_hidden_layers).find(|&k| cfg.is_moe_layer(k)))
            .collect();
        let routed = RoutedExperts::open(dir, opts)?;
        Ok(Qwen3Moe {
            config,
            cfg,
            backbone,
            names,
            attn,
            next_moe,
            routed,
        })
    }

    fn m(&self, name: &str) -> Result<MatRef<'_>, EngineError> {
        Ok(self.backbone.matrix(name)?)
    }

    fn v(&self, name: &str) -> Result<&[f32], EngineError> {
        Ok(self.backbone.vector(name)?)
    }

    /// Runs one token at the next position of `cache`; returns the logits `[vocab_size]` and
    /// the routing of every MoE layer.
    ///
    /// Errors: token id outside the vocabulary, expert read or checksum failures.
    fn forward_token(
        &self,
        cache: &mut KvCache,
        token: u32,
        draft: bool,
    ) -> Result<(Vec<f32>, LayerRoutes), EngineError> {
        let c = &self.cfg;
        if token as usize >= c.vocab_size {
            return Err(EngineError::TokenOutOfRange {
                id: token,
                vocab_size: c.vocab_size,
            });
        }
        cache.check(c.num_hidden_layers, &self.attn.dims)?;
        let h = c.hidden_size;
        let mut b = std::mem::take(&mut cache.buffers);
        b.x.resize(h, 0.0);
        b.xn.resize(h, 0.0);
        b.out.resize(h, 0.0);
        // x = embed_tokens(token): [hidden]
        self.m("model.embed_tokens.weight")?.row_into(token as usize, &mut b.x);
        let mut routes = Vec::new();
        for l in 0..c.num_hidden_layers {
            let n = &self.names[l];
            // h = x + self_attn(input_layernorm(x))
            rms_norm(&b.x, self.v(&n.input_layernorm)?, c.rms_norm_eps, &mut b.xn);
            let mut out = std::mem::take(&mut b.out);
            let xn = std::mem::take(&mut b.xn);
            let r = self.routed.time_attention(|| {
                self.attn
                    .forward(&self.backbone, &n.attn, l, &xn, cache, &mut b, &mut out)
            });
            b.xn = xn;
            r?;
            for (a, o) in b.x.iter_mut().zip(&out) {
                *a += o;
            }
            // x = h + mlp(post_attention_layernorm(h))
            rms_norm(&b.x, self.v(&n.post_attention_layernorm)?, c.rms_norm_eps, &mut b.xn);
            self.routed.time_mlp(|| -> Result<(), EngineError> {
                if c.is_moe_layer(l) {
                    let next = match self.next_moe[l] {
                        Some(k) => Some((k, self.m(&self.names[k].router)?)),
                        None => None,
                    };
                    let (y, r) = softmax_moe(
                        &self.routed,
                        l,
                        self.m(&n.router)?,
                        next,
                        c.norm_topk_prob,
                        &b.xn,
                        &mut b.router,
                        &mut b.probs,
                        draft,
                    )?;
                    out.copy_from_slice(&y);
                    routes.push((l, r));
                } else {
                    swiglu_into(
                        self.m(&n.gate_proj)?,
                        self.m(&n.up_proj)?,
                        self.m(&n.down_proj)?,
                        &b.xn,
                        &mut b.gate,
                        &mut b.up,
                        &mut out,
                    );
                }
                Ok(())
            })?;
            for (a, o) in b.x.iter_mut().zip(&out) {
                *a += o;
            }
            b.out = out;
        }
        cache.advance();
        self.routed.count_forward();
        // logits = lm_head(norm(x))
        rms_norm(&b.x, self.v("model.norm.weight")?, c.rms_norm_eps, &mut b.xn);
        let lm = self.m("lm_head.weight")?;
        let mut logits = vec![0f32; lm.rows];
        lm.matvec(&b.xn, &mut logits);
        cache.buffers = b;
        Ok((logits, routes))
    }

    /// Runs a chunk of tokens at the next positions of `cache`: batched GQA
    /// ([`GqaAttention::forward_batch`]), expert-major MoE ([`softmax_moe_batch`]) and dense MLPs
    /// as matrix-matrix products; see [`CausalLm::forward_batch`]. Every position's logits
    /// equal [`Self::forward_token`]'s bit for bit.
    fn forward_chunk(&self, cache: &mut KvCache, tokens: &[u32], all_logits: bool) -> Result<BatchOutput, EngineError> {
        let c = &self.cfg;
        let dec = GqaDecoder {
            backbone: &self.backbone,
            attn: &self.attn,
            routed: &self.routed,
            n_layers: c.num_hidden_layers,
            vocab_size: c.vocab_size,
            rms_norm_eps: c.rms_norm_eps,
        };
        let layer = |l: usize| {
            let n = &self.names[l];
            GqaLayer {
                input_layernorm: &n.input_layernorm,
                post_attention_layernorm: &n.post_attention_layernorm,
                attn: &n.attn,
            }
        };
        let mlp = |l: usize, xn: &[f32], nt: usize| {
            let n = &self.names[l];
            if c.is_moe_layer(l) {
                let (y, r) = softmax_moe_batch(&self.routed, l, self.m(&n.router)?, c.norm_topk_prob, xn, nt)?;
                Ok((y, Some(r)))
            } else {
                let y = swiglu_batch(
                    self.m(&n.gate_proj)?,
                    self.m(&n.up_proj)?,
                    self.m(&n.down_proj)?,
                    xn,
                    nt,
                );
                Ok((y, None))
            }
        };
        dec.forward_chunk(&layer, cache, tokens, all_logits, &mlp)
    }
}

impl CausalLm for Qwen3Moe {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn new_state(&self) -> Box<dyn DecodeState> {
        Box::new(KvCache::new(self.cfg.num_hidden_layers, &self.attn.dims))
    }

    fn forward(&self, state: &mut dyn DecodeState, token: u32) -> Result<(Vec<f32>, LayerRoutes), EngineError> {
        self.forward_token(state_as::<KvCache>(state)?, token, false)
    }

    fn forward_draft(&self, state: &mut dyn DecodeState, token: u32) -> Result<Option<Vec<f32>>, EngineError> {
        Ok(Some(self.forward_token(state_as::<KvCache>(state)?, token, true)?.0))
    }

    fn supports_draft(&self) -> bool {
        true
    }

    fn forward_batch(
        &self,
        state: &mut dyn DecodeState,
        tokens: &[u32],
        all_logits: bool,
    ) -> Result<BatchOutput, EngineError> {
        one_or_chunk::<KvCache>(
            state,
            tokens,
            all_logits,
            |c, t| self.forward_token(c, t, false),
            |c, t, a| self.forward_chunk(c, t, a),
        )
    }

    fn batch_bytes_per_token(&self) -> usize {
        self.attn
            .batch_bytes_per_token(self.cfg.num_experts.max(2 * self.cfg.intermediate_size))
    }

    fn routed(&self) -> &RoutedExperts {
        &self.routed
    }

    fn routed_mut(&mut self) -> &mut RoutedExperts {
        &mut self.routed
    }

    fn backbone_bytes(&self) -> usize {
        self.backbone.bytes()
    }
}

impl crate::models::gqa_cuda::GqaFamily for Qwen3Moe {
    fn backbone(&self) -> &Backbone {
        &self.backbone
    }

    fn attention(&self) -> &GqaAttention {
        &self.attn
    }

    fn layer_specs(&self) -> Vec<crate::models::gqa_cuda::GqaLayerSpec> {
        use crate::models::gqa_cuda::{GqaLayerSpec, MlpSpec};
        self.names
            .iter()
            .enumerate()
            .map(|(l, n)| GqaLayerSpec {
                input_layernorm: n.input_layernorm.clone(),
                post_attention_layernorm: n.post_attention_layernorm.clone(),
                attn: n.attn.clone(),
                mlp: if self.cfg.is_moe_layer(l) {
                    MlpSpec::Moe {
                        router: n.router.clone(),
                        router_bias: None,
                    }
                } else {
                    MlpSpec::Dense([n.gate_proj.clone(), n.up_proj.clone(), n.down_proj.clone()])
                },
            })
            .collect()
    }

    fn softmax_router(&self) -> deltafin_cuda::SoftmaxRouter {
        deltafin_cuda::SoftmaxRouter::SoftmaxThenTopK {
            norm_topk_prob: self.cfg.norm_topk_prob,
        }
    }

    fn rms_norm_eps(&self) -> f32 {
        self.cfg.rms_norm_eps
    }
}
