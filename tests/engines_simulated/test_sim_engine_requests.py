"""Disconnects free memory, bad requests get OpenAI-style errors, timing follows the decode model."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from sim_engine_support import chat, start_engine, wait_for

RUNNING = "vllm:num_requests_running"
KV = "vllm:kv_cache_usage_perc"


def test_stream_disconnect_stops_generation_and_frees_memory(engine) -> None:
    before = engine.metrics()["vllm:generation_tokens_total"]
    body = {"model": "sim-test", "messages": [{"role": "user", "content": "long story " * 50}],
            "max_tokens": 20000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{engine.url}/v1/chat/completions", json=body, timeout=10) as r:
        lines = r.iter_lines()
        seen = [next(lines) for _ in range(10)]
        assert all(line.startswith("data: ") or line == "" for line in seen)
        during = engine.metrics()
        assert during[RUNNING] == 1 and during[KV] > 0
    # the client is gone: the request leaves the decode system and its KV memory is released
    assert wait_for(lambda: engine.metrics()[RUNNING] == 0, timeout=3)
    after = engine.metrics()
    assert after[KV] == 0
    assert engine.status()["kv_cache"]["used_tokens"] == 0
    aborted = after['vllm:request_success_total{engine="0",model_name="sim-test",finished_reason="abort"}']
    assert aborted >= 1
    generated = after["vllm:generation_tokens_total"] - before
    time.sleep(0.1)
    assert engine.metrics()["vllm:generation_tokens_total"] - before == generated  # nothing more decoded
    assert generated < 2000


def test_non_streaming_disconnect_frees_memory(engine) -> None:
    with pytest.raises(httpx.ReadTimeout):
        chat(engine.url, max_tokens=20000, ignore_eos=True, timeout=0.3)
    assert wait_for(lambda: engine.metrics()[RUNNING] == 0, timeout=3)
    assert engine.metrics()[KV] == 0


@pytest.mark.parametrize(
    ("body", "status", "code", "param"),
    [
        ({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, 404, "model_not_found", "model"),
        ({"model": "sim-test", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40000}, 400,
         "context_length_exceeded", "messages"),
        ({"model": "sim-test", "messages": [{"role": "user", "content": "word " * 40000}]}, 400,
         "context_length_exceeded", "messages"),
        ({"model": "sim-test", "messages": [{"role": "user", "content": "hi"}], "temperature": 9}, 400, None,
         "temperature"),
        ({"model": "sim-test", "messages": []}, 400, None, "messages"),
        ({"model": "sim-test", "messages": [{"role": "user", "content": "hi"}], "n": 500}, 400, None, "n"),
        ({"model": "sim-test", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, None,
         "max_tokens"),
        ({"model": "sim-test", "messages": [{"role": "user", "content": "hi"}],
          "stream_options": {"include_usage": True}}, 400, None, None),
    ],
)
def test_invalid_requests_get_openai_errors(engine, body, status, code, param) -> None:
    r = httpx.post(f"{engine.url}/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == status
    error = r.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    assert error["code"] == code
    if param is not None:
        assert error["param"] == param
    assert r.headers["x-modelpool-engine"] == "simulated-vllm"


def test_malformed_json_and_empty_prompt(engine) -> None:
    r = httpx.post(f"{engine.url}/v1/completions", content=b"{not json", timeout=5,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{engine.url}/v1/completions", json={"model": "sim-test", "prompt": ""}, timeout=5)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_token_id_prompt_counts_ids(engine) -> None:
    r = httpx.post(f"{engine.url}/v1/completions", timeout=5,
                   json={"model": "sim-test", "prompt": list(range(37)), "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 37


@pytest.mark.parametrize(("d_0", "speedup"), [(0.02, 1.0), (0.2, 10.0)])
def test_tokens_arrive_at_the_decode_model_pace(d_0: float, speedup: float) -> None:
    """20 tokens of one request take 20 batches of d_0 (+ d_1 per token), divided by the speed-up."""
    running = start_engine(d_0=d_0, d_1=0.0, speedup=speedup)
    try:
        arrivals = []
        with httpx.stream("POST", f"{running.url}/v1/completions", timeout=10, json={
            "model": "sim-test", "prompt": "x", "max_tokens": 21, "ignore_eos": True, "stream": True,
        }) as r:
            for line in r.iter_lines():
                if line.startswith('data: {') and '"text":""' not in line:
                    arrivals.append(time.perf_counter())
        assert len(arrivals) == 21
        per_token = (arrivals[-1] - arrivals[0]) / 20
        assert 0.016 <= per_token <= 0.035, per_token  # scheduled: 0.02 s
    finally:
        running.stop()


@pytest.mark.parametrize("mode", ["swap", "sacrifice"])
async def test_memory_pressure_preempts_but_every_token_arrives_once(mode: str) -> None:
    running = start_engine(kv_cache_tokens=400, max_model_len=400, preemption_mode=mode,
                           enable_prefix_caching=False)
    try:
        async with httpx.AsyncClient(base_url=running.url, timeout=30) as client:
            async def one(i: int) -> list[str]:
                body = {"model": "sim-test", "prompt": f"request {i} " * 8, "max_tokens": 120,
                        "ignore_eos": True, "stream": True, "seed": i}
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    return [line async for line in r.aiter_lines() if line.startswith("data: {")]

            streams = await asyncio.gather(*[one(i) for i in range(8)])
        for events in streams:
            tokens = [e for e in events if '"finish_reason"' not in e]
            assert len(tokens) == 120  # a sacrificed request recomputes silently: no repeats
        metrics = running.metrics()
        assert metrics["vllm:num_preemptions_total"] > 0
        assert metrics["vllm:generation_tokens_total"] == 8 * 120
        assert metrics[KV] == 0
    finally:
        running.stop()


def test_a_failing_decode_loop_fails_requests_instead_of_hanging() -> None:
    running = start_engine()
    try:
        def broken_step(now: float):
            raise RuntimeError("injected fault")

        running.server.driver.system.step = broken_step  # type: ignore[method-assign]
        first = chat(running.url, timeout=5)
        assert first.status_code == 500 and "injected fault" in first.json()["error"]["message"]
        second = chat(running.url, timeout=5)
        assert second.status_code == 500 and "decode loop failed" in second.json()["error"]["message"]
    finally:
        running.stop()
