"""Admission through the real gateway: capacity per instance, the queue in order, 429, 408, clients that leave."""

from __future__ import annotations

import asyncio
import time

import httpx
from gateway_support import ALIAS, SLOW, start_engine, wait_healthy
from test_gateway_holds import CHAT, metric

from helpers import eventually
from shared.contracts.config import PoolConfig
from shared.contracts.states import RoutingState as R
from shared.prometheus import parse_samples

# About 1.2 s on a simulated vLLM engine in real time (12 ms a token).
LONG = {**CHAT, "max_tokens": 100, "ignore_eos": True}


def pool(**gateway) -> PoolConfig:
    return PoolConfig.model_validate({"gateway": gateway})


async def engine_running(client: httpx.AsyncClient, url: str) -> int:
    text = (await client.get(f"{url}/metrics")).text
    return int(next(s.value for s in parse_samples(text) if s.name == "vllm:num_requests_running"))


async def serving_engine(tmp_path, facts, capacity: int | None):
    """One simulated vLLM engine in real time, the alias VLLM_PRIMARY on it with `capacity`."""
    engine = start_engine(tmp_path, "vllm", ALIAS, "--speedup", "1")
    wait_healthy([engine])
    await facts.alias()
    await facts.running("v1", engine, SLOW, capacity=capacity)
    await facts.route(R.VLLM_PRIMARY)
    return engine


async def test_an_instance_gets_its_capacity_and_the_rest_are_served_in_arrival_order(tmp_path, facts, gateways):
    engine = await serving_engine(tmp_path, facts, capacity=2)
    try:
        gateway = await gateways.start()
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
            first_content: dict[int, float] = {}
            finished: dict[int, float] = {}

            async def send(n: int) -> int:
                async with client.stream("POST", "/v1/chat/completions", json={**LONG, "stream": True}) as response:
                    async for line in response.aiter_lines():
                        if line.startswith('data: {"id"') and '"content":"' in line and n not in first_content:
                            first_content[n] = time.monotonic()
                    finished[n] = time.monotonic()
                    return response.status_code

            tasks = []
            for n in range(6):
                tasks.append(asyncio.create_task(send(n)))
                await asyncio.sleep(0.05)
            running, waiting = [], []
            while not all(t.done() for t in tasks):
                running.append(await engine_running(client, engine.url))
                waiting.append(metric(await gateway.metrics(), "modelpool:num_requests_waiting", alias=ALIAS))
                await asyncio.sleep(0.05)
            statuses = [t.result() for t in tasks]
    finally:
        engine.stop()
    assert statuses == [200] * 6
    assert max(running) == 2 and max(waiting) == 4  # the engine never saw more than its capacity
    order = sorted(first_content, key=first_content.get)
    assert order == list(range(6))  # served in the order they came
    # A freed slot goes to the next waiter at once: its first token follows the end of the one before by a prefill.
    assert first_content[2] - min(finished[0], finished[1]) < 0.3
    text = await gateway.metrics()
    assert metric(text, "modelpool:request_queue_time_seconds_count", alias=ALIAS, outcome="served") == 4


async def test_a_full_queue_answers_429_and_a_wait_past_the_queue_timeout_408(tmp_path, facts, gateways):
    engine = await serving_engine(tmp_path, facts, capacity=1)
    try:
        gateway = await gateways.start(pool(queue_size=1, queue_timeout_s=0.6))
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
            busy = asyncio.create_task(client.post("/v1/chat/completions", json={**LONG, "max_tokens": 250}))
            await asyncio.sleep(0.2)
            sent = time.monotonic()
            queued = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT))
            await asyncio.sleep(0.1)
            full = await client.post("/v1/chat/completions", json=CHAT)
            refused_after = time.monotonic() - sent
            timed_out = await queued
            waited = time.monotonic() - sent
            assert (await busy).status_code == 200
    finally:
        engine.stop()
    assert full.status_code == 429 and refused_after < 0.5
    assert int(full.headers["retry-after"]) >= 1
    error = full.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "rate_limit_error"
    assert "queue" in error["message"] and ALIAS in error["message"]

    assert timed_out.status_code == 408 and 0.55 < waited < 1.5
    assert timed_out.json()["error"]["code"] == "request_timeout"
    text = await gateway.metrics()
    assert metric(text, "modelpool:requests_total", alias=ALIAS, backend="none", outcome="queue_full", status="429") == 1
    assert metric(text, "modelpool:requests_total", alias=ALIAS, backend="none", outcome="queue_timeout", status="408") == 1
    assert metric(text, "modelpool:request_queue_time_seconds_count", alias=ALIAS, outcome="timeout") == 1


async def test_a_refused_client_keeps_its_connection_as_long_as_the_openai_sdk_would_reuse_it(facts, gateways):
    """An SDK sends its next request on an idle connection until its keep-alive expiry (httpx's 5 s); had the
    gateway closed the connection by then, a request meeting the close would be reset, unanswered."""
    await facts.alias()
    gateway = await gateways.start(pool(queue_size=0))  # nothing runs and nothing may wait: every request is a 429
    refused, connections = [], []
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30, limits=httpx.Limits(keepalive_expiry=60)) as client:
        for idle_s in (0, httpx.Limits().keepalive_expiry + 1):
            await asyncio.sleep(idle_s)
            refused.append(await client.post("/v1/chat/completions", json=CHAT))
            connections.append(refused[-1].extensions["network_stream"].get_extra_info("client_addr"))
    for response in refused:
        assert response.status_code == 429 and int(response.headers["retry-after"]) >= 1
        assert response.json()["error"]["code"] == "rate_limit_exceeded"
    assert connections[1] == connections[0]  # the same connection, still open


async def test_a_client_that_leaves_the_queue_gives_up_its_place(tmp_path, facts, gateways):
    engine = await serving_engine(tmp_path, facts, capacity=1)
    try:
        gateway = await gateways.start()
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
            busy = asyncio.create_task(client.post("/v1/chat/completions", json=LONG))
            await asyncio.sleep(0.2)
            try:
                await client.post("/v1/chat/completions", json=CHAT, timeout=0.3)
            except httpx.ReadTimeout:
                pass
            async def left() -> bool:
                return metric(await gateway.metrics(), "modelpool:num_requests_waiting", alias=ALIAS) == 0
            await eventually(left, timeout=2)
            after = await client.post("/v1/chat/completions", json=CHAT)  # next in line: served once `busy` ends
            assert after.status_code == 200 and (await busy).status_code == 200
    finally:
        engine.stop()
    text = await gateway.metrics()
    assert metric(text, "modelpool:request_queue_time_seconds_count", alias=ALIAS, outcome="left") == 1
    assert metric(text, "modelpool:requests_total", alias=ALIAS, backend="none", outcome="client_left") == 1


async def test_a_client_that_leaves_mid_answer_stops_the_simulated_engine(tmp_path, facts, gateways):
    engine = await serving_engine(tmp_path, facts, capacity=None)
    endless = {**LONG, "max_tokens": 3000}  # 36 s if nobody stopped it
    try:
        gateway = await gateways.start()
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
            async with client.stream("POST", "/v1/chat/completions", json={**endless, "stream": True}) as response:
                async for line in response.aiter_lines():
                    if '"content":"' in line:
                        break

            async def stopped() -> bool:
                return await engine_running(client, engine.url) == 0
            await eventually(stopped, timeout=2)

            whole = asyncio.create_task(client.post("/v1/chat/completions", json=endless))

            async def generating() -> bool:
                return await engine_running(client, engine.url) == 1
            await eventually(generating, timeout=2)
            whole.cancel()  # the client of a non-streamed answer hangs up while it is generated
            await eventually(stopped, timeout=2)
    finally:
        engine.stop()
