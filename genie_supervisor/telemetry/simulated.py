"""A scriptable platform for tests and demos: values change when told, or on a timed script.

    source = SimulatedSource(temps_c={"gpu": 50.0})
    source.set(temps_c={"gpu": 82.0})          # the next sample() sees 82 °C
    demo = SimulatedSource(script=[(0, {"temps_c": {"gpu": 50.0}}), (30, {"temps_c": {"gpu": 85.0}})])
    demo = SimulatedSource(script="heat.jsonl", loop=True)   # {"t": 30, "temps_c": {...}} lines

The defaults look like an idle Jetson Orin Nano 8 GB so a demo shows plausible numbers.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from genie_supervisor.events import TelemetrySample, now

FIELDS = frozenset(f.name for f in dataclasses.fields(TelemetrySample)) - {"platform", "ts"}
"""The TelemetrySample fields a simulation may set."""

DEFAULTS: dict[str, Any] = {
    "temps_c": {"cpu": 45.0, "gpu": 44.0, "tj": 45.5},
    "trip_points_c": {"cpu": (99.0, 103.0), "gpu": (99.0, 103.0), "tj": (99.0, 103.0)},
    "gpu_load_pct": 0.0,
    "gpu_freq_mhz": 306.0,
    "cpu_load_pct": 3.0,
    "power_w": {"VDD_IN": 5.0, "VDD_CPU_GPU_CV": 0.6, "VDD_SOC": 1.4},
    "mem_total_mb": 7620.0,
    "mem_available_mb": 5200.0,
    "swap_total_mb": 3810.0,
    "swap_used_mb": 0.0,
    "gpu_mem_used_mb": None,
    "power_mode": "15W",
}

Step = tuple[float, Mapping[str, Any]]
"""A script step: at `t` seconds after the source was built (or after the loop restarted), set these fields."""


def _check(fields: Mapping[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(fields) - FIELDS)
    if unknown:
        raise ValueError(f"unknown telemetry field(s) {unknown}; expected some of {sorted(FIELDS)}")
    checked = dict(fields)
    if isinstance(checked.get("trip_points_c"), Mapping):  # JSON gives lists
        checked["trip_points_c"] = {k: tuple(v) for k, v in checked["trip_points_c"].items()}
    return checked


def load_script(path: str | os.PathLike[str]) -> list[Step]:
    """Read a JSONL script: one ``{"t": seconds, <TelemetrySample fields>...}`` object a line.

    Blank lines and lines starting with ``#`` are skipped; a bad line raises ValueError naming
    the file and line.
    """
    steps: list[Step] = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            try:
                entry = json.loads(line)
                if not isinstance(entry, dict) or not isinstance(entry.get("t"), (int, float)):
                    raise ValueError('expected an object with a numeric "t"')
                t = float(entry.pop("t"))
                steps.append((t, _check(entry)))
            except ValueError as exc:
                raise ValueError(f"{os.fspath(path)}:{number}: {exc}") from None
    return steps


class SimulatedSource:
    """Returns the current simulated values; `set()` and script steps change them, thread-safely."""

    name = "simulated"

    def __init__(
        self,
        *,
        script: Iterable[Step] | str | os.PathLike[str] = (),
        loop: bool = False,
        period_s: float | None = None,
        clock: Callable[[], float] = now,
        defaults: bool = True,
        **values: Any,
    ) -> None:
        """`values` are initial TelemetrySample fields on top of DEFAULTS (or of nothing when
        `defaults` is False). `script` (steps, or a JSONL file) applies each step once `clock()`
        has advanced `t` seconds. With `loop` the script starts over every `period_s` seconds;
        by default the last step is held as long as the gap before it (steps at 0 and 10 s
        repeat every 20 s)."""
        self._lock = threading.Lock()
        self._values: dict[str, Any] = dict(DEFAULTS) if defaults else {}
        self._values.update(_check(values))
        raw = load_script(script) if isinstance(script, (str, os.PathLike)) else script
        steps = [(float(t), _check(fields)) for t, fields in raw]
        self._script = sorted(steps, key=lambda step: step[0])
        self._period = period_s if period_s is not None else _default_period(self._script)
        if loop and self._period <= 0:
            raise ValueError("a looping script needs a period > 0 (steps at different times)")
        self._loop = loop
        self._next = 0  # index of the next step to apply
        self._cycle = 0  # completed passes through a looping script
        self._clock = clock
        self._t0 = clock()
        self.samples_taken = 0
        """How many samples were served (lets tests wait for the sampler without sleeping)."""

    def set(self, **fields: Any) -> None:
        """Change fields now; the next sample() returns them."""
        checked = _check(fields)
        with self._lock:
            self._values.update(checked)

    def probe(self) -> str | None:
        return None

    def sample(self) -> TelemetrySample:
        with self._lock:
            self._advance(self._clock() - self._t0)
            values = {k: _copy(v) for k, v in self._values.items()}
            self.samples_taken += 1
        return TelemetrySample(platform="simulated", ts=now(), **values)

    def _advance(self, elapsed: float) -> None:
        if self._loop and elapsed >= (self._cycle + 2) * self._period:
            # Far behind (a long gap between samples): replay only the last whole pass.
            self._cycle, self._next = int(elapsed // self._period) - 1, 0
        while self._next < len(self._script):
            t, fields = self._script[self._next]
            if self._cycle * self._period + t > elapsed:
                return
            self._values.update(fields)
            self._next += 1
            if self._next == len(self._script) and self._loop:
                self._cycle, self._next = self._cycle + 1, 0

    def close(self) -> None:
        """Nothing to release."""


def _default_period(script: list[tuple[float, dict[str, Any]]]) -> float:
    if len(script) < 2:
        return script[0][0] * 2 if script else 0.0
    last, before = script[-1][0], script[-2][0]
    return last + (last - before)


def _copy(value: Any) -> Any:
    return dict(value) if isinstance(value, Mapping) else value
