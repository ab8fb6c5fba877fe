"""Load and validate policy files; watch one for changes and reload it, keeping the last good one.

An invalid file never replaces a valid policy: the watcher keeps the previous policy in force,
logs the error, and exposes it (``last_error``) for /status and MQTT.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import anyio
import structlog
from anyio.abc import TaskStatus

from ..errors import PolicyError, PolicyErrors
from ..yamlsrc import load_yaml, read_source, validate
from .schema import Policy

log = structlog.get_logger(__name__)


def parse_policy(text: str, path: str = "<policy>") -> Policy:
    """Validate policy YAML `text` (named `path` in errors); raises PolicyErrors."""
    data, lines, issues = load_yaml(text, path, PolicyError)
    if issues:
        raise PolicyErrors(issues)
    policy, issues = validate(Policy, data, lines, path, PolicyError)
    if issues or policy is None:
        raise PolicyErrors(issues)
    return policy


def load_policy(path: str | os.PathLike[str]) -> Policy:
    """Read and validate a policy file; raises PolicyErrors (also for a missing file)."""
    name = os.fspath(path)
    try:
        text = read_source(name)
    except (OSError, ValueError) as exc:
        raise PolicyErrors([PolicyError(name, None, "", f"cannot read: {exc}")]) from None
    return parse_policy(text, name)


def _load_guarded(path: str) -> Policy:
    """`load_policy`, with any unexpected failure turned into PolicyErrors (a reload never crashes the daemon)."""
    try:
        return load_policy(path)
    except PolicyErrors:
        raise
    except Exception as exc:  # noqa: BLE001 - a bad file must be reported, never fatal
        log.exception("policy_load_failed", path=path)
        raise PolicyErrors([PolicyError(path, None, "", f"cannot load: {type(exc).__name__}: {exc}")]) from None


Listener = Callable[[Policy, "PolicyErrors | None"], None]


class PolicyWatcher:
    """The policy in force, reloaded when its file changes (polled) or on ``reload()`` (SIGHUP)."""

    def __init__(self, path: str | os.PathLike[str], *, poll_interval_s: float = 1.0) -> None:
        self.path = os.fspath(path)
        """Policy file."""
        self.poll_interval_s = poll_interval_s
        """How often the file's metadata is checked."""
        self.policy: Policy | None = None
        """The policy in force (None until `load()` succeeded)."""
        self.last_error: PolicyErrors | None = None
        """Error of the last (re)load, None if it was clean."""
        self.generation = 0
        """Counts successful loads."""
        self._stamp: tuple[int, int, int] | None = None
        self._listeners: list[Listener] = []

    def add_listener(self, fn: Listener) -> None:
        """Call `fn(policy, error)` after every (re)load attempt, successful or not."""
        self._listeners.append(fn)

    async def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = await anyio.Path(self.path).stat()
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    async def load(self) -> Policy:
        """First load: raises PolicyErrors when the file is invalid (the daemon must not start)."""
        self._stamp = await self._stat()
        policy = await anyio.to_thread.run_sync(_load_guarded, self.path)
        self.policy, self.last_error = policy, None
        self.generation += 1
        self._notify()
        return policy

    async def reload(self) -> bool:
        """Reload now; True if a new policy is in force, False if the file was rejected."""
        self._stamp = await self._stat()
        try:
            policy = await anyio.to_thread.run_sync(_load_guarded, self.path)
        except PolicyErrors as exc:
            self.last_error = exc
            log.error(
                "policy_rejected",
                path=self.path,
                errors=[i.format() for i in exc.issues],
                kept=self.policy.name if self.policy else None,
            )
            self._notify()
            return False
        old = self.policy.name if self.policy else None
        self.policy, self.last_error = policy, None
        self.generation += 1
        log.info("policy_loaded", path=self.path, name=policy.name, previous=old)
        self._notify()
        return True

    async def switch(self, path: str | os.PathLike[str]) -> bool:
        """Put another policy file in force; on a bad file keep the current one (and its path)."""
        new = os.fspath(path)
        try:
            policy = await anyio.to_thread.run_sync(_load_guarded, new)
        except PolicyErrors as exc:
            self.last_error = exc
            log.error(
                "policy_rejected",
                path=new,
                errors=[i.format() for i in exc.issues],
                kept=self.policy.name if self.policy else None,
            )
            self._notify()
            return False
        old = self.policy.name if self.policy else None
        self.path = new
        self._stamp = await self._stat()
        self.policy, self.last_error = policy, None
        self.generation += 1
        log.info("policy_switched", path=new, name=policy.name, previous=old)
        self._notify()
        return True

    def _notify(self) -> None:
        if self.policy is None:
            return
        for fn in self._listeners:
            fn(self.policy, self.last_error)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Poll the file and reload on change (run in the daemon's task group)."""
        if self.policy is None:
            await self.load()
        task_status.started()
        while True:
            await anyio.sleep(self.poll_interval_s)
            stamp = await self._stat()
            if stamp is not None and stamp != self._stamp:
                await self.reload()
