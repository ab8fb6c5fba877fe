"""Is the MQTT broker there: TCP connect, then an MQTT 3.1.1 CONNECT and its CONNACK.

A raw socket with one deadline, so the doctor needs no event loop and sees exactly why a broker
refuses (bad credentials, not authorised) rather than a client library's retry loop. The client
id is the doctor's own: a running daemon's session is never taken over.
"""

from __future__ import annotations

import os
import socket
import ssl
import struct
import time
from urllib.parse import unquote, urlsplit

from ..urls import redact_url
from .checks import Check

CONNACK_CODES = {
    1: "unacceptable protocol version",
    2: "client identifier rejected",
    3: "server unavailable",
    4: "bad user name or password",
    5: "not authorised",
}
"""MQTT 3.1.1 CONNACK return codes other than 0 (accepted)."""


def _utf8(text: str) -> bytes:
    data = text.encode("utf-8")
    return struct.pack("!H", len(data)) + data


def _remaining_length(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n % 128, n // 128
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def connect_packet(
    client_id: str, username: str | None = None, password: str | None = None, keepalive: int = 10
) -> bytes:
    """An MQTT 3.1.1 CONNECT with a clean session."""
    flags = 0x02 | (0x80 if username is not None else 0) | (0x40 if password is not None else 0)
    body = _utf8("MQTT") + bytes([4, flags]) + struct.pack("!H", keepalive) + _utf8(client_id)
    if username is not None:
        body += _utf8(username)
    if password is not None:
        body += _utf8(password)
    return b"\x10" + _remaining_length(len(body)) + body


def _read_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the broker closed the connection before CONNACK")
        data += chunk
    return data


def mqtt_ping(
    url: str,
    *,
    username: str | None = None,
    password: str | None = None,
    tls: bool = False,
    ca_file: str | None = None,
    cert_file: str | None = None,
    key_file: str | None = None,
    timeout_s: float = 2.0,
) -> tuple[bool, str]:
    """(True, "CONNACK accepted in N ms") when the broker at `url` accepts a CONNECT, else (False, why).

    User name and password default to the URL's (``mqtt://user:pass@host``), as the daemon's.
    """
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    secure = tls or parts.scheme == "mqtts"
    port = parts.port or (8883 if secure else 1883)
    if username is None and parts.username:
        username = unquote(parts.username)
    if password is None and parts.password:
        password = unquote(parts.password)
    started = time.perf_counter()
    try:
        raw = socket.create_connection((host, port), timeout=timeout_s)
    except TimeoutError:
        return False, f"TCP connect to {host}:{port}: no answer within {timeout_s:g} s"
    except OSError as exc:
        return False, f"TCP connect to {host}:{port}: {exc.strerror or exc}"
    sock: socket.socket = raw
    try:
        if secure:
            context = ssl.create_default_context(cafile=ca_file)
            if cert_file is not None:
                context.load_cert_chain(cert_file, key_file)
            sock = context.wrap_socket(raw, server_hostname=host)
        sock.settimeout(max(0.05, timeout_s - (time.perf_counter() - started)))
        sock.sendall(connect_packet(f"genie-doctor-{os.getpid()}", username, password))
        header = _read_exact(sock, 4)
        if header[0] != 0x20 or header[1] != 0x02:
            return False, f"{host}:{port} answered, but not with an MQTT CONNACK ({header.hex()})"
        code = header[3]
        if code:
            return False, f"{host}:{port} refused the connection: {CONNACK_CODES.get(code, f'code {code}')}"
        try:
            sock.sendall(b"\xe0\x00")  # DISCONNECT
        except OSError:
            pass
        ms = (time.perf_counter() - started) * 1000
        return True, f"{host}:{port} accepted MQTT CONNECT in {ms:.0f} ms"
    except TimeoutError:
        return False, f"{host}:{port} accepted TCP but sent no CONNACK within {timeout_s:g} s"
    except (OSError, ConnectionError) as exc:
        return False, f"{host}:{port}: {exc}"
    finally:
        sock.close()


def check_broker(url: str | None, ping: tuple[bool, str] | None) -> Check:
    """The broker verdict: `ping` is mqtt_ping's answer (None when MQTT is disabled)."""
    if url is None or ping is None:
        return Check("broker", "ok", "MQTT disabled (mqtt.url is null)")
    url = redact_url(url) or ""  # never show a password given in the URL
    up, why = ping
    if up:
        return Check("broker", "ok", f"{url}: {why}")
    if "refused the connection" in why:
        fix = "set mqtt.username / mqtt.password to a user of the broker's password_file"
    else:
        fix = (
            "install and start Mosquitto (apt install mosquitto; deploy/mosquitto/genie.conf) or fix "
            "mqtt.url; the daemon runs without it and reconnects, but Home Assistant sees nothing"
        )
    return Check("broker", "warn", f"{url}: {why}", fix)
