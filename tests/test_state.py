"""StateStore: snapshots, overlapping voice sessions, hint expiry, change notification; voice hints."""

from __future__ import annotations

import anyio
import pytest

from genie_supervisor.events import EngineStats, ServiceObservation, TelemetrySample, VoiceActivity
from genie_supervisor.state import StateStore
from genie_supervisor.voice import VoiceHints


class Clock:
    """A settable clock for the store."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def stt(active: bool, ts: float, session: str | None = None, source: str = "proxy:whisper") -> VoiceActivity:
    """An STT start/stop event."""
    return VoiceActivity("stt", active, source, ts=ts, session=session)


def test_snapshot_holds_latest_observations() -> None:
    """The snapshot carries the latest telemetry, service and engine observations."""
    clock = Clock(5.0)
    store = StateStore(clock=clock)
    store.publish(TelemetrySample("simulated", ts=1.0, temps_c={"cpu": 50}))
    store.publish(TelemetrySample("simulated", ts=2.0, temps_c={"cpu": 60}))
    store.publish(ServiceObservation("whisper", up=True, ts=3.0))
    store.publish(EngineStats("decoding", ts=4.0))
    s = store.snapshot()
    assert s.ts == 5.0 and s.telemetry is not None and s.telemetry.temps_c == {"cpu": 60}
    assert s.services["whisper"].up and s.engine is not None and s.engine.state == "decoding"
    assert s.version == 4


def test_publish_rejects_non_observations() -> None:
    """Only observation types can be published."""
    with pytest.raises(TypeError):
        StateStore().publish("hello")  # type: ignore[arg-type]


def test_overlapping_sessions_keep_stt_active_until_both_end() -> None:
    """Two concurrent STT requests keep STT active until both have stopped."""
    clock = Clock(10.0)
    store = StateStore(clock=clock)
    store.publish(stt(True, 1.0, "a"))
    store.publish(stt(True, 2.0, "b"))
    v = store.snapshot().voice
    assert v.stt_active and v.stt_sessions == 2 and v.stt_active_since == 1.0
    store.publish(stt(False, 3.0, "a"))
    assert store.snapshot().voice.stt_active and store.snapshot().voice.stt_sessions == 1
    store.publish(stt(False, 4.0, "b"))
    v = store.snapshot().voice
    assert not v.stt_active and v.stt_idle_since == 4.0


def test_anonymous_hints_are_counted() -> None:
    """Hints without a session count starts and stops, and a stop never goes below zero."""
    store = StateStore(clock=Clock(10.0))
    store.publish(stt(True, 1.0, source="http"))
    store.publish(stt(True, 2.0, source="http"))
    store.publish(stt(False, 3.0, source="mqtt"))  # closes the oldest anonymous start
    assert store.snapshot().voice.stt_sessions == 1
    store.publish(stt(False, 4.0, source="http"))
    store.publish(stt(False, 5.0, source="http"))
    v = store.snapshot().voice
    assert v.stt_sessions == 0 and v.stt_idle_since == 4.0


def test_stop_of_unknown_session_is_ignored() -> None:
    """A stop for a session that never started changes nothing."""
    store = StateStore(clock=Clock(1.0))
    store.publish(stt(True, 0.5, "a"))
    store.publish(stt(False, 0.6, "zzz"))
    assert store.snapshot().voice.stt_sessions == 1


def test_hint_start_without_stop_expires() -> None:
    """An STT start with no stop expires after hint_timeout_s, going idle at the expiry time."""
    clock = Clock(0.0)
    store = StateStore(hint_timeout_s=30.0, clock=clock)
    store.publish(stt(True, 0.0, source="http"))
    assert store.snapshot().voice.hint_expires_at == 30.0
    clock.t = 29.9
    assert store.expire() is False and store.snapshot().voice.stt_active
    clock.t = 31.0
    assert store.expire() is True
    v = store.snapshot().voice
    assert not v.stt_active and v.stt_idle_since == 30.0 and v.hint_expires_at is None


def test_stt_unknown_for_watched_stt_service() -> None:
    """A watched STT service whose state is unknown sets stt_unknown; other services do not."""
    store = StateStore(stt_services=["whisper"], clock=Clock(1.0))
    store.publish(ServiceObservation("piper", up=None, ts=0.5))
    assert not store.snapshot().voice.stt_unknown
    store.publish(ServiceObservation("whisper", up=None, ts=0.6))
    assert store.snapshot().voice.stt_unknown
    store.publish(ServiceObservation("whisper", up=True, ts=0.7))
    assert not store.snapshot().voice.stt_unknown


def test_policy_status_is_recorded() -> None:
    """set_policy records the policy name and last error in the snapshot."""
    store = StateStore()
    store.set_policy("orin", "p.yaml:3 x: bad")
    s = store.snapshot()
    assert (s.policy_name, s.policy_error) == ("orin", "p.yaml:3 x: bad")


async def test_subscribe_wakes_on_publish() -> None:
    """A subscriber gets the current snapshot and then one after each change."""
    store = StateStore()
    got: list[int] = []
    ready = anyio.Event()
    done = anyio.Event()

    async def consume() -> None:
        async for s in store.subscribe():
            got.append(s.version)
            ready.set()
            if s.version >= 1:
                done.set()
                return

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await ready.wait()
            store.publish(TelemetrySample("simulated"))
            await done.wait()
    assert got == [0, 1]


async def test_run_expiry_expires_on_time() -> None:
    """The expiry task drops a lost start after the timeout without any other event."""
    store = StateStore(hint_timeout_s=0.05)
    VoiceHints(store).handle({"service": "stt", "event": "start"}, "http")
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            await tg.start(store.run_expiry)
            version = store.version
            await store.wait_changed(version)
            tg.cancel_scope.cancel()
    assert not store.snapshot().voice.stt_active


def test_voice_hints_publish_activity() -> None:
    """A valid hint becomes a VoiceActivity in the store."""
    store = StateStore(clock=Clock(2.0))
    hints = VoiceHints(store, clock=lambda: 1.5)
    act = hints.handle({"service": "stt", "event": "start"}, "http")
    assert (act.service, act.active, act.source, act.ts) == ("stt", True, "http", 1.5)
    assert store.snapshot().voice.stt_active
    hints.handle_json(b'{"service": "stt", "event": "stop"}', "mqtt")
    assert not store.snapshot().voice.stt_active


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ([], "a voice hint must be a JSON object, got list"),
        ({"service": "asr", "event": "start"}, "service must be 'stt' or 'tts', got 'asr'"),
        ({"service": "stt", "event": "go"}, "event must be 'start' or 'stop', got 'go'"),
        ({"service": "stt"}, "event must be 'start' or 'stop', got None"),
        (
            {"service": "stt", "event": "start", "x": 1},
            "unknown key 'x'; expected service, event and optionally session",
        ),
        ({"service": "stt", "event": "start", "session": 3}, "session must be a string, got 3"),
    ],
)
def test_voice_hints_reject_bad_payloads(payload: object, message: str) -> None:
    """A bad hint is refused with a clear one-line reason and publishes nothing."""
    store = StateStore()
    with pytest.raises(ValueError) as exc:
        VoiceHints(store).handle(payload, "http")
    assert str(exc.value) == message and store.version == 0


def test_voice_hints_reject_bad_json() -> None:
    """A payload that is not JSON is refused."""
    with pytest.raises(ValueError, match="must be JSON"):
        VoiceHints(StateStore()).handle_json(b"{nope", "mqtt")
