//! Qwen3-Next (`qwen3_next`) and Qwen3.5-MoE (`qwen3_5_moe`, text model) forward pass, matching
//! transformers 5.24 `models/qwen3_next/modeling_qwen3_next.py` and
//! `models/qwen3_5_moe/modeling_qwen3_5_moe.py` (`Qwen3_5MoeForCausalLM`) in f32.
//!
//! Per decoder layer (PyTorch equivalent in the comments):
//! ```text
//! h = x + mixer(input_layernorm(x))            # gated DeltaNet or gated attention (layer_types)
//! x = h + mlp(post_attention_layernorm(h))     # sparse MoE block, or a dense MLP
//! ```
//! then `logits = lm_head(norm(x))`. Every RMSNorm of the model, the per-head q/k norms
//! included, is zero-centred: `x · rsqrt(mean(x²) + eps) · (1 + w)` (`Qwen3NextRMSNorm`); the
//! DeltaNet output norm is the ordinary gated one ([`crate::blocks::gated_deltanet`]).
//!
//! Gated attention (`Qwen3NextAttention`): `q_proj(x)` holds per head `[query (hd) | gate
//! (hd)]`; q and k get their per-head zero-centred RMSNorm, then rotate-half RoPE on the first
//! `rotary_dim = head_dim · partial_rotary_factor` dims only; grouped-query softmax attention with
//! scale `head_dim^-0.5`; the context is multiplied by `sigmoid(gate)` before `o_proj`. Qwen3.5's
//! interleaved M-RoPE uses the same position for its three sections with text-only input, which
//! is ordinary RoPE. [QWEN3_NEXT_ATTENTION]
//!
//! MoE (`Qwen3NextSparseMoeBlock`): softmax over all experts, top-k, renormalised when
//! `norm_topk_prob` [SOFTMAX_TOPK]; SwiGLU experts; plus a shared SwiGLU expert scaled by
//! `sigmoid(shared_expert_gate · x)`. [QWEN3_NEXT_MOE]
//!
//! Decode state: keys and values of the attention layers, and per DeltaNet layer its
//! convolution rows and recurrent state, which roll back within a window for speculative
//! decoding ([`GdnState`]).
//!
//! Weights: every tensor is resolved once at load into each `Layer` (handles named as in the
//! checkpoint, zero-centred norms precomputed) and read with the infallible [`Backbone::mat`] /
//! [`Backbone::vec`]: a forward pass looks nothing up by name.

use deltafin_format::model_dir::{Backbone, MatHandle, VecHandle};
use deltafin_format::qwen3_next::Qwen3NextMixer;
use deltafin_format::{ModelConfig, ModelDir, Qwen3NextConfig};
use deltafin_kernels::{axpy, dot, rms_norm_inplace, sigmoid, silu, softmax_inplace};

use crate::blocks::gated_deltanet::{GatedDeltaNet, GdnDims, GdnProj, GdnState, GdnWeights};
use crate::compute::{chunk_logits, decoder_layers, on_cpu, Cpu};
use crate::experts::{Expert, StoreOptions};
use crate::model::{
    add_into, swiglu, swiglu_batch, BatchOutput, FamilyModel, GluTensorNames, GluTensors, LayerRoutes, RoutedExperts,
};
use crate::models::family_config;
use crate::models::hybrid_state::{HybridState, LayerState};
use crate::moe::{route_softmax, route_softmax_masked, Routing};
use crate::rope::RotaryEmbedding;
use crate::EngineError;

/// Tokens past the last commit a DeltaNet state can roll back over (speculative decoding
/// verifies drafts shorter than this).
const GDN_ROLLBACK_WINDOW: usize = 32;
// A self-drafting run and its verification pass each fit in the rollback window.
const _: () = assert!(GDN_ROLLBACK_WINDOW > crate::speculate::MAX_DRAFT);

/// One token mixer's weights, resolved in the backbone once at load (names as in the
/// checkpoint) and read with [`Backbone::mat`] / [`Backbone::vec`].
enum Mixer {
    /// `self_attn.*` (`Qwen3NextAttention`).
    Attention(AttentionTensors),
    /// `linear_attn.*` (`Qwen3NextGatedDeltaNet`).
    DeltaNet(DeltaNetTensors),
}

/// One gated attention's tensors.
struct AttentionTensors {
    /// `[n_heads · 2 · head_dim, hidden]`: per head `[query | gate]`.
    q_proj: MatHandle,
    /// `[n_kv_heads · head_dim, hidden]` each.
    k_proj: MatHandle,
    v_proj: MatHandle,
    /// `[hidden, n_heads · head_dim]`.
    o_proj: MatHandle,
    /// `1 + q_norm.weight`, `1 + k_norm.weight`: `[head_dim]`.
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
}

/// One gated DeltaNet's tensors ([`GdnWeights`] as handles).
struct DeltaNetTensors {
    proj: ProjTensors,
    /// `conv1d.weight [conv_dim, 1, K]`, flat.
    conv1d: VecHandle,
    /// `dt_bias [nv]`.
    dt_bias: VecHandle,
    /// `A_log [nv]`.
    a_log: VecHandle,
    /// `norm.weight [dv]`.
    norm: VecHandle,
    /// `out_proj.weight [hidden, value_dim]`.
    out_proj: MatHandle,
}

/// [`GdnProj`] as handles.
enum ProjTensors {
    /// Qwen3-Next: `in_proj_qkvz`, `in_proj_ba`.
    Fused {
        in_proj_qkvz: MatHandle,
        in_proj_ba: MatHandle,
    },
    /// Qwen3.5: `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`.
    Split {
        in_proj_qkv: MatHandle,
        in_proj_z: MatHandle,
        in_proj_b: MatHandle,
        in_proj_a: MatHandle,
    },
}

/// One layer's `mlp`.
enum Mlp {
    /// `Qwen3NextMLP`: `mlp.{gate,up,down}_proj`.
    Dense(GluTensors),
    /// `Qwen3NextSparseMoeBlock` (the routed experts come from the expert store).
    Moe {
        /// The router `mlp.gate.weight [num_experts, hidden]`.
        gate: MatHandle,
        /// `mlp.shared_expert.{gate,up,down}_proj`.
        shared_expert: GluTensors,
        /// `mlp.shared_expert_gate.weight [1, hidden]`.
        shared_expert_gate: MatHandle,
    },
}

/// One decoder layer: its weights and precomputed norm weights.
struct Layer {
    /// `1 + input_layernorm.weight`, `1 + post_attention_layernorm.weight`: `[hidden]`.
    input_ln: Vec<f32>,
    post_ln: Vec<f32>,
    mixer: Mixer,
    mlp: Mlp,
}

/// Decode state of one Qwen3-Next layer's token mixer (a [`HybridState`] layer).
#[derive(Debug, Clone)]
pub enum MixerState {
    /// Keys (normalised, rotated) and values `[n_tokens, n_kv_heads · head_dim]`.
    Kv { k: Vec<f32>, v: Vec<f32> },
    /// A gated DeltaNet layer's recurrent state (with its rollback log).
    DeltaNet(GdnState),
}

impl LayerState for MixerState {
    fn commit(&mut self) {
        if let MixerState::DeltaNet(g) = self {
            g.commit();
        }
    }

    fn bytes(&self) -> usize {
        match self {
            MixerState::Kv { k, v } => (k.capacity() + v.capacity()) * 4,
            MixerState::DeltaNet(g) => g.bytes(),
        }
    }

    fn rollback_floor(&self) -> usize {
        match self {
            MixerState::DeltaNet(g) => g.committed_len(),
            MixerState::Kv { .. } => 0,
        }
    }
}

/// Per-sequence decode state of a Qwen3-Next model: one mixer state per layer; `dims` is the
/// attention layers' key/value width `n_kv_heads · head_dim`.
pub type Qwen3NextState = HybridState<MixerState, usize>;

/// A loaded Qwen3-Next / Qwen3.5-MoE model.
pub struct Qwen3Next {
    config: ModelConfig,
    pub cfg: Qwen3NextConfig,
    backbone: Backbone,
    layers: Vec<Layer>,
    /// `embed_tokens.weight [vocab_size, hidden]` (under the config's prefix).
    embed_tokens: MatHandle,
    /// `lm_head.weight [vocab_size, hidden]`.
    lm_head: MatHandle,
    /// `1 + norm.weight`.
    final_norm: Vec<f32>,
    rope: RotaryEmbedding,
    gdn: GdnDims,
    /// For each layer, the next MoE layer after it (prefetch prediction).
    next_moe: Vec<Option<usize>>,
    routed: RoutedExperts,
}

/// `1 + w` of a zero-centred RMSNorm weight.
fn centred(bb: &Backbone, name: &str) -> Result<Vec<f32>, EngineError> {
    Ok(bb.vector(name)?.iter().map(|w| 1.0 + w).collect())
}

impl Qwen3Next {
    /// Loads the backbone into memory and opens the expert store with `opts`.
    ///
    /// Errors: not a qwen3_next / qwen3_5_moe directory, a missing or malformed backbone tensor
    /// (every tensor the forward pass reads is checked here), unreadable files.
    pub fn load_with(dir: &ModelDir, opts: StoreOptions) -> Result<Self, EngineError> {
        let config = dir.manifest.config.clone();
        let cfg = family_config(dir, "qwen3_next", ModelConfig::as_qwen3_next)?;
        let bb = dir.load_backbone()?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for l in 0..cfg.num_hidden_layers {
            let p = cfg.name(&format!("layers.{l}"));
            let mixer = match cfg.mixers[l] {
                Qwen3NextMixer::Attention => {
                    let a = format!("{p}.self_attn");
                    Mixer::Attention(AttentionTensors {
                        q_proj: bb.matrix_handle(&format!("{a}.q_proj.weight"))?,
                        k_proj: bb.matrix_handle(&format!("{a}.k_proj.weight"))?,
                        v_proj: bb.matrix_handle(&format!("{a}.v_proj.weight"))?,
                        o_proj: bb.matrix_handle(&format!("{a}.o_proj.weight"))?,
                        q_norm: centred(&bb, &format!("{a}.q_norm.weight"))?,
                        k_norm: centred(&bb, &format!("{a}.k_norm.weight"))?,
                    })
                }
                Qwen3NextMixer::GatedDeltaNet => {
                    let a = format!("{p}.linear_attn");
                    let m = |n: &str| bb.matrix_handle(&format!("{a}.{n}.weight"));
                    let proj = if cfg.fused_linear_proj {
                        ProjTensors::Fused {
                            in_proj_qkvz: m("in_proj_qkvz")?,
                            in_proj_ba: m("in_proj_ba")?,
                        }
                    } else {
                        ProjTensors::Split {
                            in_proj_qkv: m("in_proj_qkv")?,
                            in_proj_z: m("in_proj_z")?,
                            in_proj_b: m("in_proj_b")?,
                            in_proj_a: m("in_proj_a")?,
                        }
                    };
                    Mixer::DeltaNet(DeltaNetTensors {
                        proj,
                        conv1d: bb.f32_handle(&format!("{a}.conv1d.weight"))?.0,
                        dt_bias: bb.vector_handle(&format!("{a}.dt_bias"))?,
                        a_log: bb.vector_handle(&format!("{a}.A_log"))?,
                        norm: bb.vector_handle(&format!("{a}.norm.weight"))?,
                        out_proj: m("out_proj")?,
                    })
                }
            };
            let mp = format!("{p}.mlp");
            let glu = |prefix: &str| GluTensors::resolve(&bb, &GluTensorNames::new(prefix));
            let mlp = if cfg.is_moe_layer(l) {
                Mlp::Moe {
                    gate: bb.matrix_handle(&format!("{mp}.gate.weight"))?,
                    shared_expert: glu(&format!("{mp}.shared_expert"))?,
                    shared_expert_gate: bb.matrix_handle(&format!("{mp}.shared_expert_gate.weight"))?,
                }
            } else {
                Mlp::Dense(glu(&mp)?)
            };
            layers.push(Layer {
                input_ln: centred(&bb, &format!("{p}.input_layernorm.weight"))?,
                post_ln: centred(&bb, &format!("{p}.post_attention_layernorm.weight"))?,
                mixer,
                mlp,
            });
        }
        let embed_tokens = bb.matrix_handle(&cfg.name("embed_tokens.weight"))?;
        let lm_head = bb.matrix_handle("lm_head.weight")?;
        let final_norm = centred(&bb, &cfg.name("norm.weight"))?;
        let gdn = GdnDims {
            hidden: cfg.hidden_size,
            nk: cfg.linear_num_key_heads,
            nv: cfg.linear_num_value_heads,
            dk: cfg.linear_key_head_dim,
            dv: cfg.linear_value_head_dim,
            kernel: cfg.linear_conv_kernel_dim,
            eps: cfg.rms_norm_eps,
        };
        let next_moe = (0..cfg.num_hidden_layers)
            .map(|l| (l + 1..cfg.num_hidden_layers).find(|&k| cfg.is_moe_layer(k)))
            .collect();
        let routed = RoutedExperts::open(dir, opts)?;
        Ok(Qwen3Next {
            rope: RotaryEmbedding::new(&cfg.rope, cfg.rotary_dim, false),
            config,
            cfg,
            backbone: bb,
            layers,
            embed_tokens,
            lm_head,
            final_norm,
            gdn,
            next_moe,
            routed,
        })
    }

    /// The gated DeltaNet `w` with its weights viewed in the backbone.
    fn deltanet(&self, w: &DeltaNetTensors) -> GatedDeltaNet<'_> {
        let bb = &self.backbone;
        let proj = match &w.proj {
            ProjTensors::Fused {
                in_proj_qkvz,
                in_proj_ba,
            } => GdnProj::Fused {
                qkvz: bb.mat(in_proj_qkvz),
                ba: bb.mat(in_proj_ba),
            },
            ProjTensors::Split {
                in_proj_qkv,
                in_proj_z,
                in_proj_b,
                in_proj_a,
            } => GdnProj::Split {
                qkv: bb.mat(in_proj_qkv),
                z: bb.mat(in_proj_z),
                b: bb.mat(in_proj_b),
                a: bb.mat(in_proj_a),
            },
        };
        GatedDeltaNet {
            dims: self.gdn,
            w: GdnWeights {
                proj,
                conv: bb.vec(&w.conv1d),
                dt_bias: bb.vec(&w.dt_bias),
                a_log: bb.vec(&w.a_log),
                norm: bb.vec(&w.norm),
                out_proj: bb.mat(&w.out_proj),
            },
        }
    }

    /// Gated attention (weights `w`) for `n` tokens `xn: [n, hidden]` at positions `pos0..`,
    /// appending their keys and values; returns `[n, hidden]`. [QWEN3_NEXT_ATTENTION]
    fn attention(
        &self,
        w: &AttentionTensors,
        xn: &[f32],
        n: usize,
        pos0: usize,
        kc: &mut Vec<f32>,
        vc: &mut Vec<f32>,
    ) -> Vec<f32> {
        let AttentionTensors {
            q_proj,
            k_proj,
            v_proj,
            o_proj,
            q_norm,
            k_norm,
        } = w;
        let bb = &self.backbone;
        let c = &self.cfg;
        let (nh, nkv, hd, rd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rotary_dim);
        let (kv_dim, group, scale) = (nkv * hd, nh / nkv, (hd as f32).powf(-0.5));
        let mut qg = vec![0f32; n * 2 * nh * hd];
        let mut k = vec![0f32; n * kv_dim];
        let mut v = vec![0f32; n * kv_dim];
        bb.mat(q_proj).matmul(xn, n, &mut qg);
        bb.mat(k_proj).matmul(xn, n, &mut k);
        bb.mat(v_proj).matmul(xn, n, &mut v);
        let mut ctx = vec![0f32; n * nh * hd];
        for t in 0..n {
            let pos = pos0 + t;
            let kt = &mut k[t * kv_dim..(t + 1) * kv_dim];
            for kh in kt.chunks_exact_mut(hd) {
                rms_norm_inplace(kh, k_norm, c.rms_norm_eps);
                self.rope.apply(&mut kh[..rd], pos);
            }
            kc.extend_from_slice(kt);
            vc.extend_from_slice(&v[t * kv_dim..(t + 1) * kv_dim]);
            let qt = &mut qg[t * 2 * nh * hd..(t + 1) * 2 * nh * hd];
            let mut scores = vec![0f32; pos + 1];
            for h in 0..nh {
                let (q, gate) = qt[h * 2 * hd..(h + 1) * 2 * hd].split_at_mut(hd);
                rms_norm_inplace(q, q_norm, c.rms_norm_eps);
                self.rope.apply(&mut q[..rd], pos);
                let kvo = (h / group) * hd;
                for (s, sc) in scores.iter_mut().enumerate() {
                    *sc = dot(q, &kc[s * kv_dim + kvo..s * kv_dim + kvo + hd]) * scale;
                }
                softmax_inplace(&mut scores);
                let o = &mut ctx[t * nh * hd + h * hd..t * nh * hd + (h + 1) * hd];
                for (s, &p) in scores.iter().enumerate() {
                    axpy(p, &vc[s * kv_dim + kvo..s * kv_dim + kvo + hd], o);
                }
                for (e, &g) in o.iter_mut().zip(gate.iter()) {
                    *e *= sigmoid(g);
                }
            }
        }
        let mut out = vec![0f32; n * c.hidden_size];
        bb.mat(o_proj).matmul(&ctx, n, &mut out);
        out
    }

    /// The MLP of layer `l` for `n` tokens `xn: [n, hidden]` → `[n, hidden]`, with the routing
    /// of each token on MoE layers. `draft` (one token): the router restricted to the experts
    /// resident in the cache, computed with those records, no reads ([`CausalLm::forward_draft`]).
    /// [QWEN3_NEXT_MOE]
    fn mlp(&self, l: usize, xn: &[f32], n: usize, draft: bool) -> Result<(Vec<f32>, Vec<Routing>), EngineError> {
        let c = &self.cfg;
        let bb = &self.backbone;
        let h = c.hidden_size;
        let (gate, shared_expert, shared_expert_gate) = match &self.layers[l].mlp {
            Mlp::Dense(d) => {
                let [g, u, d] = d.view(bb);
                return Ok((swiglu_batch(g, u, d, xn, n), Vec::new()));
            }
            Mlp::Moe {
                gate,
                shared_expert,
                shared_expert_gate,
            } => (gate, shared_expert, shared_expert_gate),
        };
        let router = bb.mat(gate);
        let [sg, su, sd] = shared_expert.view(bb);
        let shared_gate = bb.mat(shared_expert_gate);
        let k = self.routed.experts_per_token();
        let mut logits = vec![0f32; n * router.rows];
        router.matmul(xn, n, &mut logits);
        let mut scratch = Vec::new();
        let routings: Vec<Routing> = if draft {
            Vec::new()
        } else {
            logits
                .chunks_exact(router.rows)
                .map(|lg| route_softmax(lg, k, c.norm_topk_prob, &mut scratch))
                .collect()
        };
        let fused = c.fused_experts;
        let (mut y, shared, routings) = if draft && n == 1 {
            let (y, shared, r) = self.routed.run_draft(
                l,
                router.rows,
                |allowed| route_softmax_masked(&logits, k, c.norm_topk_prob, &mut scratch, Some(allowed)),
                h,
                |e| expert_forward(e, fused, xn),
                Some(|| swiglu(sg, su, sd, xn)),
            );
            (y, shared, vec![r])
        } else if n == 1 {
            let predict = || -> Result<Option<(usize, Vec<usize>)>, EngineError> {
                let Some(next) = self.next_moe[l] else { return Ok(None) };
                let Mlp::Moe { gate: next_gate, .. } = &self.layers[next].mlp else {
                    return Ok(None);
                };
                let r = bb.mat(next_gate);
                let mut lg = vec![0f32; r.rows];
                r.matvec(xn, &mut lg);
                let mut p = Vec::new();
                Ok(Some((next, route_softmax(&lg, k, c.norm_topk_prob, &mut p).experts)))
            };
            let (y, shared) = self.routed.run(
                l,
                &routings[0],
                h,
                |e| expert_forward(e, fused, xn),
                Some(|| swiglu(sg, su, sd, xn)),
                predict,
            )?;
            (y, shared, routings)
        } else {
            let (y, shared) = self.routed.run_batch(
                l,
                &routings,
                h,
                |e, toks| {
                    let x: Vec<f32> = toks
                        .iter()
                        .flat_map(|&t| xn[t * h..(t + 1) * h].iter().copied())
                        .collect();
                    expert_forward_batch(e, fused, &x, toks.len())
                },
                Some(|| swiglu_batch(sg, su, sd, xn, n)),
            )?;
            (y, shared, routings)
        };
        let shared = shared.ok_or_else(|| EngineError::Invalid(format!("layer {l}: shared expert output missing")))?;
        // y += sigmoid(shared_expert_gate · x) · shared_expert(x), per token.
        let mut gl = vec![0f32; n];
        shared_gate.matmul(xn, n, &mut gl);
        for t in 0..n {
            axpy(sigmoid(gl[t]), &shared[t * h..(t + 1) * h], &mut y[t * h..(t + 1) * h]);
        }
        Ok((y, routings))
    }

    /// Runs `tokens` at the next positions of `st`; DeltaNet layers take the chunked path when
    /// `chunked` (prefill), the recurrence otherwise; `draft` routes MoE layers among the cached
    /// experts only (one token, self-drafting). Returns logits of every position
    /// (`all_logits`) or the last, and every position's routes.
    fn forward_tokens(
        &self,
        st: &mut Qwen3NextState,
        tokens: &[u32],
        all_logits: bool,
        chunked: bool,
        draft: bool,
    ) -> Result<BatchOutput, EngineError> {
        let c = &self.cfg;
        let (n, h) = (tokens.len(), c.hidden_size);
        let foreign = st
            .layers
            .iter()
            .any(|s| matches!(s, MixerState::DeltaNet(g) if g.dims() != self.gdn));
        if foreign || st.layers.len() != c.num_hidden_layers || st.dims != c.num_key_value_heads * c.head_dim {
            return Err(EngineError::Invalid("decode state belongs to another model".into()));
        }
        EngineError::check_tokens(tokens, c.vocab_size)?;
        if n == 0 {
            return Ok(BatchOutput::default());
        }
        let bb = &self.backbone;
        let embed = bb.mat(&self.embed_tokens);
        let mut x = vec![0f32; n * h];
        for (t, &tok) in tokens.iter().enumerate() {
            embed.row_into(tok as usize, &mut x[t * h..(t + 1) * h]);
        }
        let pos0 = st.len;
        let mut routes: Vec<LayerRoutes> = vec![Vec::new(); n];
        let layers = &self.layers;
        decoder_layers(
            &Cpu,
            &mut x,
            n,
            (layers.len(), c.rms_norm_eps),
            |l| (&layers[l].input_ln[..], &layers[l].post_ln[..]),
            |l, xn, out| {
                *out = self.routed.time_attention(|| -> Result<Vec<f32>, EngineError> {
                    match (&layers[l].mixer, &mut st.layers[l]) {
                        (Mixer::Attention(w), MixerState::Kv { k, v }) => Ok(self.attention(w, xn, n, pos0, k, v)),
                        (Mixer::DeltaNet(w), MixerState::DeltaNet(s)) => {
                            let mut out = vec![0f32; n * h];
                            self.deltanet(w).forward(s, xn, n, &mut out, chunked);
                            Ok(out)
                        }
                        _ => Err(EngineError::Invalid(format!(
                            "layer {l}: the decode state is not this model's (another mixer kind)"
                        ))),
                    }
                })?;
                Ok(())
            },
            |l, xn, x| {
                let (y, r) = self.routed.time_mlp(|| self.mlp(l, xn, n, draft))?;
                add_into(x, &y);
                for (t, rt) in r.into_iter().enumerate() {
                    routes[t].push((l, rt));
                }
                Ok(())
            },
        )?;
        st.len += n;
        for _ in 0..n {
            self.routed.count_forward();
        }
        let logits = on_cpu(chunk_logits(
            &Cpu,
            x,
            n,
            all_logits,
            (&self.final_norm, c.rms_norm_eps),
            &bb.mat(&self.lm_head),
        ));
        Ok(BatchOutput { logits, routes })
    }
}

/// One routed expert on `x: [hidden]`: SwiGLU from `gate_proj`, `up_proj`, `down_proj`, or from
/// the fused `gate_up_proj [2I, hidden]` (gate rows first) and `down_proj`.
fn expert_forward(e: &Expert, fused: bool, x: &[f32]) -> Vec<f32> {
    if !fused {
        return swiglu(e.matrix(0), e.matrix(1), e.matrix(2), x);
    }
    expert_forward_batch(e, true, x, 1)
}

/// [`expert_forward`] for `n` tokens `x: [n, hidden]` → `[n, hidden]`.
fn expert_forward_batch(e: &Expert, fused: bool, x: &[f32], n: usize) -> Vec<f32> {
    if !fused {
        return swiglu_batch(e.matrix(0), e.matrix(1), e.matrix(2), x, n);
    }
    let (gu, down) = (e.matrix(0), e.matrix(1));
    let i = gu.rows / 2;
    let mut a = vec![0f32; n * gu.rows];
    gu.matmul(x, n, &mut a);
    let mut act = vec![0f32; n * i];
    for t in 0..n {
        let (g, u) = a[t * 2 * i..(t + 1) * 2 * i].split_at(i);
        for ((o, &gv), &uv) in act[t * i..(t + 1) * i].iter_mut().zip(g).zip(u) {
            *o = silu(gv) * uv;
        }
    }
    let mut out = vec![0f32; n * down.rows];
    down.matmul(&act, n, &mut out);
    out
}

impl FamilyModel for Qwen3Next {
    type State = Qwen3NextState;

    crate::model::resident_items!();

    fn new_state(&self) -> Qwen3NextState {
        let layers = self
            .cfg
            .mixers
            .iter()
            .map(|m| match m {
                Qwen3NextMixer::Attention => MixerState::Kv {
                    k: Vec::new(),
                    v: Vec::new(),
                },
                Qwen3NextMixer::GatedDeltaNet => MixerState::DeltaNet(GdnState::new(self.gdn, GDN_ROLLBACK_WINDOW)),
            })
            .collect();
        HybridState::new(layers, self.cfg.num_key_value_heads * self.cfg.head_dim)
    }

    fn step(&self, st: &mut Qwen3NextState, token: u32) -> Result<(Vec<f32>, LayerRoutes), EngineError> {
        let mut out = self.forward_tokens(st, &[token], false, false, false)?;
        let logits = out.logits.pop().unwrap_or_default();
        Ok((logits, out.routes.pop().unwrap_or_default()))
    }

    fn draft_step(&self, st: &mut Qwen3NextState, token: u32) -> Result<Option<Vec<f32>>, EngineError> {
        let mut out = self.forward_tokens(st, &[token], false, false, true)?;
        Ok(out.logits.pop())
    }

    fn supports_draft(&self) -> bool {
        true
    }

    /// A layer-major pass over the chunk: DeltaNet layers in chunks (the reference's prefill
    /// path), attention token by token within the layer, MoE expert-major
    /// ([`RoutedExperts::run_batch`]).
    fn chunk(&self, st: &mut Qwen3NextState, tokens: &[u32], all_logits: bool) -> Result<BatchOutput, EngineError> {
        self.forward_tokens(st, tokens, all_logits, true, false)
    }

    /// f32 activations of a batched pass per token: the DeltaNet projections (`in_proj_qkvz` /
    /// `in_proj_qkv + z`), conv inputs and outputs, q, k, v, z, o and the block output; the
    /// attention query+gate, keys and values; hidden-sized residual and norm buffers; router
    /// logits.
    fn batch_bytes_per_token(&self) -> usize {
        let c = &self.cfg;
        let (kd, vd) = (c.key_dim(), c.value_dim());
        let deltanet = (2 * kd + 2 * vd + 2 * c.linear_num_value_heads) + 2 * c.conv_dim() + 2 * kd + 3 * vd;
        let attn = 3 * c.num_attention_heads * c.head_dim + 2 * c.num_key_value_heads * c.head_dim;
        4 * (deltanet.max(attn) + 8 * c.hidden_size + c.num_experts)
    }

    fn rollback(&self, st: &mut Qwen3NextState, len: usize) -> bool {
        st.rollback(len, |_, &kv_dim, s| match s {
            MixerState::DeltaNet(g) => g.rollback(len),
            MixerState::Kv { k, v } => {
                k.truncate(len * kv_dim);
                v.truncate(len * kv_dim);
                true
            }
        })
    }
}
