"""CUDA C of the non-GEMV kernels: activation rounding, RMSNorm, RoPE, decode attention, argmax."""

OPS = r"""
// llama.cpp's activation rounding (NumpyOps.act_quant): q8_0 groups of 32, one warp per group.
// The `_h` kernels store the rounded values as fp16 (cvt.rn, what `astype(float16)` gives) for the
// fp16 prefill GEMMs: rounding and conversion in one launch.
__device__ __forceinline__ void act_store(float* p, float v) { *p = v; }
__device__ __forceinline__ void act_store(unsigned short* p, float v) { *p = f2h(v); }
template <typename Y> __device__ __forceinline__ void act_q8_0_body(const float* x, Y* y, int n_groups) {
    int g = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (g >= n_groups) return;
    float v = x[(long long)g * 32 + lane], a = fabsf(v);
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
    float d = a / 127.0f;
    float inv = d != 0.f ? 1.0f / d : 0.f;
    act_store(y + (long long)g * 32 + lane, rintf(v * inv) * d);
}
extern "C" __global__ void act_q8_0(const float* x, float* y, int n_groups) { act_q8_0_body(x, y, n_groups); }
extern "C" __global__ void act_q8_0_h(const float* x, unsigned short* y, int n_groups) {
    act_q8_0_body(x, y, n_groups);
}
// int8 KV cache write (engine.kv_cache rule, as the decode step's qkv_post): x [T, KV, D] float
// into values q [KV, n_ctx, D] and fp16 scales d [KV, n_ctx, D/32] at positions start..;
// one warp per 32 values.
extern "C" __global__ void kv_store_int8(const float* x, signed char* q, unsigned short* d, int T,
                                         int KV, int D, int n_ctx, int start) {
    long long g = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31, nb = D >> 5;
    if (g >= (long long)T * KV * nb) return;
    int j = (int)(g % nb), h = (int)((g / nb) % KV), t = (int)(g / ((long long)nb * KV));
    float v = x[((long long)t * KV + h) * D + j * 32 + lane], a = fabsf(v);
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
    float s = a / 127.0f;
    long long row = (long long)h * n_ctx + start + t;
    q[row * D + j * 32 + lane] = (signed char)(s > 0.f ? __float2int_rn(v / s) : 0);
    if (lane == 0) d[row * nb + j] = f2h(s);
}
// q8_k: groups of 256, one warp per group; scale from the first value of largest magnitude.
template <typename Y> __device__ __forceinline__ void act_q8_k_body(const float* x, Y* y, int n_groups) {
    int g = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (g >= n_groups) return;
    float v[8];
    float iscale = q8k_group(x + (long long)g * 256, lane, v);
    float d = iscale != 0.f ? 1.0f / iscale : 0.f;
    #pragma unroll
    for (int k = 0; k < 8; k++) act_store(y + (long long)g * 256 + lane + 32*k, fminf(rintf(v[k] * iscale), 127.f) * d);
}
extern "C" __global__ void act_q8_k(const float* x, float* y, int n_groups) { act_q8_k_body(x, y, n_groups); }
extern "C" __global__ void act_q8_k_h(const float* x, unsigned short* y, int n_groups) {
    act_q8_k_body(x, y, n_groups);
}
// The sum of squares of xr[0..n) over the block (`part`: 32 floats of shared memory), in one
// order: what rms_norm and norm_rope divide by. Ends without a barrier after reading part[0]: a
// kernel calling it twice must __syncthreads() between the calls.
__device__ __forceinline__ float block_sumsq(const float* xr, int n, float* part) {
    float s = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += xr[i] * xr[i];
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = s;
    __syncthreads();
    if (threadIdx.x < 32) {
        s = threadIdx.x < (blockDim.x >> 5) ? part[threadIdx.x] : 0.f;
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (threadIdx.x == 0) part[0] = s;
    }
    __syncthreads();
    return part[0];
}
// RMSNorm of each row of n values, one block per row.
extern "C" __global__ void rms_norm(const float* x, const float* w, float* y, int n, float eps) {
    __shared__ float part[32];
    const float* xr = x + (long long)blockIdx.x * n;
    float* yr = y + (long long)blockIdx.x * n;
    float r = sqrtf(block_sumsq(xr, n, part) / (float)n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = xr[i] / r * w[i];
}
// Prefill attention's softmax, in place on scores [KV, T, G, L] (L = end - lo key positions from
// lo): scale, causal + sliding-window mask (query t sits at start + t), max, exp, normalise; one
// block per row. Same float operations as the CuPy expression it replaces (x * scale, masked to
// -inf, x - max, exp, x / sum), one launch instead of ~10.
extern "C" __global__ void causal_softmax(float* s, int L, int T, int G, int start, int lo,
                                          int window, float scale) {
    __shared__ float red[32];
    long long r = blockIdx.x;
    int qpos = start + (int)((r / G) % T);
    float* row = s + r * (long long)L;
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
    float mx = __int_as_float(0xff800000);
    for (int j = tid; j < L; j += blockDim.x) {
        int kp = lo + j;
        float v = row[j] * scale;
        if (kp > qpos || (window && qpos - kp >= window)) v = __int_as_float(0xff800000);
        row[j] = v;
        mx = fmaxf(mx, v);
    }
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    if (lane == 0) red[warp] = mx;
    __syncthreads();
    mx = red[0];
    for (int w = 1; w < nw; w++) mx = fmaxf(mx, red[w]);
    __syncthreads();
    float sum = 0.f;
    for (int j = tid; j < L; j += blockDim.x) { float e = expf(row[j] - mx); row[j] = e; sum += e; }
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane == 0) red[warp] = sum;
    __syncthreads();
    float tot = 0.f;
    for (int w = 0; w < nw; w++) tot += red[w];
    for (int j = tid; j < L; j += blockDim.x) row[j] = row[j] / tot;
}
// RoPE in place on x [T, H, D]; cos/sin [T, half]; neox rotates (i, i+half), else (2i, 2i+1).
extern "C" __global__ void rope(float* x, const float* cs, const float* sn, int T, int H, int D,
                                int half, int neox) {
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)T * H * half) return;
    int i = (int)(idx % half); long long th = idx / half; int t = (int)(th / H);
    float c = cs[(long long)t * half + i], s = sn[(long long)t * half + i];
    float* r = x + th * D;
    int i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
    float x0 = r[i0], x1 = r[i1];
    r[i0] = x0 * c - x1 * s;
    r[i1] = x0 * s + x1 * c;
}
// A prefill pass's query or key heads made ready for attention in one launch: row r = (t, h) of
// x (row t at x + t * ld, head h at + h * D: the heads' columns of the fused QKV output, read in
// place) RMS-normalised by w when w is given (Qwen3's per-head Q/K norm: `rms_norm`'s arithmetic
// and reduction order, its block size min(256, max(32, D rounded up to 32))), then rotated as
// `rope` rotates (tables cs/sn [T, half] from the pass's first position), into y [T, H, D]
// (contiguous). One block per row; D <= 1024.
extern "C" __global__ void norm_rope(const float* x, long long ld, const float* w, float* y, int H, int D,
                                     float eps, const float* cs, const float* sn, int half, int neox) {
    __shared__ float part[32];
    __shared__ float row[1024];
    long long r = blockIdx.x;
    int t = (int)(r / H), h = (int)(r % H);
    const float* xr = x + (long long)t * ld + (long long)h * D;
    float* yr = y + r * D;
    if (w != nullptr) {
        float rr = sqrtf(block_sumsq(xr, D, part) / (float)D + eps);
        for (int i = threadIdx.x; i < D; i += blockDim.x) row[i] = xr[i] / rr * w[i];
    } else {
        for (int i = threadIdx.x; i < D; i += blockDim.x) row[i] = xr[i];
    }
    __syncthreads();
    const float* ct = cs + (long long)t * half;
    const float* st = sn + (long long)t * half;
    for (int j = threadIdx.x; j < D; j += blockDim.x) {
        float out = row[j];
        if (j < 2 * half) {
            int i, i0, i1;
            if (neox) { i = j < half ? j : j - half; i0 = i; i1 = i + half; }
            else { i = j >> 1; i0 = 2 * i; i1 = 2 * i + 1; }
            float c = ct[i], s = st[i], x0 = row[i0], x1 = row[i1];
            out = j == i0 ? x0 * c - x1 * s : x0 * s + x1 * c;
        }
        yr[j] = out;
    }
}
// The prompt cache's device checksum (`engine.kv_file.device_sums`, host twin `host_sum`): over the
// 16-bit units of rows 0..n-1 of one KV array [KV, n_ctx, D] in file order (unit i of head h at
// a + h * pitch + i % width), the sum mod 2^64 of a mix of each unit and its index, so any changed,
// moved or missing unit changes it; one atomic add per warp into out[slot].
extern "C" __global__ void kv_sum16(const unsigned short* a, long long pitch, long long width, long long n,
                                    unsigned long long* out, int slot) {
    unsigned long long acc = 0ull;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        long long h = i / width;
        unsigned long long x = (unsigned long long)a[h * pitch + (i - h * width)] + (unsigned long long)i * 0x9E3779B97F4A7C15ull;
        x *= 0xBF58476D1CE4E5B9ull;
        x ^= x >> 31;
        x *= 0x94D049BB133111EBull;
        x ^= x >> 29;
        acc += x;
    }
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if ((threadIdx.x & 31) == 0) atomicAdd(out + slot, acc);
}
// Greedy sampling on the device: index of the largest value (first one on ties), one block.
extern "C" __global__ void argmax(const float* x, int n, long long* out) {
    __shared__ float bv[1024]; __shared__ int bi[1024];
    float best = __int_as_float(0xff800000); int idx = 0x7fffffff;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = x[i];
        if (v > best) { best = v; idx = i; }
    }
    bv[threadIdx.x] = best; bi[threadIdx.x] = idx;
    __syncthreads();
    for (int s = blockDim.x >> 1; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            float ov = bv[threadIdx.x + s]; int oi = bi[threadIdx.x + s];
            if (ov > bv[threadIdx.x] || (ov == bv[threadIdx.x] && oi < bi[threadIdx.x])) {
                bv[threadIdx.x] = ov; bi[threadIdx.x] = oi;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) *out = bi[0];
}
"""

# Decode attention (one query position), one block per query head, for a KV cache of type KT.
ATTN_HELPERS = r"""
__device__ __forceinline__ float ldkv_float(const float* p) { return *p; }
__device__ __forceinline__ float ldkv_half(const unsigned short* p) { return h2f(*p); }
"""
ATTN = r"""
extern "C" __global__ void attn_decode_{N}(const float* q, const {KT}* K, const {KT}* V,
        float* out, float* scores, int G, int D, int Dv, int n_ctx, int lo, int end, float scale) {
    __shared__ float red[32];
    __shared__ float qs[512];
    int h = blockIdx.x, kvh = h / G;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    for (int i = threadIdx.x; i < D; i += blockDim.x) qs[i] = q[(long long)h * D + i];
    __syncthreads();
    const {KT}* Kh = K + (long long)kvh * n_ctx * D;
    const {KT}* Vh = V + (long long)kvh * n_ctx * Dv;
    float* sc = scores + (long long)h * n_ctx;
    float mx = __int_as_float(0xff800000);
    for (int s = lo + warp; s < end; s += nw) {
        const {KT}* kr = Kh + (long long)s * D;
        float a = 0.f;
        for (int i = lane; i < D; i += 32) a += qs[i] * ldkv_{N}(kr + i);
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
        a *= scale;
        if (lane == 0) sc[s] = a;
        mx = fmaxf(mx, a);
    }
    if (lane == 0) red[warp] = mx;
    __syncthreads();
    if (threadIdx.x == 0) { float m = __int_as_float(0xff800000); for (int w = 0; w < nw; w++) m = fmaxf(m, red[w]); red[31] = m; }
    __syncthreads();
    mx = red[31];
    __syncthreads();
    float sum = 0.f;
    for (int s = lo + threadIdx.x; s < end; s += blockDim.x) { float e = expf(sc[s] - mx); sc[s] = e; sum += e; }
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane == 0) red[warp] = sum;
    __syncthreads();
    if (threadIdx.x == 0) { float t = 0.f; for (int w = 0; w < nw; w++) t += red[w]; red[30] = t; }
    __syncthreads();
    float inv = 1.0f / red[30];
    for (int d = threadIdx.x; d < Dv; d += blockDim.x) {
        float acc = 0.f;
        for (int s = lo; s < end; s++) acc += sc[s] * ldkv_{N}(Vh + (long long)s * Dv + d);
        out[(long long)h * Dv + d] = acc * inv;
    }
}
"""


def source() -> str:
    """Every kernel of this file as one CUDA C translation unit."""
    attn = "".join(
        ATTN.replace("{N}", n).replace("{KT}", kt) for n, kt in (("float", "float"), ("half", "unsigned short"))
    )
    return OPS + ATTN_HELPERS + attn
