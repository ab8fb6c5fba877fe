"""The daemon's run-time controls, as methods of the Supervisor: the policy in force and what may change it.

`SupervisorControls` holds what an operator can do while the daemon runs: read the policy in force
(the policy file's, else the built-in one, with the thermal soft limit set over MQTT laid over it),
list and select the policy files beside it, set the first thermal level's enter temperature,
reload the policy (SIGHUP, MQTT), and start the MQTT bridge whose commands call these. The
Supervisor (app.py) inherits it and sets the attributes declared here in its constructor.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
from anyio.abc import TaskGroup

from .arbiter import DecodeGate
from .config import Config
from .errors import PolicyErrors
from .llm.manager import ModelManager
from .policy import Policy, PolicyWatcher
from .policy.schema import builtin_policy, with_thermal_soft_limit
from .state import StateStore
from .urls import redact_url

if TYPE_CHECKING:
    from .api.deps import ControlActions, VoiceHintHandler

log = structlog.get_logger("genie_supervisor.app")  # the logger name these events always had


class SupervisorControls:
    """The policy in force, its run-time overrides and the MQTT bridge wired to them (mixed into Supervisor)."""

    cfg: Config
    store: StateStore
    gate: DecodeGate
    voice: VoiceHintHandler
    models: ModelManager
    policy_watcher: PolicyWatcher | None
    thermal_soft_limit: float | None
    mqtt: Any
    _builtin: Policy | None
    _limited: tuple[tuple[int, float], Policy] | None

    @property
    def policy(self) -> Policy:
        """The policy in force (with the thermal soft limit set over MQTT, if any)."""
        if self.policy_watcher is not None and self.policy_watcher.policy is not None:
            base = self.policy_watcher.policy
        else:
            base = self._builtin or builtin_policy()
        if self.thermal_soft_limit is None:
            return base
        key = (id(base), self.thermal_soft_limit)
        if self._limited is None or self._limited[0] != key:
            try:
                self._limited = (key, with_thermal_soft_limit(base, self.thermal_soft_limit))
            except ValueError as exc:  # a new policy file the limit no longer fits: drop the limit
                log.warning("thermal_soft_limit_dropped", limit_c=self.thermal_soft_limit, reason=str(exc))
                self.thermal_soft_limit = None
                return base
        return self._limited[1]

    def policy_options(self) -> list[str]:
        """Policy files selectable at run time: the *.yaml next to the policy in force."""
        if self.policy_watcher is None:
            return [self.policy.name]
        folder = Path(self.policy_watcher.path).parent
        return sorted(p.stem for p in folder.glob("*.yaml"))

    async def select_policy(self, name: str) -> None:
        """Put the policy file `name` (from `policy_options`) in force; a bad file changes nothing."""
        if self.policy_watcher is None or name not in self.policy_options():
            raise ValueError(f"unknown policy {name!r} (options: {', '.join(self.policy_options())})")
        path = Path(self.policy_watcher.path).parent / f"{name}.yaml"
        if not await self.policy_watcher.switch(path):
            raise ValueError(f"policy {name!r} was rejected; {self.policy.name!r} stays in force")

    def active_policy_option(self) -> str | None:
        """The selected policy file's name (the select entity's state)."""
        return Path(self.policy_watcher.path).stem if self.policy_watcher is not None else None

    async def set_thermal_soft_limit(self, celsius: float) -> None:
        """Enter the first thermal level at `celsius` (keeps its hysteresis); re-evaluates now."""
        with_thermal_soft_limit(
            self.policy_watcher.policy
            if self.policy_watcher and self.policy_watcher.policy
            else (self._builtin or builtin_policy()),
            celsius,
        )  # validate first
        self.thermal_soft_limit = celsius
        log.info("thermal_soft_limit_set", limit_c=celsius)
        snap = self.store.snapshot()
        self.store.set_policy(self.policy.name, snap.policy_error)  # wakes the arbiter

    def current_thermal_soft_limit(self) -> float | None:
        """The first thermal level's enter temperature in force (the number entity's state)."""
        levels = self.policy.thermal.levels
        return levels[0].enter_c if levels else None

    def _on_policy(self, policy: Policy, error: PolicyErrors | None) -> None:
        self.store.set_policy(policy.name, str(error) if error else None)
        self.store.set_hint_timeout(policy.voice.hint_timeout_s or self.cfg.voice.hint_timeout_s)

    async def reload_policy(self) -> bool:
        """Reload the policy file now (SIGHUP); False if it was rejected (the old one stays)."""
        if self.policy_watcher is None:
            log.info("policy_reload_skipped", reason="no policy file configured (built-in policy)")
            return False
        return await self.policy_watcher.reload()

    def control_actions(self) -> ControlActions:
        """The controls as the HTTP routes and the web page call them (the MQTT bridge's calls)."""
        from .api.deps import ControlActions  # FastAPI: imported once the HTTP server starts

        return ControlActions(
            select_policy=self.select_policy,
            set_llm_enabled=self.models.set_enabled,
            reload_policy=self.reload_policy,
            policy_options=self.policy_options,
            active_policy=self.active_policy_option,
            llm_enabled=lambda: self.models.enabled,
        )

    async def _start_mqtt(self, tg: TaskGroup) -> None:
        # --- MQTT hook (lead: finish the wiring) ------------------------------------------------
        # Wired: the bridge, voice hints, policy reload, LLM enable/disable and unload (the model
        # manager). Not wired yet (they answer with an error): policy select and the thermal soft
        # limit; they need a policy-override API that does not exist yet.
        if not self.cfg.mqtt.url:
            return
        try:
            from .mqtt import MqttBridge, MqttCommands
        except ImportError as exc:  # pragma: no cover - the package ships with mqtt/
            log.warning("mqtt_unavailable", url=redact_url(self.cfg.mqtt.url), reason=str(exc))
            return

        async def voice_hint(payload: dict[str, Any]) -> None:
            self.voice.handle(payload, "mqtt")

        async def reload_policy() -> None:
            await self.reload_policy()

        async def unload_model() -> None:
            await self.models.unload()

        commands = MqttCommands(
            select_policy=self.select_policy,
            set_llm_enabled=self.models.set_enabled,
            reload_policy=reload_policy,
            unload_model=unload_model,
            set_thermal_soft_limit=self.set_thermal_soft_limit,
            voice_hint=voice_hint,
            policy_options=self.policy_options,
            active_policy=self.active_policy_option,
            thermal_soft_limit=self.current_thermal_soft_limit,
            llm_enabled=lambda: self.models.enabled,
        )
        self.mqtt = MqttBridge(
            self.cfg.mqtt, self.cfg.node_id, self.store, gate_metrics=self.gate.metrics, commands=commands
        )
        await tg.start(self.mqtt.run)
