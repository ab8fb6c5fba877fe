"""The configured models as Ollama names them: ``id:latest`` and ``role:latest``, with GGUF details.

    names = OllamaNames(deps.models)
    m = names.resolve("brain")            # ManagedModel; "brain", "brain:latest" (any case) both resolve
    card = await model_card(m)            # details read once from the GGUF header (cached per file)
    card.details   # {"format": "gguf", "family": "llama", "parameter_size": "135M", "quantization_level": "Q4_1"}

Names never go through the model manager's fallbacks: an Ollama client asking for a model the daemon
does not serve gets 404 (and may ``pull`` it, which also answers 404), as Ollama would.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np

from engine.errors import EngineError
from engine.gguf_file import read_gguf

from ..errors import UnknownModel

if TYPE_CHECKING:
    from ..llm.managed_model import ManagedModel
    from ..llm.manager import ModelManager

LATEST = "latest"
"""The tag a name without one has."""
FOREVER = "2318-01-01T00:00:00Z"
"""``expires_at`` of a model that is never unloaded (what Ollama says for ``keep_alive: -1``)."""
_BIG_ARRAY = 64
"""Metadata arrays longer than this (the vocabulary, merges, scores) are left out of ``model_info``."""


def ollama_name(name: str) -> str:
    """`name` with Ollama's default tag (``smollm2`` -> ``smollm2:latest``; a tagged name is kept)."""
    return name if ":" in name.rsplit("/", 1)[-1] else f"{name}:{LATEST}"


class OllamaNames:
    """Ollama names of the configured models: each id and each role, with the ``:latest`` tag."""

    def __init__(self, models: ModelManager) -> None:
        self.models = models
        """The daemon's models."""

    def listed(self) -> list[tuple[str, ManagedModel]]:
        """(Ollama name, model) for every id and role, in config order (a name taken twice: its first)."""
        out: dict[str, ManagedModel] = {}
        for m in self.models.models.values():
            for name in m.names:
                out.setdefault(ollama_name(name), m)
        return list(out.items())

    def resolve(self, name: str) -> ManagedModel:
        """The model `name` names (``x``, ``x:latest``, any case); UnknownModel listing the names known."""
        want = ollama_name(name.strip())
        listed = self.listed()
        for known, m in listed:
            if known == want:
                return m
        for known, m in listed:
            if known.lower() == want.lower():
                return m
        names = ", ".join(n for n, _ in listed) or "none"
        raise UnknownModel(f"model {name!r} not found (this daemon serves: {names})")


@dataclass(frozen=True)
class ModelCard:
    """What Ollama says about a model file: tags' and show's fields."""

    size: int = 0
    """File size in bytes."""
    digest: str = ""
    """A stable id of the file (sha256 of its path, size and mtime; not of its bytes)."""
    modified_at: str = "1970-01-01T00:00:00Z"
    """The file's mtime (RFC 3339, UTC)."""
    details: dict[str, Any] = field(default_factory=dict)
    """format, family, families, parameter_size, quantization_level."""
    model_info: dict[str, Any] = field(default_factory=dict)
    """The GGUF header's scalar metadata (``general.architecture``, ``llama.context_length``, ...)."""
    template: str = ""
    """The chat template (Jinja, as the GGUF holds it)."""


_CARDS: dict[tuple[str, int, int], ModelCard] = {}


def _rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def human_count(n: int) -> str:
    """A parameter count as Ollama writes it: ``135M``, ``1.5B``."""
    if n >= 1_000_000_000:
        return f"{n / 1e9:.1f}B"
    if n >= 1_000_000:
        return f"{n / 1e6:.0f}M"
    return f"{n / 1e3:.0f}K"


def _quantization(file_type: Any) -> str:
    from gguf import LlamaFileType  # here: the package costs the daemon's start ~30 ms of imports

    try:
        name = LlamaFileType(int(file_type)).name
    except (TypeError, ValueError):
        return "unknown"
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")


def _plain(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


def read_card(path: str) -> ModelCard:
    """The card of the GGUF at `path` (blocking: reads the header; cached per path, size and mtime)."""
    st = os.stat(path)
    key = (os.path.abspath(path), st.st_size, st.st_mtime_ns)
    if key in _CARDS:
        return _CARDS[key]
    gf = read_gguf(path)
    arch = str(gf.get("general.architecture", ""))
    n_params = gf.get("general.parameter_count")
    if n_params is None:
        n_params = sum(int(np.prod(t.shape)) for t in gf.tensors.values())
    n_params = int(_plain(n_params))
    info = {
        k: _plain(v)
        for k, v in gf.metadata.items()
        if not (isinstance(v, (list, np.ndarray)) and len(v) > _BIG_ARRAY) and k != "tokenizer.chat_template"
    }
    info["general.parameter_count"] = n_params
    card = ModelCard(
        size=st.st_size,
        digest=hashlib.sha256(f"{key[0]}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest(),
        modified_at=_rfc3339(st.st_mtime),
        details={
            "parent_model": "",
            "format": "gguf",
            "family": arch,
            "families": [arch] if arch else [],
            "parameter_size": str(gf.get("general.size_label") or human_count(n_params)),
            "quantization_level": _quantization(gf.get("general.file_type")),
        },
        model_info=info,
        template=str(gf.get("tokenizer.chat_template") or ""),
    )
    _CARDS[key] = card
    return card


async def model_card(m: ManagedModel) -> ModelCard:
    """The card of model `m` (read in a worker thread the first time); a bare one where it has no
    readable GGUF (a llama_cpp model attached by URL)."""
    path = m.entry.path
    if path:
        try:
            return await anyio.to_thread.run_sync(read_card, path)
        except (OSError, EngineError):
            pass
    digest = hashlib.sha256(m.id.encode()).hexdigest()
    return ModelCard(digest=digest, details={"parent_model": "", "format": "gguf", "family": "", "families": []})


def tool_capable(m: ManagedModel) -> bool:
    """Whether requests with ``tools`` are served for `m` (the builtin and openai backends; llama_cpp refuses them)."""
    return m.kind in ("builtin", "openai")
