"""Scale from zero on real llama.cpp: the first wave is held, one instance starts, everyone is answered."""

from __future__ import annotations

import asyncio

import httpx

from scenario import Requests, history, one

POOL = """
aliases:
  - alias: smol
    backends:
      llama.cpp: {model_name: SmolLM2-135M-Instruct, model_path: default, gpu_memory_gb: 0, min_replicas: 0, max_replicas: 2}
"""


async def test_a_cold_wave_on_real_llamacpp_is_answered_and_starts_one_instance(local_pool, store):
    pool = local_pool(POOL)
    tally = Requests()
    timeout = httpx.Timeout(connect=10.0, read=120.0, write=10.0, pool=None)
    async with httpx.AsyncClient(base_url=pool.gateway, timeout=timeout) as client:
        wave = [one(client, "smol", tally, stream=n % 2 == 0, max_tokens=12) for n in range(6)]
        await asyncio.gather(*wave)
        assert (tally.sent, tally.answered, tally.lost) == (6, 6, 0), tally
        assert set(tally.served_by) == {"llama.cpp"} and len(tally.instances) == 1
        # ...and a real model answered: the real engine says so.
        response = await client.post("/chat/completions", json={
            "model": "smol", "max_tokens": 8, "messages": [{"role": "user", "content": "Say hi."}]})
        assert response.status_code == 200 and response.headers["x-modelpool-engine"] == "llama.cpp"
        assert response.json()["choices"][0]["message"]["content"]

    events = await history(store, "smol")
    types = [e.type for e in events]
    assert types.count("PlacementDecided") == 1  # six first requests, one start
    (switch,) = [e for e in events if e.type == "RoutingStateChanged"]
    assert switch.payload["from_state"] == "COLD" and switch.payload["to_state"] == "FAST_ONLY"

    async def cold_start():
        return [e for e in await history(store, "smol") if e.type == "ColdStartCompleted"]

    from helpers import eventually

    (cold,) = await eventually(cold_start, timeout=10)
    assert 0 < cold.payload["duration_s"] < 60
