"""CUDA C shared by the decode step's module (`decode_src`) and the sampler's (`sample_src`)."""

from __future__ import annotations

LAST_BLOCK = r"""
// The hand-off of a grid-wide reduction: each block, its partial results written, counts itself
// in *COUNTER; the one that counts TOTAL goes on and sees every other block's writes, the others
// return. LAST: the kernel's __shared__ int.
#define LAST_BLOCK_OR_RETURN(LAST, COUNTER, TOTAL)                          \
    __threadfence();                                                        \
    __syncthreads();                                                        \
    if (threadIdx.x == 0) LAST = atomicAdd(COUNTER, 1) == (TOTAL) - 1;      \
    __syncthreads();                                                        \
    if (!LAST) return;                                                      \
    __threadfence()
"""
