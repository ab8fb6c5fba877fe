"""Talking to the broker: the aiomqtt client built from the config, and what the bridge logs about it.

``make_client`` builds the client of one connection attempt (credentials from the config or the
URL, TLS through ``tls_context``, the retained ``offline`` will, ``BROKER_TIMEOUT_S``);
``broker_url`` is the broker without credentials for logs and /status; ``scan_retained`` collects
our own retained discovery at the start of a connection so stale messages can be cleared;
``describe`` flattens an exception group into the text of ``last_error``. ``MqttBridge`` in
``bridge`` runs the connection loop on top of these.
"""

from __future__ import annotations

import logging
import secrets
import ssl
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any
from urllib.parse import unquote, urlsplit

import aiomqtt
import anyio
import structlog

from ..config import MqttConfig
from ..urls import redact_url
from .entity_model import Topics

log = structlog.get_logger("genie_supervisor.mqtt.bridge")  # the logger name these events always had

BROKER_TIMEOUT_S = 10.0
"""Longest wait on the broker (CONNACK, SUBACK, PUBACK); a connection refused after the TLS
handshake (a missing client certificate under TLS 1.3) is seen when the CONNACK wait runs out."""
SCAN_TIMEOUT_S = 3.0
"""Longest the start-up scan for our own retained discovery waits."""


def broker_url(url: str | None) -> str:
    """The broker URL without credentials (for logs and /status)."""
    try:
        parts = urlsplit(url or "")
        host = parts.hostname or ""
        return f"{parts.scheme}://{host}:{parts.port}" if parts.port else f"{parts.scheme}://{host}"
    except ValueError:
        return redact_url(url) or ""


def make_client(cfg: MqttConfig, topics: Topics) -> aiomqtt.Client:
    """The client of one connection attempt to the broker of `cfg`, with the retained ``offline`` will."""
    parts = urlsplit(cfg.url or "")
    tls = cfg.tls or parts.scheme == "mqtts"
    username = cfg.username if cfg.username is not None else (unquote(parts.username) if parts.username else None)
    password = cfg.password if cfg.password is not None else (unquote(parts.password) if parts.password else None)
    return aiomqtt.Client(
        parts.hostname or "localhost",
        parts.port or (8883 if tls else 1883),
        username=username,
        password=password,
        identifier=cfg.client_id or f"genie-{topics.node_id}",
        protocol=aiomqtt.ProtocolVersion.V5 if cfg.protocol == "5" else aiomqtt.ProtocolVersion.V311,
        will=aiomqtt.Will(topics.availability, "offline", qos=1, retain=True),
        keepalive=cfg.keepalive,
        tls_context=tls_context(cfg) if tls else None,
        timeout=BROKER_TIMEOUT_S,
        logger=logging.getLogger("genie_supervisor.mqtt.paho"),
    )


async def scan_retained(client: aiomqtt.Client, t: Topics) -> dict[str, bytes]:
    """Our retained discovery messages, collected until our own marker message comes back."""
    marker_topic = t.state("_sync")
    filters = [t.device_config, t.entity_config_filter, marker_topic]
    await client.subscribe([(f, 1) for f in filters])
    marker = secrets.token_hex(8).encode()
    await client.publish(marker_topic, marker, qos=1)
    found: dict[str, bytes] = {}
    with anyio.move_on_after(SCAN_TIMEOUT_S) as scope:
        async for msg in client.messages:
            body = payload_bytes(msg.payload)
            if msg.topic.value == marker_topic and body == marker:
                break
            if msg.retain and msg.topic.value != marker_topic:
                found[msg.topic.value] = body
    if scope.cancelled_caught:
        log.warning("mqtt_discovery_scan_incomplete", waited_s=SCAN_TIMEOUT_S)
    await client.unsubscribe(filters)
    return found


def now_iso() -> str:
    """The time now, ISO 8601 in UTC to the millisecond with a ``Z``."""
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class _ClosingSSLSocket(ssl.SSLSocket):
    """Closes itself when the handshake fails (paho leaves that socket to the garbage collector)."""

    def do_handshake(self, block: bool = False) -> None:
        try:
            super().do_handshake(block)
        except BaseException:
            self.close()
            raise


def tls_context(cfg: MqttConfig) -> ssl.SSLContext:
    """The client's TLS context: the broker's certificate checked against ``ca_file`` (default: the
    system's CAs) and its host name; ``cert_file`` / ``key_file`` as the client certificate."""
    context = ssl.create_default_context(cafile=cfg.ca_file)
    if cfg.cert_file is not None:
        context.load_cert_chain(cfg.cert_file, cfg.key_file)
    context.sslsocket_class = _ClosingSSLSocket
    return context


def payload_bytes(payload: Any) -> bytes:
    """A received message's payload as bytes (empty for None)."""
    if payload is None:
        return b""
    if isinstance(payload, (bytes, bytearray)):
        return bytes(payload)
    return str(payload).encode()


def leaves(exc: BaseException) -> Iterator[BaseException]:
    """The exceptions inside `exc`, exception groups flattened (`exc` itself when it is no group)."""
    subs = getattr(exc, "exceptions", None)
    if isinstance(subs, tuple) and subs:
        for sub in subs:
            yield from leaves(sub)
    else:
        yield exc


def describe(exc: BaseException) -> str:
    """``Type: message`` of every exception inside `exc`, joined with ``; ``."""
    return "; ".join(f"{type(e).__name__}: {e}" for e in leaves(exc))
