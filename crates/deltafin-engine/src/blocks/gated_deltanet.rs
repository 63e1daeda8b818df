//! Gated DeltaNet (Yang et al. 2024, "Gated Delta Networks", arXiv:2412.06464), the linear
//! attention of Qwen3-Next and Qwen3.5-MoE, matching transformers 5.24
//! `models/qwen3_next/modeling_qwen3_next.py` (`Qwen3NextGatedDeltaNet` with its torch fallbacks
//! `torch_chunk_gated_delta_rule` / `torch_recurrent_gated_delta_rule`, `causal_conv1d_*`,
//! `Qwen3NextRMSNormGated`) and `models/qwen3_5_moe/modeling_qwen3_5_moe.py`
//! (`Qwen3_5MoeGatedDeltaNet`: the same math with separate input projections) in f32.
//!
//! For one token `x: [hidden]` (the layer's `input_layernorm` output), `nk` key heads of width
//! `dk`, `nv = r · nk` value heads of width `dv` (PyTorch equivalent on the right):
//! ```text
//! q', k', v', z, b, a = projections of x             # fused in_proj_qkvz/in_proj_ba (grouped
//!                                                    #  per key head) or in_proj_qkv/z/b/a
//! q, k, v = silu(conv([q' | k' | v']))               # depthwise causal conv1d, kernel K, no bias
//! q, k    = l2norm(q_h), l2norm(k_h) per key head    # x / sqrt(sum x² + 1e-6)
//! q      *= dk^-0.5
//! β       = σ(b)                                      # [nv]
//! g       = -exp(A_log) · softplus(a + dt_bias)       # [nv], softplus(u) = u above 20
//! S_h     = e^{g_h} S_h                               # value head h, key head h / r, S_h: [dk, dv]
//! S_h    += k (β_h (v_h − S_h^T k))^T                 # delta rule
//! o_h     = S_h^T q
//! o_h     = rms(o_h) · norm.weight · silu(z_h)        # gated RMSNorm, eps rms_norm_eps
//! out     = out_proj(o)                               # [hidden]
//! ```
//! This is KDA ([`crate::blocks::kda`]) with one decay per head instead of per channel, separate
//! key and value widths and grouped value heads; the recurrence and the chunked form are KDA's
//! ([`delta_step_kv`], [`chunk_step_kv`]) with the head's decay repeated over `dk`.
//! [GDN_RECURRENCE]
//!
//! The state per sequence ([`GdnState`]) holds the last `K - 1` convolution inputs and the
//! recurrent states; like KDA's it rolls back to any length since its last commit by replaying
//! logged updates from the committed state. [GDN_ROLLBACK]

use deltafin_kernels::{rms_norm_inplace, sigmoid, silu, MatRef};
use rayon::prelude::*;

use crate::blocks::kda::{chunk_step_kv, delta_step_kv, l2_normalize};

/// Above this torch's `F.softplus` returns its input unchanged (`threshold=20`).
const SOFTPLUS_THRESHOLD: f32 = 20.0;

/// Tokens per chunk of the chunked prefill (transformers' `chunk_size` default).
pub const GDN_CHUNK_SIZE: usize = 64;

/// Shape of one gated DeltaNet layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GdnDims {
    pub hidden: usize,
    /// `linear_num_key_heads`.
    pub nk: usize,
    /// `linear_num_value_heads` (a multiple of `nk`).
    pub nv: usize,
    /// `linear_key_head_dim`.
    pub dk: usize,
    /// `linear_value_head_dim`.
    pub dv: usize,
    /// `linear_conv_kernel_dim`.
    pub kernel: usize,
    /// eps of the gated output RMSNorm (`rms_norm_eps`).
    pub eps: f32,
}

impl GdnDims {
    /// `nk · dk`.
    pub fn key_dim(&self) -> usize {
        self.nk * self.dk
    }

    /// `nv · dv`.
    pub fn value_dim(&self) -> usize {
        self.nv * self.dv
    }

    /// Convolution channels `[q | k | v]`: `2 · key_dim + value_dim`.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }

    /// Recurrent state values per sequence: `nv · dk · dv`.
    pub fn state_len(&self) -> usize {
        self.nv * self.dk * self.dv
    }
}

/// The input projections, as the checkpoint stores them.
#[derive(Debug, Clone, Copy)]
pub enum GdnProj<'a> {
    /// Qwen3-Next: `in_proj_qkvz [2·key_dim + 2·value_dim, hidden]` whose rows are grouped per
    /// key head `g` as `[q_g (dk) | k_g (dk) | v (r·dv) | z (r·dv)]`, and `in_proj_ba [2·nv,
    /// hidden]` grouped as `[b (r) | a (r)]` (`fix_query_key_value_ordering`).
    Fused { qkvz: MatRef<'a>, ba: MatRef<'a> },
    /// Qwen3.5-MoE: `in_proj_qkv [conv_dim, hidden]` already in `[q | k | v]` order,
    /// `in_proj_z [value_dim, hidden]`, `in_proj_b`, `in_proj_a [nv, hidden]`.
    Split {
        qkv: MatRef<'a>,
        z: MatRef<'a>,
        b: MatRef<'a>,
        a: MatRef<'a>,
    },
}

/// Borrowed weights of one layer.
#[derive(Debug, Clone, Copy)]
pub struct GdnWeights<'a> {
    pub proj: GdnProj<'a>,
    /// Depthwise conv kernels `[conv_dim, K]` (the checkpoint's `[conv_dim, 1, K]`); tap `K - 1`
    /// multiplies the current token.
    pub conv: &'a [f32],
    /// `[nv]`.
    pub dt_bias: &'a [f32],
    /// `[nv]`.
    pub a_log: &'a [f32],
    /// Gated RMSNorm weight `[dv]` (an ordinary weight, not zero-centred).
    pub norm: &'a [f32],
    /// `[hidden, value_dim]`.
    pub out_proj: MatRef<'a>,
}

/// Per-sequence state of one layer, with rollback. [GDN_ROLLBACK]
///
/// With a window `W > 0`, every token since the last commit keeps its normalised key, value,
/// decay and β (`key_dim + value_dim + 2·nv` values) and its convolution input row; the
/// recurrent state at the commit is kept in a second buffer. [`GdnState::rollback`] to `m`
/// tokens past the commit copies the committed state back and replays those `m` delta-rule
/// updates (no projections). A forward that would take the log past `W` tokens commits first; a
/// forward longer than `W` commits after itself too. With `W = 0` every forward commits.
#[derive(Debug, Clone)]
pub struct GdnState {
    /// Conv input rows `[conv_dim]`, oldest first: `K - 1` rows before the commit point, then
    /// one per token since.
    conv: Vec<f32>,
    /// Recurrent state `[nv, dk, dv]` at `len`.
    cur: Vec<f32>,
    /// Recurrent state at `base_len` (empty when the window is 0).
    base: Vec<f32>,
    len: usize,
    base_len: usize,
    window: usize,
    /// Per token since the commit: `k [key_dim] | v [value_dim] | g [nv] | β [nv]`.
    log: Vec<f32>,
    dims: GdnDims,
}

impl GdnState {
    /// A zeroed state for `dims` that can roll back up to `window` tokens past its last commit.
    pub fn new(dims: GdnDims, window: usize) -> Self {
        GdnState {
            conv: vec![0.0; (dims.kernel - 1) * dims.conv_dim()],
            cur: vec![0.0; dims.state_len()],
            base: if window > 0 {
                vec![0.0; dims.state_len()]
            } else {
                Vec::new()
            },
            len: 0,
            base_len: 0,
            window,
            log: Vec::new(),
            dims,
        }
    }

    /// Tokens processed.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no token has been processed.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The shortest length [`GdnState::rollback`] can return to.
    pub fn committed_len(&self) -> usize {
        self.base_len
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        (self.conv.capacity() + self.cur.capacity() + self.base.capacity() + self.log.capacity()) * 4
    }

    /// The layer shape this state was made for.
    pub fn dims(&self) -> GdnDims {
        self.dims
    }

    /// The recurrent state `[nv, dk, dv]` at the current length.
    pub fn recurrent(&self) -> &[f32] {
        &self.cur
    }

    fn log_row(&self) -> usize {
        self.dims.key_dim() + self.dims.value_dim() + 2 * self.dims.nv
    }

    /// Accepts every token so far: rollback can no longer go before the current length.
    pub fn commit(&mut self) {
        if self.window > 0 && self.len != self.base_len {
            self.base.copy_from_slice(&self.cur);
        }
        self.base_len = self.len;
        self.log.clear();
        let keep = (self.dims.kernel - 1) * self.dims.conv_dim();
        let drop = self.conv.len() - keep;
        self.conv.drain(..drop);
    }

    /// Returns the state to what it was after `to` tokens, `committed_len() <= to <= len()`.
    /// Returns false (state unchanged) outside that range.
    pub fn rollback(&mut self, to: usize) -> bool {
        if to < self.base_len || to > self.len {
            return false;
        }
        if to == self.len {
            return true;
        }
        let d = self.dims;
        let m = to - self.base_len;
        self.cur.copy_from_slice(&self.base);
        let row = self.log_row();
        let (kd, vd, nv) = (d.key_dim(), d.value_dim(), d.nv);
        for t in 0..m {
            let r = &self.log[t * row..(t + 1) * row];
            let (k, rest) = r.split_at(kd);
            let (v, rest) = rest.split_at(vd);
            let (g, beta) = rest.split_at(nv);
            recurrence(&d, &mut self.cur, None, k, v, g, beta, None);
        }
        self.log.truncate(m * row);
        self.conv.truncate((d.kernel - 1 + m) * d.conv_dim());
        self.len = to;
        true
    }
}

/// One gated DeltaNet layer: dimensions plus borrowed weights.
#[derive(Debug, Clone, Copy)]
pub struct GatedDeltaNet<'a> {
    pub dims: GdnDims,
    pub w: GdnWeights<'a>,
}

impl<'a> GatedDeltaNet<'a> {
    /// Runs `n` tokens `x: [n, hidden]` → `out: [n, hidden]`, appending them to `state`:
    /// token by token through the recurrence (the reference's decode path) when `chunked` is
    /// false, else in chunks of [`GDN_CHUNK_SIZE`] (its prefill path); the two agree up to f32
    /// rounding. `state` must have been made for `self.dims` (the caller checks
    /// [`GdnState::dims`]).
    pub fn forward(&self, state: &mut GdnState, x: &[f32], n: usize, out: &mut [f32], chunked: bool) {
        let d = self.dims;
        let (kd, vd, nv, c) = (d.key_dim(), d.value_dim(), d.nv, d.conv_dim());
        if (state.len - state.base_len) + n > state.window {
            state.commit();
        }
        let logged = (state.len - state.base_len) + n <= state.window;
        // Projections: mixed [n, conv_dim] in [q | k | v] order, z [n, value_dim], b/a [n, nv].
        let mut mixed = vec![0f32; n * c];
        let mut z = vec![0f32; n * vd];
        let mut b = vec![0f32; n * nv];
        let mut a = vec![0f32; n * nv];
        match self.w.proj {
            GdnProj::Split {
                qkv,
                z: zp,
                b: bp,
                a: ap,
            } => {
                qkv.matmul(x, n, &mut mixed);
                zp.matmul(x, n, &mut z);
                bp.matmul(x, n, &mut b);
                ap.matmul(x, n, &mut a);
            }
            GdnProj::Fused { qkvz, ba } => {
                let r = d.nv / d.nk;
                let gw = 2 * d.dk + 2 * r * d.dv;
                let mut p = vec![0f32; n * d.nk * gw];
                qkvz.matmul(x, n, &mut p);
                let mut pba = vec![0f32; n * 2 * nv];
                ba.matmul(x, n, &mut pba);
                for t in 0..n {
                    let (pt, mt) = (&p[t * d.nk * gw..(t + 1) * d.nk * gw], &mut mixed[t * c..(t + 1) * c]);
                    let zt = &mut z[t * vd..(t + 1) * vd];
                    for g in 0..d.nk {
                        let src = &pt[g * gw..(g + 1) * gw];
                        let rv = r * d.dv;
                        mt[g * d.dk..(g + 1) * d.dk].copy_from_slice(&src[..d.dk]);
                        mt[kd + g * d.dk..kd + (g + 1) * d.dk].copy_from_slice(&src[d.dk..2 * d.dk]);
                        mt[2 * kd + g * rv..2 * kd + (g + 1) * rv].copy_from_slice(&src[2 * d.dk..2 * d.dk + rv]);
                        zt[g * rv..(g + 1) * rv].copy_from_slice(&src[2 * d.dk + rv..]);
                        let bat = &pba[t * 2 * nv + g * 2 * r..t * 2 * nv + (g + 1) * 2 * r];
                        b[t * nv + g * r..t * nv + (g + 1) * r].copy_from_slice(&bat[..r]);
                        a[t * nv + g * r..t * nv + (g + 1) * r].copy_from_slice(&bat[r..]);
                    }
                }
            }
        }
        // Causal depthwise conv + SiLU over the history rows (K - 1 earlier rows kept).
        let first = state.conv.len() / c;
        state.conv.extend_from_slice(&mixed);
        let kk = d.kernel;
        let mut conv = vec![0f32; n * c];
        for t in 0..n {
            let r = first + t;
            for (ch, o) in conv[t * c..(t + 1) * c].iter_mut().enumerate() {
                let taps = &self.w.conv[ch * kk..(ch + 1) * kk];
                let mut acc = 0f32;
                for (j, &tw) in taps.iter().enumerate() {
                    acc += tw * state.conv[(r + 1 + j - kk) * c + ch];
                }
                *o = silu(acc);
            }
        }
        // q, k: per-key-head L2 norm (q also scaled); v as is. β and g per value head.
        let scale = 1.0 / (d.dk as f32).sqrt();
        let mut q = vec![0f32; n * kd];
        let mut k = vec![0f32; n * kd];
        let mut v = vec![0f32; n * vd];
        for t in 0..n {
            let ct = &conv[t * c..(t + 1) * c];
            q[t * kd..(t + 1) * kd].copy_from_slice(&ct[..kd]);
            k[t * kd..(t + 1) * kd].copy_from_slice(&ct[kd..2 * kd]);
            v[t * vd..(t + 1) * vd].copy_from_slice(&ct[2 * kd..]);
        }
        for qh in q.chunks_exact_mut(d.dk) {
            l2_normalize(qh);
            for e in qh.iter_mut() {
                *e *= scale;
            }
        }
        for kh in k.chunks_exact_mut(d.dk) {
            l2_normalize(kh);
        }
        let mut g = vec![0f32; n * nv];
        for t in 0..n {
            for h in 0..nv {
                let u = a[t * nv + h] + self.w.dt_bias[h];
                let sp = if u > SOFTPLUS_THRESHOLD { u } else { u.exp().ln_1p() };
                g[t * nv + h] = -self.w.a_log[h].exp() * sp;
                b[t * nv + h] = sigmoid(b[t * nv + h]);
            }
        }
        let beta = b;
        if logged {
            for t in 0..n {
                state.log.extend_from_slice(&k[t * kd..(t + 1) * kd]);
                state.log.extend_from_slice(&v[t * vd..(t + 1) * vd]);
                state.log.extend_from_slice(&g[t * nv..(t + 1) * nv]);
                state.log.extend_from_slice(&beta[t * nv..(t + 1) * nv]);
            }
        }
        // o: [n, value_dim]
        let mut o = vec![0f32; n * vd];
        if chunked {
            chunked_rule(&d, &mut state.cur, &q, &k, &v, &g, &beta, &mut o);
        } else {
            recurrence(&d, &mut state.cur, Some(&q), &k, &v, &g, &beta, Some(&mut o));
        }
        state.len += n;
        if !logged {
            state.commit();
        }
        // Gated RMSNorm per value head, then out_proj.
        for (oh, zh) in o.chunks_exact_mut(d.dv).zip(z.chunks_exact(d.dv)) {
            rms_norm_inplace(oh, self.w.norm, d.eps);
            for (e, &zv) in oh.iter_mut().zip(zh) {
                *e *= silu(zv);
            }
        }
        self.w.out_proj.matmul(&o, n, out);
    }
}

/// Token-by-token delta rule on every value head for `n = g.len() / nv` tokens (`q, k: [n,
/// key_dim]`, `v: [n, value_dim]`, `g, beta: [n, nv]`), updating `s: [nv, dk, dv]` in place;
/// `o: [n, value_dim]` when given (then `q` too). [GDN_RECURRENCE]
#[allow(clippy::too_many_arguments)]
fn recurrence(
    d: &GdnDims,
    s: &mut [f32],
    q: Option<&[f32]>,
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    o: Option<&mut [f32]>,
) {
    let (kd, vd, nv) = (d.key_dim(), d.value_dim(), d.nv);
    let n = g.len() / nv;
    each_value_head(d, s, n, o, |h, kh, sh| {
        let mut oh = vec![0f32; if q.is_some() { n * d.dv } else { 0 }];
        let mut gv = vec![0f32; d.dk];
        for t in 0..n {
            gv.fill(g[t * nv + h]);
            let kr = t * kd + kh * d.dk..t * kd + (kh + 1) * d.dk;
            let qt = q.map(|q| &q[kr.clone()]);
            let out_t = if q.is_some() {
                Some(&mut oh[t * d.dv..(t + 1) * d.dv])
            } else {
                None
            };
            delta_step_kv(
                None,
                sh,
                d.dk,
                d.dv,
                qt,
                &k[kr],
                &v[t * vd + h * d.dv..t * vd + (h + 1) * d.dv],
                &gv,
                beta[t * nv + h],
                out_t,
            );
        }
        oh
    });
}

/// The chunked form of [`recurrence`] (always with outputs), chunks of [`GDN_CHUNK_SIZE`].
#[allow(clippy::too_many_arguments)]
fn chunked_rule(d: &GdnDims, s: &mut [f32], q: &[f32], k: &[f32], v: &[f32], g: &[f32], beta: &[f32], o: &mut [f32]) {
    let (kd, vd, nv) = (d.key_dim(), d.value_dim(), d.nv);
    let n = g.len() / nv;
    each_value_head(d, s, n, Some(o), |h, kh, sh| {
        let gather = |a: &[f32], width: usize, stride: usize, head: usize| -> Vec<f32> {
            (0..n)
                .flat_map(|t| {
                    a[t * stride + head * width..t * stride + (head + 1) * width]
                        .iter()
                        .copied()
                })
                .collect()
        };
        let (qh, kh_, vh) = (gather(q, d.dk, kd, kh), gather(k, d.dk, kd, kh), gather(v, d.dv, vd, h));
        let gh: Vec<f32> = (0..n).flat_map(|t| std::iter::repeat_n(g[t * nv + h], d.dk)).collect();
        let bh: Vec<f32> = (0..n).map(|t| beta[t * nv + h]).collect();
        let mut oh = vec![0f32; n * d.dv];
        let mut t0 = 0;
        while t0 < n {
            let t1 = (t0 + GDN_CHUNK_SIZE).min(n);
            let (rk, rv) = (t0 * d.dk..t1 * d.dk, t0 * d.dv..t1 * d.dv);
            chunk_step_kv(
                None,
                sh,
                d.dk,
                d.dv,
                &qh[rk.clone()],
                &kh_[rk.clone()],
                &vh[rv.clone()],
                &gh[rk],
                &bh[t0..t1],
                &mut oh[rv],
            );
            t0 = t1;
        }
        oh
    });
}

/// Runs `head(h, kh, s_h)` for every value head `h` in parallel: `kh = h / (nv / nk)` is the
/// key head it shares (`q`, `k` heads repeat over value heads), `s_h: [dk, dv]` its slice of
/// the state `s: [nv, dk, dv]`; `head` returns the head's outputs `[n, dv]` (or nothing), which
/// go to the head's columns of `o: [n, value_dim]` when `o` is given.
fn each_value_head(
    d: &GdnDims,
    s: &mut [f32],
    n: usize,
    o: Option<&mut [f32]>,
    head: impl Fn(usize, usize, &mut [f32]) -> Vec<f32> + Sync + Send,
) {
    let (vd, r) = (d.value_dim(), d.nv / d.nk);
    let per_head: Vec<Vec<f32>> = s
        .par_chunks_mut(d.dk * d.dv)
        .enumerate()
        .map(|(h, sh)| head(h, h / r, sh))
        .collect();
    if let Some(o) = o {
        for (h, oh) in per_head.iter().enumerate() {
            for t in 0..n {
                o[t * vd + h * d.dv..t * vd + (h + 1) * d.dv].copy_from_slice(&oh[t * d.dv..(t + 1) * d.dv]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use deltafin_kernels::MatData;

    /// Random-ish deterministic values in [-1, 1).
    fn vals(n: usize, seed: u32) -> Vec<f32> {
        let mut x = seed.wrapping_mul(2654435761).wrapping_add(1);
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                (x as f32 / u32::MAX as f32) * 2.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn chunked_and_rollback_match_the_recurrence() {
        let d = GdnDims {
            hidden: 12,
            nk: 2,
            nv: 4,
            dk: 4,
            dv: 3,
            kernel: 3,
            eps: 1e-6,
        };
        let (h, c, vd, nv) = (d.hidden, d.conv_dim(), d.value_dim(), d.nv);
        let (wqkv, wz, wb, wa) = (vals(c * h, 1), vals(vd * h, 2), vals(nv * h, 3), vals(nv * h, 4));
        let (conv, dt, alog, norm, wo) = (vals(c * 3, 5), vals(nv, 6), vals(nv, 7), vals(d.dv, 8), vals(h * vd, 9));
        fn m(v: &[f32], rows: usize, cols: usize) -> MatRef<'_> {
            MatRef::new(rows, cols, MatData::F32(v)).unwrap()
        }
        let net = GatedDeltaNet {
            dims: d,
            w: GdnWeights {
                proj: GdnProj::Split {
                    qkv: m(&wqkv, c, h),
                    z: m(&wz, vd, h),
                    b: m(&wb, nv, h),
                    a: m(&wa, nv, h),
                },
                conv: &conv,
                dt_bias: &dt,
                a_log: &alog,
                norm: &norm,
                out_proj: m(&wo, h, vd),
            },
        };
        let n = 150; // three chunks, the last partial
        let x = vals(n * h, 10);
        let mut one = GdnState::new(d, 8);
        let mut want = vec![0f32; n * h];
        for t in 0..n {
            net.forward(
                &mut one,
                &x[t * h..(t + 1) * h],
                1,
                &mut want[t * h..(t + 1) * h],
                false,
            );
        }
        let mut all = GdnState::new(d, 8);
        let mut got = vec![0f32; n * h];
        net.forward(&mut all, &x, n, &mut got, true);
        let err = want.iter().zip(&got).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(err < 1e-4, "chunked vs recurrence: {err}");
        let serr = one
            .recurrent()
            .iter()
            .zip(all.recurrent())
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(serr < 1e-4, "state: {serr}");
        // Rollback: 5 more tokens, back 3, the next 2 again must equal the first run.
        let extra = vals(5 * h, 11);
        let mut o = vec![0f32; 5 * h];
        let before = one.len();
        net.forward(&mut one, &extra, 5, &mut o, false);
        assert!(one.rollback(before + 2));
        assert!(!one.rollback(before - 1), "before the commit");
        let mut o2 = vec![0f32; 3 * h];
        net.forward(&mut one, &extra[2 * h..], 3, &mut o2, false);
        assert_eq!(&o[2 * h..], &o2[..], "replayed state differs");
    }
}
