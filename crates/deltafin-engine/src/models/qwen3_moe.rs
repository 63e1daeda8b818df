//! Qwen3-MoE, matching transformers' `models/qwen3_moe/modeling_qwen3_moe.py` in f32: the
//! shared GQA decoder ([`GqaLm`]) with per-head q/k norms and Qwen3-MoE's feed-forward blocks.
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

use deltafin_cuda::SoftmaxRouter;
use deltafin_format::model_dir::{Backbone, MatHandle};
use deltafin_format::{ModelConfig, ModelDir, Qwen3MoeConfig};

use crate::experts::StoreOptions;
use crate::gqa::{Buffers, GqaNames};
use crate::model::{softmax_moe_batch, swiglu_batch, swiglu_into, GluTensorNames, GluTensors, RoutedExperts};
use crate::models::family_config;
use crate::models::gqa_cuda::MlpSpec;
use crate::models::gqa_lm::{decoder_shape, GqaLm, GqaMlp, MlpStep};
use crate::moe::Routing;
use crate::EngineError;

/// A loaded Qwen3-MoE model.
pub type Qwen3Moe = GqaLm<Qwen3MoeMlp>;

/// Qwen3-MoE's `mlp` of every layer: sparse or dense.
pub struct Qwen3MoeMlp {
    pub cfg: Qwen3MoeConfig,
    /// Each layer's `model.layers.{l}.mlp.*` names.
    names: Vec<MlpNames>,
    /// For each layer, the next MoE layer after it (prefetch prediction).
    next_moe: Vec<Option<usize>>,
}

/// Tensor names of one layer's `mlp`.
enum MlpNames {
    /// `Qwen3MoeSparseMoeBlock`: the router `mlp.gate.weight [num_experts, hidden]`.
    Sparse { gate: String },
    /// `Qwen3MoeMLP`: `mlp.{gate,up,down}_proj.weight`.
    Dense(GluTensorNames),
}

/// One layer's `mlp` weights, resolved in the backbone at load.
#[derive(Debug, Clone, Copy)]
pub enum Qwen3MoeMlpWeights {
    /// The router `gate` `[num_experts, hidden]`.
    Sparse { gate: MatHandle },
    /// `Qwen3MoeMLP`: `gate_proj`, `up_proj` `[intermediate_size, hidden]`, `down_proj`
    /// `[hidden, intermediate_size]`.
    Dense(GluTensors),
}

impl Qwen3Moe {
    /// Loads the backbone into memory and opens the expert store with `opts`.
    ///
    /// Errors: not a `qwen3_moe` directory, a missing or malformed tensor in the backbone,
    /// unreadable files, O_DIRECT refused.
    pub fn load_with(dir: &ModelDir, opts: StoreOptions) -> Result<Self, EngineError> {
        let cfg = family_config(dir, "qwen3_moe", ModelConfig::as_qwen3_moe)?;
        let shape = decoder_shape!(&cfg, sliding_window: cfg.sliding_window, attn: |l| GqaNames::new(l, true));
        let layers = 0..cfg.num_hidden_layers;
        let names = layers
            .clone()
            .map(|l| {
                let m = format!("model.layers.{l}.mlp");
                if cfg.is_moe_layer(l) {
                    MlpNames::Sparse {
                        gate: format!("{m}.gate.weight"),
                    }
                } else {
                    MlpNames::Dense(GluTensorNames::new(&m))
                }
            })
            .collect();
        let next_moe = layers
            .map(|l| (l + 1..cfg.num_hidden_layers).find(|&k| cfg.is_moe_layer(k)))
            .collect();
        let mlp = Qwen3MoeMlp {
            cfg: cfg.clone(),
            names,
            next_moe,
        };
        GqaLm::load(dir, opts, shape, mlp)
    }
}

impl GqaMlp for Qwen3MoeMlp {
    type Weights = Qwen3MoeMlpWeights;

    fn weights(&self, bb: &Backbone, l: usize) -> Result<Qwen3MoeMlpWeights, EngineError> {
        Ok(match &self.names[l] {
            MlpNames::Sparse { gate } => Qwen3MoeMlpWeights::Sparse {
                gate: bb.matrix_handle(gate)?,
            },
            MlpNames::Dense(names) => Qwen3MoeMlpWeights::Dense(GluTensors::resolve(bb, names)?),
        })
    }

    fn forward(
        &self,
        step: MlpStep<'_>,
        layers: &[Qwen3MoeMlpWeights],
        xn: &[f32],
        buf: &mut Buffers,
        out: &mut [f32],
    ) -> Result<Option<Routing>, EngineError> {
        let (l, bb) = (step.layer, step.backbone);
        match &layers[l] {
            Qwen3MoeMlpWeights::Sparse { gate } => {
                // Prefetch: the next MoE layer's router on this hidden state predicts its experts.
                let next = self.next_moe[l].and_then(|k| match &layers[k] {
                    Qwen3MoeMlpWeights::Sparse { gate } => Some((k, bb.mat(gate))),
                    Qwen3MoeMlpWeights::Dense(_) => None,
                });
                step.softmax_moe(bb.mat(gate), next, self.cfg.norm_topk_prob, xn, buf, out)
            }
            Qwen3MoeMlpWeights::Dense(dense) => {
                let [g, u, d] = dense.view(bb);
                swiglu_into(g, u, d, xn, &mut buf.gate, &mut buf.up, out);
                Ok(None)
            }
        }
    }

    fn forward_chunk(
        &self,
        routed: &RoutedExperts,
        bb: &Backbone,
        w: &Qwen3MoeMlpWeights,
        l: usize,
        xn: &[f32],
        nt: usize,
    ) -> Result<(Vec<f32>, Option<Vec<Routing>>), EngineError> {
        match w {
            Qwen3MoeMlpWeights::Sparse { gate } => {
                let (y, routings) = softmax_moe_batch(routed, l, bb.mat(gate), self.cfg.norm_topk_prob, xn, nt)?;
                Ok((y, Some(routings)))
            }
            Qwen3MoeMlpWeights::Dense(dense) => {
                let [g, u, d] = dense.view(bb);
                Ok((swiglu_batch(g, u, d, xn, nt), None))
            }
        }
    }

    fn batch_f32_per_token(&self) -> usize {
        self.cfg.num_experts.max(2 * self.cfg.intermediate_size)
    }

    fn cuda_spec(&self, l: usize) -> MlpSpec {
        match &self.names[l] {
            MlpNames::Sparse { gate } => MlpSpec::Moe {
                router: gate.clone(),
                router_bias: None,
            },
            MlpNames::Dense(n) => MlpSpec::Dense([&n.gate_proj, &n.up_proj, &n.down_proj].map(String::clone)),
        }
    }

    fn softmax_router(&self) -> SoftmaxRouter {
        SoftmaxRouter::SoftmaxThenTopK {
            norm_topk_prob: self.cfg.norm_topk_prob,
        }
    }
}
