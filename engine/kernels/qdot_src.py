"""CUDA C: integer dot products of quantized weights with int8-quantized activations (MMVQ style).

llama.cpp's CPU path rounds the activation vector to int8 blocks before a quantized dot product
(q8_0: blocks of 32 for the legacy types; q8_k: blocks of 256 for the K-quants); the NumPy
reference emulates that rounding (`NumpyOps.act_quant`). Here the rounded activations are kept as
what they are (int8 values + one float scale per block, + the sum of each 16 values), so a weight
block meets them with `__dp4a` (4 int8 products a cycle) and one float scaling per block instead
of 32 float FMAs. Same rounding, same values: the result differs from the float path only by
float summation order (measured in tests/test_cupy_decoder.py).

A *chunk* is 32 weights of one row; chunk c of a row holds (per type):
- Q4_K: a 16-byte slice of one pair of sub-blocks' nibbles: low nibbles = 16 values of sub-block
  2j, high nibbles = 16 values of 2j+1 (j = (c & 7) >> 1); plus the 16-byte block header (d, dmin,
  12 scale bytes). Two 16-byte loads.
- Q6_K: 16 bytes of ql (low nibbles: quarter q, high: quarter q+2) + the 16 matching qh bytes;
  210-byte blocks are only 2-byte aligned, so the 16-byte runs are read as 5 aligned words and
  funnel-shifted.
- Q4_1: one 20-byte block (d, m, 16 bytes of nibbles), 4-byte loads.
- Q8_0: one 34-byte block (d + 32 int8), 2-byte aligned: aligned words + funnel shifts.

The plain and two-piece GEMVs read the K-quants in 64-value chunks instead (`PLAIN`: codes
`Q4_K2`, `Q6_K2`): Q4_K's sub-block pair j (32 bytes of nibbles, one header, one scale
unpacking), Q6_K's quarters `pair` and pair + 2 of one half (32 ql + 32 qh bytes as 9 aligned words
each). Their per-chunk integer sums are those of the two 32-value chunks added before the one float
scaling, so they differ from the 32-value kernels by float rounding only.

`ld_<T>(row, c, raw)` loads a chunk's bytes into registers (no dependency on the activations, so
a GEMV issues them before it prepares its input); `dot_<T>(raw, c, xq, xd, xs16)` is the chunk's
contribution given the int8 activations `xq`, their per-block scales `xd` (per 32 for q8_0, per
256 for q8_k) and per-16 sums `xs16`.
"""

from ..options import DEFAULT_OPTIONS

UNROLL = DEFAULT_OPTIONS.qgemv_unroll
"""Default chunks a thread of `qgemv_<T>` loads at once (`EngineOptions.qgemv_unroll`, env
GENIE_QGEMV_UNROLL, for tuning). Timed with the weights coming from DRAM (v7): 2 beats 4 and 8
(fewer registers, more blocks resident; Qwen3-4B-shape step 2.85 ms with 4, 3.13 with 8, head
172 -> 146 us with 2)."""
UNROLL_GLU = DEFAULT_OPTIONS.qgemv_unroll_glu
"""The same for each of the two rows of `qgemv_glu_<T>` (`EngineOptions.qgemv_unroll_glu`)."""

QTYPES = {"Q4_K": 2, "Q6_K": 2, "Q4_1": 1, "Q8_0": 1}
"""Types with an integer dot product, and the activation rounding (AQ code) each one needs."""
PLAIN = {"Q4_K": "Q4_K2", "Q6_K": "Q6_K2", "Q4_1": "Q4_1", "Q8_0": "Q8_0"}
"""The chunk code (`ld_<C>` / `dot_<C>`) of each type's plain and two-piece GEMVs: the K-quants in
64-value chunks there (Q4_K: one header and scale unpacking per 64 values; Q6_K: 22 loads per 64
values instead of 26), 32-value ones in the gate+up kernel (64 needed 64 registers there)."""

QDOT = r"""
// 16 bytes at a 2-byte aligned address, as 4 words (5 aligned loads + funnel shifts).
__device__ __forceinline__ void ld16_a2(const unsigned char* p, unsigned int* o) {
    // aligned by pointer arithmetic, not an integer cast: the loads keep the pointer's space (LDG / LDS)
    const unsigned int* a = (const unsigned int*)(p - ((unsigned int)(unsigned long long)p & 2u));
    unsigned int sh = ((unsigned int)(unsigned long long)p & 2u) * 8u;
    unsigned int w0 = a[0], w1 = a[1], w2 = a[2], w3 = a[3], w4 = a[4];
    o[0] = __funnelshift_r(w0, w1, sh); o[1] = __funnelshift_r(w1, w2, sh);
    o[2] = __funnelshift_r(w2, w3, sh); o[3] = __funnelshift_r(w3, w4, sh);
}

#define QSUMS_Q4_K true
#define QSUMS_Q6_K false
#define QSUMS_Q4_1 true
#define QSUMS_Q8_0 false
// Per chunk code C: QCW_C = log2 of the values a chunk, QU_C(u) the chunks a thread loads at once
// for a given unroll u, QLB_C the launch bounds of a plain kernel reading it (`PLAIN`).
#define QCW_Q4_K 5
#define QCW_Q6_K 5
#define QCW_Q4_1 5
#define QCW_Q8_0 5
#define QU_Q4_K(u) (u)
#define QU_Q6_K(u) (u)
#define QU_Q4_1(u) (u)
#define QU_Q8_0(u) (u)
#ifdef QGEMV_MINB  // EngineOptions.qgemv_min_blocks (tuning): every integer GEMV held to that many blocks an SM
#define QLB_Q4_1 __launch_bounds__(256, QGEMV_MINB)
#define QLB_Q8_0 __launch_bounds__(256, QGEMV_MINB)
#define QLB_KQ2 __launch_bounds__(256, QGEMV_MINB)
#define QLB_GLU __launch_bounds__(256, QGEMV_MINB)
#else
#define QLB_Q4_1 __launch_bounds__(256)
#define QLB_Q8_0 __launch_bounds__(256)
#define QLB_GLU __launch_bounds__(256)
// The 64-value K-quant codes and their two-piece kernels are held to 48 registers (5 blocks an SM)
// at the default unroll; a larger tuning unroll needs more registers than that without spilling.
#if QGEMV_U <= 2
#define QLB_KQ2 __launch_bounds__(256, 5)
#else
#define QLB_KQ2 __launch_bounds__(256)
#endif
#endif
// 64-value chunks a thread loads at once for an unroll u: the bytes of u 32-value chunks
#define QU_KQ2(u) ((u) > 1 ? (u) / 2 : 1)
// The 6-bit scales and mins of sub-blocks 2j and 2j + 1 of a Q4_K block from its header h, packed
// as sc = sc0 | sc1 << 8 and mn = m0 | m1 << 8, without a branch on j (a warp's lanes hold
// different j). The 12 scale bytes s are h.y, h.z, h.w; pair j's bytes sit at byte 2 (j & 1) of a
// word: j < 2, sc = s[2j + i] & 63, m = s[2j + 4 + i] & 63; j >= 2, sc = (s[2j + 4 + i] & 15) |
// (s[2j - 4 + i] >> 6) << 4, m = (s[2j + 4 + i] >> 4) | (s[2j + i] >> 6) << 4 (llama.cpp's
// get_scale_min_k4).
__device__ __forceinline__ void q4k_pair(const uint4& h, int j, unsigned int& sc, unsigned int& mn) {
    unsigned int sh = (j & 1) * 16;
    unsigned int y = h.y >> sh, z = h.z >> sh, w = h.w >> sh;
    unsigned int sc_hi = (w & 0x0f0fu) | ((y >> 2) & 0x3030u), mn_hi = ((w >> 4) & 0x0f0fu) | ((z >> 2) & 0x3030u);
    sc = (j & 2) ? sc_hi : (y & 0x3f3fu);
    mn = (j & 2) ? mn_hi : (z & 0x3f3fu);
}
struct raw_Q4_K { uint4 h; uint4 q; };
__device__ __forceinline__ void ld_Q4_K(const unsigned char* row, int c, raw_Q4_K& r) {
    const unsigned char* p = row + (long long)(c >> 3) * 144;
    int k = c & 7;
    r.h = __ldg((const uint4*)p);
    r.q = __ldg((const uint4*)(p + 16 + 32 * (k >> 1) + 16 * (k & 1)));
}
__device__ __forceinline__ float dot_Q4_K(const raw_Q4_K& r, int c, const signed char* xq,
                                          const float* xd, const int* xs16) {
    int sb = c >> 3, k = c & 7, j = k >> 1;
    int e = sb * 256 + 64 * j + 16 * (k & 1);
    int4 xl = *(const int4*)(xq + e), xh = *(const int4*)(xq + e + 32);
    unsigned int sc, mn;
    q4k_pair(r.h, j, sc, mn);
    int s_lo = xs16[e >> 4], s_hi = xs16[(e >> 4) + 2];
    int lo = 0, hi = 0;
    lo = __dp4a((int)(r.q.x & 0x0F0F0F0Fu), xl.x, lo); hi = __dp4a((int)((r.q.x >> 4) & 0x0F0F0F0Fu), xh.x, hi);
    lo = __dp4a((int)(r.q.y & 0x0F0F0F0Fu), xl.y, lo); hi = __dp4a((int)((r.q.y >> 4) & 0x0F0F0F0Fu), xh.y, hi);
    lo = __dp4a((int)(r.q.z & 0x0F0F0F0Fu), xl.z, lo); hi = __dp4a((int)((r.q.z >> 4) & 0x0F0F0F0Fu), xh.z, hi);
    lo = __dp4a((int)(r.q.w & 0x0F0F0F0Fu), xl.w, lo); hi = __dp4a((int)((r.q.w >> 4) & 0x0F0F0F0Fu), xh.w, hi);
    float d = h2f(r.h.x & 0xffff), dm = h2f(r.h.x >> 16);
    int isc = (int)(sc & 0xffu) * lo + (int)(sc >> 8) * hi;
    int imn = (int)(mn & 0xffu) * s_lo + (int)(mn >> 8) * s_hi;
    return xd[sb] * (d * (float)isc - dm * (float)imn);
}

// Q4_K2: Q4_K in chunks of 64 values (QCW 6; the plain and two-piece GEMVs): sub-blocks 2j and
// 2j + 1 of one block, whose 32 bytes of nibbles, scales and mins go together - one header load
// and one scale unpacking per 64 values.
#define QCW_Q4_K2 6
#define QU_Q4_K2(u) QU_KQ2(u)
#define QLB_Q4_K2 QLB_KQ2  // 48 registers at the default unroll (59 unbounded), no spills: 5 blocks an SM
struct raw_Q4_K2 { uint4 h; uint4 q0; uint4 q1; };
__device__ __forceinline__ void ld_Q4_K2(const unsigned char* row, int c, raw_Q4_K2& r) {
    const unsigned char* p = row + (long long)(c >> 2) * 144;
    int j = c & 3;
    r.h = __ldg((const uint4*)p);
    r.q0 = __ldg((const uint4*)(p + 16 + 32 * j));
    r.q1 = __ldg((const uint4*)(p + 32 + 32 * j));
}
__device__ __forceinline__ float dot_Q4_K2(const raw_Q4_K2& r, int c, const signed char* xq,
                                          const float* xd, const int* xs16) {
    int sb = c >> 2, j = c & 3;
    int e = sb * 256 + 64 * j;
    const int4* xp = (const int4*)(xq + e);
    int4 xl0 = xp[0], xl1 = xp[1], xh0 = xp[2], xh1 = xp[3];
    int4 s16 = *(const int4*)(xs16 + (e >> 4));
    unsigned int sc, mn;
    q4k_pair(r.h, j, sc, mn);
    unsigned int q[8] = {r.q0.x, r.q0.y, r.q0.z, r.q0.w, r.q1.x, r.q1.y, r.q1.z, r.q1.w};
    int xl[8] = {xl0.x, xl0.y, xl0.z, xl0.w, xl1.x, xl1.y, xl1.z, xl1.w};
    int xh[8] = {xh0.x, xh0.y, xh0.z, xh0.w, xh1.x, xh1.y, xh1.z, xh1.w};
    int lo = 0, hi = 0;
    #pragma unroll
    for (int i = 0; i < 8; i++) {
        lo = __dp4a((int)(q[i] & 0x0F0F0F0Fu), xl[i], lo);
        hi = __dp4a((int)((q[i] >> 4) & 0x0F0F0F0Fu), xh[i], hi);
    }
    int s_lo = s16.x + s16.y, s_hi = s16.z + s16.w;
    float d = h2f(r.h.x & 0xffff), dm = h2f(r.h.x >> 16);
    int isc = (int)(sc & 0xffu) * lo + (int)(sc >> 8) * hi;
    int imn = (int)(mn & 0xffu) * s_lo + (int)(mn >> 8) * s_hi;
    return xd[sb] * (d * (float)isc - dm * (float)imn);
}

// Q6_K's four 6-bit values v (0..63) of a word as the signed bytes v - 32: v + 96 <= 159 carries
// into no other byte, and flipping bit 7 subtracts 128 (two instructions; __vsubss4 is emulated).
#define Q6S(v) ((int)(((v) + 0x60606060u) ^ 0x80808080u))
struct raw_Q6_K { unsigned int l[4]; unsigned int h[4]; unsigned int sd; int sc; };
__device__ __forceinline__ void ld_Q6_K(const unsigned char* row, int c, raw_Q6_K& r) {
    const unsigned char* p = row + (long long)(c >> 3) * 210;
    int k = c & 7, hf = k >> 2, pair = (k >> 1) & 1, n0 = (k & 1) * 16;
    ld16_a2(p + hf * 64 + pair * 32 + n0, r.l);
    ld16_a2(p + 128 + hf * 32 + n0, r.h);
    const signed char* s = (const signed char*)(p + 192 + hf * 8 + pair * 2 + (n0 >> 4));
    r.sc = ((int)s[0] & 0xff) | (((int)s[4] & 0xff) << 8);
    r.sd = ld16(p + 208);
}
__device__ __forceinline__ float dot_Q6_K(const raw_Q6_K& r, int c, const signed char* xq,
                                          const float* xd, const int* xs16) {
    int sb = c >> 3, k = c & 7, hf = k >> 2, pair = (k >> 1) & 1, n0 = (k & 1) * 16;
    int e = sb * 256 + hf * 128 + pair * 32 + n0;
    int4 xa = *(const int4*)(xq + e), xb = *(const int4*)(xq + e + 64);
    int xa_[4] = {xa.x, xa.y, xa.z, xa.w}, xb_[4] = {xb.x, xb.y, xb.z, xb.w};
    int sa = 0, sb_ = 0;
    int sh = 2 * pair;
    #pragma unroll
    for (int i = 0; i < 4; i++) {
        unsigned int ql = r.l[i], qh = r.h[i];
        unsigned int t = qh >> sh;
        unsigned int va = (ql & 0x0F0F0F0Fu) + ((t << 4) & 0x30303030u);
        unsigned int vb = ((ql >> 4) & 0x0F0F0F0Fu) + (t & 0x30303030u);
        sa = __dp4a(Q6S(va), xa_[i], sa);
        sb_ = __dp4a(Q6S(vb), xb_[i], sb_);
    }
    int sca = (int)(signed char)(r.sc & 0xff), scb = (int)(signed char)((r.sc >> 8) & 0xff);
    return xd[sb] * h2f(r.sd) * (float)(sca * sa + scb * sb_);
}

// Q6_K2: Q6_K read in chunks of 64 values (QCW 6, the plain and two-piece GEMVs): 32 values of
// quarter `pair` and of quarter pair + 2 of one half - 32 bytes of ql and the half's 32 bytes of qh
// as 9 aligned words each, 4 scale bytes and d: 22 loads for 64 values instead of 26.
#define QCW_Q6_K2 6
#define QU_Q6_K2(u) QU_KQ2(u)
#define QLB_Q6_K2 QLB_KQ2
struct raw_Q6_K2 { unsigned int l[8]; unsigned int h[8]; unsigned int sd; unsigned int sc; };
__device__ __forceinline__ void ld_Q6_K2(const unsigned char* row, int c, raw_Q6_K2& r) {
    const unsigned char* p = row + (long long)(c >> 2) * 210;
    int j = c & 3, hf = j >> 1, pair = j & 1;
    ld_a2x8(p + hf * 64 + pair * 32, r.l);
    ld_a2x8(p + 128 + hf * 32, r.h);
    const unsigned char* s = p + 192 + hf * 8 + pair * 2;
    r.sc = ld16(s) | (ld16(s + 4) << 16);  // scales of values 0-15 / 16-31 of quarter pair, then of pair + 2
    r.sd = ld16(p + 208);
}
__device__ __forceinline__ float dot_Q6_K2(const raw_Q6_K2& r, int c, const signed char* xq,
                                           const float* xd, const int* xs16) {
    int sb = c >> 2, j = c & 3, hf = j >> 1, pair = j & 1;
    int e = sb * 256 + hf * 128 + pair * 32;
    const int4* xp = (const int4*)(xq + e);
    int4 xa0 = xp[0], xa1 = xp[1], xb0 = xp[4], xb1 = xp[5];
    int xa_[8] = {xa0.x, xa0.y, xa0.z, xa0.w, xa1.x, xa1.y, xa1.z, xa1.w};
    int xb_[8] = {xb0.x, xb0.y, xb0.z, xb0.w, xb1.x, xb1.y, xb1.z, xb1.w};
    int sa[2] = {0, 0}, sb_[2] = {0, 0};
    int sh = 2 * pair;
    #pragma unroll
    for (int i = 0; i < 8; i++) {
        unsigned int ql = r.l[i], qh = r.h[i];
        unsigned int t = qh >> sh;
        unsigned int va = (ql & 0x0F0F0F0Fu) + ((t << 4) & 0x30303030u);
        unsigned int vb = ((ql >> 4) & 0x0F0F0F0Fu) + (t & 0x30303030u);
        sa[i >> 2] = __dp4a(Q6S(va), xa_[i], sa[i >> 2]);
        sb_[i >> 2] = __dp4a(Q6S(vb), xb_[i], sb_[i >> 2]);
    }
    int isc = (int)(signed char)(r.sc & 0xff) * sa[0] + (int)(signed char)((r.sc >> 8) & 0xff) * sa[1]
            + (int)(signed char)((r.sc >> 16) & 0xff) * sb_[0] + (int)(signed char)(r.sc >> 24) * sb_[1];
    return xd[sb] * h2f(r.sd) * (float)isc;
}

struct raw_Q4_1 { unsigned int dm; unsigned int q[4]; };
__device__ __forceinline__ void ld_Q4_1(const unsigned char* row, int c, raw_Q4_1& r) {
    const unsigned int* p = (const unsigned int*)(row + (long long)c * 20);
    r.dm = __ldg(p);
    #pragma unroll
    for (int i = 0; i < 4; i++) r.q[i] = __ldg(p + 1 + i);
}
__device__ __forceinline__ float dot_Q4_1(const raw_Q4_1& r, int c, const signed char* xq,
                                          const float* xd, const int* xs16) {
    int e = c * 32;
    int4 xl = *(const int4*)(xq + e), xh = *(const int4*)(xq + e + 16);
    int xl_[4] = {xl.x, xl.y, xl.z, xl.w}, xh_[4] = {xh.x, xh.y, xh.z, xh.w};
    int s = 0;
    #pragma unroll
    for (int i = 0; i < 4; i++) {
        s = __dp4a((int)(r.q[i] & 0x0F0F0F0Fu), xl_[i], s);
        s = __dp4a((int)((r.q[i] >> 4) & 0x0F0F0F0Fu), xh_[i], s);
    }
    float d = h2f(r.dm & 0xffff), m = h2f(r.dm >> 16);
    return xd[c] * (d * (float)s + m * (float)(xs16[2 * c] + xs16[2 * c + 1]));
}

struct raw_Q8_0 { unsigned int d; unsigned int q[8]; };
// The block's 32 quants are read as 9 aligned words when they start 2 bytes into one; the last
// word then reaches 2 bytes past the block (inside CuPy's 512-byte allocation rounding).
__device__ __forceinline__ void ld_Q8_0(const unsigned char* row, int c, raw_Q8_0& r) {
    const unsigned char* p = row + (long long)c * 34;
    r.d = ld16(p);
    ld_a2x8(p + 2, r.q);
}
__device__ __forceinline__ float dot_Q8_0(const raw_Q8_0& r, int c, const signed char* xq,
                                          const float* xd, const int* xs16) {
    const int4* xp = (const int4*)(xq + c * 32);
    int4 x0 = xp[0], x1 = xp[1];
    int s = 0;
    s = __dp4a((int)r.q[0], x0.x, s); s = __dp4a((int)r.q[1], x0.y, s);
    s = __dp4a((int)r.q[2], x0.z, s); s = __dp4a((int)r.q[3], x0.w, s);
    s = __dp4a((int)r.q[4], x1.x, s); s = __dp4a((int)r.q[5], x1.y, s);
    s = __dp4a((int)r.q[6], x1.z, s); s = __dp4a((int)r.q[7], x1.w, s);
    return xd[c] * h2f(r.d) * (float)s;
}
"""

# Input preparation of the integer GEMV, once per matrix input (`qprep_x`, its own small launch):
# x RMS-normalised by nw (if given), then rounded to int8 blocks exactly as `prep_input` /
# `NumpyOps.act_quant` round it (aq 1: q8_0, blocks of 32; aq 2: q8_k, blocks of 256), written to a
# preallocated global buffer as int8 values `xq[cols]`, one float scale per block `xd` and the sum
# of each 16 values `xs16`. One warp per rounding block, 8 a thread block; every thread block
# forms the sum of squares over the whole input itself (same order as before: the values are
# bit-identical to the per-block preparation the GEMV used to do). With q8_k rounding a warp loads
# its share of the norm's weights before the wait for the kernel that writes x, and its share of x
# together with the sum of squares: one dependent memory round trip after the wait instead of three.
ROUND = r"""
__device__ __forceinline__ int sum16(int v) {
    #pragma unroll
    for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
// One warp rounds rounding group g of a vector (aq 1: q8_0, 32 values; aq 2: q8_k, 256) whose
// i-th value is val(i), into xq / xd / xs16 (layout above).
template <typename F>
__device__ __forceinline__ void round_group(F val, int aq, int g, int lane, signed char* __restrict__ xq,
                                            float* __restrict__ xd, int* __restrict__ xs16) {
    if (aq == 1) {
        float v = val(g * 32 + lane);
        float a = warp_max(fabsf(v));
        float d = a / 127.0f;
        float inv = d != 0.f ? 1.0f / d : 0.f;
        int q = (int)rintf(v * inv);
        xq[g * 32 + lane] = (signed char)q;
        int s = sum16(q);
        if ((lane & 15) == 0) xs16[2 * g + (lane >> 4)] = s;
        if (lane == 0) xd[g] = d;
    } else {
        float v[8];
        #pragma unroll
        for (int k = 0; k < 8; k++) v[k] = val(g * 256 + lane + 32 * k);
        int bi = q8k_argmax_abs(v, lane);
        float mx = __shfl_sync(0xffffffffu, v[0], 0);
        #pragma unroll
        for (int k = 0; k < 8; k++) { float t = __shfl_sync(0xffffffffu, v[k], bi & 31); if ((bi >> 5) == k) mx = t; }
        float iscale = q8k_iscale(mx);
        float d = iscale != 0.f ? 1.0f / iscale : 0.f;
        #pragma unroll
        for (int k = 0; k < 8; k++) {
            int q = (int)fminf(rintf(v[k] * iscale), 127.f);
            xq[g * 256 + lane + 32 * k] = (signed char)q;
            int s = sum16(q);
            if ((lane & 15) == 0) xs16[g * 16 + 2 * k + (lane >> 4)] = s;
        }
        if (lane == 0) xd[g] = d;
    }
}
"""
QPREP = r"""
extern "C" __global__ void __launch_bounds__(256) qprep_x(
        const float* __restrict__ x, const float* __restrict__ nw, float eps, int aq, int cols,
        signed char* __restrict__ xq, float* __restrict__ xd, int* __restrict__ xs16) {
    PDL_LAUNCH();
    __shared__ float red[8];
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    int g = blockIdx.x * 8 + warp;
    bool mine = g < (cols >> (aq == 1 ? 5 : 8));
    // q8_k (aq 2): this warp's 256 values of the norm's weights are loaded before the wait
    // (weights: no kernel before writes them), its values of x right after it, together with the
    // sum of squares - one dependent round trip after the wait instead of three (Qwen3-4B shape:
    // decode 1.12x). q8_0 (aq 1) keeps the loads after the sum: the same change made the SmolLM2
    // shape's decode 0.945x (measured, not understood), so that path is the one before.
    bool early = aq == 2 && mine;
    int base = g * 256 + lane;  // value base + 32 k of x (q8_k)
    float nv[8], xv[8];  // the norm's weights and x at value base + 32 k
    #pragma unroll
    for (int k = 0; k < 8; k++) nv[k] = (early && nw) ? nw[base + 32 * k] : 1.f;
    PDL_WAIT();
    #pragma unroll
    for (int k = 0; k < 8; k++) xv[k] = early ? x[base + 32 * k] : 0.f;
    float r = 1.f;
    if (nw) {
        float ss = 0.f;
        #pragma unroll 8
        for (int i = tid; i < cols; i += 256) { float v = x[i]; ss += v * v; }
        ss = warp_sum(ss);
        if (lane == 0) red[warp] = ss;
        __syncthreads();
        float tot = 0.f;
        #pragma unroll
        for (int w = 0; w < 8; w++) tot += red[w];
        r = sqrtf(tot / (float)cols + eps);
    }
    if (!mine) return;
    // the normalised value (x / r * w, as prep_input computes it) is formed where it is rounded;
    // aq a constant in each call, so the index below folds to k (registers, no local memory)
    if (aq == 1) {
        round_group([&](int i) { return nw ? x[i] / r * nw[i] : x[i]; }, 1, g, lane, xq, xd, xs16);
    } else {
        if (nw) {
            #pragma unroll
            for (int k = 0; k < 8; k++) xv[k] = xv[k] / r * nv[k];
        }
        round_group([&](int i) { return xv[(i - base) >> 5]; }, 2, g, lane, xq, xd, xs16);
    }
}
"""

# The integer GEMV of type T over an input already rounded by `qprep_x` (xq, xd, xs16 in global
# memory, read through L1: every row of a block reads the same 2.5-10 KB). `tpr` threads per
# output row (8..256, a power of two; 256 / tpr rows a block; rows strided over the grid); each
# thread takes chunks t, t + tpr, ... (U at a time, loads first). No barrier before the first dot
# product. NR = 2: GLU epilogue, rows r and r + up_off of one output. Epilogues as dgemv_<T>:
# 0 store (+ bias), 1 add, 2 SwiGLU, 3 GeGLU. SUB: the block is number `bid` of `nblk` given to
# this body (a two-piece kernel, below), else the grid's.
QGEMV = r"""
template <int NR, int U>
__device__ __forceinline__ void qload_{T}(raw_{T} (&buf)[NR][U], const unsigned char* W, long long row_bytes,
                                          int row, int rows, int up_off, int c0, int tpr, int nc) {
    if (row >= rows) return;
    #pragma unroll
    for (int r = 0; r < NR; r++) {
        const unsigned char* rp = W + (long long)(row + r * up_off) * row_bytes;
        #pragma unroll
        for (int u = 0; u < U; u++) {
            int c = c0 + u * tpr;
            if (c < nc) ld_{T}(rp, c, buf[r][u]);
        }
    }
}
template <int NR, int U, bool SUB>
__device__ __forceinline__ void qgemv_body_{T}(
        const unsigned char* __restrict__ W, long long row_bytes, int rows, int cols,
        const signed char* __restrict__ xq, const float* __restrict__ xd, const int* __restrict__ xs16,
        float* y, const float* __restrict__ bias, int epi, int up_off, int tpr, int bid, int nblk) {
    __shared__ float part[NR][8];
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int rpb = 256 / tpr, t = tid % tpr, rl = tid / tpr;
    int nc = cols >> QCW_{T};
    int ngroups = (rows + rpb - 1) / rpb;
    int width = tpr < 32 ? tpr : 32;
    int g0 = SUB ? bid : blockIdx.x, gs = SUB ? nblk : gridDim.x;
    raw_{T} buf[NR][U];
    // the first weight chunks are loaded before waiting for the kernel that writes the input
    PDL_LAUNCH();
    bool pre = g0 < ngroups;
    if (pre) qload_{T}<NR, U>(buf, W, row_bytes, g0 * rpb + rl, rows, up_off, t, tpr, nc);
    PDL_WAIT();
    for (int g = g0; g < ngroups; g += gs) {
        int row = g * rpb + rl;
        float acc[NR];
        #pragma unroll
        for (int r = 0; r < NR; r++) acc[r] = 0.f;
        for (int c0 = t; c0 - t < nc; c0 += U * tpr) {
            if (!pre) qload_{T}<NR, U>(buf, W, row_bytes, row, rows, up_off, c0, tpr, nc);
            pre = false;
            if (row < rows) {
                #pragma unroll
                for (int r = 0; r < NR; r++) {
                    #pragma unroll
                    for (int u = 0; u < U; u++) {
                        int c = c0 + u * tpr;
                        if (c < nc) acc[r] += dot_{T}(buf[r][u], c, xq, xd, xs16);
                    }
                }
            }
        }
        // the group's sums, reduced over its threads (every thread of the block reaches this for
        // the same group: the barriers are uniform) and stored
        #pragma unroll
        for (int r = 0; r < NR; r++) {
            for (int o = width >> 1; o > 0; o >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);
        }
        if (tpr > 32) {
            if (lane == 0) {
                #pragma unroll
                for (int r = 0; r < NR; r++) part[r][warp] = acc[r];
            }
            __syncthreads();
            if (t == 0) {
                int w0 = warp, nwr = tpr >> 5;
                #pragma unroll
                for (int r = 0; r < NR; r++) {
                    float s = 0.f;
                    for (int w = 0; w < nwr; w++) s += part[r][w0 + w];
                    acc[r] = s;
                }
            }
            __syncthreads();
        }
        if (t == 0 && row < rows) {
            if (NR == 1) {
                if (epi == 0) y[row] = acc[0] + (bias ? bias[row] : 0.f);
                else y[row] += acc[0];
            } else {
                y[row] = epi == 2 ? glu_silu(acc[0], acc[NR - 1]) : glu_gelu(acc[0], acc[NR - 1]);
            }
        }
    }
}
"""
QGEMV_KERNELS = r"""
extern "C" __global__ void {BOUNDS} qgemv_{T}(
        const unsigned char* __restrict__ W, long long row_bytes, int rows, int cols,
        const signed char* __restrict__ xq, const float* __restrict__ xd, const int* __restrict__ xs16,
        float* y, const float* __restrict__ bias, int epi, int up_off, int tpr) {
    qgemv_body_{P}<1, QU_{P}(QGEMV_U), false>(W, row_bytes, rows, cols, xq, xd, xs16, y, bias, epi, up_off, tpr, 0, 0);
}
"""
# The fused gate+up kernel: two rows a thread (rows r and r + up_off), in the type's 32-value chunks.
QGEMV_GLU = r"""extern "C" __global__ void QLB_GLU qgemv_glu_{T}(
        const unsigned char* __restrict__ W, long long row_bytes, int rows, int cols,
        const signed char* __restrict__ xq, const float* __restrict__ xd, const int* __restrict__ xs16,
        float* y, const float* __restrict__ bias, int epi, int up_off, int tpr) {
    qgemv_body_{T}<2, QU_{T}(QGEMV_UG), false>(W, row_bytes, rows, cols, xq, xd, xs16, y, bias, epi, up_off, tpr, 0, 0);
}
"""

# Two pieces of one matrix in one launch (a mixed QKV: Q and K in Q4_K, V in Q6_K): blocks below
# `nblk_a` run piece A's rows (type A, `tpr_a` threads a row), the others piece B's, written after
# A's `rows_a` outputs. Each block runs one body, so its registers and shared memory are the larger
# of the two kernels', and the rows and sums are those of two separate launches (same bits). Its
# launch bounds are its chunk codes' (the two round alike, so they share them: QLB_KQ2 for the
# K-quants, none for Q4_1 / Q8_0, which spill 28 bytes under QLB_KQ2).
QGEMV_MIX = r"""
extern "C" __global__ void {BOUNDS} qgemv_mix_{A}_{B}(
        const unsigned char* __restrict__ Wa, long long rba, int rows_a, int tpr_a, int nblk_a,
        const unsigned char* __restrict__ Wb, long long rbb, int rows_b, int tpr_b, int cols,
        const signed char* __restrict__ xq, const float* __restrict__ xd, const int* __restrict__ xs16,
        float* y, const float* __restrict__ bias, int epi) {
    if ((int)blockIdx.x < nblk_a)
        qgemv_body_{PA}<1, QU_{PA}(QGEMV_U), true>(Wa, rba, rows_a, cols, xq, xd, xs16, y, bias, epi, 0, tpr_a,
                                          blockIdx.x, nblk_a);
    else
        qgemv_body_{PB}<1, QU_{PB}(QGEMV_U), true>(Wb, rbb, rows_b, cols, xq, xd, xs16, y + rows_a,
                                          bias ? bias + rows_a : nullptr, epi, 0, tpr_b,
                                          blockIdx.x - nblk_a, gridDim.x - nblk_a);
}
"""


def mix_pairs(types: list[str] | tuple[str, ...]) -> list[tuple[str, str]]:
    """The ordered pairs of two different types among `types` that round their input alike, each
    one `qgemv_mix_<A>_<B>` kernel (Q4_K + Q6_K: both q8_k; Q4_1 + Q8_0: both q8_0)."""
    qt = sorted(t for t in set(types) if t in QTYPES)
    return [(a, b) for a in qt for b in qt if a != b and QTYPES[a] == QTYPES[b]]


def source(
    types: list[str] | tuple[str, ...],
    unroll: int = UNROLL,
    unroll_glu: int = UNROLL_GLU,
    min_blocks: int = 0,
) -> str:
    """The integer-dot GEMV kernels for those of `types` that have one (after UNITS + COMMON),
    loading `unroll` chunks at once (`unroll_glu` per row of the fused gate+up kernels), and the
    two-piece kernels of `mix_pairs(types)`; `min_blocks` > 0 holds every one of them to that many
    blocks of 256 threads an SM (`__launch_bounds__`; 0: the rule above, 5 for the 64-value K-quant
    kernels at the default unroll, none for the others)."""
    qt = sorted(t for t in set(types) if t in QTYPES)
    if not qt:
        return ""
    unroll_defs = f"#define QGEMV_U {int(unroll)}\n#define QGEMV_UG {int(unroll_glu)}\n"
    if min_blocks > 0:
        unroll_defs += f"#define QGEMV_MINB {int(min_blocks)}\n"
    bodies = sorted({*qt, *(PLAIN[t] for t in qt)})
    kernels = "".join(
        QGEMV_KERNELS.replace("{BOUNDS}", f"QLB_{PLAIN[t]}").replace("{T}", t).replace("{P}", PLAIN[t])
        + QGEMV_GLU.replace("{T}", t)
        for t in qt
    )
    mixed = "".join(
        QGEMV_MIX.replace("{BOUNDS}", f"QLB_{PLAIN[a]}")
        .replace("{A}", a)
        .replace("{B}", b)
        .replace("{PA}", PLAIN[a])
        .replace("{PB}", PLAIN[b])
        for a, b in mix_pairs(qt)
    )
    return unroll_defs + QDOT + QPREP + "".join(QGEMV.replace("{T}", t) for t in bodies) + kernels + mixed


def round_source() -> str:
    """`round_group` (the rounding of one group of a GEMV input); after UNITS + COMMON."""
    return ROUND
