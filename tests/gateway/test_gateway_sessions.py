"""Sessions: identified, bound in the log once, followed by every replica, moved off a hot host, released when idle."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from gateway_support import (ALIAS, FAST, SLOW, all_recorded, chat, events_are, pool_of, session_events,
                             start_engine, start_llama_engine)
from helpers import eventually
from shared.contracts.backends import EngineKind
from shared.contracts.states import RoutingState as R

EAR = {"plugin": "ear", "t_hot_tokens": 400, "t_cool_s": 30, "recompute_budget": None}
"""Moves recompute whatever they save more wait than: these tests move sessions off hot hosts from the first turn."""


async def turn_off_a_hot_host(client: httpx.AsyncClient, first_turn: dict, next_turn, long_words: int = 2000):
    """A session's first turn; then, while a long turn of the same session keeps its host in prefill (over
    T_hot), its next turn (`next_turn(first answer)`). Both answers, the next one's status checked."""
    headers = {"x-session-id": "agent"}
    first = await client.post("/v1/chat/completions", json=first_turn, headers=headers)
    assert first.status_code == 200, first.text
    long_turn = asyncio.create_task(client.post("/v1/chat/completions", json=chat("word " * long_words),
                                                headers=headers))
    await asyncio.sleep(0.3)
    moved = await client.post("/v1/chat/completions", json=next_turn(first.json()["choices"][0]["message"]["content"]),
                              headers=headers)
    assert moved.status_code == 200 and (await long_turn).status_code == 200, moved.text
    return first, moved


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
        # One write, for the first request only (written behind the request: awaited, then checked once more).
        await eventually(lambda: events_are(store, "s1", ["SessionBound"]), timeout=10)
        assert await session_events(store, "s1") == ["SessionBound"]

        # Without a header: the OpenAI `user` field, else the system prompt and first user turn.
        for later in ("", " and more"):
            await client.post("/v1/chat/completions", json=chat("hi" + later, user="bob"))
            await client.post("/v1/chat/completions", json=chat("task: sort a list", "ok", "next" + later,
                                                              system="you are a coder"))
    await eventually(lambda: events_are(store, "user:bob", ["SessionBound"]), timeout=5)  # written behind the requests

    async def prefixed():
        return [e for e in await store.of_type("SessionBound") if "/prefix:" in e.payload["session_id"]]

    await eventually(prefixed, timeout=5)
    assert len(await prefixed()) == 1


async def test_two_replicas_binding_the_same_new_sessions_at_once_end_with_one_binding_each(two_vllm, gateways, store):
    first, second = await gateways.start(), await gateways.start()
    async with httpx.AsyncClient(timeout=30) as client:

        async def both(session: str) -> set[str]:
            answers = await asyncio.gather(*(client.post(f"{g.url}/v1/chat/completions", json=chat("race"),
                                                         headers={"x-session-id": session}) for g in (first, second)))
            assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
            return {a.headers["x-modelpool-instance"] for a in answers}

        # The first requests go where each replica chose (bindings are written behind the requests)...
        await asyncio.gather(*(both(f"race-{i}") for i in range(20)))

        await eventually(lambda: all_recorded(store, [f"race-{i}" for i in range(20)]), timeout=10)
        for i in range(20):
            assert await session_events(store, f"race-{i}") == ["SessionBound"]  # one binding won
        await first.caught_up()
        await second.caught_up()
        # ...and from then on the loser follows the winner.
        placed = await asyncio.gather(*(both(f"race-{i}") for i in range(20)))
    assert all(len(hosts) == 1 for hosts in placed), placed
    bound = {e.payload["session_id"]: e.payload["instance_id"] for e in await store.of_type("SessionBound")}
    assert all(hosts == {bound[f"{ALIAS}/race-{i}"]} for i, hosts in enumerate(placed))


async def test_a_hot_host_moves_the_session_to_a_less_loaded_instance_and_the_move_is_recorded(facts, gateways, store,
                                                                                              tmp_path):
    # Prefill slow enough (4 ms a token) that a long prompt keeps its host hot for a while.
    slow = [start_engine(tmp_path, "vllm", ALIAS, "--d-1", "0.004") for _ in range(2)]
    try:
        gateway = await pool_of(slow, facts, gateways, EAR)
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as client:
            first, moved = await turn_off_a_hot_host(client, chat("start"), lambda _: chat("quick question"))
        host, target = first.headers["x-modelpool-instance"], moved.headers["x-modelpool-instance"]
        assert target != host
        events = await store.read_stream(f"session:{ALIAS}/agent")
        assert [e.type for e in events] == ["SessionBound", "SessionMigrated"]
        assert events[1].payload["from_instance_id"] == host and events[1].payload["to_instance_id"] == target
        assert events[1].payload["reason"] == "host_hot"
        assert events[1].payload["metrics"]["kv_moved"] == 0  # engines without an internal port: recompute
        assert 'modelpool:session_migrations_total{alias="tiny",reason="host_hot"} 1' in await gateway.metrics()
    finally:
        for engine in slow:
            engine.stop()


@pytest.mark.parametrize("move_kv", [True, False])
async def test_a_moved_session_takes_its_kv_along_and_its_next_turn_hits_the_cache_on_the_new_host(
        facts, gateways, store, tmp_path, move_kv):
    slow = [start_engine(tmp_path, "vllm", ALIAS, "--d-1", "0.004", internal=True) for _ in range(2)]
    try:
        gateway = await pool_of(slow, facts, gateways, {**EAR, "move_kv": move_kv})
        context = "the repository layout and its build files " * 40
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as client:
            first, moved = await turn_off_a_hot_host(
                client, chat(context), lambda answer: chat(context, answer, "now run the tests"))
        assert moved.headers["x-modelpool-instance"] != first.headers["x-modelpool-instance"]
        migrated = (await store.read_stream(f"session:{ALIAS}/agent"))[1]
        assert migrated.type == "SessionMigrated"
        kv, cached = migrated.payload["metrics"], moved.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        if move_kv:
            assert kv["kv_moved"] == 1 and kv["kv_tokens"] >= 256 and kv["kv_move_s"] > 0, kv
            assert kv["kv_bytes"] == kv["kv_tokens"] * 114_688  # the simulated engine's bytes per token
            assert cached >= kv["kv_tokens"]  # the next turn found the moved blocks on the new host
            assert 'modelpool:session_kv_moves_total{alias="tiny",outcome="moved"} 1' in await gateway.metrics()
        else:
            assert kv["kv_moved"] == 0 and cached == 0
    finally:
        for engine in slow:
            engine.stop()


async def test_on_real_llama_cpp_engines_a_moved_sessions_next_turn_is_served_from_the_moved_kv(
        facts, gateways, store, tmp_path):
    real = [start_llama_engine(tmp_path, ALIAS) for _ in range(2)]
    try:
        gateway = await pool_of(real, facts, gateways, {**EAR, "t_hot_tokens": 200}, FAST, EngineKind.LLAMA_CPP)
        context = "Summarise what the build files and the test suite of this repository do. " * 6
        async with httpx.AsyncClient(base_url=gateway.url, timeout=120) as client:
            # 700 words keep a CPU engine's host in prefill for a while.
            first, moved = await turn_off_a_hot_host(
                client, chat(context, max_tokens=8, temperature=0),
                lambda answer: chat(context, answer, "Now list the tests.", max_tokens=8, temperature=0), 700)
        assert moved.headers["x-modelpool-instance"] != first.headers["x-modelpool-instance"]
        assert moved.headers["x-modelpool-engine"] == "llama.cpp"
        kv = (await store.read_stream(f"session:{ALIAS}/agent"))[1].payload["metrics"]
        cached = moved.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        print(f"moved {kv['kv_tokens']:.0f} tokens ({kv['kv_bytes'] / 1e6:.1f} MB) in {kv['kv_move_s'] * 1000:.1f} ms; "
              f"the next turn on the new host: {cached} of {moved.json()['usage']['prompt_tokens']} prompt tokens cached")
        assert kv["kv_moved"] == 1 and kv["kv_bytes"] > 0
        assert cached >= first.json()["usage"]["prompt_tokens"]  # turn 1's context came along: not recomputed
    finally:
        for engine in real:
            engine.stop()


async def test_an_idle_session_is_released_and_placed_anew(engines, facts, gateways, store):
    await facts.alias(router={**EAR, "session_idle_s": 0.5})
    await facts.running("v0", engines[SLOW][0], SLOW)
    await facts.route(R.VLLM_PRIMARY)
    gateway = await gateways.start()
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
        await client.post("/v1/chat/completions", json=chat("hi"), headers={"x-session-id": "idle"})
        await eventually(lambda: events_are(store, "idle", ["SessionBound", "SessionReleased"]), timeout=5)
        await gateway.caught_up()
        await client.post("/v1/chat/completions", json=chat("back"), headers={"x-session-id": "idle"})
    await eventually(lambda: events_are(store, "idle", ["SessionBound", "SessionReleased", "SessionBound"]), timeout=5)
