//! `config.json` of a gpt-oss checkpoint (`model_type` `gpt_oss`, e.g. gpt-oss-20b,
//! gpt-oss-120b), resolved into concrete hyperparameters, and its tensor tables.
//!
//! Keys a checkpoint omits take the defaults of transformers' `GptOssConfig`
//! (`src/transformers/models/gpt_oss/configuration_gpt_oss.py`, 5.x): `rope_theta` 150000
//! (`default_theta`) with YaRN `factor` 32, `beta_fast` 32, `beta_slow` 1, `truncate` false,
//! `original_max_position_embeddings` 4096 when no RoPE config is given; `layer_types`
//! alternating `sliding_attention` (even layers) and `full_attention` (odd layers);
//! `sliding_window` 128; `swiglu_alpha` 1.702, `swiglu_limit` 7.0; `attention_bias` true;
//! `head_dim` 64; 128 experts, top-4; `rms_norm_eps` 1e-5. [GPT_OSS_CONFIG]
//!
//! Routed experts are fused over the experts in one tensor per layer and projection
//! (`mlp.experts.gate_up_proj`, `gate_up_proj_bias`, `down_proj`, `down_proj_bias`). Their
//! layout depends on how the checkpoint stores them [GPT_OSS_LAYOUT]:
//! - unquantized (what transformers' `save_pretrained` writes): `gate_up_proj [E, hidden, 2I]`,
//!   `down_proj [E, I, hidden]` (`y = x @ W`), read transposed;
//! - MXFP4 as on the Hub (`quantization_config.quant_method` `mxfp4`):
//!   `gate_up_proj_blocks [E, 2I, hidden/32, 16]` + `_scales [E, 2I, hidden/32]`,
//!   `down_proj_blocks [E, hidden, I/32, 16]` + `_scales`, i.e. `[E, out, in]` (transformers'
//!   `convert_moe_packed_tensors` transposes them after dequantizing), copied bit for bit.
//!
//! In both, the `2I` outputs of `gate_up_proj` interleave gate and up: gate is output `2j`, up
//! output `2j + 1` (`gate_up[..., ::2]`, `gate_up[..., 1::2]`). Biases stay f32.

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::family::{
    check_gqa, check_layer_count, check_top_k, decoder_backbone, fused, gqa_attention_tensors, matrices, tensors,
    BackboneTensor, ExpertMatrix, ExpertSource, Family, TensorRole,
};
use crate::json::{
    bool_or, eos_bos, f32_in, f64_or, field_err, get, opt_usize, reject_tied_embeddings, require_nonzero_fields,
    require_silu, resolve_aliases, text_config, usize_null_or, usize_or, Aliases, Range,
};
use crate::rope::{resolve_rope, Rope};
use crate::FormatError;

/// `GptOssConfig.attribute_map`: `num_experts` is read as `num_local_experts`.
/// [TRANSFORMERS_ATTRIBUTE_MAP]
const ALIASES: Aliases = &[("num_experts", "num_local_experts")];

/// Concrete hyperparameters of a gpt-oss model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GptOssConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// Intermediate width `I` of one routed expert (`gate_up_proj` has `2I` outputs).
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    /// Key/value heads of grouped-query attention (divides `num_attention_heads`).
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    /// Routed experts per layer (`num_local_experts`).
    pub num_local_experts: usize,
    /// top-k: routed experts chosen per token.
    pub num_experts_per_tok: usize,
    pub rms_norm_eps: f32,
    pub max_position_embeddings: usize,
    pub rope: Rope,
    /// Window of the `sliding_attention` layers in tokens (keys `t` with `pos - t < window`).
    pub sliding_window: usize,
    /// Per layer: whether it is a `sliding_attention` layer (else `full_attention`).
    pub sliding_layers: Vec<bool>,
    /// Sigmoid gain of the clamped SwiGLU (`swiglu_alpha`).
    pub swiglu_alpha: f32,
    /// Clamp of the clamped SwiGLU (`swiglu_limit`).
    pub swiglu_limit: f32,
    /// The checkpoint stores the expert weights as the Hub's MXFP4 `_blocks`/`_scales`
    /// `[E, out, in]` (`quantization_config.quant_method` `mxfp4`); otherwise as transformers
    /// saves them, `[E, in, out]`. [GPT_OSS_LAYOUT]
    pub mxfp4_experts: bool,
    /// end-of-sequence id(s) named by config.json (int or list).
    pub eos_token_id: Vec<u32>,
    pub bos_token_id: Option<u32>,
}

impl GptOssConfig {
    /// Resolves a parsed `config.json` (`path` is only used in error messages).
    ///
    /// Errors: a field of the wrong type, a setting this implementation does not support
    /// (`hidden_act` other than `silu`, `attention_bias` false, tied embeddings, a
    /// `layer_types` entry other than `sliding_attention`/`full_attention`, a
    /// `quantization_config` other than `mxfp4`), or what [`Self::validate`] rejects; each
    /// names the field.
    pub fn from_value(raw: &Value, path: &Path) -> Result<Self, FormatError> {
        let raw = &*resolve_aliases(raw, path, ALIASES)?;
        let tc = text_config(raw);
        require_silu(tc, path)?;
        if !bool_or(tc, path, "attention_bias", true)? {
            return Err(field_err(
                path,
                "attention_bias",
                "gpt-oss without attention biases is not supported",
            ));
        }
        reject_tied_embeddings(tc, path, "gpt-oss")?;
        let hidden_size = usize_or(tc, path, "hidden_size", 2880)?;
        let num_attention_heads = usize_or(tc, path, "num_attention_heads", 64)?;
        let num_key_value_heads = usize_null_or(tc, path, "num_key_value_heads", num_attention_heads, 8)?;
        // `head_dim: null` means `hidden_size / num_attention_heads`; absent means 64.
        let head_dim = match opt_usize(tc, path, "head_dim")? {
            Some(d) => d,
            None if tc.get("head_dim").is_some() => hidden_size / num_attention_heads.max(1),
            None => 64,
        };
        let num_hidden_layers = usize_or(tc, path, "num_hidden_layers", 36)?;
        let sliding_layers = match get(tc, "layer_types") {
            None => (0..num_hidden_layers).map(|l| l % 2 == 0).collect(),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| match v.as_str() {
                    Some("sliding_attention") => Ok(true),
                    Some("full_attention") => Ok(false),
                    _ => Err(field_err(
                        path,
                        "layer_types",
                        format!("{v}: expected \"sliding_attention\" or \"full_attention\""),
                    )),
                })
                .collect::<Result<Vec<_>, _>>()?,
            Some(v) => return Err(field_err(path, "layer_types", format!("expected a list, got {v}"))),
        };
        let mxfp4_experts = match get(raw, "quantization_config").or_else(|| get(tc, "quantization_config")) {
            None => false,
            Some(q) => match q.get("quant_method").and_then(Value::as_str) {
                Some("mxfp4") => true,
                other => {
                    return Err(field_err(
                        path,
                        "quantization_config.quant_method",
                        format!("{other:?}: gpt-oss checkpoints are read unquantized or as MXFP4 (\"mxfp4\")"),
                    ))
                }
            },
        };
        let max_position_embeddings = usize_or(tc, path, "max_position_embeddings", 131072)?;
        // No RoPE config at all: GptOssConfig's default YaRN.
        let rope = if get(tc, "rope_parameters").is_none() && get(tc, "rope_scaling").is_none() {
            let mut t = tc.clone();
            t["rope_parameters"] = json!({
                "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": false, "original_max_position_embeddings": 4096,
            });
            resolve_rope(&t, path, max_position_embeddings, 150000.0)?
        } else {
            resolve_rope(tc, path, max_position_embeddings, 150000.0)?
        };
        let (eos_token_id, bos_token_id) = eos_bos(tc, raw);
        let cfg = GptOssConfig {
            vocab_size: usize_or(tc, path, "vocab_size", 201088)?,
            hidden_size,
            intermediate_size: usize_or(tc, path, "intermediate_size", 2880)?,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            num_local_experts: usize_or(tc, path, "num_local_experts", 128)?,
            num_experts_per_tok: usize_or(tc, path, "num_experts_per_tok", 4)?,
            rms_norm_eps: f32_in(tc, path, "rms_norm_eps", 1e-5, Range::NonNegative)?,
            max_position_embeddings,
            rope,
            sliding_window: usize_or(tc, path, "sliding_window", 128)?,
            sliding_layers,
            swiglu_alpha: f64_or(tc, path, "swiglu_alpha", 1.702)? as f32,
            swiglu_limit: f64_or(tc, path, "swiglu_limit", 7.0)? as f32,
            mxfp4_experts,
            eos_token_id,
            bos_token_id,
        };
        cfg.validate(path)?;
        Ok(cfg)
    }

    /// Fails fast on hyperparameters this implementation cannot run (field named).
    pub fn validate(&self, path: &Path) -> Result<(), FormatError> {
        require_nonzero_fields!(path, self; vocab_size, max_position_embeddings, hidden_size, intermediate_size,
            num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim, num_local_experts,
            sliding_window)?;
        check_gqa(path, self.num_attention_heads, self.num_key_value_heads, self.head_dim)?;
        check_top_k(
            path,
            self.num_experts_per_tok,
            self.num_local_experts,
            "num_local_experts",
        )?;
        check_layer_count(
            path,
            "layer_types",
            "entries",
            self.sliding_layers.len(),
            self.num_hidden_layers,
        )?;
        // The clamped SwiGLU clamps `up` to [-limit, limit]: a limit ≤ 0 makes the bounds cross
        // (`f32::clamp` panics in every expert computation).
        if !(self.swiglu_limit.is_finite() && self.swiglu_limit > 0.0) {
            return Err(field_err(
                path,
                "swiglu_limit",
                format!(
                    "must be a finite number greater than 0 (the SwiGLU clamp), got {}",
                    self.swiglu_limit
                ),
            ));
        }
        Ok(())
    }

    /// Every gpt-oss decoder layer is a MoE layer.
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        layer < self.num_hidden_layers
    }

    /// Attention window of layer `layer`: `Some(sliding_window)` for `sliding_attention`
    /// layers, None (full causal) for `full_attention` ones.
    pub fn layer_window(&self, layer: usize) -> Option<usize> {
        self.sliding_layers
            .get(layer)
            .copied()
            .unwrap_or(false)
            .then_some(self.sliding_window)
    }
}

impl Family for GptOssConfig {
    crate::family::family_items!(family: "gpt_oss", routed_experts: num_local_experts, top_k: num_experts_per_tok);

    fn max_experts_per_tok(&self) -> (usize, String) {
        (self.num_local_experts, "routed experts per layer".into())
    }

    /// The backbone tensors with their shapes, in checkpoint order: GQA with q/k/v/o biases and
    /// per-head `sinks [n_heads]`, the router `mlp.router.weight [E, hidden]` + `bias [E]`.
    fn backbone_tensors(&self) -> Vec<BackboneTensor> {
        let h = self.hidden_size;
        let (nh, nkv, hd) = (self.num_attention_heads, self.num_key_value_heads, self.head_dim);
        let e = self.num_local_experts;
        decoder_backbone("model", self.vocab_size, h, self.num_hidden_layers, |_, p| {
            let mut t = gqa_attention_tensors(p, h, nh, nkv, hd, false);
            let a = format!("{p}.self_attn");
            t.extend(tensors([
                (format!("{a}.q_proj.bias"), vec![nh * hd], TensorRole::F32),
                (format!("{a}.k_proj.bias"), vec![nkv * hd], TensorRole::F32),
                (format!("{a}.v_proj.bias"), vec![nkv * hd], TensorRole::F32),
                (format!("{a}.o_proj.bias"), vec![h], TensorRole::F32),
                (format!("{a}.sinks"), vec![nh], TensorRole::F32),
                (format!("{p}.mlp.router.weight"), vec![e, h], TensorRole::F32),
                (format!("{p}.mlp.router.bias"), vec![e], TensorRole::F32),
            ]));
            t
        })
    }

    /// The four parts of one routed expert in record order (`y = W x`): `gate_up_proj
    /// [2I, hidden]` (gate and up interleaved by output), `gate_up_proj_bias [1, 2I]` (f32),
    /// `down_proj [hidden, I]`, `down_proj_bias [1, hidden]` (f32).
    fn expert_matrices(&self) -> Vec<ExpertMatrix> {
        let (h, i) = (self.hidden_size, self.intermediate_size);
        matrices([
            ("gate_up_proj", 2 * i, h, TensorRole::Matrix),
            ("gate_up_proj_bias", 1, 2 * i, TensorRole::F32),
            ("down_proj", h, i, TensorRole::Matrix),
            ("down_proj_bias", 1, h, TensorRole::F32),
        ])
    }

    /// Where part `m` of expert `expert` in layer `layer` comes from: slice `expert` of the
    /// fused `model.layers.{l}.mlp.experts.{name}` (layouts in the module docs).
    fn expert_source(&self, layer: usize, expert: usize, m: &ExpertMatrix) -> ExpertSource {
        let e = self.num_local_experts;
        let tensor = format!("model.layers.{layer}.mlp.experts.{}", m.name);
        let (shape, transposed) = match m.role {
            TensorRole::F32 => (vec![e, m.cols], false),
            TensorRole::Matrix if self.mxfp4_experts => (vec![e, m.rows, m.cols], false),
            TensorRole::Matrix => (vec![e, m.cols, m.rows], true),
        };
        fused(tensor, shape, expert, transposed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::family::test_support::*;
    use crate::family::Select;

    #[test]
    fn defaults_follow_transformers() {
        let c = GptOssConfig::from_value(&json!({"model_type": "gpt_oss"}), p()).unwrap();
        assert_eq!(
            (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim),
            (2880, 64, 8, 64)
        );
        assert_eq!((c.num_local_experts, c.num_experts_per_tok), (128, 4));
        assert_eq!((c.swiglu_alpha, c.swiglu_limit, c.sliding_window), (1.702, 7.0, 128));
        assert_eq!(&c.sliding_layers[..4], &[true, false, true, false]);
        assert_eq!((c.layer_window(0), c.layer_window(1)), (Some(128), None));
        assert!(!c.mxfp4_experts);
        assert_eq!(
            c.rope,
            Rope::Yarn {
                theta: 150000.0,
                factor: 32.0,
                original_max_position_embeddings: 4096.0,
                beta_fast: 32.0,
                beta_slow: 1.0,
                mscale: None,
                mscale_all_dim: None,
                attention_factor: None,
                truncate: false,
            }
        );
    }

    #[test]
    fn hub_style_config_and_expert_sources() {
        let c = GptOssConfig::from_value(
            &json!({"model_type": "gpt_oss", "num_hidden_layers": 3, "hidden_size": 64, "intermediate_size": 32,
                    "num_local_experts": 4, "layer_types": ["full_attention", "sliding_attention", "full_attention"],
                    "rope_theta": 150000, "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                    "beta_slow": 1.0, "truncate": false, "original_max_position_embeddings": 4096},
                    "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}}),
            p(),
        )
        .unwrap();
        assert_eq!(c.sliding_layers, vec![false, true, false]);
        assert!(c.mxfp4_experts);
        let m = c.expert_matrices();
        assert_eq!(
            m.iter().map(|x| (x.name.as_str(), x.rows, x.cols)).collect::<Vec<_>>(),
            [
                ("gate_up_proj", 64, 64),
                ("gate_up_proj_bias", 1, 64),
                ("down_proj", 64, 32),
                ("down_proj_bias", 1, 64)
            ]
        );
        let s = c.expert_source(2, 3, &m[2]);
        assert_eq!(s.tensor, "model.layers.2.mlp.experts.down_proj");
        assert_eq!(s.shape, vec![4, 64, 32]);
        assert_eq!(
            s.select,
            Select::Expert {
                index: 3,
                transposed: false
            }
        );
        // Unquantized: transformers' [E, in, out], read transposed; biases [E, n].
        let mut raw =
            json!({"model_type": "gpt_oss", "hidden_size": 64, "intermediate_size": 32, "num_local_experts": 4});
        let c = GptOssConfig::from_value(&raw, p()).unwrap();
        let m = c.expert_matrices();
        let s = c.expert_source(0, 1, &m[0]);
        assert_eq!(
            (s.shape, s.select),
            (
                vec![4, 64, 64],
                Select::Expert {
                    index: 1,
                    transposed: true
                }
            )
        );
        let s = c.expert_source(0, 1, &m[2]);
        assert_eq!(s.shape, vec![4, 32, 64]);
        let s = c.expert_source(0, 1, &m[3]);
        assert_eq!(s.tensor, "model.layers.0.mlp.experts.down_proj_bias");
        assert_eq!(
            (s.shape, s.select),
            (
                vec![4, 64],
                Select::Expert {
                    index: 1,
                    transposed: false
                }
            )
        );
        raw["quantization_config"] = json!({"quant_method": "fp8"});
        let e = GptOssConfig::from_value(&raw, p()).unwrap_err().to_string();
        assert!(e.contains("quant_method"), "{e}");
    }

    #[test]
    fn swiglu_limit_must_be_positive_and_finite() {
        for v in [json!(-1.0), json!(0.0), json!(-0.0), json!(1e39)] {
            let e = GptOssConfig::from_value(&json!({"model_type": "gpt_oss", "swiglu_limit": v}), p())
                .unwrap_err()
                .to_string();
            assert!(e.contains("swiglu_limit") && !e.contains('\n'), "{e}");
        }
        let c = GptOssConfig::from_value(&json!({"model_type": "gpt_oss", "swiglu_limit": 0.5}), p()).unwrap();
        assert_eq!(c.swiglu_limit, 0.5);
    }

    #[test]
    fn validation_names_the_field() {
        let bad = [
            (
                json!({"num_hidden_layers": 2, "layer_types": ["full_attention"]}),
                "layer_types",
            ),
            (json!({"layer_types": ["chunked_attention"]}), "layer_types"),
            (
                json!({"num_local_experts": 2, "num_experts_per_tok": 3}),
                "num_experts_per_tok",
            ),
            (json!({"attention_bias": false}), "attention_bias"),
            (json!({"tie_word_embeddings": true}), "tie_word_embeddings"),
            (json!({"hidden_act": "gelu"}), "hidden_act"),
            (json!({"sliding_window": 0}), "sliding_window"),
        ];
        assert_names_field("gpt_oss", bad, GptOssConfig::from_value);
    }
}
