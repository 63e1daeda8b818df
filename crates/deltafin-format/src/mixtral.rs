//! `config.json` of a Mixtral checkpoint (`model_type` `mixtral`, e.g. Mixtral-8x7B,
//! Mixtral-8x22B), resolved into concrete hyperparameters.
//!
//! Keys a checkpoint omits take the defaults of transformers' `MixtralConfig`
//! (`src/transformers/models/mixtral/configuration_mixtral.py`): `rope_theta` 1e6
//! (`default_theta`), `rms_norm_eps` 1e-5, `num_key_value_heads` 8 (an explicit null means
//! `num_attention_heads`), `head_dim` `hidden_size / num_attention_heads` when absent or null,
//! 8 experts, top-2, no sliding window. Every layer is a MoE layer. [MIXTRAL_CONFIG]

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::family::{
    check_gqa, check_top_k, decoder_backbone, glu_expert_matrices, gqa_attention_tensors, per_expert, tensors,
    BackboneTensor, ExpertMatrix, ExpertSource, Family, TensorRole,
};
use crate::json::{
    eos_bos, f32_in, field_err, opt_usize, reject_tied_embeddings, require_nonzero_fields, require_silu,
    resolve_aliases, text_config, usize_null_or, usize_or, Aliases, Range,
};
use crate::rope::{resolve_rope, Rope};
use crate::FormatError;

/// `MixtralConfig.attribute_map`: `num_experts` is read as `num_local_experts`.
/// [TRANSFORMERS_ATTRIBUTE_MAP]
const ALIASES: Aliases = &[("num_experts", "num_local_experts")];

/// Concrete hyperparameters of a Mixtral text model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MixtralConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// Intermediate width of one routed expert (Mixtral has no dense MLP).
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    /// Key/value heads of grouped-query attention (divides `num_attention_heads`).
    pub num_key_value_heads: usize,
    /// Width of one attention head.
    pub head_dim: usize,
    /// Routed experts per layer (`num_local_experts`).
    pub num_local_experts: usize,
    /// top-k: routed experts chosen per token.
    pub num_experts_per_tok: usize,
    pub rms_norm_eps: f32,
    pub max_position_embeddings: usize,
    pub rope: Rope,
    /// Attention window in tokens (keys `t` with `pos - t < window`); None: full causal.
    pub sliding_window: Option<usize>,
    /// end-of-sequence id(s) named by config.json (int or list).
    pub eos_token_id: Vec<u32>,
    pub bos_token_id: Option<u32>,
}

impl MixtralConfig {
    /// Resolves a parsed `config.json` (`path` is only used in error messages).
    ///
    /// Errors: a field of the wrong type, or a setting this implementation does not support
    /// (`hidden_act` other than `silu`, tied embeddings, a RoPE type other than
    /// `default`/`yarn`), or what [`Self::validate`] rejects; each names the field.
    pub fn from_value(raw: &Value, path: &Path) -> Result<Self, FormatError> {
        let raw = &*resolve_aliases(raw, path, ALIASES)?;
        let tc = text_config(raw);
        require_silu(tc, path)?;
        reject_tied_embeddings(tc, path, "Mixtral")?;
        let hidden_size = usize_or(tc, path, "hidden_size", 4096)?;
        let num_attention_heads = usize_or(tc, path, "num_attention_heads", 32)?;
        // `num_key_value_heads: null` means as many as the query heads; absent means 8.
        let num_key_value_heads = usize_null_or(tc, path, "num_key_value_heads", num_attention_heads, 8)?;
        let head_dim = opt_usize(tc, path, "head_dim")?.unwrap_or(hidden_size / num_attention_heads.max(1));
        let sliding_window = opt_usize(tc, path, "sliding_window")?;
        let max_position_embeddings = usize_or(tc, path, "max_position_embeddings", 4096 * 32)?;
        let (eos_token_id, bos_token_id) = eos_bos(tc, raw);
        let cfg = MixtralConfig {
            vocab_size: usize_or(tc, path, "vocab_size", 32000)?,
            hidden_size,
            intermediate_size: usize_or(tc, path, "intermediate_size", 14336)?,
            num_hidden_layers: usize_or(tc, path, "num_hidden_layers", 32)?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            num_local_experts: usize_or(tc, path, "num_local_experts", 8)?,
            num_experts_per_tok: usize_or(tc, path, "num_experts_per_tok", 2)?,
            rms_norm_eps: f32_in(tc, path, "rms_norm_eps", 1e-5, Range::NonNegative)?,
            max_position_embeddings,
            rope: resolve_rope(tc, path, max_position_embeddings, 1e6)?,
            sliding_window,
            // transformers' MixtralConfig defaults: bos 1, eos 2.
            eos_token_id: if tc.get("eos_token_id").is_none() && eos_token_id.is_empty() {
                vec![2]
            } else {
                eos_token_id
            },
            bos_token_id: if tc.get("bos_token_id").is_none() {
                Some(1)
            } else {
                bos_token_id
            },
        };
        cfg.validate(path)?;
        Ok(cfg)
    }

    /// Fails fast on hyperparameters this implementation cannot run (field named).
    pub fn validate(&self, path: &Path) -> Result<(), FormatError> {
        require_nonzero_fields!(path, self; vocab_size, max_position_embeddings, hidden_size, intermediate_size,
            num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim, num_local_experts)?;
        check_gqa(path, self.num_attention_heads, self.num_key_value_heads, self.head_dim)?;
        check_top_k(
            path,
            self.num_experts_per_tok,
            self.num_local_experts,
            "num_local_experts",
        )?;
        if self.sliding_window == Some(0) {
            return Err(field_err(path, "sliding_window", "must be greater than 0"));
        }
        Ok(())
    }

    /// Every Mixtral decoder layer is a MoE layer.
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        layer < self.num_hidden_layers
    }
}

impl Family for MixtralConfig {
    crate::family::family_items!(family: "mixtral", routed_experts: num_local_experts, top_k: num_experts_per_tok);

    fn max_experts_per_tok(&self) -> (usize, String) {
        (self.num_local_experts, "routed experts per layer".into())
    }

    /// The backbone tensors with their shapes, in checkpoint order.
    fn backbone_tensors(&self) -> Vec<BackboneTensor> {
        let h = self.hidden_size;
        let (nh, nkv, hd) = (self.num_attention_heads, self.num_key_value_heads, self.head_dim);
        decoder_backbone("model", self.vocab_size, h, self.num_hidden_layers, |_, p| {
            let mut t = gqa_attention_tensors(p, h, nh, nkv, hd, false);
            t.extend(tensors([(
                format!("{p}.block_sparse_moe.gate.weight"),
                vec![self.num_local_experts, h],
                TensorRole::F32,
            )]));
            t
        })
    }

    /// The three matrices of one routed expert (`y = W x`) in record order gate, up, down, with
    /// their checkpoint names (`model.layers.{l}.block_sparse_moe.experts.{e}.{name}.weight`):
    /// `w1` gate `[intermediate, hidden]`, `w3` up `[intermediate, hidden]`, `w2` down
    /// `[hidden, intermediate]`.
    fn expert_matrices(&self) -> Vec<ExpertMatrix> {
        let (h, i) = (self.hidden_size, self.intermediate_size);
        glu_expert_matrices(["w1", "w3", "w2"], h, i)
    }

    fn expert_source(&self, layer: usize, expert: usize, m: &ExpertMatrix) -> ExpertSource {
        per_expert(&format!("model.layers.{layer}.block_sparse_moe"), expert, m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::family::test_support::*;
    use serde_json::json;

    #[test]
    fn defaults_follow_transformers() {
        let c = MixtralConfig::from_value(&json!({"model_type": "mixtral"}), p()).unwrap();
        assert_eq!(
            (c.hidden_size, c.num_attention_heads, c.num_key_value_heads),
            (4096, 32, 8)
        );
        assert_eq!(c.head_dim, 128);
        assert_eq!((c.num_local_experts, c.num_experts_per_tok), (8, 2));
        assert_eq!(c.rope, Rope::Default { theta: 1e6 });
        assert_eq!(c.rms_norm_eps, 1e-5);
        assert_eq!((c.bos_token_id, c.eos_token_id.clone()), (Some(1), vec![2]));
        let c = MixtralConfig::from_value(
            &json!({"model_type": "mixtral", "num_key_value_heads": null, "head_dim": null, "sliding_window": 4096}),
            p(),
        )
        .unwrap();
        assert_eq!(
            (c.num_key_value_heads, c.head_dim, c.sliding_window),
            (32, 128, Some(4096))
        );
    }

    #[test]
    fn validation_names_the_field() {
        let bad = [
            (
                json!({"hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 4}),
                "num_key_value_heads",
            ),
            (
                json!({"num_local_experts": 2, "num_experts_per_tok": 3}),
                "num_experts_per_tok",
            ),
            (json!({"sliding_window": 0}), "sliding_window"),
            (json!({"hidden_act": "gelu"}), "hidden_act"),
            (json!({"head_dim": 7}), "head_dim"),
        ];
        assert_names_field("mixtral", bad, MixtralConfig::from_value);
    }
}
