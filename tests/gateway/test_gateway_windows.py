"""Metric windows: exact time averages, numbers against a known load, and two replicas' windows merging."""

from __future__ import annotations

import asyncio
import collections
import json
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone

import httpx
import numpy as np
import pytest
from gateway_support import FAST, SLOW, EngineProcess, start_engine, wait_healthy

from services.gateway.sse import EventScanner
from shared.contracts.states import RoutingState as R
from shared.contracts.telemetry import GatewayWindow, LogHistogram, merge_windows
from shared.metering import AliasMeter, RequestOutcome, RequestTrace

STEADY = "steady"
STEP_S = 0.02
"""The steady engine's decode step: every request in the batch gets one token per step, whatever the batch."""


@pytest.fixture(scope="module")
def steady(tmp_path_factory) -> Iterator[EngineProcess]:
    """A llama.cpp-like engine in real time with a fixed step, so a request's length sets its duration."""
    engine = start_engine(tmp_path_factory.mktemp("steady"), "llama.cpp", STEADY, "--speedup", "1",
                          "--d-0", str(STEP_S), "--d-1", "0", "--parallel", "8")
    try:
        wait_healthy([engine])
        yield engine
    finally:
        engine.stop()


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_inflight_and_queue_are_exact_time_averages_and_carry_into_the_next_window():
    clock = FakeClock()
    meter = AliasMeter(clock)
    t0 = datetime(2026, 11, 23, tzinfo=timezone.utc)
    held = RequestTrace(meter, clock)
    meter.add_held(1)  # 0.0 .. 1.5 held
    a = RequestTrace(meter, clock)
    a.dispatched(FAST)  # 0.0 .. 1.5 on llama.cpp
    clock.now += 0.5
    b = RequestTrace(meter, clock)
    b.dispatched(FAST)  # 0.5 .. 2.5 on llama.cpp
    clock.now += 1.0
    a.content(1, clock.now)
    a.finished(RequestOutcome.OK, (10, 4))
    meter.add_held(-1)
    held.dispatched(SLOW)  # 1.5 .. on vLLM
    clock.now += 0.5
    first = meter.close("g", "a", t0, t0 + timedelta(seconds=2))
    assert first.arrivals == 3 and first.requests_fast == 1 and first.decode_tokens == 4 and first.prefill_tokens == 10
    assert first.inflight_fast == pytest.approx((1.5 + 1.5) / 2.0)
    assert first.inflight_slow == pytest.approx(0.5 / 2.0)
    assert first.queue_len == pytest.approx(1.5 / 2.0) and first.held == 0
    assert first.inflight_peak == 2 and first.queue_wait_s.n == 3 and first.ttft_s.n == 1
    assert first.e2e_fast_s.n == 1 and first.e2e_fast_s.maximum == pytest.approx(1.5)

    clock.now += 0.5
    b.finished(RequestOutcome.ENGINE_ERROR, None)
    clock.now += 1.5
    second = meter.close("g", "a", t0 + timedelta(seconds=2), t0 + timedelta(seconds=4))
    assert second.arrivals == 0 and second.requests_fast == 1 and second.errors_fast == 1
    assert second.inflight_fast == pytest.approx(0.5 / 2.0) and second.inflight_slow == pytest.approx(1.0)
    assert second.inflight_peak == 2  # what was in flight when the window opened
    assert second.e2e_fast_s.n == 0  # an error has no end-to-end time


def test_the_event_scanner_counts_content_and_takes_out_usage_the_client_did_not_ask_for():
    stream = (b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'
              + b''.join(b'data: {"choices":[{"delta":{"content":"w%d"}}]}\n\n' % i for i in range(5))
              + b'data: {"choices":[{"delta":{},"finish_reason":"length"}]}\n\n'
              + b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":5,"total_tokens":12}}\n\n'
              + b'data: [DONE]\n\n')
    for keep in (False, True):
        scanner = EventScanner(keep_usage=keep)
        out, chunks = b"", 0
        for i in range(0, len(stream), 13):  # reads cut events anywhere
            events, n = scanner.feed(stream[i:i + 13])
            out, chunks = out + events, chunks + n
        rest, n = scanner.flush()
        out, chunks = out + rest, chunks + n
        assert chunks == 5 and scanner.usage == (7, 5)
        assert (b'"usage"' in out) is keep and out.endswith(b"data: [DONE]\n\n")
        assert out == stream if keep else out == stream.replace(stream[stream.index(b'data: {"choices":[],"usage"'):
                                                                      stream.index(b"data: [DONE]")], b"")


async def test_a_windows_numbers_match_a_known_load(steady, facts, gateways):
    await facts.alias(STEADY)
    await facts.running("s1", steady, FAST, alias=STEADY)
    await facts.route(R.FAST_ONLY, alias=STEADY)
    gateway = await gateways.start(metric_window_s=1.0)
    async with httpx.AsyncClient(timeout=30) as client:
        prompt = (await client.post(f"{steady.url}/v1/chat/completions", json={
            "model": STEADY, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 1})).json()["usage"]["prompt_tokens"]

    clients, duration_s = 4, 3.5
    lengths: list[int] = []
    e2e: list[float] = []
    spans: list[tuple[float, float]] = []  # wall-clock time each request was out, as its client saw it
    began = datetime.now(timezone.utc)
    stop_at = time.monotonic() + duration_s

    async def closed_loop(client: httpx.AsyncClient, n: int) -> None:
        i = 0
        while time.monotonic() < stop_at:
            tokens = 30 if (i + n) % 10 == 0 else 8  # one in ten is long: it sets the 95th percentile
            body = {"model": STEADY, "messages": [{"role": "user", "content": "hello"}], "max_tokens": tokens,
                    "ignore_eos": True, "stream": True}
            sent, sent_at = time.monotonic(), time.time()
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                text = "".join([line async for line in response.aiter_lines()])
            e2e.append(time.monotonic() - sent)
            spans.append((sent_at, time.time()))
            assert response.status_code == 200 and '"usage"' not in text and text.count('"content":"w') <= tokens
            lengths.append(tokens)
            i += 1

    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
        await asyncio.gather(*(closed_loop(client, n) for n in range(clients)))
    ended = datetime.now(timezone.utc)
    await asyncio.sleep(1.5)  # the last window closes and is published
    windows = await gateway.ctx.telemetry_bus.read_windows(began, alias=STEADY)

    n = len(lengths)
    assert sum(w.arrivals for w in windows) == n and sum(w.requests_fast for w in windows) == n
    assert sum(w.requests_slow + w.errors_fast + w.errors_slow + w.errors_gateway for w in windows) == 0
    assert sum(w.decode_tokens for w in windows) == sum(lengths)  # from the engine's usage, asked for by the gateway
    assert sum(w.prefill_tokens for w in windows) == n * prompt

    full = [w for w in windows if began <= w.window_start and w.window_end <= ended]
    assert len(full) >= 2
    for w in full:
        # The gateway counts a request from dispatch to its last byte, inside the client's own span
        # by the client's turnaround and a parse: the same average, a little less (more so on a busy machine).
        start, end = w.window_start.timestamp(), w.window_end.timestamp()
        seen = sum(max(0.0, min(b, end) - max(a, start)) for a, b in spans) / (end - start)
        assert seen - 0.25 <= w.inflight_fast <= seen + 0.02 and w.inflight_fast > 3, (w.inflight_fast, seen)
        assert w.inflight_peak == 4 and w.inflight_slow == 0 and w.queue_len == 0 and w.held == 0

    def merged(name: str) -> LogHistogram:
        return LogHistogram.merge(getattr(w, name) for w in windows)

    e2e_hist, ttft, tbt, queue_wait = merged("e2e_fast_s"), merged("ttft_s"), merged("tbt_s"), merged("queue_wait_s")
    assert e2e_hist.n == ttft.n == queue_wait.n == n
    # The gateway measures from arrival to its last byte; the client a little more on both ends.
    expected = float(np.quantile(e2e, 0.95))
    assert abs(e2e_hist.quantile(0.95) - expected) <= 0.05 * expected + 0.015, (e2e_hist.quantile(0.95), expected)
    assert 0 < tbt.n <= sum(lengths) - n
    assert STEP_S * 0.6 <= tbt.quantile(0.5) <= STEP_S * 2, tbt.quantile(0.5)  # one token per step
    assert queue_wait.quantile(0.95) < 0.05  # nothing is held: parse, pick, connect


async def test_two_replicas_windows_share_their_periods_and_merge(steady, facts, gateways):
    await facts.alias(STEADY)
    await facts.running("s1", steady, FAST, alias=STEADY)
    await facts.route(R.FAST_ONLY, alias=STEADY)
    one = await gateways.start(metric_window_s=1.0)
    two = await gateways.start(metric_window_s=1.0)
    began = datetime.now(timezone.utc)
    e2e: list[float] = []

    async def send(client: httpx.AsyncClient, tokens: int) -> None:
        sent = time.monotonic()
        response = await client.post("/v1/chat/completions", json={
            "model": STEADY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens, "ignore_eos": True})
        e2e.append(time.monotonic() - sent)
        assert response.status_code == 200

    async def shorts() -> None:  # replica one: quick answers only
        async with httpx.AsyncClient(base_url=one.url, timeout=30) as client:
            for _ in range(40):
                await send(client, 2)

    async def longs() -> None:  # replica two: slow answers only
        async with httpx.AsyncClient(base_url=two.url, timeout=30) as client:
            for _ in range(2):
                await asyncio.gather(*(send(client, 30) for _ in range(5)))

    await asyncio.gather(shorts(), longs())
    await asyncio.sleep(1.5)
    windows = await one.ctx.telemetry_bus.read_windows(began, alias=STEADY)  # both replicas were up by then
    periods: dict[datetime, list[GatewayWindow]] = collections.defaultdict(list)
    for w in windows:
        periods[w.window_start].append(w)
    # Both replicas publish a window for every period, load or not, with the same boundaries.
    assert all(sorted(w.gateway_id for w in group) == ["g1", "g2"] for group in periods.values()), periods
    merged = [merge_windows(group) for group in periods.values()]
    assert all(m.gateways == 2 for m in merged)
    assert sum(m.requests_fast for m in merged) == sum(m.arrivals for m in merged) == 50

    # Over the whole run, the 95th percentile of all 50 answers is a slow one (rank 48 > 40 quick
    # ones); the two replicas' own 95th percentiles, averaged, would say something in between.
    everything = LogHistogram.merge(w.e2e_fast_s for w in windows)
    own = [LogHistogram.merge(w.e2e_fast_s for w in windows if w.gateway_id == g).quantile(0.95) for g in ("g1", "g2")]
    expected = float(np.quantile(e2e, 0.95))
    assert abs(everything.quantile(0.95) - expected) <= 0.05 * expected + 0.015
    assert everything.quantile(0.95) > 1.4 * (own[0] + own[1]) / 2


async def test_engine_failures_count_against_their_backend_and_client_mistakes_do_not(tmp_path, facts, gateways):
    slow = start_engine(tmp_path, "vllm", STEADY, "--speedup", "10")
    fast = start_engine(tmp_path, "llama.cpp", STEADY, "--speedup", "1")
    try:
        wait_healthy([slow, fast])
        await facts.alias(STEADY)
        await facts.running("v1", slow, SLOW, alias=STEADY)
        await facts.running("f1", fast, FAST, alias=STEADY)
        await facts.route(R.VLLM_PRIMARY, alias=STEADY)
        gateway = await gateways.start(metric_window_s=1.0)
        began = datetime.now(timezone.utc)
        chat = {"model": STEADY, "messages": [{"role": "user", "content": "hi"}]}
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
            too_long = await client.post("/v1/chat/completions", json={**chat, "max_tokens": 10**7})
            assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
            # The log says RUNNING, the engine is asleep: it answers 503 itself.
            assert (await client.post(f"{slow.url}/sleep?level=1")).status_code == 200
            asleep = await client.post("/v1/chat/completions", json={**chat, "max_tokens": 2})
            assert asleep.status_code == 503 and asleep.json()["error"]["code"] == "engine_sleeping"

            await facts.route(R.FAST_ONLY, alias=STEADY)
            await gateway.caught_up()
            body = {**chat, "max_tokens": 500, "ignore_eos": True, "stream": True}
            async with client.stream("POST", "/v1/chat/completions", json=body) as stream:
                lines = stream.aiter_lines()
                async for line in lines:  # until the first token
                    if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                        break
                fast.proc.kill()  # the engine dies mid-stream
                rest = [line async for line in lines if line]
        error = [json.loads(line[6:]) for line in rest if line.startswith('data: {"error"')]
        assert error and error[0]["error"]["code"] == "stream_broken" and rest[-1] == "data: [DONE]"

        await asyncio.sleep(1.2)
        windows = await gateway.ctx.telemetry_bus.read_windows(began, alias=STEADY)
        assert sum(w.requests_slow for w in windows) == 2 and sum(w.errors_slow for w in windows) == 1
        assert sum(w.requests_fast for w in windows) == 1 and sum(w.errors_fast for w in windows) == 1
        assert sum(w.errors_gateway + w.timeouts_slow for w in windows) == 0
        assert sum(w.e2e_slow_s.n + w.e2e_fast_s.n for w in windows) == 0  # refusals and failures have no end-to-end time
        assert sum(w.decode_tokens for w in windows) >= 1  # counted from the chunks that did arrive
    finally:
        slow.stop()
        fast.stop()
