"""Admission: the one owner of every slot a request holds, from its first placement to its retries.

An instance takes at most its reported capacity of requests (`Router.take`).
A request that finds no room waits in its alias's queue (`routing/queue.py`:
seed 003's RequestQueue, 256 deep); a slot that frees, or an instance that
comes up, goes to the waiter first in line at once (`pump`): by priority class,
then to the tenant served the fewest tokens for its weight (`routing/fairness.py`;
`queue_order: fifo` serves in arrival order alone). A tenant holding fewer of the
alias's slots than its weighted share of them does not wait for others' backlog
at all: its request borrows a slot past an instance's capacity (within a quarter
of it, `routing.BORROW_FRACTION`), and the overcommit passes as requests end,
since no waiter is granted a slot until the instance is back under capacity. A
full queue refuses with 429 and a `Retry-After` worked out from how fast the
queue has been draining.

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
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace

from routing.fairness import DEFAULT_AGING_S, FairShare, Tenancy
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
    tenants: Counter[str] = field(default_factory=Counter)
    """Waiters per tenant: who is waiting, without a walk through the queue at every arrival."""
    cold: bool = False
    """Requests waited while nothing of the alias was routable: the next slot granted ends a cold start."""
    signaller: asyncio.Task[None] | None = None
    """Sends the alias's demand signals while any of its requests waits."""


def _uncount(queue: AliasQueue, waiter: Waiter) -> None:
    tenant = waiter.ask.tenancy.tenant
    queue.tenants[tenant] -= 1
    if queue.tenants[tenant] <= 0:
        del queue.tenants[tenant]


def _tenancy_of(waiter: Waiter) -> Tenancy:
    return waiter.ask.tenancy


def _entered(waiter: Waiter) -> float:
    return waiter.entered


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
                 keepalive_s: float, start_progress: Callable[[str], StartProgress] | None = None,
                 fair: bool = True, priority_aging_s: float = DEFAULT_AGING_S) -> None:
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
        self.fair = fair
        self.priority_aging_s = priority_aging_s
        self.shares: dict[str, FairShare] = {}
        """Each alias's tenants' virtual token counters: they outlive its queue, which closes whenever it empties."""
        self.held: dict[str, Counter[str]] = {}
        """Slots each tenant holds on each alias, and each tenant's weight: its fair share of the alias's slots."""
        self.weights: dict[str, float] = {}

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
        self._count(other, 1)  # its prompt was charged when it first got a slot
        ctx.slot = other
        return other

    def release(self, ctx: RequestContext) -> None:
        """The request is done with its slot: its completion is charged to its tenant, and the next waiter of the
        alias takes the slot at once."""
        slot, ctx.slot = ctx.slot, None
        if slot is not None:
            if ctx.usage is not None:
                self.charge(ctx.alias, ctx.ask.tenancy, ctx.usage[1])
            self.give_back(slot)

    def charge(self, alias: str, tenancy: Tenancy, tokens: int) -> None:
        """Tokens served to a tenant on the alias (a prompt when its request gets a slot, a completion when it
        ends): what its fair share is counted in."""
        if self.fair:
            self._share(alias).charge(tenancy, tokens)

    def _share(self, alias: str) -> FairShare:
        share = self.shares.get(alias)
        if share is None:
            share = self.shares[alias] = FairShare(self.priority_aging_s)
        return share

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
                return self._granted(alias, slot)
        if self.fair and self._below_share(alias, ask.tenancy, queue):
            slot = self.router.take(alias, ask, borrow=True)
            if slot is not None:
                self.metrics.borrowed(alias)
                return self._granted(alias, slot)
        if queue is None:
            queue = self.queues[alias] = AliasQueue(alias, AdmissionQueue(alias, self.queue_size))
        waiter = Waiter(alias, ask, self.clock(), asyncio.get_running_loop().create_future())
        queue.queue.enqueue(waiter, waiter.entered)
        tenant = ask.tenancy.tenant
        if self.fair and not queue.tenants[tenant]:  # its first request waiting: it banked nothing
            self._share(alias).joined(tenant, list(queue.tenants))
        queue.tenants[tenant] += 1
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
            _uncount(queue, waiter)
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
        self._count(slot, -1)
        self.pump(slot.instance.alias)

    def _granted(self, alias: str, slot: Slot) -> Slot:
        """A request got a slot: its tenant holds one more, and is charged its prompt."""
        self._count(slot, 1)
        self.charge(alias, slot.ask.tenancy, slot.ask.tokens)
        return slot

    def _count(self, slot: Slot, change: int) -> None:
        tenancy = slot.ask.tenancy
        held = self.held.setdefault(slot.instance.alias, Counter())
        held[tenancy.tenant] += change
        if held[tenancy.tenant] <= 0:
            del held[tenancy.tenant]
        self.weights[tenancy.tenant] = tenancy.weight

    def _below_share(self, alias: str, tenancy: Tenancy, queue: AliasQueue | None) -> bool:
        """Whether the tenant holds fewer of the alias's slots than its weighted share of them, among the tenants
        holding or waiting for one (a lone tenant's share is every slot: it never borrows)."""
        capacity = self.router.capacity(alias)
        if not capacity:
            return False
        held = self.held.get(alias, Counter())
        active = set(held) | {tenancy.tenant} | (set(queue.tenants) if queue is not None else set())
        if len(active) < 2:
            return False  # nobody else's backlog to be held behind
        self.weights[tenancy.tenant] = tenancy.weight
        share = capacity * tenancy.weight / sum(self.weights.get(t, 1.0) for t in active)
        return held[tenancy.tenant] + 1 <= share

    def view_advanced(self) -> None:
        for alias in list(self.queues):
            self.pump(alias)

    def pump(self, alias: str) -> None:
        """Hand free slots to the alias's waiters, head first, for as long as there are both."""
        queue = self.queues.get(alias)
        if queue is None:
            return
        now = self.clock()
        per_session = self._per_session(alias)
        share = self._share(alias) if self.fair else None

        def fair_order(waiting: Sequence[Waiter]) -> list[Waiter]:
            assert share is not None
            if not waiting:
                return []
            if per_session:  # a waiter whose instance is full lets the next one try: all of them, in order
                return share.order(waiting, now, _tenancy_of, _entered)
            return [share.first(waiting, now, _tenancy_of, _entered)]  # only the first may go: no sort

        order = fair_order if share is not None else None
        for waiter, slot in queue.queue.pump(now, self._take(alias), per_session, order):
            _uncount(queue, waiter)
            waiter.granted.set_result(slot)
            if queue.cold:
                queue.cold = False
                self.metrics.cold_start(alias)
        self._note_cold(queue)

    def refuses(self, alias: str, tenancy: Tenancy) -> float | None:
        """If a request of the tenant for `alias` would be refused now whatever it asks (the queue is full and it
        may neither try for a slot first nor borrow one): how long to retry after. Decided before its body is
        read."""
        queue = self.queues.get(alias)
        if queue is None or len(queue.queue) < self.queue_size or self._per_session(alias):
            return None
        if self.fair and self._below_share(alias, tenancy, queue):
            return None
        return queue.queue.retry_after_s(self.clock())

    def waiting(self, alias: str) -> int:
        queue = self.queues.get(alias)
        return len(queue.queue) if queue else 0

    def _take(self, alias: str) -> Callable[[Waiter], Slot | None]:
        def take(waiter: Waiter) -> Slot | None:
            slot = self.router.take(alias, waiter.ask)
            return self._granted(alias, slot) if slot is not None else None  # charged before the next is ranked
        return take

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
