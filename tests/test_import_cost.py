"""What the daemon's start imports: the modules it needs only later (a health URL to check, the first
/metrics scrape, a remote backend, MQTT, constrained output) stay out of a fresh process that imports
the app and builds its HTTP routes, so the start's import time cannot quietly grow back."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(120)

LATER = (
    "httpx",  # a watcher with a health URL, a remote or llama-server backend
    "prometheus_client",  # the first /metrics scrape
    "genie_supervisor.api.metrics",
    "genie_supervisor.watchers",  # a config with services
    "jsonschema",
    "llguidance",  # the first constrained request
    "openai",
    "ollama",
    "aiomqtt",  # MQTT, started after the models
    "genie_supervisor.mqtt",
    "genie_supervisor.llm.remote",
    "genie_supervisor.llm.llama_cpp",
    "genie_supervisor.doctor",
    "pydantic.v1",  # FastAPI's analysis of a declared query or path parameter (api.llama_extra's /props)
    "gguf",  # the file-type names of /api/show (the engine writes out the format's constants itself)
    "difflib",  # the did-you-mean of a config error
)
"""Modules a start with no services, no MQTT and the builtin backend must not import."""


def _imported(code: str) -> list[str]:
    """The LATER modules a fresh interpreter has imported after running `code`."""
    probe = (
        textwrap.dedent(code) + f"\nimport json, sys\nprint(json.dumps([m for m in {LATER!r} if m in sys.modules]))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=90, check=False)
    assert done.returncode == 0, done.stderr
    return list(json.loads(done.stdout.strip().splitlines()[-1]))


def test_the_app_and_its_routes_import_nothing_needed_only_later() -> None:
    """Importing genie_supervisor.app and building a Supervisor's HTTP app imports none of LATER."""
    code = """
        from genie_supervisor.api.server import create_app
        from genie_supervisor.app import Supervisor
        from genie_supervisor.config import load_config

        create_app(Supervisor(load_config(None, {}))._api_deps())
    """
    assert _imported(code) == []


def test_the_canary_fires() -> None:
    """The check sees a module of LATER once something imports it (here the metrics a scrape reads)."""
    assert _imported("import genie_supervisor.app, genie_supervisor.api.metrics") == [
        "prometheus_client",
        "genie_supervisor.api.metrics",
    ]


def test_the_engine_imports_no_daemon_or_grammar_module() -> None:
    """`import engine` (the early load's first step) imports neither llguidance nor jsonschema nor any daemon module."""
    assert _imported("import engine") == []
    code = "import engine, sys\nassert not [m for m in sys.modules if m.startswith(('genie_supervisor', 'fastapi', 'pydantic'))]"
    assert _imported(code) == []


def test_the_engine_never_imports_cupyx() -> None:
    """No engine module imports `cupyx`: it imports SciPy's sparse modules, 0.55 s that the first
    prompt-cache restore after a restart paid on a GPU (`kv_file.host_buffers` reaches CuPy's
    pinned pool through `cupy.cuda` instead)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "engine"
    pattern = re.compile(r"^\s*(import|from)\s+cupyx\b", re.M)
    offenders = [str(p.relative_to(root)) for p in root.rglob("*.py") if pattern.search(p.read_text(encoding="utf-8"))]
    assert offenders == []
