// deltafin CUDA kernels, compiled at run time by NVRTC (no CUDA toolkit at build time).
//
// Numerics (the product's promise, issue #16): f32 activations, f32 accumulation, weights decoded
// exactly to f32, and a fixed reduction order in every kernel: no atomics in reductions, no
// tensor cores, no TF32. A result therefore depends only on the inputs, never on timing, so
// output is bit-identical run to run. It is not the CPU kernels' summation order (which differs
// between the CPU's own SIMD levels), so results agree with the CPU to f32 rounding.
//
// Matrix layouts are the CPU crate's (deltafin-kernels `MatData`): row-major `[rows, cols]`,
// rows = output features.
//   f32:   w[rows * cols]
//   int8:  q[rows * cols] (i8), scales[rows] (f32); W[r, c] = scales[r] * q[r, c]
//   MXFP4: packed[rows * 16 * nb], scales[rows * nb] with nb = ceil(cols / 32); per block of 32
//          elements, 16 bytes with element 2i in the low nibble of byte i (OCP MX v1.0 §5.3.3,
//          Hugging Face layout), one E8M0 scale byte 2^(s-127) (§5.4.1; 0 is 2^-127, 255 NaN).
//
// Reduction order of every matrix kernel (one warp per output row):
//   lane l belongs to group g = l / 4 (8 groups) and quarter q = l % 4;
//   group g takes blocks g, g + 8, g + 16, ... in increasing order; within a block, lane q sums
//   its 8 elements 8q .. 8q+7 in index order (int8/f32: 16 / 4 elements of each 512 / 128-element
//   step, same habit), multiplies that partial by the block's scale (a power of two: exact
//   unless it under- or overflows) and adds it to its own accumulator;
//   the 32 lane accumulators are then summed by the butterfly tree shfl_xor 16, 8, 4, 2, 1.
// The matmul kernels run exactly this sequence for each token, so a token's row of a matmul is
// bit-identical to the matvec of that token.

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned int u32;

__device__ __constant__ float E2M1[16] = {
    0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
    -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// exp and log of an f32, rounded once from double precision: correctly rounded except in
// cases rarer than 1 in 2^28 (CUDA's double exp and log are within 1 ulp of double), where
// expf/logf are within 2 ulp. The CPU path's f32::exp / f32::ln (glibc, within 0.51 ulp) then
// agree with these on almost every input, so SiLU, the router's sigmoid and the softmaxes give
// the CPU's values and the GPU's logits stay closer to the CPU's (bench/NOTES.md, 2026-12-02).
__device__ __forceinline__ float exp_f32(float x) { return (float)exp((double)x); }
__device__ __forceinline__ float log_f32(float x) { return (float)log((double)x); }

// w[i] = exp(w[i] - m) / sum for i in 0..n, m the caller's max of w, the sum from zero in index
// order and every step correctly rounded (no contraction): the CPU's softmax of a short row
// (gqa.cu's top-k-then-softmax router, kda.cu's attention-residual depth mix).
__device__ __forceinline__ void softmax_given_max(float* w, int n, float m) {
    float sum = 0.0f;
    for (int i = 0; i < n; ++i) {
        w[i] = exp_f32(__fsub_rn(w[i], m));
        sum = __fadd_rn(sum, w[i]);
    }
    for (int i = 0; i < n; ++i) w[i] = __fdiv_rn(w[i], sum);
}

__device__ __forceinline__ float e8m0(u8 s) {
    if (s == 255) return __int_as_float(0x7fc00000);
    if (s == 0) return __int_as_float(0x00400000);
    return __int_as_float(((u32)s) << 23);
}

__device__ __forceinline__ float warp_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 16);
    v += __shfl_xor_sync(0xffffffffu, v, 8);
    v += __shfl_xor_sync(0xffffffffu, v, 4);
    v += __shfl_xor_sync(0xffffffffu, v, 2);
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v;
}

// The 32 lanes' partials of V outputs (V = 32 * 2^k) summed by warp_sum's tree (own value +
// partner's at shfl_xor 16, 8, 4, 2, 1; every lane of a pair gets the same sum), scattered:
// afterwards lane l holds outputs V/32 * l .. V/32 * (l + 1) - 1 in a[0 .. V/32].
// The selects are PTX selp on values already in registers: written as `up ? a[i] : a[i + half]`
// the compiler turns them into a load from a selected address, which puts the whole array in
// local memory (ptxas: a 256-byte stack frame for 64 outputs).
__device__ __forceinline__ float selp(bool c, float x, float y) {
    float r;
    asm("{\n\t.reg .pred p;\n\tsetp.ne.u32 p, %3, 0;\n\tselp.f32 %0, %1, %2, p;\n\t}"
        : "=f"(r) : "f"(x), "f"(y), "r"((u32)c));
    return r;
}
// One stage: lanes l and l ^ OFF each keep one half of the first 2 HALF values (the upper lane
// the upper half) and add the partner's copy of it.
template <int HALF, int OFF, int V>
__device__ __forceinline__ void reduce_scatter_stage(float (&a)[V], bool up) {
#pragma unroll
    for (int i = 0; i < HALF; ++i) {
        const float lo = a[i], hi = a[i + HALF];
        a[i] = selp(up, hi, lo) + __shfl_xor_sync(0xffffffffu, selp(up, lo, hi), OFF);
    }
}
template <int V>
__device__ __forceinline__ void warp_reduce_scatter(float (&a)[V]) {
    static_assert(V >= 32 && (V & (V - 1)) == 0, "V = 32 * 2^k");
    const int lane = threadIdx.x & 31;
    reduce_scatter_stage<V / 2, 16>(a, (lane & 16) != 0);
    reduce_scatter_stage<V / 4, 8>(a, (lane & 8) != 0);
    reduce_scatter_stage<V / 8, 4>(a, (lane & 4) != 0);
    reduce_scatter_stage<V / 16, 2>(a, (lane & 2) != 0);
    reduce_scatter_stage<V / 32, 1>(a, (lane & 1) != 0);
}

// E2M1 decoders. Each gives the exact E2M1 value of a code, or that value times a power of two
// that the caller folds back into the block scale (`DEC_SCALE`): products and sums then round
// exactly as with the plain values (scaling by 2^k commutes with f32 rounding in the normal
// range), so every decoder gives the same bits; the tests check it.
//   DEC 0: the __constant__ table (serializes when lanes read different entries: the baseline).
//   DEC 1: a copy of the table in shared memory (16 words in 16 banks: conflict-free).
//   DEC 2: bit construction through f16: code (s e1 e0 m) becomes the half with sign s and bits
//          e1 e0 m at 11..9, i.e. E2M1 x 2^-14 (e = 0 lands on the f16 subnormal 0.5 x 2^-14), two
//          codes per 32-bit word, widened exactly to f32.
template <int DEC> struct Dec;
template <> struct Dec<0> {
    static constexpr float SCALE = 1.0f;
    __device__ __forceinline__ static void run(u32 w, const float*, float v[8]) {
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = E2M1[(w >> (4 * j)) & 15u];
    }
};
template <> struct Dec<1> {
    static constexpr float SCALE = 1.0f;
    __device__ __forceinline__ static void run(u32 w, const float* lut, float v[8]) {
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = lut[(w >> (4 * j)) & 15u];
    }
};
// Codes k (bits 4k..) and k + 4 (bits 4k + 16..) of w as DEC 2 decodes them, into v[k], v[k + 4].
__device__ __forceinline__ void dec_f16_pair(u32 w, int k, float v[8]) {
    const u32 c = w >> (4 * k);
    const u32 h = ((c << 9) & 0x0E000E00u) | ((c << 12) & 0x80008000u);
    float lo, hi;
    // Exact f16 -> f32 widening of both halves (PTX cvt.f32.f16; no header needed).
    asm("{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.f32.f16 %0, l;\n\tcvt.f32.f16 %1, h;\n\t}"
        : "=f"(lo), "=f"(hi) : "r"(h));
    v[k] = lo;
    v[k + 4] = hi;
}
template <> struct Dec<2> {
    static constexpr float SCALE = 16384.0f;  // 2^14
    __device__ __forceinline__ static void run(u32 w, const float*, float v[8]) {
#pragma unroll
        for (int k = 0; k < 4; ++k) dec_f16_pair(w, k, v);
    }
};

// PTX prmt.b32 in its default mode: byte i of the result is byte (s >> 4i) & 7 of the pair
// {a (bytes 0-3), b (bytes 4-7)}, or, when bit 4i + 3 of s is set, that byte's sign bit
// replicated over the byte. Only the low 16 bits of s are read.
__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 s) {
    u32 d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(s));
    return d;
}

//   DEC 3: byte permutes only (no conversion unit, no shared memory): a code's 4 bits are a
//          prmt selector, its sign bit the selector's sign-replicate bit. Table A holds
//          64 + 2|v| for the 8 magnitudes and table B 64 - 2|v|, all below 128: selecting with
//          the code gives A's byte for a positive code and 0 for a negative one, selecting with
//          the sign bit flipped gives the reverse from B, so A | B = 64 + 2v for every code (four
//          codes per pair of permutes). One more permute puts that byte into the low mantissa
//          byte of 2^23, and subtracting 2^23 + 64 leaves 2v exactly (an integer below 2^24):
//          about two integer and one float operation a weight besides the FMA. The factor 2
//          goes back into the block scale (SCALE 1/2). -0 (code 8) decodes to +0, which adds
//          nothing different: every partial sum starts at +0.
// DEC 3's lookup: byte j of p0 (codes 0-3) and of p1 (codes 4-7) is 64 + 2v of code j (j + 4).
__device__ __forceinline__ void dec_prmt_bytes(u32 w, u32* p0, u32* p1) {
    const u32 a_lo = 0x43424140u, a_hi = 0x4C484644u;  // 64 + {0, 1, 2, 3, 4, 6, 8, 12}
    const u32 b_lo = 0x3D3E3F40u, b_hi = 0x34383A3Cu;  // 64 - {0, 1, 2, 3, 4, 6, 8, 12}
    const u32 f = w ^ 0x88888888u;
    *p0 = prmt(a_lo, a_hi, w) | prmt(b_lo, b_hi, f);
    *p1 = prmt(a_lo, a_hi, w >> 16) | prmt(b_lo, b_hi, f >> 16);
}
template <> struct Dec<3> {
    static constexpr float SCALE = 0.5f;
    __device__ __forceinline__ static void run(u32 w, const float*, float v[8]) {
        u32 p0, p1;
        dec_prmt_bytes(w, &p0, &p1);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            v[j] = __int_as_float(prmt(p0, 0x4B000000u, 0x7650u + j)) - 8388672.0f;
            v[j + 4] = __int_as_float(prmt(p1, 0x4B000000u, 0x7650u + j)) - 8388672.0f;
        }
    }
};

//   DEC 4: both pipes at once. Codes 0, 4, 1, 5 as DEC 2 (f16 bits through the conversion
//          unit), codes 2, 3, 6, 7 by byte permutes (integer unit): DEC 3's lookup, with the
//          byte put into the low mantissa byte of 256.0 instead of 2^23, so that subtracting
//          256 + 64 * 2^-15 (exact: both in [256, 512)) leaves 2v * 2^-15 = v * 2^-14, DEC 2's
//          scaling. The conversion unit (16 lanes a clock per SM on sm_90) then carries half
//          the codes, so neither pipe alone bounds the decode.
template <> struct Dec<4> {
    static constexpr float SCALE = 16384.0f;  // 2^14, as DEC 2
    __device__ __forceinline__ static void run(u32 w, const float*, float v[8]) {
        dec_f16_pair(w, 0, v);
        dec_f16_pair(w, 1, v);
        u32 p0, p1;
        dec_prmt_bytes(w, &p0, &p1);
#pragma unroll
        for (int j = 2; j < 4; ++j) {
            v[j] = __int_as_float(prmt(p0, 0x43800000u, 0x7650u + j)) - 256.001953125f;
            v[j + 4] = __int_as_float(prmt(p1, 0x43800000u, 0x7650u + j)) - 256.001953125f;
        }
    }
};

// The decoder of the fused launches and the x-stationary kernels (fused.cu, kda.cu): any gives
// the same bits; f16 bits (2) measured fastest on the H200, byte permutes (3) within 5 % of it
// and slower in the x-stationary kernel (bench/NOTES.md, 2026-12-02).
#define MX_DEC 2

// Fills the block's shared copy of the E2M1 table (DEC 1); every thread must reach this.
__device__ __forceinline__ const float* lut_init(float* lut) {
    if (threadIdx.x < 16) lut[threadIdx.x] = E2M1[threadIdx.x];
    __syncthreads();
    return lut;
}

// One lane's 8 decoded codes of an MX block against its 8 activations, summed in index order
// from +0 (the partial every MXFP4 kernel multiplies by the block scale): from two float4 loads,
// or from `valid` < 8 scalars at a matrix's ragged end. Every MXFP4 dot product goes through
// these two, so the kernels' bits agree by construction.
__device__ __forceinline__ float mx_dot8(const float v[8], float4 a, float4 c) {
    float s = 0.0f;
    s += v[0] * a.x; s += v[1] * a.y; s += v[2] * a.z; s += v[3] * a.w;
    s += v[4] * c.x; s += v[5] * c.y; s += v[6] * c.z; s += v[7] * c.w;
    return s;
}
__device__ __forceinline__ float mx_dot8_tail(const float v[8], const float* __restrict__ xt, int valid) {
    float s = 0.0f;
    for (int j = 0; j < 8 && j < valid; ++j) s += v[j] * xt[j];
    return s;
}

// R consecutive rows of an MXFP4 matrix (row stride nb blocks) against up to T tokens
// (x: [n, cols], token stride cols); `nr` <= R rows exist. Each x load serves R rows and each
// decoded weight T tokens. For every (row, token) the operations and their order are those of
// R = T = 1, so the kernels below agree bit for bit whatever R and T they use. The float4
// loads of x need cols % 4 == 0; otherwise every block takes the scalar path.
template <int DEC, int R, int T>
__device__ __forceinline__ void mx_rows(const u8* __restrict__ packed, const u8* __restrict__ scales,
                                        int nr, int cols, int nb, const float* lut,
                                        const float* __restrict__ x, int nt, float acc[R][T]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const int full = (cols & 3) == 0 ? cols >> 5 : 0;  // blocks on the vector path
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int t = 0; t < T; ++t) acc[r][t] = 0.0f;
#pragma unroll 2
    for (int b = g; b < nb; b += 8) {
        u32 w[R];
        float sc[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            w[r] = r < nr ? *reinterpret_cast<const u32*>(packed + ((size_t)r * nb + b) * 16 + 4 * q) : 0u;
            sc[r] = r < nr ? e8m0(scales[(size_t)r * nb + b]) * Dec<DEC>::SCALE : 0.0f;
        }
        float v[R][8];
#pragma unroll
        for (int r = 0; r < R; ++r) Dec<DEC>::run(w[r], lut, v[r]);
        const int base = b * 32 + 8 * q;
        if (b < full) {
#pragma unroll
            for (int t = 0; t < T; ++t) {
                if (t >= nt) continue;
                const float4 a = *reinterpret_cast<const float4*>(x + (size_t)t * cols + base);
                const float4 c = *reinterpret_cast<const float4*>(x + (size_t)t * cols + base + 4);
#pragma unroll
                for (int r = 0; r < R; ++r) acc[r][t] += mx_dot8(v[r], a, c) * sc[r];
            }
        } else {
            const int valid = cols - base;
            if (valid <= 0) continue;
#pragma unroll
            for (int t = 0; t < T; ++t) {
                if (t >= nt) continue;
                const float* xt = x + (size_t)t * cols + base;
#pragma unroll
                for (int r = 0; r < R; ++r) acc[r][t] += mx_dot8_tail(v[r], xt, valid) * sc[r];
            }
        }
    }
}

// Y[t, r] = sum_c W[r, c] X[t, c] for MXFP4 W: [rows, cols], X: [n, cols], Y: [n, rows]: one
// warp per R rows, blockDim.x = 32 * warps, tokens in tiles of T (blockIdx.y).
template <int DEC, int R, int T>
__device__ __forceinline__ void mxfp4_mm(const u8* __restrict__ packed, const u8* __restrict__ scales,
                                         int rows, int cols, const float* __restrict__ x, int n,
                                         float* __restrict__ y) {
    __shared__ float lut_s[16];
    const float* lut = lut_init(lut_s);
    const int row0 = (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * R;
    if (row0 >= rows) return;
    const int nr = min(R, rows - row0);
    const int t0 = blockIdx.y * T;
    const int nt = min(T, n - t0);
    const int nb = (cols + 31) >> 5;
    float acc[R][T];
    mx_rows<DEC, R, T>(packed + (size_t)row0 * nb * 16, scales + (size_t)row0 * nb, nr, cols, nb, lut,
                       x + (size_t)t0 * cols, nt, acc);
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int t = 0; t < T; ++t) {
            const float s = warp_sum(acc[r][t]);
            if ((threadIdx.x & 31) == 0 && r < nr && t < nt) y[(size_t)(t0 + t) * rows + row0 + r] = s;
        }
}

// The parameters of every MXFP4 product's entry point (the MX_, MVP_, MVL_ and XS_KERNEL
// instances; the host launches them all alike): codes and scale bytes of W [rows, cols], x
// [n, cols], y [n, rows]. The matvec-only kernels (mvp, mvl) take n = 1 and ignore it.
#define MXFP4_PARAMS                                                                          \
    const u8* __restrict__ packed, const u8* __restrict__ scales, int rows, int cols,         \
        const float* __restrict__ x, int n, float* __restrict__ y
#define MX_KERNEL(NAME, DEC, R, T)                                                            \
    extern "C" __global__ void NAME(MXFP4_PARAMS) {                                           \
        mxfp4_mm<DEC, R, T>(packed, scales, rows, cols, x, n, y);                             \
    }
// Matrix-vector (n = 1, T = 1): the decoders at one row a warp, and the f16 decoder at 2 and 4.
MX_KERNEL(mxfp4_mv_const_r1, 0, 1, 1)
MX_KERNEL(mxfp4_mv_lds_r1, 1, 1, 1)
MX_KERNEL(mxfp4_mv_f16_r1, 2, 1, 1)
MX_KERNEL(mxfp4_mv_f16_r2, 2, 2, 1)
MX_KERNEL(mxfp4_mv_f16_r4, 2, 4, 1)
// Expert-major matrix-matrix, tokens in tiles of 8.
MX_KERNEL(mxfp4_mm_f16_r1, 2, 1, 8)
MX_KERNEL(mxfp4_mm_f16_r2, 2, 2, 8)
MX_KERNEL(mxfp4_mm_f16_r4, 2, 4, 8)
// The byte-permute decoder (DEC 3), same forms.
MX_KERNEL(mxfp4_mv_prmt_r1, 3, 1, 1)
MX_KERNEL(mxfp4_mv_prmt_r2, 3, 2, 1)
MX_KERNEL(mxfp4_mv_prmt_r4, 3, 4, 1)
MX_KERNEL(mxfp4_mm_prmt_r1, 3, 1, 8)
MX_KERNEL(mxfp4_mm_prmt_r2, 3, 2, 8)
MX_KERNEL(mxfp4_mm_prmt_r4, 3, 4, 8)

// ---- pipelined MXFP4 matrix-vector --------------------------------------------------------
// The one-warp-a-row matvec keeps only a few 4-byte code loads in flight per warp, too few bytes
// to cover the memory latency. Here each warp streams its R rows through a private ring of
// MVP_S stages in shared memory with cp.async (16 bytes a lane a row a stage: MVP_CH = 32 MX
// blocks = 512 bytes of codes and their 32 scale bytes), so MVP_S - 1 stages are always in
// flight, and computes from shared memory with mx_rows' lane mapping and order: lane (g, q)
// takes blocks g, g + 8, ... of the row, elements 8q .. 8q + 7, adds dot8 * scale to its
// accumulator in increasing block order, and the warp sums by warp_sum. Same bits as every
// other matvec. Warps are persistent: warp w of W takes row groups w, w + W, ... and its ring
// runs on across them. Needs nb % 4 == 0 (4-byte scale copies) and cols % 4 == 0; the caller
// takes the one-warp-a-row kernel otherwise.
#define MVP_WARPS 8
#define MVP_CH 32
#define MVP_S 4

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
    const u32 s = (u32)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, int src_bytes) {
    const u32 s = (u32)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::); }
__device__ __forceinline__ void cp_async_wait_stages() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(MVP_S - 2));
}

template <int DEC, int R>
__device__ __forceinline__ void mxfp4_mvp(const u8* __restrict__ packed, const u8* __restrict__ scales,
                                          int rows, int cols, const float* __restrict__ x,
                                          float* __restrict__ y) {
    constexpr int STAGE = R * (MVP_CH * 16 + MVP_CH);  // bytes of one stage: codes then scales
    extern __shared__ __align__(16) u8 mvp_smem[];
    u8* ring = mvp_smem + (threadIdx.x >> 5) * (MVP_S * STAGE);
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const int nb = cols >> 5;
    const int nch = (nb + MVP_CH - 1) / MVP_CH;
    const int groups = (rows + R - 1) / R;
    const int warp = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int nwarps = gridDim.x * (blockDim.x >> 5);
    // The stage to issue next and the stage to compute next, as (row group, chunk, ring slot):
    // advanced, never divided (a division per stage was ~30 instructions of the loop).
    int irg = warp, ic = 0, is = 0;
    int crg = warp, cc = 0, cs = 0;
    auto issue = [&]() {
        if (irg < groups) {
            u8* st = ring + is * STAGE;
            const int b = ic * MVP_CH + lane;
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const int row = irg * R + r;
                const bool ok = row < rows && b < nb;
                const size_t off = ok ? ((size_t)row * nb + b) * 16 : 0;
                cp_async16(st + r * (MVP_CH * 16) + lane * 16, packed + off, ok ? 16 : 0);
                if (lane < MVP_CH / 4) {
                    const int sb = ic * MVP_CH + 4 * lane;
                    const bool sok = row < rows && sb < nb;
                    const size_t soff = sok ? (size_t)row * nb + sb : 0;
                    cp_async4(st + R * (MVP_CH * 16) + r * MVP_CH + 4 * lane, scales + soff, sok ? 4 : 0);
                }
            }
            if (++ic == nch) {
                ic = 0;
                irg += nwarps;
            }
            if (++is == MVP_S) is = 0;
        }
        cp_async_commit();
    };
#pragma unroll
    for (int s = 0; s < MVP_S - 1; ++s) issue();
    float acc[R];
    // Block bl of the stage (lane's i-th: bl = g + 8 i) for every row.
    auto block = [&](const u8* st, int bl, int b) {
        const float* xb = x + (size_t)b * 32 + 8 * q;
        const float4 a = *reinterpret_cast<const float4*>(xb);
        const float4 d = *reinterpret_cast<const float4*>(xb + 4);
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const u32 w = *reinterpret_cast<const u32*>(st + r * (MVP_CH * 16) + bl * 16 + 4 * q);
            const float sc = e8m0(st[R * (MVP_CH * 16) + r * MVP_CH + bl]) * Dec<DEC>::SCALE;
            float v[8];
            Dec<DEC>::run(w, nullptr, v);
            acc[r] += mx_dot8(v, a, d) * sc;
        }
    };
    while (crg < groups) {
        cp_async_wait_stages();
        __syncwarp();
        issue();  // into the slot every lane finished reading a stage ago
        const u8* st = ring + cs * STAGE;
        if (cc == 0) {
#pragma unroll
            for (int r = 0; r < R; ++r) acc[r] = 0.0f;
        }
        const int b0 = cc * MVP_CH;
        if (b0 + MVP_CH <= nb) {
            // Every block of the stage exists (all stages but a ragged row end): no checks.
#pragma unroll
            for (int i = 0; i < MVP_CH / 8; ++i) block(st, g + 8 * i, b0 + g + 8 * i);
        } else {
#pragma unroll
            for (int i = 0; i < MVP_CH / 8; ++i)
                if (b0 + g + 8 * i < nb) block(st, g + 8 * i, b0 + g + 8 * i);
        }
        if (cc == nch - 1) {
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const float s = warp_sum(acc[r]);
                if (lane == 0 && crg * R + r < rows) y[crg * R + r] = s;
            }
        }
        if (++cc == nch) {
            cc = 0;
            crg += nwarps;
        }
        if (++cs == MVP_S) cs = 0;
    }
    cp_async_wait_all();
}

#define MVP_KERNEL(NAME, DEC, R)                                                              \
    extern "C" __global__ void __launch_bounds__(32 * MVP_WARPS) NAME(MXFP4_PARAMS) {         \
        mxfp4_mvp<DEC, R>(packed, scales, rows, cols, x, y);                                  \
    }
MVP_KERNEL(mxfp4_mvp_f16_r1, 2, 1)
MVP_KERNEL(mxfp4_mvp_f16_r2, 2, 2)
MVP_KERNEL(mxfp4_mvp_prmt_r1, 3, 1)
MVP_KERNEL(mxfp4_mvp_prmt_r2, 3, 2)
MVP_KERNEL(mxfp4_mvp_mix_r1, 4, 1)
MVP_KERNEL(mxfp4_mvp_mix_r2, 4, 2)
MVP_KERNEL(mxfp4_mvp_mix_r4, 4, 4)
// The one-warp-a-row matvec with the mixed decoder, for comparison.
MX_KERNEL(mxfp4_mv_mix_r1, 4, 1, 1)
MX_KERNEL(mxfp4_mv_mix_r2, 4, 2, 1)
MX_KERNEL(mxfp4_mm_mix_r2, 4, 2, 8)

// ---- lean MXFP4 matrix-vector --------------------------------------------------------------
// mx_rows' lane mapping and order (same bits as every other matvec) with the bookkeeping taken
// out of the inner loop, for cols % 32 == 0 (every block whole): the block scales come from a
// shared table of e8m0(s) * DEC_SCALE (one load, no branches), each row's codes through a
// running offset with the U blocks of an iteration at fixed distances (8 blocks = 128 bytes
// apart), the weights loaded past L1 (ld.global.nc.L1::no_allocate: they are read once, and
// L1 keeps x, which every row re-reads), U x R code words in flight per lane, and warps
// persistent over row groups (grid-stride) so the table is filled once per block.
#define MVL_WARPS 8

__device__ __forceinline__ u32 ld_stream_u32(const u32* p) {
    u32 v;
    asm volatile("ld.global.nc.L1::no_allocate.b32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}

// sct[s] = e8m0(s) * DEC_SCALE for every scale byte s (the factor every MXFP4 kernel multiplies a
// lane's block partial by), filled by the whole block: call it before any thread returns.
__device__ __forceinline__ void mx_scale_table(float* sct) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) sct[i] = e8m0((u8)i) * Dec<MX_DEC>::SCALE;
    __syncthreads();
}

template <int R, int U>
__device__ __forceinline__ void mxfp4_mvl(const u8* __restrict__ packed, const u8* __restrict__ scales, int rows,
                                          int cols, const float* __restrict__ x, float* __restrict__ y) {
    __shared__ float sct[256];
    mx_scale_table(sct);
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const int nb = cols >> 5;
    const int stride = gridDim.x * (blockDim.x >> 5) * R;
    for (int row0 = (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * R; row0 < rows; row0 += stride) {
        // Lane (g, q)'s word of block g of each row, advanced by 8 U blocks an iteration.
        const u32* pw[R];
        const u8* ps[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const size_t row = (size_t)min(row0 + r, rows - 1);  // a missing row repeats the last one
            pw[r] = reinterpret_cast<const u32*>(packed + row * nb * 16) + 4 * g + q;
            ps[r] = scales + row * nb + g;
        }
        const float* xp = x + 32 * g + 8 * q;
        float acc[R];
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] = 0.0f;
        // Software pipelined: the next iteration's U x R code words and scale bytes are loaded
        // before this iteration's are used, so two iterations of loads are in flight a lane.
        int b = g;
        bool full = b + 8 * (U - 1) < nb;
        u32 w[U][R], sb[U][R];
        if (full) {
#pragma unroll
            for (int u = 0; u < U; ++u)
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    w[u][r] = ld_stream_u32(pw[r] + 32 * u);
                    sb[u][r] = ps[r][8 * u];
                }
        }
        while (full) {
            const bool next = b + 8 * U + 8 * (U - 1) < nb;
            u32 wn[U][R], sn[U][R];
#pragma unroll
            for (int u = 0; u < U; ++u)
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    wn[u][r] = next ? ld_stream_u32(pw[r] + 32 * (U + u)) : 0u;
                    sn[u][r] = next ? ps[r][8 * (U + u)] : 0u;
                }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const float4 a = *reinterpret_cast<const float4*>(xp + 256 * u);
                const float4 c = *reinterpret_cast<const float4*>(xp + 256 * u + 4);
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    float v[8];
                    Dec<MX_DEC>::run(w[u][r], nullptr, v);
                    acc[r] += mx_dot8(v, a, c) * sct[sb[u][r]];
                }
            }
#pragma unroll
            for (int r = 0; r < R; ++r) {
                pw[r] += 32 * U;
                ps[r] += 8 * U;
            }
            xp += 256 * U;
            b += 8 * U;
#pragma unroll
            for (int u = 0; u < U; ++u)
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    w[u][r] = wn[u][r];
                    sb[u][r] = sn[u][r];
                }
            full = next;
        }
        for (; b < nb; b += 8) {
            const float4 a = *reinterpret_cast<const float4*>(xp);
            const float4 c = *reinterpret_cast<const float4*>(xp + 4);
#pragma unroll
            for (int r = 0; r < R; ++r) {
                float v[8];
                Dec<MX_DEC>::run(ld_stream_u32(pw[r]), nullptr, v);
                acc[r] += mx_dot8(v, a, c) * sct[ps[r][0]];
                pw[r] += 32;
                ps[r] += 8;
            }
            xp += 256;
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const float s = warp_sum(acc[r]);
            if (lane == 0 && row0 + r < rows) y[row0 + r] = s;
        }
    }
}

#define MVL_KERNEL(NAME, R, U)                                                                \
    extern "C" __global__ void __launch_bounds__(32 * MVL_WARPS) NAME(MXFP4_PARAMS) {         \
        mxfp4_mvl<R, U>(packed, scales, rows, cols, x, y);                                    \
    }
// Measured on the H200, [65,536, 7,168] (bench/NOTES.md, session 8): R = 4, U = 4 fastest.
MVL_KERNEL(mxfp4_mvl_r1, 1, 8)
MVL_KERNEL(mxfp4_mvl_r2, 2, 4)
MVL_KERNEL(mxfp4_mvl_r4, 4, 4)

// ---- x-stationary MXFP4 products ------------------------------------------------------------
// A block of 256 threads holds the activations in registers and streams rows through: thread i
// owns MX blocks i, i + 256, ..., i + 256 (NP - 1) of every row (16-byte loads, consecutive
// threads on consecutive blocks), so no x is re-read per row. Reduction order of one output
// (row, token), fixed: thread i sums each owned block's 32 elements in index order, times the
// block scale, over its blocks in increasing order; the 32 lanes of a warp combine by the
// butterfly shfl_xor 16, 8, 4, 2, 1; the 8 warp sums are added in warp order. The matvec and the
// matmul below follow it exactly, so a matmul row equals the matvec of that token bit for bit.
// Needs cols <= 256 * 32 * NP.

#define XS_THREADS 256
#define XS_ROWS 4  // rows per pass of the block (each thread has XS_ROWS 16-byte loads in flight)

// The owned blocks of x for T tokens into registers (zeros past cols: the padding weights are
// zero codes, and 0 * 0 adds +0, which leaves every partial sum unchanged).
template <int NP, int T>
__device__ __forceinline__ void xs_load_x(const float* __restrict__ x, int cols, int nt, float xr[T][NP][32]) {
#pragma unroll
    for (int t = 0; t < T; ++t)
#pragma unroll
        for (int p = 0; p < NP; ++p) {
            const int base = (threadIdx.x + XS_THREADS * p) * 32;
#pragma unroll
            for (int j = 0; j < 32; ++j)
                xr[t][p][j] = (t < nt && base + j < cols) ? x[(size_t)t * cols + base + j] : 0.0f;
        }
}

// One owned block (4 words) against the 32 x values of one token, in index order.
__device__ __forceinline__ float xs_dot32(const uint4 w, const float xv[32]) {
    float v[8];
    float s = 0.0f;
    Dec<MX_DEC>::run(w.x, nullptr, v);
#pragma unroll
    for (int j = 0; j < 8; ++j) s += v[j] * xv[j];
    Dec<MX_DEC>::run(w.y, nullptr, v);
#pragma unroll
    for (int j = 0; j < 8; ++j) s += v[j] * xv[8 + j];
    Dec<MX_DEC>::run(w.z, nullptr, v);
#pragma unroll
    for (int j = 0; j < 8; ++j) s += v[j] * xv[16 + j];
    Dec<MX_DEC>::run(w.w, nullptr, v);
#pragma unroll
    for (int j = 0; j < 8; ++j) s += v[j] * xv[24 + j];
    return s;
}

template <int NP, int T>
__device__ __forceinline__ void mxfp4_xs(const u8* __restrict__ packed, const u8* __restrict__ scales,
                                         int rows, int cols, const float* __restrict__ x, int n,
                                         float* __restrict__ y) {
    __shared__ float part[XS_ROWS][T][XS_THREADS / 32];
    const int nb = (cols + 31) >> 5;
    const int t0 = blockIdx.y * T;
    const int nt = min(T, n - t0);
    float xr[T][NP][32];
    xs_load_x<NP, T>(x + (size_t)t0 * cols, cols, nt, xr);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int r0 = blockIdx.x * XS_ROWS; r0 < rows; r0 += gridDim.x * XS_ROWS) {
        uint4 w[XS_ROWS][NP];
        float sc[XS_ROWS][NP];
#pragma unroll
        for (int r = 0; r < XS_ROWS; ++r)
#pragma unroll
            for (int p = 0; p < NP; ++p) {
                const int b = threadIdx.x + XS_THREADS * p;
                const bool ok = r0 + r < rows && b < nb;
                w[r][p] = ok ? *reinterpret_cast<const uint4*>(packed + ((size_t)(r0 + r) * nb + b) * 16)
                             : make_uint4(0u, 0u, 0u, 0u);
                sc[r][p] = ok ? e8m0(scales[(size_t)(r0 + r) * nb + b]) * Dec<MX_DEC>::SCALE : 0.0f;
            }
#pragma unroll
        for (int r = 0; r < XS_ROWS; ++r)
#pragma unroll
            for (int t = 0; t < T; ++t) {
                float acc = 0.0f;
#pragma unroll
                for (int p = 0; p < NP; ++p) acc += xs_dot32(w[r][p], xr[t][p]) * sc[r][p];
                acc = warp_sum(acc);
                if (lane == 0) part[r][t][warp] = acc;
            }
        __syncthreads();
        if (threadIdx.x < XS_ROWS * T) {
            const int r = threadIdx.x / T, t = threadIdx.x % T;
            float s = 0.0f;
#pragma unroll
            for (int k = 0; k < XS_THREADS / 32; ++k) s += part[r][t][k];
            if (r0 + r < rows && t < nt) y[(size_t)(t0 + t) * rows + r0 + r] = s;
        }
        __syncthreads();
    }
}

#define XS_KERNEL(NAME, NP, T)                                                                \
    extern "C" __global__ void __launch_bounds__(XS_THREADS) NAME(MXFP4_PARAMS) {             \
        mxfp4_xs<NP, T>(packed, scales, rows, cols, x, n, y);                                 \
    }
XS_KERNEL(mxfp4_xs_np1_t1, 1, 1)
XS_KERNEL(mxfp4_xs_np2_t1, 2, 1)
XS_KERNEL(mxfp4_xs_np1_t2, 1, 2)
XS_KERNEL(mxfp4_xs_np2_t2, 2, 2)

// Signed byte j of v (already XORed with 0x80: unsigned = signed + 128) as an exact f32: the
// byte becomes the low mantissa byte of 2^23 (one byte permute), and 2^23 + 128 comes off (one
// add, exact for every integer below 2^24): full-rate instead of the quarter-rate I2F.
__device__ __forceinline__ float i8f(u32 vx, int j) {
    return __int_as_float(__byte_perm(vx, 0x4B000000u, 0x7650u + j)) - 8388736.0f;
}

// R consecutive rows of an int8 matrix (q: [R, cols] row-major, `nr` <= R exist) against up
// to T tokens: steps of 512 columns, lane l takes columns [step + 16 l, +16) and sums them in
// index order into its accumulator (the order of R = T = 1 for every row and token). Vector
// loads need 16-byte aligned rows (cols % 16 == 0) and cols % 4 == 0 for x.
template <int R, int T>
__device__ __forceinline__ void i8_rows(const i8* __restrict__ q, int nr, int cols,
                                        const float* __restrict__ x, int nt, float acc[R][T]) {
    const int lane = threadIdx.x & 31;
    const bool vec = ((((size_t)q) & 15) == 0) && ((cols & 15) == 0);
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int t = 0; t < T; ++t) acc[r][t] = 0.0f;
    for (int c0 = lane * 16; c0 < cols; c0 += 512) {
        if (vec) {
            float f[R][16];
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const uint4 v = r < nr ? *reinterpret_cast<const uint4*>(q + (size_t)r * cols + c0)
                                       : make_uint4(0u, 0u, 0u, 0u);
                const u32 w[4] = {v.x ^ 0x80808080u, v.y ^ 0x80808080u, v.z ^ 0x80808080u, v.w ^ 0x80808080u};
#pragma unroll
                for (int j = 0; j < 16; ++j) f[r][j] = i8f(w[j >> 2], j & 3);
            }
#pragma unroll
            for (int t = 0; t < T; ++t) {
                if (t >= nt) continue;
                const float4* xt = reinterpret_cast<const float4*>(x + (size_t)t * cols + c0);
                const float4 a0 = xt[0], a1 = xt[1], a2 = xt[2], a3 = xt[3];
                const float xs[16] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w,
                                      a2.x, a2.y, a2.z, a2.w, a3.x, a3.y, a3.z, a3.w};
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    float s = 0.0f;
#pragma unroll
                    for (int j = 0; j < 16; ++j) s += f[r][j] * xs[j];
                    acc[r][t] += s;
                }
            }
        } else {
            const int m = min(16, cols - c0);
#pragma unroll
            for (int t = 0; t < T; ++t) {
                if (t >= nt) continue;
                const float* xt = x + (size_t)t * cols + c0;
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    if (r >= nr) continue;
                    float s = 0.0f;
                    for (int j = 0; j < m; ++j) s += (float)q[(size_t)r * cols + c0 + j] * xt[j];
                    acc[r][t] += s;
                }
            }
        }
    }
}

// int8 rows: Y[t, r] = scales[r] * sum_c q[r, c] X[t, c] (the CPU reference's arithmetic: the
// row scale multiplies the finished sum); one warp per R rows, tokens in tiles of T.
template <int R, int T>
__device__ __forceinline__ void int8_mm(const i8* __restrict__ q, const float* __restrict__ scales,
                                        int rows, int cols, const float* __restrict__ x, int n,
                                        float* __restrict__ y) {
    const int row0 = (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * R;
    if (row0 >= rows) return;
    const int nr = min(R, rows - row0);
    const int t0 = blockIdx.y * T;
    const int nt = min(T, n - t0);
    float acc[R][T];
    i8_rows<R, T>(q + (size_t)row0 * cols, nr, cols, x + (size_t)t0 * cols, nt, acc);
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int t = 0; t < T; ++t) {
            const float s = warp_sum(acc[r][t]);
            if ((threadIdx.x & 31) == 0 && r < nr && t < nt)
                y[(size_t)(t0 + t) * rows + row0 + r] = scales[row0 + r] * s;
        }
}

#define I8_KERNEL(NAME, R, T)                                                                        \
    extern "C" __global__ void NAME(const i8* __restrict__ q, const float* __restrict__ scales,     \
                                    int rows, int cols, const float* __restrict__ x, int n,         \
                                    float* __restrict__ y) {                                        \
        int8_mm<R, T>(q, scales, rows, cols, x, n, y);                                              \
    }
I8_KERNEL(int8_mv_r1, 1, 1)
I8_KERNEL(int8_mv_r2, 2, 1)
I8_KERNEL(int8_mv_r4, 4, 1)
I8_KERNEL(int8_mm_r1, 1, 8)
I8_KERNEL(int8_mm_r2, 2, 8)
I8_KERNEL(int8_mm_r4, 4, 8)

// ---- A token tile staged in shared memory (int8_mm_staged below, the staged grouped experts in
// fused.cu) ------------------------------------------------------------------------------------
// Shared layout: token t, MX block b at xs[(t * nb + b) * SX]: 32 floats and 4 of padding, so
// the lanes of one LDS.128 that read 8 consecutive floats each (mx_rows' eight groups, four
// quarters) or 16 each (i8_rows' lanes) fall on distinct banks.
#define SX 36

// Stages rows 0..nt of src ([*, cols], row stride cols) into xs for T tokens: zeros past cols
// and for tokens nt..T (their outputs are computed and dropped).
template <int T>
__device__ __forceinline__ void stage_tile(const float* __restrict__ src, int cols, int nb, int nt,
                                           float* __restrict__ xs) {
    if ((cols & 3) == 0) {
        const int per_tok = nb * 8;  // float4s a token, padded to whole blocks
        for (int i = threadIdx.x; i < T * per_tok; i += blockDim.x) {
            const int t = i / per_tok, c4 = i - t * per_tok, c = 4 * c4;
            float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (t < nt && c < cols) v = *reinterpret_cast<const float4*>(src + (size_t)t * cols + c);
            *reinterpret_cast<float4*>(xs + ((size_t)t * nb + (c >> 5)) * SX + (c & 31)) = v;
        }
    } else {
        const int per_tok = nb * 32;
        for (int i = threadIdx.x; i < T * per_tok; i += blockDim.x) {
            const int t = i / per_tok, c = i - t * per_tok;
            xs[((size_t)t * nb + (c >> 5)) * SX + (c & 31)] = t < nt && c < cols ? src[(size_t)t * cols + c] : 0.0f;
        }
    }
    __syncthreads();
}

// ---- int8 matrix-matrix, the token tile staged in shared memory ------------------------------
// The outputs of int8_mm above, bit for bit, with the data moved differently: a block of 4 warps
// stages its tile of T tokens (all columns) in shared memory once, and each warp computes R rows
// for all T tokens at a time, so one 16-byte load of x from shared memory serves R rows (R / 4
// FMAs a byte instead of int8_mm_r4's 1 a byte from L1) and one decoded weight T tokens. A lane
// still runs i8_rows' vector path for every (row, token): columns c0 + 16 l .. +16 for c0 in
// steps of 512, the 16 products summed in index order from +0 into s, then acc += s. It walks
// each 16 columns in four quarters of 4 (one LDS.128 a token and quarter) and keeps the R * T
// partial sums s between quarters; each s still sees its 16 products in index order, so only the
// interleaving between different (row, token) pairs changes, which no result depends on. The 32
// lane partials of the R * T outputs are then summed by warp_reduce_scatter (warp_sum's tree)
// and the row scale multiplies the sum, as in int8_mm.
//
// Shared layout (SX): token t, column c at xs[(t * nb + c / 32) * SX + c % 32]. Lane l's 16
// columns of a step are half of MX block 16 step + l / 2, so the 8 lanes of one phase of an
// LDS.128 start at banks (4 (l / 2) + 16 (l % 2) + 4 k) mod 32 for quarter k, all distinct.
//
// Registers (ptxas, sm_90): r8t8b2 255 a thread, r4t8b3 168, neither with a stack frame or
// spills. Rows past the matrix (or the block) get zero codes and tokens past n zero inputs;
// their outputs are computed and dropped.

// One quarter (columns 4 K .. 4 K + 3 of the lane's 16) of R rows' codes w against the T staged
// tokens (xq: the lane's first column of token 0; token stride ts floats), into the partial sums
// s[t * R + r] (set from +0 at K = 0). One instance a quarter keeps every index a constant.
template <int K, int R, int T>
__device__ __forceinline__ void i8_quarter(const uint4 (&w)[R], const float* __restrict__ xq, int ts,
                                           float (&s)[R * T]) {
    float f[R][4];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const u32 v = (K == 0 ? w[r].x : K == 1 ? w[r].y : K == 2 ? w[r].z : w[r].w) ^ 0x80808080u;
#pragma unroll
        for (int j = 0; j < 4; ++j) f[r][j] = i8f(v, j);
    }
#pragma unroll
    for (int t = 0; t < T; ++t) {
        const float4 a = *reinterpret_cast<const float4*>(xq + (size_t)t * ts + 4 * K);
#pragma unroll
        for (int r = 0; r < R; ++r) {
            float p = K == 0 ? 0.0f : s[t * R + r];
            p += f[r][0] * a.x;
            p += f[r][1] * a.y;
            p += f[r][2] * a.z;
            p += f[r][3] * a.w;
            s[t * R + r] = p;
        }
    }
}

// Y[t, r] = scales[r] * sum_c q[r, c] X[t, c] (int8_mm's outputs) for cols % 16 == 0: block
// (blockIdx.x, blockIdx.y) covers rows blockIdx.x * cta_rows .. + cta_rows of tokens
// T blockIdx.y .. + T, its warps taking R rows at a time in turn. Each lane walks (row group,
// step) pairs in one loop and loads the next pair's R codes (16 bytes a row) before this pair's
// arithmetic, also across row groups, so a matrix of one step (cols <= 512) still has loads in
// flight.
template <int R, int T>
__device__ __forceinline__ void int8_mm_staged_impl(const i8* __restrict__ q, const float* __restrict__ scales,
                                                    int rows, int cols, int cta_rows, const float* __restrict__ x,
                                                    int n, float* __restrict__ y) {
    static_assert(R * T >= 32 && ((R * T) & (R * T - 1)) == 0, "R * T = 32 * 2^k outputs a warp");
    constexpr int PER_LANE = R * T / 32;
    extern __shared__ float xs[];
    const int nb = (cols + 31) >> 5;
    const int t0 = blockIdx.y * T;
    const int nt = min(T, n - t0);
    stage_tile<T>(x + (size_t)t0 * cols, cols, nb, nt, xs);
    const int lane = threadIdx.x & 31, stride = (blockDim.x >> 5) * R;
    const int end = min(rows, (blockIdx.x + 1) * cta_rows);
    const int steps = (cols + 511) >> 9;
    const int ts = nb * SX;  // token stride in xs
    // Codes of (row group fr, step fk), zeros for rows past `end` and columns past cols.
    uint4 wn[R];
    auto fetch = [&](int fr, int fk) {
        const int c0 = 512 * fk + 16 * lane;
#pragma unroll
        for (int r = 0; r < R; ++r)
            wn[r] = fr + r < end && c0 < cols ? *reinterpret_cast<const uint4*>(q + (size_t)(fr + r) * cols + c0)
                                              : make_uint4(0u, 0u, 0u, 0u);
    };
    int row0 = blockIdx.x * cta_rows + (threadIdx.x >> 5) * R, k = 0;
    int fr = row0, fk = 0;
    fetch(fr, fk);
    float acc[R * T];
#pragma unroll
    for (int i = 0; i < R * T; ++i) acc[i] = 0.0f;
    while (row0 < end) {
        uint4 w[R];
#pragma unroll
        for (int r = 0; r < R; ++r) w[r] = wn[r];
        if (++fk == steps) {
            fk = 0;
            fr += stride;
        }
        fetch(fr, fk);
        const int c0 = 512 * k + 16 * lane;
        if (c0 < cols) {
            const float* xq = xs + (size_t)(c0 >> 5) * SX + (c0 & 31);
            float s[R * T];
            i8_quarter<0, R, T>(w, xq, ts, s);
            i8_quarter<1, R, T>(w, xq, ts, s);
            i8_quarter<2, R, T>(w, xq, ts, s);
            i8_quarter<3, R, T>(w, xq, ts, s);
#pragma unroll
            for (int i = 0; i < R * T; ++i) acc[i] += s[i];
        }
        if (++k == steps) {
            warp_reduce_scatter<R * T>(acc);
            // Lane l holds outputs PER_LANE l .. + PER_LANE: output o is token o / R, row o % R.
#pragma unroll
            for (int i = 0; i < PER_LANE; ++i) {
                const int o = PER_LANE * lane + i, t = o / R, r = o % R;
                if (row0 + r < end && t < nt) y[(size_t)(t0 + t) * rows + row0 + r] = scales[row0 + r] * acc[i];
            }
#pragma unroll
            for (int i = 0; i < R * T; ++i) acc[i] = 0.0f;
            k = 0;
            row0 += stride;
        }
    }
}

#define I8_STAGED(NAME, R, T, MINB)                                                                  \
    extern "C" __global__ void __launch_bounds__(128, MINB)                                         \
        NAME(const i8* __restrict__ q, const float* __restrict__ scales, int rows, int cols,        \
             int cta_rows, const float* __restrict__ x, int n, float* __restrict__ y) {             \
        int8_mm_staged_impl<R, T>(q, scales, rows, cols, cta_rows, x, n, y);                        \
    }
// Name: rows a warp R, tokens T, blocks an SM the registers are capped for.
I8_STAGED(int8_mm_staged_r8t8b2, 8, 8, 2)
I8_STAGED(int8_mm_staged_r4t8b3, 4, 8, 3)

// One f32 row against up to T tokens: lane l takes columns 4 l + 128 k .. +3, k in order.
template <int T>
__device__ __forceinline__ void f32_row(const float* __restrict__ w, int cols, const float* __restrict__ x,
                                        int nt, float acc[T]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int t = 0; t < T; ++t) acc[t] = 0.0f;
    if ((cols & 3) == 0 && (((size_t)w) & 15) == 0 && (((size_t)x) & 15) == 0) {
        // 16-byte loads, CH steps of loads in flight before any is used; the same order.
        constexpr int CH = T == 1 ? 8 : 2;
        for (int c00 = lane * 4; c00 < cols; c00 += 128 * CH) {
            float4 wv[CH];
#pragma unroll
            for (int k = 0; k < CH; ++k) {
                const int c0 = c00 + 128 * k;
                wv[k] = c0 < cols ? *reinterpret_cast<const float4*>(w + c0) : make_float4(0.f, 0.f, 0.f, 0.f);
            }
#pragma unroll
            for (int k = 0; k < CH; ++k) {
                const int c0 = c00 + 128 * k;
                if (c0 >= cols) break;
#pragma unroll
                for (int t = 0; t < T; ++t) {
                    if (t >= nt) continue;
                    const float4 xv = *reinterpret_cast<const float4*>(x + (size_t)t * cols + c0);
                    float s = 0.0f;
                    s += wv[k].x * xv.x;
                    s += wv[k].y * xv.y;
                    s += wv[k].z * xv.z;
                    s += wv[k].w * xv.w;
                    acc[t] += s;
                }
            }
        }
        return;
    }
    for (int c0 = lane * 4; c0 < cols; c0 += 128) {
        const int m = min(4, cols - c0);
#pragma unroll
        for (int t = 0; t < T; ++t) {
            if (t >= nt) continue;
            const float* xt = x + (size_t)t * cols + c0;
            float s = 0.0f;
            for (int j = 0; j < m; ++j) s += w[c0 + j] * xt[j];
            acc[t] += s;
        }
    }
}

extern "C" __global__ void f32_matvec(const float* __restrict__ w, int rows, int cols,
                                      const float* __restrict__ x, float* __restrict__ y) {
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;
    float acc[1];
    f32_row<1>(w + (size_t)row * cols, cols, x, 1, acc);
    const float s = warp_sum(acc[0]);
    if ((threadIdx.x & 31) == 0) y[row] = s;
}

extern "C" __global__ void f32_matmul(const float* __restrict__ w, int rows, int cols,
                                      const float* __restrict__ x, int n, float* __restrict__ y) {
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;
    const int t0 = blockIdx.y * 8;
    const int nt = min(8, n - t0);
    float acc[8];
    f32_row<8>(w + (size_t)row * cols, cols, x + (size_t)t0 * cols, nt, acc);
#pragma unroll
    for (int t = 0; t < 8; ++t) {
        const float s = warp_sum(acc[t]);
        if ((threadIdx.x & 31) == 0 && t < nt) y[(size_t)(t0 + t) * rows + row] = s;
    }
}

// RMSNorm over rows of x: [n, dim] (Zhang & Sennrich 2019; transformers' DeepseekV3RMSNorm):
// y = x * rsqrt(mean(x^2) + eps) * weight. One block of 256 threads per row; thread i sums
// x[i], x[i + 256], ... in order, then a fixed shared-memory tree (128, 64, ..., 1).
// `one_plus` = 1 applies (1 + weight) (Qwen3-Next's zero-centred norm).
// One row by a block of 256 threads; `part` is 256 floats of shared memory. Every kernel that
// normalizes (this one, and the fused launches' pre-norm in fused.cu) runs this code, so they
// agree bit for bit. Ends with the block synchronized (yr written by this thread only).
__device__ __forceinline__ void block_rms_norm(const float* __restrict__ xr, const float* __restrict__ weight,
                                               int dim, float eps, int one_plus, float* __restrict__ yr,
                                               float* part) {
    float s = 0.0f;
    for (int i = threadIdx.x; i < dim; i += 256) s += xr[i] * xr[i];
    part[threadIdx.x] = s;
    __syncthreads();
    for (int w = 128; w > 0; w >>= 1) {
        if (threadIdx.x < w) part[threadIdx.x] += part[threadIdx.x + w];
        __syncthreads();
    }
    const float inv = 1.0f / sqrtf(part[0] / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += 256) {
        const float w = one_plus ? 1.0f + weight[i] : weight[i];
        yr[i] = xr[i] * inv * w;
    }
    __syncthreads();
}

extern "C" __global__ void rms_norm(const float* __restrict__ x, const float* __restrict__ weight,
                                    int dim, float eps, int one_plus, float* __restrict__ y) {
    __shared__ float part[256];
    block_rms_norm(x + (size_t)blockIdx.x * dim, weight, dim, eps, one_plus, y + (size_t)blockIdx.x * dim, part);
}

// SwiGLU on concatenated projections: out[t, i] = silu(gate[t, i]) * up[t, i] with
// silu(v) = v / (1 + exp(-v)) (transformers ACT2FN["silu"]); gate/up: [n, inter].
extern "C" __global__ void swiglu(const float* __restrict__ gate, const float* __restrict__ up,
                                  int len, float* __restrict__ out) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= len) return;
    const float g = gate[i];
    out[i] = g / (1.0f + exp_f32(-g)) * up[i];
}

// y[i] += alpha * x[i] (a multiply, then an add: the CPU `axpy`'s arithmetic).
extern "C" __global__ void axpy(float alpha, const float* __restrict__ x, int len, float* __restrict__ y) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= len) return;
    y[i] = __fadd_rn(y[i], __fmul_rn(alpha, x[i]));
}

// Streaming copy with the same access width as the matrix kernels' weight loads (16 bytes a
// lane): the bandwidth ceiling the MXFP4 matvec is measured against (issue #16 target 4).
extern "C" __global__ void copy16(const int4* __restrict__ src, int4* __restrict__ dst, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        dst[i] = src[i];
}

// ---- attention ------------------------------------------------------------------------------

// RoPE on n_vec vectors (stride `stride`, rotary part at `offset`, width 2 * half) with the
// cos/sin of the position computed on the host exactly as the CPU path computes them
// (deltafin-engine rope.rs: angle = pos * inv_freq[i], times the YaRN attention factor), so the
// rotation is the CPU's arithmetic bit for bit: x[a] = xa c - xb s, x[b] = xb c + xa s, pairs
// (2i, 2i + 1) when interleaved, else (i, i + half).
extern "C" __global__ void rope_apply(float* __restrict__ x, int n_vec, int stride, int offset,
                                      const float* __restrict__ cs, int half, int interleaved) {
    const int k = blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= n_vec * half) return;
    const int v = k / half, i = k % half;
    float* xv = x + (size_t)v * stride + offset;
    const int a = interleaved ? 2 * i : i, b = interleaved ? 2 * i + 1 : i + half;
    const float c = cs[i], s = cs[half + i];
    const float xa = xv[a], xb = xv[b];
    xv[a] = __fsub_rn(__fmul_rn(xa, c), __fmul_rn(xb, s));
    xv[b] = __fadd_rn(__fmul_rn(xb, c), __fmul_rn(xa, s));
}

// kv_b_proj weight W[row, col] (int8 rows with f32 scales, or f32), `cols` = kv_lora_rank.
template <bool I8>
__device__ __forceinline__ float kvb(const void* w, const float* sc, int row, int col, int cols) {
    if (I8) return (float)reinterpret_cast<const i8*>(w)[(size_t)row * cols + col] * sc[row];
    return reinterpret_cast<const float*>(w)[(size_t)row * cols + col];
}

// RoPE of one pair (rope_apply's arithmetic): (xa, xb) -> (xa c - xb s, xb c + xa s).
__device__ __forceinline__ void rope_pair(float xa, float xb, float c, float s, float* ya, float* yb) {
    *ya = __fsub_rn(__fmul_rn(xa, c), __fmul_rn(xb, s));
    *yb = __fadd_rn(__fmul_rn(xb, c), __fmul_rn(xa, s));
}

// MLA decode for one token, weight-absorbed (DeepSeek-V2 §2.1, arXiv:2405.04434; the CPU's
// deepseek_v3.rs `attend_head`), split over the positions (flash-decoding): block (h, s) takes
// head h's positions [64 s, 64 s + 64) of the T = *pos + 1 (device) or T positions, and the
// block of head h that finishes last combines the splits. Blocks with s >= ceil(T / 64) only
// count themselves, so one grid (sized for the KV cache's capacity) serves every position of a
// captured graph.
//   q: [nh, nope + rope] (rope part already rotated, or rotated here with `cs` = [cos[half],
//   sin[half]] when cs is not null: rope_apply's arithmetic), ckv: [T, kvl] normalised latents,
//   kpe: [T, rope] rotated shared keys, W = kv_b_proj [nh * (nope + vd), kvl] (per head W_UK
//   rows then W_UV rows), scratch: nh int counters (zero between launches; rounded up to 4) then
//   [nh, S_cap, kvl + 2] partials, out: [nh, vd]. qabs (optional): q_abs precomputed by
//   mla_qabs_* (same bits).
//   q_abs = W_UK_h^T q_nope (sum over the nope rows in order); s_t = (q_abs . c_t + q_pe . k_t) *
//   scale (warp butterfly sums, a warp per position); per split: m = max s_t, e_t = exp(s_t - m),
//   l = sum e_t (lane l adds e_l, e_{l + 32}, then the butterfly), acc = sum_t e_t c_t in t order
//   (one fused multiply-add a term);
//   combine: M = max m_s, f_s = exp(m_s - M), L = sum_s f_s l_s, ctx = (sum_s f_s acc_s) / L in
//   split order; o_h = W_UV_h ctx (int8: scale * sum, warp butterfly). The result depends on T
//   only, never on S_cap, so a prompt's chunk (mla_prefill_*) gives each token decode's bits.
// Dynamic shared memory: 2 * kvl + rope + 64 floats.
#define MLA_SPLIT 64
#define MLA_FS 256  // splits whose exp(m_s - M) mla_combine holds in shared memory at a time

// q_abs[c] = sum_r q_nope[r] W_UK_h[r, c] (r in order) into qa, threads over c.
template <bool I8>
__device__ __forceinline__ void mla_qabs_into(const float* __restrict__ qh, const void* __restrict__ w,
                                              const float* __restrict__ wsc, int base, int nope, int kvl,
                                              float* qa) {
    for (int c = threadIdx.x; c < kvl; c += 256) {
        float s = 0.0f;
#pragma unroll 16
        for (int r = 0; r < nope; ++r) s += qh[r] * kvb<I8>(w, wsc, base + r, c, kvl);
        qa[c] = s;
    }
}

// Head h's partial over split sp of a query at positions 0..T-1 (positions sp * MLA_SPLIT ..):
// part[sp] = (m, l, acc[kvl]) as described above. qh: the head's query [nope + rope] (RoPE by
// cs when not null), qabs_h: its q_abs (or null: computed here). sh: the dynamic shared memory.
// Ends with a __syncthreads, so the caller may start another head.
template <bool I8>
__device__ __forceinline__ void mla_part(const float* __restrict__ qh, const float* __restrict__ ckv,
                                         const float* __restrict__ kpe, const void* __restrict__ w,
                                         const float* __restrict__ wsc, int nope, int rope, int vd, int kvl, int T,
                                         int sp, int h, float scale, const float* __restrict__ cs, int interleaved,
                                         const float* __restrict__ qabs_h, float* part, float* sh) {
    float* q_abs = sh;
    float* qpe = sh + 2 * kvl;
    float* sc = sh + 2 * kvl + rope;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int base = h * (nope + vd);
    if (cs != nullptr) {
        const int half = rope / 2;
        for (int i = tid; i < half; i += 256) {
            const int a = interleaved ? 2 * i : i, b = interleaved ? 2 * i + 1 : i + half;
            rope_pair(qh[nope + a], qh[nope + b], cs[i], cs[half + i], &qpe[a], &qpe[b]);
        }
    } else {
        for (int i = tid; i < rope; i += 256) qpe[i] = qh[nope + i];
    }
    if (qabs_h != nullptr) {
        for (int c = tid; c < kvl; c += 256) q_abs[c] = qabs_h[c];
    } else {
        mla_qabs_into<I8>(qh, w, wsc, base, nope, kvl, q_abs);
    }
    __syncthreads();
    const int t0 = sp * MLA_SPLIT, n = min(MLA_SPLIT, T - t0);
    for (int u = warp; u < n; u += 8) {
        const int t = t0 + u;
        float a = 0.0f, b = 0.0f;
        for (int c = lane; c < kvl; c += 32) a += q_abs[c] * ckv[(size_t)t * kvl + c];
        for (int c = lane; c < rope; c += 32) b += qpe[c] * kpe[(size_t)t * rope + c];
        a = warp_sum(a);
        b = warp_sum(b);
        if (lane == 0) sc[u] = (a + b) * scale;
    }
    __syncthreads();
    if (warp == 0) {
        float m = __int_as_float(0xff800000u);
        for (int u = lane; u < n; u += 32) m = fmaxf(m, sc[u]);
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
        float l = 0.0f;
        for (int u = lane; u < n; u += 32) {
            const float e = exp_f32(sc[u] - m);
            sc[u] = e;
            l += e;
        }
        l = warp_sum(l);
        if (lane == 0) {
            part[(size_t)sp * (kvl + 2)] = m;
            part[(size_t)sp * (kvl + 2) + 1] = l;
        }
    }
    __syncthreads();
    for (int c = tid; c < kvl; c += 256) {
        float a = 0.0f;
#pragma unroll 8
        for (int u = 0; u < n; ++u) a = __fmaf_rn(sc[u], ckv[(size_t)(t0 + u) * kvl + c], a);
        part[(size_t)sp * (kvl + 2) + 2 + c] = a;
    }
    __syncthreads();
}

// Head h's output from its S partials (written by other blocks: read with __ldcg):
// out_h[vd] = W_UV_h ctx as described above. ctx: kvl floats of shared memory. Ends with a
// __syncthreads.
template <bool I8>
__device__ __forceinline__ void mla_combine(int S, const float* part, const void* __restrict__ w,
                                            const float* __restrict__ wsc, int nope, int vd, int kvl, int h,
                                            float* ctx, float* __restrict__ out_h) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int base = h * (nope + vd);
    // f_s = exp(m_s - M) once a split (not once a (split, column)), MLA_FS splits at a time
    // through shared memory; L and the columns add f_s-weighted terms in split order as before.
    __shared__ float fs[MLA_FS], ls[MLA_FS];
    float mm = __int_as_float(0xff800000u);
    for (int s2 = 0; s2 < S; ++s2) mm = fmaxf(mm, __ldcg(part + (size_t)s2 * (kvl + 2)));
    for (int c0 = 0; c0 < kvl; c0 += 512) {
        float a[2] = {0.0f, 0.0f}, L = 0.0f;
        for (int s0 = 0; s0 < S; s0 += MLA_FS) {
            const int ns = min(MLA_FS, S - s0);
            __syncthreads();  // the previous chunk's f_s are no longer read
            for (int i = tid; i < ns; i += 256) {
                const float* ps = part + (size_t)(s0 + i) * (kvl + 2);
                fs[i] = exp_f32(__ldcg(ps) - mm);
                ls[i] = __ldcg(ps + 1);
            }
            __syncthreads();
            for (int i = 0; i < ns; ++i) {
                const float* ps = part + (size_t)(s0 + i) * (kvl + 2) + 2;
                const float f = fs[i];
                L = __fadd_rn(L, __fmul_rn(f, ls[i]));
#pragma unroll
                for (int z = 0; z < 2; ++z) {
                    const int c = c0 + tid + 256 * z;
                    if (c < kvl) a[z] = __fadd_rn(a[z], __fmul_rn(f, __ldcg(ps + c)));
                }
            }
        }
#pragma unroll
        for (int z = 0; z < 2; ++z) {
            const int c = c0 + tid + 256 * z;
            if (c < kvl) ctx[c] = __fdiv_rn(a[z], L);
        }
    }
    __syncthreads();
    for (int j = warp; j < vd; j += 8) {
        const int row = base + nope + j;
        float a = 0.0f;
        if (I8) {
            const i8* wr = reinterpret_cast<const i8*>(w) + (size_t)row * kvl;
            for (int c = lane; c < kvl; c += 32) a += (float)wr[c] * ctx[c];
            a = warp_sum(a) * wsc[row];
        } else {
            const float* wr = reinterpret_cast<const float*>(w) + (size_t)row * kvl;
            for (int c = lane; c < kvl; c += 32) a += wr[c] * ctx[c];
            a = warp_sum(a);
        }
        if (lane == 0) out_h[j] = a;
    }
    __syncthreads();
}

template <bool I8>
__device__ __forceinline__ void mla_split_impl(const float* __restrict__ q, const float* __restrict__ ckv,
                                               const float* __restrict__ kpe, const void* __restrict__ w,
                                               const float* __restrict__ wsc, int nope, int rope, int vd,
                                               int kvl, int T, float scale, const float* __restrict__ cs,
                                               int interleaved, const int* __restrict__ pos, int s_cap,
                                               const float* __restrict__ qabs, int* counters, float* parts,
                                               float* __restrict__ out) {
    if (pos != nullptr) T = *pos + 1;
    extern __shared__ float sh[];
    __shared__ int is_last;
    const int h = blockIdx.x, sp = blockIdx.y;
    const int qk = nope + rope, S = (T + MLA_SPLIT - 1) / MLA_SPLIT;
    int* counter = counters + h;
    float* part = parts + (size_t)h * s_cap * (kvl + 2);
    if (sp < S)
        mla_part<I8>(q + (size_t)h * qk, ckv, kpe, w, wsc, nope, rope, vd, kvl, T, sp, h, scale, cs, interleaved,
                     qabs != nullptr ? qabs + (size_t)h * kvl : nullptr, part, sh);
    // The block of head h that finishes last combines (last_block's pattern, one counter a head).
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) is_last = atomicAdd(counter, 1) == (int)gridDim.y - 1;
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    mla_combine<I8>(S, part, w, wsc, nope, vd, kvl, h, sh + kvl, out + (size_t)h * vd);
    if (threadIdx.x == 0) *counter = 0;
}

extern "C" __global__ void __launch_bounds__(256)
    mla_decode_i8(const float* q, const float* ckv, const float* kpe, const i8* w, const float* wsc, int nope,
                  int rope, int vd, int kvl, int T, float scale, const float* cs, int interleaved, const int* pos,
                  int s_cap, float* scratch, float* out) {
    mla_split_impl<true>(q, ckv, kpe, w, wsc, nope, rope, vd, kvl, T, scale, cs, interleaved, pos, s_cap, nullptr,
                         reinterpret_cast<int*>(scratch), scratch + ((gridDim.x + 3) & ~3u), out);
}
extern "C" __global__ void __launch_bounds__(256)
    mla_decode_f32(const float* q, const float* ckv, const float* kpe, const float* w, int nope, int rope, int vd,
                   int kvl, int T, float scale, const float* cs, int interleaved, const int* pos, int s_cap,
                   float* scratch, float* out) {
    mla_split_impl<false>(q, ckv, kpe, w, nullptr, nope, rope, vd, kvl, T, scale, cs, interleaved, pos, s_cap,
                          nullptr, reinterpret_cast<int*>(scratch), scratch + ((gridDim.x + 3) & ~3u), out);
}

// ---- Routed experts of one token, fused (decode) ----------------------------------------------
// The chosen MXFP4 experts of one token in three launches instead of five per expert. Each
// output is computed with exactly the operations of the unfused path (mx_rows at R = T = 1 and
// warp_sum as mxfp4_mv_f16_r1; swiglu's expression; axpy's multiply-then-add in router order),
// so the fused and unfused paths agree bit for bit.
#define MOE_MAX_K 16
struct MoePtrs {
    const u8* packed[MOE_MAX_K];
    const u8* scales[MOE_MAX_K];
};
struct MoeWeights {
    float w[MOE_MAX_K];
};

// Row `row` of slot k's gate and up matrices ([inter, hidden] MXFP4) dotted with x, as
// mxfp4_mv_f16_r1 computes each (mx_rows at R = T = 1, then warp_sum): the gate/up kernels of
// every GLU variant (SwiGLU here, SiTU-GLU in kda.cu) share it.
__device__ __forceinline__ void moe_gate_up_row(const MoePtrs& gate, const MoePtrs& up, int k, int row, int hidden,
                                                const float* lut, const float* __restrict__ x, float* g,
                                                float* u) {
    const int nb = (hidden + 31) >> 5;
    float a[1][1], b[1][1];
    mx_rows<MX_DEC, 1, 1>(gate.packed[k] + (size_t)row * nb * 16, gate.scales[k] + (size_t)row * nb, 1, hidden, nb,
                          lut, x, 1, a);
    mx_rows<MX_DEC, 1, 1>(up.packed[k] + (size_t)row * nb * 16, up.scales[k] + (size_t)row * nb, 1, hidden, nb, lut,
                          x, 1, b);
    *g = warp_sum(a[0][0]);
    *u = warp_sum(b[0][0]);
}

// h[k, r] = act(gate_k[r] . x, up_k[r] . x); gate_k, up_k: [inter, hidden]; one warp a row,
// blockIdx.y = expert. The body of every fused gate/up launch; `act` is its GLU.
template <typename Act>
__device__ __forceinline__ void moe_gate_up_glu(MoePtrs gate, MoePtrs up, int inter, int hidden,
                                                const float* __restrict__ x, float* __restrict__ h, Act act) {
    __shared__ float lut_s[16];
    const float* lut = lut_init(lut_s);
    const int k = blockIdx.y;
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= inter) return;
    float g, u;
    moe_gate_up_row(gate, up, k, row, hidden, lut, x, &g, &u);
    if ((threadIdx.x & 31) == 0) h[(size_t)k * inter + row] = act(g, u);
}

// SwiGLU: h[k, r] = silu(gate_k[r] . x) * (up_k[r] . x).
extern "C" __global__ void moe_gate_up_mxfp4(MoePtrs gate, MoePtrs up, int inter, int hidden,
                                             const float* __restrict__ x, float* __restrict__ h) {
    moe_gate_up_glu(gate, up, inter, hidden, x, h, [](float g, float u) { return g / (1.0f + exp_f32(-g)) * u; });
}

// y[k, r] = down_k[r] . h[k]; down_k: [hidden, inter]; one warp a row, blockIdx.y = expert.
extern "C" __global__ void moe_down_mxfp4(MoePtrs down, int hidden, int inter, const float* __restrict__ h,
                                          float* __restrict__ y) {
    __shared__ float lut_s[16];
    const float* lut = lut_init(lut_s);
    const int k = blockIdx.y;
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= hidden) return;
    const int nb = (inter + 31) >> 5;
    float a[1][1];
    mx_rows<MX_DEC, 1, 1>(down.packed[k] + (size_t)row * nb * 16, down.scales[k] + (size_t)row * nb, 1, inter, nb,
                     lut, h + (size_t)k * inter, 1, a);
    const float s = warp_sum(a[0][0]);
    if ((threadIdx.x & 31) == 0) y[(size_t)k * hidden + row] = s;
}

// x[i] += (sum_k w_k y[k, i]) + shared[i]: the weighted sum from 0 in router order, then the
// shared experts' output (when `shared` is not null), then the residual add, each a multiply
// then an add (axpy's arithmetic, alpha 1 for the last two).
extern "C" __global__ void moe_combine(const float* __restrict__ y, MoeWeights w, int k, int hidden,
                                       const float* __restrict__ shared, float* __restrict__ x) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= hidden) return;
    float acc = 0.0f;
    for (int j = 0; j < k; ++j) acc = __fadd_rn(acc, __fmul_rn(w.w[j], y[(size_t)j * hidden + i]));
    if (shared != nullptr) acc = __fadd_rn(acc, __fmul_rn(1.0f, shared[i]));
    x[i] = __fadd_rn(x[i], __fmul_rn(1.0f, acc));
}

// ---- Batched (prefill) forms -------------------------------------------------------------------
// Each computes, for every token of a chunk, exactly what the one-token kernel above computes
// for that token (same device code, same order), so a prompt processed in chunks gives the bits
// of token-at-a-time decoding.

// RoPE on the vectors of n_tok tokens (vec_per_tok vectors a token, stride `stride`, rotary part
// at `offset`), token j with its own cos/sin row cs[j] = [cos[half], sin[half]].
extern "C" __global__ void rope_apply_tokens(float* __restrict__ x, int n_tok, int vec_per_tok, int stride,
                                             int offset, const float* __restrict__ cs, int half,
                                             int interleaved) {
    const int k = blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= n_tok * vec_per_tok * half) return;
    const int v = k / half, i = k % half, tok = v / vec_per_tok;
    float* xv = x + (size_t)v * stride + offset;
    const float* ct = cs + (size_t)tok * 2 * half;
    const int a = interleaved ? 2 * i : i, b = interleaved ? 2 * i + 1 : i + half;
    const float c = ct[i], s = ct[half + i];
    const float xa = xv[a], xb = xv[b];
    xv[a] = __fsub_rn(__fmul_rn(xa, c), __fmul_rn(xb, s));
    xv[b] = __fadd_rn(__fmul_rn(xb, c), __fmul_rn(xa, s));
}

// MLA for tokens j = 0 .. gridDim.z - 1 of a chunk whose first token is at position t0 (its
// latents already appended): token j attends to positions 0 ..= t0 + j, exactly as
// mla_decode_* for that token (grid (nh, s_cap, n)). q: [n, nh, qk]; qabs: [n, nh, kvl] from
// mla_qabs_*; counters: [n, nh] zeroed (left zeroed); parts: [n, nh, s_cap, kvl + 2] partials;
// out: [n, nh, vd].
// Token j = blockIdx.y of a chunk at positions t0 + j, split sp = blockIdx.x, every head in one
// block (head after head: each latent row of the split is read once from L2 for all heads and
// served from L1 to the others), each head with mla_decode's operations, so a chunk gives every
// token its decode bits. The block of token j that finishes last combines all its heads.
// Grid (s_cap, n); counters: one a token (zero between launches).
template <bool I8>
__device__ __forceinline__ void mla_prefill_impl(const float* q, const float* ckv, const float* kpe, const void* w,
                                                 const float* wsc, int nh, int nope, int rope, int vd, int kvl,
                                                 int t0, int s_cap, float scale, const float* qabs, int* counters,
                                                 float* parts, float* out) {
    extern __shared__ float sh[];
    __shared__ int is_last;
    const int sp = blockIdx.x, j = blockIdx.y, qk = nope + rope;
    const int T = t0 + j + 1, S = (T + MLA_SPLIT - 1) / MLA_SPLIT;
    float* tparts = parts + (size_t)j * nh * s_cap * (kvl + 2);
    if (sp < S) {
        for (int h = 0; h < nh; ++h)
            mla_part<I8>(q + ((size_t)j * nh + h) * qk, ckv, kpe, w, wsc, nope, rope, vd, kvl, T, sp, h, scale,
                         nullptr, 0, qabs + ((size_t)j * nh + h) * kvl, tparts + (size_t)h * s_cap * (kvl + 2), sh);
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) is_last = atomicAdd(counters + j, 1) == (int)gridDim.x - 1;
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    for (int h = 0; h < nh; ++h)
        mla_combine<I8>(S, tparts + (size_t)h * s_cap * (kvl + 2), w, wsc, nope, vd, kvl, h, sh + kvl,
                        out + ((size_t)j * nh + h) * vd);
    if (threadIdx.x == 0) counters[j] = 0;
}
extern "C" __global__ void __launch_bounds__(256)
    mla_prefill_i8(const float* q, const float* ckv, const float* kpe, const i8* w, const float* wsc, int nh,
                   int nope, int rope, int vd, int kvl, int t0, int s_cap, float scale, const float* qabs,
                   int* counters, float* parts, float* out) {
    mla_prefill_impl<true>(q, ckv, kpe, w, wsc, nh, nope, rope, vd, kvl, t0, s_cap, scale, qabs, counters, parts,
                           out);
}
extern "C" __global__ void __launch_bounds__(256)
    mla_prefill_f32(const float* q, const float* ckv, const float* kpe, const float* w, int nh, int nope, int rope,
                    int vd, int kvl, int t0, int s_cap, float scale, const float* qabs, int* counters, float* parts,
                    float* out) {
    mla_prefill_impl<false>(q, ckv, kpe, w, nullptr, nh, nope, rope, vd, kvl, t0, s_cap, scale, qabs, counters,
                            parts, out);
}

// q_abs of every (token, head) of a chunk for mla_prefill_* (mla_qabs_into's bits): one block
// a (head, token), grid (nh, n). q: [n, nh, qk], qabs: [n, nh, kvl].
template <bool I8>
__device__ __forceinline__ void mla_qabs_impl(const float* q, const void* w, const float* wsc, int nope, int rope,
                                              int vd, int kvl, float* qabs) {
    const int h = blockIdx.x, j = blockIdx.y, nh = gridDim.x;
    mla_qabs_into<I8>(q + ((size_t)j * nh + h) * (nope + rope), w, wsc, h * (nope + vd), nope, kvl,
                      qabs + ((size_t)j * nh + h) * kvl);
}
extern "C" __global__ void __launch_bounds__(256)
    mla_qabs_i8(const float* q, const i8* w, const float* wsc, int nope, int rope, int vd, int kvl, float* qabs) {
    mla_qabs_impl<true>(q, w, wsc, nope, rope, vd, kvl, qabs);
}
extern "C" __global__ void __launch_bounds__(256)
    mla_qabs_f32(const float* q, const float* w, int nope, int rope, int vd, int kvl, float* qabs) {
    mla_qabs_impl<false>(q, w, nullptr, nope, rope, vd, kvl, qabs);
}

// ---- MLA prefill in the decompressed (multi-head) form -------------------------------------
// DeepSeek-V2 §2.1 (arXiv:2405.04434, eq. 12-19), the form the CPU's `mla_decompressed` and
// transformers' DeepseekV3Attention use for a prompt: keys [k_nope_h(t), k_pe(t)] and values
// v_h(t) from kv = kv_b_proj c_t (decompressed for every position beforehand), then plain causal
// attention per head; 160 multiply-adds a (query, key) pair at the `bench` shape against 544 in
// the absorbed form. Block (query tile, head), 128 threads; the query tiles with the most keys
// are launched first. Thread (rg, kc) = (tid / 8, tid % 8) owns rows 2 rg, 2 rg + 1 of the tile
// and, in each key tile of MHA_KT, keys 4 kc .. 4 kc + 3 (scores) and value columns
// 4 kc + 32 j .. + 3 (the weighted sum). Order, fixed (no atomics), for a query at position p:
//   s_t = (sum over d ascending of q[d] k_t[d], one FMA chain) * scale, for t <= p; -inf after;
//   per key tile (tiles of MHA_KT from key 0): m' = max(m, the tile's max: lanes' 4 keys, then
//   shfl_xor 1, 2, 4), a = exp(m - m'), e_t = exp(s_t - m'), l = l a + (e of the lane's 4 keys
//   in order, then shfl_xor 1, 2, 4), o = o a, then o += e_t v_t for t ascending (FMA);
//   out = o / l.
// A query's bits depend on its position and the inputs only (a fully masked tile leaves m, l
// and o unchanged), so a prompt gives the same bits however it is chunked. Equal to the CPU's
// decompressed form and to the absorbed form within f32 rounding, not bit for bit.
// q: [n, nh, dk] (rope applied), kv: [t0 + n, nh * (nope + vd)] (per head k_nope then v), kpe:
// [t0 + n, rope] (rotated), out: [n, nh, vd]. Needs vd <= 32 * VDJ. Dynamic shared memory: see
// mha_smem_floats in batch.rs.
#define MHA_QT 32
#define MHA_KT 32
#define MHA_KTP 36  // row stride of the transposed key tile and of the probabilities (16-byte rows)

template <int VDJ>
__device__ __forceinline__ void mla_mha_impl(const float* __restrict__ q, const float* __restrict__ kv,
                                             const float* __restrict__ kpe, int nh, int nope, int rope, int vd,
                                             int t0, int n, float scale, float* __restrict__ out) {
    extern __shared__ __align__(16) float mha_smem[];
    const int dk = nope + rope, qs = dk + 1, vdp = (vd + 3) & ~3;
    float* Qs = mha_smem;                               // [MHA_QT][dk + 1]
    float* Ks = Qs + ((MHA_QT * qs + 3) & ~3);          // [dk][MHA_KTP], key-major columns
    float* Vs = Ks + dk * MHA_KTP;                      // [MHA_KT][vdp]
    float* Ps = Vs + MHA_KT * vdp;                      // [MHA_QT][MHA_KTP]
    const int h = blockIdx.y;
    const int i0 = (gridDim.x - 1 - blockIdx.x) * MHA_QT;
    const int nq = min(MHA_QT, n - i0);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int rg = tid >> 3, kc = tid & 7;
    const size_t kvw = (size_t)nh * (nope + vd);
    const float* kvh = kv + (size_t)h * (nope + vd);
    for (int r = warp; r < MHA_QT; r += 4)
        for (int d = lane; d < dk; d += 32) Qs[r * qs + d] = r < nq ? q[((size_t)(i0 + r) * nh + h) * dk + d] : 0.0f;
    const int pos0 = t0 + i0 + 2 * rg;  // position of the thread's first row (rows past nq: discarded)
    const int kend = t0 + i0 + nq;      // keys 0 .. kend - 1
    const float ninf = __int_as_float(0xff800000);
    float m[2] = {ninf, ninf}, l[2] = {0.0f, 0.0f};
    float o[2][VDJ][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < VDJ; ++j) o[i][j][0] = o[i][j][1] = o[i][j][2] = o[i][j][3] = 0.0f;
    for (int k0 = 0; k0 < kend; k0 += MHA_KT) {
        __syncthreads();  // the previous tile's readers are done
        for (int kk = warp; kk < MHA_KT; kk += 4) {
            const int t = k0 + kk;
            const bool ok = t < kend;
            for (int d = lane; d < dk; d += 32)
                Ks[d * MHA_KTP + kk] = ok ? (d < nope ? kvh[t * kvw + d] : kpe[(size_t)t * rope + d - nope]) : 0.0f;
            for (int c = lane; c < vdp; c += 32) Vs[kk * vdp + c] = ok && c < vd ? kvh[t * kvw + nope + c] : 0.0f;
        }
        __syncthreads();
        float s[2][4];
#pragma unroll
        for (int i = 0; i < 2; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
        const float* qa = Qs + (2 * rg) * qs;
        const float* qb = qa + qs;
#pragma unroll 4
        for (int d = 0; d < dk; ++d) {
            const float a = qa[d], b = qb[d];
            const float4 k = *reinterpret_cast<const float4*>(Ks + d * MHA_KTP + 4 * kc);
            s[0][0] = fmaf(a, k.x, s[0][0]);
            s[0][1] = fmaf(a, k.y, s[0][1]);
            s[0][2] = fmaf(a, k.z, s[0][2]);
            s[0][3] = fmaf(a, k.w, s[0][3]);
            s[1][0] = fmaf(b, k.x, s[1][0]);
            s[1][1] = fmaf(b, k.y, s[1][1]);
            s[1][2] = fmaf(b, k.z, s[1][2]);
            s[1][3] = fmaf(b, k.w, s[1][3]);
        }
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            float mx = ninf;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                s[i][j] = k0 + 4 * kc + j <= pos0 + i ? s[i][j] * scale : ninf;
                mx = fmaxf(mx, s[i][j]);
            }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
            const float mn = fmaxf(m[i], mx);
            const float a = exp_f32(m[i] - mn);  // m = mn: 1; the first tile: exp(-inf) = 0
            float e[4], sum = 0.0f;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                e[j] = exp_f32(s[i][j] - mn);
                sum += e[j];
            }
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            sum += __shfl_xor_sync(0xffffffffu, sum, 4);
            l[i] = fmaf(l[i], a, sum);
            m[i] = mn;
            *reinterpret_cast<float4*>(Ps + (2 * rg + i) * MHA_KTP + 4 * kc) = make_float4(e[0], e[1], e[2], e[3]);
#pragma unroll
            for (int j = 0; j < VDJ; ++j) {
                o[i][j][0] *= a;
                o[i][j][1] *= a;
                o[i][j][2] *= a;
                o[i][j][3] *= a;
            }
        }
        __syncthreads();
        const float* pa = Ps + (2 * rg) * MHA_KTP;
        const float* pb = pa + MHA_KTP;
#pragma unroll 4
        for (int k = 0; k < MHA_KT; ++k) {
            const float ea = pa[k], eb = pb[k];
#pragma unroll
            for (int j = 0; j < VDJ; ++j) {
                const int c = 4 * kc + 32 * j;
                if (c < vdp) {
                    const float4 v = *reinterpret_cast<const float4*>(Vs + k * vdp + c);
                    o[0][j][0] = fmaf(ea, v.x, o[0][j][0]);
                    o[0][j][1] = fmaf(ea, v.y, o[0][j][1]);
                    o[0][j][2] = fmaf(ea, v.z, o[0][j][2]);
                    o[0][j][3] = fmaf(ea, v.w, o[0][j][3]);
                    o[1][j][0] = fmaf(eb, v.x, o[1][j][0]);
                    o[1][j][1] = fmaf(eb, v.y, o[1][j][1]);
                    o[1][j][2] = fmaf(eb, v.z, o[1][j][2]);
                    o[1][j][3] = fmaf(eb, v.w, o[1][j][3]);
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int r = 2 * rg + i;
        if (r >= nq) continue;
        float* dst = out + ((size_t)(i0 + r) * nh + h) * vd;
#pragma unroll
        for (int j = 0; j < VDJ; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int c = 4 * kc + 32 * j + e;
                if (c < vd) dst[c] = o[i][j][e] / l[i];
            }
    }
}

#define MLA_MHA_KERNEL(NAME, VDJ)                                                                   \
    extern "C" __global__ void __launch_bounds__(128)                                                \
        NAME(const float* __restrict__ q, const float* __restrict__ kv, const float* __restrict__ kpe, \
             int nh, int nope, int rope, int vd, int t0, int n, float scale, float* __restrict__ out) { \
        mla_mha_impl<VDJ>(q, kv, kpe, nh, nope, rope, vd, t0, n, scale, out);                       \
    }
MLA_MHA_KERNEL(mla_mha_prefill_v64, 2)
MLA_MHA_KERNEL(mla_mha_prefill_v128, 4)

// dst[i, :] = src[idx[off + i], :] for i < m (rows of width dim).
extern "C" __global__ void gather_rows(const float* __restrict__ src, const int* __restrict__ idx, int off, int m,
                                       int dim, float* __restrict__ dst) {
    const size_t k = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (k >= (size_t)m * dim) return;
    const int i = (int)(k / dim), c = (int)(k % dim);
    dst[k] = src[(size_t)idx[off + i] * dim + c];
}

// dst[idx[off + i], :] = src[i, :] for i < m (rows of width dim; every destination row distinct).
extern "C" __global__ void scatter_rows(const float* __restrict__ src, const int* __restrict__ idx, int off, int m,
                                        int dim, float* __restrict__ dst) {
    const size_t k = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (k >= (size_t)m * dim) return;
    const int i = (int)(k / dim), c = (int)(k % dim);
    dst[(size_t)idx[off + i] * dim + c] = src[k];
}

// moe_combine for n tokens: x[t, i] += (sum_j w[t, j] y[t, j, i]) + shared[t, i], each token with
// moe_combine's arithmetic. y: [n, k, hidden], w: [n, k], shared: [n, hidden] or null.
extern "C" __global__ void moe_combine_tokens(const float* __restrict__ y, const float* __restrict__ w, int k,
                                              int hidden, int n, const float* __restrict__ shared,
                                              float* __restrict__ x) {
    const size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (e >= (size_t)n * hidden) return;
    const int t = (int)(e / hidden), i = (int)(e % hidden);
    float acc = 0.0f;
    for (int j = 0; j < k; ++j)
        acc = __fadd_rn(acc, __fmul_rn(w[(size_t)t * k + j], y[((size_t)t * k + j) * hidden + i]));
    if (shared != nullptr) acc = __fadd_rn(acc, __fmul_rn(1.0f, shared[e]));
    x[e] = __fadd_rn(x[e], __fmul_rn(1.0f, acc));
}

// ---- MLA prefill, tiled: several tokens and every head in one block --------------------------
// The partials and outputs of mla_prefill_* (so each token still gets its decode bits), with the
// work split for reuse: block (split sp, token group jg) takes tokens jg * qt .. + qt of the chunk
// and all their heads, "query-heads" idx = jj * nh + h (jj the token in the group).
//   Scores: a warp holds MLA_QH query-heads' q_abs and rope queries in registers (lane l: the
//   columns c = l, l + 32, ..., the lanes' order in mla_part) and streams the split's latent rows
//   through, four positions at a time; each (query-head, position) lane partial is mla_part's
//   (a += q_abs[c] ckv[t, c] over the lane's columns in order, b likewise for the rope part), and
//   the 32 partials are summed by warp_reduce_scatter (warp_sum's tree), then (a + b) * scale.
//   Softmax: a warp a query-head, mla_part's max, exp and sum (lane l adds e_l then e_{l+32}).
//   Values: thread i owns columns i and i + 256 for 32 query-heads at a time and adds
//   e_u * ckv[t_u, c] for u in order (mla_part's fused multiply-adds), skipping the positions
//   a token does not see (only at the end of its split).
// mla_prefill_combine_* then combines every (token, head) (mla_combine), one block each. The
// partials do not depend on kv_b_proj, so this kernel has one form (two sizes: KV = 16 latent
// columns a lane, RP = 2 rope columns, NC = 2 value columns a thread for kvl <= 512, rope <= 64;
// 8 / 1 / 1 for kvl <= 256, rope <= 32). At most 128 heads (the host uses mla_prefill_*
// otherwise). Dynamic shared memory: MLA_SPLIT * nqp + 32 floats, nqp = qt * nh rounded up to 4.
#define MLA_QH 4

template <int KV, int RP, int NC>
__device__ __forceinline__ void mla_prefill_tiled_impl(const float* __restrict__ q, const float* __restrict__ ckv,
                                                       const float* __restrict__ kpe, int nh, int nope, int rope,
                                                       int kvl, int t0, int n, int qt, int s_cap,
                                                       float scale, const float* __restrict__ qabs, float* parts) {
    extern __shared__ float sh[];
    const int sp = blockIdx.x, jg = blockIdx.y;
    const int j0 = jg * qt, nj = min(qt, n - j0), nqh = nj * nh, nqp = (nqh + 3) & ~3;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int ts = sp * MLA_SPLIT, qk = nope + rope;
    const int nmax = min(MLA_SPLIT, t0 + j0 + nj - ts);  // positions the group's last token sees
    const int kvn = (kvl - lane + 31) >> 5, rpn = (rope - lane + 31) >> 5;  // this lane's columns
    float* es = sh;  // [MLA_SPLIT, nqp]: scores, then their exps
    if (nmax > 0) {
        for (int g0 = warp * MLA_QH; g0 < nqh; g0 += 8 * MLA_QH) {
            float qa[MLA_QH][KV], qp[MLA_QH][RP];
#pragma unroll
            for (int i = 0; i < MLA_QH; ++i) {
                const int idx = g0 + i;
                const int jj = idx / nh, h = idx - jj * nh;
                const size_t row = (size_t)(j0 + jj) * nh + h;
#pragma unroll
                for (int k = 0; k < KV; ++k) qa[i][k] = idx < nqh && k < kvn ? qabs[row * kvl + lane + 32 * k] : 0.0f;
#pragma unroll
                for (int k = 0; k < RP; ++k) qp[i][k] = idx < nqh && k < rpn ? q[row * qk + nope + lane + 32 * k] : 0.0f;
            }
            for (int u0 = 0; u0 < nmax; u0 += 4) {
                float r[32];  // r[uu * MLA_QH + i]: a of (u0 + uu, g0 + i); r[16 + ...]: its b
#pragma unroll
                for (int uu = 0; uu < 4; ++uu) {
                    const int t = ts + min(u0 + uu, nmax - 1);
                    float kv[KV], kp[RP];
#pragma unroll
                    for (int k = 0; k < KV; ++k) kv[k] = k < kvn ? ckv[(size_t)t * kvl + lane + 32 * k] : 0.0f;
#pragma unroll
                    for (int k = 0; k < RP; ++k) kp[k] = k < rpn ? kpe[(size_t)t * rope + lane + 32 * k] : 0.0f;
#pragma unroll
                    for (int i = 0; i < MLA_QH; ++i) {
                        float a = 0.0f, b = 0.0f;
#pragma unroll
                        for (int k = 0; k < KV; ++k)
                            if (k < kvn) a += qa[i][k] * kv[k];
#pragma unroll
                        for (int k = 0; k < RP; ++k)
                            if (k < rpn) b += qp[i][k] * kp[k];
                        r[uu * MLA_QH + i] = a;
                        r[16 + uu * MLA_QH + i] = b;
                    }
                }
                warp_reduce_scatter<32>(r);
                const float b = __shfl_down_sync(0xffffffffu, r[0], 16);
                if (lane < 16) {
                    const int u = u0 + lane / MLA_QH, idx = g0 + lane % MLA_QH;
                    if (u < nmax && idx < nqh) es[u * nqp + idx] = (r[0] + b) * scale;
                }
            }
        }
        __syncthreads();
        for (int idx = warp; idx < nqh; idx += 8) {
            const int jj = idx / nh, h = idx - jj * nh;
            const int nu = min(MLA_SPLIT, t0 + j0 + jj + 1 - ts);
            if (nu <= 0) continue;
            float m = __int_as_float(0xff800000u);
            for (int u = lane; u < nu; u += 32) m = fmaxf(m, es[u * nqp + idx]);
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
            float l = 0.0f;
            for (int u = lane; u < nu; u += 32) {
                const float e = exp_f32(es[u * nqp + idx] - m);
                es[u * nqp + idx] = e;
                l += e;
            }
            l = warp_sum(l);
            if (lane == 0) {
                float* part = parts + (((size_t)(j0 + jj) * nh + h) * s_cap + sp) * (kvl + 2);
                part[0] = m;
                part[1] = l;
            }
        }
        __syncthreads();
        // Token jj sees position u of the split when jj >= u + ts - t0 - j0: every query-head of
        // the group sees u < u_all (no test in that loop), the rest only from query-head thr on.
        const int u_all = max(0, min(nmax, t0 + j0 - ts + 1));
        for (int i0 = 0; i0 < nqh; i0 += 32) {
            float acc[32][NC];
#pragma unroll
            for (int i = 0; i < 32; ++i)
#pragma unroll
                for (int z = 0; z < NC; ++z) acc[i][z] = 0.0f;
            // UB positions' latent columns are loaded before any is used (one L2 latency a
            // group instead of one a position).
            constexpr int UB = 8 / NC;
            for (int u0 = 0; u0 < nmax; u0 += UB) {
                float kc[UB][NC];
#pragma unroll
                for (int uu = 0; uu < UB; ++uu)
#pragma unroll
                    for (int z = 0; z < NC; ++z)
                        kc[uu][z] = u0 + uu < nmax && tid + 256 * z < kvl
                                        ? ckv[(size_t)(ts + u0 + uu) * kvl + tid + 256 * z]
                                        : 0.0f;
#pragma unroll
                for (int uu = 0; uu < UB; ++uu) {
                    const int u = u0 + uu;
                    if (u >= nmax) break;
                    const float* eu = es + u * nqp + i0;
                    if (u < u_all) {
#pragma unroll
                        for (int i4 = 0; i4 < 8; ++i4) {
                            const float4 e4 = *reinterpret_cast<const float4*>(eu + 4 * i4);
                            const float ev[4] = {e4.x, e4.y, e4.z, e4.w};
#pragma unroll
                            for (int z = 0; z < 4; ++z)
#pragma unroll
                                for (int y = 0; y < NC; ++y)
                                    acc[4 * i4 + z][y] = __fmaf_rn(ev[z], kc[uu][y], acc[4 * i4 + z][y]);
                        }
                    } else {
                        const int thr = (u + ts - t0 - j0) * nh;  // first query-head that sees u
#pragma unroll
                        for (int i4 = 0; i4 < 8; ++i4) {
                            const float4 e4 = *reinterpret_cast<const float4*>(eu + 4 * i4);
                            const float ev[4] = {e4.x, e4.y, e4.z, e4.w};
#pragma unroll
                            for (int z = 0; z < 4; ++z) {
                                const int i = 4 * i4 + z;
                                if (i0 + i >= thr) {
#pragma unroll
                                    for (int y = 0; y < NC; ++y)
                                        acc[i][y] = __fmaf_rn(ev[z], kc[uu][y], acc[i][y]);
                                }
                            }
                        }
                    }
                }
            }
#pragma unroll
            for (int i = 0; i < 32; ++i) {
                const int idx = i0 + i;
                if (idx >= nqh) break;
                const int jj = idx / nh, h = idx - jj * nh;
                if (t0 + j0 + jj + 1 - ts <= 0) continue;
                float* part = parts + (((size_t)(j0 + jj) * nh + h) * s_cap + sp) * (kvl + 2);
#pragma unroll
                for (int y = 0; y < NC; ++y)
                    if (tid + 256 * y < kvl) part[2 + tid + 256 * y] = acc[i][y];
            }
        }
    }
}

// The combine of mla_prefill_tiled: one block a (head h = blockIdx.x, token j = blockIdx.y),
// mla_combine over the token's S = ceil((t0 + j + 1) / 64) partials (its own launch, so the
// (token, head) combines run in parallel rather than one after another in a last block).
template <bool I8>
__device__ __forceinline__ void mla_prefill_combine_impl(const float* parts, const void* __restrict__ w,
                                                         const float* __restrict__ wsc, int nope, int vd, int kvl,
                                                         int t0, int s_cap, float* __restrict__ out) {
    extern __shared__ float sh[];
    const int h = blockIdx.x, j = blockIdx.y, nh = gridDim.x;
    const int S = (t0 + j + 1 + MLA_SPLIT - 1) / MLA_SPLIT;
    mla_combine<I8>(S, parts + ((size_t)j * nh + h) * s_cap * (kvl + 2), w, wsc, nope, vd, kvl, h, sh,
                    out + ((size_t)j * nh + h) * vd);
}
extern "C" __global__ void __launch_bounds__(256)
    mla_prefill_combine_i8(const float* parts, const i8* w, const float* wsc, int nope, int vd, int kvl, int t0,
                           int s_cap, float* out) {
    mla_prefill_combine_impl<true>(parts, w, wsc, nope, vd, kvl, t0, s_cap, out);
}
extern "C" __global__ void __launch_bounds__(256)
    mla_prefill_combine_f32(const float* parts, const float* w, int nope, int vd, int kvl, int t0, int s_cap,
                            float* out) {
    mla_prefill_combine_impl<false>(parts, w, nullptr, nope, vd, kvl, t0, s_cap, out);
}
extern "C" __global__ void __launch_bounds__(256, 2)
    mla_prefill_tiled(const float* q, const float* ckv, const float* kpe, int nh, int nope, int rope, int kvl,
                      int t0, int n, int qt, int s_cap, float scale, const float* qabs, float* parts) {
    mla_prefill_tiled_impl<16, 2, 2>(q, ckv, kpe, nh, nope, rope, kvl, t0, n, qt, s_cap, scale, qabs, parts);
}
// The same for kv_lora_rank <= 256 and rope <= 32 (the bench preset): half the registers and none
// of the large form's idle lanes; the same operations on every column, so the same bits.
extern "C" __global__ void __launch_bounds__(256, 2)
    mla_prefill_tiled_256(const float* q, const float* ckv, const float* kpe, int nh, int nope, int rope, int kvl,
                          int t0, int n, int qt, int s_cap, float scale, const float* qabs, float* parts) {
    mla_prefill_tiled_impl<8, 1, 1>(q, ckv, kpe, nh, nope, rope, kvl, t0, n, qt, s_cap, scale, qabs, parts);
}
