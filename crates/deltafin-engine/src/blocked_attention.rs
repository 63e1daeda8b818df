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

use deltafin_kernels::attention::accumulate4;
pub use deltafin_kernels::attention::Values;
use deltafin_kernels::axpy;

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
    // Scores, key tile by key tile; rows with the same window in pairs, two keys at a time.
    for_each_tile(windows, |r, (s, e), (a, b)| {
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
            2
        } else {
            for t in a..b {
                scores[o0 + t - s] = score.score(r, t);
            }
            1
        }
    });
    for (r, &(s, e)) in windows.iter().enumerate() {
        softmax(r, &mut scores[offsets[r]..offsets[r] + e.saturating_sub(s)]);
    }
    // Weighted values, key tile by key tile; per output element ascending t. Runs of four
    // rows with the same window (the heads of one token) share each value load.
    for_each_tile(windows, |r, (s, e), (a, b)| {
        if r + 4 <= windows.len() && windows[r + 1..r + 4].iter().all(|&w| w == (s, e)) {
            let p = [0, 1, 2, 3].map(|i| &scores[offsets[r + i]..offsets[r + i] + e.saturating_sub(s)]);
            accumulate4(p, &values, s, a, b, &mut ctx[r * dv..(r + 4) * dv]);
            4
        } else {
            let row = &scores[offsets[r]..offsets[r] + e.saturating_sub(s)];
            let c = &mut ctx[r * dv..(r + 1) * dv];
            for t in a..b {
                axpy(row[t - s], values.row(t), c);
            }
            1
        }
    });
}

/// The schedule of both passes of [`attend_rows`]: the key positions every row of `windows`
/// sees, `lo..hi`, in tiles of [`KEY_TILE`], tile by tile in ascending order and, within a tile,
/// row by row. `visit(r, (start, end), (a, b))` handles row `r` (window `start..end`) on keys
/// `a..b` of the tile (empty when the window misses it) and returns how many rows, from `r` on,
/// it handled (rows with the same window are handled together).
fn for_each_tile(windows: &[(usize, usize)], mut visit: impl FnMut(usize, (usize, usize), (usize, usize)) -> usize) {
    let lo = windows.iter().map(|w| w.0).min().unwrap_or(0);
    let hi = windows.iter().map(|w| w.1).max().unwrap_or(0);
    let mut t0 = lo;
    while t0 < hi {
        let t1 = (t0 + KEY_TILE).min(hi);
        let mut r = 0;
        while r < windows.len() {
            let (s, e) = windows[r];
            r += visit(r, (s, e), (s.max(t0), e.min(t1)));
        }
        t0 = t1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use deltafin_kernels::{dot, softmax_inplace};

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
}
