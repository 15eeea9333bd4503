"""llama.cpp's own `llama-server` as the fast tier's engine, on the real binary and model, through the whole pool:
a cold wave held and answered (streams included), bursts past its HTTP threads answered, and a client that goes
away stops its generation."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from helpers import eventually
from scenario import Requests, one

POOL = """
aliases:
  - alias: smol
    backends:
      llama.cpp: {model_name: SmolLM2-135M-Instruct, model_path: default, gpu_memory_gb: 0, min_replicas: 0,
                  max_replicas: 1, engine: llama-server, engine_args: {parallel: 4, ctx-size: 8192}}
"""


async def test_llama_server_serves_a_cold_wave_and_stops_generating_for_a_client_gone(local_pool, store):
    pool = local_pool(POOL)
    tally = Requests()
    timeout = httpx.Timeout(connect=10.0, read=120.0, write=10.0, pool=None)
    async with httpx.AsyncClient(base_url=pool.gateway, timeout=timeout) as client:
        await asyncio.gather(*(one(client, "smol", tally, stream=n % 2 == 0, max_tokens=12) for n in range(4)))
        assert (tally.sent, tally.answered, tally.lost) == (4, 4, 0), tally
        assert set(tally.served_by) == {"llama.cpp"} and len(tally.instances) == 1  # the fast tier (its backend)
        response = await client.post("/chat/completions", json={
            "model": "smol", "max_tokens": 8, "messages": [{"role": "user", "content": "Say hi."}]})
        assert response.status_code == 200 and response.headers["x-modelpool-engine"] == "llama-server"
        assert response.json()["choices"][0]["message"]["content"]

        # More streams than the server has HTTP threads, twice over (connections reused): every one answered.
        burst = Requests()
        for _ in range(2):
            await asyncio.gather(*(one(client, "smol", burst, stream=True, max_tokens=8) for _ in range(16)))
        assert (burst.sent, burst.answered) == (32, 32), burst

        (running,) = [e for e in await store.history("smol")
                      if e.type == "InstanceStateChanged" and e.payload["to_state"] == "RUNNING"]
        endpoint = running.payload["endpoint"]
        async with httpx.AsyncClient(base_url=endpoint, timeout=10) as engine:
            slots = (await engine.get("/slots")).json()
            assert len(slots) == 4  # the alias's `parallel`, read by the worker as the instance's capacity

            # A long stream, left after its first tokens: the engine must stop decoding it.
            body = {"model": "smol", "max_tokens": 2000, "stream": True, "ignore_eos": True,
                    "messages": [{"role": "user", "content": "Count to ten thousand."}]}
            async with client.stream("POST", "/chat/completions", json=body) as stream:
                chunks = 0
                async for line in stream.aiter_lines():
                    chunks += line.startswith("data: {")
                    if chunks >= 5:
                        break
            left_at = time.monotonic()

            async def idle() -> bool:
                return not any(s["is_processing"] for s in (await engine.get("/slots")).json())

            await eventually(idle, timeout=10, interval=0.1)
            stopped_after = time.monotonic() - left_at
            generated = tokens_predicted(await engine.get("/metrics"))
            await asyncio.sleep(1.0)
            assert tokens_predicted(await engine.get("/metrics")) == generated  # nothing decodes for nobody
    assert stopped_after < 5  # 2000 tokens would take far longer: it stopped, it did not finish


def tokens_predicted(metrics: httpx.Response) -> float:
    for line in metrics.text.splitlines():
        if line.startswith("llamacpp:tokens_predicted_total"):
            return float(line.split()[-1])
    raise AssertionError(f"no llamacpp:tokens_predicted_total in {json.dumps(metrics.text[:300])}")
