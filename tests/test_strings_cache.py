"""The GGUF strings cache (`engine.strings_cache`): a restart takes a long vocabulary from disk
instead of parsing it, gets exactly the strings a parse gives, never trusts an entry that does not
match the model file's bytes or its own digest, stays bounded, and is off unless its folder is set.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine import strings_cache
from engine.gguf_file import read_gguf
from engine.synth import preset_config, write_config

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def vocab_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "q.gguf"  # Qwen3's 151,936-token vocabulary, header only
    write_config(str(path), preset_config("qwen3-4b-q4_k_m", fast=True), header_only=True)
    return path


def _read(path: Path) -> tuple[list[str], strings_cache.StringsCache | None]:
    gf = read_gguf(path, header_only=True)
    cache = strings_cache.active()
    if cache is not None:
        cache.wait(30)
    return gf.metadata["tokenizer.ggml.tokens"], cache


def _parsed(path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    with monkeypatch.context() as m:
        m.delenv(strings_cache.ENV, raising=False)
        return _read(path)[0]


def _fresh(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As a restarted process: the variable set, no cache object yet."""
    monkeypatch.setenv(strings_cache.ENV, str(folder))
    monkeypatch.setattr(strings_cache, "_active", [])


def test_a_restart_takes_the_vocabulary_from_the_cache_with_the_same_strings(
    vocab_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first read parses and writes an entry; a restarted process reads the same strings from it."""
    expected = _parsed(vocab_file, monkeypatch)
    _fresh(tmp_path, monkeypatch)
    first, cache = _read(vocab_file)
    assert cache is not None and cache.hits == 0 and first == expected
    assert len(list(tmp_path.glob("*.strings"))) == 1
    _fresh(tmp_path, monkeypatch)
    again, cache = _read(vocab_file)
    assert cache is not None and cache.hits == 1
    assert again == expected


def test_a_changed_model_file_at_the_same_path_is_parsed_again(
    vocab_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another vocabulary of the same size at the same place in the file misses (digest of its
    bytes), is parsed, and replaces the entry."""
    path = tmp_path / "model.gguf"
    path.write_bytes(vocab_file.read_bytes())
    _fresh(tmp_path / "cache", monkeypatch)
    _read(path)
    data = path.read_bytes()
    assert data.count(b"<unused733>") == 1
    path.write_bytes(data.replace(b"<unused733>", b"<renamed73>"))
    expected = _parsed(path, monkeypatch)
    _fresh(tmp_path / "cache", monkeypatch)
    got, cache = _read(path)
    assert cache is not None and cache.hits == 0
    assert got == expected and "<renamed73>" in got
    _fresh(tmp_path / "cache", monkeypatch)
    assert _read(path)[1].hits == 1  # type: ignore[union-attr]


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage"])
def test_a_damaged_entry_is_ignored_and_replaced(
    vocab_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    """A flipped byte in the data, a cut file or garbage is a miss: the strings come from the
    parse, and the entry is written again whole."""
    expected = _parsed(vocab_file, monkeypatch)
    _fresh(tmp_path, monkeypatch)
    _read(vocab_file)
    (entry,) = tmp_path.glob("*.strings")
    raw = bytearray(entry.read_bytes())
    if damage == "flip":
        raw[-100] ^= 0x20
    elif damage == "truncate":
        raw = raw[: len(raw) // 2]
    else:
        raw = bytearray(b"not a strings entry" * 10)
    entry.write_bytes(bytes(raw))
    _fresh(tmp_path, monkeypatch)
    got, cache = _read(vocab_file)
    assert cache is not None and cache.hits == 0 and got == expected
    _fresh(tmp_path, monkeypatch)
    got, cache = _read(vocab_file)
    assert cache is not None and cache.hits == 1 and got == expected


def test_the_folder_keeps_at_most_its_bound(vocab_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Beyond `MAX_ENTRIES` the least recently used entries are removed."""
    monkeypatch.setattr(strings_cache, "MAX_ENTRIES", 2)
    _fresh(tmp_path / "cache", monkeypatch)
    for i in range(4):
        copy = tmp_path / f"m{i}.gguf"
        copy.write_bytes(vocab_file.read_bytes())
        _read(copy)
    assert len(list((tmp_path / "cache").glob("*.strings"))) == 2


def test_nothing_is_cached_without_the_folder(vocab_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With `$GENIE_STRINGS_CACHE_DIR` unset the vocabulary is parsed and nothing is written."""
    monkeypatch.delenv(strings_cache.ENV, raising=False)
    tokens, cache = _read(vocab_file)
    assert cache is None and len(tokens) == 151_936


def test_an_unwritable_folder_costs_a_parse_and_nothing_else(
    vocab_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A folder that cannot be made (a file in its place) leaves every read correct."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    expected = _parsed(vocab_file, monkeypatch)
    _fresh(blocker / "strings", monkeypatch)
    for _ in range(2):
        got, cache = _read(vocab_file)
        assert got == expected and cache is not None and cache.hits == 0


def test_an_entry_holds_the_parse_of_the_bytes_its_digest_covers(
    vocab_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer parses its own copy of the file's bytes: strings the reader got from other bytes
    (a file rewritten while it was read) never reach the entry."""
    from engine import gguf_file

    expected = _parsed(vocab_file, monkeypatch)
    real, calls = gguf_file._parse_strings, [0]

    def stale_first(*args: Any) -> tuple[list[str], int]:
        calls[0] += 1
        out, end = real(*args)
        return (["stale"] * len(out) if calls[0] == 1 else out), end

    monkeypatch.setattr(gguf_file, "_parse_strings", stale_first)
    _fresh(tmp_path, monkeypatch)
    assert _read(vocab_file)[0][0] == "stale"  # what the reader parsed
    monkeypatch.setattr(gguf_file, "_parse_strings", real)
    _fresh(tmp_path, monkeypatch)
    got, cache = _read(vocab_file)
    assert cache is not None and cache.hits == 1 and got == expected


def test_a_folder_others_may_write_to_is_not_used(
    vocab_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Entries in a folder that group or others may write are neither read nor written."""
    _fresh(tmp_path, monkeypatch)
    _read(vocab_file)
    tmp_path.chmod(0o777)
    try:
        _fresh(tmp_path, monkeypatch)
        got, cache = _read(vocab_file)
        assert cache is not None and cache.hits == 0 and len(got) == 151_936
    finally:
        tmp_path.chmod(0o700)
    _fresh(tmp_path, monkeypatch)
    assert _read(vocab_file)[1].hits == 1  # type: ignore[union-attr]


def test_one_process_writes_a_bounded_number_of_entries_per_model_file(
    vocab_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file with more long arrays than `MAX_PER_FILE` gets entries for the first ones only."""
    monkeypatch.setattr(strings_cache, "MIN_STRINGS", 4)  # the tokens and the 8 merges both qualify
    monkeypatch.setattr(strings_cache, "MAX_PER_FILE", 1)
    _fresh(tmp_path, monkeypatch)
    _read(vocab_file)
    assert len(list(tmp_path.glob("*.strings"))) == 1
    monkeypatch.setattr(strings_cache, "MAX_PER_FILE", 4)
    _fresh(tmp_path, monkeypatch)
    _read(vocab_file)
    assert len(list(tmp_path.glob("*.strings"))) == 2
