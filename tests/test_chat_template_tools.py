"""Tools through the chat template: a template that reads `tools` gets them (and the tool history) as Hugging
Face passes them; SmolLM2's real template, other templates without tool support and the built-in fallbacks
get the documented fallback block and the history as <tool_call>/<tool_response> text; all inside the budget."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine.chat_template import RenderBudget, render_chat, validate_messages
from engine.errors import TemplateBudgetError, TemplateError
from engine.tool_calls import fallback_tools_prompt, template_supports_tools, tool_syntax

pytestmark = pytest.mark.timeout(60)

# Qwen2.5-Instruct's chat template (Qwen/Qwen2.5-7B-Instruct, tokenizer_config.json), faithful in every line
# that handles tools, tool calls and tool results.
QWEN25_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    '    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'
    'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}\n'
    "    {%- for tool in tools %}\n"
    '        {{- "\\n" }}\n'
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": '
    '<args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n'
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or '
    '(message.role == "assistant" and not message.tool_calls) %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    '    {%- elif message.role == "assistant" %}\n'
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    '            {{- \'\\n<tool_call>\\n{"name": "\' }}\n'
    "            {{- tool_call.name }}\n"
    '            {{- \'", "arguments": \' }}\n'
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    '    {%- elif message.role == "tool" %}\n'
    '        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}\n'
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOOLS = [WEATHER]
ASK = {"role": "user", "content": "Weather in Oslo?"}
# The assistant's call as the OpenAI API sends it back: arguments a JSON string, content null.
CALLED = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    ],
}
RESULT = {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": '{"temp_c": 4}'}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def test_qwen25_template_gets_tools() -> None:
    """Qwen2.5's template reads `tools` and renders them in its own # Tools block, one JSON line each."""
    assert template_supports_tools(QWEN25_TEMPLATE)
    out = render_chat(QWEN25_TEMPLATE, [ASK], tools=TOOLS)
    assert out == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + json.dumps(WEATHER)
        + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
        "<args-json-object>}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\nWeather in Oslo?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_qwen25_template_renders_the_tool_history() -> None:
    """An assistant's calls (string arguments decoded) and tool results render as Qwen2.5 writes them."""
    out = render_chat(QWEN25_TEMPLATE, [ASK, CALLED, RESULT], tools=TOOLS)
    assert out.endswith(
        "<|im_start|>user\nWeather in Oslo?<|im_end|>\n"
        f"<|im_start|>assistant\n{CALL_TEXT}<|im_end|>\n"
        '<|im_start|>user\n<tool_response>\n{"temp_c": 4}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n"
    )


# Qwen3's chat template, verbatim (Qwen/Qwen3-*, tokenizer_config.json "chat_template").
QWEN3_TEMPLATE = (Path(__file__).parent / "templates" / "qwen3.jinja").read_text(encoding="utf-8")
SET_LIGHT = {
    "type": "function",
    "function": {
        "name": "set_light",
        "description": "Turn a light on or off",
        "parameters": {
            "type": "object",
            "properties": {"entity_id": {"type": "string"}, "on": {"type": "boolean"}},
            "required": ["entity_id", "on"],
        },
    },
}


def test_qwen3_template_renders_tools_calls_and_results() -> None:
    """Qwen3's real template, in the sandbox, renders what Hugging Face's Jinja renders for a tool round trip."""
    messages = [
        {"role": "system", "content": "You control a home."},
        {"role": "user", "content": "Turn off the kitchen light"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "set_light", "arguments": '{"entity_id": "light.kitchen", "on": false}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": '{"ok": true}'},
    ]
    assert render_chat(QWEN3_TEMPLATE, messages, tools=[SET_LIGHT]) == (
        "<|im_start|>system\nYou control a home.\n\n# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + json.dumps(SET_LIGHT)
        + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
        "<args-json-object>}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\nTurn off the kitchen light<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "set_light", "arguments": {"entity_id": "light.kitchen", '
        '"on": false}}\n</tool_call><|im_end|>\n'
        '<|im_start|>user\n<tool_response>\n{"ok": true}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n"
    )
    assert tool_syntax(QWEN3_TEMPLATE, "qwen3").name == "hermes"


def test_without_tools_a_tools_template_renders_as_before() -> None:
    """No tools (None or []) leaves `tools` undefined: the template takes its no-tools branch."""
    plain = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
    assert render_chat(QWEN25_TEMPLATE, [ASK]).startswith(plain)
    assert render_chat(QWEN25_TEMPLATE, [ASK], tools=[]).startswith(plain)


def test_smollm2_template_gets_the_fallback_block(smollm2_template: str) -> None:
    """SmolLM2's real template knows no tools: the fallback block becomes its system message."""
    assert not template_supports_tools(smollm2_template)
    out = render_chat(smollm2_template, [ASK], tools=TOOLS, arch="llama")
    assert out == (
        f"<|im_start|>system\n{fallback_tools_prompt(TOOLS)}<|im_end|>\n"
        "<|im_start|>user\nWeather in Oslo?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in out
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in out


def test_fallback_merges_with_an_existing_system_message(smollm2_template: str) -> None:
    """A system message keeps its text, followed by the fallback block."""
    system = {"role": "system", "content": "You control a smart home."}
    out = render_chat(smollm2_template, [system, ASK], tools=TOOLS, arch="llama")
    assert out.startswith(f"<|im_start|>system\nYou control a smart home.\n\n{fallback_tools_prompt(TOOLS)}<|im_end|>")


def test_fallback_renders_the_tool_history_as_text(smollm2_template: str) -> None:
    """Earlier calls become <tool_call> blocks and results a user turn of <tool_response> blocks."""
    second = {"role": "tool", "tool_call_id": "call_2", "content": "windy"}
    said = {**CALLED, "content": "Checking."}
    out = render_chat(smollm2_template, [ASK, said, RESULT, second], tools=TOOLS, arch="llama")
    assert out.endswith(
        "<|im_start|>user\nWeather in Oslo?<|im_end|>\n"
        f"<|im_start|>assistant\nChecking.\n{CALL_TEXT}<|im_end|>\n"
        '<|im_start|>user\n<tool_response>\n{"temp_c": 4}\n</tool_response>\n'
        "<tool_response>\nwindy\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_chatml_fallback_gets_tools() -> None:
    """Without a template, ChatML carries the fallback block as its system turn."""
    out = render_chat(None, [ASK, CALLED, RESULT], tools=TOOLS, arch="qwen2")
    assert out == (
        f"<|im_start|>system\n{fallback_tools_prompt(TOOLS)}<|im_end|>\n"
        "<|im_start|>user\nWeather in Oslo?<|im_end|>\n"
        f"<|im_start|>assistant\n{CALL_TEXT}<|im_end|>\n"
        '<|im_start|>user\n<tool_response>\n{"temp_c": 4}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n"
    )


def test_gemma_fallback_folds_the_tools_block_into_the_first_user_turn() -> None:
    """Gemma has no system role: the fallback block goes in front of the first user turn."""
    out = render_chat(None, [ASK, CALLED, RESULT], tools=TOOLS, arch="gemma3")
    assert out == (
        f"<start_of_turn>user\n{fallback_tools_prompt(TOOLS)}\n\nWeather in Oslo?<end_of_turn>\n"
        f"<start_of_turn>model\n{CALL_TEXT}<end_of_turn>\n"
        '<start_of_turn>user\n<tool_response>\n{"temp_c": 4}\n</tool_response><end_of_turn>\n'
        "<start_of_turn>model\n"
    )


# Mistral-7B-Instruct-v0.1's template: strict user/assistant alternation, so a system turn raises.
ALTERNATING = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token + ' ' }}{% endif %}{% endfor %}"
)


def test_fallback_goes_into_the_user_turn_when_the_template_refuses_a_system_role() -> None:
    """A template that raises on a system message gets the fallback block in front of the first user turn."""
    out = render_chat(ALTERNATING, [ASK], tools=TOOLS, bos_token="<s>")
    assert out == f"<s>[INST] {fallback_tools_prompt(TOOLS)}\n\nWeather in Oslo? [/INST]"


def test_messages_with_tool_calls_and_tool_results_validate() -> None:
    """Null content with tool_calls becomes ""; string arguments are decoded; tool messages keep their ids."""
    msgs = validate_messages([ASK, CALLED, RESULT])
    assert msgs[1]["content"] == ""
    assert msgs[1]["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    ]
    assert msgs[2] == RESULT
    ollama = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]}
    assert validate_messages([ollama])[0]["tool_calls"] == [
        {"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
    ]
    empty = validate_messages([{"role": "assistant", "content": "hi", "tool_calls": []}])
    assert empty == [{"role": "assistant", "content": "hi"}]


def test_tool_messages_are_named_after_their_call() -> None:
    """A tool message gets the name of the call it answers, or Ollama's tool_name, for templates that print it."""
    unnamed = {"role": "tool", "tool_call_id": "call_1", "content": "4"}
    assert validate_messages([ASK, CALLED, unnamed])[2]["name"] == "get_weather"
    ollama = {"role": "tool", "tool_name": "get_weather", "content": "4"}
    assert validate_messages([ASK, ollama])[1] == {"role": "tool", "name": "get_weather", "content": "4"}
    stranger = {"role": "tool", "tool_call_id": "call_9", "content": "4"}
    assert "name" not in validate_messages([ASK, CALLED, stranger])[2]


def test_arguments_that_are_not_a_json_object_stay_a_string() -> None:
    """Arguments a client sends as a string that is not a JSON object reach the template as that string."""
    for raw in ("{nope", "[1]"):
        call = {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": raw}}]}
        assert validate_messages([call])[0]["tool_calls"][0]["function"]["arguments"] == raw


@pytest.mark.parametrize(
    ("message", "match"),
    [
        ({"role": "assistant", "content": None}, "content must be a string"),
        ({"role": "assistant", "tool_calls": "x"}, r"tool_calls must be a list"),
        ({"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}, r"function\.name"),
        ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": [1]}}]}, "JSON object"),
        ({"role": "assistant", "tool_calls": [{"name": "f"}]}, r"\.function must be an object"),
        ({"role": "tool", "content": "x", "tool_call_id": 5}, "tool_call_id must be a string"),
        ({"role": "tool"}, "content is missing"),
    ],
)
def test_malformed_tool_messages_raise_template_error(message: dict[str, Any], match: str) -> None:
    """Bad tool_calls or tool messages are refused with a message naming the field."""
    with pytest.raises(TemplateError, match=match):
        render_chat(None, [ASK, message])


def test_malformed_tools_raise_template_error() -> None:
    """A tools list the API passed through unchecked is refused naming the entry."""
    with pytest.raises(TemplateError, match=r"tools\[0\]"):
        render_chat(QWEN25_TEMPLATE, [ASK], tools=[{"type": "function", "function": {"name": 3}}])


def test_tools_count_against_the_render_budget(smollm2_template: str) -> None:
    """A huge tools list makes the render exceed its output budget, natively and through the fallback."""
    tools = [{"type": "function", "function": {"name": f"f{i}", "description": "x" * 1000}} for i in range(200)]
    small = RenderBudget(chars=50_000)
    for template in (QWEN25_TEMPLATE, smollm2_template):
        with pytest.raises(TemplateBudgetError):
            render_chat(template, [ASK], tools=tools, budget=small)
