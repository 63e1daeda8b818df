// deltafin CUDA kernels, part 2: matrices of any layout behind one descriptor, the fused launches
// of a decode step, and the noaux_tc router on the device. Appended to ops.cu (its helpers:
// warp_sum, mx_rows, i8_rows, f32_row, block_rms_norm, rope_pair).
//
// Exactness: every value below is computed by the same device code, in the same order, as the
// one-operation kernels of ops.cu (a row's dot product as mxfp4_mv_f16_* / int8_mv_* /
// f32_matvec at one row and one token; a norm as rms_norm; SwiGLU as swiglu; the MoE sum as
// moe_combine), so a fused launch gives the unfused launches' bits, and the batched prefill
// (ops.cu's matmul kernels) gives every token the bits of decoding it alone.

// One weight matrix `[rows, cols]` in one of deltafin-kernels' layouts (mat.rs `MatDesc`).
//   fmt 0: f32, w = float[rows * cols];
//   fmt 1: int8, w = i8 codes [rows * cols], s = f32 row scales [rows];
//   fmt 2: MXFP4, w = packed codes [rows * 16 * nb], s = E8M0 block scales [rows * nb].
struct Mat {
    const void* w;
    const void* s;
    int rows;
    int cols;
    int fmt;
    int pad;
};

// Row `row` of m dotted with x (cols floats, 16-byte aligned), by one warp; every lane gets the
// result. The arithmetic of the matrix kernels at one row and one token.
__device__ __forceinline__ float mat_row_dot(const Mat& m, int row, const float* __restrict__ x) {
    if (m.fmt == 2) {
        const int nb = (m.cols + 31) >> 5;
        float a[1][1];
        mx_rows<2, 1, 1>(reinterpret_cast<const u8*>(m.w) + (size_t)row * nb * 16,
                         reinterpret_cast<const u8*>(m.s) + (size_t)row * nb, 1, m.cols, nb, nullptr, x, 1, a);
        return warp_sum(a[0][0]);
    }
    if (m.fmt == 1) {
        float a[1][1];
        i8_rows<1, 1>(reinterpret_cast<const i8*>(m.w) + (size_t)row * m.cols, 1, m.cols, x, 1, a);
        return reinterpret_cast<const float*>(m.s)[row] * warp_sum(a[0][0]);
    }
    float a[1];
    f32_row<1>(reinterpret_cast<const float*>(m.w) + (size_t)row * m.cols, m.cols, x, 1, a);
    return warp_sum(a[0]);
}

// SwiGLU's expression (swiglu, moe_gate_up_mxfp4): silu(g) * u with silu(v) = v / (1 + exp(-v)).
__device__ __forceinline__ float silu_mul(float g, float u) { return g / (1.0f + expf(-g)) * u; }

// ---- The noaux_tc router (DeepSeek-V3 §2.1.2; transformers DeepseekV3TopkRouter) ------------
// For one token, by the first warp of a block: scores s_i = 1 / (1 + exp(-logit_i)),
// choice c_i = s_i + bias_i; with n_group > 1 each group's score is its two largest c summed
// (largest first), the topk_group best groups are kept and the others' c set to -inf; the top_k
// largest c are chosen (ties to the lower id), sorted by id; weights s_e in that order, divided by
// (their sum in id order + 1e-20) when norm, then times `scale`. The host's deltafin-engine
// moe::route does the same steps; only exp may differ from the host libm's in the last bit.
// `rs`: shared memory of 2 * n_experts floats + n_experts bytes. Logits are read through L2
// (__ldcg): they may have been written by other blocks of the same launch.
struct RouteCfg {
    int n_experts;
    int top_k;
    int n_group;
    int topk_group;
    int norm;
    float scale;
};

__device__ __forceinline__ bool route_better(float v, int i, float bv, int bi) {
    return bi < 0 || v > bv || (v == bv && i < bi);
}

__device__ void route_token(const float* lg, const float* __restrict__ bias, const RouteCfg& c,
                            int* __restrict__ ids, float* __restrict__ weights, float* rs) {
    float* score = rs;
    float* choice = rs + c.n_experts;
    unsigned char* taken = reinterpret_cast<unsigned char*>(rs + 2 * c.n_experts);
    __shared__ float gsc[64];
    __shared__ int gkeep[64];
    __shared__ int chosen[MOE_MAX_K];
    const int lane = threadIdx.x & 31;
    const int n = c.n_experts;
    for (int i = lane; i < n; i += 32) {
        const float s = 1.0f / (1.0f + expf(-__ldcg(lg + i)));
        score[i] = s;
        choice[i] = s + bias[i];
        taken[i] = 0;
    }
    __syncwarp();
    if (c.n_group > 1) {
        const int per = n / c.n_group;
        for (int g = lane; g < c.n_group; g += 32) {
            const float* cg = choice + g * per;
            int b0 = -1, b1 = -1;
            for (int i = 0; i < per; ++i) {
                if (b0 < 0 || cg[i] > cg[b0]) {
                    b1 = b0;
                    b0 = i;
                } else if (b1 < 0 || cg[i] > cg[b1]) {
                    b1 = i;
                }
            }
            gsc[g] = b1 >= 0 ? __fadd_rn(cg[b0], cg[b1]) : cg[b0];
            gkeep[g] = 0;
        }
        __syncwarp();
        if (lane == 0) {
            for (int r = 0; r < c.topk_group; ++r) {
                int best = -1;
                for (int g = 0; g < c.n_group; ++g)
                    if (!gkeep[g] && (best < 0 || gsc[g] > gsc[best])) best = g;
                if (best >= 0) gkeep[best] = 1;
            }
        }
        __syncwarp();
        for (int i = lane; i < n; i += 32)
            if (!gkeep[i / per]) choice[i] = __int_as_float(0xff800000u);
        __syncwarp();
    }
    for (int r = 0; r < c.top_k; ++r) {
        float bv = 0.0f;
        int bi = -1;
        for (int i = lane; i < n; i += 32)
            if (!taken[i] && route_better(choice[i], i, bv, bi)) {
                bv = choice[i];
                bi = i;
            }
        for (int off = 16; off > 0; off >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, off);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, off);
            if (oi >= 0 && route_better(ov, oi, bv, bi)) {
                bv = ov;
                bi = oi;
            }
        }
        if (lane == 0) {
            chosen[r] = bi;
            if (bi >= 0) taken[bi] = 1;
        }
        __syncwarp();
    }
    if (lane == 0) {
        const int k = c.top_k;
        for (int a = 1; a < k; ++a) {
            const int v = chosen[a];
            int b = a - 1;
            while (b >= 0 && chosen[b] > v) {
                chosen[b + 1] = chosen[b];
                --b;
            }
            chosen[b + 1] = v;
        }
        float d = 0.0f;
        for (int j = 0; j < k; ++j) d = __fadd_rn(d, score[chosen[j]]);
        d = __fadd_rn(d, 1e-20f);
        for (int j = 0; j < k; ++j) {
            const float v = c.norm ? __fdiv_rn(score[chosen[j]], d) : score[chosen[j]];
            ids[j] = chosen[j];
            weights[j] = __fmul_rn(v, c.scale);
        }
    }
}

// One token a block of 32 threads (blockIdx.x = token): ids[t * k ..], weights[t * k ..].
// Dynamic shared memory: 2 * n_experts floats + n_experts bytes.
extern "C" __global__ void route_noaux(const float* __restrict__ logits, const float* __restrict__ bias, RouteCfg c,
                                       int* __restrict__ ids, float* __restrict__ weights) {
    extern __shared__ float rs_dyn[];
    const size_t t = blockIdx.x;
    route_token(logits + t * c.n_experts, bias, c, ids + t * c.top_k, weights + t * c.top_k, rs_dyn);
}

// The block that finishes last among a launch's blocks (a completion counter, reset by that
// block for the next launch on the stream): true in every thread of that block only. Writes of
// all blocks before their call are visible to it through L2 (read them with __ldcg). The counter
// orders only completion; no value is reduced through atomics.
__device__ __forceinline__ bool last_block(int* counter) {
    __shared__ int is_last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) is_last = atomicAdd(counter, 1) == (int)(gridDim.x * gridDim.y) - 1;
    __syncthreads();
    if (is_last) __threadfence();
    return is_last;
}

// ---- MLA's per-token preparation --------------------------------------------------------------
// Role 0: latent = RMSNorm(ckv_raw) (kv_a_layernorm, rms_norm's code) into the latent cache row
// of position *pos; role 1: RoPE of the shared rope key (rope_apply's arithmetic) into the
// rope-key cache row (the position read on the device, so a captured graph serves every token).
// One block of 256 threads a role.
struct MlaPrep {
    const float* ckv_raw;
    const float* norm_w;
    float* c_kv;
    const float* kpe_raw;
    const float* cs;
    float* k_pe;
    const int* pos;
    int kvl;
    float eps;
    int rope;
    int interleaved;
    int enabled;
    int pad;
};

__device__ __forceinline__ void mla_prep_role(const MlaPrep& m, int role, float* part) {
    const size_t p = (size_t)*m.pos;
    if (role == 0) {
        block_rms_norm(m.ckv_raw, m.norm_w, m.kvl, m.eps, 0, m.c_kv + p * m.kvl, part);
        return;
    }
    float* kpe_dst = m.k_pe + p * m.rope;
    const int half = m.rope / 2;
    for (int i = threadIdx.x; i < half; i += 256) {
        const int a = m.interleaved ? 2 * i : i, b = m.interleaved ? 2 * i + 1 : i + half;
        rope_pair(m.kpe_raw[a], m.kpe_raw[b], m.cs[i], m.cs[half + i], &kpe_dst[a], &kpe_dst[b]);
    }
}

extern "C" __global__ void __launch_bounds__(256) mla_prep(MlaPrep m) {
    __shared__ float part[256];
    mla_prep_role(m, blockIdx.x, part);
}

// ---- Several matrix-vector products of one input, one launch ----------------------------------
// Job kinds: 0 y[r] = W[r] . x; 1 y[r] += W[r] . x (axpy's multiply by 1 then add: the residual
// stream); 2 y[r] = silu(A[r] . x) * (B[r] . x) (a gate/up pair). Rows of all jobs are laid end
// to end (`row0` of each job); one warp a row, 8 warps a block.
#define MAX_JOBS 4
struct Job {
    Mat a;
    Mat b;
    float* y;
    int kind;
    int row0;
};
struct Jobs {
    Job j[MAX_JOBS];
    int n;
    int pad;
};
// Optional RMSNorm of the input first (w not null): every block normalizes x into shared memory
// with rms_norm's code (so the products see rms_norm's bits), block 0 also writes it to `out`
// when that is not null.
struct PreNorm {
    const float* w;
    float* out;
    float eps;
    int dim;
    int one_plus;
    int pad;
};

// Optional router after the products (enabled != 0): job 0 is the router (its y the logits), and
// the block that finishes last routes the token with route_token into ids/weights.
struct RouteTail {
    const float* bias;
    int* ids;
    float* weights;
    int* counter;
    RouteCfg c;
    int enabled;
};

// Optional MLA preparation (prep.enabled != 0, never with rt.enabled): the launch's last two
// blocks do mla_prep's two roles instead of products.
// Dynamic shared memory: max(pn.dim floats when pn.w is not null, the router's when rt.enabled).
extern "C" __global__ void __launch_bounds__(256) mv_jobs(Jobs jobs, const float* __restrict__ x, PreNorm pn,
                                                          RouteTail rt, MlaPrep prep) {
    extern __shared__ __align__(16) float xs[];
    __shared__ float part[256];
    if (prep.enabled && (int)blockIdx.x >= (int)gridDim.x - 2) {
        mla_prep_role(prep, blockIdx.x - (gridDim.x - 2), part);
        return;
    }
    const float* xin = x;
    if (pn.w != nullptr) {
        block_rms_norm(x, pn.w, pn.dim, pn.eps, pn.one_plus, xs, part);
        if (blockIdx.x == 0 && pn.out != nullptr)
            for (int i = threadIdx.x; i < pn.dim; i += 256) pn.out[i] = xs[i];
        xin = xs;
    }
    const int gr = blockIdx.x * 8 + (threadIdx.x >> 5);
    Job job = jobs.j[0];
#pragma unroll
    for (int i = 1; i < MAX_JOBS; ++i)
        if (i < jobs.n && gr >= jobs.j[i].row0) job = jobs.j[i];
    const int r = gr - job.row0;
    if (r < job.a.rows) {
        float v = mat_row_dot(job.a, r, xin);
        if (job.kind == 2) v = silu_mul(v, mat_row_dot(job.b, r, xin));
        if ((threadIdx.x & 31) == 0) {
            if (job.kind == 1) job.y[r] = __fadd_rn(job.y[r], __fmul_rn(1.0f, v));
            else job.y[r] = v;
        }
    }
    if (rt.enabled == 0) return;
    if (!last_block(rt.counter)) return;
    __syncthreads();  // xs is reused by the router below
    if (threadIdx.x < 32) route_token(jobs.j[0].y, rt.bias, rt.c, rt.ids, rt.weights, xs);
    if (threadIdx.x == 0) *rt.counter = 0;
}

// ---- Routed experts from a device table -------------------------------------------------------
// table[e] holds expert e's three matrices; ids[j] names the expert of slot j (router order).
struct Expert {
    Mat gate;
    Mat up;
    Mat down;
};

// h[j, r] = silu(gate_j[r] . x) * (up_j[r] . x), gate_j, up_j: [inter, hidden]; one warp a row,
// blockIdx.y = slot j. moe_gate_up_mxfp4's arithmetic, for any layout.
extern "C" __global__ void __launch_bounds__(256)
    moe_gate_up_tab(const Expert* __restrict__ table, const int* __restrict__ ids, int inter,
                    const float* __restrict__ x, float* __restrict__ h) {
    const int j = blockIdx.y;
    const int row = blockIdx.x * 8 + (threadIdx.x >> 5);
    if (row >= inter) return;
    const int e = ids[j];
    const Mat g = table[e].gate, u = table[e].up;
    const float gv = mat_row_dot(g, row, x);
    const float uv = mat_row_dot(u, row, x);
    if ((threadIdx.x & 31) == 0) h[(size_t)j * inter + row] = silu_mul(gv, uv);
}

// x[r] += (sum_j w[j] (down_j[r] . h_j)) + (shared_down[r] . shared_h): each slot's dot as
// moe_down_mxfp4 computes it, the sum from 0 in slot (router) order, then the shared experts'
// output (when shared_h is not null: the shared down projection as a matvec computes it), then
// the residual add: moe_combine's arithmetic. One warp a row of hidden.
extern "C" __global__ void __launch_bounds__(256)
    moe_down_combine_tab(const Expert* __restrict__ table, const int* __restrict__ ids,
                         const float* __restrict__ w, int k, int hidden, int inter, const float* __restrict__ h,
                         Mat shared_down, const float* __restrict__ shared_h, float* __restrict__ x) {
    const int row = blockIdx.x * 8 + (threadIdx.x >> 5);
    if (row >= hidden) return;
    float acc = 0.0f;
    for (int j = 0; j < k; ++j) {
        const Mat d = table[ids[j]].down;
        const float y = mat_row_dot(d, row, h + (size_t)j * inter);
        acc = __fadd_rn(acc, __fmul_rn(w[j], y));
    }
    if (shared_h != nullptr) acc = __fadd_rn(acc, __fmul_rn(1.0f, mat_row_dot(shared_down, row, shared_h)));
    if ((threadIdx.x & 31) == 0) x[row] = __fadd_rn(x[row], __fmul_rn(1.0f, acc));
}

// The down projections as their own launch (more warps in flight than moe_down_combine_tab's
// one warp a row): y[j, r] = down_j[r] . h_j for slots j < k (blockIdx.y = j), and with
// shared_h not null y[k, r] = shared_down[r] . shared_h (blockIdx.y = k). The block that finishes
// last then adds them to x in moe_down_combine_tab's order: x[i] += (sum_{j<k} w[j] y[j, i]) +
// y[k, i]: the same bits.
extern "C" __global__ void __launch_bounds__(256)
    moe_down_tab(const Expert* __restrict__ table, const int* __restrict__ ids, const float* __restrict__ w, int k,
                 int hidden, int inter, const float* __restrict__ h, Mat shared_down,
                 const float* __restrict__ shared_h, float* y, float* __restrict__ x, int* counter) {
    const int j = blockIdx.y;
    const int row = blockIdx.x * 8 + (threadIdx.x >> 5);
    if (row < hidden) {
        float v;
        if (j < k) {
            const Mat d = table[ids[j]].down;
            v = mat_row_dot(d, row, h + (size_t)j * inter);
        } else {
            v = mat_row_dot(shared_down, row, shared_h);
        }
        if ((threadIdx.x & 31) == 0) y[(size_t)j * hidden + row] = v;
    }
    if (!last_block(counter)) return;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        float acc = 0.0f;
        for (int jj = 0; jj < k; ++jj) acc = __fadd_rn(acc, __fmul_rn(w[jj], __ldcg(y + (size_t)jj * hidden + i)));
        if (shared_h != nullptr) acc = __fadd_rn(acc, __fmul_rn(1.0f, __ldcg(y + (size_t)k * hidden + i)));
        x[i] = __fadd_rn(x[i], __fmul_rn(1.0f, acc));
    }
    if (threadIdx.x == 0) *counter = 0;
}
