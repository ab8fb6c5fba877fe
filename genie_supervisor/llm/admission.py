"""Admission: a bounded priority queue in front of the models (voice > tool > background).

    async with admission.slot("voice") as ticket:   # QueueFull (429), QueueTimeout (503)
        ...                                         # at most `max_running` requests are in here

Classes and their limits come from the policy (``priorities.classes``: order, ``max_queue``,
``max_wait_s``), pushed by the arbiter with each decision that changes them; the total queue is
bounded by the config (``api.max_queue``). Waiters are served highest class first, first come first
served within a class. A request more urgent than every running one (a voice turn while background
generations hold the slots) is admitted beyond `max_running`; the engine makes the running
generation yield to it between two steps. When the queue is full, a request of a higher class takes
the place of the newest waiter of the lowest class (which gets 429). A waiter whose task is
cancelled (its client went away) leaves the queue; a slot is always given back, whatever happens
inside the block.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import Counter, defaultdict, deque
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Protocol

import anyio
import structlog

from ..errors import QueueFull, QueueTimeout, UnknownPriority
from ..state import DEFAULT_PRIORITIES, PriorityClass, PriorityTable

log = structlog.get_logger(__name__)

PRIORITY_HEADER = "x-genie-priority"
"""Request header naming the class (the body field ``priority`` works too)."""


class _Headed(Protocol):
    @property
    def headers(self) -> Mapping[str, str]: ...


def request_priority(request: _Headed, body_priority: str | None) -> str | None:
    """The class a request asks for: the `PRIORITY_HEADER` header, else its body's ``priority`` (None: the default)."""
    return request.headers.get(PRIORITY_HEADER) or body_priority


@dataclass(eq=False)
class Ticket:
    """One admitted request."""

    cls: str
    """Its class."""
    enqueued_at: float = field(default_factory=time.monotonic)
    """When it asked."""
    granted_at: float | None = None
    """When it got its slot."""
    rank: int = 0
    seq: int = 0
    event: anyio.Event = field(default_factory=anyio.Event)
    bumped: bool = False

    @property
    def wait_s(self) -> float:
        """Seconds it waited in the queue."""
        return (self.granted_at or time.monotonic()) - self.enqueued_at


class Admission:
    """Slots and a bounded priority queue; counters for /metrics and /status."""

    def __init__(
        self,
        priorities: PriorityTable = DEFAULT_PRIORITIES,
        *,
        max_running: int,
        max_queue: int,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.max_running = max_running
        """Requests in their slot at once."""
        self.max_queue = max_queue
        """Waiting requests, all classes together."""
        self.running = 0
        """Requests holding a slot now."""
        self.waiters: list[Ticket] = []
        """Queued requests, in service order."""
        self.rejected: Counter[tuple[str, str]] = Counter()
        """(class, reason) -> requests refused (queue_full, timeout, disconnected)."""
        self.admitted: Counter[str] = Counter()
        """class -> requests that got a slot."""
        self.wait_sum_s: dict[str, float] = defaultdict(float)
        """class -> seconds waited in total by admitted requests."""
        self._priorities = priorities
        self._on_change = on_change
        self._seq = itertools.count()
        self._durations: deque[float] = deque(maxlen=32)
        self._running_ranks: Counter[int] = Counter()

    # -- classes ----------------------------------------------------------------------------
    def apply_priorities(self, table: PriorityTable) -> None:
        """Serve the classes of `table` from now on (requests already queued keep their place)."""
        self._priorities = table

    def classes(self) -> list[PriorityClass]:
        """The policy's classes, highest first."""
        return list(self._priorities.classes)

    def resolve(self, name: str | None) -> str:
        """The class a request names (None: the policy's default); UnknownPriority if none such."""
        pol = self._priorities
        if name is None or name == "":
            return pol.default_class
        names = [c.name for c in pol.classes]
        if name not in names:
            raise UnknownPriority(f"priority {name!r} is not one of {', '.join(names)}")
        return name

    def _class(self, name: str) -> tuple[int, PriorityClass]:
        for i, c in enumerate(self._priorities.classes):
            if c.name == name:
                return i, c
        raise UnknownPriority(f"priority {name!r} is not defined by the policy")

    @property
    def queued(self) -> int:
        """Requests waiting now."""
        return len(self.waiters)

    def queued_by_class(self) -> dict[str, int]:
        """class -> requests waiting now."""
        out = {c.name: 0 for c in self.classes()}
        for w in self.waiters:
            out[w.cls] = out.get(w.cls, 0) + 1
        return out

    def retry_after(self) -> int:
        """Seconds until a slot is likely free (from recent request durations), 1-60."""
        avg = sum(self._durations) / len(self._durations) if self._durations else 1.0
        est = avg * (len(self.waiters) + 1) / max(1, self.max_running)
        return int(min(60, max(1, math.ceil(est))))

    # -- slots ------------------------------------------------------------------------------
    @asynccontextmanager
    async def slot(self, cls: str) -> AsyncIterator[Ticket]:
        """Hold a slot for the block (waiting in the queue first when all are taken)."""
        ticket = await self._acquire(cls)
        t0 = time.monotonic()
        try:
            yield ticket
        finally:
            self._durations.append(time.monotonic() - t0)
            self._release(ticket)

    async def _acquire(self, cls: str) -> Ticket:
        rank, rc = self._class(cls)
        ticket = Ticket(cls, rank=rank, seq=next(self._seq))
        if self.running < self.max_running and not self.waiters:
            return self._grant_now(ticket)
        if self._outranks_everyone(rank):
            return self._grant_now(ticket)  # the engine makes the lower-class generation yield
        mine = sum(1 for w in self.waiters if w.cls == cls)
        if mine >= rc.max_queue:
            self._reject(cls, "queue_full")
            raise QueueFull(f"the queue of class {cls} is full ({rc.max_queue} waiting)", self.retry_after())
        if len(self.waiters) >= self.max_queue and not self._bump_for(rank):
            self._reject(cls, "queue_full")
            raise QueueFull(
                f"the request queue is full ({self.max_queue} waiting, {self.running} running)", self.retry_after()
            )
        self.waiters.append(ticket)
        self.waiters.sort(key=lambda w: (w.rank, w.seq))
        self._on_change()
        try:
            with anyio.fail_after(rc.max_wait_s):
                await ticket.event.wait()
        except TimeoutError:
            if ticket.granted_at is not None:
                return ticket
            self._reject(cls, "timeout")
            raise QueueTimeout(
                f"waited {rc.max_wait_s:g} s (priorities.classes {cls} max_wait_s) "
                f"without a free slot; {self.running} running, {len(self.waiters)} queued"
            ) from None
        except BaseException:
            if ticket.granted_at is not None:
                self._release(ticket)
            else:
                self._reject(cls, "disconnected")
            raise
        finally:
            if ticket in self.waiters:
                self.waiters.remove(ticket)
                self._on_change()
        if ticket.bumped:
            raise QueueFull("a request of a higher class took this place in the queue", self.retry_after())
        return ticket

    def _outranks_everyone(self, rank: int) -> bool:
        """A request more urgent than every running and waiting one gets a slot beyond
        `max_running` (at most one per class): the engine preempts the lower class between two steps."""
        running = [r for r, n in self._running_ranks.items() if n > 0]
        return bool(running) and rank < min(running) and all(w.rank > rank for w in self.waiters)

    def _bump_for(self, rank: int) -> bool:
        """Make room for a class of `rank` by refusing the newest waiter of a lower class."""
        lower = [w for w in self.waiters if w.rank > rank]
        if not lower:
            return False
        victim = max(lower, key=lambda w: (w.rank, w.seq))
        self.waiters.remove(victim)
        victim.bumped = True
        self._reject(victim.cls, "queue_full")
        victim.event.set()
        return True

    def _grant_now(self, ticket: Ticket) -> Ticket:
        self.running += 1
        self._running_ranks[ticket.rank] += 1
        ticket.granted_at = time.monotonic()
        self.admitted[ticket.cls] += 1
        self.wait_sum_s[ticket.cls] += ticket.wait_s
        self._on_change()
        return ticket

    def _release(self, ticket: Ticket) -> None:
        self.running -= 1
        self._running_ranks[ticket.rank] -= 1
        while self.running < self.max_running and self.waiters:
            head = self.waiters.pop(0)
            self._grant_now(head)
            head.event.set()
        self._on_change()

    def _reject(self, cls: str, reason: str) -> None:
        self.rejected[(cls, reason)] += 1
        log.info("request_rejected", priority=cls, reason=reason, running=self.running, queued=len(self.waiters))

    def describe(self) -> dict[str, object]:
        """Slots and queue for /status."""
        return {
            "running": self.running,
            "max_running": self.max_running,
            "queued": len(self.waiters),
            "max_queue": self.max_queue,
            "queued_by_class": self.queued_by_class(),
            "admitted": dict(self.admitted),
            "rejected": {f"{c}/{r}": n for (c, r), n in sorted(self.rejected.items())},
        }
