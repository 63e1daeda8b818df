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
        mx_rows<MX_DEC, 1, 1>(reinterpret_cast<const u8*>(m.w) + (size_t)row * nb * 16,
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
__device__ __forceinline__ float silu_mul(float g, float u) { return g / (1.0f + exp_f32(-g)) * u; }

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

// The same steps with every value in registers (the general code below walks shared memory
// from lane 0 for the group and sorting steps: ~17 us a token on the H200, a tenth of a layer).
// Lane l owns the E consecutive entries l E .. l E + E - 1 (n = 32 E); with groups, a group is
// L = per / E consecutive lanes (a power of two). Group scores: each lane's two largest choices,
// merged over the group's lanes by shuffles (the two largest of a multiset; the sum's operands
// are those of the general code). Group choice and the top-k: rounds of a warp arg-max under
// route_better's order (larger value, then lower index), the winning lane taking its next best.
// Ids sorted by rank counting; the normalizing sum in id order, weights by lanes 0 .. k-1.
// Gives the general code's ids and bits (test device_router_chooses_what_the_host_router_chooses).
__device__ __forceinline__ void warp_best(float& v, int& i, float& s) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, off);
        const int oi = __shfl_xor_sync(0xffffffffu, i, off);
        const float os = __shfl_xor_sync(0xffffffffu, s, off);
        if (oi >= 0 && route_better(ov, oi, v, i)) {
            v = ov;
            i = oi;
            s = os;
        }
    }
}

template <int E>
__device__ void route_token_regs(const float* lg, const float* __restrict__ bias, const RouteCfg& c,
                                 int* __restrict__ ids, float* __restrict__ weights) {
    __shared__ int rid[MOE_MAX_K];
    __shared__ float rsc[MOE_MAX_K];
    const int lane = threadIdx.x & 31;
    const int i0 = lane * E;
    float sc[E], ch[E];
#pragma unroll
    for (int e = 0; e < E; ++e) {
        sc[e] = 1.0f / (1.0f + exp_f32(-__ldcg(lg + i0 + e)));
        ch[e] = sc[e] + bias[i0 + e];
    }
    if (c.n_group > 1) {
        const int per = c.n_experts / c.n_group, L = per / E;
        float t1 = ch[0], t2 = __int_as_float(0xff800000u);
#pragma unroll
        for (int e = 1; e < E; ++e) {
            if (ch[e] > t1) {
                t2 = t1;
                t1 = ch[e];
            } else if (ch[e] > t2) {
                t2 = ch[e];
            }
        }
        for (int off = 1; off < L; off <<= 1) {
            const float o1 = __shfl_xor_sync(0xffffffffu, t1, off);
            const float o2 = __shfl_xor_sync(0xffffffffu, t2, off);
            const float hi = fmaxf(t1, o1), lo = fmaxf(fminf(t1, o1), fmaxf(t2, o2));
            t1 = hi;
            t2 = lo;
        }
        const float gs = per > 1 ? __fadd_rn(t1, t2) : t1;
        const int g = lane / L;
        bool kept = false;
        for (int r = 0; r < c.topk_group; ++r) {
            float bv = kept ? 0.0f : gs, bs = 0.0f;
            int bg = kept ? -1 : g;
            warp_best(bv, bg, bs);
            if (bg == g) kept = true;
        }
        if (!kept)
#pragma unroll
            for (int e = 0; e < E; ++e) ch[e] = __int_as_float(0xff800000u);
    }
    unsigned taken = 0u;
    float lv = 0.0f, ls = 0.0f;
    int li = -1;
#pragma unroll
    for (int e = 0; e < E; ++e)
        if (route_better(ch[e], i0 + e, lv, li)) {
            lv = ch[e];
            li = i0 + e;
            ls = sc[e];
        }
    int my_id = -1;
    float my_s = 0.0f;
    for (int r = 0; r < c.top_k; ++r) {
        float bv = lv, bs = ls;
        int bi = li;
        warp_best(bv, bi, bs);
        if (lane == r) {
            my_id = bi;
            my_s = bs;
        }
        if (bi == li && bi >= 0) {
            taken |= 1u << (bi - i0);
            lv = 0.0f;
            li = -1;
#pragma unroll
            for (int e = 0; e < E; ++e)
                if (!(taken & (1u << e)) && route_better(ch[e], i0 + e, lv, li)) {
                    lv = ch[e];
                    li = i0 + e;
                    ls = sc[e];
                }
        }
    }
    int rank = 0;
    for (int j = 0; j < c.top_k; ++j) {
        const int o = __shfl_sync(0xffffffffu, my_id, j);
        if (o < my_id) ++rank;
    }
    if (lane < c.top_k) {
        rid[rank] = my_id;
        rsc[rank] = my_s;
    }
    __syncwarp();
    float d = 0.0f;
    for (int j = 0; j < c.top_k; ++j) d = __fadd_rn(d, rsc[j]);
    d = __fadd_rn(d, 1e-20f);
    if (lane < c.top_k) {
        const float v = c.norm ? __fdiv_rn(rsc[lane], d) : rsc[lane];
        ids[lane] = rid[lane];
        weights[lane] = __fmul_rn(v, c.scale);
    }
    __syncwarp();
}

// route_token's register form applies: n = 32 E for an instantiated E, top_k <= 32, and groups
// (if any) of a power-of-two number of whole lanes.
__device__ __forceinline__ bool route_regs_fit(const RouteCfg& c, int E) {
    if (c.n_experts != 32 * E || c.top_k > MOE_MAX_K || c.top_k > c.n_experts) return false;
    if (c.n_group <= 1) return true;
    if (c.n_experts % c.n_group != 0) return false;
    const int per = c.n_experts / c.n_group;
    if (per % E != 0) return false;
    const int L = per / E;
    return L >= 1 && L <= 32 && (L & (L - 1)) == 0 && c.topk_group <= c.n_group;
}

__device__ void route_token_general(const float* lg, const float* __restrict__ bias, const RouteCfg& c,
                                    int* __restrict__ ids, float* __restrict__ weights, float* rs);

__device__ void route_token(const float* lg, const float* __restrict__ bias, const RouteCfg& c,
                            int* __restrict__ ids, float* __restrict__ weights, float* rs) {
    const int E = c.n_experts / 32;
#define ROUTE_E(N)                                                                                   \
    if (E == N && route_regs_fit(c, N)) {                                                           \
        route_token_regs<N>(lg, bias, c, ids, weights);                                              \
        return;                                                                                      \
    }
    ROUTE_E(1)
    ROUTE_E(2)
    ROUTE_E(4)
    ROUTE_E(8)
    ROUTE_E(12)
    ROUTE_E(16)
    ROUTE_E(28)
#undef ROUTE_E
    route_token_general(lg, bias, c, ids, weights, rs);
}

__device__ void route_token_general(const float* lg, const float* __restrict__ bias, const RouteCfg& c,
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
        const float s = 1.0f / (1.0f + exp_f32(-__ldcg(lg + i)));
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

// NM dot products of MXFP4 rows of `cols` columns, row m with codes pm[m], scales sm[m] and
// activations xm[m] (all the same x when SHARED_X), each computed with mx_rows' operations in
// its order at one row and one token, so each lane partial (and its warp_sum) is the one
// mat_row_dot gives for that row, bit for bit. The block scales come from the block's table
// `sct` (mx_scale_table: the same values, no branches) and the codes are loaded past L1 (read
// once a step; L1 keeps x). The code and scale loads of every row for CH
// steps are issued before any is used, and with SHARED_X each x load serves all NM rows: a
// decode step's expert matrices are small, and one row at a time leaves the warp waiting on
// its loads (ncu: L1TEX scoreboard stalls, 15 % of DRAM bandwidth).
template <int NM, int CH, bool SHARED_X>
__device__ __forceinline__ void mx_dots(const u8* const (&pm)[NM], const u8* const (&sm)[NM],
                                        const float* const (&xm)[NM], int cols, const float* sct,
                                        float acc[NM]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const int nb = (cols + 31) >> 5;
    const int full = (cols & 3) == 0 ? cols >> 5 : 0;
#pragma unroll
    for (int m = 0; m < NM; ++m) acc[m] = 0.0f;
    for (int b0 = g; b0 < nb; b0 += 8 * CH) {
        u32 w[CH][NM];
        float sc[CH][NM];
#pragma unroll
        for (int c = 0; c < CH; ++c) {
            const int b = b0 + 8 * c;
#pragma unroll
            for (int m = 0; m < NM; ++m) {
                w[c][m] = b < nb ? ld_stream_u32(reinterpret_cast<const u32*>(pm[m] + (size_t)b * 16 + 4 * q)) : 0u;
                sc[c][m] = b < nb ? sct[sm[m][b]] : 0.0f;
            }
        }
#pragma unroll
        for (int c = 0; c < CH; ++c) {
            const int b = b0 + 8 * c;
            if (b >= nb) break;
            const int base = b * 32 + 8 * q;
            if (b < full) {
                float4 a = make_float4(0.f, 0.f, 0.f, 0.f), cc = a;
                if (SHARED_X) {
                    a = *reinterpret_cast<const float4*>(xm[0] + base);
                    cc = *reinterpret_cast<const float4*>(xm[0] + base + 4);
                }
#pragma unroll
                for (int m = 0; m < NM; ++m) {
                    if (!SHARED_X) {
                        a = *reinterpret_cast<const float4*>(xm[m] + base);
                        cc = *reinterpret_cast<const float4*>(xm[m] + base + 4);
                    }
                    float v[8];
                    Dec<MX_DEC>::run(w[c][m], nullptr, v);
                    acc[m] += mx_dot8(v, a, cc) * sc[c][m];
                }
            } else {
                const int valid = cols - base;
                if (valid <= 0) continue;
#pragma unroll
                for (int m = 0; m < NM; ++m) {
                    float v[8];
                    Dec<MX_DEC>::run(w[c][m], nullptr, v);
                    acc[m] += mx_dot8_tail(v, xm[m] + base, valid) * sc[c][m];
                }
            }
        }
    }
}

// h[j, r] = silu(gate_j[r] . x) * (up_j[r] . x), gate_j, up_j: [inter, hidden]; one warp a row,
// blockIdx.y = slot j. moe_gate_up_mxfp4's arithmetic, for any layout (MXFP4 pairs through
// mx_dots: both rows' loads in flight together, one x load for both).
extern "C" __global__ void __launch_bounds__(256)
    moe_gate_up_tab(const Expert* __restrict__ table, const int* __restrict__ ids, int inter,
                    const float* __restrict__ x, float* __restrict__ h) {
    __shared__ float sct[256];
    mx_scale_table(sct);
    const int j = blockIdx.y;
    const int row = blockIdx.x * 8 + (threadIdx.x >> 5);
    if (row >= inter) return;
    const int e = ids[j];
    const Mat g = table[e].gate, u = table[e].up;
    float gv, uv;
    if (g.fmt == 2 && u.fmt == 2 && g.cols == u.cols) {
        const int nb = (g.cols + 31) >> 5;
        const u8* const pm[2] = {reinterpret_cast<const u8*>(g.w) + (size_t)row * nb * 16,
                                 reinterpret_cast<const u8*>(u.w) + (size_t)row * nb * 16};
        const u8* const sm[2] = {reinterpret_cast<const u8*>(g.s) + (size_t)row * nb,
                                 reinterpret_cast<const u8*>(u.s) + (size_t)row * nb};
        const float* const xm[2] = {x, x};
        float a[2];
        mx_dots<2, 8, true>(pm, sm, xm, g.cols, sct, a);
        gv = warp_sum(a[0]);
        uv = warp_sum(a[1]);
    } else {
        gv = mat_row_dot(g, row, x);
        uv = mat_row_dot(u, row, x);
    }
    if ((threadIdx.x & 31) == 0) h[(size_t)j * inter + row] = silu_mul(gv, uv);
}

// x[r] += (sum_j w[j] (down_j[r] . h_j)) + (shared_down[r] . shared_h): each slot's dot as
// moe_down_mxfp4 computes it, the sum from 0 in slot (router) order, then the shared experts'
// output (when shared_h is not null: the shared down projection as a matvec computes it), then
// the residual add: moe_combine's arithmetic. One warp a row of hidden; MXFP4 slots four at a
// time through mx_dots (their loads in flight together).
extern "C" __global__ void __launch_bounds__(256)
    moe_down_combine_tab(const Expert* __restrict__ table, const int* __restrict__ ids,
                         const float* __restrict__ w, int k, int hidden, int inter, const float* __restrict__ h,
                         Mat shared_down, const float* __restrict__ shared_h, float* __restrict__ x) {
    __shared__ float sct[256];
    mx_scale_table(sct);
    const int row = blockIdx.x * 8 + (threadIdx.x >> 5);
    if (row >= hidden) return;
    float acc = 0.0f;
    for (int j0 = 0; j0 < k; j0 += 4) {
        const int nj = min(4, k - j0);
        Mat d[4];
        bool mx = true;
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
            d[jj] = table[ids[j0 + min(jj, nj - 1)]].down;
            mx = mx && d[jj].fmt == 2 && d[jj].cols == inter;
        }
        if (mx) {
            const int nb = (inter + 31) >> 5;
            const u8* pm[4];
            const u8* sm[4];
            const float* xm[4];
#pragma unroll
            for (int jj = 0; jj < 4; ++jj) {
                pm[jj] = reinterpret_cast<const u8*>(d[jj].w) + (size_t)row * nb * 16;
                sm[jj] = reinterpret_cast<const u8*>(d[jj].s) + (size_t)row * nb;
                xm[jj] = h + (size_t)(j0 + min(jj, nj - 1)) * inter;
            }
            float a[4];
            mx_dots<4, 4, false>(pm, sm, xm, inter, sct, a);
#pragma unroll
            for (int jj = 0; jj < 4; ++jj) {
                const float y = warp_sum(a[jj]);
                if (jj < nj) acc = __fadd_rn(acc, __fmul_rn(w[j0 + jj], y));
            }
        } else {
            for (int jj = 0; jj < nj; ++jj) {
                const float y = mat_row_dot(d[jj], row, h + (size_t)(j0 + jj) * inter);
                acc = __fadd_rn(acc, __fmul_rn(w[j0 + jj], y));
            }
        }
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

// ---- Routed experts of a prefill chunk, grouped (expert-major) --------------------------------
// The chunk's (token, slot) pairs sorted by expert (the "gathered order", row i of xg is the
// input of pair i): tile i covers gathered rows tiles[3i + 1] .. tiles[3i + 1] + tiles[3i + 2]
// (at most the shape's T) of expert table[tiles[3i]]. Every (row, pair) output is mx_rows' result for
// that row and that token at any R, T, then warp_sum: what mxfp4_mm computes for it, so these
// two launches give the bits of the per-expert matmul + swiglu + matmul path (and of decoding).
// blockIdx.y + tile0 = tile; one warp GROUP_R consecutive rows. MXFP4 experts only (the host
// checks every entry's layout and shape).
template <int R, int T, int U>
__device__ __forceinline__ void mx_rows_pair(const u8* __restrict__ ga, const u8* __restrict__ gs,
                                             const u8* __restrict__ ua, const u8* __restrict__ us, int nr, int cols,
                                             int nb, const float* __restrict__ x, int nt, float accg[R][T],
                                             float accu[R][T]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const int full = (cols & 3) == 0 ? cols >> 5 : 0;
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int t = 0; t < T; ++t) accg[r][t] = accu[r][t] = 0.0f;
#pragma unroll U
    for (int b = g; b < nb; b += 8) {
        u32 wg[R], wu[R];
        float sg[R], su[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const size_t o = ((size_t)r * nb + b) * 16 + 4 * q;
            wg[r] = r < nr ? *reinterpret_cast<const u32*>(ga + o) : 0u;
            wu[r] = r < nr ? *reinterpret_cast<const u32*>(ua + o) : 0u;
            sg[r] = r < nr ? e8m0(gs[(size_t)r * nb + b]) * Dec<MX_DEC>::SCALE : 0.0f;
            su[r] = r < nr ? e8m0(us[(size_t)r * nb + b]) * Dec<MX_DEC>::SCALE : 0.0f;
        }
        float vg[R][8], vu[R][8];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            Dec<MX_DEC>::run(wg[r], nullptr, vg[r]);
            Dec<MX_DEC>::run(wu[r], nullptr, vu[r]);
        }
        const int base = b * 32 + 8 * q;
        if (b < full) {
#pragma unroll
            for (int t = 0; t < T; ++t) {
                if (t >= nt) continue;
                const float4 a = *reinterpret_cast<const float4*>(x + (size_t)t * cols + base);
                const float4 c = *reinterpret_cast<const float4*>(x + (size_t)t * cols + base + 4);
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    accg[r][t] += mx_dot8(vg[r], a, c) * sg[r];
                    accu[r][t] += mx_dot8(vu[r], a, c) * su[r];
                }
            }
        } else {
            const int valid = cols - base;
            if (valid <= 0) continue;
#pragma unroll
            for (int t = 0; t < T; ++t) {
                if (t >= nt) continue;
                const float* xt = x + (size_t)t * cols + base;
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    accg[r][t] += mx_dot8_tail(vg[r], xt, valid) * sg[r];
                    accu[r][t] += mx_dot8_tail(vu[r], xt, valid) * su[r];
                }
            }
        }
    }
}

// Tile i of the grouped kernels: the pairs and expert it covers.
__device__ __forceinline__ void grouped_tile(const int* __restrict__ tiles, int tile0, int* e, int* off, int* nt) {
    const int* tl = tiles + 3 * (size_t)(tile0 + blockIdx.y);
    *e = tl[0];
    *off = tl[1];
    *nt = tl[2];
}

// h[p, r] = silu(gate_e[r] . xg[p]) * (up_e[r] . xg[p]) for the pairs p of each tile (expert e,
// at most T pairs); xg: [pairs, hidden], h: [pairs, inter]; a warp R rows of gate and of up.
template <int R, int T, int U>
__device__ __forceinline__ void moe_gate_up_grouped_impl(const Expert* __restrict__ table, const int* __restrict__ tiles,
                                                         int tile0, int inter, int hidden, const float* __restrict__ xg,
                                                         float* __restrict__ h) {
    int e, off, nt;
    grouped_tile(tiles, tile0, &e, &off, &nt);
    const int row0 = (blockIdx.x * 8 + (threadIdx.x >> 5)) * R;
    if (row0 >= inter) return;
    const int nr = min(R, inter - row0);
    const Mat g = table[e].gate, u = table[e].up;
    const int nb = (hidden + 31) >> 5;
    float ag[R][T], au[R][T];
    mx_rows_pair<R, T, U>(reinterpret_cast<const u8*>(g.w) + (size_t)row0 * nb * 16,
                          reinterpret_cast<const u8*>(g.s) + (size_t)row0 * nb,
                          reinterpret_cast<const u8*>(u.w) + (size_t)row0 * nb * 16,
                          reinterpret_cast<const u8*>(u.s) + (size_t)row0 * nb, nr, hidden, nb,
                          xg + (size_t)off * hidden, nt, ag, au);
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int t = 0; t < T; ++t) {
            const float gv = warp_sum(ag[r][t]);
            const float uv = warp_sum(au[r][t]);
            if ((threadIdx.x & 31) == 0 && r < nr && t < nt) h[(size_t)(off + t) * inter + row0 + r] = silu_mul(gv, uv);
        }
}

// y[dst[p], r] = down_e[r] . h[p] for the pairs p of each tile (expert e, at most T pairs);
// h: [pairs, inter], y: rows of hidden, dst[p] distinct; a warp R rows.
template <int R, int T>
__device__ __forceinline__ void moe_down_grouped_impl(const Expert* __restrict__ table, const int* __restrict__ tiles,
                                                      int tile0, int hidden, int inter, const float* __restrict__ h,
                                                      const int* __restrict__ dst, float* __restrict__ y) {
    int e, off, nt;
    grouped_tile(tiles, tile0, &e, &off, &nt);
    const int row0 = (blockIdx.x * 8 + (threadIdx.x >> 5)) * R;
    if (row0 >= hidden) return;
    const int nr = min(R, hidden - row0);
    const Mat d = table[e].down;
    const int nb = (inter + 31) >> 5;
    float a[R][T];
    mx_rows<MX_DEC, R, T>(reinterpret_cast<const u8*>(d.w) + (size_t)row0 * nb * 16,
                          reinterpret_cast<const u8*>(d.s) + (size_t)row0 * nb, nr, inter, nb, nullptr,
                          h + (size_t)off * inter, nt, a);
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int t = 0; t < T; ++t) {
            const float v = warp_sum(a[r][t]);
            if ((threadIdx.x & 31) == 0 && r < nr && t < nt) y[(size_t)dst[off + t] * hidden + row0 + r] = v;
        }
}

// The shapes (rows a warp R, pairs a tile T, block-loop unroll U): every one gives the same bits.
#define GU_GROUPED(NAME, R, T, U)                                                                    \
    extern "C" __global__ void __launch_bounds__(256)                                                 \
        NAME(const Expert* __restrict__ table, const int* __restrict__ tiles, int tile0, int inter,   \
             int hidden, const float* __restrict__ xg, float* __restrict__ h) {                       \
        moe_gate_up_grouped_impl<R, T, U>(table, tiles, tile0, inter, hidden, xg, h);                \
    }
#define DN_GROUPED(NAME, R, T)                                                                       \
    extern "C" __global__ void __launch_bounds__(256)                                                 \
        NAME(const Expert* __restrict__ table, const int* __restrict__ tiles, int tile0, int hidden,  \
             int inter, const float* __restrict__ h, const int* __restrict__ dst, float* __restrict__ y) { \
        moe_down_grouped_impl<R, T>(table, tiles, tile0, hidden, inter, h, dst, y);                   \
    }
GU_GROUPED(moe_gate_up_grouped_r2t8, 2, 8, 1)
GU_GROUPED(moe_gate_up_grouped_r2t8u2, 2, 8, 2)
GU_GROUPED(moe_gate_up_grouped_r1t8, 1, 8, 1)
GU_GROUPED(moe_gate_up_grouped_r1t8u2, 1, 8, 2)
GU_GROUPED(moe_gate_up_grouped_r1t16, 1, 16, 1)
GU_GROUPED(moe_gate_up_grouped_r2t4, 2, 4, 1)
GU_GROUPED(moe_gate_up_grouped_r4t4, 4, 4, 1)
DN_GROUPED(moe_down_grouped_r4t8, 4, 8)
DN_GROUPED(moe_down_grouped_r2t8, 2, 8)
DN_GROUPED(moe_down_grouped_r1t8, 1, 8)
DN_GROUPED(moe_down_grouped_r2t16, 2, 16)
DN_GROUPED(moe_down_grouped_r4t4, 4, 4)
DN_GROUPED(moe_down_grouped_r2t4, 2, 4)

// ---- Grouped experts, the tile's activations staged in shared memory -------------------------
// The same outputs as the kernels above, bit for bit, with a different split of the work: a
// block of W warps stages its tile's T inputs in shared memory once (instead of every warp
// re-reading them through L1), and each warp computes R rows (gate/up: R rows of gate and R of
// up) for all T tokens of the tile at once, so each x load serves 2R (or R) rows and each decoded
// code T tokens. A lane still does mx_rows' operations in mx_rows' order for every (row, token):
// group g = lane / 4 takes blocks g, g + 8, ..., quarter q = lane % 4 its 8 elements in index
// order, times the block scale, into its own accumulator. The 32 partials of each output are
// then combined by warp_reduce_scatter, whose tree is warp_sum's (shfl_xor 16, 8, 4, 2, 1, own
// value + partner's), so every output has warp_sum's bits; each lane ends holding two outputs
// instead of every lane holding all of them (62 shuffles for 64 outputs instead of 320).
//
// The tile is staged by ops.cu's stage_tile (layout SX: each MX block of 32 floats padded to 36,
// so that the lanes of one LDS.128 (eight groups, four quarters) fall on distinct banks).

// mx_dot8_tail's operations with the loop unrolled (constant indices keep v in registers).
__device__ __forceinline__ float mx_dot8_tail_unrolled(const float v[8], const float* __restrict__ xt, int valid) {
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j)
        if (j < valid) s += v[j] * xt[j];
    return s;
}

// NM matrices' R consecutive rows (codes pk[m], scales sc_[m], row stride nb blocks; nr <= R
// rows exist) against the T staged tokens: acc[(r * T + t) * NM + m], mx_rows' per-lane partials.
// With PF, the next block's codes and scale bytes are loaded before this block's arithmetic
// (the same values and operations, issued earlier). Block scales come from sct
// (mx_scale_table: e8m0 * DEC_SCALE without branches). Loads are never skipped: a row past nr
// reads row nr - 1 and a block past nb block nb - 1, so no load sits behind a branch; those
// accumulators are never written out (warp_reduce_scatter sums each output's own partials only).
template <int NM, int R, int T, bool PF>
__device__ __forceinline__ void mx_rows_staged(const u8* const (&pk)[NM], const u8* const (&sk)[NM], int nr,
                                               int cols, int nb, const float* __restrict__ xs,
                                               const float* __restrict__ sct, float (&acc)[NM * R * T]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const int full = (cols & 3) == 0 ? cols >> 5 : 0;
#pragma unroll
    for (int i = 0; i < NM * R * T; ++i) acc[i] = 0.0f;
    u32 wn[NM][R];
    u8 sn[NM][R];
    auto fetch = [&](int b) {
        const int bb = min(b, nb - 1);
#pragma unroll
        for (int m = 0; m < NM; ++m)
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const size_t rb = (size_t)min(r, nr - 1) * nb + bb;
                wn[m][r] = *reinterpret_cast<const u32*>(pk[m] + rb * 16 + 4 * q);
                sn[m][r] = sk[m][rb];
            }
    };
    if (PF) fetch(g);
    for (int b = g; b < nb; b += 8) {
        u32 w[NM][R];
        float sc[NM][R];
        if (!PF) fetch(b);
#pragma unroll
        for (int m = 0; m < NM; ++m)
#pragma unroll
            for (int r = 0; r < R; ++r) {
                w[m][r] = wn[m][r];
                sc[m][r] = sct[sn[m][r]];
            }
        if (PF) fetch(b + 8);
        float v[NM][R][8];
#pragma unroll
        for (int m = 0; m < NM; ++m)
#pragma unroll
            for (int r = 0; r < R; ++r) Dec<MX_DEC>::run(w[m][r], nullptr, v[m][r]);
        const float* xb = xs + (size_t)b * SX + 8 * q;
        if (b < full) {
#pragma unroll
            for (int t = 0; t < T; ++t) {
                const float4 a = *reinterpret_cast<const float4*>(xb + (size_t)t * nb * SX);
                const float4 c = *reinterpret_cast<const float4*>(xb + (size_t)t * nb * SX + 4);
#pragma unroll
                for (int r = 0; r < R; ++r)
#pragma unroll
                    for (int m = 0; m < NM; ++m) acc[(r * T + t) * NM + m] += mx_dot8(v[m][r], a, c) * sc[m][r];
            }
        } else {
            const int valid = cols - (b * 32 + 8 * q);
            if (valid <= 0) continue;
#pragma unroll
            for (int t = 0; t < T; ++t)
#pragma unroll
                for (int r = 0; r < R; ++r)
#pragma unroll
                    for (int m = 0; m < NM; ++m)
                        acc[(r * T + t) * NM + m] += mx_dot8_tail_unrolled(v[m][r], xb + (size_t)t * nb * SX, valid) * sc[m][r];
        }
    }
}

// The start of a staged grouped kernel: the MX scale table in sct, the block's tile (expert *e,
// first pair *off, *nt pairs; grouped_tile) and those pairs' rows of x ([pairs, cols]) staged
// in xs (stage_tile). Returns nb, the MX blocks of a row.
template <int T>
__device__ __forceinline__ int grouped_staged_prologue(const int* __restrict__ tiles, int tile0,
                                                       const float* __restrict__ x, int cols, float* sct,
                                                       float* __restrict__ xs, int* e, int* off, int* nt) {
    mx_scale_table(sct);
    grouped_tile(tiles, tile0, e, off, nt);
    const int nb = (cols + 31) >> 5;
    stage_tile<T>(x + (size_t)*off * cols, cols, nb, *nt, xs);
    return nb;
}

// h[p, r] = silu(gate_e[r] . xg[p]) * (up_e[r] . xg[p]) (moe_gate_up_grouped's outputs): block
// (blockIdx.x, tile blockIdx.y + tile0) covers rows blockIdx.x * cta_rows .. + cta_rows, its
// warps taking R rows at a time in turn.
template <int R, int T, bool PF>
__device__ __forceinline__ void moe_gate_up_staged_impl(const Expert* __restrict__ table, const int* __restrict__ tiles,
                                                        int tile0, int inter, int hidden, int cta_rows,
                                                        const float* __restrict__ xg, float* __restrict__ h) {
    static_assert(2 * R * T == 64, "two outputs a lane");
    extern __shared__ float xs[];
    __shared__ float sct[256];
    int e, off, nt;
    const int nb = grouped_staged_prologue<T>(tiles, tile0, xg, hidden, sct, xs, &e, &off, &nt);
    const Mat gm = table[e].gate, um = table[e].up;
    const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    const int end = min(inter, (blockIdx.x + 1) * cta_rows);
    for (int row0 = blockIdx.x * cta_rows + (threadIdx.x >> 5) * R; row0 < end; row0 += warps * R) {
        const int nr = min(R, end - row0);
        const u8* const pk[2] = {reinterpret_cast<const u8*>(gm.w) + (size_t)row0 * nb * 16,
                                 reinterpret_cast<const u8*>(um.w) + (size_t)row0 * nb * 16};
        const u8* const sk[2] = {reinterpret_cast<const u8*>(gm.s) + (size_t)row0 * nb,
                                 reinterpret_cast<const u8*>(um.s) + (size_t)row0 * nb};
        float acc[2 * R * T];
        mx_rows_staged<2, R, T, PF>(pk, sk, nr, hidden, nb, xs, sct, acc);
        warp_reduce_scatter<2 * R * T>(acc);
        // Lane l holds gate (acc[0]) and up (acc[1]) of output l = r * T + t.
        const int r = lane / T, t = lane % T;
        if (r < nr && t < nt) h[(size_t)(off + t) * inter + row0 + r] = silu_mul(acc[0], acc[1]);
    }
}

// y[dst[p], r] = down_e[r] . h[p] (moe_down_grouped's outputs), split as above.
template <int R, int T, bool PF>
__device__ __forceinline__ void moe_down_staged_impl(const Expert* __restrict__ table, const int* __restrict__ tiles,
                                                     int tile0, int hidden, int inter, int cta_rows,
                                                     const float* __restrict__ h, const int* __restrict__ dst,
                                                     float* __restrict__ y) {
    static_assert(R * T == 64 && T % 2 == 0, "two outputs a lane, of one row");
    extern __shared__ float xs[];
    __shared__ float sct[256];
    int e, off, nt;
    const int nb = grouped_staged_prologue<T>(tiles, tile0, h, inter, sct, xs, &e, &off, &nt);
    const Mat d = table[e].down;
    const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    const int end = min(hidden, (blockIdx.x + 1) * cta_rows);
    for (int row0 = blockIdx.x * cta_rows + (threadIdx.x >> 5) * R; row0 < end; row0 += warps * R) {
        const int nr = min(R, end - row0);
        const u8* const pk[1] = {reinterpret_cast<const u8*>(d.w) + (size_t)row0 * nb * 16};
        const u8* const sk[1] = {reinterpret_cast<const u8*>(d.s) + (size_t)row0 * nb};
        float acc[R * T];
        mx_rows_staged<1, R, T, PF>(pk, sk, nr, inter, nb, xs, sct, acc);
        warp_reduce_scatter<R * T>(acc);
        // Lane l holds outputs 2l and 2l + 1: row r = 2l / T, tokens t and t + 1.
        const int r = (2 * lane) / T, t = (2 * lane) % T;
        if (r < nr) {
            if (t < nt) y[(size_t)dst[off + t] * hidden + row0 + r] = acc[0];
            if (t + 1 < nt) y[(size_t)dst[off + t + 1] * hidden + row0 + r] = acc[1];
        }
    }
}

#define GU_STAGED(NAME, R, T, MINB, PF)                                                               \
    extern "C" __global__ void __launch_bounds__(128, MINB)                                           \
        NAME(const Expert* __restrict__ table, const int* __restrict__ tiles, int tile0, int inter,    \
             int hidden, int cta_rows, const float* __restrict__ xg, float* __restrict__ h) {          \
        moe_gate_up_staged_impl<R, T, PF>(table, tiles, tile0, inter, hidden, cta_rows, xg, h);       \
    }
#define DN_STAGED(NAME, R, T, MINB, PF)                                                               \
    extern "C" __global__ void __launch_bounds__(128, MINB)                                           \
        NAME(const Expert* __restrict__ table, const int* __restrict__ tiles, int tile0, int hidden,   \
             int inter, int cta_rows, const float* __restrict__ h, const int* __restrict__ dst,        \
             float* __restrict__ y) {                                                                 \
        moe_down_staged_impl<R, T, PF>(table, tiles, tile0, hidden, inter, cta_rows, h, dst, y);      \
    }
// Name: rows a warp R, tokens T, blocks an SM the registers are capped for (b3: 168 registers,
// a few spilled; b2: up to 255), p: the next block's codes loaded ahead.
GU_STAGED(moe_gate_up_staged_r4t8b3, 4, 8, 3, false)
GU_STAGED(moe_gate_up_staged_r4t8b3p, 4, 8, 3, true)
GU_STAGED(moe_gate_up_staged_r4t8b2p, 4, 8, 2, true)
DN_STAGED(moe_down_staged_r8t8b3, 8, 8, 3, false)
DN_STAGED(moe_down_staged_r8t8b3p, 8, 8, 3, true)
DN_STAGED(moe_down_staged_r8t8b2p, 8, 8, 2, true)
