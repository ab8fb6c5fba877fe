"""CUDA C kernels compiled and run on the host, for checking their arithmetic and indexing on a
machine without a GPU (CI).

`HEADER` stands in for what the kernels use of CUDA: the qualifiers (`__device__`, `__global__`),
the vector types, the integer intrinsics (`__dp4a`, `__funnelshift_r`, `__vsubss4`), the loads
(`__ldg`, `__ldcg`), the warp-wide matrix instructions (`ldmatrix`, `mma.sync`, in their PTX
fragment layouts), and the SIMT part: every thread of a block is a fiber of one host thread (a
stack of its own, switched by a few instructions on x86-64, `ucontext` elsewhere) with its own
`threadIdx`; `__syncthreads`, `__syncwarp` and the shuffles are barriers that switch to the next
fiber until all have arrived. A thread that returns drops out of its barriers, as an exited
thread stops counting on the GPU. The blocks of one thread-block cluster run together, each with
its own `__shared__` storage (peer reads: `host_ld_peer`); clusters (or blocks) run one after
another, so `atomicAdd` and `__threadfence` (the C++ atomics) make "the last block to finish" the
last one run, and dynamic shared memory (`extern __shared__`) is one static buffer. Inline PTX has
no host meaning: the kernels keep theirs behind `#ifdef __CUDA_ARCH__` with a host branch (`h2f`,
`prefetch_l2`, `ld_peer`). What it does not model: blocks of different clusters running at the
same time (a block spinning on another's flag would never return), warp divergence inside a
shuffle (every shuffle is taken by the whole warp, as in these kernels), and float contraction
(the host rounds each multiply and add; the GPU fuses some, so float results agree to rounding,
integer ones exactly).

`HostModule(folder, source)` compiles a translation unit (`HEADER` + `source`) with a C++20
compiler and gives every `extern "C" __global__` kernel of it a launcher:
`module.launch("qgemv_Q4_K", grid, block, *args)` with NumPy arrays for pointers. The whole CUDA
backend runs on it through `tests/host_cupy` (a stand-in for CuPy).
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np

HEADER = r"""
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <math.h>
#include <ucontext.h>
#include <functional>
#include <vector>
#define __device__
#define __global__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __cluster_dims__(...)
#define __align__(n) alignas(n)
struct uint4 { unsigned int x, y, z, w; };
struct int4 { int x, y, z, w; };
struct int2 { int x, y; };
struct float4 { float x, y, z, w; };
static inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w) { return uint4{x, y, z, w}; }
static inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
struct dim3 { unsigned int x, y, z; };
static inline int __dp4a(int a, int b, int c) {
    for (int i = 0; i < 4; i++) c += (int)(signed char)(a >> (8 * i)) * (int)(signed char)(b >> (8 * i));
    return c;
}
static inline unsigned int __funnelshift_r(unsigned int lo, unsigned int hi, unsigned int sh) {
    sh &= 31u;
    return sh ? (lo >> sh) | (hi << (32u - sh)) : lo;
}
static inline unsigned int __vsubss4(unsigned int a, unsigned int b) {
    unsigned int r = 0;
    for (int i = 0; i < 4; i++) {
        int v = (int)(signed char)(a >> (8 * i)) - (int)(signed char)(b >> (8 * i));
        v = v < -128 ? -128 : (v > 127 ? 127 : v);
        r |= ((unsigned int)v & 0xffu) << (8 * i);
    }
    return r;
}
template <typename T> static inline T __ldg(const T* p) { return *p; }
template <typename T> static inline T __ldcg(const T* p) { return *p; }
static inline float __uint_as_float(unsigned int u) { float f; memcpy(&f, &u, 4); return f; }
static inline float __int_as_float(int u) { float f; memcpy(&f, &u, 4); return f; }
static inline int __float_as_int(float f) { int u; memcpy(&u, &f, 4); return u; }
static inline unsigned int __float_as_uint(float f) { unsigned int u; memcpy(&u, &f, 4); return u; }
static inline unsigned long long __double2ull_rn(double x) { return (unsigned long long)nearbyint(x); }
static inline int __float2int_rn(float f) { return (int)rintf(f); }
static inline int min(int a, int b) { return a < b ? a : b; }
static inline int max(int a, int b) { return a > b ? a : b; }

template <typename T> static inline T atomicAdd(T* p, T v) { return std::atomic_ref<T>(*p).fetch_add(v); }
template <typename T> static inline T atomicOr(T* p, T v) { return std::atomic_ref<T>(*p).fetch_or(v); }
static inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
static unsigned char g_dyn_smem[228 * 1024];  // `extern __shared__ T name[]` (HostModule rewrites it)

// Fibers: a stack and a saved context each, switched without a system call on x86-64 (ucontext's
// swapcontext saves the signal mask through one, which made it most of the time of a launch).
#if defined(__x86_64__)
extern "C" void host_switch(void** save_sp, void* to_sp);
// callee-saved registers pushed on the stack being left, its stack pointer saved, the other's
// restored and its registers popped; `ret` resumes it (or enters a new fiber's entry function)
asm(R"(
    .text
    .globl host_switch
    .hidden host_switch
host_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
)");
struct HostCtx { void* sp; };
static inline void ctx_init(HostCtx& c, char* stack, size_t size, void (*entry)()) {
    void** top = (void**)(((uintptr_t)(stack + size)) & ~(uintptr_t)15);
    *--top = nullptr;        // the entry's return address (it never returns): rsp % 16 == 8 there
    *--top = (void*)entry;   // where host_switch's `ret` goes
    for (int i = 0; i < 6; i++) *--top = nullptr;  // rbp, rbx, r12-r15
    c.sp = top;
}
static inline void ctx_swap(HostCtx& from, HostCtx& to) { host_switch(&from.sp, to.sp); }
#else
struct HostCtx { ucontext_t uc; };
static inline void ctx_init(HostCtx& c, char* stack, size_t size, void (*entry)()) {
    getcontext(&c.uc);
    c.uc.uc_stack.ss_sp = stack;
    c.uc.uc_stack.ss_size = size;
    c.uc.uc_link = nullptr;
    makecontext(&c.uc, entry, 0);
}
static inline void ctx_swap(HostCtx& from, HostCtx& to) { swapcontext(&from.uc, &to.uc); }
#endif

// SIMT: a CUDA thread is a fiber of one host thread. The blocks of one thread-block
// cluster (one block without clusters) run together, each in a slot with its own barriers, shuffle
// slots and shared memory; the fibers run in turn, each until it waits at a barrier or ends.
static const int HOST_SLOTS = 16;  // the most blocks of a cluster
static const int HOST_THREADS = 1024;
static dim3 threadIdx, blockIdx;
static dim3 blockDim, gridDim;
static int g_slot_now;  // the running fiber's block slot (its rank in the cluster)
struct HostBarrier { int expected, arrived; unsigned int gen; };
static HostBarrier g_block_bar[HOST_SLOTS], g_warp_bar[HOST_SLOTS][32], g_cluster_bar;
static unsigned long long g_xchg[HOST_SLOTS][HOST_THREADS];
struct HostFiber { HostCtx ctx; bool done; dim3 tid, bid; int slot; };
static HostFiber g_fiber[HOST_SLOTS * HOST_THREADS];
static char* g_stack[HOST_SLOTS * HOST_THREADS];
static const size_t STACK = 128 * 1024;
static HostCtx g_sched;
static int g_cur;
static std::function<void()>* g_body;
// __shared__ variables (HostModule rewrites each declaration to this): one per block slot
struct HostShared { char* base; size_t size; };
static std::vector<HostShared> g_shared;
template <typename T, int ID> static inline T& host_shared() {
    struct alignas(16) Box { T v; };  // each block's copy 16-byte aligned, as __align__(16) asks
    static Box s[HOST_SLOTS];
    static bool known = (g_shared.push_back(HostShared{(char*)s, sizeof(Box)}), true);
    (void)known;
    return s[g_slot_now].v;
}
static inline void host_yield() { ctx_swap(g_fiber[g_cur].ctx, g_sched); }
static inline void host_wait(HostBarrier& b) {
    unsigned int gen = b.gen;
    if (++b.arrived >= b.expected) { b.arrived = 0; b.gen++; return; }
    while (b.gen == gen) host_yield();
}
static inline void host_drop(HostBarrier& b) {  // an ended thread no longer counts
    b.expected--;
    if (b.arrived > 0 && b.arrived >= b.expected) { b.arrived = 0; b.gen++; }
}
static inline void __syncthreads() { host_wait(g_block_bar[g_slot_now]); }
static inline void __syncwarp(unsigned int = 0xffffffffu) { host_wait(g_warp_bar[g_slot_now][threadIdx.x >> 5]); }
static inline void host_cluster_sync() { host_wait(g_cluster_bar); }
// v in this block's shared memory, read from the same place in the block of cluster rank `rank`
static inline float host_ld_peer(const float* v, unsigned int rank) {
    for (const HostShared& sh : g_shared) {
        char* mine = sh.base + (size_t)g_slot_now * sh.size;
        if ((const char*)v >= mine && (const char*)v < mine + sh.size)
            return *(const float*)(sh.base + (size_t)rank * sh.size + ((const char*)v - mine));
    }
    abort();  // not a __shared__ variable
}
template <typename T> static inline T shfl_from(T v, unsigned int src) {
    unsigned int w = threadIdx.x >> 5;
    memcpy(&g_xchg[g_slot_now][threadIdx.x], &v, sizeof(T));
    host_wait(g_warp_bar[g_slot_now][w]);
    T r;
    memcpy(&r, &g_xchg[g_slot_now][w * 32 + (src & 31u)], sizeof(T));
    host_wait(g_warp_bar[g_slot_now][w]);
    return r;
}
template <typename T> static inline T __shfl_xor_sync(unsigned int, T v, int o) { return shfl_from(v, (threadIdx.x & 31u) ^ (unsigned int)o); }
// The warp-wide matrix instructions of the prefill GEMMs (PTX ISA fragment layouts; lane = 4 g + t)
static const void* g_lane_ptr[HOST_SLOTS][HOST_THREADS];
static unsigned int g_lane_regs[HOST_SLOTS][HOST_THREADS][6];
static inline float host_half(unsigned short h) { _Float16 v; memcpy(&v, &h, 2); return (float)v; }
// ldmatrix.sync.aligned.m8n8.x4.shared.b16: lane l gives row l % 8 of matrix l / 8; matrix j's row
// l / 4, elements 2 (l % 4) and 2 (l % 4) + 1, come back in r[j]
static inline void host_ldmatrix_x4(unsigned int* r, const void* p) {
    unsigned int w = threadIdx.x >> 5, l = threadIdx.x & 31u;
    g_lane_ptr[g_slot_now][threadIdx.x] = p;
    host_wait(g_warp_bar[g_slot_now][w]);
    for (int j = 0; j < 4; j++) {
        const unsigned short* row = (const unsigned short*)g_lane_ptr[g_slot_now][w * 32 + j * 8 + l / 4];
        r[j] = (unsigned int)row[2 * (l % 4)] | ((unsigned int)row[2 * (l % 4) + 1] << 16);
    }
    host_wait(g_warp_bar[g_slot_now][w]);
}
// mma.sync.aligned.m16n8k{16 f16, 32 s8}.row.col: A [16, K] in a[0..3], B [K, 8] in b0, b1, C / D
// [16, 8] in c[0..3]; E elements of B / 4 bytes: f16 2 a register, s8 4
template <typename Acc, int E> static inline void host_mma(Acc* c, const unsigned int* a, unsigned int b0, unsigned int b1) {
    unsigned int w = threadIdx.x >> 5, l = threadIdx.x & 31u, g = l >> 2, t = l & 3u;
    unsigned int* mine = g_lane_regs[g_slot_now][threadIdx.x];
    for (int i = 0; i < 4; i++) mine[i] = a[i];
    mine[4] = b0; mine[5] = b1;
    host_wait(g_warp_bar[g_slot_now][w]);
    const int K = 8 * E, H = 4 * E;  // K, and the k a register pair splits at (8 f16, 16 s8)
    auto elem = [&](unsigned int lane, int reg, int k) -> Acc {
        unsigned int v = g_lane_regs[g_slot_now][w * 32 + lane][reg];
        if (E == 2) return (Acc)host_half((unsigned short)(v >> (16 * (k % 2))));
        return (Acc)(signed char)(v >> (8 * (k % 4)));
    };
    for (int q = 0; q < 4; q++) {
        int row = (int)g + 8 * (q >> 1), col = (int)(2 * t) + (q & 1);
        Acc sum = 0;
        for (int k = 0; k < K; k++) {
            // A[row][k]: lane 4 (row % 8) + (k % H) / E, register (row >= 8) + 2 (k >= H)
            Acc av = elem(4 * (row % 8) + (k % H) / E, (row >= 8) + 2 * (k >= H), k);
            // B[k][col]: lane 4 col + (k % H) / E, register (k >= H)
            Acc bv = elem(4 * col + (k % H) / E, 4 + (k >= H), k);
            sum += av * bv;
        }
        c[q] += sum;
    }
    host_wait(g_warp_bar[g_slot_now][w]);
}
template <typename T> static inline T __shfl_sync(unsigned int, T v, int src) { return shfl_from(v, (unsigned int)src); }
template <typename T> static inline T __shfl_up_sync(unsigned int, T v, int d) {
    unsigned int l = threadIdx.x & 31u;
    return shfl_from(v, l >= (unsigned int)d ? l - (unsigned int)d : l);
}
static void host_fiber_main() {
    (*g_body)();
    HostFiber& f = g_fiber[g_cur];
    f.done = true;
    host_drop(g_block_bar[f.slot]);
    host_drop(g_warp_bar[f.slot][f.tid.x >> 5]);
    host_drop(g_cluster_bar);
    ctx_swap(f.ctx, g_sched);  // never resumed: a done fiber is not run again
    abort();
}
// The grid (gx, gy) in clusters of `cluster` blocks along y (1: no clusters), each cluster's blocks
// running together, the clusters one after another.
template <typename F> static void host_launch(unsigned int gx, unsigned int gy, unsigned int gz, unsigned int block, unsigned int cluster, F body) {
    if (cluster < 1 || cluster > HOST_SLOTS || gy % cluster || block > HOST_THREADS) abort();
    gridDim = dim3{gx, gy, gz};
    blockDim = dim3{block, 1, 1};
    std::function<void()> fn = body;
    g_body = &fn;
    for (unsigned int c = 0; c < gx * (gy / cluster) * gz; c++) {
        unsigned int x = c % gx, y0 = ((c / gx) % (gy / cluster)) * cluster, z = c / (gx * (gy / cluster));
        g_cluster_bar = HostBarrier{(int)(cluster * block), 0, 0};
        int n = 0;
        for (unsigned int r = 0; r < cluster; r++) {
            g_block_bar[r] = HostBarrier{(int)block, 0, 0};
            for (unsigned int w = 0; w < (block + 31) / 32; w++)
                g_warp_bar[r][w] = HostBarrier{(int)(block - 32 * w < 32 ? block - 32 * w : 32), 0, 0};
            for (unsigned int t = 0; t < block; t++, n++) {
                HostFiber& f = g_fiber[n];
                if (!g_stack[n]) g_stack[n] = new char[STACK];
                ctx_init(f.ctx, g_stack[n], STACK, host_fiber_main);
                f.done = false;
                f.tid = dim3{t, 0, 0};
                f.bid = dim3{x, y0 + r, z};
                f.slot = (int)r;
            }
        }
        for (bool left = true; left;) {
            left = false;
            for (int i = 0; i < n; i++) {
                HostFiber& f = g_fiber[i];
                if (f.done) continue;
                g_cur = i;
                threadIdx = f.tid;
                blockIdx = f.bid;
                g_slot_now = f.slot;
                ctx_swap(g_sched, f.ctx);
                left = left || !f.done;
            }
        }
    }
}
"""

DYN_SMEM = re.compile(r"extern __shared__ (\w+) (\w+)\[\];")
"""Dynamic shared memory, which becomes the host's one static buffer (blocks run one at a time)."""
SHARED = re.compile(r"__shared__\s+(?:__align__\(\d+\)\s+)?((?:unsigned\s+)?\w+)\s+([^;]+);")
"""A `__shared__` declaration: its element type and its declarators (`a[2][3], b, c[N]`)."""
KERNEL = re.compile(r'extern "C" __global__ void\s+(?:\w+(?:\([^)]*\))?\s+)*?(\w+)\(([^)]*)\)\s*\{')
"""A kernel's name and parameter list (after any launch-bounds macro)."""


def compiler() -> str | None:
    """A C++ compiler on PATH, or None."""
    for cand in ("c++", "g++", "clang++"):
        if shutil.which(cand):
            return cand
    return None


_ids = iter(range(1, 1 << 30))


def _per_block(m: re.Match[str]) -> str:
    """One `__shared__` declaration as references to per-block storage (`host_shared`)."""
    kind, decls, out, depth, cur = m.group(1), m.group(2), [], 0, ""
    for ch in decls + ",":
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
            continue
        depth += ch == "["
        depth -= ch == "]"
        cur += ch
    refs = []
    for d in out:
        name, dims = re.match(r"(\w+)\s*(.*)", d).groups()  # type: ignore[union-attr]
        n = next(_ids)
        refs.append(
            f"{kind} (&{name}){dims} = host_shared<{kind}{dims}, {n}>();"
            if dims
            else f"{kind}& {name} = host_shared<{kind}, {n}>();"
        )
    return " ".join(refs)


def build(folder: Path, source: str, cxx: str, name: str) -> ctypes.CDLL:
    """C++20 `source` compiled as a shared library in `folder` (no float contraction: each multiply
    and add rounded, as the tolerances of the host tests assume) and loaded; a library built there
    from the same source before is loaded as it is."""
    src, lib = folder / f"{name}.cpp", folder / f"{name}.so"
    if lib.exists() and src.exists() and src.read_text() == source:
        return ctypes.CDLL(str(lib))
    src.write_text(source)
    cmd = [cxx, "-O1", "-std=c++20", "-ffp-contract=off", "-shared", "-fPIC", "-o", str(lib), str(src)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        lib.unlink(missing_ok=True)  # not to be taken for this source's library later
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stderr[-6000:]}")
    return ctypes.CDLL(str(lib))


def _ctype(param: str) -> Any:
    """The ctypes type of one kernel parameter's declaration."""
    if "*" in param:
        return ctypes.c_void_p
    words = param.replace("const", "").split()[:-1]
    kind = " ".join(words)
    table = {
        "int": ctypes.c_int,
        "long long": ctypes.c_longlong,
        "float": ctypes.c_float,
        "unsigned int": ctypes.c_uint,
    }
    if kind not in table:
        raise ValueError(f"unsupported kernel parameter {param!r}")
    return table[kind]


class HostModule:
    """A CUDA C source compiled for the host, its kernels launchable one block at a time."""

    def __init__(self, folder: Path, source: str, cxx: str, name: str = "module") -> None:
        kernels = {m.group(1): [p.strip() for p in m.group(2).split(",") if p.strip()] for m in KERNEL.finditer(source)}
        wrappers = []
        for k, params in kernels.items():
            names = ", ".join(re.findall(r"(\w+)\s*$", p)[0] for p in params)
            wrappers.append(
                f'extern "C" void host_{k}(unsigned int gx, unsigned int gy, unsigned int gz, unsigned int block, '
                f"unsigned int cluster, {', '.join(params)}) "
                f"{{ host_launch(gx, gy, gz, block, cluster, [&] {{ {k}({names}); }}); }}\n"
            )
        source = SHARED.sub(_per_block, DYN_SMEM.sub(r"\1* \2 = (\1*)g_dyn_smem;", source))
        self.lib = build(folder, HEADER + source + "".join(wrappers), cxx, name)
        self.kernels = kernels
        for k, params in kernels.items():
            fn = getattr(self.lib, f"host_{k}")
            fn.restype = None
            fn.argtypes = [ctypes.c_uint] * 5 + [_ctype(p) for p in params]

    def launch(self, kernel: str, grid: int | tuple[int, ...], block: int, *args: Any, cluster: int = 1) -> None:
        """Run `kernel` over `grid` blocks (x, (x, y) or (x, y, z)) of `block` threads, in
        thread-block clusters of `cluster` blocks along y (the kernel's `__cluster_dims__(1,
        cluster, 1)`) that run together, one cluster after another (x fastest); NumPy arrays
        (C-contiguous, kept alive by the caller) for pointers, None for a null pointer, numbers for
        the rest."""
        gx, gy, gz = (*grid, 1, 1)[:3] if isinstance(grid, tuple) else (grid, 1, 1)
        conv = [a.ctypes.data if isinstance(a, np.ndarray) else a for a in args]
        getattr(self.lib, f"host_{kernel}")(gx, gy, gz, block, cluster, *conv)


def cxx_or_skip(what: str) -> str:
    """A C++ compiler; without one the calling test is skipped (failed under CI=true) naming `what`
    needed it."""
    from tests.models import missing

    cxx = compiler()
    if cxx is None:
        missing(f"no C++ compiler (c++, g++ or clang++) to build {what} for the host")
    return cxx


def decode_module(
    folder: Path,
    *,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    kv: str,
    n_split: int,
    rope_half: int | None = None,
    neox: bool = True,
    cluster: int = 0,
) -> HostModule:
    """The decode module of one head shape with no weight types (attention, `qkv_post` and the
    small kernels: quicker to build) and a `kv` cache ("float32", "float16" or "int8"), for the
    host; `cluster`: the sm_90 build's thread-block clusters (0: none)."""
    from engine.kernels import decode_src

    src = decode_src.source(
        [],
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        v_head_dim=head_dim,
        rope_half=head_dim // 2 if rope_half is None else rope_half,
        neox=neox,
        kv_half=kv == "float16",
        kv_int8=kv == "int8",
        n_split=n_split,
        attn_cluster=cluster,
    )
    return HostModule(folder, src, cxx_or_skip("the decode kernels"), "decode")


class DecodeModules:
    """`decode_module`s built on first use and kept, each in its own folder of `tmp` (a pytest
    `TempPathFactory`): `get(**keywords)` with `decode_module`'s keywords."""

    def __init__(self, tmp: Any) -> None:
        self._tmp = tmp
        self._built: dict[tuple[tuple[str, Any], ...], HostModule] = {}

    def get(self, **kw: Any) -> HostModule:
        key = tuple(sorted(kw.items()))
        if key not in self._built:
            self._built[key] = decode_module(self._tmp.mktemp("decode"), **kw)
        return self._built[key]
