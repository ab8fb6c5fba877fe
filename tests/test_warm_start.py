"""Warm start: compiled kernels land in the folder the systemd unit keeps, and the daemon reports
its process start to ready (a real daemon process on SmolLM2, native CPU kernels)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from genie_supervisor.startup import kernel_cache_dir, use_kernel_cache
from tests.daemon_process import DaemonProcess
from tests.models import SMOLLM2, require

pytestmark = pytest.mark.timeout(120)


def test_kernel_cache_dir_prefers_the_config_then_systemd_then_the_user_cache() -> None:
    """engine.kernel_cache_dir wins; else systemd's $CACHE_DIRECTORY/kernels; else XDG (~/.cache)."""
    assert kernel_cache_dir("/srv/k", {"CACHE_DIRECTORY": "/var/cache/g"}) == Path("/srv/k")
    assert kernel_cache_dir(None, {"CACHE_DIRECTORY": "/var/cache/g:/other"}) == Path("/var/cache/g/kernels")
    assert kernel_cache_dir(None, {"XDG_CACHE_HOME": "/x"}) == Path("/x/genie-supervisor/kernels")
    env = {"CUPY_CACHE_DIR": "/mine"}
    assert use_kernel_cache(Path("/k"), env) == {"GENIE_KERNEL_CACHE_DIR": "/k/native"}
    assert env == {"CUPY_CACHE_DIR": "/mine", "GENIE_KERNEL_CACHE_DIR": "/k/native"}  # a set variable wins


async def test_daemon_keeps_kernels_under_the_cache_directory_and_reports_start_to_ready(tmp_path: Path) -> None:
    """Under systemd's CacheDirectory= (no kernel_cache_dir in the config) the native kernels are
    built into $CACHE_DIRECTORY/kernels/native, and the ready line and /status say how long the
    process took from its start to ready, with the model's load phases in model_loaded."""
    cache = tmp_path / "var-cache"
    env = {"CACHE_DIRECTORY": str(cache), "GENIE_KERNEL_CACHE_DIR": "", "CUPY_CACHE_DIR": ""}
    daemon = DaemonProcess(tmp_path, model=require(SMOLLM2), backend="native", env=env)
    async with daemon as d, httpx.AsyncClient(base_url=d.url, timeout=60) as api:
        ready = await d.event("supervisor_ready")
        loaded = await d.event("model_loaded")
        assert ready["kernel_cache_dir"] == str(cache / "kernels")
        assert 0 < ready["start_to_ready_s"] < 120 and ready["prewarm_error"] is None
        assert set(loaded["phases_s"]) == {"header", "backend", "tokenizer", "template", "ops", "weights_kv", "decoder"}
        assert loaded["plan"]["prefill_chunk"] == 16 and loaded["plan"]["kv_dtype"] == "f16"
        startup = (await api.get("/status")).json()["startup"]
        assert startup["start_to_ready_s"] == ready["start_to_ready_s"]
    assert list((cache / "kernels" / "native").glob("qgemv-*.so"))
