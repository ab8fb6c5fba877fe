"""Desktop / server NVIDIA GPUs through NVML (nvidia-ml-py), on top of the host's `linux` readings.

The GPU adds ``temps_c["gpu"]``, its slowdown/shutdown thresholds as ``trip_points_c["gpu"]``,
utilisation, graphics clock, memory in use and board power (``power_w["gpu"]``). Host memory,
swap, CPU and sysfs thermal zones come from the `linux` source. A query the GPU does not support
(NVML_ERROR_NOT_SUPPORTED on many consumer boards) leaves that one field empty.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from types import ModuleType
from typing import Any, TypeVar

from genie_supervisor.errors import TelemetryError
from genie_supervisor.events import TelemetrySample
from genie_supervisor.telemetry.linux import BYTES_PER_MIB, LinuxSource

T = TypeVar("T")


class NvmlSource:
    """NVML readings for one GPU (by index) merged into the host's Linux sample."""

    name = "nvml"

    def __init__(self, index: int = 0, *, root: str = "/", nvml: ModuleType | Any = None) -> None:
        self.index = index
        self._nvml = nvml
        self._host = LinuxSource(root)
        self._handle: Any = None
        self._initialised = False
        self._trips: tuple[float, ...] = ()
        self.device_name: str | None = None
        """The GPU's name as NVML reports it, once probed."""

    def probe(self) -> str | None:
        if self._handle is not None:
            return None
        if self._nvml is None:
            try:
                self._nvml = importlib.import_module("pynvml")
            except ImportError:
                return "nvidia-ml-py (pynvml) is not installed"
        nvml = self._nvml
        try:
            nvml.nvmlInit()
        except Exception as exc:
            return f"NVML unavailable: {_text(exc)}"
        self._initialised = True
        try:
            count = nvml.nvmlDeviceGetCount()
            if self.index >= count:
                self.close()
                return f"NVML sees {count} GPU(s); index {self.index} does not exist"
            self._handle = nvml.nvmlDeviceGetHandleByIndex(self.index)
        except Exception as exc:
            self.close()
            return f"NVML cannot open GPU {self.index}: {_text(exc)}"
        self.device_name = self._optional(lambda: _text(nvml.nvmlDeviceGetName(self._handle)))
        self._trips = self._thresholds()
        return None

    def _optional(self, read: Callable[[], T]) -> T | None:
        try:
            return read()
        except self._nvml.NVMLError:
            return None

    def _thresholds(self) -> tuple[float, ...]:
        nvml, handle = self._nvml, self._handle
        found: list[float] = []
        for kind in ("NVML_TEMPERATURE_THRESHOLD_SLOWDOWN", "NVML_TEMPERATURE_THRESHOLD_SHUTDOWN"):
            const = getattr(nvml, kind, None)
            if const is None:
                continue
            value = self._optional(partial(nvml.nvmlDeviceGetTemperatureThreshold, handle, const))
            if value:
                found.append(float(value))
        return tuple(sorted(set(found)))

    def sample(self) -> TelemetrySample:
        reason = self.probe()
        if reason:
            raise TelemetryError(reason)
        nvml, handle = self._nvml, self._handle
        host = self._host.sample()
        temp = self._optional(lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))
        util = self._optional(lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        clock = self._optional(lambda: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_GRAPHICS))
        mem_used = self._optional(lambda: nvml.nvmlDeviceGetMemoryInfo(handle).used)
        power_mw = self._optional(lambda: nvml.nvmlDeviceGetPowerUsage(handle))
        temps = dict(host.temps_c)
        trips = dict(host.trip_points_c)
        if temp is not None:
            temps["gpu"] = float(temp)
            if self._trips:
                trips["gpu"] = self._trips
        power = dict(host.power_w)
        if power_mw is not None:
            power["gpu"] = power_mw / 1000.0
        return replace(
            host,
            platform="nvml",
            temps_c=temps,
            trip_points_c=trips,
            gpu_load_pct=None if util is None else float(util),
            gpu_freq_mhz=None if clock is None else float(clock),
            power_w=power,
            gpu_mem_used_mb=None if mem_used is None else mem_used / BYTES_PER_MIB,
        )

    def close(self) -> None:
        self._handle = None
        if self._initialised:
            self._initialised = False
            try:
                self._nvml.nvmlShutdown()
            except Exception:  # shutting down a half-initialised library is best effort
                pass


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return str(value)
