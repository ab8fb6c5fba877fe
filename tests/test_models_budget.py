"""A policy reload changes the model manager's budget and admission's classes in the running daemon (tiny synthetic models)."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from tests.apitools import POLICY, http, make_api_supervisor, synth

pytestmark = pytest.mark.timeout(90)


async def test_policy_reload_changes_the_budget_and_classes_the_daemon_serves(tmp_path: Path) -> None:
    """A model over the budget is refused with the numbers; after a reload that raises the budget and
    adds a class it loads, and requests of the new class are admitted (both pushed by the arbiter)."""
    body = f"models:\n  huge: {{path: {synth(tmp_path, 'huge', 'big')}}}\napi: {{max_running: 2, warmup: false}}\n"
    sup = make_api_supervisor(tmp_path, body, budget=4)
    ask = {"prompt": "hi", "n_predict": 2, "model": "huge"}
    with anyio.fail_after(80):
        async with sup, http(sup) as client:
            assert sup.models.budget_mb == 4
            r = await client.post("/completion", json=ask)
            assert r.status_code == 503
            assert "budget (policy memory.llm_budget_mb) is 4.0 MiB" in r.json()["error"]["message"]
            r = await client.post("/completion", json=ask, headers={"x-genie-priority": "urgent"})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_priority"

            text = POLICY.format(budget=64, wait=30).replace(
                "  classes:\n", "  classes:\n    - {name: urgent, max_queue: 1, max_wait_s: 3}\n"
            )
            (tmp_path / "policy.yaml").write_text(text, encoding="utf-8")
            assert await sup.reload_policy() is True
            assert sup.models.budget_mb == 64 and sup.arbiter.decision is not None
            assert sup.arbiter.decision.llm_budget_mb == 64
            assert [c.name for c in sup.admission.classes()] == ["urgent", "voice", "tool", "background"]

            r = await client.post("/completion", json=ask, headers={"x-genie-priority": "urgent"})
            assert r.status_code == 200, r.text
            assert sup.models.models["huge"].state == "ready"
            assert sup.admission.admitted["urgent"] == 1
            status = (await client.get("/status")).json()
            assert status["decision"]["llm_budget_mb"] == 64
            assert status["memory_plan"]["budget_mb"] == 64
