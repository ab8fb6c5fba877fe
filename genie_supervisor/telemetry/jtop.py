"""jtop (jetson-stats) as a Jetson telemetry source, used only when installed and its service runs.

jtop's client talks to the ``jtop.service`` daemon over ``/run/jtop.sock``; without the service
it cannot work, so the probe checks both the import and the socket. jetson-stats' dictionaries
have changed between releases, so every field is read defensively: one missing key costs that
field only.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping
from typing import Any

from genie_supervisor.errors import TelemetryError
from genie_supervisor.events import TelemetrySample, now
from genie_supervisor.telemetry.sysfs import KIB_PER_MIB, read_meminfo

JTOP_SOCKET = "/run/jtop.sock"


def _default_factory(interval_s: float) -> Any:
    module = importlib.import_module("jtop")
    return module.jtop(interval=interval_s)


class JtopSource:
    """Reads temperatures, rails, GPU, CPU, memory and nvpmodel through a jtop client."""

    name = "jetson-jtop"

    def __init__(
        self,
        *,
        socket_path: str = JTOP_SOCKET,
        interval_s: float = 1.0,
        factory: Callable[[float], Any] | None = None,
    ) -> None:
        self.socket_path = socket_path
        self.interval_s = interval_s
        self._factory = factory
        self._client: Any = None

    def probe(self) -> str | None:
        if self._factory is None:
            try:
                importlib.import_module("jtop")
            except ImportError:
                return "jetson-stats (jtop) is not installed"
            except Exception as exc:  # a broken install must not break auto-selection
                return f"jtop import failed: {type(exc).__name__}: {exc}"
        if not os.path.exists(self.socket_path):
            return f"jtop service is not running ({self.socket_path} does not exist)"
        return None

    def _connect(self) -> Any:
        if self._client is None:
            factory = self._factory or _default_factory
            client = factory(self.interval_s)
            try:
                client.start()
            except Exception as exc:
                raise TelemetryError(f"cannot connect to the jtop service: {exc}") from exc
            self._client = client
        return self._client

    def sample(self) -> TelemetrySample:
        client = self._connect()
        ts = now()
        mem = read_meminfo("/")
        ram = _get(client, "memory", "RAM") or {}
        swap = _get(client, "memory", "SWAP") or {}
        mem_total = _either(mem.total_mb, _kib(ram.get("tot")))
        mem_available = mem.available_mb
        if mem_available is None and mem_total is not None and _kib(ram.get("used")) is not None:
            mem_available = mem_total - (_kib(ram.get("used")) or 0.0)
        gpu = _first_gpu(client)
        gpu_khz = _num(_dig(gpu, "freq", "cur"))
        idle = _num(_get(client, "cpu", "total", "idle"))
        return TelemetrySample(
            platform="jetson",
            ts=ts,
            temps_c=_temps(client),
            gpu_load_pct=_num(_dig(gpu, "status", "load")),
            gpu_freq_mhz=None if gpu_khz is None else gpu_khz / 1000.0,
            cpu_load_pct=None if idle is None else max(0.0, 100.0 - idle),
            power_w=_rails(client),
            mem_total_mb=mem_total,
            mem_available_mb=mem_available,
            swap_total_mb=_either(mem.swap_total_mb, _kib(swap.get("tot"))),
            swap_used_mb=_either(mem.swap_used_mb, _kib(swap.get("used"))),
            power_mode=_mode(client),
        )

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # closing a dead connection is not worth an error
                pass


def _get(client: Any, attribute: str, *keys: str) -> Any:
    try:
        value = getattr(client, attribute)
    except Exception:
        return None
    return _dig(value, *keys)


def _dig(value: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(value, Mapping):
            return None
        value = value.get(key)
    return value


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _either(preferred: float | None, fallback: float | None) -> float | None:
    return preferred if preferred is not None else fallback


def _kib(value: Any) -> float | None:
    number = _num(value)
    return None if number is None else number / KIB_PER_MIB


def _temps(client: Any) -> dict[str, float]:
    temps: dict[str, float] = {}
    raw = _get(client, "temperature")
    for name, entry in (raw or {}).items():
        celsius = _num(_dig(entry, "temp")) if isinstance(entry, Mapping) else _num(entry)
        online = entry.get("online", True) if isinstance(entry, Mapping) else True
        if celsius is not None and online and celsius > -100.0:
            temps[str(name).lower()] = celsius
    return temps


def _rails(client: Any) -> dict[str, float]:
    rails: dict[str, float] = {}
    for name, entry in (_get(client, "power", "rail") or {}).items():
        mw = _num(_dig(entry, "power"))
        if mw is not None:
            rails[str(name)] = mw / 1000.0
    total = _get(client, "power", "tot") or {}
    total_mw = _num(total.get("power")) if isinstance(total, Mapping) else None
    if total_mw is not None:
        rails.setdefault(str(total.get("name") or "total"), total_mw / 1000.0)
    return rails


def _first_gpu(client: Any) -> Any:
    gpus = _get(client, "gpu")
    if isinstance(gpus, Mapping) and gpus:
        return gpus.get("gpu") or next(iter(gpus.values()))
    return None


def _mode(client: Any) -> str | None:
    try:
        mode = client.nvpmodel
    except Exception:
        return None
    if mode is None:
        return None
    name = getattr(mode, "name", None)
    return str(name if name is not None else mode)
