"""Errors the engine raises: small, structured, printable without a traceback."""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class ModelFormatError(EngineError):
    """A GGUF file the engine cannot use; `key` names what is wrong (a metadata key, a tensor, ...)."""

    def __init__(self, path: str, key: str, message: str) -> None:
        self.path = path
        self.key = key
        self.message = message
        super().__init__(f"{path}: {key}: {message}")


class TemplateError(EngineError):
    """A chat template that fails to render or tries to escape the sandbox."""


class ContextOverflowError(EngineError):
    """A prompt (plus requested tokens) longer than the context the KV cache was sized for."""

    def __init__(self, needed: int, limit: int) -> None:
        self.needed = needed
        self.limit = limit
        super().__init__(f"{needed} tokens exceed the context of {limit} tokens")
