// ---- Grouped-query attention and the softmax top-k router (Mixtral, Qwen3-MoE, gpt-oss) -------
// Uses ops.cu's helpers (warp_sum, exp_f32). Every kernel computes each token of a chunk with
// exactly the arithmetic it uses for a single token, so a chunked prompt gives the bits of
// token-at-a-time decoding.

// +infinity (NVRTC has no <cmath> macros).
__device__ __forceinline__ float gqa_inf() { return __int_as_float(0x7f800000); }

// GQA attention core (Ainslie et al. 2023, arXiv:2305.13245; the CPU's gqa.rs `attend`) for the
// tokens j = 0 .. gridDim.y - 1 of a chunk whose first token sits at position t0, their keys and
// values already in the cache. Block (h, j), 128 threads (4 warps):
//   pos = t0 + j; window lo .. pos (lo = max(0, pos + 1 - window) when window > 0, else 0)
//   s_t = (q_h . K[t, g]) * scale, g = h / (nh / nkv): warp w takes t = lo + w, lo + w + 4, ...;
//        lane l sums elements l, l + 32, ... of the head in order, then warp_sum's butterfly
//   m   = max(s_t, sink_h)                 (the sink only with `sinks` not null; max is exact)
//   e_t = exp(s_t - m); S = sum of e_t: thread i sums t = i, i + 128, ... in order, then the
//        shared-memory tree 64, 32, ..., 1; with a sink S = S + exp(sink_h - m)   [ATTN_SINKS]
//   p_t = e_t / S
//   o[d] = sum over t ascending of p_t * V[t, g, d] (a multiply, then an add: the CPU's axpy)
// q: [n, nh, hd] (normed and rotated), kc / vc: [>= t0 + n, nkv, hd], sinks: [nh] or null,
// scratch: [n, nh, s_cap] with s_cap >= the longest window of the chunk, out: [n, nh, hd].
extern "C" __global__ void __launch_bounds__(128)
    gqa_attend(const float* __restrict__ q, const float* __restrict__ kc, const float* __restrict__ vc, int nh,
               int nkv, int hd, int t0, int window, float scale, const float* __restrict__ sinks, int s_cap,
               float* scratch, float* __restrict__ out) {
    __shared__ float red[128];
    const int h = blockIdx.x, j = blockIdx.y;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int pos = t0 + j;
    const int lo = window > 0 ? max(0, pos + 1 - window) : 0;
    const int len = pos + 1 - lo;
    const int g = h / (nh / nkv);
    const size_t kvd = (size_t)nkv * hd;
    const float* qr = q + ((size_t)j * nh + h) * hd;
    float* s = scratch + ((size_t)j * nh + h) * s_cap;
    for (int i = warp; i < len; i += 4) {
        const float* kr = kc + (size_t)(lo + i) * kvd + (size_t)g * hd;
        float acc = 0.0f;
        for (int d = lane; d < hd; d += 32) acc += qr[d] * kr[d];
        acc = warp_sum(acc);
        if (lane == 0) s[i] = __fmul_rn(acc, scale);
    }
    __syncthreads();
    const bool has_sink = sinks != nullptr;
    const float sink = has_sink ? sinks[h] : 0.0f;
    float m = has_sink ? sink : -gqa_inf();
    for (int i = tid; i < len; i += 128) m = fmaxf(m, s[i]);
    red[tid] = m;
    __syncthreads();
    for (int w = 64; w > 0; w >>= 1) {
        if (tid < w) red[tid] = fmaxf(red[tid], red[tid + w]);
        __syncthreads();
    }
    m = red[0];
    __syncthreads();
    float part = 0.0f;
    for (int i = tid; i < len; i += 128) {
        const float e = exp_f32(__fsub_rn(s[i], m));
        s[i] = e;
        part = __fadd_rn(part, e);
    }
    red[tid] = part;
    __syncthreads();
    for (int w = 64; w > 0; w >>= 1) {
        if (tid < w) red[tid] = __fadd_rn(red[tid], red[tid + w]);
        __syncthreads();
    }
    float total = red[0];
    if (has_sink) total = __fadd_rn(total, exp_f32(__fsub_rn(sink, m)));
    for (int i = tid; i < len; i += 128) s[i] = __fdiv_rn(s[i], total);
    __syncthreads();
    const float* vb = vc + (size_t)lo * kvd + (size_t)g * hd;
    float* o = out + ((size_t)j * nh + h) * hd;
    for (int d = tid; d < hd; d += 128) {
        float acc = 0.0f;
        for (int t = 0; t < len; ++t) acc = __fadd_rn(acc, __fmul_rn(s[t], vb[(size_t)t * kvd + d]));
        o[d] = acc;
    }
}

// The softmax top-k routers, one thread per token (t = blockIdx.x * blockDim.x + threadIdx.x),
// the CPU's sequence of operations (deltafin-engine moe.rs) so the choice is the CPU's on the
// same logits:
//   mode 0 (Mixtral, Qwen3-MoE `route_softmax`, [SOFTMAX_TOPK]): p = softmax(logits) over all E
//     (max, then e = exp(l - max) summed in index order, then p = e / sum; all zero when every
//     logit is -inf); the k largest p, ties to the lower id; with `norm` each divided by their
//     sum taken largest first.
//   mode 1 (gpt-oss `route_topk_softmax`, [TOPK_THEN_SOFTMAX]): the k largest logits, ties to the
//     lower id; weights the softmax over those k logits, largest first.
// The i-th pick is the largest value below the (i-1)-th in the order (value descending, id
// ascending). Output sorted by expert id: ids [n, k], weights [n, k]. probs: [n, E] scratch
// (mode 0). k <= 16. A NaN logit is never picked; if fewer than k can be picked the rest are -1
// (the host refuses them).
extern "C" __global__ void route_softmax_topk(const float* __restrict__ logits, int n, int E, int k, int mode,
                                              int norm, float* __restrict__ probs, int* __restrict__ ids,
                                              float* __restrict__ weights) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n) return;
    const float* lg = logits + (size_t)t * E;
    const float* v = lg;
    if (mode == 0) {
        float* p = probs + (size_t)t * E;
        float mx = -gqa_inf();
        for (int e = 0; e < E; ++e) mx = fmaxf(mx, lg[e]);
        if (mx == -gqa_inf()) {
            for (int e = 0; e < E; ++e) p[e] = 0.0f;
        } else {
            float sum = 0.0f;
            for (int e = 0; e < E; ++e) {
                const float x = exp_f32(__fsub_rn(lg[e], mx));
                p[e] = x;
                sum = __fadd_rn(sum, x);
            }
            for (int e = 0; e < E; ++e) p[e] = __fdiv_rn(p[e], sum);
        }
        v = p;
    }
    int pick[16];
    float w[16];
    float pv = gqa_inf();
    int pi = -1;
    for (int i = 0; i < k; ++i) {
        int best = -1;
        float bv = 0.0f;
        for (int e = 0; e < E; ++e) {
            const float x = v[e];
            const bool below = x < pv || (x == pv && e > pi);
            if (below && (best < 0 || x > bv)) {
                best = e;
                bv = x;
            }
        }
        pick[i] = best;
        w[i] = best < 0 ? 0.0f : bv;
        if (best >= 0) {
            pv = bv;
            pi = best;
        }
    }
    if (mode == 0 && norm) {
        float d = 0.0f;
        for (int i = 0; i < k; ++i) d = __fadd_rn(d, w[i]);
        for (int i = 0; i < k; ++i) w[i] = __fdiv_rn(w[i], d);
    } else if (mode == 1) {
        float mx = -gqa_inf();
        for (int i = 0; i < k; ++i) mx = fmaxf(mx, w[i]);
        softmax_given_max(w, k, mx);
    }
    // Insertion sort by id (-1, never picked, first; the host refuses those).
    for (int a = 1; a < k; ++a) {
        const int id = pick[a];
        const float wv = w[a];
        int b = a - 1;
        while (b >= 0 && pick[b] > id) {
            pick[b + 1] = pick[b];
            w[b + 1] = w[b];
            --b;
        }
        pick[b + 1] = id;
        w[b + 1] = wv;
    }
    for (int i = 0; i < k; ++i) {
        ids[(size_t)t * k + i] = pick[i];
        weights[(size_t)t * k + i] = w[i];
    }
}

// y[t, i] += b[i] for y: [n, dim] (projection biases: gpt-oss' q/k/v/o and router biases; the
// CPU's add_bias, one add).
extern "C" __global__ void add_bias_rows(float* __restrict__ y, const float* __restrict__ b, int n, int dim) {
    const size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (e >= (size_t)n * dim) return;
    y[e] = __fadd_rn(y[e], b[e % dim]);
}

// gpt-oss' clamped SwiGLU on the interleaved gate/up projection of n tokens (transformers
// GptOssExperts._apply_gate; the CPU's gpt_oss.rs `clamped_swiglu_expert`, [CLAMPED_SWIGLU]):
//   gate = min(gu[t, 2j] + b[2j], limit), up = clamp(gu[t, 2j + 1] + b[2j + 1], -limit, limit)
//   h[t, j] = (up + 1) * (gate * sigmoid(gate * alpha)),  sigmoid(v) = 1 / (1 + exp(-v))
// gu: [n, 2 * inter], b: [2 * inter], h: [n, inter].
extern "C" __global__ void clamped_swiglu(const float* __restrict__ gu, const float* __restrict__ b, int n,
                                          int inter, float alpha, float limit, float* __restrict__ h) {
    const size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (e >= (size_t)n * inter) return;
    const size_t t = e / inter;
    const int j = (int)(e % inter);
    const float* r = gu + t * 2 * inter;
    const float gate = fminf(__fadd_rn(r[2 * j], b[2 * j]), limit);
    const float up = fminf(fmaxf(__fadd_rn(r[2 * j + 1], b[2 * j + 1]), -limit), limit);
    const float sg = __fdiv_rn(1.0f, __fadd_rn(1.0f, exp_f32(-__fmul_rn(gate, alpha))));
    h[e] = __fmul_rn(__fadd_rn(up, 1.0f), __fmul_rn(gate, sg));
}
