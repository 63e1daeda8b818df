//! Mixtral, matching transformers' `models/mixtral/modeling_mixtral.py` in f32: the shared GQA
//! decoder ([`GqaLm`]) with Mixtral's sparse MoE block.
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

use deltafin_cuda::SoftmaxRouter;
use deltafin_format::model_dir::{Backbone, MatHandle};
use deltafin_format::{MixtralConfig, ModelConfig, ModelDir};

use crate::experts::StoreOptions;
use crate::gqa::{Buffers, GqaNames};
use crate::model::{softmax_moe_batch, RoutedExperts};
use crate::models::family_config;
use crate::models::gqa_cuda::MlpSpec;
use crate::models::gqa_lm::{decoder_shape, GqaLm, GqaMlp, MlpStep};
use crate::moe::Routing;
use crate::EngineError;

/// A loaded Mixtral model.
pub type Mixtral = GqaLm<MixtralMoe>;

/// Mixtral's `block_sparse_moe` in every layer.
pub struct MixtralMoe {
    pub cfg: MixtralConfig,
    /// `model.layers.{l}.block_sparse_moe.gate.weight [num_local_experts, hidden]`.
    gate: Vec<String>,
}

impl Mixtral {
    /// Loads the backbone into memory and opens the expert store with `opts`.
    ///
    /// Errors: not a `mixtral` directory, a missing or malformed tensor in the backbone,
    /// unreadable files, O_DIRECT refused.
    pub fn load_with(dir: &ModelDir, opts: StoreOptions) -> Result<Self, EngineError> {
        let cfg = family_config(dir, "mixtral", ModelConfig::as_mixtral)?;
        let shape = decoder_shape!(&cfg, sliding_window: cfg.sliding_window, attn: |l| GqaNames::new(l, false));
        let gate = (0..cfg.num_hidden_layers)
            .map(|l| format!("model.layers.{l}.block_sparse_moe.gate.weight"))
            .collect();
        let moe = MixtralMoe { cfg: cfg.clone(), gate };
        GqaLm::load(dir, opts, shape, moe)
    }
}

impl GqaMlp for MixtralMoe {
    /// The router `gate`.
    type Weights = MatHandle;

    fn weights(&self, bb: &Backbone, l: usize) -> Result<MatHandle, EngineError> {
        Ok(bb.matrix_handle(&self.gate[l])?)
    }

    fn forward(
        &self,
        step: MlpStep<'_>,
        gate: &[MatHandle],
        xn: &[f32],
        buf: &mut Buffers,
        out: &mut [f32],
    ) -> Result<Option<Routing>, EngineError> {
        let (l, bb) = (step.layer, step.backbone);
        // Prefetch: the next layer's router on this hidden state predicts its experts.
        let next = gate.get(l + 1).map(|g| (l + 1, bb.mat(g)));
        step.softmax_moe(bb.mat(&gate[l]), next, true, xn, buf, out)
    }

    fn forward_chunk(
        &self,
        routed: &RoutedExperts,
        bb: &Backbone,
        gate: &MatHandle,
        l: usize,
        xn: &[f32],
        nt: usize,
    ) -> Result<(Vec<f32>, Option<Vec<Routing>>), EngineError> {
        let (y, routings) = softmax_moe_batch(routed, l, bb.mat(gate), true, xn, nt)?;
        Ok((y, Some(routings)))
    }

    fn batch_f32_per_token(&self) -> usize {
        self.cfg.num_local_experts
    }

    fn cuda_spec(&self, l: usize) -> MlpSpec {
        MlpSpec::Moe {
            router: self.gate[l].clone(),
            router_bias: None,
        }
    }

    fn softmax_router(&self) -> SoftmaxRouter {
        // Mixtral always renormalises the chosen probabilities.
        SoftmaxRouter::SoftmaxThenTopK { norm_topk_prob: true }
    }
}
