"""Chat prompts: the model's own Jinja template (``tokenizer.chat_template``), rendered in a sandbox.

The environment mirrors Hugging Face's ``apply_chat_template`` (trim_blocks, lstrip_blocks,
loop controls, ``raise_exception``, ``strftime_now``, a ``tojson`` that does not HTML-escape) inside
Jinja's ``ImmutableSandboxedEnvironment``, made stricter: reaching for an unsafe attribute
(``__class__``, ``__globals__`` ...) raises at once instead of yielding an undefined value, and
string / list repetition and powers are bounded. Every failure surfaces as `TemplateError`.

Without a template, Gemma models get Gemma's turn format and everything else gets ChatML.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.exceptions import SecurityError
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import TemplateError

MAX_OUTPUT_CHARS = 4_000_000
"""A rendered prompt longer than this is refused (far beyond any context the engine runs)."""
_MAX_REPEAT = 1_000_000
_MAX_EXPONENT = 1_000


class _RaisedByTemplate(Exception):
    """``raise_exception(message)`` called by the template itself."""


def _raise_exception(message: str) -> None:
    raise _RaisedByTemplate(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}`` (HF's assistant-mask marker): renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        body: list[nodes.Node] = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return body


class _ChatSandbox(ImmutableSandboxedEnvironment):
    """Immutable sandbox that raises on unsafe attributes and bounds repetition."""

    intercepted_binops = frozenset(["*", "**"])

    def unsafe_undefined(self, obj: Any, attribute: Any) -> Any:
        raise SecurityError(
            f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is not allowed"
        )

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(count, int):
                    if len(seq) * count > _MAX_REPEAT:
                        raise SecurityError(f"repetition to {len(seq) * count} items is too large")
        if operator == "**" and isinstance(right, (int, float)) and abs(right) > _MAX_EXPONENT:
            raise SecurityError(f"exponent {right} is too large")
        return super().call_binop(context, operator, left, right)


def _make_env() -> _ChatSandbox:
    env = _ChatSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, "jinja2.ext.loopcontrols"],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _make_env()


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    try:
        return _ENV.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(
            f"chat template syntax error at line {exc.lineno}: {exc.message}"
        ) from None
    except SecurityError as exc:
        raise TemplateError(f"chat template blocked by the sandbox: {exc}") from None


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Messages with string roles and string contents (text parts joined with newlines)."""
    if not isinstance(messages, list):
        raise TemplateError(f"messages must be a list, not {type(messages).__name__}")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise TemplateError(f"messages[{i}] must be an object, not {type(msg).__name__}")
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise TemplateError(f"messages[{i}].role must be a non-empty string, got {role!r}")
        if "content" not in msg:
            raise TemplateError(f"messages[{i}].content is missing")
        content = msg["content"]
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text":
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise TemplateError(
                        f"messages[{i}].content[{j}]: only text parts are supported, got {kind!r}"
                    )
                text = part.get("text")
                if not isinstance(text, str):
                    raise TemplateError(f"messages[{i}].content[{j}].text must be a string")
                texts.append(text)
            content = "\n".join(texts)
        elif not isinstance(content, str):
            raise TemplateError(
                f"messages[{i}].content must be a string or a list of text parts, "
                f"not {type(content).__name__}"
            )
        out.append({**msg, "role": role, "content": content})
    return out


def render_chat(
    template: str | None,
    messages: list[dict],
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    arch: str = "",
) -> str:
    """The prompt for `messages`: `template` rendered in the sandbox, or the built-in fallback."""
    msgs = validate_messages(messages)
    if template is None:
        if arch.startswith("gemma"):
            return _gemma_turns(msgs, add_generation_prompt)
        return _chatml(msgs, add_generation_prompt)
    compiled = _compile(template)
    try:
        pieces: list[str] = []
        size = 0
        for piece in compiled.generate(
            messages=msgs,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
        ):
            size += len(piece)
            if size > MAX_OUTPUT_CHARS:
                raise TemplateError(f"chat template output exceeds {MAX_OUTPUT_CHARS} characters")
            pieces.append(piece)
        return "".join(pieces)
    except TemplateError:
        raise
    except _RaisedByTemplate as exc:
        raise TemplateError(f"chat template raised an error: {exc}") from None
    except SecurityError as exc:
        raise TemplateError(f"chat template blocked by the sandbox: {exc}") from None
    except jinja2.TemplateError as exc:
        raise TemplateError(f"chat template failed: {exc}") from None
    except Exception as exc:  # a template can trigger any error in a filter or a test
        raise TemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from None


_ASCII_SPACE = " \t\n\r\v\f"


def _gemma_turns(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    """Gemma's turns; system text goes in front of the next user turn (as llama.cpp's "gemma")."""
    out: list[str] = []
    system = ""
    for msg in messages:
        role = msg["role"]
        content = msg["content"].strip(_ASCII_SPACE)
        if role == "system":
            system += content
            continue
        role = "model" if role == "assistant" else role
        out.append(f"<start_of_turn>{role}\n")
        if system and role != "model":
            out.append(system + "\n\n")
            system = ""
        out.append(content + "<end_of_turn>\n")
    if add_generation_prompt:
        out.append("<start_of_turn>model\n")
    return "".join(out)


def _chatml(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    """ChatML turns: ``<|im_start|>role\\ncontent<|im_end|>\\n``."""
    out = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)
