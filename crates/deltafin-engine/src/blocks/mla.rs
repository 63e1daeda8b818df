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

use deltafin_kernels::{rms_norm, sigmoid, softmax_inplace, MatRef};
use rayon::prelude::*;

use crate::blocked_attention::{mla_chunk, MlaForm, MlaQuery, MlaShape};

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
/// of tokens (all heads) in parallel through [`crate::blocked_attention::mla_chunk`] in `form`.
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
