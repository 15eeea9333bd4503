"""The event log in Postgres: one `events` table per namespace schema, created only by the migrations.

Appends go through SQLAlchemy (transactions, pooling); bulk reads use the asyncpg
connection underneath for speed. Writers serialise on a table lock so positions
become visible in increasing order (`_commit_group_in` says why).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Collection, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import orjson
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

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

_COLUMNS = "position, id, stream_id, stream_version, type, version, occurred_at, causation_id, correlation_id, payload"


@dataclass
class _Request:
    """One caller's append, waiting for the next group commit."""

    appends: Sequence[Append]
    headers: str
    done: asyncio.Future[list[Envelope]]


class PostgresEventStore(EventStore):
    """The log in one Postgres schema: appends through SQLAlchemy's pool, bulk reads on asyncpg underneath."""

    def __init__(self, engine: AsyncEngine, registry: Registry, *, notify_channel: str, max_group: int = 512) -> None:
        super().__init__(registry, notify_channel=notify_channel)
        self.engine = engine
        self.max_group = max_group
        self._queue: list[_Request] = []
        self._committer: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ writing

    async def _commit(self, appends: Sequence[Append], headers: str) -> list[Envelope]:
        request = _Request(appends, headers, asyncio.get_running_loop().create_future())
        self._queue.append(request)
        if self._committer is None or self._committer.done():
            self._committer = asyncio.create_task(self._commit_queued())
        return await request.done

    async def _commit_queued(self) -> None:
        """Group commit: every append waiting now goes into one transaction.

        Writers are serialised by the table lock anyway (see `_commit_group`), so
        a transaction per append would spend its time waiting for the lock and the
        commit's disk flush. One transaction carries all appends that queued up
        meanwhile; each is still checked, and accepted or refused, on its own. If
        the database refuses the group as a whole (a payload Postgres cannot store,
        or a retry racing its original so one event id comes twice), each append is
        retried alone: one caller's problem never fails another's, and the retry
        finds its original stored.
        """
        try:
            while self._queue:
                group, self._queue = self._queue[: self.max_group], self._queue[self.max_group :]
                try:
                    results = await self._commit_group(group)
                except Exception as exc:
                    if len(group) == 1:
                        results = [exc]
                    else:
                        results = []
                        for request in group:
                            try:
                                results += await self._commit_group([request])
                            except Exception as alone:
                                results.append(alone)
                for request, result in zip(group, results):
                    if request.done.done():
                        continue
                    if isinstance(result, Exception):
                        request.done.set_exception(result)
                    else:
                        request.done.set_result(result)
        finally:
            # Cancelled mid-way (the loop is shutting down): nobody may wait forever.
            for request in self._queue:
                if not request.done.done():
                    request.done.set_exception(RuntimeError("the event store stopped before this append was committed"))
            self._queue = []

    async def _commit_group(self, group: list[_Request]) -> list[list[Envelope] | Exception]:
        ids = [e.id for r in group for a in r.appends for e in a.events]
        streams = sorted({a.stream_id for r in group for a in r.appends})
        async with self.engine.connect() as conn:
            # The hot path talks to asyncpg directly, in a transaction of its own:
            # one group commit is five round trips and no more.
            raw = (await conn.get_raw_connection()).driver_connection
            async with raw.transaction():
                return await self._commit_group_in(raw, group, ids, streams)

    async def _commit_group_in(
        self, raw: Any, group: list[_Request], ids: list[uuid.UUID], streams: list[str]
    ) -> list[list[Envelope] | Exception]:
        # Why a table lock: positions come from a sequence, and sequence values
        # are handed out when a row is inserted, not when its transaction
        # commits. Without serialising writers, transaction A could take
        # position 10, transaction B position 11, and B commit first: a reader
        # tailing "position > 9" would see 11, move its cursor past 10, and
        # never see A's event when it commits a moment later. EXCLUSIVE mode
        # lets readers (ACCESS SHARE) through but admits one writer at a time,
        # held to commit, so positions become visible in increasing order.
        # A rolled-back writer leaves a hole that is never filled, which a
        # reader may safely skip. The cost is that writers are serial; the
        # group commit above amortises it. Services may not lock the table
        # themselves (that takes UPDATE or DELETE rights on the log, which they
        # do not have): the owner's `events_lock_for_append()` takes the lock
        # for them (migration 0006).
        await raw.execute("SELECT events_lock_for_append()")
        known, heads_json = await raw.fetchrow(
            "SELECT (SELECT coalesce(array_agg(id), '{}') FROM events WHERE id = ANY($1::uuid[])),"
            " (SELECT coalesce(json_object_agg(stream_id, head), '{}')::text FROM"
            "   (SELECT stream_id, max(stream_version) AS head FROM events WHERE stream_id = ANY($2::text[])"
            "    GROUP BY stream_id) h)",
            ids,
            streams,
        )
        heads: dict[str, int] = orjson.loads(heads_json)
        stored = await _existing(raw, list(known)) if known else {}

        results: list[list[Envelope] | Exception | None] = []
        rows: list[tuple[Any, ...]] = []
        placed: list[tuple[int, Envelope, str, int]] = []  # (request index, event, stream, version)
        for index, request in enumerate(group):
            mine = [e for a in request.appends for e in a.events]
            already = [stored[e.id] for e in mine if e.id in stored]
            if already:
                if len(already) == len(mine):
                    results.append(already)
                else:
                    results.append(DuplicateEventError(
                        f"{len(already)} of {len(mine)} events are already in the log; a retry must resend the same batch"))
                continue
            conflict = next(
                (a for a in request.appends if a.expected_version not in (ANY_VERSION, heads.get(a.stream_id, 0))), None
            )
            if conflict is not None:
                results.append(ConcurrencyError(conflict.stream_id, conflict.expected_version, heads.get(conflict.stream_id, 0)))
                continue
            for a in request.appends:
                for e in a.events:
                    version = heads[a.stream_id] = heads.get(a.stream_id, 0) + 1
                    placed.append((index, e, a.stream_id, version))
                    rows.append((e.id, a.stream_id, version, e.type, e.version, e.occurred_at, e.causation_id,
                                 e.correlation_id, orjson.dumps(e.payload).decode(), request.headers))
            results.append(None)

        positions: dict[uuid.UUID, int] = {}
        if rows:
            # One round trip: insert, and notify the relay with the highest position
            # (delivered at commit, and only if the transaction commits).
            inserted = await raw.fetch(
                "WITH ins AS (INSERT INTO events (id, stream_id, stream_version, type, version, occurred_at,"
                "   causation_id, correlation_id, payload, headers)"
                "  SELECT * FROM unnest($1::uuid[], $2::text[], $3::int[], $4::text[], $5::smallint[],"
                "   $6::timestamptz[], $7::uuid[], $8::uuid[], $9::jsonb[], $10::jsonb[])"
                "  RETURNING id, position)"
                " SELECT id, position, pg_notify($11, (SELECT max(position) FROM ins)::text) FROM ins",
                *map(list, zip(*rows)),
                self.notify_channel,
            )
            positions = {row[0]: row[1] for row in inserted}

        written: dict[int, list[Envelope]] = {}
        for index, e, stream_id, version in placed:
            written.setdefault(index, []).append(
                e.model_copy(update={"stream_id": stream_id, "stream_version": version, "position": positions[e.id]}))
        return [written[i] if r is None else r for i, r in enumerate(results)]

    @staticmethod
    async def _head(conn: AsyncConnection, stream_id: str) -> int:
        return (await PostgresEventStore._heads(conn, [stream_id])).get(stream_id, 0)

    @staticmethod
    async def _heads(conn: AsyncConnection, stream_ids: list[str]) -> dict[str, int]:
        result = await conn.execute(
            text("SELECT stream_id, max(stream_version) FROM events WHERE stream_id = ANY(CAST(:s AS text[])) GROUP BY stream_id"),
            {"s": stream_ids},
        )
        return {row[0]: int(row[1]) for row in result}

    # ------------------------------------------------------------------ reading

    async def get(self, event_id: uuid.UUID) -> Envelope | None:
        async with self.engine.connect() as conn:
            raw = (await conn.get_raw_connection()).driver_connection
            stored = (await _existing(raw, [event_id])).get(event_id)
        return self._upcast(stored) if stored is not None else None

    async def stream_version(self, stream_id: str) -> int:
        async with self.engine.connect() as conn:
            return await self._head(conn, stream_id)

    async def read_stream(self, stream_id: str) -> list[Envelope]:
        async with self.engine.connect() as conn:
            result = await conn.execute(
                text(f"SELECT {_COLUMNS} FROM events WHERE stream_id = :s ORDER BY stream_version"), {"s": stream_id}
            )
            return [self._upcast(_envelope(row)) for row in result]

    async def last_of(self, stream_id: str) -> Envelope | None:
        """The stream's latest event, or None for a stream with none."""
        async with self.engine.connect() as conn:
            result = await conn.execute(
                text(f"SELECT {_COLUMNS} FROM events WHERE stream_id = :s ORDER BY stream_version DESC LIMIT 1"),
                {"s": stream_id},
            )
            row = result.first()
        return self._upcast(_envelope(row)) if row is not None else None

    async def read_after(self, position: int, limit: int = 1000) -> list[Envelope]:
        """Committed events after `position`, in position order. Safe to tail: see `append_batch`."""
        async with self.engine.connect() as conn:
            result = await conn.execute(
                text(f"SELECT {_COLUMNS} FROM events WHERE position > :p ORDER BY position LIMIT :n"),
                {"p": position, "n": limit},
            )
            return [self._upcast(_envelope(row)) for row in result]

    async def head_position(self) -> int:
        async with self.engine.connect() as conn:
            result = await conn.execute(text("SELECT coalesce(max(position), 0) FROM events"))
            return int(result.scalar_one())

    async def read_outbox(self, position: int, limit: int = 1000) -> list[OutboxEvent]:
        """Committed events after `position`, ready to publish: the envelope JSON is built
        by Postgres, so the relay moves bytes without decoding and re-encoding them."""
        async with self.engine.connect() as conn:
            raw = (await conn.get_raw_connection()).driver_connection
            rows = await raw.fetch(
                "SELECT position, id::text, stream_id, type, version, headers::text,"
                " json_build_object('id', id, 'type', type, 'version', version, 'occurred_at', occurred_at,"
                "   'causation_id', causation_id, 'correlation_id', correlation_id, 'payload', payload,"
                "   'stream_id', stream_id, 'stream_version', stream_version, 'position', position)::text"
                " FROM events WHERE position > $1 ORDER BY position LIMIT $2",
                position,
                limit,
            )
        return [OutboxEvent(r[0], r[1], r[2], r[3], r[4], orjson.loads(r[5]), r[6].encode()) for r in rows]

    async def history(
        self, alias: str, *, since: datetime | None = None, until: datetime | None = None,
        types: Collection[str] | None = None,
    ) -> list[Envelope]:
        """Every event naming the alias in [since, until], in log order, upcast; `types` limits the read."""
        clauses, params = ["payload->>'alias' = :alias"], {"alias": alias}
        if types is not None:
            clauses.append("type = ANY(:types)")
            params["types"] = list(types)
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
            return [self._upcast(_envelope(row)) for row in result]

    async def of_type(self, type_name: str, *, alias: str | None = None) -> list[Envelope]:
        """Every stored event of one type (optionally of one alias), in log order, upcast."""
        clauses, params = ["type = :type"], {"type": type_name}
        if alias is not None:
            clauses.append("payload->>'alias' = :alias")
            params["alias"] = alias
        async with self.engine.connect() as conn:
            result = await conn.execute(
                text(f"SELECT {_COLUMNS} FROM events WHERE {' AND '.join(clauses)} ORDER BY position"), params)
            return [self._upcast(_envelope(row)) for row in result]

    async def iter_events(
        self, after: int, upto: int | None = None, batch: int = 20000, types: Collection[str] | None = None
    ) -> AsyncIterator[list[StoredEvent]]:
        """One server-side cursor walks the position index once, so the cost stays
        linear in the events read, whatever the planner's statistics say, and
        memory stays flat. The next batch is fetched while the caller works on
        the current one, so Postgres and Python run side by side."""
        decoders, decoder = self._decoders, self._decoder
        query = "SELECT position, type, version, payload::text, occurred_at FROM events WHERE position > $1"
        args: list[Any] = [after]
        if upto is not None:
            args.append(upto)
            query += f" AND position <= ${len(args)}"
        if types is not None:
            args.append(sorted(types))
            query += f" AND type = ANY(${len(args)}::text[])"
        query += " ORDER BY position"
        async with self.engine.connect() as conn:
            raw = (await conn.get_raw_connection()).driver_connection
            async with raw.transaction(readonly=True):
                cursor = await raw.cursor(query, *args)
                rows = await cursor.fetch(batch)
                while rows:
                    upcoming = asyncio.ensure_future(cursor.fetch(batch))
                    await asyncio.sleep(0)  # let it send the request before we get busy
                    out: list[StoredEvent] = []
                    try:
                        for position, type_name, version, payload_text, occurred_at in rows:
                            decode = decoders.get((type_name, version), _UNSEEN)
                            if decode is _UNSEEN:
                                decode = decoder(type_name, version)
                            if decode is not None:  # None: written by a newer release; skipped, not guessed
                                out.append(StoredEvent(position, occurred_at, decode(payload_text)))
                        yield out
                    except BaseException:
                        upcoming.cancel()
                        with contextlib.suppress(BaseException):
                            await upcoming
                        raise
                    rows = await upcoming


_UNSEEN = object()


async def _existing(raw: Any, ids: list[uuid.UUID]) -> dict[uuid.UUID, Envelope]:
    records = await raw.fetch(f"SELECT {_COLUMNS} FROM events WHERE id = ANY($1::uuid[])", ids)
    return {r["id"]: _envelope(r) for r in records}


def _envelope(row: Any) -> Envelope:
    """An envelope from a stored row: an asyncpg record or a SQLAlchemy row."""
    m = row._mapping if hasattr(row, "_mapping") else row
    payload = m["payload"] if isinstance(m["payload"], dict) else orjson.loads(m["payload"])
    return Envelope(
        id=m["id"],
        type=m["type"],
        version=m["version"],
        occurred_at=m["occurred_at"],
        causation_id=m["causation_id"],
        correlation_id=m["correlation_id"],
        payload=payload,
        stream_id=m["stream_id"],
        stream_version=m["stream_version"],
        position=m["position"],
    )
