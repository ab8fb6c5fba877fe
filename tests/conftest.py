"""Fixtures shared by the test files: `broker`, a fresh Mosquitto on a free loopback port."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.broker import MOSQUITTO, Mosquitto


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
