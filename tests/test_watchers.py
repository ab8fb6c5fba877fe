"""Process, cgroup, HTTP health and DFN watchers against real processes, files and servers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import anyio
import pytest
from anyio.abc import SocketAttribute, SocketStream

from genie_supervisor.config import ServiceConfig
from genie_supervisor.events import ServiceObservation
from genie_supervisor.watchers import ProbeResult, ServiceWatcher, WyomingProxy, build_watchers
from genie_supervisor.watchers.base import merge
from genie_supervisor.watchers.cgroup import CgroupProbe, find_container_cgroup, read_memory
from genie_supervisor.watchers.dfn import COUNTER, UnderrunCounter
from genie_supervisor.watchers.http_health import HttpHealthProbe
from genie_supervisor.watchers.process import ProcessProbe, ProcessSelector, find_pids
from tests.awaitlog import Log

MIB = 1024 * 1024


async def start_fake_piper(marker: str) -> anyio.abc.Process:
    return await anyio.open_process(
        [sys.executable, "-c", "import time; time.sleep(60)", marker],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


# -- processes ----------------------------------------------------------------------------------


@pytest.mark.timeout(30)
async def test_process_watcher_sees_a_process_die_and_restart() -> None:
    """A fake piper found by its command line: up with memory, down when killed, up again counted."""
    marker = f"--fake-piper-{uuid.uuid4().hex[:8]}"
    selector = ProcessSelector(cmdline_pattern=re.escape(marker))
    published = Log()
    watcher = ServiceWatcher("piper", [ProcessProbe(selector, gpu_memory=lambda pids: 12.5)], published, interval_s=0.1)
    async with anyio.create_task_group() as tg:
        await tg.start(watcher.run)
        assert published.items[0].up is None and "never found" in published.items[0].reason

        first = await start_fake_piper(marker)
        up = await published.wait_for(lambda o: o.up is True, within_s=2)
        assert up.pids == (first.pid,) and up.rss_mb > 1 and up.gpu_mem_mb == 12.5
        assert up.restarts == 0
        busy = await published.wait_for(lambda o: o.cpu_pct is not None, within_s=2)
        assert busy.cpu_pct >= 0

        mark = len(published.items)
        first.kill()
        await first.aclose()
        down = await published.wait_for(lambda o: o.up is False, start=mark, within_s=2)
        assert "process not found" in down.reason

        mark = len(published.items)
        second = await start_fake_piper(marker)
        back = await published.wait_for(lambda o: o.up is True, start=mark, within_s=2)
        assert back.pids == (second.pid,) and back.restarts == 1
        second.kill()
        await second.aclose()
        tg.cancel_scope.cancel()


@pytest.mark.timeout(30)
async def test_pid_file_unit_cgroup_and_name_selectors_find_a_process(tmp_path: Path) -> None:
    """A pid file, a systemd unit's cgroup.procs and the executable name each find the process."""
    marker = f"--fake-whisper-{uuid.uuid4().hex[:8]}"
    proc = await start_fake_piper(marker)
    try:
        pid_file = tmp_path / "whisper.pid"
        pid_file.write_text(f"{proc.pid}\n")
        unit = tmp_path / "cgroup" / "system.slice" / "wyoming-whisper.service"
        unit.mkdir(parents=True)
        (unit / "cgroup.procs").write_text(f"{proc.pid}\n")
        root = str(tmp_path / "cgroup")
        assert find_pids(ProcessSelector(pid_file=str(pid_file))) == {proc.pid}
        assert find_pids(ProcessSelector(systemd_unit="wyoming-whisper", cgroup_root=root)) == {proc.pid}
        by_name = ProcessSelector(process_name=os.path.basename(sys.executable))
        found = await anyio.to_thread.run_sync(find_pids, by_name)
        assert proc.pid in found and os.getpid() not in found
    finally:
        proc.kill()
        await proc.aclose()
    assert find_pids(ProcessSelector(pid_file=str(pid_file))) == set()
    assert find_pids(ProcessSelector(pid_file=str(tmp_path / "missing.pid"))) == set()
    with pytest.raises(ValueError):
        ProcessProbe(ProcessSelector())


# -- cgroups ------------------------------------------------------------------------------------

HA_ID = "a1b2c3d4e5f6" + "0" * 52
MQTT_ID = "fedcba987654" + "1" * 52


def fake_container(
    root: Path,
    proc: Path,
    cid: str,
    pid: int,
    cmdline: list[str],
    environ: list[str],
    current: int,
    inactive_file: int,
    usage_usec: int,
) -> Path:
    """One container in the kernel's cgroup v2 and procfs formats."""
    directory = root / "system.slice" / f"docker-{cid}.scope"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "cgroup.procs").write_text(f"{pid}\n")
    (directory / "memory.current").write_text(f"{current}\n")
    (directory / "memory.stat").write_text(
        f"anon {current - 2 * inactive_file}\nfile {2 * inactive_file}\nkernel 1234\n"
        f"active_file {inactive_file}\ninactive_file {inactive_file}\n"
    )
    (directory / "cpu.stat").write_text(f"usage_usec {usage_usec}\nuser_usec {usage_usec}\nsystem_usec 0\n")
    (proc / str(pid)).mkdir(parents=True, exist_ok=True)
    (proc / str(pid) / "cmdline").write_bytes(b"\0".join(s.encode() for s in cmdline) + b"\0")
    (proc / str(pid) / "environ").write_bytes(b"\0".join(s.encode() for s in environ) + b"\0")
    return directory


@pytest.fixture
def cgroup_tree(tmp_path: Path) -> tuple[Path, Path]:
    root, proc = tmp_path / "cgroup", tmp_path / "proc"
    fake_container(
        root,
        proc,
        HA_ID,
        4242,
        ["python3", "-m", "homeassistant", "--config", "/config"],
        ["PATH=/usr/bin", "HOSTNAME=ha-box"],
        current=734_003_200,
        inactive_file=100_000_000,
        usage_usec=1_000_000,
    )
    fake_container(
        root,
        proc,
        MQTT_ID,
        5151,
        ["/usr/sbin/mosquitto", "-c", "/m.conf"],
        ["HOSTNAME=mqtt"],
        current=10 * MIB,
        inactive_file=0,
        usage_usec=5,
    )
    return root, proc


@pytest.mark.timeout(10)
def test_container_cgroup_found_by_cmdline_hostname_or_id(cgroup_tree: tuple[Path, Path]) -> None:
    """A container's cgroup is found by a command-line word, its hostname or an id prefix."""
    root, proc = cgroup_tree
    ha = root / "system.slice" / f"docker-{HA_ID}.scope"
    assert find_container_cgroup("homeassistant", root, proc) == ha
    assert find_container_cgroup("ha-box", root, proc) == ha
    assert find_container_cgroup(MQTT_ID[:12], root, proc) == (root / "system.slice" / f"docker-{MQTT_ID}.scope")
    assert find_container_cgroup("frigate", root, proc) is None
    memory = read_memory(ha)
    assert memory.current_bytes == 734_003_200 and memory.inactive_file_bytes == 100_000_000
    assert memory.working_set_bytes == 634_003_200


@pytest.mark.timeout(10)
def test_cgroup_probe_reports_memory_cpu_and_container_restarts(
    cgroup_tree: tuple[Path, Path],
) -> None:
    """Memory is the working set, CPU comes from usage_usec deltas, a new container is a restart."""
    root, proc = cgroup_tree
    probe = CgroupProbe(container="homeassistant", cgroup_root=root, proc_root=proc)
    first = probe.probe_sync()
    assert first.up is True and first.rss_mb == pytest.approx(634_003_200 / MIB)
    assert first.pids == (4242,) and first.cpu_pct is None
    ha = root / "system.slice" / f"docker-{HA_ID}.scope"
    (ha / "cpu.stat").write_text("usage_usec 9000000\nuser_usec 9000000\nsystem_usec 0\n")
    assert (probe.probe_sync().cpu_pct or 0.0) > 0

    for f in ha.iterdir():
        f.unlink()
    ha.rmdir()
    gone = probe.probe_sync()
    assert gone.up is False and "no cgroup found" in gone.reason

    new_id = "0badc0ffee00" + "2" * 52
    fake_container(
        root,
        proc,
        new_id,
        4343,
        ["python3", "-m", "homeassistant"],
        [],
        current=300 * MIB,
        inactive_file=0,
        usage_usec=1,
    )
    back = probe.probe_sync()
    assert back.up is True and back.restarts == 1 and back.rss_mb == pytest.approx(300)

    direct = CgroupProbe(cgroup_path=root / "system.slice" / f"docker-{MQTT_ID}.scope")
    assert direct.probe_sync().rss_mb == pytest.approx(10)
    never = CgroupProbe(cgroup_path=root / "nope").probe_sync()
    assert never.up is None


# -- HTTP health --------------------------------------------------------------------------------


async def _http_handler(stream: SocketStream) -> None:
    async with stream:
        request = b""
        while b"\r\n\r\n" not in request:
            request += await stream.receive()
        line, *headers = request.decode().split("\r\n")
        path = line.split()[1]
        authorized = "authorization: bearer tok" in [h.lower() for h in headers]
        if path == "/silent":
            await anyio.sleep_forever()
        status = {"/health": 200, "/fail": 503}.get(path, 200 if authorized else 401)
        body = b'{"status": "ok"}'
        await stream.send(
            f"HTTP/1.1 {status} X\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body
        )


@pytest.mark.timeout(20)
async def test_http_health_up_down_and_token() -> None:
    """2xx is up, 401 is up with a token hint, 503/refused/silent are down with the reason."""
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, _http_handler)
        base = f"http://127.0.0.1:{listener.extra(SocketAttribute.local_port)}"
        assert (await HttpHealthProbe(f"{base}/health").probe()).reason == "health 200"
        with_token = await HttpHealthProbe(f"{base}/api/", token="tok").probe()
        assert with_token.up is True and with_token.reason == "health 200"
        no_token = await HttpHealthProbe(f"{base}/api/").probe()
        assert no_token.up is True and "401" in no_token.reason and "token" in no_token.reason
        failing = await HttpHealthProbe(f"{base}/fail").probe()
        assert failing.up is False and failing.reason == "health 503"
        silent = await HttpHealthProbe(f"{base}/silent", timeout_s=0.3).probe()
        assert silent.up is False and "no answer within 0.3s" in silent.reason
        tg.cancel_scope.cancel()
    refused = await HttpHealthProbe(base + "/health").probe()
    assert refused.up is False and "ConnectError" in refused.reason


# -- DeepFilterNet --------------------------------------------------------------------------------


@pytest.mark.timeout(20)
async def test_dfn_underruns_counted_from_an_appended_log(tmp_path: Path) -> None:
    """Only new "Processing too slow" lines count, split writes and truncation included."""
    log_file = tmp_path / "dfn.log"
    log_file.write_text("old: Processing too slow\n")
    published = Log()
    watcher = ServiceWatcher("dfn", [UnderrunCounter(log_file=log_file)], published, interval_s=0.05)

    def append(text: str) -> None:
        with log_file.open("a") as f:
            f.write(text)

    async with anyio.create_task_group() as tg:
        await tg.start(watcher.run)
        assert published.items[-1].counters == {COUNTER: 0}
        append("INFO started\nWARN Processing too slow, skipping frame\nINFO x\n")
        append("WARN Processing too slow\nWARN Processing too")
        await published.wait_for(lambda o: o.counters[COUNTER] == 2)
        append(" slow\n")
        await published.wait_for(lambda o: o.counters[COUNTER] == 3)
        log_file.write_text("WARN Processing too slow\n")  # rotated: a shorter file
        done = await published.wait_for(lambda o: o.counters[COUNTER] == 4)
        assert done.up is None and done.service == "dfn"
        tg.cancel_scope.cancel()


@pytest.mark.timeout(20)
async def test_dfn_underruns_counted_from_a_journal_stream() -> None:
    """Lines from a followed journal command are counted; a missing journalctl is reported."""
    script = (
        "import time; print('Processing too slow'); print('fine');"
        "print('Processing too slow', flush=True); time.sleep(30)"
    )
    counter = UnderrunCounter(journal_command=[sys.executable, "-c", script])
    published = Log()
    watcher = ServiceWatcher("dfn", [counter], published, interval_s=0.05)
    async with anyio.create_task_group() as tg:
        await tg.start(watcher.run)
        await published.wait_for(lambda o: o.counters[COUNTER] == 2)
        tg.cancel_scope.cancel()

    missing = UnderrunCounter(journal_command=["no-such-journalctl-binary", "-f"])
    await missing.run_background()
    assert "not found" in (await missing.probe()).reason


# -- composition --------------------------------------------------------------------------------


def test_merge_any_down_wins_and_counters_add_up() -> None:
    """A down source makes the service down with that source's reason; numbers come through."""
    obs = merge(
        "whisper",
        {
            "process": ProbeResult(up=True, reason="1 process", rss_mb=300.0, pids=(7,), restarts=2),
            "wyoming": ProbeResult(up=False, reason="connect failed"),
            "dfn_log": ProbeResult(up=None, counters={COUNTER: 3}, decides_up=False),
        },
    )
    assert isinstance(obs, ServiceObservation)
    assert (obs.up, obs.reason, obs.rss_mb, obs.pids, obs.restarts) == (
        False,
        "wyoming: connect failed",
        300.0,
        (7,),
        2,
    )
    assert obs.counters == {COUNTER: 3}
    assert merge("x", {}).up is None


@pytest.mark.timeout(20)
async def test_factory_builds_homeassistant_and_whisper_with_proxy(
    cgroup_tree: tuple[Path, Path],
) -> None:
    """Config services become watchers: HA from cgroup + health, whisper as process watcher + proxy."""
    root, proc = cgroup_tree
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    published = Log()
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, _http_handler)
        url = f"http://127.0.0.1:{listener.extra(SocketAttribute.local_port)}/api/"
        services = {
            "homeassistant": ServiceConfig.model_validate(
                {"kind": "homeassistant", "match": {"container": "homeassistant", "health_url": url}, "token": "tok"}
            ),
            "whisper": ServiceConfig.model_validate(
                {
                    "kind": "wyoming_stt",
                    "match": {"cmdline_pattern": "no-such-whisper-xyz"},
                    "proxy": {"listen": "127.0.0.1:10300", "upstream": "127.0.0.1:1"},
                }
            ),
        }
        runnables = build_watchers(services, published, cgroup_root=str(root), proc_root=str(proc))
        ha, whisper, proxy = runnables
        assert isinstance(ha, ServiceWatcher) and isinstance(whisper, ServiceWatcher)
        assert isinstance(proxy, WyomingProxy) and proxy.service == "stt" and proxy.upstream_port == 1
        assert (proxy.listen_host, proxy.listen_port, proxy.hold_max_s) == ("127.0.0.1", 10300, 0.25)
        obs = await ha.probe_once()
        assert obs.up is True and obs.rss_mb == pytest.approx(634_003_200 / MIB)
        assert "health 200" in obs.reason
        proxy.publish(ServiceObservation(service="whisper", up=False, reason="connect failed"))
        assert whisper.last is not None and whisper.last.up is False
        assert "wyoming: connect failed" in whisper.last.reason
        tg.cancel_scope.cancel()

    with pytest.raises(ValueError, match="colour"):
        ServiceConfig.model_validate({"kind": "process", "colour": "red"})
    with pytest.raises(ValueError, match="a proxy only applies"):
        ServiceConfig.model_validate({"kind": "process", "proxy": {"listen": "1", "upstream": "127.0.0.1:2"}})
