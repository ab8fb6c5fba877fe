"""The early load started by `genie_supervisor.boot` from the raw config, before the daemon's heavy
imports: the same load the validated config asks for, disowned when it differs, dropped on failure."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

from genie_supervisor import boot
from genie_supervisor.config import load_config
from genie_supervisor.config_sections import EngineConfig
from genie_supervisor.policy.schema import MemoryPolicy, VoicePolicy
from genie_supervisor.startup import _early
from tests.models import SMOLLM2, require

pytestmark = pytest.mark.timeout(120)

HEAVY = ("fastapi", "uvicorn", "pydantic", "aiomqtt", "llguidance", "prometheus_client", "jinja2", "httpx")
"""The daemon's heavy imports, none of which the early load may wait for."""


def test_defaults_are_the_schemas() -> None:
    """The defaults `boot` assumes for what a file leaves out are the config's and policy's own."""
    engine, voice, memory = EngineConfig(), VoicePolicy(), MemoryPolicy()
    assert boot.DEFAULTS == {
        "n_ctx": engine.n_ctx,
        "kv_dtype": engine.kv_dtype,
        "chunk": voice.prefill_chunk_tokens,
        "budget_mb": memory.llm_budget_mb,
    }


CASES = {
    "engine model, defaults": ("engine: {model: m.gguf}\n", None),
    "engine model, policy": (
        "engine: {model: sub/m.gguf, backend: numpy, n_ctx: 2048, kv_dtype: int8, threads: 3}\n"
        "policy: {path: p.yaml}\n",
        "version: 1\nname: p\nvoice: {prefill_chunk_tokens: 32}\nmemory: {llm_budget_mb: 3000}\n",
    ),
    "one resident model": (
        "engine: {n_ctx: 1024}\nmodels:\n  a: {path: a.gguf, resident: true, kv_dtype: int8}\n"
        "  b: {path: b.gguf, roles: [x]}\n",
        None,
    ),
    "a swap group's first member": (
        "models:\n  a: {path: a.gguf, preload: true, group: g, n_ctx: 512}\n"
        "  b: {path: b.gguf, preload: true, group: g, roles: [x]}\n",
        None,
    ),
    "two at the start": (
        "models:\n  a: {path: a.gguf, resident: true}\n  b: {path: b.gguf, resident: true, roles: [x]}\n",
        None,
    ),
    "prewarm off": ("engine: {model: m.gguf, prewarm: false}\n", None),
    "remote backend": ("backend: llama_cpp\nllama_cpp: {url: 'http://127.0.0.1:9'}\n", None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_guess_is_the_validated_configs_early_load(tmp_path: Path, case: str) -> None:
    """What `boot.guess` reads from the raw files is exactly the load `startup._early` derives from
    the validated config and policy (or nothing, where that derives nothing)."""
    config_text, policy_text = CASES[case]
    cfg_path = tmp_path / "supervisor.yaml"
    cfg_path.write_text(config_text)
    if policy_text is not None:
        (tmp_path / "p.yaml").write_text(policy_text)
    g = boot.guess(str(cfg_path), {})
    cfg = load_config(cfg_path)
    early, options = _early(cfg) if cfg.engine.prewarm else (None, None)
    if early is None or options is None:
        assert g is None
        return
    assert g is not None
    assert (g.path, g.n_ctx, g.kv_dtype, g.threads) == (early.path, early.n_ctx, early.kv_dtype, early.threads)
    assert int(g.budget_mb * 1024 * 1024) == early.budget_bytes
    assert g.chunk == options.prefill_chunk and g.backend == cfg.engine.backend


def test_overrides_and_unusual_files(tmp_path: Path) -> None:
    """The command line's --model and --policy count as in the config; a value of another type,
    a ``$VARIABLE`` path or a file that is not YAML gives no guess (the daemon loads as before)."""
    cfg_path = tmp_path / "supervisor.yaml"
    cfg_path.write_text("engine: {model: m.gguf}\n")
    (tmp_path / "p.yaml").write_text("voice: {prefill_chunk_tokens: 8}\n")
    g = boot.guess(str(cfg_path), {"model": "/x/o.gguf", "policy": str(tmp_path / "p.yaml")})
    assert g is not None and g.path == "/x/o.gguf" and g.chunk == 8
    for text in ("engine: {model: m.gguf, n_ctx: big}\n", "engine: {model: ${HOME}/m.gguf}\n", "engine: [\n"):
        cfg_path.write_text(text)
        assert boot.guess(str(cfg_path), {}) is None
    assert boot.guess(str(tmp_path / "missing.yaml"), {}) is None


def test_the_load_thread_starts_before_the_daemons_heavy_imports(tmp_path: Path) -> None:
    """``genie-supervisor run`` starts the prewarm thread before FastAPI, uvicorn, pydantic,
    aiomqtt, llguidance and the rest are imported (the thread's start is observed in a real run)."""
    model = require(SMOLLM2)
    cfg = tmp_path / "supervisor.yaml"
    cfg.write_text(f"engine: {{model: {model}, backend: numpy, n_ctx: 256}}\ntelemetry: {{platform: simulated}}\n")
    probe = textwrap.dedent(
        f"""
        import json, os, sys, threading
        start = threading.Thread.start
        def observed(self):
            if self.name == "engine-prewarm":
                print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]), flush=True)
                os._exit(0)
            start(self)
        threading.Thread.start = observed
        from genie_supervisor.cli import main
        main(["run", "--config", {str(cfg)!r}])
        """
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == []


def _run(code: str) -> dict[str, object]:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90, check=False)
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_an_early_load_the_validated_config_does_not_ask_for_is_disowned(tmp_path: Path) -> None:
    """When the validated config asks for another load than the raw files did (here: another
    context length), `prepare` disowns the early model: no load takes it and it is dropped."""
    model = require(SMOLLM2)
    raw = tmp_path / "raw.yaml"
    raw.write_text(f"engine: {{model: {model}, backend: numpy, n_ctx: 256}}\n")
    real = tmp_path / "real.yaml"
    real.write_text(f"engine: {{model: {model}, backend: numpy, n_ctx: 512}}\n")
    result = _run(
        textwrap.dedent(
            f"""
            import json
            from genie_supervisor import boot, startup
            from genie_supervisor.config import load_config
            assert boot.start({str(raw)!r}, {{}}) is not None
            startup.prepare(load_config({str(real)!r}))
            rec = startup.PREWARM
            rec.done.wait(60)
            taken = [rec.take("numpy", rec.options, {str(model)!r}, n, "f16", None) for n in (256, 512)]
            print(json.dumps({{"disowned": rec.disowned, "model": rec.model is not None,
                              "taken": [t is not None for t in taken]}}))
            """
        )
    )
    assert result["disowned"] and result["model"] is False and result["taken"] == [False, False]


def test_the_same_load_is_kept_for_the_model_manager(tmp_path: Path) -> None:
    """With the raw and validated config alike, the early model waits to be taken (once)."""
    model = require(SMOLLM2)
    cfg = tmp_path / "supervisor.yaml"
    cfg.write_text(f"engine: {{model: {model}, backend: numpy, n_ctx: 256}}\n")
    result = _run(
        textwrap.dedent(
            f"""
            import json
            from genie_supervisor import boot, startup
            from genie_supervisor.config import load_config
            boot.start({str(cfg)!r}, {{}})
            startup.prepare(load_config({str(cfg)!r}))
            rec = startup.PREWARM
            first = startup.take_early("numpy", rec.options, {str(model)!r}, 256, "f16", None)
            again = startup.take_early("numpy", rec.options, {str(model)!r}, 256, "f16", None)
            print(json.dumps({{"disowned": rec.disowned, "first": first is not None and first.info.n_ctx,
                              "again": again is not None}}))
            """
        )
    )
    assert result == {"disowned": None, "first": 256, "again": False}


def test_a_failed_early_load_is_dropped_and_says_why(tmp_path: Path) -> None:
    """An early load that fails (a file that is no GGUF) leaves no model, says why, and no load
    takes anything: the model manager's own load then reports the error where it is handled."""
    from engine.options import EngineOptions
    from engine.prewarm import EarlyLoad, start_prewarm

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all" * 100)
    options = replace(EngineOptions(), prefill_chunk=16)
    rec = start_prewarm("numpy", options, EarlyLoad(str(bad), 256, "f16", None, budget_bytes=1 << 30))
    assert rec.done.wait(60)
    assert rec.model is None and rec.skipped is not None and rec.load_s is None
    assert rec.take("numpy", options, str(bad), 256, "f16", None) is None


def test_start_returns_once_the_thread_has_imported_the_engine(tmp_path: Path) -> None:
    """`boot.start` returns only after the prewarm thread has imported the engine, so the daemon's own
    imports of engine modules cannot race it for Python's module locks (a deadlock seen in a real run)."""
    model = require(SMOLLM2)
    cfg = tmp_path / "supervisor.yaml"
    cfg.write_text(f"engine: {{model: {model}, backend: numpy, n_ctx: 256}}\ntelemetry: {{platform: simulated}}\n")
    code = textwrap.dedent(
        f"""
        import json, sys
        from genie_supervisor import boot
        g = boot.start({str(cfg)!r}, {{}})
        print(json.dumps({{"started": g is not None, "engine": "engine.prewarm" in sys.modules,
                           "errors": boot.import_error}}), flush=True)
        """
    )
    assert _run(code) == {"started": True, "engine": True, "errors": []}
