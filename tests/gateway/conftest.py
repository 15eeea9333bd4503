"""Fixtures of the gateway tests (the helpers they use are in gateway_support.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack

import pytest
import pytest_asyncio
from gateway_support import ALIAS, FAST, SLOW, EngineProcess, Facts, Gateways, start_engine, wait_healthy

from shared.contracts.backends import BackendType


@pytest.fixture(scope="session")
def engines(tmp_path_factory) -> Iterator[dict[BackendType, list[EngineProcess]]]:
    """Two llama.cpp-like and two vLLM-like simulated engines serving `tiny`, ten times faster than real time."""
    log_dir = tmp_path_factory.mktemp("engines")
    started = {FAST: [start_engine(log_dir, "llama.cpp", ALIAS, "--speedup", "10") for _ in range(2)],
               SLOW: [start_engine(log_dir, "vllm", ALIAS, "--speedup", "10") for _ in range(2)]}
    try:
        wait_healthy([*started[FAST], *started[SLOW]])
        yield started
    finally:
        for engine in (*started[FAST], *started[SLOW]):
            engine.stop()


@pytest.fixture
def facts(store) -> Facts:
    return Facts(store)


@pytest_asyncio.fixture
async def gateways(store, bus, settings) -> AsyncIterator[Gateways]:
    async with AsyncExitStack() as stack:
        running = Gateways(settings, store, stack)
        try:
            yield running
        finally:
            for gateway in running.started:
                gateway.ctx.stop.set()
            await asyncio.gather(*(g.task for g in running.started), *([running.relay_task] if running.relay_task else []))
