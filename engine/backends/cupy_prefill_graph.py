"""A prompt's first chunk replayed from a CUDA graph, for small models whose prefill is host-bound.

A 512-token forward pass of a SmolLM2-sized model is ~1,100 CuPy calls of 10-40 us of host time
each while the GPU work behind them takes a few microseconds: the pass takes as long as Python
takes to issue it. For such models (weights below `cupy_plan.GRAPH_MAX_WEIGHTS`, 1 GiB;
`EngineOptions.cupy_prefill_graph`, env GENIE_CUPY_PREFILL_GRAPH=0/1, forces it off/on) the first chunk of a prompt (start 0, the common case: a voice assistant's prompt fits one chunk) runs as one graph:

- the chunk is padded to the chunk length (`cupy_plan.prefill_graph_buckets`: 512, or n_ctx when
  smaller) so one graph serves every prompt length; padding positions write K/V rows beyond the prompt,
  which the next step overwrites before any attention reads them (causal: position p reads keys
  <= p only, and the decode step writes p first);
- the token ids live in a device buffer (written from pinned memory before each replay);
- the layers run inside the graph and stop before the output norm; the last real row's norm and
  head GEMV run eagerly after the replay (3 launches), so logits are computed for one row only;
- everything the pass allocates comes from a memory pool owned by the graph (intermediates reuse
  each other's blocks in stream order, as in the eager pass); the pool lives as long as the graph,
  so nothing else can be handed memory the graph writes. Its bytes are `held_bytes`.

A bucket is captured the first time a prompt needs it, after one eager warm-up pass at that
length (cuBLAS handles, tile and attention buffers, the GemmEx check). Where capture fails the
pass runs eagerly from then on (logged).
"""

from __future__ import annotations

import logging
from typing import Any

import cupy as cp
import numpy as np

log = logging.getLogger(__name__)

_H2D = cp.cuda.runtime.memcpyHostToDevice


class _Bucket:
    """One captured first chunk of `n` tokens: graph, its id buffer, output and memory pool."""

    def __init__(self, n: int) -> None:
        self.pool = cp.cuda.MemoryPool()
        self.ids = cp.zeros(n, dtype=cp.int64)
        self._host_mem = cp.cuda.alloc_pinned_memory(8 * n)
        self.ids_host = np.frombuffer(self._host_mem, np.int64, n)
        self.graph: Any = None
        self.hidden: Any = None  # [n, E] after the last layer, written by each replay


class PrefillGraphs:
    """First-chunk graphs of one model (`Transformer.forward` asks `run` before its eager pass)."""

    def __init__(self, buckets: tuple[int, ...]) -> None:
        self.buckets = buckets  # cupy_plan.prefill_graph_buckets
        self._graphs: dict[tuple[int, str], _Bucket] = {}
        self.stream = cp.cuda.Stream(non_blocking=True)
        self._done = cp.cuda.Event(block=False, disable_timing=True)
        self.failed = False

    @property
    def held_bytes(self) -> int:
        """Device bytes the captured graphs' pools hold."""
        return int(sum(b.pool.total_bytes() for b in self._graphs.values()))

    def bucket_for(self, t: int, start: int, last_n: int | None, n_ctx: int) -> int | None:
        """The bucket a forward call of `t` tokens at `start` replays, or None (eager)."""
        if self.failed or start != 0 or last_n != 1 or t < 2:
            return None
        return next((b for b in self.buckets if t <= b <= n_ctx), None)

    def run(self, tf: Any, ids: Any, bucket: int) -> Any:
        """Logits [1, vocab] of the last of `ids` (its K/V and the chunk's written into the cache),
        from the bucket's graph (captured now if new); None where capture failed."""
        key = (bucket, tf.ops.prefill_dtype)  # the tiles' precision is baked in
        b = self._graphs.get(key)
        t = len(ids)
        if b is None:
            b = self._capture(tf, bucket, ids)
            if b is None:
                return None
            self._graphs[key] = b
        b.ids_host[:t] = ids
        b.ids_host[t:] = ids[-1]
        # work queued on the caller's stream (an earlier chunk, a decode step) comes first
        self._done.record(cp.cuda.get_current_stream())
        self.stream.wait_event(self._done)
        cp.cuda.runtime.memcpyAsync(b.ids.data.ptr, b.ids_host.ctypes.data, 8 * bucket, _H2D, self.stream.ptr)
        b.graph.launch(self.stream)
        with self.stream:
            out = tf.head(b.hidden[t - 1 : t])
        self._done.record(self.stream)
        cp.cuda.get_current_stream().wait_event(self._done)
        return out

    def _capture(self, tf: Any, bucket: int, ids: Any) -> _Bucket | None:
        b = _Bucket(bucket)
        pad = list(ids) + [int(ids[-1])] * (bucket - len(ids))
        try:
            tf.forward(pad, 0, last_n=None, hidden=True)  # warm-up: buffers, cuBLAS, checks
            cp.cuda.get_current_stream().synchronize()
            with cp.cuda.using_allocator(b.pool.malloc), self.stream:
                self.stream.begin_capture()
                try:
                    b.hidden = tf.forward(b.ids, 0, last_n=None, hidden=True, graph=False)
                finally:
                    b.graph = self.stream.end_capture()
            self.stream.synchronize()
        except Exception as exc:  # a driver / library that cannot capture this pass
            log.warning(
                "prefill: CUDA graph capture of a %d-token first chunk failed (%s: %s); prefill runs eagerly",
                bucket,
                type(exc).__name__,
                exc,
            )
            self.failed = True
            return None
        log.info(
            "prefill: first chunks of <= %d tokens replay a CUDA graph (%.1f MiB pool)",
            bucket,
            b.pool.total_bytes() / 2**20,
        )
        return b
