"""A service's in-memory copy of read models: load from Postgres, then follow the log.

A starting service loads the projection rows and the position they were written
at (one snapshot), then applies every later event from the log with the same
reducers the projector uses. It learns that there is something new from the bus
(any message on the namespace's event subjects) and polls slowly as a fallback,
but it always reads the events themselves from the log, in position order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence

from nats.aio.client import Client as NATS
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from shared.bus.subjects import Subjects
from shared.eventlog.store import EventStore, StoredEvent
from shared.faults import Outage
from shared.projections.projector import load_position, load_rows
from shared.projections.readmodels import Projection, Rows

log = logging.getLogger(__name__)


class LiveView:
    def __init__(self, store: EventStore, engine: AsyncEngine, projections: Sequence[Projection]) -> None:
        self.store = store
        self.engine = engine
        self.projections = tuple(projections)
        self.rows: dict[str, Rows] = {p.name: {} for p in projections}
        self.position = 0
        self._wake = asyncio.Event()
        self._folding = asyncio.Lock()
        self._listeners: list[Callable[[Sequence[StoredEvent]], None]] = []
        self._watched: dict[str, list[set[str]]] = {}

    def __getitem__(self, projection: Projection) -> Rows:
        return self.rows[projection.name]

    def add_listener(self, listener: Callable[[Sequence[StoredEvent]], None]) -> None:
        """Call `listener` with every batch of events once the rows include them.

        A service that waits for the view to show something (the gateway holding a
        request until an instance runs) is woken by this instead of polling the rows.
        """
        self._listeners.append(listener)

    def watch_keys(self, projection: Projection) -> set[str]:
        """A set the view adds to the key of every row of `projection` an event touches (deleted ones included).

        The caller empties it as it reads it: a reader that rebuilds only what changed
        (the controller's instance views) learns what did without scanning the rows.
        After `load` every key counts as touched.
        """
        keys: set[str] = set(self.rows[projection.name])
        self._watched.setdefault(projection.name, []).append(keys)
        return keys

    async def load(self) -> None:
        """Rows and position from the projector's tables, read in one snapshot."""
        async with self.engine.connect() as conn:
            await conn.execute(text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ"))
            positions = {p.name: await load_position(conn, p.name) for p in self.projections}
            rows = {p.name: await load_rows(conn, p) for p in self.projections}
            await conn.rollback()
        before = self.rows
        if len(set(positions.values())) > 1:
            # Projections at different positions (one added later): start them all from scratch.
            self.rows, self.position = {p.name: {} for p in self.projections}, 0
        else:
            self.rows, self.position = rows, next(iter(positions.values()), 0)
        for name, watchers in self._watched.items():
            for keys in watchers:
                keys.update(before[name], self.rows[name])
        await self.catch_up()

    async def catch_up(self) -> int:
        """Fold every committed event after our position; return how many."""
        applied = 0
        # One fold at a time: two readers starting from the same position would fold events twice.
        async with self._folding:
            async for events in self.store.iter_events(self.position):
                for event in events:
                    for p in self.projections:
                        touched = p.apply(self.rows[p.name], event)
                        for keys in self._watched.get(p.name, ()):
                            keys.update(touched)
                if events:
                    self.position = events[-1].position
                    applied += len(events)
                    for listener in self._listeners:
                        listener(events)
        return applied

    async def follow(self, nc: NATS, subjects: Subjects, stop: asyncio.Event, poll_interval_s: float = 1.0) -> None:
        """Fold new events as the bus announces them, and at least every `poll_interval_s`, until `stop`.

        While Postgres is away the rows stay as they were (the gateway serves from
        them); the view catches up once the log can be read again.
        """
        sub = await nc.subscribe(subjects.all_events, cb=self._on_message)
        stop_wait = asyncio.ensure_future(stop.wait())
        outage = Outage("following the log", log)
        try:
            while not stop.is_set():
                wake_wait = asyncio.ensure_future(self._wake.wait())
                await asyncio.wait({wake_wait, stop_wait}, timeout=poll_interval_s, return_when=asyncio.FIRST_COMPLETED)
                wake_wait.cancel()
                self._wake.clear()
                try:
                    await self.catch_up()
                except Exception as exc:
                    outage.failed(exc)
                else:
                    outage.succeeded()
        finally:
            stop_wait.cancel()
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _on_message(self, msg) -> None:
        self._wake.set()
