"""Chat templates are bounded in work and size inside the render; a template that cannot render a small
chat within its budget is refused at load (issue 15: a GGUF from the internet is untrusted input)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import jinja2
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

import engine.synth
from engine import load_model
from engine.chat_template import (
    MAX_OUTPUT_CHARS,
    PROBE_CONVERSATIONS,
    RenderBudget,
    probe_chat_template,
    render_chat,
)
from engine.errors import ModelFormatError, TemplateBudgetError, TemplateError
from engine.synth import write_synthetic_gguf
from tests.apitools import SHAPES, http, make_api_supervisor
from tests.models import FIXTURES, missing

pytestmark = pytest.mark.timeout(60)

HI: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
NESTED_LOOPS = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"

# Gemma 3's chat template (google/gemma-3-*-it, tokenizer_config.json); the demo GGUF carries none.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    '    {%- set first_user_prefix = "" -%}\n'
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    '        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}\n'
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    '        {%- set role = "model" -%}\n'
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    '        {{ raise_exception("Invalid content type") }}\n'
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n"
    "{%- endif -%}\n"
)
# Mistral-7B-Instruct-v0.1's template: strict user/assistant alternation, so a system turn raises.
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token + ' ' }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)


def _chat(n_turns: int, system: bool = True) -> list[dict[str, Any]]:
    msgs = [{"role": "system", "content": "Be brief."}] if system else []
    for i in range(n_turns):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}: " + "words " * 20})
    return msgs


def _unbounded_render(template: str, messages: list[dict[str, Any]], **kw: Any) -> str:
    """The same template rendered by plain Jinja (HF's settings, no budget): the reference."""

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, **kw)


# --- request-time budget ------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_nested_loops_stop_within_the_default_budget() -> None:
    """The issue's 10^10-iteration nested loop stops with TemplateBudgetError (steps or clock, about a second)."""
    with pytest.raises(TemplateBudgetError, match="render budget: more than") as exc:
        render_chat(NESTED_LOOPS, HI)
    assert (exc.value.limit, exc.value.value) in {("steps", 1_000_000), ("seconds", 2.0)}


@pytest.mark.timeout(10)
def test_nested_loops_stop_at_the_step_budget() -> None:
    """Without the clock in the way, the nested loop stops after exactly its step budget."""
    with pytest.raises(TemplateBudgetError, match="render budget: more than 200000 steps") as exc:
        render_chat(NESTED_LOOPS, HI, budget=RenderBudget(steps=200_000, seconds=60))
    assert exc.value.limit == "steps" and exc.value.value == 200_000


def test_steps_count_loop_iterations_and_calls() -> None:
    """One step per loop iteration and per call: range(10) plus its 10 iterations take exactly 11 steps."""
    template = "{% for x in range(10) %}{% endfor %}ok"
    assert render_chat(template, HI, budget=RenderBudget(steps=11)) == "ok"
    with pytest.raises(TemplateBudgetError, match="more than 10 steps"):
        render_chat(template, HI, budget=RenderBudget(steps=10))
    filtered = "{% for x in range(10) if x > 100 %}{% endfor %}ok"  # a loop filter's test is a step too
    with pytest.raises(TemplateBudgetError, match="more than 10 steps"):
        render_chat(filtered, HI, budget=RenderBudget(steps=10))


@pytest.mark.timeout(10)
def test_time_budget_is_checked_inside_the_render() -> None:
    """With a huge step budget the clock stops the render: the call itself returns, no thread is left running."""
    before = threading.active_count()
    with pytest.raises(TemplateBudgetError, match=r"more than 0.05 s") as exc:
        render_chat(NESTED_LOOPS, HI, budget=RenderBudget(steps=10**12, seconds=0.05))
    assert exc.value.limit == "seconds"
    assert threading.active_count() == before


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    ("template", "limit"),
    [
        # loops and recursion
        ("{% for a in range(100000) %}{% for b in range(100000) if false %}{% endfor %}{% endfor %}", "steps"),
        ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "depth"),
        ("{% for x in [1] recursive %}{{ loop([1]) }}{% endfor %}", "depth"),
        ("{% macro f(n) %}{% if n < 40 %}{{ f(n + 1) }}{{ f(n + 1) }}{% endif %}{% endmacro %}{{ f(0) }}", "steps"),
        # strings and lists that double, join or pad past the size bound
        ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "chars"),
        ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", "chars"),
        ("{% set ns = namespace(s=['x']) %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", "chars"),
        ("{% set l = ['x' * 1000] * 1000 %}{{ (l + l + l + l + l) | join }}", "chars"),
        ("{% set l = ['x' * 1000] * 1000 %}{{ ''.join(l + l + l + l + l) }}", "chars"),
        ("{% set l = ['x' * 1000] * 1000 %}{{ (l + l + l + l + l) | join(attribute='upper') }}", "chars"),
        ("{{ '{:>1000000000}'.format('x') }}", "chars"),
        ("{{ '{:>{}}'.format('x', 1000000000) }}", "chars"),
        ("{{ '%1000000000s' % 'x' }}", "chars"),
        ("{{ '%*s' % (1000000000, 'x') }}", "chars"),
        ("{{ 'x'.center(1000000000) }}", "chars"),
        ("{{ 'x' | center(1000000000) }}", "chars"),
        ("{{ ('x' * 1000) | replace('', 'y' * 1000000) }}", "chars"),
        ("{{ ('x' * 1000).replace('', 'y' * 1000000) }}", "chars"),
        ("{{ ('\n' * 1000000) | indent(1000, true) }}", "chars"),
        ("{{ [1] | batch(1000000000, 'x') | list }}", "chars"),
        ("{{ messages | tojson(indent=1000000000) }}", "chars"),
        # output
        ("{% for i in range(5000) %}{{ 'x' * 1000 }}{% endfor %}", "chars"),
    ],
)
def test_hostile_templates_stop_with_a_budget_error(template: str, limit: str) -> None:
    """Runaway loops, recursion and values that grow past the bounds stop with TemplateBudgetError naming the bound."""
    with pytest.raises(TemplateBudgetError, match="render budget") as exc:
        render_chat(template, HI, budget=RenderBudget(steps=20_000, seconds=60))  # the clock never decides
    assert exc.value.limit == limit


@pytest.mark.parametrize(
    "template",
    [
        "{% for x in range(10**6) %}{% endfor %}",
        "{{ (['x' * 1000000] * 1000000) | join }}",
        "{% set s = 'x' * 1000000 %}{{ [s] * 1000 }}",
    ],
)
def test_oversized_ranges_and_repetitions_are_blocked_by_the_sandbox(template: str) -> None:
    """A range past 100,000 items and a repetition past the size bound are refused before they are built."""
    with pytest.raises(TemplateError, match="sandbox|Range too big"):
        render_chat(template, HI)


def test_output_within_the_bound_renders() -> None:
    """Values and output just under the bounds still render (the bounds are not over-eager)."""
    out = render_chat("{{ 'x' * 1000000 }}{% for i in range(2000) %}{{ 'y' * 1000 }}{% endfor %}", HI)
    assert len(out) == 3_000_000 < MAX_OUTPUT_CHARS


def test_a_budget_error_leaves_other_renders_alone() -> None:
    """Each render has its own budget: a good render in another thread, during and after a runaway one, succeeds."""
    results: dict[str, Any] = {}

    def runaway() -> None:
        try:
            render_chat(NESTED_LOOPS, HI, budget=RenderBudget(seconds=0.5, steps=10**12))  # the clock stops it
        except TemplateBudgetError as exc:
            results["runaway"] = exc.limit

    t = threading.Thread(target=runaway)
    t.start()
    assert render_chat("{% for m in messages %}{{ m.role }}{% endfor %}", HI * 50) == "user" * 50
    t.join(timeout=10)
    assert results == {"runaway": "seconds"}
    assert render_chat("{% for m in messages %}{{ m.role }}{% endfor %}", HI) == "user"


def test_real_templates_render_as_plain_jinja_does(smollm2_template: str) -> None:
    """SmolLM2's and Gemma 3's templates give the same text as unbudgeted Jinja, for short and 400-turn chats."""
    for template in (smollm2_template, GEMMA3_TEMPLATE):
        for messages in (_chat(3), _chat(1, system=False), _chat(401)):
            for add in (True, False):
                kw: dict[str, Any] = dict(add_generation_prompt=add, bos_token="<s>", eos_token="</s>")
                assert render_chat(template, messages, **kw) == _unbounded_render(template, messages, **kw)


def test_gemma3_template_gives_llama_cpp_prompts() -> None:
    """Gemma 3's own template, under the budget, gives llama.cpp's prompt text for every chat case."""
    path = FIXTURES / "gemma3-270m-q4_k_m" / "greedy.jsonl"
    if not path.exists():
        missing(f"oracle fixture {path} is missing")
    import json

    cases = [r for r in map(json.loads, path.read_text(encoding="utf-8").splitlines()) if r["kind"] == "chat"]
    assert cases
    for case in cases:
        assert render_chat(GEMMA3_TEMPLATE, [{"role": "user", "content": case["message"]}]) == case["prompt_text"]


def test_long_chat_fits_the_request_budget(smollm2_template: str) -> None:
    """A 4,000-turn chat (far past any context the engine runs) renders within the default budget."""
    out = render_chat(smollm2_template, _chat(4000))
    assert out.count("<|im_start|>") == 4002


# --- load-time probe -----------------------------------------------------------------------


def test_probe_accepts_real_templates(smollm2_template: str) -> None:
    """SmolLM2's and Gemma 3's templates, and Mistral's that refuses a system turn, pass the load probe."""
    for template in (smollm2_template, GEMMA3_TEMPLATE, MISTRAL_TEMPLATE):
        probe_chat_template(template, path="m.gguf", bos_token="<s>", eos_token="</s>")
    with pytest.raises(TemplateError, match="roles must alternate"):  # Mistral really refuses the first probe
        render_chat(MISTRAL_TEMPLATE, [dict(m) for m in PROBE_CONVERSATIONS[0]])


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("template", "message"),
    [
        (NESTED_LOOPS, "render budget: more than 100000 steps"),
        ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "nested more than 64 deep"),
        ("{{ ''.__class__ }}", "sandbox"),
        ("{% for m in messages %}", "syntax error"),
        ("{{ raise_exception('this model takes no chat') }}", "this model takes no chat"),
        ("{{ messages[0].content.nope.deeper }}", "no attribute 'nope'"),
    ],
)
def test_probe_refuses_templates_that_cannot_render_a_small_chat(template: str, message: str) -> None:
    """A template over the probe budget, blocked by the sandbox, unparsable or failing on every probe chat is refused."""
    with pytest.raises(ModelFormatError, match=message) as exc:
        probe_chat_template(template, path="m.gguf")
    assert exc.value.key == "tokenizer.chat_template" and exc.value.path == "m.gguf"


def _synth_with_template(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, template: str, name: str) -> Path:
    monkeypatch.setattr(engine.synth, "CHATML", template)
    path = tmp_path / f"{name}.gguf"
    write_synthetic_gguf(path, "llama", name=name, **SHAPES["small"])
    monkeypatch.undo()
    return path


@pytest.mark.timeout(20)
def test_gguf_with_runaway_template_is_refused_at_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """load_model refuses a GGUF whose template loops past the probe budget, naming the key; a sane one loads."""
    bad = _synth_with_template(tmp_path, monkeypatch, NESTED_LOOPS, "runaway")
    with pytest.raises(ModelFormatError, match="render budget") as exc:
        load_model(bad, backend="numpy", n_ctx=64)
    assert exc.value.key == "tokenizer.chat_template" and exc.value.path == str(bad)
    good = _synth_with_template(tmp_path, monkeypatch, MISTRAL_TEMPLATE, "mistralish")
    model = load_model(good, backend="numpy", n_ctx=64)
    assert model.render_chat([{"role": "user", "content": "hi"}]).endswith("[INST] hi [/INST]")


# --- through the API -----------------------------------------------------------------------

# Fine on the probe's chats (at most 4 messages), a runaway loop from 6 messages on.
LATE_RUNAWAY = "{% if messages | length > 5 %}" + NESTED_LOOPS + "{% endif %}" + engine.synth.CHATML


@pytest.mark.timeout(60)
async def test_api_answers_400_for_a_chat_past_the_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A chat the template cannot render within its budget gets a 400 naming the budget; the daemon keeps serving."""
    path = _synth_with_template(tmp_path, monkeypatch, LATE_RUNAWAY, "late")
    sup = make_api_supervisor(
        tmp_path,
        f"models:\n  late: {{path: {path}, resident: true}}\napi: {{max_running: 1, max_queue: 4, warmup: false}}\n",
    )
    async with sup, http(sup) as client:
        r = await client.post("/v1/chat/completions", json={"messages": HI * 6, "max_tokens": 2})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert "render budget" in err["message"] and err["type"] == "invalid_request_error"
        r = await client.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
        assert isinstance(r.json()["choices"][0]["message"]["content"], str)
