"""Errors the engine raises: small, structured, printable without a traceback."""

from __future__ import annotations

QUOTE_CHARS = 200
"""Longest piece of a file's own text (a key, a value) an error message carries."""


def cap_text(text: str, limit: int = QUOTE_CHARS) -> str:
    """`text` cut to `limit` characters, saying how long it was: a file's 50 MB string never floods a log."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class ModelFormatError(EngineError):
    """A GGUF file the engine cannot use; `key` names what is wrong (a metadata key, a tensor, ...)."""

    def __init__(self, path: str, key: str, message: str) -> None:
        self.path = path
        self.key = cap_text(key)
        self.message = cap_text(message, 1000)
        super().__init__(f"{path}: {self.key}: {self.message}")


class TemplateError(EngineError):
    """A chat template that fails to render or tries to escape the sandbox."""


class TemplateBudgetError(TemplateError):
    """A chat template that ran past its render budget; `limit` names which one.

    `limit` is "steps" (loop iterations and calls), "seconds" (wall clock), "chars" (the size of
    the output or of one value it builds) or "depth" (nested macro calls); `value` is the bound.
    """

    def __init__(self, limit: str, value: float, message: str) -> None:
        self.limit = limit
        self.value = value
        super().__init__(message)


class ContextOverflowError(EngineError):
    """A prompt (plus requested tokens) longer than the context the KV cache was sized for."""

    def __init__(self, needed: int, limit: int) -> None:
        self.needed = needed
        self.limit = limit
        super().__init__(f"{needed} tokens exceed the context of {limit} tokens")


class GrammarError(EngineError):
    """A grammar or JSON schema the constraint library rejects, or a bad `logit_bias` entry.

    The message is the library's own (llguidance names the line and column of a grammar);
    `param` names the request field it came from, set by the API layer (e.g.
    ``"response_format.json_schema"``; None until then).
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        self.message = cap_text(message.strip(), 2000)
        self.param = param
        super().__init__(self.message)
