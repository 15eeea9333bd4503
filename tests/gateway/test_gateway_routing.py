"""Routing: the gateway follows the log's routing state and mix weight, balances by its own count, retries a refused connection."""

from __future__ import annotations

import asyncio
import collections
import json
from datetime import datetime, timedelta, timezone

import httpx
import openai

from gateway_support import ALIAS, FAST, SLOW
from shared.contracts.states import InstanceState as I, RoutingState as R
from shared.net import free_port

CHAT = {"model": ALIAS, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 1}


async def test_a_mix_weight_of_a_half_splits_traffic_and_a_step_is_followed_within_a_window(engines, facts, gateways):
    await facts.alias()
    await facts.running("f1", engines[FAST][0], FAST)
    await facts.running("v1", engines[SLOW][0], SLOW)
    await facts.route(R.FAST_ONLY, R.WARMING_VLLM, R.MIXED, mix_weight=0.5)
    gateway = await gateways.start(metric_window_s=1.0)

    backends: collections.Counter[str] = collections.Counter()
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
        gate = asyncio.Semaphore(8)

        async def one() -> None:
            async with gate:
                response = await client.post("/v1/chat/completions", json=CHAT)
                assert response.status_code == 200, response.text
                backends[response.headers["x-modelpool-backend"]] += 1
                assert response.headers["x-modelpool-route"].endswith("; mix: vllm step 50 %")

        await asyncio.gather(*(one() for _ in range(200)))
        # Binomial(200, 0.5): 4 standard deviations either side.
        assert 72 <= backends["vllm"] <= 128 and backends["vllm"] + backends["llama.cpp"] == 200, backends

        await facts.mix(1.0)
        recorded = asyncio.get_running_loop().time()
        await gateway.caught_up()
        assert asyncio.get_running_loop().time() - recorded < 1.0, "mix step not followed within one window"
        tail = [(await client.post("/v1/chat/completions", json=CHAT)).headers["x-modelpool-backend"] for _ in range(20)]
        assert set(tail) == {"vllm"}


async def test_a_stream_stays_on_its_instance_while_routing_moves_away(engines, facts, gateways):
    await facts.alias()
    for i, engine in enumerate(engines[SLOW]):
        await facts.running(f"v{i}", engine, SLOW)
    await facts.running("f1", engines[FAST][0], FAST)
    await facts.route(R.VLLM_PRIMARY)
    gateway = await gateways.start()

    body = {**CHAT, "max_tokens": 200, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
        async with client.stream("POST", "/v1/chat/completions", json=body) as stream:
            instance = stream.headers["x-modelpool-instance"]
            lines = stream.aiter_lines()
            first = await anext(lines)
            # Routing moves to llama.cpp and the stream's instance starts draining, mid-stream.
            await facts.route(R.FAST_ONLY)
            await facts.instance(instance, SLOW, I.DRAINING)
            await gateway.caught_up()
            moved = await client.post("/v1/chat/completions", json=CHAT)
            assert moved.headers["x-modelpool-instance"] == "f1"
            events = [line for line in [first] + [line async for line in lines] if line]
    chunks = [json.loads(line[6:]) for line in events if line.startswith("data: {")]
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}  # one answer, from one engine
    assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")) == 200
    assert events[-1] == "data: [DONE]"
    assert not any("usage" in c for c in chunks)  # asked for by the gateway, taken out again


async def test_requests_go_to_the_instance_with_fewest_in_flight_and_a_refused_connection_is_retried(engines, facts, gateways):
    await facts.alias()
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there: every connection is refused
    await facts.instance("v-dead", SLOW, I.STARTING, I.RUNNING, endpoint=dead)
    await facts.running("v1", engines[SLOW][0], SLOW)
    await facts.running("v2", engines[SLOW][1], SLOW)
    await facts.route(R.VLLM_PRIMARY)
    gateway = await gateways.start(metric_window_s=1.0)
    since = datetime.now(timezone.utc)

    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
        # Two long streams in flight: the next ones avoid their instances.
        body = {**CHAT, "max_tokens": 2000, "ignore_eos": True, "stream": True}
        async with client.stream("POST", "/v1/chat/completions", json=body) as one, \
                client.stream("POST", "/v1/chat/completions", json=body) as two:
            busy = {one.headers["x-modelpool-instance"], two.headers["x-modelpool-instance"]}
            assert busy == {"v1", "v2"}  # the dead one refused; the retry went to the idle live one
            served = [await client.post("/v1/chat/completions", json=CHAT) for _ in range(30)]
            await one.aclose()
            await two.aclose()
    assert all(r.status_code == 200 for r in served)
    picked = collections.Counter(r.headers["x-modelpool-instance"] for r in served)
    assert set(picked) <= {"v1", "v2"} and sum(picked.values()) == 30

    await asyncio.sleep(1.2)
    windows = await gateway.ctx.telemetry_bus.read_windows(since - timedelta(seconds=2), alias=ALIAS)
    timeouts = sum(w.timeouts_slow for w in windows)
    # With a stream on each live instance, the dead one has the fewest in flight and is tried
    # first for each of the 30: every refusal is counted, and none of them became an error.
    assert timeouts >= 30 and sum(w.errors_slow for w in windows) == 0
    assert sum(w.requests_slow for w in windows) == 32


async def test_the_openai_sdk_works_through_the_gateway(engines, facts, gateways):
    await facts.alias()
    await facts.running("f1", engines[FAST][0], FAST)
    await facts.route(R.FAST_ONLY)
    gateway = await gateways.start()
    sdk = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
    try:
        raw = await sdk.chat.completions.with_raw_response.create(
            model=ALIAS, messages=[{"role": "user", "content": "Say hello"}], max_tokens=8)
        completion = raw.parse()
        assert completion.choices[0].message.content and 0 < completion.usage.completion_tokens <= 8
        assert raw.headers["x-modelpool-engine"] == "simulated-llama.cpp" and raw.headers["x-modelpool-instance"] == "f1"

        stream = await sdk.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": "Count"}],
                                                   max_tokens=6, stream=True, stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6  # asked for: kept

        text = await sdk.completions.create(model=ALIAS, prompt="Once upon", max_tokens=4)
        assert text.choices[0].text

        unknown = None
        try:
            await sdk.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
        except openai.NotFoundError as exc:
            unknown = exc
        assert unknown is not None and unknown.body["param"] == "model"
    finally:
        await sdk.close()


async def test_two_replicas_behind_one_address_route_the_same_way_and_share_only_the_log(engines, facts, gateways):
    await facts.alias()
    await facts.running("f1", engines[FAST][0], FAST, capacity=2)
    await facts.running("v1", engines[SLOW][0], SLOW)
    await facts.route(R.FAST_ONLY)
    replicas = [await gateways.start(), await gateways.start()]
    async with httpx.AsyncClient(timeout=30) as client:
        async def through_the_address(n: int) -> list[tuple[str, str]]:
            """`n` requests, round-robin over the replicas as a load balancer in front of them would send them."""
            sent = []
            for i in range(n):
                replica = replicas[i % 2]
                response = await client.post(f"{replica.url}/v1/chat/completions", json=CHAT)
                assert response.status_code == 200, response.text
                sent.append((replica.url, response.headers["x-modelpool-backend"]))
            return sent

        fast = await through_the_address(10)
        await facts.route(R.WARMING_VLLM, R.MIXED, R.VLLM_PRIMARY, mix_weight=1.0)
        for replica in replicas:
            await replica.caught_up()
        slow = await through_the_address(10)

        # Each replica admits up to the instance's capacity on its own count: two each, four at once.
        await facts.route(R.FAST_ONLY)
        for replica in replicas:
            await replica.caught_up()
        held = [asyncio.create_task(client.post(f"{r.url}/v1/chat/completions", json={**CHAT, "max_tokens": 400,
                                                                                         "ignore_eos": True}))
                for r in replicas for _ in range(3)]
        await asyncio.sleep(0.2)
        waiting = [metric_of(await replica.metrics(), "modelpool:num_requests_waiting") for replica in replicas]
        await asyncio.gather(*held)
    assert {backend for _, backend in fast} == {"llama.cpp"} and {url for url, _ in fast} == {r.url for r in replicas}
    assert {backend for _, backend in slow} == {"vllm"}
    assert waiting == [1, 1]


def metric_of(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))
