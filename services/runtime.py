"""What every modelpool service process shares: its connections and its lifetime.

`ServiceContext` holds the dependencies a service is given (settings, telemetry,
database engine, event store, NATS connection); `run_service` builds one, runs
the service body until SIGTERM / SIGINT, then closes everything in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

import uvicorn

from faststream.nats import NatsBroker
from faststream.security import SASLPlaintext
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.types import ASGIApp

from services.links import ServerLinks, ping_postgres
from services.service_metrics import ServiceMetrics, metrics_app
from shared.bus.auth import FILE_ENV, USER_ENV, BusCredentials, CredentialsError
from shared.bus.jetstream import NATS_OPTIONS, Consumer, connect, ensure_streams, servers_of, wait_for_streams
from shared.bus.permissions import DECLARING_ROLES, required_streams
from shared.bus.subjects import Subjects
from shared.bus.telemetry import TelemetryBus
from shared.contracts.commands import command_registry
from shared.contracts.events import event_registry
from shared.contracts.messages import Envelope, Registry
from shared.eventlog.db import create_engine
from shared.eventlog.store import EventStore, make_store
from shared.faults import StopRequested, retry_until_done
from shared.settings import Settings
from shared.telemetry import Telemetry

log = logging.getLogger("modelpool")


@dataclass
class ServiceContext:
    name: str
    settings: Settings
    telemetry: Telemetry
    engine: AsyncEngine
    store: EventStore
    nc: NATS
    js: JetStreamContext
    subjects: Subjects
    events: Registry
    commands: Registry
    broker: NatsBroker
    telemetry_bus: TelemetryBus
    links: ServerLinks
    metrics: ServiceMetrics
    """What the service counts, served on `MODELPOOL_METRICS_PORT` when set."""
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    inbox_prefix: str | None = None
    """Where this process's replies come, on a bus with users (its user's own inboxes)."""

    async def consume(self, *consumers: Consumer) -> None:
        """Run these bus consumers (FastStream drives their pull loops) until the service stops."""
        for consumer in consumers:
            consumer.subscribe(self.broker, self.inbox_prefix)
        await self.broker.start()
        await self.stop.wait()
        # Stop taking messages before the service's own shutdown, so nothing new
        # starts while it is releasing what it holds.
        await self.broker.stop()
        for consumer in consumers:
            await consumer.stop()

    async def record(self, *events: Envelope, expected_version: int = -1) -> list[Envelope]:
        """Append events of one stream to the log, carrying the current trace context."""
        stream_id = events[0].stream_id
        assert stream_id and all(e.stream_id == stream_id for e in events)
        return await self.store.append(stream_id, list(events), expected_version, headers=self.telemetry.current_headers())


async def open_context(name: str, settings: Settings, stack: AsyncExitStack) -> ServiceContext:
    """Connect to both servers, waiting for them as long as it takes, and declare the bus's streams."""
    telemetry = Telemetry.from_settings(settings, f"modelpool-{name}")
    stack.callback(telemetry.shutdown)
    links = ServerLinks(name, settings.health_file)
    engine = create_engine(settings)
    stack.push_async_callback(engine.dispose)
    events = event_registry()
    store = make_store(engine, events, settings.namespace)
    # On a bus with users, this process connects as its own (shared/bus/auth.py), in the handshake.
    credentials = settings.nats_credentials
    # Reconnects for ever (an outage of any length is waited out), and notices a server that
    # stops answering (paused, partitioned) within a few pings rather than minutes.
    nc = await connect_refusing_bad_credentials(settings, f"modelpool-{name}-{socket.gethostname()}", links)
    links.nats.reached()
    stack.push_async_callback(close_nats, nc)
    js = nc.jetstream()
    subjects = Subjects(settings.namespace)
    # Declaring a stream is as good as publishing anywhere (shared/bus/permissions.py): on a bus with users
    # only the autoscaler does it (and `modelpool migrate` before every service); the others wait for theirs.
    declares = credentials is None or name in DECLARING_ROLES
    telemetry_bus = TelemetryBus(nc, js, subjects, declares=declares)

    async def declare() -> None:
        if declares:
            await ensure_streams(js, subjects, settings.stream_replicas)
        await telemetry_bus.ensure(settings.stream_replicas)

    if declares:
        await retry_until_done(declare, "declaring the bus's streams", log)
    else:
        await retry_until_done(lambda: wait_for_streams(js, required_streams(name, subjects), log),
                               "finding the bus's streams", log)
    # A NATS restarted without its store (or memory-only state lost in a restart) gets them again.
    links.on_nats_reconnect(lambda: retry_until_done(declare, "declaring the bus's streams again", log))
    await retry_until_done(lambda: ping_postgres(engine), "connecting to Postgres", log)
    links.postgres.reached()
    # Per-message lines at DEBUG: a busy service would otherwise log every message it handles.
    broker = NatsBroker(servers_of(settings.nats_url), logger=logging.getLogger(f"modelpool.{name}.bus"),
                        log_level=logging.DEBUG, **NATS_OPTIONS, **broker_credentials(credentials))
    stack.push_async_callback(broker.stop)
    return ServiceContext(
        name=name,
        settings=settings,
        telemetry=telemetry,
        engine=engine,
        store=store,
        nc=nc,
        js=js,
        subjects=subjects,
        events=events,
        commands=command_registry(),
        broker=broker,
        telemetry_bus=telemetry_bus,
        links=links,
        metrics=ServiceMetrics(name),
        inbox_prefix=credentials.inbox_prefix if credentials else None,
    )


async def connect_refusing_bad_credentials(settings: Settings, client_name: str, links: ServerLinks) -> NATS:
    """The service's connection, waiting for NATS as long as it takes; but a server that refuses its credentials
    (or their absence) at the first connection is a configuration error, said at once, naming the settings."""
    callbacks = links.nats_callbacks()
    refused: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def on_error(exc: Exception) -> None:
        if "authorization violation" in str(exc).lower() and not refused.done():
            refused.set_result(str(exc))
        await callbacks["error_cb"](exc)

    credentials = settings.nats_credentials
    connecting = asyncio.ensure_future(connect(settings.nats_url, name=client_name, credentials=credentials,
                                               **{**callbacks, "error_cb": on_error}))
    await asyncio.wait({connecting, refused}, return_when=asyncio.FIRST_COMPLETED)
    if connecting.done():
        return connecting.result()
    connecting.cancel()
    with contextlib.suppress(BaseException):
        await connecting
    who = f"user {credentials.user!r}" if credentials else "a client without credentials"
    raise CredentialsError(f"{FILE_ENV} / {USER_ENV}: NATS at {settings.nats_url} refused {who} "
                           f"({refused.result()}): give this service its own user's credentials")


def broker_credentials(credentials: BusCredentials | None) -> dict[str, Any]:
    """What FastStream's broker takes to connect as this process's user (its own inboxes included)."""
    if credentials is None:
        return {}
    return {"security": SASLPlaintext(username=credentials.user, password=credentials.password),
            "inbox_prefix": credentials.inbox_prefix}


async def close_nats(nc: NATS) -> None:
    # Flush what we published (acks included), then close. Draining would wait on
    # idle pull subscriptions for its whole timeout; every message this process
    # handled is already acked, and anything unacked is redelivered by design.
    try:
        await nc.flush(timeout=2)
    except Exception:
        pass
    # A server gone for good (stopping while NATS is away) has nothing to say goodbye to: closing must not raise.
    with contextlib.suppress(OSError):
        await nc.close()


def http_server(app: ASGIApp, host: str, port: int, **config: Any) -> uvicorn.Server:
    """uvicorn serving `app` without access log or lifespan; the service's own signal handling decides when to stop,
    uvicorn only serves. `config`: more of uvicorn's settings."""
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                           lifespan="off", **config))
    server.capture_signals = contextlib.nullcontext
    return server


def configure_logging(name: str) -> None:
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s {name} %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # A line per HTTP call would bury everything else: a worker asks each engine about itself every second.
    logging.getLogger("httpx").setLevel(logging.WARNING)


def run_service(name: str, body: Callable[[ServiceContext], Awaitable[None]], settings: Settings | None = None,
                *, fast_loop: bool = False) -> int:
    """Run `body` until it returns or the process is asked to stop; exit code 0 on a clean stop.

    `fast_loop`: on uvloop (shipped with uvicorn[standard]), for a service whose own work is
    per-request I/O, where the event loop's overhead is a good part of what it adds.
    """
    configure_logging(name)
    settings = settings or Settings.load()

    async def main() -> None:
        async with AsyncExitStack() as stack:
            ctx = await open_context(name, settings, stack)
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, ctx.stop.set)
            log.info("%s started (namespace %s)", name, settings.namespace)
            watching = asyncio.create_task(ctx.links.run(ctx.engine, ctx.nc, ctx.stop))
            exporting = None
            if settings.metrics_port is not None:
                exporter = http_server(metrics_app(ctx.metrics, ctx.links), settings.metrics_host, settings.metrics_port)
                exporting = asyncio.create_task(exporter.serve())
                log.info("metrics on http://%s:%d/metrics", settings.metrics_host, settings.metrics_port)
            try:
                await body(ctx)
            except StopRequested as stopped:
                log.info("%s", stopped)
            finally:
                ctx.stop.set()
                await watching
                if exporting is not None:
                    exporter.should_exit = True
                    await exporting
            log.info("%s stopped", name)

    loop_factory = None
    if fast_loop:
        import uvloop

        loop_factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(main())
    return 0
