"""The cyclic garbage collector held off from process start to ready, then the start's objects frozen.

A daemon's start allocates ~120k container objects (the modules, pydantic's and FastAPI's schemas,
the config, the model's tables) and creates almost no cyclic garbage (~1k objects at ready). The
collector still ran ~170 young and one full collection over them, on the GIL that the early
model load needs too: 15-25 % of the imports' time on the 2-core CPU. `hold()` (the first thing
``genie-supervisor run`` does) disables it; `release()` (at ``supervisor_ready``, or after
`HOLD_LIMIT_S` whatever happens) moves everything alive into the permanent generation
(`gc.freeze`: later collections, during generation too, no longer walk the start's objects) and
enables it again. Only the ``run`` command holds it; a Supervisor in a test process never does.
A model unload unfreezes them (`llm.host.release_freed_memory`) before its full collection, so a
model loaded at start is collected like any other.

`hold()` also shortens the interpreter's switch interval (`sys.setswitchinterval`, 5 ms by
default) to `START_SWITCH_S` until `release()`: during the start the threads of the early load
(file reads, transfers, driver calls: each one takes the GIL back after a wait) compete with the
daemon's imports, which hold it for whole intervals; with the default a waiting thread loses up
to 5 ms each time it wants the GIL back.
"""

from __future__ import annotations

import gc
import sys
import threading

HOLD_LIMIT_S = 120.0
"""Longest the collector stays off (a start that never gets ready must not grow without bound)."""
START_SWITCH_S = 0.001
"""The switch interval from `hold` to `release` (then the previous one again)."""
_switch_before: float | None = None  # the interval `hold` replaced, until `release` puts it back

_lock = threading.Lock()
_held = False
_once = False


def hold(limit_s: float = HOLD_LIMIT_S) -> None:
    """Disable the collector until `release` (at most `limit_s` seconds); once per process."""
    global _held, _once, _switch_before
    with _lock:
        if _once or not gc.isenabled():
            return
        gc.disable()
        _held = _once = True
        _switch_before = sys.getswitchinterval()
        sys.setswitchinterval(min(START_SWITCH_S, _switch_before))
    timer = threading.Timer(limit_s, release)
    timer.daemon = True
    timer.start()


def release() -> bool:
    """Freeze the objects alive now and enable the collector, once, if `hold` disabled it;
    whether this call did it."""
    global _held, _switch_before
    with _lock:
        if not _held:
            return False
        _held = False
        gc.freeze()
        gc.enable()
        if _switch_before is not None:
            sys.setswitchinterval(_switch_before)
            _switch_before = None
    return True


def held() -> bool:
    """Whether the collector is held off now."""
    return _held
