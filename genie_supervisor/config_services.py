"""The daemon config's `services` entries: the neighbours the supervisor watches and their Wyoming proxies.

`ServiceConfig` says what a service is (`kind`), how to find it (`MatchConfig`) and, for Wyoming
STT/TTS, the byte-transparent proxy in front of it (`WyomingProxy`). These models are the one schema
of a watched service: frozen once validated, `genie_supervisor.watchers.build_watchers` takes them as
they are. `genie_supervisor.config` re-exports these names.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from .config_sections import _hostport, _Section, parse_hostport
from .yamlsrc import KeyedValueError


class _Frozen(_Section):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MatchConfig(_Frozen):
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


class WyomingProxy(_Frozen):
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

    @property
    def listen_address(self) -> tuple[str, int]:
        """(host, port) the proxy binds."""
        return parse_hostport(self.listen)

    @property
    def upstream_address(self) -> tuple[str, int]:
        """(host, port) of the real Wyoming server."""
        return parse_hostport(self.upstream)

    @property
    def hold_max_s(self) -> float:
        """`hold_max_ms` in seconds."""
        return self.hold_max_ms / 1000.0


ServiceKind = Literal["wyoming_stt", "wyoming_tts", "process", "http", "dfn", "homeassistant"]


class ServiceConfig(_Frozen):
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

    @property
    def voice_service(self) -> Literal["stt", "tts"] | None:
        """What the service does on the voice path: ``stt``, ``tts`` or None (not a Wyoming service)."""
        return _VOICE_SERVICE.get(self.kind)


_VOICE_SERVICE: dict[str, Literal["stt", "tts"]] = {"wyoming_stt": "stt", "wyoming_tts": "tts"}
