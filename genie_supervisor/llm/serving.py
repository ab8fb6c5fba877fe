"""Backends behind one facade: what serves a model, chosen by config alone.

    backend = create_backend("builtin", model_id, entry, ctx)    # or "llama_cpp", "openai"
    plan = await backend.plan()          # bytes it will need (from the GGUF header)
    await backend.load()                 # BackendUnavailable when it cannot start
    stream = await backend.generate(messages_or_text, SamplingParams(...), "voice", RequestExtras(...))
    async with stream:
        async for piece in stream: ...   # Piece: text, token ids, log-probabilities
    stream.finish_reason, stream.prompt_tokens, stream.completion_tokens, stream.timings()
    await backend.unload()

``builtin`` runs the engine in this process behind the DecodeGate; ``llama_cpp`` talks to an
external llama-server (started by us, or attached by URL), gated at admission; ``openai`` talks to a
remote OpenAI-compatible server by URL, gated at admission, with a local fallback model.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import BackendUnavailable as BackendUnavailable  # re-export
from ..errors import UpstreamError as UpstreamError  # re-export

if TYPE_CHECKING:
    from engine import Model
    from engine.prompt_cache import PromptCache
    from engine.tool_calls import ToolSyntax

    from ..arbiter import Arbiter, DecodeGate
    from ..config import Config, ModelEntry
    from ..events import Observation


MiB = 1024 * 1024


@dataclass(frozen=True)
class Plan:
    """Memory a model will hold once loaded (bytes), from its GGUF header."""

    weights: int
    """Weights as the backend stores them."""
    kv: int
    """KV cache at the configured context."""
    scratch: int
    """Activations (estimate)."""
    n_ctx: int
    """Context the KV cache is sized for."""
    kv_dtype: str = "f16"
    """KV cache element type (``f16``, ``int8``)."""
    chunk: int | None = None
    """Prefill chunk (tokens) the scratch is sized for (None: the backend does not say)."""

    @property
    def total(self) -> int:
        """Everything together."""
        return self.weights + self.kv + self.scratch


def plan_parts_mb(plan: Any) -> dict[str, Any]:
    """A memory plan's parts as /status, /running, MQTT and the logs show them: MiB rounded, the
    context, the KV type and the prefill chunk (a `Plan` or an engine `MemoryPlan`)."""
    return {
        "weights_mb": round(plan.weights / MiB, 3),
        "kv_mb": round(plan.kv / MiB, 3),
        "scratch_mb": round(plan.scratch / MiB, 3),
        "total_mb": round(plan.total / MiB, 3),
        "n_ctx": plan.n_ctx,
        "kv_dtype": plan.kv_dtype,
        "prefill_chunk": plan.chunk,
    }


def plan_text(plan: Any) -> str:
    """One line of a plan's parts, as errors and doctor write it."""
    chunk = f", prefill chunk {plan.chunk}" if plan.chunk else ""
    return (
        f"weights {plan.weights / MiB:.1f} + KV {plan.kv / MiB:.1f} + scratch {plan.scratch / MiB:.1f} MiB "
        f"at n_ctx {plan.n_ctx}, {plan.kv_dtype} KV{chunk}"
    )


@dataclass(frozen=True)
class BackendContext:
    """What every backend may use from the daemon."""

    cfg: Config
    """The daemon config (engine defaults, llama_cpp section)."""
    gate: DecodeGate
    """The decode gate."""
    arbiter: Arbiter
    """Admission flags and the prefill chunk."""
    publish: Callable[[Observation], None]
    """Where engine stats go (the model manager aggregates them)."""
    loader: Callable[..., Model] | None = None
    """Model loader of the builtin backend (tests pass a fake)."""
    lease: Callable[[str], AbstractAsyncContextManager[Any]] | None = None
    """The model manager's lease by id or role (the openai backend's fallback model answers through it)."""
    changed: Callable[[], None] = lambda: None
    """Tell the model manager the backend's state changed (the openai backend's switch to its fallback)."""
    prompt_cache: PromptCache | None = None
    """The prompt cache on disk the builtin backend attaches its model to (None: off)."""


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability and the most likely alternatives at its step."""

    token: int
    """Token id."""
    piece: bytes
    """The token's bytes as the tokenizer spells it."""
    logprob: float
    """Natural log of its probability."""
    top: tuple[tuple[int, bytes, float], ...] = ()
    """The most likely tokens at this step: (id, bytes, logprob), most likely first."""


@dataclass(frozen=True)
class Piece:
    """A piece of streamed output: its text and the tokens that made it."""

    text: str
    """Text this piece adds ("" for tokens whose text is still held back)."""
    tokens: tuple[int, ...] = ()
    """Token ids generated for it (empty where a backend does not say)."""
    logprobs: tuple[TokenLogprob, ...] = ()
    """One per token when the request asked for log-probabilities."""


@dataclass(frozen=True)
class RequestExtras:
    """What a request asks for beyond sampling: tools and constrained output."""

    tools: tuple[dict[str, Any], ...] = ()
    """OpenAI function tools (``{"type": "function", "function": {...}}``)."""
    tool_choice: str | dict[str, Any] = "auto"
    """``auto``, ``none``, ``required`` or ``{"type": "function", "function": {"name": ...}}``."""
    parallel_tool_calls: bool = True
    """Whether an answer may call several tools."""
    grammar: Any = None
    """An `engine.constrain.Grammar` the output must follow (response_format, json_schema, grammar, format)."""
    grammar_param: str | None = None
    """The request field the grammar came from (errors name it)."""
    bias_text: tuple[tuple[str, float], ...] = ()
    """llama-server's ``logit_bias`` by string: every token of each text gets its bias (-inf bans)."""

    @property
    def empty(self) -> bool:
        """Nothing beyond plain generation is asked."""
        return not self.tools and self.grammar is None and not self.bias_text

    @property
    def tools_active(self) -> bool:
        """Tools reach the prompt (there are some and ``tool_choice`` is not ``none``)."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forced(self) -> bool:
        """``tool_choice`` forces a call (``required`` or a named function)."""
        return self.tools_active and self.tool_choice != "auto"


NO_EXTRAS = RequestExtras()


class TextStream(Protocol):
    """One running generation: pieces, then counts."""

    @property
    def finish_reason(self) -> str | None:
        """``stop``, ``length`` or ``cancelled`` once finished."""

    @property
    def prompt_tokens(self) -> int:
        """Tokens in the prompt."""

    @property
    def completion_tokens(self) -> int:
        """Tokens generated so far."""

    @property
    def tool_syntax(self) -> ToolSyntax | None:
        """How the model writes tool calls when the request gave it tools (None: no tools, no parsing)."""

    @property
    def parallel_tool_calls(self) -> bool:
        """Whether the answer may carry several calls (else only the first one parsed counts)."""

    def __aiter__(self) -> AsyncIterator[Piece]: ...

    async def aclose(self) -> None: ...

    def timings(self) -> dict[str, float]: ...


class Backend(Protocol):
    """What the model manager needs from a backend serving one model."""

    kind: str
    """``builtin``, ``llama_cpp`` or ``openai``."""
    n_ctx: int
    """Context length."""

    def identity(self) -> str: ...

    async def plan(self) -> Plan: ...

    async def load(self) -> None: ...

    async def unload(self, timeout: float = 2.0) -> None: ...  # noqa: ASYNC109

    async def shutdown(self, timeout: float = 2.0) -> None: ...  # noqa: ASYNC109

    async def generate(
        self, prompt: Any, sampling: Any, priority: str | None, extras: RequestExtras = NO_EXTRAS
    ) -> TextStream: ...

    async def check(self) -> str | None: ...

    def describe(self) -> dict[str, Any]: ...


def create_backend(kind: str, model_id: str, entry: ModelEntry, ctx: BackendContext) -> Backend:
    """A backend of `kind` for one configured model (nothing started yet)."""
    if kind == "builtin":
        from .builtin import BuiltinBackend

        return BuiltinBackend(model_id, entry, ctx)
    if kind == "llama_cpp":
        from .llama_cpp import LlamaCppBackend

        return LlamaCppBackend(model_id, entry, ctx)
    if kind == "openai":
        from .remote import OpenAIBackend

        return OpenAIBackend(model_id, entry, ctx)
    raise ValueError(f"unknown backend {kind!r} (known: builtin, llama_cpp, openai)")


__all__ = [
    "NO_EXTRAS",
    "Backend",
    "BackendContext",
    "BackendUnavailable",
    "Piece",
    "Plan",
    "RequestExtras",
    "TextStream",
    "TokenLogprob",
    "UpstreamError",
    "create_backend",
    "plan_parts_mb",
    "plan_text",
]
