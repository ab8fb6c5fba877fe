"""The llama_cpp backend: an external llama.cpp ``llama-server``, started by us or attached by URL.

Started: ``<binary> -m <path> --host H --port P -c <n_ctx> --alias <id> <args...>``, one process
per loaded model (loading starts it, unloading stops it), ready once ``GET /health`` answers 200.
Attached (``llama_cpp.url``): loading only checks ``/health``; unloading leaves the server alone.
Gated at admission: a request waits while the decode gate is paused for its class, and forwarding
waits between chunks (a ``voice`` request passes the pauses held for the voice path, as on the
builtin engine). With ``pause_with_signals`` the process we started is SIGSTOPped while the policy
pauses, except while a voice request that the pause lets through is in flight.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread
import httpx
import structlog

from engine import SamplingParams, open_model_file
from engine.kv_cache import kv_bytes
from engine.spec import read_spec

from ..arbiter import VOICE_CLASS
from ..config import ModelEntry
from ..errors import BackendUnavailable, BadRequest, UpstreamError
from .llama_overflow import error_object, fill_overflow, overflow_error, overflow_of
from .serving import NO_EXTRAS, BackendContext, Piece, Plan, RequestExtras
from .upstream import ChatDeltas, RelayStream, error_answer, error_message, is_chat, openai_message, sampling_fields

log = structlog.get_logger(__name__)


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


SECRET_FLAGS = frozenset({"--api-key", "--api-key-file", "--hf-token", "-hft", "--ssl-key-file"})
"""llama-server flags whose value is a secret (or names one): never logged."""


def redacted(cmd: list[str]) -> list[str]:
    """`cmd` with the value of every secret flag (``--api-key K`` or ``--api-key=K``) replaced by ``***``."""
    out: list[str] = []
    hide = False
    for arg in cmd:
        flag, eq, _ = arg.partition("=")
        if hide:
            out.append("***")
        elif eq and flag in SECRET_FLAGS:
            out.append(f"{flag}=***")
        else:
            out.append(arg)
        hide = not eq and arg in SECRET_FLAGS
    return out


def _tail(path: str, n: int = 8) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return " | ".join(line.strip() for line in f.readlines()[-n:] if line.strip())
    except OSError:
        return ""


class LlamaStream(RelayStream):
    """A streamed llama-server answer (SSE): OpenAI chat chunks, or ``/completion``'s own events."""

    def __init__(
        self, backend: LlamaCppBackend, response: httpx.Response, chat: bool, priority: str | None = None
    ) -> None:
        super().__init__(response, backend.gate, priority, who="llama-server")
        self._backend = backend
        self._chat = ChatDeltas() if chat else None

    def _take(self, obj: Mapping[str, Any]) -> Piece | None:
        if self._chat is not None:
            piece = self._chat.take(obj)
            self.finish_reason = self._chat.finish_reason
            self.prompt_tokens, self.completion_tokens = self._chat.prompt_tokens, self._chat.completion_tokens
            return piece
        text = str(obj.get("content") or "")
        if obj.get("stop"):
            self.prompt_tokens = int(obj.get("tokens_evaluated") or 0)
            self.completion_tokens = int(obj.get("tokens_predicted") or self.completion_tokens)
            self.finish_reason = "length" if obj.get("stop_type") == "limit" else "stop"
        elif text:
            self.completion_tokens += 1
        return Piece(text) if text else None

    def _error(self, err: Any) -> Exception:
        """An error event: llama-server's context overflow is the daemon's 400 (with the numbers it sent)."""
        overflow = overflow_of(err)
        return super()._error(err) if overflow is None else overflow_error(overflow)

    def _released(self) -> None:
        """A voice stream stops keeping a SIGSTOPped llama-server running."""
        self._backend._voice_done(self._priority)


class LlamaCppBackend:
    """One model served by llama-server."""

    kind = "llama_cpp"

    def __init__(self, model_id: str, entry: ModelEntry, ctx: BackendContext) -> None:
        self.model_id = model_id
        """The model's id (the llama-server alias)."""
        self.cfg = ctx.cfg.llama_cpp
        """The llama_cpp section."""
        self.path = entry.path
        """GGUF file passed with -m (None when attached without one)."""
        self.n_ctx = entry.n_ctx or ctx.cfg.engine.n_ctx
        """Context passed with -c."""
        self.kv_dtype = entry.kv_dtype or ctx.cfg.engine.kv_dtype
        """KV cache type: int8 starts llama-server with q8_0 K and V caches."""
        self.gate = ctx.gate
        """The decode gate (admission and forwarding wait on it)."""
        self.base_url: str | None = self.cfg.url.rstrip("/") if self.cfg.url else None
        """Where llama-server answers (set once started)."""
        self.process: anyio.abc.Process | None = None
        """The llama-server we started."""
        self.stopped = False
        """True while the process is SIGSTOPped."""
        self._decision: Any = None
        self._voice_in_flight = 0
        self._log_path: str | None = None
        self._client: httpx.AsyncClient | None = None
        ctx.arbiter.add_listener(self._on_decision)

    def identity(self) -> str:
        """``llama_cpp`` plus how it is reached."""
        return "llama_cpp/attached" if self.cfg.url else "llama_cpp/started"

    def cache_args(self) -> list[str]:
        """llama-server's KV cache type flags for `kv_dtype` (none for f16, its default, or when
        llama_cpp.args sets them itself). A q8_0 V cache needs flash attention, which recent
        llama-server turns on by itself where the backend has it (`-fa auto`)."""
        if self.kv_dtype != "int8" or any(a.startswith(("--cache-type", "-ctk", "-ctv")) for a in self.cfg.args):
            return []
        return ["--cache-type-k", "q8_0", "--cache-type-v", "q8_0"]

    async def plan(self) -> Plan:
        """Weights as stored in the file (llama.cpp keeps them quantized) + KV (f16, or q8_0 for
        int8: 34 bytes a 32 values) + a small scratch."""
        if self.path is None:
            return Plan(0, 0, 0, self.n_ctx, self.kv_dtype)

        def read() -> Plan:
            gf = open_model_file(self.path, header_only=True)  # type: ignore[arg-type]
            spec = read_spec(gf)
            weights = sum(t.nbytes for t in gf.tensors.values())
            scratch = 512 * (spec.n_vocab * 4 + spec.n_embd * 16)
            kv = kv_bytes(spec, self.n_ctx, "f16")
            if self.kv_dtype == "int8":
                kv = kv * 34 // 64  # q8_0: 34 bytes per 32 values, f16: 64
            return Plan(weights, kv, scratch, self.n_ctx, self.kv_dtype, 512)  # llama-server's -ub 512

        try:
            return await anyio.to_thread.run_sync(read)
        except (OSError, ValueError) as exc:
            raise BackendUnavailable(f"model {self.model_id!r}: {exc}") from exc

    # -- lifecycle --------------------------------------------------------------------------
    async def load(self) -> None:
        """Start llama-server (or check the attached one) and wait until /health says ok."""
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(self.cfg.request_timeout_s, connect=5.0))
        if self.cfg.url:
            await self._wait_healthy(None)
            return
        binary = self.cfg.binary and (
            shutil.which(self.cfg.binary) or (self.cfg.binary if os.access(self.cfg.binary, os.X_OK) else None)
        )
        if not binary:
            raise BackendUnavailable(f"llama_cpp.binary {self.cfg.binary!r} is not an executable file")
        if self.path is None:
            raise BackendUnavailable(f"model {self.model_id!r}: starting llama-server needs a model path")
        port = _free_port(self.cfg.host)
        host = f"[{self.cfg.host}]" if ":" in self.cfg.host else self.cfg.host
        self.base_url = f"http://{host}:{port}"
        cmd = [
            binary,
            "-m",
            self.path,
            "--host",
            self.cfg.host,
            "--port",
            str(port),
            "-c",
            str(self.n_ctx),
            "--alias",
            self.model_id,
            *self.cache_args(),
            *self.cfg.args,
        ]
        fd, self._log_path = tempfile.mkstemp(prefix=f"llama-server-{self.model_id}-", suffix=".log")
        log.info("llama_server_starting", model=self.model_id, cmd=redacted(cmd), log=self._log_path)
        try:
            self.process = await anyio.open_process(cmd, stdin=subprocess.DEVNULL, stdout=fd, stderr=subprocess.STDOUT)
        finally:
            os.close(fd)
        try:
            await self._wait_healthy(self.process)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._stop_process()
            raise
        log.info("llama_server_ready", model=self.model_id, url=self.base_url, pid=self.process.pid)

    async def _wait_healthy(self, proc: anyio.abc.Process | None) -> None:
        assert self._client is not None
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        last = "no answer"
        delay = 0.05
        while True:
            if proc is not None and proc.returncode is not None:
                raise BackendUnavailable(
                    f"llama-server exited with status {proc.returncode} while starting: {_tail(self._log_path or '')}"
                )
            try:
                r = await self._client.get(f"{self.base_url}/health", timeout=2.0)
                if r.status_code == 200:
                    return
                last = f"/health answered {r.status_code}"
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
            if time.monotonic() > deadline:
                raise BackendUnavailable(
                    f"llama-server at {self.base_url} not healthy after {self.cfg.startup_timeout_s:g} s ({last})"
                )
            await anyio.sleep(delay)  # polling a process we do not control: back off, capped
            delay = min(delay * 2, 0.5)

    async def unload(self, timeout: float = 2.0) -> None:  # noqa: ASYNC109 - a bounded stop
        """Stop the llama-server we started (an attached one is left running)."""
        await self._stop_process(timeout)
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def shutdown(self, timeout: float = 2.0) -> None:  # noqa: ASYNC109 - a bounded stop
        """Process exit: stop the llama-server we started."""
        await self.unload(timeout)

    async def _stop_process(self, timeout: float = 5.0) -> None:  # noqa: ASYNC109
        proc, self.process = self.process, None
        if proc is None or proc.returncode is not None:
            return
        if self.stopped:
            proc.send_signal(signal.SIGCONT)
            self.stopped = False
        proc.terminate()
        with anyio.move_on_after(timeout):
            await proc.wait()
            return
        proc.kill()
        await proc.wait()

    def _on_decision(self, decision: Any) -> None:
        self._decision = decision
        self._apply_signal()

    def _voice_done(self, priority: str | None) -> None:
        """A request's stream ended: a voice one no longer keeps a stopped process running."""
        if priority == VOICE_CLASS and self._voice_in_flight > 0:
            self._voice_in_flight -= 1
            self._apply_signal()

    def _apply_signal(self) -> None:
        """SIGSTOP the started process while the gate is paused, unless a voice request the pause
        lets through is in flight (the voice reply must not freeze); SIGCONT otherwise."""
        decision = self._decision
        if (
            decision is None
            or not self.cfg.pause_with_signals
            or self.process is None
            or self.process.returncode is not None
        ):
            return
        voice_runs = self._voice_in_flight > 0 and getattr(decision, "voice_gate", "paused") != "paused"
        want_stop = decision.gate == "paused" and not voice_runs
        if want_stop != self.stopped:
            self.process.send_signal(signal.SIGSTOP if want_stop else signal.SIGCONT)
            self.stopped = want_stop
            log.info("llama_server_signalled", model=self.model_id, signal="SIGSTOP" if want_stop else "SIGCONT")

    async def check(self) -> str | None:
        """None when /health answers 200, else why not."""
        if self.process is not None and self.process.returncode is not None:
            return f"llama-server exited with status {self.process.returncode}: {_tail(self._log_path or '')}"
        if self.stopped or self._client is None:
            return None
        try:
            r = await self._client.get(f"{self.base_url}/health", timeout=2.0)
        except httpx.HTTPError as exc:
            return f"llama-server /health: {type(exc).__name__}: {exc}"
        return None if r.status_code == 200 else f"llama-server /health answered {r.status_code}"

    # -- requests ---------------------------------------------------------------------------
    async def generate(
        self, prompt: Any, sampling: SamplingParams, priority: str | None, extras: RequestExtras = NO_EXTRAS
    ) -> LlamaStream:
        """Wait for the gate, send the request upstream (streaming) and return its stream."""
        if not extras.empty or sampling.logprobs is not None:
            field = (
                "tools"
                if extras.tools
                else "logit_bias"
                if extras.bias_text
                else "logprobs"
                if extras.grammar is None
                else extras.grammar_param or "grammar"
            )
            raise BadRequest(f"{field} is not supported by the llama_cpp backend (use the builtin engine)", field)
        if self._client is None:
            raise BackendUnavailable(f"model {self.model_id!r} is not loaded")
        await self.gate.wait("prefill", priority)
        if priority == VOICE_CLASS:
            self._voice_in_flight += 1
            self._apply_signal()
        try:
            return await self._send(prompt, sampling, priority)
        except BaseException:
            self._voice_done(priority)
            raise

    async def _send(self, prompt: Any, sampling: SamplingParams, priority: str | None) -> LlamaStream:
        assert self._client is not None
        common = sampling_fields(sampling)
        if sampling.logit_bias:  # llama-server's pairs; false bans a token
            common["logit_bias"] = [[t, False if b == float("-inf") else b] for t, b in sampling.logit_bias]
        chat = is_chat(prompt)
        if chat:
            body = {
                **common,
                "model": self.model_id,
                "messages": [openai_message(m) for m in prompt],
                "max_tokens": sampling.max_tokens,
                "stream_options": {"include_usage": True},
            }
            url = f"{self.base_url}/v1/chat/completions"
        else:
            body = {**common, "prompt": prompt, "n_predict": sampling.max_tokens}
            url = f"{self.base_url}/completion"
        request = self._client.build_request("POST", url, json=body)
        try:
            response = await self._client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise BackendUnavailable(f"llama-server at {self.base_url}: {type(exc).__name__}: {exc}") from exc
        if response.status_code != 200:
            raw = await error_answer(response, "llama-server")
            overflow = overflow_of(error_object(raw))
            if overflow is not None:  # the same 400 as the builtin engine's (numbers asked for if missing)
                n_ctx = None if self.cfg.url else self.n_ctx
                raise await fill_overflow(self._client, self.base_url or "", overflow, prompt, chat, n_ctx)
            raise UpstreamError(response.status_code, f"llama-server: {error_message(raw)}")
        return LlamaStream(self, response, chat, priority)

    def describe(self) -> dict[str, Any]:
        """How llama-server is reached."""
        return {
            "url": self.base_url,
            "pid": self.process.pid if self.process else None,
            "stopped": self.stopped,
            "path": os.path.basename(self.path or ""),
        }
