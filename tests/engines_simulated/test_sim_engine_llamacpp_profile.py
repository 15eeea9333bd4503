"""The llama.cpp profile: /health 503 while loading, parallel slots, /slots, llamacpp: metrics."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
from sim_engine_support import chat, start_engine, wait_for


def test_health_is_503_while_loading_then_200() -> None:
    running = start_engine("llama.cpp", startup_s=2.0)
    try:
        loading = httpx.get(f"{running.url}/health")
        assert loading.status_code == 503
        assert loading.json()["error"]["message"] == "Loading model"
        assert chat(running.url).status_code == 503
        assert wait_for(lambda: httpx.get(f"{running.url}/health").status_code == 200, timeout=5)
        assert httpx.get(f"{running.url}/health").json() == {"status": "ok"}
        r = chat(running.url)
        assert r.status_code == 200
        assert r.headers["x-modelpool-engine"] == "simulated-llama.cpp"
        assert r.json()["system_fingerprint"] == "simulated-llama.cpp"
    finally:
        running.stop()


async def test_slots_limit_concurrency_and_metrics_use_llamacpp_names() -> None:
    running = start_engine("llama.cpp", max_num_seqs=2, d_0=0.005)
    try:
        body = {"model": "sim-test", "prompt": "go", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        async with httpx.AsyncClient(base_url=running.url, timeout=10) as client:
            opened = [client.stream("POST", "/v1/completions", json=body) for _ in range(5)]
            responses = [await ctx.__aenter__() for ctx in opened]
            assert all(r.status_code == 200 for r in responses)
            assert await asyncio.to_thread(
                wait_for, lambda: running.metrics().get("llamacpp:requests_deferred") == 3, 3)
            m = running.metrics()
            assert m["llamacpp:requests_processing"] == 2
            slots = (await client.get("/slots")).json()
            assert len(slots) == 2
            assert [s["is_processing"] for s in slots] == [True, True]
            assert slots[0]["n_ctx"] == running.config.kv_tokens // 2
            for ctx in opened:
                await ctx.__aexit__(None, None, None)
        # the clients left: their requests are gone from the slots and from the queue
        assert wait_for(lambda: running.metrics()["llamacpp:requests_processing"] == 0, 3)
        m = running.metrics()
        assert m["llamacpp:requests_deferred"] == 0 and m["llamacpp:kv_cache_tokens"] == 0
        before = m["llamacpp:tokens_predicted_total"]
        assert [chat(running.url, max_tokens=7).status_code for _ in range(3)] == [200] * 3
        m = running.metrics()
        assert m["llamacpp:tokens_predicted_total"] - before == 3 * 7
        assert m["llamacpp:n_decode_total"] >= 7 and m["llamacpp:prompt_tokens_total"] > 0
        assert not any(name.startswith("vllm:") for name in m)
    finally:
        running.stop()


def test_no_sleep_mode_and_models_say_simulated() -> None:
    running = start_engine("llama.cpp")
    try:
        assert httpx.post(f"{running.url}/sleep?level=1").status_code == 404
        assert httpx.post(f"{running.url}/wake_up").status_code == 404
        card = httpx.get(f"{running.url}/v1/models").json()["data"][0]
        assert card["engine"] == "simulated-llama.cpp" and card["simulated"] is True
        sdk = openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0)
        t = time.perf_counter()
        chunks = list(sdk.chat.completions.create(
            model="sim-test", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True))
        assert time.perf_counter() - t < 5
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) == 3
    finally:
        running.stop()
