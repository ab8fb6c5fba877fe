"""The model manager seen as one engine (``sup.engine``, /status's engine fields): the default model, its
EngineHost when the builtin backend serves it, one state word for the whole LLM side, and the description that
adds every model, the fallback and the remotes. `ModelManager` inherits it and sets the attributes declared here.
"""

from __future__ import annotations

from typing import Any

from ..config import Config
from ..errors import EngineUnavailable
from ..events import EngineStats
from .managed_model import NO_HOST, ManagedModel


class EngineView:
    """The single-model engine view of the model manager (mixed into `ModelManager`)."""

    cfg: Config
    models: dict[str, ManagedModel]
    enabled: bool
    _budget_mb: float | None

    @property
    def default(self) -> ManagedModel | None:
        """The model used when a request names none: the first resident model, else the first."""
        return next((m for m in self.models.values() if m.entry.resident), next(iter(self.models.values()), None))

    def stats(self) -> EngineStats:
        """The aggregate EngineStats (the model manager's)."""
        raise NotImplementedError

    @property
    def host(self) -> Any:
        """The default model's EngineHost when the builtin backend serves it, else None."""
        m = self.default
        return getattr(m.backend, "host", None) if m is not None else None

    async def generate(self, prompt: Any, sampling: Any = None, *, priority: str | None = None) -> Any:
        """Generate on the default model's engine directly (no queue): the in-process API of tests and bench."""
        host = self.host
        if host is None:
            raise EngineUnavailable("the default model is not served by the builtin engine")
        return await host.generate(prompt, sampling, priority=priority)

    @property
    def state(self) -> str:
        """One word for the whole LLM side (EngineStats.state)."""
        return self.stats().state

    @property
    def backend(self) -> str | None:
        """Compute backend of the default model (``numpy``/``cupy``) or ``llama_cpp``."""
        m = self.default
        if m is None:
            return None
        host = getattr(m.backend, "host", None)
        return host.backend if host is not None else m.kind

    def describe(self) -> dict[str, Any]:
        """The default model's engine view (state, model, backend, memory plan) plus every model."""
        host = self.host
        default_id = self.default.id if self.default else None
        base: dict[str, Any] = (
            host.describe() if host is not None else {**NO_HOST, "model": default_id, "backend": self.backend}
        )
        base["state"] = self.state
        m = self.default
        base["backend_kind"] = m.kind if m else None
        base["backend_identity"] = m.backend.identity() if m else None
        base["fallback"] = self.cfg.fallback
        base["fell_back"] = any(x.fell_back for x in self.models.values())
        base["remotes"] = {x.id: x.backend.describe()["remote"] for x in self.models.values() if x.kind == "openai"}
        base["enabled"] = self.enabled
        if base.get("memory_plan") is not None:
            base["memory_plan"]["budget_mb"] = self._budget_mb
        return base
