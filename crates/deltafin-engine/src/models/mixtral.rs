//! Mixtral forward pass, one token at a time or a chunk at once (batched GQA, expert-major
//! MoE; bit-identical to token at a time), matching transformers'
//! `models/mixtral/modeling_mixtral.py` in f32.
//!
//! Per decoder layer (PyTorch equivalent in the comments):
//! ```text
//! h = x + self_attn(input_layernorm(x))                  # GQA, optional sliding window
//! x = h + block_sparse_moe(post_attention_layernorm(h))  # every layer is MoE
//! ```
//! then `logits = lm_head(norm(x))`.
//!
//! `block_sparse_moe`: router `gate` `[num_local_experts, hidden]`, softmax over all experts,
//! top-k (2), always renormalised [SOFTMAX_TOPK]; expert `e` is
//! `w2(silu(w1(x)) * w3(x))` (`w1` gate, `w3` up, `w2` down); no shared expert. Attention:
//! [GQA_ATTENTION] without q/k norms, window `sliding_window` when the config sets one.

use deltafin_format::model_dir::Backbone;
use deltafin_format::{MixtralConfig, ModelConfig, ModelDir};
use deltafin_kernels::{rms_norm, MatRef};

use crate::experts::StoreOptions;
use crate::gqa::{GqaAttention, GqaDecoder, GqaDims, GqaLayer, GqaNames, KvCache};
use crate::model::{
    one_or_chunk, softmax_moe, softmax_moe_batch, state_as, BatchOutput, CausalLm, DecodeState, LayerRoutes,
    RoutedExperts,
};
use crate::EngineError;

/// Tensor names of one decoder layer, as in the Hugging Face checkpoint.
struct LayerNames {
    input_layernorm: String,
    post_attention_layernorm: String,
    attn: GqaNames,
    /// `block_sparse_moe.gate.weight [num_local_experts, hidden]`.
    router: String,
}

impl LayerNames {
    fn new(l: usize) -> Self {
        let p = format!("model.layers.{l}");
        LayerNames {
            input_layernorm: format!("{p}.input_layernorm.weight"),
            post_attention_layernorm: format!("{p}.post_attention_layernorm.weight"),
            attn: GqaNames::new(&p, false),
            router: format!("{p}.block_sparse_moe.gate.weight"),
        }
    }
}

/// A loaded Mixtral model: resident backbone plus the routed-expert store.
pub struct Mixtral {
    config: ModelConfig,
    pub cfg: MixtralConfig,
    backbone: Backbone,
    names: Vec<LayerNames>,
    attn: GqaAttention,
    routed: RoutedExperts,
}

impl Mixtral {
    /// Loads the backbone into memory and opens the expert store with `opts`.
    ///
    /// Errors: not a `mixtral` directory, a missing or malformed tensor in the backbone,
    /// unreadable files, O_DIRECT refused.
    pub fn load_with(dir: &ModelDir, opts: StoreOptions) -> Result<Self, EngineError> {
        let config = dir.manifest.config.clone();
        let cfg = config
            .as_mixtral()
            .ok_or_else(|| EngineError::Invalid(format!("{}: not a mixtral model", dir.path.display())))?
            .clone();
        let backbone = dir.load_backbone()?;
        let names: Vec<LayerNames> = (0..cfg.num_hidden_layers).map(LayerNames::new).collect();
        // Check every tensor the forward pass uses once, so a bad directory fails at load.
        backbone.matrix("model.embed_tokens.weight")?;
        backbone.matrix("lm_head.weight")?;
        backbone.vector("model.norm.weight")?;
        for n in &names {
            backbone.vector(&n.input_layernorm)?;
            backbone.vector(&n.post_attention_layernorm)?;
            n.attn.check(&backbone)?;
            backbone.matrix(&n.router)?;
        }
        let dims = GqaDims {
            hidden: cfg.hidden_size,
            n_heads: cfg.num_attention_heads,
            n_kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
            sliding_window: cfg.sliding_window,
        };
        let attn = GqaAttention::new(dims, &cfg.rope, cfg.rms_norm_eps);
        let routed = RoutedExperts::open(dir, opts)?;
        Ok(Mixtral {
            config,
            cfg,
            backbone,
            names,
            attn,
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
    /// the routing of every layer.
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
        let mut routes = Vec::with_capacity(c.num_hidden_layers);
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
            b.out = out;
            // x = h + block_sparse_moe(post_attention_layernorm(h))
            rms_norm(&b.x, self.v(&n.post_attention_layernorm)?, c.rms_norm_eps, &mut b.xn);
            let next = match self.names.get(l + 1) {
                Some(nn) => Some((l + 1, self.m(&nn.router)?)),
                None => None,
            };
            let (y, r) = self.routed.time_mlp(|| {
                softmax_moe(
                    &self.routed,
                    l,
                    self.m(&n.router)?,
                    next,
                    true,
                    &b.xn,
                    &mut b.router,
                    &mut b.probs,
                    draft,
                )
            })?;
            for (a, o) in b.x.iter_mut().zip(&y) {
                *a += o;
            }
            routes.push((l, r));
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
    /// ([`GqaAttention::forward_batch`]) and expert-major MoE ([`softmax_moe_batch`]); see
    /// [`CausalLm::forward_batch`]. Every position's logits equal [`Self::forward_token`]'s
    /// bit for bit.
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
            let (y, r) = softmax_moe_batch(&self.routed, l, self.m(&self.names[l].router)?, true, xn, nt)?;
            Ok((y, Some(r)))
        };
        dec.forward_chunk(&layer, cache, tokens, all_logits, &mlp)
    }
}

impl CausalLm for Mixtral {
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
        self.attn.batch_bytes_per_token(self.cfg.num_local_experts)
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

impl crate::models::gqa_cuda::GqaFamily for Mixtral {
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
            .map(|n| GqaLayerSpec {
                input_layernorm: n.input_layernorm.clone(),
                post_attention_layernorm: n.post_attention_layernorm.clone(),
                attn: n.attn.clone(),
                mlp: MlpSpec::Moe {
                    router: n.router.clone(),
                    router_bias: None,
                },
            })
            .collect()
    }

    fn softmax_router(&self) -> deltafin_cuda::SoftmaxRouter {
        // Mixtral always renormalises the chosen probabilities (`softmax_moe(.., true, ..)`).
        deltafin_cuda::SoftmaxRouter::SoftmaxThenTopK { norm_topk_prob: true }
    }

    fn rms_norm_eps(&self) -> f32 {
        self.cfg.rms_norm_eps
    }
}
