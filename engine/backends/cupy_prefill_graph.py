"""A prompt's first chunk replayed from a CUDA graph, for small models whose prefill is host-bound.

A 512-token forward pass of a SmolLM2-sized model is ~1,100 CuPy calls of 10-40 us of host time
each while the GPU work behind them takes a few microseconds: the pass takes as long as Python
takes to issue it. The same holds for a larger model's first chunks that are longer than
`EngineOptions.cupy_mmq_tokens` (their GEMMs run as fp16 tiles + cuBLAS: Qwen3-4B's shape at 512
tokens is 21 ms of GPU work behind 31-55 ms of Python; prefilled in layer groups, for a pause
between two, such a chunk stays eager: `grouped_eager`). For such models (weights below
`cupy_plan.GRAPH_MAX_WEIGHTS`, 1 GiB) and such chunks (`cupy_plan.prefill_graph_buckets`;
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

**Later chunks** (every model unless `cupy_prefill_graph` is False): a chunk of at most
`cupy_plan.later_graph_max` tokens (128, or the chunk when smaller) at a start above 0 - the
question after a prefix the cache kept or restored from disk - is ~700 launches for a 4B model,
20-45 ms of Python, as much as its GPU work or more once its GEMMs split K (`mmq_splits`). It is
replayed from graphs keyed by (padded length, start, layer group); which chunks, and when they
are captured, is `later_chunks`' bookkeeping:

- the length is padded to a multiple of `LATER_STEP` tokens (a 72-token question runs 80 rows);
  the padding writes K/V rows past the chunk, which nothing reads before they are written again;
- a start is captured the second time a chunk begins there, or the first time after `expect`
  named it (a prefix restored from the prompt cache or pinned: questions begin where it ends),
  and only once the model ran an eager multi-token pass (its buffers exist: a capture must not
  create them; it is checked, and a capture that did is dropped);
- the layers are captured in segments of the generation's layer group (`Model.prefill_pass`),
  one graph each, so the gate is still checked between two groups; a whole chunk is one segment;
- the embedding runs eagerly (`Later.load`: the table of a model with a separate output matrix
  stays on the host) into one shared input buffer [later_max, E] that every graph reads;
- the last real row is gathered inside the graph (its index is written beside the rows), so a
  graph keeps one row [1, E]; the activations come from one pool that every later-chunk graph
  shares (they run one at a time, in stream order), reserved at the first capture as one
  `later_graph_max` chunk's (`cupy_plan.plan`) and never freed under a graph (its allocator
  fails instead of letting CuPy free the pool's free blocks and retry); `LATER_KEEP` graphs are
  kept, the least recently used dropped first;
- a chunk of exactly `later_max` tokens may be the middle of a prompt prefilled in such chunks:
  only a start `expect` named takes one (else a long prompt's starts would cycle through the
  cache, each captured and never replayed).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from itertools import pairwise
from typing import Any

import cupy as cp
import numpy as np

from .later_chunks import LATER_KEEP, LATER_STEP, Sightings, keep_recent, later_bucket

log = logging.getLogger(__name__)

_H2D = cp.cuda.runtime.memcpyHostToDevice
__all__ = ["LATER_KEEP", "LATER_STEP", "Later", "PrefillGraphs", "segments"]


class _Bucket:
    """One captured first chunk of `n` tokens: graph, its id buffer, output and memory pool."""

    def __init__(self, n: int) -> None:
        self.pool = cp.cuda.MemoryPool()
        self.ids = cp.zeros(n, dtype=cp.int64)
        self._host_mem = cp.cuda.alloc_pinned_memory(8 * n)
        self.ids_host = np.frombuffer(self._host_mem, np.int64, n)
        self.graph: Any = None
        self.hidden: Any = None  # [n, E] after the last layer, written by each replay


class Later:
    """One captured later chunk: `bucket` tokens at `start`, its layers in segments (`bounds`),
    one graph each, reading the shared first-layer rows `x0`; `load` writes a chunk's rows and
    its last row's index, `launch` replays segments, `row` is the last real row's output [1, E]
    once the last segment ran."""

    def __init__(self, bucket: int, start: int, bounds: tuple[int, ...], x0: Any) -> None:
        self.bucket, self.start, self.bounds, self.x0 = bucket, start, bounds, x0
        self.last = cp.zeros(1, dtype=cp.int64)  # the last real row's index
        self._host_mem = cp.cuda.alloc_pinned_memory(8)
        self.last_host = np.frombuffer(self._host_mem, np.int64, 1)
        self.graphs: list[Any] = []
        self.row: Any = None

    def load(self, tf: Any, ids: Sequence[int]) -> None:
        """Queue the chunk's first-layer rows (`ids` padded with its last id, embedded eagerly:
        the table may live on the host) into `x0` and its last row's index."""
        t = len(ids)
        self.x0[: self.bucket] = tf.embed([*ids, *[ids[-1]] * (self.bucket - t)])
        self.last_host[0] = t - 1
        stream = cp.cuda.get_current_stream()
        cp.cuda.runtime.memcpyAsync(self.last.data.ptr, self.last_host.ctypes.data, 8, _H2D, stream.ptr)

    def launch(self, lo: int, hi: int) -> None:
        """Replay layers lo..hi-1 on the calling thread's stream (both on segment bounds)."""
        hi = min(hi, self.bounds[-1])
        if lo not in self.bounds or hi not in self.bounds:
            raise ValueError(f"layers {lo}..{hi} are not on the captured segments {self.bounds}")
        stream = cp.cuda.get_current_stream()
        for i, g in enumerate(self.graphs):
            if lo <= self.bounds[i] and self.bounds[i + 1] <= hi:
                g.launch(stream)


def _no_retry_malloc(size: int) -> Any:
    """The later-chunk pool's allocator: on a failed cudaMalloc CuPy's pool frees its free
    blocks and tries again, and this pool's free blocks are what captured graphs write into;
    an error of another type makes the capture fail instead (its graphs stay valid)."""
    try:
        mem = cp.cuda.Memory(size)
    except cp.cuda.runtime.CUDARuntimeError as exc:
        raise MemoryError(f"later-chunk graph pool: {exc}") from None
    return cp.cuda.MemoryPointer(mem, 0)


def segments(n_layers: int, group: int) -> tuple[int, ...]:
    """Segment bounds of `n_layers` layers in groups of `group` (0 or >= n_layers: one segment)."""
    g = group if 0 < group < n_layers else n_layers
    return (*range(0, n_layers, g), n_layers)


class PrefillGraphs:
    """Prefill graphs of one model: first chunks (`run`, `Transformer.forward` asks before its
    eager pass) and later chunks (`later`, `Transformer.begin_replay`)."""

    def __init__(
        self,
        buckets: tuple[int, ...],
        later_max: int = 0,
        later_bytes: int = 0,
        shortest: int = 2,
        grouped_eager: bool = False,
    ) -> None:
        self.buckets = buckets  # cupy_plan.prefill_graph_buckets
        self.shortest = shortest  # the shortest first chunk a bucket takes (cupy_plan.prefill_graph_buckets)
        self.grouped_eager = grouped_eager
        """A prefill in layer groups (a pause between two) runs its first chunk eagerly: set for models
        above GRAPH_MAX_WEIGHTS, whose graphed chunk would be one long piece (the Qwen3-4B shape's
        512 tokens: ~21 ms on an H200, against a pause within two groups of 4 layers)."""
        self.later_max = later_max  # cupy_plan.later_graph_max (0: no later-chunk graphs)
        self.later_bytes = later_bytes  # the later pool the plan counts (reserved at the first capture)
        self._graphs: dict[tuple[int, str], _Bucket] = {}
        self._later: OrderedDict[tuple[int, int, tuple[int, ...], str], Later] = OrderedDict()
        self._sightings = Sightings(later_max)
        self.later_pool = cp.cuda.MemoryPool(_no_retry_malloc)
        self._x0: Any = None  # [later_max, E]: the later graphs' first-layer rows (`Later.load`)
        self.later_failures = 0
        self.stream = cp.cuda.Stream(non_blocking=True)
        self._done = cp.cuda.Event(block=False, disable_timing=True)
        self.failed = False

    @property
    def held_bytes(self) -> int:
        """Device bytes the captured graphs' pools hold (the later graphs' input rows come from
        CuPy's default pool, with the rest of the backend's buffers)."""
        first = sum(b.pool.total_bytes() for b in self._graphs.values())
        return int(first + self.later_pool.total_bytes())

    def expect(self, start: int) -> None:
        """Chunks will begin at `start` (a prefix of that many tokens was restored or pinned):
        the first one there is captured at once instead of at the second sighting."""
        self._sightings.expect(start)

    def later(self, tf: Any, ids: Sequence[int], start: int, group: int) -> Later | None:
        """The graph that replays later chunk `ids` at `start` in layer groups of `group` (0:
        whole), captured now where due (module doc); None: run it eagerly."""
        t = len(ids)
        bucket = later_bucket(t, start, self.later_max)
        if bucket is None or self.later_failures >= 2:
            return None
        bounds = segments(len(tf.layers), group)
        key = (bucket, start, bounds, tf.ops.prefill_dtype)
        e = self._later.get(key)
        if e is not None:
            self._later.move_to_end(key)
            return e
        if not self._sightings.due(t, start) or start + bucket > tf.n_ctx or not tf.ops.prefill_warm():
            return None
        e = self._capture_later(tf, bucket, start, bounds)
        if e is not None:
            self._later[key] = e
            keep_recent(self._later, LATER_KEEP)
        return e

    def _capture_later(self, tf: Any, bucket: int, start: int, bounds: tuple[int, ...]) -> Later | None:
        before = tf.ops.prefill_state()
        p: Any = None
        try:
            if self._x0 is None:
                self._x0 = cp.zeros((self.later_max, tf.spec.n_embd), dtype=cp.float32)
                if self.later_bytes:  # one block, freed into the pool at once (the capture
                    with self.stream:  # stream's free list, as CuPy's pool keeps one a stream)
                        self.later_pool.malloc(self.later_bytes)
            e = Later(bucket, start, bounds, self._x0)
            cp.cuda.device.get_cublas_handle()  # this thread's cuBLAS handle exists before the capture
            with cp.cuda.using_allocator(self.later_pool.malloc), self.stream:
                for lo, hi in pairwise(bounds):
                    self.stream.begin_capture()
                    try:
                        if p is None:
                            p = tf.begin_rows(self._x0[:bucket], start)
                        tf.run_layers(p, lo, hi)
                        if hi == bounds[-1]:
                            e.row = cp.take(p.x, e.last, axis=0)  # [1, E]: the last real row
                            p = None
                    finally:
                        e.graphs.append(self.stream.end_capture())
            if not tf.ops.prefill_state_same(before):
                raise RuntimeError("the pass created prefill buffers inside the capture")
        except Exception as exc:  # a driver / library that cannot capture this pass
            tf.ops.drop_prefill_state(before)
            self.later_failures += 1
            log.warning(
                "prefill: CUDA graph capture of a %d-token chunk at %d failed (%s: %s); it runs eagerly",
                bucket,
                start,
                type(exc).__name__,
                exc,
            )
            return None
        log.info(
            "prefill: %d-token chunks at %d replay CUDA graphs (%d segments; later-chunk pool %.1f MiB)",
            bucket,
            start,
            len(e.graphs),
            self.later_pool.total_bytes() / 2**20,
        )
        return e

    def bucket_for(self, t: int, start: int, last_n: int | None, n_ctx: int, grouped: bool = False) -> int | None:
        """The bucket a forward call of `t` tokens at `start` replays, or None (eager); `grouped`:
        the caller would run the chunk in layer groups (`grouped_eager` keeps it eager)."""
        if self.failed or start != 0 or last_n != 1 or t < max(2, self.shortest) or (grouped and self.grouped_eager):
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
