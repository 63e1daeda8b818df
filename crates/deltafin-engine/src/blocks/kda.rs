//! Kimi Delta Attention (KDA), the linear-attention mixer of Kimi Linear (`kimi_linear`) and
//! Kimi K3, matching transformers 5.24 `models/kimi_linear/modeling_kimi_linear.py`
//! (`KimiLinearDeltaAttention` with its torch fallbacks `chunk_kimi_delta_attention` and
//! `recurrent_kimi_delta_attention`) in f32, plus K3's gate and output-gate variants from
//! `K3-SPEC.md` §3.
//!
//! For one token `x: [hidden]` (the layer's `input_layernorm` output), with `P = num_heads ·
//! head_dim` and `d = head_dim` (PyTorch equivalent on the right):
//! ```text
//! q', k', v' = x Wq^T, x Wk^T, x Wv^T               # q_proj/k_proj/v_proj, [P] each
//! q, k, v    = silu(conv(q')), silu(conv(k')), ...  # depthwise causal conv, kernel K  [KDA_CONV]
//! q, k       = l2norm(q_h), l2norm(k_h) per head    # x / sqrt(sum x² + 1e-6)        [KDA_L2NORM]
//! q         *= d^-0.5
//! u          = f_b_proj(f_a_proj(x)) + dt_bias      # [P]
//! g          = -exp(A_log[h]) · softplus(u)          # kimi_linear                    [KDA_GATE]
//!            | lower_bound · σ(exp(A_log[h]) · u)    # K3 gate_lower_bound
//! β          = σ(b_proj(x))                          # [num_heads]
//! S_h        = diag(exp(g_h)) S_h                    # per head, S_h: [d (key), d (value)] f32
//! S_h       += k_h (β_h (v_h − S_h^T k_h))^T         # delta rule                     [KDA_RECURRENCE]
//! o_h        = S_h^T q_h
//! o_h        = rms(o_h; o_norm, eps) ⊙ σ(gate_h)    # gate = g_b(g_a(x)) or g_proj(x) [KDA_OUT_NORM]
//! out        = o_proj(o)                             # [hidden]
//! ```
//! Prefill runs the same algebra chunk by chunk ([`Kda::prefill`], [KDA_CHUNK]); decode runs the
//! recurrence one token at a time ([`Kda::step`]). The state per sequence ([`KdaState`]) has a fixed
//! size and supports rollback to any length since the last [`KdaState::commit`] ([KDA_ROLLBACK]).

use deltafin_format::model_dir::{Backbone, MatHandle, VecHandle};
use deltafin_format::FormatError;
use deltafin_kernels::{rms_norm_inplace, sigmoid, silu, MatRef};
use rayon::prelude::*;

/// eps inside the square root of the q/k L2 normalisation: transformers' `l2norm(x, eps=1e-6)`
/// computes `x / sqrt(sum(x²) + eps)` (fla's convention, not `F.normalize`'s max). [KDA_L2NORM]
pub const L2_NORM_EPS: f32 = 1e-6;

/// Above this the reference's softplus returns its input unchanged (`torch.where(g > 20, g,
/// log(1 + exp(g)))` in `KimiLinearForgetGate.forward`). [KDA_GATE]
const SOFTPLUS_THRESHOLD: f32 = 20.0;

/// Prefill chunk length used when the caller has no preference. Any value ≥ 1 gives the same
/// result up to f32 rounding (the reference uses 64).
pub const DEFAULT_CHUNK_SIZE: usize = 16;

/// Errors from building or running a KDA block.
#[derive(Debug, thiserror::Error)]
pub enum KdaError {
    #[error("KDA layer {layer}: tensor {tensor}: shape {found:?}, expected {expected:?}")]
    Shape {
        layer: usize,
        tensor: &'static str,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("KDA layer {layer}: invalid configuration: {message}")]
    Config { layer: usize, message: String },
    #[error("KDA layer {layer}: input of {len} values is not a whole number of {hidden}-wide tokens (or the output buffer is {out_len})")]
    Input {
        layer: usize,
        len: usize,
        hidden: usize,
        out_len: usize,
    },
    #[error("KDA layer {layer}: the state was made for another shape (conv rows of {found_conv}, recurrent {found_rec} values; expected {expected_conv} and {expected_rec})")]
    State {
        layer: usize,
        found_conv: usize,
        found_rec: usize,
        expected_conv: usize,
        expected_rec: usize,
    },
    #[error("KDA state: cannot roll back to length {to}: the state holds {len} tokens and can return only to lengths {min}..={len} (last commit, rollback window {window})")]
    Rollback {
        to: usize,
        len: usize,
        min: usize,
        window: usize,
    },
}

/// The channel-wise log-decay activation. [KDA_GATE]
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum DecayGate {
    /// Kimi Linear: `g = -exp(A_log[h]) · softplus(u)`, `g ∈ (-inf, 0]`
    /// (transformers `KimiLinearForgetGate`).
    Softplus,
    /// Kimi K3 (`linear_attn_config.gate_lower_bound`, e.g. -5): `g = lower_bound ·
    /// σ(exp(A_log[h]) · u)`, `g ∈ (lower_bound, 0)`. Not a clamp: it replaces softplus
    /// (K3-SPEC §3; transformers `Glm5NextTextForgetGate` with `linear_lower_bound`).
    ScaledSigmoid { lower_bound: f32 },
}

impl DecayGate {
    /// `g` for one channel from `u = f_b_proj(f_a_proj(x)) + dt_bias` and its head's `A_log`.
    #[inline]
    pub fn apply(self, a_log: f32, u: f32) -> f32 {
        match self {
            DecayGate::Softplus => {
                let sp = if u > SOFTPLUS_THRESHOLD {
                    u
                } else {
                    (1.0 + u.exp()).ln()
                };
                -a_log.exp() * sp
            }
            DecayGate::ScaledSigmoid { lower_bound } => lower_bound * sigmoid(a_log.exp() * u),
        }
    }
}

/// Hyperparameters of one KDA layer.
///
/// From a Hugging Face config: `hidden_size`; `linear_attn_config.num_heads`, `.head_dim`,
/// `.short_conv_kernel_size`; `rms_norm_eps` (the output norm's eps); `.gate_lower_bound` (present:
/// [`DecayGate::ScaledSigmoid`], absent: [`DecayGate::Softplus`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KdaConfig {
    /// Index of the decoder layer (for error messages only).
    pub layer: usize,
    pub hidden_size: usize,
    /// KDA heads (`linear_attn_config.num_heads`).
    pub num_heads: usize,
    /// Key and value width per head, `d` (`linear_attn_config.head_dim`); the state is `[d, d]`.
    pub head_dim: usize,
    /// Short-convolution kernel length `K` (`short_conv_kernel_size`, 4 in every released model).
    pub conv_kernel_size: usize,
    /// eps of the gated output RMSNorm (`o_norm`): the reference passes `rms_norm_eps`.
    pub norm_eps: f32,
    pub decay_gate: DecayGate,
    /// Tokens per prefill chunk (≥ 1); see [`DEFAULT_CHUNK_SIZE`].
    pub chunk_size: usize,
}

impl KdaConfig {
    /// `P = num_heads · head_dim`, the width of q, k, v, the gate and the output before `o_proj`.
    pub fn proj_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }
}

/// The output gate before `o_proj`. [KDA_OUT_NORM]
#[derive(Debug, Clone, Copy)]
pub enum OutputGate<'a> {
    /// Kimi Linear: `g_b_proj(g_a_proj(x))`, `a: [head_dim, hidden]`, `b: [P, head_dim]`.
    LowRank { a: MatRef<'a>, b: MatRef<'a> },
    /// Kimi K3 (`use_full_rank_gate`): `g_proj(x)`, `[P, hidden]`.
    FullRank(MatRef<'a>),
}

/// Borrowed weights of one KDA layer, shapes as in the Hugging Face checkpoint (`[out, in]`).
#[derive(Debug, Clone, Copy)]
pub struct KdaWeights<'a> {
    /// `[P, hidden]` each.
    pub q_proj: MatRef<'a>,
    pub k_proj: MatRef<'a>,
    pub v_proj: MatRef<'a>,
    /// Depthwise causal conv kernels, `[P, K]` row-major (the checkpoint's `[P, 1, K]`); tap
    /// `K - 1` multiplies the current token.
    pub q_conv: &'a [f32],
    pub k_conv: &'a [f32],
    pub v_conv: &'a [f32],
    /// `[head_dim, hidden]`.
    pub f_a_proj: MatRef<'a>,
    /// `[P, head_dim]`.
    pub f_b_proj: MatRef<'a>,
    /// `[num_heads]` (Kimi Linear stores `[1, 1, num_heads, 1]`, K3 `[num_heads]`).
    pub a_log: &'a [f32],
    /// `[P]`.
    pub dt_bias: &'a [f32],
    /// `[num_heads, hidden]`.
    pub b_proj: MatRef<'a>,
    pub output_gate: OutputGate<'a>,
    /// `[head_dim]`.
    pub o_norm: &'a [f32],
    /// `[hidden, P]`.
    pub o_proj: MatRef<'a>,
}

/// [`OutputGate`]'s tensors as handles.
#[derive(Debug, Clone, Copy)]
pub enum OutputGateTensors {
    /// Kimi Linear: `g_a_proj` `[head_dim, hidden]`, `g_b_proj` `[P, head_dim]`.
    LowRank { g_a_proj: MatHandle, g_b_proj: MatHandle },
    /// Kimi K3: `g_proj` `[P, hidden]`.
    FullRank { g_proj: MatHandle },
}

/// [`KdaWeights`] resolved in the backbone once at load ([`KdaTensors::resolve`]): the same
/// tensors as handles, viewed for a pass with the infallible [`KdaTensors::view`] (no lookup).
#[derive(Debug, Clone, Copy)]
pub struct KdaTensors {
    pub q_proj: MatHandle,
    pub k_proj: MatHandle,
    pub v_proj: MatHandle,
    /// `[P, 1, K]` each, flat.
    pub q_conv1d: VecHandle,
    pub k_conv1d: VecHandle,
    pub v_conv1d: VecHandle,
    pub f_a_proj: MatHandle,
    pub f_b_proj: MatHandle,
    /// `A_log`, flat (`[1, 1, num_heads, 1]` or `[num_heads]`).
    pub a_log: VecHandle,
    pub dt_bias: VecHandle,
    pub b_proj: MatHandle,
    pub output_gate: OutputGateTensors,
    pub o_norm: VecHandle,
    pub o_proj: MatHandle,
}

impl KdaTensors {
    /// Resolves the tensors `n` names in `bb`: the conv kernels, `A_log` and `dt_bias` as flat
    /// f32 tensors of any rank, `o_norm` as an f32 vector, the rest as matrices; the output gate
    /// full-rank (`g_proj`) when `full_rank_gate`, else low-rank.
    ///
    /// Errors: a missing or malformed tensor (named).
    pub fn resolve(bb: &Backbone, n: &KdaTensorNames, full_rank_gate: bool) -> Result<Self, FormatError> {
        let flat = |name: &str| -> Result<VecHandle, FormatError> { Ok(bb.f32_handle(name)?.0) };
        Ok(KdaTensors {
            q_proj: bb.matrix_handle(&n.q_proj)?,
            k_proj: bb.matrix_handle(&n.k_proj)?,
            v_proj: bb.matrix_handle(&n.v_proj)?,
            q_conv1d: flat(&n.q_conv1d)?,
            k_conv1d: flat(&n.k_conv1d)?,
            v_conv1d: flat(&n.v_conv1d)?,
            f_a_proj: bb.matrix_handle(&n.f_a_proj)?,
            f_b_proj: bb.matrix_handle(&n.f_b_proj)?,
            a_log: flat(&n.a_log)?,
            dt_bias: flat(&n.dt_bias)?,
            b_proj: bb.matrix_handle(&n.b_proj)?,
            output_gate: if full_rank_gate {
                OutputGateTensors::FullRank {
                    g_proj: bb.matrix_handle(&n.g_proj)?,
                }
            } else {
                OutputGateTensors::LowRank {
                    g_a_proj: bb.matrix_handle(&n.g_a_proj)?,
                    g_b_proj: bb.matrix_handle(&n.g_b_proj)?,
                }
            },
            o_norm: bb.vector_handle(&n.o_norm)?,
            o_proj: bb.matrix_handle(&n.o_proj)?,
        })
    }

    /// The weights as views into `bb`, the backbone that resolved them.
    pub fn view<'a>(&self, bb: &'a Backbone) -> KdaWeights<'a> {
        KdaWeights {
            q_proj: bb.mat(&self.q_proj),
            k_proj: bb.mat(&self.k_proj),
            v_proj: bb.mat(&self.v_proj),
            q_conv: bb.vec(&self.q_conv1d),
            k_conv: bb.vec(&self.k_conv1d),
            v_conv: bb.vec(&self.v_conv1d),
            f_a_proj: bb.mat(&self.f_a_proj),
            f_b_proj: bb.mat(&self.f_b_proj),
            a_log: bb.vec(&self.a_log),
            dt_bias: bb.vec(&self.dt_bias),
            b_proj: bb.mat(&self.b_proj),
            output_gate: match &self.output_gate {
                OutputGateTensors::LowRank { g_a_proj, g_b_proj } => OutputGate::LowRank {
                    a: bb.mat(g_a_proj),
                    b: bb.mat(g_b_proj),
                },
                OutputGateTensors::FullRank { g_proj } => OutputGate::FullRank(bb.mat(g_proj)),
            },
            o_norm: bb.vec(&self.o_norm),
            o_proj: bb.mat(&self.o_proj),
        }
    }
}

/// Checkpoint tensor names of one KDA layer (`{prefix}` is `model.layers.{l}.self_attn`; K3
/// shards add a `language_model.` prefix that the checkpoint reader strips).
#[derive(Debug, Clone)]
pub struct KdaTensorNames {
    pub q_proj: String,
    pub k_proj: String,
    pub v_proj: String,
    /// `[P, 1, K]`.
    pub q_conv1d: String,
    pub k_conv1d: String,
    pub v_conv1d: String,
    pub f_a_proj: String,
    pub f_b_proj: String,
    /// Kimi Linear `[1, 1, num_heads, 1]`, K3 `[num_heads]`; f32 in the reference.
    pub a_log: String,
    /// `[P]`, f32 in the reference.
    pub dt_bias: String,
    pub b_proj: String,
    /// Low-rank output gate (Kimi Linear).
    pub g_a_proj: String,
    pub g_b_proj: String,
    /// Full-rank output gate (K3). The same name is MLA's output gate in MLA layers.
    pub g_proj: String,
    pub o_norm: String,
    pub o_proj: String,
}

impl KdaTensorNames {
    /// Names under `prefix` (for example `model.layers.3.self_attn`).
    pub fn new(prefix: &str) -> Self {
        let n = |s: &str| format!("{prefix}.{s}");
        KdaTensorNames {
            q_proj: n("q_proj.weight"),
            k_proj: n("k_proj.weight"),
            v_proj: n("v_proj.weight"),
            q_conv1d: n("q_conv1d.weight"),
            k_conv1d: n("k_conv1d.weight"),
            v_conv1d: n("v_conv1d.weight"),
            f_a_proj: n("f_a_proj.weight"),
            f_b_proj: n("f_b_proj.weight"),
            a_log: n("A_log"),
            dt_bias: n("dt_bias"),
            b_proj: n("b_proj.weight"),
            g_a_proj: n("g_a_proj.weight"),
            g_b_proj: n("g_b_proj.weight"),
            g_proj: n("g_proj.weight"),
            o_norm: n("o_norm.weight"),
            o_proj: n("o_proj.weight"),
        }
    }
}

/// Per-sequence state of one KDA layer: the short-convolution history and the per-head f32
/// recurrent state, with rollback. [KDA_ROLLBACK]
///
/// Rollback: with a window `W > 0` ([`Kda::new_state`]), every token since the last
/// [`KdaState::commit`] keeps its pre-convolution projections (`3P` values, needed by the conv
/// anyway) and its decay `g` and `β` (`P + num_heads` values), and the recurrent state at the
/// commit stays untouched in a second buffer: the first update after a commit writes its result
/// into the other buffer (the same work as an in-place update, no copy). [`KdaState::rollback`]
/// to a length `m` tokens past the commit restores the committed buffer and replays those `m`
/// tokens' delta-rule updates from the log (recomputing k and v from the kept conv inputs): cost
/// `m` recurrence steps, no projections and no state copy. Memory: a second recurrent state
/// (`num_heads · d² · 4` bytes) plus `(4P + num_heads) · 4` bytes per logged token. A forward
/// that would take the log past `W` tokens commits first (rollback then reaches back only to
/// that point); a forward of more than `W` tokens also commits after itself. With `W = 0` there
/// is one buffer, no log, and every forward commits.
#[derive(Debug, Clone)]
pub struct KdaState {
    /// Conv input rows `[q' | k' | v']` (`3P` each), oldest first: `K - 1` rows before the commit
    /// point, then one per token since.
    conv: Vec<f32>,
    /// Recurrent state buffers, each `[num_heads, d (key), d (value)]`; the second is empty when
    /// the window is 0.
    rec: [Vec<f32>; 2],
    /// Buffer holding the state at `len`.
    cur: usize,
    /// Buffer holding the state at `base_len` (equals `cur` when `len == base_len`).
    base: usize,
    len: usize,
    base_len: usize,
    window: usize,
    /// Per token since the commit: `g: [P]` then `β: [num_heads]`.
    log: Vec<f32>,
    /// `3P` and `P + num_heads`, for slicing.
    row: usize,
    log_row: usize,
    kernel: usize,
}

impl KdaState {
    /// Tokens processed.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no token has been processed.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Length at the last commit: the shortest length [`KdaState::rollback`] can return to.
    pub fn committed_len(&self) -> usize {
        self.base_len
    }

    /// Bytes held (both recurrent buffers, conv history and log).
    pub fn bytes(&self) -> usize {
        (self.conv.capacity() + self.rec[0].capacity() + self.rec[1].capacity() + self.log.capacity()) * 4
    }

    /// The recurrent state at the current length, `[num_heads, d (key), d (value)]`, `o_h = S_h^T q_h`.
    pub fn recurrent(&self) -> &[f32] {
        &self.rec[self.cur]
    }

    /// Accepts every token so far: rollback can no longer go before the current length. O(K · P).
    pub fn commit(&mut self) {
        self.base = self.cur;
        self.base_len = self.len;
        self.log.clear();
        let keep = (self.kernel - 1) * self.row;
        let drop = self.conv.len() - keep;
        self.conv.drain(..drop);
    }

    /// Returns the state to what it was after `to` tokens, for any `to` in
    /// `committed_len()..=len()`; replays `to - committed_len()` delta-rule updates (see the type's
    /// documentation for the cost).
    ///
    /// Errors: `to` outside that range ([`KdaError::Rollback`]); the state is unchanged.
    pub fn rollback(&mut self, kda: &Kda<'_>, to: usize) -> Result<(), KdaError> {
        if to < self.base_len || to > self.len {
            return Err(KdaError::Rollback {
                to,
                len: self.len,
                min: self.base_len,
                window: self.window,
            });
        }
        kda.check_state(self)?;
        if to == self.len {
            return Ok(());
        }
        let m = to - self.base_len;
        self.cur = self.base;
        self.len = self.base_len;
        let (p, nh) = (kda.cfg.proj_dim(), kda.cfg.num_heads);
        for i in 0..m {
            // k and v of logged token i from its kept conv inputs; g and β from the log.
            let r = self.kernel - 1 + i;
            let mut kv = vec![0f32; 2 * p];
            kda.conv_rows(&self.conv, r, 1, p, 3 * p, &mut kv);
            let (k, v) = kv.split_at_mut(p);
            kda.finish_keys(k);
            let lg = self.log[i * self.log_row..(i + 1) * self.log_row].to_vec();
            let (g, beta) = (&lg[..p], &lg[p..p + nh]);
            let (src, dst) = self.update_buffers();
            kda.recurrence(src, dst, None, k, v, g, beta, None);
            self.len += 1;
        }
        self.log.truncate(m * self.log_row);
        self.conv.truncate((self.kernel - 1 + m) * self.row);
        Ok(())
    }

    /// Buffers for the next update: `(Some(committed state), other buffer)` when the current state
    /// is the committed one and must stay intact, else `(None, current state)` to update in place.
    fn update_buffers(&mut self) -> (Option<&[f32]>, &mut [f32]) {
        if self.window > 0 && self.cur == self.base {
            let src = self.base;
            self.cur = 1 - src;
            let (a, b) = self.rec.split_at_mut(1);
            if src == 0 {
                (Some(&a[0]), &mut b[0])
            } else {
                (Some(&b[0]), &mut a[0])
            }
        } else {
            (None, &mut self.rec[self.cur])
        }
    }
}

/// One KDA layer: configuration plus borrowed weights.
#[derive(Debug, Clone, Copy)]
pub struct Kda<'a> {
    pub cfg: KdaConfig,
    pub w: KdaWeights<'a>,
}

/// Per-token activations shared by the decode and prefill paths, `[n, ·]` row-major.
struct Prepared {
    /// `[n, P]` normalised and scaled q, normalised k, v, log-decay g; `[n, num_heads]` β.
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
}

impl<'a> Kda<'a> {
    /// Checks every weight's shape against `cfg`.
    ///
    /// Errors: [`KdaError::Config`] for zero sizes, a zero chunk size or a non-negative
    /// `lower_bound`; [`KdaError::Shape`] naming the first tensor whose shape differs.
    pub fn new(cfg: KdaConfig, w: KdaWeights<'a>) -> Result<Self, KdaError> {
        let layer = cfg.layer;
        let bad = |message: String| KdaError::Config { layer, message };
        if cfg.hidden_size == 0 || cfg.num_heads == 0 || cfg.head_dim == 0 || cfg.conv_kernel_size == 0 {
            return Err(bad(format!(
                "hidden_size {}, num_heads {}, head_dim {}, conv_kernel_size {} must all be positive",
                cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.conv_kernel_size
            )));
        }
        if cfg.chunk_size == 0 {
            return Err(bad("chunk_size must be at least 1".into()));
        }
        if let DecayGate::ScaledSigmoid { lower_bound } = cfg.decay_gate {
            if !(lower_bound < 0.0 && lower_bound.is_finite()) {
                return Err(bad(format!(
                    "gate_lower_bound {lower_bound} must be negative and finite"
                )));
            }
        }
        let (h, p, d, nh, k) = (
            cfg.hidden_size,
            cfg.proj_dim(),
            cfg.head_dim,
            cfg.num_heads,
            cfg.conv_kernel_size,
        );
        let mat = |tensor: &'static str, m: &MatRef, rows: usize, cols: usize| {
            if m.rows == rows && m.cols == cols {
                Ok(())
            } else {
                Err(KdaError::Shape {
                    layer,
                    tensor,
                    expected: vec![rows, cols],
                    found: vec![m.rows, m.cols],
                })
            }
        };
        let vec = |tensor: &'static str, v: &[f32], len: usize| {
            if v.len() == len {
                Ok(())
            } else {
                Err(KdaError::Shape {
                    layer,
                    tensor,
                    expected: vec![len],
                    found: vec![v.len()],
                })
            }
        };
        mat("q_proj", &w.q_proj, p, h)?;
        mat("k_proj", &w.k_proj, p, h)?;
        mat("v_proj", &w.v_proj, p, h)?;
        vec("q_conv1d", w.q_conv, p * k)?;
        vec("k_conv1d", w.k_conv, p * k)?;
        vec("v_conv1d", w.v_conv, p * k)?;
        mat("f_a_proj", &w.f_a_proj, d, h)?;
        mat("f_b_proj", &w.f_b_proj, p, d)?;
        vec("A_log", w.a_log, nh)?;
        vec("dt_bias", w.dt_bias, p)?;
        mat("b_proj", &w.b_proj, nh, h)?;
        match &w.output_gate {
            OutputGate::LowRank { a, b } => {
                mat("g_a_proj", a, d, h)?;
                mat("g_b_proj", b, p, d)?;
            }
            OutputGate::FullRank(g) => mat("g_proj", g, p, h)?,
        }
        vec("o_norm", w.o_norm, d)?;
        mat("o_proj", &w.o_proj, h, p)?;
        Ok(Kda { cfg, w })
    }

    /// A zeroed state for a new sequence that can roll back up to `rollback_window` tokens past
    /// its last commit (0: no rollback, one recurrent buffer). See [`KdaState`] for the costs.
    pub fn new_state(&self, rollback_window: usize) -> KdaState {
        let (p, nh, d, k) = (
            self.cfg.proj_dim(),
            self.cfg.num_heads,
            self.cfg.head_dim,
            self.cfg.conv_kernel_size,
        );
        let rec_len = nh * d * d;
        KdaState {
            conv: vec![0.0; (k - 1) * 3 * p],
            rec: [
                vec![0.0; rec_len],
                if rollback_window > 0 {
                    vec![0.0; rec_len]
                } else {
                    Vec::new()
                },
            ],
            cur: 0,
            base: 0,
            len: 0,
            base_len: 0,
            window: rollback_window,
            log: Vec::new(),
            row: 3 * p,
            log_row: p + nh,
            kernel: k,
        }
    }

    /// Decode: one token `x: [hidden]` (after `input_layernorm`) → `out: [hidden]`, using the
    /// recurrence directly (transformers' `recurrent_kimi_delta_attention`). [KDA_RECURRENCE]
    ///
    /// Errors: wrong lengths ([`KdaError::Input`]) or a state from another layer shape.
    pub fn step(&self, state: &mut KdaState, x: &[f32], out: &mut [f32]) -> Result<(), KdaError> {
        let h = self.cfg.hidden_size;
        if x.len() != h || out.len() != h {
            return Err(self.input_error(x.len(), out.len()));
        }
        self.run(state, x, 1, out, false)
    }

    /// Prefill: `n` tokens `x: [n, hidden]` → `out: [n, hidden]` in chunks of
    /// `cfg.chunk_size` tokens (transformers' `chunk_kimi_delta_attention`); the same result as
    /// `n` calls of [`Kda::step`] up to f32 rounding. [KDA_CHUNK]
    ///
    /// Errors: lengths that are not whole tokens or differ ([`KdaError::Input`]), or a state from
    /// another layer shape.
    pub fn prefill(&self, state: &mut KdaState, x: &[f32], out: &mut [f32]) -> Result<(), KdaError> {
        let h = self.cfg.hidden_size;
        if !x.len().is_multiple_of(h) || out.len() != x.len() {
            return Err(self.input_error(x.len(), out.len()));
        }
        let n = x.len() / h;
        if n == 0 {
            return Ok(());
        }
        self.run(state, x, n, out, true)
    }

    fn input_error(&self, len: usize, out_len: usize) -> KdaError {
        KdaError::Input {
            layer: self.cfg.layer,
            len,
            hidden: self.cfg.hidden_size,
            out_len,
        }
    }

    fn check_state(&self, s: &KdaState) -> Result<(), KdaError> {
        let (p, nh, d, k) = (
            self.cfg.proj_dim(),
            self.cfg.num_heads,
            self.cfg.head_dim,
            self.cfg.conv_kernel_size,
        );
        if s.row != 3 * p || s.kernel != k || s.log_row != p + nh || s.rec[0].len() != nh * d * d {
            return Err(KdaError::State {
                layer: self.cfg.layer,
                found_conv: s.row,
                found_rec: s.rec[0].len(),
                expected_conv: 3 * p,
                expected_rec: nh * d * d,
            });
        }
        Ok(())
    }

    fn run(&self, state: &mut KdaState, x: &[f32], n: usize, out: &mut [f32], chunked: bool) -> Result<(), KdaError> {
        self.check_state(state)?;
        let (p, nh) = (self.cfg.proj_dim(), self.cfg.num_heads);
        // A forward that would overflow the rollback log commits first; one longer than the
        // whole window is not logged and commits after itself too. [KDA_ROLLBACK]
        if (state.len - state.base_len) + n > state.window {
            state.commit();
        }
        let logged = (state.len - state.base_len) + n <= state.window;
        let pre = self.prepare(state, x, n);
        if logged {
            for t in 0..n {
                state.log.extend_from_slice(&pre.g[t * p..(t + 1) * p]);
                state.log.extend_from_slice(&pre.beta[t * nh..(t + 1) * nh]);
            }
        }
        // o: [n, P]
        let mut o = vec![0f32; n * p];
        {
            let (src, dst) = state.update_buffers();
            if chunked {
                self.chunked(src, dst, &pre, n, &mut o);
            } else {
                self.recurrence(src, dst, Some(&pre.q), &pre.k, &pre.v, &pre.g, &pre.beta, Some(&mut o));
            }
        }
        state.len += n;
        if !logged {
            state.commit();
        }
        self.output(x, n, &mut o, out);
        Ok(())
    }

    /// Projections, conv + SiLU, L2 norms, gate and β for `n` tokens; appends the tokens' conv
    /// inputs to the state's history.
    fn prepare(&self, state: &mut KdaState, x: &[f32], n: usize) -> Prepared {
        let (p, nh, d) = (self.cfg.proj_dim(), self.cfg.num_heads, self.cfg.head_dim);
        let w = &self.w;
        // q', k', v' = x W^T: [n, P] each, appended to the conv history as rows [q' | k' | v'].
        let mut qp = vec![0f32; n * p];
        let mut kp = vec![0f32; n * p];
        let mut vp = vec![0f32; n * p];
        w.q_proj.matmul(x, n, &mut qp);
        w.k_proj.matmul(x, n, &mut kp);
        w.v_proj.matmul(x, n, &mut vp);
        let first = state.conv.len() / state.row;
        state.conv.reserve(n * 3 * p);
        for t in 0..n {
            state.conv.extend_from_slice(&qp[t * p..(t + 1) * p]);
            state.conv.extend_from_slice(&kp[t * p..(t + 1) * p]);
            state.conv.extend_from_slice(&vp[t * p..(t + 1) * p]);
        }
        // q, k, v = silu(causal conv): [n, P] each, then per-head L2 norms and the q scale.
        let mut q = vec![0f32; n * p];
        let mut k = vec![0f32; n * p];
        let mut v = vec![0f32; n * p];
        self.conv_rows(&state.conv, first, n, 0, p, &mut q);
        self.conv_rows(&state.conv, first, n, p, 2 * p, &mut k);
        self.conv_rows(&state.conv, first, n, 2 * p, 3 * p, &mut v);
        let scale = 1.0 / (d as f32).sqrt();
        for qt in q.chunks_exact_mut(d) {
            l2_normalize(qt);
            for e in qt.iter_mut() {
                *e *= scale;
            }
        }
        self.finish_keys(&mut k);
        // u = f_b(f_a(x)) + dt_bias: [n, P]; g = gate(A_log[h], u). [KDA_GATE]
        let mut fa = vec![0f32; n * d];
        w.f_a_proj.matmul(x, n, &mut fa);
        let mut g = vec![0f32; n * p];
        w.f_b_proj.matmul(&fa, n, &mut g);
        for gt in g.chunks_exact_mut(p) {
            for (hh, gh) in gt.chunks_exact_mut(d).enumerate() {
                let a = w.a_log[hh];
                for (gi, &b) in gh.iter_mut().zip(&w.dt_bias[hh * d..(hh + 1) * d]) {
                    *gi = self.cfg.decay_gate.apply(a, *gi + b);
                }
            }
        }
        // β = σ(b_proj(x)): [n, num_heads]
        let mut beta = vec![0f32; n * nh];
        w.b_proj.matmul(x, n, &mut beta);
        for b in beta.iter_mut() {
            *b = sigmoid(*b);
        }
        Prepared { q, k, v, g, beta }
    }

    /// L2 normalisation of every head of `k: [n, P]`. [KDA_L2NORM]
    fn finish_keys(&self, k: &mut [f32]) {
        for kt in k.chunks_exact_mut(self.cfg.head_dim) {
            l2_normalize(kt);
        }
    }

    /// `silu(conv)` of conv-history rows `first..first + n`, channels `c0..c1` of the `3P`-wide
    /// rows, into `out: [n, c1 - c0]`. Tap `K - 1` is the row itself, tap `j` the row
    /// `K - 1 - j` earlier (PyTorch conv1d with `K - 1` zeros of left padding). [KDA_CONV]
    fn conv_rows(&self, hist: &[f32], first: usize, n: usize, c0: usize, c1: usize, out: &mut [f32]) {
        let p = self.cfg.proj_dim();
        let kk = self.cfg.conv_kernel_size;
        let row = 3 * p;
        let width = c1 - c0;
        for t in 0..n {
            let r = first + t;
            let o = &mut out[t * width..(t + 1) * width];
            for (ci, oc) in o.iter_mut().enumerate() {
                let c = c0 + ci;
                // weights of channel c (q, k or v conv by block), [K]
                let (wv, wc) = match c / p {
                    0 => (self.w.q_conv, c),
                    1 => (self.w.k_conv, c - p),
                    _ => (self.w.v_conv, c - 2 * p),
                };
                let taps = &wv[wc * kk..(wc + 1) * kk];
                let mut acc = 0f32;
                for (j, &tw) in taps.iter().enumerate() {
                    acc += tw * hist[(r + 1 + j - kk) * row + c];
                }
                *oc = silu(acc);
            }
        }
    }

    /// Token-by-token delta rule for `n = k.len() / P` tokens on every head, reading the state
    /// from `src` (or `dst` itself when `None`) and leaving it in `dst`; `o: [n, P]` when given
    /// (then `q` too). [KDA_RECURRENCE]
    #[allow(clippy::too_many_arguments)]
    fn recurrence(
        &self,
        src: Option<&[f32]>,
        dst: &mut [f32],
        q: Option<&[f32]>,
        k: &[f32],
        v: &[f32],
        g: &[f32],
        beta: &[f32],
        o: Option<&mut [f32]>,
    ) {
        let (p, nh, d) = (self.cfg.proj_dim(), self.cfg.num_heads, self.cfg.head_dim);
        let n = k.len() / p;
        let dd = d * d;
        let per_head: Vec<Vec<f32>> = dst
            .par_chunks_mut(dd)
            .enumerate()
            .map(|(hh, s)| {
                let mut oh = vec![0f32; if q.is_some() { n * d } else { 0 }];
                let mut src_h = src.map(|x| &x[hh * dd..(hh + 1) * dd]);
                for t in 0..n {
                    let r = t * p + hh * d..t * p + (hh + 1) * d;
                    let qt = q.map(|q| &q[r.clone()]);
                    let out_t = if q.is_some() {
                        Some(&mut oh[t * d..(t + 1) * d])
                    } else {
                        None
                    };
                    delta_step(
                        src_h.take(),
                        s,
                        d,
                        qt,
                        &k[r.clone()],
                        &v[r.clone()],
                        &g[r],
                        beta[t * nh + hh],
                        out_t,
                    );
                }
                oh
            })
            .collect();
        if let Some(o) = o {
            for (hh, oh) in per_head.iter().enumerate() {
                for t in 0..n {
                    o[t * p + hh * d..t * p + (hh + 1) * d].copy_from_slice(&oh[t * d..(t + 1) * d]);
                }
            }
        }
    }

    /// Chunked form over all heads: `pre` holds `n` tokens, `o: [n, P]`. [KDA_CHUNK]
    fn chunked(&self, src: Option<&[f32]>, dst: &mut [f32], pre: &Prepared, n: usize, o: &mut [f32]) {
        let (p, nh, d) = (self.cfg.proj_dim(), self.cfg.num_heads, self.cfg.head_dim);
        let c = self.cfg.chunk_size;
        let dd = d * d;
        let per_head: Vec<Vec<f32>> = dst
            .par_chunks_mut(dd)
            .enumerate()
            .map(|(hh, s)| {
                // this head's q, k, v, g: [n, d]; β: [n]
                let gather = |a: &[f32]| -> Vec<f32> {
                    (0..n)
                        .flat_map(|t| a[t * p + hh * d..t * p + (hh + 1) * d].iter().copied())
                        .collect()
                };
                let (qh, kh, vh, gh) = (gather(&pre.q), gather(&pre.k), gather(&pre.v), gather(&pre.g));
                let bh: Vec<f32> = (0..n).map(|t| pre.beta[t * nh + hh]).collect();
                let mut oh = vec![0f32; n * d];
                let mut src_h = src.map(|x| &x[hh * dd..(hh + 1) * dd]);
                let mut t0 = 0;
                while t0 < n {
                    let t1 = (t0 + c).min(n);
                    let r = t0 * d..t1 * d;
                    chunk_step(
                        src_h.take(),
                        s,
                        d,
                        &qh[r.clone()],
                        &kh[r.clone()],
                        &vh[r.clone()],
                        &gh[r.clone()],
                        &bh[t0..t1],
                        &mut oh[r],
                    );
                    t0 = t1;
                }
                oh
            })
            .collect();
        for (hh, oh) in per_head.iter().enumerate() {
            for t in 0..n {
                o[t * p + hh * d..t * p + (hh + 1) * d].copy_from_slice(&oh[t * d..(t + 1) * d]);
            }
        }
    }

    /// Gated per-head RMSNorm of `o: [n, P]` and `o_proj` into `out: [n, hidden]`. [KDA_OUT_NORM]
    fn output(&self, x: &[f32], n: usize, o: &mut [f32], out: &mut [f32]) {
        let (p, d) = (self.cfg.proj_dim(), self.cfg.head_dim);
        // gate: [n, P]
        let mut gate = vec![0f32; n * p];
        match &self.w.output_gate {
            OutputGate::LowRank { a, b } => {
                let mut ga = vec![0f32; n * d];
                a.matmul(x, n, &mut ga);
                b.matmul(&ga, n, &mut gate);
            }
            OutputGate::FullRank(gp) => gp.matmul(x, n, &mut gate),
        }
        for (oh, gh) in o.chunks_exact_mut(d).zip(gate.chunks_exact(d)) {
            rms_norm_inplace(oh, self.w.o_norm, self.cfg.norm_eps);
            for (e, &gv) in oh.iter_mut().zip(gh) {
                *e *= sigmoid(gv);
            }
        }
        self.w.o_proj.matmul(o, n, out);
    }
}

/// `x / sqrt(sum(x²) + 1e-6)` in place (transformers `l2norm`, fla's convention). [KDA_L2NORM]
pub fn l2_normalize(x: &mut [f32]) {
    let ss: f32 = x.iter().map(|v| v * v).sum();
    let norm = (ss + L2_NORM_EPS).sqrt();
    for v in x.iter_mut() {
        *v /= norm;
    }
}

/// One delta-rule update of one head's state `s: [d (key), d (value)]`: `S ← diag(e^g) S` (reading
/// `src` instead of `s` when given), `S ← S + k (β (v − S^T k))^T`, then `out = S^T q` when both
/// are given. `k`, `v`, `g`, `q`, `out`: `[d]`. [KDA_RECURRENCE]
#[allow(clippy::too_many_arguments)]
pub fn delta_step(
    src: Option<&[f32]>,
    s: &mut [f32],
    d: usize,
    q: Option<&[f32]>,
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: f32,
    out: Option<&mut [f32]>,
) {
    delta_step_kv(src, s, d, d, q, k, v, g, beta, out)
}

/// [`delta_step`] with key width `dk` and value width `dv`: state `s: [dk, dv]`, `q`, `k`, `g`:
/// `[dk]`, `v`, `out`: `[dv]` (gated DeltaNet passes its per-head scalar decay repeated over
/// `dk`). Same arithmetic in the same order, so `dk = dv = d` gives [`delta_step`]'s bits.
#[allow(clippy::too_many_arguments)]
pub fn delta_step_kv(
    src: Option<&[f32]>,
    s: &mut [f32],
    dk: usize,
    dv: usize,
    q: Option<&[f32]>,
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: f32,
    out: Option<&mut [f32]>,
) {
    // decay each key row, and r = S^T k: [dv]
    let mut r = vec![0f32; dv];
    for i in 0..dk {
        let e = g[i].exp();
        let row = &mut s[i * dv..(i + 1) * dv];
        match src {
            Some(x) => {
                for (a, &b) in row.iter_mut().zip(&x[i * dv..(i + 1) * dv]) {
                    *a = b * e;
                }
            }
            None => {
                for a in row.iter_mut() {
                    *a *= e;
                }
            }
        }
        let ki = k[i];
        for (rj, &sj) in r.iter_mut().zip(row.iter()) {
            *rj += ki * sj;
        }
    }
    // δ = β (v − r)
    for (rj, &vj) in r.iter_mut().zip(v) {
        *rj = beta * (vj - *rj);
    }
    let delta = r;
    let mut o = vec![0f32; if q.is_some() { dv } else { 0 }];
    for i in 0..dk {
        let row = &mut s[i * dv..(i + 1) * dv];
        let ki = k[i];
        for (a, &dj) in row.iter_mut().zip(&delta) {
            *a += ki * dj;
        }
        if let Some(q) = q {
            let qi = q[i];
            for (oj, &sj) in o.iter_mut().zip(row.iter()) {
                *oj += qi * sj;
            }
        }
    }
    if let Some(out) = out {
        out.copy_from_slice(&o);
    }
}

/// One chunk of `c = beta.len()` tokens on one head (the WY form of the same recurrence as
/// [`delta_step`]). `q, k, v, g, o: [c, d]`, state `s: [d, d]` read from `src` when given.
///
/// With `G_t = Σ_{j≤t} g_j` (per channel, within the chunk) and `S_0` the state before it:
/// `U_t = β_t (v_t − (k_t ⊙ e^{G_t})^T S_0 − Σ_{j<t} <k_t ⊙ e^{G_t − G_j}, k_j> U_j)`,
/// `o_t = (q_t ⊙ e^{G_t})^T S_0 + Σ_{j≤t} <q_t ⊙ e^{G_t − G_j}, k_j> U_j`,
/// `S_c = diag(e^{G_c}) S_0 + Σ_t (k_t ⊙ e^{G_c − G_t}) U_t^T`.
/// Every exponent is a difference `G_t − G_j ≤ 0` or `G_t ≤ 0`, computed before `exp`, so long
/// chunks with strong decay underflow towards 0 instead of overflowing (no `e^{−G}` factor).
/// [KDA_CHUNK]
#[allow(clippy::too_many_arguments)]
pub fn chunk_step(
    src: Option<&[f32]>,
    s: &mut [f32],
    d: usize,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    o: &mut [f32],
) {
    chunk_step_kv(src, s, d, d, q, k, v, g, beta, o)
}

/// [`chunk_step`] with key width `dk` and value width `dv`: `q, k, g: [c, dk]`, `v, o: [c, dv]`,
/// state `s: [dk, dv]`. Same arithmetic in the same order, so `dk = dv = d` gives
/// [`chunk_step`]'s bits.
#[allow(clippy::too_many_arguments)]
pub fn chunk_step_kv(
    src: Option<&[f32]>,
    s: &mut [f32],
    dk: usize,
    dv: usize,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    o: &mut [f32],
) {
    let c = beta.len();
    // G: [c, dk] cumulative log-decays
    let mut cg = g.to_vec();
    for t in 1..c {
        for i in 0..dk {
            cg[t * dk + i] += cg[(t - 1) * dk + i];
        }
    }
    let s0: &[f32] = match src {
        Some(x) => x,
        None => &*s,
    };
    // u[t] = v_t − (k_t ⊙ e^{G_t})^T S_0 and o[t] = (q_t ⊙ e^{G_t})^T S_0, both [dv]
    let mut u = v.to_vec();
    for t in 0..c {
        let (ut, ot) = (&mut u[t * dv..(t + 1) * dv], &mut o[t * dv..(t + 1) * dv]);
        ot.fill(0.0);
        for i in 0..dk {
            let e = cg[t * dk + i].exp();
            let (kc, qc) = (k[t * dk + i] * e, q[t * dk + i] * e);
            let row = &s0[i * dv..(i + 1) * dv];
            for ((uj, oj), &sj) in ut.iter_mut().zip(ot.iter_mut()).zip(row) {
                *uj -= kc * sj;
                *oj += qc * sj;
            }
        }
    }
    // Forward substitution over the chunk: U_t = β_t (u_t − Σ_{j<t} A_tj U_j); o_t += Σ_{j≤t} M_tj U_j.
    for t in 0..c {
        let (prev, rest) = u.split_at_mut(t * dv);
        let ut = &mut rest[..dv];
        let mut m_tt = 0f32;
        for j in 0..t {
            let (mut a, mut m) = (0f32, 0f32);
            for i in 0..dk {
                let e = (cg[t * dk + i] - cg[j * dk + i]).exp();
                a += k[t * dk + i] * e * k[j * dk + i];
                m += q[t * dk + i] * e * k[j * dk + i];
            }
            let uj = &prev[j * dv..(j + 1) * dv];
            for (x, &y) in ut.iter_mut().zip(uj) {
                *x -= a * y;
            }
            for (x, &y) in o[t * dv..(t + 1) * dv].iter_mut().zip(uj) {
                *x += m * y;
            }
        }
        for i in 0..dk {
            m_tt += q[t * dk + i] * k[t * dk + i];
        }
        for x in ut.iter_mut() {
            *x *= beta[t];
        }
        for (x, &y) in o[t * dv..(t + 1) * dv].iter_mut().zip(ut.iter()) {
            *x += m_tt * y;
        }
    }
    // S_c = diag(e^{G_c}) S_0 + Σ_t (k_t ⊙ e^{G_c − G_t}) U_t^T
    let last = (c - 1) * dk;
    for i in 0..dk {
        let e = cg[last + i].exp();
        let row = &mut s[i * dv..(i + 1) * dv];
        match src {
            Some(x) => {
                for (a, &b) in row.iter_mut().zip(&x[i * dv..(i + 1) * dv]) {
                    *a = b * e;
                }
            }
            None => {
                for a in row.iter_mut() {
                    *a *= e;
                }
            }
        }
        for t in 0..c {
            let kw = k[t * dk + i] * (cg[last + i] - cg[t * dk + i]).exp();
            for (a, &b) in row.iter_mut().zip(&u[t * dv..(t + 1) * dv]) {
                *a += kw * b;
            }
        }
    }
}

#[cfg(test)]
mod tests;
