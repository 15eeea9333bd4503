"""Real clients through the gateway to the real llama.cpp engine: the official SDK (sync, async, streaming),
LangChain's ChatOpenAI, a hang-up the engine sees, an image the text-only engine refuses; and schemathesis
against the gateway's own OpenAPI document."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from gateway_support import ALIAS, FAST, SLOW, EngineProcess, wait_healthy
from langchain_core.messages import HumanMessage
from langchain_openai import ChatOpenAI

from helpers import eventually
from shared.contracts.states import RoutingState as R
from shared.net import free_port

QUESTION = [{"role": "user", "content": "Name a colour."}]
NO_END = {"0": -100, "1": -100, "2": -100}
"""SmolLM2's end-of-text, start and end-of-turn tokens, banned: an answer that runs to max_tokens."""


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Iterator[EngineProcess]:
    """The real llama.cpp engine on SmolLM2-135M, serving `tiny`, as the worker starts it."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("llama") / "engine.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "engine", "llama.cpp", "--port", str(port), "--model-alias", ALIAS,
         "--threads", "1", "--n-seq-max", "4", "--log-level", "warning"],
        stdout=log_path.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    engine = EngineProcess(f"http://127.0.0.1:{port}", proc, log_path)
    try:
        wait_healthy([engine], timeout=120)
        yield engine
    finally:
        engine.stop()


async def on_llama(llama, facts, gateways):
    await facts.alias()
    await facts.running("f1", llama, FAST, capacity=4)
    await facts.route(R.FAST_ONLY)
    return await gateways.start()


async def test_the_official_sdk_sync_async_and_streaming(llama, facts, gateways):
    gateway = await on_llama(llama, facts, gateways)
    base = f"{gateway.url}/v1"

    def sync_call() -> openai.types.chat.ChatCompletion:
        with openai.OpenAI(base_url=base, api_key="unused", max_retries=0) as client:
            return client.chat.completions.create(model=ALIAS, messages=QUESTION, max_tokens=8, temperature=0)

    answer = await asyncio.to_thread(sync_call)  # the gateway serves on this loop: the sync client gets a thread
    assert answer.choices[0].message.content and answer.usage.completion_tokens <= 8
    async with openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0) as client:
        again = await client.chat.completions.create(model=ALIAS, messages=QUESTION, max_tokens=8, temperature=0)
        assert again.choices[0].message.content == answer.choices[0].message.content  # greedy: the same text
        stream = await client.chat.completions.create(model=ALIAS, messages=QUESTION, max_tokens=8, temperature=0,
                                                      stream=True, stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == answer.choices[0].message.content
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == answer.usage.completion_tokens
        completion = await client.completions.create(model=ALIAS, prompt="The sky is", max_tokens=5, temperature=0)
        assert completion.choices[0].text
        (model,) = (await client.models.list()).data
        assert model.id == ALIAS


async def test_langchain_chat_openai_invokes_and_streams(llama, facts, gateways):
    gateway = await on_llama(llama, facts, gateways)
    chat = ChatOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", model=ALIAS, max_tokens=8, temperature=0,
                      max_retries=0)
    reply = await chat.ainvoke([HumanMessage(content="Name a colour.")])
    assert isinstance(reply.content, str) and reply.content
    streamed = "".join([part.content async for part in chat.astream([HumanMessage(content="Name a colour.")])])
    assert streamed == reply.content
    threaded = await asyncio.to_thread(chat.invoke, [HumanMessage(content="Name a colour.")])
    assert threaded.content == reply.content


async def running_on(client: httpx.AsyncClient, llama: EngineProcess) -> int:
    return int((await client.get(f"{llama.url}/slots")).json()["running"])


async def test_a_client_that_hangs_up_stops_llama_cpp_generating_streamed_or_not(llama, facts, gateways):
    gateway = await on_llama(llama, facts, gateways)
    endless = {"model": ALIAS, "messages": QUESTION, "max_tokens": 1500, "logit_bias": NO_END}
    async with httpx.AsyncClient(timeout=60) as client:
        async def idle() -> bool:
            return await running_on(client, llama) == 0

        async def busy() -> bool:
            return await running_on(client, llama) == 1

        async with client.stream("POST", f"{gateway.url}/v1/chat/completions", json={**endless, "stream": True}) as response:
            seen = 0
            async for line in response.aiter_lines():
                seen += '"content":"' in line
                if seen == 3:
                    break
        assert await running_on(client, llama) <= 1
        left = time.monotonic()
        await eventually(idle, timeout=3)
        stopped_after = time.monotonic() - left

        whole = asyncio.create_task(client.post(f"{gateway.url}/v1/chat/completions", json=endless))
        await eventually(busy, timeout=5)
        whole.cancel()
        await eventually(idle, timeout=3)
    assert stopped_after < 3  # 1,500 tokens would take far longer


async def test_an_image_part_for_the_text_only_engine_is_its_clear_400(llama, facts, gateways):
    gateway = await on_llama(llama, facts, gateways)
    image = {"model": ALIAS, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]}
    async with openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(**image)
    assert refused.value.body["code"] == "unsupported_content" and "text-only" in refused.value.body["message"]
    assert refused.value.body["param"] == "messages[0].content"


async def test_schemathesis_finds_no_server_error_in_the_gateways_own_api(engines, facts, gateways):
    await facts.alias()
    await facts.running("f1", engines[FAST][0], FAST)
    await facts.running("v1", engines[SLOW][0], SLOW)
    await facts.route(R.FAST_ONLY)
    gateway = await gateways.start()
    async with httpx.AsyncClient(base_url=gateway.url) as client:
        document = (await client.get("/openapi.json")).json()
    assert set(document["paths"]) == {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"}
    run = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "schemathesis.cli", "run", f"{gateway.url}/openapi.json",
        "--checks", "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance",
        "--max-examples", "40", "--generation-deterministic", "--request-timeout", "20", "--no-color",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    output, _ = await run.communicate()
    report = output.decode(errors="replace")
    assert run.returncode == 0, report[-4000:]
    assert "passed" in report.lower()


async def test_stop_seed_and_n_reach_llama_cpp_as_the_client_sent_them(llama, facts, gateways):
    gateway = await on_llama(llama, facts, gateways)
    async with openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0) as client:
        async def say(**options) -> str:
            answer = await client.chat.completions.create(model=ALIAS, messages=QUESTION, max_tokens=12, **options)
            return answer.choices[0].message.content

        whole = await say(temperature=0)
        last_word = whole.split()[-1]
        assert await say(temperature=0, stop=[last_word]) == whole[:whole.index(last_word)]
        assert await say(temperature=1.0, seed=7) == await say(temperature=1.0, seed=7)
        with pytest.raises(openai.BadRequestError) as refused:
            await say(n=2)
    assert refused.value.body["param"] == "n" and refused.value.body["code"] == "unsupported_parameter"
