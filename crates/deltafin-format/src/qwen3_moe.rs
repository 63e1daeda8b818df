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
    glu_expert_matrices, gqa_layer_tensors, whole, BackboneTensor, ExpertMatrix, ExpertSource, Family, TensorRole,
};
use crate::json::{
    bool_or, eos_bos, f32_in, field_err, get, require_silu, resolve_aliases, text_config, usize_or, Aliases, Range,
};
use crate::rope::{resolve_rope, Rope};
use crate::FormatError;

/// `Qwen3MoeConfig.attribute_map` (transformers 5): `num_experts` is stored as
/// `num_local_experts`; this crate reads `num_experts`, so the map is applied in reverse.
/// [TRANSFORMERS_ATTRIBUTE_MAP]
const ALIASES: Aliases = &[("num_local_experts", "num_experts")];

/// Concrete hyperparameters of a Qwen3-MoE text model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Qwen3MoeConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// Intermediate width of the dense MLP layers (`mlp_only_layers` and the layers
    /// `decoder_sparse_step` skips).
    pub intermediate_size: usize,
    /// Intermediate width of one routed expert.
    pub moe_intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
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
        if bool_or(tc, path, "attention_bias", false)? {
            return Err(field_err(path, "attention_bias", "attention biases are not supported"));
        }
        if bool_or(tc, path, "tie_word_embeddings", false)? {
            return Err(field_err(
                path,
                "tie_word_embeddings",
                "tied embeddings are not supported (Qwen3-MoE checkpoints have an untied lm_head)",
            ));
        }
        let hidden_size = usize_or(tc, path, "hidden_size", 2048)?;
        let num_attention_heads = usize_or(tc, path, "num_attention_heads", 32)?;
        let head_dim = match get(tc, "head_dim") {
            Some(_) => usize_or(tc, path, "head_dim", 0)?,
            None => hidden_size / num_attention_heads.max(1),
        };
        let mlp_only_layers = match get(tc, "mlp_only_layers") {
            None => Vec::new(),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| {
                    v.as_u64()
                        .map(|x| x as usize)
                        .ok_or_else(|| field_err(path, "mlp_only_layers", format!("expected layer indices, got {v}")))
                })
                .collect::<Result<Vec<_>, _>>()?,
            Some(v) => {
                return Err(field_err(
                    path,
                    "mlp_only_layers",
                    format!("expected a list of layer indices, got {v}"),
                ))
            }
        };
        let sliding_window = if bool_or(tc, path, "use_sliding_window", false)? {
            match get(tc, "sliding_window") {
                None => None,
                Some(_) => Some(usize_or(tc, path, "sliding_window", 0)?),
            }
        } else {
            None
        };
        let max_position_embeddings = usize_or(tc, path, "max_position_embeddings", 32768)?;
        let (eos_token_id, bos_token_id) = eos_bos(tc, raw);
        let cfg = Qwen3MoeConfig {
            vocab_size: usize_or(tc, path, "vocab_size", 151936)?,
            hidden_size,
            intermediate_size: usize_or(tc, path, "intermediate_size", 6144)?,
            moe_intermediate_size: usize_or(tc, path, "moe_intermediate_size", 768)?,
            num_hidden_layers: usize_or(tc, path, "num_hidden_layers", 24)?,
            num_attention_heads,
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
        let nonzero = [
            ("vocab_size", self.vocab_size),
            ("max_position_embeddings", self.max_position_embeddings),
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("decoder_sparse_step", self.decoder_sparse_step),
        ];
        for (k, v) in nonzero {
            if v == 0 {
                return Err(field_err(path, k, "must be greater than 0"));
            }
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(field_err(path, "head_dim", "must be even (RoPE rotates pairs)"));
        }
        if !self.num_attention_heads.is_multiple_of(self.num_key_value_heads) {
            return Err(field_err(
                path,
                "num_key_value_heads",
                format!(
                    "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                    self.num_attention_heads, self.num_key_value_heads
                ),
            ));
        }
        if let Some(&l) = self.mlp_only_layers.iter().find(|&&l| l >= self.num_hidden_layers) {
            return Err(field_err(
                path,
                "mlp_only_layers",
                format!(
                    "layer {l} does not exist (num_hidden_layers {})",
                    self.num_hidden_layers
                ),
            ));
        }
        if self.sliding_window == Some(0) {
            return Err(field_err(path, "sliding_window", "must be greater than 0"));
        }
        if self.has_moe() {
            if self.num_experts_per_tok == 0 || self.num_experts_per_tok > self.num_experts {
                return Err(field_err(
                    path,
                    "num_experts_per_tok",
                    format!(
                        "must be between 1 and num_experts ({}), got {}",
                        self.num_experts, self.num_experts_per_tok
                    ),
                ));
            }
            if self.moe_intermediate_size == 0 {
                return Err(field_err(path, "moe_intermediate_size", "must be greater than 0"));
            }
        }
        if (0..self.num_hidden_layers).any(|l| !self.is_moe_layer(l)) && self.intermediate_size == 0 {
            return Err(field_err(
                path,
                "intermediate_size",
                "dense layers need intermediate_size > 0",
            ));
        }
        Ok(())
    }

    /// Whether decoder layer `layer` (0-based) is a MoE layer, as `Qwen3MoeDecoderLayer`
    /// decides: not in `mlp_only_layers`, experts present, and `(layer + 1) %
    /// decoder_sparse_step == 0`. [QWEN3_MOE_LAYERS]
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        layer < self.num_hidden_layers
            && !self.mlp_only_layers.contains(&layer)
            && self.num_experts > 0
            && (layer + 1).is_multiple_of(self.decoder_sparse_step.max(1))
    }

    /// Whether any layer is a MoE layer.
    pub fn has_moe(&self) -> bool {
        (0..self.num_hidden_layers).any(|l| self.is_moe_layer(l))
    }
}

impl Family for Qwen3MoeConfig {
    crate::family::config_fields!();

    fn family(&self) -> &'static str {
        "qwen3_moe"
    }

    fn model_type(&self) -> &str {
        "qwen3_moe"
    }

    fn validate(&self, path: &Path) -> Result<(), FormatError> {
        Qwen3MoeConfig::validate(self, path)
    }

    fn is_moe_layer(&self, layer: usize) -> bool {
        Qwen3MoeConfig::is_moe_layer(self, layer)
    }

    fn n_routed_experts(&self) -> usize {
        self.num_experts
    }

    fn num_experts_per_tok(&self) -> usize {
        self.num_experts_per_tok
    }

    /// The backbone tensors with their shapes, in checkpoint order.
    fn backbone_tensors(&self) -> Vec<BackboneTensor> {
        let (h, v) = (self.hidden_size, self.vocab_size);
        let mut t = vec![BackboneTensor {
            name: "model.embed_tokens.weight".into(),
            shape: vec![v, h],
            role: TensorRole::Matrix,
        }];
        for l in 0..self.num_hidden_layers {
            let p = format!("model.layers.{l}");
            t.extend(gqa_layer_tensors(
                &p,
                h,
                self.num_attention_heads,
                self.num_key_value_heads,
                self.head_dim,
                true,
            ));
            let m = format!("{p}.mlp");
            let mut push = |name: String, shape: Vec<usize>, role| t.push(BackboneTensor { name, shape, role });
            if self.is_moe_layer(l) {
                push(format!("{m}.gate.weight"), vec![self.num_experts, h], TensorRole::F32);
            } else {
                let i = self.intermediate_size;
                push(format!("{m}.gate_proj.weight"), vec![i, h], TensorRole::Matrix);
                push(format!("{m}.up_proj.weight"), vec![i, h], TensorRole::Matrix);
                push(format!("{m}.down_proj.weight"), vec![h, i], TensorRole::Matrix);
            }
        }
        t.push(BackboneTensor {
            name: "model.norm.weight".into(),
            shape: vec![h],
            role: TensorRole::F32,
        });
        t.push(BackboneTensor {
            name: "lm_head.weight".into(),
            shape: vec![v, h],
            role: TensorRole::Matrix,
        });
        t
    }

    /// The three matrices of one routed expert (`y = W x`), as named in the checkpoint
    /// (`model.layers.{l}.mlp.experts.{e}.{name}.weight`).
    fn expert_matrices(&self) -> Vec<ExpertMatrix> {
        let (h, i) = (self.hidden_size, self.moe_intermediate_size);
        glu_expert_matrices(["gate_proj", "up_proj", "down_proj"], h, i)
    }

    fn expert_source(&self, layer: usize, expert: usize, m: &ExpertMatrix) -> ExpertSource {
        whole(
            format!("model.layers.{layer}.mlp.experts.{expert}.{}.weight", m.name),
            m,
        )
    }

    /// Names the converter deliberately skips: rotary frequency buffers.
    fn is_ignored(&self, name: &str) -> bool {
        name.ends_with("rotary_emb.inv_freq")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn p() -> &'static Path {
        Path::new("config.json")
    }

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
        for (mut v, field) in bad {
            v["model_type"] = json!("qwen3_moe");
            let e = Qwen3MoeConfig::from_value(&v, p()).unwrap_err();
            assert!(e.to_string().contains(field), "{v}: {e}");
        }
    }
}
