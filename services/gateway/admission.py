"""Admission: the one owner of every slot a request holds, from its first placement to its retries.

An instance takes at most its reported capacity of requests (`Router.take`).
A request that finds no room waits in its alias's queue (`routing/queue.py`:
a bounded FIFO, seed 003's RequestQueue, 256 deep); a slot that frees, or an
instance that comes up, goes to the head of the queue at once (`pump`). A full
queue refuses with 429 and a `Retry-After` worked out from how fast the queue
has been draining.

How long a request waits depends on what it waits for (`place`): a slot on a
running instance (the queue timeout, then 408) or an instance to start at all
(the alias's start budget from `starts.py`, then 503, with the stream's headers
sent at once and, while it waits, comments saying where the start stands: phase
and ETA; a whole answer says how long it waited in `x-modelpool-cold-start-ms`).
A request sent again after a failure (`move`) gives its slot back here and
takes another of the same backend, so no slot changes hands anywhere else.

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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

from routing.queue import AdmissionQueue, AdmissionQueueFull
from services.gateway.client_stream import ClientStream
from services.gateway.context import Refused, RequestContext
from services.gateway.meter import Meter
from services.gateway.metrics import GatewayMetrics
from services.gateway.routing import NO_PROMPT, Ask, Router, Slot
from services.gateway.starts import StartProgress
from shared.contracts.messages import utcnow
from shared.contracts.telemetry import DemandSignal
from shared.faults import Outage
from shared.metering import RequestOutcome
from shared.openai_protocol import APIError, request_timeout, too_many_requests

log = logging.getLogger(__name__)

DEMAND_INTERVAL_S = 1.0
RETRY_AFTER_S = 2
"""Told to a client whose hold expired; a retry is held again, so a short wait loses nothing."""
PROGRESS_S = 1.0
"""How often a stream held through a cold start is told where the start stands (or at its keep-alive, if sooner)."""


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
    queue: AdmissionQueue[Waiter, Slot]
    cold: bool = False
    """Requests waited while nothing of the alias was routable: the next slot granted ends a cold start."""
    signaller: asyncio.Task[None] | None = None
    """Sends the alias's demand signals while any of its requests waits."""


def alias_starting(alias: str, waited_s: float) -> APIError:
    return APIError(
        503, f"alias `{alias}` is starting: no instance was ready after {waited_s:.0f} s; retry shortly",
        type="service_unavailable_error", code="alias_starting", headers={"Retry-After": str(RETRY_AFTER_S)},
    )


class Admission:
    """Every alias's queue, the slots handed out from it, and the demand signals for cold aliases."""

    def __init__(self, router: Router, meter: Meter, metrics: GatewayMetrics,
                 publish_demand: Callable[[DemandSignal], Awaitable[None]], gateway_id: str, queue_size: int,
                 clock: Callable[[], float], queue_timeout_s: float, start_budget_s: Callable[[str], float],
                 keepalive_s: float, start_progress: Callable[[str], StartProgress] | None = None) -> None:
        self.router = router
        self.meter = meter
        self.metrics = metrics
        self.publish_demand = publish_demand
        self.gateway_id = gateway_id
        self.queue_size = queue_size
        self.clock = clock
        self.queue_timeout_s = queue_timeout_s
        self.start_budget_s = start_budget_s
        self.keepalive_s = keepalive_s
        self.start_progress = start_progress or (lambda alias: StartProgress("placing", None))
        """Where an alias's start stands (`starts.py`), for the clients it holds."""
        self.queues: dict[str, AliasQueue] = {}

    # ------------------------------------------------------------------ the stage

    async def place(self, ctx: RequestContext, client: ClientStream) -> Slot:
        """Give the request a slot, at once or after waiting for one; `Refused` when it cannot have one."""
        try:
            admitted = self.admit(ctx.alias, ctx.ask)
        except AdmissionQueueFull as full:
            raise Refused(too_many_requests(
                f"{full}; the queue of `{ctx.alias}` is full, retry after {full.retry_after_s:.0f} s",
                full.retry_after_s), RequestOutcome.QUEUE_FULL) from None
        ctx.slot = admitted if isinstance(admitted, Slot) else await self._hold(ctx, client, admitted)
        return ctx.slot

    async def move(self, ctx: RequestContext, client: ClientStream, *, wait: bool) -> Slot | None:
        """Move the request off its slot's instance, which failed it, to another of the same backend: one with
        room now or (with `wait`) the first to have room; None, keeping the slot, when there is no other."""
        failed = ctx.slot
        assert failed is not None
        ask = replace(ctx.ask, backend=failed.backend, avoid=ctx.ask.avoid | {failed.instance_id})
        if not self.router.has_other(ctx.alias, failed.backend, ask.avoid):
            return None
        other = self.router.take(ctx.alias, ask)  # sent once already: it does not queue behind new arrivals
        if other is None and not wait:
            return None
        ctx.ask = ask
        self.release(ctx)
        if other is None:
            return await self.place(ctx, client)
        ctx.slot = other
        return other

    def release(self, ctx: RequestContext) -> None:
        """The request is done with its slot: the next waiter of the alias takes it at once."""
        slot, ctx.slot = ctx.slot, None
        if slot is not None:
            self.give_back(slot)

    async def _hold(self, ctx: RequestContext, client: ClientStream, waiter: Waiter) -> Slot:
        """Wait in the alias's queue for a slot; `Refused` when the wait's budget runs out first. While nothing of
        the alias is routable, a stream is told where the start stands every `PROGRESS_S` (or keep-alive)."""
        outcome = "left"
        progress_due = waiter.entered
        try:
            while True:
                routable = self.router.routable(ctx.alias)
                now = self.clock()
                if not routable:
                    ctx.cold_start_ms = round((now - waiter.entered) * 1000)
                    await client.hold()
                    if now >= progress_due:
                        await client.keepalive(self.start_progress(ctx.alias).comment(now - waiter.entered))
                        progress_due = now + min(PROGRESS_S, self.keepalive_s)
                budget = self.queue_timeout_s if routable else self.start_budget_s(ctx.alias)
                deadline = waiter.entered + budget
                remaining = deadline - now
                if remaining <= 0:
                    if routable:
                        outcome = "timeout"
                        raise Refused(request_timeout(
                            f"no slot on an instance of `{ctx.alias}` freed within {budget:g} s (queue timeout); "
                            "retry later"), RequestOutcome.QUEUE_TIMEOUT)
                    outcome = "expired"
                    raise Refused(alias_starting(ctx.alias, now - ctx.trace.arrived), RequestOutcome.HOLD_EXPIRED)
                # Woken early by a slot; otherwise at the deadline, the next keep-alive or progress, to look again.
                slot = await self.wait(waiter, min(remaining, self.keepalive_s if routable else progress_due - now))
                if slot is not None:
                    outcome = "served"
                    if ctx.cold_start_ms is not None:
                        waited = self.clock() - waiter.entered
                        ctx.cold_start_ms = round(waited * 1000)
                        await client.keepalive(StartProgress("ready", None, slot.backend).comment(waited))
                    return slot
                if routable and self.clock() < deadline:
                    await client.keepalive()
        finally:
            self.leave(waiter, outcome)

    # ------------------------------------------------------------------ the queues

    def admit(self, alias: str, ask: Ask = NO_PROMPT) -> Slot | Waiter:
        """A slot now, or a place at the end of the alias's queue; `AdmissionQueueFull` when the queue is full."""
        queue = self.queues.get(alias)
        if queue is None or queue.queue.may_take_now(self._per_session(alias)):
            slot = self.router.take(alias, ask)  # the common case: no queue at all, and no object made for one
            if slot is not None:
                return slot
        if queue is None:
            queue = self.queues[alias] = AliasQueue(alias, AdmissionQueue(alias, self.queue_size))
        waiter = Waiter(alias, ask, self.clock(), asyncio.get_running_loop().create_future())
        queue.queue.enqueue(waiter, waiter.entered)
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
            queue.queue.leave(waiter)
        self.meter.of(waiter.alias).add_held(-1)
        self.metrics.waited(waiter.alias, outcome, self.clock() - waiter.entered)
        if waiter.granted.done() and not waiter.claimed:
            self.give_back(waiter.granted.result())
        elif not waiter.granted.done():
            waiter.granted.cancel()
        if queue is not None and not queue.queue:
            self._close(queue)

    def give_back(self, slot: Slot) -> None:
        """A slot is free again: the next waiter of the alias takes it at once."""
        self.router.release(slot)
        self.pump(slot.instance.alias)

    def view_advanced(self) -> None:
        for alias in list(self.queues):
            self.pump(alias)

    def pump(self, alias: str) -> None:
        """Hand free slots to the alias's waiters, head first, for as long as there are both."""
        queue = self.queues.get(alias)
        if queue is None:
            return
        for waiter, slot in queue.queue.pump(self.clock(), self._take(alias), self._per_session(alias)):
            waiter.granted.set_result(slot)
            if queue.cold:
                queue.cold = False
                self.metrics.cold_start(alias)
        self._note_cold(queue)

    def waiting(self, alias: str) -> int:
        queue = self.queues.get(alias)
        return len(queue.queue) if queue else 0

    def _take(self, alias: str) -> Callable[[Waiter], Slot | None]:
        return lambda waiter: self.router.take(alias, waiter.ask)

    def _per_session(self, alias: str) -> bool:
        return self.router.scheduler(alias).per_session

    def _note_cold(self, queue: AliasQueue) -> None:
        """Start signalling demand when the alias's waiters have nothing routable to wait for."""
        if queue.queue and not self.router.routable(queue.alias):
            queue.cold = True
            if queue.signaller is None:
                queue.signaller = asyncio.create_task(self._signal_demand(queue))

    def _close(self, queue: AliasQueue) -> None:
        if queue.signaller is not None:
            queue.signaller.cancel()
            queue.signaller = None
        if not queue.queue.drained_lately(self.clock()):
            del self.queues[queue.alias]  # keep a recently drained queue's rate for the next Retry-After

    async def _signal_demand(self, queue: AliasQueue) -> None:
        outage = Outage(f"signalling demand for {queue.alias}", log)
        while queue.queue:
            try:
                await self.publish_demand(DemandSignal(gateway_id=self.gateway_id, alias=queue.alias,
                                                       held=len(queue.queue), at=utcnow()))
                self.metrics.demand_signalled(queue.alias)
            except Exception as exc:  # the bus is away: keep waiting, try again next second
                outage.failed(exc)
            else:
                outage.succeeded()
            await asyncio.sleep(DEMAND_INTERVAL_S)
        queue.signaller = None
