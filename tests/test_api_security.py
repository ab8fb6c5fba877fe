"""The API key, CORS and the browser checks, against one real daemon process on SmolLM2.

One `genie-supervisor run` per module (loading the model takes seconds); its whole log (stdout and
stderr, at debug level) is kept and searched for the key at the end. The rules themselves (Host
names, key files) are also tested without a daemon.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from genie_supervisor.api.security import Guarded
from genie_supervisor.config import load_config
from genie_supervisor.errors import ConfigErrors
from genie_supervisor.status import cmd_status
from tests.daemon import write_policy
from tests.lines import Lines as _Lines
from tests.models import SMOLLM2, require
from tests.net import free_port as _free_port

pytestmark = pytest.mark.timeout(120)

KEY = "gs-test-7f3a9c1e5b2d4f60a8e1"
WRONG = "gs-test-0000000000000000wrong"
ORIGIN = "http://app.example:3000"
EVIL = "http://evil.example"
MODEL_ID = "brain"


@dataclass
class Daemon:
    """A running daemon process and what it printed."""

    proc: subprocess.Popen[str]
    out: _Lines
    port: int
    base: str

    def client(self, key: str | None = KEY, header: str = "bearer", **kw: Any) -> httpx.Client:
        headers = dict(kw.pop("headers", {}))
        if key is not None:
            headers.update({"Authorization": f"Bearer {key}"} if header == "bearer" else {"x-api-key": key})
        return httpx.Client(base_url=self.base, headers=headers, timeout=60, **kw)

    def log(self) -> str:
        """Everything printed so far (the reader thread keeps what wait_for has not consumed)."""
        while not self.out.lines.empty():
            self.out.seen.append(self.out.lines.get_nowait())
        return "".join(self.out.seen)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """`genie-supervisor run` with a key file, one listed CORS origin and one extra LAN name."""
    model = require(SMOLLM2)
    tmp = tmp_path_factory.mktemp("security")
    (tmp / "api-key").write_text(KEY + "\n", encoding="utf-8")
    port = _free_port()
    cfg = tmp / "supervisor.yaml"
    cfg.write_text(
        "\n".join(
            [
                "log: {level: debug, format: json}",
                "telemetry: {platform: simulated, interval_s: 0.05}",
                f"policy: {{path: {write_policy(tmp / 'p.yaml')}, watch: false}}",
                "engine: {backend: auto, n_ctx: 512}",
                f"http: {{listen: '127.0.0.1:{port}', cors_origins: ['{ORIGIN}'], allowed_hosts: [genie.lan]}}",
                "api: {api_key_file: api-key, warmup: false}",
                "models:",
                f"  {MODEL_ID}: {{path: {model}, roles: [default], resident: true}}",
                f"  spare: {{path: {model}}}",  # never loaded: POST /unload of it is a harmless 200
            ]
        )
        + "\n",
        encoding="utf-8",
    )
    env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "genie_supervisor", "run", "--config", str(cfg)],
        cwd=tmp,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    out = _Lines(proc)
    try:
        out.wait_for('"supervisor_ready"', 90)
        yield Daemon(proc, out, port, f"http://127.0.0.1:{port}")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        out.thread.join(5)
        if proc.stdout is not None:
            proc.stdout.close()


CHAT = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0}
ROUTES = [
    pytest.param("POST", "/v1/chat/completions", CHAT, id="openai-chat"),
    pytest.param(
        "POST", "/v1/completions", {"model": "default", "prompt": "Hi", "max_tokens": 1}, id="openai-completions"
    ),
    pytest.param("GET", "/v1/models", None, id="openai-models"),
    pytest.param("POST", "/completion", {"prompt": "Hi", "n_predict": 1}, id="llama-completion"),
    pytest.param("GET", "/status", None, id="ops-status"),
    pytest.param("GET", "/metrics", None, id="ops-metrics"),
    pytest.param("GET", "/running", None, id="manage-running"),
    pytest.param("POST", "/unload", {"model": "spare"}, id="manage-unload"),
    pytest.param("POST", "/v1/voice/events", {"service": "tts", "event": "stop"}, id="manage-voice-events"),
]


def _call(http: httpx.Client, method: str, path: str, body: Any) -> httpx.Response:
    return http.request(method, path, json=body) if body is not None else http.request(method, path)


def _assert_401(r: httpx.Response) -> None:
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"].startswith("Bearer")
    err = r.json()["error"]
    assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error" and err["message"]
    assert KEY not in r.text and WRONG not in r.text


@pytest.mark.parametrize(("method", "path", "body"), ROUTES)
def test_route_needs_the_key_in_either_header(daemon: Daemon, method: str, path: str, body: Any) -> None:
    """Each route family answers 401 without the key or with a wrong one, and 2xx with it as Bearer or x-api-key."""
    with (
        daemon.client(None) as anon,
        daemon.client(WRONG) as wrong,
        daemon.client(WRONG, "x-api-key") as wrong_x,
        daemon.client(KEY) as bearer,
        daemon.client(KEY, "x-api-key") as xkey,
    ):
        for refused in (anon, wrong, wrong_x):
            _assert_401(_call(refused, method, path, body))
        with daemon.client(None, headers={"Authorization": f"Basic {KEY}"}) as basic:
            _assert_401(_call(basic, method, path, body))  # only the Bearer scheme carries the key
        for ok in (bearer, xkey):
            r = _call(ok, method, path, body)
            assert 200 <= r.status_code < 300, (r.status_code, r.text)


def test_health_is_open_and_status_never_shows_the_key(daemon: Daemon) -> None:
    """/health answers without a key; /status (with it) does not contain the key."""
    with daemon.client(None) as anon, daemon.client() as http:
        health = anon.get("/health")
        assert health.status_code == 200 and health.json()["models"][MODEL_ID] == "ready"
        status = http.get("/status")
        assert status.status_code == 200 and KEY not in status.text


def test_openai_client_with_the_key_works_and_a_wrong_key_raises(daemon: Daemon) -> None:
    """The official client with api_key=KEY gets a completion; with a wrong key it raises AuthenticationError."""
    with openai.OpenAI(base_url=f"{daemon.base}/v1", api_key=KEY, max_retries=0, timeout=60) as good:
        reply = good.chat.completions.create(**CHAT)
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert [m.id for m in good.models.list().data] == [MODEL_ID, "spare"]
    with (
        openai.OpenAI(base_url=f"{daemon.base}/v1", api_key=WRONG, max_retries=0, timeout=60) as bad,
        pytest.raises(openai.AuthenticationError) as info,
    ):
        bad.chat.completions.create(**CHAT)
    assert info.value.status_code == 401 and info.value.code == "invalid_api_key"


def test_cors_preflight_for_a_listed_origin_and_refusal_for_another(daemon: Daemon) -> None:
    """A preflight from a listed origin gets 204 with the allow headers (no key); another origin gets 403."""
    ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization, content-type"}
    with daemon.client(None) as anon:
        r = anon.options("/v1/chat/completions", headers={"Origin": ORIGIN, **ask})
        assert r.status_code == 204, r.text
        assert r.headers["access-control-allow-origin"] == ORIGIN
        assert r.headers["access-control-allow-credentials"] == "true"
        assert "POST" in r.headers["access-control-allow-methods"]
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        assert int(r.headers["access-control-max-age"]) > 0
        refused = anon.options("/v1/chat/completions", headers={"Origin": EVIL, **ask})
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "origin_not_allowed"
        assert "access-control-allow-origin" not in refused.headers
    with daemon.client(headers={"Origin": ORIGIN}) as listed, daemon.client(headers={"Origin": EVIL}) as other:
        r = listed.get("/v1/models")
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
        r = listed.post("/v1/voice/events", json={"service": "tts", "event": "stop"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
        with daemon.client(None, headers={"Origin": ORIGIN}) as listed_anon:
            r = listed_anon.get("/status")  # a browser app can read why it was refused
            assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGIN
        r = other.get("/v1/models")
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_cross_origin_unload_is_refused_and_the_model_stays_loaded(daemon: Daemon) -> None:
    """POST /unload from an unlisted Origin (even with the key, even with an empty body) gets 403; the model stays ready."""
    with daemon.client(headers={"Origin": EVIL}) as page, daemon.client() as http:
        for r in (
            page.post("/unload"),
            page.post("/unload", json={"model": MODEL_ID, "force": True}),
            page.post("/unload", headers={"Origin": "null"}),
        ):
            assert r.status_code == 403, r.text
            assert r.json()["error"]["code"] == "origin_not_allowed"
        running = http.get("/running").json()["running"]
        assert [(m["id"], m["state"]) for m in running] == [(MODEL_ID, "ready")]
        own = http.post("/unload", json={"model": "spare"}, headers={"Origin": daemon.base})
        assert own.status_code == 200  # the daemon's own origin is not cross-origin


def test_text_plain_voice_event_is_refused_and_the_gate_stays_open(daemon: Daemon) -> None:
    """A text/plain (or form) body on POST /v1/voice/events gets 415 and does not pause the LLM."""
    body = b'{"service": "stt", "event": "start"}'
    with daemon.client() as http:
        for ctype in ("text/plain;charset=UTF-8", "application/x-www-form-urlencoded", "multipart/form-data"):
            r = http.post("/v1/voice/events", content=body, headers={"Content-Type": ctype})
            assert r.status_code == 415, (ctype, r.text)
            assert r.json()["error"]["code"] == "unsupported_media_type"
        status = http.get("/status").json()
        assert status["voice"]["stt_active"] is False and status["gate"]["mode"] == "open"
        for ctype in ("application/json; charset=utf-8", "application/merge-patch+json"):
            r = http.post(
                "/v1/voice/events", content=b'{"service": "tts", "event": "stop"}', headers={"Content-Type": ctype}
            )
            assert r.status_code == 200, (ctype, r.text)
        assert http.post("/unload", json={"model": "spare"}).status_code == 200
        r = http.post("/v1/voice/events", headers={"Content-Type": "text/plain"})  # empty: the route's own 400
        assert r.status_code == 400 and "must be JSON" in r.json()["error"]["message"], r.text


def test_a_host_that_is_not_this_daemon_is_refused(daemon: Daemon) -> None:
    """A DNS-rebinding Host gets 403 on every route, /health included; loopback, IPs and allowed_hosts pass."""
    with daemon.client() as http:
        for host in ("evil.example", f"evil.example:{daemon.port}", "127.0.0.1.evil.example", "genie.lan.evil"):
            for path in ("/health", "/v1/models", "/status"):
                r = http.get(path, headers={"Host": host})
                assert r.status_code == 403, (host, path, r.status_code)
                assert r.json()["error"]["code"] == "host_not_allowed"
        r = http.post("/unload", json={"model": MODEL_ID}, headers={"Host": "evil.example"})
        assert r.status_code == 403
        for host in (
            f"localhost:{daemon.port}",
            f"127.0.0.1:{daemon.port}",
            "genie.lan",
            f"GENIE.LAN:{daemon.port}",
            "192.168.1.20:8080",
        ):
            assert http.get("/v1/models", headers={"Host": host}).status_code == 200, host
        assert http.get("/running").json()["running"][0]["state"] == "ready"


def test_status_command_sends_the_key_from_the_environment(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`genie-supervisor status` passes $GENIE_API_KEY; without it, it exits 1 saying how to give the key."""
    args = argparse.Namespace(url=daemon.base)
    monkeypatch.delenv("GENIE_API_KEY", raising=False)
    assert cmd_status(args) == 1
    assert "wants the API key: GENIE_API_KEY=" in capsys.readouterr().err
    monkeypatch.setenv("GENIE_API_KEY", KEY)
    assert cmd_status(args) == 0
    out = capsys.readouterr().out
    assert f"at {daemon.base}: ready" in out and KEY not in out


def test_zz_the_key_is_never_in_the_log(daemon: Daemon) -> None:
    """After every request above (wrong keys too) the daemon's whole debug log holds neither key; refusals are logged."""
    with daemon.client(None) as anon:
        assert anon.get("/status", headers={"Authorization": f"Bearer {WRONG}"}).status_code == 401
    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.proc.wait(timeout=15) == 0
    daemon.out.thread.join(5)
    log = daemon.log()
    assert '"supervisor_stopped"' in log and '"http_refused"' in log and '"api_key": true' in log
    assert KEY not in log and WRONG not in log


# --- the rules without a daemon -----------------------------------------------------------------


def _config(tmp_path: Path, body: str) -> Any:
    path = tmp_path / "supervisor.yaml"
    path.write_text(body, encoding="utf-8")
    return load_config(path)


def test_key_file_is_read_with_its_newline_stripped_and_never_dumped(tmp_path: Path) -> None:
    """api.api_key_file (relative to the config, or ${CREDENTIALS_DIRECTORY}/...) gives the key; dumps mask api_key."""
    (tmp_path / "k").write_text(KEY + "\r\n", encoding="utf-8")
    assert _config(tmp_path, "api: {api_key_file: k}").api.key() == KEY
    os.environ["GENIE_TEST_CREDS"] = str(tmp_path)
    try:
        assert _config(tmp_path, "api: {api_key_file: '${GENIE_TEST_CREDS}/k'}").api.key() == KEY
    finally:
        del os.environ["GENIE_TEST_CREDS"]
    cfg = _config(tmp_path, f"api: {{api_key: {KEY}}}")
    assert cfg.api.key() == KEY
    assert KEY not in repr(cfg) and KEY not in str(cfg.model_dump()) and KEY not in cfg.model_dump_json()
    assert _config(tmp_path, "http: {listen: '127.0.0.1:1'}").api.key() is None


@pytest.mark.parametrize(
    ("body", "content", "message"),
    [
        ("api: {api_key_file: missing}", None, "cannot read the API key file {dir}/missing"),
        ("api: {api_key_file: k}", "\n", "the API key file {dir}/k is empty"),
        ("api: {api_key_file: k, api_key: x}", "x", "give api_key or api_key_file, not both"),
        ("api: {api_key: ''}", None, "the API key is empty"),
        ("api: {api_key_file: '${GENIE_TEST_UNSET_VAR}/k'}", None, "$GENIE_TEST_UNSET_VAR is not set"),
        ("http: {cors_origins: ['http://a.example/path']}", None, "expected an origin like http://HOST[:PORT]"),
        ("http: {allowed_hosts: ['http://a.example']}", None, "expected a host name or IP address"),
    ],
)
def test_bad_key_or_origin_config_is_an_error_naming_file_and_key(
    tmp_path: Path, body: str, content: str | None, message: str
) -> None:
    """A missing or empty key file, two keys, an empty key, a path as origin: a config error naming the file."""
    if content is not None:
        (tmp_path / "k").write_text(content, encoding="utf-8")
    with pytest.raises(ConfigErrors) as info:
        _config(tmp_path, body + "\n")
    text = str(info.value)
    assert f"{tmp_path / 'supervisor.yaml'}:1" in text and message.format(dir=tmp_path) in text, text
    assert KEY not in text


def test_host_rules_follow_the_listen_address_and_the_key(tmp_path: Path) -> None:
    """Loopback accepts loopback names and IPs; a wildcard listen adds the host name, or any name with a key."""
    loop = Guarded.from_config(_config(tmp_path, "http: {listen: '127.0.0.1:8080'}"), hostname="orin")
    assert loop.host_ok("localhost:8080") and loop.host_ok("127.0.0.1:8080") and loop.host_ok("[::1]:8080")
    assert loop.host_ok("10.0.0.5") and not loop.host_ok("orin:8080") and not loop.host_ok("attacker.example")
    assert not loop.host_ok("") and not loop.host_ok(None) and not loop.host_ok("[::1") and not loop.host_ok("a:b:c")
    lan = Guarded.from_config(
        _config(tmp_path, "http: {listen: '0.0.0.0:8080', allowed_hosts: [genie.lan]}"), hostname="orin.home"
    )
    assert all(lan.host_ok(h) for h in ("orin:8080", "orin.local", "orin.home", "genie.lan", "192.168.1.9:8080"))
    assert not lan.host_ok("attacker.example:8080")
    named = Guarded.from_config(_config(tmp_path, "http: {listen: 'orin.lan:8080'}"), hostname="orin")
    assert named.host_ok("orin.lan:8080") and named.host_ok("orin") and not named.host_ok("evil.lan")
    keyed = Guarded.from_config(_config(tmp_path, f"http: {{listen: '[::]:8080'}}\napi: {{api_key: {KEY}}}"))
    assert keyed.hosts is None and keyed.host_ok("anything.example")
    assert not keyed.needs_key("/health") and keyed.needs_key("/metrics") and keyed.needs_key("/v1/models")
    public = Guarded.from_config(_config(tmp_path, f"api: {{api_key: {KEY}, metrics_public: true}}"))
    assert not public.needs_key("/metrics") and public.needs_key("/status")
    assert not Guarded.from_config(_config(tmp_path, "node_id: x")).needs_key("/status")
