"""Home Assistant: container (or cgroup) memory plus the ``/api/`` health route."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .base import Probe, Publish, ServiceWatcher
from .cgroup import CgroupProbe
from .http_health import HttpHealthProbe

DEFAULT_URL = "http://127.0.0.1:8123/api/"


def homeassistant_probes(
    *,
    container: str | None = None,
    cgroup_path: str | Path | None = None,
    health_url: str | None = DEFAULT_URL,
    token: str | None = None,
    timeout_s: float = 2.0,
    cgroup_root: str | Path = "/sys/fs/cgroup",
    proc_root: str | Path = "/proc",
) -> list[Probe]:
    """The probes for Home Assistant: cgroup memory when located, HTTP health when a URL is set."""
    probes: list[Probe] = []
    if container is not None or cgroup_path is not None:
        probes.append(
            CgroupProbe(
                cgroup_path=cgroup_path,
                container=None if cgroup_path is not None else container,
                cgroup_root=cgroup_root,
                proc_root=proc_root,
            )
        )
    if health_url:
        probes.append(HttpHealthProbe(health_url, token=token, timeout_s=timeout_s))
    return probes


def build_homeassistant(
    publish: Publish, *, name: str = "homeassistant", interval_s: float = 5.0, **options: Any
) -> ServiceWatcher:
    """A ServiceWatcher for Home Assistant (options as for `homeassistant_probes`)."""
    return ServiceWatcher(
        name,
        homeassistant_probes(**options),
        publish,
        interval_s=interval_s,
    )
