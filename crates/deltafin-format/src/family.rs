//! What a model family is to the format crate: the [`Family`] trait that each family's config
//! implements in its own file (`deepseek_v3.rs`, `kimi_linear.rs`, `qwen3_moe.rs`, `mixtral.rs`,
//! `gpt_oss.rs`, `qwen3_next.rs`), and the vocabulary of its tensor tables: the resident
//! backbone tensors with their shapes and storage role, the matrices of one routed-expert
//! record, and where each comes from in the checkpoint. [`crate::arch::ModelConfig`] holds one
//! family's config and answers through this trait.

use std::path::Path;

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
    /// layer `layer` comes from in the checkpoint.
    fn expert_source(&self, layer: usize, expert: usize, m: &ExpertMatrix) -> ExpertSource;
    /// Checkpoint tensors deliberately not converted (e.g. multi-token-prediction layers,
    /// rotary buffers).
    fn is_ignored(&self, name: &str) -> bool;
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

/// The tensors of one grouped-query-attention decoder layer under `prefix`
/// (`model.layers.{l}`) except its MLP: the two RMSNorm weights, `q_proj [n_heads * head_dim,
/// hidden]`, `k_proj`/`v_proj [n_kv_heads * head_dim, hidden]`, `o_proj [hidden, n_heads *
/// head_dim]`, and with `qk_norm` the per-head `q_norm`/`k_norm [head_dim]` (Qwen3).
pub(crate) fn gqa_layer_tensors(
    prefix: &str,
    hidden: usize,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    qk_norm: bool,
) -> Vec<BackboneTensor> {
    let a = format!("{prefix}.self_attn");
    let mut t = vec![
        (
            format!("{prefix}.input_layernorm.weight"),
            vec![hidden],
            TensorRole::F32,
        ),
        (
            format!("{prefix}.post_attention_layernorm.weight"),
            vec![hidden],
            TensorRole::F32,
        ),
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
    ];
    if qk_norm {
        t.push((format!("{a}.q_norm.weight"), vec![head_dim], TensorRole::F32));
        t.push((format!("{a}.k_norm.weight"), vec![head_dim], TensorRole::F32));
    }
    t.into_iter()
        .map(|(name, shape, role)| BackboneTensor { name, shape, role })
        .collect()
}

/// The three matrices of a gated-MLP routed expert (`y = W x`) in record order gate, up, down,
/// named as in the family's checkpoint (`gate_proj`/`up_proj`/`down_proj`, or Mixtral/Kimi's
/// `w1`/`w3`/`w2`): gate and up `[inter, width]`, down `[width, inter]`, all stored in the
/// experts' dtype.
pub(crate) fn glu_expert_matrices(names: [&str; 3], width: usize, inter: usize) -> Vec<ExpertMatrix> {
    let [g, u, d] = names;
    [(g, inter, width), (u, inter, width), (d, width, inter)]
        .into_iter()
        .map(|(n, rows, cols)| ExpertMatrix {
            name: n.into(),
            rows,
            cols,
            role: TensorRole::Matrix,
        })
        .collect()
}

/// The [`Family`] accessors every family config answers from fields of the same name
/// (`vocab_size`, `hidden_size`, `num_hidden_layers`, `max_position_embeddings`, `eos_token_id`,
/// `bos_token_id`), written once; used inside each family's `impl Family`.
macro_rules! config_fields {
    () => {
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
pub(crate) use config_fields;
