"""The official `openai` SDK (sync, async, streaming) against the simulated vLLM engine."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from services.engines.simulated.synthetic import FillerText

MESSAGES = [{"role": "user", "content": "Name three prime numbers, please."}]


def client(engine) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{engine.url}/v1", api_key="unused", max_retries=0, timeout=20)


def test_sync_chat_completion(engine) -> None:
    out = client(engine).chat.completions.create(model="sim-test", messages=MESSAGES, max_tokens=7)
    choice = out.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.role == "assistant"
    assert len(choice.message.content.split()) == 7  # one filler word per token
    assert out.usage.completion_tokens == 7
    assert out.usage.prompt_tokens > 8  # content plus the chat template
    assert out.usage.total_tokens == out.usage.prompt_tokens + 7
    assert out.model == "sim-test"
    assert out.system_fingerprint == "simulated-vllm"


def test_same_request_gives_the_same_text(engine) -> None:
    c = client(engine)
    a = c.chat.completions.create(model="sim-test", messages=MESSAGES, max_tokens=12, seed=3)
    b = c.chat.completions.create(model="sim-test", messages=MESSAGES, max_tokens=12, seed=3)
    d = c.chat.completions.create(model="sim-test", messages=MESSAGES, max_tokens=12, seed=4)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.choices[0].message.content != d.choices[0].message.content


def test_natural_stop_before_the_limit(engine) -> None:
    out = client(engine).chat.completions.create(model="sim-test", messages=MESSAGES, max_tokens=5000)
    mean = engine.config.natural_output_tokens
    assert out.choices[0].finish_reason == "stop"
    assert mean // 2 <= out.usage.completion_tokens <= mean // 2 + mean


def test_ignore_eos_generates_exactly_max_tokens(engine) -> None:
    out = client(engine).completions.create(
        model="sim-test", prompt="count", max_tokens=300, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 300
    assert out.choices[0].finish_reason == "length"


def test_streaming_chat_matches_non_streaming_and_reports_usage(engine) -> None:
    c = client(engine)
    whole = c.chat.completions.create(model="sim-test", messages=MESSAGES, max_tokens=9, seed=1)
    chunks = list(c.chat.completions.create(
        model="sim-test", messages=MESSAGES, max_tokens=9, seed=1, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    pieces = [ch.choices[0].delta.content for ch in chunks if ch.choices and ch.choices[0].delta.content]
    assert len(pieces) == 9  # one event per token
    assert "".join(pieces) == whole.choices[0].message.content
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(ch.system_fingerprint == "simulated-vllm" for ch in chunks)


def test_streaming_without_usage_option_has_no_usage(engine) -> None:
    chunks = list(client(engine).chat.completions.create(
        model="sim-test", messages=MESSAGES, max_tokens=3, stream=True))
    assert all(ch.usage is None for ch in chunks)


def test_streaming_text_completion_ends_with_done(engine) -> None:
    with httpx.stream("POST", f"{engine.url}/v1/completions", timeout=10, json={
        "model": "sim-test", "prompt": "once upon a time", "max_tokens": 4, "stream": True,
        "stream_options": {"include_usage": True},
    }) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-modelpool-engine"] == "simulated-vllm"
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert len(events) == 4 + 1 + 1 + 1  # tokens, finish, usage, done


def test_sdk_text_completion_stream(engine) -> None:
    chunks = list(client(engine).completions.create(
        model="sim-test", prompt="once upon a time", max_tokens=5, stream=True, seed=2))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == FillerText.build().text(_seed_of(engine, "once upon a time", 2), 5)


def _seed_of(engine, prompt: str, seed: int) -> int:
    from services.engines.simulated import synthetic

    tokens = synthetic.pieces(prompt)
    return synthetic.stable_seed(engine.config.seed, seed, len(tokens), *tokens[-32:])


async def test_async_client_concurrent_requests(engine) -> None:
    c = openai.AsyncOpenAI(base_url=f"{engine.url}/v1", api_key="unused", max_retries=0, timeout=20)
    outs = await asyncio.gather(*[
        c.chat.completions.create(model="sim-test", messages=MESSAGES, max_tokens=5 + i) for i in range(20)
    ])
    assert [o.usage.completion_tokens for o in outs] == [5 + i for i in range(20)]
    stream = await c.chat.completions.create(model="sim-test", messages=MESSAGES, max_tokens=4, stream=True)
    got = [ch async for ch in stream]
    assert sum(1 for ch in got if ch.choices and ch.choices[0].delta.content) == 4
    await c.close()


def test_models_say_simulated(engine) -> None:
    r = httpx.get(f"{engine.url}/v1/models")
    assert r.headers["x-modelpool-engine"] == "simulated-vllm"
    card = r.json()["data"][0]
    assert card["id"] == "sim-test"
    assert card["engine"] == "simulated-vllm" and card["simulated"] is True
    assert card["max_model_len"] == engine.config.max_model_len
    models = client(engine).models.list()
    assert [m.id for m in models.data] == ["sim-test"]


@pytest.mark.parametrize("path", ["/health", "/metrics", "/is_sleeping", "/v1/models", "/no-such-route"])
def test_every_response_names_the_simulated_engine(engine, path: str) -> None:
    assert httpx.get(f"{engine.url}{path}").headers["x-modelpool-engine"] == "simulated-vllm"


def test_prefix_cache_serves_a_repeated_prompt(engine) -> None:
    long_prompt = [{"role": "system", "content": "You are terse. " * 40}, *MESSAGES]
    c = client(engine)
    before = engine.metrics()
    first = c.chat.completions.create(model="sim-test", messages=long_prompt, max_tokens=2)
    second = c.chat.completions.create(model="sim-test", messages=long_prompt, max_tokens=2)
    after = engine.metrics()
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= second.usage.prompt_tokens - 2 * engine.config.block_size
    hits = after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
    queries = after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"]
    assert hits == cached
    assert queries == 2 * second.usage.prompt_tokens


def test_image_content_counts_toward_the_prompt(engine) -> None:
    content = [{"type": "text", "text": "Describe the picture."},
               {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]
    out = client(engine).chat.completions.create(
        model="sim-test", messages=[{"role": "user", "content": content}], max_tokens=3)
    text_only = client(engine).chat.completions.create(
        model="sim-test", messages=[{"role": "user", "content": "Describe the picture."}], max_tokens=3)
    assert out.usage.prompt_tokens - text_only.usage.prompt_tokens == 256
