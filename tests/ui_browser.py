"""Debian's Chromium, headless, driven by Playwright's Python package (no browser download): the web page's tests
and the screenshot in docs/ use it.

    with browser() as b:                       # skips (fails under CI=true) when chromium or playwright is missing
        page, errors = open_page(b, url)       # errors: console errors and uncaught exceptions, as they come
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tests.models import missing

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
"""What a root, network-less machine needs (without the networking flags Chromium keeps calling out)."""


def chromium_path() -> str | None:
    """Debian's chromium binary, None when it is not installed (`make system-deps` installs it)."""
    return shutil.which("chromium")


@contextmanager
def browser() -> Iterator[Any]:
    """A headless Chromium with a fresh profile; `missing` (skip, or fail under CI) without chromium or playwright."""
    path = chromium_path()
    if path is None:
        missing("chromium is not installed (Debian: apt-get install chromium; `make system-deps` does it)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing("the playwright package is not installed (pip install -e '.[dev]')")
    with tempfile.TemporaryDirectory(prefix="genie-chromium-") as profile, sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            profile,
            executable_path=path,
            headless=True,
            args=CHROMIUM_FLAGS,
            viewport={"width": 1280, "height": 900},
        )
        try:
            yield context
        finally:
            context.close()


def open_page(context: Any, url: str, *, viewport: dict[str, int] | None = None) -> tuple[Any, list[str]]:
    """A new tab on `url`, and the list its console errors and uncaught exceptions are appended to."""
    page = context.new_page()
    if viewport is not None:
        page.set_viewport_size(viewport)
    errors: list[str] = []
    page.on("console", lambda m: errors.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(f"uncaught: {exc}"))
    page.goto(url)
    return page, errors
