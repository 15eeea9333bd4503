"""A shared prefix pulled across instances: a new session placed by load on an instance that lacks its prompt's
opening (a tool description other sessions sent elsewhere) gets it from the instance holding it, over the engines'
KV ports, instead of computing it again; where the holder will not hand it out, it is computed, and the request is
served either way."""

from __future__ import annotations

import asyncio
import re

import httpx

from gateway_support import ALIAS, FAST, chat, pool_of, start_engine, start_llama_engine
from shared.contracts.backends import EngineKind

TOOLS = "tool run_tests: runs the suite and reports each failure with its file and line. " * 60
EAR_PULLING = {"plugin": "ear", "t_hot_tokens": 400, "t_cool_s": 30, "pull_prefix": True}


async def a_second_session_while_the_first_keeps_its_host_busy(client: httpx.AsyncClient, tools: str,
                                                              long_words: int = 2000, **extra):
    """Session a opens with the tools; while a long turn of a keeps its host in prefill, session b opens with the
    same tools. a's first answer and b's."""
    first = await client.post("/v1/chat/completions", json=chat("fix the build", system=tools, **extra),
                              headers={"x-session-id": "a"})
    assert first.status_code == 200, first.text
    busy = asyncio.create_task(client.post("/v1/chat/completions", json=chat("word " * long_words, system="other"),
                                           headers={"x-session-id": "a"}))
    await asyncio.sleep(0.3)
    second = await client.post("/v1/chat/completions", json=chat("add a test", system=tools, **extra),
                               headers={"x-session-id": "b"})
    assert second.status_code == 200 and (await busy).status_code == 200, second.text
    return first, second


async def test_a_new_session_placed_by_load_pulls_the_shared_prefix_from_the_instance_holding_it(
        facts, gateways, tmp_path):
    slow = [start_engine(tmp_path, "vllm", ALIAS, "--d-1", "0.004", internal=True) for _ in range(2)]
    try:
        gateway = await pool_of(slow, facts, gateways, EAR_PULLING)
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as client:
            first, second = await a_second_session_while_the_first_keeps_its_host_busy(client, TOOLS)
        assert second.headers["x-modelpool-instance"] != first.headers["x-modelpool-instance"]
        assert "pulled" in second.headers["x-modelpool-route"], second.headers["x-modelpool-route"]
        shared = first.json()["usage"]["prompt_tokens"] - 8  # the tools, less the first user turn's few tokens
        assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= shared * 0.9
        metrics = await gateway.metrics()
        assert 'modelpool:prefix_pulls_total{alias="tiny",outcome="pulled"} 1' in metrics
        # The pull's wait is counted: at least the simulated link's transfer of what was pulled.
        waited = re.search(r'modelpool:prefix_pull_seconds_total\{alias="tiny",outcome="pulled"\} ([0-9.]+)', metrics)
        assert waited is not None and float(waited.group(1)) > 0, metrics
    finally:
        for engine in slow:
            engine.stop()


async def test_a_holder_that_hands_out_only_its_own_sessions_kv_leaves_the_prefix_to_be_computed(
        facts, gateways, tmp_path):
    # llama.cpp's engine exports a session's own KV only: the pull is refused, counted, and the request served.
    real = [start_llama_engine(tmp_path, ALIAS) for _ in range(2)]
    try:
        gateway = await pool_of(real, facts, gateways, {**EAR_PULLING, "t_hot_tokens": 200}, FAST,
                                EngineKind.LLAMA_CPP)
        tools = "Tool run_tests runs the suite and reports each failure. " * 60  # over a block (512 tokens)
        async with httpx.AsyncClient(base_url=gateway.url, timeout=120) as client:
            first, second = await a_second_session_while_the_first_keeps_its_host_busy(
                client, tools, 700, max_tokens=4, temperature=0)  # 700 words keep a CPU engine busy a while
        assert second.headers["x-modelpool-instance"] != first.headers["x-modelpool-instance"]
        assert 'modelpool:prefix_pulls_total{alias="tiny",outcome="recomputed"} 1' in await gateway.metrics()
        assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        for engine in real:
            engine.stop()
