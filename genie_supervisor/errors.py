"""Errors the supervisor raises on purpose: small, structured, printable as one line each."""

from __future__ import annotations

from collections.abc import Iterable

from engine.errors import cap_text


class SupervisorError(Exception):
    """Base class of every error the supervisor raises on purpose."""


class SourceError(SupervisorError):
    """One problem at a place in a YAML file: prints as ``file:line key.path: message``."""

    def __init__(self, path: str, line: int | None, key: str, message: str) -> None:
        key, message = cap_text(key), cap_text(message, 1000)  # a file's own text never floods a log
        self.path = path
        """File the problem is in."""
        self.line = line
        """1-based line of the offending key (None where the file has no such line)."""
        self.key = key
        """Dotted key path, list items as ``[i]`` (empty for file-level problems)."""
        self.message = message
        """What is wrong and what was expected."""
        super().__init__(self.format())

    def format(self) -> str:
        """The canonical one-line form."""
        where = self.path if self.line is None else f"{self.path}:{self.line}"
        return f"{where} {self.key}: {self.message}" if self.key else f"{where}: {self.message}"


class ConfigError(SourceError):
    """A problem in the daemon config file."""


class PolicyError(SourceError):
    """A problem in a policy file."""


class SourceErrors(SupervisorError):
    """Every problem found in one file; ``str()`` is one ``file:line key: message`` per line."""

    def __init__(self, issues: Iterable[SourceError]) -> None:
        self.issues = list(issues)
        """The individual problems, in file order."""
        super().__init__("\n".join(i.format() for i in self.issues))


class ConfigErrors(SourceErrors):
    """All problems of one daemon config file."""

    issues: list[ConfigError]  # type: ignore[assignment]


class PolicyErrors(SourceErrors):
    """All problems of one policy file."""

    issues: list[PolicyError]  # type: ignore[assignment]


class BudgetError(SupervisorError):
    """Something does not fit in the memory it is allowed: says what, how much, and how much there is."""

    def __init__(self, needed_mb: float, available_mb: float, what: str) -> None:
        self.needed_mb = needed_mb
        """Memory the thing needs, in MiB."""
        self.available_mb = available_mb
        """Memory it may use, in MiB."""
        self.what = what
        """What was refused (e.g. ``model smollm2 with n_ctx 8192``)."""
        super().__init__(
            f"{what} needs {needed_mb:.0f} MiB but only {available_mb:.0f} MiB are available"
        )
