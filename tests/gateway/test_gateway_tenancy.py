"""Tenants at the front door: a saturated alias serves a light tenant's request at once, borrowing a slot while it
is below its share, ahead of a flooding tenant's backlog, where arrival order would have it wait for all of it."""

from __future__ import annotations

import asyncio
import time

import httpx
from gateway_support import FAST, ALIAS, start_engine, wait_healthy

from shared.contracts.states import RoutingState as R

KEYS = [{"key": "sk-flood", "tenant": "flood"}, {"key": "sk-light", "tenant": "light"}]
STEP_S = 0.02
TOKENS = 8  # a request holds its slot for about TOKENS x STEP_S


async def finishing_order(url: str, floods: int) -> list[str]:
    """`floods` requests of the flooding tenant at once, then one of the light tenant: who finished when."""
    done: list[str] = []

    async def send(client: httpx.AsyncClient, key: str, name: str) -> None:
        answer = await client.post("/v1/chat/completions", headers={"authorization": f"Bearer {key}"}, json={
            "model": ALIAS, "messages": [{"role": "user", "content": name}], "max_tokens": TOKENS})
        assert answer.status_code == 200, answer.text
        done.append(name)

    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        flood = [asyncio.create_task(send(client, "sk-flood", f"a{i}")) for i in range(floods)]
        await asyncio.sleep(0.3)  # the flood is queued behind the two slots
        await send(client, "sk-light", "b")
        await asyncio.gather(*flood)
    return done


async def test_a_light_tenant_is_served_ahead_of_a_flooding_ones_backlog(tmp_path, facts, gateways) -> None:
    engine = start_engine(tmp_path, "llama.cpp", ALIAS, "--speedup", "1", "--d-0", str(STEP_S), "--d-1", "0",
                          "--parallel", "2")
    try:
        wait_healthy([engine])
        await facts.alias()
        await facts.running("f1", engine, FAST, capacity=2)
        await facts.route(R.FAST_ONLY)
        fair = await gateways.start(tenant_keys=KEYS)
        started = time.monotonic()
        order = await finishing_order(fair.url, 30)
        ahead = order.index("b")
        assert ahead <= 6, order  # it went at once: past the two slots' capacity, below its share of them
        async with httpx.AsyncClient(base_url=fair.url) as client:
            metrics = (await client.get("/metrics")).text
        assert f'modelpool:slots_borrowed_total{{alias="{ALIAS}"}} 1' in metrics
        fifo = await gateways.start(tenant_keys=KEYS, queue_order="fifo")
        order = await finishing_order(fifo.url, 30)
        assert order.index("b") >= 26, order  # arrival order: behind the whole backlog
        print(f"fair: the light request finished {ahead}th; fifo: {order.index('b')}th "
              f"({time.monotonic() - started:.1f} s)")
        async with httpx.AsyncClient(base_url=fair.url) as client:
            refused = await client.post("/v1/chat/completions", headers={"authorization": "Bearer sk-other"},
                                        json={"model": ALIAS, "messages": [{"role": "user", "content": "x"}]})
        assert refused.status_code == 401
    finally:
        engine.stop()
