"""``genie-supervisor run``: the daemon as a process, from its config to its exit status.

`cmd_run` loads the config (command-line flags override it), configures logging, builds the
Supervisor with the process's signals and an ExitDeadline, and runs it on the event loop (uvloop
when installed); `_serve` maps what ends the loop to an exit status: 0 after a clean stop, 1 for a
bad config or policy, a start-up failure or a crash (logged with its traceback), 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .app import Supervisor

OVERRIDES = ("model", "policy", "mqtt", "listen", "platform")
"""The flags of ``run`` that override the config."""


def start_early(args: argparse.Namespace) -> None:
    """`boot.start` for these arguments: the first thing ``genie-supervisor run`` does, before any
    heavy import (this module imports nothing else at its top for that reason)."""
    from . import boot, gc_start

    gc_start.hold()  # until supervisor_ready: the start makes almost no cyclic garbage
    boot.start(args.config, {k: getattr(args, k, None) for k in OVERRIDES})


async def _main(sup: Supervisor) -> None:
    await sup.run()


def cmd_run(args: argparse.Namespace) -> int:
    """``genie-supervisor run``: load the config (flags override it) and run until SIGTERM.

    The engine's per-process start-up (CUDA context, kernels) and the start model's load begin in
    a thread before anything else is imported (`boot.start`, from the raw config and policy),
    checked against the validated config by `startup.prepare`."""
    start_early(args)  # the start model's load, before the imports below (once: cli.main may have)
    from .config import load_config
    from .errors import ConfigErrors
    from .startup import prepare

    overrides = {k: getattr(args, k, None) for k in OVERRIDES}
    try:
        cfg = load_config(args.config, overrides)
    except ConfigErrors as exc:
        print(str(exc), file=sys.stderr)
        return 1
    from .logging import configure_logging

    configure_logging(cfg.log.level, cfg.log.format)  # before the prewarm thread may log
    prepare(cfg)
    from .app import Supervisor
    from .exit_deadline import ExitDeadline

    deadline = ExitDeadline()
    sup = Supervisor(cfg, handle_signals=True, exit_deadline=deadline)
    rc = _serve(sup)
    deadline.finish(rc, sup.shutdown_timeout_s)  # a worker thread stuck in a long call: exit anyway
    return rc


def _serve(sup: Supervisor) -> int:
    """Run the daemon's loop to the end; the exit status."""
    import anyio
    import structlog

    from engine.errors import EngineError

    from .app import _unwrap
    from .errors import ConfigErrors, PolicyErrors, SupervisorError, TelemetryError

    log = structlog.get_logger("genie_supervisor.app")  # the logger name these events always had

    backend = "asyncio"
    options: dict[str, Any] = {}
    try:
        import uvloop  # noqa: F401

        options["use_uvloop"] = True
    except ImportError:
        log.info("uvloop_unavailable", fallback="asyncio default loop")
    try:
        anyio.run(_main, sup, backend=backend, backend_options=options)
    except BaseException as raw:  # noqa: B036 - mapped to an exit status below, or re-raised
        err = _unwrap(raw)
        if isinstance(err, (PolicyErrors, ConfigErrors)):
            print(str(err), file=sys.stderr)
            return 1
        if isinstance(err, (SupervisorError, TelemetryError, EngineError, OSError, ValueError)):
            log.error("supervisor_failed", error=f"{type(err).__name__}: {err}")
            print(f"error: {err}", file=sys.stderr)
            return 1
        if isinstance(err, KeyboardInterrupt):
            return 130
        log.critical("supervisor_crashed", exc_info=err)  # the traceback (no locals), then exit 1
        return 1
    return 0
