"""Where the tests find the real demo models (fetched by `make test` into the cache) and llama.cpp's
oracle fixtures; a missing one skips the test locally and fails it under CI (`CI=true`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import NoReturn

import pytest

CACHE = Path(os.environ.get("GENIE_MODELS_DIR") or Path.home() / ".cache" / "genie-supervisor" / "models")
SMOLLM2 = CACHE / "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3 = CACHE / "gemma-3-270m-q4_k_m.gguf"
FIXTURES = Path(
    os.environ.get("GENIE_FIXTURES_DIR") or Path(__file__).resolve().parents[1].parent / "shared" / "fixtures"
)
"""llama.cpp's oracle files: $GENIE_FIXTURES_DIR, else ../shared/fixtures beside the checkout."""

MODELS = {"smollm2-135m-q4_1": SMOLLM2, "gemma3-270m-q4_k_m": GEMMA3}


def under_ci() -> bool:
    """Whether the tests run under CI (the environment sets CI=true)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def missing(reason: str) -> NoReturn:
    """Fail the calling test with `reason` under CI, else skip it with `reason`."""
    if under_ci():
        pytest.fail(f"{reason} (CI=true: a missing model or fixture fails the test)", pytrace=False)
    pytest.skip(reason)


def require(path: Path) -> Path:
    """`path` when the model file exists, else `missing` (run `make models`)."""
    if not path.exists():
        missing(f"{path} missing: run `genie-supervisor models fetch`")
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
