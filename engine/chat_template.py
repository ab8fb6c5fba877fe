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

Tools (issue 18): a template that reads ``tools`` gets them as HF passes them; any other template, and the
built-in fallbacks, get `engine.tool_calls.fallback_tools_prompt` in the system message and the tool history
as ``<tool_call>`` / ``<tool_response>`` text (see `render_chat`).
"""

from __future__ import annotations

import json
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
from .tool_calls import fallback_tools_prompt, hermes_call_text, template_supports_tools, validate_tools

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
    """Messages with string roles and string contents (text parts joined with newlines).

    An assistant message may carry ``tool_calls`` (OpenAI's or Ollama's shape; arguments a dict or a JSON
    string, decoded when it holds an object) and then a null or missing content (""); they come out as
    ``{"id"?, "type": "function", "function": {"name", "arguments"}}``. A ``tool`` message has a content
    and optional string ``tool_call_id`` and ``name`` (Ollama's ``tool_name``; else the name of the call it
    answers)."""
    if not isinstance(messages, list):
        raise TemplateError(f"messages must be a list, not {type(messages).__name__}")
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # call id -> function name, to name the tool messages that answer them
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise TemplateError(f"messages[{i}] must be an object, not {type(msg).__name__}")
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise TemplateError(f"messages[{i}].role must be a non-empty string, got {role!r}")
        msg = dict(msg)
        if "tool_calls" in msg:
            calls = _tool_calls(i, msg.pop("tool_calls"))
            if calls:
                msg["tool_calls"] = calls
                if msg.get("content") is None:
                    msg["content"] = ""
                names.update((c["id"], c["function"]["name"]) for c in calls if "id" in c)
        if role == "tool":
            if "name" not in msg and isinstance(msg.get("tool_name"), str):  # Ollama's spelling
                msg["name"] = msg.pop("tool_name")
            if "name" not in msg and msg.get("tool_call_id") in names:  # some templates print message.name
                msg["name"] = names[msg["tool_call_id"]]
        for key in ("tool_call_id", "name"):
            if key in msg and not isinstance(msg[key], str):
                raise TemplateError(f"messages[{i}].{key} must be a string, not {type(msg[key]).__name__}")
        if "content" not in msg:
            raise TemplateError(f"messages[{i}].content is missing")
        out.append({**msg, "role": role, "content": _content(i, msg["content"])})
    return out


def _content(i: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise TemplateError(
            f"messages[{i}].content must be a string or a list of text parts, not {type(content).__name__}"
        )
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise TemplateError(f"messages[{i}].content[{j}]: only text parts are supported, got {kind!r}")
        text = part.get("text")
        if not isinstance(text, str):
            raise TemplateError(f"messages[{i}].content[{j}].text must be a string")
        texts.append(text)
    return "\n".join(texts)


def _tool_calls(i: int, calls: Any) -> list[dict[str, Any]]:
    """An assistant's earlier calls in one shape (an empty list: none)."""
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise TemplateError(f"messages[{i}].tool_calls must be a list, not {type(calls).__name__}")
    out: list[dict[str, Any]] = []
    for j, call in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            raise TemplateError(f"{where}.function must be an object")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise TemplateError(f"{where}.function.name must be a non-empty string, got {name!r}")
        args = fn.get("arguments", {})
        if isinstance(args, str):  # OpenAI's JSON string; kept as it is when it is not an object (llama.cpp too)
            try:
                decoded = json.loads(args) if args.strip() else {}
            except ValueError:
                decoded = None
            args = decoded if isinstance(decoded, dict) else args
        elif not isinstance(args, dict):
            raise TemplateError(f"{where}.function.arguments must be a JSON object, not {type(args).__name__}")
        entry: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": args}}
        if isinstance(call.get("id"), str):
            entry = {"id": call["id"], **entry}
        out.append(entry)
    return out


def render_chat(
    template: str | None,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    arch: str = "",
    budget: RenderBudget = REQUEST_BUDGET,
) -> str:
    """The prompt for `messages`: `template` rendered in the sandbox within `budget`, or the
    built-in fallback. Raises TemplateError (TemplateBudgetError past the budget).

    `tools` (OpenAI's function list) reach a template that reads ``tools`` as that variable, in Hugging
    Face's shape. A template without tool support (and the built-in fallbacks) gets `fallback_tools_prompt`
    merged into the system message (into the first user turn if the template refuses a system role) and
    the tool history as text: earlier calls as ``<tool_call>`` blocks, results as ``<tool_response>``
    blocks in a user turn."""
    msgs = validate_messages(messages)
    tool_list = validate_tools(tools) if tools else None
    if template is not None and template_supports_tools(template):
        return _render(template, msgs, tool_list, add_generation_prompt, bos_token, eos_token, budget)
    msgs = _tool_history_as_text(msgs)
    if template is None:
        msgs = _with_tools_prompt(msgs, tool_list, into_user=False)
        if arch.startswith("gemma"):
            return _gemma_turns(msgs, add_generation_prompt)
        return _chatml(msgs, add_generation_prompt)
    try:
        with_system = _with_tools_prompt(msgs, tool_list, into_user=False)
        return _render(template, with_system, None, add_generation_prompt, bos_token, eos_token, budget)
    except _RefusedByTemplate:
        if not tool_list or (msgs and msgs[0]["role"] == "system"):
            raise
        into_user = _with_tools_prompt(msgs, tool_list, into_user=True)  # it may refuse a system role
        return _render(template, into_user, None, add_generation_prompt, bos_token, eos_token, budget)


def _with_tools_prompt(
    msgs: list[dict[str, Any]], tools: list[dict[str, Any]] | None, *, into_user: bool
) -> list[dict[str, Any]]:
    """`msgs` with the fallback tools prompt in the system message (created when missing), or in front of
    the first user turn."""
    if not tools:
        return msgs
    prompt = fallback_tools_prompt(tools)
    out = list(msgs)
    if into_user:
        for k, m in enumerate(out):
            if m["role"] == "user":
                out[k] = {**m, "content": prompt + "\n\n" + m["content"]}
                break
        return out
    if out and out[0]["role"] == "system":
        head = out[0]["content"]
        out[0] = {**out[0], "content": f"{head}\n\n{prompt}" if head else prompt}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out


def _tool_history_as_text(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Earlier calls and their results as text for a template without tool support: an assistant's calls
    as ``<tool_call>`` blocks after its content; each run of ``tool`` messages as one user turn of
    ``<tool_response>`` blocks (as Qwen2.5's template writes them)."""
    if not any(m["role"] == "tool" or m.get("tool_calls") for m in msgs):
        return msgs
    out: list[dict[str, Any]] = []
    for m in msgs:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("_tool_turn"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_turn": True})
            continue
        if m.get("tool_calls"):
            calls = "\n".join(
                hermes_call_text(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]
            )
            text = m["content"].rstrip()
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m["content"] = f"{text}\n{calls}" if text else calls
        out.append(m)
    return [{k: v for k, v in m.items() if k != "_tool_turn"} for m in out]


def _render(
    template: str,
    msgs: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool,
    bos_token: str,
    eos_token: str,
    budget: RenderBudget,
) -> str:
    """`template` rendered in the sandbox within `budget` (``tools`` passed only when there are some)."""
    compiled = _compile(template)
    meter = _Meter(budget)
    outer, _ACTIVE.meter = _ACTIVE.meter, meter
    context: dict[str, Any] = {
        "messages": msgs,
        "add_generation_prompt": add_generation_prompt,
        "bos_token": bos_token,
        "eos_token": eos_token,
    }
    if tools:
        context["tools"] = tools
    try:
        pieces: list[str] = []
        size = 0
        for piece in compiled.generate(**context):
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
