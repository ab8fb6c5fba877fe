"""``genie-supervisor models plan MODEL``: a model's memory plan from its GGUF header alone, against
the LLM budget of the profile (the config's policy), before the model is deployed.

The header is read with ``read_gguf(header_only=True)``: no tensor byte is read (a file cut after
its header plans the same). The plan is the engine's own (`engine.model.plan_on`, the numbers
the daemon checks before a load): weights as the backend stores them, the KV cache at the context,
and the scratch for the policy's prefill chunk.

Exit status: 0 the plan fits the budget, 3 it does not (the numbers say by how much), 1 the model,
config or policy cannot be read (the reason on stderr), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

MiB = 1024 * 1024
FITS, ERROR, OVER = 0, 1, 3


def add_parser(models: Any) -> None:
    """The ``plan`` subcommand under ``models``."""
    p = models.add_parser("plan", help="a model's memory plan from its GGUF header, against the profile's budget")
    p.add_argument("model", help="GGUF file (only its header is read)")
    p.add_argument(
        "--config", help="daemon config YAML: its engine defaults and its policy's budget (default: built-in)"
    )
    p.add_argument("--policy", help="policy YAML whose memory.llm_budget_mb applies (default: the config's policy)")
    p.add_argument("--n-ctx", type=int, help="context length (default: the config's engine.n_ctx)")
    p.add_argument("--kv", choices=["f16", "int8"], help="KV cache type (default: the config's engine.kv_dtype)")
    p.add_argument(
        "--backend",
        choices=["auto", "numpy", "native", "cupy"],
        help="backend to plan for (default: the config's; auto as it resolves on this machine)",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def plan_model(args: argparse.Namespace) -> dict[str, Any]:
    """The plan of `args.model` under `args.config` as a dict (raises on unreadable input)."""
    from engine import open_model_file
    from engine.backends import resolve_backend
    from engine.model import plan_on
    from engine.options import EngineOptions
    from engine.spec import read_spec

    from .config import load_config
    from .policy import load_policy
    from .policy.schema import builtin_policy

    cfg = load_config(args.config, {"policy": args.policy})
    policy = load_policy(cfg.policy.path) if cfg.policy.path else builtin_policy()
    asked = args.backend or cfg.engine.backend
    backend = resolve_backend(asked)
    n_ctx = args.n_ctx or cfg.engine.n_ctx
    kv = args.kv or cfg.engine.kv_dtype
    chunk = policy.voice.prefill_chunk_tokens
    gf = open_model_file(args.model, header_only=True)
    spec = read_spec(gf)
    plan = plan_on(gf, n_ctx, kv, backend, EngineOptions(prefill_chunk=chunk))
    budget = policy.memory.llm_budget_mb
    total = plan.total / MiB
    return {
        "model": args.model,
        "arch": spec.arch,
        "layers": spec.n_layers,
        "backend": backend,
        "backend_asked": asked,
        "n_ctx": n_ctx,
        "kv_dtype": kv,
        "prefill_chunk": chunk,
        "weights_mb": round(plan.weights / MiB, 1),
        "kv_mb": round(plan.kv / MiB, 1),
        "scratch_mb": round(plan.scratch / MiB, 1),
        "scratch_parts_mb": {name: round(b / MiB, 1) for name, b in plan.parts},
        "total_mb": round(total, 1),
        "policy": policy.name,
        "budget_mb": budget,
        "left_mb": round(budget - total, 1),
        "fits": total <= budget,
    }


def render(p: dict[str, Any]) -> str:
    """The plan as the terminal shows it."""
    auto = " (auto on this machine)" if p["backend_asked"] == "auto" else ""
    lines = [
        f"{p['model']}: {p['arch']}, {p['layers']} layers; backend {p['backend']}{auto}, n_ctx {p['n_ctx']}, "
        f"{p['kv_dtype']} KV, prefill chunk {p['prefill_chunk']} (policy {p['policy']!r})",
        f"  weights  {p['weights_mb']:9.1f} MiB",
        f"  KV       {p['kv_mb']:9.1f} MiB",
        f"  scratch  {p['scratch_mb']:9.1f} MiB"
        + (
            "  (" + ", ".join(f"{k} {v:.1f}" for k, v in p["scratch_parts_mb"].items() if v) + ")"
            if p["scratch_parts_mb"]
            else ""
        ),
        f"  total    {p['total_mb']:9.1f} MiB of the {p['budget_mb']:.0f} MiB LLM budget (memory.llm_budget_mb)",
    ]
    if p["fits"]:
        lines.append(f"fits: {p['left_mb']:.1f} MiB of the budget left")
    else:
        lines.append(
            f"does not fit: {-p['left_mb']:.1f} MiB over; lower --n-ctx, use --kv int8, a smaller model, "
            "or raise memory.llm_budget_mb in the policy"
        )
    return "\n".join(lines)


def cmd_plan(args: argparse.Namespace) -> int:
    """Print the plan; the exit status says whether it fits (module docstring)."""
    from engine.errors import EngineError

    from .errors import ConfigErrors, PolicyErrors

    try:
        p = plan_model(args)
    except (ConfigErrors, PolicyErrors) as exc:
        print(str(exc), file=sys.stderr)
        return ERROR
    except (EngineError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return ERROR
    print(json.dumps(p, indent=1) if args.json else render(p))
    return FITS if p["fits"] else OVER
