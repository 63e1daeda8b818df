//! `config.json` of a Qwen3-MoE checkpoint (`model_type` `qwen3_moe`, e.g. Qwen3-30B-A3B,
//! Qwen3-235B-A22B), resolved into concrete hyperparameters.
//!
//! Keys a checkpoint omits take the defaults of transformers' `Qwen3MoeConfig`
//! (`src/transformers/models/qwen3_moe/configuration_qwen3_moe.py`): note `num_key_value_heads`
//! defaults to 4 (not to `num_attention_heads`), `norm_topk_prob` to false, `head_dim` to
//! `hidden_size / num_attention_heads`, and `sliding_window` only applies when
//! `use_sliding_window` is true. [QWEN3_MOE_CONFIG]

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::family::{
    check_dense_width, check_gqa, check_mlp_only_layers, check_top_k, decoder_backbone, glu_expert_matrices,
    glu_mlp_tensors, gqa_attention_tensors, sparse_step_moe_layer, tensors, BackboneTensor, ExpertMatrix, Family,
    MoeDecoderSizes, TensorRole, GATE_UP_DOWN,
};
use crate::json::{
    bool_or, eos_bos, f32_in, field_err, layer_indices, opt_usize, reject_tied_embeddings, reject_true,
    require_nonzero_fields, require_silu, resolve_aliases, text_config, usize_or, Aliases, Range,
};
use crate::rope::{resolve_rope, Rope};
use crate::FormatError;

/// `Qwen3MoeConfig.attribute_map` (transformers 5): `num_experts` is stored as
/// `num_local_experts`; this crate reads `num_experts`, so the map is applied in reverse.
/// [TRANSFORMERS_ATTRIBUTE_MAP]
const ALIASES: Aliases = &[("num_local_experts", "num_experts")];

/// `Qwen3MoeConfig`'s defaults of the [`MoeDecoderSizes`].
const SIZES: MoeDecoderSizes = MoeDecoderSizes {
    vocab_size: 151936,
    hidden_size: 2048,
    intermediate_size: 6144,
    moe_intermediate_size: 768,
    num_hidden_layers: 24,
    num_attention_heads: 32,
};

/// Concrete hyperparameters of a Qwen3-MoE text model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Qwen3MoeConfig {
    /// `vocab_size` … `num_attention_heads` (query heads); dense MLP layers are
    /// `mlp_only_layers` and the layers `decoder_sparse_step` skips.
    #[serde(flatten)]
    pub sizes: MoeDecoderSizes,
    /// Key/value heads of grouped-query attention (divides `num_attention_heads`).
    pub num_key_value_heads: usize,
    /// Width of one attention head (explicit in real checkpoints; not `hidden / heads` there).
    pub head_dim: usize,
    /// Routed experts per MoE layer (`num_experts`).
    pub num_experts: usize,
    /// top-k: routed experts chosen per token.
    pub num_experts_per_tok: usize,
    /// Layer `l` is MoE when `(l + 1) % decoder_sparse_step == 0` and `l` is not in
    /// `mlp_only_layers`.
    pub decoder_sparse_step: usize,
    pub mlp_only_layers: Vec<usize>,
    /// Renormalise the top-k softmax probabilities to sum to 1.
    pub norm_topk_prob: bool,
    pub rms_norm_eps: f32,
    pub max_position_embeddings: usize,
    pub rope: Rope,
    /// Attention window in tokens (keys `t` with `pos - t < window`), when
    /// `use_sliding_window` is set; None: full causal attention.
    pub sliding_window: Option<usize>,
    /// end-of-sequence id(s) named by config.json (int or list).
    pub eos_token_id: Vec<u32>,
    pub bos_token_id: Option<u32>,
}

impl Qwen3MoeConfig {
    /// Resolves a parsed `config.json` (`path` is only used in error messages).
    ///
    /// Errors: a field of the wrong type, or a setting this implementation does not support
    /// (`hidden_act` other than `silu`, `attention_bias`, tied embeddings, a RoPE type other than
    /// `default`/`yarn`), or what [`Self::validate`] rejects; each names the field.
    pub fn from_value(raw: &Value, path: &Path) -> Result<Self, FormatError> {
        let raw = &*resolve_aliases(raw, path, ALIASES)?;
        let tc = text_config(raw);
        require_silu(tc, path)?;
        reject_true(tc, path, "attention_bias", "attention biases are not supported")?;
        reject_tied_embeddings(tc, path, "Qwen3-MoE")?;
        let hidden_size = usize_or(tc, path, "hidden_size", SIZES.hidden_size)?;
        let num_attention_heads = usize_or(tc, path, "num_attention_heads", SIZES.num_attention_heads)?;
        let head_dim = opt_usize(tc, path, "head_dim")?.unwrap_or(hidden_size / num_attention_heads.max(1));
        let mlp_only_layers = layer_indices(tc, path, "mlp_only_layers")?;
        let sliding_window = if bool_or(tc, path, "use_sliding_window", false)? {
            opt_usize(tc, path, "sliding_window")?
        } else {
            None
        };
        let max_position_embeddings = usize_or(tc, path, "max_position_embeddings", 32768)?;
        let (eos_token_id, bos_token_id) = eos_bos(tc, raw);
        let cfg = Qwen3MoeConfig {
            // Reads `hidden_size` and `num_attention_heads` again: the same values as above.
            sizes: MoeDecoderSizes::read(tc, path, &SIZES)?,
            num_key_value_heads: usize_or(tc, path, "num_key_value_heads", 4)?,
            head_dim,
            num_experts: usize_or(tc, path, "num_experts", 128)?,
            num_experts_per_tok: usize_or(tc, path, "num_experts_per_tok", 8)?,
            decoder_sparse_step: usize_or(tc, path, "decoder_sparse_step", 1)?,
            mlp_only_layers,
            norm_topk_prob: bool_or(tc, path, "norm_topk_prob", false)?,
            rms_norm_eps: f32_in(tc, path, "rms_norm_eps", 1e-6, Range::NonNegative)?,
            max_position_embeddings,
            rope: resolve_rope(tc, path, max_position_embeddings, 10000.0)?,
            sliding_window,
            eos_token_id,
            bos_token_id,
        };
        cfg.validate(path)?;
        Ok(cfg)
    }

    /// Fails fast on hyperparameters this implementation cannot run (field named).
    pub fn validate(&self, path: &Path) -> Result<(), FormatError> {
        require_nonzero_fields!(path, self; vocab_size, max_position_embeddings, hidden_size, num_hidden_layers,
            num_attention_heads, num_key_value_heads, head_dim, decoder_sparse_step)?;
        check_gqa(path, self.num_attention_heads, self.num_key_value_heads, self.head_dim)?;
        check_mlp_only_layers(path, &self.mlp_only_layers, self.num_hidden_layers)?;
        if self.sliding_window == Some(0) {
            return Err(field_err(path, "sliding_window", "must be greater than 0"));
        }
        if self.has_moe() {
            check_top_k(path, self.num_experts_per_tok, self.num_experts, "num_experts")?;
            require_nonzero_fields!(path, self; moe_intermediate_size)?;
        }
        check_dense_width(path, self, self.intermediate_size)
    }

    /// Whether decoder layer `layer` (0-based) is a MoE layer, as `Qwen3MoeDecoderLayer`
    /// decides: not in `mlp_only_layers`, experts present, and `(layer + 1) %
    /// decoder_sparse_step == 0`. [QWEN3_MOE_LAYERS]
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        sparse_step_moe_layer(
            layer,
            self.num_hidden_layers,
            &self.mlp_only_layers,
            self.num_experts,
            self.decoder_sparse_step,
        )
    }

    /// Whether any layer is a MoE layer.
    pub fn has_moe(&self) -> bool {
        (0..self.num_hidden_layers).any(|l| self.is_moe_layer(l))
    }
}

crate::family::deref_to_sizes!(Qwen3MoeConfig);

impl Family for Qwen3MoeConfig {
    crate::family::family_items!(family: "qwen3_moe", routed_experts: num_experts, top_k: num_experts_per_tok);

    /// The backbone tensors with their shapes, in checkpoint order.
    fn backbone_tensors(&self) -> Vec<BackboneTensor> {
        let h = self.hidden_size;
        let (nh, nkv, hd) = (self.num_attention_heads, self.num_key_value_heads, self.head_dim);
        decoder_backbone("model", self.vocab_size, h, self.num_hidden_layers, |l, p| {
            let mut t = gqa_attention_tensors(p, h, nh, nkv, hd, true);
            let m = format!("{p}.mlp");
            if self.is_moe_layer(l) {
                t.extend(tensors([(
                    format!("{m}.gate.weight"),
                    vec![self.num_experts, h],
                    TensorRole::F32,
                )]));
            } else {
                t.extend(glu_mlp_tensors(&m, h, self.intermediate_size));
            }
            t
        })
    }

    /// The three matrices of one routed expert (`y = W x`), as named in the checkpoint
    /// (`model.layers.{l}.mlp.experts.{e}.{name}.weight`).
    fn expert_matrices(&self) -> Vec<ExpertMatrix> {
        let (h, i) = (self.hidden_size, self.moe_intermediate_size);
        glu_expert_matrices(GATE_UP_DOWN, h, i)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::family::test_support::*;
    use serde_json::json;

    #[test]
    fn defaults_follow_transformers() {
        let c = Qwen3MoeConfig::from_value(&json!({"model_type": "qwen3_moe"}), p()).unwrap();
        assert_eq!(
            (c.hidden_size, c.num_attention_heads, c.num_key_value_heads),
            (2048, 32, 4)
        );
        assert_eq!(c.head_dim, 64);
        assert_eq!((c.num_experts, c.num_experts_per_tok), (128, 8));
        assert!(!c.norm_topk_prob);
        assert_eq!(c.rope, Rope::Default { theta: 10000.0 });
        assert_eq!(c.sliding_window, None);
    }

    #[test]
    fn moe_layers_from_sparse_step_and_mlp_only_layers() {
        let c = Qwen3MoeConfig::from_value(
            &json!({"model_type": "qwen3_moe", "num_hidden_layers": 6, "decoder_sparse_step": 2,
                    "mlp_only_layers": [3], "head_dim": 128, "use_sliding_window": true, "sliding_window": 16}),
            p(),
        )
        .unwrap();
        let moe: Vec<usize> = (0..6).filter(|&l| c.is_moe_layer(l)).collect();
        assert_eq!(moe, vec![1, 5]);
        assert_eq!(c.head_dim, 128);
        assert_eq!(c.sliding_window, Some(16));
        // Dense layers carry an MLP, MoE layers a router, in the tensor table.
        let names: Vec<String> = c.backbone_tensors().into_iter().map(|t| t.name).collect();
        assert!(names.contains(&"model.layers.3.mlp.gate_proj.weight".to_string()));
        assert!(names.contains(&"model.layers.5.mlp.gate.weight".to_string()));
        assert!(names.contains(&"model.layers.0.self_attn.q_norm.weight".to_string()));
    }

    #[test]
    fn validation_names_the_field() {
        let bad = [
            (
                json!({"hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 4}),
                "num_key_value_heads",
            ),
            (json!({"decoder_sparse_step": 0}), "decoder_sparse_step"),
            (
                json!({"num_experts": 4, "num_experts_per_tok": 5}),
                "num_experts_per_tok",
            ),
            (json!({"mlp_only_layers": [99]}), "mlp_only_layers"),
            (json!({"hidden_act": "gelu"}), "hidden_act"),
            (json!({"tie_word_embeddings": true}), "tie_word_embeddings"),
            (json!({"head_dim": "x"}), "head_dim"),
        ];
        assert_names_field("qwen3_moe", bad, Qwen3MoeConfig::from_value);
    }
}
