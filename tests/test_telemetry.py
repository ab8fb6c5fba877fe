"""Platform telemetry: kernel-file readers on fake trees, tegrastats parsing, sources, the sampler."""

from __future__ import annotations

import stat
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import pytest
from structlog.testing import capture_logs

from genie_supervisor.events import TelemetrySample
from genie_supervisor.telemetry import (
    JetsonSource,
    JtopSource,
    LinuxSource,
    NvmlSource,
    SimulatedSource,
    TegrastatsSource,
    TelemetryError,
    TelemetrySource,
    TelemetryUnavailable,
    create_source,
    parse_tegrastats,
    run_sampler,
)
from genie_supervisor.telemetry.jetson import (
    NvpmodelReader,
    find_gpu,
    find_power_rails,
    not_jetson_reason,
    parse_nvpmodel_conf,
    parse_nvpmodel_query,
    parse_nvpmodel_status,
)
from genie_supervisor.telemetry.sysfs import ProcStatCpu, parse_meminfo, read_thermal

# --- captured formats ---------------------------------------------------------------------

MEMINFO = """\
MemTotal:        7802628 kB
MemFree:         4321412 kB
MemAvailable:    5506248 kB
Buffers:           41228 kB
Cached:          1247960 kB
SwapCached:            0 kB
Active:           987472 kB
SwapTotal:       3901296 kB
SwapFree:        3799920 kB
HugePages_Total:       0
Hugepagesize:       2048 kB
"""

PROC_STAT_1 = """\
cpu  10000 200 3000 80000 500 0 100 0 0 0
cpu0 2000 50 600 13000 100 0 30 0 0 0
intr 123456 0 0
ctxt 987654
"""
# +300 user, +100 system, +580 idle, +20 iowait: 400 busy ticks of 1000.
PROC_STAT_2 = """\
cpu  10300 200 3100 80580 520 0 100 0 0 0
cpu0 2050 50 620 13100 104 0 30 0 0 0
intr 123999 0 0
ctxt 987999
"""

NVPMODEL_CONF = """\
# NVPMODEL config for Jetson Orin Nano 8GB
< PARAM TYPE=FILE NAME=CPU_ONLINE >
CORE_0 /sys/devices/system/cpu/cpu0/online

< POWER_MODEL ID=0 NAME=15W >
CPU_ONLINE CORE_0 1
GPU MAX_FREQ 624750000

< POWER_MODEL ID=1 NAME=7W >
CPU_ONLINE CORE_0 1
GPU MAX_FREQ 408000000

< POWER_MODEL ID=2 NAME=MAXN_SUPER >
CPU_ONLINE CORE_0 1

< PM_CONFIG DEFAULT=0 >
"""

TEGRASTATS_JP5 = (
    "RAM 2448/7620MB (lfb 2x4MB) SWAP 0/3810MB (cached 0MB) "
    "CPU [2%@1510,1%@1510,0%@1510,0%@1510,off,off] EMC_FREQ 0% GR3D_FREQ 0% "
    "cpu@45.5C soc2@44.9C soc0@45.1C gpu@44.8C tj@45.5C soc1@44.6C "
    "VDD_IN 4963mW/4963mW VDD_CPU_GPU_CV 601mW/601mW VDD_SOC 1442mW/1442mW"
)
TEGRASTATS_JP6 = (
    "11-30-2024 15:02:11 RAM 3120/7620MB (lfb 4x4MB) SWAP 12/3810MB (cached 0MB) "
    "CPU [12%@1728,8%@1728,30%@1728,10%@1728,0%@729,0%@729] EMC_FREQ 3%@2133 "
    "GR3D_FREQ 57%@[624] NVDEC off NVJPG off NVJPG1 off VIC off OFA off APE 200 "
    "cpu@47.281C soc2@46.031C soc0@46.625C gpu@45.375C tj@47.281C soc1@45.968C "
    "VDD_IN 5102mW/5102mW VDD_CPU_GPU_CV 722mW/722mW VDD_SOC 1523mW/1523mW"
)
TEGRASTATS_AGX_ORIN = (
    "RAM 4722/30536MB (lfb 6063x4MB) SWAP 0/15268MB (cached 0MB) "
    "CPU [1%@729,0%@729,0%@729,0%@729,off,off,off,off,off,off,off,off] EMC_FREQ 0%@2133 "
    "GR3D_FREQ 0%@[0,0] VIC_FREQ 729 APE 174 CPU@44.968C Tboard@33C SOC2@41.343C "
    "Tdiode@35C SOC0@42.25C CV1@-256C GPU@-256C tj@44.968C SOC1@41.281C CV2@-256C "
    "VDD_GPU_SOC 2797mW/2797mW VDD_CPU_CV 399mW/399mW VIN_SYS_5V0 3524mW/3524mW "
    "NC 0mW/0mW VDDQ_VDD2_1V8AO 503mW/503mW NC 0mW/0mW"
)
TEGRASTATS_JP4_NANO = (
    "RAM 1662/3964MB (lfb 4x2MB) SWAP 0/1982MB (cached 0MB) IRAM 0/252kB(lfb 252kB) "
    "CPU [3%@102,2%@102,1%@102,0%@102] EMC_FREQ 0%@204 GR3D_FREQ 0%@76 APE 25 "
    "PLL@24.5C CPU@26.5C PMIC@100C GPU@25C AO@32C thermal@25.75C "
    "POM_5V_IN 1186/1186 POM_5V_GPU 0/0 POM_5V_CPU 157/157"
)


# --- fake trees ---------------------------------------------------------------------------


def write(root: Path, path: str, text: str) -> Path:
    """Create `path` under `root` with `text` (sysfs values end with a newline)."""
    target = root / path.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    return target


def add_zone(root: Path, n: int, zone_type: str, milli: int, trips: tuple[tuple[int, str], ...] = ()):
    """Add /sys/class/thermal/thermal_zone<n> with its trip points."""
    base = f"/sys/class/thermal/thermal_zone{n}"
    write(root, f"{base}/type", f"{zone_type}\n")
    write(root, f"{base}/temp", f"{milli}\n")
    for i, (trip_milli, kind) in enumerate(trips):
        write(root, f"{base}/trip_point_{i}_temp", f"{trip_milli}\n")
        write(root, f"{base}/trip_point_{i}_type", f"{kind}\n")


def add_hwmon_rails(root: Path, hwmon: str, rails: list[tuple[str, int, int]], sum_channel: bool):
    """Add an INA3221 hwmon folder (JetPack 5/6): in<N>_label, in<N>_input mV, curr<N>_input mA."""
    base = f"/sys/bus/i2c/drivers/ina3221/1-0040/hwmon/{hwmon}"
    write(root, f"{base}/name", "ina3221\n")
    for n, (label, mv, ma) in enumerate(rails, start=1):
        write(root, f"{base}/in{n}_label", f"{label}\n")
        write(root, f"{base}/in{n}_input", f"{mv}\n")
        write(root, f"{base}/curr{n}_input", f"{ma}\n")
        write(root, f"{base}/curr{n}_crit", "32760\n")
        write(root, f"{base}/curr{n}_max", "32760\n")
    if sum_channel:
        write(root, f"{base}/in7_label", "sum of shunt voltages\n")
        write(root, f"{base}/in7_input", "1640\n")


ORIN_NANO_RAILS = [("VDD_IN", 5096, 1001), ("VDD_CPU_GPU_CV", 5088, 142), ("VDD_SOC", 5088, 299)]
ORIN_TRIPS = ((99000, "passive"), (103000, "hot"), (104500, "critical"))


@pytest.fixture
def orin_nano(tmp_path: Path) -> Path:
    """A JetPack 6 Orin Nano 8 GB sysfs/procfs tree with the kernel's file formats."""
    root = tmp_path / "orin"
    write(root, "/etc/nv_tegra_release", "# R36 (release), REVISION: 3.0, GCID: 36923193\n")
    write(root, "/proc/device-tree/model", "NVIDIA Jetson Orin Nano Developer Kit\x00")
    add_zone(root, 0, "cpu-thermal", 47281, ORIN_TRIPS)
    add_zone(root, 1, "gpu-thermal", 45375, ORIN_TRIPS)
    add_zone(root, 2, "cv0-thermal", -256000)
    add_zone(root, 3, "soc0-thermal", 46625, ORIN_TRIPS)
    add_zone(root, 4, "soc1-thermal", 45968, ORIN_TRIPS)
    add_zone(root, 5, "soc2-thermal", 46031, ORIN_TRIPS)
    add_zone(root, 6, "tj-thermal", 47281, (*ORIN_TRIPS, (50000, "active")))
    add_hwmon_rails(root, "hwmon1", ORIN_NANO_RAILS, sum_channel=True)
    write(root, "/sys/class/devfreq/17000000.gpu/cur_freq", "624750000\n")
    write(root, "/sys/class/devfreq/17000000.gpu/device/load", "523\n")
    write(root, "/sys/class/devfreq/3d00000.pcie/cur_freq", "1000000\n")
    write(root, "/proc/meminfo", MEMINFO)
    write(root, "/proc/stat", PROC_STAT_1)
    write(root, "/etc/nvpmodel.conf", NVPMODEL_CONF)
    write(root, "/var/lib/nvpmodel/status", "pmode:0001 fmode:quiet\n")
    return root


def fake_binary(tmp_path: Path, name: str, line: str) -> Path:
    """A stand-in for a Jetson tool: a shell script that prints `line` every 50 ms."""
    path = tmp_path / "bin" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\nwhile true; do echo '{line}'; sleep 0.05; done\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


# --- detection and kernel files -----------------------------------------------------------


def test_jetson_detected_from_release_file_or_device_tree_model(tmp_path: Path) -> None:
    """A Jetson is recognised by /etc/nv_tegra_release or a device-tree model naming one."""
    by_release = tmp_path / "a"
    write(by_release, "/etc/nv_tegra_release", "# R35 (release), REVISION: 4.1\n")
    by_model = tmp_path / "b"
    write(by_model, "/proc/device-tree/model", "NVIDIA Jetson AGX Orin Developer Kit\x00")
    other = tmp_path / "c"
    write(other, "/proc/device-tree/model", "Raspberry Pi 5 Model B Rev 1.0\x00")
    assert not_jetson_reason(str(by_release)) is None
    assert not_jetson_reason(str(by_model)) is None
    reason = not_jetson_reason(str(other))
    assert reason is not None and "Raspberry Pi 5" in reason


def test_thermal_zones_give_celsius_and_trip_points_without_absent_sensors(orin_nano: Path) -> None:
    """Thermal zones read in °C with passive/hot/critical trips; -256 °C sensors and fan trips are dropped."""
    thermal = read_thermal(str(orin_nano))
    assert thermal.temps_c == {
        "cpu": 47.281,
        "gpu": 45.375,
        "soc0": 46.625,
        "soc1": 45.968,
        "soc2": 46.031,
        "tj": 47.281,
    }
    assert thermal.trip_points_c["tj"] == (99.0, 103.0, 104.5)
    assert "cv0" not in thermal.trip_points_c


def test_thermal_zone_names_are_unique_and_disabled_zones_skipped(tmp_path: Path) -> None:
    """Two zones of one type get distinct names; a disabled or unreadable zone is left out."""
    add_zone(tmp_path, 0, "acpitz", 27800)
    add_zone(tmp_path, 1, "acpitz", 29800)
    add_zone(tmp_path, 2, "x86_pkg_temp", 51000)
    write(tmp_path, "/sys/class/thermal/thermal_zone2/mode", "disabled\n")
    add_zone(tmp_path, 10, "GPU-therm", 41000)
    write(tmp_path, "/sys/class/thermal/thermal_zone11/type", "BAT0\n")  # temp unreadable
    assert read_thermal(str(tmp_path)).temps_c == {"acpitz": 27.8, "acpitz1": 29.8, "gpu": 41.0}


def test_meminfo_and_proc_stat_deltas() -> None:
    """/proc/meminfo becomes MiB (swap used = total - free) and /proc/stat deltas give CPU load."""
    mem = parse_meminfo(MEMINFO)
    assert mem.total_mb == pytest.approx(7802628 / 1024)
    assert mem.available_mb == pytest.approx(5506248 / 1024)
    assert mem.swap_used_mb == pytest.approx((3901296 - 3799920) / 1024)
    assert parse_meminfo("garbage\nMemTotal: lots kB\n").total_mb is None


def test_cpu_load_from_proc_stat_between_two_samples(tmp_path: Path) -> None:
    """CPU load is busy ticks over all ticks between two reads of /proc/stat (iowait counts as idle)."""
    write(tmp_path, "/proc/stat", PROC_STAT_1)
    cpu = ProcStatCpu(str(tmp_path))
    write(tmp_path, "/proc/stat", PROC_STAT_2)
    assert cpu.load_pct() == pytest.approx(40.0)
    assert cpu.load_pct() is None  # no ticks elapsed since


def test_power_rails_jetpack6_hwmon_skip_sum_channel(orin_nano: Path) -> None:
    """JetPack 6 hwmon rails are found by label and turned into watts; the in7 sum channel is skipped."""
    rails = {rail.name: rail.read_w() for rail in find_power_rails(str(orin_nano))}
    assert rails == pytest.approx(
        {
            "VDD_IN": 5096 * 1001 / 1e6,
            "VDD_CPU_GPU_CV": 5088 * 142 / 1e6,
            "VDD_SOC": 5088 * 299 / 1e6,
        }
    )


def test_power_rails_jetpack5_hwmon_and_jetpack4_iio(tmp_path: Path) -> None:
    """The JetPack 5 hwmon layout (NC rails skipped) and the JetPack 4 iio layout both give rails."""
    jp5 = tmp_path / "jp5"
    add_hwmon_rails(jp5, "hwmon3", [("VDD_IN", 5000, 1000), ("NC", 0, 0)], sum_channel=False)
    assert {r.name: r.read_w() for r in find_power_rails(str(jp5))} == {"VDD_IN": 5.0}
    jp4 = tmp_path / "jp4"
    iio = "/sys/bus/i2c/drivers/ina3221x/6-0040/iio:device0"
    for n, (label, mw) in enumerate([("POM_5V_IN", 1186), ("POM_5V_GPU", 0), ("POM_5V_CPU", 157)]):
        write(jp4, f"{iio}/rail_name_{n}", f"{label}\n")
        write(jp4, f"{iio}/in_power{n}_input", f"{mw}\n")
    rails = {r.name: r.read_w() for r in find_power_rails(str(jp4))}
    assert rails == {"POM_5V_IN": 1.186, "POM_5V_GPU": 0.0, "POM_5V_CPU": 0.157}


def test_gpu_found_through_devfreq_or_platform_load(orin_nano: Path, tmp_path: Path) -> None:
    """The GPU's devfreq node is found by name (not the PCIe one); a bare platform load file also works."""
    gpu = find_gpu(str(orin_nano))
    assert gpu.freq_path and gpu.freq_path.endswith("17000000.gpu/cur_freq")
    nano = tmp_path / "nano"
    write(nano, "/sys/devices/platform/gpu.0/load", "1000\n")
    assert find_gpu(str(nano)).load_path == str(nano / "sys/devices/platform/gpu.0/load")


def test_nvpmodel_mode_name_from_files_and_query_output(orin_nano: Path, tmp_path: Path) -> None:
    """nvpmodel's mode name comes from nvpmodel.conf + the status id; `nvpmodel -q` output also parses."""
    assert parse_nvpmodel_conf(NVPMODEL_CONF) == {0: "15W", 1: "7W", 2: "MAXN_SUPER"}
    assert parse_nvpmodel_status("pmode:0002 fmode:cool\n") == 2
    assert parse_nvpmodel_status("0\n") == 0
    assert parse_nvpmodel_status("rubbish") is None
    assert parse_nvpmodel_query("NV Power Mode: 15W\n0\n") == "15W"
    assert NvpmodelReader(str(orin_nano)).mode() == "7W"
    assert NvpmodelReader(str(tmp_path)).mode() is None


def test_jetson_source_sample_on_fake_orin_nano(orin_nano: Path) -> None:
    """The jetson source fills every field it can from an Orin Nano tree, and CPU load follows /proc/stat."""
    source = JetsonSource(str(orin_nano))
    assert source.probe() is None
    write(orin_nano, "/proc/stat", PROC_STAT_2)
    sample = source.sample()
    assert sample.platform == "jetson"
    assert sample.temps_c["tj"] == 47.281 and "cv0" not in sample.temps_c
    assert sample.trip_points_c["gpu"] == (99.0, 103.0, 104.5)
    assert sample.power_w["VDD_IN"] == pytest.approx(5.101096)
    assert sample.gpu_load_pct == pytest.approx(52.3)
    assert sample.gpu_freq_mhz == pytest.approx(624.75)
    assert sample.cpu_load_pct == pytest.approx(40.0)
    assert sample.mem_available_mb == pytest.approx(5506248 / 1024)
    assert sample.swap_total_mb == pytest.approx(3901296 / 1024)
    assert sample.gpu_mem_used_mb is None
    assert sample.power_mode == "7W"


def test_jetson_source_probe_explains_a_non_jetson(tmp_path: Path) -> None:
    """On a tree without Jetson markers the jetson probe names what it looked for."""
    reason = JetsonSource(str(tmp_path)).probe()
    assert reason is not None and "nv_tegra_release" in reason


# --- tegrastats ---------------------------------------------------------------------------


def test_tegrastats_jetpack5_line() -> None:
    """A JetPack 5 Orin Nano line gives memory, swap, CPU, GPU load, temperatures and rails."""
    s = parse_tegrastats(TEGRASTATS_JP5, ts=1.0)
    assert s is not None and s.platform == "jetson" and s.ts == 1.0
    assert (s.mem_total_mb, s.mem_available_mb) == (7620.0, 7620.0 - 2448.0)
    assert (s.swap_total_mb, s.swap_used_mb) == (3810.0, 0.0)
    assert s.cpu_load_pct == pytest.approx(0.75)  # offline cores are left out
    assert s.gpu_load_pct == 0.0 and s.gpu_freq_mhz is None
    assert s.temps_c == {
        "cpu": 45.5,
        "soc2": 44.9,
        "soc0": 45.1,
        "gpu": 44.8,
        "tj": 45.5,
        "soc1": 44.6,
    }
    assert s.power_w == {"VDD_IN": 4.963, "VDD_CPU_GPU_CV": 0.601, "VDD_SOC": 1.442}


def test_tegrastats_jetpack6_line() -> None:
    """A JetPack 6 line (timestamp, GR3D_FREQ with a GPC clock list, engine tokens) parses."""
    s = parse_tegrastats(TEGRASTATS_JP6)
    assert s is not None
    assert s.gpu_load_pct == 57.0 and s.gpu_freq_mhz == 624.0
    assert s.cpu_load_pct == pytest.approx(10.0)
    assert s.swap_used_mb == 12.0
    assert s.temps_c["tj"] == 47.281 and s.temps_c["soc1"] == 45.968
    assert s.power_w == {"VDD_IN": 5.102, "VDD_CPU_GPU_CV": 0.722, "VDD_SOC": 1.523}
    assert "APE" not in s.power_w and "OFA" not in s.power_w


def test_tegrastats_agx_orin_and_jetpack4_lines() -> None:
    """AGX Orin drops -256 C sensors and NC rails; JetPack 4 rails without mW units and PMIC@100C are handled."""
    agx = parse_tegrastats(TEGRASTATS_AGX_ORIN)
    assert agx is not None
    assert "gpu" not in agx.temps_c and "cv1" not in agx.temps_c
    assert agx.temps_c["cpu"] == 44.968 and agx.temps_c["tboard"] == 33.0
    assert agx.power_w == {
        "VDD_GPU_SOC": 2.797,
        "VDD_CPU_CV": 0.399,
        "VIN_SYS_5V0": 3.524,
        "VDDQ_VDD2_1V8AO": 0.503,
    }
    assert agx.gpu_freq_mhz == 0.0  # "0%@[0,0]": both GPCs clocked down
    nano = parse_tegrastats(TEGRASTATS_JP4_NANO)
    assert nano is not None
    assert nano.gpu_freq_mhz == 76.0
    assert "pmic" not in nano.temps_c and nano.temps_c["thermal"] == 25.75
    assert nano.power_w == {"POM_5V_IN": 1.186, "POM_5V_GPU": 0.0, "POM_5V_CPU": 0.157}


def test_tegrastats_garbage_and_partial_lines_never_crash() -> None:
    """Unknown tokens are ignored, a line with nothing known gives None, a cut-off line keeps what it has."""
    assert parse_tegrastats("") is None
    assert parse_tegrastats("tegrastats: command not found") is None
    assert parse_tegrastats("RAM lots/many CPU [x,y] GR3D_FREQ ?% cpu@hotC VDD_IN abc/def") is None
    partial = parse_tegrastats(TEGRASTATS_JP6[:120])
    assert partial is not None and partial.mem_total_mb == 7620.0 and partial.power_w == {}
    future = parse_tegrastats("RAM 100/200MB NEWFIELD 7 gpu@40C FOO_BAR 12mW/12mW trailing GR3D_FREQ")
    assert future is not None and future.temps_c == {"gpu": 40.0} and future.power_w == {"FOO_BAR": 0.012}


def test_tegrastats_source_streams_from_the_binary(tmp_path: Path) -> None:
    """The tegrastats source runs the binary, serves its last parsed line, and stops it on close."""
    binary = fake_binary(tmp_path, "tegrastats", TEGRASTATS_JP6)
    source = TegrastatsSource(binary=str(binary), interval_ms=50, first_line_timeout_s=5.0)
    assert source.probe() is None
    try:
        sample = source.sample()
        assert sample.gpu_load_pct == 57.0 and sample.power_w["VDD_IN"] == 5.102
        proc = source._proc
        assert proc is not None and proc.poll() is None
    finally:
        source.close()
    assert proc.returncode is not None
    assert TegrastatsSource(binary=str(tmp_path / "missing")).probe() is not None


# --- jtop, nvml, linux --------------------------------------------------------------------


def test_jtop_probe_reports_why_not() -> None:
    """Without jetson-stats installed (or without its socket) the jtop probe says which is missing."""
    reason = JtopSource(socket_path="/nonexistent/jtop.sock").probe()
    assert reason is not None and ("not installed" in reason or "not running" in reason)
    with_fake = JtopSource(socket_path="/nonexistent/jtop.sock", factory=lambda interval: None)
    assert "not running" in (with_fake.probe() or "")


def test_jtop_source_maps_client_values(tmp_path: Path) -> None:
    """A jtop client's dictionaries map onto the sample (temps, rails incl. total, GPU, CPU, mode)."""
    client = SimpleNamespace(
        start=lambda: None,
        close=lambda: None,
        temperature={
            "cpu": {"temp": 48.5, "online": True},
            "cv0": {"temp": -256.0, "online": False},
        },
        power={
            "rail": {"VDD_CPU_GPU_CV": {"power": 722}},
            "tot": {"power": 5102, "name": "VDD_IN"},
        },
        gpu={"gpu": {"status": {"load": 33.0}, "freq": {"cur": 624750}}},
        cpu={"total": {"user": 10.0, "system": 5.0, "idle": 85.0}},
        memory={"RAM": {"tot": 7802628, "used": 2000000}, "SWAP": {"tot": 3901296, "used": 0}},
        nvpmodel=SimpleNamespace(name="15W", id=0),
    )
    socket = write(tmp_path, "/run/jtop.sock", "")
    source = JtopSource(socket_path=str(socket), factory=lambda interval: client)
    assert source.probe() is None
    s = source.sample()
    assert s.temps_c == {"cpu": 48.5}
    assert s.power_w == {"VDD_CPU_GPU_CV": 0.722, "VDD_IN": 5.102}
    assert (s.gpu_load_pct, s.gpu_freq_mhz, s.cpu_load_pct) == (33.0, 624.75, 15.0)
    assert s.power_mode == "15W"
    source.close()


def test_nvml_unavailable_here_is_reported_not_raised() -> None:
    """Without an NVIDIA driver the nvml probe returns NVML's reason and an explicit request raises it."""
    probe = NvmlSource().probe()
    if probe is None:
        pytest.skip("this machine has a working NVML")
    assert probe.startswith("NVML unavailable") or "not installed" in probe
    with pytest.raises(TelemetryUnavailable) as info:
        create_source("nvml")
    assert info.value.platform == "nvml" and probe in info.value.reason
    with pytest.raises(TelemetryError):
        NvmlSource().sample()


class FakeNvml:
    """Stands in for pynvml at the hardware boundary: one 24 GB GPU, power not supported."""

    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_GRAPHICS = 0
    NVML_TEMPERATURE_THRESHOLD_SHUTDOWN = 0
    NVML_TEMPERATURE_THRESHOLD_SLOWDOWN = 1

    class NVMLError(Exception):
        pass

    def __init__(self) -> None:
        self.shutdowns = 0

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        return f"gpu{index}"

    def nvmlDeviceGetName(self, handle: str) -> bytes:
        return b"NVIDIA GeForce RTX 4090"

    def nvmlDeviceGetTemperature(self, handle: str, sensor: int) -> int:
        return 61

    def nvmlDeviceGetTemperatureThreshold(self, handle: str, kind: int) -> int:
        return {0: 92, 1: 87}[kind]

    def nvmlDeviceGetUtilizationRates(self, handle: str) -> Any:
        return SimpleNamespace(gpu=77, memory=30)

    def nvmlDeviceGetClockInfo(self, handle: str, clock: int) -> int:
        return 2520

    def nvmlDeviceGetMemoryInfo(self, handle: str) -> Any:
        return SimpleNamespace(total=24 << 30, used=3 << 30, free=21 << 30)

    def nvmlDeviceGetPowerUsage(self, handle: str) -> int:
        raise self.NVMLError("Not Supported")


def test_nvml_available_path_with_a_stand_in_library(tmp_path: Path) -> None:
    """With NVML working the sample carries GPU temp, thresholds, load, clock, memory; unsupported power is left out."""
    nvml = FakeNvml()
    source = NvmlSource(0, root=str(tmp_path), nvml=nvml)
    assert source.probe() is None and source.device_name == "NVIDIA GeForce RTX 4090"
    s = source.sample()
    assert s.platform == "nvml"
    assert s.temps_c == {"gpu": 61.0} and s.trip_points_c == {"gpu": (87.0, 92.0)}
    assert (s.gpu_load_pct, s.gpu_freq_mhz, s.gpu_mem_used_mb) == (77.0, 2520.0, 3072.0)
    assert "gpu" not in s.power_w and s.mem_total_mb is not None
    source.close()
    source.close()
    assert nvml.shutdowns == 1
    assert NvmlSource(3, nvml=FakeNvml()).probe() == "NVML sees 1 GPU(s); index 3 does not exist"


def test_linux_source_reads_thermal_under_root_and_psutil_memory(tmp_path: Path) -> None:
    """The linux source reads thermal zones (shared reader) and the real machine's memory via psutil."""
    add_zone(tmp_path, 0, "x86_pkg_temp", 52000, ((100000, "critical"),))
    source = LinuxSource(str(tmp_path))
    assert source.probe() is None
    s = source.sample()
    assert s.platform == "linux" and s.temps_c == {"x86_pkg_temp": 52.0}
    assert s.trip_points_c == {"x86_pkg_temp": (100.0,)}
    assert s.mem_total_mb and s.mem_available_mb and 0 < s.mem_available_mb <= s.mem_total_mb


# --- simulated ----------------------------------------------------------------------------


def test_simulated_set_is_visible_in_the_next_sample() -> None:
    """`set()` changes values immediately; the returned dicts are copies."""
    source = SimulatedSource(temps_c={"gpu": 50.0})
    assert source.sample().temps_c == {"gpu": 50.0}
    source.set(temps_c={"gpu": 83.5}, mem_available_mb=900.0)
    s = source.sample()
    assert s.platform == "simulated" and s.temps_c == {"gpu": 83.5} and s.mem_available_mb == 900.0
    s.temps_c["gpu"] = 0.0
    assert source.sample().temps_c == {"gpu": 83.5}
    with pytest.raises(ValueError, match="unknown telemetry field"):
        source.set(temperature=3)


def test_simulated_script_applies_steps_by_time() -> None:
    """Script steps apply once the (injected) clock passes their time, in order."""
    clock = [100.0]
    source = SimulatedSource(
        clock=lambda: clock[0],
        script=[(10, {"temps_c": {"gpu": 90.0}}), (5, {"temps_c": {"gpu": 70.0}})],
        temps_c={"gpu": 50.0},
    )
    assert source.sample().temps_c["gpu"] == 50.0
    clock[0] = 106.0
    assert source.sample().temps_c["gpu"] == 70.0
    clock[0] = 111.0
    assert source.sample().temps_c["gpu"] == 90.0


def test_simulated_script_from_jsonl_loops(tmp_path: Path) -> None:
    """A JSONL script (``{"t": s, fields...}`` lines) replays, and with `loop` starts over after its last step."""
    script = tmp_path / "heat.jsonl"
    script.write_text(
        "# a heat wave\n"
        '{"t": 0, "temps_c": {"gpu": 50.0}}\n'
        '{"t": 10, "temps_c": {"gpu": 90.0}, "trip_points_c": {"gpu": [99, 103]}}\n'
    )
    clock = [0.0]
    source = SimulatedSource(script=str(script), loop=True, clock=lambda: clock[0])
    seen = []
    for t in (0.0, 9.9, 10.0, 19.9, 20.0, 31.0, 1005.0, 1015.0):
        clock[0] = t
        seen.append(source.sample().temps_c["gpu"])
    assert seen == [50.0, 50.0, 90.0, 90.0, 50.0, 90.0, 50.0, 90.0]  # the pass lasts 20 s
    assert source.sample().trip_points_c["gpu"] == (99.0, 103.0)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"t": 0}\n{"temps_c": {}}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        SimulatedSource(script=bad)


# --- the sampler --------------------------------------------------------------------------


class FlakySource:
    """A source whose first sample() raises, then returns simulated samples."""

    name = "flaky"

    def __init__(self) -> None:
        self.calls = 0
        self.inner = SimulatedSource()

    def probe(self) -> str | None:
        return None

    def sample(self) -> TelemetrySample:
        self.calls += 1
        if self.calls == 1:
            raise OSError("i2c read failed")
        return self.inner.sample()

    def close(self) -> None:
        pass


async def test_run_sampler_publishes_and_survives_a_failing_sample() -> None:
    """The sampler logs a failed sample, backs off, and keeps publishing afterwards."""
    source = FlakySource()
    got: list[TelemetrySample] = []
    three = anyio.Event()

    def publish(sample: TelemetrySample) -> None:
        got.append(sample)
        if len(got) == 3:
            three.set()

    with capture_logs() as logs, anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            await tg.start(run_sampler, source, publish, 0.01)
            await three.wait()
            tg.cancel_scope.cancel()
    assert source.calls >= 4 and all(s.platform == "simulated" for s in got)
    failed = [e for e in logs if e["event"] == "telemetry_sample_failed"]
    assert len(failed) == 1 and "i2c read failed" in failed[0]["error"]
    assert any(e["event"] == "telemetry_sample_recovered" for e in logs)


async def test_run_sampler_is_ready_after_the_first_sample_and_awaits_async_publish() -> None:
    """`tg.start` returns once the first sample was published; a coroutine publish is awaited."""
    source = SimulatedSource()
    got: list[TelemetrySample] = []

    async def publish(sample: TelemetrySample) -> None:
        await anyio.lowlevel.checkpoint()
        got.append(sample)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            await tg.start(run_sampler, source, publish, 60.0)
            assert len(got) == 1
            tg.cancel_scope.cancel()


async def test_run_sampler_times_out_a_hung_sample_without_running_it_twice() -> None:
    """A sample() past its deadline is logged; until it returns no second one starts; then sampling resumes."""
    second_call = threading.Event()
    lock = threading.Lock()
    running = [0, 0]  # now, most at once

    class Hung(SimulatedSource):
        def sample(self) -> TelemetrySample:
            with lock:
                running[0] += 1
                running[1] = max(running)
            try:
                if self.samples_taken == 0:
                    threading.Event().wait(0.5)  # the hung sensor: well past the 0.1 s deadline
                else:
                    second_call.set()
                return super().sample()
            finally:
                with lock:
                    running[0] -= 1

    with capture_logs() as logs, anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: run_sampler(Hung(), lambda s: None, 0.01, sample_timeout_s=0.1))
            await anyio.to_thread.run_sync(second_call.wait, 5)
            tg.cancel_scope.cancel()
    errors = [e["error"] for e in logs if e["event"] == "telemetry_sample_failed"]
    assert "longer than 0.1 s" in errors[0]
    assert any("still running" in error for error in errors[1:])
    assert running[1] == 1


# --- selection ----------------------------------------------------------------------------


def test_auto_on_this_machine_picks_linux_and_says_why_not_jetson_or_nvml() -> None:
    """On this (non-Jetson, GPU-less) machine auto picks linux and logs why jetson and nvml were skipped."""
    if NvmlSource().probe() is None or not_jetson_reason("/") is None:
        pytest.skip("this machine has a usable Jetson or NVIDIA GPU")
    with capture_logs() as logs:
        source = create_source("auto")
    try:
        assert isinstance(source, LinuxSource) and isinstance(source, TelemetrySource)
        (selected,) = [e for e in logs if e["event"] == "telemetry_selected"]
        assert selected["platform"] == "linux"
        assert selected["skipped"]["jetson"].startswith("not a Jetson")
        assert selected["skipped"]["nvml"].startswith(("NVML unavailable", "nvidia-ml-py"))
    finally:
        source.close()


def test_auto_on_a_jetson_tree_picks_the_sysfs_source(orin_nano: Path) -> None:
    """On an Orin Nano tree auto picks the jetson sysfs source without trying the others."""
    with capture_logs() as logs:
        source = create_source("auto", root=str(orin_nano))
    assert isinstance(source, JetsonSource)
    assert logs[-1]["skipped"] == {}


def test_jetson_falls_back_to_tegrastats_when_sysfs_is_unreadable(tmp_path: Path) -> None:
    """A Jetson without readable sysfs (e.g. a container) skips sysfs and jtop and runs tegrastats."""
    root = tmp_path / "container"
    write(root, "/etc/nv_tegra_release", "# R36 (release), REVISION: 4.0\n")
    binary = fake_binary(tmp_path, "tegrastats", TEGRASTATS_JP5)
    with capture_logs() as logs:
        source = create_source("jetson", root=str(root), tegrastats_binary=str(binary))
    try:
        assert isinstance(source, TegrastatsSource)
        skipped = logs[-1]["skipped"]
        assert "no thermal zones" in skipped["jetson"] and "jetson-jtop" in skipped
        assert source.sample().temps_c["cpu"] == 45.5
    finally:
        source.close()


def test_explicit_platform_errors_and_unknown_names(tmp_path: Path) -> None:
    """An unusable explicit platform raises with the reason; unknown platforms and options are refused."""
    with pytest.raises(TelemetryUnavailable, match="not a Jetson"):
        create_source("jetson", root=str(tmp_path))
    with pytest.raises(ValueError, match="unknown telemetry platform"):
        create_source("raspberry")
    with pytest.raises(TypeError, match="gpu_index"):
        create_source("linux", gpu_index=1)
    sim = create_source("simulated", temps_c={"gpu": 40.0})
    assert isinstance(sim, SimulatedSource) and sim.sample().temps_c == {"gpu": 40.0}
