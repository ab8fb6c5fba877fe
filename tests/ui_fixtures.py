"""Fixtures of the web page's tests: a daemon on SmolLM2 whose policy folder holds two policies (the page's
select), a plain HTTP client, and a reader of the server-sent events of ``/ui/events``.

Import them into a test module (``from tests.ui_fixtures import ui_api, ui_daemon``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine import load_model
from genie_supervisor.app import Supervisor
from tests.daemon import write_config, write_policy
from tests.models import SMOLLM2, require
from tests.serving_daemon import threaded_daemon

__all__ = ["ui_api", "ui_daemon", "events", "policy_dir"]


def policy_dir(tmp: Path) -> Path:
    """A folder with the policies ``main`` (named ui-main) and ``other`` (ui-other), both pausing on STT."""
    folder = tmp / "policies"
    folder.mkdir()
    write_policy(folder / "main.yaml", "ui-main", holdoff_ms=100)
    write_policy(folder / "other.yaml", "ui-other", holdoff_ms=100)
    return folder


@pytest.fixture(scope="module")
def ui_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Supervisor]:
    """The daemon serving SmolLM2 (one CPU thread; a fresh load after each unload) under policies/main.yaml,
    run by a thread of its own."""
    tmp = tmp_path_factory.mktemp("ui")
    cfg = write_config(tmp / "supervisor.yaml", policy_dir(tmp) / "main.yaml", model=require(SMOLLM2))

    def load(*_args: Any, **_kwargs: Any) -> Any:
        return load_model(SMOLLM2, threads=1)

    with threaded_daemon(cfg, model_loader=load) as sup:
        yield sup


@pytest.fixture(scope="module")
def ui_api(ui_daemon: Supervisor) -> Iterator[httpx.Client]:
    """A plain HTTP client against the daemon."""
    assert ui_daemon.http is not None
    with httpx.Client(base_url=f"http://127.0.0.1:{ui_daemon.http.port}", timeout=60) as client:
        yield client


def events(response: httpx.Response) -> Iterator[tuple[str, dict[str, Any]]]:
    """The (event name, data) pairs of a server-sent-events response, as they arrive (comments skipped)."""
    name, data = "message", ""
    for line in response.iter_lines():
        if line.startswith(":"):
            continue
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            data += line[6:]
        elif line == "" and data:
            yield name, json.loads(data)
            name, data = "message", ""
