"""The web page's server side against a real daemon on SmolLM2: the page and its files, the event stream
(snapshot, coalesced updates, the gate and finished requests in it), the control routes, the API key."""

from __future__ import annotations

import base64
import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from genie_supervisor.api.security import StreamTokens
from genie_supervisor.app import Supervisor
from genie_supervisor.ui import vendor
from tests.daemon import client, make_supervisor, write_config, write_policy
from tests.serving_daemon import threaded_daemon
from tests.ui_fixtures import events, ui_api, ui_daemon

__all__ = ["ui_api", "ui_daemon"]

pytestmark = pytest.mark.timeout(120)

KEY = "gs-ui-test-5d1e9a7c3b"


def first_update(api: httpx.Client, want: Any, within: int = 200) -> dict[str, Any]:
    """Open ``/ui/events`` and read until an update's sample (not the snapshot's past ones) satisfies `want`
    (at most `within` events); returns the sample."""
    with api.stream("GET", "/ui/events") as r:
        assert r.status_code == 200
        for n, (name, data) in enumerate(events(r)):
            for sample in data["samples"] if name == "update" else ():
                if want(sample):
                    return dict(sample)
            assert n < within, "no matching sample arrived"
    raise AssertionError("the stream ended")


def test_page_and_files_need_no_key_and_name_the_charts_only_when_installed(ui_api: httpx.Client) -> None:
    """GET /ui is HTML with a CSP, loads ui.js, and links uPlot exactly when the vendor files are installed;
    the files under /ui/static/ are served with their types and nothing outside the folder is."""
    page = ui_api.get("/ui")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert "/ui/static/ui.js" in page.text
    assert ("uPlot.iife.min.js" in page.text) == vendor.installed()
    js = ui_api.get("/ui/static/ui.js")
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    assert ui_api.get("/ui/static/ui.css").headers["content-type"].startswith("text/css")
    for bad in ("/ui/static/../feed.py", "/ui/static/%2e%2e/feed.py", "/ui/static/nothing.js", "/ui/static/vendor.py"):
        assert ui_api.get(bad).status_code == 404, bad


@pytest.mark.timeout(300)
def test_wheel_carries_the_page_and_the_installed_charting_library(tmp_path: Path) -> None:
    """A wheel built from the checkout holds the page's files, and uPlot's files when `make deps` fetched them."""
    root = Path(__file__).resolve().parents[1]
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path)]
    done = subprocess.run([*build, str(root)], capture_output=True, text=True, timeout=280, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = tmp_path.glob("genie_supervisor-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    static = "genie_supervisor/ui/static/"
    assert {static + f for f in ("index.html", "ui.js", "ui.css")} <= names
    shipped = {static + "vendor/" + f for f in (*vendor.FILES.values(), vendor.STAMP)}
    assert (shipped <= names) == vendor.installed()


def test_vendor_checks_the_tarball_hash_and_the_installed_version(tmp_path: Path) -> None:
    """The fetch refuses bytes whose SHA-512 is not the pinned one, and the library counts as installed only
    with all its files and the pinned version's stamp."""
    data = b"a tarball"
    vendor.check_integrity(data, "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode())
    with pytest.raises(vendor.VendorError, match="expected"):
        vendor.check_integrity(data)
    assert not vendor.installed(tmp_path)
    for name in vendor.FILES.values():
        (tmp_path / name).write_text("x")
    (tmp_path / vendor.STAMP).write_text("0.0.1\n")
    assert not vendor.installed(tmp_path)
    (tmp_path / vendor.STAMP).write_text(vendor.VERSION + "\n")
    assert vendor.installed(tmp_path)


def test_stream_starts_with_a_snapshot_then_updates_at_most_ten_a_second(
    ui_daemon: Supervisor, ui_api: httpx.Client
) -> None:
    """The first event is a snapshot (kept samples, the view with the model and the policy); later samples come
    at least 0.1 s apart although telemetry alone changes the store every 50 ms."""
    with ui_api.stream("GET", "/ui/events") as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        stream = events(r)
        name, snap = next(stream)
        assert name == "snapshot" and snap["max_rate_hz"] == 10 and snap["window_s"] == 300
        assert snap["samples"] and snap["samples"][-1]["temps"]
        view = snap["view"]
        assert [m["id"] for m in view["models"]] == list(ui_daemon.models.models)
        assert view["models"][0]["memory"]["weights_mb"] > 0 and view["memory"]["budget_mb"] > 0
        assert view["policy"] == {"name": "ui-main", "error": None, "options": ["main", "other"], "active": "main"}
        stamps = [s["t"] for s in snap["samples"][-5:]]
        views = 0
        for _ in range(15):
            name, data = next(stream)
            assert name == "update"
            stamps += [s["t"] for s in data["samples"]]
            views += "view" in data
    assert views < 15  # the view comes again only when it changed (nothing changes it here)
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    assert min(gaps) >= 0.095, gaps


def test_voice_event_shows_the_gate_paused_for_stt_in_the_stream(ui_api: httpx.Client) -> None:
    """An STT start makes a sample with one STT session and the gate paused for stt; the stop opens it again."""
    assert (
        ui_api.post("/v1/voice/events", json={"service": "stt", "event": "start", "session": "ui-1"}).status_code == 200
    )
    try:
        paused = first_update(ui_api, lambda s: s["gate"] == "paused")
        assert paused["stt"] == 1 and paused["why"] == ["stt"]
    finally:
        ui_api.post("/v1/voice/events", json={"service": "stt", "event": "stop", "session": "ui-1"})
    assert first_update(ui_api, lambda s: s["gate"] == "open")["stt"] == 0


def test_finished_request_is_in_the_view_with_its_priority_and_first_token_time(ui_api: httpx.Client) -> None:
    """A finished chat request appears first in the view's requests (and /status) with its class, tokens, TTFT
    and finish reason."""
    r = ui_api.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4, "temperature": 0},
        headers={"X-Genie-Priority": "tool"},
    )
    assert r.status_code == 200, r.text
    with ui_api.stream("GET", "/ui/events") as s:
        _name, snap = next(events(s))
    done = snap["view"]["requests"][0]
    assert done["priority"] == "tool" and done["finish"] == "length" and done["completion"] == 4
    assert done["ttft_ms"] > 0 and done["prompt"] > 0 and done["tps"] > 0
    assert ui_api.get("/status").json()["requests"][-1]["priority"] == "tool"


def test_a_tool_call_answer_is_in_the_view_as_tool_calls(ui_api: httpx.Client) -> None:
    """A chat answered with a tool call (streamed or not) is listed with finish ``tool_calls``, as the API
    answered it, not the engine's ``stop``."""
    tool = {
        "type": "function",
        "function": {
            "name": "turn_on",
            "parameters": {
                "type": "object",
                "properties": {"room": {"type": "string", "enum": ["kitchen", "bedroom"]}},
                "required": ["room"],
            },
        },
    }
    body = {
        "messages": [{"role": "user", "content": "Turn on the kitchen light"}],
        "tools": [tool],
        "tool_choice": {"type": "function", "function": {"name": "turn_on"}},
        "max_tokens": 48,
        "temperature": 0,
    }
    for stream in (False, True):
        r = ui_api.post("/v1/chat/completions", json={**body, "stream": stream})
        assert r.status_code == 200 and "turn_on" in r.text, r.text
        assert ('"finish_reason":"tool_calls"' in r.text.replace(" ", "")) or (
            not stream and r.json()["choices"][0]["finish_reason"] == "tool_calls"
        ), r.text
        with ui_api.stream("GET", "/ui/events") as s:
            _name, snap = next(events(s))
        assert snap["view"]["requests"][0]["finish"] == "tool_calls", snap["view"]["requests"][0]


def test_controls_select_the_policy_switch_the_llm_and_reload(ui_daemon: Supervisor, ui_api: httpx.Client) -> None:
    """/control/policy puts another file in force (an unknown one is a 400 naming the field), /control/llm
    switches the LLM, /control/reload reloads, and a rejected reload is a 409 with the file's error."""
    bad = ui_api.post("/control/policy", json={"policy": "nope"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "policy"
    assert ui_api.post("/control/llm", json={"enabled": "no"}).json()["error"]["param"] == "enabled"
    try:
        r = ui_api.post("/control/policy", json={"policy": "other"})
        assert r.status_code == 200 and r.json()["policy"] == "other"
        assert ui_api.get("/status").json()["policy"]["name"] == "ui-other"
        off = ui_api.post("/control/llm", json={"enabled": False})
        assert off.json()["llm_enabled"] is False and not ui_daemon.models.enabled
        assert ui_api.post("/control/reload").json()["reloaded"] is True
        path = Path(ui_daemon.policy_watcher.path if ui_daemon.policy_watcher else "")
        good = path.read_text()
        path.write_text("version: 1\nname: [broken\n")
        try:
            rejected = ui_api.post("/control/reload")
            assert rejected.status_code == 409 and "other.yaml" in rejected.json()["error"]["message"]
            assert ui_api.get("/status").json()["policy"]["name"] == "ui-other"
        finally:
            path.write_text(good)
    finally:
        ui_api.post("/control/llm", json={"enabled": True})
        ui_api.post("/control/policy", json={"policy": "main"})
    assert ui_api.get("/status").json()["policy"]["name"] == "ui-main"


def test_stream_tokens_expire_and_only_their_own_mac_passes() -> None:
    """A token is valid until its expiry, not after, and a changed MAC or expiry (or one of any length) is refused."""
    now = [1000.0]
    tokens = StreamTokens(60, clock=lambda: now[0])
    token = tokens.issue()
    assert tokens.valid(token)
    expiry, _, mac = token.partition(".")
    assert not tokens.valid(f"{int(expiry) + 100}.{mac}")
    assert not tokens.valid(f"{expiry}.{mac[:-1]}0" if mac[-1] != "0" else f"{expiry}.{mac[:-1]}1")
    assert not StreamTokens(60, clock=lambda: now[0]).valid(token)  # another daemon's secret
    now[0] += 61
    assert not tokens.valid(token)
    assert not tokens.valid("") and not tokens.valid("abc.def") and not tokens.valid("١٢.x")
    assert not tokens.valid("9" * 5000 + ".x")  # more digits than int() takes: refused, not a 500


def test_with_a_key_the_page_is_open_but_stream_token_and_controls_need_it(tmp_path: Path) -> None:
    """With api.api_key: /ui and its files need no key; /ui/token, /control/* and /ui/events do, and the stream
    also opens with a token from /ui/token, which opens nothing else."""
    cfg = write_config(
        tmp_path / "supervisor.yaml", write_policy(tmp_path / "p.yaml"), extra=f"api: {{api_key: {KEY}, warmup: false}}"
    )
    with threaded_daemon(cfg) as sup:
        assert sup.http is not None
        base = f"http://127.0.0.1:{sup.http.port}"
        auth = {"Authorization": f"Bearer {KEY}"}
        with httpx.Client(base_url=base, timeout=30) as api:
            assert api.get("/ui").status_code == 200 and api.get("/ui/static/ui.js").status_code == 200
            assert api.post("/ui/token").status_code == 401
            assert api.post("/control/llm", json={"enabled": True}).status_code == 401
            assert api.get("/ui/events").status_code == 401
            assert api.get("/ui/events", params={"token": "1.abc"}).status_code == 401
            issued = api.post("/ui/token", headers=auth).json()
            assert issued["key_required"] is True and issued["expires_in"] == 60
            token = issued["token"]
            assert api.get("/status", params={"token": token}).status_code == 401
            for how in ({"params": {"token": token}}, {"headers": auth}):
                with api.stream("GET", "/ui/events", **how) as r:  # type: ignore[arg-type]
                    assert r.status_code == 200
                    assert next(events(r))[0] == "snapshot"
            assert api.post("/control/llm", json={"enabled": True}, headers=auth).status_code == 200


async def test_open_stream_ends_when_the_daemon_stops(tmp_path: Path) -> None:
    """A page's open stream does not hold up shutdown: it ends, and the daemon stops within its budget."""
    sup = make_supervisor(tmp_path, policy=write_policy(tmp_path / "p.yaml"))
    ended = anyio.Event()
    async with sup:
        async with client(sup) as http, anyio.create_task_group() as tg:
            opened = anyio.Event()

            async def read() -> None:
                async with http.stream("GET", "/ui/events") as r:
                    async for _line in r.aiter_lines():
                        opened.set()
                ended.set()

            tg.start_soon(read)
            with anyio.fail_after(10):
                await opened.wait()
            sup.request_stop("test")
            with anyio.fail_after(sup.shutdown_timeout_s):
                await ended.wait()
            assert sup.ui.subscribers == 0
