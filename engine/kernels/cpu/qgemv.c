/*
 * qgemv.c: quantized matrix x vector products over GGUF blocks, for the native CPU backend.
 *
 * The weights stay in their GGUF block layout (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K).
 * The activation row is quantized once per call to the type llama.cpp's CPU backend pairs with
 * the weight type (its "vec_dot_type"), with the arithmetic of its x86 AVX2 build:
 *   Q4_0, Q5_0, Q8_0 -> Q8_0   (blocks of 32, d = amax / 127 stored as fp16, q = rint(x * (127 / amax)))
 *   Q4_1, Q5_1       -> Q8_1   (Q8_0's values plus s = fp16(d * sum(q)), d unrounded)
 *   Q4_K, Q5_K, Q6_K -> Q8_K   (blocks of 256, d = 1 / (-127 / max) in fp32, bsums of 16)
 * The 32-block types accumulate as ggml's AVX2 ggml_vec_dot_*: eight float lanes, lane m holding
 * the integer sum of elements 4m..4m+3 of each block, acc[m] = fma(d_w * d_x, lane, acc[m]) block
 * by block, then the lanes summed pairwise ((0+4)+(2+6)) + ((1+5)+(3+7)) and, for Q4_1 / Q5_1, the
 * float sum of the blocks' m * s added last. The K-quants follow ggml's generic order. Built with
 * -ffp-contract=off, so the only fused multiply-adds are the explicit fmaf() calls: the result is
 * the same on every machine, and equal to llama.cpp's x86 build bit for bit.
 *
 * The second half of the file holds the other operations of llama.cpp's CPU forward pass with
 * the same arithmetic (RMSNorm, RoPE, flash attention over an fp16 KV cache, SwiGLU, GeGLU).
 *
 * Portable C99; the inner loops are written for the compiler's auto-vectorizer (-O3
 * -march=native on x86, -mcpu=native on aarch64). Rows are split across threads with OpenMP when
 * it is available.
 *
 * Activation buffer layout, per row of n values (see qg_act_row_bytes):
 *   32-blocks (Q8_0/Q8_1): float d[nb]; float s[nb]; int8 q[n]          (nb = n / 32)
 *   256-blocks (Q8_K):     float d[nb]; int16 bsums[16 * nb]; int8 q[n]   (nb = n / 256)
 */

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

/* PARALLEL_FOR(cond): the `for` loop after it runs on `nthreads` OpenMP threads (static schedule) when
 * `cond` holds; without OpenMP, on this one. */
#define QG_PRAGMA(x) _Pragma(#x)
#ifdef _OPENMP
#define PARALLEL_FOR(cond) QG_PRAGMA(omp parallel for schedule(static) num_threads(nthreads) if (cond))
#else
#define PARALLEL_FOR(cond)
#endif

/* ggml type ids (GGMLQuantizationType) */
enum {
    QG_Q4_0 = 2, QG_Q4_1 = 3, QG_Q5_0 = 6, QG_Q5_1 = 7, QG_Q8_0 = 8,
    QG_Q4_K = 12, QG_Q5_K = 13, QG_Q6_K = 14
};

/* activation kinds */
enum { QG_ACT_32 = 0, QG_ACT_256 = 1 };

/* ------------------------------------------------------------------------------------------ */
/* fp16 <-> fp32                                                                              */

static float g_f16[65536];
static uint64_t g_hbits[256]; /* byte -> 8 bytes of 0x00 / 0x10 (bit i of the byte -> byte i) */
static int g_ready = 0;

static float f16_bits_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f;
    uint32_t mant = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else if (exp == 0) {
        /* zero or subnormal: mant * 2^-24, exact in float */
        float f = (float)mant * (1.0f / 16777216.0f);
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* fp32 -> fp16 bits, round to nearest even (what F16C's vcvtps2ph and ggml's fallback do). */
static uint16_t f32_to_f16_bits(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) { /* inf or nan */
        return (uint16_t)(sign | (ax > 0x7f800000u ? 0x7e00u : 0x7c00u));
    }
    if (ax >= 0x477ff000u) { /* rounds to >= 65520: overflow to inf */
        return (uint16_t)(sign | 0x7c00u);
    }
    if (ax < 0x38800000u) { /* below 2^-14: half subnormal or zero */
        float af;
        memcpy(&af, &ax, 4);
        af = af + 0.5f; /* the float adder rounds to the half-subnormal grid (ulp 2^-24) */
        uint32_t r;
        memcpy(&r, &af, 4);
        return (uint16_t)(sign | (r - 0x3f000000u));
    }
    uint32_t odd = (ax >> 13) & 1u;
    ax += 0xc8000fffu + odd; /* rebias exponent (-112 << 23) and round half to even */
    return (uint16_t)(sign | (ax >> 13));
}

static float round_f16(float f) { return g_f16[f32_to_f16_bits(f)]; }

static void gelu_table(void);

int qg_init(void) {
    if (g_ready) return 1;
    for (uint32_t i = 0; i < 65536; ++i) g_f16[i] = f16_bits_to_f32((uint16_t)i);
    for (uint32_t b = 0; b < 256; ++b) {
        uint64_t v = 0;
        for (int i = 0; i < 8; ++i) {
            if (b & (1u << i)) v |= (uint64_t)0x10 << (8 * i);
        }
        g_hbits[b] = v; /* little-endian: byte i of v is element i */
    }
    gelu_table();
    g_ready = 1;
#ifdef _OPENMP
    return 2; /* 2 = with OpenMP */
#else
    return 1;
#endif
}

/* test helpers */
uint16_t qg_f32_to_f16(float f) { return f32_to_f16_bits(f); }
float qg_f16_to_f32(uint16_t h) { return f16_bits_to_f32(h); }

static inline float rdf16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return g_f16[v];
}

/* 32 bytes of 0 / 16: the fifth bit of each element of a Q5_0/Q5_1 block (bit j -> element j) */
static inline void high_bits32(const uint8_t *qh, uint8_t *out) {
    for (int i = 0; i < 4; ++i) memcpy(out + 8 * i, &g_hbits[qh[i]], 8);
}

/* ------------------------------------------------------------------------------------------ */
/* activation quantization (ggml's x86 quantize_row_q8_0 / q8_1, quantize_row_q8_K_ref)       */

size_t qg_act_row_bytes(int kind, int n) {
    if (kind == QG_ACT_32) return (size_t)(n / 32) * 8 + (size_t)n;
    return (size_t)(n / 256) * 36 + (size_t)n;
}

/* round to nearest, ties to even, for |f| < 2^22 (ggml's nearest_int; _mm256_round_ps' rule) */
static inline int nearest_int(float f) {
    float v = f + 12582912.0f;
    int32_t i;
    memcpy(&i, &v, 4);
    return (i & 0x007fffff) - 0x00400000;
}

/* ggml's AVX2 quantize_row_q8_0 / q8_1: id = 127 / amax (not 1 / d), ties to even */
static void quant_row_32(const float *x, uint8_t *out, int n) {
    const int nb = n / 32;
    float *d = (float *)out;
    float *s = d + nb;
    int8_t *q = (int8_t *)(s + nb);
    for (int ib = 0; ib < nb; ++ib) {
        const float *xb = x + 32 * ib;
        float amax = 0.0f;
        for (int j = 0; j < 32; ++j) {
            const float v = fabsf(xb[j]);
            amax = amax > v ? amax : v;
        }
        const float dd = amax / 127.0f;
        const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
        int sum = 0;
        for (int j = 0; j < 32; ++j) {
            const int8_t v = (int8_t)nearest_int(xb[j] * id);
            q[32 * ib + j] = v;
            sum += v;
        }
        d[ib] = round_f16(dd);
        s[ib] = round_f16((float)sum * dd);
    }
}

static void quant_row_256(const float *x, uint8_t *out, int n) {
    const int nb = n / 256;
    float *d = (float *)out;
    int16_t *bs = (int16_t *)(d + nb);
    int8_t *q = (int8_t *)(bs + 16 * nb);
    for (int ib = 0; ib < nb; ++ib) {
        const float *xb = x + 256 * ib;
        int8_t *qb = q + 256 * ib;
        float mx = 0.0f, amax = 0.0f;
        for (int j = 0; j < 256; ++j) {
            const float ax = fabsf(xb[j]);
            if (ax > amax) {
                amax = ax;
                mx = xb[j];
            }
        }
        if (amax == 0.0f) {
            d[ib] = 0.0f;
            memset(qb, 0, 256);
            memset(bs + 16 * ib, 0, 32);
            continue;
        }
        const float iscale = -127.0f / mx;
        for (int j = 0; j < 256; ++j) {
            const int v = nearest_int(iscale * xb[j]);
            qb[j] = (int8_t)(v < 127 ? v : 127);
        }
        for (int j = 0; j < 16; ++j) {
            int sum = 0;
            for (int i = 0; i < 16; ++i) sum += qb[16 * j + i];
            bs[16 * ib + j] = (int16_t)sum;
        }
        d[ib] = 1.0f / iscale;
    }
}

/* x: [T, n] float32 (rows ldx apart) -> out: T rows of qg_act_row_bytes(kind, n) */
void qg_quantize(int kind, const float *x, long ldx, int T, int n, uint8_t *out, int nthreads) {
    const size_t rb = qg_act_row_bytes(kind, n);
    (void)nthreads;
    PARALLEL_FOR(T > 1)
    for (int t = 0; t < T; ++t) {
        if (kind == QG_ACT_32) quant_row_32(x + (long)t * ldx, out + rb * t, n);
        else quant_row_256(x + (long)t * ldx, out + rb * t, n);
    }
}

/* ------------------------------------------------------------------------------------------ */
/* row dot products: one weight row (nb blocks) x one quantized activation row               */

typedef float (*dot_fn)(const uint8_t *restrict w, const uint8_t *restrict a, int n);

/*
 * Block primitives: the eight int32 lanes of one 32-block product, lane m = the sum of the
 * products of elements 4m..4m+3 (what ggml's AVX2 madd(maddubs(.)) leaves in each lane), and the
 * float accumulator they are added to with one fma per lane and block. The integer lanes are
 * exact whichever path computes them and fmaf rounds once like vfmadd, so the SIMD path (x86
 * AVX2, chosen by the compiler's own target macros) and the portable C loops give bit-identical
 * results; only their speed differs.
 */
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

typedef __m256i lanes_t;
typedef __m256 facc_t;

static inline facc_t acc_zero(void) { return _mm256_setzero_ps(); }
static inline facc_t acc_fma(facc_t acc, float dd, lanes_t l) {
    return _mm256_fmadd_ps(_mm256_set1_ps(dd), _mm256_cvtepi32_ps(l), acc);
}
/* ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)), ggml's hsum_float_8 */
static inline float acc_sum(facc_t a) {
    __m128 r = _mm_add_ps(_mm256_extractf128_ps(a, 1), _mm256_castps256_ps128(a));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}

static inline int32_t hsum8_i32(__m256i v) {
    __m128i r = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    r = _mm_add_epi32(r, _mm_shuffle_epi32(r, _MM_SHUFFLE(1, 0, 3, 2)));
    r = _mm_add_epi32(r, _mm_shuffle_epi32(r, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(r);
}

/* u8 (0..31 or |signed| <= 128) x s8 -> 8 int32 lanes; no int16 saturation for our ranges */
static inline __m256i madd_us8(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

static inline __m256i load_q4(const uint8_t *qs) {
    const __m128i b = _mm_loadu_si128((const __m128i *)qs);
    const __m128i m = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(b, m);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), m);
    return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
}

static inline __m256i load_hb(const uint8_t *qh) {
    return _mm256_set_epi64x((long long)g_hbits[qh[3]], (long long)g_hbits[qh[2]],
                             (long long)g_hbits[qh[1]], (long long)g_hbits[qh[0]]);
}

/* a weight block ready for madd_us8: `a` the unsigned bytes, `s` the signs to give the activations
 * (signed types: |w| and w, ggml's mul_sum_i8_pairs; unsigned types: w and unused) */
typedef struct { __m256i a, s; } wprep_t;

static inline wprep_t prep_signed(__m256i w) {
    wprep_t p = {_mm256_sign_epi8(w, w), w};
    return p;
}
static inline wprep_t prep_unsigned(__m256i w) {
    wprep_t p = {w, w};
    return p;
}
static inline lanes_t lanes_s(wprep_t p, const int8_t *y) {
    return madd_us8(p.a, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)y), p.s));
}
static inline lanes_t lanes_u(wprep_t p, const int8_t *y) {
    return madd_us8(p.a, _mm256_loadu_si256((const __m256i *)y));
}

static inline wprep_t prep_q4_0(const uint8_t *w) {
    return prep_signed(_mm256_sub_epi8(load_q4(w + 2), _mm256_set1_epi8(8)));
}
static inline wprep_t prep_q4_1(const uint8_t *w) { return prep_unsigned(load_q4(w + 4)); }
static inline wprep_t prep_q5_0(const uint8_t *w) {
    return prep_signed(_mm256_sub_epi8(_mm256_or_si256(load_q4(w + 6), load_hb(w + 2)), _mm256_set1_epi8(16)));
}
static inline wprep_t prep_q5_1(const uint8_t *w) {
    return prep_unsigned(_mm256_or_si256(load_q4(w + 8), load_hb(w + 4)));
}
static inline wprep_t prep_q8_0(const uint8_t *w) {
    return prep_signed(_mm256_loadu_si256((const __m256i *)(w + 2)));
}

#else /* portable C */

typedef struct { int32_t v[8]; } lanes_t;
typedef struct { float v[8]; } facc_t;

static inline facc_t acc_zero(void) {
    facc_t a;
    for (int m = 0; m < 8; ++m) a.v[m] = 0.0f;
    return a;
}
static inline facc_t acc_fma(facc_t acc, float dd, lanes_t l) {
    for (int m = 0; m < 8; ++m) acc.v[m] = fmaf(dd, (float)l.v[m], acc.v[m]);
    return acc;
}
static inline float acc_sum(facc_t a) {
    const float r0 = a.v[0] + a.v[4], r1 = a.v[1] + a.v[5], r2 = a.v[2] + a.v[6], r3 = a.v[3] + a.v[7];
    return (r0 + r2) + (r1 + r3);
}

static inline lanes_t lanes32(const int8_t *restrict x, const int8_t *restrict y) {
    lanes_t l;
    for (int m = 0; m < 8; ++m) {
        l.v[m] = x[4 * m] * y[4 * m] + x[4 * m + 1] * y[4 * m + 1] + x[4 * m + 2] * y[4 * m + 2] +
                 x[4 * m + 3] * y[4 * m + 3];
    }
    return l;
}

static inline void unpack_q4(const uint8_t *restrict qs, int8_t *restrict w8, int off) {
    for (int j = 0; j < 16; ++j) w8[j] = (int8_t)((qs[j] & 0x0F) - off);
    for (int j = 0; j < 16; ++j) w8[j + 16] = (int8_t)((qs[j] >> 4) - off);
}

static inline void unpack_q5(const uint8_t *restrict qh, const uint8_t *restrict qs,
                             int8_t *restrict w8, int off) {
    uint8_t hb[32];
    high_bits32(qh, hb);
    for (int j = 0; j < 16; ++j) w8[j] = (int8_t)(((qs[j] & 0x0F) | hb[j]) - off);
    for (int j = 0; j < 16; ++j) w8[j + 16] = (int8_t)(((qs[j] >> 4) | hb[j + 16]) - off);
}

typedef struct { int8_t v[32]; } wprep_t; /* the block's 32 values in element order */

static inline lanes_t lanes_s(const wprep_t p, const int8_t *y) { return lanes32(p.v, y); }
#define lanes_u lanes_s

static inline wprep_t prep_q4_0(const uint8_t *w) {
    wprep_t p;
    unpack_q4(w + 2, p.v, 8);
    return p;
}
static inline wprep_t prep_q4_1(const uint8_t *w) {
    wprep_t p;
    unpack_q4(w + 4, p.v, 0);
    return p;
}
static inline wprep_t prep_q5_0(const uint8_t *w) {
    wprep_t p;
    unpack_q5(w + 2, w + 6, p.v, 16);
    return p;
}
static inline wprep_t prep_q5_1(const uint8_t *w) {
    wprep_t p;
    unpack_q5(w + 4, w + 8, p.v, 0);
    return p;
}
static inline wprep_t prep_q8_0(const uint8_t *w) {
    wprep_t p;
    memcpy(p.v, w + 2, 32);
    return p;
}

#endif

/*
 * One weight row against K <= 4 activation rows (ggml's vec_dot for each: the weight block is
 * unpacked once and used K times, each output keeps its own accumulator, so every output is
 * computed exactly as alone). Activation rows: float d[nb], float s[nb], int8 q[n].
 */
typedef void (*dotk_fn)(const uint8_t *restrict w, const uint8_t *const *a, int K, int n, float *out);

#define DOT32(NAME, BYTES, HAS_M, PREP, LANES)                                                    \
    static void NAME##_k(const uint8_t *restrict w, const uint8_t *const *a, int K, int n,      \
                         float *out) {                                                          \
        const int nb = n / 32;                                                                  \
        facc_t acc[4];                                                                          \
        float summs[4];                                                                         \
        const float *d[4], *s[4];                                                               \
        const int8_t *q[4];                                                                     \
        for (int k = 0; k < K; ++k) {                                                           \
            acc[k] = acc_zero();                                                                \
            summs[k] = 0.0f;                                                                    \
            d[k] = (const float *)a[k];                                                         \
            s[k] = d[k] + nb;                                                                   \
            q[k] = (const int8_t *)(d[k] + 2 * nb);                                             \
        }                                                                                       \
        for (int ib = 0; ib < nb; ++ib, w += (BYTES)) {                                         \
            const float dw = rdf16(w);                                                          \
            const wprep_t p = PREP(w);                                                          \
            for (int k = 0; k < K; ++k) {                                                       \
                if (HAS_M) summs[k] += rdf16(w + 2) * s[k][ib];                                 \
                acc[k] = acc_fma(acc[k], dw * d[k][ib], LANES(p, q[k] + 32 * ib));              \
            }                                                                                   \
        }                                                                                       \
        for (int k = 0; k < K; ++k) out[k] = HAS_M ? acc_sum(acc[k]) + summs[k] : acc_sum(acc[k]); \
    }                                                                                           \
    static float NAME(const uint8_t *restrict w, const uint8_t *restrict a, int n) {           \
        const uint8_t *rows[1] = {a};                                                           \
        float o;                                                                                \
        NAME##_k(w, rows, 1, n, &o);                                                            \
        return o;                                                                               \
    }

DOT32(dot_q4_0, 18, 0, prep_q4_0, lanes_s)
DOT32(dot_q4_1, 20, 1, prep_q4_1, lanes_u)
DOT32(dot_q5_0, 22, 0, prep_q5_0, lanes_s)
DOT32(dot_q5_1, 24, 1, prep_q5_1, lanes_u)
DOT32(dot_q8_0, 34, 0, prep_q8_0, lanes_s)

/* Q4_K / Q5_K scales: 12 bytes -> 8 six-bit scales and 8 six-bit mins (ggml's utmp shuffle) */
static inline void k_scales(const uint8_t *s, uint8_t *sc, uint8_t *mn) {
    for (int j = 0; j < 4; ++j) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (uint8_t)((s[j + 8] & 0x0F) | ((s[j] >> 6) << 4));
        mn[j + 4] = (uint8_t)((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
    }
}

/*
 * The K-quant dot products keep ggml's eight lane accumulators: aux32[l] sums, over the
 * super-block, scale * q8[i] * a[i] for every element i with i % 8 == l; the float part is
 * sums[l] += d * aux32[l] per super-block, sumf -= dmin * (bsums . mins) per super-block, and
 * finally sumf += sums[0..7] in lane order. `len` elements (a multiple of 8) share one scale;
 * their products fit int16 (|q8 * a| <= 128 * 32, at most four per lane).
 */
static inline void lane_acc(const int8_t *restrict q8, const int8_t *restrict a, int len,
                            int32_t scale, int32_t *restrict aux32) {
    int16_t v[8] = {0};
    for (int k = 0; k < len; k += 8) {
        for (int l = 0; l < 8; ++l) v[l] = (int16_t)(v[l] + q8[k + l] * a[k + l]);
    }
    for (int l = 0; l < 8; ++l) aux32[l] += scale * (int32_t)v[l];
}

/* the 256 values of a Q4_K / Q5_K super-block in element order (ggml's aux8) */
static inline void unpack_k4(const uint8_t *restrict qs, int8_t *restrict a) {
    for (int c = 0; c < 4; ++c) {
        for (int l = 0; l < 32; ++l) {
            a[64 * c + l] = (int8_t)(qs[32 * c + l] & 0x0F);
            a[64 * c + 32 + l] = (int8_t)(qs[32 * c + l] >> 4);
        }
    }
}

/* Q4_K and Q5_K: 8 sub-blocks of 32 with 6-bit scales and mins, the 4-bit values at `qs_at`;
 * Q5_K adds each value's fifth bit from the 32 bytes at `qh_at` (-1: none). */
static float dot_k45(const uint8_t *restrict w, const uint8_t *restrict a, int n,
                     int block_bytes, int qs_at, int qh_at) {
    const int nb = n / 256;
    const float *d = (const float *)a;
    const int16_t *bs = (const int16_t *)(d + nb);
    const int8_t *q = (const int8_t *)(bs + 16 * nb);
    float sums[8] = {0};
    float sumf = 0.0f;
    int8_t aux8[256];
    for (int ib = 0; ib < nb; ++ib, w += block_bytes, q += 256, bs += 16) {
        uint8_t sc[8], mn[8];
        k_scales(w + 4, sc, mn);
        unpack_k4(w + qs_at, aux8);
        if (qh_at >= 0) {
            const uint8_t *qh = w + qh_at;
            for (int j = 0; j < 8; ++j) {
                for (int l = 0; l < 32; ++l) aux8[32 * j + l] = (int8_t)(aux8[32 * j + l] | (((qh[l] >> j) & 1) << 4));
            }
        }
        int32_t aux32[8] = {0};
        for (int j = 0; j < 8; ++j) lane_acc(q + 32 * j, aux8 + 32 * j, 32, sc[j], aux32);
        int sumi = 0;
        for (int j = 0; j < 16; ++j) sumi += bs[j] * mn[j / 2];
        const float dd = rdf16(w) * d[ib];
        for (int l = 0; l < 8; ++l) sums[l] += dd * (float)aux32[l];
        const float dmin = rdf16(w + 2) * d[ib];
        sumf -= dmin * (float)sumi;
    }
    for (int l = 0; l < 8; ++l) sumf += sums[l];
    return sumf;
}

/* Q4_K's eight 32-element sub-block integer dots of one super-block, each times its scale
 * (isub[s] = sc[s] * sum w*q over sub-block s), split by the eight AVX2 lanes too
 * (lane[m] = sum_s sc[s] * sum over elements 4m..4m+3 of sub-block s), and the mins term
 * imin[p] = mn[2p] * bsum32[2p] + mn[2p+1] * bsum32[2p+1] (bsum32: sum of a sub-block's q).
 * isub or lane may be NULL when the caller's order does not use them. */
static inline void q4k_ints(const uint8_t *restrict w, const int8_t *restrict q, const int16_t *bs,
                            int32_t isub[8], int32_t lane[8], int32_t imin[4]) {
    uint8_t sc[8], mn[8];
    k_scales(w + 4, sc, mn);
#if defined(__AVX2__) && defined(__FMA__)
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256i lanes = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) { /* 64 elements: sub-block 2j the low nibbles, 2j+1 the high */
        const __m256i b = _mm256_loadu_si256((const __m256i *)(w + 16 + 32 * j));
        const __m256i pl = madd_us8(_mm256_and_si256(b, m4), _mm256_loadu_si256((const __m256i *)(q + 64 * j)));
        const __m256i ph = madd_us8(_mm256_and_si256(_mm256_srli_epi16(b, 4), m4),
                                    _mm256_loadu_si256((const __m256i *)(q + 64 * j + 32)));
        if (isub) {
            isub[2 * j] = sc[2 * j] * hsum8_i32(pl);
            isub[2 * j + 1] = sc[2 * j + 1] * hsum8_i32(ph);
        }
        if (lane) {
            lanes = _mm256_add_epi32(lanes, _mm256_add_epi32(_mm256_mullo_epi32(pl, _mm256_set1_epi32(sc[2 * j])),
                                                             _mm256_mullo_epi32(ph, _mm256_set1_epi32(sc[2 * j + 1]))));
        }
    }
    if (lane) _mm256_storeu_si256((__m256i *)lane, lanes);
#else
    int8_t aux8[256];
    unpack_k4(w + 16, aux8);
    int32_t lanes[8] = {0};
    for (int sb = 0; sb < 8; ++sb) {
        int32_t tot = 0;
        for (int m = 0; m < 8; ++m) {
            const int8_t *x = aux8 + 32 * sb + 4 * m, *y = q + 32 * sb + 4 * m;
            const int32_t v = x[0] * y[0] + x[1] * y[1] + x[2] * y[2] + x[3] * y[3];
            lanes[m] += sc[sb] * v;
            tot += v;
        }
        if (isub) isub[sb] = sc[sb] * tot;
    }
    if (lane) memcpy(lane, lanes, sizeof(lanes));
#endif
    for (int p = 0; p < 4; ++p) {
        imin[p] = mn[2 * p] * (bs[4 * p] + bs[4 * p + 1]) + mn[2 * p + 1] * (bs[4 * p + 2] + bs[4 * p + 3]);
    }
}

/* Q4_K as ggml's AVX2 ggml_vec_dot_q4_K_q8_K (matrices llama.cpp does not repack): eight lanes
 * acc[m] = fma(d_x * d_w, lane[m], acc[m]), four mins lanes with -d_x * dmin_w, then
 * hsum(acc) + ((m0 + m2) + (m1 + m3)). */
static float dot_q4_k(const uint8_t *restrict w, const uint8_t *restrict a, int n) {
    const int nb = n / 256;
    const float *d = (const float *)a;
    const int16_t *bs = (const int16_t *)(d + nb);
    const int8_t *q = (const int8_t *)(bs + 16 * nb);
    float acc[8] = {0}, accm[4] = {0};
    for (int ib = 0; ib < nb; ++ib, w += 144) {
        int32_t lane[8], imin[4];
        q4k_ints(w, q + 256 * ib, bs + 16 * ib, NULL, lane, imin);
        const float dd = d[ib] * rdf16(w), dmin = -d[ib] * rdf16(w + 2);
        for (int p = 0; p < 4; ++p) accm[p] = fmaf(dmin, (float)imin[p], accm[p]);
        for (int m = 0; m < 8; ++m) acc[m] = fmaf(dd, (float)lane[m], acc[m]);
    }
    const float r0 = acc[0] + acc[4], r1 = acc[1] + acc[5], r2 = acc[2] + acc[6], r3 = acc[3] + acc[7];
    return ((r0 + r2) + (r1 + r3)) + ((accm[0] + accm[2]) + (accm[1] + accm[3]));
}

/* Q4_K as llama.cpp's AVX2 repacked (8x8) kernels compute it, for matrices of rows % 8 == 0.
 * gemv (single rows and a batch's last T % 4 rows): per super-block acc = fma(sum_s isub[s],
 * d_w * d_x, acc) and accmin = fma(sum_p imin[p], dmin_w * d_x, accmin); gemm (a batch's rows in
 * groups of four): one fma of each per pair of sub-blocks. Result acc - accmin. */
static float dot_q4_k_repacked(const uint8_t *restrict w, const uint8_t *restrict a, int n, int gemm) {
    const int nb = n / 256;
    const float *d = (const float *)a;
    const int16_t *bs = (const int16_t *)(d + nb);
    const int8_t *q = (const int8_t *)(bs + 16 * nb);
    float acc = 0.0f, accmin = 0.0f;
    for (int ib = 0; ib < nb; ++ib, w += 144) {
        int32_t isub[8], imin[4];
        q4k_ints(w, q + 256 * ib, bs + 16 * ib, isub, NULL, imin);
        const float dd = rdf16(w) * d[ib], dm = rdf16(w + 2) * d[ib];
        if (gemm) {
            for (int p = 0; p < 4; ++p) {
                acc = fmaf((float)(isub[2 * p] + isub[2 * p + 1]), dd, acc);
                accmin = fmaf((float)imin[p], dm, accmin);
            }
        } else {
            int32_t tot = 0;
            for (int sb = 0; sb < 8; ++sb) tot += isub[sb];
            acc = fmaf((float)tot, dd, acc);
            accmin = fmaf((float)(imin[0] + imin[1] + imin[2] + imin[3]), dm, accmin);
        }
    }
    return acc - accmin;
}

static float dot_q5_k(const uint8_t *restrict w, const uint8_t *restrict a, int n) {
    return dot_k45(w, a, n, 176, 48, 16);
}

/* Q6_K's eight int32 lanes of one super-block (ggml's AVX2 order): lane m sums
 * scale * (w - 32) * q over elements 4m..4m+3 of each 32-element chunk c, the chunk's first 16
 * elements with scale 2c, the rest with 2c + 1 */
static inline void q6k_lanes(const uint8_t *restrict w, const int8_t *restrict q, int32_t lane[8]) {
    const int8_t *scales = (const int8_t *)(w + 192);
#if defined(__AVX2__) && defined(__FMA__)
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3), k32 = _mm256_set1_epi8(32);
    __m256i acc = _mm256_setzero_si256();
    for (int h = 0; h < 2; ++h) {
        const __m256i l1 = _mm256_loadu_si256((const __m256i *)(w + 64 * h));
        const __m256i l2 = _mm256_loadu_si256((const __m256i *)(w + 64 * h + 32));
        const __m256i hb = _mm256_loadu_si256((const __m256i *)(w + 128 + 32 * h));
        __m256i c[4];
        c[0] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_slli_epi16(_mm256_and_si256(hb, m3), 4));
        c[1] = _mm256_or_si256(_mm256_and_si256(l2, m4),
                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2), m3), 4));
        c[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 4), m3), 4));
        c[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l2, 4), m4),
                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 6), m3), 4));
        for (int k = 0; k < 4; ++k) {
            const __m256i y = _mm256_loadu_si256((const __m256i *)(q + 128 * h + 32 * k));
            const __m256i p16 = _mm256_sub_epi16(_mm256_maddubs_epi16(c[k], y), _mm256_maddubs_epi16(k32, y));
            const short s0 = scales[2 * (4 * h + k)], s1 = scales[2 * (4 * h + k) + 1];
            const __m256i sv = _mm256_setr_epi16(s0, s0, s0, s0, s0, s0, s0, s0, s1, s1, s1, s1, s1, s1, s1, s1);
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p16, sv));
        }
    }
    _mm256_storeu_si256((__m256i *)lane, acc);
#else
    int8_t aux8[256];
    for (int h = 0; h < 2; ++h) {
        const uint8_t *ql = w + 64 * h;
        const uint8_t *qh = w + 128 + 32 * h;
        int8_t *o = aux8 + 128 * h;
        for (int l = 0; l < 32; ++l) {
            o[l] = (int8_t)(((ql[l] & 0x0F) | (((qh[l] >> 0) & 3) << 4)) - 32);
            o[l + 32] = (int8_t)(((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32);
            o[l + 64] = (int8_t)(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
            o[l + 96] = (int8_t)(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
        }
    }
    for (int m = 0; m < 8; ++m) lane[m] = 0;
    for (int c = 0; c < 8; ++c) {
        for (int m = 0; m < 8; ++m) {
            const int8_t *x = aux8 + 32 * c + 4 * m, *y = q + 32 * c + 4 * m;
            lane[m] += scales[2 * c + (m >> 2)] * (x[0] * y[0] + x[1] * y[1] + x[2] * y[2] + x[3] * y[3]);
        }
    }
#endif
}

/* Q6_K as llama.cpp's repacked (8x8) kernel computes it for matrices of rows % 8 == 0: per
 * super-block one fma of the whole integer sum (sum of scale * (w - 32) * q) times d_w * d_x.
 * (llama.cpp's gemm for a batch's rows in groups of four may group the sum differently.) */
static float dot_q6_k_repacked(const uint8_t *restrict w, const uint8_t *restrict a, int n) {
    const int nb = n / 256;
    const float *d = (const float *)a;
    const int16_t *bs = (const int16_t *)(d + nb);
    const int8_t *q = (const int8_t *)(bs + 16 * nb);
    float acc = 0.0f;
    for (int ib = 0; ib < nb; ++ib, w += 210, q += 256) {
        int32_t lane[8];
        q6k_lanes(w, q, lane);
        int32_t tot = 0;
        for (int m = 0; m < 8; ++m) tot += lane[m];
        acc = fmaf((float)tot, rdf16(w + 208) * d[ib], acc);
    }
    return acc;
}

/* Q6_K as ggml's AVX2 ggml_vec_dot_q6_K_q8_K: per super-block eight int lanes, lane m summing
 * scale * (w - 32) * q over elements 4m..4m+3 of each 32-element chunk (the chunk's first 16
 * with scale 2c, the rest with 2c+1), acc[m] = fma(d_x * d_w, lane[m], acc[m]); hsum at the end. */
static float dot_q6_k(const uint8_t *restrict w, const uint8_t *restrict a, int n) {
    const int nb = n / 256;
    const float *d = (const float *)a;
    const int16_t *bs = (const int16_t *)(d + nb);
    const int8_t *q = (const int8_t *)(bs + 16 * nb);
    float acc[8] = {0};
    for (int ib = 0; ib < nb; ++ib, w += 210, q += 256) {
        int32_t lane[8];
        q6k_lanes(w, q, lane);
        const float dd = d[ib] * rdf16(w + 208);
        for (int m = 0; m < 8; ++m) acc[m] = fmaf(dd, (float)lane[m], acc[m]);
    }
    const float r0 = acc[0] + acc[4], r1 = acc[1] + acc[5], r2 = acc[2] + acc[6], r3 = acc[3] + acc[7];
    return (r0 + r2) + (r1 + r3);
}

/* the row dot of a weight type, its K-row form where it has one (else *dotk = 0) */
static dot_fn dot_for(int type, int *block, int *bytes, int *kind, dotk_fn *dotk) {
    *dotk = 0;
    switch (type) {
    case QG_Q4_0: *block = 32; *bytes = 18; *kind = QG_ACT_32; *dotk = dot_q4_0_k; return dot_q4_0;
    case QG_Q4_1: *block = 32; *bytes = 20; *kind = QG_ACT_32; *dotk = dot_q4_1_k; return dot_q4_1;
    case QG_Q5_0: *block = 32; *bytes = 22; *kind = QG_ACT_32; *dotk = dot_q5_0_k; return dot_q5_0;
    case QG_Q5_1: *block = 32; *bytes = 24; *kind = QG_ACT_32; *dotk = dot_q5_1_k; return dot_q5_1;
    case QG_Q8_0: *block = 32; *bytes = 34; *kind = QG_ACT_32; *dotk = dot_q8_0_k; return dot_q8_0;
    case QG_Q4_K: *block = 256; *bytes = 144; *kind = QG_ACT_256; return dot_q4_k;
    case QG_Q5_K: *block = 256; *bytes = 176; *kind = QG_ACT_256; return dot_q5_k;
    case QG_Q6_K: *block = 256; *bytes = 210; *kind = QG_ACT_256; return dot_q6_k;
    default: return 0;
    }
}

/* activation kind of a weight type, -1 when unsupported */
int qg_act_kind(int type) {
    int b, s, k;
    dotk_fn dk;
    return dot_for(type, &b, &s, &k, &dk) ? k : -1;
}

/*
 * y[t, r] = dot(w row r, xq row t) (+ bias[r]) for r < rows, t < T.
 * w: rows x (n / block * bytes) bytes; xq: T rows of qg_act_row_bytes(kind, n);
 * y: row t at y + t * ldy. Returns 0, or -1 for an unsupported type / size.
 */
int qg_gemm(int type, const uint8_t *w, int rows, int n, const uint8_t *xq, int T,
            float *y, long ldy, const float *bias, int nthreads) {
    int block, bytes, kind;
    dotk_fn dotk;
    dot_fn dot = dot_for(type, &block, &bytes, &kind, &dotk);
    if (!dot || n % block) return -1;
    const size_t wrb = (size_t)(n / block) * bytes;
    const size_t arb = qg_act_row_bytes(kind, n);
    (void)nthreads;
    if (type == QG_Q6_K && rows % 8 == 0) dot = dot_q6_k_repacked; /* repacked by llama.cpp */
    if (type == QG_Q4_K && rows % 8 == 0) {
        /* repacked by llama.cpp into 8x8 tiles: activation rows in groups of four (the first
         * T - T % 4 of a batch of T > 3) take its gemm order, the others its gemv order */
        const int tg = T > 3 ? T - T % 4 : 0;
        PARALLEL_FOR(rows >= 64)
        for (int r = 0; r < rows; ++r) {
            for (int t = 0; t < T; ++t) {
                const float v = dot_q4_k_repacked(w + wrb * r, xq + arb * t, n, t < tg);
                y[ldy * t + r] = bias ? v + bias[r] : v;
            }
        }
        return 0;
    }
    if (T == 1) {
        PARALLEL_FOR(rows >= 64)
        for (int r = 0; r < rows; ++r) {
            float v = dot(w + wrb * r, xq, n);
            y[r] = bias ? v + bias[r] : v;
        }
        return 0;
    }
    /* T > 1: tiles of rows x all T (the weight tile stays in L1 while the activations stream), four
     * activation rows at a time for the types with a K-row dot */
    const int RT = 8;
    const int ntiles = (rows + RT - 1) / RT;
    PARALLEL_FOR(1) /* every tile */
    for (int tile = 0; tile < ntiles; ++tile) {
        const int r0 = tile * RT;
        const int r1 = r0 + RT < rows ? r0 + RT : rows;
        for (int t = 0; t < T; t += 4) {
            const int K = T - t < 4 ? T - t : 4;
            const uint8_t *a[4];
            for (int k = 0; k < K; ++k) a[k] = xq + arb * (t + k);
            for (int r = r0; r < r1; ++r) {
                float v[4];
                if (dotk) {
                    dotk(w + wrb * r, a, K, n, v);
                } else {
                    for (int k = 0; k < K; ++k) v[k] = dot(w + wrb * r, a[k], n);
                }
                for (int k = 0; k < K; ++k) y[ldy * (t + k) + r] = bias ? v[k] + bias[r] : v[k];
            }
        }
    }
    return 0;
}

/* dequantization is left to NumPy (engine.quants): only rows of the embedding are needed */

int qg_max_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

/* ========================================================================================== */
/* The rest of llama.cpp's CPU forward pass, with the arithmetic of its x86 AVX2 build          */
/* (ggml-cpu ops.cpp / vec.h): every float operation below happens in the same order with the */
/* same rounding, fmaf() exactly where that build fuses, libm's expf/cosf/sinf/powf where it  */
/* calls them. Rows are independent of each other, so results do not depend on batching.     */
/* ========================================================================================== */

/* RMSNorm: double sum of float squares, mean rounded to float, y = (x * (1 / sqrtf(mean + eps))) * w.
 * x: T rows of n, ldx apart; y: T rows of n (contiguous). */
void qg_rms_norm(const float *x, long ldx, const float *w, float *y, int T, int n, float eps,
                 int nthreads) {
    (void)nthreads;
    PARALLEL_FOR(T > 16)
    for (int t = 0; t < T; ++t) {
        const float *xr = x + (long)t * ldx;
        float *yr = y + (long)t * n;
        double sum = 0.0;
        for (int i = 0; i < n; ++i) sum += (double)(xr[i] * xr[i]);
        const float mean = (float)(sum / n);
        const float scale = 1.0f / sqrtf(mean + eps);
        for (int i = 0; i < n; ++i) yr[i] = (xr[i] * scale) * w[i];
    }
}

/* RoPE tables for positions p0..p0+T-1: theta starts at (float)p and is multiplied by
 * powf(base, -2 / n_dims) once per pair (float), cos/sin from libm of freq_scale * theta.
 * cos_out/sin_out: [T, n_dims / 2]. */
void qg_rope_cache(int p0, int T, int n_dims, float base, float freq_scale, float *cos_out,
                   float *sin_out) {
    const float theta_scale = powf(base, -2.0f / (float)n_dims);
    const int half = n_dims / 2;
    for (int t = 0; t < T; ++t) {
        float theta = (float)(p0 + t);
        for (int i = 0; i < half; ++i) {
            const float th = freq_scale * theta;
            cos_out[(long)t * half + i] = cosf(th);
            sin_out[(long)t * half + i] = sinf(th);
            theta *= theta_scale;
        }
    }
}

/* Rotate x [T, H, D] in place; the first n_rot dims of each head rotate, pair i uses
 * cos/sin[t, i] ([T, n_rot / 2]). neox: pairs (i, i + n_rot/2); else (2i, 2i + 1).
 * x0' = fma(x0, c, -(x1 * s)), x1' = fma(x0, s, x1 * c): how GCC contracts ggml's
 * `x0*c - x1*s` / `x0*s + x1*c` (the other ways to fuse them, or none, all diverge from
 * llama.cpp's logits on the oracle fixtures). */
void qg_rope(float *x, int T, int H, int D, int n_rot, const float *cs, const float *sn, int neox,
             int nthreads) {
    const int half = n_rot / 2;
    (void)nthreads;
    PARALLEL_FOR(T > 16)
    for (int t = 0; t < T; ++t) {
        const float *c = cs + (long)t * half;
        const float *s = sn + (long)t * half;
        for (int h = 0; h < H; ++h) {
            float *v = x + ((long)t * H + h) * D;
            for (int i = 0; i < half; ++i) {
                const int i0 = neox ? i : 2 * i;
                const int i1 = neox ? i + half : 2 * i + 1;
                const float x0 = v[i0], x1 = v[i1];
                v[i0] = fmaf(x0, c[i], -(x1 * s[i]));
                v[i1] = fmaf(x0, s[i], x1 * c[i]);
            }
        }
    }
}

/* ggml_vec_dot_f16 (AVX2): four accumulators of eight lanes over 32-element steps, element
 * i + 8j + l into accumulator j lane l; reduced (0+2) + (1+3), then lanes (l + l+4), then
 * pairwise; a remainder adds float products into a double. */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QG_F16C 1
static float dot_f16_ggml(const uint16_t *k, const uint16_t *q, int n) {
    const int np = n & ~31;
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int i = 0; i < np; i += 32) {
        for (int j = 0; j < 4; ++j) {
            const __m256 a = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(k + i + 8 * j)));
            const __m256 b = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(q + i + 8 * j)));
            acc[j] = _mm256_fmadd_ps(a, b, acc[j]);
        }
    }
    acc[0] = _mm256_add_ps(acc[0], acc[2]);
    acc[1] = _mm256_add_ps(acc[1], acc[3]);
    acc[0] = _mm256_add_ps(acc[0], acc[1]);
    const __m128 t0 = _mm_add_ps(_mm256_castps256_ps128(acc[0]), _mm256_extractf128_ps(acc[0], 1));
    const __m128 t1 = _mm_hadd_ps(t0, t0);
    double sum = (double)_mm_cvtss_f32(_mm_hadd_ps(t1, t1));
    for (int i = np; i < n; ++i) sum += (double)(g_f16[k[i]] * g_f16[q[i]]);
    return (float)sum;
}
#else
#define QG_F16C 0
static float dot_f16_ggml(const uint16_t *k, const uint16_t *q, int n) {
    const int np = n & ~31;
    float acc[4][8];
    for (int j = 0; j < 4; ++j) for (int l = 0; l < 8; ++l) acc[j][l] = 0.0f;
    for (int i = 0; i < np; i += 32) {
        for (int j = 0; j < 4; ++j) {
            for (int l = 0; l < 8; ++l) {
                acc[j][l] = fmaf(g_f16[k[i + 8 * j + l]], g_f16[q[i + 8 * j + l]], acc[j][l]);
            }
        }
    }
    float x0[8];
    for (int l = 0; l < 8; ++l) {
        const float a = acc[0][l] + acc[2][l];
        const float b = acc[1][l] + acc[3][l];
        x0[l] = a + b;
    }
    const float t0 = x0[0] + x0[4], t1 = x0[1] + x0[5], t2 = x0[2] + x0[6], t3 = x0[3] + x0[7];
    double sum = (double)((t0 + t1) + (t2 + t3));
    for (int i = np; i < n; ++i) sum += (double)(g_f16[k[i]] * g_f16[q[i]]);
    return (float)sum;
}
#endif

/* fp16 accumulator updates of the flash attention: y = fp16(y * v), y = fp16(fma(x, v, y)) */
static inline void scale_f16(uint16_t *y, float v, int n) {
    int i = 0;
#if QG_F16C
    const __m256 vv = _mm256_set1_ps(v);
    for (; i + 8 <= n; i += 8) {
        const __m256 a = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(y + i))), vv);
        _mm_storeu_si128((__m128i *)(y + i), _mm256_cvtps_ph(a, 0));
    }
#endif
    for (; i < n; ++i) y[i] = f32_to_f16_bits(g_f16[y[i]] * v);
}

static inline void mad_f16(uint16_t *y, const uint16_t *x, float v, int n) {
    int i = 0;
#if QG_F16C
    const __m256 vv = _mm256_set1_ps(v);
    for (; i + 8 <= n; i += 8) {
        const __m256 a = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(x + i))), vv,
                                         _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(y + i))));
        _mm_storeu_si128((__m128i *)(y + i), _mm256_cvtps_ph(a, 0));
    }
#endif
    for (; i < n; ++i) y[i] = f32_to_f16_bits(fmaf(g_f16[x[i]], v, g_f16[y[i]]));
}

/*
 * Causal (optionally sliding-window) GQA attention over an fp16 KV cache, as ggml's CPU
 * flash attention (ggml_compute_forward_flash_attn_ext_f16): the query row rounded to fp16,
 * one key at a time in position order, online softmax with libm expf, the weighted sum of V
 * kept in fp16 (rounded after every key), divided by the sum at the end.
 * q: [T, H, D] float; kc: [KV, n_ctx, D] fp16 bits; vc: [KV, n_ctx, Dv]; out: [T, H * Dv].
 * Query t sits at position start + t and sees keys max(0, pos - window + 1)..pos (window 0: all).
 */
int qg_attn_f16(const float *q, int T, int H, int D, const uint16_t *kc, const uint16_t *vc,
                int KV, int n_ctx, int Dv, int start, int window, float scale, float *out,
                int nthreads) {
    if (KV <= 0 || H % KV || D > 1024 || Dv > 1024) return -1;
    const int g = H / KV;
    (void)nthreads;
#ifdef _OPENMP
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (T * H > 1)
#endif
    for (int th = 0; th < T * H; ++th) {
        const int t = th / H, h = th % H;
        const int kvh = h / g;
        const uint16_t *K = kc + (long)kvh * n_ctx * D;
        const uint16_t *V = vc + (long)kvh * n_ctx * Dv;
        uint16_t qh[1024];
        uint16_t acc[1024];
        const float *qr = q + ((long)t * H + h) * D;
        for (int i = 0; i < D; ++i) qh[i] = f32_to_f16_bits(qr[i]);
        for (int i = 0; i < Dv; ++i) acc[i] = 0;
        const int pos = start + t;
        const int lo = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
        float M = -INFINITY, S = 0.0f;
        for (int ic = lo; ic <= pos; ++ic) {
            float s = dot_f16_ggml(K + (long)ic * D, qh, D);
            s = s * scale;
            const float Mold = M;
            float ms = 1.0f, vs = 1.0f;
            if (s > M) {
                M = s;
                ms = expf(Mold - M);
                scale_f16(acc, ms, Dv);
            } else {
                vs = expf(s - M);
            }
            const uint16_t *vr = V + (long)ic * Dv;
            mad_f16(acc, vr, vs, Dv);
            S = fmaf(S, ms, vs); /* ggml's `S = S*ms + vs`, fused by its build */
        }
        const float sinv = S == 0.0f ? 0.0f : 1.0f / S;
        float *o = out + (long)t * H * Dv + (long)h * Dv;
        for (int i = 0; i < Dv; ++i) o[i] = g_f16[acc[i]] * sinv;
    }
    return 0;
}

/* ggml_v_expf (AVX2 + FMA), one lane */
static float ggml_v_expf1(float x) {
    const float r = 0x1.8p23f;
    const float z = fmaf(x, 0x1.715476p+0f, r);
    const float n = z - r;
    const float b = fmaf(-n, 0x1.7f7d1cp-20f, fmaf(-n, 0x1.62e4p-1f, x));
    uint32_t zb;
    memcpy(&zb, &z, 4);
    const uint32_t e = zb << 23;
    const uint32_t kb = e + 0x3f800000u;
    float k;
    memcpy(&k, &kb, 4);
    const float u = b * b;
    const float j = fmaf(fmaf(fmaf(0x1.0e4020p-7f, b, 0x1.573e2ep-5f), u,
                              fmaf(0x1.555e66p-3f, b, 0x1.fffdb6p-2f)),
                         u, 0x1.ffffecp-1f * b);
    if (!(fabsf(n) > 126.0f)) return fmaf(j, k, k);
    const uint32_t gb = n <= 0.0f ? 0x82000000u : 0u;
    const uint32_t s1b = gb + 0x7f000000u, s2b = e - gb;
    float s1, s2;
    memcpy(&s1, &s1b, 4);
    memcpy(&s2, &s2b, 4);
    if (fabsf(n) > 192.0f) return s1 * s1;
    return fmaf(s2, j, s2) * s1;
}

/* SwiGLU, ggml_vec_swiglu_f32 (AVX2): y = x / (1 + v_expf(-x)) * u in groups of eight, the last
 * n % 8 values with libm expf */
static void swiglu_row(const float *g, const float *u, float *y, int n) {
    const int nv = n & ~7;
    int i = 0;
    for (; i < nv; ++i) y[i] = (g[i] / (1.0f + ggml_v_expf1(0.0f - g[i]))) * u[i];
    for (; i < n; ++i) y[i] = (g[i] / (1.0f + expf(-g[i]))) * u[i];
}

/* GeGLU with ggml's fp16 GELU table (GGML_GELU_FP16): x <= -10 -> 0, x >= 10 -> x * u, else
 * table[fp16(x)] * u; the table holds fp16(0.5x(1 + tanh(sqrt(2/pi) x (1 + 0.044715 x^2)))),
 * built once by qg_init. */
static uint16_t g_gelu[65536];

static void gelu_table(void) {
    for (uint32_t h = 0; h < 65536; ++h) {
        const float x = g_f16[h];
        const float inner = fmaf(0.044715f * x, x, 1.0f);
        const float v = 0.5f * x * (1.0f + tanhf(0.79788456080286535587989211986876f * x * inner));
        g_gelu[h] = f32_to_f16_bits(v);
    }
}

static void geglu_row(const float *g, const float *u, float *y, int n) {
    for (int i = 0; i < n; ++i) {
        const float x = g[i];
        const float a = x <= -10.0f ? 0.0f : x >= 10.0f ? x : g_f16[g_gelu[f32_to_f16_bits(x)]];
        y[i] = a * u[i];
    }
}

/* gated activation of T rows: kind 0 SwiGLU, 1 GeGLU; g, u: T rows ld apart; y: [T, n] */
void qg_glu(int kind, const float *g, const float *u, long ld, float *y, int T, int n, int nthreads) {
    (void)nthreads;
    PARALLEL_FOR(T > 4)
    for (int t = 0; t < T; ++t) {
        (kind ? geglu_row : swiglu_row)(g + (long)t * ld, u + (long)t * ld, y + (long)t * n, n);
    }
}
