"""Tool calls streamed as the model writes them (`engine.tool_stream` through the API's `ToolSplitter`), on the
recorded outputs of every native syntax, cut into pieces the way tokens arrive."""

from __future__ import annotations

import json
from typing import Any

import pytest

from engine.tool_calls import SYNTAXES, ToolSyntax
from engine.tool_stream import CallDelta, arguments_text
from genie_supervisor.api.generation import Result, ToolSplitter
from genie_supervisor.llm.serving import Piece
from tests.test_tool_calls import GEMMA_RECORDED, HERMES_RECORDED, LLAMA3_RECORDED, QWEN_PARALLEL

pytestmark = pytest.mark.timeout(60)

RECORDED = (
    [("hermes", t) for t, _c, _k in HERMES_RECORDED]
    + [("llama3", t) for t, _c, _k in LLAMA3_RECORDED]
    + [("gemma", t) for t, _c, _k in GEMMA_RECORDED]
)


def _stream(
    syntax: ToolSyntax, text: str, size: int, parallel: bool = True
) -> tuple[str, list[CallDelta], int, Result]:
    """`text` pushed `size` characters at a time: the content sent, every call delta in order, how many deltas
    came before the end, and the parsed result."""
    splitter = ToolSplitter(syntax, parallel)
    content, deltas = "", []
    for i in range(0, len(text), size):
        out = splitter.push(Piece(text[i : i + size]))
        content += out.text if out is not None else ""
        deltas += splitter.deltas()
    early = len(deltas)
    result = Result("m", text=text)
    rest, more = splitter.finish(result)
    return content + (rest.text if rest is not None else ""), deltas + more, early, result


def _gathered(deltas: list[CallDelta]) -> list[tuple[str, str, str]]:
    """The calls a client gathers by index (id, name, arguments), checking that each call's head comes first
    and that a call's fragments all come before the next call begins."""
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if d.name is not None:
            assert d.index == len(calls) and d.arguments == "" and d.id is not None, d
            calls[d.index] = [d.id, d.name, ""]
        else:
            assert d.index == len(calls) - 1 and d.id is None, (d, calls)  # the call begun last
            calls[d.index][2] += d.arguments
    return [(i, n, a) for i, n, a in calls.values()]


@pytest.mark.parametrize("size", [1, 3, 7])
@pytest.mark.parametrize(("name", "text"), RECORDED)
def test_streamed_calls_equal_the_whole_parse(name: str, text: str, size: int) -> None:
    """For every recorded output in every piece size: content and calls gathered by index equal the parse of the
    whole output, ids included, and the argument fragments join to each call's arguments text."""
    syntax = SYNTAXES[name]
    content, deltas, _early, result = _stream(syntax, text, size)
    expected_content, expected_calls = syntax.parse(text)
    assert content == expected_content == result.message
    assert [(c.name, c.arguments) for c in result.tool_calls] == [(c.name, c.arguments) for c in expected_calls]
    assert _gathered(deltas) == [(c.id, c.name, arguments_text(c)) for c in result.tool_calls]
    assert all(json.loads(arguments_text(c)) == c.arguments for c in result.tool_calls)


STREAMED_AS_WRITTEN: list[tuple[str, str, int]] = [
    ("hermes", QWEN_PARALLEL, 2),
    (
        "hermes",
        '<tool_call>[{"name": "a", "arguments": {"n": 12345}}, {"name": "b", "arguments": {"s": "xyz"}}]</tool_call>',
        2,
    ),
    (
        "hermes",
        '<function=special_function>{"arg1": 1}</function>\n<function=python>{"code":"print(\'hello\')"}</function>',
        2,
    ),
    ("llama3", '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {"y": "zz"}}', 2),
    ("gemma", 'Checking.\n<tool_call>\n{"name": "special_function", "arguments": {"arg1": 100}}\n</tool_call>', 1),
]
"""JSON calls naming the function first: they stream before the output ends (with the number of calls)."""


@pytest.mark.parametrize(("name", "text", "n"), STREAMED_AS_WRITTEN)
def test_json_calls_stream_fragment_by_fragment_before_the_end(name: str, text: str, n: int) -> None:
    """Heads and argument fragments arrive while the text grows: every call has its head and more than one
    fragment before the end, the indexes run 0..n-1, and the end adds nothing."""
    content, deltas, early, result = _stream(SYNTAXES[name], text, 2)
    assert early == len(deltas) and len(result.tool_calls) == n
    for k in range(n):
        fragments = [d for d in deltas if d.index == k and d.name is None]
        assert len(fragments) > 1 and "".join(d.arguments for d in fragments) == arguments_text(result.tool_calls[k])


def test_python_style_calls_come_whole_at_the_end() -> None:
    """Gemma's Python list cannot stream as it is written: each call comes whole (head, then its arguments) at
    the end, written as JSON."""
    text = '[get_weather(location="Paris", unit="celsius"), get_time(zone="Europe/Paris")]'
    _content, deltas, early, result = _stream(SYNTAXES["gemma"], text, 2)
    assert early == 0 and [d.arguments for d in deltas if d.name is None] == [
        '{"location": "Paris", "unit": "celsius"}',
        '{"zone": "Europe/Paris"}',
    ]
    assert [c.name for c in result.tool_calls] == ["get_weather", "get_time"]


def test_one_call_only_when_parallel_calls_are_off() -> None:
    """parallel false: the second call is neither streamed nor answered."""
    _content, deltas, _early, result = _stream(SYNTAXES["hermes"], QWEN_PARALLEL, 3, parallel=False)
    assert {d.index for d in deltas} == {0} and [c.name for c in result.tool_calls] == ["get_current_temperature"]


def test_a_call_cut_off_stays_as_streamed_and_is_not_answered() -> None:
    """A call max_tokens cut short: its head and fragments were streamed, the parse does not count it (as the
    whole answer does not), and nothing more is sent for it."""
    text = '<tool_call>\n{"name": "set_light", "arguments": {"room": "kitch'
    content, deltas, early, result = _stream(SYNTAXES["hermes"], text, 4)
    assert early == len(deltas) and _gathered(deltas)[0][1:] == ("set_light", '{"room": "kitch')
    assert result.tool_calls == [] and content == text == result.message


def test_arguments_keep_the_models_own_text() -> None:
    """The arguments text is the model's (spacing, key order, escapes), not a re-encoding, streamed or whole."""
    text = '<tool_call>\n{"name":"f","arguments":{"b" :1,"a":"\\u00e9\\n"}}\n</tool_call>'
    _content, deltas, _early, result = _stream(SYNTAXES["hermes"], text, 5)
    assert _gathered(deltas)[0][2] == '{"b" :1,"a":"\\u00e9\\n"}' == arguments_text(result.tool_calls[0])
    assert result.tool_calls[0].arguments == {"b": 1, "a": "é\n"}


def test_arguments_given_as_a_json_string_are_its_content() -> None:
    """OpenAI-shaped output with the arguments as a JSON string: the string's content is the arguments text."""
    content, calls = SYNTAXES["hermes"].parse('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert content == "" and arguments_text(calls[0]) == '{"a": 1}'


def _ids(result: Result) -> Any:
    return [c.id for c in result.tool_calls]


def test_each_call_gets_its_own_id() -> None:
    """Two calls: two distinct call_ ids, the same in the heads and in the parsed result."""
    _content, deltas, _early, result = _stream(SYNTAXES["hermes"], QWEN_PARALLEL, 6)
    heads = [d.id for d in deltas if d.name is not None]
    assert heads == _ids(result) and len(set(heads)) == 2 and all(str(i).startswith("call_") for i in heads)
