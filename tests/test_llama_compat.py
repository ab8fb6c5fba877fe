"""llama-server's shapes where its clients rely on them, on the daemon serving SmolLM2 (CPU): the unprefixed
aliases, unknown model names, /health's readiness, the context-overflow body, /completion's fields, and
/tokenize, /detokenize, /apply-template, /props and /slots."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
import pytest

from genie_supervisor.api import create_app
from genie_supervisor.errors import UnknownModel
from tests.apitools import LLAMA_CPP_CONFIG, fake_llama_server, make_api_supervisor, oai
from tests.apitools import http as api_http
from tests.daemon import client, make_supervisor, write_policy
from tests.fake_llama_server import VOCAB
from tests.models import SMOLLM2, require, shared_model

pytestmark = pytest.mark.timeout(120)

MESSAGES: list[Any] = [{"role": "user", "content": "What is the capital of France?"}]
MODEL_ID = "SmolLM2-135M-Instruct.Q4_1"


@asynccontextmanager
async def _serving(tmp_path: Path, extra: str = "") -> AsyncIterator[tuple[Any, Any, httpx.AsyncClient]]:
    """The shared SmolLM2, a daemon serving it (`extra`: more config), and an HTTP client against it."""
    model = shared_model(require(SMOLLM2))
    policy = write_policy(tmp_path / "p.yaml")
    sup = make_supervisor(tmp_path, policy=policy, model=SMOLLM2, model_loader=lambda *_a, **_k: model, extra=extra)
    async with sup, client(sup) as http:
        yield model, sup, http


def _folder(path: Path) -> Path:
    """`path`, made (a second daemon's config folder)."""
    path.mkdir()
    return path


@contextmanager
def _unstarted(sup: Any) -> Iterator[Any]:
    """A Supervisor that is never run: its listening socket is closed at the end."""
    try:
        yield sup
    finally:
        sup._http_socket.close()


def _sse(text: str) -> list[Any]:
    events = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


async def test_unprefixed_aliases_answer_the_openai_client_with_cached_tokens_and_timings(tmp_path: Path) -> None:
    """/chat/completions, /completions and /models serve the openai client at the bare base URL; usage gives
    prompt_tokens_details.cached_tokens and the streamed usage chunk carries timings."""
    with anyio.fail_after(100):
        async with (
            _serving(tmp_path) as (model, sup, http),
            openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{sup.http.port}", api_key="x", max_retries=0) as oa,
        ):
            assert [m.id for m in (await oa.models.list()).data] == [MODEL_ID]
            chat = await oa.chat.completions.create(messages=MESSAGES, model="x", max_tokens=4, temperature=0)
            assert chat.choices[0].message.content and chat.usage is not None
            assert chat.usage.prompt_tokens == len(model.encode_chat(MESSAGES))
            assert chat.usage.prompt_tokens_details is not None
            again = await oa.chat.completions.create(messages=MESSAGES, model="x", max_tokens=4, temperature=0)
            assert again.usage is not None and again.usage.prompt_tokens_details is not None
            cached = again.usage.prompt_tokens_details.cached_tokens
            assert cached is not None and 0 < cached < again.usage.prompt_tokens  # the same prompt: its prefix cached
            text = await oa.completions.create(prompt="The capital of France is", model="x", max_tokens=3)
            assert text.object == "text_completion" and text.usage is not None

            for path, body in (
                ("/chat/completions", {"messages": MESSAGES}),
                ("/completions", {"prompt": "The capital of France is"}),
            ):
                r = await http.post(
                    path,
                    json={**body, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}},
                )
                events = _sse(r.text)
                assert events[-1] == "[DONE]"
                last = events[-2]
                assert last["choices"] == [] and last["usage"]["completion_tokens"] >= 1
                assert "cached_tokens" in last["usage"]["prompt_tokens_details"]
                assert last["timings"]["predicted_n"] == last["usage"]["completion_tokens"]
                assert {"prompt_n", "prompt_ms", "predicted_ms", "cache_n"} <= set(last["timings"])


async def test_an_unknown_model_name_is_served_by_the_one_model_unless_configured_off(tmp_path: Path) -> None:
    """With one model, any name is served by it (api.unknown_model: default); `error` keeps the 404; with several
    models an unknown name is always a 404."""
    with anyio.fail_after(100):
        async with _serving(tmp_path) as (_model, _sup, http):
            r = await http.post("/v1/chat/completions", json={"model": "gpt-4o", "messages": MESSAGES, "max_tokens": 1})
            assert r.status_code == 200 and r.json()["model"] == MODEL_ID
            r = await http.post("/completion", json={"model": "llama", "prompt": "Hi", "n_predict": 1})
            assert r.status_code == 200 and r.json()["model"] == MODEL_ID
            assert (await http.post("/unload", json={"model": "gpt-4o"})).status_code == 404  # not a generation
    with anyio.fail_after(100):
        async with _serving(_folder(tmp_path / "strict"), extra="api: {warmup: false, unknown_model: error}") as (
            _m,
            _s,
            http,
        ):
            r = await http.post("/v1/chat/completions", json={"model": "gpt-4o", "messages": MESSAGES, "max_tokens": 1})
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    two = f"models:\n  a: {{path: {SMOLLM2}, roles: [voice]}}\n  b: {{path: {SMOLLM2}, roles: [brain]}}\n"
    with _unstarted(
        make_supervisor(_folder(tmp_path / "two"), policy=write_policy(tmp_path / "p2.yaml"), extra=two)
    ) as sup:
        assert sup.models.resolve("brain", fallback=True).id == "b"
        with pytest.raises(UnknownModel):
            sup.models.resolve("gpt-4o", fallback=True)


async def test_health_is_503_until_the_resident_models_are_ready(tmp_path: Path) -> None:
    """Before the model manager has loaded the residents /health answers 503 loading (it said 200 before the first
    load began); once they are ready, 200 ok."""
    model = shared_model(require(SMOLLM2))
    policy = write_policy(tmp_path / "p.yaml")
    loader = lambda *_a, **_k: model  # noqa: E731
    with _unstarted(
        make_supervisor(_folder(tmp_path / "early"), policy=policy, model=SMOLLM2, model_loader=loader)
    ) as early:
        app = create_app(early._api_deps())  # the routes of a daemon whose models have not started loading
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as c:
            r = await c.get("/health")
        assert early.models.models[MODEL_ID].state == "unloaded"
    assert r.status_code == 503 and r.json()["status"] == "loading"
    with anyio.fail_after(100):
        async with _serving(tmp_path) as (_model, _sup, http):
            r = await http.get("/health")
            assert r.status_code == 200 and r.json()["status"] == "ok"


async def test_context_overflow_keeps_openai_code_and_adds_llama_server_numbers(tmp_path: Path) -> None:
    """A prompt plus max_tokens over the context is a 400 context_length_exceeded with n_prompt_tokens and n_ctx."""
    with anyio.fail_after(100):
        async with _serving(tmp_path) as (model, _sup, http):
            n_ctx = model.info.n_ctx
            r = await http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": n_ctx})
            err = r.json()["error"]
            assert r.status_code == 400 and err["code"] == "context_length_exceeded"
            assert err["n_prompt_tokens"] == len(model.encode_chat(MESSAGES)) and err["n_ctx"] == n_ctx
            r = await http.post("/completion", json={"prompt": "Hi there", "n_predict": n_ctx})
            err = r.json()["error"]
            assert err["n_prompt_tokens"] == len(model.tokenizer.encode("Hi there")) and err["n_ctx"] == n_ctx


async def test_completion_gives_tokens_cache_settings_and_decode_speed_as_llama_server(tmp_path: Path) -> None:
    """/completion: tokens in each chunk and the final object, timings.cache_n, the whole generation_settings as
    asked, completion_probabilities with n_probs, and predicted_per_second over the n-1 decode steps."""
    with anyio.fail_after(100):
        async with _serving(tmp_path) as (model, _sup, http):
            hello = model.tokenizer.encode(" Hello", add_special=False)[0]
            ask = {
                "prompt": "Once upon a time",
                "n_predict": 8,
                "temperature": 0,
                "top_k": 20,
                "top_p": 0.9,
                "min_p": 0.1,
                "seed": 7,
                "stop": ["\n\n"],
                "repeat_penalty": 1.1,
                "repeat_last_n": 32,
                "ignore_eos": True,
                "n_probs": 2,
                "logit_bias": [[hello, -0.5]],
            }
            body = (await http.post("/completion", json=ask)).json()
            assert body["stop"] is True and body["tokens_predicted"] == 8 == len(body["tokens"])
            assert model.tokenizer.decode(body["tokens"]) == body["content"]
            settings = body["generation_settings"]
            for key in ("n_predict", "temperature", "top_k", "top_p", "min_p", "seed", "stop", "n_probs"):
                assert settings[key] == ask[key], key
            assert settings["repeat_penalty"] == 1.1 and settings["repeat_last_n"] == 32 and settings["ignore_eos"]
            assert settings["logit_bias"] == [{"bias": -0.5, "token": hello}]
            assert settings["grammar"] == "" and settings["json_schema"] is None
            assert settings["n_ctx"] == model.info.n_ctx and settings["model"] == MODEL_ID
            assert {"mirostat", "dry_multiplier", "samplers", "typical_p", "stream"} <= set(settings)
            probs = body["completion_probabilities"]
            assert [p["id"] for p in probs] == body["tokens"] and all(len(p["top_logprobs"]) == 2 for p in probs)

            t = body["timings"]
            assert (
                t["predicted_n"] == 8 and t["cache_n"] >= 0 and t["prompt_n"] + t["cache_n"] == body["tokens_evaluated"]
            )
            assert t["predicted_per_second"] == pytest.approx(7 * 1000.0 / t["predicted_ms"], rel=0.02)

            again = (await http.post("/completion", json={**ask, "stream": True})).text
            events = _sse(again)
            chunks, final = events[:-1], events[-1]
            assert all(c["stop"] is False and "tokens" in c for c in chunks)
            streamed = [t for c in chunks for t in c["tokens"]]
            assert len(streamed) == final["tokens_predicted"] == chunks[-1]["tokens_predicted"] == 8
            assert model.tokenizer.decode(streamed) == "".join(c["content"] for c in chunks)
            assert final["stop"] is True and final["tokens"] == [] and final["content"] == ""
            assert final["timings"]["cache_n"] > 0  # the same prompt again: its prefix came from the cache
            assert sum(len(c["completion_probabilities"]) for c in chunks) == 8

            schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
            body = (
                await http.post(
                    "/completion", json={"prompt": "JSON:", "n_predict": 16, "json_schema": schema}, timeout=60
                )
            ).json()
            assert body["generation_settings"]["json_schema"] == schema
            gbnf = 'root ::= "yes" | "no"'
            body = (
                await http.post("/completion", json={"prompt": "Answer:", "n_predict": 4, "grammar": gbnf}, timeout=60)
            ).json()
            assert body["generation_settings"]["grammar"] == gbnf and body["content"] in ("yes", "no")


async def test_tokenize_detokenize_and_apply_template_use_the_model(tmp_path: Path) -> None:
    """/tokenize (add_special, with_pieces), /detokenize and /apply-template answer with the model's tokenizer and
    chat template; a token id outside the vocabulary is a 400 naming tokens."""
    with anyio.fail_after(100):
        async with _serving(tmp_path) as (model, _sup, http):
            tok = model.tokenizer
            text = "Hello world <|im_start|> é"
            ids = (await http.post("/tokenize", json={"content": text})).json()["tokens"]
            assert ids == tok.encode(text, add_special=False, parse_special=True)
            plain = (await http.post("/tokenize", json={"content": text, "parse_special": False})).json()["tokens"]
            assert plain == tok.encode(text, add_special=False, parse_special=False) and plain != ids
            special = (await http.post("/tokenize", json={"content": text, "add_special": True})).json()["tokens"]
            assert special == tok.encode(text, add_special=True, parse_special=True)
            pieces = (await http.post("/tokenize", json={"content": text, "with_pieces": True})).json()["tokens"]
            assert [p["id"] for p in pieces] == ids
            spelled = b"".join(
                p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces
            )
            assert spelled.decode() == text

            assert (await http.post("/detokenize", json={"tokens": ids})).json() == {"content": text}
            bad = await http.post("/detokenize", json={"tokens": [1, tok.n_vocab]})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens[1]"
            assert (await http.post("/tokenize", json={"content": 5})).status_code == 400

            chat = [{"role": "system", "content": "Be brief."}, *MESSAGES]
            r = await http.post("/apply-template", json={"messages": chat})
            assert r.json() == {"prompt": model.render_chat(chat)}
            assert (await http.post("/apply-template", json={"messages": []})).status_code == 400


async def test_props_and_slots_describe_the_model_read_only(tmp_path: Path) -> None:
    """/props gives llama-server's default_generation_settings, total_slots, model_path, chat_template and n_ctx;
    /slots one slot per model with its state, ?fail_on_no_slot=1 is 200 while it is idle, a non-integer 400."""
    with anyio.fail_after(100):
        async with _serving(tmp_path) as (model, _sup, http):
            props = (await http.get("/props")).json()
            dgs = props["default_generation_settings"]
            assert dgs["n_ctx"] == model.info.n_ctx == props["n_ctx"] and dgs["is_processing"] is False
            params = dgs["params"]
            assert params["temperature"] == 0.8 and params["top_k"] == 40 and params["n_predict"] == -1
            assert params["top_p"] == 0.95 and params["min_p"] == 0.05 and params["samplers"]
            assert props["total_slots"] == 1 and props["model_path"] == str(SMOLLM2)
            assert props["chat_template"] == model.chat_template and props["is_sleeping"] is False
            assert props["bos_token"] is not None and props["modalities"] == {"vision": False, "audio": False}
            assert (await http.get("/props", params={"model": "whatever"})).json()["model_path"] == str(SMOLLM2)

            slots = (await http.get("/slots")).json()
            assert len(slots) == 1
            assert slots[0]["id"] == 0 and slots[0]["model"] == MODEL_ID and slots[0]["state"] == "ready"
            assert slots[0]["is_processing"] is False and slots[0]["n_ctx"] == model.info.n_ctx
            assert (await http.get("/slots", params={"fail_on_no_slot": 1})).status_code == 200
            bad = await http.get("/slots", params={"fail_on_no_slot": "yes"})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "fail_on_no_slot"
            assert (await http.post("/slots", json={})).status_code == 405  # read only


async def test_helper_routes_of_a_llama_cpp_model_are_passed_on_to_its_llama_server(tmp_path: Path) -> None:
    """On the llama_cpp backend /tokenize, /detokenize, /apply-template and /props answer what its llama-server
    says; /slots stays the daemon's own."""
    async with fake_llama_server("-c", "512") as (port, _):
        with anyio.fail_after(60):
            sup = make_api_supervisor(tmp_path, LLAMA_CPP_CONFIG.format(port=port))
            async with sup, api_http(sup) as c:
                ids = (await c.post("/tokenize", json={"content": "Hello fake server"})).json()["tokens"]
                assert ids == [VOCAB.index("Hello"), VOCAB.index("fake"), VOCAB.index("server")]
                assert (await c.post("/detokenize", json={"tokens": ids})).json() == {"content": "Hello fake server"}
                r = await c.post("/apply-template", json={"messages": MESSAGES})
                assert r.json() == {"prompt": f"<user>{MESSAGES[0]['content']}\n<assistant>"}
                props = (await c.get("/props")).json()
                assert props["total_slots"] == 4 and props["chat_template"] == "fake"
                slots = (await c.get("/slots")).json()
                assert [(x["model"], x["state"], x["n_ctx"]) for x in slots] == [("remote", "ready", 512)]


@pytest.mark.parametrize("legacy", [False, True])
async def test_an_upstream_llama_servers_overflow_gets_the_same_400_body_as_ours(tmp_path: Path, legacy: bool) -> None:
    """Through the llama_cpp backend llama-server's context overflow is a 400 context_length_exceeded with
    n_prompt_tokens and n_ctx, on chat (streamed or not, and to the openai client) and /completion; an older
    llama-server's body without the numbers gets them from its /props and /tokenize."""
    words = "w " * 80
    messages = [{"role": "user", "content": words}]
    async with fake_llama_server("-c", "64", *(["--legacy-overflow"] if legacy else [])) as (port, _):
        with anyio.fail_after(60):
            sup = make_api_supervisor(tmp_path, LLAMA_CPP_CONFIG.format(port=port))
            async with sup, api_http(sup) as c, oai(sup) as oa:
                rendered = (await c.post("/apply-template", json={"messages": messages})).json()["prompt"]
                chat_tokens = (
                    80 + 2
                    if not legacy
                    else len((await c.post("/tokenize", json={"content": rendered})).json()["tokens"])
                )
                for stream in (False, True):
                    body = {"messages": messages, "max_tokens": 4, "stream": stream}
                    r = await c.post("/v1/chat/completions", json=body)
                    err = r.json()["error"]
                    assert r.status_code == 400 and err["code"] == "context_length_exceeded", r.text
                    assert (err["n_prompt_tokens"], err["n_ctx"], err["type"]) == (
                        chat_tokens,
                        64,
                        "invalid_request_error",
                    )
                    assert "exceeds the available context size" in err["message"]
                    assert ("asked of llama-server" in err["message"]) == legacy
                r = await c.post("/completion", json={"prompt": words, "n_predict": 4})
                err = r.json()["error"]
                assert r.status_code == 400 and (err["code"], err["n_prompt_tokens"], err["n_ctx"]) == (
                    "context_length_exceeded",
                    80,
                    64,
                )
                with pytest.raises(openai.BadRequestError) as info:
                    await oa.chat.completions.create(model="remote", messages=messages, max_tokens=4)
                assert info.value.code == "context_length_exceeded"
