// ---- Kimi Linear / Kimi K3 kernels (kda.cu, compiled after ops.cu in one NVRTC unit) -----------
//
// Kimi Delta Attention (KDA) decode, its short causal convolution, SiTU-GLU, the sigmoid output
// gate, the attention-residual depth mix (K3) and the fused SiTU routed experts. Numerics as in
// ops.cu: f32 everywhere, fixed reduction orders, no atomics. Where the CPU reference
// (deltafin-engine blocks/kda.rs, models/kimi_linear.rs) accumulates sequentially, these kernels
// do the same operations in the same order with explicitly rounded multiplies and adds
// (__fmul_rn / __fadd_rn: no FMA contraction, as Rust does not contract), so they differ from the
// CPU only where a libm function (expf, tanhf, logf) differs in the last bit.

__device__ __forceinline__ float df_sigmoid(float x) { return __fdiv_rn(1.0f, __fadd_rn(1.0f, exp_f32(-x))); }
__device__ __forceinline__ float df_silu(float x) { return __fdiv_rn(x, __fadd_rn(1.0f, exp_f32(-x))); }

// SiTU-GLU (K3-SPEC §5, [SITU]): (beta tanh(g / beta) sigmoid(g)) * (lbeta tanh(u / lbeta)); the up
// branch is u when has_lin == 0. The CPU's expression order (models/kimi_linear.rs `situ`).
__device__ __forceinline__ float df_situ(float g, float u, float beta, float lbeta, int has_lin) {
    const float gate = __fmul_rn(__fmul_rn(beta, tanhf(__fdiv_rn(g, beta))), df_sigmoid(g));
    const float up = has_lin ? __fmul_rn(lbeta, tanhf(__fdiv_rn(u, lbeta))) : u;
    return __fmul_rn(gate, up);
}

// out[i] = situ(gate[i], up[i]) for i < len.
extern "C" __global__ void situ_glu(const float* __restrict__ gate, const float* __restrict__ up, int len, float beta,
                                    float lbeta, int has_lin, float* __restrict__ out) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= len) return;
    out[i] = df_situ(gate[i], up[i], beta, lbeta, has_lin);
}

// o[i] *= sigmoid(g[i]) for i < len (KDA's gated output norm and K3's MLA output gate).
extern "C" __global__ void sigmoid_mul(float* __restrict__ o, const float* __restrict__ g, int len) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= len) return;
    o[i] = __fmul_rn(o[i], df_sigmoid(g[i]));
}

// KDA short causal convolution for one token, all 3P channels [q' | k' | v'] (depthwise, kernel K,
// PyTorch conv1d with K - 1 zeros of left padding, then SiLU) [KDA_CONV]. `hist` points at the
// K - 1 previous rows (3P floats each, oldest first); the new row (qp | kp | vp) is written after
// them (row K - 1) and tap j reads row j: acc = sum_{j < K} w[c, j] * row_j[c] in j order from 0.
// w*: [P, K] per block of channels. out: [3P] = silu(acc) (q, then k, then v).
extern "C" __global__ void kda_conv_step(float* __restrict__ hist, const float* __restrict__ qp,
                                         const float* __restrict__ kp, const float* __restrict__ vp,
                                         const float* __restrict__ wq, const float* __restrict__ wk,
                                         const float* __restrict__ wv, int p, int kk, float* __restrict__ out) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const int row = 3 * p;
    if (c >= row) return;
    const int blk = c / p, wc = c - blk * p;
    const float* src = blk == 0 ? qp : (blk == 1 ? kp : vp);
    const float* w = blk == 0 ? wq : (blk == 1 ? wk : wv);
    hist[(size_t)(kk - 1) * row + c] = src[wc];
    float acc = 0.0f;
    for (int j = 0; j < kk; ++j) acc = __fadd_rn(acc, __fmul_rn(w[(size_t)wc * kk + j], hist[(size_t)j * row + c]));
    out[c] = df_silu(acc);
}

// Sequential sum of squares of x[0..d) (the CPU's `iter().map(v * v).sum()` order).
__device__ __forceinline__ float df_sumsq(const float* x, int d) {
    float s = 0.0f;
    for (int i = 0; i < d; ++i) s = __fadd_rn(s, __fmul_rn(x[i], x[i]));
    return s;
}

// KDA per-token activations of head h = blockIdx.x [KDA_L2NORM, KDA_GATE]:
//   q = l2norm(conv_q_h) * d^-0.5, k = l2norm(conv_k_h) (x / sqrt(sum x^2 + 1e-6)), v = conv_v_h,
//   g = gate(A_log[h], u + dt_bias), gate 0: -exp(A_log) softplus(.) (threshold 20), gate 1:
//   lower_bound * sigmoid(exp(A_log) .); beta = sigmoid(braw[h]).
// conv: [3P] (q | k | v after SiLU), u: [P] (f_b_proj output), braw: [nh]. Writes q_out: [P] and
// the token's log row: k_out, v_out, g_out: [P], beta_out: [nh].
extern "C" __global__ void kda_prepare(const float* __restrict__ conv, const float* __restrict__ u,
                                       const float* __restrict__ braw, const float* __restrict__ a_log,
                                       const float* __restrict__ dt_bias, int p, int d, int gate_kind,
                                       float lower_bound, float q_scale, float* __restrict__ q_out,
                                       float* __restrict__ k_out, float* __restrict__ v_out,
                                       float* __restrict__ g_out, float* __restrict__ beta_out) {
    __shared__ float norms[2];
    const int h = blockIdx.x;
    const float* qh = conv + (size_t)h * d;
    const float* kh = conv + (size_t)p + (size_t)h * d;
    const float* vh = conv + 2 * (size_t)p + (size_t)h * d;
    if (threadIdx.x == 0) norms[0] = sqrtf(__fadd_rn(df_sumsq(qh, d), 1e-6f));
    if (threadIdx.x == 32 || (blockDim.x <= 32 && threadIdx.x == 0))
        norms[1] = sqrtf(__fadd_rn(df_sumsq(kh, d), 1e-6f));
    __syncthreads();
    const float a = a_log[h];
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        const size_t i = (size_t)h * d + c;
        q_out[i] = __fmul_rn(__fdiv_rn(qh[c], norms[0]), q_scale);
        k_out[i] = __fdiv_rn(kh[c], norms[1]);
        v_out[i] = vh[c];
        const float x = __fadd_rn(u[i], dt_bias[i]);
        float g;
        if (gate_kind == 0) {
            const float sp = x > 20.0f ? x : log_f32(__fadd_rn(1.0f, exp_f32(x)));
            g = __fmul_rn(-exp_f32(a), sp);
        } else {
            g = __fmul_rn(lower_bound, df_sigmoid(__fmul_rn(exp_f32(a), x)));
        }
        g_out[i] = g;
    }
    if (threadIdx.x == 0) beta_out[h] = df_sigmoid(braw[h]);
}

// One delta-rule update of head h = blockIdx.x [KDA_RECURRENCE], state S_h: [d (key i), d (value j)]
// read from `src` and written to `dst` (the same buffer for an in-place update):
//   S <- diag(exp(g)) S;  r = S^T k;  delta = beta (v - r);  S <- S + k delta^T;  o = S^T q.
// Thread j owns value column j: both passes over i run in increasing i with the CPU's operations
// (`delta_step_kv`), so every column is computed in the CPU's order. q and o may be null (a
// rollback replay: update only). k, v, g, q, o: [P] (head h at h * d), beta: [nh].
// Dynamic shared memory: 3 * d floats.
extern "C" __global__ void kda_delta(const float* src, float* dst, const float* __restrict__ q,
                                     const float* __restrict__ k, const float* __restrict__ v,
                                     const float* __restrict__ g, const float* __restrict__ beta, int d,
                                     float* __restrict__ o) {
    extern __shared__ float sh[];
    float* e = sh;
    float* ks = sh + d;
    float* qs = sh + 2 * d;
    const int h = blockIdx.x;
    const size_t off = (size_t)h * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        e[i] = exp_f32(g[off + i]);
        ks[i] = k[off + i];
        qs[i] = q != nullptr ? q[off + i] : 0.0f;
    }
    __syncthreads();
    const float b = beta[h];
    const float* sh_src = src + off * d;
    float* sh_dst = dst + off * d;
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
        float r = 0.0f;
        for (int i = 0; i < d; ++i) {
            const float s = __fmul_rn(sh_src[(size_t)i * d + j], e[i]);
            sh_dst[(size_t)i * d + j] = s;
            r = __fadd_rn(r, __fmul_rn(ks[i], s));
        }
        const float delta = __fmul_rn(b, __fsub_rn(v[off + j], r));
        float acc = 0.0f;
        for (int i = 0; i < d; ++i) {
            const float s = __fadd_rn(sh_dst[(size_t)i * d + j], __fmul_rn(ks[i], delta));
            sh_dst[(size_t)i * d + j] = s;
            acc = __fadd_rn(acc, __fmul_rn(qs[i], s));
        }
        if (o != nullptr) o[off + j] = acc;
    }
}

// Attention-residual depth mix (K3-SPEC §2, [ATTN_RES]) in one block of 256 threads: for each of
// the n_bank rows of `bank` ([n_bank, dim]) and the current vector `cur` ([dim]), the score
// s = <v, w> / sqrt(mean(v^2) + eps); alpha = softmax(s) (max-subtracted, sum in entry order);
// out = sum_k alpha_k v_k over the raw vectors, from 0 in entry order (bank first, cur last).
// Each dot product and sum of squares: thread t sums elements t, t + 256, ... in order, then a
// fixed shared-memory tree. n_bank <= 63. out: [dim] (must not alias cur or bank).
extern "C" __global__ void attn_res_mix(const float* __restrict__ bank, int n_bank, const float* __restrict__ cur,
                                        const float* __restrict__ w, int dim, float eps,
                                        float* __restrict__ out) {
    __shared__ float pd[256], ps[256];
    __shared__ float alpha[64];
    const int tid = threadIdx.x;
    const int n = n_bank + 1;
    for (int k = 0; k < n; ++k) {
        const float* v = k < n_bank ? bank + (size_t)k * dim : cur;
        float a = 0.0f, s = 0.0f;
        for (int i = tid; i < dim; i += 256) {
            a = __fadd_rn(a, __fmul_rn(v[i], w[i]));
            s = __fadd_rn(s, __fmul_rn(v[i], v[i]));
        }
        pd[tid] = a;
        ps[tid] = s;
        __syncthreads();
        for (int m = 128; m > 0; m >>= 1) {
            if (tid < m) {
                pd[tid] = __fadd_rn(pd[tid], pd[tid + m]);
                ps[tid] = __fadd_rn(ps[tid], ps[tid + m]);
            }
            __syncthreads();
        }
        if (tid == 0) alpha[k] = __fdiv_rn(pd[0], sqrtf(__fadd_rn(__fdiv_rn(ps[0], (float)dim), eps)));
        __syncthreads();
    }
    if (tid == 0) {
        float m = alpha[0];
        for (int k = 1; k < n; ++k) m = fmaxf(m, alpha[k]);
        softmax_given_max(alpha, n, m);
    }
    __syncthreads();
    for (int i = tid; i < dim; i += 256) {
        float acc = 0.0f;
        for (int k = 0; k < n; ++k) {
            const float* v = k < n_bank ? bank + (size_t)k * dim : cur;
            acc = __fadd_rn(acc, __fmul_rn(alpha[k], v[i]));
        }
        out[i] = acc;
    }
}

// moe_gate_up_mxfp4 with SiTU-GLU instead of SwiGLU: h[k, r] = situ(gate_k[r] . x, up_k[r] . x),
// the products exactly as mxfp4_mv_f16_r1 (mx_rows at R = T = 1, warp_sum), the activation as
// situ_glu, so the fused and unfused paths agree bit for bit. Launch as moe_gate_up_mxfp4.
extern "C" __global__ void moe_gate_up_situ_mxfp4(MoePtrs gate, MoePtrs up, int inter, int hidden,
                                                  const float* __restrict__ x, float beta, float lbeta,
                                                  int has_lin, float* __restrict__ h) {
    moe_gate_up_glu(gate, up, inter, hidden, x, h,
                    [=](float g, float u) { return df_situ(g, u, beta, lbeta, has_lin); });
}
