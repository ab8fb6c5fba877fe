"""The MQTT client task: connection loop, discovery, state publishing, commands and voice hints.

``MqttBridge.run`` lives in the daemon's task group. Each connection: connect (with a retained
``offline`` will on ``<base>/<node>/availability``) -> find our own retained discovery and clear
what is stale -> publish discovery and every state -> ``online`` -> work until the connection
drops. On an error it logs, backs off (0.5 s doubling to ``reconnect_max_s``, starting over after
a connection that got online) and retries; cancellation always propagates, after publishing
``offline`` and disconnecting cleanly (bounded by a short deadline). ``online`` is re-published
with every periodic refresh (a heartbeat); a frozen daemon stops sending keepalives, and the
broker publishes the will after 1.5 x ``keepalive``.

Commands wait in ``PendingCommands`` (one per topic, the latest value wins) and run one after the
other; voice hints run at once. A refused command (bad payload, or the app's callback raising
ValueError) is published on the ``command_error`` sensor and the control's state is sent again, so
Home Assistant's number, select or switch snaps back to the value in force.

Readiness: ``task_status.started()`` is called once the first connection is online, or after
``startup_wait_s`` when the broker cannot be reached: the daemon never waits on the broker; the
bridge keeps retrying in the background.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable
from typing import Any

import aiomqtt
import anyio
import structlog
from anyio.abc import TaskStatus

from .. import __version__
from ..config import MqttConfig
from ..errors import CommandError
from ..state import StateStore
from ..urls import redact_url
from .commands import (
    COMMAND_PATHS,
    Command,
    MqttCommands,
    PendingCommands,
    parse_command,
    quote,
)
from .connection import BROKER_TIMEOUT_S as BROKER_TIMEOUT_S
from .connection import broker_url, describe, leaves, make_client, now_iso, payload_bytes, scan_retained
from .discovery import (
    DeviceInfo,
    device_config,
    entity_configs,
    expire_after,
    plan_cleanup,
    signature,
)
from .entities import entities
from .entity_model import CommandRefusal, Entity, Inputs, Topics
from .publisher import Message, StatePublisher, render

log = structlog.get_logger(__name__)

BACKOFF_START_S = 0.5
"""First wait after a failed or lost connection."""
SHUTDOWN_TIMEOUT_S = 2.0
"""Longest a clean shutdown spends publishing ``offline`` and disconnecting."""
HA_BIRTH_DELAY_S = (0.5, 2.5)
"""Discovery and state are re-sent this long (uniformly jittered) after Home Assistant comes online."""
RENDER_COALESCE_S = 0.05
"""Store changes closer together than this are rendered once (engine stats can change per token)."""


class MqttBridge:
    """Publishes the supervisor to Home Assistant over MQTT and takes its commands."""

    def __init__(
        self,
        config: MqttConfig,
        node_id: str,
        store: StateStore,
        *,
        gate_metrics: Callable[[], dict[str, Any]],
        commands: MqttCommands,
        clock: Callable[[], float] = time.monotonic,
        device_name: str | None = None,
        min_publish_interval_s: float = 1.0,
    ) -> None:
        self._config = config
        self._store = store
        self._gate_metrics = gate_metrics
        self._commands = commands
        self._clock = clock
        self.topics = Topics.make(config.base_topic, config.discovery_prefix, node_id)
        """Every topic of this node."""
        self.device = DeviceInfo(node_id, device_name or f"Genie {node_id}", sw_version=__version__)
        """The Home Assistant device."""
        self.connected = False
        """A connection is up (and past the handshake)."""
        self.connections = 0
        """Connections that got online since start."""
        self.last_error: str | None = None
        """Why the last connection ended or failed, None before the first failure."""
        self.since: str | None = None
        """When ``connected`` last changed (ISO 8601, UTC); None before the first attempt ended."""
        self.last_command_error: CommandRefusal | None = None
        """The last refused command (published on the ``command_error`` sensor)."""
        self._pending = PendingCommands()
        self._status_changed = anyio.Event()
        self._publisher = StatePublisher(min_interval_s=min_publish_interval_s, clock=clock)
        self._online = anyio.Event()
        self._wake = anyio.Event()
        self._published: dict[str, str] = {}
        self._removed: dict[str, str] = {}
        self._signature: str | None = None
        self._birth_at: float | None = None
        self._random = random.Random()

    # -- the task -----------------------------------------------------------------------------
    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Connect and keep connected until cancelled; ready once online or after ``startup_wait_s``."""
        if self._config.url is None:
            log.info("mqtt_disabled")
            task_status.started()
            return
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._reconnect_loop)
            with anyio.move_on_after(self._config.startup_wait_s):
                await self._online.wait()
            if not self._online.is_set():
                log.warning(
                    "mqtt_not_online_at_start",
                    broker=self.broker,
                    waited_s=self._config.startup_wait_s,
                    error=self.last_error,
                )
            task_status.started()

    @property
    def broker(self) -> str:
        """The broker URL without credentials (for logs and /status)."""
        return broker_url(self._config.url)

    def status(self) -> dict[str, Any]:
        """Connection state for /status (no credentials)."""
        refusal = self.last_command_error
        return {
            "url": redact_url(self._config.url),
            "enabled": self._config.url is not None,
            "broker": self.broker if self._config.url else None,
            "connected": self.connected,
            "since": self.since,
            "connections": self.connections,
            "last_error": self.last_error,
            "availability_topic": self.topics.availability,
            "last_command_error": refusal.__dict__ if refusal is not None else None,
        }

    async def wait_status(self, pred: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        """``status()`` once `pred` holds for it (checked at every connect, disconnect and failure)."""
        while not pred(status := self.status()):
            await self._status_changed.wait()
        return status

    def _status_change(self) -> None:
        self._status_changed.set()
        self._status_changed = anyio.Event()

    def _set_connected(self, up: bool) -> None:
        self.connected = up
        self.since = now_iso()
        self._status_change()

    async def _reconnect_loop(self) -> None:
        delay = BACKOFF_START_S
        while True:
            got_online = self.connections
            try:
                await self._connection()
            except Exception as exc:  # cancellation is not an Exception: it always propagates
                self.last_error = describe(exc)
                self._status_change()
                if self.connections > got_online:
                    delay = BACKOFF_START_S
                unexpected = [e for e in leaves(exc) if not isinstance(e, aiomqtt.MqttError)]
                log.warning(
                    "mqtt_connection_lost" if self.connections > got_online else "mqtt_connect_failed",
                    broker=self.broker,
                    error=self.last_error,
                    retry_in_s=delay,
                    exc_info=unexpected[0] if unexpected else None,
                )
            wait = delay * self._random.uniform(0.8, 1.0)
            delay = min(delay * 2, self._config.reconnect_max_s)
            await anyio.sleep(wait)

    async def _connection(self) -> None:
        client = make_client(self._config, self.topics)
        try:
            await client.__aenter__()  # connect; the exit below is shielded so it runs on cancellation
        except BaseException:
            self.since = self.since or now_iso()
            raise
        self._set_connected(True)
        try:
            await self._session(client)
        except BaseException:
            if anyio.current_effective_deadline() == -math.inf:  # being cancelled: clean shutdown
                with anyio.CancelScope(shield=True), anyio.move_on_after(SHUTDOWN_TIMEOUT_S):
                    await client.publish(self.topics.availability, "offline", qos=1, retain=True)
                    log.info("mqtt_offline", broker=self.broker)
            raise
        finally:
            self._set_connected(False)
            with anyio.CancelScope(shield=True), anyio.move_on_after(SHUTDOWN_TIMEOUT_S):
                try:
                    await client.__aexit__(None, None, None)
                except aiomqtt.MqttError:
                    pass

    # -- one connection -------------------------------------------------------------------------
    async def _session(self, client: aiomqtt.Client) -> None:
        t = self.topics
        self._publisher.reset()
        self._signature = None
        retained = await scan_retained(client, t)
        await client.subscribe(
            [(t.state(path), 1) for path in COMMAND_PATHS]
            + [(topic, 1) for topic in sorted({t.ha_status, "homeassistant/status"})]
        )
        inputs = self._inputs()
        ents = entities(inputs)
        cleanup = plan_cleanup(retained, t, ents, per_entity=self._config.per_entity_discovery)
        for topic in cleanup.clear_topics:
            await client.publish(topic, b"", qos=1, retain=True)
        self._removed.update(cleanup.removed)
        if cleanup.clear_topics or cleanup.removed:
            log.info(
                "mqtt_stale_discovery_removed", topics=list(cleanup.clear_topics), components=sorted(cleanup.removed)
            )
        await self._publish_discovery(client, ents)
        await self._send(client, self._publisher.refresh(render(ents, inputs, t)))
        await client.publish(t.availability, "online", qos=1, retain=True)
        self.connections += 1
        self._online.set()
        log.info(
            "mqtt_online",
            broker=self.broker,
            entities=len(ents),
            connections=self.connections,
            discovery="per_entity" if self._config.per_entity_discovery else "device",
        )
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._watch_store)
            tg.start_soon(self._run_commands)
            tg.start_soon(self._publish_loop, client)
            await self._receive(client)
            tg.cancel_scope.cancel()  # the message stream ended: the connection is gone
        raise aiomqtt.MqttError("message stream ended")

    def _inputs(self) -> Inputs:
        c = self._commands
        return Inputs(
            snapshot=self._store.snapshot(),
            gate=self._gate_metrics(),
            policy_options=tuple(c.policy_options()),
            active_policy=c.active_policy(),
            llm_enabled=c.llm_enabled(),
            thermal_soft_limit=c.thermal_soft_limit(),
            thermal_limit_range=c.thermal_limit_range,
            command_error=self.last_command_error,
        )

    def notify(self) -> None:
        """Something outside the store changed (e.g. the arbiter applied a decision): publish changes now."""
        self._wake.set()

    async def _watch_store(self) -> None:
        while True:
            await self._store.wait_changed(self._store.version)
            self.notify()

    async def _publish_loop(self, client: aiomqtt.Client) -> None:
        interval = self._config.publish_interval_s
        next_refresh = self._clock() + interval
        due: float | None = None
        last_render = -math.inf
        while True:
            deadline = min(
                next_refresh, math.inf if due is None else due, math.inf if self._birth_at is None else self._birth_at
            )
            with anyio.move_on_after(max(0.0, deadline - self._clock())):
                await self._wake.wait()
            await anyio.sleep(max(0.0, last_render + RENDER_COALESCE_S - self._clock()))
            self._wake = anyio.Event()
            now = last_render = self._clock()
            inputs = self._inputs()
            ents = entities(inputs)
            messages = render(ents, inputs, self.topics)
            if self._birth_at is not None and now >= self._birth_at:
                self._birth_at = None
                log.info("mqtt_republish", why="homeassistant_online")
                await self._publish_discovery(client, ents, force=True)
                await self._send(client, self._publisher.refresh(messages))
                await client.publish(self.topics.availability, "online", qos=1, retain=True)
                next_refresh, due = now + interval, None
                continue
            if signature(ents) != self._signature:
                await self._publish_discovery(client, ents)
            if now >= next_refresh:
                await self._send(client, self._publisher.refresh(messages))
                await client.publish(self.topics.availability, "online", qos=1, retain=True)  # heartbeat
                next_refresh, due = now + interval, None
            else:
                out, due = self._publisher.changes(messages)
                await self._send(client, out)

    async def _send(self, client: aiomqtt.Client, messages: list[Message]) -> None:
        for m in messages:
            await client.publish(m.topic, m.payload, qos=0, retain=True)

    async def _publish_discovery(self, client: aiomqtt.Client, ents: list[Entity], *, force: bool = False) -> None:
        sig = signature(ents)
        if not force and sig == self._signature:
            return
        t = self.topics
        current = {e.key: e.platform for e in ents}
        gone = {k: p for k, p in self._published.items() if k not in current}
        expire_s = expire_after(self._config.publish_interval_s)
        if self._config.per_entity_discovery:
            for key, platform in gone.items():
                await client.publish(t.entity_config(platform, key), b"", qos=1, retain=True)
            for topic, cfg in entity_configs(ents, t, self.device, expire_s=expire_s).items():
                await client.publish(topic, json.dumps(cfg), qos=1, retain=True)
        else:
            self._removed.update(gone)
            for key in current:
                self._removed.pop(key, None)
            cfg = device_config(ents, t, self.device, expire_s=expire_s, removed=self._removed)
            await client.publish(t.device_config, json.dumps(cfg), qos=1, retain=True)
        if gone:
            log.info("mqtt_entities_removed", entities=sorted(gone))
        self._published, self._signature = current, sig

    async def _receive(self, client: aiomqtt.Client) -> None:
        async for msg in client.messages:
            topic, body = msg.topic.value, payload_bytes(msg.payload)
            try:
                await self._handle(topic, body, retained=msg.retain)
            except Exception:  # one bad message never ends the connection
                log.exception("mqtt_message_crashed", topic=topic, payload=quote(body))

    async def _handle(self, topic: str, body: bytes, *, retained: bool) -> None:
        t = self.topics
        prefix = t.base + "/"
        if topic in (t.ha_status, "homeassistant/status"):
            if body.strip().lower() == b"online":
                self._birth_at = self._clock() + self._random.uniform(*HA_BIRTH_DELAY_S)
                self.notify()
            return
        path = topic[len(prefix) :] if topic.startswith(prefix) else ""
        if path not in COMMAND_PATHS:
            return
        if retained:
            log.warning("mqtt_command_ignored", topic=topic, why="retained command messages are not acted on")
            return
        try:
            cmd = parse_command(path, topic, body, self._inputs())
        except CommandError as exc:
            log.warning("mqtt_command_rejected", topic=topic, payload=quote(body), error=exc.message)
            self._refuse(topic, path, quote(body), exc.message)
            return
        if cmd.action == "voice_hint":  # the voice path never waits behind a slow command
            await self._call(cmd)
            return
        if self._pending.put(path, cmd):
            log.debug("mqtt_command_coalesced", topic=topic, why="a newer command on this topic replaced it")

    async def _run_commands(self) -> None:
        while True:
            await self._call(await self._pending.get())

    async def _call(self, cmd: Command) -> None:
        try:
            await cmd.run(self._commands)
        except ValueError as exc:
            log.warning("mqtt_command_failed", action=cmd.action, arg=cmd.arg, error=str(exc))
            self._refuse_command(cmd, str(exc))
        except Exception as exc:
            log.exception("mqtt_command_crashed", action=cmd.action, arg=cmd.arg)
            self._refuse_command(cmd, f"internal error: {type(exc).__name__}")
        else:
            log.info("mqtt_command", action=cmd.action, arg=cmd.arg)
        self.notify()

    def _refuse_command(self, cmd: Command, reason: str) -> None:
        prefix = self.topics.base + "/"
        self._refuse(cmd.topic, cmd.topic[len(prefix) :] if cmd.topic.startswith(prefix) else "", cmd.payload, reason)

    def _refuse(self, topic: str, path: str, payload: str, reason: str) -> None:
        """Publish the refusal, and send the refused control's state again so Home Assistant snaps back."""
        self.last_command_error = CommandRefusal(topic, payload, reason, now_iso())
        for e in entities(self._inputs()):
            if e.command == path and e.state is not None:
                self._publisher.forget(self.topics.state(e.state))
        self.notify()
