"""How long a request may wait for a cold alias to start: measured from the log.

A request for an alias with nothing routable (COLD, or every instance starting
or asleep) waits in the gateway instead of being refused (`admission.py`). It
waits a few times the longest of the alias's recent STARTING -> RUNNING
durations plus a margin, capped by the gateway's `hold_timeout_s` (which is also the
bound while nothing is measured yet).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from datetime import datetime

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from shared.contracts.events import InstanceStateChanged
from shared.contracts.states import InstanceState
from shared.eventlog.store import StoredEvent

RECENT_STARTS = 5
"""Start durations remembered per alias: recent enough to follow a changed model or machine."""
HOLD_START_FACTOR = 3.0
HOLD_MARGIN_S = 2.0
"""Budget = factor x longest recent start + margin: a slow start is common, a tripled one is not."""

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

    def _fold(self, alias: str, instance_id: str, to_state: InstanceState, at: datetime) -> None:
        if to_state is InstanceState.STARTING:
            self._starting[instance_id] = at
            return
        began = self._starting.pop(instance_id, None)
        if began is not None and to_state is InstanceState.RUNNING:
            self.recent.setdefault(alias, deque(maxlen=RECENT_STARTS)).append((at - began).total_seconds())

    def apply(self, events: Iterable[StoredEvent]) -> None:
        for stored in events:
            e = stored.event
            if isinstance(e, InstanceStateChanged):
                self._fold(e.alias, e.instance_id, e.to_state, stored.occurred_at)

    async def load(self, engine: AsyncEngine, aliases: Iterable[str], upto: int) -> None:
        """The starts already in the log, up to the position the live view starts following from."""
        async with engine.connect() as conn:
            for alias in aliases:
                rows = (await conn.execute(_RECENT_TRANSITIONS, {"alias": alias, "upto": upto})).all()
                for instance_id, to_state, at in reversed(rows):
                    self._fold(alias, instance_id, InstanceState(to_state), at)

    def budget_s(self, alias: str) -> float:
        """How long a request for `alias` may be held."""
        recent = self.recent.get(alias)
        if not recent:
            return self.hold_timeout_s
        return min(self.hold_timeout_s, HOLD_START_FACTOR * max(recent) + HOLD_MARGIN_S)
