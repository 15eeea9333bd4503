"""The OpenAI-compatible front door of the pool.

Each request goes to one serving instance of its alias, chosen by the routing
state in the gateway's live view of the log (`routing.py`); a request never
crosses backends and a stream stays on its instance. A request for an alias with
nothing to serve it is held until an instance runs (`holds.py`). Every request is
measured into its alias's metric window (`meter.py`). The gateway decides nothing
about states or replicas; that is the controller's alone.
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
from collections.abc import Sequence

import httpx
import orjson
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from services.gateway.holds import Holds, StartTimes
from services.gateway.meter import Meter, Outcome, RequestTrace, outcome_of
from services.gateway.metrics import GatewayMetrics
from services.gateway.routing import Choice, Router
from services.gateway.sse import EventScanner, Usage, usage_of_body
from shared.bus.telemetry import TelemetryBus
from shared.contracts.backends import BackendType, EngineKind, engine_label
from shared.contracts.config import PoolConfig
from shared.eventlog.store import RawEvent
from shared.openai_protocol import (
    ENGINE_HEADER,
    SSE_DONE,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    bad_request,
    internal_error,
    not_found_model,
    service_unavailable,
    validation_error,
)
from shared.projections.live import LiveView
from shared.projections.readmodels import ROUTING
from shared.settings import Settings

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0
"""An instance that does not accept a connection this fast is treated like one that refused it."""
RETRY_AFTER_S = 2
"""Told to a client whose hold expired; a retry is held again, so a short wait loses nothing."""
KEEPALIVE = b": keep-alive\n\n"
SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # proxies such as nginx would otherwise buffer the keep-alives
]


def gateway_id(settings: Settings) -> str:
    """This replica's name in its windows and demand signals, usable as a NATS subject token."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", settings.gateway_id or f"{socket.gethostname()}-{os.getpid()}")


def upstream_client() -> httpx.AsyncClient:
    # No read timeout: a long generation is not a failure; a client that gives up disconnects, which we follow.
    return httpx.AsyncClient(limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100),
                             timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S))


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.to_dict(), status_code=exc.status, headers=exc.headers)


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


class Refused(Exception):
    """The request cannot be sent to an instance: what the client is told, and how it counts."""

    def __init__(self, error: APIError, outcome: Outcome) -> None:
        super().__init__(error.body.error.message)
        self.error = error
        self.outcome = outcome


class Gateway:
    """Everything the gateway keeps between requests: its view, router, holds and meters."""

    def __init__(self, settings: Settings, view: LiveView, client: httpx.AsyncClient, bus: TelemetryBus,
                 pool: PoolConfig | None = None) -> None:
        self.settings = settings
        self.view = view
        self.client = client
        self.bus = bus
        # The pool file's aliases, as configured: known (and held, as COLD) before the controller registers them.
        self.configured = {a.alias: a.model_dump(mode="json") for a in pool.aliases} if pool else {}
        self.gateway_id = gateway_id(settings)
        self.clock = time.monotonic
        self.router = Router(view, random.Random(), frozenset(self.configured))
        self.meter = Meter(self.gateway_id, settings.metric_window_s, self.clock)
        self.metrics = GatewayMetrics()
        self.starts = StartTimes(settings.hold_timeout_s)
        self.holds = Holds(self.router, self.meter, self.metrics, bus.publish_demand, self.gateway_id)

    async def start(self) -> None:
        """Read past start times, then follow the view; call after the view has loaded and before serving."""
        await self.starts.load(self.view.engine, list(self.view[ROUTING]), self.view.position)
        self.view.add_listener(self.view_advanced)

    def view_advanced(self, events: Sequence[RawEvent]) -> None:
        self.router.view_advanced()  # first: the holds ask the router
        self.starts.apply(events)
        self.holds.view_advanced()

    async def publish_windows(self, stop: asyncio.Event) -> None:
        await self.meter.run(lambda: list(self.view[ROUTING]), self.bus.publish_window, stop)

    async def exchange(self, request: Request, model_cls: type, path: str) -> Exchange | Response:
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError:
            return error_response(bad_request("request body is not valid JSON"))
        try:
            parsed = model_cls.model_validate(body)
        except ValidationError as exc:
            return error_response(validation_error(exc))
        if not self.router.known(parsed.model):
            return error_response(not_found_model(parsed.model))
        if parsed.stream:
            # Ask for usage, so the window counts tokens exactly; the scanner takes it out
            # again unless the client asked for it too.
            body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        return Exchange(self, parsed.model, path, orjson.dumps(body), parsed.stream, parsed.include_usage_in_stream())


class Exchange:
    """One proxied request, as an ASGI response: held if it must be, sent to an instance, relayed, measured.

    It sends its own ASGI messages rather than use a streaming response, because
    it has to notice a client that leaves while nothing is being sent (held, or
    waiting on a slow engine), and release what it holds in every case.
    """

    def __init__(self, gateway: Gateway, alias: str, path: str, payload: bytes, stream: bool, keep_usage: bool) -> None:
        self.gateway = gateway
        self.alias = alias
        self.path = path
        self.payload = payload
        self.stream = stream
        self.keep_usage = keep_usage
        self.trace = RequestTrace(gateway.meter.of(alias), gateway.clock)
        self.started = False
        self.instance: dict | None = None
        self.upstream: httpx.Response | None = None
        self.usage: Usage | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        work = asyncio.ensure_future(self._run(send))
        gone = asyncio.ensure_future(_client_gone(receive))
        try:
            await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            work.cancel()  # the client left (or the server stops): stop holding, close the upstream
            with contextlib.suppress(asyncio.CancelledError):
                await work

    async def _run(self, send: Send) -> None:
        outcome = Outcome.LEFT  # unless something below says otherwise, we were cancelled: the client is gone
        try:
            outcome = await self._serve(send)
        except Exception as exc:
            log.exception("request for %s failed in the gateway", self.alias)
            outcome = Outcome.GATEWAY_ERROR
            with contextlib.suppress(Exception):
                await self._refuse(send, internal_error(f"gateway failure: {exc!r}"))
        finally:
            self.trace.finished(outcome, self.usage)
            backend = self.trace.backend.value if self.trace.backend else "none"
            self.gateway.metrics.request(self.alias, backend, outcome.value)
            if self.instance is not None:
                self.gateway.router.release(self.instance["instance_id"])
            if self.upstream is not None:
                await self.upstream.aclose()  # an unfinished answer: the engine sees the disconnect and stops

    async def _serve(self, send: Send) -> Outcome:
        choice = self.gateway.router.choose(self.alias)
        if choice is None:
            choice = await self._hold(send)
            if choice is None:
                await self._refuse(send, alias_starting(self.alias, self.gateway.clock() - self.trace.arrived))
                return Outcome.HOLD_EXPIRED
        try:
            self.upstream = await self._connect(choice)
        except Refused as refused:
            await self._refuse(send, refused.error)
            return refused.outcome
        return await self._relay(send, self.upstream)

    async def _hold(self, send: Send) -> Choice | None:
        """Wait for a routable instance; None when the hold's budget ran out first."""
        gateway, clock = self.gateway, self.gateway.clock
        hold = gateway.holds.enter(self.alias)
        entered = clock()
        deadline = self.trace.arrived + gateway.starts.budget_s(self.alias)
        keepalive_s = gateway.settings.hold_keepalive_s
        outcome = "left"
        try:
            if self.stream:
                # Headers now, so the client and any proxy between see an answer begin.
                await self._start(send, 200, SSE_HEADERS)
            while (choice := gateway.router.choose(self.alias)) is None:
                remaining = deadline - clock()
                if remaining <= 0:
                    outcome = "expired"
                    return None
                await gateway.holds.wait(hold, min(remaining, keepalive_s) if self.stream else remaining)
                if self.stream and not gateway.router.routable(self.alias) and clock() < deadline:
                    await self._send(send, KEEPALIVE)
            outcome = "served"
            return choice
        finally:
            gateway.holds.leave(hold, outcome, clock() - entered)

    async def _connect(self, choice: Choice) -> httpx.Response:
        """Send the request to the first instance of the choice; a refused connection is retried once, on the next."""
        router, trace = self.gateway.router, self.trace
        trace.dispatched(choice.backend)
        failures = []
        for instance in choice.instances[:2]:
            router.acquire(instance["instance_id"])
            self.instance = instance
            request = self.gateway.client.build_request(
                "POST", f"{instance['endpoint']}{self.path}", content=self.payload,
                # Uncompressed, so the bytes relayed as they come are the bytes the client can read.
                headers={"content-type": "application/json", "accept-encoding": "identity"})
            try:
                return await self.gateway.client.send(request, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                # Nothing reached the engine, so trying another instance cannot run the request twice.
                failures.append(f"{instance['instance_id']}: {exc!r}")
                trace.refused(choice.backend)
            except httpx.HTTPError as exc:
                # The engine may have started on it: not safe to send again.
                raise Refused(APIError(502, f"instance {instance['instance_id']} failed before answering: {exc!r}",
                                       type="api_error", code="instance_failed"), Outcome.ENGINE_ERROR) from exc
            router.release(instance["instance_id"])
            self.instance = None
        log.warning("no %s instance of %s took the request: %s", choice.backend.value, self.alias, "; ".join(failures))
        raise Refused(service_unavailable(
            f"no {choice.backend.value} instance of `{self.alias}` took the connection; retry shortly",
            code="instance_unreachable"), Outcome.UNREACHABLE)

    async def _relay(self, send: Send, response: httpx.Response) -> Outcome:
        status = response.status_code
        if self.started:  # a held stream: its 200 is out, so an engine's error becomes an error event
            if status != 200:
                await self._send(send, error_event(upstream_error(await response.aread(), status)), more=False)
                return outcome_of(status)
            # Its headers went out before an instance was chosen: say which one serves it, as SSE
            # comments carry it (clients skip comment lines).
            instance = self.instance
            engine = response.headers.get(ENGINE_HEADER, instance["engine"])
            await self._send(send, f": modelpool instance={instance['instance_id']} backend={instance['backend_type']} "
                                   f"engine={engine}\n\n".encode())
        else:
            instance = self.instance
            await self._start(send, status, [
                (b"content-type", response.headers.get("content-type", "application/json").encode()),
                (b"x-modelpool-instance", instance["instance_id"].encode()),
                (b"x-modelpool-backend", instance["backend_type"].encode()),
                (ENGINE_HEADER.encode(), response.headers.get(ENGINE_HEADER, instance["engine"]).encode()),
            ])
        if self.stream and status == 200:
            return await self._relay_events(send, response)
        return await self._relay_body(send, response)

    async def _relay_events(self, send: Send, response: httpx.Response) -> Outcome:
        scanner, trace, clock = EventScanner(self.keep_usage), self.trace, self.gateway.clock
        try:
            async for data in response.aiter_raw():
                now = clock()
                events, chunks = scanner.feed(data)
                if chunks:
                    trace.content(chunks, now)
                if events:
                    await self._send(send, events)
        except httpx.HTTPError as exc:
            log.warning("stream of %s from %s broke: %r", self.alias, self.instance["instance_id"], exc)
            await self._send(send, error_event(APIError(502, f"the instance's stream broke: {exc!r}", type="api_error",
                                                        code="stream_broken")), more=False)
            return Outcome.ENGINE_ERROR
        rest, chunks = scanner.flush()
        if chunks:
            trace.content(chunks, clock())
        self.usage = scanner.usage
        await self._send(send, rest, more=False)
        return Outcome.OK

    async def _relay_body(self, send: Send, response: httpx.Response) -> Outcome:
        body: list[bytes] = []
        try:
            async for data in response.aiter_raw():
                body.append(data)
                await self._send(send, data)
        except httpx.HTTPError as exc:
            # Returning without ending the body makes the server close the connection:
            # the client sees a broken answer rather than a truncated one that parses.
            log.warning("answer of %s from %s broke: %r", self.alias, self.instance["instance_id"], exc)
            return Outcome.ENGINE_ERROR
        if response.status_code == 200:
            self.usage = usage_of_body(b"".join(body))
        await self._send(send, b"", more=False)
        return outcome_of(response.status_code)

    async def _start(self, send: Send, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        await send({"type": "http.response.start", "status": status, "headers": headers})
        self.started = True

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


async def _client_gone(receive: Receive) -> None:
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            return


def create_app(gateway: Gateway) -> Starlette:
    view = gateway.view

    async def health(_: Request) -> Response:
        return JSONResponse({"status": "ok", "position": view.position, "gateway_id": gateway.gateway_id})

    async def models(_: Request) -> Response:
        cards = []
        configs = {**gateway.configured, **{alias: row.get("config") for alias, row in view[ROUTING].items()}}
        for alias, config in sorted(configs.items()):
            backends = (config or {}).get("backends", {})
            engines = [
                engine_label(EngineKind((cfg or {}).get("engine") or name), BackendType(name)) for name, cfg in backends.items()
            ]
            cards.append(
                ModelCard(
                    id=alias, engine=",".join(engines) or None, simulated=any(e.startswith("simulated-") for e in engines),
                    max_model_len=(backends.get("vllm") or {}).get("max_model_len"),
                )
            )
        return JSONResponse(ModelList(data=cards).model_dump())

    async def metrics(_: Request) -> Response:
        return Response(gateway.metrics.render(gateway.meter), media_type="text/plain; version=0.0.4")

    async def chat(request: Request) -> Exchange | Response:
        return await gateway.exchange(request, ChatCompletionRequest, "/v1/chat/completions")

    async def completions(request: Request) -> Exchange | Response:
        return await gateway.exchange(request, CompletionRequest, "/v1/completions")

    return Starlette(
        routes=[
            Route("/health", health),
            Route("/metrics", metrics),
            Route("/v1/models", models),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
        ]
    )
