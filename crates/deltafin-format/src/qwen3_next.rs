//! `config.json` of the Qwen3-Next family, resolved into concrete hyperparameters, and its
//! tensor tables: Qwen3-Next (`model_type` `qwen3_next`, e.g. Qwen3-Next-80B-A3B) and the text
//! model of Qwen3.5-MoE (`qwen3_5_moe`, whose `text_config` is `qwen3_5_moe_text`, e.g.
//! Qwen3.5-35B-A3B).
//!
//! Both are the same hybrid: gated DeltaNet linear-attention layers and gated full-attention
//! layers (`layer_types`, or every `full_attention_interval`-th layer), each followed by a MoE
//! block with a sigmoid-gated shared expert. What differs is the checkpoint layout
//! [QWEN3_NEXT_LAYOUT]:
//! - Qwen3-Next: fused DeltaNet input projections `linear_attn.in_proj_qkvz` and
//!   `linear_attn.in_proj_ba`, grouped per key head; per-expert tensors
//!   `mlp.experts.{e}.{gate,up,down}_proj.weight`; names under `model.`; `mlp_only_layers` /
//!   `decoder_sparse_step` choose dense layers; `norm_topk_prob` (default true).
//! - Qwen3.5-MoE: separate `in_proj_qkv` / `in_proj_z` / `in_proj_b` / `in_proj_a`; experts
//!   fused over the experts (`mlp.experts.gate_up_proj [E, 2I, hidden]`,
//!   `mlp.experts.down_proj [E, hidden, I]`); names under `model.language_model.` (the vision
//!   tower `model.visual.*` and the MTP head `mtp.*` are skipped); every layer is MoE and the
//!   top-k weights are always renormalised.
//!
//! Keys a checkpoint omits take the defaults of transformers 5.24
//! `models/qwen3_next/configuration_qwen3_next.py` and
//! `models/qwen3_5_moe/configuration_qwen3_5_moe.py` (`Qwen3_5MoeTextConfig`), including
//! `partial_rotary_factor` 0.25 and a full-attention interval of 4. [QWEN3_NEXT_CONFIG]

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::family::{
    check_dense_width, check_kv_heads, check_layer_count, check_mlp_only_layers, check_top_k, decoder_backbone, fused,
    glu_expert_matrices, glu_mlp_tensors, matrices, per_expert, sparse_step_moe_layer, tensors, BackboneTensor,
    ExpertMatrix, ExpertSource, Family, TensorRole, GATE_UP_DOWN,
};
use crate::json::{
    bool_or, eos_bos, f32_in, f64_or, field_err, get, layer_indices, reject_true, require_nonzero_fields, require_silu,
    resolve_aliases, text_config, usize_or, Aliases, Range,
};
use crate::rope::{resolve_rope, Rope};
use crate::FormatError;

/// `num_local_experts` is read as `num_experts`, as `Qwen3MoeConfig.attribute_map` maps the
/// two for the MoE block Qwen3-Next shares with it. [TRANSFORMERS_ATTRIBUTE_MAP]
const ALIASES: Aliases = &[("num_local_experts", "num_experts")];

/// Token mixer of one decoder layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Qwen3NextMixer {
    /// Gated DeltaNet (`linear_attention`): linear attention with a recurrent state.
    GatedDeltaNet,
    /// Gated grouped-query attention (`full_attention`) with partial RoPE.
    Attention,
}

/// Concrete hyperparameters of a Qwen3-Next / Qwen3.5-MoE text model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Qwen3NextConfig {
    /// `qwen3_next` or `qwen3_5_moe` (the top-level `model_type`).
    pub model_type: String,
    /// Name prefix of the text model's tensors: `model` (Qwen3-Next) or `model.language_model`
    /// (Qwen3.5-MoE). `lm_head.weight` has no prefix.
    pub prefix: String,
    /// Qwen3-Next's fused `in_proj_qkvz` / `in_proj_ba` (true) or Qwen3.5's separate
    /// `in_proj_qkv` / `in_proj_z` / `in_proj_b` / `in_proj_a` (false).
    pub fused_linear_proj: bool,
    /// Routed experts fused over the experts in the checkpoint (Qwen3.5: `gate_up_proj`,
    /// `down_proj`), else one tensor per expert and matrix (Qwen3-Next).
    pub fused_experts: bool,
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// Intermediate width of dense MLP layers.
    pub intermediate_size: usize,
    pub moe_intermediate_size: usize,
    /// Intermediate width of the shared expert.
    pub shared_expert_intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    /// Rotated leading dims of each head: `int(head_dim × partial_rotary_factor)` (even).
    pub rotary_dim: usize,
    pub rope: Rope,
    pub linear_conv_kernel_dim: usize,
    pub linear_key_head_dim: usize,
    pub linear_value_head_dim: usize,
    pub linear_num_key_heads: usize,
    /// A multiple of `linear_num_key_heads`: key head `h / (nv / nk)` serves value head `h`.
    pub linear_num_value_heads: usize,
    /// Token mixer of each layer (zero-based).
    pub mixers: Vec<Qwen3NextMixer>,
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    /// Renormalise the top-k softmax probabilities to sum to 1.
    pub norm_topk_prob: bool,
    pub decoder_sparse_step: usize,
    pub mlp_only_layers: Vec<usize>,
    pub rms_norm_eps: f32,
    pub max_position_embeddings: usize,
    pub eos_token_id: Vec<u32>,
    pub bos_token_id: Option<u32>,
}

impl Qwen3NextConfig {
    /// Resolves a parsed `config.json`: top-level `qwen3_next`, or a `qwen3_5_moe` wrapper whose
    /// `text_config` is `qwen3_5_moe_text` (a bare `qwen3_5_moe_text` config is accepted too).
    /// `path` names the file in errors.
    ///
    /// Errors: a field of the wrong type, or a setting this implementation does not run
    /// (`hidden_act` other than silu, attention biases, tied embeddings, unknown layer types, a
    /// RoPE type other than default/yarn), or what [`Self::validate`] rejects; each names the
    /// field.
    pub fn from_value(raw: &Value, path: &Path) -> Result<Self, FormatError> {
        let raw = &*resolve_aliases(raw, path, ALIASES)?;
        let tc = text_config(raw);
        let tmt = tc.get("model_type").and_then(Value::as_str).unwrap_or("");
        let qwen35 = tmt == "qwen3_5_moe_text";
        require_silu(tc, path)?;
        reject_true(tc, path, "attention_bias", "attention biases are not supported")?;
        if bool_or(tc, path, "tie_word_embeddings", false)? || bool_or(raw, path, "tie_word_embeddings", false)? {
            return Err(field_err(
                path,
                "tie_word_embeddings",
                "tied embeddings are not supported (the released checkpoints have an untied lm_head)",
            ));
        }
        let n_layers = usize_or(tc, path, "num_hidden_layers", if qwen35 { 40 } else { 48 })?;
        let mixers = match get(tc, "layer_types") {
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| match v.as_str() {
                    Some("linear_attention") => Ok(Qwen3NextMixer::GatedDeltaNet),
                    Some("full_attention") => Ok(Qwen3NextMixer::Attention),
                    _ => Err(field_err(
                        path,
                        "layer_types",
                        format!("{v} is not a layer type (linear_attention, full_attention)"),
                    )),
                })
                .collect::<Result<Vec<_>, _>>()?,
            Some(v) => return Err(field_err(path, "layer_types", format!("expected a list, got {v}"))),
            None => {
                let interval = usize_or(tc, path, "full_attention_interval", 4)?;
                if interval == 0 {
                    return Err(field_err(path, "full_attention_interval", "must be greater than 0"));
                }
                (0..n_layers)
                    .map(|i| {
                        if (i + 1).is_multiple_of(interval) {
                            Qwen3NextMixer::Attention
                        } else {
                            Qwen3NextMixer::GatedDeltaNet
                        }
                    })
                    .collect()
            }
        };
        check_layer_count(path, "layer_types", "entries", mixers.len(), n_layers)?;
        let mlp_only_layers = if qwen35 {
            Vec::new()
        } else {
            layer_indices(tc, path, "mlp_only_layers")?
        };
        let hidden_size = usize_or(tc, path, "hidden_size", 2048)?;
        let num_attention_heads = usize_or(tc, path, "num_attention_heads", 16)?;
        let head_dim = usize_or(tc, path, "head_dim", 256)?;
        // transformers 5 keeps partial_rotary_factor in rope_parameters; 4.x-style configs give it
        // at the top level. Default 0.25 (`kwargs.setdefault` in both configs).
        let prf = match get(tc, "rope_parameters").filter(|v| v.is_object()) {
            Some(p) if get(p, "partial_rotary_factor").is_some() => f64_or(p, path, "partial_rotary_factor", 0.25)?,
            _ => f64_or(tc, path, "partial_rotary_factor", 0.25)?,
        };
        if !(prf > 0.0 && prf <= 1.0) {
            return Err(field_err(
                path,
                "partial_rotary_factor",
                format!("{prf} is not in (0, 1]"),
            ));
        }
        let rotary_dim = (head_dim as f64 * prf) as usize;
        let max_position_embeddings = usize_or(tc, path, "max_position_embeddings", 32768)?;
        let (eos_token_id, bos_token_id) = eos_bos(tc, raw);
        let top = raw.get("model_type").and_then(Value::as_str).unwrap_or("qwen3_next");
        let cfg = Qwen3NextConfig {
            model_type: if qwen35 { "qwen3_5_moe".into() } else { top.to_string() },
            prefix: if qwen35 {
                "model.language_model".into()
            } else {
                "model".into()
            },
            fused_linear_proj: !qwen35,
            fused_experts: qwen35,
            vocab_size: usize_or(tc, path, "vocab_size", if qwen35 { 248320 } else { 151936 })?,
            hidden_size,
            intermediate_size: usize_or(tc, path, "intermediate_size", if qwen35 { 0 } else { 5632 })?,
            moe_intermediate_size: usize_or(tc, path, "moe_intermediate_size", 512)?,
            shared_expert_intermediate_size: usize_or(tc, path, "shared_expert_intermediate_size", 512)?,
            num_hidden_layers: n_layers,
            num_attention_heads,
            num_key_value_heads: usize_or(tc, path, "num_key_value_heads", 2)?,
            head_dim,
            rotary_dim,
            rope: resolve_rope(tc, path, max_position_embeddings, 10000.0)?,
            linear_conv_kernel_dim: usize_or(tc, path, "linear_conv_kernel_dim", 4)?,
            linear_key_head_dim: usize_or(tc, path, "linear_key_head_dim", 128)?,
            linear_value_head_dim: usize_or(tc, path, "linear_value_head_dim", 128)?,
            linear_num_key_heads: usize_or(tc, path, "linear_num_key_heads", 16)?,
            linear_num_value_heads: usize_or(tc, path, "linear_num_value_heads", 32)?,
            mixers,
            num_experts: usize_or(tc, path, "num_experts", if qwen35 { 256 } else { 512 })?,
            num_experts_per_tok: usize_or(tc, path, "num_experts_per_tok", if qwen35 { 8 } else { 10 })?,
            // Qwen3_5MoeTopKRouter always renormalises.
            norm_topk_prob: qwen35 || bool_or(tc, path, "norm_topk_prob", true)?,
            decoder_sparse_step: if qwen35 {
                1
            } else {
                usize_or(tc, path, "decoder_sparse_step", 1)?
            },
            mlp_only_layers,
            rms_norm_eps: f32_in(tc, path, "rms_norm_eps", 1e-6, Range::NonNegative)?,
            max_position_embeddings,
            eos_token_id,
            bos_token_id,
        };
        cfg.validate(path)?;
        Ok(cfg)
    }

    /// Fails fast on hyperparameters this implementation cannot run (field named).
    pub fn validate(&self, path: &Path) -> Result<(), FormatError> {
        require_nonzero_fields!(path, self; vocab_size, max_position_embeddings, hidden_size, num_hidden_layers,
            num_attention_heads, num_key_value_heads, head_dim, linear_conv_kernel_dim, linear_key_head_dim,
            linear_value_head_dim, linear_num_key_heads, linear_num_value_heads, decoder_sparse_step)?;
        check_layer_count(
            path,
            "layer_types",
            "entries",
            self.mixers.len(),
            self.num_hidden_layers,
        )?;
        if self.rotary_dim == 0 || !self.rotary_dim.is_multiple_of(2) || self.rotary_dim > self.head_dim {
            return Err(field_err(
                path,
                "partial_rotary_factor",
                format!(
                    "rotary width {} must be even, positive and at most head_dim {}",
                    self.rotary_dim, self.head_dim
                ),
            ));
        }
        check_kv_heads(path, self.num_attention_heads, self.num_key_value_heads)?;
        if !self.linear_num_value_heads.is_multiple_of(self.linear_num_key_heads) {
            return Err(field_err(
                path,
                "linear_num_value_heads",
                format!(
                    "{} is not a multiple of linear_num_key_heads {}",
                    self.linear_num_value_heads, self.linear_num_key_heads
                ),
            ));
        }
        check_mlp_only_layers(path, &self.mlp_only_layers, self.num_hidden_layers)?;
        if self.has_moe() {
            check_top_k(path, self.num_experts_per_tok, self.num_experts, "num_experts")?;
            require_nonzero_fields!(path, self; moe_intermediate_size, shared_expert_intermediate_size)?;
        }
        check_dense_width(path, self, self.intermediate_size)
    }

    /// Follows the checkpoint's routed-expert naming where both exist in the wild: fused over
    /// the experts (`mlp.experts.gate_up_proj [E, 2I, hidden]`, `down_proj [E, hidden, I]`, as
    /// transformers' Qwen3.5-MoE module holds them) or one set per expert
    /// (`mlp.experts.{e}.{gate,up,down}_proj.weight`, the original Qwen3-Next release and
    /// re-exports such as vLLM's loader accepts). `has(name)` says whether the checkpoint holds a
    /// tensor; with both or neither form present the family's default stays (and the converter's
    /// completeness check names what is missing).
    pub fn adapt_expert_naming(&mut self, has: impl Fn(&str) -> bool) {
        let Some(l) = (0..self.num_hidden_layers).find(|&l| self.is_moe_layer(l)) else {
            return;
        };
        let e = self.name(&format!("layers.{l}.mlp.experts"));
        let fused = has(&format!("{e}.gate_up_proj"));
        let split = has(&format!("{e}.0.gate_proj.weight"));
        if fused != split {
            self.fused_experts = fused;
        }
    }

    /// Whether decoder layer `layer` (0-based) is a MoE layer, as `Qwen3NextDecoderLayer`
    /// decides: not in `mlp_only_layers`, experts present, `(layer + 1) % decoder_sparse_step ==
    /// 0` (Qwen3.5-MoE: every layer).
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

    /// `linear_num_key_heads × linear_key_head_dim`.
    pub fn key_dim(&self) -> usize {
        self.linear_num_key_heads * self.linear_key_head_dim
    }

    /// `linear_num_value_heads × linear_value_head_dim`.
    pub fn value_dim(&self) -> usize {
        self.linear_num_value_heads * self.linear_value_head_dim
    }

    /// Channels of the DeltaNet convolution: `[q | k | v]`, `2 key_dim + value_dim`.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }

    /// Checkpoint name of a text-model tensor (`{prefix}.{rest}`).
    pub fn name(&self, rest: &str) -> String {
        format!("{}.{rest}", self.prefix)
    }
}

impl Family for Qwen3NextConfig {
    crate::family::family_items!(
        family: "qwen3_next", model_type: self.model_type, routed_experts: num_experts, top_k: num_experts_per_tok
    );

    /// The resident tensors with their shapes, in checkpoint order. Matrices that produce
    /// gates and decays (`in_proj_ba` / `in_proj_b` / `in_proj_a`, `shared_expert_gate`, the
    /// router) stay f32 like norms.
    fn backbone_tensors(&self) -> Vec<BackboneTensor> {
        use TensorRole::{Matrix, F32};
        let h = self.hidden_size;
        let (nh, nkv, hd) = (self.num_attention_heads, self.num_key_value_heads, self.head_dim);
        let (kd, vd, nv) = (self.key_dim(), self.value_dim(), self.linear_num_value_heads);
        decoder_backbone(&self.prefix, self.vocab_size, h, self.num_hidden_layers, |l, p| {
            let mut t = Vec::new();
            match self.mixers[l] {
                Qwen3NextMixer::Attention => {
                    let a = format!("{p}.self_attn");
                    t.push((format!("{a}.q_proj.weight"), vec![2 * nh * hd, h], Matrix));
                    t.push((format!("{a}.k_proj.weight"), vec![nkv * hd, h], Matrix));
                    t.push((format!("{a}.v_proj.weight"), vec![nkv * hd, h], Matrix));
                    t.push((format!("{a}.o_proj.weight"), vec![h, nh * hd], Matrix));
                    t.push((format!("{a}.q_norm.weight"), vec![hd], F32));
                    t.push((format!("{a}.k_norm.weight"), vec![hd], F32));
                }
                Qwen3NextMixer::GatedDeltaNet => {
                    let a = format!("{p}.linear_attn");
                    if self.fused_linear_proj {
                        t.push((format!("{a}.in_proj_qkvz.weight"), vec![2 * kd + 2 * vd, h], Matrix));
                        t.push((format!("{a}.in_proj_ba.weight"), vec![2 * nv, h], F32));
                    } else {
                        t.push((format!("{a}.in_proj_qkv.weight"), vec![2 * kd + vd, h], Matrix));
                        t.push((format!("{a}.in_proj_z.weight"), vec![vd, h], Matrix));
                        t.push((format!("{a}.in_proj_b.weight"), vec![nv, h], F32));
                        t.push((format!("{a}.in_proj_a.weight"), vec![nv, h], F32));
                    }
                    let conv = vec![self.conv_dim(), 1, self.linear_conv_kernel_dim];
                    t.push((format!("{a}.conv1d.weight"), conv, F32));
                    t.push((format!("{a}.dt_bias"), vec![nv], F32));
                    t.push((format!("{a}.A_log"), vec![nv], F32));
                    t.push((format!("{a}.norm.weight"), vec![self.linear_value_head_dim], F32));
                    t.push((format!("{a}.out_proj.weight"), vec![h, vd], Matrix));
                }
            }
            let m = format!("{p}.mlp");
            let mut t = tensors(t);
            if self.is_moe_layer(l) {
                let s = self.shared_expert_intermediate_size;
                t.extend(tensors([(format!("{m}.gate.weight"), vec![self.num_experts, h], F32)]));
                t.extend(glu_mlp_tensors(&format!("{m}.shared_expert"), h, s));
                t.extend(tensors([(format!("{m}.shared_expert_gate.weight"), vec![1, h], F32)]));
            } else {
                t.extend(glu_mlp_tensors(&m, h, self.intermediate_size));
            }
            t
        })
    }

    /// The matrices of one routed expert (`y = W x`): Qwen3-Next `gate_proj`, `up_proj`
    /// `[I, hidden]`, `down_proj [hidden, I]`; Qwen3.5-MoE `gate_up_proj [2I, hidden]` (gate rows
    /// first, then up: transformers' `.chunk(2)`) and `down_proj [hidden, I]`.
    fn expert_matrices(&self) -> Vec<ExpertMatrix> {
        let (h, i) = (self.hidden_size, self.moe_intermediate_size);
        if self.fused_experts {
            matrices([
                ("gate_up_proj", 2 * i, h, TensorRole::Matrix),
                ("down_proj", h, i, TensorRole::Matrix),
            ])
        } else {
            glu_expert_matrices(GATE_UP_DOWN, h, i)
        }
    }

    /// Where matrix `m` of routed expert `expert` in layer `layer` comes from: its own tensor
    /// (Qwen3-Next) or slice `expert` of the fused `[E, rows, cols]` tensor (Qwen3.5-MoE).
    fn expert_source(&self, layer: usize, expert: usize, m: &ExpertMatrix) -> ExpertSource {
        let block = self.name(&format!("layers.{layer}.mlp"));
        if self.fused_experts {
            let shape = vec![self.num_experts, m.rows, m.cols];
            fused(format!("{block}.experts.{}", m.name), shape, expert, false)
        } else {
            per_expert(&block, expert, m)
        }
    }

    /// Names the converter deliberately skips: rotary buffers, the multi-token-prediction head
    /// (`mtp.*`) and, for Qwen3.5-MoE, the vision tower (`model.visual.*`).
    fn is_ignored(&self, name: &str) -> bool {
        name.ends_with("rotary_emb.inv_freq") || name.starts_with("mtp.") || name.starts_with("model.visual.")
    }

    fn recurrent_state_values(&self) -> u128 {
        self.linear_num_value_heads as u128 * self.linear_key_head_dim as u128 * self.linear_value_head_dim as u128
    }

    fn adapt_to_checkpoint(&mut self, has: &dyn Fn(&str) -> bool) {
        self.adapt_expert_naming(has);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::family::test_support::*;
    use serde_json::json;

    #[test]
    fn defaults_follow_transformers() {
        let c = Qwen3NextConfig::from_value(&json!({"model_type": "qwen3_next"}), p()).unwrap();
        assert_eq!(
            (c.hidden_size, c.num_hidden_layers, c.head_dim, c.rotary_dim),
            (2048, 48, 256, 64)
        );
        assert_eq!((c.num_experts, c.num_experts_per_tok), (512, 10));
        assert!(c.norm_topk_prob && c.fused_linear_proj && !c.fused_experts);
        // every 4th layer (l + 1 divisible by 4) is full attention
        assert_eq!(c.mixers[2], Qwen3NextMixer::GatedDeltaNet);
        assert_eq!(c.mixers[3], Qwen3NextMixer::Attention);
        assert_eq!(c.name("norm.weight"), "model.norm.weight");
        let w = json!({"model_type": "qwen3_5_moe", "text_config": {"model_type": "qwen3_5_moe_text",
            "num_hidden_layers": 4, "rope_parameters": {"rope_type": "default", "rope_theta": 1e7,
            "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1], "mrope_interleaved": true}},
            "vision_config": {"model_type": "qwen3_5_moe_vision"}});
        let c = Qwen3NextConfig::from_value(&w, p()).unwrap();
        assert_eq!(c.model_type, "qwen3_5_moe");
        assert_eq!((c.num_experts, c.num_experts_per_tok, c.rotary_dim), (256, 8, 128));
        assert!(c.norm_topk_prob && !c.fused_linear_proj && c.fused_experts);
        assert_eq!(c.rope, Rope::Default { theta: 1e7 });
        assert!((0..4).all(|l| c.is_moe_layer(l)));
        assert!(c.is_ignored("model.visual.blocks.0.attn.qkv.weight") && c.is_ignored("mtp.fc.weight"));
        let m = &c.expert_matrices()[0];
        let s = c.expert_source(1, 3, m);
        assert_eq!(s.tensor, "model.language_model.layers.1.mlp.experts.gate_up_proj");
        assert_eq!(s.shape, vec![256, 1024, 2048]);
    }

    #[test]
    fn validation_names_the_field() {
        let bad = [
            (
                json!({"linear_num_key_heads": 3, "linear_num_value_heads": 4}),
                "linear_num_value_heads",
            ),
            (
                json!({"layer_types": ["linear_attention"], "num_hidden_layers": 2}),
                "layer_types",
            ),
            (
                json!({"layer_types": ["sliding_attention"], "num_hidden_layers": 1}),
                "layer_types",
            ),
            (json!({"mlp_only_layers": [99]}), "mlp_only_layers"),
            (json!({"hidden_act": "gelu"}), "hidden_act"),
            (
                json!({"num_experts": 4, "num_experts_per_tok": 5}),
                "num_experts_per_tok",
            ),
        ];
        assert_names_field("qwen3_next", bad, Qwen3NextConfig::from_value);
    }
}
