"""The event log: append-only, optimistic concurrency per stream, a gapless global order.

Appends go through SQLAlchemy (transactions, pooling); bulk reads use the asyncpg
connection underneath for speed.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from shared.contracts.messages import Envelope, Registry


class ConcurrencyError(Exception):
    """Another writer appended to the stream first. Nothing was written."""

    def __init__(self, stream_id: str, expected: int, actual: int) -> None:
        self.stream_id, self.expected, self.actual = stream_id, expected, actual
        super().__init__(f"stream {stream_id!r} is at version {actual}, expected {expected}")


class DuplicateEventError(ValueError):
    """A batch mixes events already in the log with new ones: not a retry, a bug."""


ANY_VERSION = -1
"""`expected_version` meaning: append at the head, whatever it is."""


@dataclass(frozen=True, slots=True)
class Append:
    """Events for one stream, appended only if the stream is at `expected_version` (0 = new)."""

    stream_id: str
    events: Sequence[Envelope]
    expected_version: int = ANY_VERSION


@dataclass(frozen=True, slots=True)
class RawEvent:
    """A stored event as the projections read it: upcast, not validated (it was on append)."""

    position: int
    type: str
    payload: dict[str, Any]
    occurred_at: datetime
    stream_id: str


_COLUMNS = "position, id, stream_id, stream_version, type, version, occurred_at, causation_id, correlation_id, payload"


class EventStore:
    def __init__(self, engine: AsyncEngine, registry: Registry, *, notify_channel: str) -> None:
        self.engine = engine
        self.registry = registry
        self.notify_channel = notify_channel

    # ------------------------------------------------------------------ writing

    async def append(
        self,
        stream_id: str,
        events: Sequence[Envelope],
        expected_version: int = ANY_VERSION,
        *,
        headers: dict[str, str] | None = None,
    ) -> list[Envelope]:
        return await self.append_batch([Append(stream_id, events, expected_version)], headers=headers)

    async def append_batch(self, appends: Sequence[Append], *, headers: dict[str, str] | None = None) -> list[Envelope]:
        """Append to one or more streams atomically; return the events with their positions.

        Idempotent by event id: appending events that are all already stored returns
        the stored copies and writes nothing, whatever `expected_version` says, so a
        retried append (or a redelivered command) has one effect.
        """
        all_events = [e for a in appends for e in a.events]
        if not all_events:
            return []
        for a in appends:
            for e in a.events:
                if not self.registry.known(e.type):
                    raise ValueError(f"cannot append unknown event type {e.type!r}")
                if e.stream_id not in (None, a.stream_id):
                    raise ValueError(f"event {e.type} belongs to stream {e.stream_id!r}, not {a.stream_id!r}")
        ids = [e.id for e in all_events]
        if len(set(ids)) != len(ids):
            raise DuplicateEventError("the same event id appears twice in one append")
        header_json = json.dumps(headers or {})

        async with self.engine.begin() as conn:
            # Why a table lock: positions come from a sequence, and sequence values
            # are handed out when a row is inserted, not when its transaction
            # commits. Without serialising writers, transaction A could take
            # position 10, transaction B position 11, and B commit first: a reader
            # tailing "position > 9" would see 11, move its cursor past 10, and
            # never see A's event when it commits a moment later. EXCLUSIVE mode
            # lets readers (ACCESS SHARE) through but admits one writer at a time,
            # held to commit, so positions become visible in increasing order.
            # A rolled-back writer leaves a hole that is never filled, which a
            # reader may safely skip. The cost is that appends are serial; batches
            # amortise it.
            await conn.execute(text("LOCK TABLE events IN EXCLUSIVE MODE"))

            stored = await self._existing(conn, ids)
            if stored:
                if len(stored) != len(ids):
                    raise DuplicateEventError(
                        f"{len(stored)} of {len(ids)} events are already in the log; a retry must resend the same batch"
                    )
                return [stored[i] for i in ids]

            rows: list[dict[str, Any]] = []
            for a in appends:
                head = await self._head(conn, a.stream_id)
                if a.expected_version != ANY_VERSION and a.expected_version != head:
                    raise ConcurrencyError(a.stream_id, a.expected_version, head)
                for offset, e in enumerate(a.events, start=1):
                    rows.append(
                        {
                            "id": e.id,
                            "stream_id": a.stream_id,
                            "stream_version": head + offset,
                            "type": e.type,
                            "version": e.version,
                            "occurred_at": e.occurred_at,
                            "causation_id": e.causation_id,
                            "correlation_id": e.correlation_id,
                            "payload": json.dumps(e.payload, separators=(",", ":")),
                            "headers": header_json,
                        }
                    )
            result = await conn.execute(
                text(
                    "INSERT INTO events (id, stream_id, stream_version, type, version, occurred_at,"
                    " causation_id, correlation_id, payload, headers)"
                    " SELECT * FROM unnest(CAST(:ids AS uuid[]), CAST(:streams AS text[]), CAST(:versions AS int[]),"
                    " CAST(:types AS text[]), CAST(:cversions AS smallint[]), CAST(:times AS timestamptz[]),"
                    " CAST(:causes AS uuid[]), CAST(:corrs AS uuid[]), CAST(:payloads AS jsonb[]), CAST(:headers AS jsonb[]))"
                    " RETURNING position"
                ),
                {
                    "ids": [r["id"] for r in rows],
                    "streams": [r["stream_id"] for r in rows],
                    "versions": [r["stream_version"] for r in rows],
                    "types": [r["type"] for r in rows],
                    "cversions": [r["version"] for r in rows],
                    "times": [r["occurred_at"] for r in rows],
                    "causes": [r["causation_id"] for r in rows],
                    "corrs": [r["correlation_id"] for r in rows],
                    "payloads": [r["payload"] for r in rows],
                    "headers": [r["headers"] for r in rows],
                },
            )
            positions = [row[0] for row in result]
            # Delivered at commit, and only if it commits: wakes the relay.
            await conn.execute(text("SELECT pg_notify(:channel, :pos)"), {"channel": self.notify_channel, "pos": str(max(positions))})

        return [
            e.model_copy(update={"stream_id": r["stream_id"], "stream_version": r["stream_version"], "position": p})
            for e, r, p in zip(all_events, rows, positions)
        ]

    async def _existing(self, conn: AsyncConnection, ids: list[uuid.UUID]) -> dict[uuid.UUID, Envelope]:
        result = await conn.execute(
            text(f"SELECT {_COLUMNS} FROM events WHERE id = ANY(CAST(:ids AS uuid[]))"), {"ids": ids}
        )
        return {row.id: _envelope(row) for row in result}

    @staticmethod
    async def _head(conn: AsyncConnection, stream_id: str) -> int:
        result = await conn.execute(
            text("SELECT coalesce(max(stream_version), 0) FROM events WHERE stream_id = :s"), {"s": stream_id}
        )
        return int(result.scalar_one())

    # ------------------------------------------------------------------ reading

    async def get(self, event_id: uuid.UUID) -> Envelope | None:
        async with self.engine.connect() as conn:
            return (await self._existing(conn, [event_id])).get(event_id)

    async def contains(self, event_id: uuid.UUID) -> bool:
        return await self.get(event_id) is not None

    async def stream_version(self, stream_id: str) -> int:
        async with self.engine.connect() as conn:
            return await self._head(conn, stream_id)

    async def read_stream(self, stream_id: str) -> list[Envelope]:
        async with self.engine.connect() as conn:
            result = await conn.execute(
                text(f"SELECT {_COLUMNS} FROM events WHERE stream_id = :s ORDER BY stream_version"), {"s": stream_id}
            )
            return [_envelope(row) for row in result]

    async def read_after(self, position: int, limit: int = 1000) -> list[Envelope]:
        """Committed events after `position`, in position order. Safe to tail: see `append_batch`."""
        async with self.engine.connect() as conn:
            result = await conn.execute(
                text(f"SELECT {_COLUMNS} FROM events WHERE position > :p ORDER BY position LIMIT :n"),
                {"p": position, "n": limit},
            )
            return [_envelope(row) for row in result]

    async def head_position(self) -> int:
        async with self.engine.connect() as conn:
            result = await conn.execute(text("SELECT coalesce(max(position), 0) FROM events"))
            return int(result.scalar_one())

    async def read_after_with_headers(self, position: int, limit: int = 1000) -> list[tuple[Envelope, dict[str, str]]]:
        async with self.engine.connect() as conn:
            result = await conn.execute(
                text(f"SELECT {_COLUMNS}, headers FROM events WHERE position > :p ORDER BY position LIMIT :n"),
                {"p": position, "n": limit},
            )
            return [(_envelope(row), dict(row.headers or {})) for row in result]

    async def history(
        self, alias: str, *, since: datetime | None = None, until: datetime | None = None
    ) -> list[Envelope]:
        clauses, params = ["payload->>'alias' = :alias"], {"alias": alias}
        if since is not None:
            clauses.append("occurred_at >= :since")
            params["since"] = since
        if until is not None:
            clauses.append("occurred_at <= :until")
            params["until"] = until
        async with self.engine.connect() as conn:
            result = await conn.execute(
                text(f"SELECT {_COLUMNS} FROM events WHERE {' AND '.join(clauses)} ORDER BY position"), params
            )
            return [_envelope(row) for row in result]

    async def iter_raw(self, after: int, upto: int | None = None, batch: int = 20000) -> AsyncIterator[list[RawEvent]]:
        """Stream events in position order as upcast dicts, in batches, for projections.

        Keyset pagination on the position index keeps each query short and the
        memory flat over logs of any size.
        """
        registry = self.registry
        async with self.engine.connect() as conn:
            raw = (await conn.get_raw_connection()).driver_connection
            cursor = after
            while True:
                if upto is not None and cursor >= upto:
                    return
                rows = await raw.fetch(
                    "SELECT position, type, version, payload::text, occurred_at, stream_id FROM events"
                    " WHERE position > $1 AND ($2::bigint IS NULL OR position <= $2) ORDER BY position LIMIT $3",
                    cursor,
                    upto,
                    batch,
                )
                if not rows:
                    return
                out: list[RawEvent] = []
                for position, type_name, version, payload_text, occurred_at, stream_id in rows:
                    payload = json.loads(payload_text)
                    if not registry.known(type_name):
                        # A type this code does not know (written by a newer release):
                        # projections skip it rather than guess.
                        continue
                    if version != registry.contract(type_name).VERSION:
                        _, payload = registry.upcast(type_name, version, payload)
                    out.append(RawEvent(position, type_name, payload, occurred_at, stream_id))
                cursor = rows[-1][0]
                yield out


def _envelope(row: Any) -> Envelope:
    payload = row.payload if isinstance(row.payload, dict) else json.loads(row.payload)
    return Envelope(
        id=row.id,
        type=row.type,
        version=row.version,
        occurred_at=row.occurred_at,
        causation_id=row.causation_id,
        correlation_id=row.correlation_id,
        payload=payload,
        stream_id=row.stream_id,
        stream_version=row.stream_version,
        position=row.position,
    )


def notify_channel(namespace: str) -> str:
    return f"{namespace}_events"


def make_store(engine: AsyncEngine, registry: Registry, namespace: str) -> EventStore:
    return EventStore(engine, registry, notify_channel=notify_channel(namespace))
