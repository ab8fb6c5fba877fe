"""Chat prompts: the model's own Jinja template (``tokenizer.chat_template``), rendered in a sandbox.

The environment mirrors Hugging Face's ``apply_chat_template`` (trim_blocks, lstrip_blocks,
loop controls, ``raise_exception``, ``strftime_now``, a ``tojson`` that does not HTML-escape) inside
Jinja's ``ImmutableSandboxedEnvironment``, made stricter: reaching for an unsafe attribute
(``__class__``, ``__globals__`` ...) raises at once instead of yielding an undefined value, and
string / list repetition and powers are bounded. Every failure surfaces as `TemplateError`.

A GGUF is untrusted input, so a render is also bounded in work (`RenderBudget`), checked inside
the render: the compiled template takes one step per loop iteration (and per loop-filter test)
and per call, checks the clock at every step, bounds macro nesting, and every value it builds
(``+``, ``~``, ``*``, ``%``, ``format``, ``join``, ``replace``, padding, any filter or call result)
and its output are bounded in size. Past a bound the render stops with `TemplateBudgetError`.
`probe_chat_template` renders a small conversation once at load and refuses a template that
cannot (``ModelFormatError`` naming ``tokenizer.chat_template``).

Without a template, Gemma models get Gemma's turn format and everything else gets ChatML.
"""

from __future__ import annotations

from typing import Any

import jinja2
from jinja2.exceptions import SecurityError

from .errors import ModelFormatError, TemplateBudgetError, TemplateError
from .template_sandbox import (
    _ACTIVE,
    MAX_OUTPUT_CHARS,
    PROBE_BUDGET,
    REQUEST_BUDGET,
    RenderBudget,
    _BrokenTemplate,
    _compile,
    _Meter,
    _RaisedByTemplate,
    _RefusedByTemplate,
)

__all__ = [
    "MAX_OUTPUT_CHARS",
    "PROBE_BUDGET",
    "PROBE_CONVERSATIONS",
    "REQUEST_BUDGET",
    "RenderBudget",
    "probe_chat_template",
    "render_chat",
    "validate_messages",
]


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
                    raise TemplateError(f"messages[{i}].content[{j}]: only text parts are supported, got {kind!r}")
                text = part.get("text")
                if not isinstance(text, str):
                    raise TemplateError(f"messages[{i}].content[{j}].text must be a string")
                texts.append(text)
            content = "\n".join(texts)
        elif not isinstance(content, str):
            raise TemplateError(
                f"messages[{i}].content must be a string or a list of text parts, not {type(content).__name__}"
            )
        out.append({**msg, "role": role, "content": content})
    return out


def render_chat(
    template: str | None,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    arch: str = "",
    budget: RenderBudget = REQUEST_BUDGET,
) -> str:
    """The prompt for `messages`: `template` rendered in the sandbox within `budget`, or the
    built-in fallback. Raises TemplateError (TemplateBudgetError past the budget)."""
    msgs = validate_messages(messages)
    if template is None:
        if arch.startswith("gemma"):
            return _gemma_turns(msgs, add_generation_prompt)
        return _chatml(msgs, add_generation_prompt)
    compiled = _compile(template)
    meter = _Meter(budget)
    outer, _ACTIVE.meter = _ACTIVE.meter, meter
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
            if size > budget.chars:
                meter.size(size, "output")
            pieces.append(piece)
        if meter.tripped is not None:  # a filter swallowed the error: the render still failed
            raise meter.tripped
        return "".join(pieces)
    except TemplateError:
        raise
    except _RaisedByTemplate as exc:
        raise _RefusedByTemplate(f"chat template raised an error: {exc}") from None
    except SecurityError as exc:
        raise _BrokenTemplate(f"chat template blocked by the sandbox: {exc}") from None
    except jinja2.TemplateError as exc:
        raise TemplateError(f"chat template failed: {exc}") from None
    except RecursionError:
        raise TemplateBudgetError("depth", budget.depth, "chat template recursed too deeply") from None
    except Exception as exc:  # a template can trigger any error in a filter or a test
        raise TemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from None
    finally:
        _ACTIVE.meter = outer


PROBE_CONVERSATIONS: tuple[tuple[dict[str, str], ...], ...] = (
    (
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Hi! How can I help?"},
        {"role": "user", "content": "What time is it?"},
    ),
    (
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Hi! How can I help?"},
        {"role": "user", "content": "What time is it?"},
    ),
    ({"role": "user", "content": "Hello!"},),
)
"""What the load-time probe renders, in order, until one renders: with a system turn first, then
without (some templates refuse a system role), then a single user turn."""


def probe_chat_template(
    template: str,
    *,
    path: str,
    bos_token: str = "",
    eos_token: str = "",
    budget: RenderBudget = PROBE_BUDGET,
) -> None:
    """Render PROBE_CONVERSATIONS with `template` within `budget`; raise ModelFormatError(path,
    "tokenizer.chat_template") when it exceeds the budget, escapes the sandbox or does not parse,
    or when it fails on every conversation. A template that refuses only some of them (its own
    ``raise_exception`` for a system role, say) passes."""
    key = "tokenizer.chat_template"
    failure: TemplateError | None = None
    for conversation in PROBE_CONVERSATIONS:
        try:
            render_chat(
                template,
                [dict(m) for m in conversation],
                add_generation_prompt=True,
                bos_token=bos_token,
                eos_token=eos_token,
                budget=budget,
            )
            return
        except TemplateBudgetError as exc:
            raise ModelFormatError(path, key, f"{exc} (probe at load: a {len(conversation)}-message chat)") from None
        except _BrokenTemplate as exc:
            raise ModelFormatError(path, key, str(exc)) from None
        except TemplateError as exc:  # its own raise_exception, or a runtime error: try the next
            failure = failure or exc
    raise ModelFormatError(path, key, f"{failure} (on every probe conversation at load)")


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
