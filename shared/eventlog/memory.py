"""The event log in this process's memory: the same interface and guarantees as the Postgres one, no server.

For tests of code that writes or reads the log (and tools that want a log for a
moment): appends are checked by the same code (`EventStore.append_batch`), are
atomic, refuse a stale expected version, are idempotent by event id, and get
gapless increasing positions. The contract suite in `tests/eventlog/` runs
against this store and the Postgres one alike. Nothing survives the process.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Collection, Sequence
from datetime import datetime

from shared.contracts.messages import Envelope, Registry
from shared.eventlog.store import (
    ANY_VERSION,
    Append,
    ConcurrencyError,
    DuplicateEventError,
    EventStore,
    OutboxEvent,
    StoredEvent,
)


class MemoryLog:
    """The stored events themselves: several `MemoryEventStore`s over one are writers of one log."""

    def __init__(self) -> None:
        self.events: list[Envelope] = []
        """In position order; an event's position is its index + 1."""
        self.by_id: dict[uuid.UUID, Envelope] = {}
        self.streams: dict[str, list[Envelope]] = {}
        self.headers: dict[uuid.UUID, str] = {}
        self.lock = asyncio.Lock()


class MemoryEventStore(EventStore):
    def __init__(self, registry: Registry, log: MemoryLog | None = None, *,
                 notify_channel: str = "memory_events") -> None:
        super().__init__(registry, notify_channel=notify_channel)
        self.log = log or MemoryLog()

    async def _commit(self, appends: Sequence[Append], headers: str) -> list[Envelope]:
        log = self.log
        async with log.lock:
            mine = [e for a in appends for e in a.events]
            already = [log.by_id[e.id] for e in mine if e.id in log.by_id]
            if already:
                if len(already) == len(mine):
                    return already
                raise DuplicateEventError(
                    f"{len(already)} of {len(mine)} events are already in the log; a retry must resend the same batch")
            for a in appends:
                head = len(log.streams.get(a.stream_id, ()))
                if a.expected_version not in (ANY_VERSION, head):
                    raise ConcurrencyError(a.stream_id, a.expected_version, head)
            stored: list[Envelope] = []
            for a in appends:
                stream = log.streams.setdefault(a.stream_id, [])
                for e in a.events:
                    event = e.model_copy(update={"stream_id": a.stream_id, "stream_version": len(stream) + 1,
                                                 "position": len(log.events) + 1})
                    stream.append(event)
                    log.events.append(event)
                    log.by_id[event.id] = event
                    log.headers[event.id] = headers
                    stored.append(event)
            return stored

    async def get(self, event_id: uuid.UUID) -> Envelope | None:
        stored = self.log.by_id.get(event_id)
        return self._upcast(stored) if stored is not None else None

    async def stream_version(self, stream_id: str) -> int:
        return len(self.log.streams.get(stream_id, ()))

    async def read_stream(self, stream_id: str) -> list[Envelope]:
        return [self._upcast(e) for e in self.log.streams.get(stream_id, ())]

    async def last_of(self, stream_id: str) -> Envelope | None:
        stream = self.log.streams.get(stream_id)
        return self._upcast(stream[-1]) if stream else None

    async def read_after(self, position: int, limit: int = 1000) -> list[Envelope]:
        return [self._upcast(e) for e in self.log.events[max(0, position):max(0, position) + limit]]

    async def head_position(self) -> int:
        return len(self.log.events)

    async def read_outbox(self, position: int, limit: int = 1000) -> list[OutboxEvent]:
        return [OutboxEvent(e.position or 0, str(e.id), e.stream_id or "", e.type, e.version,
                            json.loads(self.log.headers[e.id]), e.model_dump_json().encode())
                for e in self.log.events[max(0, position):max(0, position) + limit]]

    async def history(self, alias: str, *, since: datetime | None = None, until: datetime | None = None,
                      types: Collection[str] | None = None) -> list[Envelope]:
        return [self._upcast(e) for e in self.log.events
                if e.payload.get("alias") == alias and (types is None or e.type in types)
                and (since is None or e.occurred_at >= since) and (until is None or e.occurred_at <= until)]

    async def of_type(self, type_name: str, *, alias: str | None = None) -> list[Envelope]:
        return [self._upcast(e) for e in self.log.events
                if e.type == type_name and (alias is None or e.payload.get("alias") == alias)]

    async def iter_events(self, after: int, upto: int | None = None, batch: int = 20000,
                          types: Collection[str] | None = None) -> AsyncIterator[list[StoredEvent]]:
        end = len(self.log.events) if upto is None else min(upto, len(self.log.events))
        for start in range(max(0, after), end, batch):
            yield [StoredEvent(e.position or 0, e.occurred_at, decode(e.payload))
                   for e in self.log.events[start:min(start + batch, end)]
                   if (types is None or e.type in types) and (decode := self._decoder(e.type, e.version))]
