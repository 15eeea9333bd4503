"""Scale from zero: requests held until their alias has an instance to serve them.

A request for an alias with nothing routable (COLD, or every instance starting
or asleep) waits in the gateway instead of being refused. While any request of
an alias waits, the gateway sends a `DemandSignal` at once and every second, so
the controller starts or wakes an instance without waiting for its next tick.
Waiters are woken by the live view catching up with the log, not by polling.

How long a request may wait comes from the log too: a few times the longest of
the alias's recent STARTING -> RUNNING durations plus a margin, capped by
`settings.hold_timeout_s` (which is also the bound while nothing is measured yet).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from services.gateway.meter import Meter
from services.gateway.metrics import GatewayMetrics
from services.gateway.routing import Router
from shared.contracts.messages import utcnow
from shared.contracts.telemetry import DemandSignal
from shared.eventlog.store import RawEvent

log = logging.getLogger(__name__)

RECENT_STARTS = 5
"""Start durations remembered per alias: recent enough to follow a changed model or machine."""
HOLD_START_FACTOR = 3.0
HOLD_MARGIN_S = 2.0
"""Budget = factor x longest recent start + margin: a slow start is common, a tripled one is not."""
DEMAND_INTERVAL_S = 1.0

# The alias's latest instance transitions, newest first, through the (alias, position) index of the log.
_RECENT_TRANSITIONS = text(
    """
    SELECT payload->>'instance_id', payload->>'to_state', occurred_at FROM events
    WHERE payload->>'alias' = :alias AND type = 'InstanceStateChanged' AND position <= :upto
    ORDER BY position DESC LIMIT 200
    """
)


class StartTimes:
    """How long each alias's instances took from STARTING to RUNNING, folded from the log."""

    def __init__(self, hold_timeout_s: float) -> None:
        self.hold_timeout_s = hold_timeout_s
        self._starting: dict[str, datetime] = {}
        self.recent: dict[str, deque[float]] = {}

    def _fold(self, alias: str, instance_id: str, to_state: str, at: datetime) -> None:
        if to_state == "STARTING":
            self._starting[instance_id] = at
            return
        began = self._starting.pop(instance_id, None)
        if began is not None and to_state == "RUNNING":
            self.recent.setdefault(alias, deque(maxlen=RECENT_STARTS)).append((at - began).total_seconds())

    def apply(self, events: Iterable[RawEvent]) -> None:
        for event in events:
            if event.type == "InstanceStateChanged":
                p = event.payload
                self._fold(p["alias"], p["instance_id"], p["to_state"], event.occurred_at)

    async def load(self, engine: AsyncEngine, aliases: Iterable[str], upto: int) -> None:
        """The starts already in the log, up to the position the live view starts following from."""
        async with engine.connect() as conn:
            for alias in aliases:
                rows = (await conn.execute(_RECENT_TRANSITIONS, {"alias": alias, "upto": upto})).all()
                for instance_id, to_state, at in reversed(rows):
                    self._fold(alias, instance_id, to_state, at)

    def budget_s(self, alias: str) -> float:
        """How long a request for `alias` may be held."""
        recent = self.recent.get(alias)
        if not recent:
            return self.hold_timeout_s
        return min(self.hold_timeout_s, HOLD_START_FACTOR * max(recent) + HOLD_MARGIN_S)


@dataclass
class AliasHold:
    """The requests of one alias held right now."""

    alias: str
    count: int = 0
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    signaller: asyncio.Task[None] = field(init=False)
    """Sends the alias's demand signals while any of its requests is held."""


class Holds:
    """Every alias's held requests, the demand signals for them, and their wake-up."""

    def __init__(self, router: Router, meter: Meter, metrics: GatewayMetrics,
                 publish_demand: Callable[[DemandSignal], Awaitable[None]], gateway_id: str) -> None:
        self.router = router
        self.meter = meter
        self.metrics = metrics
        self.publish_demand = publish_demand
        self.gateway_id = gateway_id
        self.aliases: dict[str, AliasHold] = {}

    def enter(self, alias: str) -> AliasHold:
        hold = self.aliases.get(alias)
        if hold is None:
            hold = self.aliases[alias] = AliasHold(alias)
            hold.signaller = asyncio.create_task(self._signal_demand(hold))
        hold.count += 1
        self.meter.of(alias).add_held(1)
        return hold

    def leave(self, hold: AliasHold, outcome: str, waited_s: float) -> None:
        hold.count -= 1
        self.meter.of(hold.alias).add_held(-1)
        self.metrics.held(hold.alias, outcome, waited_s)
        if hold.count == 0:
            del self.aliases[hold.alias]
            hold.signaller.cancel()

    async def wait(self, hold: AliasHold, timeout_s: float) -> None:
        """Until the view shows a routable instance for the alias, or `timeout_s` passes.

        Callers check the router before calling, in the same step, so a wake-up
        between their check and this clear cannot be missed.
        """
        hold.ready.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(hold.ready.wait(), timeout_s)

    def view_advanced(self) -> None:
        for alias, hold in self.aliases.items():
            if self.router.routable(alias):
                hold.ready.set()

    async def _signal_demand(self, hold: AliasHold) -> None:
        while True:
            try:
                await self.publish_demand(DemandSignal(gateway_id=self.gateway_id, alias=hold.alias, held=hold.count, at=utcnow()))
                self.metrics.demand_signalled(hold.alias)
            except Exception as exc:  # the bus is away: keep holding, try again next second
                log.warning("demand signal for %s not sent: %r", hold.alias, exc)
            await asyncio.sleep(DEMAND_INTERVAL_S)
