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
        super().__init__(f"{what} needs {needed_mb:.0f} MiB but only {available_mb:.0f} MiB are available")


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


class EngineUnavailable(AdmissionError):
    """No model is loaded (none configured, still loading, failed, or shutting down)."""


class RequestRefused(AdmissionError):
    """The policy refuses new requests right now (memory pressure)."""

    code = "refused"


class ContextTooLong(AdmissionError):
    """Prompt plus max_tokens exceed the context allowed now."""

    status = 400
    code = "context_length_exceeded"
    error_type = "invalid_request_error"

    def __init__(self, needed: int, limit: int, why: str) -> None:
        self.needed = needed
        """prompt tokens + max_tokens."""
        self.limit = limit
        """The context a new request may use now."""
        super().__init__(f"prompt and max_tokens need {needed} tokens but {why} allows {limit}")


class QueueFull(AdmissionError):
    """The queue (or this class's share of it) is full: come back after `retry_after` seconds."""

    status = 429
    code = "queue_full"
    error_type = "invalid_request_error"

    def __init__(self, message: str, retry_after: int) -> None:
        self.retry_after = retry_after
        """Seconds the client should wait before retrying (the Retry-After header)."""
        super().__init__(message)


class QueueTimeout(AdmissionError):
    """A request waited longer than its class's ``max_wait_s``."""

    code = "queue_timeout"


class UnknownPriority(AdmissionError):
    """A priority class the policy does not define."""

    status = 400
    code = "invalid_priority"
    error_type = "invalid_request_error"


class BackendUnavailable(AdmissionError):
    """A backend cannot serve (binary missing, server not answering, load failed)."""

    code = "backend_unavailable"


class UpstreamError(AdmissionError):
    """llama-server answered a request with an error; its status and message are passed on."""

    status = 502
    code = "upstream_error"

    def __init__(self, status: int, message: str) -> None:
        self.status = status if 400 <= status < 600 else 502
        self.error_type = "invalid_request_error" if self.status < 500 else "server_error"
        super().__init__(message)


class UnknownModel(AdmissionError):
    """No model has this id or role."""

    status = 404
    code = "model_not_found"
    error_type = "invalid_request_error"


class ModelTooLarge(AdmissionError):
    """A model does not fit the LLM memory budget (even after every allowed eviction)."""

    status = 503
    code = "insufficient_memory"

    def __init__(self, needed_mb: float, budget_mb: float, message: str) -> None:
        self.needed_mb = needed_mb
        """What the model needs (MiB)."""
        self.budget_mb = budget_mb
        """The budget (MiB)."""
        super().__init__(message)


class LlmDisabled(AdmissionError):
    """The LLM is switched off (MQTT switch or API); requests get 503 until it is switched on."""

    code = "llm_disabled"


class BadRequest(AdmissionError):
    """A request body that is not what the route takes (400, naming the field)."""

    status = 400
    code = "invalid_request"
    error_type = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None) -> None:
        self.param = param
        """The offending field (dotted), if one is to blame."""
        super().__init__(message)


# -- everything else ------------------------------------------------------------------------


class CommandError(SupervisorError):
    """A command payload that is not valid: it is logged and ignored."""

    def __init__(self, topic: str, payload: bytes, message: str) -> None:
        self.topic = topic
        """Command topic it arrived on."""
        self.payload = payload
        """What arrived (for the log)."""
        self.message = message
        """What is wrong and what was expected."""
        super().__init__(f"{topic}: {message}")


class TelemetryError(SupervisorError):
    """A telemetry source could not produce a sample this time (the sampler logs it and retries)."""


class TelemetryUnavailable(TelemetryError):
    """A telemetry source cannot be used on this machine."""

    def __init__(self, platform: str, reason: str) -> None:
        super().__init__(f"telemetry platform {platform!r} is unavailable: {reason}")
        self.platform = platform
        """The platform that was asked for (``jetson``, ``nvml``, ...)."""
        self.reason = reason
        """Why it cannot be used, in one line."""


class FetchError(RuntimeError):
    """A demo model could not be fetched or did not verify (a CLI error, not a daemon one)."""
