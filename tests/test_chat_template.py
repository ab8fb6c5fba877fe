"""Chat templates: the GGUF's own template and the fallbacks give llama.cpp's prompts; the sandbox holds."""

from __future__ import annotations

import json
from typing import Any

import pytest

from engine.chat_template import render_chat
from engine.errors import TemplateError
from tests.models import FIXTURES, missing

FIXTURES_DIR = FIXTURES


def _chat_cases(fixture: str) -> list[dict[str, Any]]:
    path = FIXTURES_DIR / fixture / "greedy.jsonl"
    if not path.exists():
        missing(f"oracle fixture {path} is missing")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
    return [r for r in rows if r["kind"] == "chat"]


@pytest.mark.parametrize(
    ("fixture", "arch"),
    [
        pytest.param("smollm2-135m-q4_1", "llama", id="smollm2"),
        pytest.param("gemma3-270m-q4_k_m", "gemma3", id="gemma3"),
    ],
)
def test_template_renders_llama_cpp_prompts(request: pytest.FixtureRequest, fixture: str, arch: str) -> None:
    """SmolLM2's GGUF template, and without a template gemma3's turn format, give the prompt text llama.cpp
    used for every chat case."""
    template = request.getfixturevalue("smollm2_template") if arch == "llama" else None
    cases = _chat_cases(fixture)
    assert cases
    for case in cases:
        messages = [{"role": "user", "content": case["message"]}]
        assert render_chat(template, messages, arch=arch) == case["prompt_text"]


def test_gemma_fallback_folds_system_into_first_user_turn() -> None:
    """A system message goes in front of the next user turn; assistant turns are "model"."""
    messages = [
        {"role": "system", "content": "Be brief. "},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    assert render_chat(None, messages, arch="gemma3", add_generation_prompt=False) == (
        "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n"
    )


def test_chatml_fallback_for_other_architectures() -> None:
    """Without a template, non-Gemma models get ChatML turns and an assistant prompt."""
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert render_chat(None, messages, arch="qwen2") == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    )


def test_text_parts_are_joined() -> None:
    """A content list of text parts becomes one string, parts joined by newlines."""
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    out = render_chat("{{ messages[0]['content'] }}", [{"role": "user", "content": parts}])
    assert out == "one\ntwo"


def test_hf_helpers_are_available() -> None:
    """bos/eos tokens, tojson (no HTML escaping), strftime_now and loop controls work as in HF."""
    template = (
        "{{ bos_token }}{{ messages | tojson }}{% for m in messages %}{% if loop.index > 1 %}"
        "{% break %}{% endif %}[{{ m.role }}]{% endfor %}{{ strftime_now('%Y') | length }}"
        "{% generation %}!{% endgeneration %}{{ eos_token }}"
    )
    messages = [{"role": "user", "content": "<a & b>"}, {"role": "assistant", "content": "x"}]
    out = render_chat(template, messages, bos_token="<s>", eos_token="</s>")
    assert out == ('<s>[{"role": "user", "content": "<a & b>"}, {"role": "assistant", "content": "x"}][user]4!</s>')


@pytest.mark.parametrize(
    "messages",
    [
        "hello",
        [{"content": "no role"}],
        [{"role": "user"}],
        [{"role": "user", "content": 42}],
        [{"role": 1, "content": "x"}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        ["not a dict"],
    ],
)
def test_invalid_messages_raise_template_error(messages: Any) -> None:
    """Messages without string role and content are refused with TemplateError."""
    with pytest.raises(TemplateError):
        render_chat(None, messages)


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ cycler.__init__.__globals__.os }}",
        "{{ joiner.__init__.__globals__ }}",
        "{{ lipsum.__globals__['os'].popen('id').read() }}",
        "{% if ''.__class__ %}leak{% endif %}",
        "{{ ''|attr('__class__') }}",
        "{{ messages|map(attribute='__class__')|list }}",
        "{{ '{0.__class__}'.format(messages) }}",
        "{{ self.__init__.__globals__ }}",
        "{{ messages.append({'role': 'x'}) }}",
        "{{ 'x' * 100000000 }}",
        "{{ 2 ** 100000000 }}",
    ],
)
def test_sandbox_escapes_raise_template_error(template: str) -> None:
    """Reaching for Python internals, mutating inputs or blowing up memory raises TemplateError."""
    with pytest.raises(TemplateError, match="sandbox"):
        render_chat(template, [{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{{ raise_exception('only user and assistant roles') }}", "only user and assistant roles"),
        ("{% for m in messages %}", "syntax error"),
        ("{{ messages[0].content.nope.deeper }}", "no attribute 'nope'"),
        ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ],
)
def test_template_failures_raise_template_error(template: str, message: str) -> None:
    """Errors the template raises or triggers become TemplateError with a clear message."""
    with pytest.raises(TemplateError, match=message):
        render_chat(template, [{"role": "user", "content": "hi"}])
