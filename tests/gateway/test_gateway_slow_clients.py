"""Slow and greedy clients at the public endpoint: headers and bodies that never finish, more connections than
the gateway keeps, and a flood at a full queue refused before its body is read — each answered with an OpenAI
error, while the gateway keeps serving everyone else."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
from gateway_support import ALIAS, FAST, start_engine, wait_healthy

from shared.contracts.states import RoutingState as R

CHAT = {"model": ALIAS, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def opened(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = url.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


async def answer_of(reader: asyncio.StreamReader, timeout_s: float = 10, closed: bool = True) -> tuple[int, dict]:
    """The status and error body of one answer; with `closed`, read to the connection's close (which must come)."""
    if closed:
        raw = await asyncio.wait_for(reader.read(), timeout_s)
    else:
        raw = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout_s)
        length = next(int(line.split(b":")[1]) for line in raw.split(b"\r\n") if line.lower().startswith(b"content-length"))
        raw += await asyncio.wait_for(reader.readexactly(length), timeout_s)
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def head_of(body_bytes: int, path: str = "/v1/chat/completions") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {body_bytes}\r\n\r\n").encode()


async def test_headers_and_bodies_that_never_finish_are_cut_off(gateways):
    gateway = await gateways.start(header_timeout_s=0.5, body_timeout_s=0.5)
    reader, writer = await opened(gateway.url)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")  # and nothing more
    started = time.monotonic()
    status, error = await answer_of(reader)
    assert status == 408 and error["error"]["code"] == "header_timeout"
    assert 0.4 <= time.monotonic() - started < 5
    writer.close()

    reader, writer = await opened(gateway.url)
    writer.write(head_of(1000) + b'{"model": "')  # the body stalls
    status, error = await answer_of(reader)
    assert status == 408 and error["error"]["code"] == "body_timeout"
    writer.close()

    async with httpx.AsyncClient(base_url=gateway.url) as client:  # a kept-alive connection: its next request too
        assert (await client.get("/health")).status_code == 200


async def test_connections_past_the_bound_are_refused_at_once_and_the_rest_served(gateways):
    gateway = await gateways.start(max_connections=20)
    idle = [await opened(gateway.url) for _ in range(19)]
    reader, writer = await opened(gateway.url)  # the 20th: still kept
    writer.write(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    assert b"200 OK" in await asyncio.wait_for(reader.read(), 5)
    writer.close()
    await asyncio.sleep(0.1)
    extra = [await opened(gateway.url) for _ in range(2)]
    reader, _ = extra[-1]
    status, error = await answer_of(reader)
    assert status == 503 and error["error"]["code"] == "too_many_connections"
    for _, w in idle + extra:
        w.close()
    await asyncio.sleep(0.2)
    async with httpx.AsyncClient(base_url=gateway.url) as client:  # room again once they closed
        assert (await client.get("/health")).status_code == 200


async def test_a_full_queue_refuses_before_the_body_is_read(tmp_path, facts, gateways):
    engine = start_engine(tmp_path, "llama.cpp", ALIAS, "--speedup", "1", "--d-0", "0.05", "--d-1", "0",
                          "--parallel", "1")
    try:
        wait_healthy([engine])
        await facts.alias()
        await facts.running("f1", engine, FAST, capacity=1)
        await facts.route(R.FAST_ONLY)
        gateway = await gateways.start(queue_size=1)
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
            busy = [asyncio.create_task(client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 40}))
                    for _ in range(2)]  # one served, one waiting: the queue is full
            await asyncio.sleep(0.5)
            reader, writer = await opened(gateway.url)
            writer.write(head_of(2_000_000))  # two megabytes announced, none sent yet
            status, error = await answer_of(reader, 5, closed=False)
            assert status == 429 and "queue of every model" in error["error"]["message"], error
            writer.write(b"x" * 2_000_000)  # dropped as it comes: the connection serves on
            writer.write(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            assert b"200 OK" in await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            writer.close()
            assert [b.status_code for b in await asyncio.gather(*busy)] == [200, 200]
        assert 'modelpool:key_limit_refusals_total{limit="queue"} 1' in await gateway.metrics()
    finally:
        engine.stop()


async def test_hundreds_of_slow_bodies_leave_the_gateway_serving(gateways):
    gateway = await gateways.start(body_timeout_s=3)
    slow = []
    for _ in range(300):
        reader, writer = await opened(gateway.url)
        writer.write(head_of(100_000) + b'{"model": "' + b"x" * 1000)
        slow.append((reader, writer))
    async with httpx.AsyncClient(base_url=gateway.url) as client:
        started = time.monotonic()
        for _ in range(20):
            assert (await client.get("/health")).status_code == 200
        assert time.monotonic() - started < 5
    statuses = [status for status, _ in await asyncio.gather(*(answer_of(r, 15) for r, _ in slow))]
    assert statuses == [408] * len(slow)
    for _, writer in slow:
        writer.close()
