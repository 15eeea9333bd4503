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


def test_level_2_discards_weights_and_wakes_slower(sleepy) -> None:
    timings = {}
    for level in (1, 2):
        assert httpx.post(f"{sleepy.url}/sleep", params={"level": level}).status_code == 200
        memory = sleepy.status()["memory"]
        if level == 2:
            assert memory["cpu_bytes"] == 0
            assert sleepy.metrics()[
                'vllm:engine_sleep_state{engine="0",model_name="sim-test",sleep_state="discard_all"}'] == 1
        t = time.perf_counter()
        assert httpx.post(f"{sleepy.url}/wake_up", timeout=10).status_code == 200
        timings[level] = time.perf_counter() - t
    assert timings[2] >= 1.0
    assert timings[1] < timings[2] - 0.5


def test_sleep_lets_in_flight_requests_finish(sleepy) -> None:
    results: dict[str, object] = {}

    def long_request() -> None:
        results["response"] = chat(sleepy.url, max_tokens=250, ignore_eos=True)  # 250 x 4 ms batches

    worker = threading.Thread(target=long_request)
    worker.start()
    assert wait_for(lambda: sleepy.status()["requests"]["running"] == 1, timeout=3)
    assert httpx.post(f"{sleepy.url}/sleep?level=1", timeout=10).status_code == 200
    worker.join(timeout=10)
    response = results["response"]
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 250
    assert httpx.get(f"{sleepy.url}/is_sleeping").json()["is_sleeping"] is True


def test_sleep_and_wake_are_idempotent_and_validated(sleepy) -> None:
    assert httpx.post(f"{sleepy.url}/wake_up").status_code == 200  # already awake: no-op
    bad = httpx.post(f"{sleepy.url}/sleep?level=3")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "level"
    assert httpx.post(f"{sleepy.url}/sleep?level=x").status_code == 400
    assert httpx.post(f"{sleepy.url}/sleep?level=2").status_code == 200
    assert httpx.post(f"{sleepy.url}/sleep?level=2").status_code == 200
    assert httpx.get(f"{sleepy.url}/health").status_code == 200  # the server stays up while asleep
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
