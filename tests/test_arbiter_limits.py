"""The LLM budget and the request classes reach the model manager and admission only through the arbiter's decisions."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import anyio
import pytest

from genie_supervisor.arbiter import Arbiter, DecodeGate
from genie_supervisor.config import Config
from genie_supervisor.llm.admission import Admission, QueueFull, UnknownPriority
from genie_supervisor.llm.manager import ModelManager
from genie_supervisor.llm.serving import BackendContext
from genie_supervisor.policy.evaluate import evaluate
from genie_supervisor.policy.schema import Policy, builtin_policy
from genie_supervisor.state import (
    DEFAULT_PRIORITIES,
    Decision,
    PriorityClass,
    PriorityTable,
    StateStore,
)

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.timeout(30)


def _policy(budget: float, classes: list[dict[str, Any]], default: str) -> Policy:
    return Policy.model_validate(
        {
            "version": 1,
            "name": "p",
            "memory": {"llm_budget_mb": budget},
            "priorities": {"classes": classes, "default_class": default},
        }
    )


def _parts(arbiter: Arbiter) -> tuple[ModelManager, Admission]:
    cfg = Config()
    manager = ModelManager(
        cfg, BackendContext(cfg, arbiter.gate, arbiter, lambda _obs: None), publish=lambda _obs: None
    )
    return manager, Admission(max_running=1, max_queue=8)


class _Recorder:
    """Counts what the arbiter pushes."""

    def __init__(self) -> None:
        self.budgets: list[float | None] = []
        self.tables: list[PriorityTable] = []

    def apply_budget(self, mb: float | None) -> None:
        self.budgets.append(mb)

    def apply_priorities(self, table: PriorityTable) -> None:
        self.tables.append(table)


async def test_policy_reload_reaches_manager_and_admission_through_the_arbiter_before_publish_returns() -> None:
    """A reloaded policy's budget and classes are in the manager and admission as soon as the store
    hears of the reload (no loop turn in between), and admission refuses with the new limits."""
    store, arbiter = StateStore(), Arbiter(DecodeGate())
    manager, admission = _parts(arbiter)
    arbiter.attach(models=manager, admission=admission)
    box = {
        "policy": _policy(
            512,
            [
                {"name": "voice", "max_queue": 2, "max_wait_s": 5},
                {"name": "background", "max_queue": 4, "max_wait_s": 60},
            ],
            "background",
        )
    }
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await tg.start(arbiter.run, store, lambda: box["policy"])
            assert manager.budget_mb == 512
            assert [c.name for c in admission.classes()] == ["voice", "background"]
            with pytest.raises(UnknownPriority, match="'tool' is not one of voice, background"):
                admission.resolve("tool")

            box["policy"] = _policy(
                1024,
                [
                    {"name": "voice", "max_queue": 2, "max_wait_s": 5},
                    {"name": "tool", "max_queue": 0, "max_wait_s": 9},
                    {"name": "background", "max_queue": 4, "max_wait_s": 60},
                ],
                "tool",
            )
            store.set_policy("p", None)  # what a reload does (Supervisor._on_policy); no await follows
            assert manager.budget_mb == 1024
            assert admission.classes() == [
                PriorityClass("voice", 2, 5.0),
                PriorityClass("tool", 0, 9.0),
                PriorityClass("background", 4, 60.0),
            ]
            assert admission.resolve(None) == "tool" and admission.resolve("tool") == "tool"
            async with admission.slot("tool"):
                with pytest.raises(QueueFull, match=r"the queue of class tool is full \(0 waiting\)"):
                    async with admission.slot("tool"):
                        pass
            assert arbiter.decision is not None and arbiter.decision.llm_budget_mb == 1024
            tg.cancel_scope.cancel()


def test_manager_and_admission_without_an_arbiter_use_the_builtin_policy_defaults() -> None:
    """Nothing pushed yet: the manager's budget and admission's classes are what the built-in policy decides."""
    manager, admission = _parts(Arbiter(DecodeGate()))
    decided = evaluate(builtin_policy(), StateStore().snapshot())
    assert manager.budget_mb == decided.llm_budget_mb == 2560
    assert admission.classes() == list(decided.priorities.classes) == list(DEFAULT_PRIORITIES.classes)
    assert [(c.name, c.max_queue, c.max_wait_s) for c in admission.classes()] == [
        ("voice", 4, 5.0),
        ("tool", 8, 30.0),
        ("background", 16, 300.0),
    ]
    assert admission.resolve(None) == decided.priorities.default_class == "background"


def test_arbiter_pushes_budget_and_classes_only_when_they_change() -> None:
    """A changed budget or table is pushed even when the gate effect is the same (no log line, no
    listener call); an equal decision pushes nothing; attaching late pushes the decision in force."""
    arbiter, rec = Arbiter(DecodeGate()), _Recorder()
    seen: list[Decision] = []
    arbiter.add_listener(seen.append)
    arbiter.attach(models=rec, admission=rec)
    table = PriorityTable((PriorityClass("voice", 1, 1.0), PriorityClass("bulk", 2, 2.0)), "bulk")
    assert arbiter.apply(Decision(ts=1.0, policy="p", llm_budget_mb=100)) is True
    assert rec.budgets == [100] and rec.tables == [DEFAULT_PRIORITIES] and len(seen) == 1
    assert arbiter.apply(Decision(ts=2.0, policy="p", llm_budget_mb=200)) is False
    assert rec.budgets == [100, 200] and len(rec.tables) == 1 and len(seen) == 1
    assert arbiter.apply(Decision(ts=3.0, policy="p", llm_budget_mb=200)) is False
    assert rec.budgets == [100, 200] and len(rec.tables) == 1
    equal = PriorityTable((PriorityClass("voice", 1, 1.0), PriorityClass("bulk", 2, 2.0)), "bulk")
    assert arbiter.apply(Decision(ts=4.0, policy="p", llm_budget_mb=200, priorities=table)) is False
    assert arbiter.apply(Decision(ts=5.0, policy="p", llm_budget_mb=200, priorities=equal)) is False
    assert rec.tables == [DEFAULT_PRIORITIES, table] and rec.budgets == [100, 200] and len(seen) == 1
    late = _Recorder()
    arbiter.attach(models=late, admission=late)
    assert late.budgets == [200] and late.tables == [table]


def test_evaluate_carries_the_policy_budget_and_classes() -> None:
    """The decision holds the policy's budget and its classes in order; the same policy gives an equal decision."""
    policy = _policy(777, [{"name": "a", "max_queue": 3, "max_wait_s": 4}, {"name": "b"}], "b")
    snap = StateStore().snapshot()
    d = evaluate(policy, snap)
    assert d.llm_budget_mb == 777
    assert d.priorities == PriorityTable((PriorityClass("a", 3, 4.0), PriorityClass("b", 8, 30.0)), "b")
    assert evaluate(policy, snap) == d
    other = _policy(777, [{"name": "a", "max_queue": 3, "max_wait_s": 4}, {"name": "b"}], "a")
    assert evaluate(other, snap).priorities.default_class == "a"
    assert evaluate(policy, snap).priorities == d.priorities


@pytest.mark.parametrize(
    "module",
    ["genie_supervisor/llm/manager.py", "genie_supervisor/llm/engine_view.py", "genie_supervisor/llm/admission.py"],
)
def test_models_and_admission_never_read_the_policy(module: str) -> None:
    """models.py and admission.py import nothing from the policy package and reach for no `.policy` attribute."""
    tree = ast.parse((ROOT / module).read_text(encoding="utf-8"), module)
    imported: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = ".".join(["genie_supervisor"] * bool(node.level) + ([node.module] if node.module else []))
            imported += [base, *(f"{base}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            imported += [a.name for a in node.names]
    assert imported, "the walk found the imports"
    assert not [m for m in imported if m.split(".")[:2] == ["genie_supervisor", "policy"]]
    assert not [
        n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in ("policy", "policy_watcher")
    ]
