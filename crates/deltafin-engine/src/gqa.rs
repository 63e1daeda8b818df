//! Grouped-query attention (Ainslie et al. 2023, arXiv:2305.13245) with a standard per-layer KV
//! cache and rotate-half RoPE, one token at a time: the attention block of Mixtral, Qwen3-MoE and
//! other Llama-style families, matching transformers' `eager_attention_forward` +
//! `apply_rotary_pos_emb` (`models/mixtral/modeling_mixtral.py`,
//! `models/qwen3_moe/modeling_qwen3_moe.py`) in f32.
//!
//! PyTorch equivalent for one token at position `pos` (`nh` query heads, `nkv` key/value heads,
//! `hd` head width, `g = nh / nkv` query heads per key/value head):
//! ```text
//! q = q_proj(x).view(nh, hd);  k = k_proj(x).view(nkv, hd);  v = v_proj(x).view(nkv, hd)
//! q, k = q_norm(q), k_norm(k)                      # Qwen3 only: RMSNorm over each head's hd
//! q, k = q*cos + rotate_half(q)*sin, (same for k)  # rotate_half pairs x[i] with x[i + hd/2]
//! K, V = cache.update(k, v)                        # [n_tokens, nkv, hd]
//! s_h[t] = q_h · K[t, h / g] * hd^-0.5             # t in window(pos)
//! o_h = softmax(s_h) @ V[:, h / g]
//! out = o_proj(concat_h o_h)
//! ```
//! `window(pos)` is `0..=pos`, or with a sliding window `w` the last `w` positions
//! `pos + 1 - w ..= pos` (transformers' `sliding_window_overlay`: `kv_idx > q_idx - w`).
//! [GQA_ATTENTION]
//!
//! gpt-oss adds biases to the four projections, a window per layer (`layer_types`), and an
//! attention sink per head: a learned logit `sink_h` that joins the softmax denominator and
//! receives no value, `p_t = exp(s_t) / (Σ_u exp(s_u) + exp(sink_h))` (transformers
//! `models/gpt_oss/modeling_gpt_oss.py` `eager_attention_forward`: the sink is concatenated as an
//! extra column, the max subtracted, softmaxed, and the column dropped). [ATTN_SINKS]

use deltafin_format::model_dir::Backbone;
use deltafin_format::Rope;
use deltafin_kernels::{axpy, dot, rms_norm_inplace, softmax_inplace};
use rayon::prelude::*;

use crate::model::DecodeState;
use crate::rope::RotaryEmbedding;
use crate::EngineError;

/// Shape of one grouped-query attention block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GqaDims {
    pub hidden: usize,
    pub n_heads: usize,
    /// Divides `n_heads`.
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Attend to at most this many most recent positions (including the current one).
    pub sliding_window: Option<usize>,
}

/// Checkpoint names of one layer's attention tensors.
#[derive(Debug, Clone)]
pub struct GqaNames {
    pub q_proj: String,
    pub k_proj: String,
    pub v_proj: String,
    pub o_proj: String,
    /// Per-head RMSNorm weights `[head_dim]` (Qwen3), applied before RoPE.
    pub q_norm: Option<String>,
    pub k_norm: Option<String>,
    /// Projection biases `[rows of the projection]` (gpt-oss): q, k, v, o.
    pub biases: Option<[String; 4]>,
    /// Per-head attention sink logits `[n_heads]` (gpt-oss). [ATTN_SINKS]
    pub sinks: Option<String>,
    /// This layer's window when it differs from [`GqaDims::sliding_window`] (gpt-oss'
    /// `sliding_attention` layers); None: the model-wide setting.
    pub sliding_window: Option<usize>,
}

impl GqaNames {
    /// Names under `{prefix}.self_attn` (`prefix` = `model.layers.{l}`), with `q_norm`/`k_norm`
    /// when `qk_norm`.
    pub fn new(prefix: &str, qk_norm: bool) -> Self {
        let a = format!("{prefix}.self_attn");
        GqaNames {
            q_proj: format!("{a}.q_proj.weight"),
            k_proj: format!("{a}.k_proj.weight"),
            v_proj: format!("{a}.v_proj.weight"),
            o_proj: format!("{a}.o_proj.weight"),
            q_norm: qk_norm.then(|| format!("{a}.q_norm.weight")),
            k_norm: qk_norm.then(|| format!("{a}.k_norm.weight")),
            biases: None,
            sinks: None,
            sliding_window: None,
        }
    }

    /// gpt-oss names: projections with biases (`{q,k,v,o}_proj.bias`), `self_attn.sinks`, and
    /// the layer's window (`Some(w)` for `sliding_attention` layers).
    pub fn with_biases_and_sinks(prefix: &str, sliding_window: Option<usize>) -> Self {
        let a = format!("{prefix}.self_attn");
        GqaNames {
            biases: Some(["q", "k", "v", "o"].map(|p| format!("{a}.{p}_proj.bias"))),
            sinks: Some(format!("{a}.sinks")),
            sliding_window,
            ..Self::new(prefix, false)
        }
    }

    /// Checks that every tensor exists with the expected kind (matrices, f32 vectors), so a bad
    /// model directory fails at load.
    ///
    /// Errors: a missing or malformed tensor (named).
    pub fn check(&self, bb: &Backbone) -> Result<(), EngineError> {
        for m in [&self.q_proj, &self.k_proj, &self.v_proj, &self.o_proj] {
            bb.matrix(m)?;
        }
        for v in [&self.q_norm, &self.k_norm, &self.sinks].into_iter().flatten() {
            bb.vector(v)?;
        }
        for v in self.biases.iter().flatten() {
            bb.vector(v)?;
        }
        Ok(())
    }
}

/// Per-token work buffers of a decoder layer, kept in the decode state so decoding does not
/// allocate them again for every token.
#[derive(Debug, Clone, Default)]
pub struct Buffers {
    /// Residual stream `[hidden]`.
    pub x: Vec<f32>,
    /// Normalised hidden state `[hidden]`.
    pub xn: Vec<f32>,
    /// Block output `[hidden]`.
    pub out: Vec<f32>,
    /// Dense-MLP gate and up activations `[intermediate]`.
    pub gate: Vec<f32>,
    pub up: Vec<f32>,
    /// Router logits and probabilities `[n_routed_experts]`.
    pub router: Vec<f32>,
    pub probs: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    scores: Vec<f32>,
    ctx: Vec<f32>,
}

/// Per-sequence decode state: keys and values of every layer, plus work buffers.
#[derive(Debug, Clone)]
pub struct KvCache {
    /// `n_kv_heads * head_dim`.
    kv_dim: usize,
    /// `[layer][n_tokens * kv_dim]`: rotated (and for Qwen3 normalised) keys.
    k: Vec<Vec<f32>>,
    /// `[layer][n_tokens * kv_dim]`: values.
    v: Vec<Vec<f32>>,
    /// Tokens cached.
    len: usize,
    /// Work buffers (take them with `std::mem::take` for the duration of a forward pass).
    pub buffers: Buffers,
}

impl KvCache {
    /// An empty cache for `n_layers` layers of attention with `dims`.
    pub fn new(n_layers: usize, dims: &GqaDims) -> Self {
        KvCache {
            kv_dim: dims.n_kv_heads * dims.head_dim,
            k: vec![Vec::new(); n_layers],
            v: vec![Vec::new(); n_layers],
            len: 0,
            buffers: Buffers::default(),
        }
    }

    /// Checks that this cache was made for `n_layers` layers of attention with `dims`.
    ///
    /// Errors: the cache belongs to a model of another shape.
    pub fn check(&self, n_layers: usize, dims: &GqaDims) -> Result<(), EngineError> {
        if self.k.len() != n_layers || self.kv_dim != dims.n_kv_heads * dims.head_dim {
            return Err(EngineError::Invalid("decode state belongs to another model".into()));
        }
        Ok(())
    }

    /// Position of the token being computed (= tokens cached before it).
    pub fn pos(&self) -> usize {
        self.len
    }

    /// Marks the current token done: every layer has appended its key and value.
    pub fn advance(&mut self) {
        self.len += 1;
    }
}

impl DecodeState for KvCache {
    fn len(&self) -> usize {
        self.len
    }

    fn truncate(&mut self, len: usize) -> bool {
        if len < self.len {
            for c in self.k.iter_mut().chain(self.v.iter_mut()) {
                c.truncate(len * self.kv_dim);
            }
            self.len = len;
        }
        true
    }

    fn bytes(&self) -> usize {
        self.k.iter().chain(&self.v).map(|c| c.capacity() * 4).sum()
    }

    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

/// The grouped-query attention of one model (shared by its layers; weights are looked up by
/// name per layer).
#[derive(Debug, Clone)]
pub struct GqaAttention {
    pub dims: GqaDims,
    rope: RotaryEmbedding,
    /// `head_dim^-0.5`.
    scale: f32,
    /// eps of the per-head q/k RMSNorm (the model's `rms_norm_eps`).
    qk_norm_eps: f32,
}

impl GqaAttention {
    /// Attention with `dims`, RoPE `rope` over the whole head (rotate-half layout), and per-head
    /// q/k RMSNorm eps `qk_norm_eps` (used only when the layer names norms).
    pub fn new(dims: GqaDims, rope: &Rope, qk_norm_eps: f32) -> Self {
        GqaAttention {
            dims,
            rope: RotaryEmbedding::new(rope, dims.head_dim, false),
            scale: (dims.head_dim as f32).powf(-0.5),
            qk_norm_eps,
        }
    }

    /// Runs layer `layer`'s attention for the token at `cache.pos()` and appends its key and
    /// value to the cache. `xn: [hidden]` (after `input_layernorm`) → `out: [hidden]`; `buf`
    /// holds the work buffers (taken out of `cache`).
    ///
    /// Errors: a missing or malformed tensor.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        bb: &Backbone,
        names: &GqaNames,
        layer: usize,
        xn: &[f32],
        cache: &mut KvCache,
        buf: &mut Buffers,
        out: &mut [f32],
    ) -> Result<(), EngineError> {
        let d = &self.dims;
        let (nh, nkv, hd) = (d.n_heads, d.n_kv_heads, d.head_dim);
        let kv_dim = nkv * hd;
        let group = nh / nkv;
        let pos = cache.pos();
        buf.q.resize(nh * hd, 0.0);
        buf.k.resize(kv_dim, 0.0);
        buf.v.resize(kv_dim, 0.0);
        bb.matrix(&names.q_proj)?.matvec(xn, &mut buf.q);
        bb.matrix(&names.k_proj)?.matvec(xn, &mut buf.k);
        bb.matrix(&names.v_proj)?.matvec(xn, &mut buf.v);
        if let Some([bq, bk, bv, _]) = &names.biases {
            for (y, b) in [(&mut buf.q, bq), (&mut buf.k, bk), (&mut buf.v, bv)] {
                add_bias(y, bb.vector(b)?);
            }
        }
        if let Some(n) = &names.q_norm {
            let w = bb.vector(n)?;
            buf.q
                .chunks_exact_mut(hd)
                .for_each(|h| rms_norm_inplace(h, w, self.qk_norm_eps));
        }
        if let Some(n) = &names.k_norm {
            let w = bb.vector(n)?;
            buf.k
                .chunks_exact_mut(hd)
                .for_each(|h| rms_norm_inplace(h, w, self.qk_norm_eps));
        }
        buf.q.chunks_exact_mut(hd).for_each(|h| self.rope.apply(h, pos));
        buf.k.chunks_exact_mut(hd).for_each(|h| self.rope.apply(h, pos));
        cache.k[layer].extend_from_slice(&buf.k);
        cache.v[layer].extend_from_slice(&buf.v);

        let start = match names.sliding_window.or(d.sliding_window) {
            Some(w) => (pos + 1).saturating_sub(w),
            None => 0,
        };
        let t_len = pos + 1 - start;
        let (keys, values) = (&cache.k[layer], &cache.v[layer]);
        buf.scores.resize(nh * t_len, 0.0);
        buf.ctx.clear();
        buf.ctx.resize(nh * hd, 0.0);
        let (q, scale) = (&buf.q, self.scale);
        let sinks = match &names.sinks {
            Some(n) => Some(bb.vector(n)?),
            None => None,
        };
        let per_head = |(h, (ctx, scores)): (usize, (&mut [f32], &mut [f32]))| {
            let qh = &q[h * hd..(h + 1) * hd];
            let kvo = (h / group) * hd;
            for (i, s) in scores.iter_mut().enumerate() {
                let t = start + i;
                *s = dot(qh, &keys[t * kv_dim + kvo..t * kv_dim + kvo + hd]) * scale;
            }
            match sinks {
                Some(sinks) => softmax_with_sink(scores, sinks[h]),
                None => softmax_inplace(scores),
            }
            for (i, p) in scores.iter().enumerate() {
                let t = start + i;
                axpy(*p, &values[t * kv_dim + kvo..t * kv_dim + kvo + hd], ctx);
            }
        };
        // Heads in parallel once there is enough work to pay for it (long contexts).
        if nh * t_len * hd >= 1 << 15 {
            buf.ctx
                .par_chunks_mut(hd)
                .zip(buf.scores.par_chunks_mut(t_len))
                .enumerate()
                .for_each(per_head);
        } else {
            buf.ctx
                .chunks_mut(hd)
                .zip(buf.scores.chunks_mut(t_len))
                .enumerate()
                .for_each(per_head);
        }
        bb.matrix(&names.o_proj)?.matvec(&buf.ctx, out);
        if let Some([.., bo]) = &names.biases {
            add_bias(out, bb.vector(bo)?);
        }
        Ok(())
    }
}

fn add_bias(y: &mut [f32], b: &[f32]) {
    for (a, b) in y.iter_mut().zip(b) {
        *a += b;
    }
}

/// Softmax of `scores` with an extra sink logit in the denominator that takes no probability
/// of its own: `p_t = exp(s_t - m) / (Σ_u exp(s_u - m) + exp(sink - m))`, `m` the max over the
/// scores and the sink. [ATTN_SINKS]
pub fn softmax_with_sink(scores: &mut [f32], sink: f32) {
    let m = scores.iter().copied().fold(sink, f32::max);
    let mut sum = (sink - m).exp();
    for s in scores.iter_mut() {
        *s = (*s - m).exp();
        sum += *s;
    }
    for s in scores.iter_mut() {
        *s /= sum;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sink_takes_share_of_the_denominator_only() {
        // Scores ln 1, ln 3 and sink ln 4: exp sum 1 + 3 + 4 = 8 → 1/8, 3/8 (sum 1/2, no value
        // for the sink).
        let mut s = [0.0f32, 3f32.ln()];
        softmax_with_sink(&mut s, 4f32.ln());
        assert!((s[0] - 0.125).abs() < 1e-7 && (s[1] - 0.375).abs() < 1e-7, "{s:?}");
        // A sink far below the scores changes nothing; large logits do not overflow (1000 + ln 2
        // is rounded to f32 spacing 6e-5 there).
        let mut s = [1000.0f32, 1000.0 + 2f32.ln()];
        softmax_with_sink(&mut s, -1e4);
        assert!(
            (s[0] - 1.0 / 3.0).abs() < 1e-4 && (s[1] - 2.0 / 3.0).abs() < 1e-4,
            "{s:?}"
        );
    }
}
