"""CUDA C: one function per tensor type that decodes 32 consecutive values of a row ("a unit").

Unit u of a row holds elements 32u..32u+31 for every type (a legacy block; a K-quant sub-block;
for Q6_K one quarter of a half super-block), so one GEMV, dequantize and gather kernel serves all
types. Loads are as wide as the block's alignment allows (Q4_K/Q5_K: 16 bytes; Q4_1: 4 bytes;
the 2-byte-aligned 18/22/34/210-byte blocks: 2 bytes). Layouts: `engine/quants.py`.
"""

UNITS = r"""
// llama.cpp's Q8_K activation rounding (quantize_row_q8_K_ref), shared by every kernel that
// rounds: in a group of 256 held as v[k] = x[lane + 32 k] by one warp, the first value of largest
// magnitude `mx` sets iscale = -127 / mx, and q = min(rint(x * iscale), 127), x' = q / iscale.
__device__ __forceinline__ int q8k_argmax_abs(const float v[8], int lane) {
    float best = -1.f; int bi = 0;
    #pragma unroll
    for (int k = 0; k < 8; k++) {
        float a = fabsf(v[k]); int i = lane + 32 * k;
        if (a > best) { best = a; bi = i; }
    }
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ob = __shfl_xor_sync(0xffffffffu, best, o);
        int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ob > best || (ob == best && oi < bi)) { best = ob; bi = oi; }
    }
    return bi;
}
__device__ __forceinline__ float q8k_iscale(float mx) { return mx != 0.f ? -127.0f / mx : 0.f; }
// One warp's group of 256 at xg (global memory): v[k] = xg[lane + 32 k], and the group's iscale.
__device__ __forceinline__ float q8k_group(const float* xg, int lane, float v[8]) {
    #pragma unroll
    for (int k = 0; k < 8; k++) v[k] = xg[lane + 32*k];
    int bi = q8k_argmax_abs(v, lane);
    return q8k_iscale(xg[bi]);
}
#ifdef __CUDA_ARCH__
__device__ __forceinline__ float h2f(unsigned short h) {
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;
}
__device__ __forceinline__ unsigned short f2h(float f) {
    unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
}
#else  // the same conversions on the host (tests/cuda_host.py compiles the kernels there)
__device__ __forceinline__ float h2f(unsigned short h) { _Float16 v; memcpy(&v, &h, 2); return (float)v; }
__device__ __forceinline__ unsigned short f2h(float f) { _Float16 v = (_Float16)f; unsigned short h; memcpy(&h, &v, 2); return h; }
#endif
__device__ __forceinline__ unsigned int ld16(const unsigned char* p) { return *(const unsigned short*)p; }
__device__ __forceinline__ unsigned int ld32(const unsigned char* p) { return *(const unsigned int*)p; }
// 32 bytes at a 2-byte aligned p as 8 little-endian words: 8 or 9 aligned 4-byte loads and funnel
// shifts instead of 16 2-byte loads (the ninth word, read only when p is not 4-byte aligned, ends
// 2 bytes past the 32: inside a block's next field, or CuPy's 512-byte allocation rounding).
__device__ __forceinline__ void ld_a2x8(const unsigned char* p, unsigned int* r) {
    // aligned by pointer arithmetic, not an integer cast: the loads keep the pointer's space (LDG / LDS)
    const unsigned int* a = (const unsigned int*)(p - ((unsigned int)(unsigned long long)p & 2u));
    unsigned int sh = ((unsigned int)(unsigned long long)p & 2u) * 8u;
    unsigned int w[9];
    #pragma unroll
    for (int i = 0; i < 8; i++) w[i] = a[i];
    w[8] = sh ? a[8] : 0u;
    #pragma unroll
    for (int i = 0; i < 8; i++) r[i] = __funnelshift_r(w[i], w[i + 1], sh);
}

__device__ __forceinline__ void unit_F32(const unsigned char* row, int u, float* v) {
    const float4* p = (const float4*)(row + (long long)u * 128);
    #pragma unroll
    for (int i = 0; i < 8; i++) { float4 a = p[i]; v[4*i] = a.x; v[4*i+1] = a.y; v[4*i+2] = a.z; v[4*i+3] = a.w; }
}
__device__ __forceinline__ void unit_F16(const unsigned char* row, int u, float* v) {
    const uint4* p = (const uint4*)(row + (long long)u * 64);
    #pragma unroll
    for (int i = 0; i < 4; i++) {
        uint4 a = p[i]; unsigned int w[4] = {a.x, a.y, a.z, a.w};
        #pragma unroll
        for (int k = 0; k < 4; k++) { v[8*i+2*k] = h2f(w[k] & 0xffff); v[8*i+2*k+1] = h2f(w[k] >> 16); }
    }
}
__device__ __forceinline__ void unit_BF16(const unsigned char* row, int u, float* v) {
    const uint4* p = (const uint4*)(row + (long long)u * 64);
    #pragma unroll
    for (int i = 0; i < 4; i++) {
        uint4 a = p[i]; unsigned int w[4] = {a.x, a.y, a.z, a.w};
        #pragma unroll
        for (int k = 0; k < 4; k++) {
            v[8*i+2*k] = __uint_as_float(w[k] << 16); v[8*i+2*k+1] = __uint_as_float(w[k] & 0xffff0000u);
        }
    }
}
__device__ __forceinline__ void unit_Q4_0(const unsigned char* row, int u, float* v) {
    const unsigned char* p = row + (long long)u * 18;
    float d = h2f(ld16(p));
    #pragma unroll
    for (int i = 0; i < 8; i++) {
        unsigned int w = ld16(p + 2 + 2*i);
        unsigned int b0 = w & 0xff, b1 = w >> 8;
        v[2*i] = ((int)(b0 & 15) - 8) * d;  v[2*i+1] = ((int)(b1 & 15) - 8) * d;
        v[16+2*i] = ((int)(b0 >> 4) - 8) * d; v[17+2*i] = ((int)(b1 >> 4) - 8) * d;
    }
}
__device__ __forceinline__ void unit_Q4_1(const unsigned char* row, int u, float* v) {
    const unsigned char* p = row + (long long)u * 20;
    unsigned int dm = ld32(p);
    float d = h2f(dm & 0xffff), m = h2f(dm >> 16);
    #pragma unroll
    for (int i = 0; i < 4; i++) {
        unsigned int w = ld32(p + 4 + 4*i);
        #pragma unroll
        for (int k = 0; k < 4; k++) {
            unsigned int b = (w >> (8*k)) & 0xff;
            v[4*i+k] = (float)(b & 15) * d + m; v[16+4*i+k] = (float)(b >> 4) * d + m;
        }
    }
}
__device__ __forceinline__ void unit_Q5_0(const unsigned char* row, int u, float* v) {
    const unsigned char* p = row + (long long)u * 22;
    float d = h2f(ld16(p));
    unsigned int qh = ld16(p + 2) | (ld16(p + 4) << 16);
    #pragma unroll
    for (int i = 0; i < 8; i++) {
        unsigned int w = ld16(p + 6 + 2*i);
        #pragma unroll
        for (int k = 0; k < 2; k++) {
            int j = 2*i + k; unsigned int b = (w >> (8*k)) & 0xff;
            int lo = (int)((b & 15) | (((qh >> j) & 1) << 4)) - 16;
            int hi = (int)((b >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16;
            v[j] = lo * d; v[j+16] = hi * d;
        }
    }
}
__device__ __forceinline__ void unit_Q5_1(const unsigned char* row, int u, float* v) {
    const unsigned char* p = row + (long long)u * 24;
    unsigned int dm = ld32(p);
    float d = h2f(dm & 0xffff), m = h2f(dm >> 16);
    unsigned int qh = ld32(p + 4);
    #pragma unroll
    for (int i = 0; i < 4; i++) {
        unsigned int w = ld32(p + 8 + 4*i);
        #pragma unroll
        for (int k = 0; k < 4; k++) {
            int j = 4*i + k; unsigned int b = (w >> (8*k)) & 0xff;
            v[j] = (float)((b & 15) | (((qh >> j) & 1) << 4)) * d + m;
            v[j+16] = (float)((b >> 4) | (((qh >> (j + 16)) & 1) << 4)) * d + m;
        }
    }
}
__device__ __forceinline__ void unit_Q8_0(const unsigned char* row, int u, float* v) {
    const unsigned char* p = row + (long long)u * 34;
    float d = h2f(ld16(p));
    #pragma unroll
    for (int i = 0; i < 16; i++) {
        unsigned int w = ld16(p + 2 + 2*i);
        v[2*i] = (float)(signed char)(w & 0xff) * d; v[2*i+1] = (float)(signed char)(w >> 8) * d;
    }
}
// Unit u of a Q4_K / Q5_K row of `bytes`-byte super-blocks (fp16 d and dmin, then 12 bytes of
// 6-bit scales and mins): its super-block, and a and b of its sub-block u & 7 (values a * q - b).
__device__ __forceinline__ const unsigned char* k_block(const unsigned char* row, int u, int bytes,
                                                        float* a, float* b) {
    const unsigned char* p = row + (long long)(u >> 3) * bytes;
    int j = u & 7, sc, mn;
    unsigned int dd = ld32(p);
    const unsigned char* s = p + 4;
    if (j < 4) { sc = s[j] & 63; mn = s[j+4] & 63; }
    else { sc = (s[j+4] & 0xF) | ((s[j-4] >> 6) << 4); mn = (s[j+4] >> 4) | ((s[j] >> 6) << 4); }
    *a = h2f(dd & 0xffff) * sc; *b = h2f(dd >> 16) * mn;
    return p;
}
__device__ __forceinline__ void unit_Q4_K(const unsigned char* row, int u, float* v) {
    float a, b;
    const unsigned char* p = k_block(row, u, 144, &a, &b);
    int j = u & 7, shift = (j & 1) * 4;
    const uint4* q = (const uint4*)(p + 16 + 32 * (j >> 1));
    #pragma unroll
    for (int i = 0; i < 2; i++) {
        uint4 c = q[i]; unsigned int w[4] = {c.x, c.y, c.z, c.w};
        #pragma unroll
        for (int k = 0; k < 16; k++) v[16*i+k] = a * (float)((w[k >> 2] >> (8*(k & 3) + shift)) & 15) - b;
    }
}
__device__ __forceinline__ void unit_Q5_K(const unsigned char* row, int u, float* v) {
    float a, b;
    const unsigned char* p = k_block(row, u, 176, &a, &b);
    int j = u & 7, shift = (j & 1) * 4;
    const uint4* h = (const uint4*)(p + 16);
    const uint4* q = (const uint4*)(p + 48 + 32 * (j >> 1));
    #pragma unroll
    for (int i = 0; i < 2; i++) {
        uint4 c = q[i]; unsigned int w[4] = {c.x, c.y, c.z, c.w};
        uint4 e = h[i]; unsigned int hw[4] = {e.x, e.y, e.z, e.w};
        #pragma unroll
        for (int k = 0; k < 16; k++) {
            unsigned int lo = (w[k >> 2] >> (8*(k & 3) + shift)) & 15;
            unsigned int hb = (hw[k >> 2] >> (8*(k & 3) + j)) & 1;
            v[16*i+k] = a * (float)(lo | (hb << 4)) - b;
        }
    }
}
__device__ __forceinline__ void unit_Q6_K(const unsigned char* row, int u, float* v) {
    const unsigned char* p = row + (long long)(u >> 3) * 210;
    int k = u & 7, half = k >> 2, quarter = k & 3;
    const unsigned char* ql = p + half * 64 + (quarter & 1) * 32;
    const unsigned char* qh = p + 128 + half * 32;
    const signed char* sc = (const signed char*)(p + 192 + half * 8 + quarter * 2);
    float d = h2f(ld16(p + 208));
    float s0 = d * (float)sc[0], s1 = d * (float)sc[1];
    int sl = (quarter >> 1) * 4, sh = quarter * 2;
    unsigned int L[8], H[8];  // the 32 bytes of low bits and of high bits (blocks are 2-byte aligned)
    ld_a2x8(ql, L);
    ld_a2x8(qh, H);
    #pragma unroll
    for (int i = 0; i < 16; i++) {
        unsigned int wl = (L[i >> 1] >> (16 * (i & 1))) & 0xffff, wh = (H[i >> 1] >> (16 * (i & 1))) & 0xffff;
        #pragma unroll
        for (int b = 0; b < 2; b++) {
            int l = 2*i + b;
            int q = (int)((((wl >> (8*b)) >> sl) & 15) | ((((wh >> (8*b)) >> sh) & 3) << 4)) - 32;
            v[l] = (l < 16 ? s0 : s1) * (float)q;
        }
    }
}
"""

TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")

# Per type: kernels that use its unit function (GEMV, dequantize to fp16, gather rows to fp32).
PER_TYPE = r"""
extern "C" __global__ void gemv_{T}(const unsigned char* W, long long row_bytes, const float* x,
                                    float* y, const float* bias, int rows, int cols) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int row = blockIdx.x * (blockDim.x >> 5) + warp;
    if (row >= rows) return;
    const unsigned char* r = W + (long long)row * row_bytes;
    int nu = cols >> 5;
    float acc = 0.f;
    for (int u = lane; u < nu; u += 32) {
        float v[32];
        unit_{T}(r, u, v);
        const float4* xp = (const float4*)(x + u * 32);
        #pragma unroll
        for (int i = 0; i < 8; i++) {
            float4 a = xp[i];
            acc += v[4*i] * a.x + v[4*i+1] * a.y + v[4*i+2] * a.z + v[4*i+3] * a.w;
        }
    }
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) y[row] = acc + (bias ? bias[row] : 0.f);
}
// The unit of this thread in a dequantisation of rows x cols: its row, its unit u and its values v;
// false past the last unit.
__device__ __forceinline__ bool dequant_unit_{T}(const unsigned char* W, long long row_bytes, int rows, int cols,
                                                 int& row, int& u, float* v) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    int nu = cols >> 5;
    if (i >= (long long)rows * nu) return false;
    row = (int)(i / nu);
    u = (int)(i % nu);
    unit_{T}(W + (long long)row * row_bytes, u, v);
    return true;
}
extern "C" __global__ void dequant_h_{T}(const unsigned char* W, long long row_bytes,
                                         unsigned short* out, int rows, int cols) {
    int row, u;
    float v[32];
    if (!dequant_unit_{T}(W, row_bytes, rows, cols, row, u, v)) return;
    // 4 x 16-byte stores (rows of cols % 32 == 0 values keep each unit 64-byte aligned)
    uint4* o = (uint4*)(out + (long long)row * cols + u * 32);
    #pragma unroll
    for (int k = 0; k < 4; k++) {
        const float* w = v + 8 * k;
        o[k] = make_uint4((unsigned int)f2h(w[0]) | ((unsigned int)f2h(w[1]) << 16),
                          (unsigned int)f2h(w[2]) | ((unsigned int)f2h(w[3]) << 16),
                          (unsigned int)f2h(w[4]) | ((unsigned int)f2h(w[5]) << 16),
                          (unsigned int)f2h(w[6]) | ((unsigned int)f2h(w[7]) << 16));
    }
}
// Rows 0..rows-1 of W as fp32 (prefill tiles), 8 x 16-byte stores a unit.
extern "C" __global__ void dequant_f_{T}(const unsigned char* W, long long row_bytes,
                                         float* out, int rows, int cols) {
    int row, u;
    float v[32];
    if (!dequant_unit_{T}(W, row_bytes, rows, cols, row, u, v)) return;
    float4* o = (float4*)(out + (long long)row * cols + u * 32);
    #pragma unroll
    for (int k = 0; k < 8; k++) o[k] = make_float4(v[4 * k], v[4 * k + 1], v[4 * k + 2], v[4 * k + 3]);
}
extern "C" __global__ void gather_{T}(const unsigned char* W, long long row_bytes,
                                      const long long* ids, float* out, int n, int cols) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    int nu = cols >> 5;
    if (i >= (long long)n * nu) return;
    int t = (int)(i / nu), u = (int)(i % nu);
    float v[32];
    unit_{T}(W + ids[t] * row_bytes, u, v);
    float* o = out + (long long)t * cols + u * 32;
    #pragma unroll
    for (int k = 0; k < 32; k++) o[k] = v[k];
}
"""


def source() -> str:
    """All unit functions and the per-type kernels."""
    return UNITS + "".join(PER_TYPE.replace("{T}", t) for t in TYPES)
