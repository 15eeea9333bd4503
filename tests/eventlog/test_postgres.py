"""What only the Postgres log does: the database itself refuses edits, and its own failures stay with their caller."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from test_contract import session_event, worker_event

from shared.eventlog.store import EventStore


async def test_the_log_refuses_updates_and_deletes(store: EventStore):
    await store.append("worker:w1", [worker_event("w1")])
    async with store.engine.begin() as conn:
        with pytest.raises(DBAPIError, match="append-only"):
            await conn.execute(text("UPDATE events SET type = 'X'"))
    async with store.engine.begin() as conn:
        with pytest.raises(DBAPIError, match="append-only"):
            await conn.execute(text("DELETE FROM events"))
    assert len(await store.read_stream("worker:w1")) == 1


async def test_one_bad_append_fails_alone(store: EventStore):
    """Postgres refuses NUL in JSON text: that caller gets the error, the others are written."""
    bad = session_event("s\u0000", "i1")
    good = worker_event("w1")
    results = await asyncio.gather(store.append(bad.stream_id, [bad]), store.append("worker:w1", [good]),
                                   return_exceptions=True)
    assert isinstance(results[0], (DBAPIError, asyncpg.PostgresError)) and isinstance(results[1], list)
    assert [e.id for e in await store.read_stream("worker:w1")] == [good.id]
