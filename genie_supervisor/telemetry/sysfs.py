"""Readers for the kernel's own files (sysfs thermal zones, /proc/meminfo, /proc/stat).

Shared by the `jetson` and `linux` sources. Every path is taken relative to a root directory,
so tests run the same code on a fake tree with the kernel's file formats. Nothing here raises
for a missing or unreadable file: a sensor that cannot be read is left out.
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass, field

KIB_PER_MIB = 1024.0
TRIP_TYPES = ("passive", "hot", "critical")
"""Trip point types reported; ``active`` ones only switch fans and are left out."""
_MIN_VALID_C = -100.0
"""Below this a reading means "no sensor" (Orin reports -256 °C for absent CV clusters)."""
_MAX_VALID_C = 200.0
_ZONE_SUFFIX = re.compile(r"[-_](thermal|therm)$")


def read_text(path: str) -> str | None:
    """The stripped contents of a small file, or None when it cannot be read."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().replace("\x00", "").strip()
    except OSError:
        return None


def read_int(path: str) -> int | None:
    """The first integer in a small file (sysfs style: ``"47281\\n"``, ``"32760 ma"``), or None."""
    text = read_text(path)
    if not text:
        return None
    try:
        return int(text.split()[0])
    except ValueError:
        return None


def under(root: str, path: str) -> str:
    """`path` (absolute, as on a real box) placed under `root`."""
    return os.path.join(root, path.lstrip("/"))


def sensor_name(zone_type: str) -> str:
    """Short sensor name from a thermal zone type: ``cpu-thermal`` -> ``cpu``, ``GPU-therm`` -> ``gpu``."""
    name = _ZONE_SUFFIX.sub("", zone_type.strip().lower())
    return name or "zone"


def _zone_index(path: str) -> int:
    digits = re.search(r"(\d+)$", path)
    return int(digits.group(1)) if digits else 0


@dataclass
class Thermal:
    """Temperatures and trip points of every readable thermal zone."""

    temps_c: dict[str, float] = field(default_factory=dict)
    """Temperature per sensor name in °C."""
    trip_points_c: dict[str, tuple[float, ...]] = field(default_factory=dict)
    """Passive/hot/critical trip points per sensor in °C, ascending."""


def thermal_zone_dirs(root: str) -> list[str]:
    """The ``thermal_zoneN`` directories under `root`, in zone order."""
    pattern = under(root, "/sys/class/thermal/thermal_zone*")
    return sorted(glob.glob(pattern), key=_zone_index)


def read_thermal(root: str) -> Thermal:
    """Read ``/sys/class/thermal/thermal_zone*/{type,temp,trip_point_N_{temp,type}}`` (millidegrees)."""
    out = Thermal()
    for zone in thermal_zone_dirs(root):
        if read_text(os.path.join(zone, "mode")) == "disabled":
            continue
        milli = read_int(os.path.join(zone, "temp"))
        if milli is None or not _MIN_VALID_C < milli / 1000.0 < _MAX_VALID_C:
            continue
        zone_type = read_text(os.path.join(zone, "type")) or os.path.basename(zone)
        name = _unique(sensor_name(zone_type), out.temps_c)
        out.temps_c[name] = milli / 1000.0
        trips = _read_trips(zone)
        if trips:
            out.trip_points_c[name] = trips
    return out


def _read_trips(zone: str) -> tuple[float, ...]:
    found: set[float] = set()
    for temp_path in glob.glob(os.path.join(zone, "trip_point_*_temp")):
        kind = read_text(temp_path[: -len("_temp")] + "_type")
        milli = read_int(temp_path)
        if kind not in TRIP_TYPES or milli is None:
            continue
        celsius = milli / 1000.0
        if 0.0 < celsius < _MAX_VALID_C:
            found.add(celsius)
    return tuple(sorted(found))


def _unique(name: str, taken: dict[str, float]) -> str:
    if name not in taken:
        return name
    n = 1
    while f"{name}{n}" in taken:
        n += 1
    return f"{name}{n}"


@dataclass(frozen=True)
class MemInfo:
    """The memory figures the policy uses, in MiB."""

    total_mb: float | None
    """MemTotal."""
    available_mb: float | None
    """MemAvailable."""
    swap_total_mb: float | None
    """SwapTotal."""
    swap_used_mb: float | None
    """SwapTotal - SwapFree."""


def parse_meminfo(text: str) -> MemInfo:
    """Parse /proc/meminfo (``MemTotal:        7800372 kB`` lines); absent keys become None."""
    kib: dict[str, int] = {}
    for line in text.splitlines():
        key, sep, rest = line.partition(":")
        parts = rest.split()
        if sep and parts:
            try:
                kib[key.strip()] = int(parts[0])
            except ValueError:
                continue

    def mib(key: str) -> float | None:
        return kib[key] / KIB_PER_MIB if key in kib else None

    swap_used = None
    if "SwapTotal" in kib and "SwapFree" in kib:
        swap_used = (kib["SwapTotal"] - kib["SwapFree"]) / KIB_PER_MIB
    return MemInfo(mib("MemTotal"), mib("MemAvailable"), mib("SwapTotal"), swap_used)


def read_meminfo(root: str) -> MemInfo:
    """Read and parse ``/proc/meminfo`` under `root` (all None when it is missing)."""
    return parse_meminfo(read_text(under(root, "/proc/meminfo")) or "")


class ProcStatCpu:
    """Whole-machine CPU utilisation from the ``cpu`` line of /proc/stat, as a delta between calls."""

    def __init__(self, root: str = "/") -> None:
        self._path = under(root, "/proc/stat")
        self._last = self._read()

    def _read(self) -> tuple[int, int] | None:
        text = read_text(self._path)
        if not text:
            return None
        first = text.splitlines()[0].split()
        if not first or first[0] != "cpu":
            return None
        try:
            # user nice system idle iowait irq softirq steal (guest time is already in user).
            ticks = [int(v) for v in first[1:9]]
        except ValueError:
            return None
        if len(ticks) < 4:
            return None
        idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
        return idle, sum(ticks)

    def load_pct(self) -> float | None:
        """Utilisation 0-100 since the previous call (or construction); None when there is no delta."""
        now, last = self._read(), self._last
        self._last = now
        if now is None or last is None:
            return None
        d_total = now[1] - last[1]
        if d_total <= 0:
            return None
        busy = d_total - (now[0] - last[0])
        return max(0.0, min(100.0, 100.0 * busy / d_total))
