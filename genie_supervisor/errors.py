"""Errors the supervisor raises on purpose: small, structured, printable as one line each."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

from engine.errors import cap_text


class SupervisorError(Exception):
    """Base class of every error the supervisor raises on purpose."""

    message_template: ClassVar[str] = "{message}"
    """How the fields of an error that is a dataclass make its message (``str.format`` over them)."""

    def __post_init__(self) -> None:
        """The message of an error that is a dataclass: `message_template` filled in with its fields."""
        super().__init__(self.message_template.format_map(vars(self)))


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


# Errors with fields are dataclasses (eq=False and repr=False keep an exception's identity and repr):
# the generated __init__ takes the fields in order; SupervisorError.__post_init__ makes the message.


# -- requests the supervisor does not serve: each class carries its HTTP answer ----------------


class AdmissionError(SupervisorError):
    """A request the supervisor does not serve now; its attributes are the HTTP error it answers with."""

    status: int = 503
    """HTTP status of the answer."""
    code: str = "unavailable"
    """OpenAI error ``code``: a short machine-readable reason."""
    error_type: str = "server_error"
    """OpenAI error ``type``: ``invalid_request_error`` for a 4xx status, ``server_error`` for a 5xx."""
    param: str | None = None
    """The request field to blame (OpenAI error ``param``), None when no one field is."""
    retry_after: int | None = None
    """Seconds the client should wait before retrying (the ``Retry-After`` header), None for no header."""

    def details(self) -> dict[str, Any]:
        """Fields the error body carries beside OpenAI's four (none by default)."""
        return {}

    def __init_subclass__(cls, *, status: int | None = None, code: str | None = None, **kwargs: Any) -> None:
        """``class X(AdmissionError, status=400, code="..."):`` gives a class its status and code;
        its ``error_type`` follows from the status (as for every class of the family)."""
        super().__init_subclass__(**kwargs)
        cls.status = cls.status if status is None else status
        cls.code = cls.code if code is None else code
        cls.error_type = "invalid_request_error" if cls.status < 500 else "server_error"


class EngineUnavailable(AdmissionError):
    """No model is loaded (none configured, still loading, failed, or shutting down)."""


class RequestRefused(AdmissionError, code="refused"):
    """The policy refuses new requests right now (memory pressure)."""


@dataclass(eq=False, repr=False)
class ContextTooLong(AdmissionError, status=400, code="context_length_exceeded"):
    """Prompt plus max_tokens exceed the context allowed now."""

    needed: int
    """prompt tokens + max_tokens."""
    limit: int
    """The context a new request may use now."""
    why: str
    """What sets the limit (``the model's context``, ``the policy``)."""
    prompt_tokens: int
    """Tokens in the prompt."""

    message_template = "prompt and max_tokens need {needed} tokens but {why} allows {limit}"

    def details(self) -> dict[str, Any]:
        """llama-server's numbers: ``n_prompt_tokens`` and ``n_ctx`` (the context allowed now)."""
        return {"n_prompt_tokens": self.prompt_tokens, "n_ctx": self.limit}


@dataclass(eq=False, repr=False)
class UpstreamContextTooLong(AdmissionError, status=400, code="context_length_exceeded"):
    """llama-server refused a prompt longer than its context (its ``exceed_context_size_error``)."""

    message: str
    """llama-server's message, and where the numbers came from when it did not send them."""
    n_prompt_tokens: int | None
    """Tokens in the prompt (llama-server's count; None when nobody could count them)."""
    n_ctx: int | None
    """llama-server's context (None when unknown)."""

    def details(self) -> dict[str, Any]:
        """The same fields as `ContextTooLong`'s, those known."""
        known = {"n_prompt_tokens": self.n_prompt_tokens, "n_ctx": self.n_ctx}
        return {k: v for k, v in known.items() if v is not None}


@dataclass(eq=False, repr=False)
class QueueFull(AdmissionError, status=429, code="queue_full"):
    """The queue (or this class's share of it) is full: come back after `retry_after` seconds."""

    message: str
    """What is full."""
    retry_after: int
    """Seconds the client should wait before retrying (the Retry-After header)."""


class QueueTimeout(AdmissionError, code="queue_timeout"):
    """A request waited longer than its class's ``max_wait_s``."""


class UnknownPriority(AdmissionError, status=400, code="invalid_priority"):
    """A priority class the policy does not define."""


class BackendUnavailable(AdmissionError, code="backend_unavailable"):
    """A backend cannot serve (binary missing, server not answering, load failed)."""


class UpstreamError(AdmissionError, status=502, code="upstream_error"):
    """llama-server answered a request with an error; its status and message are passed on."""

    def __init__(self, status: int, message: str) -> None:
        self.status = status if 400 <= status < 600 else 502
        self.error_type = "invalid_request_error" if self.status < 500 else "server_error"
        super().__init__(message)


class UnknownModel(AdmissionError, status=404, code="model_not_found"):
    """No model has this id or role."""


@dataclass(eq=False, repr=False)
class ModelTooLarge(AdmissionError, code="insufficient_memory"):
    """A model does not fit the LLM memory budget (even after every allowed eviction)."""

    needed_mb: float
    """What the model needs (MiB)."""
    budget_mb: float
    """The budget (MiB)."""
    message: str
    """The numbers, and what could not be evicted."""


class LlmDisabled(AdmissionError, code="llm_disabled"):
    """The LLM is switched off (MQTT switch or API); requests get 503 until it is switched on."""


@dataclass(eq=False, repr=False)
class BadRequest(AdmissionError, status=400, code="invalid_request"):
    """A request body that is not what the route takes (400, naming the field)."""

    message: str
    """What is wrong with the body."""
    param: str | None = None
    """The offending field (dotted), if one is to blame."""


# -- everything else ------------------------------------------------------------------------


@dataclass(eq=False, repr=False)
class CommandError(SupervisorError):
    """A command payload that is not valid: it is logged and ignored."""

    topic: str
    """Command topic it arrived on."""
    payload: bytes
    """What arrived (for the log)."""
    message: str
    """What is wrong and what was expected."""

    message_template = "{topic}: {message}"


class TelemetryError(SupervisorError):
    """A telemetry source could not produce a sample this time (the sampler logs it and retries)."""


@dataclass(eq=False, repr=False)
class TelemetryUnavailable(TelemetryError):
    """A telemetry source cannot be used on this machine."""

    platform: str
    """The platform that was asked for (``jetson``, ``nvml``, ...)."""
    reason: str
    """Why it cannot be used, in one line."""

    message_template = "telemetry platform {platform!r} is unavailable: {reason}"


class FetchError(RuntimeError):
    """A demo model could not be fetched or did not verify (a CLI error, not a daemon one)."""
