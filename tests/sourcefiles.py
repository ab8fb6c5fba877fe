"""Helpers for the tests of YAML files that are reported as file:line errors (config, policy)."""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from genie_supervisor.errors import SourceErrors


def write_dedented(path: Path, text: str) -> str:
    """Write `text`, dedented and without its leading newlines, to `path` and return the path."""
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return str(path)


def errors_of(load: Callable[[str], object], errors: type[SourceErrors], path: str) -> list[str]:
    """The formatted errors that `load(path)` raises as `errors`."""
    with pytest.raises(errors) as exc:
        load(path)
    return [i.format() for i in exc.value.issues]
