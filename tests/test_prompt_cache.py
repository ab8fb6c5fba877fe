"""The prompt cache on disk (engine.prompt_cache, engine.kv_file): restored K/V equal what was saved,
every mismatched, corrupt or truncated file is refused and replaced, the directory stays bounded."""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

import engine.synth
from engine import Model, SamplingParams, load_model
from engine.kv_file import CacheKey, cache_key, kv_arrays, rows_to_host, write
from engine.prompt_cache import ModelCache, PromptCache
from tests.apitools import SHAPES
from tests.models import SMOLLM2, require

pytestmark = pytest.mark.timeout(300)

SYSTEM = "You run the lights of a small house. Answer in one short sentence and never guess."


class Events:
    """The store's events, in order."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, name: str, fields: dict[str, Any]) -> None:
        self.seen.append((name, fields))

    def names(self) -> list[str]:
        return [n for n, _ in self.seen]


_OPEN: list[PromptCache] = []


@pytest.fixture(autouse=True)
def _close_stores() -> Iterator[None]:
    """Each test's stores end their read threads (left running, they outlive the test)."""
    yield
    while _OPEN:
        _OPEN.pop().close()


def store_at(path: Path, max_bytes: int = 1 << 30, min_tokens: int = 8) -> tuple[PromptCache, Events]:
    events = Events()
    store = PromptCache(path, max_bytes, min_tokens, on_event=events)
    _OPEN.append(store)
    return store, events


def attach(store: PromptCache, model: Model) -> ModelCache:
    cache = store.attach(model)
    assert cache.wait_ready(60), cache.error
    return cache


def synth_model(tmp_path: Path, name: str = "a", seed: int = 0) -> Path:
    path = tmp_path / f"{name}.gguf"
    engine.synth.write_synthetic_gguf(path, "llama", seed=seed, name="synthetic", **SHAPES["mid"])
    return path


def load(path: Path, kv_dtype: str = "f16", n_ctx: int = 256, backend: str = "numpy") -> Model:
    return load_model(str(path), backend=backend, n_ctx=n_ctx, kv_dtype=kv_dtype)


def fill(model: Model, ids: list[int]) -> None:
    """Prefill `ids` into the model's KV cache (the cache then holds exactly them)."""
    model.with_kv(lambda kv: kv.tokens.clear())
    model.step_logits(ids, 0)


def wipe(model: Model) -> None:
    """Zero every KV array and forget its tokens (what a fresh process starts from)."""

    def zero(kv: Any) -> None:
        for _, a in kv_arrays(kv):
            a[...] = 0
        kv.tokens.clear()

    model.with_kv(zero)


def ids_of(model: Model, text: str, n: int) -> list[int]:
    ids = model.tokenizer.encode(text * 40, add_special=False)
    assert len(ids) >= n
    return [int(t) for t in ids[:n]]


@pytest.mark.parametrize("kv_dtype", ["f16", "int8"])
def test_restored_prefix_gives_the_logits_of_the_prefix_it_was_saved_from(tmp_path: Path, kv_dtype: str) -> None:
    """SmolLM2's K/V of a prefix, saved and restored into a freshly loaded model (a restart), give
    bit-identical logits for the rest of the prompt, and a whole greedy generation from the disk
    cache gives the tokens of one without it."""
    path = str(require(SMOLLM2))
    first = load_model(path, kv_dtype=kv_dtype, n_ctx=512)
    store, events = store_at(tmp_path / "pc", min_tokens=16)
    cache = attach(store, first)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Is the porch light on?"}]
    ids = first.encode_chat(msgs)
    n = cache.stable_prefix(msgs, None, ids)
    assert 16 <= n < len(ids)
    fill(first, ids[:n])
    assert cache.offer(ids[:n])
    assert store.flush(60)
    reference = first.step_logits(ids[n:], n)  # the in-memory prefix cache

    second = load_model(path, kv_dtype=kv_dtype, n_ctx=512)
    restored = attach(store, second)
    wipe(second)
    assert restored.restore(ids, 0, n) == (n, n)
    assert np.array_equal(second.step_logits(ids[n:], n), reference)
    assert events.names() == ["prompt_cache_saved", "prompt_cache_restored"]

    async def greedy(model: Model, pc: ModelCache | None) -> tuple[list[int], int]:
        gen = model.generate(ids, SamplingParams(max_tokens=6, temperature=0), prompt_cache=pc)
        return [t.id async for t in gen], gen.stats.disk_tokens

    wipe(second)
    from_disk, disk_tokens = anyio.run(greedy, second, restored)
    wipe(second)
    plain, _ = anyio.run(greedy, second, None)
    assert disk_tokens == n
    assert from_disk == plain


def test_stable_prefix_is_the_system_message_and_tools(tmp_path: Path) -> None:
    """The stable prefix is the prompt up to the end of the system message(s), tools included; a
    conversation without a system message or tools has none."""
    model = load(synth_model(tmp_path))
    store, _ = store_at(tmp_path / "pc")
    cache = store.attach(model)
    sys_only = model.tokenizer.encode(
        model.render_chat([{"role": "system", "content": SYSTEM}], add_generation_prompt=False), parse_special=True
    )
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello"}]
    ids = model.encode_chat(msgs)
    assert cache.stable_prefix(msgs, None, ids) == len(sys_only)
    assert ids[: len(sys_only)] == sys_only
    tools = [{"type": "function", "function": {"name": "light_on", "parameters": {"type": "object"}}}]
    with_tools = model.encode_chat(msgs, tools=tools)
    assert cache.stable_prefix(msgs, tools, with_tools) > len(sys_only)
    user_only = [{"role": "user", "content": "Hello"}]
    assert cache.stable_prefix(user_only, None, model.encode_chat(user_only)) == 0


def _other_template(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine.synth, "CHATML", engine.synth.CHATML.replace("<|im_start|>", "<|im_start|> "))


def _other_tokenizer(monkeypatch: pytest.MonkeyPatch) -> None:
    vocabulary = engine.synth.vocabulary

    def fewer_merges(n: int) -> Any:
        tokens, types, merges = vocabulary(n)
        return tokens, types, merges[:-1]

    monkeypatch.setattr(engine.synth, "vocabulary", fewer_merges)


VARIANTS: dict[str, tuple[Callable[[pytest.MonkeyPatch], None] | None, dict[str, Any], str]] = {
    "weights": (None, {"seed": 1}, "model"),
    "tokenizer": (_other_tokenizer, {}, "tokenizer"),
    "template": (_other_template, {}, "template"),
    "kv_type": (None, {"kv_dtype": "int8"}, "kv_dtype"),
    "context": (None, {"n_ctx": 128}, "layout"),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_file_of_another_model_tokenizer_template_or_kv_type_is_rejected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variant: str
) -> None:
    """A cache file made for one model, put where another model's files are (same shape, other
    weights, tokenizer, chat template, KV type or context), is refused with the field that differs,
    deleted, and never restored."""
    patch, kw, field = VARIANTS[variant]
    first = load(synth_model(tmp_path, "a"))
    if patch is not None:
        patch(monkeypatch)
    second = load(
        synth_model(tmp_path, "b", seed=kw.get("seed", 0)),
        kv_dtype=kw.get("kv_dtype", "f16"),
        n_ctx=kw.get("n_ctx", 256),
    )
    key_a, key_b = cache_key(first), cache_key(second)
    assert key_b.first_difference(dataclasses.asdict(key_a)) == field
    ids = ids_of(first, "the lamp is on. ", 40)
    store, events = store_at(tmp_path / "pc")
    cache = attach(store, first)
    fill(first, ids)
    cache.offer(ids)
    store.flush(30)
    (made,) = cache.entries
    foreign = tmp_path / "pc" / key_b.digest() / made.path.name
    foreign.parent.mkdir(parents=True)
    shutil.copy(made.path, foreign)

    other = attach(store, second)
    assert other.entries == []
    assert not foreign.exists()
    assert store.stats().reject_reasons == {f"key:{field}": 1}
    assert ("prompt_cache_rejected", f"key:{field}") in [(n, f.get("reason")) for n, f in events.seen]
    wipe(second)
    assert other.restore(ids + [5], 0) == (0, 0)


def test_the_key_hashes_the_loaded_files_records_and_refuses_a_changed_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The key is made from the bytes of the metadata records where the load found them (the
    header is not parsed again: the same key with the parser broken), a change to one record's
    bytes changes its part of the key, and a file changed on disk since the load gets no key."""
    import os

    import engine.gguf_file
    from engine.errors import ModelFormatError

    path = synth_model(tmp_path)
    model = load(path)
    key = cache_key(model)

    def no_parsing(*_args: Any) -> Any:
        raise AssertionError("the header was parsed again")

    with monkeypatch.context() as m:
        m.setattr(engine.gguf_file._Cursor, "strings", no_parsing)
        m.setattr(engine.gguf_file._Cursor, "value", no_parsing)
        assert cache_key(model) == key

    start, end = model.gguf_index.spans["tokenizer.ggml.tokens"]
    data = bytearray(path.read_bytes())
    data[end - 1] ^= 0x01  # the last byte of the last token's text
    other = tmp_path / "other.gguf"
    other.write_bytes(bytes(data))
    changed = cache_key(load(other))
    assert changed.first_difference(dataclasses.asdict(key)) == "tokenizer"
    assert (changed.model, changed.template) == (key.model, key.template)

    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    with pytest.raises(ModelFormatError, match="changed on disk"):
        cache_key(model)


def _flip(offset: Callable[[int], int]) -> Callable[[Path], None]:
    def mutate(p: Path) -> None:
        data = bytearray(p.read_bytes())
        data[offset(len(data))] ^= 0x40
        p.write_bytes(bytes(data))

    return mutate


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[:-100])


def _garbage(p: Path) -> None:
    p.write_bytes(b"not a cache file at all" * 10)


def _longer(p: Path) -> None:
    p.write_bytes(p.read_bytes() + b"\0" * 64)


DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "data_byte": (_flip(lambda n: n - 10), "checksum"),
    "header_byte": (_flip(lambda n: 60), "checksum"),
    "truncated": (_truncate, "truncated"),
    "garbage": (_garbage, "magic"),
    "longer": (_longer, "size"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_corrupt_or_truncated_file_is_rejected_and_replaced(tmp_path: Path, damage: str) -> None:
    """A damaged cache file (a flipped data or header byte, cut short, garbage, extra bytes) is
    refused with its reason when read - at restart or at restore - and deleted; the prompt then
    prefills as usual and its prefix is written again, and that file restores."""
    mutate, reason = DAMAGE[damage]
    model = load(synth_model(tmp_path))
    ids = ids_of(model, "the blinds go down at eight. ", 48)
    store, events = store_at(tmp_path / "pc")
    cache = attach(store, model)
    fill(model, ids[:40])
    cache.offer(ids[:40])
    store.flush(30)
    (entry,) = cache.entries
    reference = model.step_logits(ids[40:], 40)
    mutate(entry.path)

    at_restart = damage != "data_byte"  # a data byte is only seen when the arrays are read
    cache = attach(store, model) if at_restart else cache
    wipe(model)
    assert cache.restore(ids, 0) == (0, 0)
    assert not entry.path.exists()
    assert store.stats().reject_reasons == {reason: 1}
    assert model.with_kv(lambda kv: list(kv.tokens)) == []

    fill(model, ids[:40])
    assert cache.offer(ids[:40])
    store.flush(30)
    assert entry.path.exists()
    wipe(model)
    assert cache.restore(ids, 0) == (40, 40)
    assert np.array_equal(model.step_logits(ids[40:], 40), reference)
    assert events.names().count("prompt_cache_rejected") == 1


def test_the_directory_never_grows_past_max_bytes_and_keeps_the_recently_used(tmp_path: Path) -> None:
    """With room for two files, saving a third deletes the least recently used one (a restore counts
    as a use); the total stays within max_bytes after every save, and a prefix larger than the
    bound is never written."""
    model = load(synth_model(tmp_path))
    one = 40 * model.transformer.kv.token_bytes()
    store, events = store_at(tmp_path / "pc", max_bytes=int(2.5 * one))
    cache = attach(store, model)
    prompts = {name: ids_of(model, f"{name} ", 40) for name in ("alpha beta", "gamma delta", "eps zeta", "eta")}

    def save(name: str) -> Path:
        fill(model, prompts[name])
        assert cache.offer(prompts[name])
        assert store.flush(30)
        sizes = [p.stat().st_size for p in (tmp_path / "pc").rglob("*.kv")]
        assert sum(sizes) <= store.max_bytes and store.stats().bytes == sum(sizes)
        return next(e.path for e in cache.entries if list(e.tokens) == prompts[name])

    a, b = save("alpha beta"), save("gamma delta")
    wipe(model)
    assert cache.restore(prompts["alpha beta"] + [7], 0)[1] == 40  # a is used again: b is the oldest
    save("eps zeta")
    assert a.exists() and not b.exists()
    save("eta")
    assert store.stats().evictions == 2 and store.stats().files == 2
    assert events.names().count("prompt_cache_evicted") == 2

    small, _ = store_at(tmp_path / "small", max_bytes=one // 2)
    tiny = attach(small, model)
    fill(model, prompts["eta"])
    assert not tiny.offer(prompts["eta"])
    assert not (tmp_path / "small").exists() or not list((tmp_path / "small").rglob("*.kv"))


def test_a_prefix_overlapping_a_saved_one_is_written_only_when_it_comes_again(tmp_path: Path) -> None:
    """A system prompt sharing its start with a saved one but ending differently (a timestamp, an
    edit) is written on its second offer only; a new one is written at once."""
    model = load(synth_model(tmp_path))
    store, _ = store_at(tmp_path / "pc")
    cache = attach(store, model)
    base = ids_of(model, "kitchen light, hall light. ", 48)
    edited = base[:40] + ids_of(model, "garage door. ", 8)
    fresh = ids_of(model, "weather today: ", 48)
    for ids, expected in ((base, True), (edited, False), (edited, True), (fresh, True), (base, False)):
        fill(model, ids)
        assert cache.offer(ids) is expected
        store.flush(30)
    assert len(cache.entries) == 3


def test_a_file_written_by_hand_with_another_key_is_rejected_by_field(tmp_path: Path) -> None:
    """Each key field is compared: a file in the model's own directory whose key differs in one
    field (e.g. the engine's sources or the backend) is refused naming that field."""
    model = load(synth_model(tmp_path))
    store, _ = store_at(tmp_path / "pc")
    cache = attach(store, model)
    assert cache.key is not None and cache.directory is not None
    ids = ids_of(model, "the door is locked. ", 20)
    fill(model, ids)
    arrays = model.with_kv(lambda kv: [(n, rows_to_host(a, len(ids))) for n, a in kv_arrays(kv)])
    for i, name in enumerate(f.name for f in dataclasses.fields(CacheKey)):
        value = 99 if name == "format" else "other"
        write(cache.directory, dataclasses.replace(cache.key, **{name: value}), ids[: 10 + i], arrays_n(arrays, 10 + i))
    again = attach(store, model)
    assert again.entries == []
    assert sorted(store.stats().reject_reasons) == sorted(f"key:{f.name}" for f in dataclasses.fields(CacheKey))


def arrays_n(arrays: list[tuple[str, np.ndarray]], n: int) -> list[tuple[str, np.ndarray]]:
    return [(name, a[:, :n, :]) for name, a in arrays]


def test_a_file_deleted_by_another_process_is_forgotten_not_refused(tmp_path: Path) -> None:
    """A file that another process trimmed away after the index was read is dropped from the index
    quietly (no reject counted) and the prompt prefills as usual."""
    model = load(synth_model(tmp_path))
    store, events = store_at(tmp_path / "pc")
    cache = attach(store, model)
    ids = ids_of(model, "the heating is at twenty. ", 40)
    fill(model, ids)
    cache.offer(ids)
    store.flush(30)
    (entry,) = cache.entries
    entry.path.unlink()
    wipe(model)
    assert cache.restore(ids + [5], 0) == (0, 0)
    assert cache.entries == [] and store.stats().rejects == 0
    assert "prompt_cache_rejected" not in events.names()


def test_the_device_checksum_twin_sees_every_changed_or_moved_unit() -> None:
    """`kv_file.host_sum` (the reference of the GPU restore's checksum) changes when any one byte
    changes or two 16-bit units swap places, and is the same for the same bytes."""
    from engine import kv_file

    rows = np.random.default_rng(5).integers(0, 256, size=(2, 7, 64), dtype=np.uint8)
    base = kv_file.host_sum(rows)
    assert kv_file.host_sum(rows.copy()) == base
    flat = rows.reshape(-1)
    for i in (0, 1, 500, flat.size - 1):
        other = flat.copy()
        other[i] ^= 1
        assert kv_file.host_sum(other.reshape(rows.shape)) != base
    swapped = flat.view("<u2").copy()
    swapped[[3, 4]] = swapped[[4, 3]]
    assert swapped[3] != swapped[4] and kv_file.host_sum(swapped.view(np.uint8).reshape(rows.shape)) != base
