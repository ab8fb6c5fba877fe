"""CUDA C: prefill GEMMs that read the GGUF blocks themselves (`mmq_h_<T>`, `mmq_w_<T>`), fp16 tensor cores.

Y[t, m] = sum_k X[t, k] W[m, k] for a prompt chunk X [T, K] (fp16, row-major) and a weight W
[M, K] in its stored block layout (`QWeight.raw`, row stride `row_bytes`), written as fp32 into
Y (row stride `ldy`: a column slice of a wider output). No dequantized copy of W exists anywhere:
each block decodes its weight tile with the type's unit decoder (`quant_units`: 32 values at a
time) straight into shared memory as fp16, while the chunk's tile is loaded beside it, and the
warps multiply the two with `mma.sync.m16n8k16` (fp16 inputs, fp32 accumulation: the numbers of
the old dequantize-then-cuBLAS path, summed in another order).

Tiles: 128 weight rows x BN tokens x 64 values of K a step, 256 threads (8 warps of 32 x BN / 2
outputs, ldmatrix fragments): `mmq_h_<T>` with BN = 64 (two blocks an SM), `mmq_w_<T>` with BN =
128 (one block an SM: half the decoding per multiply-add; `mmq_tile` picks). Each thread decodes
one 32-value unit of the next step into registers, then loads its next chunk values, while the
warps multiply the current step from shared memory (one buffer, two barriers a step). Decoding
after the multiply instead, with the next unit's bytes asked of L1 (`prefetch.global.L1`) before
it, measured 0.85-0.93x (`bench/results/prefill_mmq_tiles-20261203-vs-be2fb0f/`). Every output
sums its K steps in the same order in both kernels, so they give the same bits. Shared rows are
padded to 72 halves, which keeps the ldmatrix phases conflict-free. Blocks run token tiles fastest
(grid.x), so the token tiles of one weight tile run side by side and the weight bytes come from L2
after the first. mma.sync needs sm_80+ (Orin is sm_87); `engine.backends.cupy_backend` uses the
tile path below that.
"""

from .quant_units import TYPES

MMQ_BM, MMQ_BK = 128, 64
"""Weight rows and K values of one block's tile (the launch grid follows from them and BN)."""


MMQ_SPLIT_T_MAX = 128
"""Chunks of at most this many tokens may split K (`mmq_splits`)."""
MMQ_SPLIT_MAX = 8
MMQ_SPLIT_ROWS = 16384
"""A split GEMM's slices hold at most this many values a token (splits x a piece's rows): its
scratch, which the memory plan counts beside each GEMM's input and output."""


def mmq_splits(t: int, rows: int, cols: int, sms: int, bn: int = 64) -> int:
    """Blocks that share one output tile's K steps (grid.z), each summing its part into a slice
    of a scratch [splits, T, rows] that `mmq_sum` adds up in order: for a short chunk the grid of
    token x row tiles is too small to fill the GPU (a Qwen3-4B `ffn_down` at 72 tokens: 40
    blocks on 132 multiprocessors, most of a question's prefill time). Enough splits for two
    blocks an SM, at most MMQ_SPLIT_MAX, MMQ_SPLIT_ROWS / rows and a quarter of the K steps;
    1 (no split, the same bits as before) above MMQ_SPLIT_T_MAX tokens or with the GPU full."""
    if t > MMQ_SPLIT_T_MAX:
        return 1
    base = -(-t // bn) * -(-rows // MMQ_BM)
    return max(1, min(-(-2 * sms // base), MMQ_SPLIT_MAX, MMQ_SPLIT_ROWS // rows, -(-cols // MMQ_BK) // 4))


def mmq_tile(t: int, rows: int, sms: int) -> int:
    """BN, the tokens of one block's tile, for a chunk of `t` tokens times a `rows`-row matrix on
    a GPU of `sms` multiprocessors: 128 (`mmq_w_<T>`) where the 64-token grid puts two to four
    blocks on each multiprocessor, else 64 (`mmq_h_<T>`). There a 128-token block (one an SM,
    ~180-200 registers) does two 64-token blocks' multiply-adds with one decoding of the weights and
    no tail of half-filled waves; with one block an SM or fewer, halving the grid leaves
    multiprocessors idle, and with many waves the two-blocks-an-SM kernel hides more latency.
    Measured on an H200 (132 SMs) on the Qwen3-4B shape's matrices, 64 to 2,048 tokens:
    `bench/results/prefill_mmq_tiles-20261203-vs-be2fb0f/`."""
    if t < 128:
        return 64
    per_sm = -(-(-(-t // 64) * -(-rows // MMQ_BM)) // sms)
    return 128 if 2 <= per_sm <= 4 else 64


_COMMON = r"""
// The store of an mmq block's accumulators acc[2][NJ][4] (mma.sync m16n8 fragments: lane g = lane / 4,
// t4 = lane % 4; warp tile at m0 + wm, n0 + wn) into Y [T, ldy] transposed, rows < M and tokens < T;
// with a K split (gridDim.z > 1) into slice blockIdx.z of the partials P [splits, T, M]. A macro,
// not a function: both kernels (mmq_body_<T>, mmq_i8_Q4_K) keep the code they had.
#define MMQ_STORE()                                                                    \
    if (gridDim.z > 1) {                                                               \
        Y = P + (long long)blockIdx.z * T * M;                                         \
        ldy = M;                                                                       \
    }                                                                                  \
    _Pragma("unroll")                                                                  \
    for (int i = 0; i < 2; i++)                                                        \
        _Pragma("unroll")                                                              \
        for (int j = 0; j < NJ; j++) {                                                 \
            int m = m0 + wm + 16 * i + g, n = n0 + wn + 8 * j + 2 * t4;                \
            _Pragma("unroll")                                                          \
            for (int c = 0; c < 4; c++) {                                              \
                int mm = m + (c >> 1) * 8, nn = n + (c & 1);                           \
                if (mm < M && nn < T) Y[(long long)nn * ldy + mm] = acc[i][j][c];      \
            }                                                                          \
        }
#define MMQ_BM 128
#define MMQ_LDS 72
// MMQ_SM80: where the tensor-core code is compiled: sm_80+, and the host (tests/cuda_host.py, whose
// host_ldmatrix_x4 / host_mma run the warp-wide instructions on the CPU)
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#define MMQ_SM80 1
#else
#define MMQ_SM80 0
#endif
__device__ __forceinline__ void mmq_ldsm_x4(unsigned int* r, const unsigned short* p) {
#if !defined(__CUDA_ARCH__)
    host_ldmatrix_x4(r, p);
#elif __CUDA_ARCH__ >= 800
    unsigned int a = (unsigned int)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
#endif
}
__device__ __forceinline__ void mmq_mma(float* c, const unsigned int* a, unsigned int b0, unsigned int b1) {
#if !defined(__CUDA_ARCH__)
    host_mma<float, 2>(c, a, b0, b1);
#elif __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}
__device__ __forceinline__ unsigned int mmq_pack(float a, float b) {
    return (unsigned int)f2h(a) | ((unsigned int)f2h(b) << 16);
}
// Y[n, m] (row stride ldy) = the sum over z, in order, of a split-K GEMM's slices P[z] [T, M].
extern "C" __global__ void mmq_sum(const float* P, int nz, float* Y, int ldy, int M, int T) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x, tm = (long long)T * M;
    if (i >= tm) return;
    float s = P[i];
    for (int z = 1; z < nz; z++) s += P[z * tm + i];
    Y[(i / M) * ldy + i % M] = s;
}
"""

_PER_TYPE = r"""
// The weight unit this thread decodes for K step `ks` (row m0 + tid / 2, unit 2 ks + tid % 2) as
// 16 fp16 pairs in w[] (zeros past the last row or unit), and its BN / 32 x 8 chunk values in x[].
template <int BN>
__device__ __forceinline__ void mmq_load_{T}(const unsigned char* wrow, bool row_ok, int ks, int nu,
                                           const unsigned short* X, int K, int T, int n0, int tid,
                                           uint4* w, uint4* x) {
    int u = 2 * ks + (tid & 1);
    if (row_ok && u < nu) {
        float v[32];
        unit_{T}(wrow, u, v);
        #pragma unroll
        for (int q = 0; q < 4; q++)
            w[q] = make_uint4(mmq_pack(v[8*q], v[8*q+1]), mmq_pack(v[8*q+2], v[8*q+3]),
                              mmq_pack(v[8*q+4], v[8*q+5]), mmq_pack(v[8*q+6], v[8*q+7]));
    } else {
        #pragma unroll
        for (int q = 0; q < 4; q++) w[q] = make_uint4(0, 0, 0, 0);
    }
    #pragma unroll
    for (int i = 0; i < BN / 32; i++) {
        int idx = tid + 256 * i, r = idx >> 3, k = ks * 64 + (idx & 7) * 8;
        x[i] = (n0 + r < T && k < K) ? *(const uint4*)(X + (long long)(n0 + r) * K + k) : make_uint4(0, 0, 0, 0);
    }
}
template <int BN>
__device__ __forceinline__ void mmq_body_{T}(const unsigned char* W, long long row_bytes, const unsigned short* X,
                                            float* Y, int ldy, int M, int K, int T, float* P) {
#if MMQ_SM80
    constexpr int WN = BN / 2, NJ = WN / 8, XV = BN / 32;  // tokens a warp, its n8 tiles, X loads a thread
    __shared__ __align__(16) unsigned short As[MMQ_BM * MMQ_LDS];
    __shared__ __align__(16) unsigned short Bs[BN * MMQ_LDS];
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    int n0 = blockIdx.x * BN, m0 = blockIdx.y * MMQ_BM;
    int nu = K >> 5, steps = (nu + 1) >> 1;
    int ar = tid >> 1;
    bool row_ok = m0 + ar < M;
    const unsigned char* wrow = W + (long long)(row_ok ? m0 + ar : 0) * row_bytes;
    uint4* a_dst = (uint4*)(As + ar * MMQ_LDS + (tid & 1) * 32);
    int wm = (warp & 3) * 32, wn = (warp >> 2) * WN;
    // split K (gridDim.z > 1): this block sums K steps k_lo..k_hi-1 into its slice of P
    int per = (steps + gridDim.z - 1) / gridDim.z, k_lo = blockIdx.z * per, k_hi = min(steps, k_lo + per);
    float acc[2][NJ][4];
    #pragma unroll
    for (int i = 0; i < 2; i++)
        #pragma unroll
        for (int j = 0; j < NJ; j++)
            #pragma unroll
            for (int c = 0; c < 4; c++) acc[i][j][c] = 0.f;
    uint4 w[4], x[XV];
    mmq_load_{T}<BN>(wrow, row_ok, k_lo, nu, X, K, T, n0, tid, w, x);
    for (int ks = k_lo; ks < k_hi; ks++) {
        #pragma unroll
        for (int q = 0; q < 4; q++) a_dst[q] = w[q];
        #pragma unroll
        for (int i = 0; i < XV; i++) {
            int idx = tid + 256 * i;
            *(uint4*)(Bs + (idx >> 3) * MMQ_LDS + (idx & 7) * 8) = x[i];
        }
        __syncthreads();
        if (ks + 1 < k_hi) mmq_load_{T}<BN>(wrow, row_ok, ks + 1, nu, X, K, T, n0, tid, w, x);  // before the multiply: measured faster than after
        #pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            unsigned int a[2][4], b[NJ][2];
            #pragma unroll
            for (int i = 0; i < 2; i++)
                mmq_ldsm_x4(a[i], As + (wm + 16 * i + (lane & 15)) * MMQ_LDS + kk * 16 + (lane >> 4) * 8);
            #pragma unroll
            for (int p = 0; p < NJ / 2; p++) {
                unsigned int r[4];
                mmq_ldsm_x4(r, Bs + (wn + 16 * p + (lane & 7) + ((lane >> 4) << 3)) * MMQ_LDS
                                   + kk * 16 + ((lane >> 3) & 1) * 8);
                b[2*p][0] = r[0]; b[2*p][1] = r[1]; b[2*p+1][0] = r[2]; b[2*p+1][1] = r[3];
            }
            #pragma unroll
            for (int i = 0; i < 2; i++)
                #pragma unroll
                for (int j = 0; j < NJ; j++) mmq_mma(acc[i][j], a[i], b[j][0], b[j][1]);
        }
        __syncthreads();
    }
    int g = lane >> 2, t4 = lane & 3;
    MMQ_STORE();
#endif
}
extern "C" __global__ void __launch_bounds__(256, 2) mmq_h_{T}(const unsigned char* W, long long row_bytes,
        const unsigned short* X, float* Y, int ldy, int M, int K, int T, float* P) {
    mmq_body_{T}<64>(W, row_bytes, X, Y, ldy, M, K, T, P);
}
extern "C" __global__ void __launch_bounds__(256, 1) mmq_w_{T}(const unsigned char* W, long long row_bytes,
        const unsigned short* X, float* Y, int ldy, int M, int K, int T, float* P) {
    mmq_body_{T}<128>(W, row_bytes, X, Y, ldy, M, K, T, P);
}
"""


I8_TYPES = ("Q4_K",)
"""Types with an int8 prefill GEMM (`mmq_i8_<T>`)."""

_I8 = r"""
// ---- int8 prefill GEMMs (llama.cpp's MMQ arithmetic) ------------------------------------------
// The chunk's rows rounded to q8_k (act_q8_k_i8: int8 values, one float scale a 256 and the sum of
// each 32 rounded values), a Q4_K weight's nibbles unpacked to bytes (no float conversion), and
// mma.sync.m16n8k32 on int8 with int32 sums: a sub-block's (32 values) products are exact integers,
// scaled as integers by the sub-block's 6-bit scale and summed over the super-block, then
// y += d_x * (d * sum(sc * dot) - dmin * sum(m * xsum)) once a super-block (Q4_K's formula).
extern "C" __global__ void act_q8_k_i8(const float* x, signed char* q, float* d, int* s32, int n_groups) {
    int g = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (g >= n_groups) return;
    float v[8];
    float iscale = q8k_group(x + (long long)g * 256, lane, v);
    #pragma unroll
    for (int k = 0; k < 8; k++) {
        int qv = (int)fminf(rintf(v[k] * iscale), 127.f);
        q[(long long)g * 256 + lane + 32*k] = (signed char)qv;
        int sum = qv;  // the sum of the 32 values of unit k of this group
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        if (lane == 0) s32[(long long)g * 8 + k] = sum;
    }
    if (lane == 0) d[g] = iscale != 0.f ? 1.0f / iscale : 0.f;
}
#define MMQ_LDB 80
__device__ __forceinline__ void mmq_mma_i8(int* c, const unsigned int* a, unsigned int b0, unsigned int b1) {
#if !defined(__CUDA_ARCH__)
    host_mma<int, 4>(c, a, b0, b1);
#elif __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}
__device__ __forceinline__ void mmq_ldsm_x4_b(unsigned int* r, const unsigned char* p) {
#if !defined(__CUDA_ARCH__)
    host_ldmatrix_x4(r, p);
#elif __CUDA_ARCH__ >= 800
    unsigned int a = (unsigned int)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
#endif
}
// Y[t, m] = sum_k Xq[t, k] W[m, k] for a Q4_K W: 128 rows x 64 tokens a block, K steps of 64 (two
// sub-blocks); 8 warps of 32 rows x 32 tokens. Shared rows are 64 bytes padded to 80 (the ldmatrix
// phases conflict-free). Split K as mmq_h_<T> (gridDim.z, slices of P summed by mmq_sum).
extern "C" __global__ void __launch_bounds__(256, 1) mmq_i8_Q4_K(const unsigned char* W, long long row_bytes,
        const signed char* Xq, const float* Xd, const int* Xs, float* Y, int ldy, int M, int K, int T, float* P) {
#if MMQ_SM80
    constexpr int BN = 64, WN = 32, NJ = 4;
    __shared__ __align__(16) unsigned char As[MMQ_BM * MMQ_LDB];
    __shared__ __align__(16) unsigned char Bs[BN * MMQ_LDB];
    __shared__ int scS[MMQ_BM][2], mnS[MMQ_BM][2], sxS[BN][2];
    __shared__ float dS[MMQ_BM], dmS[MMQ_BM], daS[BN];
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    int n0 = blockIdx.x * BN, m0 = blockIdx.y * MMQ_BM;
    int nu = K >> 5, steps = nu >> 1, nsb = K >> 8;
    int ar = tid >> 1, half = tid & 1;
    bool row_ok = m0 + ar < M;
    const unsigned char* wrow = W + (long long)(row_ok ? m0 + ar : 0) * row_bytes;
    int wm = (warp & 3) * 32, wn = (warp >> 2) * WN;
    int g = lane >> 2, t4 = lane & 3;
    int per = (steps + gridDim.z - 1) / gridDim.z, k_lo = blockIdx.z * per, k_hi = min(steps, k_lo + per);
    float acc[2][NJ][4];
    int sp[2][NJ][4], sm[2][NJ][4];
    #pragma unroll
    for (int i = 0; i < 2; i++)
        #pragma unroll
        for (int j = 0; j < NJ; j++)
            #pragma unroll
            for (int c = 0; c < 4; c++) { acc[i][j][c] = 0.f; sp[i][j][c] = 0; sm[i][j][c] = 0; }
    int xt = tid >> 2, xc = tid & 3;  // the token row and 16-byte piece of X this thread stages
    // what this thread stages for one K step, loaded into registers a step ahead (the global loads
    // of step ks + 1 are in flight while the warps multiply step ks, as in mmq_h_<T>)
    uint4 c0, c1, xv;  // raw bytes only: unpacked when stored, so the loads stay in flight
    unsigned int dd = 0, s0 = 0, s1 = 0, s2 = 0;
    int sx = 0, jn = 0;
    float da = 0.f;
    auto load = [&](int ks) {
        int u = 2 * ks + half;
        jn = u & 7;
        c0 = make_uint4(0, 0, 0, 0); c1 = c0; dd = 0; s0 = 0; s1 = 0; s2 = 0;
        if (row_ok) {
            const unsigned char* p = wrow + (long long)(u >> 3) * 144;
            const uint4* q = (const uint4*)(p + 16 + 32 * (jn >> 1));
            c0 = q[0]; c1 = q[1];
            const unsigned int* hw = (const unsigned int*)p;
            dd = hw[0]; s0 = hw[1]; s1 = hw[2]; s2 = hw[3];
        }
        xv = n0 + xt < T ? *(const uint4*)(Xq + (long long)(n0 + xt) * K + ks * 64 + xc * 16) : make_uint4(0, 0, 0, 0);
        if (tid < 2 * BN) {
            int tt = tid >> 1;
            sx = n0 + tt < T ? Xs[(long long)(n0 + tt) * nu + 2 * ks + half] : 0;
        }
        if (tid < BN) da = n0 + tid < T ? Xd[(long long)(n0 + tid) * nsb + (ks >> 2)] : 0.f;
    };
    if (k_lo < k_hi) load(k_lo);
    for (int ks = k_lo; ks < k_hi; ks++) {
        {   // the weight unit 2 ks + half of row ar (nibbles as bytes, its scale and min), 64 tokens x
            // 64 bytes of Xq, each unit's sum, each token's scale
            int sh = (jn & 1) * 4;
            uint4* dst = (uint4*)(As + ar * MMQ_LDB + half * 32);
            dst[0] = make_uint4((c0.x >> sh) & 0x0F0F0F0Fu, (c0.y >> sh) & 0x0F0F0F0Fu,
                                (c0.z >> sh) & 0x0F0F0F0Fu, (c0.w >> sh) & 0x0F0F0F0Fu);
            dst[1] = make_uint4((c1.x >> sh) & 0x0F0F0F0Fu, (c1.y >> sh) & 0x0F0F0F0Fu,
                                (c1.z >> sh) & 0x0F0F0F0Fu, (c1.w >> sh) & 0x0F0F0F0Fu);
            unsigned int sw[3] = {s0, s1, s2};  // the 12 scale bytes: sc, mn of sub-block jn (get_scale_min_k4)
            #define MMQ_SB(k) ((sw[(k) >> 2] >> (8 * ((k) & 3))) & 0xFFu)
            int sc, mn;
            if (jn < 4) { sc = MMQ_SB(jn) & 63; mn = MMQ_SB(jn + 4) & 63; }
            else { sc = (MMQ_SB(jn + 4) & 0xF) | ((MMQ_SB(jn - 4) >> 6) << 4); mn = (MMQ_SB(jn + 4) >> 4) | ((MMQ_SB(jn) >> 6) << 4); }
            #undef MMQ_SB
            scS[ar][half] = sc; mnS[ar][half] = mn;
            if (half == 0) { dS[ar] = h2f(dd & 0xffff); dmS[ar] = h2f(dd >> 16); }
            *(uint4*)(Bs + xt * MMQ_LDB + xc * 16) = xv;
            if (tid < 2 * BN) sxS[tid >> 1][half] = sx;
            if (tid < BN) daS[tid] = da;
        }
        __syncthreads();
        if (ks + 1 < k_hi) load(ks + 1);
        #pragma unroll
        for (int kk = 0; kk < 2; kk++) {
            unsigned int a[2][4], b[NJ][2];
            #pragma unroll
            for (int i = 0; i < 2; i++)
                mmq_ldsm_x4_b(a[i], As + (wm + 16 * i + (lane & 15)) * MMQ_LDB + kk * 32 + (lane >> 4) * 16);
            #pragma unroll
            for (int p = 0; p < NJ / 2; p++) {
                unsigned int r[4];
                mmq_ldsm_x4_b(r, Bs + (wn + 16 * p + (lane & 7) + ((lane >> 4) << 3)) * MMQ_LDB
                                   + kk * 32 + ((lane >> 3) & 1) * 16);
                b[2*p][0] = r[0]; b[2*p][1] = r[1]; b[2*p+1][0] = r[2]; b[2*p+1][1] = r[3];
            }
            #pragma unroll
            for (int i = 0; i < 2; i++) {
                int r0 = wm + 16 * i + g;
                int sc0 = scS[r0][kk], sc1 = scS[r0 + 8][kk], mn0 = mnS[r0][kk], mn1 = mnS[r0 + 8][kk];
                #pragma unroll
                for (int j = 0; j < NJ; j++) {
                    int c[4] = {0, 0, 0, 0};
                    mmq_mma_i8(c, a[i], b[j][0], b[j][1]);
                    int n = wn + 8 * j + 2 * t4;
                    int s0 = sxS[n][kk], s1 = sxS[n + 1][kk];
                    sp[i][j][0] += sc0 * c[0]; sp[i][j][1] += sc0 * c[1];
                    sp[i][j][2] += sc1 * c[2]; sp[i][j][3] += sc1 * c[3];
                    sm[i][j][0] += mn0 * s0; sm[i][j][1] += mn0 * s1;
                    sm[i][j][2] += mn1 * s0; sm[i][j][3] += mn1 * s1;
                }
            }
        }
        if ((ks & 3) == 3 || ks == k_hi - 1) {  // a super-block's end (or the split's): into floats
            #pragma unroll
            for (int i = 0; i < 2; i++)
                #pragma unroll
                for (int j = 0; j < NJ; j++)
                    #pragma unroll
                    for (int c = 0; c < 4; c++) {
                        int r = wm + 16 * i + g + (c >> 1) * 8, n = wn + 8 * j + 2 * t4 + (c & 1);
                        acc[i][j][c] += daS[n] * (dS[r] * (float)sp[i][j][c] - dmS[r] * (float)sm[i][j][c]);
                        sp[i][j][c] = 0; sm[i][j][c] = 0;
                    }
        }
        __syncthreads();
    }
    MMQ_STORE();
#endif
}
"""


def source() -> str:
    """The shared helpers, the `mmq_h_<T>` / `mmq_w_<T>` kernels per tensor type and the int8 ones
    (`act_q8_k_i8`, `mmq_i8_<T>` for `I8_TYPES`) (needs `quant_units`' UNITS in front: the unit
    decoders, `f2h`, the q8_k rounding)."""
    return _COMMON + "".join(_PER_TYPE.replace("{T}", t) for t in TYPES) + _I8
