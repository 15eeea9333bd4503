"""Sleep mode as vLLM documents it: sleep -> is_sleeping -> refused -> wake_up -> served again."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
from sim_engine_support import chat, start_engine, wait_for

from services.engines.simulated.config import GIB


@pytest.fixture
def sleepy():
    running = start_engine(wake_l1_s=0.05, wake_l2_s=1.0, sleep_l1_s=0.02, sleep_l2_s=0.02)
    yield running
    running.stop()


def test_sleep_refuse_wake_serve(sleepy) -> None:
    sdk = openai.OpenAI(base_url=f"{sleepy.url}/v1", api_key="unused", max_retries=0)
    assert httpx.get(f"{sleepy.url}/is_sleeping").json() == {"is_sleeping": False}
    awake_memory = sleepy.status()["memory"]

    assert httpx.post(f"{sleepy.url}/sleep?level=1").status_code == 200
    assert httpx.get(f"{sleepy.url}/is_sleeping").json() == {"is_sleeping": True}
    with pytest.raises(openai.APIStatusError) as refused:
        sdk.chat.completions.create(model="sim-test", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert refused.value.status_code == 503
    assert "sleeping" in refused.value.message and "wake_up" in refused.value.message
    r = chat(sleepy.url, stream=True)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_sleeping"

    metrics = sleepy.metrics()
    assert metrics['vllm:engine_sleep_state{engine="0",model_name="sim-test",sleep_state="awake"}'] == 0
    assert metrics['vllm:engine_sleep_state{engine="0",model_name="sim-test",sleep_state="weights_offloaded"}'] == 1
    asleep_memory = sleepy.status()["memory"]
    weights = int(sleepy.config.weights_gib * GIB)
    assert asleep_memory["cpu_bytes"] == weights  # level 1 keeps the weights in CPU memory
    assert asleep_memory["gpu_bytes"] == int(sleepy.config.residual_gib * GIB)
    assert awake_memory["gpu_bytes"] > asleep_memory["gpu_bytes"] + weights

    assert httpx.post(f"{sleepy.url}/wake_up").status_code == 200
    assert httpx.get(f"{sleepy.url}/is_sleeping").json() == {"is_sleeping": False}
    assert sleepy.status()["memory"] == awake_memory
    out = sdk.chat.completions.create(model="sim-test", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert out.usage.completion_tokens == 2


def test_level_2_discards_weights_and_serves_only_after_they_are_reloaded(sleepy) -> None:
    assert httpx.post(f"{sleepy.url}/sleep", params={"level": 2}).status_code == 200
    assert sleepy.status()["memory"]["cpu_bytes"] == 0
    assert sleepy.metrics()['vllm:engine_sleep_state{engine="0",model_name="sim-test",sleep_state="discard_all"}'] == 1
    # A plain wake-up from level 2 remaps empty weights: a real vLLM would answer garbage, this one refuses.
    assert httpx.post(f"{sleepy.url}/wake_up", timeout=10).status_code == 200
    assert httpx.get(f"{sleepy.url}/is_sleeping").json() == {"is_sleeping": False}
    garbage = chat(sleepy.url)
    assert garbage.status_code == 500 and garbage.json()["error"]["code"] == "weights_not_loaded"

    assert httpx.post(f"{sleepy.url}/sleep", params={"level": 2}).status_code == 200
    started = time.perf_counter()
    assert httpx.post(f"{sleepy.url}/wake_up", params={"tags": "weights"}).status_code == 200
    assert httpx.get(f"{sleepy.url}/is_sleeping").json() == {"is_sleeping": True}  # the KV cache still sleeps
    assert chat(sleepy.url).status_code == 503
    reload = httpx.post(f"{sleepy.url}/collective_rpc", json={"method": "reload_weights"}, timeout=10)
    assert reload.status_code == 200 and reload.json() == {"results": [None]}
    assert httpx.post(f"{sleepy.url}/wake_up", params={"tags": "kv_cache"}).status_code == 200
    assert time.perf_counter() - started >= 1.0  # the reload takes the level-2 wake time (wake_l2_s)
    assert httpx.get(f"{sleepy.url}/is_sleeping").json() == {"is_sleeping": False}
    served = chat(sleepy.url)
    assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] > 0

    # Level 1 keeps the weights in CPU memory: one plain wake-up, and quicker.
    assert httpx.post(f"{sleepy.url}/sleep", params={"level": 1}).status_code == 200
    started = time.perf_counter()
    assert httpx.post(f"{sleepy.url}/wake_up", timeout=10).status_code == 200
    assert time.perf_counter() - started < 0.5
    assert chat(sleepy.url).status_code == 200


def test_sleep_waits_for_requests_under_way_only_when_told_to(sleepy) -> None:
    """vLLM's sleep aborts what runs (`mode=abort`, its default) unless asked to wait (`mode=wait`)."""
    for mode, status, tokens in (("wait", 200, 250), ("abort", 500, None)):
        results: dict[str, httpx.Response] = {}

        def long_request() -> None:
            results["response"] = chat(sleepy.url, max_tokens=250, ignore_eos=True)  # 250 x 4 ms batches

        worker = threading.Thread(target=long_request)
        worker.start()
        assert wait_for(lambda: sleepy.status()["requests"]["running"] == 1, timeout=3)
        assert httpx.post(f"{sleepy.url}/sleep", params={"level": 1, "mode": mode}, timeout=10).status_code == 200
        worker.join(timeout=10)
        response = results["response"]
        assert response.status_code == status, mode
        if tokens:
            assert response.json()["usage"]["completion_tokens"] == tokens
        else:
            assert "put to sleep" in response.json()["error"]["message"]
        assert httpx.get(f"{sleepy.url}/is_sleeping").json()["is_sleeping"] is True
        assert httpx.post(f"{sleepy.url}/wake_up", timeout=10).status_code == 200


def test_sleep_and_wake_are_idempotent_and_validated(sleepy) -> None:
    assert httpx.post(f"{sleepy.url}/wake_up").status_code == 200  # already awake: no-op
    bad = httpx.post(f"{sleepy.url}/sleep?level=3")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "level"
    assert httpx.post(f"{sleepy.url}/sleep?level=x").status_code == 400
    keep = httpx.post(f"{sleepy.url}/sleep?level=1&mode=keep")
    assert keep.status_code == 400 and keep.json()["error"]["param"] == "mode"
    assert httpx.post(f"{sleepy.url}/collective_rpc", json={"method": "shutdown"}).status_code == 400
    assert httpx.post(f"{sleepy.url}/collective_rpc", json={}).status_code == 400
    assert httpx.post(f"{sleepy.url}/collective_rpc", content=b"{not json").status_code == 400
    assert httpx.post(f"{sleepy.url}/sleep?level=2").status_code == 200
    assert httpx.post(f"{sleepy.url}/sleep?level=2").status_code == 200
    assert httpx.get(f"{sleepy.url}/health").status_code == 200  # the server stays up while asleep
    early = httpx.post(f"{sleepy.url}/collective_rpc", json={"method": "reload_weights"})
    assert early.status_code == 409 and "wake_up?tags=weights" in early.json()["error"]["message"]
    assert httpx.post(f"{sleepy.url}/wake_up", timeout=10).status_code == 200


def test_vllm_port_opens_only_after_the_cold_start() -> None:
    running = start_engine(wait=False, startup_s=0.6)
    try:
        time.sleep(0.2)
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{running.url}/health", timeout=1)
        deadline = time.time() + 5
        while time.time() < deadline:
            try:
                if httpx.get(f"{running.url}/health", timeout=1).status_code == 200:
                    break
            except httpx.ConnectError:
                time.sleep(0.05)
        else:
            pytest.fail("engine never became healthy")
    finally:
        running.stop()


def test_a_second_sleep_is_ignored_like_vllm(sleepy) -> None:
    assert httpx.post(f"{sleepy.url}/sleep?level=1").status_code == 200
    assert httpx.post(f"{sleepy.url}/sleep?level=2").status_code == 200
    status = sleepy.status()
    assert status["sleep_level"] == 1  # still level 1: the weights stay in CPU memory
    assert status["memory"]["cpu_bytes"] == int(sleepy.config.weights_gib * GIB)
    assert httpx.post(f"{sleepy.url}/wake_up", timeout=10).status_code == 200
    assert httpx.post(f"{sleepy.url}/sleep?level=2").status_code == 200
    assert sleepy.status()["sleep_level"] == 2
