"""Scale-down hands sessions over: a drained host's sessions move to the next host, with their KV, before it goes."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from gateway_support import ALIAS, FAST, SLOW, chat, events_are, pool_of, start_engine, start_llama_engine
from helpers import eventually, wait_healthy
from shared.contracts.backends import EngineKind
from shared.contracts.states import InstanceState as S

CONTEXT = "the repository layout and its build files " * 40


async def first_turn(client: httpx.AsyncClient, session_id: str = "agent") -> httpx.Response:
    first = await client.post("/v1/chat/completions", json=chat(CONTEXT), headers={"x-session-id": session_id})
    assert first.status_code == 200, first.text
    return first


async def next_turn(client: httpx.AsyncClient, first: httpx.Response, session_id: str = "agent") -> httpx.Response:
    answer = first.json()["choices"][0]["message"]["content"]
    response = await client.post("/v1/chat/completions", json=chat(CONTEXT, answer, "now run the tests"),
                                 headers={"x-session-id": session_id})
    assert response.status_code == 200, response.text
    return response


async def handoff_of(store, session_id: str = "agent") -> dict:
    await eventually(lambda: events_are(store, session_id, ["SessionBound", "SessionMigrated"]), timeout=15)
    return (await store.read_stream(f"session:{ALIAS}/{session_id}"))[1].payload


@pytest.fixture
async def two_with_kv(tmp_path):
    """Two simulated engines with internal ports and prefix caching (the llama.cpp profile as modelpool's engine
    runs it: finished sequences stay cached)."""
    engines = [start_engine(tmp_path, "llama.cpp", ALIAS, "--prefix-caching", internal=True) for _ in range(2)]
    yield engines
    for engine in engines:
        engine.stop()


async def test_a_drained_hosts_sessions_move_to_the_next_host_with_their_kv_before_it_goes(
        two_with_kv, facts, gateways, store):
    gateway = await pool_of(two_with_kv, facts, gateways, {"plugin": "ear", "drain_handoff_s": 5}, FAST)
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as client:
        first = await first_turn(client)
        host = first.headers["x-modelpool-instance"]
        other = next(i for i in ("f0", "f1") if i != host)
        await facts.instance(host, FAST, S.DRAINING)  # as its worker records a drain
        moved = await handoff_of(store)
        assert (moved["from_instance_id"], moved["to_instance_id"], moved["reason"]) == (host, other, "drain")
        kv = moved["metrics"]
        assert kv["kv_moved"] == 1 and kv["kv_tokens"] >= 256 and kv["kv_move_s"] > 0, kv
        await gateway.caught_up()
        following = await next_turn(client, first)
    assert following.headers["x-modelpool-instance"] == other
    assert following.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= kv["kv_tokens"]
    metrics = await gateway.metrics()
    assert 'modelpool:session_migrations_total{alias="tiny",reason="drain"} 1' in metrics
    assert 'modelpool:session_kv_moves_total{alias="tiny",outcome="moved"} 1' in metrics


async def test_a_scale_in_spreads_the_drained_hosts_sessions_over_the_hosts_left(facts, gateways, store, tmp_path):
    engines = [start_engine(tmp_path, "llama.cpp", ALIAS, "--prefix-caching", internal=True) for _ in range(3)]
    try:
        gateway = await pool_of(engines[:1], facts, gateways, {"plugin": "ear"}, FAST)
        sessions = [f"agent-{i}" for i in range(4)]
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as client:
            for session_id in sessions:  # all on f0, the only instance yet
                await first_turn(client, session_id)
            wait_healthy(engines[1:])
            for i, engine in enumerate(engines[1:], 1):
                await facts.running(f"f{i}", engine, FAST)
            await facts.instance("f0", FAST, S.DRAINING)
            handoffs = [await handoff_of(store, session_id) for session_id in sessions]
        # By load alone all four would go to the same idle host and evict each other's KV there.
        assert sorted(h["to_instance_id"] for h in handoffs) == ["f1", "f1", "f2", "f2"]
        assert all(h["metrics"]["kv_moved"] == 1 for h in handoffs)
    finally:
        for engine in engines:
            engine.stop()


async def test_without_a_handoff_the_drained_hosts_session_recomputes_at_its_next_turn(
        two_with_kv, facts, gateways, store):
    gateway = await pool_of(two_with_kv, facts, gateways, {"plugin": "ear", "drain_handoff_s": 0}, FAST)
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as client:
        first = await first_turn(client)
        host = first.headers["x-modelpool-instance"]
        await eventually(lambda: events_are(store, "agent", ["SessionBound"]))  # written behind the answer
        await facts.instance(host, FAST, S.DRAINING, S.DELETING, S.ABSENT)  # deleted at once: nothing waited for it
        await gateway.caught_up()
        await asyncio.sleep(0.5)
        assert await events_are(store, "agent", ["SessionBound"])  # nobody handed it over
        following = await next_turn(client, first)
    moved = (await store.read_stream(f"session:{ALIAS}/agent"))[1].payload
    assert moved["reason"] == "host_gone" and moved["metrics"]["kv_moved"] == 0
    assert following.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_a_host_gone_to_sleep_hands_its_sessions_over_without_kv(facts, gateways, store, tmp_path):
    engines = [start_engine(tmp_path, "vllm", ALIAS, internal=True) for _ in range(2)]
    try:
        gateway = await pool_of(engines, facts, gateways, {"plugin": "affinity"}, SLOW)
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as client:
            first = await first_turn(client)
            host = first.headers["x-modelpool-instance"]
            await facts.instance(host, SLOW, S.SLEEP_1)
            moved = await handoff_of(store)
            assert moved["reason"] == "drain" and moved["to_instance_id"] != host
            assert moved["metrics"]["kv_moved"] == 0  # vLLM in sleep mode keeps no KV
            await gateway.caught_up()
            following = await next_turn(client, first)
        assert following.headers["x-modelpool-instance"] == moved["to_instance_id"]
    finally:
        for engine in engines:
            engine.stop()


async def test_on_real_llama_cpp_engines_a_drained_hosts_session_continues_from_its_moved_kv(
        facts, gateways, store, tmp_path):
    real = [start_llama_engine(tmp_path, ALIAS) for _ in range(2)]
    try:
        gateway = await pool_of(real, facts, gateways, {"plugin": "ear"}, FAST, EngineKind.LLAMA_CPP)
        context = "Summarise what the build files and the test suite of this repository do. " * 6
        headers = {"x-session-id": "agent"}
        async with httpx.AsyncClient(base_url=gateway.url, timeout=120) as client:
            first = await client.post("/v1/chat/completions", json=chat(context, max_tokens=8, temperature=0),
                                      headers=headers)
            assert first.status_code == 200, first.text
            host = first.headers["x-modelpool-instance"]
            await facts.instance(host, FAST, S.DRAINING)
            kv = (await handoff_of(store))["metrics"]
            assert kv["kv_moved"] == 1 and kv["kv_bytes"] > 0, kv
            await gateway.caught_up()
            answer = first.json()["choices"][0]["message"]["content"]
            following = await client.post(
                "/v1/chat/completions", json=chat(context, answer, "Now list the tests.", max_tokens=8, temperature=0),
                headers=headers)
        assert following.status_code == 200 and following.headers["x-modelpool-instance"] != host
        # Turn 1's whole context came along: the next turn computes only what is new.
        assert following.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= \
            first.json()["usage"]["prompt_tokens"]
    finally:
        for engine in real:
            engine.stop()
