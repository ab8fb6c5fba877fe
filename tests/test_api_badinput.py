"""Bad input on every POST route of the running daemon (SmolLM2) is a clean 4xx JSON error, never a 500.

Generated bodies follow the route schemas (valid shapes with bad values, wrong types, missing and
extra fields, unicode, NUL bytes, lone surrogates, invalid UTF-8, deep nesting, huge numbers);
explicit regressions pin the three 500s a probe found (JSON nested 1,000 and 100,000 levels, token
ids outside the vocabulary on /v1/completions and /completion). One daemon serves the module: it
runs in a thread of its own (an anyio blocking portal) so hypothesis drives it with a plain client.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import SamplingParams
from genie_supervisor.app import Supervisor
from genie_supervisor.jsonlimits import (
    MAX_DEPTH,
    JsonDepthError,
    check_depth,
    loads_bounded,
    max_depth,
)
from tests.daemon import write_config, write_policy
from tests.models import SMOLLM2, require, shared_model
from tests.serving_daemon import api, threaded_daemon

__all__ = ["api"]  # the HTTP client fixture, against this module's daemon

pytestmark = pytest.mark.timeout(120)

N_VOCAB = 49152
"""SmolLM2's vocabulary."""
ROUTES = (
    "/v1/chat/completions",
    "/v1/completions",
    "/completion",
    "/chat/completions",
    "/completions",
    "/tokenize",
    "/detokenize",
    "/apply-template",
    "/unload",
    "/v1/voice/events",
)
"""Every POST route."""
JSON = {"content-type": "application/json"}
GENERATED = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
"""Generation routes: 60 examples each, reproducible."""
FEWER = settings(GENERATED, max_examples=50)
"""The small control routes: 50 examples each."""


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Supervisor]:
    """The daemon on SmolLM2 (requests naming no max_tokens get 2), run by a thread of its own.

    It loads the model itself, not the session's shared one: generated ``/unload`` requests close it.
    """
    require(SMOLLM2)
    tmp = tmp_path_factory.mktemp("badinput")
    cfg = write_config(
        tmp / "supervisor.yaml",
        write_policy(tmp / "p.yaml"),
        model=SMOLLM2,
        extra="api: {warmup: false, default_max_tokens: 2}",
    )
    with threaded_daemon(cfg) as sup:
        yield sup


def post(api: httpx.Client, route: str, body: Any) -> httpx.Response:
    """POST `body` (bytes as they are, anything else as JSON) with a JSON content type."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return api.post(route, content=raw, headers=JSON)


def assert_clean(r: httpx.Response) -> dict[str, Any] | None:
    """Below 500; a 4xx is an OpenAI-shaped JSON error; a streamed 200 carries no server error. The error, if any."""
    assert r.status_code < 500, f"{r.status_code}: {r.text[:300]}"
    if r.status_code >= 400:
        assert r.headers["content-type"].startswith("application/json"), r.text[:300]
        error = r.json()["error"]
        assert isinstance(error["message"], str) and error["message"], error
        assert error["type"] == "invalid_request_error" and "code" in error, error
        assert error.get("param") is None or isinstance(error["param"], str), error
        return dict(error)
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        events = [
            json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"
        ]
        assert not [e for e in events if "error" in e], events
    return None


def assert_error(r: httpx.Response, status: int, message: str, param: str | None = None) -> None:
    """An error answer with this status, message and param."""
    error = assert_clean(r)
    assert r.status_code == status and error is not None, r.text[:300]
    assert error["message"] == message and error["param"] == param, error


def nested(depth: int, inner: bytes = b"1") -> bytes:
    """`inner` inside `depth` arrays."""
    return b"[" * depth + inner + b"]" * depth


# -- strategies: the schemas' fields, each either a good value or a bad one -------------------------

NASTY = [
    "",
    "\x00",
    "a\x00b",
    "\ud800",
    "\udfff",
    "é",
    "\U0001f600",
    "<|im_end|>",
    "{{ x }}",
    "%s%n",
    "\u202e",
    "\r\n",
    "default",
    "voice",
]
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.sampled_from(NASTY),
)
anything = st.recursive(
    scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3), max_leaves=6
)
numbers = st.one_of(
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, -1, 1, 2, 0.5, -0.0, 1e308, 2**63, 2**64, 10**30, -(10**30)]),
)
texts = st.one_of(st.text(max_size=12), st.sampled_from(NASTY))
ids = st.one_of(st.integers(0, N_VOCAB - 1), st.integers(), st.sampled_from([-1, N_VOCAB - 1, N_VOCAB, 2**63, 10**40]))


Spec = dict[str, tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]]
"""Field name -> (valid values, bad values of the field's kind)."""


def field(good: st.SearchStrategy[Any], bad: st.SearchStrategy[Any] = numbers) -> st.SearchStrategy[Any]:
    """Mostly a valid value of the field, else a bad one of its kind, else any JSON at all."""
    return st.one_of(good, good, good, good, bad, anything)


few_tokens = (
    st.sampled_from([1, 2]),
    st.sampled_from([0, -1, -2, 4097, 1_048_577, 2**64, 10**30, 1.0, 1.5, "1", True, None, [], {}]),
)
"""max_tokens / n_predict: 1 or 2 when valid, so that a generation is quick."""
unit = st.floats(0, 1)
SAMPLING: Spec = {
    "model": (st.sampled_from(["default", "SmolLM2-135M-Instruct.Q4_1"]), st.sampled_from(["nope", ""]) | texts),
    "temperature": (st.floats(0, 2), numbers),
    "top_p": (unit, numbers),
    "min_p": (unit, numbers),
    "top_k": (st.integers(0, 100_000), numbers),
    "seed": (st.integers(-1, 2**64 - 1), numbers),
    "stop": (
        st.lists(st.text(max_size=4), max_size=3) | st.text(max_size=4),
        st.lists(texts, max_size=20) | texts | st.just(["a" * 1025]),
    ),
    "stream": (st.booleans(), numbers | texts),
    "priority": (st.sampled_from(["voice", "tool", "background"]), texts),
}
OPENAI: Spec = {
    **SAMPLING,
    "n": (st.just(1), numbers),
    "stream_options": (
        st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
        st.fixed_dictionaries({"include_usage": anything}) | numbers,
    ),
}
ROLES = ["system", "developer", "user", "assistant", "tool"]
good_message = st.fixed_dictionaries(
    {"role": st.sampled_from(ROLES)},
    optional={
        "content": st.text(max_size=12)
        | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=8)}), max_size=2),
        "name": st.text(max_size=6),
    },
)
part = st.fixed_dictionaries(
    {"type": field(st.just("text"), st.sampled_from(["image_url", ""]))},
    optional={"text": field(st.text(max_size=12), texts)},
)
any_message = st.fixed_dictionaries(
    {"role": field(st.sampled_from(ROLES), st.just("bob") | texts)},
    optional={
        "content": field(st.text(max_size=12) | st.lists(part, max_size=2) | st.none(), texts),
        "name": field(st.text(max_size=6), texts),
    },
)
extra = st.dictionaries(st.text(max_size=8), anything, max_size=2)
prompt_ids = st.lists(st.integers(0, N_VOCAB - 1), min_size=1, max_size=6)


def body(required: Spec, optional: Spec) -> st.SearchStrategy[Any]:
    """A route's body: one field bad; many bad; a required one missing; valid with extra fields; not JSON at all."""
    spec = {**required, **optional}
    valid = st.fixed_dictionaries(
        {k: g for k, (g, _) in required.items()}, optional={k: g for k, (g, _) in optional.items()}
    )
    one_bad = st.sampled_from(sorted(spec)).flatmap(
        lambda k: st.builds(lambda d, v: {**d, k: v}, valid, spec[k][1] | anything)
    )
    many_bad = st.fixed_dictionaries(
        {k: field(g, b) for k, (g, b) in required.items()}, optional={k: field(g, b) for k, (g, b) in optional.items()}
    )
    shaped = st.one_of(one_bad, one_bad, one_bad, many_bad, st.builds(lambda d, e: {**e, **d}, valid, extra))
    if required:
        shaped |= st.builds(
            lambda d, k: {f: v for f, v in d.items() if f != k}, valid, st.sampled_from(sorted(required))
        )
    encoded = st.builds(
        lambda v, ascii_: json.dumps(v, ensure_ascii=ascii_).encode("utf-8", "surrogatepass"), shaped, st.booleans()
    )
    raw = st.one_of(
        st.binary(max_size=40),
        st.sampled_from(
            [
                b"",
                b"\x00",
                b"{",
                b"null",
                b"[]",
                b'{"a":1}{',
                b"\xff\xfe{}",
                b'{"max_tokens": 1' + b"0" * 5000 + b"}",
                nested(MAX_DEPTH + 1),
                nested(3000),
                b'{"x":' + nested(MAX_DEPTH) + b"}",
            ]
        ),
    )
    return st.one_of(shaped, shaped, encoded, raw)


CHAT = body(
    {
        "messages": (
            st.lists(good_message, min_size=1, max_size=3),
            st.lists(any_message, max_size=3) | st.lists(anything, max_size=2),
        ),
        "max_tokens": few_tokens,
    },
    {**OPENAI, "max_completion_tokens": few_tokens},
)
COMPLETIONS = body(
    {
        "prompt": (
            st.text(min_size=1, max_size=12) | prompt_ids | st.lists(prompt_ids, min_size=1, max_size=1),
            st.lists(ids, max_size=6)
            | st.lists(st.lists(ids, max_size=4), max_size=2)
            | st.lists(texts, max_size=2)
            | texts,
        ),
        "max_tokens": few_tokens,
    },
    OPENAI,
)
LLAMA = body(
    {
        "prompt": (
            st.text(min_size=1, max_size=12) | prompt_ids,
            st.lists(ids, max_size=6) | st.lists(ids | texts, max_size=4) | texts,
        ),
        "n_predict": few_tokens,
    },
    {
        **SAMPLING,
        "repeat_penalty": (st.floats(0.5, 2), numbers),
        "repeat_last_n": (st.integers(0, 64), numbers),
        "ignore_eos": (st.booleans(), numbers),
        "stop": (st.lists(st.text(max_size=4), max_size=3), st.lists(texts, max_size=20) | texts),
    },
)
UNLOAD = body({}, {"model": (st.sampled_from(["default", "nope"]), texts), "force": (st.booleans(), numbers | texts)})
MODEL: Spec = {"model": SAMPLING["model"]}
TOKENIZE = body(
    {"content": (st.text(max_size=12), numbers)},
    {
        **MODEL,
        "add_special": (st.booleans(), numbers | texts),
        "parse_special": (st.booleans(), numbers),
        "with_pieces": (st.booleans(), numbers),
    },
)
DETOKENIZE = body({"tokens": (st.lists(ids, max_size=6), st.lists(ids | texts, max_size=4) | texts)}, MODEL)
APPLY_TEMPLATE = body(
    {"messages": (st.lists(good_message, min_size=1, max_size=3), st.lists(any_message, max_size=3) | texts)}, MODEL
)
VOICE = body(
    {},
    {
        "service": (st.sampled_from(["stt", "tts"]), st.just("wake") | texts),
        "event": (st.sampled_from(["start", "stop"]), st.just("maybe") | texts),
        "session": (st.text(max_size=6), numbers),
    },
)


# -- the depth scan on its own ------------------------------------------------------------------------


def _depth(value: Any) -> int:
    """The reference: nesting depth by recursion (fine at the sizes generated)."""
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(
    st.recursive(
        scalars | st.sampled_from(['"[', '\\"[{', "\\", "]}\\\\"]),
        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
        max_leaves=30,
    ),
    st.booleans(),
)
def test_max_depth_agrees_with_a_recursive_count(value: Any, ascii_: bool) -> None:
    """The scan's depth of any JSON document (brackets and escapes inside strings too) equals a recursive count."""
    raw = json.dumps(value, ensure_ascii=ascii_)
    assert max_depth(raw) == max_depth(raw.encode("utf-8", "surrogatepass")) == _depth(value)
    limit = _depth(value)
    check_depth(raw, limit)
    if limit:
        with pytest.raises(JsonDepthError):
            check_depth(raw, limit - 1)


def test_deep_documents_are_refused_without_recursion() -> None:
    """100,000 open brackets, closed or not, are refused by a scan that does not recurse; the limit itself passes."""
    for raw in (nested(100_000), b"[" * 100_000, b'{"a":' * 100_000):
        with pytest.raises(JsonDepthError, match=f"JSON nested deeper than {MAX_DEPTH} levels"):
            loads_bounded(raw)
    assert loads_bounded(nested(MAX_DEPTH)) is not None
    with pytest.raises(JsonDepthError):
        loads_bounded(nested(MAX_DEPTH + 1))
    with pytest.raises(ValueError, match="Expecting"):
        loads_bounded(b"[1,]")  # ordinary bad JSON is still json's ValueError


def test_engine_refuses_prompt_ids_outside_the_vocabulary() -> None:
    """The engine itself names the first prompt id outside 0..n_vocab-1 (negative ones too) before generating."""
    model = shared_model(require(SMOLLM2))
    for bad, i in (([1, N_VOCAB], 1), ([-1, 2], 0)):
        with pytest.raises(
            ValueError,
            match=rf"prompt\[{i}\]: token id {bad[i]} is outside the vocabulary "
            rf"\(0\.\.{N_VOCAB - 1}\)",
        ):
            model.generate(bad, SamplingParams(max_tokens=1))


# -- regressions: the 500s a probe found -------------------------------------------------------------


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("depth", [1_000, 100_000])
def test_deep_json_is_a_400_naming_the_limit(api: httpx.Client, route: str, depth: int) -> None:
    """A body nested 1,000 or 100,000 levels (bare, or as a field) is a JSON 400 saying how deep is allowed."""
    message = f"the body is JSON nested deeper than {MAX_DEPTH} levels"
    for raw in (nested(depth), b'{"prompt": ' + nested(depth) + b', "messages": []}'):
        r = post(api, route, raw)
        assert_error(r, 400, message)
        assert r.json()["error"]["code"] == "json_too_deep"


def test_json_as_deep_as_the_limit_is_served(api: httpx.Client) -> None:
    """A request whose ignored extra field nests exactly to the limit is answered normally."""
    raw = b'{"prompt": "Hi", "max_tokens": 1, "x": ' + nested(MAX_DEPTH - 1) + b"}"
    r = post(api, "/v1/completions", raw)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 1


@pytest.mark.parametrize("stream", [False, True])
def test_token_ids_outside_the_vocabulary_are_a_400_naming_the_id(api: httpx.Client, stream: bool) -> None:
    """Ids >= n_vocab or negative, in any token-id prompt shape, are a 400 naming prompt[i] (streaming too); edge ids work."""
    vocab = f"(0..{N_VOCAB - 1})"
    cases = [
        ("/v1/completions", {"prompt": [1, 2, 3, N_VOCAB], "max_tokens": 1}, "prompt[3]", N_VOCAB),
        ("/v1/completions", {"prompt": [1, -5], "max_tokens": 1}, "prompt[1]", -5),
        ("/v1/completions", {"prompt": [[7, 10**40]], "max_tokens": 1}, "prompt[0][1]", None),
        ("/completion", {"prompt": [N_VOCAB + 7, 1], "n_predict": 1}, "prompt[0]", N_VOCAB + 7),
        ("/completion", {"prompt": [1, 2, -1], "n_predict": 1}, "prompt[2]", -1),
    ]
    for route, request, param, bad in cases:
        r = post(api, route, {**request, "stream": stream})
        shown = str(bad) if bad is not None else "1000000000000000000... (41 digits)"
        assert_error(r, 400, f"{param}: token id {shown} is outside the vocabulary {vocab}", param)
    for route, request in (
        ("/v1/completions", {"prompt": [0, N_VOCAB - 1], "max_tokens": 1}),
        ("/v1/completions", {"prompt": [[1, 2]], "max_tokens": 1}),
        ("/completion", {"prompt": [N_VOCAB - 1, 0], "n_predict": 1}),
    ):
        r = post(api, route, {**request, "stream": stream})
        assert r.status_code == 200 and assert_clean(r) is None, r.text


def test_parseable_but_invalid_values_are_named_400s(api: httpx.Client) -> None:
    """NaN and infinities, out-of-range seeds, too many or too long stops, lone surrogates, mixed prompts: named 400s."""
    chat: dict[str, Any] = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    cases: list[tuple[str, bytes | dict[str, Any], str | None, str]] = [
        ("/v1/completions", b'{"prompt": "Hi", "max_tokens": 1, "temperature": 1e999}', "temperature", "finite"),
        ("/v1/chat/completions", json.dumps({**chat, "top_p": float("nan")}).encode(), "top_p", "finite"),
        ("/completion", b'{"prompt": "Hi", "n_predict": 1, "min_p": -Infinity}', "min_p", "finite"),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 1, "seed": 2**64}, "seed", "less than or equal"),
        ("/completion", {"prompt": "Hi", "n_predict": 1, "seed": -2}, "seed", "greater than or equal"),
        ("/v1/chat/completions", {**chat, "stop": ["x"] * 17}, "stop", "at most 16 stop strings"),
        ("/completion", {"prompt": "Hi", "n_predict": 1, "stop": ["x"] * 17}, "stop", "at most 16 stop strings"),
        ("/v1/chat/completions", {**chat, "stop": ["ok", "y" * 1025]}, "stop[1]", "at most 1024 characters"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 1}',
            "messages.0.content",
            "lone UTF-16 surrogate",
        ),
        ("/v1/chat/completions", {**chat, "model": "m" * 257}, "model", "at most 256 characters"),
        ("/v1/chat/completions", {**chat, "n": 2}, "n", "n must be 1"),
        ("/v1/chat/completions", {**chat, "messages": []}, "messages", "at least 1 item"),
        ("/v1/completions", {"prompt": [], "max_tokens": 1}, "prompt", "the prompt is empty"),
        ("/v1/completions", {"prompt": [[]], "max_tokens": 1}, "prompt[0]", "the prompt is empty"),
        ("/v1/completions", {"prompt": [[1], [2]], "max_tokens": 1}, "prompt", "one prompt per request"),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
        ("/v1/completions", {"prompt": "Hi " * 4200, "max_tokens": 1}, None, "context"),
        (
            "/completion",
            {"prompt": [1, "x"], "n_predict": 1},
            "prompt",
            "a list prompt holds token ids (integers), all of one kind; got strings and token ids (integers)",
        ),
        ("/v1/completions", {"prompt": [[1], 2], "max_tokens": 1}, "prompt", "all of one kind"),
        (
            "/completion",
            {"prompt": "Hi", "n_predict": 1, "repeat_penalty": 5e-324},
            "repeat_penalty",
            "greater than or equal to 0.000001",
        ),
    ]
    for route, request, param, words in cases:
        r = post(api, route, request)
        error = assert_clean(r)
        assert r.status_code == 400 and error is not None, (route, request, r.text[:300])
        assert words in error["message"] and error["param"] == param, (route, error)


def test_a_vanishing_temperature_is_greedy(api: httpx.Client) -> None:
    """A temperature of 5e-324 (valid, but logits / T overflows) answers as temperature 0 does."""
    texts = []
    for temperature in (0, 5e-324, 1e-31):
        r = post(
            api,
            "/v1/completions",
            {"prompt": "The capital of France is", "max_tokens": 3, "temperature": temperature, "seed": 1},
        )
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["text"])
    assert texts[0] == texts[1] == texts[2] and texts[0]


def test_an_unexpected_exception_in_a_route_is_a_json_500(daemon: Supervisor, api: httpx.Client) -> None:
    """A bug inside a route (not bad input) still answers in the OpenAI error shape, as JSON."""
    sup: Any = daemon

    def broken() -> dict[str, Any]:
        raise RuntimeError("a bug")

    sup.status = broken
    try:
        r = api.get("/status")
    finally:
        del sup.status
    assert r.status_code == 500 and r.headers["content-type"].startswith("application/json")
    assert r.json()["error"] == {
        "message": "internal error: RuntimeError",
        "type": "server_error",
        "param": None,
        "code": "internal_error",
    }
    assert api.get("/status").status_code == 200


# -- generated bad input, route by route (voice events and unload last: they change state) ------------


GENERATION_ROUTES = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETIONS, "/completion": LLAMA}
"""The generation routes and the strategies of their bodies."""


@GENERATED
@pytest.mark.parametrize("route", GENERATION_ROUTES)
@given(data=st.data())
def test_generated_generation_requests_never_500(api: httpx.Client, route: str, data: st.DataObject) -> None:
    """Generated bodies of each generation route get < 500, and a JSON error when refused."""
    assert_clean(post(api, route, data.draw(GENERATION_ROUTES[route], label="request_body")))


HELPER_ROUTES = {"/tokenize": TOKENIZE, "/detokenize": DETOKENIZE, "/apply-template": APPLY_TEMPLATE}
"""llama-server's helper routes and the strategies of their bodies."""


@FEWER
@pytest.mark.parametrize("route", HELPER_ROUTES)
@given(data=st.data())
def test_generated_llama_helper_requests_never_500(api: httpx.Client, route: str, data: st.DataObject) -> None:
    """Generated /tokenize, /detokenize and /apply-template bodies get < 500, and a JSON error when refused."""
    assert_clean(post(api, route, data.draw(HELPER_ROUTES[route], label="request_body")))


@FEWER
@given(VOICE)
def test_generated_voice_events_never_500(api: httpx.Client, request_body: Any) -> None:
    """Generated /v1/voice/events bodies get < 500, and a JSON error when refused."""
    r = post(api, "/v1/voice/events", request_body)
    if r.status_code == 200 and r.json()["active"]:  # a generated "start" must not pause what follows
        stop = {"service": r.json()["service"], "event": "stop", "session": r.json()["session"]}
        post(api, "/v1/voice/events", {k: v for k, v in stop.items() if v is not None}).raise_for_status()
    assert_clean(r)


@FEWER
@given(UNLOAD)
def test_generated_unload_requests_never_500(api: httpx.Client, request_body: Any) -> None:
    """Generated /unload bodies get < 500, and a JSON error when refused."""
    assert_clean(post(api, "/unload", request_body))
