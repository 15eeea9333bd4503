"""The OpenAI-compatible front door of the pool.

Each request is checked at the edge (`edge.py`: key, size, shape), admitted to
a slot on one serving instance of its alias or queued for one (`admission.py`),
sent there, and relayed back. The routing state in the gateway's live view of
the log picks the backend (`routing.py`); a request never crosses backends, a
stream stays on its instance, and a request is sent again (once, to another
instance of the same backend) only when nothing of it can have run: the
connection was refused or the engine answered 503. Every request is measured
into its alias's metric window (`meter.py`) and `/metrics`, and logged in one
access-log line. The gateway decides nothing about states or replicas; that is
the controller's alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import re
import socket
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Any

import aiohttp
import orjson
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from services.gateway.admission import Admission, AliasQueueFull, Waiter
from services.gateway.edge import (
    CHAT,
    COMPLETIONS,
    Keys,
    error_response,
    http_error,
    parse_request,
    read_body,
    unexpected_error,
)
from services.gateway.kv_moves import KVMove, move_kv
from services.gateway.meter import Meter, RequestOutcome, RequestTrace, outcome_of
from services.gateway.metrics import GatewayMetrics
from services.gateway.openapi import openapi_document
from services.gateway.prompts import SESSION_HEADER, read_prompt
from services.gateway.resume import StreamTranscript
from services.gateway.routing import Ask, Router, Slot
from services.gateway.sessions import Sessions
from services.gateway.sse import EventScanner, Usage, usage_of_body
from services.gateway.starts import StartTimes
from shared.client_gone import client_gone
from shared.bus.telemetry import TelemetryBus
from shared.contracts.backends import BackendType, engine_label
from shared.contracts.config import GatewayConfig, PoolConfig
from shared.contracts.states import RoutingState
from shared.eventlog.store import StoredEvent
from shared.openai_protocol import (
    ENGINE_HEADER,
    SSE_DONE,
    APIError,
    BackendCard,
    ModelCard,
    ModelList,
    internal_error,
    not_found_model,
    request_timeout,
    service_unavailable,
    too_many_requests,
)
from shared.projections.live import LiveView
from shared.projections.readmodels import INSTANCES, ROUTING, SESSIONS
from shared.projections.rows import InstanceRow
from shared.settings import Settings
from shared.telemetry import Telemetry

log = logging.getLogger(__name__)
access_log = logging.getLogger("modelpool.access")

RETRY_AFTER_S = 2
"""Told to a client whose hold expired; a retry is held again, so a short wait loses nothing."""
MAX_ATTEMPTS = 3
"""Sends of one request to instances (the first, then others after failures): a request that broke three
engines is not sent to a fourth."""
KEEPALIVE = b": keep-alive\n\n"
SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # proxies such as nginx would otherwise buffer the keep-alives
]
REQUEST_ID_HEADER = "x-request-id"
TRACE_HEADERS = ("traceparent", "tracestate")


def gateway_id(settings: Settings) -> str:
    """This replica's name in its windows and demand signals, usable as a NATS subject token."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", settings.gateway_id or f"{socket.gethostname()}-{os.getpid()}")


UPSTREAM_KEEPALIVE_S = 4.0
"""A pooled connection to an engine is dropped after this long idle: before the engine's own server
(uvicorn: 5 s) closes it, so a request never goes out on a connection closing under it."""
UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)
UPSTREAM_REFUSED = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
"""Failures where nothing reached the engine: the request may go to another instance."""


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


def error_event(exc: APIError) -> bytes:
    """An OpenAI-style error inside a stream whose 200 has been sent, and the stream's end."""
    return b"data: " + orjson.dumps(exc.to_dict()) + b"\n\n" + SSE_DONE


def alias_starting(alias: str, waited_s: float) -> APIError:
    return APIError(
        503, f"alias `{alias}` is starting: no instance was ready after {waited_s:.0f} s; retry shortly",
        type="service_unavailable_error", code="alias_starting", headers={"Retry-After": str(RETRY_AFTER_S)},
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
    return APIError(502, f"instance {instance_id} {what_failed(exc)} while answering: {exc!r}", type="api_error",
                    code="instance_failed")


class Refused(Exception):
    """The request cannot be served: what the client is told, and how it counts."""

    def __init__(self, error: APIError, outcome: RequestOutcome) -> None:
        super().__init__(error.body.error.message)
        self.error = error
        self.outcome = outcome


class Gateway:
    """Everything the gateway keeps between requests: its view, router, admission, meters and keys."""

    def __init__(self, settings: Settings, view: LiveView, client: aiohttp.ClientSession, bus: TelemetryBus,
                 pool: PoolConfig | None = None, telemetry: Telemetry | None = None) -> None:
        pool = pool or PoolConfig()
        self.settings = settings
        self.config = pool.gateway
        self.keys = Keys(pool.gateway.keys())
        self.view = view
        self.client = client
        self.bus = bus
        self.telemetry = telemetry or Telemetry("gateway")
        # The pool file's aliases, as configured: known (and held, as COLD) before the controller registers them.
        self.configured = {a.alias: a for a in pool.aliases}
        self.gateway_id = gateway_id(settings)
        self.clock = time.monotonic
        self.sessions = Sessions(view.store, self.clock)
        self.router = Router(view, random.Random(), self.configured, self.sessions)
        self.meter = Meter(self.gateway_id, settings.metric_window_s, self.clock)
        self.metrics = GatewayMetrics()
        self.starts = StartTimes(settings.hold_timeout_s)
        self.admission = Admission(self.router, self.meter, self.metrics, bus.publish_demand, self.gateway_id,
                                   self.config.queue_size, self.clock)

    async def start(self) -> None:
        """Read past start times, then follow the view; call after the view has loaded and before serving."""
        await self.starts.load(self.view.engine, list(self.view[ROUTING]), self.view.position)
        self.sessions.load(self.view[SESSIONS])
        self.view.add_listener(self.view_advanced)

    def view_advanced(self, events: Sequence[StoredEvent]) -> None:
        self.sessions.apply(events)
        self.router.view_advanced()  # first: admission asks the router
        self.starts.apply(events)
        self.admission.view_advanced()

    async def publish_windows(self, stop: asyncio.Event) -> None:
        await self.meter.run(lambda: list(self.view[ROUTING]), self.bus.publish_window, stop)

    async def keep_sessions(self, stop: asyncio.Event, every_s: float = 1.0) -> None:
        """Record the bindings made, and release the sessions this replica served that have idled past their
        router's `session_idle_s`."""
        await asyncio.gather(
            self.sessions.run_writes(stop),
            self.sessions.run_releases(lambda alias: self.router.router_config(alias).session_idle_s, stop, every_s))

    async def exchange(self, request: Request, path: str) -> Exchange | Response:
        request_id = request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
        try:
            self.keys.check(request)
            routed = parse_request(await read_body(request, self.config.max_body_bytes), path)
            if not self.router.known(routed.model):
                raise not_found_model(routed.model)
        except APIError as exc:
            response = error_response(exc)
            response.headers[REQUEST_ID_HEADER] = request_id
            access_log.info("%s", orjson.dumps({"request_id": request_id, "path": path, "status": exc.status,
                                                 "outcome": "rejected", "error": exc.body.error.code}).decode())
            return response
        body = routed.body
        if routed.stream:
            # Ask for usage, so the window counts tokens exactly; the scanner takes it out
            # again unless the client asked for it too.
            body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        trace_headers = {k: request.headers[k] for k in TRACE_HEADERS if k in request.headers} if self.telemetry.tracing else {}
        prompt = read_prompt(routed.model, body, request.headers.get(SESSION_HEADER))
        ask = Ask(prompt, self.router.tokens.tokens(routed.model, prompt.size_bytes))
        return Exchange(self, routed.model, path, body, routed.stream, routed.include_usage, request_id,
                        trace_headers, ask)


class Exchange:
    """One proxied request, as an ASGI response: admitted or queued, sent to an instance, relayed, measured.

    It sends its own ASGI messages rather than use a streaming response, because
    it has to notice a client that leaves while nothing is being sent (queued, or
    waiting on a slow engine), and release what it holds in every case.
    """

    def __init__(self, gateway: Gateway, alias: str, path: str, body: dict[str, Any], stream: bool, keep_usage: bool,
                 request_id: str, trace_headers: dict[str, str], ask: Ask) -> None:
        self.gateway = gateway
        self.ask = ask
        self.alias = alias
        self.path = path
        self.payload = orjson.dumps(body)
        self.transcript = StreamTranscript(path, body) if stream else None
        """What the client has been sent of a stream: a stream broken midway is carried on from there."""
        self.stream = stream
        self.keep_usage = keep_usage
        self.request_id = request_id
        self.trace_headers = trace_headers
        """The client's `traceparent` / `tracestate`, if it sent them."""
        self.trace = RequestTrace(gateway.meter.of(alias), gateway.clock)
        self.status: int | None = None
        self.slot: Slot | None = None
        self.engine: str | None = None
        self.attempts = 0
        """Times the request (or the rest of its stream) was sent to an instance."""
        self.upstream: aiohttp.ClientResponse | None = None
        self.head = b""
        """What was read of the upstream answer before relaying began: a stream's first events, or the whole body."""
        self.read_whole = False
        """The engine's answer was read to its end: its connection can serve another request."""
        self.usage: Usage | None = None

    @property
    def started(self) -> bool:
        return self.status is not None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        work = asyncio.ensure_future(self._run(send))
        gone = asyncio.ensure_future(client_gone(receive))
        try:
            await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            work.cancel()  # the client left (or the server stops): stop waiting, close the upstream
            with contextlib.suppress(asyncio.CancelledError):
                await work

    async def _run(self, send: Send) -> None:
        outcome = RequestOutcome.LEFT  # unless something below says otherwise, we were cancelled: the client is gone
        with self._span() as span:
            try:
                outcome = await self._serve(send)
            except Exception as exc:
                log.exception("request for %s failed in the gateway", self.alias)
                outcome = RequestOutcome.GATEWAY_ERROR
                with contextlib.suppress(Exception):
                    await self._refuse(send, internal_error(f"gateway failure: {exc!r}"))
            finally:
                await self._finish(outcome, span)

    def _span(self) -> contextlib.AbstractContextManager[Span | None]:
        """The request's server span, continuing the client's trace; none when tracing is off (the hot path)."""
        telemetry = self.gateway.telemetry
        if not telemetry.tracing:
            return contextlib.nullcontext()
        context = telemetry.extract(self.trace_headers)
        return telemetry.tracer.start_as_current_span("gateway.request", context=context, kind=SpanKind.SERVER,
                                                      attributes={"modelpool.alias": self.alias, "http.route": self.path})

    async def _finish(self, outcome: RequestOutcome, span: Span | None) -> None:
        gateway, trace = self.gateway, self.trace
        trace.finished(outcome, self.usage)
        backend = trace.backend.value if trace.backend else "none"
        gateway.metrics.request(self.alias, backend, outcome.value, self.status)
        if outcome is RequestOutcome.OK and trace.backend is not None:
            gateway.metrics.served(self.alias, backend, trace.ttft_s, trace.ended - trace.arrived, trace.tpot_s)
        if self.slot is not None:
            if self.usage is not None and outcome is RequestOutcome.OK:
                gateway.router.tokens.observe(self.alias, self.ask.prompt.size_bytes, self.usage[0])
                if self.slot.binds:
                    gateway.sessions.seen(self.ask.prompt.session_id, self.usage[0] + self.usage[1])
            gateway.admission.release(self.slot)
        if self.upstream is not None:
            if self.read_whole:
                self.upstream.release()
            else:
                self.upstream.close()  # an unfinished answer: the engine sees the disconnect and stops generating
        instance = self.slot.instance_id if self.slot else None
        if span is not None:
            span.set_attributes({"modelpool.outcome": outcome.value, "modelpool.backend": backend,
                                 "http.response.status_code": self.status or 0, "modelpool.instance": instance or ""})
            if outcome not in (RequestOutcome.OK, RequestOutcome.CLIENT_ERROR, RequestOutcome.LEFT):
                span.set_status(Status(StatusCode.ERROR, outcome.value))
        if not access_log.isEnabledFor(logging.INFO):
            return
        record = {
            "request_id": self.request_id, "alias": self.alias, "path": self.path, "stream": self.stream,
            "status": self.status, "outcome": outcome.value, "instance": instance, "backend": backend,
            "engine": self.engine, "retries": max(0, self.attempts - 1), "session": self.ask.prompt.session_id,
            "moved_from": self.slot.moved_from if self.slot else None,
            "queue_s": round(trace.dispatched_at - trace.arrived, 4) if trace.dispatched_at is not None else None,
            "ttft_s": round(trace.ttft_s, 4) if trace.ttft_s is not None else None,
            "e2e_s": round(trace.ended - trace.arrived, 4),
            "prompt_tokens": self.usage[0] if self.usage else None,
            "completion_tokens": self.usage[1] if self.usage else trace.content_chunks or None,
        }
        access_log.info("%s", orjson.dumps(record).decode())

    async def _serve(self, send: Send) -> RequestOutcome:
        try:
            self.slot = await self._place(send)
            self.trace.dispatched(self.slot.backend)
            self.upstream = await self._connect(send, self.payload)
        except Refused as refused:
            await self._refuse(send, refused.error)
            return refused.outcome
        except AliasQueueFull as full:
            await self._refuse(send, too_many_requests(
                f"{full}; the queue of `{self.alias}` is full, retry after {full.retry_after_s:.0f} s",
                full.retry_after_s))
            return RequestOutcome.QUEUE_FULL
        return await self._relay(send, self.upstream, self.head)

    async def _place(self, send: Send) -> Slot:
        """A slot, admitted at once or after waiting, with the session's binding noted where the router binds."""
        admitted = self.gateway.admission.admit(self.alias, self.ask)
        slot = admitted if isinstance(admitted, Slot) else await self._wait(send, admitted)
        if slot.binds:
            await self._note_session(slot)
        return slot

    async def _note_session(self, slot: Slot) -> None:
        """Bind the session to the slot's instance, or move it there with its KV; the log records it behind us."""
        sessions, session_id = self.gateway.sessions, self.ask.prompt.session_id
        if slot.moved_from is not None:
            self.gateway.metrics.session_moved(self.alias, slot.reason)
            move = await self._move_kv(slot)
            sessions.migrate(session_id, self.alias, slot.moved_from, slot.instance_id, slot.reason, move.metrics())
        elif session_id not in sessions.bindings:
            sessions.bind(session_id, self.alias, slot.instance_id)

    async def _move_kv(self, slot: Slot) -> KVMove:
        """Carry the session's KV from its old host to the slot's instance, where the router and engines allow."""
        gateway = self.gateway
        config = gateway.router.router_config(self.alias)
        if not config.move_kv:
            return KVMove(False, detail="move_kv is off")
        assert slot.moved_from is not None
        move = await move_kv(gateway.client, gateway.view[INSTANCES].get(slot.moved_from), slot.instance, self.path,
                             self.payload, config.kv_move_timeout_s, gateway.clock)
        gateway.metrics.kv_move(self.alias, move.moved, move.seconds)
        if move.moved:
            gateway.router.kv_moved(slot, move.tokens)
        else:
            log.info("session %s moved to %s without its KV: %s", self.ask.prompt.session_id, slot.instance_id,
                     move.detail)
        return move

    async def _wait(self, send: Send, waiter: Waiter) -> Slot:
        """Wait in the alias's queue for a slot; raise `Refused` when the wait's budget runs out first.

        The budget depends on what the request waits for: a slot on a running
        instance (the queue timeout, then 408) or an instance to start at all (the
        alias's start budget, then 503). A stream waiting for a start gets its
        headers now and keep-alives, so the client and any proxy see an answer begin.
        """
        gateway, clock = self.gateway, self.gateway.clock
        keepalive_s = gateway.settings.hold_keepalive_s
        outcome = "left"
        try:
            while True:
                routable = gateway.router.routable(self.alias)
                if not routable and self.stream and not self.started:
                    await self._start(send, 200, SSE_HEADERS)
                budget = gateway.config.queue_timeout_s if routable else gateway.starts.budget_s(self.alias)
                remaining = waiter.entered + budget - clock()
                if remaining <= 0:
                    waited = clock() - self.trace.arrived
                    if routable:
                        outcome = "timeout"
                        raise Refused(request_timeout(
                            f"no slot on an instance of `{self.alias}` freed within {budget:g} s (queue timeout); "
                            "retry later"), RequestOutcome.QUEUE_TIMEOUT)
                    outcome = "expired"
                    raise Refused(alias_starting(self.alias, waited), RequestOutcome.HOLD_EXPIRED)
                # Woken early by a slot; otherwise at the deadline or the next keep-alive, to look again.
                slot = await gateway.admission.wait(waiter, min(remaining, keepalive_s))
                if slot is not None:
                    outcome = "served"
                    return slot
                if self.started and clock() < waiter.entered + budget:
                    await self._send(send, KEEPALIVE)
        finally:
            gateway.admission.leave(waiter, outcome)

    async def _connect(self, send: Send, payload: bytes) -> aiohttp.ClientResponse:
        """Send `payload` to the slot's instance and read the start of its answer; sent again, elsewhere, if it
        fails while nothing of the answer has reached the client.

        That is: the connection was refused, or the engine broke or went silent before its
        answer began (a whole answer, or a stream's first event within
        `first_byte_timeout_s`); then another running instance of the same backend takes
        it (never the other backend, seed 000 §6), waiting for room on one if all are
        busy; with none, the client gets the failure. An engine that answers 503 is alive
        and said no: only an instance with room now takes the request instead, else the
        client gets that 503. At most MAX_ATTEMPTS sends in all.
        """
        gateway, trace = self.gateway, self.trace
        while True:
            slot = self.slot
            assert slot is not None
            self.attempts += 1
            response, reason, failure = None, None, None
            try:
                response, self.head = await self._send_to(slot, payload)
            except UPSTREAM_REFUSED as exc:
                trace.refused(slot.backend)
                reason, failure = "refused", exc
            except UPSTREAM_ERRORS as exc:
                reason, failure = "broke", exc
            if response is not None:
                if response.status != 503:
                    return response
                reason = "unavailable"
            other = await self._place_again(send, slot, wait=response is None) if self.attempts < MAX_ATTEMPTS else None
            if other is None:
                if response is not None:
                    return response  # the engine's own 503, as it said it
                log.warning("request for %s failed on %s (%s: %r); no other %s instance to send it to", self.alias,
                            slot.instance_id, reason, failure, slot.backend.value)
                if reason == "refused":
                    raise Refused(service_unavailable(
                        f"no {slot.backend.value} instance of `{self.alias}` took the connection; retry shortly",
                        code="instance_unreachable"), RequestOutcome.UNREACHABLE)
                raise Refused(instance_failed(slot.instance_id, failure), RequestOutcome.ENGINE_ERROR) from failure
            if response is not None:
                response.close()
            gateway.metrics.retried(self.alias, slot.backend.value, reason or "refused")

    async def _place_again(self, send: Send, failed: Slot, *, wait: bool) -> Slot | None:
        """Move the request to another instance of the failed one's backend: one with room now, or (with `wait`)
        the first to have room; None, keeping the failed slot, when there is no other instance."""
        gateway = self.gateway
        ask = replace(self.ask, backend=failed.backend, avoid=self.ask.avoid | {failed.instance_id})
        if not gateway.router.has_other(self.alias, failed.backend, ask.avoid):
            return None
        other = gateway.router.take(self.alias, ask)
        if other is None and not wait:
            return None
        self.ask = ask
        gateway.admission.release(failed)
        self.slot = None
        if other is None:
            other = await self._place(send)
        elif other.binds:
            await self._note_session(other)
        self.slot = other
        return other

    async def _send_to(self, slot: Slot, payload: bytes) -> tuple[aiohttp.ClientResponse, bytes]:
        """Post `payload` to `slot`'s instance; the response and what is read of it before anything is relayed:
        a stream's first events (within the first-byte timeout), else the whole answer."""
        client, config = self.gateway.client, self.gateway.config
        url = f"{slot.instance.endpoint}{self.path}"
        if not self.stream:
            response = await client.post(url, data=payload, headers=self._upstream_headers())
            try:
                return response, await response.read()
            except BaseException:
                response.close()
                raise
        async with asyncio.timeout(config.first_byte_timeout_s):
            response = await client.post(url, data=payload, headers=self._upstream_headers())
            try:
                if response.status != 200:
                    return response, await response.read()
                head = await response.content.readany()
            except BaseException:
                response.close()
                raise
        if not head:
            response.close()
            raise aiohttp.ServerDisconnectedError("the stream ended before its first event")
        return response, head

    def _upstream_headers(self) -> dict[str, str]:
        headers = {"content-type": "application/json",
                   # Uncompressed, so the bytes relayed as they come are the bytes the client can read.
                   "accept-encoding": "identity", REQUEST_ID_HEADER: self.request_id}
        if self.gateway.telemetry.tracing:
            self.gateway.telemetry.inject(headers)  # traceparent: the engine's spans join the request's trace
        return headers

    async def _relay(self, send: Send, response: aiohttp.ClientResponse, head: bytes) -> RequestOutcome:
        instance = self.slot.instance  # type: ignore[union-attr]
        status = response.status
        self.engine = response.headers.get(ENGINE_HEADER, instance.engine.value)
        if self.stream and status == 200:
            if self.started:
                # A held stream: its headers went out before an instance was chosen. Say which one
                # serves it, as SSE comments carry it (clients skip comment lines).
                await self._send(send, f": modelpool instance={instance.instance_id} "
                                       f"backend={instance.backend_type.value} engine={self.engine}\n\n".encode())
            else:
                await self._start(send, 200, [*SSE_HEADERS, *self._served_by(instance)])
            return await self._relay_events(send, response, head)
        # A whole answer (or an engine's error), read before anything is sent (`_send_to`): an
        # engine that fails midway is retried elsewhere, or a 502 with an error body, never a truncated answer.
        body = head
        self.read_whole = True
        if self.started:  # a held stream the engine refused: its 200 is out, so the error is an event
            await self._send(send, error_event(upstream_error(body, status)), more=False)
            return outcome_of(status)
        if status == 200:
            self.usage = usage_of_body(body)
        await self._start(send, status, [
            (b"content-type", response.headers.get("content-type", "application/json").encode()),
            *self._served_by(instance)])
        await self._send(send, body, more=False)
        return outcome_of(status)

    def _served_by(self, instance: InstanceRow) -> list[tuple[bytes, bytes]]:
        return [(b"x-modelpool-instance", instance.instance_id.encode()),
                (b"x-modelpool-backend", instance.backend_type.value.encode()),
                (ENGINE_HEADER.encode(), (self.engine or instance.engine.value).encode())]

    async def _relay_events(self, send: Send, response: aiohttp.ClientResponse, head: bytes) -> RequestOutcome:
        """Relay a stream's events as they come; one that breaks midway is carried on by another instance of
        the backend from where the client is (`resume.py`), while attempts are left; else it ends with an error event."""
        transcript, trace, clock = self.transcript, self.trace, self.gateway.clock
        assert transcript is not None
        scanner = EventScanner(self.keep_usage, transcript)
        while True:
            try:
                async for data in _chunks(head, response):
                    now = clock()
                    events, chunks = scanner.feed(data)
                    if chunks:
                        if trace.content_chunks == 0:
                            self.gateway.router.first_token(self.slot)  # type: ignore[arg-type]
                        trace.content(chunks, now)
                    if events:
                        await self._send(send, events)
                if scanner.ended or transcript.finished:
                    break
                failure: BaseException = aiohttp.ServerDisconnectedError("the stream ended before its [DONE]")
            except UPSTREAM_ERRORS as exc:
                if transcript.finished:  # all of the answer is out; only its end is missing
                    break
                failure = exc
            response = await self._carry_on(send, failure, scanner)
            if response is None:
                return RequestOutcome.ENGINE_ERROR
            self.upstream, head = response, self.head
        self.read_whole = scanner.ended
        if not scanner.ended:
            scanner.drop_partial()  # the stream broke after its last choice finished: end it here
        rest, chunks = scanner.flush()
        if chunks:
            trace.content(chunks, clock())
        self.usage = scanner.usage
        await self._send(send, rest if scanner.ended else rest + SSE_DONE, more=False)
        return RequestOutcome.OK

    async def _carry_on(self, send: Send, failure: BaseException, scanner: EventScanner) -> aiohttp.ClientResponse | None:
        """The stream broke: the rest of it from another instance of the backend, or None after an error event."""
        transcript, slot = self.transcript, self.slot
        assert transcript is not None and slot is not None and self.upstream is not None
        log.warning("stream of %s from %s broke after %d chunks: %r", self.alias, slot.instance_id, transcript.chunks,
                    failure)
        self.upstream.close()
        scanner.drop_partial()  # half an event the client never saw
        body = transcript.continuation() if self.attempts < MAX_ATTEMPTS else None
        other = await self._place_again(send, slot, wait=True) if body is not None else None
        if other is None:
            await self._send(send, error_event(APIError(502, f"the instance's stream {what_failed(failure)}: {failure!r}",
                                                        type="api_error", code="stream_broken")), more=False)
            return None
        self.gateway.metrics.retried(self.alias, slot.backend.value, "resumed")
        try:
            response = await self._connect(send, orjson.dumps(body))
        except Refused as refused:
            await self._send(send, error_event(refused.error), more=False)
            return None
        if response.status != 200:
            await self._send(send, error_event(upstream_error(self.head, response.status)), more=False)
            return None
        assert self.slot is not None
        await self._send(send, f": modelpool resumed on instance={self.slot.instance_id} "
                               f"after {transcript.chunks} chunks\n\n".encode())
        return response

    async def _start(self, send: Send, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [*headers, (REQUEST_ID_HEADER.encode(), self.request_id.encode())]})
        self.status = status

    @staticmethod
    async def _send(send: Send, body: bytes, more: bool = True) -> None:
        await send({"type": "http.response.body", "body": body, "more_body": more})

    async def _refuse(self, send: Send, exc: APIError) -> None:
        if self.started:
            if self.stream:
                await self._send(send, error_event(exc), more=False)
            # A JSON answer already under way is left unfinished: the server closes the connection.
            return
        headers = [(b"content-type", b"application/json"), *((k.lower().encode(), v.encode()) for k, v in exc.headers.items())]
        await self._start(send, exc.status, headers)
        await self._send(send, orjson.dumps(exc.to_dict()), more=False)


async def _chunks(head: bytes, response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """What was read of the answer before relaying began, then the rest as it comes."""
    yield head
    async for data in response.content.iter_any():
        yield data


def model_cards(gateway: Gateway) -> list[ModelCard]:
    """Every alias the gateway serves, with its routing state and, per backend, its engine and whether it is simulated."""
    routing = gateway.view[ROUTING]
    cards = []
    for alias in sorted({*gateway.configured, *routing}):
        config = gateway.router.config(alias)
        listed = {}
        for backend in config.backends if config else ():
            engine = engine_label(config.engine_for(backend), backend)  # type: ignore[union-attr]
            listed[backend.value] = BackendCard(engine=engine, simulated=engine.startswith("simulated-"))
        row = routing.get(alias)
        vllm = config.backends.get(BackendType.VLLM) if config else None
        cards.append(ModelCard(
            id=alias, engine=",".join(b.engine for b in listed.values()) or None,
            simulated=any(b.simulated for b in listed.values()),
            max_model_len=vllm.max_model_len if vllm else None,
            routing_state=(row.state if row else RoutingState.COLD).value, backends=listed,
        ))
    return cards


def create_app(gateway: Gateway) -> Starlette:
    view = gateway.view

    async def health(_: Request) -> Response:
        return JSONResponse({"status": "ok", "position": view.position, "gateway_id": gateway.gateway_id})

    async def models(request: Request) -> Response:
        try:
            gateway.keys.check(request)
        except APIError as exc:
            return error_response(exc)
        return JSONResponse(ModelList(data=model_cards(gateway)).model_dump(exclude_none=True))

    async def metrics(_: Request) -> Response:
        waiting = {alias: gateway.admission.waiting(alias) for alias in gateway.admission.queues}
        return Response(gateway.metrics.render(gateway.meter, waiting), media_type="text/plain; version=0.0.4")

    async def openapi(_: Request) -> Response:
        return JSONResponse(openapi_document(sorted({*gateway.configured, *view[ROUTING]}), gateway.keys.required))

    async def chat(request: Request) -> Exchange | Response:
        return await gateway.exchange(request, CHAT)

    async def completions(request: Request) -> Exchange | Response:
        return await gateway.exchange(request, COMPLETIONS)

    return Starlette(
        routes=[
            Route("/health", health),
            Route("/metrics", metrics),
            Route("/v1/models", models),
            Route("/openapi.json", openapi),
            Route(CHAT, chat, methods=["POST"]),
            Route(COMPLETIONS, completions, methods=["POST"]),
        ],
        exception_handlers={404: http_error, 405: http_error, Exception: unexpected_error},
    )
