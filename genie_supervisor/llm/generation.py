"""One admitted generation on the host's model, and the gate it runs behind.

`HostedGeneration` is what `EngineHost.generate` returns: an async iterator of engine TokenEvents
that runs the model's generation inside ``gate.generation()`` with the policy's prefill chunk and
layer group, at the engine priority of its request class (`PRIORITY_RANK`: a voice turn preempts a
running background generation), and tells the host when it starts, yields its first token and
finishes. `_HostGate` is the DecodeGate seen by that one generation, plus the way out at shutdown:
every wait raises `_Shutdown` instead of parking once the host is closing or unloading.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, Any

import anyio

from engine import GenerationStats, SamplingParams, TokenEvent

from ..errors import EngineUnavailable

if TYPE_CHECKING:
    from .extras import Prepared
    from .host import EngineHost


class _Shutdown(Exception):
    """Raised from the gate into a generation when the host shuts down."""


PRIORITY_RANK = {"voice": 2, "tool": 1, "background": 0}
"""Engine priority of each request class: a voice turn preempts a running background generation."""


class _HostGate:
    """The DecodeGate for one generation of class `priority`, plus a way out: during shutdown
    every wait raises instead of parking."""

    def __init__(self, host: EngineHost, priority: str | None) -> None:
        self._host = host
        self._priority = priority

    def running(self) -> Any:
        """Entered by the engine while the generation holds the model (see DecodeGate.parked)."""
        return self._host.gate.generation(self._priority)

    def blocks(self, phase: Any) -> bool:
        """Whether `wait` would park or raise now (the engine finishes queued GPU work first)."""
        return self._host.closing or self._host.gate.blocks(phase, self._priority)

    async def wait(self, phase: Any) -> None:
        host, cls = self._host, self._priority
        if host.closing:
            raise _Shutdown
        if host.gate.mode_for(cls)[0] == "paused":  # parked: an unload must still be able to stop it
            async with anyio.create_task_group() as tg:

                async def step() -> None:
                    await host.gate.wait(phase, cls)
                    tg.cancel_scope.cancel()

                tg.start_soon(step)
                await host.closed_event().wait()
                tg.cancel_scope.cancel()
        else:
            await host.gate.wait(phase, cls)
        if host.closing:
            raise _Shutdown


class HostedGeneration:
    """One admitted generation: an async iterator of TokenEvent; close it (``async with``) when done."""

    def __init__(
        self,
        host: EngineHost,
        prompt_ids: list[int],
        sampling: SamplingParams,
        priority: str | None,
        prepared: Prepared | None = None,
        save_prefix: int = 0,
    ) -> None:
        self.prompt_ids = prompt_ids
        """The prompt as token ids."""
        self.sampling = sampling
        """The sampling parameters."""
        self.priority = priority
        """Request class (voice, tool, background; used by the later admission queue)."""
        self.finish_reason: str | None = None
        """``stop``, ``length`` or ``cancelled`` once finished."""
        self.stats = GenerationStats(prompt_tokens=len(prompt_ids))
        """Counts and timings (the engine's), final once finished."""
        self.text = ""
        """Text produced so far."""
        self.first_token_at: float | None = None
        """Monotonic time of the first token."""
        self.tokens = 0
        """Token events seen so far."""
        self.constraint = prepared.constraint if prepared is not None else None
        """The grammar the output follows (None: free)."""
        self.tool_syntax = prepared.tool_syntax if prepared is not None else None
        """How the model writes tool calls when the request's tools reached the prompt (None: no tools)."""
        self.parallel_tool_calls = prepared.parallel if prepared is not None else True
        """Whether several calls may come back."""
        self.save_prefix = save_prefix
        """Leading prompt tokens (system messages and tools) the prompt cache on disk may keep."""
        self._host = host
        self._agen = self._run()

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        return self

    async def __anext__(self) -> TokenEvent:
        return await self._agen.__anext__()

    async def aclose(self) -> None:
        """Stop the generation (within one step) and release the model."""
        await self._agen.aclose()

    async def __aenter__(self) -> HostedGeneration:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def collect(self) -> str:
        """Run to the end and return the whole text."""
        async with self:
            async for _ in self:
                pass
        return self.text

    @property
    def decoding(self) -> bool:
        """True once the first token came out."""
        return self.first_token_at is not None

    def wall_tps(self) -> float | None:
        """Tokens per second since the first token, wall clock (gate waits included)."""
        if self.first_token_at is None or self.tokens < 2:
            return None
        elapsed = time.monotonic() - self.first_token_at
        return (self.tokens - 1) / elapsed if elapsed > 0 else None

    async def _run(self) -> AsyncGenerator[TokenEvent, None]:
        host = self._host
        model = host.model
        if model is None:
            raise EngineUnavailable(f"the engine is {host.state}")
        gen = model.generate(
            self.prompt_ids,
            self.sampling,
            gate=_HostGate(host, self.priority),
            prefill_chunk=host.prefill_chunk,
            prefill_layer_group=host.arbiter.prefill_layer_group,
            priority=PRIORITY_RANK.get(self.priority or "", 0),
            pin_prefix=self.priority == "voice",
            constraint=self.constraint,
            prompt_cache=host.model_cache,
            save_prefix=self.save_prefix,
        )
        self.stats = gen.stats
        host._started(self)
        try:
            try:
                async for tok in gen:
                    if self.first_token_at is None:
                        self.first_token_at = time.monotonic()
                        host._changed()
                    self.tokens += 1
                    self.text += tok.text
                    yield tok
            except _Shutdown:
                pass
            finally:
                with anyio.CancelScope(shield=True):
                    await gen.aclose()
        finally:
            self.finish_reason = gen.finish_reason or "cancelled"
            host._finished(self)
