//! The weights every decoder family shares, typed and resolved once at load: the token
//! embedding, per layer the two RMSNorms around a token mixer (`self_attn`) and a feed-forward
//! block (`mlp`), then the final norm and the output head. Names as in the Hugging Face
//! checkpoints (`model.embed_tokens`, `model.layers.{l}.input_layernorm`, …, `model.norm`,
//! `lm_head`); a family supplies its own mixer and feed-forward types (DeepSeek-V3: MLA and
//! dense / MoE MLPs; Kimi Linear: KDA or MLA and dense / MoE blocks).

use deltafin_format::model_dir::{Backbone, MatHandle, VecHandle};

use crate::EngineError;

/// Every weight of a forward pass: `A` is a layer's token mixer, `F` its feed-forward block.
/// Read with [`Backbone::mat`] / [`Backbone::vec`]: no name lookup in a forward pass.
pub(crate) struct DecoderWeights<A, F> {
    /// `model.embed_tokens.weight [vocab_size, hidden]`.
    pub(crate) embed_tokens: MatHandle,
    pub(crate) layers: Vec<DecoderLayer<A, F>>,
    /// `model.norm.weight [hidden]`.
    pub(crate) norm: VecHandle,
    /// `lm_head.weight [vocab_size, hidden]`.
    pub(crate) lm_head: MatHandle,
}

/// One decoder layer's weights (`model.layers.{l}.*`).
pub(crate) struct DecoderLayer<A, F> {
    /// `input_layernorm.weight [hidden]`.
    pub(crate) input_layernorm: VecHandle,
    /// `post_attention_layernorm.weight [hidden]`.
    pub(crate) post_attention_layernorm: VecHandle,
    /// The token mixer, `self_attn.*`.
    pub(crate) self_attn: A,
    /// The feed-forward block (`mlp.*` or `block_sparse_moe.*`).
    pub(crate) mlp: F,
}

impl<A, F> DecoderWeights<A, F> {
    /// Resolves the shared tensors in `bb` and, for each layer `l < n_layers`, its two norms
    /// (named by `norms(l)`: input, post-attention) and what `layer(l)` resolves (mixer,
    /// feed-forward block).
    ///
    /// Errors: a missing or malformed tensor (named), or what `layer` returns.
    pub(crate) fn resolve<'n>(
        bb: &Backbone,
        n_layers: usize,
        norms: impl Fn(usize) -> (&'n str, &'n str),
        mut layer: impl FnMut(usize) -> Result<(A, F), EngineError>,
    ) -> Result<Self, EngineError> {
        let mut layers = Vec::with_capacity(n_layers);
        for l in 0..n_layers {
            let (input, post) = norms(l);
            let (self_attn, mlp) = layer(l)?;
            layers.push(DecoderLayer {
                input_layernorm: bb.vector_handle(input)?,
                post_attention_layernorm: bb.vector_handle(post)?,
                self_attn,
                mlp,
            });
        }
        Ok(Self {
            embed_tokens: bb.matrix_handle("model.embed_tokens.weight")?,
            layers,
            norm: bb.vector_handle("model.norm.weight")?,
            lm_head: bb.matrix_handle("lm_head.weight")?,
        })
    }
}
