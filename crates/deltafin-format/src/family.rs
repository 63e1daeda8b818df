//! What a model family is to the format crate: the [`Family`] trait that each family's config
//! implements in its own file (`deepseek_v3.rs`, `kimi_linear.rs`, `qwen3_moe.rs`, `mixtral.rs`,
//! `gpt_oss.rs`, `qwen3_next.rs`), and the vocabulary of its tensor tables: the resident
//! backbone tensors with their shapes and storage role, the matrices of one routed-expert
//! record, and where each comes from in the checkpoint. [`crate::arch::ModelConfig`] holds one
//! family's config and answers through this trait.
//!
//! Also what several families share, so that each family file says only what is specific to
//! it: the table builders (`decoder_backbone`, GQA and MLA attention, gated MLPs, the sigmoid
//! router and shared experts of DeepSeek-V3 and Kimi, GLU experts), the checks of GQA heads,
//! top-k, group-limited routing and dense layers, and `family_items!`, the `impl Family` items
//! every family answers alike.

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::json::{field_err, usize_or};
use crate::FormatError;

/// One model family's resolved config: its hyperparameters and its tensor tables. Implemented
/// once per family, next to that family's `from_value` and `validate`.
pub trait Family {
    /// Family name (the engine's model file), e.g. `deepseek_v3`.
    fn family(&self) -> &'static str;
    /// `model_type` of the text config (e.g. `kimi_k2` for a Kimi K2 checkpoint).
    fn model_type(&self) -> &str;
    /// The family's own checks of a resolved config (field named in the error).
    fn validate(&self, path: &Path) -> Result<(), FormatError>;
    /// Vocabulary size (rows of the embedding and the LM head).
    fn vocab_size(&self) -> usize;
    /// Width of the residual stream.
    fn hidden_size(&self) -> usize;
    /// Decoder layers.
    fn num_hidden_layers(&self) -> usize;
    /// Context length in tokens (`max_position_embeddings`).
    fn max_position_embeddings(&self) -> usize;
    /// Whether decoder layer `layer` (0-based) has routed experts.
    fn is_moe_layer(&self, layer: usize) -> bool;
    /// Routed experts per MoE layer.
    fn n_routed_experts(&self) -> usize;
    /// The model's top-k: routed experts chosen per token.
    fn num_experts_per_tok(&self) -> usize;
    /// Most experts per token the router can select, with the reason when it is below
    /// [`Self::n_routed_experts`].
    fn max_experts_per_tok(&self) -> (usize, String) {
        (self.n_routed_experts(), "routed experts per MoE layer".into())
    }
    /// End-of-sequence ids named by `config.json`.
    fn eos_token_id(&self) -> &[u32];
    /// Begin-of-sequence id named by `config.json`.
    fn bos_token_id(&self) -> Option<u32>;
    /// The resident tensors, in checkpoint order.
    fn backbone_tensors(&self) -> Vec<BackboneTensor>;
    /// The matrices of one routed-expert record, in record order.
    fn expert_matrices(&self) -> Vec<ExpertMatrix>;
    /// Where matrix `m` (an entry of [`Self::expert_matrices`]) of routed expert `expert` in
    /// layer `layer` comes from in the checkpoint. By default transformers' layout of one
    /// tensor per expert and matrix under the layer's `mlp` block,
    /// `model.layers.{layer}.mlp.experts.{expert}.{m.name}.weight` ([`per_expert`]).
    fn expert_source(&self, layer: usize, expert: usize, m: &ExpertMatrix) -> ExpertSource {
        per_expert(&format!("model.layers.{layer}.mlp"), expert, m)
    }
    /// Checkpoint tensors deliberately not converted (e.g. multi-token-prediction layers,
    /// rotary buffers). By default the rotary frequency buffers (`…rotary_emb.inv_freq`).
    fn is_ignored(&self, name: &str) -> bool {
        name.ends_with("rotary_emb.inv_freq")
    }
    /// Values of one linear-attention layer's recurrent state (`[heads, d_k, d_v]`), 0 for a
    /// family without one; bounded by [`crate::arch::ModelConfig::check_sizes`].
    fn recurrent_state_values(&self) -> u128 {
        0
    }
    /// Adapts what a config cannot tell to what the checkpoint holds (`has(name)`: the
    /// checkpoint has a tensor of that name). Nothing for most families.
    fn adapt_to_checkpoint(&mut self, _has: &dyn Fn(&str) -> bool) {}
}

/// An expert matrix stored whole under `tensor` as `[m.rows, m.cols]`.
pub(crate) fn whole(tensor: String, m: &ExpertMatrix) -> ExpertSource {
    ExpertSource {
        tensor,
        shape: vec![m.rows, m.cols],
        select: Select::Whole,
    }
}

/// Expert matrix `m` of routed expert `expert` stored whole, one tensor per expert and matrix,
/// under the MoE block `block` (`model.layers.{l}.mlp`): `{block}.experts.{expert}.{m.name}.weight`.
pub(crate) fn per_expert(block: &str, expert: usize, m: &ExpertMatrix) -> ExpertSource {
    whole(format!("{block}.experts.{expert}.{}.weight", m.name), m)
}

/// Slice `expert` of `tensor`, fused over the experts with full shape `shape`, read as stored
/// (`transposed`: read as `[cols, rows]`, see [`Select::Expert`]).
pub(crate) fn fused(tensor: String, shape: Vec<usize>, expert: usize, transposed: bool) -> ExpertSource {
    ExpertSource {
        tensor,
        shape,
        select: Select::Expert {
            index: expert,
            transposed,
        },
    }
}

/// How a backbone tensor is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorRole {
    /// Always f32 whatever `--backbone` says (norms, routers, biases, small vectors).
    F32,
    /// A 2-D matrix stored in the backbone dtype (int8 by default).
    Matrix,
}

/// One resident tensor: checkpoint name, shape as in the checkpoint, storage role.
#[derive(Debug, Clone, PartialEq)]
pub struct BackboneTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub role: TensorRole,
}

/// One matrix of a routed-expert record: record-local name (`gate_proj`, `up_proj`, `down_proj`
/// as in the checkpoint) and shape `[rows, cols]` (`y = W x` with `x: [cols]`; a bias vector is
/// `[1, n]`).
#[derive(Debug, Clone, PartialEq)]
pub struct ExpertMatrix {
    pub name: String,
    pub rows: usize,
    pub cols: usize,
    /// [`TensorRole::Matrix`]: stored in the `--experts` dtype (MXFP4 by default);
    /// [`TensorRole::F32`]: always f32 (gpt-oss expert biases).
    pub role: TensorRole,
}

/// Where one expert matrix comes from in the checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct ExpertSource {
    /// Checkpoint tensor name.
    pub tensor: String,
    /// Its full shape in the checkpoint.
    pub shape: Vec<usize>,
    /// Which part of it is this expert's matrix.
    pub select: Select,
}

/// Part of a checkpoint tensor that forms one expert matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Select {
    /// The whole tensor, `[rows, cols]`.
    Whole,
    /// Slice `index` along dimension 0 of a tensor fused over the experts (`[n_experts, ..]`,
    /// gpt-oss): the slice holds the `rows * cols` values as `[rows, cols]`, or as
    /// `[cols, rows]` when `transposed` (transformers' `x @ W` layout, read transposed).
    Expert { index: usize, transposed: bool },
}

/// Backbone tensors from `(name, shape, role)` triples, in order.
pub(crate) fn tensors(t: impl IntoIterator<Item = (String, Vec<usize>, TensorRole)>) -> Vec<BackboneTensor> {
    t.into_iter()
        .map(|(name, shape, role)| BackboneTensor { name, shape, role })
        .collect()
}

/// The resident tensors of a decoder whose text-model tensors are named under `prefix`
/// (`model`, or `model.language_model`), in checkpoint order: `{prefix}.embed_tokens.weight
/// [vocab, hidden]`; per layer `l`, under `{prefix}.layers.{l}`, the two RMSNorm weights
/// (`input_layernorm`, `post_attention_layernorm`, `[hidden]`) followed by `layer(l, p)` (the
/// family's own tensors, `p` the layer's prefix); `{prefix}.norm.weight [hidden]` and the
/// untied `lm_head.weight [vocab, hidden]` last.
pub(crate) fn decoder_backbone(
    prefix: &str,
    vocab: usize,
    hidden: usize,
    n_layers: usize,
    mut layer: impl FnMut(usize, &str) -> Vec<BackboneTensor>,
) -> Vec<BackboneTensor> {
    let (v, h) = (vocab, hidden);
    let mut t = tensors([(format!("{prefix}.embed_tokens.weight"), vec![v, h], TensorRole::Matrix)]);
    for l in 0..n_layers {
        let p = format!("{prefix}.layers.{l}");
        t.extend(tensors([
            (format!("{p}.input_layernorm.weight"), vec![h], TensorRole::F32),
            (format!("{p}.post_attention_layernorm.weight"), vec![h], TensorRole::F32),
        ]));
        t.extend(layer(l, &p));
    }
    t.extend(tensors([
        (format!("{prefix}.norm.weight"), vec![h], TensorRole::F32),
        ("lm_head.weight".to_string(), vec![v, h], TensorRole::Matrix),
    ]));
    t
}

/// The attention tensors of one grouped-query-attention decoder layer under `prefix`
/// (`model.layers.{l}`): `q_proj [n_heads * head_dim, hidden]`, `k_proj`/`v_proj [n_kv_heads *
/// head_dim, hidden]`, `o_proj [hidden, n_heads * head_dim]`, and with `qk_norm` the per-head
/// `q_norm`/`k_norm [head_dim]` (Qwen3).
pub(crate) fn gqa_attention_tensors(
    prefix: &str,
    hidden: usize,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    qk_norm: bool,
) -> Vec<BackboneTensor> {
    let a = format!("{prefix}.self_attn");
    let mut t = tensors([
        (
            format!("{a}.q_proj.weight"),
            vec![n_heads * head_dim, hidden],
            TensorRole::Matrix,
        ),
        (
            format!("{a}.k_proj.weight"),
            vec![n_kv_heads * head_dim, hidden],
            TensorRole::Matrix,
        ),
        (
            format!("{a}.v_proj.weight"),
            vec![n_kv_heads * head_dim, hidden],
            TensorRole::Matrix,
        ),
        (
            format!("{a}.o_proj.weight"),
            vec![hidden, n_heads * head_dim],
            TensorRole::Matrix,
        ),
    ]);
    if qk_norm {
        t.extend(tensors([
            (format!("{a}.q_norm.weight"), vec![head_dim], TensorRole::F32),
            (format!("{a}.k_norm.weight"), vec![head_dim], TensorRole::F32),
        ]));
    }
    t
}

/// The three matrices of a gated MLP under `prefix` (`model.layers.{l}.mlp`, or a shared
/// expert's): `gate_proj`, `up_proj [inter, hidden]`, `down_proj [hidden, inter]`, all stored in
/// the backbone dtype.
pub(crate) fn glu_mlp_tensors(prefix: &str, hidden: usize, inter: usize) -> Vec<BackboneTensor> {
    let (h, i) = (hidden, inter);
    tensors([
        (format!("{prefix}.gate_proj.weight"), vec![i, h], TensorRole::Matrix),
        (format!("{prefix}.up_proj.weight"), vec![i, h], TensorRole::Matrix),
        (format!("{prefix}.down_proj.weight"), vec![h, i], TensorRole::Matrix),
    ])
}

/// The sizes that DeepSeek-V3, Kimi Linear and Qwen3-MoE configs name alike and in the same
/// order: a decoder whose layers are dense or MoE. Each family config holds them as its field
/// `sizes`, flattened, so that the manifest stores the keys where the family's own fields stood
/// (after `model_type`, when the family has one), and reads them through `Deref`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MoeDecoderSizes {
    /// Rows of the embedding and the LM head.
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Intermediate width of the dense MLP layers (which layers are dense is the family's
    /// rule: `first_k_dense_replace`, or `mlp_only_layers` and `decoder_sparse_step`).
    pub intermediate_size: usize,
    /// Intermediate width of one routed expert (DeepSeek-V3's and Kimi's shared experts are
    /// a multiple of it).
    pub moe_intermediate_size: usize,
    pub num_hidden_layers: usize,
    /// Attention heads (MLA heads in DeepSeek-V3 and Kimi, query heads in Qwen3-MoE).
    pub num_attention_heads: usize,
}

impl MoeDecoderSizes {
    /// Reads the six sizes from text config `tc` in field order, each absent or null one taking
    /// the family's transformers default from `defaults`.
    ///
    /// Errors: as [`usize_or`] (the first bad field, named).
    pub(crate) fn read(tc: &Value, path: &Path, defaults: &MoeDecoderSizes) -> Result<Self, FormatError> {
        Ok(MoeDecoderSizes {
            vocab_size: usize_or(tc, path, "vocab_size", defaults.vocab_size)?,
            hidden_size: usize_or(tc, path, "hidden_size", defaults.hidden_size)?,
            intermediate_size: usize_or(tc, path, "intermediate_size", defaults.intermediate_size)?,
            moe_intermediate_size: usize_or(tc, path, "moe_intermediate_size", defaults.moe_intermediate_size)?,
            num_hidden_layers: usize_or(tc, path, "num_hidden_layers", defaults.num_hidden_layers)?,
            num_attention_heads: usize_or(tc, path, "num_attention_heads", defaults.num_attention_heads)?,
        })
    }
}

/// `impl Deref<Target = MoeDecoderSizes>` for a family config holding them as field `sizes`, so
/// that `cfg.hidden_size` reads as it did when the sizes were the config's own fields.
macro_rules! deref_to_sizes {
    ($config:ty) => {
        impl std::ops::Deref for $config {
            type Target = crate::family::MoeDecoderSizes;

            fn deref(&self) -> &crate::family::MoeDecoderSizes {
                &self.sizes
            }
        }
    };
}
pub(crate) use deref_to_sizes;

/// Widths of multi-head latent attention (DeepSeek-V3, Kimi Linear's MLA layers), as the
/// config names them.
pub(crate) struct Mla {
    pub n_heads: usize,
    /// None: one `q_proj`; Some(r): `q_a_proj` → `q_a_layernorm` → `q_b_proj`.
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
}

/// The [`Mla`] widths of a config that names them as transformers does (`num_attention_heads`,
/// `q_lora_rank`, `kv_lora_rank`, `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`):
/// DeepSeek-V3's and Kimi Linear's.
macro_rules! mla_widths {
    ($c:expr) => {
        crate::family::Mla {
            n_heads: $c.num_attention_heads,
            q_lora_rank: $c.q_lora_rank,
            kv_lora_rank: $c.kv_lora_rank,
            qk_nope_head_dim: $c.qk_nope_head_dim,
            qk_rope_head_dim: $c.qk_rope_head_dim,
            v_head_dim: $c.v_head_dim,
        }
    };
}
pub(crate) use mla_widths;

/// The tensors of one MLA block under `a` (`model.layers.{l}.self_attn`), in checkpoint order:
/// the query projection(s), `kv_a_proj_with_mqa [kv_lora_rank + qk_rope_head_dim, hidden]`,
/// `kv_a_layernorm [kv_lora_rank]`, `kv_b_proj [n_heads * (qk_nope_head_dim + v_head_dim),
/// kv_lora_rank]`, with `output_gate` `g_proj [n_heads * v_head_dim, hidden]` (K3), and `o_proj
/// [hidden, n_heads * v_head_dim]`.
pub(crate) fn mla_tensors(a: &str, hidden: usize, m: &Mla, output_gate: bool) -> Vec<BackboneTensor> {
    use TensorRole::{Matrix, F32};
    let (h, nh, kv) = (hidden, m.n_heads, m.kv_lora_rank);
    let qk = m.qk_nope_head_dim + m.qk_rope_head_dim;
    let mut t = match m.q_lora_rank {
        Some(r) => vec![
            (format!("{a}.q_a_proj.weight"), vec![r, h], Matrix),
            (format!("{a}.q_a_layernorm.weight"), vec![r], F32),
            (format!("{a}.q_b_proj.weight"), vec![nh * qk, r], Matrix),
        ],
        None => vec![(format!("{a}.q_proj.weight"), vec![nh * qk, h], Matrix)],
    };
    t.push((
        format!("{a}.kv_a_proj_with_mqa.weight"),
        vec![kv + m.qk_rope_head_dim, h],
        Matrix,
    ));
    t.push((format!("{a}.kv_a_layernorm.weight"), vec![kv], F32));
    t.push((
        format!("{a}.kv_b_proj.weight"),
        vec![nh * (m.qk_nope_head_dim + m.v_head_dim), kv],
        Matrix,
    ));
    if output_gate {
        t.push((format!("{a}.g_proj.weight"), vec![nh * m.v_head_dim, h], Matrix));
    }
    t.push((format!("{a}.o_proj.weight"), vec![h, nh * m.v_head_dim], Matrix));
    tensors(t)
}

/// The router of a sigmoid-scored MoE block (DeepSeek-V3 `noaux_tc`, Kimi) under `m`
/// (`model.layers.{l}.mlp`, Kimi's `block_sparse_moe`): `gate.weight [n_experts, hidden]` and
/// `gate.e_score_correction_bias [n_experts]`, both f32.
pub(crate) fn noaux_router_tensors(m: &str, hidden: usize, n_experts: usize) -> Vec<BackboneTensor> {
    tensors([
        (format!("{m}.gate.weight"), vec![n_experts, hidden], TensorRole::F32),
        (
            format!("{m}.gate.e_score_correction_bias"),
            vec![n_experts],
            TensorRole::F32,
        ),
    ])
}

/// The `n_shared` shared experts of the MoE block under `m`, fused into one gated MLP
/// `{m}.shared_experts` of width `n_shared × moe_inter` ([`glu_mlp_tensors`]); none when
/// `n_shared` is 0.
pub(crate) fn shared_experts_tensors(m: &str, hidden: usize, moe_inter: usize, n_shared: usize) -> Vec<BackboneTensor> {
    if n_shared == 0 {
        return Vec::new();
    }
    glu_mlp_tensors(&format!("{m}.shared_experts"), hidden, moe_inter * n_shared)
}

/// Expert matrices from `(name, rows, cols, role)`, in record order.
pub(crate) fn matrices<'a>(parts: impl IntoIterator<Item = (&'a str, usize, usize, TensorRole)>) -> Vec<ExpertMatrix> {
    parts
        .into_iter()
        .map(|(n, rows, cols, role)| ExpertMatrix {
            name: n.into(),
            rows,
            cols,
            role,
        })
        .collect()
}

/// transformers' names of a gated MLP's matrices, in record order gate, up, down.
pub(crate) const GATE_UP_DOWN: [&str; 3] = ["gate_proj", "up_proj", "down_proj"];

/// The three matrices of a gated-MLP routed expert (`y = W x`) in record order gate, up, down,
/// named as in the family's checkpoint (`gate_proj`/`up_proj`/`down_proj`, or Mixtral/Kimi's
/// `w1`/`w3`/`w2`): gate and up `[inter, width]`, down `[width, inter]`, all stored in the
/// experts' dtype.
pub(crate) fn glu_expert_matrices(names: [&str; 3], width: usize, inter: usize) -> Vec<ExpertMatrix> {
    let [g, u, d] = names;
    matrices([(g, inter, width), (u, inter, width), (d, width, inter)].map(|(n, r, c)| (n, r, c, TensorRole::Matrix)))
}

/// Whether checkpoint tensor `name` belongs to a decoder layer at or beyond `n_layers`
/// (`model.layers.{i}.…` with `i >= n_layers`: the multi-token-prediction layers DeepSeek-V3
/// and Kimi append).
pub(crate) fn is_beyond_layers(name: &str, n_layers: usize) -> bool {
    name.strip_prefix("model.layers.")
        .and_then(|rest| rest.split('.').next())
        .and_then(|s| s.parse::<usize>().ok())
        .is_some_and(|idx| idx >= n_layers)
}

/// Checks grouped-query attention widths: `head_dim` even (RoPE rotates pairs), then
/// [`check_kv_heads`].
///
/// Errors: `head_dim` odd, or what [`check_kv_heads`] rejects (field named).
pub(crate) fn check_gqa(path: &Path, n_heads: usize, n_kv_heads: usize, head_dim: usize) -> Result<(), FormatError> {
    if !head_dim.is_multiple_of(2) {
        return Err(field_err(path, "head_dim", "must be even (RoPE rotates pairs)"));
    }
    check_kv_heads(path, n_heads, n_kv_heads)
}

/// Checks that `num_attention_heads` (`n_heads`) is a multiple of `num_key_value_heads`
/// (`n_kv_heads`, nonzero), as grouped-query attention shares each key/value head among a
/// whole number of query heads.
///
/// Errors: not a multiple (`num_key_value_heads` named, with both counts).
pub(crate) fn check_kv_heads(path: &Path, n_heads: usize, n_kv_heads: usize) -> Result<(), FormatError> {
    if !n_heads.is_multiple_of(n_kv_heads) {
        return Err(field_err(
            path,
            "num_key_value_heads",
            format!("num_attention_heads {n_heads} is not a multiple of num_key_value_heads {n_kv_heads}"),
        ));
    }
    Ok(())
}

/// Checks the top-k `num_experts_per_tok` (`top_k`) against the `n_experts` routed experts,
/// counted by config field `experts_field` (`num_experts`, `num_local_experts`).
///
/// Errors: `top_k` 0 or above `n_experts` (`num_experts_per_tok` named).
pub(crate) fn check_top_k(path: &Path, top_k: usize, n_experts: usize, experts_field: &str) -> Result<(), FormatError> {
    if top_k == 0 || top_k > n_experts {
        return Err(field_err(
            path,
            "num_experts_per_tok",
            format!("must be between 1 and {experts_field} ({n_experts}), got {top_k}"),
        ));
    }
    Ok(())
}

/// Whether `layer` is a MoE layer under the Qwen3-MoE rule (`Qwen3MoeDecoderLayer`,
/// `Qwen3NextDecoderLayer`): below `n_layers`, not in `mlp_only_layers`, experts present, and
/// `(layer + 1) % decoder_sparse_step == 0`. [QWEN3_MOE_LAYERS]
pub(crate) fn sparse_step_moe_layer(
    layer: usize,
    n_layers: usize,
    mlp_only_layers: &[usize],
    n_experts: usize,
    decoder_sparse_step: usize,
) -> bool {
    layer < n_layers
        && !mlp_only_layers.contains(&layer)
        && n_experts > 0
        && (layer + 1).is_multiple_of(decoder_sparse_step.max(1))
}

/// Checks that every entry of `mlp_only_layers` names one of the `n_layers` layers.
///
/// Errors: an index at or beyond `n_layers` (`mlp_only_layers` named, with the index).
pub(crate) fn check_mlp_only_layers(
    path: &Path,
    mlp_only_layers: &[usize],
    n_layers: usize,
) -> Result<(), FormatError> {
    if let Some(&l) = mlp_only_layers.iter().find(|&&l| l >= n_layers) {
        return Err(field_err(
            path,
            "mlp_only_layers",
            format!("layer {l} does not exist (num_hidden_layers {n_layers})"),
        ));
    }
    Ok(())
}

/// Checks that a per-layer list of `len` entries (config field `field`, each one of `entries`:
/// `entries`, `layer kinds`) covers the model's `n_layers` decoder layers.
///
/// Errors: another length (`field` named: "{len} {entries} for num_hidden_layers {n_layers}").
pub(crate) fn check_layer_count(
    path: &Path,
    field: &str,
    entries: &str,
    len: usize,
    n_layers: usize,
) -> Result<(), FormatError> {
    if len != n_layers {
        return Err(field_err(
            path,
            field,
            format!("{len} {entries} for num_hidden_layers {n_layers}"),
        ));
    }
    Ok(())
}

/// Checks that a model with dense layers (layers [`Family::is_moe_layer`] says no to) has a
/// dense MLP width `intermediate_size`.
///
/// Errors: a dense layer and `intermediate_size` 0 (`intermediate_size` named).
pub(crate) fn check_dense_width(path: &Path, f: &impl Family, intermediate_size: usize) -> Result<(), FormatError> {
    if (0..f.num_hidden_layers()).any(|l| !f.is_moe_layer(l)) && intermediate_size == 0 {
        return Err(field_err(
            path,
            "intermediate_size",
            "dense layers need intermediate_size > 0",
        ));
    }
    Ok(())
}

/// Group-limited routing (DeepSeek-V3 `noaux_tc`, Kimi): the config fields that name the
/// top-k and the group count, and the counts themselves.
pub(crate) struct ExpertGroups<'a> {
    /// Config field of the top-k (`num_experts_per_tok`, Kimi's `num_experts_per_token`).
    pub top_k_field: &'a str,
    /// Config field of the group count (`n_group`, Kimi's `num_expert_group`).
    pub group_field: &'a str,
    pub n_experts: usize,
    pub n_group: usize,
    pub topk_group: usize,
}

impl ExpertGroups<'_> {
    /// Most experts per token the router can select: those of the `topk_group` chosen groups,
    /// with the reason ([`Family::max_experts_per_tok`]).
    pub(crate) fn max_experts_per_tok(&self) -> (usize, String) {
        (
            self.topk_group * (self.n_experts / self.n_group.max(1)),
            format!(
                "routed experts selectable within topk_group {} of {} {}",
                self.topk_group, self.group_field, self.n_group
            ),
        )
    }

    /// Checks that the `top_k` experts per token fit in the chosen groups and that every group
    /// holds the two experts its score sums. The caller has checked that `n_group` is nonzero
    /// and divides `n_experts`.
    ///
    /// Errors: more experts per token than the groups hold (top-k field named), groups of one
    /// expert (group field named).
    pub(crate) fn check(&self, path: &Path, top_k: usize) -> Result<(), FormatError> {
        if top_k > self.topk_group * (self.n_experts / self.n_group) {
            return Err(field_err(
                path,
                self.top_k_field,
                "more experts per token than the chosen groups hold",
            ));
        }
        if self.n_group > 1 && self.n_experts / self.n_group < 2 {
            return Err(field_err(
                path,
                self.group_field,
                "groups need at least 2 experts (group score = sum of top-2)",
            ));
        }
        Ok(())
    }
}

/// The [`Family`] items every family config answers the same way, written once; used inside
/// each family's `impl Family`: `family` (the literal `$family`), `model_type` (`$family` too,
/// or with `model_type: self.model_type` that field), `validate` and `is_moe_layer` (the
/// config's inherent methods of those names), `n_routed_experts` and `num_experts_per_tok`
/// (fields `$experts` and `$top_k`), and the fields of the same name (`vocab_size`,
/// `hidden_size`, `num_hidden_layers`, `max_position_embeddings`, `eos_token_id`,
/// `bos_token_id`).
macro_rules! family_items {
    (family: $family:literal, routed_experts: $experts:ident, top_k: $top_k:ident $(,)?) => {
        fn model_type(&self) -> &str {
            $family
        }

        crate::family::family_items!(@common $family, $experts, $top_k);
    };
    (
        family: $family:literal, model_type: self.model_type, routed_experts: $experts:ident,
        top_k: $top_k:ident $(,)?
    ) => {
        fn model_type(&self) -> &str {
            &self.model_type
        }

        crate::family::family_items!(@common $family, $experts, $top_k);
    };
    (@common $family:literal, $experts:ident, $top_k:ident) => {
        fn family(&self) -> &'static str {
            $family
        }

        fn validate(&self, path: &std::path::Path) -> Result<(), crate::FormatError> {
            Self::validate(self, path)
        }

        fn is_moe_layer(&self, layer: usize) -> bool {
            Self::is_moe_layer(self, layer)
        }

        fn n_routed_experts(&self) -> usize {
            self.$experts
        }

        fn num_experts_per_tok(&self) -> usize {
            self.$top_k
        }

        fn vocab_size(&self) -> usize {
            self.vocab_size
        }

        fn hidden_size(&self) -> usize {
            self.hidden_size
        }

        fn num_hidden_layers(&self) -> usize {
            self.num_hidden_layers
        }

        fn max_position_embeddings(&self) -> usize {
            self.max_position_embeddings
        }

        fn eos_token_id(&self) -> &[u32] {
            &self.eos_token_id
        }

        fn bos_token_id(&self) -> Option<u32> {
            self.bos_token_id
        }
    };
}
pub(crate) use family_items;

/// What the family files' tests share.
#[cfg(test)]
pub(crate) mod test_support {
    use std::fmt::Debug;
    use std::path::Path;

    use serde_json::{json, Value};

    use crate::FormatError;

    /// The file name the tests' errors carry.
    pub(crate) fn p() -> &'static Path {
        Path::new("config.json")
    }

    /// Asserts that `from_value` rejects each config of `bad` (with `model_type` set to
    /// `model_type`) with an error naming its field.
    pub(crate) fn assert_names_field<T: Debug, const N: usize>(
        model_type: &str,
        bad: [(Value, &str); N],
        from_value: impl Fn(&Value, &Path) -> Result<T, FormatError>,
    ) {
        for (mut v, field) in bad {
            v["model_type"] = json!(model_type);
            let e = from_value(&v, p()).unwrap_err();
            assert!(e.to_string().contains(field), "{v}: {e}");
        }
    }
}
