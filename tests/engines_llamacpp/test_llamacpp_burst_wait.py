"""An idle engine waits for the rest of a burst only while bursts are what it sees: a lone stream never waits."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from llamacpp_helpers import chat
from services.engines.llamacpp.burst_wait import BurstWait
from services.engines.llamacpp.http_app import REQUEST_ID_HEADER


def test_the_wait_is_armed_by_company_and_disarmed_by_a_lone_start() -> None:
    gate = BurstWait(0.005)
    assert gate.wait_s(10.001, [10.0]) == pytest.approx(0.004)  # at first it waits: a cold start's wave
    gate.started([10.0])  # nobody came
    assert gate.wait_s(11.0, [11.0]) == 0.0  # so the next lone request goes at once
    gate.started([11.0])
    gate.arrived(11.002, busy=False)  # the next came within the window but after the first was answered: no company
    assert not gate.expecting
    gate.arrived(11.003, busy=True)  # ... and then another came within the window, while the first decoded
    assert gate.wait_s(12.0, [12.0]) == 0.005
    gate.started([12.0, 12.004])  # gathered: company again, the wait stays armed
    assert gate.expecting
    gate.arrived(12.5, busy=True)  # far outside the window of that start: not its company
    gate.started([13.0])
    assert gate.wait_s(13.0, [13.0]) == 0.0
    assert BurstWait(0.0).wait_s(0.0, [0.0]) == 0.0  # a window of 0 never waits


def _first_prefill_steps(engine: Any, request_ids: list[int]) -> list[set[int]]:
    """The requests prefilled in each step that prefilled any of `request_ids`, in step order."""
    steps = []
    for step in engine.step_log:
        prefilled = {rid for _, rid, _, kind in step.seqs if kind == "prefill" and rid in request_ids}
        if prefilled:
            steps.append(prefilled)
    return steps


def test_a_lone_stream_never_waits_and_spread_out_bursts_after_a_burst_start_together(make_server: Any) -> None:
    window_s = 1.0  # long enough that a wait, or its absence, stands out from any CI machine's noise
    server = make_server(admission_wait_ms=window_s * 1000)

    async def one(client: httpx.AsyncClient, words: str, delay_s: float = 0.0) -> tuple[int, float]:
        await asyncio.sleep(delay_s)
        t0 = time.perf_counter()
        r = await client.post("/v1/chat/completions", json=chat(server.alias, words, max_tokens=12, logit_bias={"2": -100}))
        assert r.status_code == 200, r.text
        return int(r.headers[REQUEST_ID_HEADER]), time.perf_counter() - t0

    async def spread_burst(client: httpx.AsyncClient, tag: str) -> list[int]:
        answers = await asyncio.gather(*(one(client, f"{tag} {i}: name a colour.", delay_s=0.1 * i) for i in range(4)))
        return [rid for rid, _ in answers]

    async def run() -> tuple[list[float], list[int], list[int]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            lone = [(await one(client, f"Lone request {i}: say hi."))[1] for i in range(3)]
            first = await spread_burst(client, "First burst")
            second = await spread_burst(client, "Second burst")
            return lone, first, second

    lone, first_burst, second_burst = asyncio.run(run())
    # A fresh engine waits the window for company once; none came, so the next lone requests go at once.
    assert lone[0] >= window_s, lone
    assert max(lone[1:]) < window_s, lone
    # The first spread-out burst found the engine expecting no one: its first request went alone ...
    assert _first_prefill_steps(server.engine, first_burst)[0] == {first_burst[0]}
    # ... and its company (within the window of that start) armed the wait: the second burst, 300 ms from first
    # arrival to last, was gathered into one prefill step.
    assert _first_prefill_steps(server.engine, second_burst)[0] == set(second_burst)
