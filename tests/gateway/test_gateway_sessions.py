"""Sessions: identified, bound in the log once, followed by every replica, moved off a hot host, released when idle."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from gateway_support import ALIAS, SLOW, start_engine, wait_healthy
from shared.contracts.states import RoutingState as R

EAR = {"plugin": "ear", "t_hot_tokens": 400, "t_cool_s": 30}


def chat(*turns: str, system: str | None = None, **extra) -> dict:
    messages = [{"role": "system", "content": system}] if system else []
    messages += [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
    return {"model": ALIAS, "messages": messages, "max_tokens": 2, **extra}


async def session_events(store, session_id: str) -> list[str]:
    return [e.type for e in await store.read_stream(f"session:{ALIAS}/{session_id}")]


@pytest.fixture
async def two_vllm(engines, facts):
    await facts.alias(router=EAR)
    for i, engine in enumerate(engines[SLOW]):
        await facts.running(f"v{i}", engine, SLOW)
    await facts.route(R.VLLM_PRIMARY)


async def test_a_session_is_bound_once_and_every_later_turn_follows_it_without_writing(two_vllm, gateways, store):
    gateway = await gateways.start()
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
        hosts = set()
        for turn in range(6):
            response = await client.post("/v1/chat/completions", json=chat(f"turn {turn}"), headers={"x-session-id": "s1"})
            assert response.status_code == 200, response.text
            hosts.add(response.headers["x-modelpool-instance"])
        assert len(hosts) == 1
        assert await session_events(store, "s1") == ["SessionBound"]  # one write, for the first request only

        # Without a header: the OpenAI `user` field, else the system prompt and first user turn.
        for later in ("", " and more"):
            await client.post("/v1/chat/completions", json=chat("hi" + later, user="bob"))
            await client.post("/v1/chat/completions", json=chat("task: sort a list", "ok", "next" + later,
                                                              system="you are a coder"))
    assert await session_events(store, "user:bob") == ["SessionBound"]
    prefixed = [e for e in await store.of_type("SessionBound") if "/prefix:" in e.payload["session_id"]]
    assert len(prefixed) == 1


async def test_two_replicas_binding_the_same_new_sessions_at_once_end_with_one_binding_each(two_vllm, gateways, store):
    first, second = await gateways.start(), await gateways.start()
    async with httpx.AsyncClient(timeout=30) as client:

        async def both(session: str) -> set[str]:
            answers = await asyncio.gather(*(client.post(f"{g.url}/v1/chat/completions", json=chat("race"),
                                                         headers={"x-session-id": session}) for g in (first, second)))
            assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
            return {a.headers["x-modelpool-instance"] for a in answers}

        placed = await asyncio.gather(*(both(f"race-{i}") for i in range(20)))
    assert all(len(hosts) == 1 for hosts in placed), placed  # the loser followed the winner
    for i in range(20):
        assert await session_events(store, f"race-{i}") == ["SessionBound"]


async def test_a_hot_host_moves_the_session_to_a_less_loaded_instance_and_the_move_is_recorded(facts, gateways, store,
                                                                                              tmp_path):
    # Prefill slow enough (4 ms a token) that a long prompt keeps its host hot for a while.
    slow = [start_engine(tmp_path, "vllm", ALIAS, "--d-1", "0.004") for _ in range(2)]
    try:
        wait_healthy(slow)
        await facts.alias(router=EAR)
        for i, engine in enumerate(slow):
            await facts.running(f"v{i}", engine, SLOW)
        await facts.route(R.VLLM_PRIMARY)
        gateway = await gateways.start()
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as client:
            headers = {"x-session-id": "agent"}
            first = await client.post("/v1/chat/completions", json=chat("start"), headers=headers)
            host = first.headers["x-modelpool-instance"]
            long_turn = asyncio.create_task(client.post("/v1/chat/completions", json=chat("word " * 2000), headers=headers))
            await asyncio.sleep(0.3)  # the long prompt is in prefill on the host: over T_hot
            moved = await client.post("/v1/chat/completions", json=chat("quick question"), headers=headers)
            assert moved.status_code == 200 and (await long_turn).status_code == 200
        target = moved.headers["x-modelpool-instance"]
        assert target != host
        events = await store.read_stream(f"session:{ALIAS}/agent")
        assert [e.type for e in events] == ["SessionBound", "SessionMigrated"]
        assert events[1].payload["from_instance_id"] == host and events[1].payload["to_instance_id"] == target
        assert events[1].payload["reason"] == "host_hot"
        assert 'modelpool:session_migrations_total{alias="tiny",reason="host_hot"} 1' in await gateway.metrics()
    finally:
        for engine in slow:
            engine.stop()


async def test_an_idle_session_is_released_and_placed_anew(engines, facts, gateways, store):
    await facts.alias(router={**EAR, "session_idle_s": 0.5})
    await facts.running("v0", engines[SLOW][0], SLOW)
    await facts.route(R.VLLM_PRIMARY)
    gateway = await gateways.start()
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
        await client.post("/v1/chat/completions", json=chat("hi"), headers={"x-session-id": "idle"})
        for _ in range(100):
            if await session_events(store, "idle") == ["SessionBound", "SessionReleased"]:
                break
            await asyncio.sleep(0.05)
        assert await session_events(store, "idle") == ["SessionBound", "SessionReleased"]
        await gateway.caught_up()
        await client.post("/v1/chat/completions", json=chat("back"), headers={"x-session-id": "idle"})
    assert await session_events(store, "idle") == ["SessionBound", "SessionReleased", "SessionBound"]
