"""The config sections of the backends that forward requests to a server: ``llama_cpp`` (a llama.cpp
``llama-server`` we start or attach to) and ``openai`` (a remote OpenAI-compatible server).

Both take a base URL checked by `_check_http_url` (http(s), a host, a valid port, no credentials: the URL
is logged and shown). `genie_supervisor.config` re-exports these names.
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit

from pydantic import Field, PrivateAttr, SecretStr, model_validator

from .config_sections import _Section
from .urls import redact_url
from .yamlsrc import KeyedValueError


class LlamaCppConfig(_Section):
    """An external llama.cpp `llama-server`: started by us from `binary`, or attached at `url`."""

    binary: str | None = Field(None, description="llama-server executable we start (one process per loaded model)")
    url: str | None = Field(
        None, description="attach to a running llama-server at this base URL instead of starting one"
    )
    host: str = Field("127.0.0.1", description="address the llama-server we start listens on")
    args: list[str] = Field(
        default_factory=list, description="extra llama-server arguments (e.g. [-ngl, '99', -t, '4'])"
    )
    startup_timeout_s: float = Field(
        120, gt=0, le=3600, description="how long a started llama-server may take to answer /health with 200"
    )
    health_interval_s: float = Field(
        5, gt=0, le=3600, description="seconds between health checks of a loaded llama-server"
    )
    request_timeout_s: float = Field(600, gt=0, le=86400, description="deadline of one request to llama-server")
    pause_with_signals: bool = Field(
        False, description="SIGSTOP the llama-server we started while the decode gate is paused, SIGCONT after"
    )

    @model_validator(mode="after")
    def _check(self) -> LlamaCppConfig:
        if self.url is not None:
            _check_http_url(self.url, "http://HOST:PORT")
        return self


def _check_http_url(url: str, expected: str) -> None:
    """KeyedValueError on ``url`` unless `url` is http(s) with a host and a valid port, and no credentials."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise KeyedValueError("url", f"expected {expected}, got {redact_url(url)!r}")
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError:
        raise KeyedValueError("url", f"bad port in {redact_url(url)!r}") from None
    if parts.username is not None:
        raise KeyedValueError(
            "url", "put no credentials in the URL (it is logged and shown); a key goes in api_key or api_key_env"
        )


class OpenAIConfig(_Section):
    """A remote OpenAI-compatible server (vLLM, llama-server, Ollama's /v1, another genie-supervisor): backend openai."""

    url: str | None = Field(
        None, description="base URL of the remote API, as the openai client takes it (http(s)://HOST:PORT/v1)"
    )
    api_key: SecretStr | None = Field(None, description="key sent as Authorization: Bearer KEY (never logged or shown)")
    api_key_env: str | None = Field(
        None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="name of the environment variable holding the key instead",
    )
    connect_timeout_s: float = Field(5.0, gt=0, le=600, description="deadline of a TCP/TLS connection to the remote")
    first_token_timeout_s: float = Field(
        120.0, gt=0, le=3600, description="deadline from sending a request to its first token (504 after)"
    )
    request_timeout_s: float = Field(600.0, gt=0, le=86400, description="deadline of a whole request (504 after)")
    health_interval_s: float = Field(
        5.0, gt=0, le=3600, description="seconds between health probes (GET <url>/models) of the remote"
    )
    forward_priority: bool = Field(
        False,
        description="send each request's class as X-Genie-Priority (a genie-supervisor remote queues it by its own "
        "policy; other servers ignore the header)",
    )
    verify_tls: bool = Field(True, description="check the remote's TLS certificate (https URLs)")
    ca_file: str | None = Field(None, description="CA certificate file the remote's certificate is checked against")

    _key: str | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _check(self) -> OpenAIConfig:
        if self.url is not None:
            _check_http_url(self.url, "http(s)://HOST:PORT/v1")
        if self.api_key is not None and self.api_key_env is not None:
            raise KeyedValueError("api_key_env", "give api_key or api_key_env, not both")
        if self.api_key is not None:
            self._key = self.api_key.get_secret_value()
        elif self.api_key_env is not None:
            self._key = os.environ.get(self.api_key_env)
            if not self._key:
                raise KeyedValueError("api_key_env", f"the environment variable {self.api_key_env} is not set or empty")
        if self.ca_file is not None and not self.verify_tls:
            raise KeyedValueError("ca_file", "ca_file is used to verify TLS: it takes verify_tls: true")
        return self

    def key(self) -> str | None:
        """The remote's API key (from api_key or the api_key_env variable, read at start), or None."""
        return self._key
