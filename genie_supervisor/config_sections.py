"""The daemon config's sections that stand alone: logging, HTTP, MQTT, engine, models, API, policy, telemetry
(the forwarding backends' sections are in `genie_supervisor.config_backends`).

Each is a pydantic model that refuses unknown keys (`_Section`); `parse_hostport` is the one
``HOST:PORT`` parser the sections, the watchers and the app share, and `read_key_file` reads the
API key file an `ApiConfig` names. `genie_supervisor.config` assembles these into `Config` and
re-exports every public name, so importers keep using that module.
"""

from __future__ import annotations

import os
import re
from typing import Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    field_validator,
    model_validator,
)

from .urls import redact_url
from .yamlsrc import KeyedValueError

_HOSTPORT = re.compile(r"^(?:tcp://)?(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")


def parse_hostport(value: str) -> tuple[str, int]:
    """``host:port`` (optionally ``tcp://host:port``, ``[v6]:port``) -> (host, port); ValueError if not."""
    m = _HOSTPORT.match(value.strip())
    if not m or not 0 < int(m.group(2)) < 65536:
        raise ValueError(f"expected HOST:PORT with a port 1-65535, got {value!r}")
    return m.group(1).strip("[]"), int(m.group(2))


def _hostport(value: str) -> str:
    parse_hostport(value)
    return value


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LogConfig(_Section):
    """Logging."""

    level: Literal["debug", "info", "warning", "error"] = Field("info", description="lowest level written")
    format: Literal["auto", "json", "console"] = Field(
        "auto", description="json lines, pretty console, or auto (console on a terminal, json otherwise)"
    )


class HttpConfig(_Section):
    """The HTTP API."""

    listen: str = Field("127.0.0.1:8080", description="HOST:PORT the API listens on")
    cors_origins: list[str] = Field(
        default_factory=list,
        description='browser origins (scheme://host[:port]) allowed to call the API cross-origin; "*" allows any (never with credentials); none by default',
    )
    allowed_hosts: list[str] = Field(
        default_factory=list,
        description='extra Host header names accepted (LAN names the API is reached by); "*" accepts any; loopback names, IP addresses and the listen host are always accepted',
    )

    _v = field_validator("listen")(classmethod(lambda cls, v: _hostport(v)))

    @field_validator("cors_origins")
    @classmethod
    def _origins(cls, origins: list[str]) -> list[str]:
        out = []
        for origin in origins:
            norm = origin.strip().rstrip("/").lower()
            parts = urlsplit(norm)
            if norm != "*" and (
                parts.scheme not in ("http", "https")
                or not parts.hostname
                or parts.path
                or parts.query
                or parts.fragment
                or parts.username is not None
            ):
                raise ValueError(f'expected an origin like http://HOST[:PORT] (no path) or "*", got {origin!r}')
            out.append(norm)
        return out

    @field_validator("allowed_hosts")
    @classmethod
    def _hosts(cls, hosts: list[str]) -> list[str]:
        for host in hosts:
            if host != "*" and not re.fullmatch(r"[A-Za-z0-9_.-]+|\[[0-9A-Fa-f:.]+\]|[0-9A-Fa-f:.]+", host):
                raise ValueError(f'expected a host name or IP address without port or scheme, or "*", got {host!r}')
        return [h.strip("[]").lower() for h in hosts]


class MqttConfig(_Section):
    """The MQTT connection and Home Assistant discovery."""

    url: str | None = Field(None, description="broker URL mqtt://HOST:PORT or mqtts://HOST:PORT; null disables MQTT")
    username: str | None = Field(None, description="broker user name")
    password: str | None = Field(None, description="broker password")
    tls: bool = Field(False, description="use TLS (implied by mqtts://)")
    client_id: str | None = Field(None, description="MQTT client id (default genie-<node_id>)")
    discovery_prefix: str = Field("homeassistant", min_length=1, description="Home Assistant discovery prefix")
    base_topic: str = Field("genie", min_length=1, description="state topics live under <base_topic>/<node_id>/")
    per_entity_discovery: bool = Field(
        False, description="one discovery message per entity instead of one device message"
    )
    publish_interval_s: float = Field(
        5.0, gt=0, le=3600, description="how often state is published (changes go out at once)"
    )
    keepalive: int = Field(
        10,
        ge=5,
        le=3600,
        description="MQTT keepalive in seconds; the broker publishes the offline will 1.5 x this after the daemon goes silent",
    )
    protocol: Literal["3.1.1", "5"] = Field("3.1.1", description="MQTT protocol version")
    ca_file: str | None = Field(None, description="CA certificate file for TLS (default: the system's CAs)")
    cert_file: str | None = Field(None, description="client certificate file for TLS client authentication")
    key_file: str | None = Field(None, description="private key of cert_file")
    reconnect_max_s: float = Field(
        10.0, ge=0.5, le=300, description="longest wait between reconnection attempts (back-off starts at 0.5 s)"
    )
    startup_wait_s: float = Field(
        3.0,
        ge=0,
        le=60,
        description="how long the daemon's start waits for a first broker connection before going on without it",
    )

    @field_validator("url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        if v is None:
            return v
        parts = urlsplit(v)
        if parts.scheme not in ("mqtt", "mqtts") or not parts.hostname:
            raise ValueError(f"expected mqtt://HOST[:PORT] or mqtts://HOST[:PORT], got {redact_url(v)!r}")
        try:
            parts.port  # noqa: B018 - raises on a bad port
        except ValueError as exc:
            raise ValueError(f"bad port in {redact_url(v)!r}") from exc
        return v

    @model_validator(mode="after")
    def _tls_files(self) -> MqttConfig:
        secure = self.tls or (self.url or "").startswith("mqtts://")
        for key in ("ca_file", "cert_file", "key_file"):
            if getattr(self, key) is not None and not secure:
                raise KeyedValueError(key, f"{key} is only used with TLS: set mqtt.tls: true or use an mqtts:// URL")
        if self.key_file is not None and self.cert_file is None:
            raise KeyedValueError("key_file", "key_file is the private key of cert_file: set cert_file too")
        return self


class EngineConfig(_Section):
    """The built-in LLM engine."""

    model: str | None = Field(None, description="GGUF model path (relative to this file); null runs without an LLM")
    backend: Literal["auto", "numpy", "native", "cupy"] = Field(
        "auto", description="compute backend (auto: cupy when CUDA works, else the native CPU kernels, else numpy)"
    )
    n_ctx: int = Field(4096, ge=128, le=1_048_576, description="context length the KV cache is sized for (tokens)")
    kv_dtype: Literal["f16", "int8"] = Field("f16", description="KV cache element type")
    threads: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="CPU threads of the native CPU kernels (default: $GENIE_THREADS, else all cores)",
    )
    kernel_cache_dir: str | None = Field(
        None,
        description="where compiled kernels are kept across restarts (default: $CACHE_DIRECTORY/kernels "
        "under systemd, else ~/.cache/genie-supervisor/kernels)",
    )
    prewarm: bool = Field(
        True,
        description="at process start, create the CUDA context and load the kernels in a thread while the "
        "daemon starts (builtin backend)",
    )


BackendName = Literal["builtin", "llama_cpp", "openai"]


class ModelEntry(_Section):
    """One model clients can ask for by its id (the key under `models`) or one of its roles."""

    path: str | None = Field(
        None,
        description="GGUF file (relative to this file); may be null for a llama_cpp model attached by URL and an openai model",
    )
    roles: list[str] = Field(
        default_factory=list, description="other names clients may put in `model` (e.g. voice, brain)"
    )
    resident: bool = Field(False, description="load at startup and never evict")
    preload: bool = Field(
        False,
        description="load at startup (ready waits for it; a failure is logged, the start goes on) but, unlike "
        "resident, it may be swapped out (a swap group's first member loaded at the start)",
    )
    group: str | None = Field(None, description="swap group: at most one member of a group is loaded at a time")
    n_ctx: int | None = Field(
        None, ge=128, le=1_048_576, description="context length (default engine.n_ctx); never shrunk to fit"
    )
    kv_dtype: Literal["f16", "int8"] | None = Field(None, description="KV cache element type (default engine.kv_dtype)")
    backend: BackendName | None = Field(
        None, description="backend serving this model (default: the top-level `backend`)"
    )
    priority: int = Field(0, ge=-1000, le=1000, description="eviction order: lower is evicted first")
    ttl_s: float | None = Field(
        None, gt=0, le=86400 * 7, description="unload after this long idle (non-resident only); null keeps it"
    )
    remote_model: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        description="backend openai: the model name sent to the remote server (null: this model's id, passed through)",
    )
    fallback_model: str | None = Field(
        None,
        min_length=1,
        description="backend openai: id or role of a local model that answers while the remote is unreachable",
    )

    @model_validator(mode="after")
    def _check(self) -> ModelEntry:
        if self.resident and self.group is not None:
            raise KeyedValueError("group", "a resident model cannot be in a swap group (it is never unloaded)")
        if self.resident and self.preload:
            raise KeyedValueError("preload", "a resident model is loaded at startup anyway: set one of the two")
        if self.resident and self.ttl_s is not None:
            raise KeyedValueError("ttl_s", "a resident model is never unloaded, so it takes no ttl_s")
        return self


class ApiConfig(_Section):
    """Limits of the OpenAI-compatible API, and its key."""

    max_running: int = Field(
        2, ge=1, le=256, description="requests generating at once (the engine runs one per model at a time)"
    )
    max_queue: int = Field(
        16, ge=0, le=10000, description="requests waiting for a slot, all classes together; more get 429"
    )
    max_body_bytes: int = Field(
        1_048_576, ge=1024, le=256 * 1_048_576, description="request bodies larger than this get 413"
    )
    load_wait_s: float = Field(
        120, gt=0, le=3600, description="how long a request waits for its model to load or swap in"
    )
    drain_timeout_s: float = Field(
        120, gt=0, le=3600, description="how long a swap waits for running requests of the model it evicts"
    )
    shutdown_timeout_s: float = Field(
        5.0,
        ge=1,
        le=300,
        description="SIGTERM/SIGINT: the process is gone within this (generations cut at their next step, HTTP drained; a worker thread stuck in one long call is left behind by a forced exit)",
    )
    default_max_tokens: int = Field(256, ge=1, le=1_048_576, description="max_tokens of requests that name none")
    unknown_model: Literal["default", "error"] = Field(
        "default",
        description="a generation request naming an unknown model: default = served by the model when the daemon "
        "serves exactly one (as llama-server), error = 404; with several models always 404",
    )
    warmup: bool = Field(
        True, description="after start, time a one-token request per resident model (the first-reply banner)"
    )
    api_key: SecretStr | None = Field(
        None,
        description="key every HTTP route but /health asks for (Authorization: Bearer KEY or x-api-key: KEY); null: no key",
    )
    api_key_file: str | None = Field(
        None,
        description="file holding the key (trailing newline stripped; $VARS expanded, e.g. ${CREDENTIALS_DIRECTORY}/api-key); read at start",
    )
    metrics_public: bool = Field(False, description="serve GET /metrics without the key (for a Prometheus scraper)")

    _key: str | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _read_key(self) -> ApiConfig:
        if self.api_key is not None and self.api_key_file is not None:
            raise KeyedValueError("api_key_file", "give api_key or api_key_file, not both")
        if self.api_key is not None:
            self._key = self.api_key.get_secret_value()
            if not self._key.strip():
                raise KeyedValueError("api_key", "the API key is empty (null turns the key off)")
        elif self.api_key_file is not None:
            self._key = read_key_file(self.api_key_file)
        return self

    def key(self) -> str | None:
        """The API key in force (from api_key or api_key_file), or None when none is configured."""
        return self._key


def read_key_file(name: str) -> str:
    """The key in file `name` ($VARS expanded, trailing newline stripped); KeyedValueError naming the file if unusable."""
    unset = [v for v in re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", name) if v not in os.environ]
    if unset:
        raise KeyedValueError(
            "api_key_file",
            f"{name}: ${unset[0]} is not set (systemd sets $CREDENTIALS_DIRECTORY only with LoadCredential=)",
        )
    path = os.path.expandvars(name)
    try:
        with open(path, "rb") as f:  # bounded: a key is short, /dev/zero must not fill memory
            raw = f.read(4097)
    except OSError as exc:
        raise KeyedValueError("api_key_file", f"cannot read the API key file {path}: {exc.strerror or exc}") from None
    if len(raw) > 4096:
        raise KeyedValueError("api_key_file", f"the API key file {path} is larger than 4096 bytes: not a key")
    try:
        key = raw.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError:
        raise KeyedValueError("api_key_file", f"the API key file {path} is not UTF-8 text") from None
    if not key.strip():
        raise KeyedValueError("api_key_file", f"the API key file {path} is empty")
    return key


class PolicyConfig(_Section):
    """Which policy is in force."""

    path: str | None = Field(None, description="policy YAML (relative to this file); null uses the built-in defaults")
    watch: bool = Field(True, description="reload the policy when its file changes")
    poll_interval_s: float = Field(1.0, gt=0, le=3600, description="how often the policy file is checked")


class SimulatedTelemetry(_Section):
    """Values of the simulated platform (tests, demos)."""

    temps_c: dict[str, float] = Field(
        default_factory=lambda: {"cpu": 45.0, "gpu": 44.0}, description="starting temperature per sensor (°C)"
    )
    mem_total_mb: float = Field(7620, gt=0, description="MemTotal reported (MiB)")
    mem_available_mb: float = Field(5000, ge=0, description="starting MemAvailable (MiB)")
    script: str | None = Field(None, description='JSONL file of timed samples to replay ({"t": s, ...sample fields})')
    loop: bool = Field(False, description="replay the script forever")


class TelemetryConfig(_Section):
    """Platform telemetry."""

    platform: Literal["auto", "jetson", "nvml", "linux", "simulated"] = Field("auto", description="telemetry source")
    interval_s: float = Field(1.0, gt=0, le=600, description="seconds between samples")
    simulated: SimulatedTelemetry = Field(
        default_factory=SimulatedTelemetry, description="settings of the simulated platform"
    )


class VoiceConfig(_Section):
    """Voice hints."""

    hint_timeout_s: float = Field(30.0, gt=0, le=3600, description="an STT/TTS start with no stop expires after this")


class SystemdConfig(_Section):
    """systemd integration (used only when running under systemd)."""

    notify: bool = Field(True, description="send READY=1/STOPPING=1 when NOTIFY_SOCKET is set")
    watchdog: bool = Field(True, description="send WATCHDOG=1 pings when WATCHDOG_USEC is set")


class PromptCacheConfig(_Section):
    """The prompt cache on disk: the K/V of each conversation's system prompt (with tools), per model."""

    enabled: bool = Field(True, description="save stable prompt prefixes to disk and restore them (builtin backend)")
    dir: str | None = Field(
        None,
        description="directory of the cache files (relative to this file); null: $GENIE_PROMPT_CACHE_DIR, else "
        "$CACHE_DIRECTORY/prompt-cache under systemd, else $XDG_CACHE_HOME/genie-supervisor/prompt-cache",
    )
    max_bytes: int = Field(
        2 << 30, ge=0, le=1 << 50, description="bound of the files' total size; the least recently used go first"
    )
    min_tokens: int = Field(
        256, ge=1, le=1_048_576, description="shortest prefix saved or restored (shorter ones prefill fast enough)"
    )


class BoxConfig(_Section):
    """The whole box's memory, as `genie-supervisor doctor` adds it up (estimates, not limits)."""

    memory_mb: float | None = Field(
        None, gt=0, le=16_777_216, description="usable memory of the box in MiB (null: this box's MemTotal)"
    )
    estimates_mb: dict[str, float] = Field(
        default_factory=dict,
        description="what else lives on the box, by name (e.g. os, homeassistant), in MiB; the voice services "
        "count with the policy's memory.reservations unless named here",
    )

    @field_validator("estimates_mb")
    @classmethod
    def _sizes(cls, v: dict[str, float]) -> dict[str, float]:
        for name, mb in v.items():
            if not 0 <= mb <= 16_777_216:
                raise ValueError(f"{name}: {mb} MiB is outside 0..16777216")
        return v
