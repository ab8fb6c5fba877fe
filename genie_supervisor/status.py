"""``genie-supervisor status [--url URL]``: the running daemon's state (from ``GET /status``), for people.

With an API key configured, pass it in ``$GENIE_API_KEY``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import httpx

from .urls import redact_url


def _mb(value: Any) -> str:
    return f"{value:.1f} MiB" if isinstance(value, (int, float)) else "-"


def _remote(r: dict[str, Any] | None) -> str:
    """A backend openai model's remote: URL, model name, state, and who answers while it is down."""
    if not r:
        return ""
    via = f", answered by {r.get('fallback_model')}" if r.get("serving") == "fallback" else ""
    return f"  remote {r.get('url')} model {r.get('remote_model')}: {r.get('state')}{via}"


def format_status(s: dict[str, Any], url: str) -> str:
    """The /status JSON as a few aligned lines."""
    lines: list[str] = []
    eng = s.get("engine") or {}
    backend = s.get("backend") or {}
    policy = s.get("policy") or {}
    lines.append(
        f"genie-supervisor {s.get('version', '?')} at {url}: {'ready' if s.get('ready') else 'starting'}, "
        f"up {s.get('uptime_s', 0):.0f} s, node {s.get('node_id', '?')}"
    )
    pol = f"policy: {policy.get('name')}" + (f" ({policy.get('path')})" if policy.get("path") else " (built-in)")
    if policy.get("error"):
        pol += f"  REJECTED RELOAD: {policy['error']}"
    lines.append(pol)
    fb = backend.get("fallback")
    lines.append(
        f"backend: {backend.get('default') or eng.get('backend_identity') or '-'} "
        f"(configured {backend.get('configured', '-')}, fallback {fb or 'none'}"
        f"{', IN USE' if eng.get('fell_back') else ''}); engine {eng.get('state', '-')}"
        f"{'' if eng.get('enabled', True) else ' (LLM disabled)'}"
    )
    gate = s.get("gate") or {}
    g = f"gate: {gate.get('mode', '-')}"
    if gate.get("reasons"):
        g += f" ({', '.join(gate['reasons'])})"
    if gate.get("throttle_tps"):
        g += f" at {gate['throttle_tps']:g} tok/s"
    paused = gate.get("paused_seconds") or {}
    if paused:
        g += "; paused so far: " + ", ".join(f"{r} {sec:.1f} s" for r, sec in sorted(paused.items()))
    if gate.get("reaction_ms_p99") is not None:
        g += f"; pause reaction p99 {gate['reaction_ms_p99']:.1f} ms"
    lines.append(g)
    models = s.get("models") or []
    if models:
        lines.append("models:")
        width = max(len(m["id"]) for m in models)
        for m in models:
            flags = [
                f
                for f, on in (
                    ("resident", m.get("resident")),
                    (f"group {m.get('group')}", m.get("group")),
                    ("draining", m.get("draining")),
                )
                if on
            ]
            roles = ",".join(m.get("roles") or []) or "-"
            mem = (m.get("memory") or {}).get("total_mb")
            lines.append(
                f"  {m['id']:<{width}}  {m.get('state', '-'):<8}  {m.get('backend_identity', '-'):<18} "
                f"{_mb(mem):>10}  roles {roles}  in flight {m.get('in_flight', 0)}"
                + (f"  [{', '.join(flags)}]" if flags else "")
                + (f"  error: {m['error']}" if m.get("error") else "")
                + _remote(m.get("remote"))
            )
    else:
        lines.append("models: none configured")
    adm = s.get("admission") or {}
    if adm:
        lines.append(
            f"admission: {adm.get('running', 0)}/{adm.get('max_running', '?')} running, "
            f"{adm.get('queued', 0)}/{adm.get('max_queue', '?')} queued"
            + (f"; rejected {adm['rejected']}" if adm.get("rejected") else "")
        )
    first = s.get("first_reply_ms") or {}
    if first:
        lines.append(
            "first reply: " + ", ".join(f"{k} {v:.0f} ms" if v is not None else f"{k} failed" for k, v in first.items())
        )
    services = s.get("services") or {}
    if services:
        lines.append("services:")
        for name, obs in sorted(services.items()):
            up = {True: "up", False: "DOWN", None: "unknown"}.get(obs.get("up"), "?")
            extra = f" ({obs['reason']})" if obs.get("reason") else ""
            lines.append(f"  {name}: {up}{extra}" + (f", {_mb(obs.get('rss_mb'))}" if obs.get("rss_mb") else ""))
    voice = s.get("voice") or {}
    if voice:
        lines.append(
            f"voice: stt {'active' if voice.get('stt_active') else 'idle'}, "
            f"tts {'active' if voice.get('tts_active') else 'idle'}"
        )
    mqtt = s.get("mqtt") or {}
    if not mqtt.get("url"):
        lines.append("mqtt: off")
    else:
        where = redact_url(mqtt.get("broker") or mqtt.get("url"))  # an older daemon may show credentials
        state = "connected" if mqtt.get("connected") else "NOT CONNECTED"
        line = f"mqtt: {where} {state}" + (f" since {mqtt['since']}" if mqtt.get("since") else "")
        if not mqtt.get("connected") and mqtt.get("last_error"):
            line += f" ({mqtt['last_error']})"
        refusal = mqtt.get("last_command_error")
        if refusal:
            line += (
                f"; last refused command: {refusal.get('topic')} {refusal.get('payload')!r}: {refusal.get('reason')}"
            )
        lines.append(line)
    return "\n".join(lines)


def cmd_status(args: argparse.Namespace) -> int:
    """Print the daemon's state; exit 1 with one clear line when it cannot be reached."""
    url = str(getattr(args, "url", None) or "http://127.0.0.1:8080").rstrip("/")
    key = os.environ.get("GENIE_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        r = httpx.get(f"{url}/status", timeout=5.0, headers=headers)
        r.raise_for_status()
        data = r.json()
    except httpx.HTTPStatusError as exc:
        if exc.response.status_code == 401:
            print(
                f"error: {url}/status wants the API key: GENIE_API_KEY=$(sudo cat /etc/genie-supervisor/api-key) "
                "genie-supervisor status" + (" (the key in GENIE_API_KEY was refused)" if key else ""),
                file=sys.stderr,
            )
            return 1
        print(f"error: {url}/status answered {exc.response.status_code}; is that a genie-supervisor?", file=sys.stderr)
        return 1
    except httpx.HTTPError as exc:
        print(
            f"error: cannot reach the daemon at {url} ({type(exc).__name__}: {exc}); is "
            "`genie-supervisor run` running and listening there (http.listen / --listen)?",
            file=sys.stderr,
        )
        return 1
    except ValueError:
        print(f"error: {url}/status did not answer JSON; is that a genie-supervisor?", file=sys.stderr)
        return 1
    print(format_status(data, url))
    return 0
