"""Untrusted files (policy and config YAML, GGUF headers) are bounded before they are parsed and fail with named errors."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import anyio
import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import EngineError, ModelFormatError, load_model
from engine.gguf_file import read_gguf
from engine.synth import write_synthetic_gguf
from genie_supervisor.config import load_config
from genie_supervisor.errors import ConfigErrors, PolicyErrors
from genie_supervisor.policy import load_policy, parse_policy
from genie_supervisor.yamlsrc import MAX_SOURCE_BYTES
from tests.daemon import client, make_supervisor, wait_for, write_policy

ALIAS_BOMB = (
    "\n".join(
        [f"a: &a [{','.join(['lol'] * 9)}]"]
        + [f"{b}: &{b} [{','.join([f'*{a}'] * 9)}]" for a, b in zip("abcdefgh", "bcdefghi", strict=True)]
    )
    + "\n"
)  # nine levels of nine aliases: 9**9 nodes once expanded, 300-odd bytes on disk


def _policy_check(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "genie_supervisor", "policy", "check", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(("byte", "name"), [(b"\x00", "0x00"), (b"\x07", "0x07")])
def test_policy_check_names_a_control_byte_without_a_traceback(tmp_path: Path, byte: bytes, name: str) -> None:
    """A NUL or BEL byte in a policy is one `file:line: message` line and exit code 1, not a crash."""
    path = tmp_path / "p.yaml"
    path.write_bytes(b"version: 1\nname: n" + byte + b"ul\n")
    done = _policy_check(path)
    assert done.returncode == 1, done.stderr
    out = done.stdout + done.stderr
    assert f"{path}:2: malformed YAML: control character {name}" in out
    assert "Traceback" not in out


@pytest.mark.timeout(60)
def test_alias_bomb_is_refused_before_it_expands(tmp_path: Path) -> None:
    """A few hundred bytes of nested aliases are refused by line, with little memory, instead of expanding to 9**9 nodes."""
    assert len(ALIAS_BOMB) < 400
    tracemalloc.start()
    try:
        with pytest.raises(PolicyErrors) as err:
            parse_policy(ALIAS_BOMB, "bomb.yaml")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "alias bomb" in str(err.value) and str(err.value).startswith("bomb.yaml:")
    assert peak < 64 * 2**20


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a: &a [*a]\n", "refers to a node that contains it"),
        ("a: " + "[" * 100 + "]" * 100 + "\n", "nesting deeper than 64 levels"),
        ("a: " + "[" * 20000 + "]" * 20000 + "\n", "nesting deeper than 64 levels"),
    ],
)
def test_recursive_or_deep_yaml_is_one_issue(text: str, message: str) -> None:
    """A self-referencing alias or a document nested beyond the limit is a named issue, not a RecursionError."""
    with pytest.raises(PolicyErrors) as err:
        parse_policy(text, "p.yaml")
    assert message in str(err.value)


def test_policy_from_a_device_or_fifo_is_refused_at_once(tmp_path: Path) -> None:
    """A policy symlinked to /dev/zero or a FIFO is refused as not a regular file (no endless read, no blocking open)."""
    zero = tmp_path / "zero.yaml"
    zero.symlink_to("/dev/zero")
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    for path, kind in ((zero, "a character device"), (fifo, "a FIFO")):
        with pytest.raises(PolicyErrors) as err:
            load_policy(path)
        assert str(err.value) == f"{path}: cannot read: not a regular file ({kind}); only regular files are read"
        with pytest.raises(ConfigErrors, match="not a regular file"):
            load_config(path)


def test_oversized_and_non_utf8_sources_are_refused(tmp_path: Path) -> None:
    """A policy larger than the read limit, or with bytes that are not UTF-8, is refused with the reason and line."""
    big = tmp_path / "big.yaml"
    big.write_bytes(b"#" * (MAX_SOURCE_BYTES + 1))
    with pytest.raises(PolicyErrors, match=f"more than the limit of {MAX_SOURCE_BYTES}"):
        load_policy(big)
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"version: 1\nname: caf\xe9\n")
    with pytest.raises(PolicyErrors, match=r"line 2: not UTF-8 text \(byte 0xe9"):
        load_policy(latin)


def test_long_values_are_quoted_short_in_errors() -> None:
    """A huge bad value or unknown key in a policy is quoted in a few hundred characters, not copied whole."""
    text = f"version: 1\nname: {'n' * 100}\nfailsafe: {{telemetry_unknown: {'x' * 500_000}}}\n{'k' * 1000}: 1\n"
    with pytest.raises(PolicyErrors) as err:
        parse_policy(text, "p.yaml")
    assert len(err.value.issues) == 3  # name too long, bad enum value, unknown key
    assert all(len(issue.format()) < 1500 for issue in err.value.issues)
    assert "(500000 characters)" in str(err.value) and "k" * 201 not in str(err.value)


@pytest.mark.timeout(60)
async def test_running_daemon_keeps_its_policy_when_the_file_gets_a_nul_byte(tmp_path: Path) -> None:
    """The watched policy file gaining a NUL byte or an alias bomb is rejected, the daemon keeps serving with the old policy."""
    policy = write_policy(tmp_path / "p.yaml", "first")
    with anyio.fail_after(45):
        async with make_supervisor(tmp_path, policy=policy) as sup, client(sup) as http:
            watcher = sup.policy_watcher
            watcher.poll_interval_s = 0.02
            for bad in (b"version: 1\nname: n\x00ul\n", ALIAS_BOMB.encode(), b"\x07"):
                errors = watcher.generation, id(watcher.last_error)
                policy.write_bytes(bad)
                assert await watcher.reload() is False
                assert (watcher.generation, id(watcher.last_error)) != errors
                status = (await http.get("/status")).json()
                assert status["policy"]["name"] == "first" and status["policy"]["error"].startswith(f"{policy}:")
            write_policy(policy, "second")
            assert await watcher.reload() is True
            await wait_for(
                sup,
                lambda: sup.store.snapshot().decision is not None and sup.store.snapshot().decision.policy == "second",
            )
            assert (await http.get("/health")).json()["status"] == "ok"


# --- generated bad YAML ---------------------------------------------------------------------

_yaml_chars = st.sampled_from(
    list("ab:- \n\t[]{},&*!|>'\"#%@`?0123456789.\\") + ["\x00", "\x07", "\x85", "\ufeff", "é"]
)
_policy_lines = st.sampled_from(
    [
        "version: 1",
        "name: p",
        "voice:",
        "  stt: {action: pause}",
        "  stt: {action: throttle, throttle_tps: -1}",
        "thermal:",
        "  levels:",
        "    - {name: w, enter_c: 80, leave_c: 90, action: pause}",
        "  sensor: [1]",
        "x: &x [1, 2]",
        "y: [*x, *x]",
        "<<: *x",
        "failsafe: {telemetry_unknown: 3}",
        "memory: {llm_budget_mb: .inf}",
        "version: 1\nversion: 2",
        "priorities: {voice: 1e999}",
    ]
)


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.one_of(
        st.text(_yaml_chars, max_size=200),
        st.lists(_policy_lines, max_size=12).map("\n".join),
        st.binary(max_size=200).map(lambda b: b.decode("utf-8", "replace")),
    )
)
def test_generated_policy_and_config_yaml_only_ever_give_named_errors(text: str) -> None:
    """Any text as a policy or a config either validates or raises the file's error type with `file:` lines."""
    for parse, errors in ((lambda t: parse_policy(t, "p.yaml"), PolicyErrors), (_parse_config, ConfigErrors)):
        try:
            parse(text)
        except errors as exc:
            assert exc.issues and all(i.format().startswith(("p.yaml", "c.yaml")) for i in exc.issues), str(exc)


def _parse_config(text: str) -> None:
    from genie_supervisor.config import Config
    from genie_supervisor.errors import ConfigError
    from genie_supervisor.yamlsrc import load_yaml, validate

    data, lines, issues = load_yaml(text, "c.yaml", ConfigError)
    if not issues:
        _, issues = validate(Config, data, lines, "c.yaml", ConfigError)
    if issues:
        raise ConfigErrors(issues)


# --- GGUF headers -----------------------------------------------------------------------------


class _Header:
    """A GGUF file written field by field, remembering where each length, count, type and offset is.

    Not a dataclass: hypothesis prints a dataclass argument field by field (250 kB here).
    """

    def __init__(self) -> None:
        self.out = bytearray()
        self.fields: dict[str, list[tuple[int, str]]] = {}

    def __repr__(self) -> str:
        return f"<GGUF header of {len(self.out)} bytes>"

    def put(self, kind: str, fmt: str, value: Any) -> None:
        self.fields.setdefault(kind, []).append((len(self.out), fmt))
        self.out += struct.pack(fmt, value)

    def string(self, text: str) -> None:
        raw = text.encode()
        self.put("strlen", "<Q", len(raw))
        self.out += raw

    def value(self, value: Any) -> None:
        if isinstance(value, str):
            self.string(value)
        elif isinstance(value, list):
            self.put("arrcount", "<Q", len(value))
            for item in value:
                self.string(item)
        elif isinstance(value, np.ndarray):
            self.put("arrcount", "<Q", len(value))
            self.out += value.astype("<i4").tobytes()
        elif isinstance(value, bool):
            self.out += struct.pack("<?", value)
        elif isinstance(value, int):
            self.put("int", "<I", value)
        else:
            self.put("float", "<f", value)


_VTYPE = {
    str: gguf.GGUFValueType.STRING,
    bool: gguf.GGUFValueType.BOOL,
    int: gguf.GGUFValueType.UINT32,
    float: gguf.GGUFValueType.FLOAT32,
}


def _serialize(path: str) -> _Header:
    """Re-write the GGUF at `path` with _Header, so that each of its fields can be lied about."""
    gf = read_gguf(path)
    h = _Header()
    h.out += b"GGUF"
    h.put("version", "<I", 3)
    h.put("tensor_count", "<Q", len(gf.tensors))
    h.put("kv_count", "<Q", len(gf.metadata))
    for key, value in gf.metadata.items():
        h.string(key)
        if isinstance(value, (list, np.ndarray)):
            h.put("vtype", "<I", gguf.GGUFValueType.ARRAY)
            h.put("etype", "<I", gguf.GGUFValueType.STRING if isinstance(value, list) else gguf.GGUFValueType.INT32)
        else:
            h.put("vtype", "<I", _VTYPE[type(value)])
        h.value(value)
    offset = 0
    blobs = []
    for name, t in gf.tensors.items():
        h.string(name)
        h.put("ndims", "<I", len(t.shape))
        for d in reversed(t.shape):
            h.put("dim", "<Q", d)
        h.put("ttype", "<I", gguf.GGMLQuantizationType[t.type_name])
        h.put("offset", "<Q", offset)
        blobs.append(np.ascontiguousarray(t.raw).tobytes())
        offset += (len(blobs[-1]) + 31) // 32 * 32
    h.out += b"\0" * (-len(h.out) % 32)
    for blob in blobs:
        h.out += blob + b"\0" * (-len(blob) % 32)
    return h


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> _Header:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_synthetic_gguf(
        path, "llama", n_layers=1, n_embd=32, n_ff=64, n_heads=2, n_kv_heads=1, n_vocab=320, weight_type="F32"
    )
    h = _serialize(str(path))
    rewritten = path.with_name("rewritten.gguf")
    rewritten.write_bytes(bytes(h.out))
    load_model(rewritten, backend="numpy", n_ctx=64)  # the unmodified re-write is a valid model
    return h


_EXTREME = st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([0, 1, 2**31, 2**32 - 1, 2**63, 2**64 - 1]))


@settings(
    max_examples=250,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    kind=st.sampled_from(
        [
            "strlen",
            "arrcount",
            "vtype",
            "etype",
            "tensor_count",
            "kv_count",
            "ndims",
            "dim",
            "ttype",
            "offset",
            "version",
            "int",
            "float",
            "truncate",
            "byte",
        ]
    ),
    which=st.integers(0, 10_000),
    value=_EXTREME,
)
def test_generated_gguf_headers_give_named_errors_without_huge_allocations(
    tiny_gguf: _Header, tmp_path: Path, kind: str, which: int, value: int
) -> None:
    """A GGUF whose counts, lengths, types or offsets lie loads or raises an EngineError, allocating < 64 MiB."""
    raw = bytearray(tiny_gguf.out)
    if kind == "truncate":
        raw = raw[: which * len(raw) // 10_000]
    elif kind == "byte":
        raw[which % len(raw)] = value & 0xFF
    else:
        offset, fmt = tiny_gguf.fields[kind][which % len(tiny_gguf.fields[kind])]
        size = struct.calcsize(fmt)
        if fmt == "<f":
            struct.pack_into("<I", raw, offset, value & 0xFFFFFFFF)
        else:
            struct.pack_into(fmt, raw, offset, value & ((1 << (8 * size)) - 1))
    path = tmp_path / f"{kind}-{which}-{value}.gguf"
    path.write_bytes(bytes(raw))
    tracemalloc.start()
    try:
        try:
            load_model(path, backend="numpy", n_ctx=64)
        except EngineError as exc:
            assert len(str(exc)) < 2000
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        path.unlink()
    assert peak < 64 * 2**20


def test_fifty_megabyte_metadata_string_is_not_copied_into_the_error(tmp_path: Path) -> None:
    """A 50 MB architecture name is quoted in a few hundred characters by the error (and its log line)."""
    path = tmp_path / "big.gguf"
    w = gguf.GGUFWriter(str(path), "x" * 50_000_000)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFormatError) as err:
        load_model(path, backend="numpy")
    assert len(str(err.value)) < 1000
    assert "unknown architecture 'xxxx" in str(err.value) and "(50000002 characters)" in str(err.value)
