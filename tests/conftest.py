"""Fixtures shared by the test files: `prompt_cache_dir` (the session's prompt cache, never the
user's), `broker` (a fresh Mosquitto on a free loopback port),
`model_loader` (the shared SmolLM2 as a Supervisor's loader), `smollm2_template`."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.gguf_file import read_gguf
from tests.broker import MOSQUITTO, Mosquitto
from tests.models import SMOLLM2, require, shared_model


@pytest.fixture(scope="session", autouse=True)
def prompt_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Every daemon of the session keeps its prompt cache in a fresh directory
    ($GENIE_PROMPT_CACHE_DIR, inherited by daemon processes), never in the user's cache."""
    path = tmp_path_factory.mktemp("prompt-cache")
    old = os.environ.get("GENIE_PROMPT_CACHE_DIR")
    os.environ["GENIE_PROMPT_CACHE_DIR"] = str(path)
    try:
        yield path
    finally:
        if old is None:
            os.environ.pop("GENIE_PROMPT_CACHE_DIR", None)
        else:
            os.environ["GENIE_PROMPT_CACHE_DIR"] = old


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[Mosquitto]:
    """A fresh Mosquitto without persistence (the test is skipped where the binary is absent)."""
    if MOSQUITTO is None:
        pytest.skip("the mosquitto binary is not installed")
    b = Mosquitto(tmp_path)
    await b.start()
    try:
        yield b
    finally:
        await b.stop()


@pytest.fixture
def model_loader() -> Any:
    """The session's shared SmolLM2 (loaded once), handed to the Supervisor as its loader."""
    model = shared_model(require(SMOLLM2))
    return lambda *_a, **_k: model


@pytest.fixture(scope="module")
def smollm2_template() -> str:
    """SmolLM2's ``tokenizer.chat_template`` from its GGUF."""
    template = read_gguf(require(SMOLLM2)).get("tokenizer.chat_template")
    assert isinstance(template, str)
    return template


# --- CuPy tests -------------------------------------------------------------------------------
@pytest.fixture(params=["exact", "act_quant"])
def act_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """`exact`: llama.cpp's q8 activation rounding off in both backends, so a comparison sees the
    kernels' float error alone. `act_quant`: on (the default); the rounding is chaotic (a 1e-6
    difference flips a rounding, which grows layer by layer to the quantization noise of ~1-2% of
    the logits), so two correct backends agree only as well as that noise allows."""
    if request.param == "exact":
        import engine.model

        monkeypatch.setattr(engine.model, "ACT_QUANT", {})
    return str(request.param)
