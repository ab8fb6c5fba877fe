"""A test double of llama.cpp's llama-server: a real process speaking its HTTP API, deterministically.

    python tests/fake_llama_server.py -m MODEL.gguf --host 127.0.0.1 --port 8081 -c 512 --alias brain

Routes: ``GET /health``, ``GET /v1/models``, ``POST /completion`` and ``POST /v1/chat/completions``
(streaming and not); ``POST /tokenize``, ``/detokenize``, ``/apply-template`` and ``GET /props`` in their shape. The answer is always the same words (``REPLY``), cut at ``n_predict`` /
``max_tokens`` (one word = one token) or at a stop string; a prompt "token" is a
whitespace-separated word. A prompt of ``-c`` tokens or more gets llama-server's 400 error (its
``exceed_context_size_error`` body, or with ``--legacy-overflow`` an older build's, without the numbers).
Unknown arguments are ignored, so it accepts whatever llama-server would be started with.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

REPLY = ["Hello", " from", " the", " fake", " llama", " server", "."]
"""The tokens every answer is made of."""
VOCAB = [w.strip() for w in REPLY]
"""What ``/tokenize`` knows: a whitespace-separated word of the reply is its index (others: len(VOCAB))."""


def _words(n: int, stop: list[str]) -> tuple[list[str], str]:
    """The first `n` reply tokens (all of them, then end of generation), cut before a stop string."""
    out: list[str] = []
    text = ""
    for piece in REPLY[:n]:
        if any(s and s in text + piece for s in stop):
            return out, "stop"
        out.append(piece)
        text += piece
    return out, "stop" if n >= len(REPLY) else "length"


def create_app(alias: str, n_ctx: int, legacy_overflow: bool = False) -> FastAPI:
    """The fake server's routes."""
    app = FastAPI()

    def too_long(n_prompt: int, n_predict: int) -> JSONResponse | None:
        """llama-server's answer to a prompt that does not fit its context (max_tokens is not counted: it stops
        at the context's end); an older build's without the numbers with ``--legacy-overflow``."""
        if n_prompt < n_ctx:
            return None
        if legacy_overflow:
            error: dict[str, Any] = {
                "code": 400,
                "type": "invalid_request_error",
                "message": "the request exceeds the available context size, try increasing it",
            }
        else:
            error = {
                "code": 400,
                "type": "exceed_context_size_error",
                "n_prompt_tokens": n_prompt,
                "n_ctx": n_ctx,
                "message": f"request ({n_prompt} tokens) exceeds the available context size ({n_ctx} tokens), "
                "try increasing it",
            }
        return JSONResponse(status_code=400, content={"error": error})

    def timings(n_prompt: int, n_pred: int) -> dict[str, float]:
        return {
            "prompt_n": n_prompt,
            "prompt_ms": 1.0 * n_prompt,
            "prompt_per_second": 1000.0,
            "predicted_n": n_pred,
            "predicted_ms": 2.0 * n_pred,
            "predicted_per_second": 500.0,
        }

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {"id": alias, "object": "model", "created": 0, "owned_by": "llamacpp", "meta": {"n_ctx_train": n_ctx}}
            ],
        }

    @app.post("/completion")
    async def completion(request: Request) -> Response:
        body = await request.json()
        prompt = body.get("prompt", "")
        n_prompt = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
        n_predict = int(body.get("n_predict", -1))
        n = n_predict if n_predict >= 0 else 16
        if (err := too_long(n_prompt, n)) is not None:
            return err
        words, finish = _words(n, list(body.get("stop") or []))

        def final(content: str) -> dict[str, Any]:
            return {
                "content": content,
                "stop": True,
                "model": alias,
                "tokens_predicted": len(words),
                "tokens_evaluated": n_prompt,
                "stop_type": "limit" if finish == "length" else "word",
                "stopping_word": "",
                "timings": timings(n_prompt, len(words)),
            }

        if not body.get("stream"):
            return JSONResponse(final("".join(words)))

        async def events() -> AsyncIterator[str]:
            for w in words:
                yield "data: " + json.dumps({"content": w, "stop": False}) + "\n\n"
            yield "data: " + json.dumps(final("")) + "\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await request.json()
        text = " ".join(str(m.get("content") or "") for m in body.get("messages", []))
        n_prompt = len(text.split()) + 2 * len(body.get("messages", []))
        n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        if (err := too_long(n_prompt, n)) is not None:
            return err
        words, finish = _words(n, [body["stop"]] if isinstance(body.get("stop"), str) else list(body.get("stop") or []))
        usage = {"prompt_tokens": n_prompt, "completion_tokens": len(words), "total_tokens": n_prompt + len(words)}
        base = {"id": "chatcmpl-fake", "created": int(time.time()), "model": alias}
        if not body.get("stream"):
            return JSONResponse(
                {
                    **base,
                    "object": "chat.completion",
                    "usage": usage,
                    "choices": [
                        {
                            "index": 0,
                            "finish_reason": finish,
                            "message": {"role": "assistant", "content": "".join(words)},
                        }
                    ],
                }
            )

        def chunk(delta: dict[str, Any], fin: str | None) -> str:
            return (
                "data: "
                + json.dumps(
                    {
                        **base,
                        "object": "chat.completion.chunk",
                        "choices": [{"index": 0, "delta": delta, "finish_reason": fin}],
                    }
                )
                + "\n\n"
            )

        async def events() -> AsyncIterator[str]:
            yield chunk({"role": "assistant", "content": None}, None)
            for w in words:
                yield chunk({"content": w}, None)
            yield chunk({}, finish)
            if (body.get("stream_options") or {}).get("include_usage"):
                yield (
                    "data: "
                    + json.dumps(
                        {
                            **base,
                            "object": "chat.completion.chunk",
                            "choices": [],
                            "usage": usage,
                            "timings": timings(n_prompt, len(words)),
                        }
                    )
                    + "\n\n"
                )
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        words = str((await request.json()).get("content", "")).split()
        return {"tokens": [VOCAB.index(w) if w in VOCAB else len(VOCAB) for w in words]}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        ids = (await request.json()).get("tokens", [])
        return {"content": " ".join(VOCAB[i] if 0 <= i < len(VOCAB) else "?" for i in ids)}

    @app.post("/apply-template")
    async def apply_template(request: Request) -> dict[str, Any]:
        messages = (await request.json()).get("messages", [])
        return {"prompt": "".join(f"<{m['role']}>{m.get('content') or ''}\n" for m in messages) + "<assistant>"}

    @app.get("/props")
    async def props() -> dict[str, Any]:
        return {
            "default_generation_settings": {"n_ctx": n_ctx, "params": {"temperature": 0.8}},
            "total_slots": 4,
            "model_path": alias,
            "chat_template": "fake",
        }

    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", default="")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("-c", "--ctx-size", type=int, default=4096)
    p.add_argument("--alias", default="fake")
    p.add_argument("--legacy-overflow", action="store_true", help="answer an overflow as builds before b5000 did")
    args, _unknown = p.parse_known_args()
    uvicorn.run(
        create_app(args.alias, args.ctx_size, args.legacy_overflow), host=args.host, port=args.port, log_level="warning"
    )


if __name__ == "__main__":
    main()
