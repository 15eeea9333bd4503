"""`modelpool gateway`: the OpenAI-compatible endpoint of the pool."""

from __future__ import annotations

import asyncio

import httpx
import uvicorn

from services.gateway.app import create_app
from services.runtime import ServiceContext, run_service
from shared.projections.live import LiveView
from shared.projections.readmodels import INSTANCES, ROUTING


async def serve(ctx: ServiceContext) -> None:
    view = LiveView(ctx.store, ctx.engine, [ROUTING, INSTANCES])
    await view.load()
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=1000)) as client:
        server = uvicorn.Server(
            uvicorn.Config(
                create_app(view, client), host=ctx.settings.gateway_host, port=ctx.settings.gateway_port,
                log_level="warning", access_log=False, lifespan="off",
            )
        )
        # The service's own signal handling decides when to stop; uvicorn only serves.
        server.install_signal_handlers = lambda: None

        async def stop_server() -> None:
            await ctx.stop.wait()
            server.should_exit = True

        print(f"gateway listening on http://{ctx.settings.gateway_host}:{ctx.settings.gateway_port}/v1", flush=True)
        await asyncio.gather(server.serve(), view.follow(ctx.nc, ctx.subjects, ctx.stop), stop_server())


def main(argv: list[str]) -> int:
    return run_service("gateway", serve)
