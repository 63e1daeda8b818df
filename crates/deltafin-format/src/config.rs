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

use crate::arch::{BackboneTensor, ExpertMatrix, TensorRole};
use crate::FormatError;

/// RoPE frequency scheme, resolved from either `rope_scaling` + `rope_theta` (transformers 4.x
/// spelling) or `rope_parameters` (transformers 5 spelling).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "rope_type", rename_all = "snake_case")]
pub enum Rope {
    /// Plain RoPE: `inv_freq[i] = theta^(-2i/dim)`.
    Default { theta: f64 },
    /// YaRN (Peng et al. 2023, arXiv:2309.00071) as transformers' `_compute_yarn_parameters`.
    Yarn {
        theta: f64,
        /// Context extension factor.
        factor: f64,
        /// Pre-extension context length in tokens.
        original_max_position_embeddings: f64,
        beta_fast: f64,
        beta_slow: f64,
        /// `mscale` of the YaRN attention factor (None when the config omits it or sets 0).
        mscale: Option<f64>,
        /// `mscale_all_dim`: also scales the MLA softmax by `yarn_mscale(factor, mscale_all_dim)^2`.
        mscale_all_dim: Option<f64>,
        /// Explicit cos/sin multiplier, when the config sets `attention_factor`.
        attention_factor: Option<f64>,
        /// Whether the correction range is rounded to whole dimensions (`truncate`, default true).
        truncate: bool,
    },
}

/// Concrete hyperparameters of a DeepSeek-V3 / Kimi K2 text model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeepseekV3Config {
    /// `model_type` of the text config (`deepseek_v3` or `kimi_k2`).
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// Intermediate width of the dense MLP layers (below `first_k_dense_replace`).
    pub intermediate_size: usize,
    /// Intermediate width of one routed expert; shared experts use `n_shared_experts ×` this.
    pub moe_intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
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

pub(crate) fn get<'a>(obj: &'a Value, key: &str) -> Option<&'a Value> {
    obj.get(key).filter(|v| !v.is_null())
}

pub(crate) fn field_err(path: &Path, field: &str, msg: impl Into<String>) -> FormatError {
    FormatError::Config {
        path: path.to_path_buf(),
        field: field.to_string(),
        message: msg.into(),
    }
}

/// Most decoder layers a config may name (the largest released MoE models have under 100).
/// Tables of per-layer tensors are built from this count before any checkpoint is read, so it
/// is bounded here: `num_hidden_layers` 10^7 would otherwise build gigabytes of tensor names.
pub const MAX_LAYERS: u64 = 1 << 12;
/// Most routed experts per layer (and experts per token) a config may name (released models
/// have at most 512); record indices are `u32`.
pub const MAX_EXPERTS: u64 = 1 << 16;
/// Most tokens of context a config may name (`max_position_embeddings` and kin).
pub const MAX_POSITIONS: u64 = 1 << 32;
/// Bound of every other count or width in a config (vocabulary, hidden and intermediate sizes,
/// heads, head widths, ranks): 2^20, far above any released model, and small enough that
/// products of two or three of them cannot overflow 64-bit arithmetic.
pub const MAX_DIM: u64 = 1 << 20;

/// The bound [`usize_or`] applies to integer field `key` (see [`MAX_LAYERS`], [`MAX_EXPERTS`],
/// [`MAX_POSITIONS`], [`MAX_DIM`]).
pub(crate) fn int_bound(key: &str) -> u64 {
    match key {
        "num_hidden_layers" => MAX_LAYERS,
        "max_position_embeddings" | "model_max_length" | "sliding_window" => MAX_POSITIONS,
        k if k.contains("experts") => MAX_EXPERTS,
        _ => MAX_DIM,
    }
}

/// Integer field `key` of `obj` (absent or null: `default`), at most its bound ([`int_bound`]),
/// so that nothing sized from a config can exhaust memory or overflow.
///
/// Errors: not a non-negative integer, or above the bound (field named).
pub(crate) fn usize_or(obj: &Value, path: &Path, key: &str, default: usize) -> Result<usize, FormatError> {
    match get(obj, key) {
        None => Ok(default),
        Some(v) => {
            let x = v
                .as_u64()
                .ok_or_else(|| field_err(path, key, format!("expected a non-negative integer, got {v}")))?;
            let bound = int_bound(key);
            if x > bound {
                return Err(field_err(
                    path,
                    key,
                    format!("{x} is larger than this implementation supports (at most {bound})"),
                ));
            }
            Ok(x as usize)
        }
    }
}

pub(crate) fn f64_or(obj: &Value, path: &Path, key: &str, default: f64) -> Result<f64, FormatError> {
    match get(obj, key) {
        None => Ok(default),
        Some(v) => v
            .as_f64()
            .ok_or_else(|| field_err(path, key, format!("expected a number, got {v}"))),
    }
}

/// Which values of a real-valued config field make sense.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Range {
    /// Any finite value.
    Finite,
    /// Finite and > 0 (RoPE `theta`, `factor`, scaling factors).
    Positive,
    /// Finite and >= 0 (`rms_norm_eps`).
    NonNegative,
}

/// Checks that `x` (field `key`) lies in `range` and stays finite as an `f32` (the engine
/// computes in f32: 1e39 would become infinity, and JSON `null` in the manifest).
///
/// Errors: outside the range (field named, with the value).
pub(crate) fn check_range(path: &Path, key: &str, x: f64, range: Range) -> Result<f64, FormatError> {
    let ok = x.is_finite()
        && (x as f32).is_finite()
        && match range {
            Range::Finite => true,
            Range::Positive => x > 0.0,
            Range::NonNegative => x >= 0.0,
        };
    if ok {
        return Ok(x);
    }
    let want = match range {
        Range::Finite => "a finite number",
        Range::Positive => "a finite number greater than 0",
        Range::NonNegative => "a finite number of at least 0",
    };
    Err(field_err(
        path,
        key,
        format!("{x} is out of range: expected {want} (within f32 range)"),
    ))
}

/// A real-valued field as `f32` (absent or null: `default`), checked against `range`.
///
/// Errors: not a number, or outside `range` ([`check_range`]); the field is named.
pub(crate) fn f32_in(obj: &Value, path: &Path, key: &str, default: f64, range: Range) -> Result<f32, FormatError> {
    let x = f64_or(obj, path, key, default)?;
    Ok(check_range(path, key, x, range)? as f32)
}

pub(crate) fn opt_f64(obj: &Value, path: &Path, key: &str) -> Result<Option<f64>, FormatError> {
    match get(obj, key) {
        None => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| field_err(path, key, format!("expected a number, got {v}"))),
    }
}

/// Spellings transformers accepts for one field: `attribute_map` entries of a config class
/// (`alias` read as `canonical`). [TRANSFORMERS_ATTRIBUTE_MAP]
pub(crate) type Aliases = &'static [(&'static str, &'static str)];

/// Returns `raw` with the text config's aliased fields ([`Aliases`]) stored under the name this
/// crate reads, as transformers' `PreTrainedConfig` does when it reads an `attribute_map`
/// key; `raw` itself when no alias is present.
///
/// Errors: both spellings present with different values (both named).
pub(crate) fn resolve_aliases<'a>(
    raw: &'a Value,
    path: &Path,
    aliases: Aliases,
) -> Result<std::borrow::Cow<'a, Value>, FormatError> {
    let tc = text_config(raw);
    if !aliases.iter().any(|(a, _)| get(tc, a).is_some()) {
        return Ok(std::borrow::Cow::Borrowed(raw));
    }
    let nested = !std::ptr::eq(tc, raw);
    let mut out = raw.clone();
    let obj = if nested { &mut out["text_config"] } else { &mut out };
    for (alias, canonical) in aliases {
        let Some(v) = get(tc, alias) else { continue };
        match get(tc, canonical) {
            Some(c) if c != v => {
                return Err(field_err(
                    path,
                    alias,
                    format!("{v} disagrees with {canonical} {c} (transformers reads both as {canonical})"),
                ))
            }
            Some(_) => {}
            None => obj[*canonical] = v.clone(),
        }
    }
    Ok(std::borrow::Cow::Owned(out))
}

pub(crate) fn bool_or(obj: &Value, path: &Path, key: &str, default: bool) -> Result<bool, FormatError> {
    match get(obj, key) {
        None => Ok(default),
        Some(v) => v
            .as_bool()
            .ok_or_else(|| field_err(path, key, format!("expected true or false, got {v}"))),
    }
}

/// Reads `eos_token_id`-style fields: an integer or a list of integers.
pub fn token_ids(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a.iter().filter_map(|x| x.as_u64()).map(|x| x as u32).collect(),
        _ => Vec::new(),
    }
}

/// `DeepseekV3Config.attribute_map`: `num_local_experts` is read as `n_routed_experts`.
/// [TRANSFORMERS_ATTRIBUTE_MAP]
const DEEPSEEK_V3_ALIASES: Aliases = &[("num_local_experts", "n_routed_experts")];

/// The text-model types of this family.
pub const MODEL_TYPES: &[&str] = &["deepseek_v3", "kimi_k2"];

/// Returns the text config object of a `config.json`: the top level, or its `text_config` when
/// the top level is a multimodal wrapper (e.g. `kimi_k25`).
pub fn text_config(raw: &Value) -> &Value {
    match get(raw, "text_config") {
        Some(tc) if tc.is_object() => tc,
        _ => raw,
    }
}

/// End-of-sequence ids of a text config `tc` (plus those of the wrapper `raw` when `tc` is
/// nested), and its begin-of-sequence id.
pub(crate) fn eos_bos(tc: &Value, raw: &Value) -> (Vec<u32>, Option<u32>) {
    let mut eos = token_ids(get(tc, "eos_token_id"));
    if !std::ptr::eq(tc, raw) {
        for id in token_ids(get(raw, "eos_token_id")) {
            if !eos.contains(&id) {
                eos.push(id);
            }
        }
    }
    let bos = get(tc, "bos_token_id")
        .or_else(|| get(raw, "bos_token_id"))
        .and_then(|v| v.as_u64())
        .map(|x| x as u32);
    (eos, bos)
}

/// Fails with the field named unless `hidden_act` (of `tc`) is absent or `silu`.
pub(crate) fn require_silu(tc: &Value, path: &Path) -> Result<(), FormatError> {
    match get(tc, "hidden_act").and_then(|v| v.as_str()) {
        Some(s) if s != "silu" => Err(field_err(
            path,
            "hidden_act",
            format!("{s:?} is not supported (only \"silu\")"),
        )),
        _ => Ok(()),
    }
}

impl DeepseekV3Config {
    /// Reads and resolves `config.json`.
    ///
    /// Errors: unreadable file, malformed JSON, unknown `model_type`, a field of the wrong type,
    /// or a setting this implementation does not support (`scoring_func` other than `sigmoid`,
    /// `topk_method` other than `noaux_tc`, `hidden_act` other than `silu`, a RoPE type other than
    /// `default`/`yarn`, inconsistent expert grouping).
    pub fn from_file(path: &Path) -> Result<(Self, Value), FormatError> {
        let text = deltafin_fs::read_to_string(path).map_err(|e| FormatError::Io {
            path: path.to_path_buf(),
            error: e,
        })?;
        let raw: Value = serde_json::from_str(&text).map_err(|e| FormatError::Json {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        let cfg = Self::from_value(&raw, path)?;
        Ok((cfg, raw))
    }

    /// Resolves a parsed `config.json` (`path` is only used in error messages).
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
        if let Some(s) = get(tc, "scoring_func").and_then(|v| v.as_str()) {
            if s != "sigmoid" {
                return Err(field_err(
                    path,
                    "scoring_func",
                    format!("{s:?} is not supported (only \"sigmoid\")"),
                ));
            }
        }
        if let Some(s) = get(tc, "topk_method").and_then(|v| v.as_str()) {
            if s != "noaux_tc" {
                return Err(field_err(
                    path,
                    "topk_method",
                    format!("{s:?} is not supported (only \"noaux_tc\")"),
                ));
            }
        }
        if let Some(s) = get(tc, "hidden_act").and_then(|v| v.as_str()) {
            if s != "silu" {
                return Err(field_err(
                    path,
                    "hidden_act",
                    format!("{s:?} is not supported (only \"silu\")"),
                ));
            }
        }
        // q_lora_rank: an explicit null means "no query compression"; an omitted key takes the
        // transformers default (1536), as DeepseekV3Config does.
        let q_lora_rank = match tc.get("q_lora_rank") {
            Some(Value::Null) => None,
            None => Some(1536),
            Some(_) => Some(usize_or(tc, path, "q_lora_rank", 0)?),
        };
        let max_position_embeddings = usize_or(tc, path, "max_position_embeddings", 4096)?;
        let rope = resolve_rope(tc, path, max_position_embeddings, 10000.0)?;
        let mut eos = token_ids(get(tc, "eos_token_id"));
        if !std::ptr::eq(tc, raw) {
            for id in token_ids(get(raw, "eos_token_id")) {
                if !eos.contains(&id) {
                    eos.push(id);
                }
            }
        }
        let bos = get(tc, "bos_token_id")
            .or_else(|| get(raw, "bos_token_id"))
            .and_then(|v| v.as_u64())
            .map(|x| x as u32);
        let cfg = DeepseekV3Config {
            model_type,
            vocab_size: usize_or(tc, path, "vocab_size", 129280)?,
            hidden_size: usize_or(tc, path, "hidden_size", 7168)?,
            intermediate_size: usize_or(tc, path, "intermediate_size", 18432)?,
            moe_intermediate_size: usize_or(tc, path, "moe_intermediate_size", 2048)?,
            num_hidden_layers: usize_or(tc, path, "num_hidden_layers", 61)?,
            num_attention_heads: usize_or(tc, path, "num_attention_heads", 128)?,
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
        let nonzero = [
            ("vocab_size", self.vocab_size),
            ("max_position_embeddings", self.max_position_embeddings),
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("kv_lora_rank", self.kv_lora_rank),
            ("v_head_dim", self.v_head_dim),
            ("n_group", self.n_group),
            ("topk_group", self.topk_group),
        ];
        for (k, v) in nonzero {
            if v == 0 {
                return Err(field_err(path, k, "must be greater than 0"));
            }
        }
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
            if self.num_experts_per_tok > self.topk_group * (self.n_routed_experts / self.n_group) {
                return Err(field_err(
                    path,
                    "num_experts_per_tok",
                    "more experts per token than the chosen groups hold",
                ));
            }
            if self.n_group > 1 && self.n_routed_experts / self.n_group < 2 {
                return Err(field_err(
                    path,
                    "n_group",
                    "groups need at least 2 experts (group score = sum of top-2)",
                ));
            }
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

    /// The backbone tensors of a DeepSeek-V3 checkpoint with their shapes, in checkpoint order.
    pub fn backbone_tensors(&self) -> Vec<BackboneTensor> {
        let c = self;
        let h = c.hidden_size;
        let nh = c.num_attention_heads;
        let mut t = vec![(
            "model.embed_tokens.weight".to_string(),
            vec![c.vocab_size, h],
            TensorRole::Matrix,
        )];
        for l in 0..c.num_hidden_layers {
            let p = format!("model.layers.{l}");
            t.push((format!("{p}.input_layernorm.weight"), vec![h], TensorRole::F32));
            t.push((format!("{p}.post_attention_layernorm.weight"), vec![h], TensorRole::F32));
            let a = format!("{p}.self_attn");
            match c.q_lora_rank {
                Some(r) => {
                    t.push((format!("{a}.q_a_proj.weight"), vec![r, h], TensorRole::Matrix));
                    t.push((format!("{a}.q_a_layernorm.weight"), vec![r], TensorRole::F32));
                    t.push((
                        format!("{a}.q_b_proj.weight"),
                        vec![nh * c.qk_head_dim(), r],
                        TensorRole::Matrix,
                    ));
                }
                None => t.push((
                    format!("{a}.q_proj.weight"),
                    vec![nh * c.qk_head_dim(), h],
                    TensorRole::Matrix,
                )),
            }
            t.push((
                format!("{a}.kv_a_proj_with_mqa.weight"),
                vec![c.kv_lora_rank + c.qk_rope_head_dim, h],
                TensorRole::Matrix,
            ));
            t.push((
                format!("{a}.kv_a_layernorm.weight"),
                vec![c.kv_lora_rank],
                TensorRole::F32,
            ));
            t.push((
                format!("{a}.kv_b_proj.weight"),
                vec![nh * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank],
                TensorRole::Matrix,
            ));
            t.push((
                format!("{a}.o_proj.weight"),
                vec![h, nh * c.v_head_dim],
                TensorRole::Matrix,
            ));
            let m = format!("{p}.mlp");
            if c.is_moe_layer(l) {
                t.push((format!("{m}.gate.weight"), vec![c.n_routed_experts, h], TensorRole::F32));
                t.push((
                    format!("{m}.gate.e_score_correction_bias"),
                    vec![c.n_routed_experts],
                    TensorRole::F32,
                ));
                if c.n_shared_experts > 0 {
                    let si = c.moe_intermediate_size * c.n_shared_experts;
                    t.push((
                        format!("{m}.shared_experts.gate_proj.weight"),
                        vec![si, h],
                        TensorRole::Matrix,
                    ));
                    t.push((
                        format!("{m}.shared_experts.up_proj.weight"),
                        vec![si, h],
                        TensorRole::Matrix,
                    ));
                    t.push((
                        format!("{m}.shared_experts.down_proj.weight"),
                        vec![h, si],
                        TensorRole::Matrix,
                    ));
                }
            } else {
                let i = c.intermediate_size;
                t.push((format!("{m}.gate_proj.weight"), vec![i, h], TensorRole::Matrix));
                t.push((format!("{m}.up_proj.weight"), vec![i, h], TensorRole::Matrix));
                t.push((format!("{m}.down_proj.weight"), vec![h, i], TensorRole::Matrix));
            }
        }
        t.push(("model.norm.weight".to_string(), vec![h], TensorRole::F32));
        t.push(("lm_head.weight".to_string(), vec![c.vocab_size, h], TensorRole::Matrix));
        t.into_iter()
            .map(|(name, shape, role)| BackboneTensor { name, shape, role })
            .collect()
    }

    /// The three matrices of one routed expert (`y = W x`), as named in the checkpoint.
    pub fn expert_matrices(&self) -> Vec<ExpertMatrix> {
        let (h, i) = (self.hidden_size, self.moe_intermediate_size);
        crate::arch::glu_expert_matrices(["gate_proj", "up_proj", "down_proj"], h, i)
    }

    /// Names the converter deliberately skips: MTP layers (index ≥ num_hidden_layers) and rotary
    /// frequency buffers.
    pub fn is_ignored(&self, name: &str) -> bool {
        if name.ends_with("rotary_emb.inv_freq") {
            return true;
        }
        if let Some(rest) = name.strip_prefix("model.layers.") {
            if let Some(idx) = rest.split('.').next().and_then(|s| s.parse::<usize>().ok()) {
                return idx >= self.num_hidden_layers;
            }
        }
        false
    }
}

/// Resolves the RoPE scheme of a text config: `rope_parameters` (transformers 5) or
/// `rope_scaling` + `rope_theta` (4.x); `default_theta` is the family's `default_theta` for a
/// config that names no theta.
///
/// Errors: a non-numeric field, a RoPE type other than `default`/`yarn` (field named).
pub(crate) fn resolve_rope(tc: &Value, path: &Path, max_pos: usize, default_theta: f64) -> Result<Rope, FormatError> {
    // transformers 5 writes `rope_parameters` (holding rope_theta); 4.x writes `rope_scaling`
    // plus a top-level `rope_theta`. Either may be absent.
    // Either key holding something other than an object (`"rope_scaling": "x"`) is an error,
    // not "no scaling": the model would silently run with another RoPE.
    for key in ["rope_parameters", "rope_scaling"] {
        if let Some(v) = get(tc, key).filter(|v| !v.is_object()) {
            return Err(field_err(path, key, format!("expected an object or null, got {v}")));
        }
    }
    let params = get(tc, "rope_parameters").or_else(|| get(tc, "rope_scaling"));
    let top_theta = check_range(
        path,
        "rope_theta",
        f64_or(tc, path, "rope_theta", default_theta)?,
        Range::Positive,
    )?;
    let Some(p) = params else {
        return Ok(Rope::Default { theta: top_theta });
    };
    let field = if get(tc, "rope_parameters").is_some() {
        "rope_parameters"
    } else {
        "rope_scaling"
    };
    // A sub-field's value checked against `range`, named `field.key` in errors.
    let sub = |key: &str, x: f64, range: Range| check_range(path, &format!("{field}.{key}"), x, range);
    let theta = sub("rope_theta", f64_or(p, path, "rope_theta", top_theta)?, Range::Positive)?;
    let kind = get(p, "rope_type")
        .or_else(|| get(p, "type"))
        .and_then(|v| v.as_str())
        .unwrap_or("default");
    match kind {
        "default" => Ok(Rope::Default { theta }),
        "yarn" => {
            let original = sub(
                "original_max_position_embeddings",
                f64_or(p, path, "original_max_position_embeddings", max_pos as f64)?,
                Range::Positive,
            )?;
            let factor = match opt_f64(p, path, "factor")? {
                Some(f) => f,
                None => max_pos as f64 / original,
            };
            let factor = sub("factor", factor, Range::Positive)?;
            let nonzero = |x: Option<f64>| x.filter(|v| *v != 0.0);
            let opt = |key: &str, range: Range| -> Result<Option<f64>, FormatError> {
                opt_f64(p, path, key)?.map(|x| sub(key, x, range)).transpose()
            };
            Ok(Rope::Yarn {
                theta,
                factor,
                original_max_position_embeddings: original,
                beta_fast: nonzero(opt("beta_fast", Range::Finite)?).unwrap_or(32.0),
                beta_slow: nonzero(opt("beta_slow", Range::Finite)?).unwrap_or(1.0),
                mscale: nonzero(opt("mscale", Range::Finite)?),
                mscale_all_dim: nonzero(opt("mscale_all_dim", Range::Finite)?),
                attention_factor: opt("attention_factor", Range::Positive)?,
                truncate: bool_or(p, path, "truncate", true)?,
            })
        }
        other => Err(field_err(
            path,
            &format!("{field}.rope_type"),
            format!("RoPE type {other:?} is not supported (supported: default, yarn)"),
        )),
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
