"""Admission: each request gets a slot on an instance, or waits for one in its alias's queue, in order.

An instance takes at most its reported capacity of requests (`Router.take`).
A request that finds no room waits in a bounded FIFO queue per alias (seed 003's
RequestQueue: 256 deep, 60 s); a slot that frees, or an instance that comes up,
goes to the head of the queue at once (`pump`), never to a request that arrived
later. A full queue refuses with 429 and a `Retry-After` worked out from how
fast the queue has been draining.

A queue whose alias has nothing routable at all is a cold start: while any
request waits the gateway sends a `DemandSignal` at once and every second, so
the controller starts or wakes an instance without waiting for its next tick.
Waiters are woken by slots freeing and by the live view catching up with the
log, never by polling.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from services.gateway.meter import Meter
from services.gateway.metrics import GatewayMetrics
from services.gateway.routing import NO_PROMPT, Ask, Router, Slot
from shared.contracts.messages import utcnow
from shared.contracts.telemetry import DemandSignal
from shared.faults import Outage

log = logging.getLogger(__name__)

DEMAND_INTERVAL_S = 1.0
DRAIN_SAMPLES = 64
"""Recent departures from a queue its drain rate is measured over."""
DRAIN_MEMORY_S = 30.0
"""Departures older than this say nothing about how fast the queue drains now."""


@dataclass(eq=False, slots=True)
class Waiter:
    """One queued request: its slot arrives through `granted`."""

    alias: str
    ask: Ask
    entered: float
    granted: asyncio.Future[Slot]
    claimed: bool = False
    """The request took the slot it was granted (else `leave` gives it back)."""


@dataclass(eq=False)
class AliasQueue:
    alias: str
    waiters: deque[Waiter] = field(default_factory=deque)
    departures: deque[float] = field(default_factory=lambda: deque(maxlen=DRAIN_SAMPLES))
    """When recent waiters got their slot (monotonic seconds)."""
    cold: bool = False
    """Requests waited while nothing of the alias was routable: the next slot granted ends a cold start."""
    signaller: asyncio.Task[None] | None = None
    """Sends the alias's demand signals while any of its requests waits."""


class AliasQueueFull(Exception):
    def __init__(self, alias: str, waiting: int, retry_after_s: float) -> None:
        super().__init__(f"{waiting} requests of `{alias}` are already waiting")
        self.retry_after_s = retry_after_s


class Admission:
    """Every alias's queue, the slots handed out from it, and the demand signals for cold aliases."""

    def __init__(self, router: Router, meter: Meter, metrics: GatewayMetrics,
                 publish_demand: Callable[[DemandSignal], Awaitable[None]], gateway_id: str, queue_size: int,
                 clock: Callable[[], float]) -> None:
        self.router = router
        self.meter = meter
        self.metrics = metrics
        self.publish_demand = publish_demand
        self.gateway_id = gateway_id
        self.queue_size = queue_size
        self.clock = clock
        self.queues: dict[str, AliasQueue] = {}

    def admit(self, alias: str, ask: Ask = NO_PROMPT) -> Slot | Waiter:
        """A slot now, or a place at the end of the alias's queue; `AliasQueueFull` when the queue is full."""
        queue = self.queues.get(alias)
        # Nobody waits ahead of this request, or those who do wait for their session's instance only.
        if queue is None or not queue.waiters or self.router.scheduler(alias).per_session:
            slot = self.router.take(alias, ask)
            if slot is not None:
                return slot
        if queue is None:
            queue = self.queues[alias] = AliasQueue(alias)
        if len(queue.waiters) >= self.queue_size:
            raise AliasQueueFull(alias, len(queue.waiters), self.retry_after_s(queue))
        waiter = Waiter(alias, ask, self.clock(), asyncio.get_running_loop().create_future())
        queue.waiters.append(waiter)
        self.meter.of(alias).add_held(1)
        self._note_cold(queue)
        return waiter

    async def wait(self, waiter: Waiter, timeout_s: float) -> Slot | None:
        """The waiter's slot, or None if `timeout_s` passed first (it stays queued)."""
        if not waiter.granted.done():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(waiter.granted), timeout_s)
        if waiter.granted.done():
            waiter.claimed = True
            return waiter.granted.result()
        return None

    def leave(self, waiter: Waiter, outcome: str) -> None:
        """The waiter is done waiting, served or not; a slot granted and never claimed is given back."""
        queue = self.queues.get(waiter.alias)
        if queue is not None and not waiter.granted.done():
            with contextlib.suppress(ValueError):
                queue.waiters.remove(waiter)
        self.meter.of(waiter.alias).add_held(-1)
        self.metrics.waited(waiter.alias, outcome, self.clock() - waiter.entered)
        if waiter.granted.done() and not waiter.claimed:
            self.release(waiter.granted.result())
        elif not waiter.granted.done():
            waiter.granted.cancel()
        if queue is not None and not queue.waiters:
            self._close(queue)

    def release(self, slot: Slot) -> None:
        """A request is done with its slot: the next waiter of the alias takes it at once."""
        self.router.release(slot)
        self.pump(slot.instance.alias)

    def view_advanced(self) -> None:
        for alias in list(self.queues):
            self.pump(alias)

    def pump(self, alias: str) -> None:
        """Hand free slots to the alias's waiters, head first, for as long as there are both.

        Where a request may go depends on its session (sticky, affinity, EAR), a
        waiter whose instance is full does not hold back those behind it that may
        go elsewhere: each instance still serves its own waiters in arrival order.
        """
        queue = self.queues.get(alias)
        if queue is None:
            return
        per_session = self.router.scheduler(alias).per_session
        for waiter in list(queue.waiters):
            slot = self.router.take(alias, waiter.ask)
            if slot is None:
                if per_session:
                    continue
                break
            queue.waiters.remove(waiter)
            waiter.granted.set_result(slot)
            queue.departures.append(self.clock())
            if queue.cold:
                queue.cold = False
                self.metrics.cold_start(alias)
        self._note_cold(queue)

    def waiting(self, alias: str) -> int:
        queue = self.queues.get(alias)
        return len(queue.waiters) if queue else 0

    def retry_after_s(self, queue: AliasQueue) -> float:
        """How long until the queue has room again, at the rate it has drained lately."""
        now = self.clock()
        recent = [t for t in queue.departures if now - t <= DRAIN_MEMORY_S]
        if recent and now > recent[0]:
            rate = len(recent) / (now - recent[0])  # measured up to now, so a queue that stalls reads slower and slower
            return max(1.0, math.ceil(len(queue.waiters) / rate))
        return DRAIN_MEMORY_S  # nothing has left the queue lately: it will not have room soon

    def _note_cold(self, queue: AliasQueue) -> None:
        """Start signalling demand when the alias's waiters have nothing routable to wait for."""
        if queue.waiters and not self.router.routable(queue.alias):
            queue.cold = True
            if queue.signaller is None:
                queue.signaller = asyncio.create_task(self._signal_demand(queue))

    def _close(self, queue: AliasQueue) -> None:
        if queue.signaller is not None:
            queue.signaller.cancel()
            queue.signaller = None
        if not queue.departures or self.clock() - queue.departures[-1] > DRAIN_MEMORY_S:
            del self.queues[queue.alias]  # keep a recently drained queue's rate for the next Retry-After

    async def _signal_demand(self, queue: AliasQueue) -> None:
        outage = Outage(f"signalling demand for {queue.alias}", log)
        while queue.waiters:
            try:
                await self.publish_demand(DemandSignal(gateway_id=self.gateway_id, alias=queue.alias,
                                                       held=len(queue.waiters), at=utcnow()))
                self.metrics.demand_signalled(queue.alias)
            except Exception as exc:  # the bus is away: keep waiting, try again next second
                outage.failed(exc)
            else:
                outage.succeeded()
            await asyncio.sleep(DEMAND_INTERVAL_S)
        queue.signaller = None
