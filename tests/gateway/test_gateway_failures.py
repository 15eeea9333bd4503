"""Failures never hang a client: a retry only before the first byte, errors in the stream, 502, timeouts."""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import openai
import pytest
from gateway_support import ALIAS, FAST, SLOW, start_engine, wait_healthy
from test_gateway_admission import LONG, engine_running, pool
from test_gateway_holds import CHAT, metric

from helpers import eventually
from shared.contracts.states import InstanceState as I, RoutingState as R
from shared.prometheus import parse_samples


async def prompt_tokens(client: httpx.AsyncClient, url: str) -> float:
    """Prefill tokens an engine has processed: more than 0 once any request reached it."""
    text = (await client.get(f"{url}/metrics")).text
    return next(s.value for s in parse_samples(text) if s.name == "vllm:prompt_tokens_total" or s.name == "vllm:prompt_tokens")


def kill(engine) -> None:
    os.killpg(engine.proc.pid, signal.SIGKILL)
    engine.proc.wait()


async def test_an_engine_503_is_retried_once_on_another_instance_of_the_same_backend_only(tmp_path, facts, gateways):
    asleep, awake, other_tier = (start_engine(tmp_path, "vllm", ALIAS, "--speedup", "10") for _ in range(3))
    try:
        wait_healthy([asleep, awake, other_tier])
        async with httpx.AsyncClient(timeout=30) as client:
            assert (await client.post(f"{asleep.url}/sleep", params={"level": 1})).status_code == 200
            await facts.alias()
            # The log still says RUNNING (the worker has not reported the sleep yet): the engine answers 503.
            await facts.running("v-asleep", asleep, SLOW)
            await facts.running("v-awake", awake, SLOW)
            await facts.route(R.VLLM_PRIMARY)
            gateway = await gateways.start()
            answers = [await client.post(f"{gateway.url}/v1/chat/completions", json=CHAT) for _ in range(12)]
            assert [a.status_code for a in answers] == [200] * 12
            assert {a.headers["x-modelpool-instance"] for a in answers} == {"v-awake"}
            retried = metric(await gateway.metrics(), "modelpool:retries_total", alias=ALIAS, backend="vllm",
                             reason="unavailable")
            assert 1 <= retried <= 12
            # The answers that were sent again say so, after why they went to the instance that served them.
            routes = [a.headers["x-modelpool-route"] for a in answers]
            assert sum(route.endswith("; retry after 503") for route in routes) == retried
            assert all(route.startswith("vllm v-awake; ") for route in routes)

            # Alone in its tier, the sleeping instance's 503 reaches the client: never sent to the other backend.
            await facts.running("f-other", other_tier, FAST)
            await facts.instance("v-awake", SLOW, I.DRAINING)
            await gateway.caught_up()
            refused = await client.post(f"{gateway.url}/v1/chat/completions", json=CHAT)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_sleeping"
            assert refused.headers["x-modelpool-backend"] == "vllm"
            assert await prompt_tokens(client, other_tier.url) == 0
    finally:
        for engine in (asleep, awake, other_tier):
            engine.stop()


async def test_an_engine_dying_mid_stream_is_carried_on_by_another_instance_else_ends_with_an_error_event(
        tmp_path, facts, gateways):
    dying, spare, last = (start_engine(tmp_path, "vllm", ALIAS, "--speedup", "1") for _ in range(3))
    long_stream = dict(model=ALIAS, messages=[{"role": "user", "content": "go"}], max_tokens=2000, stream=True,
                       extra_body={"ignore_eos": True})
    try:
        wait_healthy([dying, spare, last])
        await facts.alias()
        await facts.running("v-dying", dying, SLOW)
        await facts.route(R.VLLM_PRIMARY)
        gateway = await gateways.start()
        sdk = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
        received = []
        try:
            # Another instance of the backend takes the rest of the stream: the client reads one whole answer.
            stream = await sdk.chat.completions.create(**long_stream, stream_options={"include_usage": True})
            async for chunk in stream:
                received.append(chunk)
                if len(received) == 1:  # the stream is on v-dying; from now on it has somewhere to go
                    await facts.running("v-spare", spare, SLOW)
                    await gateway.caught_up()
                if len(received) == 3:
                    kill(dying)
            content = [c for c in received if c.choices and c.choices[0].delta.content]
            assert len(content) == 2000 and received[-2].choices[0].finish_reason == "length"
            assert {c.id for c in received} == {received[0].id}  # one stream, as the client sees it
            assert [c.choices[0].delta.role for c in received if c.choices and c.choices[0].delta.role] == ["assistant"]
            assert received[-1].usage.completion_tokens == 2000
            async with httpx.AsyncClient(timeout=10) as client:
                assert await prompt_tokens(client, spare.url) > 2  # it was given the text so far to go on from

            # Alone in its backend, a dying instance's stream ends with an error event the SDK raises.
            received.clear()
            await facts.instance("v-spare", SLOW, I.DRAINING)
            await facts.instance("v-dying", SLOW, I.ERROR)
            await facts.running("v-last", last, SLOW)
            await gateway.caught_up()
            stream = await sdk.chat.completions.create(**long_stream)
            with pytest.raises(openai.APIError) as raised:
                async for chunk in stream:
                    received.append(chunk)
                    if len(received) == 3:
                        kill(last)
        finally:
            await sdk.close()
        assert len(received) >= 3 and "stream" in raised.value.message
        text = await gateway.metrics()
        assert metric(text, "modelpool:retries_total", alias=ALIAS, backend="vllm", reason="resumed") == 1
        assert metric(text, "modelpool:requests_total", alias=ALIAS, backend="vllm", outcome="engine_error") == 1
        assert metric(text, "modelpool:requests_total", alias=ALIAS, backend="vllm", outcome="ok") == 1
    finally:
        for engine in (dying, spare, last):
            engine.stop()


async def test_a_whole_answer_broken_midway_is_a_502_and_a_silent_engine_times_out(tmp_path, facts, gateways):
    dying = start_engine(tmp_path, "vllm", ALIAS, "--speedup", "1")
    try:
        wait_healthy([dying])
        await facts.alias()
        await facts.running("v1", dying, SLOW)
        await facts.route(R.VLLM_PRIMARY)
        gateway = await gateways.start(pool(read_timeout_s=0.5))
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
            # 1.2 s of generation before the engine sends a byte: past the read timeout.
            silent = await client.post("/v1/chat/completions", json=LONG)
            assert silent.status_code == 502 and silent.json()["error"]["code"] == "instance_failed"
            assert "went silent past its timeout" in silent.json()["error"]["message"]

            async def stopped() -> bool:
                return await engine_running(client, dying.url) == 0
            await eventually(stopped, timeout=2)  # the gateway hung up, so the engine stopped

            # A stream's chunks come faster than the timeout: served whole.
            stream = await client.post("/v1/chat/completions", json={**LONG, "stream": True})
            assert stream.status_code == 200 and stream.text.rstrip().endswith("data: [DONE]")
            assert '"error"' not in stream.text

        gateway = await gateways.start()
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
            whole = asyncio.create_task(client.post("/v1/chat/completions", json={**LONG, "max_tokens": 400}))
            await asyncio.sleep(0.5)
            kill(dying)
            broken = await whole
        assert broken.status_code == 502
        error = broken.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == "instance_failed"
        port = dying.url.rsplit(":", 1)[1]
        for answer in (silent, broken):  # what failed is named; where the engine listens is not
            assert port not in answer.text and "127.0.0.1" not in answer.text, answer.text
    finally:
        dying.stop()


async def test_a_stream_whose_instance_is_silent_past_the_first_byte_timeout_is_answered_by_another(
        tmp_path, facts, gateways):
    hung, healthy = (start_engine(tmp_path, "vllm", ALIAS, "--speedup", "10") for _ in range(2))
    try:
        wait_healthy([hung, healthy])
        await facts.alias(router={"plugin": "round-robin"})
        await facts.running("v-hung", hung, SLOW)
        await facts.running("v-healthy", healthy, SLOW)
        await facts.route(R.VLLM_PRIMARY)
        gateway = await gateways.start(pool(first_byte_timeout_s=1.0))
        os.killpg(hung.proc.pid, signal.SIGSTOP)  # accepts connections (the kernel does), answers nothing
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
            answers = []
            for _ in range(4):  # round-robin: every other one is sent to the silent instance first
                began = asyncio.get_running_loop().time()
                answer = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
                answers.append((answer, asyncio.get_running_loop().time() - began))
        assert all(a.status_code == 200 and a.text.rstrip().endswith("data: [DONE]") for a, _ in answers)
        assert {a.headers["x-modelpool-instance"] for a, _ in answers} == {"v-healthy"}
        assert max(seconds for _, seconds in answers) < 1.0 + 3  # the timeout, then the other instance's answer
        assert metric(await gateway.metrics(), "modelpool:retries_total", alias=ALIAS, backend="vllm",
                      reason="broke") >= 1
    finally:
        os.killpg(hung.proc.pid, signal.SIGCONT)
        for engine in (hung, healthy):
            engine.stop()


async def test_requests_waiting_on_an_instance_the_log_gives_up_are_sent_to_another_at_once(tmp_path, facts, gateways):
    """A worker cut off by a partition: its engine takes connections and answers nothing, whole answers and streams
    wait on it with no timeout near. Once the log records the instance ERROR (the worker lost), they are
    withdrawn from it and answered by another instance, long before any timeout."""
    cut_off, healthy = (start_engine(tmp_path, "vllm", ALIAS, "--speedup", "10") for _ in range(2))
    try:
        wait_healthy([cut_off, healthy])
        await facts.alias(router={"plugin": "round-robin"})
        await facts.running("v-cut-off", cut_off, SLOW)
        await facts.running("v-healthy", healthy, SLOW)
        await facts.route(R.VLLM_PRIMARY)
        gateway = await gateways.start()  # the defaults: 60 s to a stream's first byte, 600 s of silence
        os.killpg(cut_off.proc.pid, signal.SIGSTOP)
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as client:
            began = asyncio.get_running_loop().time()
            # Round robin: of each pair, one is sent to the cut-off instance first.
            requests = [asyncio.create_task(client.post("/v1/chat/completions", json={**CHAT, "stream": stream}))
                        for stream in (False, False, True, True)]
            await asyncio.sleep(1.0)
            assert sum(not r.done() for r in requests) == 2, "two requests wait on the cut-off instance"
            await facts.instance("v-cut-off", SLOW, I.ERROR)
            answers = await asyncio.gather(*requests)
            took = asyncio.get_running_loop().time() - began
        assert [a.status_code for a in answers] == [200] * 4
        assert {a.headers["x-modelpool-instance"] for a in answers} == {"v-healthy"}
        assert answers[2].text.rstrip().endswith("data: [DONE]") and answers[3].text.rstrip().endswith("data: [DONE]")
        assert took < 10, f"{took:.1f} s: waited out a timeout instead of moving on"
        assert metric(await gateway.metrics(), "modelpool:retries_total", alias=ALIAS, backend="vllm",
                      reason="withdrawn") == 2
    finally:
        os.killpg(cut_off.proc.pid, signal.SIGCONT)
        for engine in (cut_off, healthy):
            engine.stop()
