"""Daemon config: defaults, the shipped example, CLI overrides, and file:line errors."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from genie_supervisor.config import Config, load_config, parse_hostport
from genie_supervisor.errors import ConfigErrors

ROOT = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, text: str) -> str:
    """Write a dedented config file and return its path."""
    p = tmp_path / "supervisor.yaml"
    p.write_text(textwrap.dedent(text).lstrip("\n"))
    return str(p)


def errors_of(path: str) -> list[str]:
    """The formatted errors of loading `path`."""
    with pytest.raises(ConfigErrors) as exc:
        load_config(path)
    return [i.format() for i in exc.value.issues]


def test_defaults_without_file() -> None:
    """With no file every section has its default."""
    c = load_config(None)
    assert c == Config()
    assert (c.node_id, c.http.listen, c.mqtt.url, c.telemetry.platform) == ("genie", "127.0.0.1:8080", None, "auto")
    assert c.voice.hint_timeout_s == 30 and c.services == {}


def test_shipped_example_loads_clean() -> None:
    """deploy/config/supervisor.yaml loads and its relative policy path resolves to a real file."""
    c = load_config(ROOT / "deploy/config/supervisor.yaml")
    assert c.services["whisper"].kind == "wyoming_stt"
    assert c.services["whisper"].proxy is not None and c.services["whisper"].proxy.hold_max_ms == 250
    assert c.policy.path is not None and Path(c.policy.path).resolve() == (ROOT / "policies/orin-nano-8gb.yaml")


def test_cli_overrides_win(tmp_path: Path) -> None:
    """CLI flags override the file; None flags are ignored."""
    f = write(
        tmp_path,
        """
        http: {listen: 127.0.0.1:1}
        telemetry: {platform: linux}
        """,
    )
    c = load_config(
        f,
        {
            "listen": "0.0.0.0:9000",
            "mqtt": "mqtt://broker:1884",
            "model": "/m.gguf",
            "policy": "/p.yaml",
            "platform": "simulated",
            "unused": None,
        },
    )
    assert (c.http.listen, c.mqtt.url, c.engine.model, c.policy.path, c.telemetry.platform) == (
        "0.0.0.0:9000",
        "mqtt://broker:1884",
        "/m.gguf",
        "/p.yaml",
        "simulated",
    )


def test_bad_override_is_reported() -> None:
    """A bad CLI value is rejected like a bad file value."""
    with pytest.raises(ConfigErrors, match=r"http\.listen: expected HOST:PORT"):
        load_config(None, {"listen": "nowhere"})


def test_relative_paths_resolve_against_the_file(tmp_path: Path) -> None:
    """Relative model and policy paths are taken relative to the config file's folder."""
    f = write(
        tmp_path,
        """
        engine: {model: models/m.gguf}
        policy: {path: p.yaml}
        """,
    )
    c = load_config(f)
    assert c.engine.model == str(tmp_path / "models/m.gguf") and c.policy.path == str(tmp_path / "p.yaml")


def test_errors_name_file_line_key_value(tmp_path: Path) -> None:
    """Unknown keys, wrong types, bad values and cross-field rules are reported each at its line."""
    f = write(
        tmp_path,
        """
        node_id: Box 1
        http:
          listen: nope
        mqtt:
          url: http://x
          keepalive: abc
        services:
          whisper:
            kind: wyoming_stt
            match: {process_nam: x}
          ha:
            kind: http
          dfn:
            kind: dfn
            proxy: {listen: "0.0.0.0:1", upstream: "127.0.0.1:2"}
        telemetry:
          platform: jetsonn
        """,
    )
    assert errors_of(f) == [
        f"{f}:1 node_id: String should match pattern '^[a-z0-9_-]{{1,64}}$' (got 'Box 1')",
        f"{f}:3 http.listen: expected HOST:PORT with a port 1-65535, got 'nope'",
        f"{f}:5 mqtt.url: expected mqtt://HOST[:PORT] or mqtts://HOST[:PORT], got 'http://x'",
        f"{f}:6 mqtt.keepalive: Input should be a valid integer, unable to parse string as an integer (got 'abc')",
        f"{f}:10 services.whisper.match.process_nam: unknown key (did you mean 'process_name'?); expected one of: "
        "cgroup_path, cmdline_pattern, container, health_url, pid_file, process_name, systemd_unit",
        f"{f}:11 services.ha.match: a http service needs match.health_url",
        f"{f}:15 services.dfn.proxy: a proxy only applies to wyoming_stt and wyoming_tts services, not dfn",
        f"{f}:17 telemetry.platform: Input should be 'auto', 'jetson', 'nvml', 'linux' or 'simulated' (got 'jetsonn')",
    ]


def test_malformed_yaml(tmp_path: Path) -> None:
    """Malformed YAML is reported at the parser's line."""
    f = write(
        tmp_path,
        """
        log:
          level: info
         format: json
        """,
    )
    (err,) = errors_of(f)
    assert err.startswith(f"{f}:3: malformed YAML:")


def test_missing_file(tmp_path: Path) -> None:
    """A missing file is one clear error."""
    (err,) = errors_of(str(tmp_path / "nope.yaml"))
    assert err.startswith(f"{tmp_path / 'nope.yaml'}: cannot read:")


def test_bad_service_name(tmp_path: Path) -> None:
    """Service names must be safe in MQTT topics."""
    f = write(
        tmp_path,
        """
        services:
          Whisper STT:
            kind: process
        """,
    )
    assert errors_of(f) == [f"{f}:2 services.Whisper STT: service name 'Whisper STT' must be 1-64 of a-z, 0-9, _ and -"]


def test_bad_cmdline_regex(tmp_path: Path) -> None:
    """A cmdline pattern must be a valid regular expression."""
    f = write(
        tmp_path,
        """
        services:
          whisper:
            kind: process
            match:
              cmdline_pattern: "whisper("
        """,
    )
    (err,) = errors_of(f)
    assert err.startswith(f"{f}:5 services.whisper.match.cmdline_pattern: not a valid regular expression")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("127.0.0.1:8080", ("127.0.0.1", 8080)),
        ("tcp://host:10300", ("host", 10300)),
        ("[::1]:80", ("::1", 80)),
    ],
)
def test_parse_hostport(value: str, expected: tuple[str, int]) -> None:
    """HOST:PORT, tcp://HOST:PORT and [v6]:PORT parse."""
    assert parse_hostport(value) == expected


@pytest.mark.parametrize("value", ["host", "host:0", "host:70000", ":80"])
def test_parse_hostport_rejects(value: str) -> None:
    """Addresses without a valid port are refused."""
    with pytest.raises(ValueError):
        parse_hostport(value)


def test_services_become_watchers() -> None:
    """The watchers take the configured services as they are: whisper's proxy gets its ports and hold from them."""
    from genie_supervisor.watchers import ServiceWatcher, WyomingProxy, build_watchers

    c = load_config(ROOT / "deploy/config/supervisor.yaml")
    runnables = build_watchers(c.services, lambda obs: None)
    proxies = {r.name: r for r in runnables if isinstance(r, WyomingProxy)}
    whisper = proxies["whisper"]
    assert whisper.service == "stt" and whisper.upstream_port == 10310 and whisper.hold_max_s == 0.25
    assert proxies["piper"].service == "tts" and proxies["piper"].listen_port == 10200
    assert {r.name for r in runnables if isinstance(r, ServiceWatcher)} == set(c.services)
    assert c.stt_services() == ["whisper"]


def test_service_settings_are_frozen() -> None:
    """A validated service, its match and its proxy cannot be changed behind the watchers' back."""
    from pydantic import ValidationError

    svc = load_config(ROOT / "deploy/config/supervisor.yaml").services["whisper"]
    assert svc.proxy is not None
    for model, key, value in ((svc, "interval_s", 1.0), (svc.match, "pid_file", "x"), (svc.proxy, "hold_max_ms", 1)):
        with pytest.raises(ValidationError, match="frozen"):
            setattr(model, key, value)
