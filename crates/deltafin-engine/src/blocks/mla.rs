//! Multi-head latent attention (MLA; DeepSeek-V2 §2.1, arXiv:2405.04434; transformers
//! `DeepseekV3Attention` and Kimi's `KimiMLAAttention`), one layer, for every family that has it
//! (DeepSeek-V3 / Kimi K2 with RoPE on the shared-key part; Kimi Linear / K3 without, and K3's
//! output gate).
//!
//! ```text
//! q        = q_b_proj(q_a_layernorm(q_a_proj(x)))   or q_proj(x)     [n_heads, nope + rope]
//! c, k_pe  = kv_a_proj_with_mqa(x) → c = kv_a_layernorm(c)            [kv_lora_rank], [rope]
//! (RoPE on q's rope part and on k_pe when the shape has a rotary embedding)
//! o_h      = W_UV_h · Σ_t softmax_t((W_UK_hᵀ q_nope_h) · c_t + q_pe_h · k_pe_t) · scale) c_t
//! out      = o_proj(o ⊙ σ(g_proj(x)))  (the gate only where configured, K3-SPEC §4)
//! ```
//!
//! The one-token form here computes each head in the weight-absorbed order [MLA_ABSORB] (the
//! scores against the latents, the weighted latent sum, then `W_UV`); the chunk form runs the
//! same per-(token, head) operations through the blocked kernels of
//! [`crate::blocked_attention`] (or its decompressed form when the batch form allows), so a
//! prompt processed in chunks gives every token the one-token bits.

use deltafin_format::model_dir::{Backbone, MatHandle, VecHandle};
use deltafin_format::FormatError;
use deltafin_kernels::{dot, dot_2x2, rms_norm, sigmoid, softmax_inplace, MatRef};
use rayon::prelude::*;

use deltafin_kernels::attention::{pv_block, qk_block, DKB, DRB};

use crate::blocked_attention::{attend_rows, tokens_per_item, RowScorer, Values};
use crate::rope::RotaryEmbedding;

/// eps of `q_a_layernorm` and `kv_a_layernorm`: the reference constructs them with the
/// `DeepseekV3RMSNorm` default (1e-6) whatever `rms_norm_eps` says. [LATENT_NORM_EPS]
pub(crate) const LATENT_NORM_EPS: f32 = 1e-6;

/// One layer's MLA weights, named as in the Hugging Face checkpoint.
pub struct MlaWeights<'a> {
    /// `q_a_proj` + `q_a_layernorm` + `q_b_proj`, or `q_proj`.
    pub query: MlaQuery<'a>,
    /// `kv_a_proj_with_mqa`: `[kv_lora_rank + qk_rope_head_dim, hidden]`.
    pub kv_a_proj_with_mqa: MatRef<'a>,
    /// `kv_a_layernorm.weight`: `[kv_lora_rank]`.
    pub kv_a_layernorm: &'a [f32],
    /// `kv_b_proj`: `[n_heads · (qk_nope_head_dim + v_head_dim), kv_lora_rank]`, per head the
    /// `W_UK` rows then the `W_UV` rows.
    pub kv_b_proj: MatRef<'a>,
    /// `o_proj`: `[hidden, n_heads · v_head_dim]`.
    pub o_proj: MatRef<'a>,
    /// K3's output gate `g_proj`: `[n_heads · v_head_dim, hidden]` (None: no gate).
    pub g_proj: Option<MatRef<'a>>,
}

/// [`MlaWeights`] resolved in the backbone once at load: the same tensors as handles, viewed
/// for a layer's pass with the infallible [`MlaTensors::view`] (no lookup).
#[derive(Debug, Clone, Copy)]
pub struct MlaTensors {
    /// `q_a_proj` + `q_a_layernorm` + `q_b_proj`, or `q_proj`.
    pub query: MlaQueryTensors,
    /// `kv_a_proj_with_mqa`: `[kv_lora_rank + qk_rope_head_dim, hidden]`.
    pub kv_a_proj_with_mqa: MatHandle,
    /// `kv_a_layernorm.weight`: `[kv_lora_rank]`.
    pub kv_a_layernorm: VecHandle,
    /// `kv_b_proj`: `[n_heads · (qk_nope_head_dim + v_head_dim), kv_lora_rank]`.
    pub kv_b_proj: MatHandle,
    /// `o_proj`: `[hidden, n_heads · v_head_dim]`.
    pub o_proj: MatHandle,
    /// K3's output gate `g_proj`: `[n_heads · v_head_dim, hidden]` (None: no gate).
    pub g_proj: Option<MatHandle>,
}

/// [`MlaQuery`]'s tensors as handles.
#[derive(Debug, Clone, Copy)]
pub enum MlaQueryTensors {
    /// `q_a_proj` `[q_lora_rank, hidden]`, `q_a_layernorm` `[q_lora_rank]`, `q_b_proj`
    /// `[n_heads · qk_head_dim, q_lora_rank]`.
    Lora {
        q_a_proj: MatHandle,
        q_a_layernorm: VecHandle,
        q_b_proj: MatHandle,
    },
    /// `q_proj` `[n_heads · qk_head_dim, hidden]`.
    Plain { q_proj: MatHandle },
}

/// Tensor names of one layer's MLA block, as in the Hugging Face checkpoint: `{prefix}.q_proj.weight`
/// and so on under a prefix such as `model.layers.3.self_attn` (DeepSeek-V3 / Kimi K2, and the MLA
/// layers of Kimi Linear / K3).
#[derive(Debug, Clone)]
pub struct MlaTensorNames {
    /// `q_proj.weight` (without q-LoRA).
    pub q_proj: String,
    /// `q_a_proj.weight`, then `q_a_layernorm.weight` and `q_b_proj.weight` (with q-LoRA).
    pub q_a_proj: String,
    pub q_a_layernorm: String,
    pub q_b_proj: String,
    pub kv_a_proj_with_mqa: String,
    pub kv_a_layernorm: String,
    pub kv_b_proj: String,
    /// K3's output gate `g_proj.weight` (`mla_use_output_gate`).
    pub g_proj: String,
    pub o_proj: String,
}

impl MlaTensorNames {
    /// Names under `prefix` (for example `model.layers.3.self_attn`).
    pub fn new(prefix: &str) -> Self {
        let n = |s: &str| format!("{prefix}.{s}");
        MlaTensorNames {
            q_proj: n("q_proj.weight"),
            q_a_proj: n("q_a_proj.weight"),
            q_a_layernorm: n("q_a_layernorm.weight"),
            q_b_proj: n("q_b_proj.weight"),
            kv_a_proj_with_mqa: n("kv_a_proj_with_mqa.weight"),
            kv_a_layernorm: n("kv_a_layernorm.weight"),
            kv_b_proj: n("kv_b_proj.weight"),
            g_proj: n("g_proj.weight"),
            o_proj: n("o_proj.weight"),
        }
    }
}

/// Which of MLA's optional tensors a layer has, as its config says.
#[derive(Debug, Clone, Copy)]
pub struct MlaVariant {
    /// `q_lora_rank` is set: the query goes through `q_a_proj`, `q_a_layernorm` and `q_b_proj`;
    /// else through `q_proj`.
    pub q_lora: bool,
    /// K3's `mla_use_output_gate`: the output is gated by `g_proj`.
    pub output_gate: bool,
}

impl MlaTensors {
    /// Resolves the tensors named by `n` that `variant` reads, in `bb`, once at load.
    ///
    /// Errors: a missing or malformed tensor (named; the name carries the layer).
    pub fn resolve(bb: &Backbone, n: &MlaTensorNames, variant: MlaVariant) -> Result<Self, FormatError> {
        Ok(MlaTensors {
            query: if variant.q_lora {
                MlaQueryTensors::Lora {
                    q_a_proj: bb.matrix_handle(&n.q_a_proj)?,
                    q_a_layernorm: bb.vector_handle(&n.q_a_layernorm)?,
                    q_b_proj: bb.matrix_handle(&n.q_b_proj)?,
                }
            } else {
                MlaQueryTensors::Plain {
                    q_proj: bb.matrix_handle(&n.q_proj)?,
                }
            },
            kv_a_proj_with_mqa: bb.matrix_handle(&n.kv_a_proj_with_mqa)?,
            kv_a_layernorm: bb.vector_handle(&n.kv_a_layernorm)?,
            kv_b_proj: bb.matrix_handle(&n.kv_b_proj)?,
            o_proj: bb.matrix_handle(&n.o_proj)?,
            g_proj: if variant.output_gate {
                Some(bb.matrix_handle(&n.g_proj)?)
            } else {
                None
            },
        })
    }

    /// The weights as views into `bb`, the backbone that resolved them.
    pub fn view<'a>(&self, bb: &'a Backbone) -> MlaWeights<'a> {
        MlaWeights {
            query: match &self.query {
                MlaQueryTensors::Lora {
                    q_a_proj,
                    q_a_layernorm,
                    q_b_proj,
                } => MlaQuery::Lora {
                    a: bb.mat(q_a_proj),
                    norm: bb.vec(q_a_layernorm),
                    b: bb.mat(q_b_proj),
                },
                MlaQueryTensors::Plain { q_proj } => MlaQuery::Plain(bb.mat(q_proj)),
            },
            kv_a_proj_with_mqa: bb.mat(&self.kv_a_proj_with_mqa),
            kv_a_layernorm: bb.vec(&self.kv_a_layernorm),
            kv_b_proj: bb.mat(&self.kv_b_proj),
            o_proj: bb.mat(&self.o_proj),
            g_proj: self.g_proj.as_ref().map(|g| bb.mat(g)),
        }
    }
}

/// MLA of one token at position `pos` (the cache holds positions `0..pos`): appends its latent
/// to `c_kv` (`[positions, kv_lora_rank]`) and its key part to `k_pe` (`[positions, rope]`,
/// rotated when the shape has RoPE), then attends causally over `0..=pos`. `eps` is the latent
/// norms' eps. xn: `[hidden]` → `[hidden]`.
pub fn mla_token(
    shape: &MlaShape<'_>,
    w: &MlaWeights<'_>,
    eps: f32,
    xn: &[f32],
    pos: usize,
    c_kv: &mut Vec<f32>,
    k_pe: &mut Vec<f32>,
) -> Vec<f32> {
    let (nh, nope, rope, vd, kvl) = (
        shape.n_heads,
        shape.nope,
        shape.rope,
        shape.v_head_dim,
        shape.kv_lora_rank,
    );
    let qk = nope + rope;
    // q: [n_heads, qk_head_dim]
    let mut q = vec![0f32; nh * qk];
    match &w.query {
        MlaQuery::Lora { a, norm, b } => {
            let mut qa = vec![0f32; a.rows];
            a.matvec(xn, &mut qa);
            let mut qan = vec![0f32; a.rows];
            rms_norm(&qa, norm, eps, &mut qan);
            b.matvec(&qan, &mut q);
        }
        MlaQuery::Plain(q_proj) => q_proj.matvec(xn, &mut q),
    }
    // compressed_kv: [kv_lora_rank + qk_rope_head_dim]; the latent is normalised, k_pe rotated.
    let mut ckv = vec![0f32; kvl + rope];
    w.kv_a_proj_with_mqa.matvec(xn, &mut ckv);
    let mut latent = vec![0f32; kvl];
    rms_norm(&ckv[..kvl], w.kv_a_layernorm, eps, &mut latent);
    let mut kp = ckv[kvl..].to_vec();
    if let Some(r) = shape.rotary {
        r.apply(&mut kp, pos);
    }
    c_kv.extend_from_slice(&latent);
    k_pe.extend_from_slice(&kp);
    let (ckv_cache, kpe_cache) = (&*c_kv, &*k_pe);
    // flat: [n_heads · v_head_dim]
    let heads: Vec<Vec<f32>> = (0..nh)
        .into_par_iter()
        .map(|hh| {
            attend_head(
                shape,
                w.kv_b_proj,
                hh,
                &q[hh * qk..(hh + 1) * qk],
                pos,
                ckv_cache,
                kpe_cache,
            )
        })
        .collect();
    let mut flat: Vec<f32> = heads.concat();
    if let Some(g_proj) = w.g_proj {
        // o ⊙ σ(x W_gᵀ)
        let mut g = vec![0f32; nh * vd];
        g_proj.matvec(xn, &mut g);
        for (o, gi) in flat.iter_mut().zip(&g) {
            *o *= sigmoid(*gi);
        }
    }
    let mut out = vec![0f32; w.o_proj.rows];
    w.o_proj.matvec(&flat, &mut out);
    out
}

/// One head of MLA for the query at position `pos` over cached positions `0..=pos` (causal),
/// in the weight-absorbed order: `q_head: [qk_head_dim]` (before RoPE) → `[v_head_dim]`.
/// [MLA_ABSORB]
fn attend_head(
    shape: &MlaShape<'_>,
    kv_b: MatRef<'_>,
    hh: usize,
    q_head: &[f32],
    pos: usize,
    ckv: &[f32],
    kpe: &[f32],
) -> Vec<f32> {
    let (nope, rope, vd, kvl) = (shape.nope, shape.rope, shape.v_head_dim, shape.kv_lora_rank);
    let mut q_pe = q_head[nope..].to_vec();
    if let Some(r) = shape.rotary {
        r.apply(&mut q_pe, pos);
    }
    let base = hh * (nope + vd);
    // q_abs = W_UK_hᵀ q_nope: [kv_lora_rank]
    let mut q_abs = vec![0f32; kvl];
    kv_b.rows(base, base + nope).matvec_t(&q_head[..nope], &mut q_abs);
    // scores[t] = (q_abs · c_t + q_pe · k_pe_t) · scale, t ≤ pos
    let mut scores: Vec<f32> = (0..=pos)
        .map(|t| {
            let s = deltafin_kernels::dot(&q_abs, &ckv[t * kvl..(t + 1) * kvl])
                + deltafin_kernels::dot(&q_pe, &kpe[t * rope..(t + 1) * rope]);
            s * shape.scale
        })
        .collect();
    softmax_inplace(&mut scores);
    // ctx = Σ_t p_t c_t: [kv_lora_rank]; o_h = W_UV_h ctx: [v_head_dim]
    let mut ctx = vec![0f32; kvl];
    for (t, p) in scores.iter().enumerate() {
        deltafin_kernels::axpy(*p, &ckv[t * kvl..(t + 1) * kvl], &mut ctx);
    }
    let mut o = vec![0f32; vd];
    kv_b.rows(base + nope, base + nope + vd).matvec(&ctx, &mut o);
    o
}

/// [`mla_token`] for a chunk of `nt` tokens at positions `pos0..pos0 + nt`: the projections as
/// matrix-matrix products, the chunk's latents and key parts appended to the cache, then tiles
/// of tokens (all heads) in parallel through [`mla_chunk`] in `form`.
/// With the exact form each token's result equals [`mla_token`]'s bit for bit (`matmul` rows
/// equal `matvec`, the same per-(token, head) operations). xn: `[nt, hidden]` → `[nt, hidden]`.
#[allow(clippy::too_many_arguments)]
pub fn mla_chunk_layer(
    shape: &MlaShape<'_>,
    w: &MlaWeights<'_>,
    eps: f32,
    xn: &[f32],
    nt: usize,
    pos0: usize,
    c_kv: &mut Vec<f32>,
    k_pe: &mut Vec<f32>,
    form: MlaForm,
) -> Vec<f32> {
    let (nh, rope, vd, kvl) = (shape.n_heads, shape.rope, shape.v_head_dim, shape.kv_lora_rank);
    // q: [nt, n_heads · qk_head_dim]
    let q = w.query.project(xn, nt, eps);
    // compressed_kv: [nt, kv_lora_rank + qk_rope_head_dim]
    let mut ckv = vec![0f32; nt * (kvl + rope)];
    w.kv_a_proj_with_mqa.matmul(xn, nt, &mut ckv);
    let mut latent = vec![0f32; kvl];
    for (i, row) in ckv.chunks_exact(kvl + rope).enumerate() {
        rms_norm(&row[..kvl], w.kv_a_layernorm, eps, &mut latent);
        let mut kp = row[kvl..].to_vec();
        if let Some(r) = shape.rotary {
            r.apply(&mut kp, pos0 + i);
        }
        c_kv.extend_from_slice(&latent);
        k_pe.extend_from_slice(&kp);
    }
    // flat: [nt, n_heads · v_head_dim], token-major (the one-token layout per token)
    let mut flat = mla_chunk(shape, w.kv_b_proj, &q, pos0, c_kv, k_pe, form);
    if let Some(g_proj) = w.g_proj {
        let mut g = vec![0f32; nt * nh * vd];
        g_proj.matmul(xn, nt, &mut g);
        for (o, gi) in flat.iter_mut().zip(&g) {
            *o *= sigmoid(*gi);
        }
    }
    let mut out = vec![0f32; nt * w.o_proj.rows];
    w.o_proj.matmul(&flat, nt, &mut out);
    out
}

/// The query projection of an MLA layer: with a query LoRA (`q_lora_rank` set), `q_a_proj`
/// `[q_lora_rank, hidden]`, `q_a_layernorm` `[q_lora_rank]` and `q_b_proj`
/// `[n_heads · qk_head_dim, q_lora_rank]`; without, `q_proj` `[n_heads · qk_head_dim, hidden]`.
pub enum MlaQuery<'a> {
    Lora {
        a: MatRef<'a>,
        norm: &'a [f32],
        b: MatRef<'a>,
    },
    Plain(MatRef<'a>),
}

impl MlaQuery<'_> {
    /// Queries of `nt` tokens: `q_b(rms_norm(q_a · x; eps))` or `q_proj · x`, row by row as the
    /// one-token path computes them (`matmul` rows equal `matvec`). xn: `[nt, hidden]` →
    /// `[nt, n_heads · qk_head_dim]`.
    ///
    /// Source: transformers `DeepseekV3Attention` / `KimiMLAAttention` (`q_b_proj(q_a_layernorm(q_a_proj(x)))`).
    pub fn project(&self, xn: &[f32], nt: usize, eps: f32) -> Vec<f32> {
        match self {
            MlaQuery::Lora { a, norm, b } => {
                let r = a.rows;
                let mut qa = vec![0f32; nt * r];
                a.matmul(xn, nt, &mut qa);
                let mut qan = vec![0f32; nt * r];
                for (x, y) in qa.chunks_exact(r).zip(qan.chunks_exact_mut(r)) {
                    rms_norm(x, norm, eps, y);
                }
                let mut q = vec![0f32; nt * b.rows];
                b.matmul(&qan, nt, &mut q);
                q
            }
            MlaQuery::Plain(m) => {
                let mut q = vec![0f32; nt * m.rows];
                m.matmul(xn, nt, &mut q);
                q
            }
        }
    }
}

/// Shape of a weight-absorbed MLA block (DeepSeek-V2 §2.1, arXiv:2405.04434; [MLA_ABSORB]) for
/// [`mla_tile`].
#[derive(Clone, Copy)]
pub struct MlaShape<'a> {
    pub n_heads: usize,
    pub nope: usize,
    /// `qk_rope_head_dim`: the shared-key part of each query.
    pub rope: usize,
    pub v_head_dim: usize,
    pub kv_lora_rank: usize,
    /// Softmax scale.
    pub scale: f32,
    /// RoPE of the shared-key part at the query's position (DeepSeek-V3); None: no rotation
    /// (Kimi's NoPE MLA, where that part is a plain shared-key dot product).
    pub rotary: Option<&'a RotaryEmbedding>,
}

/// Weight-absorbed MLA of a tile of `q.len() / (n_heads · qk_head_dim)` consecutive tokens at
/// positions `pos0..`, every head, over the cached latents `ckv: [n_cached, kv_lora_rank]` and
/// shared keys `kpe: [n_cached, rope]` (which already hold the tile): `q: [tokens, n_heads *
/// qk_head_dim]` (before rope) → `out: [tokens, n_heads * v_head_dim]`. Per (token, head): the
/// absorbed query `q_abs = W_UK_h^T q_nope` (`kv_b` rows `h·(nope + v) ..+ nope`), scores
/// `(q_abs · c_t + q_pe · k_pe_t) · scale` over `t ≤ pos`, softmax, `ctx = Σ_t p_t c_t` in
/// ascending `t`, `o_h = W_UV_h ctx` — the operations of the one-token path
/// (`DeepseekV3::attend_head`, `KimiLinear::mla`), scheduled by [`attend_rows`], so each row is
/// bit-identical to it. `w_uk`: the `W_UK` rows of every head decoded once by the caller
/// ([`decode_w_uk`]), so `q_abs` is `matvec_t` over f32 rows — the same multiply-then-add
/// sequence as over `kv_b`'s own rows, without decoding them again for every (token, head).
/// `scores` is scratch.
#[allow(clippy::too_many_arguments)]
pub fn mla_tile(
    shape: &MlaShape<'_>,
    kv_b: MatRef<'_>,
    w_uk: &[f32],
    q: &[f32],
    pos0: usize,
    ckv: &[f32],
    kpe: &[f32],
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    let (nh, nope, rope, vd, kvl) = (
        shape.n_heads,
        shape.nope,
        shape.rope,
        shape.v_head_dim,
        shape.kv_lora_rank,
    );
    let qk = nope + rope;
    let rows = q.len() / qk;
    // Per row (token, head): the absorbed query [kv_lora_rank] and the (rotated) rope query.
    let mut q_abs = vec![0f32; rows * kvl];
    let mut q_pe = vec![0f32; rows * rope];
    for (r, qa) in q_abs.chunks_exact_mut(kvl).enumerate() {
        let (t, hh) = (r / nh, r % nh);
        let qh = &q[r * qk..(r + 1) * qk];
        let qp = &mut q_pe[r * rope..(r + 1) * rope];
        qp.copy_from_slice(&qh[nope..]);
        if let Some(rot) = shape.rotary {
            rot.apply(qp, pos0 + t);
        }
        let w = &w_uk[hh * nope * kvl..(hh + 1) * nope * kvl];
        MatRef::new(nope, kvl, deltafin_kernels::MatData::F32(w))
            .expect("W_UK rows")
            .matvec_t(&qh[..nope], qa);
    }
    let windows: Vec<(usize, usize)> = (0..rows).map(|r| (0, pos0 + r / nh + 1)).collect();
    let mut ctx = vec![0f32; rows * kvl];
    attend_rows(
        &windows,
        AbsorbedScores {
            q_abs: &q_abs,
            q_pe: &q_pe,
            ckv,
            kpe,
            kvl,
            rope,
            scale: shape.scale,
        },
        |_, s| softmax_inplace(s),
        Values {
            data: ckv,
            stride: kvl,
            offset: 0,
            width: kvl,
        },
        scores,
        &mut ctx,
    );
    // o_h = W_UV_h ctx: [v_head_dim]
    for (r, (o, cx)) in out.chunks_exact_mut(vd).zip(ctx.chunks_exact(kvl)).enumerate() {
        let base = (r % nh) * (nope + vd);
        kv_b.rows(base + nope, base + nope + vd).matvec(cx, o);
    }
}

/// How a batched MLA pass (a chunk of tokens) computes attention. The one-token path always
/// uses the weight-absorbed form.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum MlaForm {
    /// [`MlaForm::Decompressed`] for chunks of at least [`DECOMPRESSED_MIN_TOKENS`] tokens
    /// when [`decompressed_pays`] says it needs at most 80 % of the absorbed form's
    /// multiply-adds (long prompt chunks), [`MlaForm::Absorbed`] otherwise (speculative
    /// verification, short chunks).
    #[default]
    Auto,
    /// Weight-absorbed ([`mla_tile`]): each position bit-identical to the one-token path.
    Absorbed,
    /// Keys and values decompressed through `kv_b_proj` for every position, then plain
    /// multi-head attention ([`mla_decompressed`]): equal to the absorbed form within f32
    /// rounding (a different association of the same products), not bit for bit.
    Decompressed,
}

impl MlaForm {
    /// Whether a batched pass of `nt` tokens after `pos0` cached positions computes MLA in the
    /// decompressed form: always for [`MlaForm::Decompressed`], never for
    /// [`MlaForm::Absorbed`], and for [`MlaForm::Auto`] from [`DECOMPRESSED_MIN_TOKENS`] tokens
    /// when [`decompressed_pays`]. The CPU's [`mla_chunk`] and the CUDA path decide alike.
    pub fn decompressed_for(self, shape: &MlaShape<'_>, nt: usize, pos0: usize) -> bool {
        match self {
            MlaForm::Auto => nt >= DECOMPRESSED_MIN_TOKENS && decompressed_pays(shape, nt, pos0),
            MlaForm::Absorbed => false,
            MlaForm::Decompressed => true,
        }
    }
}

/// Chunk length from which [`MlaForm::Auto`] may pick the decompressed form: above every
/// speculative verification pass (at most `MAX_DRAFT + 1` tokens, asserted where speculation
/// defines `MAX_DRAFT`), which therefore stays bit-identical to token-at-a-time decoding.
pub const DECOMPRESSED_MIN_TOKENS: usize = 16;

/// Whether the decompressed form needs at most 80 % of the absorbed form's multiply-adds for
/// a chunk of `nt` tokens after `pos0` cached positions. Per head, with `P = Σ_i (pos0 + i + 1)`
/// (query, key) pairs: absorbed `P · (2 · kv_lora_rank + rope) + nt · 2 · nope · kv_lora_rank`
/// (scores and weighted sum over the latents, query absorption and `W_UV`); decompressed
/// `(pos0 + nt) · (nope + v_head_dim) · kv_lora_rank + P · (nope + rope + v_head_dim)`
/// (`kv_b_proj` over every position, then scores and weighted sum per head). DeepSeek-V2 §2.1
/// (arXiv:2405.04434) gives both forms; vLLM and FlashMLA use the decompressed one for prefill.
pub fn decompressed_pays(shape: &MlaShape<'_>, nt: usize, pos0: usize) -> bool {
    let (nt, pos0) = (nt as f64, pos0 as f64);
    let (nope, rope, vd, kvl) = (
        shape.nope as f64,
        shape.rope as f64,
        shape.v_head_dim as f64,
        shape.kv_lora_rank as f64,
    );
    let pairs = nt * pos0 + nt * (nt + 1.0) / 2.0;
    let absorbed = pairs * (2.0 * kvl + rope) + nt * 2.0 * nope * kvl;
    let decompressed = (pos0 + nt) * (nope + vd) * kvl + pairs * (nope + rope + vd);
    decompressed * 5.0 <= absorbed * 4.0
}

/// MLA of a chunk of `nt = q.len() / (n_heads · qk_head_dim)` tokens at positions
/// `pos0..pos0 + nt` over the cache `ckv: [pos0 + nt, kv_lora_rank]`, `kpe: [pos0 + nt, rope]`
/// (which already hold the chunk), every head, causal: `q: [nt, n_heads · qk_head_dim]` (before
/// rope) → `[nt, n_heads · v_head_dim]`, in the form `form` picks. Token tiles run in parallel
/// on the rayon pool.
pub fn mla_chunk(
    shape: &MlaShape<'_>,
    kv_b: MatRef<'_>,
    q: &[f32],
    pos0: usize,
    ckv: &[f32],
    kpe: &[f32],
    form: MlaForm,
) -> Vec<f32> {
    let (nh, qk, vd) = (shape.n_heads, shape.nope + shape.rope, shape.v_head_dim);
    let nt = q.len() / (nh * qk);
    let decompressed = form.decompressed_for(shape, nt, pos0);
    let mut out = vec![0f32; nt * nh * vd];
    if decompressed {
        mla_decompressed(shape, kv_b, q, pos0, ckv, kpe, &mut out);
        return out;
    }
    let w_uk = decode_w_uk(shape, kv_b);
    // Blocked: a tile of tokens with all their heads shares every latent tile; tiles in
    // parallel (several per thread, the later ones see more keys).
    let threads = rayon::current_num_threads().max(1);
    let tile = tokens_per_item(nt, nh, pos0 + nt, threads);
    out.par_chunks_mut(tile * nh * vd)
        .enumerate()
        .for_each_init(Vec::new, |scores, (i, o)| {
            let t0 = i * tile;
            let t1 = (t0 + tile).min(nt);
            mla_tile(
                shape,
                kv_b,
                &w_uk,
                &q[t0 * nh * qk..t1 * nh * qk],
                pos0 + t0,
                ckv,
                kpe,
                scores,
                o,
            );
        });
    out
}

/// The `W_UK` rows of every head of `kv_b` (`[n_heads · (nope + v_head_dim), kv_lora_rank]`:
/// per head `nope` key rows, then `v_head_dim` value rows) decoded to f32 exactly
/// ([`MatRef::row_into`]): `[n_heads · nope, kv_lora_rank]`.
pub fn decode_w_uk(shape: &MlaShape<'_>, kv_b: MatRef<'_>) -> Vec<f32> {
    let (nh, nope, vd, kvl) = (shape.n_heads, shape.nope, shape.v_head_dim, shape.kv_lora_rank);
    let mut w = vec![0f32; nh * nope * kvl];
    for (i, row) in w.chunks_exact_mut(kvl.max(1)).enumerate() {
        let (h, j) = (i / nope, i % nope);
        kv_b.row_into(h * (nope + vd) + j, row);
    }
    w
}

/// Tokens per work item of [`mla_decompressed`].
const DQT: usize = 32;

/// MLA of a chunk in the decompressed (multi-head) form, for [`mla_chunk`]: `kv = kv_b_proj ·
/// c_t` for every cached position `t` (`[n_heads · (nope + v_head_dim)]`: per head `k_nope`
/// then `v`), keys `[k_nope_h(t), k_pe(t)]`, queries `[q_nope, rope(q_pe)]`, scores `q · k ·
/// scale` over `t ≤ pos` (each an FMA chain over the key dimension in order), softmax, `o_h =
/// Σ_t p_t v_h(t)` (FMAs in ascending `t`). Same shapes as [`mla_chunk`]; `out` is
/// overwritten. The arithmetic is the same on every SIMD level and thread count (vector lanes
/// run over keys or value elements, never inside one sum).
///
/// Source: the MHA form of MLA, DeepSeek-V2 §2.1 (arXiv:2405.04434), eq. 12–19; transformers
/// `DeepseekV3Attention` computes attention this way.
pub fn mla_decompressed(
    shape: &MlaShape<'_>,
    kv_b: MatRef<'_>,
    q: &[f32],
    pos0: usize,
    ckv: &[f32],
    kpe: &[f32],
    out: &mut [f32],
) {
    let (nh, nope, rope, vd, kvl) = (
        shape.n_heads,
        shape.nope,
        shape.rope,
        shape.v_head_dim,
        shape.kv_lora_rank,
    );
    let dk = nope + rope;
    let nt = q.len() / (nh * dk);
    let n_ctx = pos0 + nt;
    assert_eq!(ckv.len(), n_ctx * kvl, "mla_decompressed: latent cache length");
    assert_eq!(kpe.len(), n_ctx * rope, "mla_decompressed: rope key cache length");
    assert_eq!(out.len(), nt * nh * vd, "mla_decompressed: out length");
    if nt == 0 {
        return;
    }
    // kv: [n_ctx, n_heads * (nope + v_head_dim)]
    let kw = nh * (nope + vd);
    let mut kv = vec![0f32; n_ctx * kw];
    kv_b.matmul(ckv, n_ctx, &mut kv);
    // Per head: keys transposed [dk, n_pad] (zero-padded to whole key blocks), values
    // [n_ctx, vd_pad] (zero-padded to whole 16-lane blocks).
    let n_pad = n_ctx.next_multiple_of(DKB);
    let vd_pad = vd.next_multiple_of(16);
    let mut kt = vec![0f32; nh * dk * n_pad];
    let mut vv = vec![0f32; nh * n_ctx * vd_pad];
    kt.par_chunks_mut(dk * n_pad)
        .zip(vv.par_chunks_mut(n_ctx * vd_pad))
        .enumerate()
        .for_each(|(h, (kth, vh))| {
            for t in 0..n_ctx {
                let row = &kv[t * kw + h * (nope + vd)..][..nope + vd];
                for (d, &k) in row[..nope].iter().enumerate() {
                    kth[d * n_pad + t] = k;
                }
                for (d, &k) in kpe[t * rope..(t + 1) * rope].iter().enumerate() {
                    kth[(nope + d) * n_pad + t] = k;
                }
                vh[t * vd_pad..t * vd_pad + vd].copy_from_slice(&row[nope..]);
            }
        });
    drop(kv);
    // Queries per head, rope applied: [n_heads, nt, dk].
    let mut qh = vec![0f32; nh * nt * dk];
    for t in 0..nt {
        for h in 0..nh {
            let dst = &mut qh[(h * nt + t) * dk..(h * nt + t + 1) * dk];
            dst.copy_from_slice(&q[(t * nh + h) * dk..(t * nh + h + 1) * dk]);
            if let Some(rot) = shape.rotary {
                rot.apply(&mut dst[nope..], pos0 + t);
            }
        }
    }
    let scale = shape.scale;
    out.par_chunks_mut(DQT * nh * vd)
        .enumerate()
        .for_each_init(Vec::new, |scores: &mut Vec<f32>, (i, o)| {
            let t0 = i * DQT;
            let tn = o.len() / (nh * vd);
            // Row r (token t0 + r) sees keys 0..pos0 + t0 + r + 1.
            let wmax = pos0 + t0 + tn;
            let wpad = wmax.next_multiple_of(DKB);
            scores.clear();
            scores.resize(tn * wpad, 0.0);
            let mut ctx = vec![0f32; DRB * vd_pad];
            for h in 0..nh {
                let kth = &kt[h * dk * n_pad..(h + 1) * dk * n_pad];
                let vh = &vv[h * n_ctx * vd_pad..(h + 1) * n_ctx * vd_pad];
                let qt = &qh[(h * nt + t0) * dk..(h * nt + t0 + tn) * dk];
                for r0 in (0..tn).step_by(DRB) {
                    let rn = DRB.min(tn - r0);
                    let wb = pos0 + t0 + r0 + rn; // the block's widest window
                    let sb = &mut scores[r0 * wpad..(r0 + rn) * wpad];
                    qk_block(&qt[r0 * dk..(r0 + rn) * dk], dk, kth, n_pad, wb, wpad, scale, sb);
                    for r in 0..rn {
                        let w = pos0 + t0 + r0 + r + 1;
                        let row = &mut sb[r * wpad..(r + 1) * wpad];
                        softmax_inplace(&mut row[..w]);
                        row[w..].fill(0.0);
                    }
                    ctx[..rn * vd_pad].fill(0.0);
                    pv_block(sb, wpad, rn, vh, vd_pad, wb, &mut ctx[..rn * vd_pad]);
                    for r in 0..rn {
                        let dst = &mut o[(r0 + r) * nh * vd + h * vd..][..vd];
                        dst.copy_from_slice(&ctx[r * vd_pad..r * vd_pad + vd]);
                    }
                }
            }
        });
}

/// Weight-absorbed MLA logits: row `r`'s `(q_abs_r · c_t + q_pe_r · k_pe_t) · scale`, the
/// one-token path's formula (`dot` of each part, then the sum, then the scale); pairs of rows
/// and keys through [`deltafin_kernels::dot_2x2`], which equals those `dot`s bit for bit.
struct AbsorbedScores<'a> {
    q_abs: &'a [f32],
    q_pe: &'a [f32],
    ckv: &'a [f32],
    kpe: &'a [f32],
    kvl: usize,
    rope: usize,
    scale: f32,
}

impl RowScorer for AbsorbedScores<'_> {
    fn score(&self, r: usize, t: usize) -> f32 {
        let (kvl, rope) = (self.kvl, self.rope);
        let s = dot(&self.q_abs[r * kvl..(r + 1) * kvl], &self.ckv[t * kvl..(t + 1) * kvl])
            + dot(
                &self.q_pe[r * rope..(r + 1) * rope],
                &self.kpe[t * rope..(t + 1) * rope],
            );
        s * self.scale
    }

    fn score_2x2(&self, r: usize, t: usize) -> [f32; 4] {
        let (kvl, rope) = (self.kvl, self.rope);
        let c = dot_2x2(
            &self.q_abs[r * kvl..(r + 1) * kvl],
            &self.q_abs[(r + 1) * kvl..(r + 2) * kvl],
            &self.ckv[t * kvl..(t + 1) * kvl],
            &self.ckv[(t + 1) * kvl..(t + 2) * kvl],
        );
        let p = dot_2x2(
            &self.q_pe[r * rope..(r + 1) * rope],
            &self.q_pe[(r + 1) * rope..(r + 2) * rope],
            &self.kpe[t * rope..(t + 1) * rope],
            &self.kpe[(t + 1) * rope..(t + 2) * rope],
        );
        [0, 1, 2, 3].map(|i| (c[i] + p[i]) * self.scale)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The decompressed form against the absorbed one (which the one-token path equals bit for
    /// bit): same chunk, odd shapes (value width not a multiple of 16, a context that is not a
    /// whole number of key blocks, a cached prefix), with and without RoPE on the shared key.
    /// Relative L2 per output row below 1e-5; and `decompressed_pays` on hand-worked shapes.
    #[test]
    fn decompressed_equals_absorbed_within_rounding() {
        let mut seed = 11u32;
        let mut rnd = || {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (seed >> 8) as f32 / (1u32 << 24) as f32 - 0.5
        };
        let rope_cfg = deltafin_format::Rope::Default { theta: 10000.0 };
        for (nh, nope, rope, vd, kvl, pos0, nt, rotate) in [
            (3, 8, 4, 12, 20, 0, 37, true),
            (2, 16, 8, 40, 32, 29, 45, true),
            (4, 6, 2, 5, 9, 3, 70, false),
        ] {
            let rot = RotaryEmbedding::new(&rope_cfg, rope, false);
            let shape = MlaShape {
                n_heads: nh,
                nope,
                rope,
                v_head_dim: vd,
                kv_lora_rank: kvl,
                scale: 0.7,
                rotary: rotate.then_some(&rot),
            };
            let n_ctx = pos0 + nt;
            let w: Vec<f32> = (0..nh * (nope + vd) * kvl).map(|_| rnd()).collect();
            let kv_b = MatRef::new(nh * (nope + vd), kvl, deltafin_kernels::MatData::F32(&w)).unwrap();
            let ckv: Vec<f32> = (0..n_ctx * kvl).map(|_| rnd() * 2.0).collect();
            let kpe: Vec<f32> = (0..n_ctx * rope).map(|_| rnd() * 2.0).collect();
            let q: Vec<f32> = (0..nt * nh * (nope + rope)).map(|_| rnd() * 3.0).collect();
            let a = mla_chunk(&shape, kv_b, &q, pos0, &ckv, &kpe, MlaForm::Absorbed);
            let d = mla_chunk(&shape, kv_b, &q, pos0, &ckv, &kpe, MlaForm::Decompressed);
            assert_eq!(a.len(), d.len());
            for (r, (x, y)) in a.chunks(vd).zip(d.chunks(vd)).enumerate() {
                let num: f64 = x.iter().zip(y).map(|(p, q)| ((p - q) as f64).powi(2)).sum();
                let den: f64 = x.iter().map(|p| (*p as f64).powi(2)).sum();
                let rel = (num / den).sqrt();
                assert!(rel < 1e-5, "shape {nh}x{nope}+{rope}/{vd}, row {r}: rel L2 {rel:e}");
            }
            // Not bit for bit (a different association), or the test would not see the form.
            assert!(a.iter().zip(&d).any(|(p, q)| p.to_bits() != q.to_bits()));
        }
        // bench preset per head: nope 64, rope 32, v 64, kv_lora 256. A 2,000-token prompt:
        // decompressed 2000·128·256 + 2001000·160 = 385.7 M vs absorbed 2001000·544 +
        // 2000·2·64·256 = 1154.1 M multiply-adds: pays. Eight verified tokens after 2,000:
        // 2008·128·256 = 65.8 M + … vs 16036·544 + 8·32768 = 9.0 M: does not.
        let rot = RotaryEmbedding::new(&rope_cfg, 32, false);
        let bench = MlaShape {
            n_heads: 16,
            nope: 64,
            rope: 32,
            v_head_dim: 64,
            kv_lora_rank: 256,
            scale: 1.0,
            rotary: Some(&rot),
        };
        assert!(decompressed_pays(&bench, 2000, 0));
        assert!(!decompressed_pays(&bench, 8, 2000));
        assert!(!decompressed_pays(&bench, 1, 0));
    }
}
