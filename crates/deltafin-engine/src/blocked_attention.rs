//! Blocked scaled-dot-product attention for many query rows over one set of cached keys and
//! values: the chunk of a batched pass (prompt prefill, speculative verification) attends to
//! the cached prefix and to itself, and every query head of the chunk that shares a key/value
//! head (GQA: the `n_heads / n_kv_heads` heads of a group; MLA: all heads, which share the
//! latents) reads the same keys.
//!
//! Streaming the keys once per (token, head) re-reads the whole cache `rows` times from wherever
//! it lives (L3 or DRAM once it outgrows L2). Here the keys are visited in tiles of
//! [`KEY_TILE`] positions; each tile is used by every query row before the next tile is loaded,
//! first for the scores, then (after each row's softmax) for the weighted sum of values.
//!
//! Exactness: the tiling only reorders *which* (row, key) pair is computed when, never the
//! arithmetic of one score or one output element. Every score is `score(row, t)` (the caller's
//! one-token formula, e.g. `dot(q, k_t) · scale`), each row's softmax sees its complete row, and
//! every output element is accumulated over `t` in ascending order with
//! [`deltafin_kernels::axpy`] (multiply, then add) — the same operations in the same order as the
//! per-(token, head) loop of the one-token path, so the result is bit-identical to it.
//!
//! Source: the query-tile × key-tile schedule of FlashAttention (Dao et al. 2022,
//! arXiv:2205.14135, Alg. 1) without its online softmax (which would change the summation
//! order): the full score row is kept, `[rows, window]` f32 per call.

pub use deltafin_kernels::attention::Values;
use deltafin_kernels::attention::{accumulate4, pv_block, qk_block, DKB, DRB};
use deltafin_kernels::{axpy, dot, dot_2x2, rms_norm, softmax_inplace, MatRef};
use rayon::prelude::*;

use crate::rope::RotaryEmbedding;

/// Key positions per tile: 64 GQA keys of 128 f32 (32 KiB) or 64 MLA latents of 512 f32
/// (128 KiB) stay in L2 while every query row of the call uses them.
pub const KEY_TILE: usize = 64;

/// Score rows × keys (f32) one work item may hold: 256 KiB, so a tile's scores stay in L2 next
/// to its key tiles.
pub const SCORES_PER_ITEM: usize = 1 << 16;

/// Tokens per work item of a batched pass of `nt` tokens whose rows (`heads` per token) see up
/// to `keys` positions: enough items for `threads` (about four each, the later ones see more
/// keys), at most 8 tokens, and at most [`SCORES_PER_ITEM`] scores (at least one token).
pub fn tokens_per_item(nt: usize, heads: usize, keys: usize, threads: usize) -> usize {
    let by_memory = SCORES_PER_ITEM / (heads.max(1) * keys.max(1));
    nt.div_ceil(4 * threads.max(1)).min(by_memory).clamp(1, 8)
}

/// The logits of query rows against key positions, for [`attend_rows`]. Any
/// `Fn(usize, usize) -> f32` is one.
pub trait RowScorer {
    /// Row `r`'s logit for key `t` (already scaled).
    fn score(&self, r: usize, t: usize) -> f32;

    /// `[score(r, t), score(r, t + 1), score(r + 1, t), score(r + 1, t + 1)]`, bit for bit;
    /// an implementation may share loads between the four.
    fn score_2x2(&self, r: usize, t: usize) -> [f32; 4] {
        [
            self.score(r, t),
            self.score(r, t + 1),
            self.score(r + 1, t),
            self.score(r + 1, t + 1),
        ]
    }
}

impl<F: Fn(usize, usize) -> f32> RowScorer for F {
    fn score(&self, r: usize, t: usize) -> f32 {
        self(r, t)
    }
}

/// Attention of `windows.len()` query rows over shared keys and values.
///
/// - `windows[r] = (start, end)`: row `r` attends to key positions `start..end` (ascending,
///   non-empty for a causal row: it includes the row's own position).
/// - `score`: row `r`'s logit for key `t` (already scaled), [`RowScorer::score`]; two
///   consecutive rows with the same window are scored two keys at a time
///   ([`RowScorer::score_2x2`]).
/// - `softmax(r, s)`: normalises row `r`'s logits `s: [end - start]` in place (plain softmax, or
///   with gpt-oss' sink).
/// - `values`: the value vector of position `t` is `values.row(t)`, `[dv]`.
/// - `scores`: scratch, grown to `Σ_r (end_r - start_r)` f32.
/// - `ctx: [rows, dv]`, must be zero on entry: `ctx[r] = Σ_t p_r[t] · value(t)` summed in
///   ascending `t` with `axpy`.
///
/// # Panics
/// If `ctx.len() != windows.len() * dv` or a value is not `[dv]`.
pub fn attend_rows<S, M>(
    windows: &[(usize, usize)],
    score: S,
    softmax: M,
    values: Values<'_>,
    scores: &mut Vec<f32>,
    ctx: &mut [f32],
) where
    S: RowScorer,
    M: Fn(usize, &mut [f32]),
{
    let dv = values.width;
    assert_eq!(ctx.len(), windows.len() * dv, "attend_rows: ctx length");
    if windows.is_empty() {
        return;
    }
    // offsets[r]: where row r's logits start in `scores`.
    let mut offsets = Vec::with_capacity(windows.len() + 1);
    let mut total = 0;
    for &(s, e) in windows {
        offsets.push(total);
        total += e.saturating_sub(s);
    }
    scores.clear();
    scores.resize(total, 0.0);
    let lo = windows.iter().map(|w| w.0).min().unwrap_or(0);
    let hi = windows.iter().map(|w| w.1).max().unwrap_or(0);
    // Scores, key tile by key tile; rows with the same window in pairs, two keys at a time.
    let mut t0 = lo;
    while t0 < hi {
        let t1 = (t0 + KEY_TILE).min(hi);
        let mut r = 0;
        while r < windows.len() {
            let (s, e) = windows[r];
            let (a, b) = (s.max(t0), e.min(t1));
            let (o0, paired) = (offsets[r], r + 1 < windows.len() && windows[r + 1] == (s, e));
            if paired {
                let o1 = offsets[r + 1];
                let mut t = a;
                while t + 2 <= b {
                    let v = score.score_2x2(r, t);
                    scores[o0 + t - s] = v[0];
                    scores[o0 + t + 1 - s] = v[1];
                    scores[o1 + t - s] = v[2];
                    scores[o1 + t + 1 - s] = v[3];
                    t += 2;
                }
                if t < b {
                    scores[o0 + t - s] = score.score(r, t);
                    scores[o1 + t - s] = score.score(r + 1, t);
                }
                r += 2;
            } else {
                for t in a..b {
                    scores[o0 + t - s] = score.score(r, t);
                }
                r += 1;
            }
        }
        t0 = t1;
    }
    for (r, &(s, e)) in windows.iter().enumerate() {
        softmax(r, &mut scores[offsets[r]..offsets[r] + e.saturating_sub(s)]);
    }
    // Weighted values, key tile by key tile; per output element ascending t. Runs of four
    // rows with the same window (the heads of one token) share each value load.
    let mut t0 = lo;
    while t0 < hi {
        let t1 = (t0 + KEY_TILE).min(hi);
        let mut r = 0;
        while r < windows.len() {
            let (s, e) = windows[r];
            let (a, b) = (s.max(t0), e.min(t1));
            if r + 4 <= windows.len() && windows[r + 1..r + 4].iter().all(|&w| w == (s, e)) {
                let p = [0, 1, 2, 3].map(|i| &scores[offsets[r + i]..offsets[r + i] + e.saturating_sub(s)]);
                accumulate4(p, &values, s, a, b, &mut ctx[r * dv..(r + 4) * dv]);
                r += 4;
            } else {
                let row = &scores[offsets[r]..offsets[r] + e.saturating_sub(s)];
                let c = &mut ctx[r * dv..(r + 1) * dv];
                for t in a..b {
                    axpy(row[t - s], values.row(t), c);
                }
                r += 1;
            }
        }
        t0 = t1;
    }
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
    let decompressed = match form {
        MlaForm::Auto => nt >= DECOMPRESSED_MIN_TOKENS && decompressed_pays(shape, nt, pos0),
        MlaForm::Absorbed => false,
        MlaForm::Decompressed => true,
    };
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

    /// Against the per-row loop (scores, softmax, axpy in t order), bit for bit, with windows
    /// of different lengths that straddle several key tiles.
    #[test]
    fn equals_the_per_row_loop_bit_for_bit() {
        let (d, n) = (24, 3 * KEY_TILE + 5);
        let mut seed = 7u32;
        let mut rnd = || {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (seed >> 8) as f32 / (1u32 << 24) as f32 - 0.5
        };
        let keys: Vec<f32> = (0..n * d).map(|_| rnd()).collect();
        let vals: Vec<f32> = (0..n * d).map(|_| rnd()).collect();
        // Pairs of equal windows take the two-rows-two-keys path (odd and even lengths).
        let windows = [
            (0, 1),
            (0, 1),
            (0, n),
            (10, KEY_TILE + 3),
            (10, KEY_TILE + 3),
            (KEY_TILE - 1, 2 * KEY_TILE + 9),
            (KEY_TILE - 1, 2 * KEY_TILE + 10),
            (n - 1, n),
        ];
        let qs: Vec<f32> = (0..windows.len() * d).map(|_| rnd() * 4.0).collect();
        let score = |r: usize, t: usize| dot(&qs[r * d..(r + 1) * d], &keys[t * d..(t + 1) * d]) * 0.3;
        let mut ctx = vec![0f32; windows.len() * d];
        let mut scratch = Vec::new();
        attend_rows(
            &windows,
            score,
            |_, s| softmax_inplace(s),
            Values {
                data: &vals,
                stride: d,
                offset: 0,
                width: d,
            },
            &mut scratch,
            &mut ctx,
        );
        for (r, &(s, e)) in windows.iter().enumerate() {
            let mut sc: Vec<f32> = (s..e).map(|t| score(r, t)).collect();
            softmax_inplace(&mut sc);
            let mut want = vec![0f32; d];
            for (i, p) in sc.iter().enumerate() {
                axpy(*p, &vals[(s + i) * d..(s + i + 1) * d], &mut want);
            }
            let got = &ctx[r * d..(r + 1) * d];
            assert!(want.iter().zip(got).all(|(a, b)| a.to_bits() == b.to_bits()), "row {r}");
        }
    }

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
