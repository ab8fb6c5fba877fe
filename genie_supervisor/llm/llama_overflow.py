"""llama-server's context overflow answered as the daemon answers its own: a 400 with OpenAI's
``code: context_length_exceeded`` and llama-server's ``n_prompt_tokens`` and ``n_ctx``.

llama-server (b5000 and later) answers a prompt longer than its context with

    400 {"error": {"code": 400, "type": "exceed_context_size_error", "n_prompt_tokens": 4476, "n_ctx": 4096,
                   "message": "request (4476 tokens) exceeds the available context size (4096 tokens), ..."}}

Older builds say only ``"the request exceeds the available context size ..."`` (type
``invalid_request_error``). Then the numbers are filled in from what llama-server tells on asking: ``n_ctx``
from ``GET /props`` (else the context we started it with), the prompt's tokens from ``POST /tokenize`` of the
prompt (a chat first through ``POST /apply-template``); a number nobody could learn is left out and the
message says so.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import httpx

from ..errors import UpstreamContextTooLong

OVERFLOW_TYPE = "exceed_context_size_error"
_OVERFLOW_WORDS = "exceeds the available context size"


def overflow_of(err: Any) -> Mapping[str, Any] | None:
    """The error object when `err` (an upstream ``error`` value) is llama-server's context overflow, else None."""
    if not isinstance(err, Mapping):
        return None
    if err.get("type") == OVERFLOW_TYPE or _OVERFLOW_WORDS in str(err.get("message", "")):
        return err
    return None


def error_object(raw: bytes) -> Any:
    """The ``error`` value of an upstream error body (None when it is not JSON)."""
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    return obj.get("error") if isinstance(obj, dict) else None


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def overflow_error(
    err: Mapping[str, Any], n_prompt: int | None = None, n_ctx: int | None = None
) -> UpstreamContextTooLong:
    """The 400 for llama-server's overflow `err`, with its numbers or else `n_prompt` / `n_ctx` (found by us)."""
    sent_prompt, sent_ctx = _count(err.get("n_prompt_tokens")), _count(err.get("n_ctx"))
    message = f"llama-server: {err.get('message') or 'the request exceeds the available context size'}"
    pairs = {"n_prompt_tokens": (sent_prompt, n_prompt), "n_ctx": (sent_ctx, n_ctx)}
    found = [k for k, (sent, ours) in pairs.items() if sent is None and ours is not None]
    missing = [k for k, (sent, ours) in pairs.items() if sent is None and ours is None]
    if found:
        message += f" ({' and '.join(found)} asked of llama-server by the daemon)"
    if missing:
        message += f" (llama-server did not say {' or '.join(missing)})"
    return UpstreamContextTooLong(
        message,
        sent_prompt if sent_prompt is not None else n_prompt,
        sent_ctx if sent_ctx is not None else n_ctx,
    )


async def fill_overflow(
    client: httpx.AsyncClient, base_url: str, err: Mapping[str, Any], prompt: Any, chat: bool, n_ctx: int | None
) -> UpstreamContextTooLong:
    """`overflow_error` with the numbers llama-server left out asked of it (`/props`, `/apply-template`,
    `/tokenize`; each bounded by 5 s, a failure leaves its number out); `n_ctx`: the context we started it with."""
    ctx, n_prompt = None, None
    if _count(err.get("n_ctx")) is None:
        props = await _post_json(client, "GET", f"{base_url}/props", None)
        settings = props.get("default_generation_settings") if isinstance(props, dict) else None
        ctx = _count(settings.get("n_ctx")) if isinstance(settings, dict) else None
        ctx = ctx if ctx is not None else n_ctx
    if _count(err.get("n_prompt_tokens")) is None:
        n_prompt = await _prompt_tokens(client, base_url, prompt, chat)
    return overflow_error(err, n_prompt, ctx)


async def _prompt_tokens(client: httpx.AsyncClient, base_url: str, prompt: Any, chat: bool) -> int | None:
    if isinstance(prompt, list) and not chat:
        return len(prompt)  # token ids
    text = prompt
    if chat:
        got = await _post_json(client, "POST", f"{base_url}/apply-template", {"messages": prompt})
        text = got.get("prompt") if isinstance(got, dict) else None
    if not isinstance(text, str):
        return None
    got = await _post_json(client, "POST", f"{base_url}/tokenize", {"content": text, "add_special": True})
    tokens = got.get("tokens") if isinstance(got, dict) else None
    return len(tokens) if isinstance(tokens, list) else None


async def _post_json(client: httpx.AsyncClient, method: str, url: str, body: Any) -> Any:
    try:
        r = await client.request(method, url, json=body, timeout=5.0)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
