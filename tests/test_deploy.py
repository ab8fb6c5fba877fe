"""The shipped deployment files: systemd units pass `systemd-analyze verify` and keep the settings
the daemon relies on, example configs load, the broker config is accepted by Mosquitto, and the
ports and unit names agree across files."""

from __future__ import annotations

import configparser
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from genie_supervisor.config import load_config, parse_hostport
from genie_supervisor.doctor.broker import mqtt_ping
from tests.broker import MOSQUITTO
from tests.net import free_port as _free_port

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
UNITS = sorted((DEPLOY / "systemd").glob("*.service"))
DROPINS = sorted((DEPLOY / "systemd").glob("*.service.d/*.conf"))
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")

pytestmark = pytest.mark.timeout(60)


def unit_settings(path: Path) -> dict[str, dict[str, list[str]]]:
    """Sections -> key -> every value (systemd keys repeat), continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    out: dict[str, dict[str, list[str]]] = {}
    section = ""
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            out[section] = {}
            continue
        key, _, value = line.partition("=")
        out[section].setdefault(key, []).append(value)
    return out


def test_the_units_and_dropins_exist() -> None:
    names = {p.name for p in UNITS}
    assert names == {"genie-supervisor.service", "wyoming-faster-whisper.service", "wyoming-piper.service"}
    assert {p.parent.name for p in DROPINS} == {"wyoming-faster-whisper.service.d", "wyoming-piper.service.d"}


@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed")
@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_systemd_analyze_verify_passes(unit: Path, tmp_path: Path) -> None:
    """verify checks every key and that ExecStart's program exists, so the program path (under
    /opt, absent here) is pointed at an executable stand-in; any warning fails the test."""
    fake = tmp_path / "bin" / "program"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    text = re.sub(r"^ExecStart=/\S+", f"ExecStart={fake}", unit.read_text(), flags=re.M)
    copy = tmp_path / unit.name
    copy.write_text(text)
    for dropin in DROPINS:
        if dropin.parent.name == f"{unit.name}.d":
            (tmp_path / dropin.parent.name).mkdir()
            shutil.copy(dropin, tmp_path / dropin.parent.name / dropin.name)
    assert SYSTEMD_ANALYZE is not None
    result = subprocess.run(
        [SYSTEMD_ANALYZE, "verify", "--man=no", str(copy)],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "SYSTEMD_LOG_LEVEL": "warning"},
    )
    problems = [line for line in (result.stdout + result.stderr).splitlines() if unit.name in line]
    assert result.returncode == 0 and not problems, result.stdout + result.stderr


def test_supervisor_unit_fits_the_daemon() -> None:
    """Type=notify with a watchdog (the daemon sends READY/WATCHDOG/STOPPING), a start limit,
    ordered before the voice services, hardened without hiding what it reads."""
    s = unit_settings(DEPLOY / "systemd" / "genie-supervisor.service")
    unit, service = s["Unit"], s["Service"]
    assert service["Type"] == ["notify"] and service["NotifyAccess"] == ["main"]
    assert service["Restart"] == ["on-failure"] and service["WatchdogSec"] == ["30s"]
    assert int(service["TimeoutStartSec"][0]) >= 120
    assert unit["StartLimitIntervalSec"] == ["120"] and unit["StartLimitBurst"] == ["3"]
    assert set(unit["Before"][0].split()) == {"wyoming-faster-whisper.service", "wyoming-piper.service"}
    assert {"network-online.target", "mosquitto.service"} <= set(unit["After"][0].split())
    assert service["ProtectSystem"] == ["strict"]
    for forbidden in ("PrivateDevices", "ProtectProc", "ProcSubset", "MemoryDenyWriteExecute"):
        assert forbidden not in service, f"{forbidden} would block the GPU, /proc or the JIT"
    assert "AF_UNIX" in service["RestrictAddressFamilies"][0]  # the notify socket
    assert service["ExecStart"][0].endswith("run --config /etc/genie-supervisor/supervisor.yaml")


def test_example_configs_load() -> None:
    for name in ("orin-nano-8gb.yaml", "linux-cpu.yaml", "supervisor.yaml"):
        cfg = load_config(DEPLOY / "config" / name)
        assert cfg.stt_services() == ["whisper"], name
    orin = load_config(DEPLOY / "config" / "orin-nano-8gb.yaml")
    assert orin.telemetry.platform == "jetson" and orin.policy.path == "/etc/genie-supervisor/policy.yaml"
    cpu = load_config(DEPLOY / "config" / "linux-cpu.yaml")
    assert cpu.engine.backend == "native" and cpu.telemetry.platform == "linux"


def test_voice_units_listen_where_the_proxies_forward() -> None:
    """The example whisper/Piper units serve the upstream of the Orin config's proxies, and the
    config finds them by the unit names the supervisor unit is ordered before."""
    cfg = load_config(DEPLOY / "config" / "orin-nano-8gb.yaml")
    before = unit_settings(DEPLOY / "systemd" / "genie-supervisor.service")["Unit"]["Before"][0].split()
    for name, unit in (("whisper", "wyoming-faster-whisper.service"), ("piper", "wyoming-piper.service")):
        svc = cfg.services[name]
        assert svc.match.systemd_unit == unit and unit in before
        assert svc.proxy is not None
        exec_start = unit_settings(DEPLOY / "systemd" / unit)["Service"]["ExecStart"][0]
        uri = re.search(r"--uri tcp://(\S+)", exec_start)
        assert uri is not None and parse_hostport(uri.group(1)) == parse_hostport(svc.proxy.upstream)
        after = unit_settings(DEPLOY / "systemd" / f"{unit}.d" / "genie.conf")["Unit"]["After"]
        assert after == ["genie-supervisor.service"]


def _run_mosquitto(tmp_path: Path, conf_text: str, probes: list[dict[str, Any]]) -> list[tuple[bool, str]]:
    """Start Mosquitto on `conf_text` and return mqtt_ping's answer for each probe (url + kwargs)."""
    conf = tmp_path / "genie.conf"
    conf.write_text(conf_text + ("user root\n" if os.geteuid() == 0 else ""))
    assert MOSQUITTO is not None
    with (tmp_path / "log").open("wb") as log:
        proc = subprocess.Popen([MOSQUITTO, "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT)
    try:
        first = dict(probes[0])
        deadline = time.monotonic() + 10
        while True:  # readiness of a process we do not control: poll, bounded
            up, why = mqtt_ping(first.pop("url"), timeout_s=1, **first)
            first = dict(probes[0])
            if "TCP connect" not in why or proc.poll() is not None or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert proc.poll() is None, (tmp_path / "log").read_text()
        return [mqtt_ping(p.pop("url"), timeout_s=2, **p) for p in map(dict, probes)]
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.skipif(MOSQUITTO is None, reason="the mosquitto binary is not installed")
def test_mosquitto_accepts_the_broker_config_on_loopback_only(tmp_path: Path) -> None:
    """deploy/mosquitto/genie.conf listens on 127.0.0.1 only (no LAN listener active) and takes local clients."""
    port = _free_port()
    text = (DEPLOY / "mosquitto" / "genie.conf").read_text()
    active = [line for line in text.splitlines() if line.strip() and not line.startswith("#")]
    assert [line for line in active if line.startswith("listener")] == ["listener 1883 127.0.0.1"]
    [(up, why)] = _run_mosquitto(
        tmp_path,
        text.replace("listener 1883 127.0.0.1", f"listener {port} 127.0.0.1"),
        [{"url": f"mqtt://127.0.0.1:{port}"}],
    )
    assert up, why + (tmp_path / "log").read_text()


@pytest.mark.skipif(
    MOSQUITTO is None or shutil.which("mosquitto_passwd") is None or shutil.which("openssl") is None,
    reason="mosquitto, mosquitto_passwd and openssl are needed",
)
def test_the_documented_lan_and_tls_sections_of_the_broker_config_work(tmp_path: Path) -> None:
    """Switched to its LAN and TLS sections, the broker config refuses anonymous clients and takes the user, over TLS too."""
    from tests.test_mqtt_security import make_pki

    pki = make_pki(tmp_path)
    passwd = tmp_path / "passwd"
    subprocess.run(
        ["mosquitto_passwd", "-b", "-c", str(passwd), "genie", "pw"], check=True, capture_output=True, timeout=10
    )
    plain, tls = _free_port(), _free_port()
    text = (DEPLOY / "mosquitto" / "genie.conf").read_text()
    text = text.replace("\nlistener 1883 127.0.0.1\nallow_anonymous true\n", "\n")
    text = re.sub(r"^#(LAN|TLS) ", "", text, flags=re.M)
    for old, new in (
        ("listener 1883", f"listener {plain} 127.0.0.1"),
        ("listener 8883", f"listener {tls} 127.0.0.1"),
        ("/etc/mosquitto/passwd", str(passwd)),
        ("/etc/mosquitto/certs/ca.crt", str(pki["ca"])),
        ("/etc/mosquitto/certs/server.crt", str(pki["server"])),
        ("/etc/mosquitto/certs/server.key", str(pki["server_key"])),
    ):
        assert re.search(rf"^{re.escape(old)}$|^\S+ {re.escape(old)}$", text, flags=re.M), old
        text = text.replace(old, new)
    user = {"username": "genie", "password": "pw"}
    anonymous, ok, anonymous_tls, ok_tls = _run_mosquitto(
        tmp_path,
        text,
        [
            {"url": f"mqtt://127.0.0.1:{plain}"},
            {"url": f"mqtt://127.0.0.1:{plain}", **user},
            {"url": f"mqtts://127.0.0.1:{tls}", "ca_file": str(pki["ca"])},
            {"url": f"mqtts://127.0.0.1:{tls}", "ca_file": str(pki["ca"]), **user},
        ],
    )
    assert not anonymous[0] and "refused the connection" in anonymous[1], anonymous
    assert not anonymous_tls[0] and "refused the connection" in anonymous_tls[1], anonymous_tls
    assert ok[0] and ok_tls[0], (ok, ok_tls)


def test_compose_file_is_consistent() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    assert {"mosquitto", "supervisor"} <= set(services)
    assert "profiles" not in services["mosquitto"] and "profiles" not in services["supervisor"]
    assert services["whisper"]["profiles"] == ["voice"] and services["piper"]["profiles"] == ["voice"]
    conf = services["mosquitto"]["volumes"][0].split(":")[0]
    assert (DEPLOY / conf).resolve() == (DEPLOY / "mosquitto" / "genie.conf").resolve()
    command = " ".join(services["supervisor"]["command"])
    for path in re.findall(r"/src/(\S+\.yaml)", command):
        assert (REPO / path).exists(), path


def test_unit_parses_as_ini() -> None:
    """Each unit is also plain INI (no stray text outside sections)."""
    for path in [*UNITS, *DROPINS]:
        parser = configparser.ConfigParser(strict=False, interpolation=None)
        parser.read_string(re.sub(r"\\\n\s*", " ", path.read_text()))
        assert parser.sections(), path
