"""Warm start: compiled kernels land in the folder the systemd unit keeps, and the daemon reports
its process start to ready (a real daemon process on SmolLM2, native CPU kernels)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from anyio.abc import SocketAttribute, SocketStream

from genie_supervisor.startup import kernel_cache_dir, use_kernel_cache
from tests.daemon import make_supervisor, write_policy
from tests.daemon_process import DaemonProcess
from tests.models import SMOLLM2, require

pytestmark = pytest.mark.timeout(120)


def test_kernel_cache_dir_prefers_the_config_then_systemd_then_the_user_cache() -> None:
    """engine.kernel_cache_dir wins; else systemd's $CACHE_DIRECTORY/kernels; else XDG (~/.cache)."""
    assert kernel_cache_dir("/srv/k", {"CACHE_DIRECTORY": "/var/cache/g"}) == Path("/srv/k")
    assert kernel_cache_dir(None, {"CACHE_DIRECTORY": "/var/cache/g:/other"}) == Path("/var/cache/g/kernels")
    assert kernel_cache_dir(None, {"XDG_CACHE_HOME": "/x"}) == Path("/x/genie-supervisor/kernels")
    env = {"CUPY_CACHE_DIR": "/mine"}
    made = {"GENIE_KERNEL_CACHE_DIR": "/k/native", "GENIE_STRINGS_CACHE_DIR": "/k/strings"}
    assert use_kernel_cache(Path("/k"), env) == made
    assert env == {"CUPY_CACHE_DIR": "/mine", **made}  # a set variable wins


async def test_daemon_keeps_kernels_under_the_cache_directory_and_reports_start_to_ready(tmp_path: Path) -> None:
    """Under systemd's CacheDirectory= (no kernel_cache_dir in the config) the native kernels are
    built into $CACHE_DIRECTORY/kernels/native and the vocabulary's parse is kept in
    $CACHE_DIRECTORY/kernels/strings, and the ready line and /status say how long the
    process took from its start to ready, with the model's load phases in model_loaded."""
    cache = tmp_path / "var-cache"
    env = {
        "CACHE_DIRECTORY": str(cache),
        "GENIE_KERNEL_CACHE_DIR": "",
        "CUPY_CACHE_DIR": "",
        "GENIE_STRINGS_CACHE_DIR": "",
    }
    daemon = DaemonProcess(tmp_path, model=require(SMOLLM2), backend="native", env=env)
    async with daemon as d, httpx.AsyncClient(base_url=d.url, timeout=60) as api:
        ready = await d.event("supervisor_ready")
        loaded = await d.event("model_loaded")
        assert ready["kernel_cache_dir"] == str(cache / "kernels")
        assert 0 < ready["start_to_ready_s"] < 120 and ready["prewarm_error"] is None
        assert set(loaded["phases_s"]) == {"header", "backend", "tokenizer", "template", "ops", "weights_kv", "decoder"}
        assert loaded["plan"]["prefill_chunk"] == 16 and loaded["plan"]["kv_dtype"] == "f16"
        startup = (await api.get("/status")).json()["startup"]
        assert startup["start_to_ready_s"] == ready["start_to_ready_s"]
        assert ready["gc_frozen"] > 10_000  # the collector was held off to ready, the start frozen
    assert list((cache / "kernels" / "native").glob("qgemv-*.so"))
    # written by a thread of the load that the process's exit waits for: the tokens and the merges
    assert len(list((cache / "kernels" / "strings").glob("*.strings"))) == 2


def test_the_collector_is_held_off_once_until_ready_or_the_limit() -> None:
    """`gc_start.hold` disables the cyclic collector and shortens the switch interval once per
    process; `release` freezes what is alive, enables the collector and puts the interval back
    (once), the limit releases it when ready never comes, and a model unload collects a frozen
    object in a reference cycle."""
    import subprocess
    import sys

    code = """
import gc, sys, time
from genie_supervisor import gc_start
sys.setswitchinterval(0.004)
gc_start.hold()
assert not gc.isenabled() and gc_start.held()
assert abs(sys.getswitchinterval() - gc_start.START_SWITCH_S) < 1e-6
junk = [[i] for i in range(50_000)]
assert gc_start.release() and gc.isenabled() and gc.get_freeze_count() >= 50_000
assert abs(sys.getswitchinterval() - 0.004) < 1e-6
assert not gc_start.release()
gc_start.hold()
assert gc.isenabled(), "held twice"
assert abs(sys.getswitchinterval() - 0.004) < 1e-6, "shortened twice"
"""
    limit = """
import gc, sys, time
from genie_supervisor import gc_start
gc_start.hold(limit_s=0.05)
deadline = time.monotonic() + 10
while not gc.isenabled() and time.monotonic() < deadline:
    time.sleep(0.01)
assert gc.isenabled() and not gc_start.held() and sys.getswitchinterval() > gc_start.START_SWITCH_S
"""
    unload = """
import gc, weakref
from genie_supervisor import gc_start
from genie_supervisor.llm.host import release_freed_memory
class Model:
    pass
gc_start.hold()
m = Model()
m.me = m  # a reference cycle, as a loaded model may hold
alive = weakref.ref(m)
gc_start.release()
del m
gc.collect()
assert alive() is not None  # frozen at ready: a collection does not see it
release_freed_memory()
assert alive() is None, "an unload must collect what the start froze"
"""
    for src in (code, limit, unload):
        done = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stderr


def test_early_load_only_within_the_budget_and_handed_over_once() -> None:
    """The prewarm thread loads the start model only when its plan fits the budget, and hands it
    over once, to a load of exactly the same parameters."""
    from engine.options import EngineOptions
    from engine.prewarm import EarlyLoad, start_prewarm

    path = str(require(SMOLLM2))
    options = EngineOptions(prefill_chunk=16)
    tight = start_prewarm("numpy", options, EarlyLoad(path, 512, "f16", None, budget_bytes=1 << 20))
    assert tight.done.wait(60) and tight.model is None and tight.skipped is not None
    assert "over the budget" in tight.skipped

    rec = start_prewarm("numpy", options, EarlyLoad(path, 512, "f16", None, budget_bytes=4 << 30))
    assert rec.take("numpy", options, path, 1024, "f16", None) is None  # another context: not this one
    assert rec.take("numpy", EngineOptions(prefill_chunk=64), path, 512, "f16", None) is None  # another chunk
    model = rec.take("numpy", options, path, 512, "f16", None)
    assert model is not None and model.info.n_ctx == 512 and model.memory_plan.chunk == 16
    assert rec.take("numpy", options, path, 512, "f16", None) is None  # once


@pytest.mark.timeout(120)
def test_the_early_load_uses_the_header_and_tokenizer_read_beside_the_prewarm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prewarm thread's early model has the tokenizer its header thread built (built once, the
    same tokens as a plain load), a tokenizer without its header is refused, and a file that is
    not a GGUF leaves no early model but the reason."""
    from engine import load_model
    from engine.options import EngineOptions
    from engine.prewarm import EarlyLoad, start_prewarm
    from engine.tokenizer import Tokenizer

    built: list[str] = []
    build = Tokenizer.from_gguf.__func__  # type: ignore[attr-defined]

    def counted(cls: type[Tokenizer], gf: Any) -> Tokenizer:
        built.append(gf.path)
        return build(cls, gf)  # type: ignore[no-any-return]

    monkeypatch.setattr(Tokenizer, "from_gguf", classmethod(counted))
    path = str(require(SMOLLM2))
    options = EngineOptions(prefill_chunk=16)
    rec = start_prewarm("numpy", options, EarlyLoad(path, 256, "f16", None, budget_bytes=4 << 30))
    model = rec.take("numpy", options, path, 256, "f16", None)
    assert built == [path]
    plain = load_model(path, backend="numpy", n_ctx=256)
    text = "Turn on the kitchen lights at 7:30, please."
    assert model is not None and model.tokenizer.encode(text) == plain.tokenizer.encode(text)
    with pytest.raises(ValueError, match="tokenizer"):
        load_model(path, backend="numpy", n_ctx=256, tokenizer=plain.tokenizer)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    broken = start_prewarm("numpy", options, EarlyLoad(str(bad), 256, "f16", None, budget_bytes=4 << 30))
    assert broken.done.wait(60) and broken.model is None
    assert broken.skipped is not None and "ModelFormatError" in broken.skipped


@pytest.mark.timeout(120)
def test_the_early_header_is_handed_out_once_for_the_same_unchanged_file(tmp_path: Path) -> None:
    """The daemon's plan at start gets the header the early load read (the same object, parsed
    once), only for that file, only once, and not after the file changed."""
    import os
    import shutil

    from engine.options import EngineOptions
    from engine.prewarm import EarlyLoad, start_prewarm

    path = str(tmp_path / "m.gguf")
    shutil.copyfile(require(SMOLLM2), path)
    options = EngineOptions(prefill_chunk=16)
    rec = start_prewarm("numpy", options, EarlyLoad(path, 256, "f16", None, budget_bytes=4 << 30))
    assert rec.header(path + ".other") is None
    rec = start_prewarm("numpy", options, EarlyLoad(path, 256, "f16", None, budget_bytes=4 << 30))
    header = rec.header(path)
    assert header is not None and header.path == path and header.loadable
    assert rec.header(path) is None  # once
    assert rec.done.wait(60) and rec.model is not None  # the early load went on with its own reference

    changed = start_prewarm("numpy", options, EarlyLoad(path, 256, "f16", None, budget_bytes=4 << 30))
    assert changed.done.wait(60)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert changed.header(path) is None


async def test_the_daemon_takes_over_the_model_loaded_at_process_start(tmp_path: Path) -> None:
    """With one model to load at the start, `run` loads it in the prewarm thread while the daemon
    imports and starts; the model manager takes it over (model_loaded says early) and it serves."""
    daemon = DaemonProcess(tmp_path, model=require(SMOLLM2), backend="native")
    async with daemon as d, httpx.AsyncClient(base_url=d.url, timeout=60) as api:
        loaded = await d.event("model_loaded")
        assert loaded["early"] is True
        startup = (await api.get("/status")).json()["startup"]
        assert startup["early_load_s"] is not None and startup["early_skipped"] is None
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        assert (await api.post("/v1/chat/completions", json=chat)).status_code == 200


async def test_the_services_first_checks_run_at_once(tmp_path: Path) -> None:
    """The watchers start together: two services whose health routes answer only once both are asked
    are both up when the daemon is ready (one after the other, the first check would time out)."""
    asked, both = 0, anyio.Event()

    async def health(stream: SocketStream) -> None:
        nonlocal asked
        async with stream:
            await stream.receive()
            asked += 1
            if asked == 2:
                both.set()
            await both.wait()
            await stream.send(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    url = f"http://127.0.0.1:{listener.extra(SocketAttribute.local_port)}/health"
    services = "".join(
        f"  {name}: {{kind: http, match: {{health_url: '{url}'}}, timeout_s: 5, interval_s: 600}}\n" for name in "ab"
    )
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, health)
        with anyio.fail_after(30):
            async with make_supervisor(
                tmp_path, policy=write_policy(tmp_path / "p.yaml"), extra="services:\n" + services
            ) as sup:
                seen = sup.store.snapshot().services
                assert {s: (o.up, o.reason) for s, o in seen.items()} == {
                    "a": (True, "http: health 200"),
                    "b": (True, "http: health 200"),
                }
        tg.cancel_scope.cancel()


class _FakeDriver:
    """libcuda's entry points `driver_context` and `release_driver_context` call, each answering `codes[name]` (0: success)."""

    def __init__(self, **codes: int) -> None:
        self.codes, self.calls = codes, []  # type: ignore[var-annotated]

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any) -> int:
            self.calls.append(name)
            return self.codes.get(name, 0)

        return call


def test_the_driver_context_is_made_where_a_driver_answers_and_skipped_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`driver_context` retains the device's primary context through the driver and says how long it
    took, `release_driver_context` gives it back; no driver library, no device or a failing call
    gives None and raises nothing."""
    import ctypes

    from engine import prewarm

    def no_lib(name: str) -> Any:
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_lib)
    assert prewarm.driver_context() is None
    for codes, calls in [
        ({}, ["cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain"]),
        ({"cuInit": 100}, ["cuInit"]),  # CUDA_ERROR_NO_DEVICE
        ({"cuDevicePrimaryCtxRetain": 2}, ["cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain"]),
    ]:
        fake = _FakeDriver(**codes)
        monkeypatch.setattr(ctypes, "CDLL", lambda name, fake=fake: fake)
        got = prewarm.driver_context()
        assert fake.calls == calls
        assert (got is not None and got >= 0) if not codes else got is None
        fake.calls.clear()
        prewarm.release_driver_context()  # gives the retain back where the device answers, else nothing
        released = ["cuInit"] if "cuInit" in codes else ["cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRelease"]
        assert fake.calls == released
    monkeypatch.setattr(ctypes, "CDLL", no_lib)
    prewarm.release_driver_context()  # no driver: nothing raised


@pytest.mark.timeout(120)
def test_the_header_is_handed_over_while_the_tokenizer_is_still_being_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon's plan gets the early header before the tokenizer is built; the model joins the
    tokenizer after its weights (its load phases say so), and a tokenizer that fails to build
    leaves no early model but the reason, and nothing of the model alive without a collection."""
    import threading

    from engine.errors import ModelFormatError
    from engine.options import EngineOptions
    from engine.prewarm import EarlyLoad, start_prewarm
    from engine.tokenizer import Tokenizer

    release, building = threading.Event(), threading.Event()
    build = Tokenizer.from_gguf.__func__  # type: ignore[attr-defined]

    def held(cls: type[Tokenizer], gf: Any) -> Tokenizer:
        building.set()
        assert release.wait(20)  # the old order (header after the tokenizer) deadlocks here
        return build(cls, gf)  # type: ignore[no-any-return]

    monkeypatch.setattr(Tokenizer, "from_gguf", classmethod(held))
    path = str(require(SMOLLM2))
    options = EngineOptions(prefill_chunk=16)
    rec = start_prewarm("numpy", options, EarlyLoad(path, 256, "f16", None, budget_bytes=4 << 30))
    assert building.wait(60)
    header = rec.header(path)  # returns while the tokenizer is held
    assert header is not None and not release.is_set()
    release.set()
    model = rec.take("numpy", options, path, 256, "f16", None)
    assert model is not None and model.tokenizer.n_vocab == len(header.get("tokenizer.ggml.tokens"))
    phases = list(model.load_phases)
    assert phases.index("weights_kv") < phases.index("tokenizer") < phases.index("template")

    def broken(cls: type[Tokenizer], gf: Any) -> Tokenizer:
        raise ModelFormatError(gf.path, "tokenizer.ggml.tokens", "made unreadable by the test")

    monkeypatch.setattr(Tokenizer, "from_gguf", classmethod(broken))
    import gc

    from engine.model import Transformer

    def alive() -> int:
        return sum(isinstance(o, Transformer) for o in gc.get_objects())

    gc.collect()
    before = alive()
    gc.disable()  # as during the daemon's start: what the failed load left must go without a collection
    try:
        failed = start_prewarm("numpy", options, EarlyLoad(path, 256, "f16", None, budget_bytes=4 << 30))
        assert failed.done.wait(60) and failed.model is None
        assert failed.skipped is not None and "made unreadable by the test" in failed.skipped
        assert alive() == before, "the failed load's weights are still held"
    finally:
        gc.enable()


def test_the_drivers_context_is_given_back_when_the_prewarm_ends_off_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """The context made for a CUDA prewarm is released when the backend turns out not to be CuPy,
    kept when it is, and its creation time is known once the prewarm is done."""
    from engine import prewarm
    from engine.options import EngineOptions

    released: list[int] = []
    monkeypatch.setattr(prewarm, "driver_context", lambda ordinal=0: 0.25)
    monkeypatch.setattr(prewarm, "release_driver_context", lambda ordinal=0: released.append(ordinal))
    for resolved, want in (("native", [0]), ("cupy", [])):
        released.clear()
        monkeypatch.setattr(prewarm, "prewarm", lambda backend, options=None, r=resolved: r)
        rec = prewarm.start_prewarm("cupy", EngineOptions())
        assert rec.done.wait(60)
        assert rec.backend == resolved and rec.context_s == 0.25 and released == want
    rec = prewarm.start_prewarm("numpy", EngineOptions())  # no context asked for
    assert rec.done.wait(60) and rec.context_s is None
