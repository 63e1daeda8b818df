//! DeepSeek-V3 / Kimi K2 on a CUDA device: the same forward pass as `deepseek_v3.rs`, one token
//! at a time, with the backbone resident in GPU memory, the MLA latent KV cache on the GPU, and
//! the routed experts read through the same expert store (host cache, O_DIRECT reads, traces,
//! prefetch) and computed on the GPU.
//!
//! Per layer, as the CPU file (transformers' `modeling_deepseek_v3.py`):
//! ```text
//! h = x + self_attn(input_layernorm(x))           # MLA, weight-absorbed (mla_decode kernel)
//! x = h + mlp(post_attention_layernorm(h))        # dense SwiGLU, or MoE
//! ```
//! What stays on the host: the token's embedding row (decoded from the int8 backbone exactly as
//! the CPU does), the router's choice (`moe::route` on the logits the GPU computed) and the
//! weighted sum of the routed experts' outputs (`RoutedExperts::run`, router order), RoPE's
//! cos/sin for the position (`RotaryEmbedding`'s own arithmetic, so RoPE is the CPU's bits).
//!
//! Numerics: f32 everywhere, fixed reduction orders (deltafin-cuda's kernels), so output is
//! deterministic run to run and agrees with the CPU path to f32 rounding; greedy ids are checked
//! against the CPU path (`deltafin run --device cuda` vs `--device cpu`, bench/NOTES.md).
//!
//! Not yet on the GPU (refused by `load`'s caller or done per token): self-drafting, the batched
//! prefill (a prompt runs token by token), a GPU expert cache (each chosen expert's record is
//! copied to the device when used).

use std::sync::{Arc, Mutex};

use deltafin_cuda::{CudaError, Gpu, GpuBuf, GpuMat, MlaShape};
use deltafin_format::{ModelConfig, ModelDir};

use crate::experts::StoreOptions;
use crate::model::{state_as, CausalLm, DecodeState, LayerRoutes, RoutedExperts};
use crate::models::deepseek_v3::{LayerNames, LATENT_NORM_EPS};
use crate::models::DeepseekV3;
use crate::moe::route;
use crate::EngineError;

fn cuda(e: CudaError) -> EngineError {
    EngineError::Invalid(format!("CUDA: {e}"))
}

/// One layer's backbone on the GPU (tensor names as in the checkpoint).
struct GpuLayer {
    input_layernorm: GpuBuf,
    post_attention_layernorm: GpuBuf,
    /// `q_a_proj`, `q_a_layernorm`, `q_b_proj` (q-LoRA), or `q_proj` alone.
    q: QProj,
    /// `kv_a_proj_with_mqa` rows `[0, kv_lora_rank)`: the latent part.
    kv_a_latent: GpuMat,
    /// `kv_a_proj_with_mqa` rows `[kv_lora_rank, kv_lora_rank + rope)`: the shared rope key.
    kv_a_rope: GpuMat,
    kv_a_layernorm: GpuBuf,
    kv_b_proj: GpuMat,
    o_proj: GpuMat,
    mlp: Mlp,
}

enum QProj {
    Lora {
        q_a_proj: GpuMat,
        q_a_layernorm: GpuBuf,
        q_b_proj: GpuMat,
    },
    Full {
        q_proj: GpuMat,
    },
}

enum Mlp {
    Dense {
        gate: GpuMat,
        up: GpuMat,
        down: GpuMat,
    },
    Moe {
        router: GpuMat,
        shared: Option<[GpuMat; 3]>,
    },
}

/// The MLA latent KV cache of every layer in GPU memory; grows by doubling.
pub struct GpuKvCache {
    gpu: Arc<Gpu>,
    kvl: usize,
    rope: usize,
    layers: usize,
    /// `[layer][capacity * kv_lora_rank]` (empty until the first token).
    c_kv: Vec<GpuBuf>,
    /// `[layer][capacity * qk_rope_head_dim]`.
    k_pe: Vec<GpuBuf>,
    len: usize,
    capacity: usize,
}

impl GpuKvCache {
    fn reserve(&mut self, n: usize) -> Result<(), CudaError> {
        if n <= self.capacity {
            return Ok(());
        }
        let cap = n.max(2 * self.capacity).max(64);
        for (bufs, width) in [(&mut self.c_kv, self.kvl), (&mut self.k_pe, self.rope)] {
            let mut grown = Vec::with_capacity(self.layers);
            for l in 0..self.layers {
                let mut nb = self.gpu.zeros(cap * width)?;
                if let Some(old) = bufs.get(l).filter(|_| self.len > 0) {
                    let old = old.slice(..self.len * width);
                    let mut dst = nb.slice_mut(..self.len * width);
                    self.gpu
                        .stream()
                        .memcpy_dtod(&old, &mut dst)
                        .map_err(|e| CudaError::Shape(format!("KV cache growth: {e}")))?;
                }
                grown.push(nb);
            }
            *bufs = grown;
        }
        self.capacity = cap;
        Ok(())
    }
}

impl DecodeState for GpuKvCache {
    fn len(&self) -> usize {
        self.len
    }

    fn truncate(&mut self, len: usize) -> bool {
        // Positions past `len` are overwritten by the next tokens.
        self.len = self.len.min(len);
        true
    }

    fn bytes(&self) -> usize {
        self.capacity * (self.kvl + self.rope) * 4 * self.c_kv.len()
    }

    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

/// DeepSeek-V3 with its forward pass on a CUDA device (see the module docs).
pub struct DeepseekV3Cuda {
    cpu: DeepseekV3,
    gpu: Arc<Gpu>,
    layers: Vec<GpuLayer>,
    norm: GpuBuf,
    lm_head: GpuMat,
    /// Serializes GPU work submitted from the expert store's compute pool.
    expert_lock: Mutex<()>,
}

impl DeepseekV3Cuda {
    /// Loads the model as [`DeepseekV3::load_with`] does, then opens `cuda:ordinal` and uploads
    /// the backbone.
    ///
    /// Errors: everything `DeepseekV3::load_with` refuses; no such device; a backbone larger than
    /// the device memory (named with both sizes); a driver or NVRTC failure.
    pub fn load_with(dir: &ModelDir, opts: StoreOptions, ordinal: usize) -> Result<Self, EngineError> {
        let cpu = DeepseekV3::load_with(dir, opts)?;
        let gpu = Arc::new(Gpu::open(ordinal).map_err(cuda)?);
        let backbone = cpu.backbone_bytes() as u64;
        let total = gpu.info().total_bytes as u64;
        if backbone > total {
            return Err(EngineError::Invalid(format!(
                "the backbone ({backbone} bytes) does not fit in cuda:{ordinal}'s {total} bytes"
            )));
        }
        let c = cpu.cfg.clone();
        let up = |name: &str| -> Result<GpuMat, EngineError> { GpuMat::upload(&gpu, &cpu.m(name)?).map_err(cuda) };
        let vec = |name: &str| -> Result<GpuBuf, EngineError> { gpu.upload(cpu.v(name)?).map_err(cuda) };
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for l in 0..c.num_hidden_layers {
            let n: &LayerNames = &cpu.names[l];
            let q = match c.q_lora_rank {
                Some(_) => QProj::Lora {
                    q_a_proj: up(&n.q_a_proj)?,
                    q_a_layernorm: vec(&n.q_a_layernorm)?,
                    q_b_proj: up(&n.q_b_proj)?,
                },
                None => QProj::Full { q_proj: up(&n.q_proj)? },
            };
            let kv_a = cpu.m(&n.kv_a_proj_with_mqa)?;
            let kvl = c.kv_lora_rank;
            let mlp = if c.is_moe_layer(l) {
                let shared = if c.n_shared_experts > 0 {
                    Some([
                        up(&n.shared_gate_proj)?,
                        up(&n.shared_up_proj)?,
                        up(&n.shared_down_proj)?,
                    ])
                } else {
                    None
                };
                Mlp::Moe {
                    router: up(&n.router)?,
                    shared,
                }
            } else {
                Mlp::Dense {
                    gate: up(&n.gate_proj)?,
                    up: up(&n.up_proj)?,
                    down: up(&n.down_proj)?,
                }
            };
            layers.push(GpuLayer {
                input_layernorm: vec(&n.input_layernorm)?,
                post_attention_layernorm: vec(&n.post_attention_layernorm)?,
                q,
                kv_a_latent: GpuMat::upload(&gpu, &kv_a.rows(0, kvl)).map_err(cuda)?,
                kv_a_rope: GpuMat::upload(&gpu, &kv_a.rows(kvl, kvl + c.qk_rope_head_dim)).map_err(cuda)?,
                kv_a_layernorm: vec(&n.kv_a_layernorm)?,
                kv_b_proj: up(&n.kv_b_proj)?,
                o_proj: up(&n.o_proj)?,
                mlp,
            });
        }
        let norm = vec("model.norm.weight")?;
        let lm_head = up("lm_head.weight")?;
        Ok(Self {
            cpu,
            gpu,
            layers,
            norm,
            lm_head,
            expert_lock: Mutex::new(()),
        })
    }

    /// `down(silu(gate x) * up x)` on the GPU. x: `[cols of gate]` → `[rows of down]`.
    fn swiglu(&self, gate: &GpuMat, up: &GpuMat, down: &GpuMat, x: &GpuBuf) -> Result<GpuBuf, CudaError> {
        let g = &self.gpu;
        let mut a = g.zeros(gate.rows)?;
        let mut b = g.zeros(up.rows)?;
        gate.matvec(g, x, &mut a)?;
        up.matvec(g, x, &mut b)?;
        let mut h = g.zeros(gate.rows)?;
        g.swiglu(&a, &b, &mut h)?;
        let mut out = g.zeros(down.rows)?;
        down.matvec(g, &h, &mut out)?;
        Ok(out)
    }

    /// RoPE cos/sin of `pos` for the rope head width, `[cos[half], sin[half]]`, with the CPU's
    /// arithmetic (`RotaryEmbedding::apply`).
    fn rope_table(&self, pos: usize) -> Vec<f32> {
        let r = &self.cpu.rope;
        let half = r.inv_freq.len();
        let mut cs = vec![0f32; 2 * half];
        let p = pos as f32;
        for i in 0..half {
            let (s, c) = (p * r.inv_freq[i]).sin_cos();
            cs[i] = c * r.attention_factor;
            cs[half + i] = s * r.attention_factor;
        }
        cs
    }

    fn attention(&self, l: usize, xn: &GpuBuf, cs: &GpuBuf, cache: &mut GpuKvCache) -> Result<GpuBuf, CudaError> {
        let c = &self.cpu.cfg;
        let g = &self.gpu;
        let lw = &self.layers[l];
        let (nh, nope, rope, kvl) = (
            c.num_attention_heads,
            c.qk_nope_head_dim,
            c.qk_rope_head_dim,
            c.kv_lora_rank,
        );
        let qk = nope + rope;
        let pos = cache.len;
        // q: [n_heads, qk_head_dim]
        let mut q = g.zeros(nh * qk)?;
        match &lw.q {
            QProj::Lora {
                q_a_proj,
                q_a_layernorm,
                q_b_proj,
            } => {
                let mut qa = g.zeros(q_a_proj.rows)?;
                q_a_proj.matvec(g, xn, &mut qa)?;
                let mut qan = g.zeros(q_a_proj.rows)?;
                g.rms_norm(&qa, q_a_layernorm, 1, LATENT_NORM_EPS, false, &mut qan)?;
                q_b_proj.matvec(g, &qan, &mut q)?;
            }
            QProj::Full { q_proj } => q_proj.matvec(g, xn, &mut q)?,
        }
        g.rope(&mut q, nh, qk, nope, cs, self.cpu.rope.interleaved)?;
        // latent = kv_a_layernorm(kv_a_proj(x)[..kvl]); k_pe = rope(kv_a_proj(x)[kvl..])
        let mut ckv = g.zeros(kvl)?;
        lw.kv_a_latent.matvec(g, xn, &mut ckv)?;
        let mut latent = g.zeros(kvl)?;
        g.rms_norm(&ckv, &lw.kv_a_layernorm, 1, LATENT_NORM_EPS, false, &mut latent)?;
        let mut k_pe = g.zeros(rope)?;
        lw.kv_a_rope.matvec(g, xn, &mut k_pe)?;
        g.rope(&mut k_pe, 1, rope, 0, cs, self.cpu.rope.interleaved)?;
        g.copy_into(&latent, &mut cache.c_kv[l], pos * kvl)?;
        g.copy_into(&k_pe, &mut cache.k_pe[l], pos * rope)?;
        let shape = MlaShape {
            n_heads: nh,
            nope,
            rope,
            v_head_dim: c.v_head_dim,
            kv_lora_rank: kvl,
        };
        let mut scores = g.zeros(nh * (pos + 1))?;
        let mut heads = g.zeros(nh * c.v_head_dim)?;
        g.mla_decode(
            shape,
            &q,
            &cache.c_kv[l],
            &cache.k_pe[l],
            &lw.kv_b_proj,
            pos + 1,
            self.cpu.softmax_scale,
            &mut scores,
            &mut heads,
        )?;
        let mut out = g.zeros(c.hidden_size)?;
        lw.o_proj.matvec(g, &heads, &mut out)?;
        Ok(out)
    }

    /// The MoE block: router logits on the GPU, the choice on the host, each chosen expert's
    /// record (through the expert store) copied to the GPU and applied there, the weighted sum
    /// in router order on the host (as the CPU path), plus the shared experts.
    fn moe(&self, l: usize, xn: &GpuBuf) -> Result<(Vec<f32>, crate::moe::Routing), EngineError> {
        let c = &self.cpu.cfg;
        let g = &self.gpu;
        let n = &self.cpu.names[l];
        let Mlp::Moe { router, shared } = &self.layers[l].mlp else {
            return Err(EngineError::Invalid(format!("layer {l} is not a MoE layer")));
        };
        let mut logits_d = g.zeros(router.rows).map_err(cuda)?;
        router.matvec(g, xn, &mut logits_d).map_err(cuda)?;
        let logits = g.download(&logits_d).map_err(cuda)?;
        let routing = route(&self.cpu.router_cfg(), &logits, self.cpu.v(&n.router_bias)?);
        let failure: Mutex<Option<CudaError>> = Mutex::new(None);
        let record = |e: CudaError| {
            if let Ok(mut f) = failure.lock() {
                f.get_or_insert(e);
            }
        };
        let expert = |e: &crate::experts::Expert| -> Vec<f32> {
            let run = || -> Result<Vec<f32>, CudaError> {
                let _guard = self
                    .expert_lock
                    .lock()
                    .map_err(|_| CudaError::Shape("expert lock poisoned".into()))?;
                g.bind_to_thread()?;
                let mats = [
                    GpuMat::upload(g, &e.matrix(0))?,
                    GpuMat::upload(g, &e.matrix(1))?,
                    GpuMat::upload(g, &e.matrix(2))?,
                ];
                let out = self.swiglu(&mats[0], &mats[1], &mats[2], xn)?;
                g.download(&out)
            };
            run().unwrap_or_else(|e| {
                record(e);
                vec![0.0; c.hidden_size]
            })
        };
        let shared_fn = shared.as_ref().map(|[gt, u, d]| {
            let record = &record;
            move || -> Vec<f32> {
                let run = || -> Result<Vec<f32>, CudaError> {
                    let _guard = self
                        .expert_lock
                        .lock()
                        .map_err(|_| CudaError::Shape("expert lock poisoned".into()))?;
                    g.bind_to_thread()?;
                    g.download(&self.swiglu(gt, u, d, xn)?)
                };
                run().unwrap_or_else(|e| {
                    record(e);
                    vec![0.0; c.hidden_size]
                })
            }
        });
        let (mut out, shared_out) = self
            .cpu
            .routed
            .run(l, &routing, c.hidden_size, expert, shared_fn, || Ok(None))?;
        if let Some(e) = failure.into_inner().ok().flatten() {
            return Err(cuda(e));
        }
        if let Some(sh) = shared_out {
            for (a, b) in out.iter_mut().zip(&sh) {
                *a += b;
            }
        }
        Ok((out, routing))
    }

    fn forward_token(&self, cache: &mut GpuKvCache, token: u32) -> Result<(Vec<f32>, LayerRoutes), EngineError> {
        let c = &self.cpu.cfg;
        if token as usize >= c.vocab_size {
            return Err(EngineError::TokenOutOfRange {
                id: token,
                vocab_size: c.vocab_size,
            });
        }
        let g = &self.gpu;
        g.bind_to_thread().map_err(cuda)?;
        cache.reserve(cache.len + 1).map_err(cuda)?;
        let h = c.hidden_size;
        let mut x_host = vec![0f32; h];
        self.cpu
            .m("model.embed_tokens.weight")?
            .row_into(token as usize, &mut x_host);
        let mut x = g.upload(&x_host).map_err(cuda)?;
        let cs = g.upload(&self.rope_table(cache.len)).map_err(cuda)?;
        let mut xn = g.zeros(h).map_err(cuda)?;
        let mut routes = Vec::new();
        for l in 0..c.num_hidden_layers {
            let lw = &self.layers[l];
            g.rms_norm(&x, &lw.input_layernorm, 1, c.rms_norm_eps, false, &mut xn)
                .map_err(cuda)?;
            let attn = self
                .cpu
                .routed
                .time_attention(|| self.attention(l, &xn, &cs, cache))
                .map_err(cuda)?;
            g.axpy(1.0, &attn, &mut x).map_err(cuda)?;
            g.rms_norm(&x, &lw.post_attention_layernorm, 1, c.rms_norm_eps, false, &mut xn)
                .map_err(cuda)?;
            let mlp = self.cpu.routed.time_mlp(|| -> Result<GpuBuf, EngineError> {
                match &lw.mlp {
                    Mlp::Moe { .. } => {
                        let (out, r) = self.moe(l, &xn)?;
                        routes.push((l, r));
                        g.upload(&out).map_err(cuda)
                    }
                    Mlp::Dense { gate, up, down } => self.swiglu(gate, up, down, &xn).map_err(cuda),
                }
            })?;
            g.axpy(1.0, &mlp, &mut x).map_err(cuda)?;
        }
        cache.len += 1;
        self.cpu.routed.count_forward();
        let mut xf = g.zeros(h).map_err(cuda)?;
        g.rms_norm(&x, &self.norm, 1, c.rms_norm_eps, false, &mut xf)
            .map_err(cuda)?;
        let mut logits = g.zeros(self.lm_head.rows).map_err(cuda)?;
        self.lm_head.matvec(g, &xf, &mut logits).map_err(cuda)?;
        Ok((g.download(&logits).map_err(cuda)?, routes))
    }
}

impl CausalLm for DeepseekV3Cuda {
    fn config(&self) -> &ModelConfig {
        self.cpu.config()
    }

    fn new_state(&self) -> Box<dyn DecodeState> {
        let c = &self.cpu.cfg;
        Box::new(GpuKvCache {
            gpu: self.gpu.clone(),
            kvl: c.kv_lora_rank,
            rope: c.qk_rope_head_dim,
            layers: c.num_hidden_layers,
            c_kv: Vec::new(),
            k_pe: Vec::new(),
            len: 0,
            capacity: 0,
        })
    }

    fn forward(&self, state: &mut dyn DecodeState, token: u32) -> Result<(Vec<f32>, LayerRoutes), EngineError> {
        let cache = state_as::<GpuKvCache>(state)?;
        self.forward_token(cache, token)
    }

    fn routed(&self) -> &RoutedExperts {
        &self.cpu.routed
    }

    fn routed_mut(&mut self) -> &mut RoutedExperts {
        &mut self.cpu.routed
    }

    fn backbone_bytes(&self) -> usize {
        self.cpu.backbone_bytes()
    }
}
