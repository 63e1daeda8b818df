//! gpt-oss forward pass, one token at a time or a chunk at once (batched GQA, expert-major
//! MoE; bit-identical to token at a time), matching transformers'
//! `models/gpt_oss/modeling_gpt_oss.py` (5.x) in f32.
//!
//! Per decoder layer (PyTorch equivalent in the comments):
//! ```text
//! h = x + self_attn(input_layernorm(x))       # GQA with q/k/v/o biases, sinks, window per layer
//! x = h + mlp(post_attention_layernorm(h))    # GptOssMLP: biased router, clamped-SwiGLU experts
//! ```
//! then `logits = lm_head(norm(x))`.
//!
//! Attention: [GQA_ATTENTION] with rotate-half RoPE (YaRN without truncation by default), the
//! per-head sink logit in the softmax denominator [ATTN_SINKS], and the `sliding_window` only on
//! `sliding_attention` layers (prefill and decode alike: the window is applied to every query).
//!
//! MoE block (`GptOssMLP`): `logits = router.weight · xn + router.bias`; the top-k logits are
//! chosen and softmaxed among themselves [TOPK_THEN_SOFTMAX]; each chosen expert computes
//! [`clamped_swiglu_expert`]; the block output is `Σ_i w_i · expert_i(xn)`. No shared expert.

use deltafin_format::model_dir::Backbone;
use deltafin_format::{GptOssConfig, ModelConfig, ModelDir, StoredDtype};
use deltafin_kernels::{rms_norm, sigmoid, MatRef};

use crate::experts::{Expert, StoreOptions};
use crate::gqa::{GqaAttention, GqaDecoder, GqaDims, GqaLayer, GqaNames, KvCache};
use crate::model::{
    gather_rows, one_or_chunk, state_as, BatchOutput, CausalLm, DecodeState, LayerRoutes, RoutedExperts,
};
use crate::moe::{route_topk_softmax, route_topk_softmax_masked, Routing};
use crate::EngineError;

/// Tensor names of one decoder layer, as in the Hugging Face checkpoint.
struct LayerNames {
    input_layernorm: String,
    post_attention_layernorm: String,
    attn: GqaNames,
    /// `mlp.router.weight [E, hidden]` and `mlp.router.bias [E]`.
    router: String,
    router_bias: String,
}

impl LayerNames {
    fn new(l: usize, window: Option<usize>) -> Self {
        let p = format!("model.layers.{l}");
        LayerNames {
            input_layernorm: format!("{p}.input_layernorm.weight"),
            post_attention_layernorm: format!("{p}.post_attention_layernorm.weight"),
            attn: GqaNames::with_biases_and_sinks(&p, window),
            router: format!("{p}.mlp.router.weight"),
            router_bias: format!("{p}.mlp.router.bias"),
        }
    }
}

/// One routed gpt-oss expert on `xn: [hidden]` → `[hidden]`, from its record (parts in the order
/// of `GptOssConfig::expert_matrices`: `gate_up_proj [2I, hidden]`, `gate_up_proj_bias [2I]`,
/// `down_proj [hidden, I]`, `down_proj_bias [hidden]`):
/// ```text
/// gu = gate_up_proj @ xn + gate_up_proj_bias          # [2I]
/// gate, up = gu[0::2], gu[1::2]                       # interleaved columns
/// gate = gate.clamp(max=limit); up = up.clamp(-limit, limit)
/// h = (up + 1) * gate * sigmoid(alpha * gate)         # [I]
/// out = down_proj @ h + down_proj_bias                # [hidden]
/// ```
/// Source: transformers `GptOssExperts._apply_gate` / `forward`. [CLAMPED_SWIGLU]
pub fn clamped_swiglu_expert(
    gate_up: MatRef<'_>,
    gate_up_bias: &[f32],
    down: MatRef<'_>,
    down_bias: &[f32],
    alpha: f32,
    limit: f32,
    xn: &[f32],
) -> Vec<f32> {
    let mut gu = vec![0f32; gate_up.rows];
    gate_up.matvec(xn, &mut gu);
    let h: Vec<f32> = gu
        .chunks_exact(2)
        .zip(gate_up_bias.chunks_exact(2))
        .map(|(v, b)| {
            let gate = (v[0] + b[0]).min(limit);
            let up = (v[1] + b[1]).clamp(-limit, limit);
            (up + 1.0) * (gate * sigmoid(gate * alpha))
        })
        .collect();
    let mut out = vec![0f32; down.rows];
    down.matvec(&h, &mut out);
    for (o, b) in out.iter_mut().zip(down_bias) {
        *o += b;
    }
    out
}

/// [`clamped_swiglu_expert`] for `n` tokens at once (matrix-matrix products): `x: [n, hidden]`
/// → `[n, hidden]`, each row bit-identical to [`clamped_swiglu_expert`] of that row (`matmul`
/// equals `n` matvecs bit for bit; the element-wise steps are the same). [CLAMPED_SWIGLU]
#[allow(clippy::too_many_arguments)]
pub fn clamped_swiglu_expert_batch(
    gate_up: MatRef<'_>,
    gate_up_bias: &[f32],
    down: MatRef<'_>,
    down_bias: &[f32],
    alpha: f32,
    limit: f32,
    x: &[f32],
    n: usize,
) -> Vec<f32> {
    let mut gu = vec![0f32; n * gate_up.rows];
    gate_up.matmul(x, n, &mut gu);
    let h: Vec<f32> = gu
        .chunks_exact(gate_up.rows)
        .flat_map(|row| {
            row.chunks_exact(2).zip(gate_up_bias.chunks_exact(2)).map(|(v, b)| {
                let gate = (v[0] + b[0]).min(limit);
                let up = (v[1] + b[1]).clamp(-limit, limit);
                (up + 1.0) * (gate * sigmoid(gate * alpha))
            })
        })
        .collect();
    let mut out = vec![0f32; n * down.rows];
    down.matmul(&h, n, &mut out);
    for row in out.chunks_exact_mut(down.rows) {
        for (o, b) in row.iter_mut().zip(down_bias) {
            *o += b;
        }
    }
    out
}

/// A loaded gpt-oss model: resident backbone plus the routed-expert store.
pub struct GptOss {
    config: ModelConfig,
    pub cfg: GptOssConfig,
    backbone: Backbone,
    names: Vec<LayerNames>,
    attn: GqaAttention,
    routed: RoutedExperts,
}

impl GptOss {
    /// Loads the backbone into memory and opens the expert store with `opts`.
    ///
    /// Errors: not a `gpt_oss` directory, a missing or malformed tensor in the backbone, expert
    /// biases not stored f32, unreadable files, O_DIRECT refused.
    pub fn load_with(dir: &ModelDir, opts: StoreOptions) -> Result<Self, EngineError> {
        let config = dir.manifest.config.clone();
        let cfg = config
            .as_gpt_oss()
            .ok_or_else(|| EngineError::Invalid(format!("{}: not a gpt_oss model", dir.path.display())))?
            .clone();
        // The manifest is input too: its config gets convert's checks again (an edited
        // `swiglu_limit` ≤ 0 would otherwise panic in every expert computation).
        cfg.validate(&dir.path.join("manifest.json"))?;
        let backbone = dir.load_backbone()?;
        let names: Vec<LayerNames> = (0..cfg.num_hidden_layers)
            .map(|l| LayerNames::new(l, cfg.layer_window(l)))
            .collect();
        // Check every tensor the forward pass uses once, so a bad directory fails at load.
        backbone.matrix("model.embed_tokens.weight")?;
        backbone.matrix("lm_head.weight")?;
        backbone.vector("model.norm.weight")?;
        for n in &names {
            backbone.vector(&n.input_layernorm)?;
            backbone.vector(&n.post_attention_layernorm)?;
            n.attn.check(&backbone)?;
            backbone.matrix(&n.router)?;
            backbone.vector(&n.router_bias)?;
        }
        let layout = &dir.manifest.experts.layout;
        if [1, 3]
            .iter()
            .any(|&i| layout.get(i).is_none_or(|l| l.dtype != StoredDtype::F32))
        {
            return Err(EngineError::Invalid(format!(
                "{}: gpt-oss expert biases must be stored f32",
                dir.path.display()
            )));
        }
        let dims = GqaDims {
            hidden: cfg.hidden_size,
            n_heads: cfg.num_attention_heads,
            n_kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
            // Per layer, in the names.
            sliding_window: None,
        };
        let attn = GqaAttention::new(dims, &cfg.rope, cfg.rms_norm_eps);
        let routed = RoutedExperts::open(dir, opts)?;
        Ok(GptOss {
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

    /// Router logits of layer `l`: `router.weight · xn + router.bias` `[E]`.
    fn router_logits(&self, l: usize, xn: &[f32], logits: &mut Vec<f32>) -> Result<(), EngineError> {
        let n = &self.names[l];
        let w = self.m(&n.router)?;
        logits.resize(w.rows, 0.0);
        w.matvec(xn, logits);
        for (a, b) in logits.iter_mut().zip(self.v(&n.router_bias)?) {
            *a += b;
        }
        Ok(())
    }

    /// The MoE block of layer `l` on `xn: [hidden]`; returns `[hidden]` and the routing.
    /// `draft`: the top-k among the experts resident in the cache, computed with those records,
    /// no reads ([`RoutedExperts::run_draft`], self-drafting).
    fn moe(
        &self,
        l: usize,
        xn: &[f32],
        logits: &mut Vec<f32>,
        draft: bool,
    ) -> Result<(Vec<f32>, crate::moe::Routing), EngineError> {
        let k = self.routed.experts_per_token();
        self.router_logits(l, xn, logits)?;
        let (alpha, limit) = (self.cfg.swiglu_alpha, self.cfg.swiglu_limit);
        let expert = |e: &Expert| {
            clamped_swiglu_expert(e.matrix(0), e.f32_part(1), e.matrix(2), e.f32_part(3), alpha, limit, xn)
        };
        if draft {
            let (out, _, routing) = self.routed.run_draft(
                l,
                logits.len(),
                |allowed| route_topk_softmax_masked(logits, k, Some(allowed)),
                xn.len(),
                expert,
                None::<fn() -> Vec<f32>>,
            );
            return Ok((out, routing));
        }
        let routing = route_topk_softmax(logits, k);
        let predict = || -> Result<Option<(usize, Vec<usize>)>, EngineError> {
            let next = l + 1;
            if next >= self.cfg.num_hidden_layers {
                return Ok(None);
            }
            let mut nl = Vec::new();
            self.router_logits(next, xn, &mut nl)?;
            Ok(Some((next, route_topk_softmax(&nl, k).experts)))
        };
        let (out, _) = self
            .routed
            .run(l, &routing, xn.len(), expert, None::<fn() -> Vec<f32>>, predict)?;
        Ok((out, routing))
    }

    /// The MoE block of layer `l` for a chunk of `nt` tokens, expert-major
    /// ([`RoutedExperts::run_batch`]): router logits as one matrix-matrix product, each expert
    /// chosen in the chunk read once and applied to its tokens
    /// ([`clamped_swiglu_expert_batch`]). xn: `[nt, hidden]` → `[nt, hidden]` and one routing per
    /// token, each equal to [`Self::moe`]'s bit for bit.
    fn moe_batch(&self, l: usize, xn: &[f32], nt: usize) -> Result<(Vec<f32>, Vec<Routing>), EngineError> {
        let k = self.routed.experts_per_token();
        let n = &self.names[l];
        let h = self.cfg.hidden_size;
        let w = self.m(&n.router)?;
        let bias = self.v(&n.router_bias)?;
        let mut logits = vec![0f32; nt * w.rows];
        w.matmul(xn, nt, &mut logits);
        let routings: Vec<Routing> = logits
            .chunks_exact_mut(w.rows)
            .map(|lg| {
                for (a, b) in lg.iter_mut().zip(bias) {
                    *a += b;
                }
                route_topk_softmax(lg, k)
            })
            .collect();
        let (alpha, limit) = (self.cfg.swiglu_alpha, self.cfg.swiglu_limit);
        let (out, _) = self.routed.run_batch(
            l,
            &routings,
            h,
            |e, tokens| {
                let xs = gather_rows(xn, h, tokens);
                clamped_swiglu_expert_batch(
                    e.matrix(0),
                    e.f32_part(1),
                    e.matrix(2),
                    e.f32_part(3),
                    alpha,
                    limit,
                    &xs,
                    tokens.len(),
                )
            },
            None::<fn() -> Vec<f32>>,
        )?;
        Ok((out, routings))
    }

    /// Runs a chunk of tokens at the next positions of `cache`: batched GQA with sinks and
    /// per-layer windows ([`GqaAttention::forward_batch`]) and expert-major MoE
    /// ([`Self::moe_batch`]); see [`CausalLm::forward_batch`]. Every position's logits equal
    /// [`Self::forward_token`]'s bit for bit.
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
            let (y, r) = self.moe_batch(l, xn, nt)?;
            Ok((y, Some(r)))
        };
        dec.forward_chunk(&layer, cache, tokens, all_logits, &mlp)
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
            // x = h + mlp(post_attention_layernorm(h))
            rms_norm(&b.x, self.v(&n.post_attention_layernorm)?, c.rms_norm_eps, &mut b.xn);
            let (y, r) = self.routed.time_mlp(|| self.moe(l, &b.xn, &mut b.router, draft))?;
            routes.push((l, r));
            for (a, o) in b.x.iter_mut().zip(&y) {
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
}

impl CausalLm for GptOss {
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

impl crate::models::gqa_cuda::GqaFamily for GptOss {
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
                    router_bias: Some(n.router_bias.clone()),
                },
            })
            .collect()
    }

    fn softmax_router(&self) -> deltafin_cuda::SoftmaxRouter {
        deltafin_cuda::SoftmaxRouter::TopKThenSoftmax
    }

    fn rms_norm_eps(&self) -> f32 {
        self.cfg.rms_norm_eps
    }

    fn expert_kind(&self) -> crate::models::gqa_cuda::ExpertKind {
        crate::models::gqa_cuda::ExpertKind::ClampedSwiGlu {
            alpha: self.cfg.swiglu_alpha,
            limit: self.cfg.swiglu_limit,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use deltafin_kernels::MatData;

    #[test]
    fn clamped_swiglu_hand_computed() {
        // hidden 1, I 2: gate_up rows [g0, u0, g1, u1] = x * [1, 2, 10, -20] + bias [0, 0, 0, 1].
        let gu = [1.0f32, 2.0, 10.0, -20.0];
        let dn = [1.0f32, 1.0];
        let (a, lim) = (1.702f32, 7.0f32);
        let x = [1.0f32];
        let y = clamped_swiglu_expert(
            MatRef::new(4, 1, MatData::F32(&gu)).unwrap(),
            &[0.0, 0.0, 0.0, 1.0],
            MatRef::new(1, 2, MatData::F32(&dn)).unwrap(),
            &[0.5],
            a,
            lim,
            &x,
        );
        // j=0: gate 1, up 2 → 3 · 1 · σ(1.702); j=1: gate 10 → 7 (clamped), up -19 → -7 →
        // (-6) · 7 · σ(7 · 1.702). Output = sum + 0.5.
        let s = |v: f32| 1.0 / (1.0 + (-v).exp());
        let want = 3.0 * s(a) - 42.0 * s(7.0 * a) + 0.5;
        assert!((y[0] - want).abs() < 1e-5, "{y:?} vs {want}");
    }
}
