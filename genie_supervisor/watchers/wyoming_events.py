"""Reading Wyoming event streams: a strict parser for what clients send, a light scanner for servers.

A Wyoming event is a JSON header line, then ``data_length`` bytes of JSON data, then
``payload_length`` bytes of payload. The proxy parses what a client (Home Assistant, or anyone on
the network) sends with `EventParser`, which hands out only complete, well-formed events -- the
bytes exactly as received -- so the upstream server never sees a malformed or truncated event from
the proxy. What the (trusted) upstream sends back is only followed with `EventScanner`, which finds
event types without copying payloads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

MAX_HEADER_BYTES = 32 * 1024
"""Longest header line accepted from a client (the `wyoming` library's reader stops at 64 KiB)."""
MAX_DATA_BYTES = 1 << 20
"""Largest ``data_length`` accepted from a client."""
MAX_PAYLOAD_BYTES = 2 << 20
"""Largest ``payload_length`` accepted from a client (64 s of 16 kHz 16-bit mono audio)."""

_SCANNER_MAX_HEADER = 1 << 20


class BadEvent(ValueError):
    """A client sent bytes that are not a well-formed Wyoming event; the message says why."""


@dataclass(frozen=True)
class ClientEvent:
    """One complete, validated event from a client."""

    type: str
    """The event's ``type``."""
    raw: bytes
    """Header line, data and payload exactly as received (forwarded unchanged)."""


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _loads(text: str) -> Any:
    return json.loads(text, parse_constant=_no_constants)


def _length(header: dict[str, Any], key: str, limit: int) -> int:
    value = header.get(key)
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadEvent(f"{key} is not an integer: {type(value).__name__}")
    if value < 0:
        raise BadEvent(f"{key} is negative: {value}")
    if value > limit:
        raise BadEvent(f"{key} {value} is over the limit of {limit} bytes")
    return value


def parse_header(line: bytes) -> tuple[str, int, int]:
    """A header line (without its newline) -> ``(type, data_length, payload_length)``, or BadEvent."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        raise BadEvent("header is not UTF-8") from None
    try:
        header = _loads(text)
    except (ValueError, RecursionError):
        raise BadEvent("header is not JSON") from None
    if not isinstance(header, dict):
        raise BadEvent(f"header is a JSON {type(header).__name__}, not an object")
    event_type = header.get("type")
    if not isinstance(event_type, str) or not event_type:
        raise BadEvent("header has no 'type' string")
    if "data" in header and not isinstance(header["data"], dict):
        raise BadEvent(f"'data' is a {type(header['data']).__name__}, not an object")
    return (
        event_type,
        _length(header, "data_length", MAX_DATA_BYTES),
        _length(header, "payload_length", MAX_PAYLOAD_BYTES),
    )


def _check_data(data: bytes) -> None:
    try:
        value = _loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise BadEvent("data is not UTF-8") from None
    except (ValueError, RecursionError):
        raise BadEvent("data is not JSON (data_length does not match?)") from None
    if not isinstance(value, dict):
        raise BadEvent(f"data is a JSON {type(value).__name__}, not an object")


class EventParser:
    """Cuts a client's byte stream into validated events.

    `feed` returns every event completed by the bytes given. At the first malformed event it stops
    for good and sets `error`; the events before it are still returned. Blank lines between events
    are dropped (a `wyoming` server would take one for the end of the stream). `pending` tells
    whether an incomplete event is buffered (it is never handed out).
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self._head: tuple[str, int, int, int] | None = None  # type, header bytes, data, payload
        self.error: str | None = None

    @property
    def pending(self) -> bool:
        """Bytes of an incomplete event are buffered."""
        return bool(self._buf)

    def feed(self, chunk: bytes) -> list[ClientEvent]:
        if self.error is not None:
            return []
        self._buf += chunk
        out: list[ClientEvent] = []
        try:
            while self._next(out):
                pass
        except BadEvent as exc:
            self.error = str(exc)
            self._buf.clear()
        return out

    def _next(self, out: list[ClientEvent]) -> bool:
        buf = self._buf
        if self._head is None:
            newline = buf.find(b"\n", 0, MAX_HEADER_BYTES + 1)
            if newline < 0:
                if len(buf) > MAX_HEADER_BYTES:
                    raise BadEvent(f"header line longer than {MAX_HEADER_BYTES} bytes")
                return False
            line = bytes(buf[:newline])
            if not line.strip():
                del buf[: newline + 1]
                return True
            event_type, data_length, payload_length = parse_header(line)
            self._head = (event_type, newline + 1, data_length, payload_length)
        event_type, head, data_length, payload_length = self._head
        total = head + data_length + payload_length
        if len(buf) < total:
            return False
        if data_length:
            _check_data(bytes(buf[head : head + data_length]))
        out.append(ClientEvent(event_type, bytes(buf[:total])))
        del buf[:total]
        self._head = None
        return True


class EventScanner:
    """Follows one direction of a Wyoming byte stream and finds where each event header ends.

    `feed` takes bytes as they arrive and returns ``(index, type)`` for every header line that
    ends in them, ``index`` being the position of its newline in the chunk. Data and payload bytes
    are skipped without copying. A stream that is not Wyoming sets `broken` and is no longer scanned
    (forwarding goes on regardless). Used on what the upstream server sends, which is trusted.
    """

    def __init__(self) -> None:
        self._header = bytearray()
        self._skip = 0
        self.broken = False

    def feed(self, chunk: bytes) -> list[tuple[int, str]]:
        found: list[tuple[int, str]] = []
        pos, end = 0, len(chunk)
        while pos < end and not self.broken:
            if self._skip:
                step = min(self._skip, end - pos)
                self._skip -= step
                pos += step
                continue
            newline = chunk.find(b"\n", pos)
            if newline < 0:
                self._header += chunk[pos:]
                self.broken = len(self._header) > _SCANNER_MAX_HEADER
                break
            self._header += chunk[pos:newline]
            pos = newline + 1
            line = bytes(self._header)
            self._header.clear()
            if not line.strip():
                continue
            try:
                header = json.loads(line)
                event_type = str(header["type"])
                data_length = int(header.get("data_length") or 0)
                payload_length = int(header.get("payload_length") or 0)
            except (ValueError, KeyError, TypeError, RecursionError):
                self.broken = True
                break
            self._skip = max(data_length, 0) + max(payload_length, 0)
            found.append((newline, event_type))
        return found
