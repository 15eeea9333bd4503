"""The OpenAI surface people use, through the gateway with the official SDK: n, log-probabilities, JSON answers,
tool calls and seeds, answered by the simulated vLLM engine as vLLM answers them."""

from __future__ import annotations

import json

import openai
from gateway_support import ALIAS, SLOW

from shared.contracts.states import RoutingState as R

ASK = [{"role": "user", "content": "Tell me about a city."}]
CITY = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer", "minimum": 1},
                                         "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["city", "population", "tags"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a place.",
                                            "parameters": {"type": "object", "properties": {
                                                "location": {"type": "string"},
                                                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                                                "required": ["location", "unit"]}}}


async def sdk_on_vllm(engines, facts, gateways) -> openai.AsyncOpenAI:
    await facts.alias()
    await facts.running("v1", engines[SLOW][0], SLOW)
    await facts.route(R.VLLM_PRIMARY)
    gateway = await gateways.start()
    return openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)


async def test_n_choices_and_log_probabilities_streamed_or_not(engines, facts, gateways):
    async with await sdk_on_vllm(engines, facts, gateways) as sdk:
        three = await sdk.chat.completions.create(model=ALIAS, messages=ASK, n=3, max_tokens=6, logprobs=True)
        assert [c.index for c in three.choices] == [0, 1, 2]
        assert len({c.message.content for c in three.choices}) == 3
        # The prompt once, every choice's tokens.
        assert three.usage.completion_tokens == sum(len(c.logprobs.content) for c in three.choices)

        stream = await sdk.chat.completions.create(model=ALIAS, messages=ASK, n=2, max_tokens=5, stream=True)
        texts, finished = {0: "", 1: ""}, set()
        async for chunk in stream:
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
                if choice.finish_reason:
                    finished.add(choice.index)
        assert finished == {0, 1} and all(texts.values()) and texts[0] != texts[1]

        scored = await sdk.chat.completions.create(model=ALIAS, messages=ASK, max_tokens=5, logprobs=True, top_logprobs=3)
        entries = scored.choices[0].logprobs.content
        assert len(entries) == scored.usage.completion_tokens and "".join(e.token for e in entries) == scored.choices[0].message.content
        for entry in entries:
            assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token
            assert entry.logprob <= 0 and entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
        streamed = await sdk.chat.completions.create(model=ALIAS, messages=ASK, max_tokens=5, logprobs=True,
                                                     top_logprobs=2, stream=True)
        tokens = [e.token async for chunk in streamed for c in chunk.choices if c.logprobs for e in c.logprobs.content]
        assert len(tokens) == 5


async def test_json_answers_follow_the_response_format(engines, facts, gateways):
    async with await sdk_on_vllm(engines, facts, gateways) as sdk:
        schema = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
        answer = await sdk.chat.completions.create(model=ALIAS, messages=ASK, max_tokens=200, response_format=schema)
        city = json.loads(answer.choices[0].message.content)
        assert set(city) == {"city", "population", "tags"} and isinstance(city["city"], str)
        assert isinstance(city["population"], int) and city["population"] >= 1 and isinstance(city["tags"], list)

        stream = await sdk.chat.completions.create(model=ALIAS, messages=ASK, max_tokens=200, response_format=schema,
                                                   stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert json.loads(text) == city  # the same request, the same answer, streamed

        anything = await sdk.chat.completions.create(model=ALIAS, messages=ASK, max_tokens=200,
                                                     response_format={"type": "json_object"})
        assert isinstance(json.loads(anything.choices[0].message.content), dict)
        refused = None
        try:
            await sdk.chat.completions.create(model=ALIAS, messages=ASK, response_format={"type": "yaml"})
        except openai.BadRequestError as exc:
            refused = exc
        assert refused is not None and refused.body["param"] == "response_format"


async def test_tool_calls_whole_and_streamed_then_the_answer_after_the_tool(engines, facts, gateways):
    async with await sdk_on_vllm(engines, facts, gateways) as sdk:
        asked = [{"role": "user", "content": "What is the weather in Paris?"}]
        call = await sdk.chat.completions.create(model=ALIAS, messages=asked, tools=[WEATHER], tool_choice="required",
                                                 max_tokens=100)
        choice = call.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (tool_call,) = choice.message.tool_calls
        arguments = json.loads(tool_call.function.arguments)
        assert tool_call.function.name == "get_weather" and arguments["unit"] == "celsius" and arguments["location"]

        stream = await sdk.chat.completions.create(model=ALIAS, messages=asked, tools=[WEATHER], max_tokens=100,
                                                   stream=True)
        name, pieces, finish = None, [], None
        async for chunk in stream:
            for c in chunk.choices:
                for delta in c.delta.tool_calls or []:
                    name = delta.function.name or name
                    pieces.append(delta.function.arguments or "")
                finish = c.finish_reason or finish
        assert name == "get_weather" and json.loads("".join(pieces)) == arguments and finish == "tool_calls"

        answered = await sdk.chat.completions.create(model=ALIAS, max_tokens=8, tools=[WEATHER], messages=[
            *asked, choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": tool_call.id, "content": "18 degrees, sunny"}])
        assert answered.choices[0].message.content and not answered.choices[0].message.tool_calls


async def test_a_seed_makes_the_answer_repeatable(engines, facts, gateways):
    async with await sdk_on_vllm(engines, facts, gateways) as sdk:
        texts = [(await sdk.chat.completions.create(model=ALIAS, messages=ASK, max_tokens=8, seed=seed,
                                                    temperature=1.0)).choices[0].message.content for seed in (7, 7, 8)]
    assert texts[0] == texts[1] != texts[2]
