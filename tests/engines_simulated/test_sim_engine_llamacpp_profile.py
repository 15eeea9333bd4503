"""The llama.cpp profile: /health 503 while loading, parallel slots, /slots, llamacpp: metrics."""

from __future__ import annotations

import threading
import time

import httpx
import openai
from sim_engine_support import chat, start_engine, wait_for


def test_health_is_503_while_loading_then_200() -> None:
    running = start_engine("llama.cpp", startup_s=0.5)
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


def test_slots_limit_concurrency_and_metrics_use_llamacpp_names() -> None:
    running = start_engine("llama.cpp", max_num_seqs=2, d_0=0.01)
    try:
        results: list[int] = []
        workers = [
            threading.Thread(target=lambda: results.append(chat(running.url, max_tokens=40).status_code))
            for _ in range(5)
        ]
        for w in workers:
            w.start()
        assert wait_for(lambda: running.metrics().get("llamacpp:requests_deferred") == 3, timeout=3)
        slots = httpx.get(f"{running.url}/slots").json()
        assert len(slots) == 2
        assert [s["is_processing"] for s in slots] == [True, True]
        assert slots[0]["n_ctx"] == running.config.kv_tokens // 2
        for w in workers:
            w.join(timeout=10)
        assert results == [200] * 5
        m = running.metrics()
        assert m["llamacpp:tokens_predicted_total"] == 5 * 40
        assert m["llamacpp:requests_deferred"] == 0 and m["llamacpp:requests_processing"] == 0
        assert m["llamacpp:n_decode_total"] >= 40 * 5 / 2
        assert m["llamacpp:prompt_tokens_total"] > 0
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
