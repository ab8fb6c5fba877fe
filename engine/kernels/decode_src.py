"""CUDA C of the one-token decode step (`engine.backends.cupy_decoder`), built per model shape.

Every kernel reads the token id and the position from a small device buffer (`ids`: token,
position, next token), so one captured CUDA graph serves every step. Shapes (heads, head sizes,
GQA group, RoPE) are compile-time constants of the module built for a model, which keeps the
attention accumulators in registers.

- `dgemv_<T>`: fused GEMV over a weight of type T (the `unit_<T>` decoders of `quant_units`),
  8 warps a block, one warp a row, rows strided over a capped grid. The block first loads the
  input vector into shared memory, optionally RMS-normalises it and rounds it the way llama.cpp
  does (q8_0 / q8_k, `NumpyOps.act_quant`'s twin), so norm + rounding + GEMV are one launch.
  Epilogues: store (+ bias), add into the output (residual), SwiGLU / GeGLU of rows r and
  r + up_off (gate and up in one pass).
- `qkv_post`: Q/K RMSNorm per head, RoPE (neox / interleaved, partial) at the device position,
  Q into its buffer, K and V written into the KV cache at that position.
- `attn_decode`: split-K decode attention (flash-decoding): each block takes a slice (>= 32
  positions) of one KV head for its whole GQA group (online softmax); the last block of the head
  merges the slices. Sliding window as in the generic path.
- `qgemv_<T>` / `qgemv_glu_<T>` (Q4_K, Q6_K, Q4_1, Q8_0 with llama.cpp's activation rounding on):
  the same GEMV with the rounded input kept as int8 blocks and `__dp4a` integer dot products on
  16-byte weight slices (`qdot_src`); used by the decoder wherever the rounding is on.
- `embed_<T>`, `add_rmsnorm` (gemma3's post norms), `glu` (unfused gate/up), `argmax_ids`.

This file is over 450 lines on purpose: it is a table of generated CUDA source (kernel templates
filled per shape), read as CUDA, not as Python; splitting it would scatter one translation unit.
"""

from __future__ import annotations

from . import grid_src, qdot_src
from .quant_units import UNITS

COMMON = r"""
// Programmatic Dependent Launch (sm_90+, `cupy_launch`): PDL_LAUNCH lets the next kernel of the
// stream start its blocks now; PDL_WAIT waits until every earlier kernel has finished and its
// writes are visible. A kernel reads only weights before PDL_WAIT and writes nothing; launched
// without the PDL attribute (or below sm_90) both are no-ops.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define PDL_LAUNCH() asm volatile("griddepcontrol.launch_dependents;" ::: "memory")
#define PDL_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")
#else
#define PDL_LAUNCH()
#define PDL_WAIT()
#endif
#define NEG_INF __int_as_float(0xff800000)
// Ask L2 for the 128-byte line at p (a hint; nothing where this is compiled for the host, tests/cuda_host.py).
__device__ __forceinline__ void prefetch_l2(const void* p) {
#ifdef __CUDA_ARCH__
    asm volatile("prefetch.global.L2 [%0];" :: "l"(p));
#endif
}
__device__ __forceinline__ float warp_sum(float v) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ float glu_silu(float g, float u) { return g / (1.0f + expf(-g)) * u; }
__device__ __forceinline__ float glu_gelu(float g, float u) {
    return 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g))) * u;
}
// Load x[cols] into xs (shared), RMS-normalise by nw (if given), round like llama.cpp (aq:
// 0 none, 1 q8_0, 2 q8_k). Ends with a barrier. blockDim.x == 256.
__device__ __forceinline__ void prep_input(const float* __restrict__ x, const float* __restrict__ nw,
                                           float eps, int aq, int cols, float* xs, float* red) {
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    float ss = 0.f;
    for (int i = tid; i < cols; i += 256) { float v = x[i]; xs[i] = v; ss += v * v; }
    if (nw) {
        ss = warp_sum(ss);
        if (lane == 0) red[warp] = ss;
        __syncthreads();
        float tot = 0.f;
        #pragma unroll
        for (int w = 0; w < 8; w++) tot += red[w];
        float r = sqrtf(tot / (float)cols + eps);
        for (int i = tid; i < cols; i += 256) xs[i] = xs[i] / r * nw[i];
    }
    __syncthreads();
    if (aq == 1) {
        for (int g = warp; g < (cols >> 5); g += 8) {
            float v = xs[g * 32 + lane];
            float a = warp_max(fabsf(v));
            float d = a / 127.0f;
            float inv = d != 0.f ? 1.0f / d : 0.f;
            xs[g * 32 + lane] = rintf(v * inv) * d;
        }
        __syncthreads();
    } else if (aq == 2) {
        for (int g = warp; g < (cols >> 8); g += 8) {
            float* xg = xs + g * 256;
            float v[8];
            #pragma unroll
            for (int k = 0; k < 8; k++) v[k] = xg[lane + 32 * k];
            int bi = q8k_argmax_abs(v, lane);
            float mx = xg[bi];
            __syncwarp();
            float iscale = q8k_iscale(mx);
            float d = iscale != 0.f ? 1.0f / iscale : 0.f;
            #pragma unroll
            for (int k = 0; k < 8; k++) xg[lane + 32 * k] = fminf(rintf(v[k] * iscale), 127.f) * d;
        }
        __syncthreads();
    }
}
"""

GEMV = r"""
// R rows per warp (R independent loads in flight per lane), 8 warps a block.
template <int R>
__device__ __forceinline__ void dgemv_body_{T}(
        const unsigned char* __restrict__ W, long long row_bytes, int rows, int cols,
        const float* __restrict__ x, const float* __restrict__ nw, float eps, int aq,
        float* y, const float* __restrict__ bias, int epi, int up_off) {
    extern __shared__ float xs[];
    __shared__ float red[8];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    PDL_LAUNCH();
    {   // the first rows' bytes towards L2 while the input is prepared (weights don't wait for x)
        int row = (blockIdx.x * 8 + warp) * R;
        for (int r = 0; r < (epi < 2 ? R : 2); r++) {
            int rr = epi < 2 ? row + r : row + r * up_off;
            if (rr >= (epi < 2 ? rows : rows + up_off)) break;
            const unsigned char* rp = W + (long long)rr * row_bytes;
            for (long long o = lane * 128; o < row_bytes; o += 32 * 128)
                prefetch_l2(rp + o);
        }
    }
    PDL_WAIT();
    prep_input(x, nw, eps, aq, cols, xs, red);
    int nu = cols >> 5;
    int step = gridDim.x * 8 * R;
    for (int row = (blockIdx.x * 8 + warp) * R; row < rows; row += step) {
        if (epi < 2) {
            float a[R];
            const unsigned char* rp[R];
            #pragma unroll
            for (int r = 0; r < R; r++) {
                a[r] = 0.f;
                rp[r] = W + (long long)min(row + r, rows - 1) * row_bytes;
            }
            #pragma unroll 2
            for (int u = lane; u < nu; u += 32) {
                const float4* xp = (const float4*)(xs + u * 32);
                #pragma unroll
                for (int r = 0; r < R; r++) {
                    float v[32];
                    unit_{T}(rp[r], u, v);
                    #pragma unroll
                    for (int i = 0; i < 8; i++) {
                        float4 b = xp[i];
                        a[r] += v[4*i] * b.x + v[4*i+1] * b.y + v[4*i+2] * b.z + v[4*i+3] * b.w;
                    }
                }
            }
            #pragma unroll
            for (int r = 0; r < R; r++) {
                float s = warp_sum(a[r]);
                if (lane == 0 && row + r < rows) {
                    if (epi == 0) y[row + r] = s + (bias ? bias[row + r] : 0.f);
                    else y[row + r] += s;
                }
            }
        } else {
            #pragma unroll
            for (int r = 0; r < R; r++) {
                if (row + r >= rows) break;
                const unsigned char* r0 = W + (long long)(row + r) * row_bytes;
                const unsigned char* r1 = W + (long long)(row + r + up_off) * row_bytes;
                float a0 = 0.f, a1 = 0.f;
                for (int u = lane; u < nu; u += 32) {
                    float v[32], w[32];
                    unit_{T}(r0, u, v);
                    unit_{T}(r1, u, w);
                    const float4* xp = (const float4*)(xs + u * 32);
                    #pragma unroll
                    for (int i = 0; i < 8; i++) {
                        float4 b = xp[i];
                        a0 += v[4*i] * b.x + v[4*i+1] * b.y + v[4*i+2] * b.z + v[4*i+3] * b.w;
                        a1 += w[4*i] * b.x + w[4*i+1] * b.y + w[4*i+2] * b.z + w[4*i+3] * b.w;
                    }
                }
                a0 = warp_sum(a0);
                a1 = warp_sum(a1);
                if (lane == 0) y[row + r] = epi == 2 ? glu_silu(a0, a1) : glu_gelu(a0, a1);
            }
        }
    }
}
extern "C" __global__ void __launch_bounds__(256) dgemv_{T}(
        const unsigned char* __restrict__ W, long long row_bytes, int rows, int cols,
        const float* __restrict__ x, const float* __restrict__ nw, float eps, int aq,
        float* y, const float* __restrict__ bias, int epi, int up_off) {
    dgemv_body_{T}<1>(W, row_bytes, rows, cols, x, nw, eps, aq, y, bias, epi, up_off);
}
extern "C" __global__ void __launch_bounds__(256) dgemv2_{T}(
        const unsigned char* __restrict__ W, long long row_bytes, int rows, int cols,
        const float* __restrict__ x, const float* __restrict__ nw, float eps, int aq,
        float* y, const float* __restrict__ bias, int epi, int up_off) {
    dgemv_body_{T}<2>(W, row_bytes, rows, cols, x, nw, eps, aq, y, bias, epi, up_off);
}
// Embedding row of the token in ids[0], times scale (gemma: sqrt(n_embd)).
extern "C" __global__ void embed_{T}(const unsigned char* W, long long row_bytes, const int* ids,
                                     float* x, int cols, float scale) {
    PDL_LAUNCH();
    PDL_WAIT();
    int u = blockIdx.x * blockDim.x + threadIdx.x;
    if (u >= (cols >> 5)) return;
    float v[32];
    unit_{T}(W + (long long)ids[0] * row_bytes, u, v);
    #pragma unroll
    for (int k = 0; k < 32; k++) x[u * 32 + k] = scale != 1.0f ? v[k] * scale : v[k];
}
"""

MISC = r"""
// x += rms_norm(t) * w (gemma3's post-attention / post-FFN norms before the residual add).
extern "C" __global__ void add_rmsnorm(float* x, const float* t, const float* w, int n, float eps) {
    PDL_LAUNCH();
    PDL_WAIT();
    __shared__ float red[32];
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, nw = blockDim.x >> 5;
    float ss = 0.f;
    for (int i = tid; i < n; i += blockDim.x) ss += t[i] * t[i];
    ss = warp_sum(ss);
    if (lane == 0) red[warp] = ss;
    __syncthreads();
    float tot = 0.f;
    for (int k = 0; k < nw; k++) tot += red[k];
    float r = sqrtf(tot / (float)n + eps);
    for (int i = tid; i < n; i += blockDim.x) x[i] = x[i] + t[i] / r * w[i];
}
// Gated activation of an unfused gate/up pair: y[i] = act(g[i]) * g[i + n].
extern "C" __global__ void glu(const float* gu, float* y, int n, int gelu) {
    PDL_LAUNCH();
    PDL_WAIT();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    y[i] = gelu ? glu_gelu(gu[i], gu[i + n]) : glu_silu(gu[i], gu[i + n]);
}
// Greedy: ids[2] = index of the largest logit (first on ties). Each block reduces a slice into
// (bv, bi); the last block to finish (atomic counter, reset by it) reduces those.
__device__ __forceinline__ void argmax_block(float& best, int& idx, float* sv, int* si) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, best, o);
        int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        if (ov > best || (ov == best && oi < idx)) { best = ov; idx = oi; }
    }
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    if (lane == 0) { sv[warp] = best; si[warp] = idx; }
    __syncthreads();
    best = lane < nw ? sv[lane] : NEG_INF; idx = lane < nw ? si[lane] : 0x7fffffff;
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, best, o);
        int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        if (ov > best || (ov == best && oi < idx)) { best = ov; idx = oi; }
    }
}
extern "C" __global__ void argmax_ids(const float* x, int n, float* bv, int* bi, int* counter, int* ids) {
    PDL_LAUNCH();
    PDL_WAIT();
    __shared__ float sv[32]; __shared__ int si[32]; __shared__ int last;
    float best = NEG_INF; int idx = 0x7fffffff;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        float v = x[i];
        if (v > best) { best = v; idx = i; }
    }
    argmax_block(best, idx, sv, si);
    if (threadIdx.x == 0) { bv[blockIdx.x] = best; bi[blockIdx.x] = idx; }
    LAST_BLOCK_OR_RETURN(last, counter, (int)gridDim.x);
    best = NEG_INF; idx = 0x7fffffff;
    for (int i = threadIdx.x; i < gridDim.x; i += blockDim.x) {
        float v = __ldcg(bv + i); int j = __ldcg(bi + i);
        if (v > best || (v == best && j < idx)) { best = v; idx = j; }
    }
    __syncthreads();
    argmax_block(best, idx, sv, si);
    if (threadIdx.x == 0) { ids[2] = idx; *counter = 0; }
}
"""

# Shape-specialised kernels. Constants: H heads, KVH KV heads, G = H / KVH, D (Q/K head size),
# DV (V head size), HALF (RoPE pairs), NEOX, KT (cache element type), LDKV/STKV.
SHAPED = r"""
#define H {H}
#define KVH {KVH}
#define G {G}
#define D {D}
#define DV {DV}
#define HALF {HALF}
#define NEOX {NEOX}
#define NSPLIT {NSPLIT}
#define KVQ {KVQ}
typedef {KT} kv_t;
__device__ __forceinline__ float ldkv(const float* p) { return *p; }
__device__ __forceinline__ float ldkv(const unsigned short* p) { return h2f(*p); }
__device__ __forceinline__ float ldkv(const signed char* p) { return (float)*p; }
__device__ __forceinline__ void stkv(float* p, float v) { *p = v; }
__device__ __forceinline__ void stkv(unsigned short* p, float v) { *p = f2h(v); }
// int8 cache (KVQ): element i of a row, stored by a whole warp holding 32 consecutive elements
// (one scale block): d = max|v| / 127, q = rint(v / d), scale stored as fp16 (engine.kv_cache).
__device__ __forceinline__ void stkv_q8(signed char* q, unsigned short* dsc, int i, float v) {
    float d = warp_max(fabsf(v)) / 127.0f;
    q[i] = (signed char)(d > 0.f ? __float2int_rn(v / d) : 0);
    if ((i & 31) == 0) dsc[i >> 5] = f2h(d);
}
// scale of element `idx` of a layer's int8 cache (1 without KVQ)
#if KVQ
#define KV_SCALE(dsc, idx) h2f((dsc)[(idx) >> 5])
#else
#define KV_SCALE(dsc, idx) 1.0f
#endif

// Block b < H: query head b; b < H + KVH: key head; else value head. blockDim.x == 128.
// qkv: [H*D | KVH*D | KVH*DV]; K cache [KVH, n_ctx, D], V cache [KVH, n_ctx, DV].
extern "C" __global__ void __launch_bounds__(128) qkv_post(
        const float* __restrict__ qkv, float* q_out, kv_t* Kc, kv_t* Vc, unsigned short* Kd,
        unsigned short* Vd, const int* ids,
        const float* __restrict__ cs, const float* __restrict__ sn,
        const float* __restrict__ qn, const float* __restrict__ kn, int n_ctx, float eps) {
    PDL_LAUNCH();
    __shared__ float xs[(D > DV ? D : DV)];
    __shared__ float red[4];
    int b = blockIdx.x, tid = threadIdx.x;
    int pos = ids[1];  // written before the step's first kernel
    bool is_q = b < H;
    const float* nw = is_q ? qn : kn;
    // what does not depend on the kernel before is loaded before the wait: the Q/K norm's weights
    // and this thread's RoPE cos/sin at the position (one dependent round trip less after it)
    const float* c = cs + (long long)pos * HALF;
    const float* s = sn + (long long)pos * HALF;
    float nwv[(D + 127) / 128], cj[(D + 127) / 128], sj[(D + 127) / 128];
    #pragma unroll
    for (int k = 0; k < (D + 127) / 128; k++) {
        int d = tid + 128 * k;
        int j = NEOX ? (d < HALF ? d : d - HALF) : d >> 1;
        bool rot = b < H + KVH && d < D && d < 2 * HALF;
        nwv[k] = (nw && b < H + KVH && d < D) ? nw[d] : 1.f;
        cj[k] = rot ? c[j] : 0.f;
        sj[k] = rot ? s[j] : 0.f;
    }
    PDL_WAIT();
    if (b >= H + KVH) {
        int h = b - H - KVH;
        const float* src = qkv + H * D + KVH * D + h * DV;
        kv_t* dst = Vc + ((long long)h * n_ctx + pos) * DV;
#if KVQ
        for (int i = tid; i < DV; i += 128) stkv_q8(dst, Vd + ((long long)h * n_ctx + pos) * (DV / 32), i, src[i]);
#else
        for (int i = tid; i < DV; i += 128) stkv(dst + i, src[i]);
#endif
        return;
    }
    const float* src = is_q ? qkv + b * D : qkv + H * D + (b - H) * D;
    float ss = 0.f;
    for (int i = tid; i < D; i += 128) { float v = src[i]; xs[i] = v; ss += v * v; }
    if (nw) {
        ss = warp_sum(ss);
        if ((tid & 31) == 0) red[tid >> 5] = ss;
        __syncthreads();
        float r = sqrtf((red[0] + red[1] + red[2] + red[3]) / (float)D + eps);
        #pragma unroll
        for (int k = 0; k < (D + 127) / 128; k++) {
            int i = tid + 128 * k;
            if (i < D) xs[i] = xs[i] / r * nwv[k];
        }
    }
    __syncthreads();
    float out[(D + 127) / 128];
    #pragma unroll
    for (int k = 0; k < (D + 127) / 128; k++) {
        int d = tid + 128 * k;
        if (d >= D) break;
        float v = xs[d];
        if (d < 2 * HALF) {  // cj / sj: c[j], s[j] of this thread's pair j
            if (NEOX) {
                if (d < HALF) v = xs[d] * cj[k] - xs[d + HALF] * sj[k];
                else { int j = d - HALF; v = xs[j] * sj[k] + xs[d] * cj[k]; }
            } else {
                if ((d & 1) == 0) v = xs[d] * cj[k] - xs[d + 1] * sj[k];
                else v = xs[d - 1] * sj[k] + xs[d] * cj[k];
            }
        }
        out[k] = v;
    }
    #pragma unroll
    for (int k = 0; k < (D + 127) / 128; k++) {
        int d = tid + 128 * k;
        if (d >= D) break;
        if (is_q) q_out[b * D + d] = out[k];
#if KVQ
        else stkv_q8(Kc + ((long long)(b - H) * n_ctx + pos) * D, Kd + ((long long)(b - H) * n_ctx + pos) * (D / 32), d, out[k]);
#else
        else stkv(Kc + ((long long)(b - H) * n_ctx + pos) * D + d, out[k]);
#endif
    }
}

// Split-K decode attention. grid (KVH, NSPLIT) (ATT_CLUSTER: (KVH, a multiple of it), below), NW warps. Positions lo..pos (lo from the sliding
// window) are cut into slices of at least MINCHUNK positions (at most NSPLIT slices); each block
// writes, per query head of its group, the slice's max score pm, sum of exp pl and unnormalised
// output pacc [H, NSPLIT, DV]; the last block of a KV head to finish (atomic counter, reset by it)
// merges the slices into out [H, DV].
#define DL ((D + 31) / 32)
#define VL ((DV + 31) / 32)
#define MINCHUNK {MINCHUNK}
#define NW {NWARP}  // warps a block
#define NT (32 * NW)
#ifndef ATT_STAGE
#define ATT_STAGE 0  // profiling only (bench/attn_sweep.py --stages): 3 launch, 1 scan, 2 + slice writes
#endif
#define FASTATT {FASTATT}
#define LPP {LPP}  // lanes a position (8 or 16): fewer registers a lane with 16
#define PPW (32 / LPP)  // positions a warp step
#define KPL (D / LPP)
#define VPL (DV / LPP)
// ATT_CLUSTER 0: the slices of a KV head are blocks of the grid, merged through global memory by
// the last one to finish (a fence, an atomic counter, then the partial results read back from L2).
// N (sm_90): the blocks of a KV head are grouped in thread-block clusters of N. Up to N x CLMIN
// positions the first cluster alone takes them, split evenly over its blocks (the others return):
// their partial results stay in shared memory, and after one cluster barrier every block merges its
// share of the outputs (one rounding group each) through distributed shared memory - no fence, no
// counter, no round trip through L2. Past that, every block of the grid is a slice as with 0
// (gridDim.y of them, at most NSPLIT).
#define ATT_CLUSTER {ATT_CLUSTER}
#define CLMIN {CLMIN}
// The online-softmax merge of N partial results, part r's max m(r), sum of exp l(r) and
// unnormalised output a(r): with M the largest m, each part weighs exp(m - M) (0 for an empty
// part, m = -inf), o and L their weighted sums; returns M. Used across a block's warps and across
// a cluster's blocks.
template <int N, typename FM, typename FL, typename FA>
__device__ __forceinline__ float merge_parts(FM m, FL l, FA a, float& o, float& L) {
    float M = m(0);
    #pragma unroll
    for (int r = 1; r < N; r++) M = fmaxf(M, m(r));
    o = 0.f; L = 0.f;
    #pragma unroll
    for (int r = 0; r < N; r++) {
        float e = m(r) == NEG_INF ? 0.f : expf(m(r) - M);
        o += a(r) * e;
        L += l(r) * e;
    }
    return M;
}
#if ATT_CLUSTER
#define ATT_BOUNDS __cluster_dims__(1, ATT_CLUSTER, 1) __launch_bounds__(NT)
// (each with a host branch for tests/cuda_host.py, which runs a cluster's blocks together on the CPU)
__device__ __forceinline__ void cluster_sync_all() {
#ifdef __CUDA_ARCH__
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#else
    host_cluster_sync();
#endif
}
// v at the same shared-memory place in block `rank` of this cluster
__device__ __forceinline__ float ld_peer(const float* v, unsigned int rank) {
#ifdef __CUDA_ARCH__
    unsigned int a = (unsigned int)__cvta_generic_to_shared(v), pa;
    float r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(pa) : "r"(a), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(r) : "r"(pa));
    return r;
#else
    return host_ld_peer(v, rank);
#endif
}
#else
#define ATT_BOUNDS __launch_bounds__(NT)
#endif
// n floats from a 16-byte aligned run of the cache (n a multiple of 4 / 8)
template <int N> __device__ __forceinline__ void ldrow(const float* p, float* o) {
    #pragma unroll
    for (int i = 0; i < N / 4; i++) {
        float4 a = __ldg((const float4*)p + i);
        o[4*i] = a.x; o[4*i+1] = a.y; o[4*i+2] = a.z; o[4*i+3] = a.w;
    }
}
template <int N> __device__ __forceinline__ void ldrow(const unsigned short* p, float* o) {
    #pragma unroll
    for (int i = 0; i < N / 8; i++) {
        uint4 a = *((const uint4*)p + i);
        unsigned int w[4] = {a.x, a.y, a.z, a.w};
        #pragma unroll
        for (int k = 0; k < 4; k++) { o[8*i+2*k] = h2f(w[k] & 0xffff); o[8*i+2*k+1] = h2f(w[k] >> 16); }
    }
}
template <int N> __device__ __forceinline__ void ldrow(const signed char* p, float* o) {
    if (N % 16 == 0) {
        #pragma unroll
        for (int i = 0; i < N / 16; i++) {
            int4 a = *((const int4*)p + i);
            int w[4] = {a.x, a.y, a.z, a.w};
            #pragma unroll
            for (int k = 0; k < 16; k++) o[16*i+k] = (float)(signed char)(w[k >> 2] >> (8 * (k & 3)));
        }
    } else {
        #pragma unroll
        for (int i = 0; i < N / 8; i++) {
            int2 a = *((const int2*)p + i);
            int w[2] = {a.x, a.y};
            #pragma unroll
            for (int k = 0; k < 8; k++) o[8*i+k] = (float)(signed char)(w[k >> 2] >> (8 * (k & 3)));
        }
    }
}
extern "C" __global__ void ATT_BOUNDS attn_decode(
        const float* __restrict__ q, const kv_t* __restrict__ Kc, const kv_t* __restrict__ Vc,
        const unsigned short* __restrict__ Kd, const unsigned short* __restrict__ Vd, const int* ids,
        float* pm, float* pl, float* pacc, int* counter, float* out, int n_ctx, int window, float scale,
        int aq, signed char* xq, float* xd, int* xs16) {
    PDL_LAUNCH();  // PDL_WAIT below, once this block's K/V rows are requested into L2
    __shared__ float wm[NW][G], wl[NW][G];
    __shared__ float wacc[NW][G][DV];
    __shared__ float sw[G][NSPLIT];
    __shared__ float sL[G];
    __shared__ int last;
    int kvh = blockIdx.x, split = blockIdx.y;
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    int pos = ids[1], end = pos + 1;
    int lo = window > 0 ? max(0, pos - window + 1) : 0;
    int len = end - lo;
#if ATT_CLUSTER
    __shared__ float cm[G], cl[G], cacc[G][DV];  // this block's partial results, read by the cluster
    const bool one = len <= ATT_CLUSTER * CLMIN;  // the same in every block: one cluster takes them all
    int chunk, active, s0, s1;
    if (one) {
        if (split >= ATT_CLUSTER) return;  // whole clusters: no block waits at a barrier for one gone
        chunk = (len + ATT_CLUSTER - 1) / ATT_CLUSTER;  // every block of the cluster runs (maybe empty)
        active = 1;
        s0 = min(end, lo + split * chunk);
        s1 = min(end, s0 + chunk);
    } else {
        chunk = max(MINCHUNK, (len + (int)gridDim.y - 1) / (int)gridDim.y);
        active = (len + chunk - 1) / chunk;
        if (split >= active) return;
        s0 = lo + split * chunk;
        s1 = min(end, s0 + chunk);
    }
#else
    int chunk = max(MINCHUNK, (len + NSPLIT - 1) / NSPLIT);
    int active = (len + chunk - 1) / chunk;
    if (split >= active) return;
    int s0 = lo + split * chunk, s1 = min(end, s0 + chunk);
#endif
    {   // ids[] is written before the step's first kernel; rows < pos are from earlier steps, and
        // the row at pos (written by qkv_post) is only read after the wait (L2 is coherent)
        const char* kb = (const char*)(Kc + ((long long)kvh * n_ctx + s0) * D);
        const char* vb = (const char*)(Vc + ((long long)kvh * n_ctx + s0) * DV);
        int kspan = (s1 - s0) * D * (int)sizeof(kv_t), vspan = (s1 - s0) * DV * (int)sizeof(kv_t);
        for (int o = tid * 128; o < kspan; o += NT * 128) prefetch_l2(kb + o);
        for (int o = tid * 128; o < vspan; o += NT * 128) prefetch_l2(vb + o);
    }
#if FASTATT
    int oct = lane / LPP, ol = lane % LPP;
    const kv_t* Kh = Kc + (long long)kvh * n_ctx * D;
    const kv_t* Vh = Vc + (long long)kvh * n_ctx * DV;
    const unsigned short* Khd = KVQ ? Kd + (long long)kvh * n_ctx * (D / 32) : nullptr;
    const unsigned short* Vhd = KVQ ? Vd + (long long)kvh * n_ctx * (DV / 32) : nullptr;
    float kn[KPL], vn[VPL], ksn = 1.f, vsn = 1.f;  // int8 cache: a lane's run is one scale block
    int sb = s0 + warp * PPW;
    // This lane's first K/V rows are loaded before the wait: rows before pos were written by
    // earlier graph launches (complete), row pos is this step's (after the wait) - the first
    // step's load latency overlaps the kernel before.
    auto ld_first = [&](int s) {
        ldrow<KPL>(Kh + (long long)s * D + ol * KPL, kn);
        ldrow<VPL>(Vh + (long long)s * DV + ol * VPL, vn);
        ksn = KV_SCALE(Khd, (long long)s * D + ol * KPL);
        vsn = KV_SCALE(Vhd, (long long)s * DV + ol * VPL);
    };
    if (sb + oct < s1 && sb + oct != pos) ld_first(sb + oct);
#endif
    PDL_WAIT();
#if ATT_STAGE == 3
    return;  // profiling: the launch alone
#endif
#if FASTATT
    // LPP lanes a position (each an aligned run of D/LPP key and DV/LPP value dims), 32/LPP
    // positions a warp step: log2(LPP) shuffles per score instead of 5, several scores in flight.
    // Each 8-lane group keeps its own online softmax; the four are merged at the end by shuffles.
    // The first K/V rows (before the wait, above) and this lane's slice of the group's queries
    // need no shared-memory staging or barrier; each step loads the next rows before it uses the
    // current ones (one step ahead), so load latency is paid about once a block.
    float qr[G][KPL];
    if (sb + oct == pos && pos < s1) ld_first(pos);  // the row qkv_post wrote this step
    #pragma unroll
    for (int g = 0; g < G; g++) ldrow<KPL>(q + (kvh * G + g) * D + ol * KPL, qr[g]);
    float m[G], l[G], acc[G][VPL];
    #pragma unroll
    for (int g = 0; g < G; g++) {
        m[g] = NEG_INF; l[g] = 0.f;
        #pragma unroll
        for (int i = 0; i < VPL; i++) acc[g][i] = 0.f;
    }
    for (; sb < s1; sb += NW * PPW) {
        int s = sb + oct;
        bool valid = s < s1;
        float k[KPL], v[VPL];
        float ks = ksn, vs = vsn;
        #pragma unroll
        for (int i = 0; i < KPL; i++) k[i] = kn[i];
        #pragma unroll
        for (int i = 0; i < VPL; i++) v[i] = vn[i];
        int sn = s + NW * PPW;
        if (sn < s1) {
            ldrow<KPL>(Kh + (long long)sn * D + ol * KPL, kn);
            ldrow<VPL>(Vh + (long long)sn * DV + ol * VPL, vn);
            ksn = KV_SCALE(Khd, (long long)sn * D + ol * KPL);
            vsn = KV_SCALE(Vhd, (long long)sn * DV + ol * VPL);
        }
        #pragma unroll
        for (int g = 0; g < G; g++) {
            float a = 0.f;
            #pragma unroll
            for (int i = 0; i < KPL; i++) a += qr[g][i] * k[i];
            a *= ks;
            #pragma unroll
            for (int o = LPP / 2; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
            a *= scale;
            if (valid) {
                float mn = fmaxf(m[g], a);
                float corr = expf(m[g] - mn);  // m = -inf: 0
                float p = expf(a - mn);
                l[g] = l[g] * corr + p;
                float pv = p * vs;
                #pragma unroll
                for (int i = 0; i < VPL; i++) acc[g][i] = acc[g][i] * corr + pv * v[i];
                m[g] = mn;
            }
        }
    }
    #pragma unroll
    for (int g = 0; g < G; g++) {
        float M = m[g];
        #pragma unroll
        for (int o = LPP; o < 32; o <<= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
        float e = m[g] == NEG_INF ? 0.f : expf(m[g] - M);
        float L = l[g] * e;
        #pragma unroll
        for (int o = LPP; o < 32; o <<= 1) L += __shfl_xor_sync(0xffffffffu, L, o);
        #pragma unroll
        for (int i = 0; i < VPL; i++) {
            float x = acc[g][i] * e;
            #pragma unroll
            for (int o = LPP; o < 32; o <<= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
            acc[g][i] = x;
        }
        if (lane == 0) { wm[warp][g] = M; wl[warp][g] = L; }
        if (lane < LPP) {
            #pragma unroll
            for (int i = 0; i < VPL; i++) wacc[warp][g][ol * VPL + i] = acc[g][i];
        }
    }
#else
    __shared__ float qs[G][D];  // the group's queries (the one-position-a-warp loop only)
    for (int i = tid; i < G * D; i += NT) qs[i / D][i % D] = q[(kvh * G) * D + i];
    __syncthreads();
    float m[G], l[G], acc[G][VL];
    #pragma unroll
    for (int g = 0; g < G; g++) {
        m[g] = NEG_INF; l[g] = 0.f;
        #pragma unroll
        for (int i = 0; i < VL; i++) acc[g][i] = 0.f;
    }
    const kv_t* Kh = Kc + (long long)kvh * n_ctx * D;
    const kv_t* Vh = Vc + (long long)kvh * n_ctx * DV;
    const unsigned short* Khd = KVQ ? Kd + (long long)kvh * n_ctx * (D / 32) : nullptr;
    const unsigned short* Vhd = KVQ ? Vd + (long long)kvh * n_ctx * (DV / 32) : nullptr;
    // K/V rows of the next position are loaded before the current one is used (one ahead)
    float kn[DL], vn[VL];
    #pragma unroll
    for (int i = 0; i < DL; i++) kn[i] = 0.f;
    #pragma unroll
    for (int i = 0; i < VL; i++) vn[i] = 0.f;
    int s = s0 + warp;
    if (s < s1) {
        #pragma unroll
        for (int i = 0; i < DL; i++) if (lane + 32 * i < D) kn[i] = ldkv(Kh + (long long)s * D + lane + 32 * i) * KV_SCALE(Khd, (long long)s * D + lane + 32 * i);
        #pragma unroll
        for (int i = 0; i < VL; i++) if (lane + 32 * i < DV) vn[i] = ldkv(Vh + (long long)s * DV + lane + 32 * i) * KV_SCALE(Vhd, (long long)s * DV + lane + 32 * i);
    }
    for (; s < s1; s += NW) {
        float k[DL], v[VL];
        #pragma unroll
        for (int i = 0; i < DL; i++) k[i] = kn[i];
        #pragma unroll
        for (int i = 0; i < VL; i++) v[i] = vn[i];
        if (s + NW < s1) {
            #pragma unroll
            for (int i = 0; i < DL; i++) if (lane + 32 * i < D) kn[i] = ldkv(Kh + (long long)(s + NW) * D + lane + 32 * i) * KV_SCALE(Khd, (long long)(s + NW) * D + lane + 32 * i);
            #pragma unroll
            for (int i = 0; i < VL; i++) if (lane + 32 * i < DV) vn[i] = ldkv(Vh + (long long)(s + NW) * DV + lane + 32 * i) * KV_SCALE(Vhd, (long long)(s + NW) * DV + lane + 32 * i);
        }
        #pragma unroll
        for (int g = 0; g < G; g++) {
            float a = 0.f;
            #pragma unroll
            for (int i = 0; i < DL; i++) if (lane + 32 * i < D) a += qs[g][lane + 32 * i] * k[i];
            a = warp_sum(a) * scale;
            float mn = fmaxf(m[g], a);
            float corr = expf(m[g] - mn);  // m = -inf: 0
            float p = expf(a - mn);
            l[g] = l[g] * corr + p;
            #pragma unroll
            for (int i = 0; i < VL; i++) acc[g][i] = acc[g][i] * corr + p * v[i];
            m[g] = mn;
        }
    }
    #pragma unroll
    for (int g = 0; g < G; g++) {
        if (lane == 0) { wm[warp][g] = m[g]; wl[warp][g] = l[g]; }
        #pragma unroll
        for (int i = 0; i < VL; i++) if (lane + 32 * i < DV) wacc[warp][g][lane + 32 * i] = acc[g][i];
    }
#endif
#if ATT_STAGE == 1
    if (m[0] == 12345.f) out[0] = acc[0][0];  // keep the work (profiling: stop after the scan)
    return;
#endif
    __syncthreads();
    for (int i = tid; i < G * DV; i += NT) {
        int g = i / DV, d = i % DV;
        float o, L;
        float M = merge_parts<NW>([&](int w) { return wm[w][g]; }, [&](int w) { return wl[w][g]; },
                                  [&](int w) { return wacc[w][g][d]; }, o, L);
#if ATT_CLUSTER
        if (one) {
            cacc[g][d] = o;
            if (d == 0) { cm[g] = M; cl[g] = L; }
            continue;
        }
#endif
        int h = kvh * G + g;
        pacc[((long long)h * NSPLIT + split) * DV + d] = o;
        if (d == 0) { pm[h * NSPLIT + split] = M; pl[h * NSPLIT + split] = L; }
    }
#if ATT_STAGE == 2
    return;  // profiling: stop after the slice results are written
#endif
#if ATT_CLUSTER
    if (one) {
        cluster_sync_all();
        // block `split` merges units split, split + N, ... of the group's outputs (a unit: one
        // rounding group of the output projection's input, else 32 outputs), each output over
        // the N blocks' partial results in their shared memory, then rounds the unit
        constexpr int NV = G * DV;
        int per = aq == 1 ? 32 : 256, base = kvh * NV;
        bool rnd = aq && NV % per == 0;
        int unit = rnd ? per : (NV % 32 == 0 ? 32 : NV);
        __shared__ float cobuf[NV];
        for (int u = split; u < NV / unit; u += ATT_CLUSTER) {
            for (int i = u * unit + tid; i < (u + 1) * unit; i += NT) {
                int g = i / DV, d = i % DV;
                float bm[ATT_CLUSTER], bl[ATT_CLUSTER], ba[ATT_CLUSTER];
                #pragma unroll
                for (int r = 0; r < ATT_CLUSTER; r++) {
                    bm[r] = ld_peer(&cm[g], r); bl[r] = ld_peer(&cl[g], r); ba[r] = ld_peer(&cacc[g][d], r);
                }
                float o, L;
                merge_parts<ATT_CLUSTER>([&](int r) { return bm[r]; }, [&](int r) { return bl[r]; },
                                         [&](int r) { return ba[r]; }, o, L);
                float v = o / L;
                out[base + i] = v;
                cobuf[i - u * unit] = v;
            }
            if (rnd) {  // the output projection's input rounding (qprep_x's work) for this unit
                __syncthreads();
                int ub = base + u * unit;
                if (warp == 0) round_group([&](int i) { return cobuf[i - ub]; }, aq, ub / per, lane, xq, xd, xs16);
                __syncthreads();
            }
        }
        cluster_sync_all();  // this block's partial results stay until every block of the cluster has read them
        return;
    }
#endif
    LAST_BLOCK_OR_RETURN(last, counter + kvh, active);
    if (tid == 0) counter[kvh] = 0;
    // merge. The first 8 slices' partial outputs of this thread's outputs are loaded together
    // with the slice maxima and sums; weights per slice: one warp per query head, lanes over
    // slices; then every output over 8 slices at a time, the next 8 loaded after each batch.
    constexpr int OPT = (G * DV + NT - 1) / NT;
    float pv[8][OPT];
    auto load_batch = [&](int sp0) {
        #pragma unroll
        for (int u = 0; u < 8; u++) {
            #pragma unroll
            for (int j = 0; j < OPT; j++) {
                int i = tid + NT * j;
                pv[u][j] = (i < G * DV && sp0 + u < active)
                    ? __ldcg(pacc + ((long long)(kvh * G + i / DV) * NSPLIT + sp0 + u) * DV + i % DV) : 0.f;
            }
        }
    };
    load_batch(0);
    __shared__ float sm_[G][NSPLIT], sl_[G][NSPLIT];
    for (int i = tid; i < G * active; i += NT) {
        int g = i / active, sp = i % active, h = kvh * G + g;
        sm_[g][sp] = __ldcg(pm + h * NSPLIT + sp);
        sl_[g][sp] = __ldcg(pl + h * NSPLIT + sp);
    }
    __syncthreads();
    for (int g = warp; g < G; g += NW) {
        float M = NEG_INF;
        for (int sp = lane; sp < active; sp += 32) M = fmaxf(M, sm_[g][sp]);
        M = warp_max(M);
        float L = 0.f;
        for (int sp = lane; sp < active; sp += 32) {
            float e = sm_[g][sp] == NEG_INF ? 0.f : expf(sm_[g][sp] - M);
            sw[g][sp] = e;
            L += sl_[g][sp] * e;
        }
        L = warp_sum(L);
        if (lane == 0) sL[g] = L;
    }
    __syncthreads();
    float o[OPT];
    #pragma unroll
    for (int j = 0; j < OPT; j++) o[j] = 0.f;
    for (int sp0 = 0; sp0 < active; sp0 += 8) {
        #pragma unroll
        for (int u = 0; u < 8; u++) {
            #pragma unroll
            for (int j = 0; j < OPT; j++) {
                int i = tid + NT * j;
                if (i < G * DV && sp0 + u < active) o[j] += pv[u][j] * sw[i / DV][sp0 + u];
            }
        }
        if (sp0 + 8 < active) load_batch(sp0 + 8);
    }
    __shared__ float obuf[G * DV];
    #pragma unroll
    for (int j = 0; j < OPT; j++) {
        int i = tid + NT * j;
        if (i < G * DV) {
            float r = o[j] / sL[i / DV];
            out[(kvh * G + i / DV) * DV + i % DV] = r;
            obuf[i] = r;
        }
    }
    if (aq) {  // the output projection's input rounding (qprep_x's work) for this head group
        __syncthreads();
        int per = aq == 1 ? 32 : 256, base = kvh * G * DV;
        for (int gg = warp; gg < G * DV / per; gg += NW)
            round_group([&](int i) { return obuf[i - base]; }, aq, base / per + gg, lane, xq, xd, xs16);
    }
}
"""


ATTN_LANES = 8
"""Lanes a position in decode attention. (16 halves the query and output values a lane keeps,
but measured slower on an H200: Qwen3-4B shape 12.2 vs 11.7 us at 640 positions, 26.5 vs 20.7 at
4000; bench/attn_sweep.py --lanes 8,16.)"""


CLUSTER_MIN = 192
"""Fewest positions a block of a decode-attention cluster takes before the context is cut into
slices over the grid instead (`CLMIN`): one cluster of N blocks takes up to N x 192 positions."""


def attn_warps(group: int, head_dim: int, cluster: int = 0) -> int:
    """Warps of a decode-attention block: 8 where a lane keeps few query/output values
    (group x head_dim / 8 <= 32: two blocks of 256 threads still fit an SM), else 4. Measured on
    an H200 (bench/attn_sweep.py --warps 4,8): SmolLM2 shape 5.9 vs 6.8 us at 640 positions, 9.4
    vs 12.4 at 4000; Qwen3-4B shape 14.8 vs 11.6 and 23.5 vs 20.6 (registers limit it to one
    block an SM). In clusters (`cluster` > 0) 8 up to 512 query values a KV head (the warps'
    partial outputs in shared memory: 16 KB): a cluster's blocks take several times more positions
    each than a slice, so positions a step matter more than blocks an SM (Qwen3-4B shape at 640
    positions: 10.1 us with 8 warps, 11.6 with 4; `Model.generate` 1.044x vs 1.010x)."""
    if cluster and group * head_dim <= 512:
        return 8
    return 8 if group * head_dim // 8 <= 32 else 4


def attn_split(n_sm: int, n_kv_heads: int) -> int:
    """The most slices a KV head's positions take in decode attention on a GPU of `n_sm`
    multiprocessors (`NSPLIT`): two blocks an SM over all KV heads, at most 64 (slices of >= 32
    positions, `min_chunk`)."""
    return max(1, min(64, -(-2 * n_sm // n_kv_heads)))


def attn_blocks(n_split: int, cluster: int) -> int:
    """Blocks a KV head in decode attention: `n_split` slices, or with clusters of `cluster` blocks
    (at most `n_split`: the slices' buffers hold that many) as many whole clusters as fit in
    `n_split`. (Fewer, as many as are resident at once, measured slower past one cluster's
    positions: Qwen3-4B shape 30.6 vs 22.4 us at 4,000.)"""
    if cluster > n_split:
        raise ValueError(f"a cluster of {cluster} blocks does not fit in {n_split} attention slices")
    return cluster * (n_split // cluster) if cluster else n_split


def source(
    types: list[str] | tuple[str, ...],
    *,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    v_head_dim: int,
    rope_half: int,
    neox: bool,
    kv_half: bool,
    n_split: int,
    kv_int8: bool = False,
    min_chunk: int = 32,
    lanes_per_pos: int | None = None,
    warps: int | None = None,
    qgemv_unroll: int = qdot_src.UNROLL,
    qgemv_unroll_glu: int = qdot_src.UNROLL_GLU,
    qgemv_min_blocks: int = 0,
    attn_cluster: int = 0,
    cluster_min: int = CLUSTER_MIN,
    attention_only: bool = False,
) -> str:
    """The decode module for one model shape and the given weight types (`kv_half` / `kv_int8`:
    the cache's element type; `min_chunk`: fewest positions an attention slice takes;
    `qgemv_unroll` / `qgemv_unroll_glu` / `qgemv_min_blocks`: the integer-dot GEMVs' unrolling and
    launch bounds, `qdot_src.source`; `attn_cluster`: 0, or the blocks of one thread-block cluster
    that take a KV head's positions in decode attention, merged through distributed shared memory:
    sm_90+, up to `attn_cluster` x `cluster_min` positions; longer contexts in slices over the grid,
    `attn_blocks` blocks a KV head; `attention_only`: without the GEMVs, for a second module whose
    `attn_decode` a decoder runs past one cluster's positions, `CupyDecoder.long_from`)."""
    shaped = SHAPED
    width = 8 if (kv_half or kv_int8) else 4  # values a lane loads at once: 16 bytes (8 for int8)
    lpp = lanes_per_pos or ATTN_LANES
    if head_dim % (lpp * width) or v_head_dim % (lpp * width):
        lpp = ATTN_LANES  # a tuning value that does not divide the heads: the default
    align = lpp * width
    for k, v in {
        "{H}": n_heads,
        "{KVH}": n_kv_heads,
        "{G}": n_heads // n_kv_heads,
        "{D}": head_dim,
        "{DV}": v_head_dim,
        "{HALF}": rope_half,
        "{NEOX}": int(neox),
        "{NSPLIT}": n_split,
        "{KT}": "signed char" if kv_int8 else "unsigned short" if kv_half else "float",
        "{KVQ}": int(kv_int8),
        "{MINCHUNK}": min_chunk,
        "{LPP}": lpp,
        "{NWARP}": warps or attn_warps(n_heads // n_kv_heads, head_dim, attn_cluster),
        "{ATT_CLUSTER}": attn_cluster,
        "{CLMIN}": cluster_min,
        "{FASTATT}": int(head_dim % align == 0 and v_head_dim % align == 0),
    }.items():
        shaped = shaped.replace(k, str(v))
    if attention_only:
        return UNITS + COMMON + grid_src.LAST_BLOCK + qdot_src.round_source() + shaped
    gemv = "".join(GEMV.replace("{T}", t) for t in sorted(set(types)))
    qdot = qdot_src.source(types, qgemv_unroll, qgemv_unroll_glu, qgemv_min_blocks)
    return UNITS + COMMON + grid_src.LAST_BLOCK + qdot_src.round_source() + gemv + qdot + MISC + shaped
