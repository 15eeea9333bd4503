"""One trace from the client through the gateway to the engine, over OTLP/HTTP to a collector."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
import pytest_asyncio
import uvicorn
from gateway_support import ALIAS, SLOW, start_engine, wait_healthy
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from test_gateway_holds import CHAT

from helpers import eventually
from shared.contracts.states import RoutingState as R
from shared.net import free_port

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


class Collector:
    """What an OpenTelemetry collector's OTLP/HTTP receiver takes: protobuf span batches at /v1/traces."""

    def __init__(self) -> None:
        self.spans: list = []

    async def traces(self, request: Request) -> Response:
        batch = ExportTraceServiceRequest()
        batch.ParseFromString(await request.body())
        for resource in batch.resource_spans:
            service = next(a.value.string_value for a in resource.resource.attributes if a.key == "service.name")
            for scope in resource.scope_spans:
                self.spans.extend((service, span) for span in scope.spans)
        return Response(status_code=200)

    def named(self, name: str) -> list:
        return [(service, span) for service, span in self.spans if span.name == name]


@pytest_asyncio.fixture
async def collector(monkeypatch) -> AsyncIterator[tuple[Collector, str]]:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # export within a tenth of a second
    received = Collector()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(Starlette(routes=[Route("/v1/traces", received.traces, methods=["POST"])]),
                                           host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve())
    await eventually(lambda: server.started, timeout=10)
    try:
        yield received, f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        with contextlib.suppress(Exception):
            await task


async def test_a_request_is_one_trace_from_client_through_gateway_to_engine(tmp_path, facts, gateways, collector):
    received, endpoint = collector
    engine = start_engine(tmp_path, "vllm", ALIAS, "--speedup", "10", "--otlp-traces-endpoint", endpoint,
                          env={"OTEL_BSP_SCHEDULE_DELAY": "100"})
    try:
        wait_healthy([engine])
        await facts.alias()
        await facts.running("v1", engine, SLOW)
        await facts.route(R.VLLM_PRIMARY)
        gateway = await gateways.start(otlp_endpoint=endpoint)
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
            traced = {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"}
            assert (await client.post("/v1/chat/completions", json=CHAT, headers=traced)).status_code == 200
            stream = await client.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers=traced)
            assert stream.status_code == 200
        await eventually(lambda: len(received.named("gateway.request")) == 2 and len(received.named("llm_request")) == 2,
                         timeout=10)
    finally:
        engine.stop()
    for (gateway_service, server_span), (engine_service, engine_span) in zip(
            sorted(received.named("gateway.request"), key=lambda s: s[1].start_time_unix_nano),
            sorted(received.named("llm_request"), key=lambda s: s[1].start_time_unix_nano)):
        assert gateway_service == "modelpool-gateway" and engine_service == "simulated-vllm"
        # The gateway continues the client's trace, and the engine continues the gateway's span.
        assert server_span.trace_id.hex() == TRACE_ID and server_span.parent_span_id.hex() == CLIENT_SPAN
        assert engine_span.trace_id.hex() == TRACE_ID and engine_span.parent_span_id == server_span.span_id
        attributes = {a.key: a.value for a in server_span.attributes}
        assert attributes["modelpool.alias"].string_value == ALIAS
        assert attributes["modelpool.instance"].string_value == "v1"
        assert attributes["http.response.status_code"].int_value == 200
