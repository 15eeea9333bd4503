"""The gateway's stages on their own (no servers): admission's holds and retries, pre-request's bindings,
post-response's bookkeeping, and what the client is sent."""

from __future__ import annotations

import asyncio
import logging
import socket
import time

import aiohttp
import orjson
import pytest
from aiohttp import web

from services.gateway.client_stream import ClientStream
from services.gateway.context import Refused, RequestContext
from services.gateway.post_response import PostResponse
from services.gateway.pre_request import PreRequest
from services.gateway.prompts import read_prompt
from services.gateway.proxy import Proxy
from services.gateway.quotas import Quotas
from services.gateway.routing import Ask
from services.gateway.sessions import Sessions
from shared.contracts.backends import BackendType
from shared.contracts.config import AliasConfig, GatewayConfig
from shared.contracts.events import event_registry
from shared.eventlog.memory import MemoryEventStore
from shared.metering import RequestOutcome, RequestTrace
from shared.openai_protocol import ENGINE_HEADER, APIError
from shared.telemetry import Telemetry
from stage_support import pool, row

SLOW = BackendType.VLLM


class Sent:
    """An ASGI `send` that keeps what it is sent."""

    def __init__(self) -> None:
        self.messages: list[dict] = []

    async def __call__(self, message: dict) -> None:
        self.messages.append(message)

    @property
    def status(self) -> int | None:
        return next((m["status"] for m in self.messages if m["type"] == "http.response.start"), None)

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages if m["type"] == "http.response.body")


def context(admission, stream: bool = False, session: str | None = None) -> RequestContext:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    prompt = read_prompt("tiny", body, session)
    return RequestContext("r1", "tiny", "/v1/chat/completions", body, orjson.dumps(body), stream, False,
                          Ask(prompt, 8), RequestTrace(admission.meter.of("tiny"), admission.clock))


async def test_a_cold_alias_holds_a_stream_with_its_headers_and_keepalives_then_answers_503():
    admission, _, _, signals = pool(clock=time.monotonic, start_budget_s=0.35, keepalive_s=0.1)
    ctx, sent = context(admission, stream=True), Sent()
    client = ClientStream(sent, ctx.request_id, stream=True)
    with pytest.raises(Refused) as refused:
        await admission.place(ctx, client)
    assert refused.value.outcome is RequestOutcome.HOLD_EXPIRED and refused.value.error.status == 503
    assert refused.value.error.headers["Retry-After"]
    assert sent.status == 200  # the stream began before any instance was there
    assert sent.body.count(b": modelpool cold-start phase=placing") >= 2  # at each keep-alive: where the start stands
    assert ctx.slot is None and admission.waiting("tiny") == 0 and signals  # demand was signalled meanwhile
    await client.refuse(refused.value.error)  # its 200 is out: the refusal is an error event, then the end
    assert b'"code":"alias_starting"' in sent.body and sent.body.endswith(b"data: [DONE]\n\n")


async def test_a_request_that_finds_every_slot_taken_waits_its_queue_timeout_then_answers_408():
    admission, _, _, _ = pool(row("f1", 1), clock=time.monotonic, queue_timeout_s=0.15, keepalive_s=0.05)
    running = context(admission)
    await admission.place(running, ClientStream(Sent(), "r0", stream=False))
    ctx, sent = context(admission), Sent()
    with pytest.raises(Refused) as refused:
        await admission.place(ctx, ClientStream(sent, ctx.request_id, stream=False))
    assert refused.value.outcome is RequestOutcome.QUEUE_TIMEOUT and refused.value.error.status == 408
    assert sent.messages == []  # a whole answer sends nothing while it waits
    assert list(admission.metrics.waits) == [("tiny", "timeout")]


async def test_a_full_queue_is_refused_429_with_a_retry_after():
    admission, _, _, _ = pool(row("f1", 1), queue_size=0)
    await admission.place(context(admission), ClientStream(Sent(), "r0", stream=False))
    with pytest.raises(Refused) as refused:
        await admission.place(context(admission), ClientStream(Sent(), "r1", stream=False))
    assert refused.value.outcome is RequestOutcome.QUEUE_FULL and refused.value.error.status == 429
    assert int(refused.value.error.headers["Retry-After"]) >= 1


async def test_a_retry_gives_its_slot_back_here_and_moves_within_its_backend_only():
    admission, _, _, _ = pool(row("f1", 1), row("f2", 1), row("v1", 1, SLOW))
    ctx, client = context(admission), ClientStream(Sent(), "r1", stream=False)
    first = await admission.place(ctx, client)
    other = await admission.move(ctx, client, wait=False)
    assert other is not None and other is ctx.slot and other.instance_id != first.instance_id
    assert other.backend is first.backend  # never the other backend (seed 000 §6)
    assert admission.router.inflight == {other.instance_id: 1}  # the failed slot is free again
    assert await admission.move(ctx, client, wait=True) is None  # no third llama.cpp instance: keep the slot
    assert ctx.slot is other and admission.router.inflight == {other.instance_id: 1}
    admission.release(ctx)
    assert ctx.slot is None and admission.router.inflight == {}


async def test_a_retry_that_must_wait_for_room_waits_in_the_queue_and_gets_the_next_slot():
    admission, _, _, _ = pool(row("f1", 1), row("f2", 1), clock=time.monotonic)
    a, b = context(admission), context(admission)
    client = ClientStream(Sent(), "r", stream=False)
    await admission.place(a, client)
    await admission.place(b, client)
    assert await admission.move(a, client, wait=False) is None  # the other instance is full: no move
    moving = asyncio.create_task(admission.move(a, client, wait=True))
    await asyncio.sleep(0.05)
    assert not moving.done() and admission.waiting("tiny") == 1
    freed = b.slot.instance_id  # type: ignore[union-attr]
    assert admission.router.inflight == {freed: 1}  # its own slot is given back while it waits
    admission.release(b)
    moved = await asyncio.wait_for(moving, 1)
    assert moved is a.slot and moved.instance_id == freed
    assert admission.router.inflight == {freed: 1}


async def test_pre_request_binds_a_new_session_only_where_the_router_binds_sessions():
    sessions = Sessions(MemoryEventStore(event_registry()))
    config = AliasConfig.model_validate({"alias": "tiny", "router": {"plugin": "affinity"}, "backends": {
        "llama.cpp": {"model_name": "tiny", "model_path": "default", "gpu_memory_gb": 0, "engine": "simulator"}}})
    admission, view, clock, _ = pool(row("f1", 2), config=config, sessions=sessions)
    stage = PreRequest(admission.router, sessions, view, None, admission.metrics, Quotas("g"))  # type: ignore[arg-type]
    ctx = context(admission, session="s1")
    await admission.place(ctx, ClientStream(Sent(), "r1", stream=False))
    assert ctx.slot is not None and ctx.slot.binds
    await stage.prepare(ctx)
    assert sessions.bindings[ctx.ask.prompt.session_id].host == "f1"

    plain, _, _, _ = pool(row("f1", 2))  # least-load binds nothing
    ctx = context(plain, session="s2")
    await plain.place(ctx, ClientStream(Sent(), "r2", stream=False))
    await PreRequest(plain.router, sessions, view, None, plain.metrics, Quotas("g")).prepare(ctx)  # type: ignore[arg-type]
    assert ctx.ask.prompt.session_id not in sessions.bindings


async def test_post_response_gives_the_slot_back_counts_the_request_and_logs_one_line(caplog):
    admission, _, _, _ = pool(row("f1", 1))
    stage = PostResponse(admission, admission.router, Sessions(MemoryEventStore(event_registry())), admission.metrics,
                         Quotas("g"))
    ctx = context(admission)
    await admission.place(ctx, ClientStream(Sent(), "r1", stream=False))
    ctx.trace.dispatched(ctx.slot.backend)  # type: ignore[union-attr]
    ctx.usage = (12, 3)
    waiter = admission.admit("tiny", ctx.ask)  # the next request waits for f1
    with caplog.at_level(logging.INFO, logger="modelpool.access"):
        stage.finish(ctx, RequestOutcome.OK, 200, None)
    assert ctx.slot is None and waiter.granted.result().instance_id == "f1"  # handed on at once
    assert admission.meter.of("tiny").prefill_tokens == 12
    line = orjson.loads(caplog.records[-1].getMessage())
    assert (line["instance"], line["outcome"], line["status"], line["prompt_tokens"]) == ("f1", "ok", 200, 12)


async def test_a_refusal_is_a_json_error_before_the_answer_starts_and_nothing_after_a_whole_answer_started():
    sent = Sent()
    await ClientStream(sent, "r1", stream=False).refuse(APIError(429, "full", type="rate_limit_error",
                                                                 headers={"Retry-After": "3"}))
    start = sent.messages[0]
    assert start["status"] == 429 and (b"retry-after", b"3") in start["headers"]
    assert (b"x-request-id", b"r1") in start["headers"] and orjson.loads(sent.body)["error"]["message"] == "full"

    sent = Sent()
    client = ClientStream(sent, "r2", stream=False)
    await client.start(200, [])
    await client.refuse(APIError(502, "broke", type="api_error"))
    assert len(sent.messages) == 1  # a JSON answer under way is left unfinished: the server closes it


async def test_the_proxy_sends_a_refused_request_again_through_admission_and_relays_the_answer():
    """f1's port takes no connection; f2 answers. The proxy asks admission for another slot and relays f2's answer."""
    async def answer(request: web.Request) -> web.Response:
        assert request.headers["x-request-id"] == "r1"
        return web.json_response({"id": "c1", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}},
                                 headers={ENGINE_HEADER: "simulated-llama.cpp"})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        dead = closed.getsockname()[1]  # bound, never listening: connections are refused
        admission, _, clock, _ = pool(row("f1", 2)._replace(endpoint=f"http://127.0.0.1:{dead}"),
                                      row("f2", 2)._replace(endpoint=f"http://127.0.0.1:{port}"))
        sent = Sent()
        client = ClientStream(sent, "r1", stream=False)
        other = context(admission)
        await admission.place(other, client)  # one request on f2 already: least-load sends the next to f1
        ctx = context(admission)
        assert (await admission.place(ctx, client)).instance_id == "f1"
        admission.release(other)
        reroutes = []

        async def reroute(ctx: RequestContext, client: ClientStream, wait: bool):
            reroutes.append((ctx.slot.instance_id, wait))  # type: ignore[union-attr]
            return await admission.move(ctx, client, wait=wait)

        async with aiohttp.ClientSession() as http:
            proxy = Proxy(http, GatewayConfig(), admission.router, admission.metrics, Telemetry("gateway"), clock,
                          reroute)
            outcome = await proxy.forward(ctx, client)
            ctx.upstream.release()  # type: ignore[union-attr]
    await runner.cleanup()
    assert outcome is RequestOutcome.OK and reroutes == [("f1", True)] and ctx.attempts == 2
    assert ctx.slot.instance_id == "f2" and ctx.usage == (5, 2) and ctx.engine == "simulated-llama.cpp"  # type: ignore[union-attr]
    assert sent.status == 200 and (b"x-modelpool-instance", b"f2") in sent.messages[0]["headers"]
    assert orjson.loads(sent.body)["id"] == "c1"
    assert admission.metrics.retries == {("tiny", "llama.cpp", "refused"): 1}
