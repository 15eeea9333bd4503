"""Reading the gateway's streamed answers on the client side (`modelpool load`, `bench/pool.py`)."""

from __future__ import annotations

import httpx

from services.ops.load import quantile, read_stream


def sse(*lines: str, headers: dict[str, str] | None = None) -> httpx.AsyncClient:
    body = "".join(f"{line}\n\n" for line in lines).encode()
    transport = httpx.MockTransport(lambda request: httpx.Response(200, headers=headers or {}, content=body))
    return httpx.AsyncClient(transport=transport, base_url="http://gateway")


CHUNK = 'data: {"choices": [{"delta": {"content": "%s"}}]}'


async def test_a_held_stream_names_its_server_in_a_comment_and_tokens_are_counted_from_the_first():
    ticks = iter(range(100))
    async with sse(": keep-alive", ": modelpool instance=f1 backend=llama.cpp engine=simulated-llama.cpp",
                   'data: {"choices": [{"delta": {"role": "assistant"}}]}', CHUNK % "Hi", CHUNK % "!", "data: [DONE]") as client:
        async with client.stream("POST", "/v1/chat/completions") as response:
            answer = await read_stream(response, lambda: next(ticks))
    assert (answer.backend, answer.engine) == ("llama.cpp", "simulated-llama.cpp")
    assert answer.tokens == 2 and answer.first_at == 0 and answer.error is None


async def test_headers_name_the_server_and_an_error_event_ends_the_answer():
    async with sse(CHUNK % "a", 'data: {"error": {"message": "broke", "type": "api_error", "param": null, "code": "stream_broken"}}',
                   headers={"x-modelpool-backend": "vllm", "x-modelpool-engine": "simulated-vllm"}) as client:
        async with client.stream("POST", "/v1/chat/completions") as response:
            answer = await read_stream(response)
    assert (answer.backend, answer.engine, answer.tokens, answer.error) == ("vllm", "simulated-vllm", 1, "stream_broken")


def test_quantile_is_a_member_of_the_values():
    assert quantile([], 0.5) is None
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0 and quantile([3.0, 1.0, 2.0], 0.95) == 3.0
