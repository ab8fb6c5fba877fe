"""GGUF tokenizers agree with llama.cpp on the real models (ids, prompts, decoding, stop tokens)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine.errors import ModelFormatError
from engine.gguf_file import GGUFFile, read_gguf
from engine.tokenizer import StreamDecoder, Tokenizer, build_tokenizer
from engine.tokenizer_bpe import PRE_TOKENIZERS, BPEModel, byte_encode
from tests.models import CACHE, FIXTURES, missing

MODELS_DIR = CACHE
FIXTURES_DIR = FIXTURES
MODELS = {
    "smollm2": ("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m-q4_1"),
    "gemma3": ("gemma-3-270m-q4_k_m.gguf", "gemma3-270m-q4_k_m"),
}


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        missing(f"oracle fixture {path} is missing")
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request: pytest.FixtureRequest) -> tuple[str, Tokenizer, str]:
    """(name, tokenizer, fixture folder) for each real model; skipped when the file is absent."""
    file_name, fixture = MODELS[request.param]
    path = MODELS_DIR / file_name
    if not path.exists():
        missing(f"model {path} is missing (fetch it with `genie-supervisor models fetch`)")
    return request.param, Tokenizer.from_gguf(read_gguf(path)), fixture


def _tokenizer(name: str) -> Tokenizer:
    """`build_tokenizer` on the model `name` of MODELS (a missing file is reported by `missing`)."""
    path = MODELS_DIR / MODELS[name][0]
    if not path.exists():
        missing(f"model {path} is missing")
    return build_tokenizer(read_gguf(path))


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    """SmolLM2's byte-level BPE tokenizer."""
    return _tokenizer("smollm2")


@pytest.fixture(scope="module")
def gemma3() -> Tokenizer:
    """Gemma 3's SentencePiece tokenizer."""
    return _tokenizer("gemma3")


@pytest.mark.parametrize("parse_special", [False, True])
def test_ids_match_llama_cpp(model: tuple[str, Tokenizer, str], parse_special: bool) -> None:
    """Every fixture string tokenizes to exactly llama.cpp's ids, with and without parse_special."""
    _, tok, fixture = model
    key = "ids_parse_special" if parse_special else "ids"
    rows = _jsonl(FIXTURES_DIR / fixture / "tokenizer.jsonl")
    wrong = [
        (r["text"], got, r[key])
        for r in rows
        if (got := tok.encode(r["text"], add_special=False, parse_special=parse_special)) != r[key]
    ]
    assert not wrong, f"{len(wrong)}/{len(rows)} differ, first: {wrong[0]}"


def test_decode_inverts_encode(model: tuple[str, Tokenizer, str]) -> None:
    """decode(encode(s)) gives back every fixture string."""
    _, tok, fixture = model
    for r in _jsonl(FIXTURES_DIR / fixture / "tokenizer.jsonl"):
        assert tok.decode(tok.encode(r["text"], add_special=False)) == r["text"]


def test_prompt_ids_match_llama_cpp(model: tuple[str, Tokenizer, str]) -> None:
    """Greedy prompts (special tokens parsed, BOS per the GGUF) give llama.cpp's prompt ids."""
    _, tok, fixture = model
    for r in _jsonl(FIXTURES_DIR / fixture / "greedy.jsonl"):
        assert tok.encode(r["prompt_text"], add_special=True, parse_special=True) == r["prompt_ids"]


def test_completions_decode_to_llama_cpp_text(model: tuple[str, Tokenizer, str]) -> None:
    """llama.cpp's greedy completions decode to its text once the final stop token is dropped."""
    _, tok, fixture = model
    for r in _jsonl(FIXTURES_DIR / fixture / "greedy.jsonl"):
        ids = list(r["completion_ids"])
        if ids and ids[-1] in tok.eog_ids:
            ids.pop()
        assert tok.decode(ids) == r["completion_text"]


def test_special_flags_and_stop_tokens(smollm2: Tokenizer, gemma3: Tokenizer) -> None:
    """BOS/EOS, add_bos and the end-of-generation ids follow each GGUF and llama.cpp's rules."""
    im_end = smollm2.token_id("<|im_end|>")
    assert smollm2.add_bos is False and smollm2.bos_id == smollm2.token_id("<|im_start|>")
    assert smollm2.eos_id == im_end
    assert {im_end, smollm2.token_id("<|endoftext|>")} <= smollm2.eog_ids
    assert smollm2.is_special(im_end) and not smollm2.is_special(smollm2.token_id("hello"))
    assert smollm2.encode("hello", add_special=True) == smollm2.encode("hello", add_special=False)

    end_of_turn = gemma3.token_id("<end_of_turn>")
    assert gemma3.add_bos is True and gemma3.bos_id == gemma3.token_id("<bos>")
    assert {gemma3.eos_id, end_of_turn} <= gemma3.eog_ids
    assert gemma3.encode("hi")[0] == gemma3.bos_id
    assert gemma3.is_special(end_of_turn)
    assert gemma3.n_vocab == 262144 and gemma3.token_id("no such token") is None


def test_user_defined_tokens_match_without_parse_special(gemma3: Tokenizer) -> None:
    """Gemma's user-defined tokens ("\\n", runs of spaces, <table>) match whole even as plain text."""
    nl, table = gemma3.token_id("\n"), gemma3.token_id("<table>")
    assert gemma3.encode("a\nb<table>", add_special=False) == [
        gemma3.token_id("a"),
        nl,
        gemma3.token_id("b"),
        table,
    ]
    turn = gemma3.encode("<start_of_turn>", add_special=False)
    assert gemma3.token_id("<start_of_turn>") not in turn
    assert gemma3.encode("<start_of_turn>", add_special=False, parse_special=True) == [
        gemma3.token_id("<start_of_turn>")
    ]


def test_skip_special_drops_control_tokens(smollm2: Tokenizer, gemma3: Tokenizer) -> None:
    """Control tokens decode to their text, or to nothing with skip_special; user-defined stay text."""
    ids = smollm2.encode("<|im_start|>user\nhi<|im_end|>", add_special=False, parse_special=True)
    assert smollm2.decode(ids) == "<|im_start|>user\nhi<|im_end|>"
    assert smollm2.decode(ids, skip_special=True) == "user\nhi"
    ids = gemma3.encode("<start_of_turn>a\n\nb", add_special=True, parse_special=True)
    assert gemma3.decode(ids, skip_special=True) == "a\n\nb"
    assert gemma3.token_to_bytes(gemma3.token_id("<0xE2>")) == b"\xe2"


MULTIBYTE = "Température 21.5 °C 🙂🚀🔥 日本語のテキスト 👨\u200d👩\u200d👧\u200d👦 ok"


def test_stream_decoder_yields_exact_text(model: tuple[str, Tokenizer, str]) -> None:
    """Feeding ids one by one yields exactly the text, never a broken character."""
    _, tok, _ = model
    ids = tok.encode(MULTIBYTE, add_special=False)
    stream = StreamDecoder(tok)
    parts = [stream.feed(i) for i in ids] + [stream.flush()]
    assert "".join(parts) == MULTIBYTE
    assert all("\ufffd" not in p for p in parts)


def test_stream_decoder_holds_back_split_characters(gemma3: Tokenizer) -> None:
    """A character spelled with byte tokens appears only once its last byte arrives."""
    byte_ids = [gemma3.token_id(f"<0x{b:02X}>") for b in "€".encode()]
    stream = StreamDecoder(gemma3)
    assert [stream.feed(i) for i in byte_ids] == ["", "", "€"]
    stream.feed(byte_ids[0])
    assert stream.flush() == "\ufffd"


def test_decode_marks_truncated_utf8_at_the_end_only(gemma3: Tokenizer) -> None:
    """decode returns a replacement character only for the incomplete tail."""
    byte_ids = [gemma3.token_id(f"<0x{b:02X}>") for b in "ab€".encode()]
    assert gemma3.decode(byte_ids[:-1]) == "ab\ufffd"
    assert gemma3.decode(byte_ids) == "ab€"


def _gguf(**metadata: Any) -> GGUFFile:
    return GGUFFile("/models/test.gguf", metadata, {})


def _tiny_bpe(pre: str) -> GGUFFile:
    tokens = [byte_encode(chr(c)) for c in range(32, 127)] + ["ab", "abc", "Ġab", "<|end|>"]
    merges = ["a b", "ab c", "Ġ ab"]
    types = np.array([1] * (len(tokens) - 1) + [3], dtype=np.int32)
    return _gguf(**{
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.eos_token_id": len(tokens) - 1,
    })  # fmt: skip


def test_unknown_pre_tokenizer_is_refused_by_name() -> None:
    """An unknown tokenizer.ggml.pre raises ModelFormatError naming the key and the value."""
    with pytest.raises(ModelFormatError) as err:
        Tokenizer.from_gguf(_tiny_bpe("klingon-bpe"))
    assert err.value.key == "tokenizer.ggml.pre" and "klingon-bpe" in str(err.value)


def test_unknown_tokenizer_model_is_refused_by_name() -> None:
    """An unknown tokenizer.ggml.model raises ModelFormatError naming the value."""
    with pytest.raises(ModelFormatError) as err:
        Tokenizer.from_gguf(_gguf(**{"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": ["a"]}))
    assert err.value.key == "tokenizer.ggml.model" and "'t5'" in str(err.value)


def test_tiny_bpe_merges_by_rank_and_finds_stop_tokens() -> None:
    """A hand-made vocabulary merges lowest rank first; <|end|> is a stop and a special token."""
    tok = Tokenizer.from_gguf(_tiny_bpe("qwen2"))
    ids = tok.encode("abc ab abd", add_special=False)
    assert [tok.tokens[i] for i in ids] == ["abc", "Ġab", "Ġab", "d"]
    end = tok.token_id("<|end|>")
    assert tok.eog_ids == frozenset([end]) and tok.is_special(end)
    assert tok.encode("x<|end|>", add_special=False, parse_special=True)[-1] == end


def test_unicode_classes_hold_exactly_the_code_points_of_their_major_category() -> None:
    """The pre-tokenizers' {L}, {N} and {P} class bodies match exactly the code points below the
    scan limit whose Unicode category starts with that letter (no surrogate in any)."""
    import re
    import unicodedata

    from engine import tokenizer_bpe

    classes = tokenizer_bpe.unicode_classes()
    limit = tokenizer_bpe._SCAN_LIMIT
    for major in "LNP":
        rx = re.compile(f"[{classes[major]}]")
        want = [cp for cp in range(limit) if unicodedata.category(chr(cp))[0] == major]
        got = [cp for cp in range(limit) if not 0xD800 <= cp < 0xE000 and rx.match(chr(cp))]
        assert got == want, major


def test_a_repeated_merge_keeps_its_first_rank() -> None:
    """A merge listed twice ranks where it first appears (as llama.cpp's map keeps it): with
    "a b" first and again last, "abc" merges a+b before b+c."""
    tokens = [byte_encode(chr(c)) for c in range(32, 127)] + ["ab", "bc", "abc"]
    gf = _gguf(**{
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": ["a b", "b c", "ab c", "a b"],
    })  # fmt: skip
    tok = Tokenizer.from_gguf(gf)
    assert [tok.tokens[i] for i in tok.encode("abc", add_special=False)] == ["abc"]


@pytest.mark.parametrize(
    ("pre", "text", "pieces"),
    [
        (
            "llama-bpe",
            "Hello world 12345\n\n  x",
            ["Hello", " world", " ", "123", "45", "\n\n", " ", " x"],
        ),
        ("qwen2", "I'M 42!?\r\n", ["I", "'M", " ", "4", "2", "!?\r\n"]),
        ("smollm", "a 2024, don't", ["a", " ", "2", "0", "2", "4", ",", " don", "'t"]),
        ("default", "x = 1234;", ["x", " ", "=", " ", "123", "4", ";"]),
    ],
)
def test_pre_tokenizers_split_like_their_regex(pre: str, text: str, pieces: list[str]) -> None:
    """Each pre-tokenizer splits text the way its regex (run piece by piece) does."""
    assert BPEModel({}, [], PRE_TOKENIZERS[pre]).split(text) == pieces
