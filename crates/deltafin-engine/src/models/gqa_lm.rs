//! The Llama-style decoder that Qwen3-MoE, Mixtral and gpt-oss share, written once: token
//! embedding `model.embed_tokens`, per layer
//! ```text
//! h = x + self_attn(input_layernorm(x))        # grouped-query attention, crate::gqa
//! x = h + mlp(post_attention_layernorm(h))     # the family's block: GqaMlp
//! ```
//! then `logits = lm_head(model.norm(x))`, one token at a time ([`GqaLm`]'s `forward`) or a
//! chunk at once (batched attention, expert-major MoE; bit-identical to token at a time). [`GqaLm`]
//! owns what the families share: the backbone, the attention, the KV-cache decode state, the
//! routed-expert runtime and the [`CausalLm`] implementation. A family file implements
//! [`GqaMlp`] (what its feed-forward block computes, in the checkpoint's names) and says its
//! config-derived shape ([`DecoderShape`]).
//!
//! Weights: the tensor names are digested once at load ([`GqaNames`] and the family's names)
//! and every tensor is resolved there, once, into a typed handle ([`LayerWeights`],
//! [`GqaMlp::Weights`]: [`MatHandle`] / [`VecHandle`] fields named as in the checkpoint), so a
//! missing or malformed tensor fails at load with its name. The model holds the handles next to
//! the backbone they index (a handle is an owned, checked byte range, not a borrow, so nothing is
//! self-referential), and a forward pass reads each weight with the infallible
//! [`Backbone::mat`] / [`Backbone::vec`]: no name lookup and no error path per use.

use deltafin_cuda::SoftmaxRouter;
use deltafin_format::model_dir::{Backbone, MatHandle, VecHandle};
use deltafin_format::{ModelConfig, ModelDir, Rope};
use deltafin_kernels::{rms_norm, MatRef};

use crate::compute::{chunk_logits, decoder_layers, on_cpu, Cpu};
use crate::experts::StoreOptions;
use crate::gqa::{Buffers, GqaAttention, GqaDims, GqaNames, GqaWeights, KvCache};
use crate::model::{add_into, softmax_moe, BatchOutput, FamilyModel, LayerRoutes, RoutedExperts};
use crate::models::gqa_cuda::{ExpertKind, GqaFamily, GqaLayerSpec, MlpSpec};
use crate::moe::Routing;
use crate::EngineError;

/// The feed-forward block of a GQA family (MoE or dense per layer), the part of a decoder layer
/// that differs between Qwen3-MoE, Mixtral and gpt-oss.
pub trait GqaMlp: Send + Sync + 'static {
    /// One layer's feed-forward weights: handles into the backbone, resolved once at load.
    type Weights: Send + Sync + 'static;

    /// Resolves layer `l`'s feed-forward tensors in `bb` (at load), checking their kinds.
    ///
    /// Errors: a missing or malformed tensor (named).
    fn weights(&self, bb: &Backbone, l: usize) -> Result<Self::Weights, EngineError>;

    /// Layer `step.layer`'s block on one token: `xn: [hidden]` (after
    /// `post_attention_layernorm`) → `out: [hidden]`; returns the routing when the layer is
    /// MoE. `layers` holds every layer's weights, read in `step.backbone` (the prefetch
    /// predicts a later layer's experts); `buf`'s router and MLP buffers are free to use.
    ///
    /// Errors: expert read or checksum failures.
    fn forward(
        &self,
        step: MlpStep<'_>,
        layers: &[Self::Weights],
        xn: &[f32],
        buf: &mut Buffers,
        out: &mut [f32],
    ) -> Result<Option<Routing>, EngineError>;

    /// Layer `l`'s block (weights `w` in `bb`) on a chunk: `xn: [nt, hidden]` → `[nt, hidden]`
    /// and, when the layer is MoE, every token's routing; each row equal to [`Self::forward`]'s
    /// bit for bit.
    ///
    /// Errors: expert read or checksum failures.
    #[allow(clippy::too_many_arguments)]
    fn forward_chunk(
        &self,
        routed: &RoutedExperts,
        bb: &Backbone,
        w: &Self::Weights,
        l: usize,
        xn: &[f32],
        nt: usize,
    ) -> Result<(Vec<f32>, Option<Vec<Routing>>), EngineError>;

    /// f32 values per token a chunk's block holds besides the attention's (router logits,
    /// dense-MLP activations), for [`CausalLm::batch_bytes_per_token`].
    fn batch_f32_per_token(&self) -> usize;

    /// Layer `l`'s block for the CUDA path (tensor names).
    fn cuda_spec(&self, l: usize) -> MlpSpec;

    /// The MoE layers' router for the CUDA path.
    fn softmax_router(&self) -> SoftmaxRouter;

    /// What a routed expert computes, for the CUDA path.
    fn expert_kind(&self) -> ExpertKind {
        ExpertKind::SwiGlu
    }
}

/// What a one-token feed-forward block runs on besides its weights.
#[derive(Clone, Copy)]
pub struct MlpStep<'a> {
    /// The routed-expert runtime.
    pub routed: &'a RoutedExperts,
    /// The backbone the weights' handles index.
    pub backbone: &'a Backbone,
    /// The layer.
    pub layer: usize,
    /// Self-drafting: route among the experts resident in the cache, read nothing
    /// ([`RoutedExperts::run_draft`]).
    pub draft: bool,
}

impl MlpStep<'_> {
    /// This layer's MoE block with softmax routing ([`softmax_moe`]: Mixtral's
    /// `block_sparse_moe`, Qwen3-MoE's sparse `mlp`) written into `out`: `router` is the
    /// layer's `gate` `[n_experts, hidden]`, `next` the next MoE layer and its router (prefetch
    /// prediction), `buf`'s router logits and probabilities are reused. xn, out: `[hidden]`.
    ///
    /// Errors: expert read or checksum failures.
    pub fn softmax_moe(
        &self,
        router: MatRef<'_>,
        next: Option<(usize, MatRef<'_>)>,
        norm_topk_prob: bool,
        xn: &[f32],
        buf: &mut Buffers,
        out: &mut [f32],
    ) -> Result<Option<Routing>, EngineError> {
        let (y, routing) = softmax_moe(
            self.routed,
            self.layer,
            router,
            next,
            norm_topk_prob,
            xn,
            &mut buf.router,
            &mut buf.probs,
            self.draft,
        )?;
        out.copy_from_slice(&y);
        Ok(Some(routing))
    }
}

/// A family's decoder shape, from its config.
pub struct DecoderShape<'a> {
    /// The attention's shape (`hidden_size`, heads, `head_dim`, model-wide window).
    pub dims: GqaDims,
    /// Rotary embedding of the attention.
    pub rope: &'a Rope,
    /// Each layer's attention names, `model.layers.{l}.self_attn.*` (the list's length is
    /// `num_hidden_layers`).
    pub attn: Vec<GqaNames>,
    /// `vocab_size`.
    pub vocab_size: usize,
    /// eps of every RMSNorm (`rms_norm_eps`), the per-head q/k norms included.
    pub rms_norm_eps: f32,
}

/// The [`DecoderShape`] of a family config `$cfg` with the Llama-style fields (`hidden_size`,
/// `num_attention_heads`, `num_key_value_heads`, `head_dim`, `rope`, `num_hidden_layers`,
/// `vocab_size`, `rms_norm_eps`): the model-wide window `$window`, layer `l`'s attention names
/// `$attn(l)`. A macro because each family's config is its own type.
macro_rules! decoder_shape {
    ($cfg:expr, sliding_window: $window:expr, attn: $attn:expr $(,)?) => {{
        let cfg = $cfg;
        $crate::models::gqa_lm::DecoderShape {
            dims: $crate::gqa::GqaDims {
                hidden: cfg.hidden_size,
                n_heads: cfg.num_attention_heads,
                n_kv_heads: cfg.num_key_value_heads,
                head_dim: cfg.head_dim,
                sliding_window: $window,
            },
            rope: &cfg.rope,
            attn: (0..cfg.num_hidden_layers).map($attn).collect(),
            vocab_size: cfg.vocab_size,
            rms_norm_eps: cfg.rms_norm_eps,
        }
    }};
}
pub(crate) use decoder_shape;

/// Names of one layer's norms and attention, `model.layers.{l}.*`.
struct LayerNames {
    input_layernorm: String,
    post_attention_layernorm: String,
    attn: GqaNames,
}

/// One layer's norms and attention, resolved in the backbone at load.
#[derive(Debug, Clone, Copy)]
pub struct LayerWeights {
    /// `input_layernorm.weight [hidden]`.
    pub input_layernorm: VecHandle,
    /// `post_attention_layernorm.weight [hidden]`.
    pub post_attention_layernorm: VecHandle,
    pub attn: GqaWeights,
}

/// Every weight of a forward pass, resolved in the backbone at load; `M` is the family's
/// [`GqaMlp::Weights`].
pub struct Weights<M> {
    /// `model.embed_tokens.weight [vocab_size, hidden]`.
    pub embed_tokens: MatHandle,
    pub layers: Vec<LayerWeights>,
    /// The feed-forward block of each layer.
    pub mlp: Vec<M>,
    /// `model.norm.weight [hidden]`.
    pub norm: VecHandle,
    /// `lm_head.weight [vocab_size, hidden]`.
    pub lm_head: MatHandle,
}

/// A loaded GQA-family model: resident backbone, the family's block `F`, the routed-expert
/// store.
pub struct GqaLm<F: GqaMlp> {
    config: ModelConfig,
    /// The family: its config and feed-forward block.
    pub family: F,
    backbone: Backbone,
    /// Every weight, as handles into `backbone`.
    weights: Weights<F::Weights>,
    /// The names behind `weights`, for the CUDA path's upload.
    layers: Vec<LayerNames>,
    attn: GqaAttention,
    vocab_size: usize,
    rms_norm_eps: f32,
    routed: RoutedExperts,
}

impl<F: GqaMlp> GqaLm<F> {
    /// Loads the backbone of `dir` into memory, checks every tensor the forward pass uses, and
    /// opens the expert store with `opts`.
    ///
    /// Errors: a missing or malformed tensor in the backbone, unreadable files, O_DIRECT refused.
    pub fn load(dir: &ModelDir, opts: StoreOptions, shape: DecoderShape<'_>, family: F) -> Result<Self, EngineError> {
        let backbone = dir.load_backbone()?;
        let layers: Vec<LayerNames> = shape
            .attn
            .into_iter()
            .enumerate()
            .map(|(l, attn)| LayerNames {
                input_layernorm: format!("model.layers.{l}.input_layernorm.weight"),
                post_attention_layernorm: format!("model.layers.{l}.post_attention_layernorm.weight"),
                attn,
            })
            .collect();
        // Every tensor the forward pass uses, once, so a bad directory fails at load.
        let weights = resolve(&backbone, &layers, &family)?;
        let routed = RoutedExperts::open(dir, opts)?;
        Ok(GqaLm {
            config: dir.manifest.config.clone(),
            family,
            backbone,
            weights,
            layers,
            attn: GqaAttention::new(shape.dims, shape.rope, shape.rms_norm_eps),
            vocab_size: shape.vocab_size,
            rms_norm_eps: shape.rms_norm_eps,
            routed,
        })
    }

    fn check_state(&self, cache: &KvCache, tokens: &[u32]) -> Result<(), EngineError> {
        EngineError::check_tokens(tokens, self.vocab_size)?;
        cache.check(self.layers.len(), &self.attn.dims)
    }

    /// Runs one token at the next position of `cache`; returns the logits `[vocab_size]` and
    /// the routing of every MoE layer. `draft`: self-drafting ([`MlpStep::draft`]).
    ///
    /// Errors: token id outside the vocabulary, a cache of another model, expert read or
    /// checksum failures.
    fn forward_token(
        &self,
        cache: &mut KvCache,
        token: u32,
        draft: bool,
    ) -> Result<(Vec<f32>, LayerRoutes), EngineError> {
        self.check_state(cache, &[token])?;
        let (bb, w) = (&self.backbone, &self.weights);
        let (h, eps) = (self.attn.dims.hidden, self.rms_norm_eps);
        let mut b = std::mem::take(&mut cache.buffers);
        b.x.resize(h, 0.0);
        b.xn.resize(h, 0.0);
        b.out.resize(h, 0.0);
        // x = embed_tokens(token): [hidden]
        bb.mat(&w.embed_tokens).row_into(token as usize, &mut b.x);
        let mut routes = Vec::with_capacity(w.layers.len());
        for (l, lw) in w.layers.iter().enumerate() {
            // h = x + self_attn(input_layernorm(x))
            rms_norm(&b.x, bb.vec(&lw.input_layernorm), eps, &mut b.xn);
            let mut out = std::mem::take(&mut b.out);
            let mut xn = std::mem::take(&mut b.xn);
            self.routed
                .time_attention(|| self.attn.forward(bb, &lw.attn, l, &xn, cache, &mut b, &mut out));
            for (a, o) in b.x.iter_mut().zip(&out) {
                *a += o;
            }
            // x = h + mlp(post_attention_layernorm(h))
            rms_norm(&b.x, bb.vec(&lw.post_attention_layernorm), eps, &mut xn);
            let step = MlpStep {
                routed: &self.routed,
                backbone: bb,
                layer: l,
                draft,
            };
            let r = self
                .routed
                .time_mlp(|| self.family.forward(step, &w.mlp, &xn, &mut b, &mut out));
            b.xn = xn;
            if let Some(r) = r? {
                routes.push((l, r));
            }
            for (a, o) in b.x.iter_mut().zip(&out) {
                *a += o;
            }
            b.out = out;
        }
        cache.advance();
        self.routed.count_forward();
        // logits = lm_head(norm(x))
        rms_norm(&b.x, bb.vec(&w.norm), eps, &mut b.xn);
        let lm_head = bb.mat(&w.lm_head);
        let mut logits = vec![0f32; lm_head.rows];
        lm_head.matvec(&b.xn, &mut logits);
        cache.buffers = b;
        Ok((logits, routes))
    }

    /// Runs `tokens` (a chunk) at the next positions of `cache` with batched attention
    /// ([`GqaAttention::forward_batch`]) and the family's batched block
    /// ([`GqaMlp::forward_chunk`], expert-major MoE); returns the logits of every position
    /// (`all_logits`) or of the last one, and every position's routing. Each position's logits
    /// equal [`Self::forward_token`]'s bit for bit.
    ///
    /// Errors: a token outside the vocabulary, a cache of another model, expert read failures.
    fn forward_chunk(&self, cache: &mut KvCache, tokens: &[u32], all_logits: bool) -> Result<BatchOutput, EngineError> {
        self.check_state(cache, tokens)?;
        let nt = tokens.len();
        if nt == 0 {
            return Ok(BatchOutput::default());
        }
        let (bb, w) = (&self.backbone, &self.weights);
        let (h, eps) = (self.attn.dims.hidden, self.rms_norm_eps);
        // x: [nt, hidden]
        let mut x = vec![0f32; nt * h];
        let embed_tokens = bb.mat(&w.embed_tokens);
        for (row, &t) in x.chunks_exact_mut(h).zip(tokens) {
            embed_tokens.row_into(t as usize, row);
        }
        let mut routes: Vec<LayerRoutes> = vec![Vec::new(); nt];
        decoder_layers(
            &Cpu,
            &mut x,
            nt,
            (w.layers.len(), eps),
            |l| {
                (
                    bb.vec(&w.layers[l].input_layernorm),
                    bb.vec(&w.layers[l].post_attention_layernorm),
                )
            },
            |l, xn, out| {
                let lw = &w.layers[l];
                self.routed
                    .time_attention(|| self.attn.forward_batch(bb, &lw.attn, l, xn, nt, cache, out));
                Ok(())
            },
            |l, xn, x| {
                let (y, rs) = self
                    .routed
                    .time_mlp(|| self.family.forward_chunk(&self.routed, bb, &w.mlp[l], l, xn, nt))?;
                if let Some(rs) = rs {
                    for (r, routing) in routes.iter_mut().zip(rs) {
                        r.push((l, routing));
                    }
                }
                add_into(x, &y);
                Ok(())
            },
        )?;
        cache.advance_by(nt);
        for _ in 0..nt {
            self.routed.count_forward();
        }
        // logits = lm_head(norm(x)) of the positions asked for
        let (norm, lm_head) = (bb.vec(&w.norm), bb.mat(&w.lm_head));
        let logits = on_cpu(chunk_logits(&Cpu, x, nt, all_logits, (norm, eps), &lm_head));
        Ok(BatchOutput { logits, routes })
    }
}

/// Resolves every weight of a forward pass in `bb` (at load): the shared tensors by their
/// checkpoint names, `layers`' norms and attention, and `family`'s blocks.
///
/// Errors: a missing or malformed tensor (named).
fn resolve<F: GqaMlp>(bb: &Backbone, layers: &[LayerNames], family: &F) -> Result<Weights<F::Weights>, EngineError> {
    let embed_tokens = bb.matrix_handle("model.embed_tokens.weight")?;
    let lm_head = bb.matrix_handle("lm_head.weight")?;
    let norm = bb.vector_handle("model.norm.weight")?;
    let mut lws = Vec::with_capacity(layers.len());
    let mut mlp = Vec::with_capacity(layers.len());
    for (l, n) in layers.iter().enumerate() {
        lws.push(LayerWeights {
            input_layernorm: bb.vector_handle(&n.input_layernorm)?,
            post_attention_layernorm: bb.vector_handle(&n.post_attention_layernorm)?,
            attn: n.attn.weights(bb)?,
        });
        mlp.push(family.weights(bb, l)?);
    }
    Ok(Weights {
        embed_tokens,
        layers: lws,
        mlp,
        norm,
        lm_head,
    })
}

impl<F: GqaMlp> FamilyModel for GqaLm<F> {
    type State = KvCache;

    crate::model::resident_items!();

    fn new_state(&self) -> KvCache {
        KvCache::new(self.layers.len(), &self.attn.dims)
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
        self.attn.batch_bytes_per_token(self.family.batch_f32_per_token())
    }
}

impl<F: GqaMlp> GqaFamily for GqaLm<F> {
    fn backbone(&self) -> &Backbone {
        &self.backbone
    }

    fn embed_tokens(&self) -> MatRef<'_> {
        self.backbone.mat(&self.weights.embed_tokens)
    }

    fn attention(&self) -> &GqaAttention {
        &self.attn
    }

    fn layer_specs(&self) -> Vec<GqaLayerSpec> {
        self.layers
            .iter()
            .enumerate()
            .map(|(l, n)| GqaLayerSpec {
                input_layernorm: n.input_layernorm.clone(),
                post_attention_layernorm: n.post_attention_layernorm.clone(),
                attn: n.attn.clone(),
                mlp: self.family.cuda_spec(l),
            })
            .collect()
    }

    fn softmax_router(&self) -> SoftmaxRouter {
        self.family.softmax_router()
    }

    fn rms_norm_eps(&self) -> f32 {
        self.rms_norm_eps
    }

    fn expert_kind(&self) -> ExpertKind {
        self.family.expert_kind()
    }
}
