"""The OpenAI-compatible front door of the pool: one request's way through the gateway's stages.

Each stage is a module over one `RequestContext` (`context.py`), in the order
llm-d's request control uses:

1. edge (`edge.py`): key, size, shape, a model the gateway serves;
2. admission (`admission.py`): a slot on one serving instance of the alias, at
   once or after waiting in the alias's queue; the one owner of every slot,
   retries included;
3. scheduling (`routing.py` over `routing/`): the routing state picks the
   backend, the alias's router plugins the instance; admission asks it;
4. pre-request (`pre_request.py`): the prompt's prefix pulled from another
   instance where the router says so; the session bound to the instance, or
   moved there with its KV;
5. proxy (`proxy.py`): sent, relayed, and sent again elsewhere only while nothing
   of it can have run;
6. post-response (`post_response.py`): measured (`meter.py`, `/metrics`), slot
   given back, one access-log line.

`Exchange` is the ASGI response: it streams what the stages send
(`client_stream.py`) and stops them when the client leaves. The gateway decides
nothing about states or replicas; that is the controller's alone.
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
from collections.abc import Sequence

import aiohttp
import orjson
from opentelemetry.trace import Span, SpanKind
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from services.gateway.access_log import log_access
from services.gateway.admission import Admission
from services.gateway.client_stream import REQUEST_ID_HEADER, ClientStream
from services.gateway.context import Refused, RequestContext
from services.gateway.edge import (
    CHAT,
    COMPLETIONS,
    Caller,
    Keys,
    accept,
    error_response,
    gateway_failure,
    http_error,
    unexpected_error,
)
from services.gateway.handoff import Handoff
from services.gateway.kv_moves import KVMover
from services.gateway.meter import Meter
from services.gateway.metrics import GatewayMetrics, render_pool, render_relay_lag
from services.gateway.openapi import openapi_document
from services.gateway.post_response import PostResponse
from services.gateway.pre_request import PreRequest
from services.gateway.prompts import SESSION_HEADER, read_prompt
from services.gateway.proxy import Proxy
from services.gateway.quotas import Quotas
from services.gateway.resume import StreamTranscript
from services.gateway.routing import Ask, Router, Slot
from services.gateway.sessions import Sessions
from services.gateway.starts import StartProgress, StartTimes
from shared.bus.telemetry import TelemetryBus
from shared.client_gone import client_gone
from shared.contracts.backends import BackendType, engine_label
from shared.contracts.config import ConfigError, PoolConfig
from shared.contracts.messages import utcnow
from shared.contracts.states import RoutingState
from shared.eventlog.store import StoredEvent
from shared.metering import RequestOutcome, RequestTrace
from shared.openai_protocol import APIError, BackendCard, ModelCard, ModelList, too_many_requests
from shared.projections.live import LiveView
from shared.projections.readmodels import INSTANCES, ROUTING, SESSIONS, WORKERS
from shared.settings import Settings
from shared.telemetry import Telemetry

log = logging.getLogger(__name__)

TRACE_HEADERS = ("traceparent", "tracestate")
LIMIT_OF_CODE = {"rpm_exceeded": "rpm", "tpm_exceeded": "tpm", "max_concurrent_exceeded": "max_concurrent",
                 "model_not_allowed": "aliases"}


KEYS_FILE_POLL_S = 2.0


def _stamp(path: str) -> tuple[int, int, int] | None:
    """What tells a changed file: its modification time, size and inode (a file replaced by a rename, too)."""
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_mtime_ns, stat.st_size, stat.st_ino


def gateway_id(settings: Settings) -> str:
    """This replica's name in its windows and demand signals, usable as a NATS subject token."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", settings.gateway_id or f"{socket.gethostname()}-{os.getpid()}")


class Gateway:
    """Everything the gateway keeps between requests: its view, router, admission, meters and keys."""

    def __init__(self, settings: Settings, view: LiveView, client: aiohttp.ClientSession, bus: TelemetryBus,
                 pool: PoolConfig | None = None, telemetry: Telemetry | None = None) -> None:
        pool = pool or PoolConfig()
        self.settings = settings
        self.config = pool.gateway
        self.keys = Keys.of(pool.gateway.keys(), pool.gateway.sessions_per_minute)
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
        self.meter = Meter(self.gateway_id, self.config.metric_window_s, self.clock)
        self.quotas = Quotas(self.gateway_id)
        self.metrics = GatewayMetrics()
        self.starts = StartTimes(self.config.hold_timeout_s)
        self.admission = Admission(self.router, self.meter, self.metrics, bus.publish_demand, self.gateway_id,
                                   self.config.queue_size, self.clock, self.config.queue_timeout_s,
                                   self.starts.budget_s, self.config.hold_keepalive_s, self.start_progress,
                                   fair=self.config.queue_order == "fair",
                                   priority_aging_s=self.config.priority_aging_s)
        mover = KVMover(client, settings.cluster_key, self.clock)
        self.pre_request = PreRequest(self.router, self.sessions, view, mover, self.metrics, self.quotas)
        self.proxy = Proxy(client, self.config, self.router, self.metrics, self.telemetry, self.clock, self._reroute)
        self.post_response = PostResponse(self.admission, self.router, self.sessions, self.metrics, self.quotas)
        self.handoff = Handoff(self.router, self.sessions, view, mover, self.metrics, self.clock)

    def start_progress(self, alias: str) -> StartProgress:
        """Where the start of an alias with nothing routable stands, as a held client is told."""
        config = self.router.config(alias)
        return self.starts.progress(alias, config.backends if config else (), self.view[INSTANCES].values(), utcnow())

    async def start(self) -> None:
        """Read past start times, then follow the view; call after the view has loaded and before serving."""
        await self.starts.load(self.view.engine, list(self.view[ROUTING]), self.view.position)
        self.sessions.load(self.view[SESSIONS])
        self.view.add_listener(self.view_advanced)

    def view_advanced(self, events: Sequence[StoredEvent]) -> None:
        self.sessions.apply(events)
        self.router.view_advanced()  # first: admission and handoffs ask the router
        self.starts.apply(events)
        self.admission.view_advanced()
        self.handoff.view_advanced(events)

    async def publish_windows(self, stop: asyncio.Event) -> None:
        await self.meter.run(lambda: list(self.view[ROUTING]), self.bus.publish_window, stop)

    async def follow_keys_file(self, stop: asyncio.Event, every_s: float = KEYS_FILE_POLL_S) -> None:
        """Read the keys file again whenever it changes, so keys are added, limited and revoked without a restart;
        a file that no longer parses is reported and the keys in use are kept."""
        path = self.config.api_keys_file
        if not path:
            return
        seen = _stamp(path)
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), every_s)
            stamp = _stamp(path)
            if stamp == seen:
                continue
            seen = stamp
            try:
                self.keys = Keys.of(self.config.keys(), self.config.sessions_per_minute)
            except ConfigError as exc:
                log.error("the keys file changed but cannot be used (%s); the keys in use are kept", exc)
                continue
            log.info("keys file %s read again: %d keys", path, len(self.keys))

    async def keep_sessions(self, stop: asyncio.Event, every_s: float = 1.0) -> None:
        """Record the bindings made, and release the sessions this replica served that have idled past their
        router's `session_idle_s`; handoffs under way end with it."""
        try:
            await asyncio.gather(
                self.sessions.run_writes(stop),
                self.sessions.run_releases(lambda alias: self.router.router_config(alias).session_idle_s, stop,
                                           every_s))
        finally:
            await self.handoff.close()

    async def exchange(self, request: Request, path: str) -> Exchange | Response:
        """The edge stage and the key's limits, then the rest of the request's way as its ASGI response; a refusal
        at once."""
        request_id = request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
        try:
            routed, caller = await accept(request, path, self.keys, self.config.max_body_bytes, self.router.known,
                                          self.refuses_unread, self.config.body_timeout_s)
            body = routed.body
            if routed.stream:
                # Ask for usage, so the window counts tokens exactly; the scanner takes it out
                # again unless the client asked for it too.
                body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
            prompt = read_prompt(routed.model, body, request.headers.get(SESSION_HEADER))
            tokens = self.router.tokens.tokens(routed.model, prompt.size_bytes)
            # Its completion is charged as it streams, from the trace made below once it is admitted (a refused
            # request is no arrival the controller should count).
            quota = self.quotas.enter(caller.limits, routed.model, tokens, lambda: trace.content_chunks)
        except APIError as exc:
            if exc.status in (403, 429):
                self.metrics.refused_by_limit(LIMIT_OF_CODE.get(str(exc.body.error.code), "queue"))
            response = error_response(exc)
            response.headers[REQUEST_ID_HEADER] = request_id
            log_access({"request_id": request_id, "path": path, "status": exc.status, "outcome": "rejected",
                        "error": exc.body.error.code})
            return response
        trace = RequestTrace(self.meter.of(routed.model), self.clock)
        ctx = RequestContext(
            request_id, routed.model, path, body, orjson.dumps(body), routed.stream, routed.include_usage,
            Ask(prompt, tokens, tenancy=caller.tenancy), trace,
            trace_headers={k: request.headers[k] for k in TRACE_HEADERS if k in request.headers}
            if self.telemetry.tracing else {},
            transcript=StreamTranscript(path, body) if routed.stream else None, quota=quota)
        return Exchange(self, ctx)

    def refuses_unread(self, caller: Caller) -> APIError | None:
        """A 429 before the body is read, when every alias the caller may use has a full queue it could not get
        past: a client flooding a saturated pool costs the gateway no buffer."""
        if not self.admission.queues:
            return None  # nothing waits anywhere: the common case, at no cost
        aliases = caller.limits.aliases or {*self.configured, *self.view[ROUTING]}
        waits = []
        for alias in aliases:
            wait = self.admission.refuses(alias, caller.tenancy) if self.router.known(alias) else None
            if wait is None:
                return None
            waits.append(wait)
        if not waits:
            return None
        if len(aliases) == 1:  # counted as the alias's queue would have: demand the controller sees, refused
            alias = next(iter(aliases))
            self.metrics.request(alias, "none", RequestOutcome.QUEUE_FULL.value, 429)
            meter = self.meter.of(alias)
            meter.arrivals += 1
            meter.errors_gateway += 1
        # The body is not buffered: the HTTP parser drops it as it comes, and the connection serves on.
        names = ", ".join(f"`{alias}`" for alias in sorted(aliases))
        return too_many_requests(f"the queue of every model this key may use is full ({names}); "
                                 f"retry after {min(waits):.0f} s", min(waits))

    async def serve(self, ctx: RequestContext, client: ClientStream) -> None:
        """Admission, pre-request and proxy, then post-response whatever happened (the client leaving included)."""
        outcome = RequestOutcome.LEFT  # unless something below says otherwise, we were cancelled: the client is gone
        with self._span(ctx) as span:
            try:
                outcome = await self._stages(ctx, client)
            except Exception:
                log.exception("request for %s failed in the gateway", ctx.alias)
                outcome = RequestOutcome.GATEWAY_ERROR
                with contextlib.suppress(Exception):
                    await client.refuse(gateway_failure(ctx.request_id))
            finally:
                self.post_response.finish(ctx, outcome, client.status, span)

    async def _stages(self, ctx: RequestContext, client: ClientStream) -> RequestOutcome:
        try:
            slot = await self.admission.place(ctx, client)
            await self.pre_request.prepare(ctx)
            ctx.trace.dispatched(slot.backend)
            return await self.proxy.forward(ctx, client)
        except Refused as refused:
            await client.refuse(refused.error)
            return refused.outcome

    async def _reroute(self, ctx: RequestContext, client: ClientStream, wait: bool) -> Slot | None:
        """The proxy's retry: admission moves the request to another instance, then it is bound there."""
        slot = await self.admission.move(ctx, client, wait=wait)
        if slot is not None:
            await self.pre_request.prepare(ctx)
        return slot

    def _span(self, ctx: RequestContext) -> contextlib.AbstractContextManager[Span | None]:
        """The request's server span, continuing the client's trace; none when tracing is off (the hot path)."""
        if not self.telemetry.tracing:
            return contextlib.nullcontext()
        context = self.telemetry.extract(ctx.trace_headers)
        return self.telemetry.tracer.start_as_current_span("gateway.request", context=context, kind=SpanKind.SERVER,
                                                           attributes={"modelpool.alias": ctx.alias,
                                                                       "http.route": ctx.path})


class Exchange:
    """One request's ASGI response: it runs the request's stages and streams what they send.

    It sends its own ASGI messages rather than use a streaming response, because
    it has to notice a client that leaves while nothing is being sent (queued, or
    waiting on a slow engine), and then stop the stages, which release what they hold.
    """

    def __init__(self, gateway: Gateway, ctx: RequestContext) -> None:
        self.gateway = gateway
        self.ctx = ctx

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        work = asyncio.ensure_future(self.gateway.serve(self.ctx, ClientStream(send, self.ctx.request_id,
                                                                               self.ctx.stream)))
        gone = asyncio.ensure_future(client_gone(receive))
        try:
            await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            work.cancel()  # the client left (or the server stops): stop waiting, close the upstream
            with contextlib.suppress(asyncio.CancelledError):
                await work


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
            caller = gateway.keys.check(request)
        except APIError as exc:
            return error_response(exc)
        cards = [card for card in model_cards(gateway) if caller.limits.allows(card.id)]
        return JSONResponse(ModelList(data=cards).model_dump(exclude_none=True))

    async def metrics(_: Request) -> Response:
        waiting = {alias: gateway.admission.waiting(alias) for alias in gateway.admission.queues}
        pool = render_pool(view[ROUTING].values(), view[INSTANCES].values(), view[WORKERS].values(), utcnow())
        relay = await render_relay_lag(view.engine)
        return Response(gateway.metrics.render(gateway.meter, waiting) + pool + relay,
                        media_type="text/plain; version=0.0.4")

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
