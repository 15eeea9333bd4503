"""The engine's HTTP edge on the real model: limits, errors, cancellation, caching, OpenAI SDK."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import pytest

from llamacpp_helpers import RunningServer, chat
from services.engines.llamacpp.http_app import REQUEST_ID_HEADER, build_app

NO_EOG = {"0": -100, "2": -100}  # SmolLM2's end-of-generation tokens: forces long answers


def test_models_health_and_engine_header_say_llama_cpp(server: RunningServer) -> None:
    models = httpx.get(server.url + "/v1/models")
    assert models.status_code == 200 and models.headers["x-modelpool-engine"] == "llama.cpp"
    card = models.json()["data"][0]
    assert card["id"] == server.alias and card["owned_by"] == "llama.cpp" and card["engine"] == "llama.cpp"
    assert card["simulated"] is False
    health = httpx.get(server.url + "/health")
    assert health.status_code == 200 and health.json()["engine"] == "llama.cpp"
    missing = httpx.get(server.url + "/nope")
    assert missing.status_code == 404 and "error" in missing.json()
    assert missing.headers["x-modelpool-engine"] == "llama.cpp"


async def test_health_is_503_while_loading() -> None:
    from services.engines.llamacpp.engine import LlamaEngine
    from services.engines.llamacpp.settings import EngineSettings

    engine = LlamaEngine(EngineSettings.load({"threads": 2, "n_seq_max": 1}, env={}))
    app = build_app(engine, manage_engine=False)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine") as client:
        loading = await client.get("/health")
        assert loading.status_code == 503 and loading.json()["error"]["code"] == "loading"
        refused = await client.post("/v1/chat/completions", json=chat("smollm2-135m-instruct", "hi"))
        assert refused.status_code == 503
        engine.start()
        await asyncio.get_running_loop().run_in_executor(None, engine.wait_ready, 60)
        assert (await client.get("/health")).status_code == 200
    engine.stop()


def test_completion_usage_stop_sequence_and_metrics(server: RunningServer) -> None:
    body = {"model": server.alias, "prompt": "1, 2, 3, 4, 5,", "max_tokens": 12, "temperature": 0, "stop": [" 8"]}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "text_completion" and out["system_fingerprint"] == "llama.cpp"
    text = out["choices"][0]["text"]
    assert " 8" not in text and out["choices"][0]["finish_reason"] == "stop"
    assert text.startswith(" 6, 7,"), text
    assert out["usage"]["prompt_tokens"] > 0 and out["usage"]["completion_tokens"] > 0
    metrics = httpx.get(server.url + "/metrics").text
    for name in (
        "llamacpp:requests_processing", "llamacpp:requests_deferred", "llamacpp:prompt_tokens_total",
        "llamacpp:tokens_predicted_total", "llamacpp:prompt_tokens_reused_total", "llamacpp:kv_cache_usage_ratio",
        "llamacpp:time_to_first_token_seconds_bucket", "llamacpp:inter_token_latency_seconds_count",
        "llamacpp:requests_rejected_total", "llamacpp:requests_timeout_total",
    ):
        assert name in metrics, name


def test_streaming_equals_non_streaming_and_ends_with_done(server: RunningServer) -> None:
    # cache_prompt false: both runs compute the prompt alike, so greedy answers are bit-identical
    body = chat(server.alias, "Name three colours.", max_tokens=20, cache_prompt=False)
    whole = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
    pieces, lines = [], []
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line:
                lines.append(line)
    import json

    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    for c in chunks:
        for choice in c["choices"]:
            pieces.append(choice["delta"].get("content") or "")
    assert "".join(pieces) == whole["choices"][0]["message"]["content"]
    assert chunks[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]


def test_bad_requests_get_openai_errors(server: RunningServer) -> None:
    url = server.url + "/v1/chat/completions"
    r = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(url, json={"model": server.alias, "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(url, json=chat("no-such-model", "hi"))
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(url, json=chat(server.alias, "hi", logit_bias={"999999": 1}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"


def test_too_long_requests_get_400_naming_the_limit(server: RunningServer) -> None:
    url = server.url + "/v1/chat/completions"
    r = httpx.post(url, json=chat(server.alias, "word " * 1500, max_tokens=4))
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded"
    assert "over the input limit of 1024 tokens" in err["message"]
    r = httpx.post(url, json=chat(server.alias, "hi", max_tokens=5000))
    assert r.status_code == 400 and "over the output limit of 2048" in r.json()["error"]["message"]
    r = httpx.post(url, json=chat(server.alias, "word " * 900, max_tokens=1500))
    assert r.status_code == 400 and "over by" in r.json()["error"]["message"]


def test_queue_full_gets_429_with_retry_after(make_server) -> None:  # type: ignore[no-untyped-def]
    srv: RunningServer = make_server(n_seq_max=1, max_running=1, max_batch_size=1, max_queue=1)
    long_body = chat(srv.alias, "Tell me a long story.", max_tokens=900, logit_bias=NO_EOG, stream=True)

    async def run() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as client:
            async with client.stream("POST", "/v1/chat/completions", json=long_body) as first:
                assert first.status_code == 200
                lines = first.aiter_lines()
                await lines.__anext__()  # decoding: it holds the only running place
                second = asyncio.create_task(client.post("/v1/chat/completions", json=chat(srv.alias, "Hi.", max_tokens=2)))
                while srv.engine.status()["queued"] < 1:  # the second fills the queue
                    await asyncio.sleep(0.01)
                third = await client.post("/v1/chat/completions", json=chat(srv.alias, "Hi.", max_tokens=2))
            # leaving the stream disconnects the first request, which lets the queued one run
            return third, await second

    third, second = asyncio.run(run())
    assert third.status_code == 429
    assert int(third.headers["retry-after"]) >= 1
    assert third.json()["error"]["type"] == "rate_limit_error"
    assert second.status_code == 200  # the queued request is not lost
    assert srv.engine.metrics.rejected_429 == 1


def test_timeout_gets_408_and_frees_the_sequence(make_server) -> None:  # type: ignore[no-untyped-def]
    srv: RunningServer = make_server(n_seq_max=1, request_timeout_s=3.0, timeout_scan_interval_s=0.2)
    t0 = time.monotonic()
    r = httpx.post(srv.url + "/v1/chat/completions", json=chat(srv.alias, "Tell me a long story.", max_tokens=2000, logit_bias=NO_EOG), timeout=60)
    assert r.status_code == 408, r.text
    assert r.json()["error"]["code"] == "request_timeout"
    assert 3.0 <= time.monotonic() - t0 < 8
    slots = httpx.get(srv.url + "/slots").json()
    assert all(s["state"] == "free" and s["n_tokens"] == 0 for s in slots["slots"])
    assert srv.engine.metrics.timeouts_408 == 1
    ok = httpx.post(srv.url + "/v1/chat/completions", json=chat(srv.alias, "Say hi.", max_tokens=1), timeout=60)
    assert ok.status_code == 200  # the only sequence id is usable again


def test_engine_failure_gets_500_and_frees_the_sequence(make_server) -> None:  # type: ignore[no-untyped-def]
    from services.engines.llamacpp.llama_backend import DecodeError

    srv: RunningServer = make_server(n_seq_max=2)
    backend = srv.engine.backend
    real_decode = backend.decode
    calls = {"n": 0}

    def failing_decode(work):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 3:  # a few tokens in
            raise DecodeError("injected failure")
        return real_decode(work)

    backend.decode = failing_decode
    try:
        r = httpx.post(srv.url + "/v1/chat/completions", json=chat(srv.alias, "Tell me a story.", max_tokens=50, logit_bias=NO_EOG), timeout=60)
    finally:
        backend.decode = real_decode
    assert r.status_code == 500 and "injected failure" in r.json()["error"]["message"]
    assert all(s["state"] == "free" and s["n_tokens"] == 0 for s in httpx.get(srv.url + "/slots").json()["slots"])
    assert srv.engine.metrics.failures_500 == 1
    ok = httpx.post(srv.url + "/v1/chat/completions", json=chat(srv.alias, "Say hi.", max_tokens=3), timeout=60)
    assert ok.status_code == 200


def test_disconnect_mid_stream_frees_the_sequence_within_one_step(server: RunningServer) -> None:
    engine = server.engine
    cancel_marks: list[int] = []
    original_cancel = engine.cancel

    def spying_cancel(request_id: int) -> bool:
        cancel_marks.append(engine.step_log[-1].step_id)  # last step finished before the cancel
        return original_cancel(request_id)

    engine.cancel = spying_cancel  # type: ignore[method-assign]
    try:
        body = chat(server.alias, "Tell me a long story.", max_tokens=600, logit_bias=NO_EOG, stream=True)
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            request_id = int(r.headers[REQUEST_ID_HEADER])
            for n, _ in enumerate(r.iter_lines()):
                if n > 10:
                    break
        deadline = time.time() + 5
        while engine.request_state(request_id) is not None and time.time() < deadline:
            time.sleep(0.02)
        assert engine.request_state(request_id) is None
    finally:
        engine.cancel = original_cancel  # type: ignore[method-assign]
    assert cancel_marks, "the disconnect never reached the engine"
    steps_with_it = [s.step_id for s in engine.step_log if request_id in s.request_ids]
    # the step in flight at cancel time may still carry it; no later step does
    assert max(steps_with_it) <= cancel_marks[0] + 1
    assert all(s["request_id"] != request_id for s in engine.slots())
    assert engine.metrics.cancelled >= 1


def test_second_turn_reuses_the_cached_prefix_and_matches_the_uncached_answer(server: RunningServer, make_server) -> None:  # type: ignore[no-untyped-def]
    url = server.url + "/v1/chat/completions"
    # Well-conditioned questions: recomputing a prompt in other chunk sizes moves logits by
    # llama.cpp's batch-dependent rounding (about 1 logit here), which must not flip a confident answer.
    turn1 = [{"role": "user", "content": "What's the capital of Japan? Answer in one sentence."}]
    r1 = httpx.post(url, json={"model": server.alias, "messages": turn1, "temperature": 0, "max_tokens": 30}, timeout=60).json()
    turn2 = turn1 + [
        {"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
        {"role": "user", "content": "What's the capital of Germany? Answer in one sentence."},
    ]
    body2 = {"model": server.alias, "messages": turn2, "temperature": 0, "max_tokens": 30}
    r2 = httpx.post(url, json=body2, timeout=60).json()
    cached = r2["usage"]["prompt_tokens_details"]["cached_tokens"]
    # the whole first turn (prompt and answer) is reused, not just the shared system prompt
    assert cached >= r1["usage"]["prompt_tokens"] + r1["usage"]["completion_tokens"] - 1, (cached, r1["usage"])

    fresh = make_server(prefix_cache=False, n_seq_max=2)
    r2_uncached = httpx.post(fresh.url + "/v1/chat/completions", json=body2, timeout=60).json()
    assert r2_uncached["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert "Berlin" in r2["choices"][0]["message"]["content"]
    assert r2["choices"][0]["message"]["content"] == r2_uncached["choices"][0]["message"]["content"]
    assert "llamacpp:prompt_tokens_reused_total" in httpx.get(server.url + "/metrics").text


def test_an_evicted_conversation_comes_back_from_host_memory_with_the_same_answer(make_server) -> None:  # type: ignore[no-untyped-def]
    # One sequence id: every other prompt evicts the conversation from llama.cpp's KV.
    engine = make_server(n_seq_max=1, n_ctx=2048)
    url = engine.url + "/v1/chat/completions"
    turn1 = [{"role": "user", "content": "What's the capital of Japan? Answer in one sentence."}]
    r1 = httpx.post(url, json={"model": engine.alias, "messages": turn1, "temperature": 0, "max_tokens": 30}, timeout=60).json()
    other = httpx.post(url, json=chat(engine.alias, "Name three colours.", max_tokens=8), timeout=60).json()
    # It shares the chat template's opening with the conversation, nothing more, and takes its only sequence.
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] < r1["usage"]["prompt_tokens"] - 8
    turn2 = turn1 + [
        {"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
        {"role": "user", "content": "What's the capital of Germany? Answer in one sentence."},
    ]
    body2 = {"model": engine.alias, "messages": turn2, "temperature": 0, "max_tokens": 30}
    r2 = httpx.post(url, json=body2, timeout=60).json()
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] >= r1["usage"]["prompt_tokens"]
    metrics = httpx.get(engine.url + "/metrics").text
    assert re.search(r"llamacpp:prompt_cache_restores_total\{[^}]*\} [1-9]", metrics), metrics
    assert re.search(r"llamacpp:prompt_cache_bytes\{[^}]*\} [1-9]", metrics)
    without = make_server(n_seq_max=1, n_ctx=2048, prompt_cache_mb=0)
    recomputed = httpx.post(without.url + "/v1/chat/completions", json=body2, timeout=60).json()
    assert recomputed["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert r2["choices"][0]["message"]["content"] == recomputed["choices"][0]["message"]["content"]


def test_openai_sdk_streaming_and_not(server: RunningServer) -> None:
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == [server.alias]
    whole = client.chat.completions.create(
        model=server.alias,
        messages=[{"role": "user", "content": "What is the capital of Japan?"}],
        max_tokens=20,
        temperature=0,
        extra_body={"cache_prompt": False},
    )
    assert "Tokyo" in whole.choices[0].message.content and whole.usage.completion_tokens > 0
    stream = client.chat.completions.create(
        model=server.alias,
        messages=[{"role": "user", "content": "What is the capital of Japan?"}],
        max_tokens=20,
        temperature=0,
        stream=True,
        extra_body={"cache_prompt": False},
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == whole.choices[0].message.content
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=server.alias, prompt="x", max_tokens=99999)


def test_slots_report_each_sequence(server: RunningServer) -> None:
    body = httpx.get(server.url + "/slots").json()
    assert [s["id"] for s in body["slots"]] == list(range(8))
    assert {s["state"] for s in body["slots"]} <= {"free", "busy"}
    assert body["engine"] == "llama.cpp"


def test_seeded_sampling_is_reproducible_and_penalties_change_the_answer(server: RunningServer) -> None:
    url = server.url + "/v1/chat/completions"
    body = chat(server.alias, "Write a poem about rain.", max_tokens=24, temperature=0.9, seed=1234, cache_prompt=False)
    a = httpx.post(url, json=body, timeout=60).json()["choices"][0]["message"]["content"]
    b = httpx.post(url, json=body, timeout=60).json()["choices"][0]["message"]["content"]
    assert a == b
    count = "Count: one, one, one, one,"
    plain = httpx.post(url, json=chat(server.alias, count, max_tokens=16, cache_prompt=False), timeout=60).json()
    penalised = httpx.post(
        url, json=chat(server.alias, count, max_tokens=16, frequency_penalty=2.0, cache_prompt=False), timeout=60
    ).json()
    assert plain["choices"][0]["message"]["content"] != penalised["choices"][0]["message"]["content"]


def test_a_copied_system_prompt_prefix_serves_a_correct_answer(server: RunningServer) -> None:
    url = server.url + "/v1/chat/completions"
    # A long first turn keeps its own KV; a different question shares only the system prompt
    # and the start of the user turn, which is copied into its own sequence.
    first = chat(server.alias, "What's the capital of Japan? Answer in one sentence. " + "Please be brief. " * 10, max_tokens=12)
    assert httpx.post(url, json=first, timeout=60).status_code == 200
    m = server.engine.metrics
    reused = m.prefix_copies + m.prompt_cache_restores
    question = "What's the capital of Germany? Answer in one short sentence."
    r = httpx.post(url, json=chat(server.alias, question, max_tokens=24), timeout=60).json()
    # Copied from the KV, or restored from host memory where an earlier test's longer match waits.
    assert m.prefix_copies + m.prompt_cache_restores == reused + 1
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= 20
    assert "Berlin" in r["choices"][0]["message"]["content"], r["choices"][0]["message"]["content"]
