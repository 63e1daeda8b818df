//! Grouped-query attention over a KV cache, the softmax top-k routers and row biases (`gqa.cu`):
//! what Mixtral, Qwen3-MoE and gpt-oss add to the shared operations. Each takes a chunk of tokens
//! and computes every token with the one-token arithmetic, so a chunked prompt gives the bits of
//! token-at-a-time decoding.

use cudarc::driver::{CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};

use crate::gpu::GpuBuf;
use crate::moe::MOE_MAX_K;
use crate::{CudaError, DriverContext, Gpu};

fn i32_of(what: &str, v: usize) -> Result<i32, CudaError> {
    i32::try_from(v).map_err(|_| CudaError::Shape(format!("{what} = {v} is too large for the CUDA kernels")))
}

/// Shape of one grouped-query attention launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GqaShape {
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads; divides `n_heads`.
    pub n_kv_heads: usize,
    /// Width of every head.
    pub head_dim: usize,
    /// Attend to at most this many most recent positions (the current one included); `None`:
    /// every position so far.
    pub window: Option<usize>,
}

impl GqaShape {
    /// Positions the last of `n` tokens starting at position `t0` attends to: the score
    /// scratch each (token, head) needs ([`Gpu::gqa_attend`]).
    pub fn span(&self, t0: usize, n: usize) -> usize {
        let last = t0 + n;
        match self.window {
            Some(w) => last.min(w),
            None => last,
        }
    }
}

/// Which softmax top-k router ([`Gpu::route_softmax_topk`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SoftmaxRouter {
    /// Softmax over every expert, then the top-k probabilities, divided by their sum when
    /// `norm_topk_prob` (Mixtral always, Qwen3-MoE per config). [SOFTMAX_TOPK]
    SoftmaxThenTopK {
        /// Renormalise the chosen probabilities.
        norm_topk_prob: bool,
    },
    /// The top-k logits, then the softmax over those k only (gpt-oss). [TOPK_THEN_SOFTMAX]
    TopKThenSoftmax,
}

impl SoftmaxRouter {
    /// Every router, each with each of its options (what a test of all of them iterates).
    pub const ALL: [SoftmaxRouter; 3] = [
        SoftmaxRouter::SoftmaxThenTopK { norm_topk_prob: true },
        SoftmaxRouter::SoftmaxThenTopK { norm_topk_prob: false },
        SoftmaxRouter::TopKThenSoftmax,
    ];
}

impl Gpu {
    /// Attention of the `n` tokens of a chunk whose first token sits at position `t0`, their
    /// keys and values already at rows `t0 ..` of the cache: token `j`'s head `h` attends to the
    /// positions of its window up to `t0 + j` with key/value head `h / (n_heads / n_kv_heads)`,
    /// `p = softmax(q·K^T · scale)` (with the head's sink logit in the denominator when `sinks`
    /// is given, [ATTN_SINKS]), `out = p · V` summed over positions in ascending order (the
    /// order of gqa.cu's `gqa_attend`; the CPU's gqa.rs computes the same formula).
    ///
    /// `q: [n, n_heads, head_dim]` (normed and rotated), `k_cache`, `v_cache`:
    /// `[>= t0 + n, n_kv_heads, head_dim]`, `sinks: [n_heads]`, `scratch`: at least
    /// `n * n_heads *` [`GqaShape::span`]`(t0, n)` floats, `out: [n, n_heads, head_dim]`.
    ///
    /// # Errors
    /// `Shape` for inconsistent lengths or heads; a driver error.
    #[allow(clippy::too_many_arguments)]
    pub fn gqa_attend(
        &self,
        s: GqaShape,
        q: &GpuBuf,
        k_cache: &GpuBuf,
        v_cache: &GpuBuf,
        t0: usize,
        n: usize,
        scale: f32,
        sinks: Option<&GpuBuf>,
        scratch: &mut GpuBuf,
        out: &mut GpuBuf,
    ) -> Result<(), CudaError> {
        let (nh, nkv, hd) = (s.n_heads, s.n_kv_heads, s.head_dim);
        let s_cap = s.span(t0, n);
        let kvd = nkv * hd;
        if n == 0
            || nh == 0
            || nkv == 0
            || hd == 0
            || !nh.is_multiple_of(nkv)
            || s.window == Some(0)
            || q.len() != n * nh * hd
            || out.len() != n * nh * hd
            || k_cache.len() < (t0 + n) * kvd
            || v_cache.len() < (t0 + n) * kvd
            || scratch.len() < n * nh * s_cap
            || sinks.is_some_and(|b| b.len() != nh)
            || n > 65_535
        {
            return Err(CudaError::Shape(format!(
                "gqa_attend: {n} tokens at {t0} of {nh} heads over {nkv} key/value heads of {hd}: q {}, out {}, caches {} and {}, scratch {} (wanted {})",
                q.len(),
                out.len(),
                k_cache.len(),
                v_cache.len(),
                scratch.len(),
                n * nh * s_cap
            )));
        }
        // The last position must fit an int too: the kernel computes t0 + j.
        i32_of("position", t0 + n)?;
        let (nh_i, nkv_i, hd_i, t0_i, w_i, cap_i) = (
            i32_of("heads", nh)?,
            i32_of("key/value heads", nkv)?,
            i32_of("head_dim", hd)?,
            i32_of("position", t0)?,
            i32_of("window", s.window.unwrap_or(0))?,
            i32_of("score row", s_cap)?,
        );
        let st = self.stream();
        let null: u64 = 0;
        let sink_ptr = sinks.map(|b| b.device_ptr(st));
        let cfg = LaunchConfig {
            grid_dim: (nh as u32, n as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = st.launch_builder(self.k.get("gqa_attend")?);
        b.arg(q)
            .arg(k_cache)
            .arg(v_cache)
            .arg(&nh_i)
            .arg(&nkv_i)
            .arg(&hd_i)
            .arg(&t0_i)
            .arg(&w_i)
            .arg(&scale);
        match &sink_ptr {
            Some((p, _)) => b.arg(p),
            None => b.arg(&null),
        };
        b.arg(&cap_i).arg(scratch).arg(out);
        // SAFETY: matches `gqa_attend` in gqa.cu; every extent checked above (the caches hold
        // t0 + n positions, the scratch n * nh rows of s_cap, q and out n * nh heads).
        unsafe { b.launch(cfg) }.ctx("launch gqa_attend")?;
        Ok(())
    }

    /// The softmax top-k router of `n` tokens: `logits: [n, n_experts]` → `ids: [n, k]`
    /// (ascending expert id) and `weights: [n, k]` (aligned with the ids), with the CPU's
    /// sequence of operations (deltafin-engine `moe::route_softmax` / `route_topk_softmax`:
    /// ties to the lower id, sums in the CPU's order). `probs: [n, n_experts]` scratch. An id
    /// of -1 means fewer than `k` experts could be chosen (NaN logits); the caller refuses it.
    ///
    /// # Errors
    /// `Shape` when `k` is 0, above [`MOE_MAX_K`] or above `n_experts`, or lengths disagree; a
    /// driver error.
    #[allow(clippy::too_many_arguments)]
    pub fn route_softmax_topk(
        &self,
        router: SoftmaxRouter,
        logits: &GpuBuf,
        n: usize,
        n_experts: usize,
        k: usize,
        probs: &mut GpuBuf,
        ids: &mut CudaSlice<i32>,
        weights: &mut GpuBuf,
    ) -> Result<(), CudaError> {
        if n == 0
            || k == 0
            || k > MOE_MAX_K
            || k > n_experts
            || logits.len() != n * n_experts
            || probs.len() < n * n_experts
            || ids.len() != n * k
            || weights.len() != n * k
        {
            return Err(CudaError::Shape(format!(
                "route_softmax_topk: top-{k} of {n_experts} experts (at most {MOE_MAX_K}) for {n} tokens: logits {}, probs {}, ids {}, weights {}",
                logits.len(),
                probs.len(),
                ids.len(),
                weights.len()
            )));
        }
        let (mode, norm) = match router {
            SoftmaxRouter::SoftmaxThenTopK { norm_topk_prob } => (0i32, norm_topk_prob as i32),
            SoftmaxRouter::TopKThenSoftmax => (1, 0),
        };
        let (n_i, e_i, k_i) = (i32_of("tokens", n)?, i32_of("experts", n_experts)?, i32_of("k", k)?);
        let cfg = LaunchConfig {
            grid_dim: ((n as u32).div_ceil(32), 1, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream().launch_builder(self.k.get("route_softmax_topk")?);
        b.arg(logits)
            .arg(&n_i)
            .arg(&e_i)
            .arg(&k_i)
            .arg(&mode)
            .arg(&norm)
            .arg(probs)
            .arg(ids)
            .arg(weights);
        // SAFETY: matches `route_softmax_topk` in gqa.cu; lengths checked above, k <= 16 (the
        // kernel's local arrays).
        unsafe { b.launch(cfg) }.ctx("launch route_softmax_topk")?;
        Ok(())
    }

    /// `y[t] += bias` for every row of `y: [n, bias.len()]` (projection biases).
    ///
    /// # Errors
    /// `Shape` when `y` is not `n` rows of the bias' width; a driver error.
    pub fn add_bias_rows(&self, y: &mut GpuBuf, bias: &GpuBuf, n: usize) -> Result<(), CudaError> {
        let dim = bias.len();
        if n == 0 || dim == 0 || y.len() != n * dim {
            return Err(CudaError::Shape(format!(
                "add_bias_rows: {} elements are not {n} rows of {dim}",
                y.len()
            )));
        }
        let (n_i, d_i) = (i32_of("rows", n)?, i32_of("width", dim)?);
        let total = u32::try_from(n * dim)
            .map_err(|_| CudaError::Shape(format!("add_bias_rows: {} elements in one launch", n * dim)))?;
        let mut b = self.stream().launch_builder(self.k.get("add_bias_rows")?);
        b.arg(y).arg(bias).arg(&n_i).arg(&d_i);
        // SAFETY: matches `add_bias_rows` in gqa.cu; y holds n rows of dim.
        unsafe { b.launch(LaunchConfig::for_num_elems(total)) }.ctx("launch add_bias_rows")?;
        Ok(())
    }

    /// gpt-oss' clamped SwiGLU of `n` tokens on the interleaved gate/up projection
    /// `gu: [n, 2 * inter]` with its bias `bias: [2 * inter]` → `h: [n, inter]`:
    /// `gate = min(gu[2j] + b[2j], limit)`, `up = clamp(gu[2j+1] + b[2j+1], ±limit)`,
    /// `h[j] = (up + 1) · gate · sigmoid(alpha · gate)` (transformers `GptOssExperts`,
    /// [CLAMPED_SWIGLU]; the CPU's `clamped_swiglu_expert` step by step).
    ///
    /// # Errors
    /// `Shape` when lengths disagree; a driver error.
    #[allow(clippy::too_many_arguments)]
    pub fn clamped_swiglu(
        &self,
        gu: &GpuBuf,
        bias: &GpuBuf,
        n: usize,
        alpha: f32,
        limit: f32,
        h: &mut GpuBuf,
    ) -> Result<(), CudaError> {
        let inter = bias.len() / 2;
        if n == 0 || inter == 0 || bias.len() != 2 * inter || gu.len() != n * 2 * inter || h.len() != n * inter {
            return Err(CudaError::Shape(format!(
                "clamped_swiglu: gu {}, bias {}, h {} elements for {n} tokens",
                gu.len(),
                bias.len(),
                h.len()
            )));
        }
        let (n_i, i_i) = (i32_of("tokens", n)?, i32_of("inter", inter)?);
        let total = u32::try_from(n * inter)
            .map_err(|_| CudaError::Shape(format!("clamped_swiglu: {} elements in one launch", n * inter)))?;
        let mut b = self.stream().launch_builder(self.k.get("clamped_swiglu")?);
        b.arg(gu).arg(bias).arg(&n_i).arg(&i_i).arg(&alpha).arg(&limit).arg(h);
        // SAFETY: matches `clamped_swiglu` in gqa.cu; gu holds n rows of 2 * inter, h n of inter.
        unsafe { b.launch(LaunchConfig::for_num_elems(total)) }.ctx("launch clamped_swiglu")?;
        Ok(())
    }
}
