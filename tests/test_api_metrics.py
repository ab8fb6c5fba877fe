"""/metrics reads the LLM budget from the arbiter's decision in force, not from the policy directly."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from tests.apitools import POLICY, http, make_api_supervisor

pytestmark = pytest.mark.timeout(60)


def _budget_mb(metrics: str) -> float:
    line = next(line for line in metrics.splitlines() if line.startswith("genie_llm_budget_bytes "))
    return float(line.split()[1]) / (1024 * 1024)


async def test_metrics_budget_is_the_decisions_budget(tmp_path: Path) -> None:
    """genie_llm_budget_bytes is the decision's llm_budget_mb, and follows a policy reload once the arbiter applies it."""
    sup = make_api_supervisor(tmp_path, "api: {warmup: false}", budget=4)
    with anyio.fail_after(50):
        async with sup, http(sup) as client:
            assert sup.arbiter.decision is not None and sup.arbiter.decision.llm_budget_mb == 4
            assert _budget_mb((await client.get("/metrics")).text) == 4

            (tmp_path / "policy.yaml").write_text(POLICY.format(budget=64, wait=30), encoding="utf-8")
            assert await sup.reload_policy() is True
            assert sup.arbiter.decision.llm_budget_mb == 64
            assert _budget_mb((await client.get("/metrics")).text) == 64
