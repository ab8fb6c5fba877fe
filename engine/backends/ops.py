"""What a backend is to the engine: the `Ops` protocol.

The forward pass (`engine.model.Transformer`) calls the operations below on arrays of its backend
(NumPy arrays for `numpy`/`native`, CuPy arrays for `cupy`). A backend also declares its abilities
as plain attributes and methods with neutral defaults, so the engine asks them directly instead of
probing with `getattr`: a batch-dependent activation rounding, a preferred prefill chunk, first-chunk
prefill graphs, a one-token decoder, and device events to keep work queued.

Shape letters used in the docstrings of every backend: T tokens of a pass, E embedding width,
H query heads, KV key/value heads, D / Dv key / value head size, F feed-forward width, V vocabulary.
"""

from __future__ import annotations

from typing import Any, Protocol

from ..gguf_file import TensorInfo


class Ops(Protocol):
    """The operations and abilities the engine uses from a backend."""

    name: str
    """``numpy``, ``native`` or ``cupy``."""
    xp: Any
    """The array module (numpy or cupy)."""
    batch_dependent: bool
    """True where a row's result depends on how many rows run together (llama.cpp's repacked
    kernels round per batch), so the engine runs a pass's kept rows as that pass would."""

    prefill_graphs: Any
    """First-chunk prefill graphs (`cupy_prefill_graph.PrefillGraphs`), None without."""
    prefill_dtype: str
    """Tile precision of the prefill GEMMs ("" where it does not apply)."""

    @property
    def prefill_chunk(self) -> int | None:
        """Prompt tokens per forward pass the backend prefers (None: the engine's default); read only,
        so a backend may declare it narrower (CuPy: an int)."""
        ...

    def weight(self, t: TensorInfo) -> Any: ...
    def concat_rows(self, parts: list[Any]) -> Any: ...
    def weight_rows(self, ts: list[TensorInfo]) -> Any:
        """`concat_rows([weight(t) for t in ts])` (the fused QKV and gate+up of a layer); CuPy
        uploads the tensors straight into the stacked buffer."""
        ...

    def finish_uploads(self) -> None:
        """Every weight holds its values from here on (CuPy reads the weights it deferred)."""

    def embed_rows(self, table: Any, ids: Any, cols: int) -> Any: ...
    def zeros(self, shape: tuple[int, ...], dtype: str) -> Any: ...
    def to_host(self, x: Any) -> Any: ...
    def linear(self, x: Any, w: Any, b: Any = None, aq: str | None = None) -> Any: ...
    def rms_norm(self, x: Any, w: Any, eps: float) -> Any: ...
    def rope_tables(self, n_ctx: int, dim: int, base: float, scale: float) -> tuple[Any, Any]: ...
    def rope(self, x: Any, cos: Any, sin: Any, style: str) -> Any: ...
    def norm_rope(self, x: Any, w: Any | None, eps: float, cos: Any, sin: Any, style: str) -> Any:
        """`rope(rms_norm(x, w, eps), cos, sin, style)` (no norm where `w` is None) on query or key
        heads [T, heads, D] (a view of the fused QKV output): CuPy does it in one launch."""
        ...

    def kv_store(self, cache: Any, start: int, x: Any) -> None: ...
    def gated_act(self, gate: Any, up: Any, kind: str) -> Any: ...
    def attention(self, q: Any, k_cache: Any, v_cache: Any, start: int, window: int, scale: float) -> Any: ...
    def make_decoder(self, transformer: Any) -> Any | None:
        """A fast one-token decode step for `transformer` (e.g. a CUDA graph), None without."""
        ...

    def mark(self) -> Any | None:
        """An event after the work queued so far (its ``synchronize()`` waits for it), None where
        every op finishes before it returns."""
        ...

    def synchronize(self) -> None:
        """Wait until the queued work has finished (a no-op on the CPU)."""
        ...
