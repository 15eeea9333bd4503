"""Sending a request to its instance and relaying the answer, with retries where nothing reached the client.

A request is sent again, elsewhere, only when nothing of it can have run or
reached the client: the connection was refused, or the engine broke or went
silent before its answer began (a whole answer, or a stream's first event within
`first_byte_timeout_s`), or the log gave its instance up while it waited (its
worker lost: `Slot.withdraw`); then another running instance of the same backend
takes it (never the other backend, seed 000 §6). An engine that answers 503 is
alive and said no: only an instance with room now takes the request instead,
else the client gets that 503. A stream that breaks midway is carried on by
another instance from where the client is (`resume.py`). At most
MAX_ATTEMPTS sends in all. Which instance takes a retry is admission's call
(`Admission.move`); the proxy only asks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import orjson

from services.gateway.client_stream import REQUEST_ID_HEADER, SSE_HEADERS, ClientStream
from services.gateway.context import Refused, RequestContext
from services.gateway.kv_moves import session_tag
from services.gateway.meter import outcome_of
from services.gateway.metrics import GatewayMetrics
from services.gateway.routing import Router, Slot
from services.gateway.sse import EventScanner, usage_of_body
from shared.contracts.backends import EngineKind
from shared.contracts.config import GatewayConfig
from shared.metering import RequestOutcome
from shared.openai_protocol import ENGINE_HEADER, SESSION_TAG_HEADER, SSE_DONE, APIError, service_unavailable
from shared.projections.rows import InstanceRow
from shared.telemetry import Telemetry

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 3
"""Sends of one request to instances (the first, then others after failures): a request that broke three
engines is not sent to a fourth."""
UPSTREAM_KEEPALIVE_S = 4.0
"""A pooled connection to an engine is dropped after this long idle: before the engine's own server
(uvicorn: 5 s) closes it, so a request never goes out on a connection closing under it."""
UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)
UPSTREAM_REFUSED = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
"""Failures where nothing reached the engine: the request may go to another instance."""

Reroute = Callable[[RequestContext, ClientStream, bool], Awaitable[Slot | None]]
"""Moves a request whose instance failed it to another of the same backend (waiting for room if told to),
bound and ready to send; None when there is no other."""


def upstream_client(config: GatewayConfig) -> aiohttp.ClientSession:
    """The gateway's connections to the engines (aiohttp: its per-request cost is a fraction of httpx's).

    The read timeout bounds an engine's silence, not a generation: a stream sends a chunk per token.
    Bodies are relayed as they come, so nothing is decompressed.
    """
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=4096, limit_per_host=0, keepalive_timeout=UPSTREAM_KEEPALIVE_S),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=config.connect_timeout_s, sock_read=config.read_timeout_s),
        auto_decompress=False,
    )


def upstream_error(body: bytes, status: int) -> APIError:
    """An engine's error answer, as an error event for a held stream (its 200 is already out)."""
    with contextlib.suppress(orjson.JSONDecodeError, TypeError, KeyError, AttributeError):
        error = orjson.loads(body)["error"]
        return APIError(status, str(error.get("message")), type=str(error.get("type") or "api_error"),
                        param=error.get("param"), code=error.get("code"))
    return APIError(status, body.decode(errors="replace")[:1000] or f"engine answered {status}", type="api_error")


def what_failed(exc: BaseException) -> str:
    return "went silent past its timeout" if isinstance(exc, asyncio.TimeoutError) else "broke"


def instance_failed(instance_id: str, exc: BaseException) -> APIError:
    """What the client is told: which instance failed and how, never where it listens (the gateway's log says)."""
    return APIError(502, f"instance {instance_id} {what_failed(exc)} while answering ({type(exc).__name__})",
                    type="api_error", code="instance_failed")


class Proxy:
    def __init__(self, client: aiohttp.ClientSession, config: GatewayConfig, router: Router,
                 metrics: GatewayMetrics, telemetry: Telemetry, clock: Callable[[], float], reroute: Reroute) -> None:
        self.client = client
        self.config = config
        self.router = router
        self.metrics = metrics
        self.telemetry = telemetry
        self.clock = clock
        self.reroute = reroute

    async def forward(self, ctx: RequestContext, client: ClientStream) -> RequestOutcome:
        """Send the request to its slot's instance and relay the answer to the client."""
        ctx.upstream = await self._connect(ctx, client, ctx.payload)
        return await self._relay(ctx, client, ctx.upstream)

    async def _connect(self, ctx: RequestContext, client: ClientStream, payload: bytes) -> aiohttp.ClientResponse:
        """Send `payload` and read the start of the answer; sent again elsewhere while nothing reached the client."""
        while True:
            slot = ctx.slot
            assert slot is not None
            ctx.attempts += 1
            response, reason, failure = None, None, None
            try:
                response, ctx.head = await self._send_to(ctx, slot, payload)
            except UPSTREAM_REFUSED as exc:
                ctx.trace.refused(slot.backend)
                reason, failure = "refused", exc
            except UPSTREAM_ERRORS as exc:
                reason, failure = "withdrawn" if slot.withdrawn else "broke", exc
            if response is not None:
                if response.status != 503:
                    return response
                reason = "unavailable"
            other = await self.reroute(ctx, client, response is None) if ctx.attempts < MAX_ATTEMPTS else None
            if other is None:
                if response is not None:
                    return response  # the engine's own 503, as it said it
                log.warning("request for %s failed on %s (%s: %r); no other %s instance to send it to", ctx.alias,
                            slot.instance_id, reason, failure, slot.backend.value)
                if reason == "refused":
                    raise Refused(service_unavailable(
                        f"no {slot.backend.value} instance of `{ctx.alias}` took the connection; retry shortly",
                        code="instance_unreachable"), RequestOutcome.UNREACHABLE)
                raise Refused(instance_failed(slot.instance_id, failure), RequestOutcome.ENGINE_ERROR) from failure
            if response is not None:
                response.close()
            self.metrics.retried(ctx.alias, slot.backend.value, reason or "refused")
            ctx.retried_after.append(RETRY_REASONS.get(reason or "refused", reason or "refused"))

    async def _send_to(self, ctx: RequestContext, slot: Slot, payload: bytes) -> tuple[aiohttp.ClientResponse, bytes]:
        """Post `payload` to `slot`'s instance; the response and what is read of it before anything is relayed:
        a stream's first events (within the first-byte timeout), else the whole answer."""
        url = f"{slot.instance.endpoint}{ctx.path}"
        headers = self._upstream_headers(ctx, slot)
        # Ended at once if the log gives the instance up meanwhile (`Slot.withdraw`): sent elsewhere.
        async with asyncio.timeout(self.config.first_byte_timeout_s if ctx.stream else None) as deadline:
            slot.watch(deadline)
            try:
                response = await self.client.post(url, data=payload, headers=headers)
                try:
                    if not ctx.stream or response.status != 200:
                        return response, await response.read()
                    head = await response.content.readany()
                except BaseException:
                    response.close()
                    raise
            finally:
                slot.watch(None)
        if not head:
            response.close()
            raise aiohttp.ServerDisconnectedError("the stream ended before its first event")
        return response, head

    def _upstream_headers(self, ctx: RequestContext, slot: Slot) -> dict[str, str]:
        headers = {"content-type": "application/json",
                   # Uncompressed, so the bytes relayed as they come are the bytes the client can read.
                   "accept-encoding": "identity", REQUEST_ID_HEADER: ctx.request_id,
                   # Which session the engine's cache entry for this request belongs to: a KV move exports by it.
                   SESSION_TAG_HEADER: session_tag(ctx.ask.prompt.session_id)}
        if slot.instance.engine is EngineKind.LLAMA_SERVER:
            # llama-server's HTTP server, with more connections than threads, closes kept-alive ones without
            # answering the next request on them: a new connection per request to it (a loopback or LAN
            # handshake, nothing next to a generation).
            headers["connection"] = "close"
        if self.telemetry.tracing:
            self.telemetry.inject(headers)  # traceparent: the engine's spans join the request's trace
        return headers

    async def _relay(self, ctx: RequestContext, client: ClientStream, response: aiohttp.ClientResponse) -> RequestOutcome:
        instance = ctx.slot.instance  # type: ignore[union-attr]
        status = response.status
        ctx.engine = response.headers.get(ENGINE_HEADER, instance.engine.value)
        if ctx.stream and status == 200:
            if client.started:
                # A held stream: its headers went out before an instance was chosen. Say which one
                # serves it, as SSE comments carry it (clients skip comment lines).
                await client.send(f": modelpool instance={instance.instance_id} "
                                  f"backend={instance.backend_type.value} engine={ctx.engine}\n\n"
                                  f": modelpool route: {ctx.route}\n\n".encode())
            else:
                await client.start(200, [*SSE_HEADERS, *served_by(ctx, instance)])
            return await self._relay_events(ctx, client, response)
        # A whole answer (or an engine's error), read before anything is sent (`_send_to`): an
        # engine that fails midway is retried elsewhere, or a 502 with an error body, never a truncated answer.
        body = ctx.head
        ctx.read_whole = True
        if client.started:  # a held stream the engine refused: its 200 is out, so the error is an event
            await client.end_with(upstream_error(body, status))
            return outcome_of(status)
        if status == 200:
            ctx.usage = usage_of_body(body)
        await client.start(status, [
            (b"content-type", response.headers.get("content-type", "application/json").encode()),
            *served_by(ctx, instance),
            *([(COLD_START_HEADER, str(ctx.cold_start_ms).encode())] if ctx.cold_start_ms is not None else [])])
        await client.send(body, more=False)
        return outcome_of(status)

    async def _relay_events(self, ctx: RequestContext, client: ClientStream,
                            response: aiohttp.ClientResponse) -> RequestOutcome:
        """Relay a stream's events as they come; one that breaks midway is carried on by another instance of
        the backend from where the client is, while attempts are left; else it ends with an error event."""
        transcript, trace, head = ctx.transcript, ctx.trace, ctx.head
        assert transcript is not None
        scanner = EventScanner(ctx.keep_usage, transcript)
        while True:
            slot = ctx.slot
            assert slot is not None
            try:
                async with asyncio.timeout(None) as deadline:  # ended if the log gives the instance up
                    slot.watch(deadline)
                    try:
                        async for data in _chunks(head, response):
                            now = self.clock()
                            events, chunks = scanner.feed(data)
                            if chunks:
                                if trace.content_chunks == 0:
                                    self.router.first_token(slot)
                                trace.content(chunks, now)
                            if events:
                                await client.send(events)
                    finally:
                        slot.watch(None)
                if scanner.ended or transcript.finished:
                    break
                failure: BaseException = aiohttp.ServerDisconnectedError("the stream ended before its [DONE]")
            except UPSTREAM_ERRORS as exc:
                if transcript.finished:  # all of the answer is out; only its end is missing
                    break
                failure = exc
            carried = await self._carry_on(ctx, client, failure, scanner)
            if carried is None:
                return RequestOutcome.ENGINE_ERROR
            ctx.upstream = response = carried
            head = ctx.head
        ctx.read_whole = scanner.ended
        if not scanner.ended:
            scanner.drop_partial()  # the stream broke after its last choice finished: end it here
        rest, chunks = scanner.flush()
        if chunks:
            trace.content(chunks, self.clock())
        ctx.usage = scanner.usage
        await client.send(rest if scanner.ended else rest + SSE_DONE, more=False)
        return RequestOutcome.OK

    async def _carry_on(self, ctx: RequestContext, client: ClientStream, failure: BaseException,
                        scanner: EventScanner) -> aiohttp.ClientResponse | None:
        """The stream broke: the rest of it from another instance of the backend, or None after an error event."""
        transcript, slot = ctx.transcript, ctx.slot
        assert transcript is not None and slot is not None and ctx.upstream is not None
        log.warning("stream of %s from %s broke after %d chunks: %r", ctx.alias, slot.instance_id, transcript.chunks,
                    failure)
        ctx.upstream.close()
        scanner.drop_partial()  # half an event the client never saw
        body = transcript.continuation() if ctx.attempts < MAX_ATTEMPTS else None
        other = await self.reroute(ctx, client, True) if body is not None else None
        if other is None:
            await client.end_with(APIError(502, f"the instance's stream {what_failed(failure)}: {failure!r}",
                                           type="api_error", code="stream_broken"))
            return None
        self.metrics.retried(ctx.alias, slot.backend.value, "resumed")
        ctx.retried_after.append(RETRY_REASONS["resumed"])
        try:
            response = await self._connect(ctx, client, orjson.dumps(body))
        except Refused as refused:
            await client.end_with(refused.error)
            return None
        if response.status != 200:
            await client.end_with(upstream_error(ctx.head, response.status))
            return None
        assert ctx.slot is not None
        await client.send(f": modelpool resumed on instance={ctx.slot.instance_id} "
                          f"after {transcript.chunks} chunks\n\n".encode())
        return response


RETRY_REASONS = {"refused": "connection refused", "broke": "broken connection", "withdrawn": "instance gone",
                 "unavailable": "503", "resumed": "broken stream, resumed"}
"""A retry's reason as the route explains it."""
ROUTE_HEADER = b"x-modelpool-route"
"""Which instance and backend served, which router, and why: `llama.cpp f1; least-load: 2 of 8 slots busy`."""
COLD_START_HEADER = b"x-modelpool-cold-start-ms"
"""On a whole answer held through a cold start: how long it waited (a stream is told in comments as it waits)."""


def served_by(ctx: RequestContext, instance: InstanceRow) -> list[tuple[bytes, bytes]]:
    headers = [(b"x-modelpool-instance", instance.instance_id.encode()),
               (b"x-modelpool-backend", instance.backend_type.value.encode()),
               (ENGINE_HEADER.encode(), (ctx.engine or instance.engine.value).encode())]
    if ctx.route:
        headers.append((ROUTE_HEADER, ctx.route.encode()))
    return headers


async def _chunks(head: bytes, response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """What was read of the answer before relaying began, then the rest as it comes."""
    yield head
    async for data in response.content.iter_any():
        yield data
