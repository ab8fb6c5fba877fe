"""Where the tests find the real demo models (fetched by `make test` into the cache)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

CACHE = Path(os.environ.get("GENIE_MODELS_DIR") or Path.home() / ".cache" / "genie-supervisor" / "models")
SMOLLM2 = CACHE / "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3 = CACHE / "gemma-3-270m-q4_k_m.gguf"
def _fixtures() -> Path:
    """llama.cpp's oracle files: $GENIE_FIXTURES_DIR, else ../shared/fixtures next to the checkout."""
    env = os.environ.get("GENIE_FIXTURES_DIR")
    if env:
        return Path(env)
    for base in (Path(__file__).resolve().parents[1], Path.cwd()):
        candidate = base.parent / "shared" / "fixtures"
        if candidate.exists():
            return candidate
    return Path("/work/shared/fixtures")


FIXTURES = _fixtures()

MODELS = {"smollm2-135m-q4_1": SMOLLM2, "gemma3-270m-q4_k_m": GEMMA3}


def require(path: Path) -> Path:
    """Skip the calling test when a model file is missing (run `make models`)."""
    if not path.exists():
        pytest.skip(f"{path} missing: run `genie-supervisor models fetch`")
    return path


_LOADED: dict[tuple[str, str], object] = {}


def shared_model(path: Path, backend: str = "auto"):  # type: ignore[no-untyped-def]
    """Load a model once per test session and backend (loading takes seconds).

    "auto" is the CPU default (the native kernels where a C compiler works, else NumPy); its
    results do not depend on prefill chunking, which tests comparing two greedy runs rely on.
    """
    from engine import load_model

    key = str(require(path))
    if (key, backend) not in _LOADED:
        _LOADED[(key, backend)] = load_model(key, backend=backend)
    return _LOADED[(key, backend)]
