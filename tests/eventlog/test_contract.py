"""The event log's contract, against every store: concurrency, ordering, idempotency, upcasting on read."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from shared.contracts.backends import EngineKind
from shared.contracts.events import SessionBound, WorkerRegistered
from shared.contracts.messages import Envelope
from shared.eventlog.store import Append, ConcurrencyError, DuplicateEventError, EventStore


def worker_event(worker_id: str, n: int = 0) -> Envelope:
    return Envelope.wrap(WorkerRegistered(worker_id=worker_id, host=f"h{n}", gpu_memory_gb=24, slots=4, engines=[EngineKind.VLLM]))


def session_event(session: str, instance: str) -> Envelope:
    return Envelope.wrap(SessionBound(session_id=session, alias="a", instance_id=instance))


async def test_append_and_read_back(any_store: EventStore):
    stored = await any_store.append("worker:w1", [worker_event("w1"), worker_event("w1", 1)], expected_version=0)
    assert [e.stream_version for e in stored] == [1, 2]
    assert stored[0].position < stored[1].position
    events = await any_store.read_stream("worker:w1")
    assert [e.id for e in events] == [e.id for e in stored]
    assert events[1].payload["host"] == "h1" and events[0].type == "WorkerRegistered"
    assert await any_store.stream_version("worker:w1") == 2


async def test_two_appenders_race_on_one_stream_version(any_store: EventStore, writer_of):
    other = writer_of()
    await any_store.append("worker:w1", [worker_event("w1")], expected_version=0)
    for _ in range(10):  # repeat the race; every round exactly one may win
        head = await any_store.stream_version("worker:w1")
        results = await asyncio.gather(
            any_store.append("worker:w1", [worker_event("w1", 1)], expected_version=head),
            other.append("worker:w1", [worker_event("w1", 2)], expected_version=head),
            return_exceptions=True,
        )
        wins = [r for r in results if isinstance(r, list)]
        conflicts = [r for r in results if isinstance(r, ConcurrencyError)]
        assert len(wins) == 1 and len(conflicts) == 1, results
        assert conflicts[0].expected == head and conflicts[0].actual == head + 1
        assert await any_store.stream_version("worker:w1") == head + 1


async def test_stale_or_future_expected_version_writes_nothing(any_store: EventStore):
    await any_store.append("worker:w1", [worker_event("w1")], expected_version=0)
    before = await any_store.head_position()
    with pytest.raises(ConcurrencyError):
        await any_store.append("worker:w1", [worker_event("w1")], expected_version=0)
    with pytest.raises(ConcurrencyError):
        await any_store.append("worker:w1", [worker_event("w1")], expected_version=5)
    # An atomic batch across streams: one bad stream and nothing is written.
    with pytest.raises(ConcurrencyError):
        await any_store.append_batch([Append("worker:w2", [worker_event("w2")], 0), Append("worker:w1", [worker_event("w1")], 0)])
    assert await any_store.head_position() == before
    assert await any_store.stream_version("worker:w2") == 0


async def test_append_is_idempotent_by_event_id(any_store: EventStore):
    event = worker_event("w1")
    first = await any_store.append("worker:w1", [event], expected_version=0)
    again = await any_store.append("worker:w1", [event], expected_version=0)  # a retry, stale expectation and all
    assert again[0].position == first[0].position
    assert len(await any_store.read_stream("worker:w1")) == 1
    with pytest.raises(DuplicateEventError):
        await any_store.append("worker:w1", [event, worker_event("w1", 1)])


async def test_concurrent_appenders_and_a_tailing_reader_miss_nothing(any_store: EventStore, writer_of):
    """8+ writers on different streams; a reader tailing by position sees each event once, in order."""
    writers, per_writer = 10, 40
    written: set[uuid.UUID] = set()
    done = asyncio.Event()
    seen: list[tuple[int, uuid.UUID]] = []

    async def writer(n: int) -> None:
        own = writer_of()  # separate transactions, as separate processes would write
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
            batch = await any_store.read_after(position, limit=25)
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


async def test_concurrent_appends_of_one_writer_are_each_checked_on_their_own(any_store: EventStore):
    """Appends that share a group commit still succeed or fail one by one."""
    await any_store.append("worker:w1", [worker_event("w1")], expected_version=0)
    results = await asyncio.gather(
        any_store.append("worker:w1", [worker_event("w1", 1)], expected_version=1),
        any_store.append("worker:w1", [worker_event("w1", 2)], expected_version=1),  # loses to the first
        any_store.append("worker:w2", [worker_event("w2")], expected_version=0),
        any_store.append("worker:w3", [worker_event("w3")], expected_version=7),  # wrong
        return_exceptions=True,
    )
    assert [type(r).__name__ for r in results] == ["list", "ConcurrencyError", "list", "ConcurrencyError"]
    assert [e.payload["host"] for e in await any_store.read_stream("worker:w1")] == ["h0", "h1"]
    assert await any_store.stream_version("worker:w3") == 0


async def test_a_retry_racing_its_original_in_one_group_is_stored_once(any_store: EventStore):
    event = worker_event("w1")
    results = await asyncio.gather(
        any_store.append("worker:w1", [event]),
        any_store.append("worker:w1", [event]),
        any_store.append("worker:w2", [worker_event("w2")]),
    )
    assert results[0][0].position == results[1][0].position
    assert len(await any_store.read_stream("worker:w1")) == 1 and len(await any_store.read_stream("worker:w2")) == 1


async def test_append_refuses_what_the_contracts_would_refuse_on_read(any_store: EventStore):
    broken = worker_event("w1").model_copy(update={"payload": {"worker_id": "w1"}})
    with pytest.raises(Exception, match="host"):
        await any_store.append("worker:w1", [broken])
    assert await any_store.head_position() == 0


async def test_history_and_stream_of_alias(any_store: EventStore):
    await any_store.append("session:s1", [session_event("s1", "i1")])
    await any_store.append("worker:w1", [worker_event("w1")])
    history = await any_store.history("a")
    assert [e.type for e in history] == ["SessionBound"]


async def test_old_event_versions_stay_stored_as_written_and_are_read_upcast(any_store: EventStore, writer_of):
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

    old_code = writer_of(Registry([PingV1]))
    await old_code.append("ping:x", [Envelope.wrap(PingV1(who="x"))])

    registry = Registry([Ping])
    registry.upcaster("Ping", 1)(lambda p: {"name": p["who"], "alias": "a"})
    new_code = writer_of(registry)
    (event,) = await new_code.read_stream("ping:x")
    assert event.version == 2 and event.payload == {"name": "x", "alias": "a"}
    (stored,) = await old_code.read_stream("ping:x")  # code that knows only v1 reads what is stored
    assert stored.version == 1 and stored.payload == {"who": "x"}  # never rewritten
    (typed,) = [e async for batch in new_code.iter_events(0) for e in batch]
    assert isinstance(typed.event, Ping) and typed.event.name == "x" and typed.position == stored.position
    assert [e async for batch in writer_of(Registry([])).iter_events(0) for e in batch] == []  # unknown types skipped


async def test_versions_that_only_added_fields_are_read_with_their_defaults(any_store: EventStore, writer_of):
    from shared.contracts.messages import Event, Registry

    class PingV1(Event):
        TYPE, VERSION, CATEGORY = "Ping", 1, "ping"
        name: str

        def stream_key(self) -> str:
            return self.name

    class Ping(Event):
        TYPE, VERSION, CATEGORY = "Ping", 2, "ping"
        name: str
        labels: dict[str, str] = {}

        def stream_key(self) -> str:
            return self.name

    await writer_of(Registry([PingV1])).append("ping:x", [Envelope.wrap(PingV1(name="x"))])
    registry = Registry([Ping])
    registry.fields_added("Ping", 1, "labels")
    new_code = writer_of(registry)
    await new_code.append("ping:y", [Envelope.wrap(Ping(name="y", labels={"k": "v"}))])
    typed = [e.event async for batch in new_code.iter_events(0) for e in batch]
    assert [(type(e), e.name, e.labels) for e in typed] == [(Ping, "x", {}), (Ping, "y", {"k": "v"})]
    (old,) = await new_code.read_stream("ping:x")
    assert old.version == 2 and old.payload == {"name": "x", "labels": {}}


async def test_every_reader_sees_the_same_log(any_store: EventStore):
    bound = await any_store.append("session:s1", [session_event("s1", "i1")])
    workers = await any_store.append("worker:w1", [worker_event("w1"), worker_event("w1", 1)])
    assert (await any_store.get(bound[0].id)).payload["instance_id"] == "i1"
    assert await any_store.contains(workers[1].id) and not await any_store.contains(uuid.uuid4())
    assert (await any_store.last_of("worker:w1")).id == workers[1].id and await any_store.last_of("worker:none") is None
    assert [e.id for e in await any_store.of_type("WorkerRegistered")] == [e.id for e in workers]
    assert [e.id for e in await any_store.of_type("SessionBound", alias="a")] == [bound[0].id]
    outbox = await any_store.read_outbox(bound[0].position)
    assert [o.id for o in outbox] == [str(e.id) for e in workers] and outbox[0].stream_id == "worker:w1"
    published = Envelope.model_validate_json(outbox[0].body)  # what the relay publishes, as it is stored
    assert published.id == workers[0].id and published.position == workers[0].position
    typed = [e async for batch in any_store.iter_events(0, upto=workers[0].position, batch=1) for e in batch]
    assert [(e.position, type(e.event)) for e in typed] == [(bound[0].position, SessionBound),
                                                              (workers[0].position, WorkerRegistered)]
    only = [e async for batch in any_store.iter_events(0, types={"WorkerRegistered"}) for e in batch]
    assert [e.event.host for e in only] == ["h0", "h1"]
    assert await any_store.head_position() == workers[1].position
