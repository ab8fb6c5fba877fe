"""`genie-supervisor doctor`: verdicts and exit codes on the simulated platform, a real model,
a real broker (Mosquitto on a free loopback port) and a broker that is not there."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from genie_supervisor.cli import main
from genie_supervisor.config import ServiceConfig
from genie_supervisor.doctor import Check, Probes, audit, exit_code, render
from genie_supervisor.doctor.broker import connect_packet, mqtt_ping
from genie_supervisor.doctor.checks import check_service, check_thermal, l4t_release
from genie_supervisor.events import TelemetrySample
from genie_supervisor.policy.schema import Policy
from tests.broker import MOSQUITTO, needs_broker
from tests.models import SMOLLM2, require
from tests.net import free_port

pytestmark = pytest.mark.timeout(60)


def write_policy(path: Path, budget_mb: float) -> Path:
    path.write_text(
        f"version: 1\nname: test-{budget_mb:g}\nmemory:\n  llm_budget_mb: {budget_mb}\n"
        "thermal:\n  levels:\n    - {name: hot, enter_c: 90, leave_c: 85, action: pause}\n"
    )
    return path


def write_config(
    tmp_path: Path, *, budget_mb: float = 2560, model: Path | None = None, mqtt: str | None = None, extra: str = ""
) -> Path:
    policy = write_policy(tmp_path / "policy.yaml", budget_mb)
    cfg = tmp_path / "supervisor.yaml"
    cfg.write_text(
        f"node_id: test\nhttp:\n  listen: 127.0.0.1:{free_port()}\n"
        f"mqtt:\n  url: {mqtt or 'null'}\n"
        f"engine:\n  model: {model or 'null'}\n  backend: numpy\n  n_ctx: 4096\n"
        f"policy:\n  path: {policy}\n"
        "telemetry:\n  platform: simulated\n  simulated:\n    mem_total_mb: 7620\n    mem_available_mb: 5000\n" + extra
    )
    return cfg


def by_name(checks: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks}


def doctor(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(["doctor", *argv])
    return code, capsys.readouterr().out


# --- memory plan against the policy's budget -------------------------------------------------


def test_model_that_fits_the_budget_passes_with_exit_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """SmolLM2 at n_ctx 4096 plans ~627 MiB: under a 2560 MiB budget and the box's 5000 MiB available."""
    cfg = write_config(tmp_path, budget_mb=2560, model=require(SMOLLM2))
    code, out = doctor(capsys, "--config", str(cfg))
    assert code == 0, out
    checks = by_name(audit(str(cfg)))
    memory = checks["memory"]
    assert memory.status == "ok"
    assert "weights 513 + KV 90 (n_ctx 4096, f16) + scratch 24 (prefill chunk 64) = 627 MiB; budget 2560 MiB" in (
        memory.detail
    )
    assert "box 5000 of 7620 MiB available" in memory.detail
    assert checks["telemetry"].status == "ok" and checks["telemetry"].detail.startswith("simulated")
    assert checks["model"].detail.startswith("SmolLM2-135M-Instruct.Q4_1.gguf: llama")
    assert "verdict: all good" in out


def test_model_over_budget_fails_with_exit_1_and_the_numbers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A 400 MiB budget is below the weights alone: refused, and no context length would help."""
    cfg = write_config(tmp_path, budget_mb=400, model=require(SMOLLM2))
    code, out = doctor(capsys, "--config", str(cfg))
    assert code == 1
    memory = by_name(audit(str(cfg)))["memory"]
    assert memory.status == "fail"
    assert memory.detail.startswith("over budget: weights 513")
    assert "n_ctx" not in memory.fix and "smaller model" in memory.fix
    assert "FAIL memory" in out and "verdict: the daemon would NOT start (1 failure(s)" in out


def test_over_budget_only_because_of_the_context_suggests_a_context_that_fits(tmp_path: Path) -> None:
    """600 MiB: n_ctx 4096 plans 627 MiB, n_ctx 2048 plans 578 MiB, so the fix names 2048."""
    cfg = write_config(tmp_path, budget_mb=600, model=require(SMOLLM2))
    memory = by_name(audit(str(cfg)))["memory"]
    assert memory.status == "fail"
    assert memory.fix.startswith("set engine.n_ctx to 2048 or less")


def test_plan_above_available_memory_warns(tmp_path: Path) -> None:
    """Within budget but more than MemAvailable: starts (warn), the load would push others out."""
    cfg = write_config(tmp_path, budget_mb=2560, model=require(SMOLLM2), extra="    temps_c: {cpu: 40}\n")
    cfg.write_text(cfg.read_text().replace("mem_available_mb: 5000", "mem_available_mb: 500"))
    checks = audit(str(cfg))
    assert by_name(checks)["memory"].status == "warn"
    assert exit_code(checks) == 0 and exit_code(checks, strict=True) == 1


def test_missing_model_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write_config(tmp_path, model=tmp_path / "nope.gguf")
    code, out = doctor(capsys, "--config", str(cfg))
    assert code == 1
    model = by_name(audit(str(cfg)))["model"]
    assert model.status == "fail" and "not found" in model.detail
    assert "models fetch" in model.fix


def test_model_flag_overrides_the_config_like_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write_config(tmp_path, model=tmp_path / "nope.gguf")
    code, out = doctor(capsys, "--config", str(cfg), "--model", str(require(SMOLLM2)))
    assert code == 0, out


def test_not_a_gguf_fails(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"this is not a gguf file at all" * 10)
    checks = by_name(audit(str(write_config(tmp_path, model=bad))))
    assert checks["model"].status == "fail"


# --- broker ------------------------------------------------------------------------------------


def test_missing_broker_warns_and_fails_only_with_strict(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Nothing listens on the port: the daemon would still start (it reconnects), so warn."""
    cfg = write_config(tmp_path, mqtt=f"mqtt://127.0.0.1:{free_port()}")
    code, out = doctor(capsys, "--config", str(cfg))
    assert code == 0, out
    broker = by_name(audit(str(cfg)))["broker"]
    assert broker.status == "warn"
    assert "Connection refused" in broker.detail and "mosquitto" in broker.fix.lower()
    code, out = doctor(capsys, "--config", str(cfg), "--strict")
    assert code == 1 and "WARN broker" in out


def test_disabled_mqtt_is_fine(tmp_path: Path) -> None:
    assert by_name(audit(str(write_config(tmp_path))))["broker"].status == "ok"


def test_connect_packet_is_mqtt_311() -> None:
    packet = connect_packet("genie-doctor-1", "u", "p")
    assert packet[0] == 0x10 and packet[1] == len(packet) - 2
    assert packet[2:10] == b"\x00\x04MQTT\x04\xc2"  # protocol name, level 4, user + password + clean


class Broker:
    """Mosquitto on a free loopback port, with a config of our own."""

    def __init__(self, workdir: Path, *, anonymous: bool = True) -> None:
        assert MOSQUITTO is not None
        self.port = free_port()
        conf = workdir / "mosquitto.conf"
        lines = [f"listener {self.port} 127.0.0.1", f"allow_anonymous {str(anonymous).lower()}"]
        if not anonymous:
            (workdir / "passwd").write_text("")
            lines.append(f"password_file {workdir / 'passwd'}")
        if os.geteuid() == 0:
            lines.append("user root")
        conf.write_text("\n".join(lines) + "\n")
        self.log = (workdir / "mosquitto.log").open("wb")
        self.proc = subprocess.Popen([MOSQUITTO, "-c", str(conf)], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while True:  # readiness of a process we do not control: poll its port, bounded
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                assert self.proc.poll() is None, (workdir / "mosquitto.log").read_text()
                assert time.monotonic() < deadline, "mosquitto did not start"
                time.sleep(0.02)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)
        self.log.close()


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    b = Broker(tmp_path)
    try:
        yield b
    finally:
        b.stop()


@needs_broker
def test_broker_that_is_up_passes(tmp_path: Path, broker: Broker, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write_config(tmp_path, mqtt=f"mqtt://127.0.0.1:{broker.port}")
    code, out = doctor(capsys, "--config", str(cfg), "--strict")
    assert code == 0, out
    check = by_name(audit(str(cfg)))["broker"]
    assert check.status == "ok" and "accepted MQTT CONNECT" in check.detail


@needs_broker
def test_broker_that_refuses_anonymous_clients_names_the_credentials(tmp_path: Path) -> None:
    b = Broker(tmp_path, anonymous=False)
    try:
        up, why = mqtt_ping(f"mqtt://127.0.0.1:{b.port}", timeout_s=5)
    finally:
        b.stop()
    assert not up and "refused the connection: not authorised" in why


# --- platform, config, policy ------------------------------------------------------------------


def test_explicit_platform_that_cannot_work_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """platform jetson on a box (an empty fake root) that is no Jetson: the daemon would refuse."""
    fake_root = tmp_path / "root"
    fake_root.mkdir()
    cfg = write_config(tmp_path)
    code, out = doctor(capsys, "--config", str(cfg), "--platform", "jetson", "--root", str(fake_root))
    assert code == 1
    telemetry = by_name(audit(str(cfg), {"platform": "jetson"}, Probes(root=str(fake_root))))["telemetry"]
    assert telemetry.status == "fail"
    assert "not a Jetson: no /etc/nv_tegra_release" in telemetry.detail


def test_board_line_reads_the_l4t_release(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "nv_tegra_release").write_text(
        "# R36 (release), REVISION: 3.0, GCID: 36191598, BOARD: generic, EABI: aarch64, DATE: Mon May 6\n"
    )
    assert l4t_release(str(tmp_path)) == (36, "R36.3.0")
    board = by_name(audit(str(write_config(tmp_path)), probes=Probes(root=str(tmp_path))))["board"]
    assert board.detail == "Jetson, L4T R36.3.0 (JetPack 6)"


def test_invalid_config_fails_with_file_and_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("node_id: test\nengine:\n  n_ctx: 12\n")
    code, out = doctor(capsys, "--config", str(cfg))
    assert code == 1
    assert f"{cfg}:3 engine.n_ctx" in out


def test_invalid_policy_fails(tmp_path: Path) -> None:
    cfg = write_config(tmp_path)
    (tmp_path / "policy.yaml").write_text("version: 1\nname: x\nmemory:\n  llm_budget_mb: -1\n")
    policy = by_name(audit(str(cfg)))["policy"]
    assert policy.status == "fail" and "policy.yaml:4" in policy.detail


def test_json_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = doctor(capsys, "--config", str(write_config(tmp_path)), "--json")
    data = json.loads(out)
    assert code == data["exit"] == 0
    assert {c["name"] for c in data["checks"]} >= {"board", "config", "policy", "telemetry", "cuda", "http"}


# --- pure checks -------------------------------------------------------------------------------


def test_policy_level_above_the_kernel_trip_point_warns() -> None:
    policy = Policy.model_validate(
        {
            "version": 1,
            "name": "p",
            "thermal": {"levels": [{"name": "hot", "enter_c": 100, "leave_c": 95, "action": "pause"}]},
        }
    )
    sample = TelemetrySample(platform="simulated", temps_c={"tj": 50.0}, trip_points_c={"tj": (99.0, 103.0)})
    check = check_thermal(sample, policy)
    assert check.status == "warn" and "first trip (99 °C)" in check.detail


def test_service_found_by_pid_file_with_a_healthy_upstream(tmp_path: Path) -> None:
    """A service found by its pid file is ok while its upstream answers, and warns with a fix when it does not."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        (tmp_path / "svc.pid").write_text(f"{proc.pid}\n")
        svc = ServiceConfig.model_validate(
            {
                "kind": "wyoming_stt",
                "match": {"pid_file": str(tmp_path / "svc.pid")},
                "proxy": {"listen": "127.0.0.1:10300", "upstream": "127.0.0.1:10310"},
            }
        )

        def probe(wyoming: tuple[bool, str], bindable: tuple[bool, str]) -> Check:
            """Check the service with the given answers of the upstream and of binding the listen port."""
            return check_service(
                "whisper",
                svc,
                cgroup_root=str(tmp_path),
                wyoming=lambda h, p: wyoming,
                http=lambda u, t: (True, "health 200"),
                bindable=lambda h, p: bindable,
            )

        check = probe((True, "describe ok"), (True, "free"))
        assert check.status == "ok", check
        assert check.detail == "wyoming_stt: 1 process(es), upstream 127.0.0.1:10310 answers"
        down = probe((False, "refused"), (False, "Address in use"))
        assert down.status == "warn"
        assert "--uri tcp://127.0.0.1:10310" in down.fix and "free 127.0.0.1:10300" in down.fix
    finally:
        proc.kill()
        proc.wait()


def test_api_beyond_loopback_without_a_key_warns(tmp_path: Path) -> None:
    """doctor warns (a --strict failure) when the API listens on 0.0.0.0 with no key; with a key file, or on loopback, ok."""
    checks = by_name(audit(str(write_config(tmp_path)), {"listen": "0.0.0.0:18080"}))
    access = checks["api access"]
    assert access.status == "warn" and "without a key" in access.detail and "api_key_file" in access.fix
    assert exit_code(list(checks.values()), strict=True) == 1
    (tmp_path / "api-key").write_text("k" * 40 + "\n")
    keyed = by_name(
        audit(str(write_config(tmp_path, extra="api:\n  api_key_file: api-key\n")), {"listen": "0.0.0.0:18080"})
    )["api access"]
    assert keyed.status == "ok" and "key required" in keyed.detail and "k" * 40 not in keyed.detail
    assert by_name(audit(str(write_config(tmp_path))))["api access"].status == "ok"


def test_render_is_one_line_per_check_then_fixes_and_verdict() -> None:
    text = render([Check("a", "ok", "fine"), Check("b", "fail", "broken", "do x")])
    lines = text.splitlines()
    assert lines[1].startswith("  ok   a") and lines[2].startswith("  FAIL b")
    assert lines[3] == "fixes:" and lines[4] == "  b: do x"
    assert lines[-1].startswith("verdict: the daemon would NOT start")


def test_box_memory_adds_up_the_estimates_and_the_llm_plan(tmp_path: Path) -> None:
    """The box check sums the config's estimates and the LLM plan against box.memory_mb and says
    what is left; a box too small for the plan fails, one too small for the whole budget warns."""
    box = "box:\n  memory_mb: 7600\n  estimates_mb: {os: 900, homeassistant: 700}\n"
    cfg = write_config(tmp_path, budget_mb=2560, model=require(SMOLLM2), extra=box)
    check = by_name(audit(str(cfg)))["box memory"]
    assert check.status == "ok", check
    assert check.detail == (
        "os 900 + homeassistant 700 + LLM plan 627 (budget 2560) = 2227 of 7600 MiB; "
        "left 5373 MiB (3440 with the whole budget)"
    )
    cfg.write_text(cfg.read_text().replace("memory_mb: 7600", "memory_mb: 3000"))
    assert by_name(audit(str(cfg)))["box memory"].status == "warn"
    cfg.write_text(cfg.read_text().replace("memory_mb: 3000", "memory_mb: 2000"))
    over = by_name(audit(str(cfg)))["box memory"]
    assert over.status == "fail" and over.detail.startswith("over: ")
