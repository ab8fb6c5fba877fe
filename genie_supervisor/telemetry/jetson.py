"""Jetson telemetry straight from the kernel: thermal zones, INA3221 power rails, devfreq GPU, nvpmodel.

Every file is read under a root directory (default ``/``) so tests can hand in a fake tree.
Paths differ between modules and JetPack releases, so they are found by globbing once, when
the source is built:

- power rails: JetPack 5 and 6 expose the INA3221 through hwmon
  (``/sys/bus/i2c/drivers/ina3221/*/hwmon/hwmon*/in<N>_label``, ``in<N>_input`` in mV,
  ``curr<N>_input`` in mA; the hwmon number differs between releases, and some expose an
  ``in7`` "sum of shunt voltages" channel without a current, which is skipped, as are rails
  labelled ``NC``); JetPack 4 used iio
  (``/sys/bus/i2c/drivers/ina3221x/*/iio:device*/rail_name_<N>``, ``in_power<N>_input`` in mW);
- GPU: a devfreq node named after the GPU (``/sys/class/devfreq/17000000.gpu`` on JetPack 6,
  ``17000000.ga10b`` on JetPack 5; ``cur_freq`` in Hz, ``device/load`` in 0.1 %), or the
  platform device's ``load`` (``/sys/devices/platform/gpu.0/load`` and friends);
- nvpmodel: mode names from ``/etc/nvpmodel.conf``, the current id from
  ``/var/lib/nvpmodel/status``, else (on the real root only) ``nvpmodel -q``.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass

from genie_supervisor.errors import TelemetryError
from genie_supervisor.events import TelemetrySample, now
from genie_supervisor.telemetry.sysfs import (
    ProcStatCpu,
    read_int,
    read_meminfo,
    read_text,
    read_thermal,
    thermal_zone_dirs,
    under,
)

JETSON_MODEL_MARK = "NVIDIA Jetson"


def jetson_model(root: str = "/") -> str | None:
    """The board's device-tree model (e.g. ``NVIDIA Jetson Orin Nano Developer Kit``), or None."""
    for path in ("/proc/device-tree/model", "/sys/firmware/devicetree/base/model"):
        text = read_text(under(root, path))
        if text:
            return text
    return None


def not_jetson_reason(root: str = "/") -> str | None:
    """None on a Jetson; otherwise why this does not look like one."""
    if os.path.isfile(under(root, "/etc/nv_tegra_release")):
        return None
    model = jetson_model(root)
    if model and JETSON_MODEL_MARK.lower() in model.lower():
        return None
    seen = f"device-tree model is {model!r}" if model else "no device-tree model"
    return f"not a Jetson: no /etc/nv_tegra_release and {seen}"


# --- power rails (INA3221) ---------------------------------------------------------------


@dataclass(frozen=True)
class PowerRail:
    """One INA3221 channel and where its readings live."""

    name: str
    """The rail's label, e.g. ``VDD_IN``."""
    volt_path: str | None = None
    """Bus voltage in mV (hwmon)."""
    curr_path: str | None = None
    """Current in mA (hwmon)."""
    power_path: str | None = None
    """Power in mW (iio, JetPack 4)."""

    def read_w(self) -> float | None:
        """The rail's power in watts, or None when a file cannot be read."""
        if self.power_path:
            mw = read_int(self.power_path)
            return None if mw is None else mw / 1000.0
        if self.volt_path and self.curr_path:
            mv, ma = read_int(self.volt_path), read_int(self.curr_path)
            if mv is None or ma is None:
                return None
            return mv * ma / 1_000_000.0
        return None


def find_power_rails(root: str = "/") -> list[PowerRail]:
    """Every labelled INA3221 channel under `root`, hwmon layout first, then the iio layout."""
    rails: list[PowerRail] = []
    names: set[str] = set()

    def add(rail: PowerRail) -> None:
        name, n = rail.name, 1
        while name in names:
            n += 1
            name = f"{rail.name}_{n}"
        names.add(name)
        rails.append(PowerRail(name, rail.volt_path, rail.curr_path, rail.power_path))

    hwmon = under(root, "/sys/bus/i2c/drivers/ina3221/*/hwmon/hwmon*/in*_label")
    for label_path in sorted(glob.glob(hwmon)):
        match = re.fullmatch(r"in(\d+)_label", os.path.basename(label_path))
        label = read_text(label_path)
        if not match or not label or _unconnected(label):
            continue
        folder, n = os.path.dirname(label_path), match.group(1)
        curr = os.path.join(folder, f"curr{n}_input")
        volt = os.path.join(folder, f"in{n}_input")
        if os.path.exists(curr) and os.path.exists(volt):
            add(PowerRail(label, volt_path=volt, curr_path=curr))

    iio = under(root, "/sys/bus/i2c/drivers/ina3221x/*/iio:device*/rail_name_*")
    for name_path in sorted(glob.glob(iio)):
        n = name_path.rsplit("_", 1)[-1]
        label = read_text(name_path)
        power = os.path.join(os.path.dirname(name_path), f"in_power{n}_input")
        if label and not _unconnected(label) and os.path.exists(power):
            add(PowerRail(label, power_path=power))
    return rails


def _unconnected(label: str) -> bool:
    return label.upper() == "NC" or label.lower().startswith("sum of shunt")


# --- GPU (devfreq) ------------------------------------------------------------------------

_GPU_DEVFREQ = re.compile(r"(gpu|ga10b|gv11b|gp10b|gm20b|gb10b)", re.IGNORECASE)
_GPU_LOAD_GLOBS = (
    "/sys/devices/platform/gpu.0/load",
    "/sys/devices/gpu.0/load",
    "/sys/devices/platform/bus@0/*.gpu/load",
    "/sys/devices/platform/*.gpu/load",
    "/sys/devices/platform/bus@0/*.ga10b/load",
    "/sys/devices/platform/*.ga10b/load",
    "/sys/devices/platform/*.gv11b/load",
)


@dataclass(frozen=True)
class GpuPaths:
    """Where the GPU's load (0.1 % units) and current clock (Hz) are read."""

    load_path: str | None
    freq_path: str | None


def find_gpu(root: str = "/") -> GpuPaths:
    """Locate the GPU's devfreq node and load file under `root`."""
    load: str | None = None
    freq: str | None = None
    for node in sorted(glob.glob(under(root, "/sys/class/devfreq/*"))):
        if not _GPU_DEVFREQ.search(os.path.basename(node)):
            continue
        if freq is None and os.path.exists(os.path.join(node, "cur_freq")):
            freq = os.path.join(node, "cur_freq")
        if load is None and os.path.exists(os.path.join(node, "device", "load")):
            load = os.path.join(node, "device", "load")
    for pattern in _GPU_LOAD_GLOBS:
        if load is not None:
            break
        hits = sorted(glob.glob(under(root, pattern)))
        load = hits[0] if hits else None
    return GpuPaths(load, freq)


def read_gpu(paths: GpuPaths) -> tuple[float | None, float | None]:
    """(load in percent, clock in MHz), each None when unreadable."""
    load = read_int(paths.load_path) if paths.load_path else None
    hz = read_int(paths.freq_path) if paths.freq_path else None
    load_pct = None if load is None else max(0.0, min(100.0, load / 10.0))
    return load_pct, None if hz is None else hz / 1_000_000.0


# --- nvpmodel -----------------------------------------------------------------------------

_CONF_MODE = re.compile(r"<\s*POWER_MODEL\s+ID\s*=\s*(\d+)\s+NAME\s*=\s*([^\s>]+)", re.IGNORECASE)
_STATUS_MODE = re.compile(r"pmode\s*[:=]\s*(\d+)", re.IGNORECASE)
_QUERY_MODE = re.compile(r"NV Power Mode\s*:\s*(\S+)", re.IGNORECASE)


def parse_nvpmodel_conf(text: str) -> dict[int, str]:
    """Mode id -> name from an nvpmodel.conf (``< POWER_MODEL ID=0 NAME=15W >`` lines)."""
    return {int(m.group(1)): m.group(2) for m in _CONF_MODE.finditer(text)}


def parse_nvpmodel_status(text: str) -> int | None:
    """The current mode id from /var/lib/nvpmodel/status (``pmode:0000 fmode:quiet``, or a bare id)."""
    match = _STATUS_MODE.search(text)
    if match:
        return int(match.group(1))
    first = text.split()
    return int(first[0]) if first and first[0].isdigit() else None


def parse_nvpmodel_query(text: str) -> str | None:
    """The mode name from ``nvpmodel -q`` output (``NV Power Mode: 15W`` then the id)."""
    match = _QUERY_MODE.search(text)
    return match.group(1) if match else None


class NvpmodelReader:
    """The current nvpmodel mode name, from files, or ``nvpmodel -q`` (cached) on the real root."""

    def __init__(self, root: str = "/", *, command: str = "nvpmodel", cache_s: float = 30.0) -> None:
        self._conf = under(root, "/etc/nvpmodel.conf")
        self._status = under(root, "/var/lib/nvpmodel/status")
        self._command = shutil.which(command) if os.path.abspath(root) == "/" else None
        self._cache_s = cache_s
        self._modes: dict[int, str] | None = None
        self._queried: tuple[float, str | None] | None = None

    def mode(self) -> str | None:
        """The mode's name (e.g. ``15W``, ``MAXN_SUPER``), or None when it cannot be told."""
        status = read_text(self._status)
        if status is not None:
            mode_id = parse_nvpmodel_status(status)
            if self._modes is None:
                self._modes = parse_nvpmodel_conf(read_text(self._conf) or "")
            if mode_id is not None and mode_id in self._modes:
                return self._modes[mode_id]
        return self._query()

    def _query(self) -> str | None:
        if self._command is None:
            return None
        if self._queried and time.monotonic() - self._queried[0] < self._cache_s:
            return self._queried[1]
        try:
            done = subprocess.run([self._command, "-q"], capture_output=True, text=True, timeout=2.0, check=False)
            name = parse_nvpmodel_query(done.stdout)
        except (OSError, subprocess.SubprocessError):
            name = None
        self._queried = (time.monotonic(), name)
        return name


# --- the source ---------------------------------------------------------------------------


class JetsonSource:
    """Jetson telemetry from sysfs, procfs and nvpmodel files; no subprocess on the hot path."""

    name = "jetson"

    def __init__(self, root: str = "/", *, nvpmodel_command: str = "nvpmodel") -> None:
        self.root = root
        self.rails = find_power_rails(root)
        self.gpu = find_gpu(root)
        self._cpu = ProcStatCpu(root)
        self._nvpmodel = NvpmodelReader(root, command=nvpmodel_command)

    def probe(self) -> str | None:
        reason = not_jetson_reason(self.root)
        if reason:
            return reason
        if not thermal_zone_dirs(self.root) and read_meminfo(self.root).total_mb is None:
            return f"no thermal zones or /proc/meminfo readable under {self.root}"
        return None

    def sample(self) -> TelemetrySample:
        ts = now()
        thermal = read_thermal(self.root)
        mem = read_meminfo(self.root)
        if not thermal.temps_c and mem.total_mb is None:
            raise TelemetryError(f"no thermal zone or /proc/meminfo readable under {self.root}")
        power: dict[str, float] = {}
        for rail in self.rails:
            watts = rail.read_w()
            if watts is not None:
                power[rail.name] = watts
        gpu_load, gpu_mhz = read_gpu(self.gpu)
        return TelemetrySample(
            platform="jetson",
            ts=ts,
            temps_c=thermal.temps_c,
            trip_points_c=thermal.trip_points_c,
            gpu_load_pct=gpu_load,
            gpu_freq_mhz=gpu_mhz,
            cpu_load_pct=self._cpu.load_pct(),
            power_w=power,
            mem_total_mb=mem.total_mb,
            mem_available_mb=mem.available_mb,
            swap_total_mb=mem.swap_total_mb,
            swap_used_mb=mem.swap_used_mb,
            power_mode=self._nvpmodel.mode(),
        )

    def close(self) -> None:
        """Nothing to release: every read opens and closes its file."""
