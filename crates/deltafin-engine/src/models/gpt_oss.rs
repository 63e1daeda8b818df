//! gpt-oss, matching transformers' `models/gpt_oss/modeling_gpt_oss.py` (5.x) in f32: the
//! shared GQA decoder ([`GqaLm`]) with biases, sinks and per-layer windows in the attention, and
//! gpt-oss' MoE block.
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

use deltafin_cuda::SoftmaxRouter;
use deltafin_format::model_dir::{Backbone, MatHandle, VecHandle};
use deltafin_format::{GptOssConfig, ModelConfig, ModelDir, StoredDtype};
use deltafin_kernels::{sigmoid, MatRef};

use crate::experts::{Expert, StoreOptions};
use crate::gqa::{Buffers, GqaNames};
use crate::model::{add_into, gather_rows, RoutedExperts};
use crate::models::family_config;
use crate::models::gqa_cuda::{ExpertKind, MlpSpec};
use crate::models::gqa_lm::{decoder_shape, GqaLm, GqaMlp, MlpStep};
use crate::moe::{route_topk_softmax, route_topk_softmax_masked, Routing};
use crate::EngineError;

/// A loaded gpt-oss model.
pub type GptOss = GqaLm<GptOssMlp>;

/// gpt-oss' `mlp` (`GptOssMLP`) in every layer.
pub struct GptOssMlp {
    pub cfg: GptOssConfig,
    /// `model.layers.{l}.mlp.router.weight [num_local_experts, hidden]` and `.bias
    /// [num_local_experts]`.
    router: Vec<[String; 2]>,
}

/// One layer's router, `mlp.router.weight` `[num_local_experts, hidden]` and `mlp.router.bias`
/// `[num_local_experts]`, resolved in the backbone at load.
#[derive(Debug, Clone, Copy)]
pub struct Router {
    pub weight: MatHandle,
    pub bias: VecHandle,
}

impl GptOss {
    /// Loads the backbone into memory and opens the expert store with `opts`.
    ///
    /// Errors: not a `gpt_oss` directory, a missing or malformed tensor in the backbone, expert
    /// biases not stored f32, unreadable files, O_DIRECT refused.
    pub fn load_with(dir: &ModelDir, opts: StoreOptions) -> Result<Self, EngineError> {
        let cfg = family_config(dir, "gpt_oss", ModelConfig::as_gpt_oss)?;
        // The manifest is input too: its config gets convert's checks again (an edited
        // `swiglu_limit` ≤ 0 would otherwise panic in every expert computation).
        cfg.validate(&dir.path.join("manifest.json"))?;
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
        // The window is per layer (`layer_types`), in the attention names.
        let shape = decoder_shape!(&cfg, sliding_window: None, attn: |l| {
            GqaNames::with_biases_and_sinks(l, cfg.layer_window(l))
        });
        let router = (0..cfg.num_hidden_layers)
            .map(|l| ["weight", "bias"].map(|p| format!("model.layers.{l}.mlp.router.{p}")))
            .collect();
        GqaLm::load(
            dir,
            opts,
            shape,
            GptOssMlp {
                cfg: cfg.clone(),
                router,
            },
        )
    }
}

impl GptOssMlp {
    /// Routed expert `e` (its record) on `n` tokens `x: [n, hidden]` → `[n, hidden]`: the
    /// clamped SwiGLU with this model's `swiglu_alpha` and `swiglu_limit`
    /// ([`clamped_swiglu_expert`]; `n = 1` is the decode step). [CLAMPED_SWIGLU]
    fn expert(&self, e: &Expert, x: &[f32], n: usize) -> Vec<f32> {
        let (alpha, limit) = (self.cfg.swiglu_alpha, self.cfg.swiglu_limit);
        clamped_swiglu_expert(
            e.matrix(0),
            e.f32_part(1),
            e.matrix(2),
            e.f32_part(3),
            alpha,
            limit,
            x,
            n,
        )
    }
}

impl Router {
    /// `weight · xn + bias` `[num_local_experts]`, the weights read in `bb`.
    fn logits(&self, bb: &Backbone, xn: &[f32], logits: &mut Vec<f32>) {
        let weight = bb.mat(&self.weight);
        logits.resize(weight.rows, 0.0);
        weight.matvec(xn, logits);
        add_into(logits, bb.vec(&self.bias));
    }
}

impl GqaMlp for GptOssMlp {
    type Weights = Router;

    fn weights(&self, bb: &Backbone, l: usize) -> Result<Router, EngineError> {
        let [weight, bias] = &self.router[l];
        Ok(Router {
            weight: bb.matrix_handle(weight)?,
            bias: bb.vector_handle(bias)?,
        })
    }

    /// `GptOssMLP` on one token: top-k of the biased router logits, softmaxed among themselves
    /// [TOPK_THEN_SOFTMAX], `Σ_i w_i · clamped_swiglu_expert_i(xn)`. Self-drafting routes among
    /// the experts resident in the cache ([`RoutedExperts::run_draft`]).
    fn forward(
        &self,
        step: MlpStep<'_>,
        router: &[Router],
        xn: &[f32],
        buf: &mut Buffers,
        out: &mut [f32],
    ) -> Result<Option<Routing>, EngineError> {
        let (l, routed, bb) = (step.layer, step.routed, step.backbone);
        let k = routed.experts_per_token();
        let logits = &mut buf.router;
        router[l].logits(bb, xn, logits);
        let expert = |e: &Expert| self.expert(e, xn, 1);
        let (y, routing) = if step.draft {
            let (y, _, routing) = routed.run_draft(
                l,
                logits.len(),
                |allowed| route_topk_softmax_masked(logits, k, Some(allowed)),
                xn.len(),
                expert,
                None::<fn() -> Vec<f32>>,
            );
            (y, routing)
        } else {
            let routing = route_topk_softmax(logits, k);
            // Prefetch: the next layer's router on this hidden state predicts its experts.
            let predict = || -> Result<Option<(usize, Vec<usize>)>, EngineError> {
                Ok(router.get(l + 1).map(|next| {
                    let mut nl = Vec::new();
                    next.logits(bb, xn, &mut nl);
                    (l + 1, route_topk_softmax(&nl, k).experts)
                }))
            };
            let (y, _) = routed.run(l, &routing, xn.len(), expert, None::<fn() -> Vec<f32>>, predict)?;
            (y, routing)
        };
        out.copy_from_slice(&y);
        Ok(Some(routing))
    }

    /// The block on a chunk, expert-major ([`RoutedExperts::run_batch`]): router logits as one
    /// matrix-matrix product, each expert chosen in the chunk read once and applied to its
    /// tokens ([`clamped_swiglu_expert`]).
    fn forward_chunk(
        &self,
        routed: &RoutedExperts,
        bb: &Backbone,
        router: &Router,
        l: usize,
        xn: &[f32],
        nt: usize,
    ) -> Result<(Vec<f32>, Option<Vec<Routing>>), EngineError> {
        let k = routed.experts_per_token();
        let h = self.cfg.hidden_size;
        let (w, bias) = (bb.mat(&router.weight), bb.vec(&router.bias));
        let mut logits = vec![0f32; nt * w.rows];
        w.matmul(xn, nt, &mut logits);
        let routings: Vec<Routing> = logits
            .chunks_exact_mut(w.rows)
            .map(|lg| {
                add_into(lg, bias);
                route_topk_softmax(lg, k)
            })
            .collect();
        let (y, _) = routed.run_batch(
            l,
            &routings,
            h,
            |e, tokens| self.expert(e, &gather_rows(xn, h, tokens), tokens.len()),
            None::<fn() -> Vec<f32>>,
        )?;
        Ok((y, Some(routings)))
    }

    fn batch_f32_per_token(&self) -> usize {
        self.cfg.num_local_experts
    }

    fn cuda_spec(&self, l: usize) -> MlpSpec {
        let [weight, bias] = &self.router[l];
        MlpSpec::Moe {
            router: weight.clone(),
            router_bias: Some(bias.clone()),
        }
    }

    fn softmax_router(&self) -> SoftmaxRouter {
        SoftmaxRouter::TopKThenSoftmax
    }

    fn expert_kind(&self) -> ExpertKind {
        ExpertKind::ClampedSwiGlu {
            alpha: self.cfg.swiglu_alpha,
            limit: self.cfg.swiglu_limit,
        }
    }
}

/// One routed gpt-oss expert on `n` tokens at once, `x: [n, hidden]` → `[n, hidden]`, from its
/// record (parts in the order of `GptOssConfig::expert_matrices`: `gate_up_proj [2I, hidden]`,
/// `gate_up_proj_bias [2I]`, `down_proj [hidden, I]`, `down_proj_bias [hidden]`), per token:
/// ```text
/// gu = gate_up_proj @ xn + gate_up_proj_bias          # [2I]
/// gate, up = gu[0::2], gu[1::2]                       # interleaved columns
/// gate = gate.clamp(max=limit); up = up.clamp(-limit, limit)
/// h = (up + 1) * gate * sigmoid(alpha * gate)         # [I]
/// out = down_proj @ h + down_proj_bias                # [hidden]
/// ```
/// The decode step is `n = 1`; a prompt chunk's row t is bit-identical to the decode step of that
/// token (`matmul` of one row is its matvec, and `n` rows equal `n` matvecs bit for bit).
/// Source: transformers `GptOssExperts._apply_gate` / `forward`. [CLAMPED_SWIGLU]
#[allow(clippy::too_many_arguments)]
pub fn clamped_swiglu_expert(
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
            row.chunks_exact(2)
                .zip(gate_up_bias.chunks_exact(2))
                .map(|(v, b)| clamped_glu(v, b, alpha, limit))
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

/// One unit of the clamped SwiGLU: `v = [gate, up]` (an interleaved pair of `gate_up_proj`'s
/// output) plus its bias `b` → `(up + 1) * gate * sigmoid(alpha * gate)` after the clamps.
/// [CLAMPED_SWIGLU]
fn clamped_glu(v: &[f32], b: &[f32], alpha: f32, limit: f32) -> f32 {
    let gate = (v[0] + b[0]).min(limit);
    let up = (v[1] + b[1]).clamp(-limit, limit);
    (up + 1.0) * (gate * sigmoid(gate * alpha))
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
            1,
        );
        // j=0: gate 1, up 2 → 3 · 1 · σ(1.702); j=1: gate 10 → 7 (clamped), up -19 → -7 →
        // (-6) · 7 · σ(7 · 1.702). Output = sum + 0.5.
        let s = |v: f32| 1.0 / (1.0 + (-v).exp());
        let want = 3.0 * s(a) - 42.0 * s(7.0 * a) + 0.5;
        assert!((y[0] - want).abs() < 1e-5, "{y:?} vs {want}");
    }
}
