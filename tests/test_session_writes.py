"""Session bindings written behind the requests: in effect at once, recorded in order, through an outage, once."""

from __future__ import annotations

import asyncio

from helpers import eventually
from services.gateway.sessions import Sessions
from shared.contracts.events import event_registry
from shared.eventlog.memory import MemoryEventStore, MemoryLog


async def written(store, session_id: str) -> list[tuple[str, str]]:
    return [(e.type, e.payload.get("instance_id") or e.payload.get("to_instance_id"))
            for e in await store.read_stream(f"session:{session_id}")]


async def test_a_binding_and_a_move_are_in_effect_at_once_and_recorded_in_order():
    store = MemoryEventStore(event_registry())
    sessions, stop = Sessions(store), asyncio.Event()
    writer = asyncio.create_task(sessions.run_writes(stop))
    sessions.bind("a/s1", "a", "i1")
    sessions.migrate("a/s1", "a", "i1", "i2", "host_hot", {"kv_moved": 0.0})
    assert sessions.state("a/s1").host == "i2"  # before anything reached the log
    await eventually(lambda: written(store, "a/s1"), timeout=5)
    await eventually(lambda: _is(written(store, "a/s1"), [("SessionBound", "i1"), ("SessionMigrated", "i2")]), timeout=5)
    stop.set()
    await writer


async def test_the_loser_of_a_race_follows_the_winner_once_its_write_finds_out():
    log = MemoryLog()
    first, second = (Sessions(MemoryEventStore(event_registry(), log)) for _ in range(2))
    first.bind("a/s1", "a", "i1")
    second.bind("a/s1", "a", "i2")  # the other replica chose another host at the same moment
    stop = asyncio.Event()
    writers = [asyncio.create_task(s.run_writes(stop)) for s in (first, second)]
    await eventually(lambda: second.state("a/s1").host == "i1" and first.state("a/s1").host == "i1", timeout=5)
    assert await written(first.store, "a/s1") == [("SessionBound", "i1")]
    stop.set()
    await asyncio.gather(*writers)


async def test_bindings_made_while_the_log_is_away_are_recorded_once_it_is_back(monkeypatch):
    store = MemoryEventStore(event_registry())
    real_append, refused = store.append, []

    async def away(*args, **kwargs):
        if len(refused) < 4:
            refused.append(1)
            raise ConnectionRefusedError("connect call failed")
        return await real_append(*args, **kwargs)

    monkeypatch.setattr(store, "append", away)
    sessions, stop = Sessions(store), asyncio.Event()
    writer = asyncio.create_task(sessions.run_writes(stop))
    for n in range(3):
        sessions.bind(f"a/s{n}", "a", f"i{n}")
    await eventually(lambda: _all_written(store, 3), timeout=15)
    assert len(refused) == 4 and [await written(store, f"a/s{n}") for n in range(3)] == \
        [[("SessionBound", f"i{n}")] for n in range(3)]
    stop.set()
    await writer


async def _is(awaitable, expected) -> bool:
    return await awaitable == expected


async def _all_written(store, n: int) -> bool:
    return all([await written(store, f"a/s{k}") for k in range(n)])
