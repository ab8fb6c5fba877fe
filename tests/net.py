"""Loopback networking for the tests: the host they listen on and a free-port picker."""

from __future__ import annotations

import socket

HOST = "127.0.0.1"
"""The loopback address every test server binds."""


def free_port() -> int:
    """A loopback port that was free a moment ago."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])
