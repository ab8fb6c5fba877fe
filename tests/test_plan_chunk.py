"""The memory plan follows the policy's prefill chunk, shows its parts everywhere, and preloaded
models load at the start (tiny synthetic models, the daemon on a free port)."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from tests.apitools import POLICY, http, make_api_supervisor, synth

pytestmark = pytest.mark.timeout(90)


async def test_plan_follows_the_policy_chunk_and_a_loaded_model_keeps_its_own(tmp_path: Path) -> None:
    """The plan is made for the policy's chunk (16) and shows n_ctx, KV type and chunk in /status and
    /running; a reload to 64-token chunks leaves the loaded model on its plan (its generations
    prefill at most 16 tokens at a time) and its next load is planned for 64 (more scratch)."""
    body = f"models:\n  m: {{path: {synth(tmp_path, 'm')}, roles: [default]}}\napi: {{warmup: false}}\n"
    sup = make_api_supervisor(tmp_path, body)
    ask = {"prompt": "hello there", "n_predict": 2, "model": "m"}
    with anyio.fail_after(80):
        async with sup, http(sup) as client:
            assert (await client.post("/completion", json=ask)).status_code == 200
            (m,) = (await client.get("/running")).json()["running"]
            first = m["memory"]
            assert (first["n_ctx"], first["kv_dtype"], first["prefill_chunk"]) == (256, "f16", 16)
            assert first["total_mb"] == pytest.approx(
                first["weights_mb"] + first["kv_mb"] + first["scratch_mb"], abs=0.01
            )
            status = (await client.get("/status")).json()
            assert status["engine"]["stats"]["n_ctx"] == 256 and status["engine"]["stats"]["kv_dtype"] == "f16"
            assert status["engine"]["stats"]["scratch_mb"] == pytest.approx(first["scratch_mb"], abs=0.01)

            (tmp_path / "policy.yaml").write_text(
                POLICY.format(budget=1024, wait=30).replace("prefill_chunk_tokens: 16", "prefill_chunk_tokens: 64"),
                encoding="utf-8",
            )
            assert await sup.reload_policy() is True
            host = sup.models.models["m"].backend.host  # type: ignore[attr-defined]
            assert sup.arbiter.prefill_chunk_tokens == 64 and host.prefill_chunk == 16
            assert sup.models.models["m"].plan.chunk == 16  # type: ignore[union-attr]

            assert (await client.post("/unload", json={"model": "m"})).status_code == 200
            assert host.prefill_chunk == 64  # nothing loaded: the policy's
            assert (await client.post("/completion", json=ask)).status_code == 200
            again = sup.models.models["m"].plan
            assert again is not None and again.chunk == 64 and host.prefill_chunk == 64
            assert again.scratch > first["scratch_mb"] * 1024 * 1024 and again.weights / 2**20 == pytest.approx(
                first["weights_mb"], abs=0.01
            )


async def test_preload_loads_the_first_of_a_swap_group_at_the_start(tmp_path: Path) -> None:
    """`preload` models load before ready (only the first member of a swap group), the start
    reports its process-start-to-ready time, and a preload that fails does not stop the start."""
    big, small = synth(tmp_path, "big"), synth(tmp_path, "small", seed=1)
    body = (
        "models:\n"
        f"  big: {{path: {big}, roles: [default], group: llm, preload: true}}\n"
        f"  small: {{path: {small}, roles: [small], group: llm, preload: true}}\n"
        f"  gone: {{path: {tmp_path / 'missing.gguf'}, preload: true}}\n"
        "api: {warmup: false}\n"
    )
    sup = make_api_supervisor(tmp_path, body)
    with anyio.fail_after(80):
        async with sup, http(sup) as client:
            states = {k: m.state for k, m in sup.models.models.items()}
            assert states == {"big": "ready", "small": "unloaded", "gone": "error"}
            status = (await client.get("/status")).json()
            ready = status["startup"]["start_to_ready_s"]
            assert isinstance(ready, float) and ready > 0
            assert status["engine"]["stats"]["ready_s"] == ready
            assert status["startup"]["load_s"]["big"] is not None and status["startup"]["load_s"]["small"] is None
            r = await client.post("/completion", json={"prompt": "hi", "n_predict": 1, "model": "small"})
            assert r.status_code == 200  # swaps the preloaded one out
            assert sup.models.models["big"].state == "unloaded"
