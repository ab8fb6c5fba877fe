"""Native tool-call syntaxes: recorded model outputs parse back into calls with the text before them kept as
content, garbage stays content, the syntax is detected from the template, and the forcing grammars compile
in llguidance, accepting a valid call and rejecting an invalid one."""

from __future__ import annotations

import json
from typing import Any

import pytest

from engine.errors import TemplateError
from engine.tool_calls import (
    SYNTAXES,
    ToolCall,
    content_prefix_len,
    tool_choice_name,
    tool_syntax,
    validate_tools,
)

pytestmark = pytest.mark.timeout(60)

HERMES = SYNTAXES["hermes"]
LLAMA3 = SYNTAXES["llama3"]
GEMMA = SYNTAXES["gemma"]
FALLBACK = SYNTAXES["fallback"]

SPECIAL = ToolCall("special_function", {"arg1": 1})
PYTHON_HELLO = ToolCall("python", {"code": "print('hello')"})


# Outputs recorded in llama.cpp's tests/test-chat.cpp (the Hermes 2 Pro / Qwen2.5 parsing cases, which
# collect what Hermes-, Qwen- and Llama-based models emit in practice), with the calls llama.cpp expects.
HERMES_RECORDED: list[tuple[str, str, list[ToolCall]]] = [
    ('<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}\n</tool_call>', "", [SPECIAL]),
    (
        'Hello, world!\nWhat\'s up?<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}\n</tool_call>',
        "Hello, world!\nWhat's up?",
        [SPECIAL],
    ),
    ('<function=special_function>{"arg1": 1}</function>', "", [SPECIAL]),
    ('<function name="special_function">\n{"arg1": 1}\n</function>', "", [SPECIAL]),
    ('<tool>\n  {"name": "special_function", "arguments": {"arg1": 1}}\n</tool>', "", [SPECIAL]),
    ('<tools>\n  {"name": "special_function", "arguments": {"arg1": 1}}\n</tools>', "", [SPECIAL]),
    ('<response>\n  {"name": "special_function", "arguments": {"arg1": 1}}\n</response>', "", [SPECIAL]),
    (
        '```xml\n<response>\n    {"name": "special_function", "arguments": {"arg1": 1}}\n</response>\n```',
        "",
        [SPECIAL],
    ),
    ('```xml\n  {"name": "special_function", "arguments": {"arg1": 1}}\n```', "", [SPECIAL]),
    ('```\n{"name": "special_function", "arguments": {"arg1": 1}}\n```', "", [SPECIAL]),
    ('```json\n  {"name": "special_function", "arguments": {"arg1": 1}}\n```', "", [SPECIAL]),
    (
        '```json\n\n                    <function_call> {"name": "special_function", "arguments": {"arg1": 1}} \n'
        "                    </function_call> \n``` ",
        "",
        [SPECIAL],
    ),
    ('<json>\n  {"name": "special_function", "arguments": {"arg1": 1}}\n</json>', "", [SPECIAL]),
    ('<xml>\n  {\n    "name": "special_function", "arguments": {"arg1": 1}\n  }\n</xml>', "", [SPECIAL]),
    ('<JSON>\n  {"name": "special_function", "arguments": {"arg1": 1}}\n</JSON>', "", [SPECIAL]),
    ('{"name": "special_function", "arguments": {"arg1": 1}}', "", [SPECIAL]),
    ('{\n  "name": "special_function", "arguments": {"arg1": 1}}', "", [SPECIAL]),
    (
        '<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "python", "arguments": {"code":"print(\'hello\')"}}\n</tool_call>',
        "",
        [SPECIAL, PYTHON_HELLO],
    ),
    (
        '<function=special_function>{"arg1": 1}</function>\n<function=python>{"code":"print(\'hello\')"}</function>',
        "",
        [SPECIAL, PYTHON_HELLO],
    ),
    (
        'This is not a tool call:\n{"name": "special_function", "arguments": {"arg1": 1}}',
        "This is not a tool call:",
        [SPECIAL],
    ),
    ("Hello, world!\nWhat's up?", "Hello, world!\nWhat's up?", []),
    # QwQ-32B / Qwen3 after its thinking: no newlines around the JSON.
    (
        'I\'m\nthinking</think>\n<tool_call>{"name": "special_function", "arguments": {"arg1": 1}}</tool_call>',
        "I'm\nthinking</think>",
        [SPECIAL],
    ),
]


# SmolLM2's trained format (its model card's tool prompt; Ollama's smollm2 template): a JSON list in the tag,
# "[]" for no call; and llama.cpp's generic JSON format (tests/test-chat.cpp, COMMON_CHAT_FORMAT_GENERIC).
HERMES_RECORDED += [
    (
        '<tool_call>[\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n]</tool_call>',
        "",
        [ToolCall("get_weather", {"city": "Paris"})],
    ),
    (
        '<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"n": 2}}]</tool_call>',
        "",
        [ToolCall("a", {}), ToolCall("b", {"n": 2})],
    ),
    ("I cannot help with that.\n<tool_call>[]</tool_call>", "I cannot help with that.", []),
    ('{"tool_call": {"name": "special_function", "arguments": {"arg1": 1}}}', "", [SPECIAL]),
    (
        '{"tool_calls": [{"name": "special_function", "arguments": {"arg1": 1}, "id": "123456789"}]}',
        "",
        [ToolCall("special_function", {"arg1": 1}, id="123456789")],
    ),
]


@pytest.mark.parametrize(("text", "content", "calls"), HERMES_RECORDED)
def test_hermes_parses_recorded_outputs(text: str, content: str, calls: list[ToolCall]) -> None:
    """Each recorded Hermes-style output gives llama.cpp's content and calls."""
    assert HERMES.parse(text) == (content, calls)
    assert FALLBACK.parse(text) == (content, calls)


# Qwen2.5-7B-Instruct's model card (function calling, "parallel" example): two calls in a row, then EOS.
QWEN_PARALLEL = (
    "<tool_call>\n"
    '{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}\n'
    "</tool_call>\n"
    "<tool_call>\n"
    '{"name": "get_temperature_date", "arguments": {"location": "San Francisco, CA, USA", "date": "2024-10-01"}}\n'
    "</tool_call>"
)


def test_hermes_two_parallel_calls_in_order() -> None:
    """Two <tool_call> blocks in a row are two calls, in the order written."""
    content, calls = HERMES.parse(QWEN_PARALLEL)
    assert content == ""
    assert [c.name for c in calls] == ["get_current_temperature", "get_temperature_date"]
    assert calls[1].arguments == {"location": "San Francisco, CA, USA", "date": "2024-10-01"}


def test_hermes_text_around_a_call_is_content() -> None:
    """Text before and after a call stays content; the whitespace next to the call goes."""
    text = 'Let me check.\n\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\nOne moment.'
    assert HERMES.parse(text) == ("Let me check.\nOne moment.", [ToolCall("f", {})])


def test_hermes_arguments_as_json_string_and_missing_close() -> None:
    """OpenAI-style string arguments decode; a model that stops before </tool_call> still made its call."""
    text = '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": [1, 2]}"}\n'
    assert HERMES.parse(text) == ("", [ToolCall("f", {"a": [1, 2]})])


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>',  # unbalanced braces
        "<tool_call>\n{'name': 'f', 'arguments': {}}\n</tool_call>",  # Python quotes, not JSON
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call',  # cut inside the closing tag
        '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>',  # no name
        '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>',  # arguments not an object
        "<tool_call>nah uhg</tool_call>",
        'A JSON example {"name": "f", "arguments": {}} mid-sentence.',
        '{"name": "Bob", "age": 3}',
        "```json\n{}\n```",
        "<tool_call>",
        "```",
        "",
    ],
)
def test_malformed_calls_stay_content(text: str) -> None:
    """Malformed JSON or text that only looks like a call is content, unchanged, and never raises."""
    for syntax in SYNTAXES.values():
        assert syntax.parse(text) == (text, [])


def test_parse_never_raises_on_garbage() -> None:
    """Random-looking and deeply nested text parses to content without an exception."""
    nested = "<tool_call>" + "[" * 100_000 + "\n"
    for syntax in SYNTAXES.values():
        for text in (nested, "```tool_code\n" + "(" * 10_000 + "\n```", "<\x00{`[<|python_tag|>", "{" * 50):
            content, calls = syntax.parse(text)
            assert (content, calls) == (text, [])


# Llama 3.1 / 3.2 outputs from llama.cpp's tests/test-chat.cpp (LLAMA_3_X cases) and Meta's Llama 3.1 model
# card (built-in tools: "<|python_tag|>brave_search.call(query=...)").
LLAMA3_RECORDED: list[tuple[str, str, list[ToolCall]]] = [
    ('{"name": "special_function", "parameters": {"arg1": 1}}', "", [SPECIAL]),
    ('<|python_tag|>{"name": "special_function", "parameters": {"arg1": 1}}', "", [SPECIAL]),
    ("<|python_tag|>python.call(code=\"print('hey')\")", "", [ToolCall("python", {"code": "print('hey')"})]),
    (
        "<|python_tag|>code_interpreter.call(code=\"print('hey')\")",
        "",
        [ToolCall("code_interpreter", {"code": "print('hey')"})],
    ),
    (
        '<|python_tag|>brave_search.call(query="current weather in Menlo Park, California")',
        "",
        [ToolCall("brave_search", {"query": "current weather in Menlo Park, California"})],
    ),
    (
        '{"type": "function", "name": "special_function", "parameters": {"arg1": 1}}',
        "",
        [SPECIAL],
    ),
    (
        '{"name": "special_function", "parameters": {"arg1": 1}}; {"name": "python", "parameters": '
        '{"code": "print(\'hello\')"}}',
        "",
        [SPECIAL, PYTHON_HELLO],
    ),
    ("Hello, world!\nWhat's up?", "Hello, world!\nWhat's up?", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), LLAMA3_RECORDED)
def test_llama3_parses_recorded_outputs(text: str, content: str, calls: list[ToolCall]) -> None:
    """Llama 3.x JSON calls (bare or after <|python_tag|>, `;`-separated) and built-in calls parse."""
    assert LLAMA3.parse(text) == (content, calls)


def test_llama3_text_before_a_call_is_content() -> None:
    """A sentence and then a JSON call on its own line: the sentence is content."""
    text = 'Sure, checking.\n{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    assert LLAMA3.parse(text) == ("Sure, checking.", [ToolCall("get_weather", {"city": "Oslo"})])


# Gemma 3 has no tool tokens. Google's "Function calling with Gemma" guide
# (ai.google.dev/gemma/docs/capabilities/function-calling) prompts for a Python list of calls, its sample answer
# being [get_product_name_by_PID(PID="807ZPKBL9V")], or for {"name": ..., "parameters": ...} JSON; Google's Gemma
# cookbook agents wrap Python calls in a ```tool_code``` block.
GEMMA_RECORDED: list[tuple[str, str, list[ToolCall]]] = [
    ('[get_product_name_by_PID(PID="807ZPKBL9V")]', "", [ToolCall("get_product_name_by_PID", {"PID": "807ZPKBL9V"})]),
    (
        '```tool_code\nget_product_name_by_PID(PID="807ZPKBL9V")\n```',
        "",
        [ToolCall("get_product_name_by_PID", {"PID": "807ZPKBL9V"})],
    ),
    (
        'I will look that up.\n```tool_code\nconvert(amount=200000, currency="EUR")\n```',
        "I will look that up.",
        [ToolCall("convert", {"amount": 200000, "currency": "EUR"})],
    ),
    (
        '[get_weather(location="Paris", unit="celsius"), get_time(zone="Europe/Paris")]',
        "",
        [
            ToolCall("get_weather", {"location": "Paris", "unit": "celsius"}),
            ToolCall("get_time", {"zone": "Europe/Paris"}),
        ],
    ),
    (
        '```tool_code\nlight_on(room="kitchen")\nlight_off(room="hall")\n```',
        "",
        [ToolCall("light_on", {"room": "kitchen"}), ToolCall("light_off", {"room": "hall"})],
    ),
    ('{"name": "special_function", "parameters": {"arg1": 1}}', "", [SPECIAL]),
    ('<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}\n</tool_call>', "", [SPECIAL]),
    ("Paris is sunny today.", "Paris is sunny today.", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), GEMMA_RECORDED)
def test_gemma_parses_tool_code_python_lists_and_json(text: str, content: str, calls: list[ToolCall]) -> None:
    """Gemma's ```tool_code``` blocks, Python lists of calls and JSON calls all parse."""
    assert GEMMA.parse(text) == (content, calls)


@pytest.mark.parametrize(
    "code",
    [
        "get_weather('Paris')",  # positional: no name to give the argument
        "__import__('os').system('id')",
        "f(a=open('/etc/passwd'))",  # not a literal
        "x = f(a=1)",
        "f(**kw)",
    ],
)
def test_gemma_python_calls_are_read_never_run(code: str) -> None:
    """Python that is not keyword calls with literal values stays content (it is never evaluated)."""
    text = f"```tool_code\n{code}\n```"
    assert GEMMA.parse(text) == (text, [])


@pytest.mark.parametrize(
    ("template", "arch", "name"),
    [
        ("{% if tools %}<tool_call>{% endif %}{{ messages }}", "qwen2", "hermes"),
        ("{% if tools is not none %}Environment: ipython{% endif %}{{ messages }}", "llama", "llama3"),
        ("{% for t in tools %}<|python_tag|>{% endfor %}", "llama", "llama3"),
        ("{{ messages }}", "llama", "fallback"),
        (None, "qwen2", "fallback"),
        (None, "gemma3", "gemma"),
        ("{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}", "gemma3", "gemma"),
        ("{% if tools %}[AVAILABLE_TOOLS]{% endif %}", "llama", "hermes"),
        ("<tool_call> in a comment but no tools variable", "qwen2", "fallback"),
    ],
)
def test_syntax_detected_from_template_markers(template: str | None, arch: str, name: str) -> None:
    """<tool_call> means Hermes, python_tag/ipython Llama 3, Gemma without tools Gemma, else the fallback."""
    assert tool_syntax(template, arch).name == name


def test_only_llama3_refuses_parallel_calls() -> None:
    """Llama 3's templates raise on two calls in one turn; the other families take several."""
    assert {name: s.parallel_calls for name, s in SYNTAXES.items()} == {
        "hermes": True,
        "llama3": False,
        "gemma": True,
        "fallback": True,
    }


def test_smollm2_template_gets_the_fallback_syntax(smollm2_template: str) -> None:
    """SmolLM2's template knows no tools: its calls are read in the fallback (Hermes) syntax."""
    assert tool_syntax(smollm2_template, "llama").name == "fallback"


@pytest.mark.parametrize(
    ("text", "streamable"),
    [
        ("Hello there", "Hello there"),
        ("Hello there\n", "Hello there"),
        ("Sure.\n<tool_call>\n{", "Sure."),
        ("Sure. <tool_c", "Sure."),
        ("Sure. <TOOL_CALL>", "Sure."),
        ("a {b} c", "a {b} c"),
        ("Here:\n{", "Here:"),
        ("Code ```python\nx", "Code ```python\nx"),
        ("Code ``", "Code"),
    ],
)
def test_content_prefix_holds_back_possible_calls(text: str, streamable: str) -> None:
    """A stream may send the text before any (possibly cut-off) opener; the rest waits for parse."""
    n = content_prefix_len(HERMES, text)
    assert text[:n] == streamable


@pytest.mark.parametrize("syntax", list(SYNTAXES.values()), ids=list(SYNTAXES))
def test_streamed_prefix_starts_the_parsed_content(syntax: Any) -> None:
    """Token by token, a stream scanning only what it has not sent sends a prefix of the parsed content."""
    texts = [
        "Checking the lights now.\n" + QWEN_PARALLEL,
        'Sure, checking.\n{"name": "get_weather", "parameters": {"city": "Oslo"}}',
        'I will look that up.\n```tool_code\nconvert(amount=200000, currency="EUR")\n```',
        "Plain answer with a {brace} and ``` fences ```python\nx = 1\n``` and <b>tags</b>.",
    ]
    for text in texts:
        sent = 0
        for end in range(len(text) + 1):
            sent = content_prefix_len(syntax, text[:end], sent)
            assert sent == content_prefix_len(syntax, text[:end])
        assert syntax.parse(text)[0].startswith(text[:sent])


def test_validate_tools_normalises_and_refuses() -> None:
    """Bare functions are wrapped in HF's shape; a tool without a name is refused naming the entry."""
    assert validate_tools([{"name": "f"}]) == [{"type": "function", "function": {"name": "f"}}]
    with pytest.raises(TemplateError, match=r"tools\[1\]\.function\.name"):
        validate_tools([{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {}}])
    with pytest.raises(TemplateError, match=r"parameters"):
        validate_tools([{"type": "function", "function": {"name": "f", "parameters": "x"}}])
    with pytest.raises(TemplateError, match="must be a list"):
        validate_tools({"name": "f"})


def test_tool_choice_names() -> None:
    """ "required" forces any tool, a named choice that one; "auto"/"none" force nothing."""
    assert tool_choice_name("required") is None
    assert tool_choice_name({"type": "function", "function": {"name": "f"}}) == "f"
    for bad in ("auto", "none", {"type": "function"}, 3):
        with pytest.raises(ValueError, match="tool_choice"):
            tool_choice_name(bad)  # type: ignore[arg-type]


# --- grammars, compiled by llguidance ----------------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city {in braces}",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
LIGHTS = {"type": "function", "function": {"name": "lights_off"}}  # no parameters: any object
CAFE = {
    "type": "function",
    "function": {"name": "café_order", "parameters": {"type": "object", "properties": {"drink": {"type": "string"}}}},
}
TOOLS = [WEATHER, LIGHTS, CAFE]


class _ByteTokenizer:
    """One token per byte plus an EOS token: llguidance then checks text, not a model's vocabulary."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [b"\xff<eos>"]
    special_token_ids = [256]

    def __call__(self, s: str | bytes) -> list[int]:
        return list(s.encode() if isinstance(s, str) else s)


@pytest.fixture(scope="module")
def matcher() -> Any:
    """A function (grammar, text) -> whether llguidance's matcher accepts exactly that text."""
    llguidance = pytest.importorskip("llguidance")
    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokenizer()))

    def accepts(grammar: str, text: str) -> bool:
        compiled = llguidance.LLMatcher.grammar_from_lark(grammar)
        assert llguidance.LLMatcher.validate_grammar(compiled, tokenizer) == "", grammar
        m = llguidance.LLMatcher(tokenizer, compiled, log_level=0)
        return bool(m.consume_tokens(list(text.encode()))) and m.is_accepting() and not m.is_error()

    return accepts


def _hermes(name: str, args: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}\n</tool_call>"


def test_hermes_grammar_accepts_a_valid_call_and_rejects_an_invalid_one(matcher: Any) -> None:
    """The "required" grammar takes a call matching a tool's schema and refuses bad or unknown calls."""
    g = HERMES.grammar(TOOLS, "required", parallel=False)
    assert matcher(g, _hermes("get_weather", {"city": "Oslo", "unit": "celsius", "days": 3}))
    assert matcher(g, _hermes("lights_off", {}))
    assert matcher(g, _hermes("café_order", {"drink": "flat white"}))
    assert not matcher(g, _hermes("get_weather", {"unit": "celsius"}))  # required key missing
    assert not matcher(g, _hermes("get_weather", {"city": "Oslo", "days": 9}))  # above the maximum
    assert not matcher(g, _hermes("get_weather", {"city": "Oslo", "unit": "kelvin"}))  # not in the enum
    assert not matcher(g, _hermes("get_weather", {"city": "Oslo", "extra": 1}))  # additionalProperties false
    assert not matcher(g, _hermes("set_alarm", {}))  # not a tool
    assert not matcher(g, "Sure! " + _hermes("lights_off", {}))  # no content before the forced call
    assert not matcher(g, _hermes("lights_off", {}) + "\n" + _hermes("lights_off", {}))  # one call only


def test_hermes_grammar_parallel_and_named(matcher: Any) -> None:
    """Parallel allows several calls in a row; a named choice allows only that function."""
    both = _hermes("lights_off", {}) + "\n" + _hermes("get_weather", {"city": "Oslo"})
    assert matcher(HERMES.grammar(TOOLS, "required", parallel=True), both)
    named = HERMES.grammar(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, parallel=False)
    assert matcher(named, _hermes("get_weather", {"city": "Oslo"}))
    assert not matcher(named, _hermes("lights_off", {}))
    assert HERMES.parse(both)[1] == [ToolCall("lights_off", {}), ToolCall("get_weather", {"city": "Oslo"})]


class _QwenLikeTokenizer(_ByteTokenizer):
    """Bytes plus <tool_call> and </tool_call> as special tokens, as in Qwen2.5's and Qwen3's vocabularies."""

    tokens = [*_ByteTokenizer.tokens, b"\xff<tool_call>", b"\xff</tool_call>"]
    special_token_ids = [256, 257, 258]


def test_hermes_grammar_uses_special_tokens_of_the_vocabulary() -> None:
    """Where <tool_call> is a special token the grammar names it, so the model writes the token it was taught."""
    llguidance = pytest.importorskip("llguidance")
    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_QwenLikeTokenizer()))
    g = HERMES.grammar(TOOLS, "required", parallel=False, special={"<tool_call>", "</tool_call>", "<|im_end|>"})
    compiled = llguidance.LLMatcher.grammar_from_lark(g)
    assert llguidance.LLMatcher.validate_grammar(compiled, tokenizer) == ""
    body = list(b'\n{"name": "lights_off", "arguments": {}}\n')
    m = llguidance.LLMatcher(tokenizer, compiled, log_level=0)
    assert m.consume_tokens([257, *body, 258]) and m.is_accepting()
    spelled = llguidance.LLMatcher(tokenizer, compiled, log_level=0)
    assert not spelled.consume_tokens(list(b"<tool_call>"))


def test_llama3_grammar_writes_parameters_calls(matcher: Any) -> None:
    """Llama 3's grammar takes bare {"name", "parameters"} calls, "; "-separated when parallel."""
    g = LLAMA3.grammar(TOOLS, "required", parallel=True)
    one = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    assert matcher(g, one)
    assert matcher(g, one + '; {"name": "lights_off", "parameters": {}}')
    assert not matcher(g, '{"name": "get_weather", "arguments": {"city": "Oslo"}}')
    assert LLAMA3.parse(one) == ("", [ToolCall("get_weather", {"city": "Oslo"})])


def test_gemma_grammar_writes_what_the_fallback_prompt_asks(matcher: Any) -> None:
    """Gemma is taught the Hermes syntax by the fallback prompt, so its grammar forces <tool_call> calls."""
    g = GEMMA.grammar(TOOLS, "required", parallel=False)
    assert matcher(g, _hermes("get_weather", {"city": "Oslo"}))
    assert not matcher(g, '```tool_code\nget_weather(city="Oslo")\n```')


def test_grammar_refuses_choices_that_force_nothing() -> None:
    """A grammar for "auto", an unknown function or no tools is a ValueError naming tool_choice."""
    with pytest.raises(ValueError, match="tool_choice"):
        HERMES.grammar(TOOLS, "auto", parallel=False)
    with pytest.raises(ValueError, match="not among the tools"):
        HERMES.grammar(TOOLS, {"type": "function", "function": {"name": "nope"}}, parallel=False)
    with pytest.raises(ValueError, match="no tools"):
        HERMES.grammar([], "required", parallel=False)
