"""ASGI middleware shared by the engines' HTTP edges."""

from __future__ import annotations

from opentelemetry.trace import SpanKind
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shared.openai_protocol import ENGINE_HEADER, APIError
from shared.telemetry import Telemetry

TRACE_HEADERS = (b"traceparent", b"tracestate")

RAW_SEND_KEY = "modelpool.raw_send"
"""Scope key of the server's own `send`, for streams that write body chunks past the wrappers."""


def error_response(err: APIError) -> JSONResponse:
    """An engine's OpenAI-style error answer."""
    return JSONResponse(err.to_dict(), status_code=err.status, headers=err.headers)


class EngineHeader:
    """Stamp every response with the engine that served it, so a simulated run is never taken for a real one."""

    def __init__(self, app: ASGIApp, engine: str) -> None:
        self.app = app
        self.header = (ENGINE_HEADER.encode(), engine.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header = self.header
        scope[RAW_SEND_KEY] = send

        async def stamped(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), header]
            await send(message)

        await self.app(scope, receive, stamped)


class TraceRequests:
    """A server span `llm_request` per OpenAI request, continuing the caller's `traceparent`.

    vLLM does the same with `--otlp-traces-endpoint`: a request that came through
    the gateway is one trace, gateway and engine. The span covers the whole
    answer, a stream to its last event.
    """

    def __init__(self, app: ASGIApp, telemetry: Telemetry, engine: str) -> None:
        self.app = app
        self.telemetry = telemetry
        self.engine = engine

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"] if k in TRACE_HEADERS}
        status = 0

        async def watched(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        with self.telemetry.tracer.start_as_current_span(
                "llm_request", context=self.telemetry.extract(carrier), kind=SpanKind.SERVER,
                attributes={"http.route": scope["path"], "modelpool.engine": self.engine}) as span:
            await self.app(scope, receive, watched)
            span.set_attribute("http.response.status_code", status)
