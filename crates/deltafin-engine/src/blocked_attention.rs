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

use deltafin_kernels::{axpy, dot, rms_norm, softmax_inplace, MatRef};

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

/// Attention of `windows.len()` query rows over shared keys and values.
///
/// - `windows[r] = (start, end)`: row `r` attends to key positions `start..end` (ascending,
///   non-empty for a causal row: it includes the row's own position).
/// - `score(r, t)`: row `r`'s logit for key `t` (already scaled).
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
    S: Fn(usize, usize) -> f32,
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
    // Scores, key tile by key tile.
    let mut t0 = lo;
    while t0 < hi {
        let t1 = (t0 + KEY_TILE).min(hi);
        for (r, &(s, e)) in windows.iter().enumerate() {
            let (a, b) = (s.max(t0), e.min(t1));
            let row = &mut scores[offsets[r]..offsets[r] + e.saturating_sub(s)];
            for t in a..b {
                row[t - s] = score(r, t);
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
/// bit-identical to it. `scores` is scratch.
#[allow(clippy::too_many_arguments)]
pub fn mla_tile(
    shape: &MlaShape<'_>,
    kv_b: MatRef<'_>,
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
        let base = hh * (nope + vd);
        kv_b.rows(base, base + nope).matvec_t(&qh[..nope], qa);
    }
    let windows: Vec<(usize, usize)> = (0..rows).map(|r| (0, pos0 + r / nh + 1)).collect();
    let mut ctx = vec![0f32; rows * kvl];
    let scale = shape.scale;
    attend_rows(
        &windows,
        |r, t| {
            let s = dot(&q_abs[r * kvl..(r + 1) * kvl], &ckv[t * kvl..(t + 1) * kvl])
                + dot(&q_pe[r * rope..(r + 1) * rope], &kpe[t * rope..(t + 1) * rope]);
            s * scale
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

/// Value vectors at a fixed stride: position `t`'s is `data[t * stride + offset ..][..width]`
/// (GQA: one key/value head's slice of `[n_tokens, n_kv_heads * head_dim]`; MLA: the latents
/// `[n_tokens, kv_lora_rank]`).
#[derive(Debug, Clone, Copy)]
pub struct Values<'a> {
    pub data: &'a [f32],
    pub stride: usize,
    pub offset: usize,
    pub width: usize,
}

impl<'a> Values<'a> {
    /// Position `t`'s vector `[width]`.
    ///
    /// # Panics
    /// If it lies outside `data`.
    #[inline]
    pub fn row(&self, t: usize) -> &'a [f32] {
        let o = t * self.stride + self.offset;
        &self.data[o..o + self.width]
    }
}

/// `ctx[i] += Σ_{t ∈ a..b} p[i][t - s] · values.row(t)` for four rows `ctx: [4, width]`, every
/// element accumulated in ascending `t` as a multiply then an add — exactly the sequence of
/// [`axpy`] calls it replaces (which is "multiply, then add" on every SIMD level), so the bits
/// are the same; each value load serves the four rows. Compiled for AVX2 when the CPU has it
/// (plain Rust, no FMA contraction: Rust never fuses `a * b + c`).
fn accumulate4(p: [&[f32]; 4], values: &Values<'_>, s: usize, a: usize, b: usize, ctx: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 was detected at run time just above.
        unsafe { accumulate4_avx2(p, values, s, a, b, ctx) };
        return;
    }
    accumulate4_body(p, values, s, a, b, ctx);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn accumulate4_avx2(p: [&[f32]; 4], values: &Values<'_>, s: usize, a: usize, b: usize, ctx: &mut [f32]) {
    accumulate4_body(p, values, s, a, b, ctx);
}

#[inline(always)]
fn accumulate4_body(p: [&[f32]; 4], values: &Values<'_>, s: usize, a: usize, b: usize, ctx: &mut [f32]) {
    const CB: usize = 16;
    let dv = values.width;
    assert_eq!(ctx.len(), 4 * dv);
    for pi in &p {
        assert!(b <= s + pi.len() && a >= s);
    }
    let mut j = 0;
    while j + CB <= dv {
        let mut acc = [[0f32; CB]; 4];
        for (i, ai) in acc.iter_mut().enumerate() {
            ai.copy_from_slice(&ctx[i * dv + j..i * dv + j + CB]);
        }
        for t in a..b {
            let v: &[f32; CB] = values.row(t)[j..j + CB].try_into().expect("CB columns");
            let ps = [p[0][t - s], p[1][t - s], p[2][t - s], p[3][t - s]];
            for (ai, &pi) in acc.iter_mut().zip(&ps) {
                for k in 0..CB {
                    ai[k] += pi * v[k];
                }
            }
        }
        for (i, ai) in acc.iter().enumerate() {
            ctx[i * dv + j..i * dv + j + CB].copy_from_slice(ai);
        }
        j += CB;
    }
    for jj in j..dv {
        for (i, pi) in p.iter().enumerate() {
            let mut x = ctx[i * dv + jj];
            for t in a..b {
                x += pi[t - s] * values.row(t)[jj];
            }
            ctx[i * dv + jj] = x;
        }
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
        let windows = [
            (0, 1),
            (0, n),
            (10, KEY_TILE + 3),
            (KEY_TILE - 1, 2 * KEY_TILE + 9),
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
}
