//! `config.json` of a DeepSeek-V3-family checkpoint, resolved into concrete hyperparameters.
//!
//! Accepted `model_type`s: `deepseek_v3`, `kimi_k2`, and multimodal wrappers (`kimi_k25`, or any
//! config with a `text_config` object) whose `text_config` holds one of those. Keys a checkpoint
//! omits take the defaults of transformers' `DeepseekV3Config`
//! (`src/transformers/models/deepseek_v3/configuration_deepseek_v3.py`); `scoring_func` defaults
//! to `sigmoid` and `topk_method` to `noaux_tc`, which is what that implementation hard-codes.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::path::Path;

use crate::family::{
    decoder_backbone, glu_expert_matrices, glu_mlp_tensors, is_beyond_layers, mla_tensors, mla_widths,
    noaux_router_tensors, shared_experts_tensors, BackboneTensor, ExpertGroups, ExpertMatrix, Family, MoeDecoderSizes,
    GATE_UP_DOWN,
};
use crate::json::{
    bool_or, eos_bos, f32_in, field_err, get, require_nonzero_fields, require_only, require_silu, resolve_aliases,
    text_config, usize_or, Aliases, Range,
};
use crate::rope::{resolve_rope, Rope};
use crate::FormatError;

/// Concrete hyperparameters of a DeepSeek-V3 / Kimi K2 text model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeepseekV3Config {
    /// `model_type` of the text config (`deepseek_v3` or `kimi_k2`).
    pub model_type: String,
    /// `vocab_size` … `num_attention_heads`; dense MLP layers are those below
    /// `first_k_dense_replace`, and shared experts use `n_shared_experts ×
    /// moe_intermediate_size`.
    #[serde(flatten)]
    pub sizes: MoeDecoderSizes,
    pub n_shared_experts: usize,
    pub n_routed_experts: usize,
    /// Multiplier on the routed experts' combined weights, applied once.
    pub routed_scaling_factor: f32,
    pub kv_lora_rank: usize,
    /// None: queries come from one `q_proj`; Some(r): `q_a_proj` → `q_a_layernorm` → `q_b_proj`.
    pub q_lora_rank: Option<usize>,
    pub qk_rope_head_dim: usize,
    pub qk_nope_head_dim: usize,
    pub v_head_dim: usize,
    pub n_group: usize,
    pub topk_group: usize,
    /// top-k: routed experts chosen per token.
    pub num_experts_per_tok: usize,
    /// Layers `< first_k_dense_replace` use a dense MLP; the rest are MoE.
    pub first_k_dense_replace: usize,
    pub norm_topk_prob: bool,
    pub rms_norm_eps: f32,
    pub max_position_embeddings: usize,
    /// Rotary pairs are adjacent (`x[2i], x[2i+1]`) when true, split halves when false.
    pub rope_interleave: bool,
    pub rope: Rope,
    pub attention_bias: bool,
    pub tie_word_embeddings: bool,
    /// end-of-sequence id(s) named by config.json (int or list).
    pub eos_token_id: Vec<u32>,
    pub bos_token_id: Option<u32>,
}

/// `DeepseekV3Config.attribute_map`: `num_local_experts` is read as `n_routed_experts`.
/// [TRANSFORMERS_ATTRIBUTE_MAP]
const DEEPSEEK_V3_ALIASES: Aliases = &[("num_local_experts", "n_routed_experts")];

/// `DeepseekV3Config`'s defaults of the [`MoeDecoderSizes`].
const SIZES: MoeDecoderSizes = MoeDecoderSizes {
    vocab_size: 129280,
    hidden_size: 7168,
    intermediate_size: 18432,
    moe_intermediate_size: 2048,
    num_hidden_layers: 61,
    num_attention_heads: 128,
};

/// The text-model types of this family.
pub const MODEL_TYPES: &[&str] = &["deepseek_v3", "kimi_k2"];

impl DeepseekV3Config {
    /// Resolves a parsed `config.json` (`path` is only used in error messages).
    ///
    /// Errors: unknown `model_type`, a field of the wrong type, or a setting this implementation
    /// does not support (`scoring_func` other than `sigmoid`, `topk_method` other than
    /// `noaux_tc`, `hidden_act` other than `silu`, a RoPE type other than `default`/`yarn`,
    /// inconsistent expert grouping), or what [`Self::validate`] rejects; each names the field.
    pub fn from_value(raw: &Value, path: &Path) -> Result<Self, FormatError> {
        let raw = &*resolve_aliases(raw, path, DEEPSEEK_V3_ALIASES)?;
        let tc = text_config(raw);
        let model_type = get(tc, "model_type").and_then(|v| v.as_str()).unwrap_or("").to_string();
        if !MODEL_TYPES.contains(&model_type.as_str()) {
            let top = get(raw, "model_type").and_then(|v| v.as_str()).unwrap_or("");
            let shown = if model_type.is_empty() { top } else { &model_type };
            return Err(field_err(
                path,
                "model_type",
                format!(
                    "unsupported model_type {shown:?} (supported: {})",
                    MODEL_TYPES.join(", ")
                ),
            ));
        }
        require_only(tc, path, "scoring_func", "sigmoid")?;
        require_only(tc, path, "topk_method", "noaux_tc")?;
        require_silu(tc, path)?;
        // q_lora_rank: an explicit null means "no query compression"; an omitted key takes the
        // transformers default (1536), as DeepseekV3Config does.
        let q_lora_rank = match tc.get("q_lora_rank") {
            Some(Value::Null) => None,
            None => Some(1536),
            Some(_) => Some(usize_or(tc, path, "q_lora_rank", 0)?),
        };
        let max_position_embeddings = usize_or(tc, path, "max_position_embeddings", 4096)?;
        let rope = resolve_rope(tc, path, max_position_embeddings, 10000.0)?;
        let (eos, bos) = eos_bos(tc, raw);
        let cfg = DeepseekV3Config {
            model_type,
            sizes: MoeDecoderSizes::read(tc, path, &SIZES)?,
            n_shared_experts: usize_or(tc, path, "n_shared_experts", 1)?,
            n_routed_experts: usize_or(tc, path, "n_routed_experts", 256)?,
            routed_scaling_factor: f32_in(tc, path, "routed_scaling_factor", 2.5, Range::Positive)?,
            kv_lora_rank: usize_or(tc, path, "kv_lora_rank", 512)?,
            q_lora_rank,
            qk_rope_head_dim: usize_or(tc, path, "qk_rope_head_dim", 64)?,
            qk_nope_head_dim: usize_or(tc, path, "qk_nope_head_dim", 128)?,
            v_head_dim: usize_or(tc, path, "v_head_dim", 128)?,
            n_group: usize_or(tc, path, "n_group", 8)?,
            topk_group: usize_or(tc, path, "topk_group", 4)?,
            num_experts_per_tok: usize_or(tc, path, "num_experts_per_tok", 8)?,
            first_k_dense_replace: usize_or(tc, path, "first_k_dense_replace", 3)?,
            norm_topk_prob: bool_or(tc, path, "norm_topk_prob", true)?,
            rms_norm_eps: f32_in(tc, path, "rms_norm_eps", 1e-6, Range::NonNegative)?,
            max_position_embeddings,
            rope_interleave: bool_or(tc, path, "rope_interleave", true)?,
            rope,
            attention_bias: bool_or(tc, path, "attention_bias", false)?,
            tie_word_embeddings: bool_or(tc, path, "tie_word_embeddings", false)?,
            eos_token_id: eos,
            bos_token_id: bos,
        };
        cfg.validate(path)?;
        Ok(cfg)
    }

    /// Fails fast on hyperparameters this implementation cannot run.
    pub fn validate(&self, path: &Path) -> Result<(), FormatError> {
        require_nonzero_fields!(path, self; vocab_size, max_position_embeddings, hidden_size, num_hidden_layers,
            num_attention_heads, kv_lora_rank, v_head_dim, n_group, topk_group)?;
        if !self.qk_rope_head_dim.is_multiple_of(2) {
            return Err(field_err(path, "qk_rope_head_dim", "must be even"));
        }
        if self.has_moe() {
            if self.n_routed_experts == 0 || self.num_experts_per_tok == 0 {
                return Err(field_err(
                    path,
                    "n_routed_experts",
                    "MoE layers need routed experts and num_experts_per_tok > 0",
                ));
            }
            if !self.n_routed_experts.is_multiple_of(self.n_group) {
                return Err(field_err(
                    path,
                    "n_group",
                    format!(
                        "n_routed_experts {} is not divisible by n_group {}",
                        self.n_routed_experts, self.n_group
                    ),
                ));
            }
            if self.topk_group > self.n_group {
                return Err(field_err(
                    path,
                    "topk_group",
                    format!("topk_group {} exceeds n_group {}", self.topk_group, self.n_group),
                ));
            }
            self.expert_groups().check(path, self.num_experts_per_tok)?;
        }
        if self.attention_bias {
            return Err(field_err(path, "attention_bias", "attention biases are not supported"));
        }
        if self.tie_word_embeddings {
            return Err(field_err(
                path,
                "tie_word_embeddings",
                "tied embeddings are not supported (DeepSeek-V3 has an untied lm_head)",
            ));
        }
        Ok(())
    }

    /// Whether any layer is a MoE layer.
    pub fn has_moe(&self) -> bool {
        self.first_k_dense_replace < self.num_hidden_layers
    }

    /// Whether decoder layer `layer` (0-based) is a MoE layer.
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        layer >= self.first_k_dense_replace && layer < self.num_hidden_layers
    }

    /// Query/key head width: `qk_nope_head_dim + qk_rope_head_dim`.
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// The group-limited routing fields (`n_group`, `topk_group`).
    fn expert_groups(&self) -> ExpertGroups<'static> {
        ExpertGroups {
            top_k_field: "num_experts_per_tok",
            group_field: "n_group",
            n_experts: self.n_routed_experts,
            n_group: self.n_group,
            topk_group: self.topk_group,
        }
    }
}

crate::family::deref_to_sizes!(DeepseekV3Config);

impl Family for DeepseekV3Config {
    crate::family::family_items!(
        family: "deepseek_v3", model_type: self.model_type, routed_experts: n_routed_experts, top_k: num_experts_per_tok
    );

    fn max_experts_per_tok(&self) -> (usize, String) {
        self.expert_groups().max_experts_per_tok()
    }

    /// The backbone tensors of a DeepSeek-V3 checkpoint with their shapes, in checkpoint order.
    fn backbone_tensors(&self) -> Vec<BackboneTensor> {
        let h = self.hidden_size;
        let mla = mla_widths!(self);
        decoder_backbone("model", self.vocab_size, h, self.num_hidden_layers, |l, p| {
            let mut t = mla_tensors(&format!("{p}.self_attn"), h, &mla, false);
            let m = format!("{p}.mlp");
            if self.is_moe_layer(l) {
                t.extend(noaux_router_tensors(&m, h, self.n_routed_experts));
                t.extend(shared_experts_tensors(
                    &m,
                    h,
                    self.moe_intermediate_size,
                    self.n_shared_experts,
                ));
            } else {
                t.extend(glu_mlp_tensors(&m, h, self.intermediate_size));
            }
            t
        })
    }

    /// The three matrices of one routed expert (`y = W x`), as named in the checkpoint.
    fn expert_matrices(&self) -> Vec<ExpertMatrix> {
        let (h, i) = (self.hidden_size, self.moe_intermediate_size);
        glu_expert_matrices(GATE_UP_DOWN, h, i)
    }

    /// Names the converter deliberately skips: MTP layers (index ≥ num_hidden_layers) and rotary
    /// frequency buffers.
    fn is_ignored(&self, name: &str) -> bool {
        name.ends_with("rotary_emb.inv_freq") || is_beyond_layers(name, self.num_hidden_layers)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::family::test_support::*;
    use serde_json::json;

    #[test]
    fn defaults_follow_transformers() {
        let c = DeepseekV3Config::from_value(&json!({"model_type": "deepseek_v3"}), p()).unwrap();
        assert_eq!(c.hidden_size, 7168);
        assert_eq!(c.q_lora_rank, Some(1536));
        assert_eq!(c.n_group, 8);
        assert_eq!(c.topk_group, 4);
        assert!(c.rope_interleave);
        assert_eq!(c.rope, Rope::Default { theta: 10000.0 });
    }

    #[test]
    fn null_q_lora_rank_means_no_compression() {
        let c = DeepseekV3Config::from_value(&json!({"model_type": "kimi_k2", "q_lora_rank": null}), p()).unwrap();
        assert_eq!(c.q_lora_rank, None);
    }

    #[test]
    fn both_rope_spellings() {
        let a = json!({"model_type": "deepseek_v3", "rope_theta": 50000.0, "max_position_embeddings": 1000,
            "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 250, "mscale": 1.0, "mscale_all_dim": 1.0}});
        let b = json!({"model_type": "deepseek_v3", "max_position_embeddings": 1000,
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0, "original_max_position_embeddings": 250, "mscale": 1.0, "mscale_all_dim": 1.0}});
        let ca = DeepseekV3Config::from_value(&a, p()).unwrap();
        let cb = DeepseekV3Config::from_value(&b, p()).unwrap();
        assert_eq!(ca.rope, cb.rope);
        match ca.rope {
            Rope::Yarn {
                theta,
                factor,
                beta_fast,
                beta_slow,
                ..
            } => {
                assert_eq!((theta, factor, beta_fast, beta_slow), (50000.0, 4.0, 32.0, 1.0));
            }
            _ => panic!("expected yarn"),
        }
    }

    #[test]
    fn nested_text_config() {
        let raw = json!({"model_type": "kimi_k25", "eos_token_id": 7,
            "text_config": {"model_type": "kimi_k2", "eos_token_id": 5, "hidden_size": 64}});
        let c = DeepseekV3Config::from_value(&raw, p()).unwrap();
        assert_eq!(c.hidden_size, 64);
        assert_eq!(c.eos_token_id, vec![5, 7]);
    }

    #[test]
    fn rejects_unknown_model_type_and_settings() {
        let e = DeepseekV3Config::from_value(&json!({"model_type": "llama"}), p()).unwrap_err();
        assert!(
            e.to_string().contains("model_type") && e.to_string().contains("llama"),
            "{e}"
        );
        let e = DeepseekV3Config::from_value(&json!({"model_type": "deepseek_v3", "scoring_func": "softmax"}), p())
            .unwrap_err();
        assert!(e.to_string().contains("scoring_func"), "{e}");
        let e =
            DeepseekV3Config::from_value(&json!({"model_type": "deepseek_v3", "hidden_size": "big"}), p()).unwrap_err();
        assert!(e.to_string().contains("hidden_size"), "{e}");
        let e = DeepseekV3Config::from_value(
            &json!({"model_type": "deepseek_v3", "rope_scaling": {"type": "longrope", "factor": 2.0}}),
            p(),
        )
        .unwrap_err();
        assert!(e.to_string().contains("longrope"), "{e}");
    }
}
