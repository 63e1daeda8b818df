//! Model families: what the converter, the model directory and the engine need to know about an
//! architecture, digested from `config.json` once. The forward code lives in the engine (one
//! file per family); this module only describes tensors: the resident backbone tensors with
//! their shapes and storage role, the matrices of one routed-expert record, where each comes
//! from in the checkpoint, and which checkpoint tensors are deliberately left out.
//!
//! Each family's config lives in its own file and implements [`Family`]; [`ModelConfig`] holds
//! one of them and answers through [`ModelConfig::as_family`]. Adding a family: a config type
//! with `from_value`, `validate` and an `impl Family` (its own file), a variant of
//! [`ModelConfig`], and its arms in [`ModelConfig::from_value`] and `as_family`.
//!
//! Families: `deepseek_v3` ([`DeepseekV3Config`]), `qwen3_moe` ([`Qwen3MoeConfig`]), `mixtral`
//! ([`MixtralConfig`]), `gpt_oss` ([`GptOssConfig`]), `qwen3_next` / `qwen3_5_moe`
//! ([`Qwen3NextConfig`]).

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::aligned::{RECORD_ALIGN, TENSOR_ALIGN};
use crate::deepseek_v3::DeepseekV3Config;
use crate::family::{BackboneTensor, ExpertMatrix, ExpertSource, Family};
use crate::gpt_oss::GptOssConfig;
use crate::json::{read_json, text_config};
use crate::kimi_linear::KimiLinearConfig;
use crate::mixtral::MixtralConfig;
use crate::qwen3_moe::Qwen3MoeConfig;
use crate::qwen3_next::Qwen3NextConfig;
use crate::FormatError;

/// Resolved hyperparameters of a supported model, tagged by family (the manifest stores it as
/// `{"deepseek_v3": {...}}`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ModelConfig {
    /// DeepSeek-V3 and Kimi K2 / K2.5 (`model_type` `deepseek_v3`, `kimi_k2`, or a wrapper whose
    /// `text_config` is one of them).
    DeepseekV3(DeepseekV3Config),
    /// Kimi Linear and Kimi K3 (`kimi_linear`, or the `kimi_k3` wrapper whose `text_config` is
    /// `kimi_linear`): KDA + NoPE MLA hybrid; K3 adds attention residuals, LatentMoE and SiTU.
    KimiLinear(KimiLinearConfig),
    /// Qwen3-MoE (`model_type` `qwen3_moe`): GQA with per-head q/k RMSNorm, softmax top-k
    /// routing, dense layers chosen by `decoder_sparse_step` / `mlp_only_layers`.
    Qwen3Moe(Qwen3MoeConfig),
    /// Mixtral (`model_type` `mixtral`): GQA, softmax top-2 routing in every layer,
    /// `block_sparse_moe` tensor names.
    Mixtral(MixtralConfig),
    /// gpt-oss (`model_type` `gpt_oss`): GQA with biases, attention sinks and alternating
    /// sliding/full layers, a biased top-k router with softmax over the chosen experts, clamped
    /// SwiGLU experts with biases, fused over the experts in the checkpoint.
    GptOss(GptOssConfig),
    /// Qwen3-Next (`qwen3_next`) and Qwen3.5-MoE (`qwen3_5_moe`, text model
    /// `qwen3_5_moe_text`): gated DeltaNet linear attention and gated full attention with partial
    /// RoPE, softmax top-k MoE with a sigmoid-gated shared expert.
    Qwen3Next(Qwen3NextConfig),
}

/// `model_type`s accepted by [`ModelConfig::from_value`] (of the text config).
pub const SUPPORTED_MODEL_TYPES: &[&str] = &[
    "deepseek_v3",
    "kimi_k2",
    "kimi_linear",
    "kimi_k3",
    "qwen3_moe",
    "mixtral",
    "gpt_oss",
    "qwen3_next",
    "qwen3_5_moe",
];

/// Most elements of one resident tensor or one routed expert ([`ModelConfig::check_sizes`]):
/// 2^40 (4 TiB as f32).
pub const MAX_TENSOR_ELEMENTS: u128 = 1 << 40;
/// Most bytes of all resident tensors as f32 ([`ModelConfig::check_sizes`]): 2^46 (64 TiB).
pub const MAX_BACKBONE_BYTES: u128 = 1 << 46;
/// Most bytes of the expert pack as f32 ([`ModelConfig::check_sizes`]): 2^52 (4 PiB).
pub const MAX_PACK_BYTES: u128 = 1 << 52;

/// Multimodal / release wrappers (top-level `model_type`) and the text models they hold
/// (`text_config.model_type`).
const WRAPPERS: &[(&str, &[&str])] = &[
    ("kimi_k25", &["deepseek_v3", "kimi_k2"]),
    ("kimi_k3", &["kimi_linear"]),
    ("qwen3_5_moe", &["qwen3_5_moe_text"]),
];

/// `$body` evaluated with `$c` bound to the family config inside `$cfg` (a `ModelConfig`, by
/// reference or mutable reference): the variant list of [`ModelConfig::as_family`] and
/// `as_family_mut`, written once.
macro_rules! each_family {
    ($cfg:expr, $c:ident => $body:expr) => {
        match $cfg {
            ModelConfig::DeepseekV3($c) => $body,
            ModelConfig::KimiLinear($c) => $body,
            ModelConfig::Qwen3Moe($c) => $body,
            ModelConfig::Mixtral($c) => $body,
            ModelConfig::GptOss($c) => $body,
            ModelConfig::Qwen3Next($c) => $body,
        }
    };
}

impl ModelConfig {
    /// Reads and resolves `config.json`, choosing the family from `model_type` (of
    /// `text_config` for multimodal wrappers). Returns the config and the raw JSON.
    ///
    /// Errors: unreadable file, malformed JSON, an unsupported `model_type`, or what the family's
    /// own validation rejects (named field).
    pub fn from_file(path: &Path) -> Result<(Self, Value), FormatError> {
        let raw = read_json(path)?;
        let cfg = Self::from_value(&raw, path)?;
        Ok((cfg, raw))
    }

    /// Resolves a parsed `config.json` (`path` only names the file in errors).
    pub fn from_value(raw: &Value, path: &Path) -> Result<Self, FormatError> {
        let tc = text_config(raw);
        let mt = tc.get("model_type").and_then(Value::as_str).unwrap_or("");
        let top = raw.get("model_type").and_then(Value::as_str).unwrap_or("");
        // Multimodal wrappers name the text model they hold; another one inside is a mix-up.
        if let Some((_, inner)) = WRAPPERS.iter().find(|(w, _)| *w == top) {
            if !inner.contains(&mt) {
                let found = if std::ptr::eq(tc, raw) {
                    "no text_config".to_string()
                } else {
                    format!("text_config.model_type {mt:?}")
                };
                return Err(FormatError::Config {
                    path: path.to_path_buf(),
                    field: "text_config.model_type".into(),
                    message: format!(
                        "model_type {top:?} wraps a text model of type {}, but the file has {found}",
                        inner.join(" or ")
                    ),
                });
            }
        }
        let cfg = match mt {
            "deepseek_v3" | "kimi_k2" => ModelConfig::DeepseekV3(DeepseekV3Config::from_value(raw, path)?),
            "kimi_linear" => ModelConfig::KimiLinear(KimiLinearConfig::from_value(raw, path)?),
            "qwen3_moe" => ModelConfig::Qwen3Moe(Qwen3MoeConfig::from_value(raw, path)?),
            "mixtral" => ModelConfig::Mixtral(MixtralConfig::from_value(raw, path)?),
            "gpt_oss" => ModelConfig::GptOss(GptOssConfig::from_value(raw, path)?),
            "qwen3_next" | "qwen3_5_moe_text" => ModelConfig::Qwen3Next(Qwen3NextConfig::from_value(raw, path)?),
            _ => {
                let shown = if mt.is_empty() { top } else { mt };
                return Err(FormatError::Config {
                    path: path.to_path_buf(),
                    field: "model_type".into(),
                    message: format!(
                        "unsupported model_type {shown:?} (supported: {})",
                        SUPPORTED_MODEL_TYPES.join(", ")
                    ),
                });
            }
        };
        cfg.check_sizes(path)?;
        Ok(cfg)
    }

    /// The family's config behind the [`Family`] trait: the one place that dispatches on the
    /// variant.
    pub fn as_family(&self) -> &dyn Family {
        each_family!(self, c => c)
    }

    fn as_family_mut(&mut self) -> &mut dyn Family {
        each_family!(self, c => c)
    }

    /// What the family's own `validate` checks (field named), plus [`Self::check_sizes`]. For a
    /// config that did not come through [`Self::from_value`] (a manifest's).
    pub fn validate(&self, path: &Path) -> Result<(), FormatError> {
        self.as_family().validate(path)?;
        self.check_sizes(path)
    }

    /// Checks, in 128-bit arithmetic, that the model this config describes has a size one
    /// machine can hold: every resident tensor under [`MAX_TENSOR_ELEMENTS`] and all together
    /// under [`MAX_BACKBONE_BYTES`] as f32, one routed expert under [`MAX_TENSOR_ELEMENTS`],
    /// the expert pack under [`MAX_PACK_BYTES`] as f32, and one layer's recurrent state under
    /// [`MAX_TENSOR_ELEMENTS`]. Callers may then size buffers
    /// from the config with plain 64-bit arithmetic.
    ///
    /// Errors: the first bound exceeded, naming the tensor or the expert count.
    pub fn check_sizes(&self, path: &Path) -> Result<(), FormatError> {
        let too_big = |what: String| FormatError::Checkpoint {
            path: path.to_path_buf(),
            message: format!("{what}: the sizes in this config describe a model larger than deltafin can hold"),
        };
        let mut backbone: u128 = 0;
        for t in self.backbone_tensors() {
            let n: u128 = t.shape.iter().map(|&d| d as u128).product();
            if n > MAX_TENSOR_ELEMENTS {
                return Err(too_big(format!("tensor {} would have shape {:?}", t.name, t.shape)));
            }
            backbone += 4 * n + TENSOR_ALIGN as u128;
        }
        if backbone > MAX_BACKBONE_BYTES {
            return Err(too_big(format!("the resident tensors would take {backbone} bytes")));
        }
        let expert: u128 = self
            .expert_matrices()
            .iter()
            .map(|m| m.rows as u128 * m.cols as u128)
            .sum();
        if expert > MAX_TENSOR_ELEMENTS {
            return Err(too_big(format!("one routed expert would have {expert} weights")));
        }
        // Recurrent state of one linear-attention layer ([heads, d_k, d_v] values).
        let recurrent = self.as_family().recurrent_state_values();
        if recurrent > MAX_TENSOR_ELEMENTS {
            return Err(too_big(format!(
                "one layer's recurrent state would hold {recurrent} values"
            )));
        }
        let records = self.moe_layers().count() as u128 * self.n_routed_experts() as u128;
        if records * (4 * expert + RECORD_ALIGN as u128) > MAX_PACK_BYTES {
            return Err(too_big(format!("{records} routed experts of {expert} weights each")));
        }
        Ok(())
    }

    /// Adapts the choices a config cannot tell to what the checkpoint holds (`has(name)`: the
    /// checkpoint has a tensor of that name): today the routed-expert naming of Qwen3-Next /
    /// Qwen3.5-MoE ([`Qwen3NextConfig::adapt_expert_naming`]). Call it after opening the
    /// checkpoint, before anything reads tensors by name.
    pub fn adapt_to_checkpoint(&mut self, has: impl Fn(&str) -> bool) {
        self.as_family_mut().adapt_to_checkpoint(&has);
    }

    /// Family name (the engine's model file), e.g. `deepseek_v3`.
    pub fn family(&self) -> &'static str {
        self.as_family().family()
    }

    /// `model_type` of the text config (e.g. `kimi_k2` for a Kimi K2 checkpoint).
    pub fn model_type(&self) -> &str {
        self.as_family().model_type()
    }

    /// The Qwen3-Next / Qwen3.5-MoE config, when this is one.
    pub fn as_qwen3_next(&self) -> Option<&Qwen3NextConfig> {
        match self {
            ModelConfig::Qwen3Next(c) => Some(c),
            _ => None,
        }
    }

    /// The Kimi Linear / K3 config, when this is one.
    pub fn as_kimi_linear(&self) -> Option<&KimiLinearConfig> {
        match self {
            ModelConfig::KimiLinear(c) => Some(c),
            _ => None,
        }
    }

    /// The DeepSeek-V3 config, when this is one.
    pub fn as_deepseek_v3(&self) -> Option<&DeepseekV3Config> {
        match self {
            ModelConfig::DeepseekV3(c) => Some(c),
            _ => None,
        }
    }

    /// The Qwen3-MoE config, when this is one.
    pub fn as_qwen3_moe(&self) -> Option<&Qwen3MoeConfig> {
        match self {
            ModelConfig::Qwen3Moe(c) => Some(c),
            _ => None,
        }
    }

    /// The gpt-oss config, when this is one.
    pub fn as_gpt_oss(&self) -> Option<&GptOssConfig> {
        match self {
            ModelConfig::GptOss(c) => Some(c),
            _ => None,
        }
    }

    /// The Mixtral config, when this is one.
    pub fn as_mixtral(&self) -> Option<&MixtralConfig> {
        match self {
            ModelConfig::Mixtral(c) => Some(c),
            _ => None,
        }
    }

    pub fn vocab_size(&self) -> usize {
        self.as_family().vocab_size()
    }

    pub fn hidden_size(&self) -> usize {
        self.as_family().hidden_size()
    }

    pub fn num_hidden_layers(&self) -> usize {
        self.as_family().num_hidden_layers()
    }

    /// Context length in tokens (`max_position_embeddings`).
    pub fn max_position_embeddings(&self) -> usize {
        self.as_family().max_position_embeddings()
    }

    /// The decoder layers (0-based, ascending) that have routed experts.
    pub fn moe_layers(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.num_hidden_layers()).filter(|&l| self.is_moe_layer(l))
    }

    /// Whether decoder layer `layer` (0-based) has routed experts.
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        self.as_family().is_moe_layer(layer)
    }

    /// Routed experts per MoE layer.
    pub fn n_routed_experts(&self) -> usize {
        self.as_family().n_routed_experts()
    }

    /// The model's top-k: routed experts chosen per token.
    pub fn num_experts_per_tok(&self) -> usize {
        self.as_family().num_experts_per_tok()
    }

    /// Most experts per token the router can select (the `--experts-per-token` upper bound),
    /// with the reason when it is below `n_routed_experts`.
    pub fn max_experts_per_tok(&self) -> (usize, String) {
        self.as_family().max_experts_per_tok()
    }

    /// End-of-sequence ids named by `config.json`.
    pub fn eos_token_id(&self) -> &[u32] {
        self.as_family().eos_token_id()
    }

    pub fn bos_token_id(&self) -> Option<u32> {
        self.as_family().bos_token_id()
    }

    /// The resident tensors, in checkpoint order.
    pub fn backbone_tensors(&self) -> Vec<BackboneTensor> {
        self.as_family().backbone_tensors()
    }

    /// The matrices of one routed-expert record, in record order.
    pub fn expert_matrices(&self) -> Vec<ExpertMatrix> {
        self.as_family().expert_matrices()
    }

    /// Where matrix `m` (an entry of [`Self::expert_matrices`]) of routed expert `expert` in
    /// layer `layer` comes from.
    pub fn expert_source(&self, layer: usize, expert: usize, m: &ExpertMatrix) -> ExpertSource {
        self.as_family().expert_source(layer, expert, m)
    }

    /// Checkpoint tensors deliberately not converted (e.g. multi-token-prediction layers,
    /// rotary buffers).
    pub fn is_ignored(&self, name: &str) -> bool {
        self.as_family().is_ignored(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn dispatches_on_model_type_and_round_trips_through_serde() {
        let p = Path::new("config.json");
        let c = ModelConfig::from_value(&json!({"model_type": "kimi_k2", "num_hidden_layers": 2}), p).unwrap();
        assert_eq!(c.family(), "deepseek_v3");
        assert_eq!(c.model_type(), "kimi_k2");
        let s = serde_json::to_value(&c).unwrap();
        assert!(s.get("deepseek_v3").is_some(), "{s}");
        let back: ModelConfig = serde_json::from_value(s).unwrap();
        assert_eq!(back, c);
        for (mt, family) in [
            ("qwen3_moe", "qwen3_moe"),
            ("mixtral", "mixtral"),
            ("gpt_oss", "gpt_oss"),
            ("qwen3_next", "qwen3_next"),
        ] {
            let c = ModelConfig::from_value(&json!({"model_type": mt, "num_hidden_layers": 2}), p).unwrap();
            assert_eq!((c.family(), c.model_type()), (family, mt));
            let back: ModelConfig = serde_json::from_value(serde_json::to_value(&c).unwrap()).unwrap();
            assert_eq!(back, c);
        }
        let e = ModelConfig::from_value(&json!({"model_type": "llama"}), p).unwrap_err();
        assert!(
            e.to_string().contains("model_type") && e.to_string().contains("llama"),
            "{e}"
        );
    }

    /// Every family reads the expert-count spellings of its transformers config class's
    /// `attribute_map` (transformers 5 saves Qwen3-MoE's as `num_local_experts`), also inside a
    /// `text_config`; two spellings that disagree are an error naming both.
    #[test]
    fn transformers_attribute_map_spellings() {
        let p = Path::new("config.json");
        for (mt, alias) in [
            ("qwen3_moe", "num_local_experts"),
            ("qwen3_next", "num_local_experts"),
            ("mixtral", "num_experts"),
            ("gpt_oss", "num_experts"),
            ("deepseek_v3", "num_local_experts"),
            ("kimi_linear", "n_routed_experts"),
            ("kimi_linear", "num_local_experts"),
        ] {
            let mut raw = json!({"model_type": mt, "num_hidden_layers": 2, "num_experts_per_tok": 2,
                "num_experts_per_token": 2, "n_group": 1, "topk_group": 1, "num_expert_group": 1});
            raw[alias] = json!(16);
            let c = ModelConfig::from_value(&raw, p).unwrap_or_else(|e| panic!("{mt} {alias}: {e}"));
            assert_eq!(c.n_routed_experts(), 16, "{mt} {alias}");
            let canonical = match c {
                ModelConfig::DeepseekV3(_) => "n_routed_experts",
                ModelConfig::Mixtral(_) | ModelConfig::GptOss(_) => "num_local_experts",
                _ => "num_experts",
            };
            raw[canonical] = json!(32);
            let e = ModelConfig::from_value(&raw, p).unwrap_err().to_string();
            assert!(
                e.contains(alias) && e.contains(canonical) && e.contains("disagrees"),
                "{e}"
            );
        }
        let raw = json!({"model_type": "kimi_k25", "text_config": {"model_type": "kimi_k2",
            "num_hidden_layers": 2, "num_local_experts": 16, "n_group": 1, "topk_group": 1}});
        assert_eq!(ModelConfig::from_value(&raw, p).unwrap().n_routed_experts(), 16);
    }

    #[test]
    fn a_wrapper_must_hold_its_own_text_model() {
        let p = Path::new("config.json");
        let e = ModelConfig::from_value(&json!({"model_type": "qwen3_5_moe", "num_hidden_layers": 2}), p)
            .unwrap_err()
            .to_string();
        assert!(e.contains("qwen3_5_moe_text") && e.contains("no text_config"), "{e}");
        let e = ModelConfig::from_value(
            &json!({"model_type": "kimi_k3", "text_config": {"model_type": "qwen3_5_moe_text"}}),
            p,
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("text_config.model_type") && e.contains("kimi_linear") && e.contains("qwen3_5_moe_text"),
            "{e}"
        );
        let c = ModelConfig::from_value(
            &json!({"model_type": "kimi_k25", "text_config": {"model_type": "kimi_k2", "num_hidden_layers": 2}}),
            p,
        )
        .unwrap();
        assert_eq!(c.family(), "deepseek_v3");
    }
}
