"""The builtin backend: the engine in this process, through `EngineHost`, fully gated."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import Any

from engine import SamplingParams, load_model
from engine.tool_calls import ToolSyntax

from ..config import ModelEntry
from ..errors import BackendUnavailable, EngineUnavailable
from .host import EngineHost, HostedGeneration, Prompt
from .serving import NO_EXTRAS, BackendContext, Piece, Plan, RequestExtras, TokenLogprob

MiB = 1024 * 1024


class BuiltinStream:
    """A HostedGeneration seen as pieces (text and the tokens that made it) with counts."""

    def __init__(self, gen: HostedGeneration, tokenizer: Any = None) -> None:
        self.gen = gen
        """The engine's generation."""
        self.tokenizer = tokenizer
        """The model's tokenizer (spells the tokens of log-probabilities)."""
        self.prompt_tokens = len(gen.prompt_ids)
        """Tokens in the prompt."""

    @property
    def finish_reason(self) -> str | None:
        """``stop``, ``length`` or ``cancelled`` once finished."""
        return self.gen.finish_reason

    @property
    def completion_tokens(self) -> int:
        """Tokens generated so far."""
        return self.gen.stats.completion_tokens

    @property
    def tool_syntax(self) -> ToolSyntax | None:
        """How the model writes tool calls when the request's tools reached the prompt (None: no tools)."""
        return self.gen.tool_syntax

    @property
    def parallel_tool_calls(self) -> bool:
        """Whether several calls may come back."""
        return self.gen.parallel_tool_calls

    async def __aiter__(self) -> AsyncIterator[Piece]:
        held: list[int] = []  # tokens whose text is still held back (UTF-8, a possible stop string)
        probs: list[TokenLogprob] = []
        want = self.gen.sampling.logprobs is not None
        piece_bytes = self._piece_bytes
        seen = 0
        async for tok in self.gen:
            if self.gen.stats.completion_tokens > seen:  # a new token (the last event may only release text)
                seen += 1
                held.append(tok.id)
                if want and tok.logprob is not None:
                    top = tuple((i, piece_bytes(i), lp) for i, lp in tok.top)
                    probs.append(TokenLogprob(tok.id, piece_bytes(tok.id), tok.logprob, top))
            if tok.text:
                yield Piece(tok.text, tuple(held), tuple(probs))
                held, probs = [], []

    def _piece_bytes(self, token: int) -> bytes:
        return self.tokenizer.token_to_bytes(token) if self.tokenizer is not None else b""

    async def aclose(self) -> None:
        """Stop the generation (within one step) and free the model."""
        await self.gen.aclose()

    def timings(self) -> dict[str, float]:
        """llama-server style timings in ms."""
        st = self.gen.stats
        n_prompt = st.prompt_tokens - st.cached_tokens
        return {
            "prompt_n": n_prompt,
            "prompt_ms": st.prefill_s * 1000.0,
            "prompt_per_second": st.prefill_tps,
            "cache_n": st.cached_tokens,
            "predicted_n": st.completion_tokens,
            "predicted_ms": st.decode_s * 1000.0,
            "predicted_per_second": st.decode_tps,
        }


class BuiltinBackend:
    """One model served by the in-process engine (loaded and unloaded on the manager's word)."""

    kind = "builtin"

    def __init__(self, model_id: str, entry: ModelEntry, ctx: BackendContext) -> None:
        cfg = ctx.cfg
        if entry.path is None:
            raise BackendUnavailable(f"model {model_id!r}: the builtin backend needs a GGUF path")
        self.model_id = model_id
        """The model's id."""
        self.n_ctx = entry.n_ctx or cfg.engine.n_ctx
        """Context length the KV cache is sized for."""
        kv = entry.kv_dtype or cfg.engine.kv_dtype
        self.host = EngineHost(
            entry.path,
            gate=ctx.gate,
            arbiter=ctx.arbiter,
            publish=ctx.publish,
            backend=cfg.engine.backend,
            n_ctx=self.n_ctx,
            kv_dtype=kv,
            threads=cfg.engine.threads,
            loader=ctx.loader or load_model,
            autoload=False,
            prompt_cache=ctx.prompt_cache,
        )
        """The engine facade of this model."""

    def identity(self) -> str:
        """``builtin/numpy`` or ``builtin/cupy`` (what was asked for until loaded)."""
        return f"builtin/{self.host.backend}"

    async def plan(self) -> Plan:
        """Weights (as the engine stores them) + KV + scratch, from the GGUF header."""
        try:
            p = await self.host.plan()
        except (OSError, ValueError) as exc:
            raise BackendUnavailable(f"model {self.model_id!r}: {exc}") from exc
        return Plan(p.weights, p.kv, p.scratch, p.n_ctx, p.kv_dtype, p.chunk)

    async def load(self) -> None:
        """Load the weights in a worker thread."""
        await self.host.load()

    async def unload(self, timeout: float = 2.0) -> None:  # noqa: ASYNC109 - a bounded drain
        """Stop what runs (next step), drop weights and KV."""
        await self.host.unload(timeout)

    async def shutdown(self, timeout: float = 2.0) -> None:  # noqa: ASYNC109 - a bounded drain
        """Process exit: stop what runs (next step); the weights go with the process."""
        await self.host.shutdown(timeout)

    async def generate(
        self, prompt: Prompt, sampling: SamplingParams, priority: str | None, extras: RequestExtras = NO_EXTRAS
    ) -> BuiltinStream:
        """Admit the request on the engine (context checked) and return its stream."""
        gen = await self.host.generate(prompt, sampling, priority=priority, extras=extras)
        return BuiltinStream(gen, self.tokenizer())

    async def check(self) -> str | None:
        """Health: None when fine, else why not."""
        if self.host.model is None and self.host.state == "error":
            return self.host.error
        return None

    def tokenizer(self) -> Any:
        """The loaded model's tokenizer (None when not loaded)."""
        return self.host.model.tokenizer if self.host.model is not None else None

    def describe(self) -> dict[str, Any]:
        """Engine state, compute backend and memory plan."""
        d = self.host.describe()
        return {
            "engine": d["state"],
            "compute": self.host.backend,
            "arch": d["arch"],
            "name": d["model"],
            "path": os.path.basename(self.host.model_path or ""),
        }


__all__ = ["BuiltinBackend", "BuiltinStream", "EngineUnavailable"]
