"""The sandbox a chat template renders in (`engine.chat_template`): Hugging Face's environment
inside Jinja's ``ImmutableSandboxedEnvironment``, made stricter, with every render bounded in work
and size by a `RenderBudget` checked inside the compiled template (see chat_template's module doc)."""

from __future__ import annotations

import functools
import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.exceptions import SecurityError
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import _PassArg

from .errors import TemplateBudgetError, TemplateError

MAX_OUTPUT_CHARS = 4_000_000
"""A rendered prompt longer than this is refused (far beyond any context the engine runs)."""
MAX_VALUE_CHARS = MAX_OUTPUT_CHARS
"""The largest string (or list / dict, counted as its rendered text) a template may build."""
MAX_STEPS = 1_000_000
"""Loop iterations + calls one render may take (a real template takes ~5-20 per message)."""
MAX_SECONDS = 2.0
"""Wall-clock bound of one render (a real template renders a long chat in milliseconds)."""
MAX_DEPTH = 64
"""Nested calls back into template code (macros, ``caller()``, recursive loops)."""
_MAX_EXPONENT = 1_000


@dataclass(frozen=True)
class RenderBudget:
    """How much work one render of a chat template may do."""

    steps: int = MAX_STEPS
    """Loop iterations, loop-filter tests and calls (macros, methods, globals)."""
    seconds: float = MAX_SECONDS
    """Wall-clock time, checked at every step."""
    chars: int = MAX_OUTPUT_CHARS
    """Characters of output, and of any one value the template builds."""
    depth: int = MAX_DEPTH
    """Nested calls into template code."""


REQUEST_BUDGET = RenderBudget()
"""The budget of a request's render."""
PROBE_BUDGET = RenderBudget(steps=100_000, seconds=1.0)
"""The budget of the load-time probe (a 4-message chat: a real template needs ~100 steps)."""


class _RaisedByTemplate(Exception):
    """``raise_exception(message)`` called by the template itself."""


class _RefusedByTemplate(TemplateError):
    """The template's own ``raise_exception`` (it refuses this conversation, e.g. a role)."""


class _BrokenTemplate(TemplateError):
    """A template that does not parse or that the sandbox stopped: bad whatever the input."""


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
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}`` (HF's assistant-mask marker): renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        body: list[nodes.Node] = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return body


# --- the budget ------------------------------------------------------------------------------


class _Meter:
    """What is left of one render's budget (one per render, held by the rendering thread)."""

    __slots__ = ("budget", "chars", "deadline", "depth", "steps_left", "tripped")

    def __init__(self, budget: RenderBudget) -> None:
        self.budget = budget
        self.chars = budget.chars
        self.steps_left = budget.steps
        self.deadline = time.monotonic() + budget.seconds
        self.depth = 0
        self.tripped: TemplateBudgetError | None = None

    def trip(self, limit: str, value: float, what: str) -> TemplateBudgetError:
        self.tripped = TemplateBudgetError(limit, value, f"chat template exceeded its render budget: {what}")
        return self.tripped

    def step(self) -> None:
        self.steps_left -= 1
        if self.steps_left < 0:
            raise self.trip("steps", self.budget.steps, f"more than {self.budget.steps} steps")
        if time.monotonic() > self.deadline:
            raise self.trip("seconds", self.budget.seconds, f"more than {self.budget.seconds:g} s")
        if self.tripped is not None:  # swallowed somewhere: stays tripped
            raise self.tripped

    def size(self, n: int, what: str) -> None:
        if n > self.budget.chars:
            raise self.trip("chars", self.budget.chars, f"{what} of {n} characters (more than {self.budget.chars})")


class _Active(threading.local):
    meter: _Meter | None = None


_ACTIVE = _Active()


def _meter() -> _Meter:
    m = _ACTIVE.meter
    if m is None:
        raise TemplateError("chat template rendered outside render_chat")
    return m


def _text_size(value: Any, limit: int) -> int:
    """About how many characters `value` renders to (str, list, tuple, dict; others count 1),
    counted until `limit` is passed (so a huge or cyclic value costs at most ~`limit` visits)."""
    total = 0
    stack = [value]
    while stack and total <= limit:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v) + 2
        elif isinstance(v, (list, tuple)):
            total += 2 + len(v)
            stack.extend(v)
        elif isinstance(v, dict):
            total += 2 + 2 * len(v)
            stack.extend(v.keys())
            stack.extend(v.values())
        else:
            total += 1
    return total


def _check_value(value: Any, what: str) -> Any:
    """`value`, after checking a string / list / dict it is is within the budget's size."""
    if isinstance(value, str):
        if len(value) > _meter().chars:
            _meter().size(len(value), what)
    elif isinstance(value, (list, tuple, dict)):
        m = _meter()
        m.size(_text_size(value, m.budget.chars), what)
    return value


def _check_ints(args: Any, what: str) -> None:
    """Refuse an int argument (a width, a count) larger than the size budget."""
    m = _meter()
    for a in args:
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > m.budget.chars:
            raise m.trip("chars", m.budget.chars, f"{what} with an argument of {a}")


_PERCENT_WIDTH = re.compile(r"%[-#0 +]*(\d+)?(?:\.(\d+))?")
_FORMAT_WIDTH = re.compile(r"\{[^{}]*:[^{}]*?(\d+)[^{}]*\}")


def _check_format_widths(fmt: str, pattern: re.Pattern[str], what: str) -> None:
    m = _meter()
    for match in pattern.finditer(fmt):
        for g in match.groups():
            if g and int(g) > m.budget.chars:
                raise m.trip("chars", m.budget.chars, f"{what} with a width of {g}")


def _join_parts(value: Any, sep: Any, what: str) -> str:
    parts = [p if isinstance(p, str) else str(p) for p in value]
    sep = str(sep)
    _meter().size(sum(map(len, parts)) + len(sep) * max(len(parts) - 1, 0), what)
    return sep.join(parts)


def _check_replace(s: str, old: Any, new: Any, count: Any = -1) -> None:
    if isinstance(old, str) and isinstance(new, str) and len(new) > len(old):
        hits = s.count(old)
        if isinstance(count, int) and count >= 0:
            hits = min(hits, count)
        _meter().size(len(s) + hits * (len(new) - len(old)), "replace() result")


@jinja2.pass_eval_context
def _join_filter(eval_ctx: Any, value: Any, d: str = "", attribute: Any = None) -> str:
    if attribute is not None:
        getter = jinja2.filters.make_attrgetter(eval_ctx.environment, attribute)
        value = map(getter, value)
    return _join_parts(value, d, "join of")


def _check_filter_args(name: str, skip: int, args: Any, kwargs: Any) -> None:
    """Refuse a filter's width / count above the size bound, and the growth of the few filters
    whose result can be much larger than their input (replace, indent, format)."""
    _check_ints((*args[skip:], *kwargs.values()), f"filter {name!r}")
    value = args[skip - 1]
    if not isinstance(value, str):
        return
    if name == "replace" and len(args) >= skip + 2:
        _check_replace(value, *args[skip : skip + 3])
    elif name == "indent":
        width = args[skip] if len(args) > skip else kwargs.get("width", 4)
        if isinstance(width, int):
            _meter().size(len(value) + (value.count("\n") + 1) * width, "indent result")
    elif name == "format":
        _check_format_widths(value, _PERCENT_WIDTH, "filter 'format'")


def _bounded_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """`func` with its int arguments (widths, counts) and its result bounded in size."""
    skip = 2 if _PassArg.from_obj(func) is not None else 1  # the context, the filtered value

    @functools.wraps(func)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        if len(args) > skip or kwargs:
            _check_filter_args(name, skip, args, kwargs)
        return _check_value(func(*args, **kwargs), f"filter {name!r} result")

    return bounded


_STR_PADDING = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs"})


_BUDGET_HOOKS = frozenset({"budget_step", "budget_test"})


def _hook(name: str, *args: nodes.Expr, lineno: int) -> nodes.Call:
    """A call of the environment's budget hook `name` (no template syntax can write one)."""
    return nodes.Call(nodes.EnvironmentAttribute(name), list(args), [], None, None, lineno=lineno)


class _BudgetCodeGenerator(CodeGenerator):
    """Jinja's code generator with budget checks compiled into loops and string concatenation:
    a step at the head of every loop body and around every loop-filter test."""

    def visit_For(self, node: nodes.For, frame: Frame) -> None:
        node.body = [nodes.ExprStmt(_hook("budget_step", lineno=node.lineno), lineno=node.lineno), *node.body]
        if node.test is not None:
            node.test = _hook("budget_test", node.test, lineno=node.test.lineno)  # type: ignore[arg-type]
        super().visit_For(node, frame)

    def visit_Call(self, node: nodes.Call, frame: Frame, forward_caller: bool = False) -> None:
        if isinstance(node.node, nodes.EnvironmentAttribute) and node.node.name in _BUDGET_HOOKS:
            self.write(f"environment.{node.node.name}(")  # direct: no sandbox call, no step
            for i, arg in enumerate(node.args):
                if i:
                    self.write(", ")
                self.visit(arg, frame)
            self.write(")")
            return
        super().visit_Call(node, frame, forward_caller=forward_caller)

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.budget_value(")
        super().visit_Concat(node, frame)
        self.write(")")


class _ChatSandbox(ImmutableSandboxedEnvironment):
    """Immutable sandbox that raises on unsafe attributes and bounds work and sizes."""

    code_generator_class = _BudgetCodeGenerator
    intercepted_binops = frozenset(["*", "**", "+", "%"])

    def unsafe_undefined(self, obj: Any, attribute: Any) -> Any:
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is not allowed")

    # called by the compiled template (see _BudgetCodeGenerator)
    def budget_step(self) -> None:
        m = _ACTIVE.meter
        m.steps_left -= 1  # type: ignore[union-attr]
        if m.steps_left < 0 or m.tripped is not None or time.monotonic() > m.deadline:  # type: ignore[union-attr]
            _meter().step()

    def budget_test(self, value: Any) -> Any:
        self.budget_step()
        return value

    def budget_value(self, value: Any) -> Any:
        if value.__class__ is str and len(value) <= _ACTIVE.meter.chars:  # type: ignore[union-attr]
            return value
        return _check_value(value, "a string")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "+":
            result = left + right
            if result.__class__ is str and len(result) <= _ACTIVE.meter.chars:  # type: ignore[union-attr]
                return result
            return _check_value(result, "the result of '+'")
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(count, int):
                    m = _meter()
                    size = _text_size(seq, m.chars) if not isinstance(seq, str) else len(seq)
                    if size * count > m.chars:
                        raise SecurityError(f"repetition to {size * count} characters is too large")
        elif operator == "**":
            if isinstance(right, (int, float)) and abs(right) > _MAX_EXPONENT:
                raise SecurityError(f"exponent {right} is too large")
        elif operator == "%" and isinstance(left, str):
            _check_format_widths(left, _PERCENT_WIDTH, "'%' formatting")
            _check_ints(right if isinstance(right, tuple) else (right,), "'%' formatting")
        result = super().call_binop(context, operator, left, right)
        if operator != "**":
            _check_value(result, f"the result of {operator!r}")
        return result

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        m = _meter()
        m.step()
        owner = getattr(obj, "__self__", None)
        if isinstance(owner, str):  # a str method: bound the ones that grow a string
            name = getattr(obj, "__name__", "")
            if name in _STR_PADDING:
                _check_ints((*args, *kwargs.values()), f"str.{name}()")
            elif name == "join" and len(args) == 1 and not kwargs:
                return _join_parts(args[0], owner, "str.join() of")
            elif name == "replace" and len(args) >= 2:
                _check_replace(owner, *args[:3])
        else:
            method: Any = getattr(obj, "__wrapped__", None)  # str.format, as the sandbox wraps it
            if isinstance(getattr(method, "__self__", None), str) and method.__name__ in ("format", "format_map"):
                _check_format_widths(method.__self__, _FORMAT_WIDTH, "format()")
                fmt_map = method.__name__ == "format_map" and args and isinstance(args[0], dict)
                _check_ints(args[0].values() if fmt_map else (*args, *kwargs.values()), "format()")
        if m.depth >= m.budget.depth:
            raise m.trip("depth", m.budget.depth, f"calls nested more than {m.budget.depth} deep")
        m.depth += 1
        try:
            result = super().call(context, obj, *args, **kwargs)
        finally:
            m.depth -= 1
        return _check_value(result, "a call's result")


def _make_env() -> _ChatSandbox:
    env = _ChatSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, "jinja2.ext.loopcontrols"],
    )
    env.filters = {name: _bounded_filter(name, f) for name, f in env.filters.items()}
    env.filters["join"] = _bounded_filter("join", _join_filter)
    env.filters["tojson"] = _bounded_filter("tojson", _tojson)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _make_env()


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    try:
        return _ENV.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise _BrokenTemplate(f"chat template syntax error at line {exc.lineno}: {exc.message}") from None
    except SecurityError as exc:
        raise _BrokenTemplate(f"chat template blocked by the sandbox: {exc}") from None
