"""YAML with line numbers: load a file, remember where every key is, map validation errors back.

``load_yaml`` returns the plain data plus a ``LineMap`` (key path -> 1-based line).
``validate`` runs a pydantic model over the data and turns a ``ValidationError`` into
``file:line key.path: message`` issues that name the offending value and what was expected.
``read_source`` reads a config or policy file with bounds: a regular file only (never a FIFO or a
device such as ``/dev/zero`` behind a symlink), at most ``MAX_SOURCE_BYTES``, UTF-8.

Untrusted YAML is bounded before anything walks it: control characters are one issue (not an
exception), and a document whose aliases expand past ``MAX_NODES`` nodes (an alias bomb), that
refers to itself, or that nests deeper than ``MAX_DEPTH`` is refused before it is constructed.
"""

from __future__ import annotations

import os
import stat
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from engine.errors import cap_text

from .errors import SourceError

MAX_SOURCE_BYTES = 1_048_576
"""Largest config or policy file read (bytes); real ones are a few KiB."""
MAX_NODES = 100_000
"""Most YAML nodes a document may have once its aliases are expanded."""
MAX_DEPTH = 64
"""Deepest nesting of mappings and sequences a document may have."""
QUOTE_CHARS = 80
"""Longest value quoted in an error message (longer ones are cut, with their length)."""

Path = tuple[str | int, ...]
M = TypeVar("M", bound=BaseModel)
IssueFactory = Callable[[str, "int | None", str, str], SourceError]


class KeyedValueError(ValueError):
    """A ValueError raised by a validator that knows which sub-key is wrong (for a precise line)."""

    def __init__(self, key: str | int | Sequence[str | int], message: str) -> None:
        self.key: Path = (key,) if isinstance(key, (str, int)) else tuple(key)
        """Key path below the validated object that the message is about."""
        super().__init__(message)


@dataclass
class LineMap:
    """Where each key path of a YAML document starts (1-based lines)."""

    lines: dict[Path, int] = field(default_factory=dict)

    def line_of(self, path: Path) -> int | None:
        """The line of `path`, or of its closest ancestor that has one."""
        for n in range(len(path), -1, -1):
            line = self.lines.get(_norm(path[:n]))
            if line is not None:
                return line
        return None


def _norm(path: Path) -> Path:
    return tuple(p if isinstance(p, int) else str(p) for p in path)


def format_path(path: Path) -> str:
    """``('thermal', 'levels', 1, 'enter_c')`` -> ``thermal.levels[1].enter_c``."""
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def _walk(node: yaml.Node, path: Path, lines: dict[Path, int], issues: list[tuple[int, str, str]]) -> None:
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = str(key_node.value)
            line = key_node.start_mark.line + 1
            if key == "<<":
                _walk(value_node, path, lines, issues)
                continue
            if key in seen:
                issues.append((line, format_path(path + (key,)), f"duplicate key (first at line {seen[key]})"))
            seen[key] = line
            lines[path + (key,)] = line
            _walk(value_node, path + (key,), lines, issues)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            lines[path + (i,)] = item.start_mark.line + 1
            _walk(item, path + (i,), lines, issues)


def quote(value: Any) -> str:
    """``repr(value)`` cut to QUOTE_CHARS characters, saying how long it was (errors never copy big values)."""
    if isinstance(value, str) and len(value) > QUOTE_CHARS:
        return f"{value[:QUOTE_CHARS]!r}... ({len(value)} characters)"
    return cap_text(repr(value), QUOTE_CHARS)


def read_source(path: str, max_bytes: int = MAX_SOURCE_BYTES) -> str:
    """The text of file `path`; OSError or ValueError say why it is refused (not a regular file, too big, not UTF-8).

    Opened non-blocking so that a FIFO cannot hang the caller; only regular files are read, and
    never more than `max_bytes` + 1 bytes (so ``/dev/zero`` or a growing file cannot exhaust memory).
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"not a regular file ({_file_kind(st.st_mode)}); only regular files are read")
        if st.st_size > max_bytes:
            raise ValueError(f"file is {st.st_size} bytes, more than the limit of {max_bytes}")
        chunks: list[bytes] = []
        size = 0
        while size <= max_bytes:
            chunk = os.read(fd, max_bytes + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > max_bytes:
            raise ValueError(f"file grew past the limit of {max_bytes} bytes while it was read")
    finally:
        os.close(fd)
    raw = b"".join(chunks)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ValueError(f"line {line}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start})") from None


def _file_kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a plain file"


def _check_size(root: yaml.Node) -> tuple[int | None, str] | None:
    """None when `root` expands to a bounded tree; else (line, why) for an alias bomb, a cycle or deep nesting."""
    sizes: dict[int, int] = {}
    depths: dict[int, int] = {}
    active: set[int] = set()
    # Iterative post-order walk over distinct nodes: an alias is the same node object again, so each
    # node is measured once and its expanded size comes from its children's memoised sizes.
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            active.discard(key)
            kids = _children(node)
            size = 1 + sum(sizes[id(k)] for k in kids)
            depth = 1 + max((depths[id(k)] for k in kids), default=0)
            if size > MAX_NODES:
                return node.start_mark.line + 1, (
                    f"document expands to more than {MAX_NODES} nodes through its aliases (an alias bomb?)"
                )
            if depth > MAX_DEPTH:
                return node.start_mark.line + 1, f"nesting deeper than {MAX_DEPTH} levels"
            sizes[key], depths[key] = size, depth
            continue
        if key in sizes:
            continue
        if key in active:
            return node.start_mark.line + 1, "an alias refers to a node that contains it (recursive document)"
        active.add(key)
        stack.append((node, True))
        for kid in _children(node):
            if id(kid) in active:
                return kid.start_mark.line + 1, "an alias refers to a node that contains it (recursive document)"
            if id(kid) not in sizes:
                stack.append((kid, False))
        if len(active) > MAX_DEPTH + 1:
            return node.start_mark.line + 1, f"nesting deeper than {MAX_DEPTH} levels"
    return None


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def load_yaml(text: str, path: str, make: IssueFactory) -> tuple[Any, LineMap, list[SourceError]]:
    """Parse `text` (from file `path`); returns (data, line map, issues). Malformed or unbounded YAML is one issue."""
    loader: yaml.SafeLoader | None = None
    try:
        loader = yaml.SafeLoader(text)  # checks every character: control bytes raise ReaderError here
        node = loader.get_single_node()
        if node is not None:
            bad = _check_size(node)
            if bad is not None:
                return None, LineMap(), [make(path, bad[0], "", bad[1])]
        data = loader.construct_document(node) if node is not None else None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        what = exc.problem or "invalid YAML"
        if exc.context:
            what = f"{exc.context}, {what}"
        return None, LineMap(), [make(path, line, "", f"malformed YAML: {what}")]
    except yaml.reader.ReaderError as exc:
        line = text.count("\n", 0, exc.position) + 1
        char = exc.character if isinstance(exc.character, str) else chr(exc.character)
        return (
            None,
            LineMap(),
            [
                make(
                    path,
                    line,
                    "",
                    f"malformed YAML: control character {ord(char):#04x} at offset {exc.position} is not allowed",
                )
            ],
        )
    except yaml.YAMLError as exc:
        return None, LineMap(), [make(path, None, "", f"malformed YAML: {exc}")]
    except RecursionError:
        return None, LineMap(), [make(path, None, "", f"malformed YAML: nesting deeper than {MAX_DEPTH} levels")]
    finally:
        if loader is not None:
            loader.dispose()
    lines: dict[Path, int] = {(): 1}
    dup: list[tuple[int, str, str]] = []
    if node is not None:
        lines[()] = node.start_mark.line + 1
        _walk(node, (), lines, dup)
    issues = [make(path, line, key, msg) for line, key, msg in dup]
    return data, LineMap(lines), issues


def validate(
    model: type[M], data: Any, lines: LineMap, path: str, make: IssueFactory, context: Any = None
) -> tuple[M | None, list[SourceError]]:
    """Validate `data` with `model`; on failure, return issues with file, line and key path."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        return None, [
            make(path, lines.line_of(()), "", f"expected a mapping of keys at the top level, got {type(data).__name__}")
        ]
    try:
        return model.model_validate(data, context=context), []
    except ValidationError as exc:
        issues = [_issue(model, err, data, lines, path, make) for err in exc.errors()]
        issues.sort(key=lambda i: (i.line or 0, i.key))
        return None, issues


def _issue(model: type[BaseModel], err: Any, data: Any, lines: LineMap, path: str, make: IssueFactory) -> SourceError:
    loc: Path = tuple(err["loc"])
    msg: str = err["msg"]
    kind: str = err["type"]
    ctx = err.get("ctx") or {}
    cause = ctx.get("error")
    if kind == "value_error" and isinstance(cause, ValueError):
        msg = str(cause)
        if isinstance(cause, KeyedValueError):
            loc = loc + cause.key
    real = _data_path(loc, data)
    if kind == "missing":
        msg = "required key is missing"
    elif kind == "extra_forbidden":
        allowed = _allowed_keys(model, real[:-1])
        msg = "unknown key"
        if allowed:
            import difflib  # only for a config with a typo: not on every start's import path

            close = difflib.get_close_matches(str(real[-1]), allowed, n=1)
            msg += f" (did you mean '{close[0]}'?)" if close else ""
            msg += f"; expected one of: {', '.join(allowed)}"
    elif kind != "value_error":
        value = err.get("input")
        if not isinstance(value, (dict, list)):
            msg = f"{msg} (got {quote(value)})"
    return make(path, lines.line_of(real), format_path(real), msg)


def _data_path(loc: Path, data: Any) -> Path:
    """Drop pydantic's union/tag markers from `loc` so that it names keys present in `data`."""
    out: list[str | int] = []
    cur = data
    for i, part in enumerate(loc):
        if isinstance(cur, dict) and part in cur:
            cur = cur[part]
            out.append(part)
        elif isinstance(cur, list) and isinstance(part, int) and 0 <= part < len(cur):
            cur = cur[part]
            out.append(part)
        elif i == len(loc) - 1:
            out.append(part)
    return tuple(out)


def _allowed_keys(model: type[BaseModel], path: Path) -> list[str]:
    """The field names of the model found at `path` below `model` (best effort; [] if unknown)."""
    tp: Any = model
    for part in path:
        tp = _step(tp, part)
        if tp is None:
            return []
    models = [m for m in _unwrap(tp) if isinstance(m, type) and issubclass(m, BaseModel)]
    if len(models) != 1:
        return []
    return sorted(f.alias or name for name, f in models[0].model_fields.items())


def _unwrap(tp: Any) -> list[Any]:
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return _unwrap(typing.get_args(tp)[0])
    if origin is typing.Union or origin is types.UnionType:
        return [u for a in typing.get_args(tp) for u in _unwrap(a)]
    return [tp]


def _step(tp: Any, part: str | int) -> Any:
    for cand in _unwrap(tp):
        if isinstance(cand, type) and issubclass(cand, BaseModel):
            f = cand.model_fields.get(str(part))
            if f is not None:
                return f.annotation
        origin = typing.get_origin(cand)
        if origin in (list, tuple) and isinstance(part, int):
            return typing.get_args(cand)[0]
        if origin is dict:
            return typing.get_args(cand)[1]
    return None
