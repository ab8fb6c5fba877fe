"""Structured logging, configured once at start-up: JSON lines off a terminal, console on one.

    configure_logging(level="info", fmt="auto")      # in cmd_run, before anything logs

structlog's own loggers and the stdlib loggers of our neighbours (uvicorn, aiomqtt/paho, httpx)
go through the same processors and the same handler, so journald gets one JSON object per line
whoever logged it. Our code logs events, not sentences: ``log.info("decode_paused", reason=...)``.

Tracebacks never show local variables (structlog's and rich's default is to show them): a frame of a
request handler holds the prompt, the config holds the API key and the MQTT password.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

import structlog

from . import boot

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
"""Config level names -> stdlib levels."""

FOREIGN_LOGGERS = (
    "uvicorn",
    "uvicorn.error",
    "uvicorn.access",
    "aiomqtt",
    "paho",
    "paho.mqtt",
    "httpx",
    "httpcore",
    "asyncio",
)
"""Stdlib loggers of libraries we run, routed through our processors (their own handlers removed)."""

_QUIET = {"httpx": logging.WARNING, "httpcore": logging.WARNING, "uvicorn.access": logging.WARNING}
"""Chatty loggers held at WARNING unless the level is debug (one line per HTTP request is noise)."""


def _exception_formatter() -> Any:
    """The console's traceback renderer: rich's when installed, plain otherwise; never with locals."""
    try:
        import rich  # noqa: F401
    except ImportError:
        return structlog.dev.plain_traceback
    return structlog.dev.RichTracebackFormatter(show_locals=False)


def _drop_color_message(_logger: Any, _name: str, event: dict[str, Any]) -> dict[str, Any]:
    event.pop("color_message", None)  # uvicorn's ANSI-coloured copy of the message
    return event


def use_json(fmt: str, stream: TextIO) -> bool:
    """Whether to write JSON lines: ``json``, ``console``, or ``auto`` (JSON unless `stream` is a TTY)."""
    if fmt == "auto":
        isatty = getattr(stream, "isatty", None)
        return not (isatty is not None and isatty())
    return fmt == "json"


def configure_logging(level: str = "info", fmt: str = "auto", stream: TextIO | None = None) -> None:
    """Configure structlog and the stdlib root logger once; later calls replace the configuration."""
    stream = sys.stdout if stream is None else stream
    lvl = LEVELS[level]
    as_json = use_json(fmt, stream)
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.stdlib.ExtraAdder(),
        _drop_color_message,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    renderer: Any
    if as_json:
        shared.append(
            structlog.processors.ExceptionRenderer(structlog.tracebacks.ExceptionDictTransformer(show_locals=False))
        )  # no prompts, no secrets
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(
            colors=bool(getattr(stream, "isatty", lambda: False)()), exception_formatter=_exception_formatter()
        )
    structlog.configure(
        processors=[structlog.stdlib.filter_by_level, *shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    early = boot.take_early_logs()  # what the prewarm thread logged before this call
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(lvl)
    for record in early:
        if record.levelno >= lvl:
            handler.handle(record)
    for name in FOREIGN_LOGGERS:
        foreign = logging.getLogger(name)
        foreign.handlers.clear()
        foreign.propagate = True
        foreign.setLevel(max(lvl, _QUIET.get(name, lvl)) if lvl > logging.DEBUG else lvl)
