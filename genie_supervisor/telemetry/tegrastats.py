"""tegrastats: a tolerant parser for its lines, and a source that keeps the last line of a running one.

tegrastats prints one line per interval; the fields differ by module and JetPack release:

    JetPack 5, Orin Nano:
      RAM 2448/7620MB (lfb 2x4MB) SWAP 0/3810MB (cached 0MB) CPU [2%@1510,1%@1510,off,off]
      EMC_FREQ 0% GR3D_FREQ 0% cpu@45.5C soc2@44.9C ... VDD_IN 4963mW/4963mW VDD_SOC 1442mW/1442mW
    JetPack 6: a timestamp first, ``GR3D_FREQ 0%@[305]``, three-decimal temperatures.
    JetPack 4: ``POM_5V_IN 1186/1186`` (mW without unit), ``GR3D_FREQ 0%@76``, ``PMIC@100C``.

The parser walks the tokens and picks up what it knows: RAM, SWAP, CPU, GR3D_FREQ,
``name@<temp>C`` and ``NAME <mW>/<avg mW>``. Anything else is ignored; a line with nothing
it knows gives None. Absent sensors read -256 C on Orin and are dropped, and ``PMIC@100C``
(a fixed value, not a measurement) is dropped too.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import threading

from genie_supervisor.errors import TelemetryError
from genie_supervisor.events import TelemetrySample, now

_USED_TOTAL_MB = re.compile(r"^(\d+)/(\d+)MB$")
_CORE = re.compile(r"^(\d+(?:\.\d+)?)%")
_GR3D = re.compile(r"^(\d+(?:\.\d+)?)%(?:@\[?([\d,]*)\]?)?$")
_TEMP = re.compile(r"^([A-Za-z][\w.-]*)@(-?\d+(?:\.\d+)?)C$")
_POWER = re.compile(r"^(\d+)(?:mW)?/(\d+)(?:mW)?$")
_RAIL_NAME = re.compile(r"^[A-Z][A-Z0-9_]*$")
_NOT_RAILS = frozenset({"RAM", "SWAP", "IRAM", "CPU", "EMC_FREQ", "GR3D_FREQ", "APE", "NC"})
_FAKE_SENSORS = frozenset({"pmic"})
_MIN_VALID_C = -100.0


def parse_tegrastats(line: str, *, ts: float | None = None) -> TelemetrySample | None:
    """Parse one tegrastats line into a ``jetson`` sample; None when no known field is found.

    MemAvailable is not printed by tegrastats; ``total - used`` stands in for it (tegrastats'
    "used" already leaves out buffers and page cache).
    """
    tokens = line.split()
    found = False
    temps: dict[str, float] = {}
    power: dict[str, float] = {}
    fields: dict[str, float] = {}
    for i, token in enumerate(tokens):
        nxt = tokens[i + 1] if i + 1 < len(tokens) else ""
        if token in ("RAM", "SWAP"):
            match = _USED_TOTAL_MB.match(nxt)
            if not match:
                continue
            used, total = float(match.group(1)), float(match.group(2))
            if token == "RAM":
                fields["mem_total_mb"], fields["mem_available_mb"] = total, max(0.0, total - used)
            else:
                fields["swap_total_mb"], fields["swap_used_mb"] = total, used
            found = True
        elif token == "CPU" and nxt.startswith("["):
            loads = [float(m.group(1)) for c in nxt.strip("[]").split(",") if (m := _CORE.match(c))]
            if loads:
                fields["cpu_load_pct"] = sum(loads) / len(loads)
                found = True
        elif token == "GR3D_FREQ":
            match = _GR3D.match(nxt)
            if not match:
                continue
            fields["gpu_load_pct"] = float(match.group(1))
            clocks = [int(c) for c in (match.group(2) or "").split(",") if c.isdigit()]
            if clocks:
                fields["gpu_freq_mhz"] = float(max(clocks))
            found = True
        elif match := _TEMP.match(token):
            name, celsius = match.group(1).lower(), float(match.group(2))
            if name not in _FAKE_SENSORS and celsius > _MIN_VALID_C:
                temps[name] = celsius
                found = True
        elif token not in _NOT_RAILS and _RAIL_NAME.match(token):
            match = _POWER.match(nxt)
            if match:
                power[token] = int(match.group(1)) / 1000.0
                found = True
    if not found:
        return None
    return TelemetrySample(
        platform="jetson",
        ts=now() if ts is None else ts,
        temps_c=temps,
        power_w=power,
        cpu_load_pct=fields.get("cpu_load_pct"),
        gpu_load_pct=fields.get("gpu_load_pct"),
        gpu_freq_mhz=fields.get("gpu_freq_mhz"),
        mem_total_mb=fields.get("mem_total_mb"),
        mem_available_mb=fields.get("mem_available_mb"),
        swap_total_mb=fields.get("swap_total_mb"),
        swap_used_mb=fields.get("swap_used_mb"),
    )


class TegrastatsSource:
    """Runs ``tegrastats --interval N`` and serves the last line it printed, parsed.

    The subprocess starts on the first `sample()` and is restarted (on a later call) if it
    exits. A reader thread parses each line as it arrives; `sample()` only copies the latest.
    """

    name = "jetson-tegrastats"

    def __init__(
        self,
        *,
        binary: str = "tegrastats",
        interval_ms: int = 1000,
        first_line_timeout_s: float | None = None,
        stale_after_s: float | None = None,
    ) -> None:
        self.binary = binary
        self.interval_ms = max(1, int(interval_ms))
        interval_s = self.interval_ms / 1000.0
        self.first_line_timeout_s = first_line_timeout_s or max(2.0, 3 * interval_s)
        self.stale_after_s = stale_after_s or max(5.0, 5 * interval_s)
        self._lock = threading.Lock()
        self._got_line = threading.Event()
        self._last: TelemetrySample | None = None
        self._proc: subprocess.Popen[str] | None = None
        self._thread: threading.Thread | None = None

    def probe(self) -> str | None:
        return None if shutil.which(self.binary) else f"{self.binary!r} not found on PATH"

    def sample(self) -> TelemetrySample:
        self._ensure_running()
        if not self._got_line.wait(self.first_line_timeout_s):
            raise TelemetryError(f"tegrastats printed no parseable line within {self.first_line_timeout_s} s")
        with self._lock:
            last = self._last
        assert last is not None
        age = now() - last.ts
        if age > self.stale_after_s:
            raise TelemetryError(f"tegrastats' last line is {age:.1f} s old")
        return last

    def _ensure_running(self) -> None:
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                return
        self._stop()
        path = shutil.which(self.binary)
        if path is None:
            raise TelemetryError(f"{self.binary!r} not found on PATH")
        proc = subprocess.Popen(
            [path, "--interval", str(self.interval_ms)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            bufsize=1,
        )
        thread = threading.Thread(target=self._read_lines, args=(proc,), name="tegrastats-reader", daemon=True)
        with self._lock:
            self._proc, self._thread = proc, thread
        thread.start()

    def _read_lines(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                parsed = parse_tegrastats(line)
                if parsed is not None:
                    with self._lock:
                        self._last = parsed
                    self._got_line.set()
        except (OSError, ValueError):  # the pipe was closed under us by close()
            return

    def _stop(self) -> None:
        with self._lock:
            proc, thread = self._proc, self._thread
            self._proc = self._thread = None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=2.0)
        if thread is not None:
            thread.join(timeout=2.0)
        if proc.stdout is not None:
            proc.stdout.close()

    def close(self) -> None:
        self._stop()
