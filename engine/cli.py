"""`genie-supervisor chat` and `genie-supervisor bench`: the engine on its own, in a terminal."""

from __future__ import annotations

import argparse
import resource
import sys
import time
from typing import Any

import anyio

from . import Model, SamplingParams, load_model


def peak_rss_mb() -> float:
    """Peak resident memory of this process in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


async def _answer(model: Model, messages: list[dict[str, Any]], params: SamplingParams) -> str:
    gen = model.generate(model.encode_chat(messages), params)
    async for tok in gen:
        sys.stdout.write(tok.text)
        sys.stdout.flush()
    st = gen.stats
    sys.stdout.write("\n")
    print(
        f"[prompt {st.prompt_tokens} tok ({st.cached_tokens} cached) {st.prefill_tps:.1f} tok/s | "
        f"decode {st.completion_tokens} tok {st.decode_tps:.1f} tok/s | "
        f"first token {1000 * (st.first_token_s or 0):.0f} ms | peak RSS {peak_rss_mb():.0f} MiB | "
        f"{gen.finish_reason}]",
        file=sys.stderr,
    )
    return gen.text


def cmd_chat(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    model = load_model(args.model, backend=args.backend, n_ctx=args.ctx)
    print(
        f"[{model.info.name} ({model.info.arch}) on {model.backend}, ctx {model.info.n_ctx}, "
        f"loaded in {time.perf_counter() - t0:.1f} s]",
        file=sys.stderr,
    )
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.seed,
        top_k=40 if args.temperature > 0 else 0,
    )
    if not args.interactive:
        prompt = args.prompt if args.prompt is not None else "Hello! Who are you?"
        anyio.run(_answer, model, [{"role": "user", "content": prompt}], params)
        return 0
    messages: list[dict[str, Any]] = []
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        if not line.strip():
            continue
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            messages.clear()
            continue
        messages.append({"role": "user", "content": line})
        text = anyio.run(_answer, model, messages, params)
        messages.append({"role": "assistant", "content": text})


def measure(model: Model, prompt_tokens: int, gen_tokens: int) -> dict[str, float]:
    """Prefill and decode speed on a synthetic prompt (fresh cache), greedy, EOS ignored."""
    import numpy as np

    rng = np.random.default_rng(0)
    n_vocab = model.spec.n_vocab
    ids = [int(t) for t in rng.integers(100, min(n_vocab, 30000), prompt_tokens)]
    model.transformer.kv.tokens = []
    params = SamplingParams(max_tokens=gen_tokens, temperature=0.0, ignore_eos=True)

    async def run() -> Any:
        gen = model.generate(ids, params, prefill_chunk=512)
        async for _ in gen:
            pass
        return gen.stats

    st = anyio.run(run)
    return {"prefill_tps": st.prefill_tps, "decode_tps": st.decode_tps, "peak_rss_mb": peak_rss_mb()}


def cmd_bench(args: argparse.Namespace) -> int:
    model = load_model(args.model, backend=args.backend)
    r = measure(model, args.prompt_tokens, args.gen_tokens)
    print(
        f"{model.info.name} [{model.backend}] prefill {r['prefill_tps']:.1f} tok/s, "
        f"decode {r['decode_tps']:.1f} tok/s, peak RSS {r['peak_rss_mb']:.0f} MiB"
    )
    return 0
