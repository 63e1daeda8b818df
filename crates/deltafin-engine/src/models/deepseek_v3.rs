//! DeepSeek-V3 / Kimi K2 forward pass, one token at a time, matching transformers'
//! `models/deepseek_v3/modeling_deepseek_v3.py` in f32.
//!
//! Per decoder layer (PyTorch equivalent in the comments):
//! ```text
//! h = x + self_attn(input_layernorm(x))           # MLA, latent KV cache
//! x = h + mlp(post_attention_layernorm(h))        # dense MLP below first_k_dense_replace, else MoE
//! ```
//! then `logits = lm_head(norm(x))`.
//!
//! MLA (DeepSeek-V2 paper §2.1, arXiv:2405.04434) runs in its weight-absorbed form: the KV cache
//! holds, per position, the normalised latent `c_kv: [kv_lora_rank]` and the rotated shared key
//! `k_pe: [qk_rope_head_dim]`, never per-head keys and values. For head h,
//! `q_nope_h · (W_UK_h c_t) = (W_UK_h^T q_nope_h) · c_t` and `Σ_t p_t W_UV_h c_t = W_UV_h Σ_t p_t c_t`,
//! which equal the reference's expanded form up to f32 summation order. [MLA_ABSORB]

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use deltafin_format::{DeepseekV3Config, ModelDir, Rope};
use deltafin_kernels::{argmax, rms_norm, silu, softmax_inplace, MatRef};
use rayon::prelude::*;

use crate::experts::{Expert, ExpertStore, StoreOptions};
use crate::moe::{route, RouterConfig, Routing};
use crate::rope::{yarn_mscale, RotaryEmbedding};
use crate::EngineError;

use deltafin_format::model_dir::Backbone;

/// eps of `q_a_layernorm` and `kv_a_layernorm`: the reference constructs them with the
/// `DeepseekV3RMSNorm` default (1e-6) whatever `rms_norm_eps` says. [LATENT_NORM_EPS]
const LATENT_NORM_EPS: f32 = 1e-6;

/// Tensor names of one decoder layer, as in the Hugging Face checkpoint.
struct LayerNames {
    input_layernorm: String,
    post_attention_layernorm: String,
    q_proj: String,
    q_a_proj: String,
    q_a_layernorm: String,
    q_b_proj: String,
    kv_a_proj_with_mqa: String,
    kv_a_layernorm: String,
    kv_b_proj: String,
    o_proj: String,
    gate_proj: String,
    up_proj: String,
    down_proj: String,
    router: String,
    router_bias: String,
    shared_gate_proj: String,
    shared_up_proj: String,
    shared_down_proj: String,
}

impl LayerNames {
    fn new(l: usize) -> Self {
        let p = format!("model.layers.{l}");
        let a = format!("{p}.self_attn");
        let m = format!("{p}.mlp");
        LayerNames {
            input_layernorm: format!("{p}.input_layernorm.weight"),
            post_attention_layernorm: format!("{p}.post_attention_layernorm.weight"),
            q_proj: format!("{a}.q_proj.weight"),
            q_a_proj: format!("{a}.q_a_proj.weight"),
            q_a_layernorm: format!("{a}.q_a_layernorm.weight"),
            q_b_proj: format!("{a}.q_b_proj.weight"),
            kv_a_proj_with_mqa: format!("{a}.kv_a_proj_with_mqa.weight"),
            kv_a_layernorm: format!("{a}.kv_a_layernorm.weight"),
            kv_b_proj: format!("{a}.kv_b_proj.weight"),
            o_proj: format!("{a}.o_proj.weight"),
            gate_proj: format!("{m}.gate_proj.weight"),
            up_proj: format!("{m}.up_proj.weight"),
            down_proj: format!("{m}.down_proj.weight"),
            router: format!("{m}.gate.weight"),
            router_bias: format!("{m}.gate.e_score_correction_bias"),
            shared_gate_proj: format!("{m}.shared_experts.gate_proj.weight"),
            shared_up_proj: format!("{m}.shared_experts.up_proj.weight"),
            shared_down_proj: format!("{m}.shared_experts.down_proj.weight"),
        }
    }
}

/// Per-sequence decode state: the MLA latent KV cache of every layer.
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    /// `[layer][n_tokens * kv_lora_rank]`: normalised latents `c_kv`.
    c_kv: Vec<Vec<f32>>,
    /// `[layer][n_tokens * qk_rope_head_dim]`: rotated shared rope keys.
    k_pe: Vec<Vec<f32>>,
    /// Tokens cached.
    len: usize,
}

impl KvCache {
    /// Tokens held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes held by the cache.
    pub fn bytes(&self) -> usize {
        self.c_kv.iter().chain(&self.k_pe).map(|v| v.capacity() * 4).sum()
    }

    /// Drops every position at or after `len` (rollback).
    pub fn truncate(&mut self, len: usize, kv_lora_rank: usize, rope_dim: usize) {
        if len < self.len {
            for v in &mut self.c_kv {
                v.truncate(len * kv_lora_rank);
            }
            for v in &mut self.k_pe {
                v.truncate(len * rope_dim);
            }
            self.len = len;
        }
    }
}

/// Which routed experts each MoE layer chose for the last token (for traces and tests).
pub type LayerRoutes = Vec<(usize, Routing)>;

/// Cumulative time spent in the parts of the forward pass, nanoseconds (for per-step breakdowns:
/// the caller takes differences around a step).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Profile {
    /// Attention (MLA) including its projections.
    pub attention_ns: u64,
    /// MoE and dense MLP blocks, including the time spent waiting for expert reads.
    pub mlp_ns: u64,
    /// Forward passes completed.
    pub forwards: u64,
}

/// A loaded DeepSeek-V3-family model: resident backbone plus the routed-expert store.
pub struct DeepseekV3 {
    pub cfg: DeepseekV3Config,
    backbone: Backbone,
    names: Vec<LayerNames>,
    rope: RotaryEmbedding,
    /// Softmax scale `qk_head_dim^-0.5 · mscale²`. [YARN_MSCALE]
    softmax_scale: f32,
    router: RouterConfig,
    /// Routed experts per token actually used (the config's top-k unless overridden).
    experts_per_token: AtomicUsize,
    /// Whether to predict the next MoE layer's experts and prefetch them.
    prefetch: bool,
    /// Compute-only measurement mode: one resident stand-in record per MoE layer (None for dense
    /// layers); no expert reads. Output is not the model's.
    compute_only: Option<Vec<Option<Arc<Expert>>>>,
    attention_ns: AtomicU64,
    mlp_ns: AtomicU64,
    forwards: AtomicU64,
    pub store: Arc<ExpertStore>,
}

impl DeepseekV3 {
    /// Loads the backbone into memory and opens the expert store with a cache of `ram_budget`
    /// bytes and default store options.
    ///
    /// Errors: a missing or malformed tensor in the backbone, unreadable files.
    pub fn load(dir: &ModelDir, ram_budget: u64) -> Result<Self, EngineError> {
        Self::load_with(dir, StoreOptions::new(ram_budget))
    }

    /// Loads the backbone into memory and opens the expert store with `opts` (prefetch of
    /// predicted experts is on when `opts.prefetch` is).
    ///
    /// Errors: a missing or malformed tensor in the backbone, unreadable files, O_DIRECT refused.
    pub fn load_with(dir: &ModelDir, opts: StoreOptions) -> Result<Self, EngineError> {
        let cfg = dir.manifest.config.clone();
        let backbone = dir.load_backbone()?;
        let names: Vec<LayerNames> = (0..cfg.num_hidden_layers).map(LayerNames::new).collect();
        // Check every tensor the forward pass uses once, so a bad directory fails at load.
        backbone.matrix("model.embed_tokens.weight")?;
        backbone.matrix("lm_head.weight")?;
        backbone.vector("model.norm.weight")?;
        for (l, n) in names.iter().enumerate() {
            backbone.vector(&n.input_layernorm)?;
            backbone.vector(&n.post_attention_layernorm)?;
            if cfg.q_lora_rank.is_some() {
                backbone.matrix(&n.q_a_proj)?;
                backbone.vector(&n.q_a_layernorm)?;
                backbone.matrix(&n.q_b_proj)?;
            } else {
                backbone.matrix(&n.q_proj)?;
            }
            backbone.matrix(&n.kv_a_proj_with_mqa)?;
            backbone.vector(&n.kv_a_layernorm)?;
            backbone.matrix(&n.kv_b_proj)?;
            backbone.matrix(&n.o_proj)?;
            if cfg.is_moe_layer(l) {
                backbone.matrix(&n.router)?;
                backbone.vector(&n.router_bias)?;
                if cfg.n_shared_experts > 0 {
                    backbone.matrix(&n.shared_gate_proj)?;
                    backbone.matrix(&n.shared_up_proj)?;
                    backbone.matrix(&n.shared_down_proj)?;
                }
            } else {
                backbone.matrix(&n.gate_proj)?;
                backbone.matrix(&n.up_proj)?;
                backbone.matrix(&n.down_proj)?;
            }
        }
        let rope = RotaryEmbedding::new(&cfg.rope, cfg.qk_rope_head_dim, cfg.rope_interleave);
        let mut softmax_scale = (cfg.qk_head_dim() as f64).powf(-0.5);
        if let Rope::Yarn {
            factor,
            mscale_all_dim: Some(m),
            ..
        } = cfg.rope
        {
            let ms = yarn_mscale(factor, m);
            softmax_scale *= ms * ms;
        }
        let router = RouterConfig {
            n_routed_experts: cfg.n_routed_experts,
            top_k: cfg.num_experts_per_tok,
            n_group: cfg.n_group,
            topk_group: cfg.topk_group,
            norm_topk_prob: cfg.norm_topk_prob,
            routed_scaling_factor: cfg.routed_scaling_factor,
        };
        let prefetch = opts.prefetch;
        let store = Arc::new(ExpertStore::open(dir, opts)?);
        Ok(DeepseekV3 {
            experts_per_token: AtomicUsize::new(cfg.num_experts_per_tok),
            prefetch,
            compute_only: None,
            attention_ns: AtomicU64::new(0),
            mlp_ns: AtomicU64::new(0),
            forwards: AtomicU64::new(0),
            cfg,
            backbone,
            names,
            rope,
            softmax_scale: softmax_scale as f32,
            router,
            store,
        })
    }

    /// Bytes of the resident backbone.
    pub fn backbone_bytes(&self) -> usize {
        self.backbone.bytes()
    }

    /// Cumulative forward-pass timings.
    pub fn profile(&self) -> Profile {
        Profile {
            attention_ns: self.attention_ns.load(Ordering::Relaxed),
            mlp_ns: self.mlp_ns.load(Ordering::Relaxed),
            forwards: self.forwards.load(Ordering::Relaxed),
        }
    }

    /// Routed experts used per token (the config's `num_experts_per_tok` unless overridden).
    pub fn experts_per_token(&self) -> usize {
        self.experts_per_token.load(Ordering::Relaxed)
    }

    /// Whether routing differs from the model's own (`--experts-per-token` set to another value):
    /// output is then not equivalent to the model.
    pub fn non_default_routing(&self) -> bool {
        self.experts_per_token() != self.cfg.num_experts_per_tok
    }

    /// Research control (`--experts-per-token K`): route every token to `k` experts instead of
    /// the config's top-k. Output is then NOT the model's; callers must label it.
    ///
    /// Errors: `k` is 0 or more than the experts the group limit leaves selectable.
    pub fn set_experts_per_token(&self, k: usize) -> Result<(), EngineError> {
        let c = &self.cfg;
        let selectable = c.topk_group * (c.n_routed_experts / c.n_group.max(1));
        if k == 0 || k > selectable {
            return Err(EngineError::Invalid(format!(
                "--experts-per-token {k}: must be between 1 and {selectable} (routed experts selectable within topk_group {} of n_group {})",
                c.topk_group, c.n_group
            )));
        }
        self.experts_per_token.store(k, Ordering::Relaxed);
        Ok(())
    }

    /// MEASUREMENT ONLY (`--compute-only`): reads one record per MoE layer now and computes every
    /// chosen expert with it, so a run measures compute with no expert I/O. Output is not the
    /// model's.
    pub fn set_compute_only(&mut self) -> Result<(), EngineError> {
        let c = &self.cfg;
        let mut v = Vec::with_capacity(c.num_hidden_layers);
        for l in 0..c.num_hidden_layers {
            v.push(if c.is_moe_layer(l) {
                Some(self.store.get(l, &[0])?.remove(0))
            } else {
                None
            });
        }
        self.compute_only = Some(v);
        Ok(())
    }

    /// Whether compute-only measurement mode is on.
    pub fn compute_only(&self) -> bool {
        self.compute_only.is_some()
    }

    /// Turns next-layer expert prediction and prefetch on or off.
    pub fn set_prefetch(&mut self, on: bool) {
        self.prefetch = on;
    }

    /// A fresh, empty KV cache for one sequence.
    pub fn new_cache(&self) -> KvCache {
        KvCache {
            c_kv: vec![Vec::new(); self.cfg.num_hidden_layers],
            k_pe: vec![Vec::new(); self.cfg.num_hidden_layers],
            len: 0,
        }
    }

    fn m(&self, name: &str) -> Result<MatRef<'_>, EngineError> {
        Ok(self.backbone.matrix(name)?)
    }

    fn v(&self, name: &str) -> Result<&[f32], EngineError> {
        Ok(self.backbone.vector(name)?)
    }

    /// Runs one token at the next position of `cache`; returns the logits `[vocab_size]` and
    /// the routing of every MoE layer.
    ///
    /// Errors: token id outside the vocabulary, expert read or checksum failures.
    pub fn forward(&self, cache: &mut KvCache, token: u32) -> Result<(Vec<f32>, LayerRoutes), EngineError> {
        let c = &self.cfg;
        if token as usize >= c.vocab_size {
            return Err(EngineError::TokenOutOfRange {
                id: token,
                vocab_size: c.vocab_size,
            });
        }
        let pos = cache.len;
        let h = c.hidden_size;
        // x: [hidden]
        let mut x = vec![0f32; h];
        self.m("model.embed_tokens.weight")?.row_into(token as usize, &mut x);
        let mut xn = vec![0f32; h];
        let mut routes = Vec::new();
        for l in 0..c.num_hidden_layers {
            let n = &self.names[l];
            rms_norm(&x, self.v(&n.input_layernorm)?, c.rms_norm_eps, &mut xn);
            let t_attn = Instant::now();
            let attn = self.attention(l, &xn, pos, cache)?;
            self.attention_ns
                .fetch_add(t_attn.elapsed().as_nanos() as u64, Ordering::Relaxed);
            for (a, b) in x.iter_mut().zip(&attn) {
                *a += b;
            }
            rms_norm(&x, self.v(&n.post_attention_layernorm)?, c.rms_norm_eps, &mut xn);
            let t_mlp = Instant::now();
            let mlp = if c.is_moe_layer(l) {
                let (out, r) = self.moe(l, &xn)?;
                routes.push((l, r));
                out
            } else {
                self.mlp(self.m(&n.gate_proj)?, self.m(&n.up_proj)?, self.m(&n.down_proj)?, &xn)
            };
            self.mlp_ns
                .fetch_add(t_mlp.elapsed().as_nanos() as u64, Ordering::Relaxed);
            for (a, b) in x.iter_mut().zip(&mlp) {
                *a += b;
            }
        }
        cache.len += 1;
        self.forwards.fetch_add(1, Ordering::Relaxed);
        rms_norm(&x.clone(), self.v("model.norm.weight")?, c.rms_norm_eps, &mut x);
        let lm = self.m("lm_head.weight")?;
        let mut logits = vec![0f32; lm.rows];
        lm.matvec(&x, &mut logits);
        Ok((logits, routes))
    }

    /// MLA for one token at position `pos`; appends this token's latent and rope key to the
    /// cache. xn: `[hidden]` → `[hidden]`.
    fn attention(&self, l: usize, xn: &[f32], pos: usize, cache: &mut KvCache) -> Result<Vec<f32>, EngineError> {
        let c = &self.cfg;
        let n = &self.names[l];
        let (nh, nope, rope, vd, kvl) = (
            c.num_attention_heads,
            c.qk_nope_head_dim,
            c.qk_rope_head_dim,
            c.v_head_dim,
            c.kv_lora_rank,
        );
        let qk = nope + rope;
        // q: [n_heads, qk_head_dim]
        let mut q = vec![0f32; nh * qk];
        match c.q_lora_rank {
            Some(r) => {
                // q = q_b_proj(q_a_layernorm(q_a_proj(x)))
                let mut qa = vec![0f32; r];
                self.m(&n.q_a_proj)?.matvec(xn, &mut qa);
                let mut qan = vec![0f32; r];
                rms_norm(&qa, self.v(&n.q_a_layernorm)?, LATENT_NORM_EPS, &mut qan);
                self.m(&n.q_b_proj)?.matvec(&qan, &mut q);
            }
            None => self.m(&n.q_proj)?.matvec(xn, &mut q),
        }
        // compressed_kv: [kv_lora_rank + qk_rope_head_dim] = kv_a_proj_with_mqa(x)
        let mut ckv = vec![0f32; kvl + rope];
        self.m(&n.kv_a_proj_with_mqa)?.matvec(xn, &mut ckv);
        let mut latent = vec![0f32; kvl];
        rms_norm(&ckv[..kvl], self.v(&n.kv_a_layernorm)?, LATENT_NORM_EPS, &mut latent);
        let mut k_pe = ckv[kvl..].to_vec();
        self.rope.apply(&mut k_pe, pos);
        cache.c_kv[l].extend_from_slice(&latent);
        cache.k_pe[l].extend_from_slice(&k_pe);
        let t_len = pos + 1;
        let ckv_cache = &cache.c_kv[l];
        let kpe_cache = &cache.k_pe[l];
        // kv_b_proj: [n_heads * (nope + v), kv_lora_rank]; per head: W_UK rows then W_UV rows.
        let kv_b = self.m(&n.kv_b_proj)?;
        let scale = self.softmax_scale;
        let rope_emb = &self.rope;
        // out: [n_heads, v_head_dim]
        let heads: Vec<Vec<f32>> = (0..nh)
            .into_par_iter()
            .map(|hh| {
                let qh = &q[hh * qk..(hh + 1) * qk];
                let mut q_pe = qh[nope..].to_vec();
                rope_emb.apply(&mut q_pe, pos);
                let base = hh * (nope + vd);
                // q_abs = W_UK_h^T q_nope: [kv_lora_rank]
                let mut q_abs = vec![0f32; kvl];
                kv_b.rows(base, base + nope).matvec_t(&qh[..nope], &mut q_abs);
                // scores[t] = (q_abs · c_t + q_pe · k_pe_t) · scale, t ≤ pos (causal)
                let mut scores: Vec<f32> = (0..t_len)
                    .map(|t| {
                        let s = deltafin_kernels::dot(&q_abs, &ckv_cache[t * kvl..(t + 1) * kvl])
                            + deltafin_kernels::dot(&q_pe, &kpe_cache[t * rope..(t + 1) * rope]);
                        s * scale
                    })
                    .collect();
                softmax_inplace(&mut scores);
                // ctx = Σ_t p_t c_t: [kv_lora_rank]; o_h = W_UV_h ctx: [v_head_dim]
                let mut ctx = vec![0f32; kvl];
                for (t, p) in scores.iter().enumerate() {
                    deltafin_kernels::axpy(*p, &ckv_cache[t * kvl..(t + 1) * kvl], &mut ctx);
                }
                let mut o = vec![0f32; vd];
                kv_b.rows(base + nope, base + nope + vd).matvec(&ctx, &mut o);
                o
            })
            .collect();
        let flat: Vec<f32> = heads.concat();
        let mut out = vec![0f32; c.hidden_size];
        self.m(&n.o_proj)?.matvec(&flat, &mut out);
        Ok(out)
    }

    /// SwiGLU MLP: `down_proj(silu(gate_proj(x)) * up_proj(x))`. x: `[hidden]` → `[hidden]`.
    fn mlp(&self, gate: MatRef<'_>, up: MatRef<'_>, down: MatRef<'_>, xn: &[f32]) -> Vec<f32> {
        let mut g = vec![0f32; gate.rows];
        let mut u = vec![0f32; up.rows];
        gate.matvec(xn, &mut g);
        up.matvec(xn, &mut u);
        for (a, b) in g.iter_mut().zip(&u) {
            *a = silu(*a) * b;
        }
        let mut out = vec![0f32; down.rows];
        down.matvec(&g, &mut out);
        out
    }

    /// MoE block: routed experts (read through the expert store) weighted by the router, plus
    /// the shared experts. x: `[hidden]` → `[hidden]`.
    fn moe(&self, l: usize, xn: &[f32]) -> Result<(Vec<f32>, Routing), EngineError> {
        let c = &self.cfg;
        let n = &self.names[l];
        // router_logits = x · W_gate^T in f32: [n_routed_experts]
        let gate = self.m(&n.router)?;
        let mut logits = vec![0f32; gate.rows];
        gate.matvec(xn, &mut logits);
        let router = RouterConfig {
            top_k: self.experts_per_token(),
            ..self.router
        };
        let routing = route(&router, &logits, self.v(&n.router_bias)?);
        // Issue the reads of every missing chosen expert at once, then predict the next MoE
        // layer's experts by applying its router to this hidden state and prefetch them (the
        // store starts speculative reads only when no demand read is pending).
        let fetch = match &self.compute_only {
            Some(_) => None,
            None => Some(self.store.fetch(l, &routing.experts)?),
        };
        if self.prefetch {
            if let Some(next) = (l + 1..c.num_hidden_layers).find(|&k| c.is_moe_layer(k)) {
                let nn = &self.names[next];
                let mut next_logits = vec![0f32; c.n_routed_experts];
                self.m(&nn.router)?.matvec(xn, &mut next_logits);
                let predicted = route(&router, &next_logits, self.v(&nn.router_bias)?);
                self.store.prefetch(next, &predicted.experts);
            }
        }
        let shared = if c.n_shared_experts > 0 {
            Some((
                self.m(&n.shared_gate_proj)?,
                self.m(&n.shared_up_proj)?,
                self.m(&n.shared_down_proj)?,
            ))
        } else {
            None
        };
        // Compute each expert as its record arrives (on the compute pool) while this thread
        // waits for the others, and the shared experts meanwhile; outs[i] belongs to
        // routing.experts[i] whatever the arrival order.
        let outs: Vec<std::sync::OnceLock<Vec<f32>>> = routing.experts.iter().map(|_| Default::default()).collect();
        let shared_out: std::sync::OnceLock<Vec<f32>> = Default::default();
        rayon::in_place_scope(|s| -> Result<(), EngineError> {
            if let Some((g, u, d)) = shared {
                let slot = &shared_out;
                s.spawn(move |_| {
                    let _ = slot.set(self.mlp(g, u, d, xn));
                });
            }
            match fetch {
                Some(fetch) => {
                    for r in fetch {
                        let (i, e) = r?;
                        let slot = &outs[i];
                        s.spawn(move |_| {
                            let _ = slot.set(self.mlp(e.matrix(0), e.matrix(1), e.matrix(2), xn));
                        });
                    }
                }
                None => {
                    // Compute-only measurement: every chosen expert is computed with this
                    // layer's resident stand-in record (same shape and cost, different values).
                    let stand_in = self.compute_only.as_ref().and_then(|v| v[l].clone()).ok_or_else(|| {
                        EngineError::Invalid(format!("layer {l}: compute-only mode without a resident record"))
                    })?;
                    for slot in &outs {
                        let e = stand_in.clone();
                        s.spawn(move |_| {
                            let _ = slot.set(self.mlp(e.matrix(0), e.matrix(1), e.matrix(2), xn));
                        });
                    }
                }
            }
            Ok(())
        })?;
        let mut out = vec![0f32; c.hidden_size];
        // Sum in ascending expert id, as the reference's index_add loop does.
        for (o, w) in outs.iter().zip(&routing.weights) {
            let o = o
                .get()
                .ok_or_else(|| EngineError::Invalid(format!("layer {l}: an expert output is missing")))?;
            deltafin_kernels::axpy(*w, o, &mut out);
        }
        if let Some(sh) = shared_out.get() {
            for (a, b) in out.iter_mut().zip(sh) {
                *a += b;
            }
        }
        Ok((out, routing))
    }

    /// Greedy choice from logits.
    pub fn greedy(logits: &[f32]) -> u32 {
        argmax(logits) as u32
    }
}
