"""The event log against a real Postgres: concurrency, ordering, idempotency, append-only."""

from __future__ import annotations

import asyncio
import uuid

import asyncpg
import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from shared.contracts.backends import EngineKind
from shared.contracts.events import SessionBound, WorkerRegistered
from shared.contracts.messages import Envelope
from shared.eventlog.store import Append, ConcurrencyError, DuplicateEventError, EventStore


def worker_event(worker_id: str, n: int = 0) -> Envelope:
    return Envelope.wrap(WorkerRegistered(worker_id=worker_id, host=f"h{n}", gpu_memory_gb=24, slots=4, engines=[EngineKind.VLLM]))


def session_event(session: str, instance: str) -> Envelope:
    return Envelope.wrap(SessionBound(session_id=session, alias="a", instance_id=instance))


async def test_append_and_read_back(store: EventStore):
    stored = await store.append("worker:w1", [worker_event("w1"), worker_event("w1", 1)], expected_version=0)
    assert [e.stream_version for e in stored] == [1, 2]
    assert stored[0].position < stored[1].position
    events = await store.read_stream("worker:w1")
    assert [e.id for e in events] == [e.id for e in stored]
    assert events[1].payload["host"] == "h1" and events[0].type == "WorkerRegistered"
    assert await store.stream_version("worker:w1") == 2


def writer_like(store: EventStore) -> EventStore:
    """Another writer with its own group-commit queue, as another process would have."""
    return EventStore(store.engine, store.registry, notify_channel=store.notify_channel)


async def test_two_appenders_race_on_one_stream_version(store: EventStore):
    other = writer_like(store)
    await store.append("worker:w1", [worker_event("w1")], expected_version=0)
    for _ in range(10):  # repeat the race; every round exactly one may win
        head = await store.stream_version("worker:w1")
        results = await asyncio.gather(
            store.append("worker:w1", [worker_event("w1", 1)], expected_version=head),
            other.append("worker:w1", [worker_event("w1", 2)], expected_version=head),
            return_exceptions=True,
        )
        wins = [r for r in results if isinstance(r, list)]
        conflicts = [r for r in results if isinstance(r, ConcurrencyError)]
        assert len(wins) == 1 and len(conflicts) == 1, results
        assert conflicts[0].expected == head and conflicts[0].actual == head + 1
        assert await store.stream_version("worker:w1") == head + 1


async def test_stale_or_future_expected_version_writes_nothing(store: EventStore):
    await store.append("worker:w1", [worker_event("w1")], expected_version=0)
    before = await store.head_position()
    with pytest.raises(ConcurrencyError):
        await store.append("worker:w1", [worker_event("w1")], expected_version=0)
    with pytest.raises(ConcurrencyError):
        await store.append("worker:w1", [worker_event("w1")], expected_version=5)
    # An atomic batch across streams: one bad stream and nothing is written.
    with pytest.raises(ConcurrencyError):
        await store.append_batch([Append("worker:w2", [worker_event("w2")], 0), Append("worker:w1", [worker_event("w1")], 0)])
    assert await store.head_position() == before
    assert await store.stream_version("worker:w2") == 0


async def test_append_is_idempotent_by_event_id(store: EventStore):
    event = worker_event("w1")
    first = await store.append("worker:w1", [event], expected_version=0)
    again = await store.append("worker:w1", [event], expected_version=0)  # a retry, stale expectation and all
    assert again[0].position == first[0].position
    assert len(await store.read_stream("worker:w1")) == 1
    with pytest.raises(DuplicateEventError):
        await store.append("worker:w1", [event, worker_event("w1", 1)])


async def test_the_log_refuses_updates_and_deletes(store: EventStore):
    await store.append("worker:w1", [worker_event("w1")])
    async with store.engine.begin() as conn:
        with pytest.raises(DBAPIError, match="append-only"):
            await conn.execute(text("UPDATE events SET type = 'X'"))
    async with store.engine.begin() as conn:
        with pytest.raises(DBAPIError, match="append-only"):
            await conn.execute(text("DELETE FROM events"))
    assert len(await store.read_stream("worker:w1")) == 1


async def test_concurrent_appenders_and_a_tailing_reader_miss_nothing(store: EventStore):
    """8+ writers on different streams; a reader tailing by position sees each event once, in order."""
    writers, per_writer = 10, 40
    written: set[uuid.UUID] = set()
    done = asyncio.Event()
    seen: list[tuple[int, uuid.UUID]] = []

    async def writer(n: int) -> None:
        own = writer_like(store)  # separate transactions, as separate processes would write
        for i in range(per_writer):
            batch = [session_event(f"s{n}", f"i{i}")] if i % 3 else [session_event(f"s{n}", f"i{i}"), session_event(f"s{n}", f"j{i}")]
            stored = await own.append(f"session:s{n}", batch)
            written.update(e.id for e in stored)
            if i % 7 == 0:
                await asyncio.sleep(0)

    async def reader() -> None:
        position = 0
        while True:
            finished = done.is_set()
            batch = await store.read_after(position, limit=25)
            for e in batch:
                assert e.position > position, "positions must only grow"
                seen.append((e.position, e.id))
                position = e.position
            if finished and not batch:
                return
            if not batch:
                await asyncio.sleep(0.001)

    tail = asyncio.create_task(reader())
    await asyncio.gather(*(writer(n) for n in range(writers)))
    done.set()
    await asyncio.wait_for(tail, 30)
    ids = [i for _, i in seen]
    assert len(ids) == len(set(ids)), "an event was seen twice"
    assert set(ids) == written, f"missed {len(written - set(ids))} events"
    assert [p for p, _ in seen] == sorted(p for p, _ in seen)


async def test_concurrent_appends_of_one_writer_are_each_checked_on_their_own(store: EventStore):
    """Appends that share a group commit still succeed or fail one by one."""
    await store.append("worker:w1", [worker_event("w1")], expected_version=0)
    results = await asyncio.gather(
        store.append("worker:w1", [worker_event("w1", 1)], expected_version=1),
        store.append("worker:w1", [worker_event("w1", 2)], expected_version=1),  # loses to the first
        store.append("worker:w2", [worker_event("w2")], expected_version=0),
        store.append("worker:w3", [worker_event("w3")], expected_version=7),  # wrong
        return_exceptions=True,
    )
    assert [type(r).__name__ for r in results] == ["list", "ConcurrencyError", "list", "ConcurrencyError"]
    assert [e.payload["host"] for e in await store.read_stream("worker:w1")] == ["h0", "h1"]
    assert await store.stream_version("worker:w3") == 0


async def test_a_retry_racing_its_original_in_one_group_is_stored_once(store: EventStore):
    event = worker_event("w1")
    results = await asyncio.gather(
        store.append("worker:w1", [event]),
        store.append("worker:w1", [event]),
        store.append("worker:w2", [worker_event("w2")]),
    )
    assert results[0][0].position == results[1][0].position
    assert len(await store.read_stream("worker:w1")) == 1 and len(await store.read_stream("worker:w2")) == 1


async def test_one_bad_append_fails_alone(store: EventStore):
    """Postgres refuses NUL in JSON text: that caller gets the error, the others are written."""
    bad = session_event("s\u0000", "i1")
    good = worker_event("w1")
    results = await asyncio.gather(store.append(bad.stream_id, [bad]), store.append("worker:w1", [good]),
                                   return_exceptions=True)
    assert isinstance(results[0], (DBAPIError, asyncpg.PostgresError)) and isinstance(results[1], list)
    assert [e.id for e in await store.read_stream("worker:w1")] == [good.id]


async def test_append_refuses_what_the_contracts_would_refuse_on_read(store: EventStore):
    broken = worker_event("w1").model_copy(update={"payload": {"worker_id": "w1"}})
    with pytest.raises(Exception, match="host"):
        await store.append("worker:w1", [broken])
    assert await store.head_position() == 0


async def test_history_and_stream_of_alias(store: EventStore):
    await store.append("session:s1", [session_event("s1", "i1")])
    await store.append("worker:w1", [worker_event("w1")])
    history = await store.history("a")
    assert [e.type for e in history] == ["SessionBound"]


async def test_old_event_versions_stay_stored_as_written_and_are_read_upcast(store: EventStore):
    from shared.contracts.messages import Event, Registry

    class PingV1(Event):
        TYPE, VERSION, CATEGORY = "Ping", 1, "ping"
        who: str

        def stream_key(self) -> str:
            return self.who

    class Ping(Event):
        TYPE, VERSION, CATEGORY = "Ping", 2, "ping"
        name: str
        alias: str

        def stream_key(self) -> str:
            return self.name

    old_code = EventStore(store.engine, Registry([PingV1]), notify_channel=store.notify_channel)
    await old_code.append("ping:x", [Envelope.wrap(PingV1(who="x"))])

    registry = Registry([Ping])
    registry.upcaster("Ping", 1)(lambda p: {"name": p["who"], "alias": "a"})
    new_code = EventStore(store.engine, registry, notify_channel=store.notify_channel)
    (event,) = await new_code.read_stream("ping:x")
    assert event.version == 2 and event.payload == {"name": "x", "alias": "a"}
    async with store.engine.connect() as conn:
        stored = (await conn.execute(text("SELECT version, payload FROM events WHERE stream_id = 'ping:x'"))).one()
    assert stored.version == 1 and stored.payload == {"who": "x"}  # never rewritten
    (raw,) = [e async for batch in new_code.iter_raw(0) for e in batch]
    assert raw.payload == {"name": "x", "alias": "a"}
