"""Any Linux box: sysfs thermal zones (with trip points) plus psutil for memory, swap and CPU."""

from __future__ import annotations

import sys

import psutil

from genie_supervisor.events import TelemetrySample, now
from genie_supervisor.telemetry.sysfs import read_thermal

BYTES_PER_MIB = 1024.0 * 1024.0
_GUEST_FIELDS = ("guest", "guest_nice")  # already counted in user / nice


class PsutilCpu:
    """Whole-machine CPU utilisation between two calls, from psutil.cpu_times().

    Keeps its own previous reading instead of using psutil.cpu_percent(), whose state is
    shared by every caller in the process.
    """

    def __init__(self) -> None:
        self._last = self._read()

    @staticmethod
    def _read() -> tuple[float, float]:
        times = psutil.cpu_times()
        parts = times._asdict()
        total = sum(v for k, v in parts.items() if k not in _GUEST_FIELDS)
        idle = parts.get("idle", 0.0) + parts.get("iowait", 0.0)
        return idle, total

    def load_pct(self) -> float | None:
        """Utilisation 0-100 since the previous call (or construction); None without a delta."""
        current, last = self._read(), self._last
        self._last = current
        d_total = current[1] - last[1]
        if d_total <= 0:
            return None
        busy = d_total - (current[0] - last[0])
        return max(0.0, min(100.0, 100.0 * busy / d_total))


class LinuxSource:
    """Thermal zones under `root`, memory and CPU from psutil (the running kernel, not `root`)."""

    name = "linux"

    def __init__(self, root: str = "/") -> None:
        self.root = root
        self._cpu = PsutilCpu()

    def probe(self) -> str | None:
        if not sys.platform.startswith("linux"):
            return f"not Linux (sys.platform is {sys.platform!r})"
        try:
            psutil.virtual_memory()
        except Exception as exc:
            return f"psutil cannot read memory: {type(exc).__name__}: {exc}"
        return None

    def sample(self) -> TelemetrySample:
        ts = now()
        thermal = read_thermal(self.root)
        vm = psutil.virtual_memory()
        swap = psutil.swap_memory()
        return TelemetrySample(
            platform="linux",
            ts=ts,
            temps_c=thermal.temps_c,
            trip_points_c=thermal.trip_points_c,
            cpu_load_pct=self._cpu.load_pct(),
            mem_total_mb=vm.total / BYTES_PER_MIB,
            mem_available_mb=vm.available / BYTES_PER_MIB,
            swap_total_mb=swap.total / BYTES_PER_MIB,
            swap_used_mb=swap.used / BYTES_PER_MIB,
        )

    def close(self) -> None:
        """Nothing to release."""
