//! Grouped-query attention (Ainslie et al. 2023, arXiv:2305.13245) with a standard per-layer KV
//! cache and rotate-half RoPE, one token at a time or a chunk of tokens at once
//! ([`GqaAttention::forward_batch`], through [`crate::blocked_attention`]; bit-identical to token
//! at a time): the attention block of Mixtral, Qwen3-MoE and
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

use deltafin_format::model_dir::{Backbone, MatHandle, VecHandle};
use deltafin_format::Rope;
use deltafin_kernels::{dot, rms_norm_inplace, softmax_inplace};
use rayon::prelude::*;

use crate::model::{add_into, DecodeState};
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
    /// Names of layer `l`'s attention, `model.layers.{l}.self_attn.*`, with `q_norm`/`k_norm`
    /// when `qk_norm`.
    pub fn new(l: usize, qk_norm: bool) -> Self {
        let a = format!("model.layers.{l}.self_attn");
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

    /// gpt-oss names of layer `l`: projections with biases (`{q,k,v,o}_proj.bias`),
    /// `self_attn.sinks`, and the layer's window (`Some(w)` for `sliding_attention` layers).
    pub fn with_biases_and_sinks(l: usize, sliding_window: Option<usize>) -> Self {
        let a = format!("model.layers.{l}.self_attn");
        GqaNames {
            biases: Some(["q", "k", "v", "o"].map(|p| format!("{a}.{p}_proj.bias"))),
            sinks: Some(format!("{a}.sinks")),
            sliding_window,
            ..Self::new(l, false)
        }
    }

    /// Resolves the named tensors in `bb` once, checking their kinds (matrices, f32 vectors),
    /// so a bad model directory fails at load and a forward pass looks nothing up.
    ///
    /// Errors: a missing or malformed tensor (named).
    pub fn weights(&self, bb: &Backbone) -> Result<GqaWeights, EngineError> {
        let vector = |n: &Option<String>| -> Result<Option<VecHandle>, EngineError> {
            Ok(match n {
                Some(n) => Some(bb.vector_handle(n)?),
                None => None,
            })
        };
        Ok(GqaWeights {
            q_proj: bb.matrix_handle(&self.q_proj)?,
            k_proj: bb.matrix_handle(&self.k_proj)?,
            v_proj: bb.matrix_handle(&self.v_proj)?,
            o_proj: bb.matrix_handle(&self.o_proj)?,
            q_norm: vector(&self.q_norm)?,
            k_norm: vector(&self.k_norm)?,
            biases: match &self.biases {
                Some([q, k, v, o]) => Some([
                    bb.vector_handle(q)?,
                    bb.vector_handle(k)?,
                    bb.vector_handle(v)?,
                    bb.vector_handle(o)?,
                ]),
                None => None,
            },
            sinks: vector(&self.sinks)?,
            sliding_window: self.sliding_window,
        })
    }
}

/// One layer's attention weights, resolved in the backbone once at load
/// ([`GqaNames::weights`]) and read with [`Backbone::mat`] / [`Backbone::vec`]; shapes as in
/// the checkpoint (`[out, in]`).
#[derive(Debug, Clone, Copy)]
pub struct GqaWeights {
    /// `[n_heads * head_dim, hidden]`.
    pub q_proj: MatHandle,
    /// `[n_kv_heads * head_dim, hidden]` each.
    pub k_proj: MatHandle,
    pub v_proj: MatHandle,
    /// `[hidden, n_heads * head_dim]`.
    pub o_proj: MatHandle,
    /// Per-head RMSNorm weights `[head_dim]` (Qwen3).
    pub q_norm: Option<VecHandle>,
    pub k_norm: Option<VecHandle>,
    /// Biases of q, k, v, o (gpt-oss).
    pub biases: Option<[VecHandle; 4]>,
    /// Per-head sink logits `[n_heads]` (gpt-oss). [ATTN_SINKS]
    pub sinks: Option<VecHandle>,
    /// The layer's window when it differs from [`GqaDims::sliding_window`].
    pub sliding_window: Option<usize>,
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

    /// Marks a chunk of `n` tokens done ([`GqaAttention::forward_batch`] on every layer).
    pub fn advance_by(&mut self, n: usize) {
        self.len += n;
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

/// The grouped-query attention of one model (shared by its layers; each call takes its layer's
/// [`GqaWeights`]).
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

    /// The rotary tables (rotate-half layout over the whole head).
    pub fn rope(&self) -> &RotaryEmbedding {
        &self.rope
    }

    /// The score scale `head_dim^-0.5`.
    pub fn scale(&self) -> f32 {
        self.scale
    }

    /// eps of the per-head q/k RMSNorm.
    pub fn qk_norm_eps(&self) -> f32 {
        self.qk_norm_eps
    }

    /// Activation bytes a batched pass holds per token of its chunk: the residual stream and
    /// its normalised copy, block outputs, q/k/v and attention context (f32), plus `extra` f32
    /// of the family's MLP (router logits, dense-MLP activations); for
    /// [`crate::model::CausalLm::batch_bytes_per_token`].
    pub fn batch_bytes_per_token(&self, extra: usize) -> usize {
        let d = &self.dims;
        4 * (8 * d.hidden + 2 * d.n_heads * d.head_dim + 2 * d.n_kv_heads * d.head_dim + extra)
    }

    /// Runs layer `layer`'s attention (weights `w` in `bb`) for the token at `cache.pos()` and
    /// appends its key and value to the cache. `xn: [hidden]` (after `input_layernorm`) →
    /// `out: [hidden]`; `buf` holds the work buffers (taken out of `cache`).
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        bb: &Backbone,
        w: &GqaWeights,
        layer: usize,
        xn: &[f32],
        cache: &mut KvCache,
        buf: &mut Buffers,
        out: &mut [f32],
    ) {
        let d = &self.dims;
        let (nh, kv_dim) = (d.n_heads, d.n_kv_heads * d.head_dim);
        let pos = cache.pos();
        buf.q.resize(nh * d.head_dim, 0.0);
        buf.k.resize(kv_dim, 0.0);
        buf.v.resize(kv_dim, 0.0);
        bb.mat(&w.q_proj).matvec(xn, &mut buf.q);
        bb.mat(&w.k_proj).matvec(xn, &mut buf.k);
        bb.mat(&w.v_proj).matvec(xn, &mut buf.v);
        self.finish_qkv(bb, w, pos, 1, &mut buf.q, &mut buf.k, &mut buf.v);
        cache.k[layer].extend_from_slice(&buf.k);
        cache.v[layer].extend_from_slice(&buf.v);
        buf.ctx.clear();
        buf.ctx.resize(nh * d.head_dim, 0.0);
        self.attend(bb, w, layer, &buf.q, pos, 1, cache, &mut buf.scores, &mut buf.ctx);
        bb.mat(&w.o_proj).matvec(&buf.ctx, out);
        if let Some([.., bo]) = &w.biases {
            add_into(out, bb.vec(bo));
        }
    }

    /// Runs layer `layer`'s attention for a chunk of `nt` tokens at positions
    /// `cache.pos() .. cache.pos() + nt` (the caller advances the cache by `nt` once every layer
    /// has run, [`KvCache::advance_by`]) and appends their keys and values to the cache. The
    /// projections run as matrix-matrix products over the chunk; each token attends causally
    /// (and within its window) over the cached prefix and the chunk up to itself through the
    /// blocked kernel ([`crate::blocked_attention`]). `xn: [nt, hidden]` → `out: [nt, hidden]`.
    /// Each token's result equals [`Self::forward`] bit for bit (`matmul` equals `matvec` row
    /// by row, and attention performs the same operations per (token, head)).
    #[allow(clippy::too_many_arguments)]
    pub fn forward_batch(
        &self,
        bb: &Backbone,
        w: &GqaWeights,
        layer: usize,
        xn: &[f32],
        nt: usize,
        cache: &mut KvCache,
        out: &mut [f32],
    ) {
        let d = &self.dims;
        let (nh, kv_dim) = (d.n_heads, d.n_kv_heads * d.head_dim);
        let pos0 = cache.pos();
        let mut q = vec![0f32; nt * nh * d.head_dim];
        let mut k = vec![0f32; nt * kv_dim];
        let mut v = vec![0f32; nt * kv_dim];
        bb.mat(&w.q_proj).matmul(xn, nt, &mut q);
        bb.mat(&w.k_proj).matmul(xn, nt, &mut k);
        bb.mat(&w.v_proj).matmul(xn, nt, &mut v);
        self.finish_qkv(bb, w, pos0, nt, &mut q, &mut k, &mut v);
        cache.k[layer].extend_from_slice(&k);
        cache.v[layer].extend_from_slice(&v);
        drop((k, v));
        let mut ctx = vec![0f32; nt * nh * d.head_dim];
        let mut scratch = Vec::new();
        self.attend(bb, w, layer, &q, pos0, nt, cache, &mut scratch, &mut ctx);
        drop(q);
        bb.mat(&w.o_proj).matmul(&ctx, nt, out);
        if let Some([.., bo]) = &w.biases {
            let bo = bb.vec(bo);
            out.chunks_exact_mut(d.hidden).for_each(|o| add_into(o, bo));
        }
    }

    /// Biases, per-head q/k norms and RoPE of `nt` tokens at positions `pos0..`: `q: [nt,
    /// n_heads * head_dim]`, `k, v: [nt, n_kv_heads * head_dim]`, in place, row by row.
    #[allow(clippy::too_many_arguments)]
    fn finish_qkv(
        &self,
        bb: &Backbone,
        w: &GqaWeights,
        pos0: usize,
        nt: usize,
        q: &mut [f32],
        k: &mut [f32],
        v: &mut [f32],
    ) {
        let hd = self.dims.head_dim;
        let (qd, kd) = (q.len() / nt, k.len() / nt);
        if let Some([bq, bk, bv, _]) = &w.biases {
            for (y, b, width) in [(&mut *q, bq, qd), (&mut *k, bk, kd), (&mut *v, bv, kd)] {
                let b = bb.vec(b);
                y.chunks_exact_mut(width).for_each(|row| add_into(row, b));
            }
        }
        if let Some(n) = &w.q_norm {
            let n = bb.vec(n);
            q.chunks_exact_mut(hd)
                .for_each(|h| rms_norm_inplace(h, n, self.qk_norm_eps));
        }
        if let Some(n) = &w.k_norm {
            let n = bb.vec(n);
            k.chunks_exact_mut(hd)
                .for_each(|h| rms_norm_inplace(h, n, self.qk_norm_eps));
        }
        for (i, (qr, kr)) in q.chunks_exact_mut(qd).zip(k.chunks_exact_mut(kd)).enumerate() {
            qr.chunks_exact_mut(hd).for_each(|h| self.rope.apply(h, pos0 + i));
            kr.chunks_exact_mut(hd).for_each(|h| self.rope.apply(h, pos0 + i));
        }
    }

    /// The attention core of `nt` tokens at positions `pos0..pos0 + nt` whose keys and values
    /// are already in layer `layer`'s cache: `q: [nt, n_heads * head_dim]` (rotated) →
    /// `ctx: [nt, n_heads * head_dim]` (zero on entry). For each (token, head):
    /// `s_t = dot(q_h, K[t, h / g]) · scale` over the window, softmax (with the sink on
    /// gpt-oss), `ctx_h = Σ_t p_t V[t, h / g]` in ascending `t` ([`crate::blocked_attention`]:
    /// the rows of one key/value head and a tile of tokens share every key tile). Work items
    /// (key/value head × token tile) run in parallel once there is enough work.
    #[allow(clippy::too_many_arguments)]
    fn attend(
        &self,
        bb: &Backbone,
        w: &GqaWeights,
        layer: usize,
        q: &[f32],
        pos0: usize,
        nt: usize,
        cache: &KvCache,
        scratch: &mut Vec<f32>,
        ctx: &mut [f32],
    ) {
        let d = &self.dims;
        let (nh, nkv, hd) = (d.n_heads, d.n_kv_heads, d.head_dim);
        let kv_dim = nkv * hd;
        let group = nh / nkv;
        let window = w.sliding_window.or(d.sliding_window);
        let (keys, values) = (&cache.k[layer], &cache.v[layer]);
        let sinks = w.sinks.as_ref().map(|s| bb.vec(s));
        let scale = self.scale;
        let span = |p: usize| match window {
            Some(w) => ((p + 1).saturating_sub(w), p + 1),
            None => (0, p + 1),
        };
        // Tokens per work item: a few per item for parallelism, at most 8, the scores bounded.
        let threads = rayon::current_num_threads().max(1);
        let n_keys = span(pos0 + nt - 1).1 - span(pos0).0;
        let tile = crate::blocked_attention::tokens_per_item(nt, group, n_keys, threads.div_ceil(nkv));
        let n_tiles = nt.div_ceil(tile);
        // One work item: key/value head g, tokens [t0, t1) → rows (token, head of g) of ctx,
        // token-major.
        let item = |g: usize, t0: usize, t1: usize, scores: &mut Vec<f32>| -> Vec<f32> {
            let rows = (t1 - t0) * group;
            let windows: Vec<(usize, usize)> = (0..rows).map(|r| span(pos0 + t0 + r / group)).collect();
            let kvo = g * hd;
            let q_row = |r: usize| {
                let (t, h) = (t0 + r / group, g * group + r % group);
                &q[(t * nh + h) * hd..(t * nh + h + 1) * hd]
            };
            let mut out = vec![0f32; rows * hd];
            crate::blocked_attention::attend_rows(
                &windows,
                |r, t| dot(q_row(r), &keys[t * kv_dim + kvo..t * kv_dim + kvo + hd]) * scale,
                |r, s| match sinks {
                    Some(sinks) => softmax_with_sink(s, sinks[g * group + r % group]),
                    None => softmax_inplace(s),
                },
                crate::blocked_attention::Values {
                    data: values,
                    stride: kv_dim,
                    offset: kvo,
                    width: hd,
                },
                scores,
                &mut out,
            );
            out
        };
        let scatter = |ctx: &mut [f32], g: usize, t0: usize, o: &[f32]| {
            for (r, row) in o.chunks_exact(hd).enumerate() {
                let (t, h) = (t0 + r / group, g * group + r % group);
                ctx[(t * nh + h) * hd..(t * nh + h + 1) * hd].copy_from_slice(row);
            }
        };
        if nh * nt * n_keys * hd >= 1 << 15 && nkv * n_tiles > 1 {
            let outs: Vec<(usize, usize, Vec<f32>)> = (0..nkv * n_tiles)
                .into_par_iter()
                .map_init(Vec::new, |scores, i| {
                    let (g, ti) = (i % nkv, i / nkv);
                    let t0 = ti * tile;
                    (g, t0, item(g, t0, (t0 + tile).min(nt), scores))
                })
                .collect();
            for (g, t0, o) in outs {
                scatter(ctx, g, t0, &o);
            }
        } else {
            for ti in 0..n_tiles {
                let t0 = ti * tile;
                for g in 0..nkv {
                    let o = item(g, t0, (t0 + tile).min(nt), scratch);
                    scatter(ctx, g, t0, &o);
                }
            }
        }
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
