"""`modelpool gateway`: the OpenAI-compatible endpoint of the pool."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Any

import uvicorn
from starlette.applications import Starlette

from services.gateway.access_log import writing_to
from services.gateway.admin import create_admin_app
from services.gateway.app import Gateway, create_app
from services.gateway.connections import bounded_http
from services.gateway.console.series import Series
from services.gateway.proxy import upstream_client
from services.runtime import ServiceContext, http_server, run_service
from shared.configuration import load_pool_config
from shared.contracts.config import PoolConfig
from shared.faults import retry_until_done
from shared.projections.live import LiveView
from shared.projections.readmodels import INSTANCES, ROUTING, SESSIONS, WORKERS

log = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 10.0
CLIENT_KEEPALIVE_S = 75
"""How long a client's idle connection is kept open (uvicorn's default: 5 s). Longer than clients keep theirs
(httpx and the OpenAI SDKs: 5 s, aiohttp: 15 s) and than a load balancer's usual 60 s, so the client ends an
idle connection, not the gateway: a request a client sends on a connection the gateway is closing at that
moment is reset unanswered."""


async def serve(ctx: ServiceContext, pool: PoolConfig | None = None) -> None:
    pool = pool or PoolConfig()
    with writing_to(Path(ctx.settings.access_log)) if ctx.settings.access_log else contextlib.nullcontext():
        await _serve(ctx, pool)


async def _serve(ctx: ServiceContext, pool: PoolConfig) -> None:
    view = LiveView(ctx.store, ctx.engine, [ROUTING, INSTANCES, SESSIONS, WORKERS])
    await retry_until_done(view.load, "loading the routing view", log, ctx.stop)
    async with upstream_client(pool.gateway) as client:
        gateway = Gateway(ctx.settings, view, client, ctx.telemetry_bus, pool, ctx.telemetry)
        await retry_until_done(gateway.start, "reading the aliases' start times", log, ctx.stop)
        settings = ctx.settings
        servers = [gateway_server(create_app(gateway), settings.gateway_host, settings.gateway_port,
                                  http=bounded_http(pool.gateway.max_connections, pool.gateway.header_timeout_s))]
        print(f"gateway {gateway.gateway_id} listening on http://{settings.gateway_host}:{settings.gateway_port}/v1",
              flush=True)
        tasks = []
        if settings.admin_token:
            series = Series()
            servers.append(gateway_server(create_admin_app(ctx, view, settings.admin_token, series), settings.admin_host,
                                       settings.admin_port))
            tasks.append(series.follow(ctx.telemetry_bus, ctx.stop))
            admin = f"http://{settings.admin_host}:{settings.admin_port}"
            print(f"admin API on {admin}/admin, console on {admin}/console", flush=True)

        async def stop_servers() -> None:
            await ctx.stop.wait()
            for server in servers:
                server.should_exit = True

        await ctx.telemetry_bus.subscribe_usage(gateway.quotas.hear)
        await asyncio.gather(*(s.serve() for s in servers), view.follow(ctx.nc, ctx.subjects, ctx.stop),
                             gateway.publish_windows(ctx.stop), gateway.keep_sessions(ctx.stop),
                             gateway.follow_keys_file(ctx.stop),
                             gateway.quotas.run(ctx.telemetry_bus.publish_usage, ctx.stop), stop_servers(), *tasks)


def gateway_server(app: Starlette, host: str, port: int, **config: Any) -> uvicorn.Server:
    return http_server(app, host, port, timeout_keep_alive=CLIENT_KEEPALIVE_S, **config,
                       # Held requests and long streams would otherwise keep a stopping gateway up for minutes.
                       timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)


def main(argv: list[str]) -> int:
    from shared.settings import Settings

    settings = Settings.load()
    # The pool file names the aliases to hold requests for while the controller starts, and
    # the gateway's limits and keys (with the environment over it); a bad file or key file
    # fails fast, before connecting to anything.
    pool = load_pool_config(settings.config_path)
    pool.gateway.keys()
    return run_service("gateway", lambda ctx: serve(ctx, pool), settings, fast_loop=True)
