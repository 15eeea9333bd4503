"""How long a cold alias takes to come up, measured from the log: the hold's budget and the client's ETA.

A request for an alias with nothing routable (COLD, or every instance starting
or asleep) waits in the gateway instead of being refused (`admission.py`). It
waits a few times the longest of the alias's recent STARTING -> RUNNING
durations plus a margin, capped by the gateway's `hold_timeout_s` (which is also the
bound while nothing is measured yet).

While it waits, the client is told where the start stands (`StartProgress`): the
phase, and an ETA from the same backend's recent measured times:

- `placing`: nothing of the alias is under way yet (the controller is choosing
  what to start or wake, placement where to put it); the ETA is the fastest of
  the alias's backends from its placement request to RUNNING;
- `starting`: an instance is STARTING, its engine process coming up; the ETA
  is that backend's STARTING -> RUNNING less the time it has been starting;
- `loading`: the starting engine answers and loads its model (`InstanceLoading`;
  llama.cpp says so, vLLM binds its port only once loaded); the ETA is that
  backend's loading -> RUNNING less the time it has been loading;
- `waking`: a wake of a sleeping instance was decided; the ETA is that
  backend's decided-wake -> RUNNING at the same sleep level, less the time since.

Where several are under way, the one expected first (the request takes whatever
comes up first); without a measurement there is a phase and no ETA.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from shared.contracts.backends import Action, BackendType
from shared.contracts.events import (
    InstanceLoading,
    InstanceStateChanged,
    PlacementFailed,
    PlacementRequested,
    PolicyDecided,
)
from shared.contracts.states import InstanceState
from shared.eventlog.store import StoredEvent
from shared.projections.rows import InstanceRow

RECENT_STARTS = 5
"""Durations remembered per alias and backend: recent enough to follow a changed model or machine."""
HOLD_START_FACTOR = 3.0
HOLD_MARGIN_S = 2.0
"""Budget = factor x longest recent start + margin: a slow start is common, a tripled one is not."""
SLEEP_LEVEL = {InstanceState.SLEEP_1: 1, InstanceState.SLEEP_2: 2}

# The alias's latest instance transitions, placement requests and decided wakes, newest first, through the
# (alias, position) index of the log.
_RECENT = text(
    """
    SELECT type, payload->>'instance_id', payload->>'from_state', payload->>'to_state', payload->>'backend_type',
           payload->'decision'->'actions', occurred_at
    FROM events
    WHERE payload->>'alias' = :alias AND position <= :upto
      AND (type IN ('InstanceStateChanged', 'InstanceLoading', 'PlacementRequested')
           OR (type = 'PolicyDecided' AND payload->'decision'->'actions' @> '[{"action": "wake"}]'))
    ORDER BY position DESC LIMIT 400
    """
)


@dataclass(frozen=True, slots=True)
class StartProgress:
    """Where a cold alias's start stands, as a held client is told."""

    phase: str
    eta_s: float | None
    """Seconds until an instance is expected to serve; None when nothing comparable was measured yet."""
    backend: BackendType | None = None

    def comment(self, waited_s: float) -> bytes:
        """The SSE comment line a held stream receives (clients skip comment lines)."""
        parts = [f"phase={self.phase}"]
        if self.eta_s is not None:
            parts.append(f"eta_ms={round(self.eta_s * 1000)}")
        if self.backend is not None:
            parts.append(f"backend={self.backend.value}")
        parts.append(f"waited_ms={round(waited_s * 1000)}")
        return f": modelpool cold-start {' '.join(parts)}\n\n".encode()


class _Recent:
    """The latest few durations of one kind, per alias and backend (and sleep level for wakes)."""

    def __init__(self) -> None:
        self.seconds: dict[tuple, deque[float]] = {}

    def add(self, key: tuple, seconds: float) -> None:
        self.seconds.setdefault(key, deque(maxlen=RECENT_STARTS)).append(seconds)

    def median(self, key: tuple) -> float | None:
        recent = self.seconds.get(key)
        return statistics.median(recent) if recent else None


class StartTimes:
    """How long each alias's instances took to come up, folded from the log."""

    def __init__(self, hold_timeout_s: float) -> None:
        self.hold_timeout_s = hold_timeout_s
        self._asked: dict[str, datetime] = {}
        self._starting: dict[str, datetime] = {}
        self._loading: dict[str, datetime] = {}
        self._wake_decided: dict[str, datetime] = {}
        self.starts = _Recent()
        """STARTING -> RUNNING, by (alias, backend)."""
        self.loads = _Recent()
        """Loading -> RUNNING, by (alias, backend)."""
        self.ready = _Recent()
        """Placement requested -> RUNNING, by (alias, backend)."""
        self.wakes = _Recent()
        """Wake decided -> RUNNING, by (alias, backend, sleep level)."""

    # ------------------------------------------------------------------ folding the log

    def _transition(self, alias: str, instance_id: str, backend: BackendType, from_state: InstanceState,
                    to_state: InstanceState, at: datetime) -> None:
        if to_state is InstanceState.STARTING:
            self._starting[instance_id] = at
            return
        began = self._starting.pop(instance_id, None)
        loaded = self._loading.pop(instance_id, None)
        asked = self._asked.pop(instance_id, None)
        woke = self._wake_decided.pop(instance_id, None)
        if to_state is not InstanceState.RUNNING:
            return
        if began is not None:
            self.starts.add((alias, backend), (at - began).total_seconds())
            if loaded is not None:
                self.loads.add((alias, backend), (at - loaded).total_seconds())
            if asked is not None:
                self.ready.add((alias, backend), (at - asked).total_seconds())
        elif woke is not None and from_state in SLEEP_LEVEL:
            self.wakes.add((alias, backend, SLEEP_LEVEL[from_state]), (at - woke).total_seconds())

    def apply(self, events: Iterable[StoredEvent]) -> None:
        for stored in events:
            e = stored.event
            if isinstance(e, InstanceStateChanged):
                self._transition(e.alias, e.instance_id, e.backend_type, e.from_state, e.to_state, stored.occurred_at)
            elif isinstance(e, InstanceLoading):
                self._loading[e.instance_id] = stored.occurred_at
            elif isinstance(e, PlacementRequested):
                self._asked[e.instance_id] = stored.occurred_at
            elif isinstance(e, PlacementFailed):
                self._asked.pop(e.instance_id, None)
            elif isinstance(e, PolicyDecided):
                for action in e.decision.actions:
                    if action.action is Action.WAKE:
                        self._wake_decided[action.instance_id] = stored.occurred_at

    async def load(self, engine: AsyncEngine, aliases: Iterable[str], upto: int) -> None:
        """The times already in the log, up to the position the live view starts following from."""
        async with engine.connect() as conn:
            for alias in aliases:
                rows = (await conn.execute(_RECENT, {"alias": alias, "upto": upto})).all()
                for kind, instance_id, from_state, to_state, backend, actions, at in reversed(rows):
                    if kind == "PlacementRequested":
                        self._asked[instance_id] = at
                    elif kind == "InstanceLoading":
                        self._loading[instance_id] = at
                    elif kind == "PolicyDecided":
                        for action in actions or ():
                            if action.get("action") == Action.WAKE.value:
                                self._wake_decided[action["instance_id"]] = at
                    else:
                        self._transition(alias, instance_id, BackendType(backend), InstanceState(from_state),
                                         InstanceState(to_state), at)

    # ------------------------------------------------------------------ what a held request is told

    def budget_s(self, alias: str) -> float:
        """How long a request for `alias` may be held."""
        recent = [s for (name, _), seconds in self.starts.seconds.items() if name == alias for s in seconds]
        if not recent:
            return self.hold_timeout_s
        return min(self.hold_timeout_s, HOLD_START_FACTOR * max(recent) + HOLD_MARGIN_S)

    def progress(self, alias: str, backends: Iterable[BackendType], instances: Iterable[InstanceRow],
                 now: datetime) -> StartProgress:
        """Where the alias's start stands: its instances under way, the soonest expected first."""
        under_way: list[StartProgress] = []
        for row in instances:
            if row.alias != alias:
                continue
            if row.state is InstanceState.STARTING and row.instance_id in self._loading:
                expected = self.loads.median((alias, row.backend_type))
                since = self._loading[row.instance_id]
                phase = "loading"
            elif row.state is InstanceState.STARTING:
                expected = self.starts.median((alias, row.backend_type))
                since = row.updated_at
                phase = "starting"
            elif row.state in SLEEP_LEVEL and row.instance_id in self._wake_decided:
                expected = self.wakes.median((alias, row.backend_type, SLEEP_LEVEL[row.state]))
                since = self._wake_decided[row.instance_id]
                phase = "waking"
            else:
                continue
            eta = None if expected is None else max(0.0, expected - (now - since).total_seconds())
            under_way.append(StartProgress(phase, eta, row.backend_type))
        if under_way:
            return min(under_way, key=lambda c: (c.eta_s is None, c.eta_s or 0.0))
        placing = [(s, b) for b in backends if (s := self.ready.median((alias, b))) is not None]
        if not placing:
            return StartProgress("placing", None)
        eta, backend = min(placing, key=lambda p: p[0])
        return StartProgress("placing", eta, backend)
