"""The daemon's config file (YAML): validated, unknown keys refused, errors as file:line.

``load_config(path, overrides)`` reads the file (or starts from defaults when `path` is None),
applies the CLI flags (``--model``, ``--policy``, ``--mqtt``, ``--listen``, ``--platform``),
and resolves relative paths against the config file's folder.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator, model_validator

from .config_backends import LlamaCppConfig, OpenAIConfig
from .config_sections import (
    ApiConfig,
    BackendName,
    BoxConfig,
    EngineConfig,
    HttpConfig,
    LogConfig,
    ModelEntry,
    MqttConfig,
    PolicyConfig,
    PromptCacheConfig,
    SimulatedTelemetry,
    SystemdConfig,
    TelemetryConfig,
    VoiceConfig,
    _Section,
    parse_hostport,
    read_key_file,
)
from .config_services import MatchConfig, ServiceConfig, ServiceKind, WyomingProxy
from .errors import ConfigError, ConfigErrors
from .yamlsrc import KeyedValueError, LineMap, load_yaml, read_source, validate

__all__ = [
    "ApiConfig",
    "BackendName",
    "Config",
    "EngineConfig",
    "HttpConfig",
    "LlamaCppConfig",
    "LogConfig",
    "MatchConfig",
    "ModelEntry",
    "MqttConfig",
    "OpenAIConfig",
    "PolicyConfig",
    "PromptCacheConfig",
    "ServiceConfig",
    "ServiceKind",
    "SimulatedTelemetry",
    "SystemdConfig",
    "TelemetryConfig",
    "VoiceConfig",
    "WyomingProxy",
    "load_config",
    "parse_hostport",
    "read_key_file",
]


class Config(_Section):
    """The whole daemon config."""

    node_id: str = Field("genie", pattern=r"^[a-z0-9_-]{1,64}$", description="this box's id in MQTT topics")
    log: LogConfig = Field(default_factory=LogConfig, description="logging")
    http: HttpConfig = Field(default_factory=HttpConfig, description="HTTP API")
    mqtt: MqttConfig = Field(default_factory=MqttConfig, description="MQTT")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="built-in LLM engine")
    backend: BackendName = Field(
        "builtin",
        description="what serves the models: builtin (this process), llama_cpp (llama-server) or openai (a remote server)",
    )
    fallback: BackendName | None = Field(
        None,
        description="backend used when `backend` cannot start a model (missing binary, model refused by the memory plan)",
    )
    llama_cpp: LlamaCppConfig = Field(default_factory=LlamaCppConfig, description="the llama_cpp backend")
    openai: OpenAIConfig = Field(default_factory=OpenAIConfig, description="the openai backend (a remote server)")
    prompt_cache: PromptCacheConfig = Field(default_factory=PromptCacheConfig, description="prompt cache on disk")
    models: dict[str, ModelEntry] = Field(
        default_factory=dict, description="models by id; empty: engine.model is the one model"
    )
    api: ApiConfig = Field(default_factory=ApiConfig, description="OpenAI-compatible API limits and key")
    policy: PolicyConfig = Field(default_factory=PolicyConfig, description="policy")
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig, description="platform telemetry")
    services: dict[str, ServiceConfig] = Field(default_factory=dict, description="watched services by name")
    voice: VoiceConfig = Field(default_factory=VoiceConfig, description="voice hints")
    systemd: SystemdConfig = Field(default_factory=SystemdConfig, description="systemd integration")
    box: BoxConfig = Field(default_factory=BoxConfig, description="the box's memory, as doctor accounts it")

    @field_validator("services")
    @classmethod
    def _names(cls, services: dict[str, ServiceConfig]) -> dict[str, ServiceConfig]:
        for name in services:
            if not re.fullmatch(r"[a-z0-9_-]{1,64}", name):
                raise KeyedValueError(name, f"service name {name!r} must be 1-64 of a-z, 0-9, _ and -")
        return services

    @model_validator(mode="after")
    def _models(self) -> Config:
        seen: dict[str, str] = {}
        for mid, entry in self.models.items():
            for name in (mid, *entry.roles):
                if name in seen and seen[name] != mid:
                    raise KeyedValueError(("models", mid), f"name {name!r} is already used by model {seen[name]!r}")
                seen[name] = mid
            backend = entry.backend or self.backend
            if entry.path is None and not (backend == "llama_cpp" and self.llama_cpp.url) and backend != "openai":
                raise KeyedValueError(
                    ("models", mid, "path"),
                    "a model needs a path (only an openai model or a llama_cpp model attached by llama_cpp.url may omit it)",
                )
        self._remote_models()
        uses_llama = (
            self.backend == "llama_cpp"
            or self.fallback == "llama_cpp"
            or any(e.backend == "llama_cpp" for e in self.models.values())
        )
        if uses_llama and not (self.llama_cpp.binary or self.llama_cpp.url):
            raise KeyedValueError("llama_cpp", "the llama_cpp backend needs llama_cpp.binary or llama_cpp.url")
        return self

    def _remote_models(self) -> None:
        """openai models: the section has a URL; a fallback names a local model; no openai-only keys elsewhere."""
        entries = self.model_entries()
        users = [mid for mid, e in entries.items() if (e.backend or self.backend) == "openai"]
        if (users or self.fallback == "openai") and not self.openai.url:
            where: Any = (
                ("models", users[0], "backend") if users and self.models else ("backend" if users else "fallback")
            )
            raise KeyedValueError(where, "the openai backend needs openai.url (the remote's base URL)")
        names = {name: mid for mid, e in entries.items() for name in (mid, *e.roles)}
        for mid, entry in entries.items():
            remote = (entry.backend or self.backend) == "openai"
            for key in ("remote_model", "fallback_model"):
                if getattr(entry, key) is not None and not remote:
                    raise KeyedValueError(("models", mid, key), f"{key} only applies to a model with backend openai")
            target = names.get(entry.fallback_model or "")
            if entry.fallback_model is not None and target is None:
                raise KeyedValueError(
                    ("models", mid, "fallback_model"), f"no model has the id or role {entry.fallback_model!r}"
                )
            if target is not None and (entries[target].backend or self.backend) == "openai":
                raise KeyedValueError(
                    ("models", mid, "fallback_model"), f"the fallback {entry.fallback_model!r} must be a local model"
                )

    def model_entries(self) -> dict[str, ModelEntry]:
        """The models to serve: `models`, or `engine.model` as one resident model (id: the file's stem)."""
        if self.models:
            return dict(self.models)
        remote = self.backend == "openai" or (self.backend == "llama_cpp" and self.llama_cpp.url)
        if self.engine.model is None and not remote:
            return {}
        path = self.engine.model
        mid = Path(path).stem if path else "default"
        return {mid: ModelEntry(path=path, roles=["default"], resident=True)}

    def stt_services(self) -> list[str]:
        """Names of the services of kind wyoming_stt (the policy's failsafe.stt_unknown watches them)."""
        return [name for name, svc in self.services.items() if svc.kind == "wyoming_stt"]


_OVERRIDES = {
    "model": ("engine", "model"),
    "policy": ("policy", "path"),
    "mqtt": ("mqtt", "url"),
    "listen": ("http", "listen"),
    "platform": ("telemetry", "platform"),
}


def load_config(path: str | os.PathLike[str] | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Read the config (defaults when `path` is None), apply CLI overrides; raises ConfigErrors."""
    name = os.fspath(path) if path is not None else "<defaults>"
    data: Any = {}
    lines = LineMap()
    if path is not None:
        try:
            text = read_source(name)
        except (OSError, ValueError) as exc:
            raise ConfigErrors([ConfigError(name, None, "", f"cannot read: {exc}")]) from None
        data, lines, issues = load_yaml(text, name, ConfigError)
        if issues:
            raise ConfigErrors(issues)
        data = {} if data is None else data
        if isinstance(data, dict):
            _resolve_paths(data, Path(name).parent)
    if isinstance(data, dict):
        for flag, value in (overrides or {}).items():
            if value is None:
                continue
            if flag not in _OVERRIDES:
                raise ValueError(f"unknown override {flag!r}")
            section, key = _OVERRIDES[flag]
            if not isinstance(data.get(section), dict):
                data[section] = {}
            data[section][key] = value
    config, issues = validate(Config, data, lines, name, ConfigError)
    if issues or config is None:
        raise ConfigErrors(issues)
    return config


def _resolve_paths(data: dict[str, Any], base: Path) -> None:
    for section, key in (
        ("engine", "model"),
        ("policy", "path"),
        ("llama_cpp", "binary"),
        ("api", "api_key_file"),
        ("openai", "ca_file"),
        ("mqtt", "ca_file"),
        ("mqtt", "cert_file"),
        ("mqtt", "key_file"),
        ("prompt_cache", "dir"),
    ):
        sec = data.get(section)
        if (
            isinstance(sec, dict)
            and isinstance(sec.get(key), str)
            and not os.path.isabs(sec[key])
            and not sec[key].startswith("$")
        ):  # ${CREDENTIALS_DIRECTORY}/... is expanded later
            if section != "llama_cpp" or "/" in sec[key]:  # a bare binary name is looked up on PATH
                sec[key] = str(base / sec[key])
    models = data.get("models")
    if isinstance(models, dict):
        for entry in models.values():
            if isinstance(entry, dict) and isinstance(entry.get("path"), str) and not os.path.isabs(entry["path"]):
                entry["path"] = str(base / entry["path"])
    sim = (data.get("telemetry") or {}).get("simulated") if isinstance(data.get("telemetry"), dict) else None
    if isinstance(sim, dict) and isinstance(sim.get("script"), str) and not os.path.isabs(sim["script"]):
        sim["script"] = str(base / sim["script"])
