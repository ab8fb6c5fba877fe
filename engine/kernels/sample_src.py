"""CUDA C of on-device sampling (`engine.backends.cupy_sample.DeviceSampler`): one logits row in,
one token id out, with `engine.sampler.Sampler`'s semantics and no host round trip.

Order: a token's rank is (logit descending, id ascending); every cut is a prefix of that order,
named by its last member's 64-bit key `(desc_bits(logit) << 32) | id` (keys ascend with rank).

- `smp_adjust` (launched only with a token mask or a logit bias; same grid): the row with the
  bias added and tokens whose mask bit is clear set to -inf, into `xa`, which `smp_prep` then
  reads instead of the logits (`Sampler.adjusted`'s order: the penalty comes after).

- `smp_prep` (one block per CHUNK ids, the last block merges): repetition penalty (each block
  marks the recent ids of its chunk in a shared bitmap, so duplicates are penalised once),
  -0 -> +0, the penalised row into `xw`, argmax (first on ties) into `out` and the state; resets
  the three selections.
- `smp_select` (same grid; one launch per radix digit; the last block picks the digit): finds the
  first key, in rank order, whose inclusive cumulative weight exceeds a target. Weights are
  integers (`w * scale`, scale = 2^(62 - ceil(log2 vocab)), rounded), so the per-block and global
  histograms (atomics) are exact and the result does not depend on the order of the additions.
  Digits: the 32 logit bits as 11+11+10, then the id bits in <= 11-bit digits (ties by id).
  Selections (all on the penalised row, m = its max):
    0 top-k: weight 1 over all tokens, target k-1              -> key of the k-th token;
    1 top-p: weight exp(x-m) over the top-k, first cum >= top_p * sum -> the last kept token;
    2 pick:  weight exp((x-m)/T) over the kept tokens (top-k, top-p, and exp(x-m) >= min_p),
             first cum > floor(u * sum)                          -> the token (into `out`).
  An inactive or finished selection returns at once (its bound stays "all").
- `chain_advance` (one thread, after a chained decode step): the picked token becomes the next
  step's input and position, and enters the repetition window's ring.
"""

from __future__ import annotations

from . import grid_src

THREADS = 512
"""Threads a block."""
CHUNK = 4096
"""Ids a block (8 a thread)."""
BITS = 11
"""Widest radix digit; histograms have 2^BITS bins."""

# params buffer: PD_N doubles, then PI_N int32
PD_TOP_P, PD_MIN_P, PD_U, PD_TEMP, PD_SCALE, PD_PENALTY = range(6)
PD_N = 8
PI_VOCAB, PI_NRECENT, PI_TOPK, PI_FLAGS, PI_NBIAS = range(5)
PI_N = 8
F_PEN, F_TOPK, F_TOPP, F_MINP, F_SAMPLE, F_MASK, F_BIAS = 1, 2, 4, 8, 16, 32, 64
STATE_BYTES = 256
"""Size of the device state (`SmpState`, 136 bytes, rounded up)."""

SOURCE = r"""
typedef unsigned long long u64;
#define SMP_THREADS %(THREADS)d
#define SMP_CHUNK %(CHUNK)d
#define SMP_BINS %(BINS)d
#define PD_TOP_P %(PD_TOP_P)d
#define PD_MIN_P %(PD_MIN_P)d
#define PD_U %(PD_U)d
#define PD_TEMP %(PD_TEMP)d
#define PD_SCALE %(PD_SCALE)d
#define PD_PENALTY %(PD_PENALTY)d
#define PD_N %(PD_N)d
#define PI_VOCAB %(PI_VOCAB)d
#define PI_NRECENT %(PI_NRECENT)d
#define PI_TOPK %(PI_TOPK)d
#define PI_FLAGS %(PI_FLAGS)d
#define PI_NBIAS %(PI_NBIAS)d
#define F_PEN %(F_PEN)d
#define F_TOPK %(F_TOPK)d
#define F_TOPP %(F_TOPP)d
#define F_MINP %(F_MINP)d
#define F_SAMPLE %(F_SAMPLE)d
#define F_MASK %(F_MASK)d
#define F_BIAS %(F_BIAS)d
#define SMP_NEG_INF __int_as_float(0xff800000)
#define SMP_ALL 0xffffffffffffffffull

struct SelState { u64 prefix, cum, target, bound; int status, pad; };  // status 0 running, 1 found, 2 all
struct SmpState { float m; int arg; int pad0, pad1; SelState sel[3]; };

// Keys ascend as logits descend: IEEE bits made monotone, then inverted.
__device__ __forceinline__ u64 smp_key(float v, int i) {
    unsigned int b = __float_as_uint(v);
    b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((u64)(~b) << 32) | (unsigned int)i;
}

__device__ __forceinline__ bool smp_better(float v, int i, float bv, int bi) {
    return v > bv || (v == bv && i < bi);
}

// Block-wide (largest value, smallest id); the result in every thread. blockDim.x == SMP_THREADS.
__device__ void smp_argmax_block(float& best, int& idx, float* sv, int* si) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, best, o);
        int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        if (smp_better(ov, oi, best, idx)) { best = ov; idx = oi; }
    }
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) { sv[warp] = best; si[warp] = idx; }
    __syncthreads();
    best = lane < SMP_THREADS / 32 ? sv[lane] : SMP_NEG_INF;
    idx = lane < SMP_THREADS / 32 ? si[lane] : 0x7fffffff;
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, best, o);
        int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        if (smp_better(ov, oi, best, idx)) { best = ov; idx = oi; }
    }
    __syncthreads();
}

// Block-wide exclusive scan of x; *total gets the sum. Call once per kernel (shared `ws`).
__device__ u64 smp_excl_scan(u64 x, u64* ws, u64* total) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    u64 inc = x;
    #pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        u64 y = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += y;
    }
    if (lane == 31) ws[warp] = inc;
    __syncthreads();
    if (warp == 0) {
        u64 w = lane < SMP_THREADS / 32 ? ws[lane] : 0ull;
        #pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            u64 y = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += y;
        }
        if (lane < SMP_THREADS / 32) ws[lane] = w;
    }
    __syncthreads();
    *total = ws[SMP_THREADS / 32 - 1];
    return (warp ? ws[warp - 1] : 0ull) + inc - x;
}

// The row with the logit bias added and tokens outside the bitmask (bit i%%32 of word i/32) at -inf.
extern "C" __global__ void __launch_bounds__(SMP_THREADS)
smp_adjust(const float* __restrict__ logits, const double* __restrict__ pd, const unsigned int* __restrict__ mask,
           const int* __restrict__ bias_ids, const float* __restrict__ bias_vals, float* __restrict__ xa) {
    const int* pi = (const int*)(pd + PD_N);
    const int V = pi[PI_VOCAB], flags = pi[PI_FLAGS];
    const int c0 = blockIdx.x * SMP_CHUNK, c1 = min(V, c0 + SMP_CHUNK);
    for (int i = c0 + threadIdx.x; i < c1; i += SMP_THREADS) {
        float v = logits[i];
        if ((flags & F_MASK) && !((mask[i >> 5] >> (i & 31)) & 1u)) v = SMP_NEG_INF;
        xa[i] = v;
    }
    if (flags & F_BIAS) {
        __syncthreads();  // this block's row written: each bias id lands in exactly one block
        const int n = pi[PI_NBIAS];
        for (int j = threadIdx.x; j < n; j += SMP_THREADS) {
            const int id = bias_ids[j];
            if (id >= c0 && id < c1) xa[id] += bias_vals[j];
        }
    }
}

extern "C" __global__ void __launch_bounds__(SMP_THREADS)
smp_prep(const float* __restrict__ logits, const double* __restrict__ pd, const int* __restrict__ recent,
         float* __restrict__ xw, SmpState* st, float* bv, int* bi, int* counter, int* out) {
    __shared__ unsigned int seen[SMP_CHUNK / 32];
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ int last;
    const int* pi = (const int*)(pd + PD_N);
    const int V = pi[PI_VOCAB], flags = pi[PI_FLAGS];
    const int c0 = blockIdx.x * SMP_CHUNK, c1 = min(V, c0 + SMP_CHUNK);
    for (int j = threadIdx.x; j < SMP_CHUNK / 32; j += SMP_THREADS) seen[j] = 0u;
    __syncthreads();
    if (flags & F_PEN) {
        const int n = pi[PI_NRECENT];
        for (int j = threadIdx.x; j < n; j += SMP_THREADS) {
            int id = recent[j];
            if (id >= c0 && id < c1) atomicOr(&seen[(id - c0) >> 5], 1u << ((id - c0) & 31));
        }
        __syncthreads();
    }
    const float pen = (float)pd[PD_PENALTY];
    float best = SMP_NEG_INF;
    int idx = 0x7fffffff;
    for (int i = c0 + threadIdx.x; i < c1; i += SMP_THREADS) {
        float v = logits[i];
        int j = i - c0;
        if (seen[j >> 5] & (1u << (j & 31))) v = v > 0.f ? v / pen : v * pen;
        if (v == 0.f) v = 0.f;  // -0 -> +0: equal logits share a key
        xw[i] = v;
        if (smp_better(v, i, best, idx)) { best = v; idx = i; }
    }
    smp_argmax_block(best, idx, sv, si);
    if (threadIdx.x == 0) { bv[blockIdx.x] = best; bi[blockIdx.x] = idx; }
    LAST_BLOCK_OR_RETURN(last, counter, (int)gridDim.x);
    best = SMP_NEG_INF; idx = 0x7fffffff;
    for (int b = threadIdx.x; b < (int)gridDim.x; b += SMP_THREADS) {
        float v = __ldcg(bv + b);
        int j = __ldcg(bi + b);
        if (smp_better(v, j, best, idx)) { best = v; idx = j; }
    }
    smp_argmax_block(best, idx, sv, si);
    if (threadIdx.x == 0) {
        st->m = best;
        st->arg = idx;
        *out = idx;
        const int active[3] = {flags & F_TOPK, flags & F_TOPP, flags & F_SAMPLE};
        for (int s = 0; s < 3; s++) {
            st->sel[s].prefix = 0ull; st->sel[s].cum = 0ull; st->sel[s].target = 0ull;
            st->sel[s].bound = SMP_ALL; st->sel[s].status = active[s] ? 0 : 2;
        }
        *counter = 0;
    }
}

extern "C" __global__ void __launch_bounds__(SMP_THREADS)
smp_select(const float* __restrict__ xw, const double* __restrict__ pd, SmpState* st, int sel, int shift,
           int nbits, u64* ghist, int* counter, int* out) {
    __shared__ u64 hist[SMP_BINS];
    __shared__ u64 ws[32];
    __shared__ int last, found;
    SelState* s = &st->sel[sel];
    if (s->status != 0) return;  // inactive or finished: the same for every block
    const int* pi = (const int*)(pd + PD_N);
    const int V = pi[PI_VOCAB], flags = pi[PI_FLAGS];
    const int nb = 1 << nbits, hi = shift + nbits;
    // read before any barrier: the last block's finder rewrites them below
    const u64 prefix = s->prefix, cum0 = s->cum, target0 = s->target;
    const u64 b0 = st->sel[0].bound, b1 = st->sel[1].bound;
    const double m = (double)st->m, scale = pd[PD_SCALE], min_p = pd[PD_MIN_P], temp = pd[PD_TEMP];
    for (int j = threadIdx.x; j < nb; j += SMP_THREADS) hist[j] = 0ull;
    __syncthreads();
    const int c0 = blockIdx.x * SMP_CHUNK, c1 = min(V, c0 + SMP_CHUNK);
    for (int i = c0 + threadIdx.x; i < c1; i += SMP_THREADS) {
        const float v = xw[i];
        const u64 key = smp_key(v, i);
        if (hi < 64 && ((key ^ prefix) >> hi) != 0ull) continue;  // outside the digits fixed so far
        u64 w = 1ull;
        if (sel >= 1) {
            if (key > b0) continue;  // past the top-k
            const double d = (double)v - m;
            if (sel == 1) {
                w = __double2ull_rn(exp(d) * scale);
            } else {
                if (key > b1) continue;  // past the top-p cut
                if ((flags & F_MINP) && exp(d) < min_p) continue;
                w = __double2ull_rn(exp(d / temp) * scale);
            }
            if (w == 0ull) continue;
        }
        atomicAdd(&hist[(key >> shift) & (u64)(nb - 1)], w);
    }
    __syncthreads();
    for (int j = threadIdx.x; j < nb; j += SMP_THREADS)
        if (hist[j]) atomicAdd(&ghist[j], hist[j]);
    LAST_BLOCK_OR_RETURN(last, counter, (int)gridDim.x);
    // the last block: bins in rank order, find the one where the cumulative weight passes the target
    const int per = (nb + SMP_THREADS - 1) / SMP_THREADS;  // <= 4 bins a thread
    u64 loc[(SMP_BINS + SMP_THREADS - 1) / SMP_THREADS];
    u64 mine = 0ull;
    for (int k = 0; k < per; k++) {
        const int b = threadIdx.x * per + k;
        loc[k] = b < nb ? __ldcg(ghist + b) : 0ull;
        mine += loc[k];
    }
    if (threadIdx.x == 0) found = 0;
    u64 total;
    const u64 before = smp_excl_scan(mine, ws, &total);
    u64 target = target0;
    if (hi >= 64) {  // first digit: the target from the total weight of the set
        if (sel == 0) {
            target = (u64)(pi[PI_TOPK] - 1);
        } else if (sel == 1) {
            const u64 c = (u64)ceil(pd[PD_TOP_P] * (double)total);
            target = c ? c - 1ull : 0ull;  // first cum >= c  <=>  first cum > c - 1
        } else {
            target = (u64)floor(pd[PD_U] * (double)total);
            if (target >= total && total) target = total - 1ull;
        }
    }
    const u64 rem = target - cum0;  // >= 0: the previous digit's bin held the crossing
    if (rem >= before && rem - before < mine) {  // exactly one thread: its bins hold the crossing
        u64 acc = before;
        int bin = threadIdx.x * per;
        for (int k = 0; k < per; k++) {
            if (acc + loc[k] > rem) { bin = threadIdx.x * per + k; break; }
            acc += loc[k];
        }
        const u64 p = prefix | ((u64)bin << shift);
        s->prefix = p;
        s->cum = cum0 + acc;
        s->target = target;
        if (shift == 0) {
            s->status = 1;
            s->bound = p;
            if (sel == 2) *out = (int)(unsigned int)(p & 0xffffffffull);
        }
        found = 1;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        if (!found) s->status = 2;  // the target is past the whole set: everything is kept
        *counter = 0;
    }
    for (int j = threadIdx.x; j < nb; j += SMP_THREADS) ghist[j] = 0ull;
}

// Decode steps chained on the device (`engine.backends.cupy_chain`), one thread: the token a
// step picked (`pick`: the decode step's argmax ids[2], or the sampler's `out`) becomes the next
// step's input ids[0] at the next position ids[1] + 1, and joins the repetition window, a ring of
// `cap` ids in `recent` whose next slot is ids[3] (cap 0: no window).
extern "C" __global__ void chain_advance(int* ids, const int* pick, int* recent, int cap) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const int t = *pick;
    ids[0] = t;
    ids[1] += 1;
    if (cap > 0) {
        const int w = ids[3];
        recent[w] = t;
        ids[3] = w + 1 == cap ? 0 : w + 1;
    }
}
"""


def source() -> str:
    """The translation unit (constants filled in)."""
    return grid_src.LAST_BLOCK + SOURCE % dict(
        THREADS=THREADS,
        CHUNK=CHUNK,
        BINS=1 << BITS,
        PD_TOP_P=PD_TOP_P,
        PD_MIN_P=PD_MIN_P,
        PD_U=PD_U,
        PD_TEMP=PD_TEMP,
        PD_SCALE=PD_SCALE,
        PD_PENALTY=PD_PENALTY,
        PD_N=PD_N,
        PI_VOCAB=PI_VOCAB,
        PI_NRECENT=PI_NRECENT,
        PI_TOPK=PI_TOPK,
        PI_FLAGS=PI_FLAGS,
        PI_NBIAS=PI_NBIAS,
        F_PEN=F_PEN,
        F_TOPK=F_TOPK,
        F_TOPP=F_TOPP,
        F_MINP=F_MINP,
        F_SAMPLE=F_SAMPLE,
        F_MASK=F_MASK,
        F_BIAS=F_BIAS,
    )
