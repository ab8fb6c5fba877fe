"""The prompt cache across a daemon restart: the real daemon on SmolLM2 saves a chat's system prompt
to disk, and the next daemon serves its first request with that prefix restored from the file."""

from __future__ import annotations

from pathlib import Path

import anyio
import httpx
import pytest

from genie_supervisor.config import PromptCacheConfig
from genie_supervisor.llm.prompt_cache import default_dir, open_prompt_cache
from tests.apitools import http, oai
from tests.daemon import make_supervisor
from tests.daemon_process import DaemonProcess
from tests.models import SMOLLM2, require

pytestmark = pytest.mark.timeout(300)

SYSTEM = "You run the lights of a small house. Answer in one short sentence and never guess."


async def test_a_restarted_daemon_serves_the_first_request_from_the_disk_cache(tmp_path: Path) -> None:
    """The first daemon writes its chat's system prompt K/V to disk (finished before it exits); a new
    daemon loading the model again serves its first request with that system prompt with
    cached_tokens > 0 from the file, and /status and /metrics count the hit."""
    model = require(SMOLLM2)
    extra = f"prompt_cache: {{dir: {tmp_path / 'pc'}, min_tokens: 16}}"
    engine = "backend: auto, n_ctx: 512"
    system = {"role": "system", "content": SYSTEM}
    with anyio.fail_after(240):
        (tmp_path / "one").mkdir()
        async with make_supervisor(tmp_path / "one", model=model, engine=engine, extra=extra) as sup, oai(sup) as oa:
            asked = [system, {"role": "user", "content": "Is the porch light on?"}]
            first = await oa.chat.completions.create(messages=asked, model="x", max_tokens=2, temperature=0)
            assert first.usage is not None and first.usage.prompt_tokens_details is not None
            assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert len(list((tmp_path / "pc").rglob("*.kv"))) == 1

        (tmp_path / "two").mkdir()
        async with (
            make_supervisor(tmp_path / "two", model=model, engine=engine, extra=extra) as sup,
            oai(sup) as oa,
            http(sup) as client,
        ):
            asked = [system, {"role": "user", "content": "Which lights are on in the kitchen?"}]
            second = await oa.chat.completions.create(messages=asked, model="x", max_tokens=2, temperature=0)
            assert second.usage is not None and second.usage.prompt_tokens_details is not None
            cached = second.usage.prompt_tokens_details.cached_tokens
            assert cached is not None and 16 <= cached < second.usage.prompt_tokens
            status = (await client.get("/status")).json()["prompt_cache"]
            assert status["enabled"] and status["dir"] == str(tmp_path / "pc")
            assert (status["hits"], status["restored_tokens"], status["files"]) == (1, cached, 1)
            metrics = (await client.get("/metrics")).text
            assert 'genie_prompt_cache_events_total{event="hit"} 1.0' in metrics
            assert f"genie_prompt_cache_restored_tokens_total {float(cached)}" in metrics


async def test_a_daemon_that_restored_from_disk_exits_at_once_on_sigterm(tmp_path: Path) -> None:
    """The disk cache's read threads end at shutdown: a daemon process that served a request from
    a restored file exits 0 on SIGTERM without a forced exit (no thread left to wait for)."""
    model = require(SMOLLM2)
    extra = f"prompt_cache: {{dir: {tmp_path / 'pc'}, min_tokens: 16}}\napi: {{warmup: false, shutdown_timeout_s: 8}}"
    system = {"role": "system", "content": SYSTEM}
    for run in ("one", "two"):
        (tmp_path / run).mkdir()
        async with DaemonProcess(tmp_path / run, model=model, backend="native", extra=extra) as d:
            async with httpx.AsyncClient(base_url=d.url, timeout=60) as api:
                chat = {"messages": [system, {"role": "user", "content": f"Hi from {run}"}], "max_tokens": 2}
                got = (await api.post("/v1/chat/completions", json=chat)).json()
            rc, elapsed = await d.sigterm(within_s=12)
            forced = d.forced_exits()
            assert rc == 0 and not forced and elapsed < 4, (elapsed, forced)
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16  # the second run restored


def test_the_default_directory_follows_the_environment_and_disabled_means_none() -> None:
    """With prompt_cache.dir null the files go to $GENIE_PROMPT_CACHE_DIR, else systemd's
    $CACHE_DIRECTORY/prompt-cache (the first of several), else $XDG_CACHE_HOME; enabled: false
    makes no store."""
    assert default_dir({"GENIE_PROMPT_CACHE_DIR": "/x", "CACHE_DIRECTORY": "/c"}) == Path("/x")
    assert default_dir({"CACHE_DIRECTORY": "/var/cache/g:/other"}) == Path("/var/cache/g/prompt-cache")
    assert default_dir({"XDG_CACHE_HOME": "/h"}) == Path("/h/genie-supervisor/prompt-cache")
    assert open_prompt_cache(PromptCacheConfig(enabled=False)) is None
    store = open_prompt_cache(PromptCacheConfig(dir="$HOME/pc", max_bytes=5, min_tokens=7), {})
    assert store is not None and (store.max_bytes, store.min_tokens) == (5, 7)
    assert store.directory == Path.home() / "pc"
