"""The daemon config's `services` entries: the neighbours the supervisor watches and their Wyoming proxies.

`ServiceConfig` says what a service is (`kind`), how to find it (`MatchConfig`) and, for Wyoming
STT/TTS, the byte-transparent proxy in front of it (`WyomingProxy`); `ServiceConfig.watcher_settings`
turns one entry into the plain mapping the watchers take. `genie_supervisor.config` re-exports
these names.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from .config_sections import _hostport, _Section, parse_hostport
from .yamlsrc import KeyedValueError


class MatchConfig(_Section):
    """How a watcher finds a service: any combination; the first that finds something wins."""

    systemd_unit: str | None = Field(None, description="systemd unit name, e.g. wyoming-faster-whisper.service")
    process_name: str | None = Field(None, description="process name (comm)")
    cmdline_pattern: str | None = Field(None, description="regular expression searched in the command line")
    pid_file: str | None = Field(None, description="file holding the process id")
    container: str | None = Field(None, description="Docker/Podman container name")
    cgroup_path: str | None = Field(None, description="cgroup v2 path whose memory/CPU is read")
    health_url: str | None = Field(None, description="URL that answers 2xx while the service is healthy")

    @field_validator("cmdline_pattern")
    @classmethod
    def _regex(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                re.compile(v)
            except re.error as exc:
                raise ValueError(f"not a valid regular expression: {exc}") from exc
        return v


class WyomingProxy(_Section):
    """A byte-transparent Wyoming proxy that tells the supervisor when STT/TTS runs."""

    listen: str = Field(..., description="HOST:PORT clients (Home Assistant) connect to; a bare PORT binds 127.0.0.1")
    upstream: str = Field(..., description="HOST:PORT (or tcp://HOST:PORT) of the real Wyoming server")
    hold_audio_stop_until_parked: bool = Field(
        True, description="hold `audio-stop` until the LLM is parked (bounded by hold_max_ms)"
    )
    hold_max_ms: int = Field(250, ge=0, le=10000, description="longest `audio-stop` is held")
    idle_timeout_s: float = Field(
        90.0,
        ge=1,
        le=3600,
        description="close a connection with no complete client event and no server bytes for this long",
    )
    max_connections: int = Field(32, ge=1, le=1024, description="client connections open at once; more are refused")
    health_interval_s: float = Field(5.0, gt=0, le=600, description="seconds between `describe` probes of the upstream")

    @field_validator("listen", mode="before")
    @classmethod
    def _listen(cls, v: Any) -> Any:
        if isinstance(v, int) or (isinstance(v, str) and v.strip().isdigit()):
            return f"127.0.0.1:{str(v).strip()}"
        return v

    _v = field_validator("listen", "upstream")(classmethod(lambda cls, v: _hostport(v)))


ServiceKind = Literal["wyoming_stt", "wyoming_tts", "process", "http", "dfn", "homeassistant"]


class ServiceConfig(_Section):
    """One neighbour service the supervisor watches."""

    kind: ServiceKind = Field(..., description="what it is; decides the watcher and its signals")
    match: MatchConfig = Field(default_factory=MatchConfig, description="how to find it")
    proxy: WyomingProxy | None = Field(
        None, description="Wyoming proxy in front of it (wyoming_stt / wyoming_tts only)"
    )
    interval_s: float = Field(2.0, gt=0, le=600, description="seconds between checks")
    timeout_s: float = Field(2.0, gt=0, le=60, description="deadline of one health check")
    token: str | None = Field(None, description="bearer token for match.health_url (Home Assistant long-lived token)")
    log_file: str | None = Field(None, description="log file in which DFN underruns are counted (kind dfn)")
    journal_unit: str | None = Field(
        None, description="systemd unit whose journal is followed for DFN underruns (kind dfn)"
    )

    @model_validator(mode="after")
    def _check(self) -> ServiceConfig:
        if self.proxy is not None and not self.kind.startswith("wyoming_"):
            raise KeyedValueError(
                "proxy", f"a proxy only applies to wyoming_stt and wyoming_tts services, not {self.kind}"
            )
        if self.kind in ("http", "homeassistant") and self.match.health_url is None:
            raise KeyedValueError("match", f"a {self.kind} service needs match.health_url")
        if (self.log_file or self.journal_unit) and self.kind != "dfn":
            raise KeyedValueError(
                "log_file" if self.log_file else "journal_unit",
                f"underrun counting only applies to kind dfn, not {self.kind}",
            )
        return self

    def watcher_settings(self, name: str) -> dict[str, Any]:
        """This service as the plain mapping ``watchers.WatcherSettings.from_mapping`` takes."""
        out: dict[str, Any] = {
            "name": name,
            "kind": _WATCHER_KIND[self.kind],
            "interval_s": self.interval_s,
            "timeout_s": self.timeout_s,
        }
        out.update({k: v for k, v in self.match.model_dump().items() if v is not None})
        out.update({k: v for k in ("token", "log_file", "journal_unit") if (v := getattr(self, k)) is not None})
        if self.proxy is not None:
            lhost, lport = parse_hostport(self.proxy.listen)
            uhost, uport = parse_hostport(self.proxy.upstream)
            out["proxy"] = {
                "listen_host": lhost,
                "listen_port": lport,
                "upstream_host": uhost,
                "upstream_port": uport,
                "service": "stt" if self.kind == "wyoming_stt" else "tts",
                "hold_audio_stop_until_parked": self.proxy.hold_audio_stop_until_parked,
                "hold_max_s": self.proxy.hold_max_ms / 1000.0,
                "idle_timeout_s": self.proxy.idle_timeout_s,
                "max_connections": self.proxy.max_connections,
                "health_interval_s": self.proxy.health_interval_s,
            }
        return out


_WATCHER_KIND = {
    "wyoming_stt": "whisper",
    "wyoming_tts": "piper",
    "dfn": "dfn",
    "homeassistant": "homeassistant",
    "process": "generic",
    "http": "generic",
}
